"""The `gpu` marker: `pytest -m gpu tests` runs the GPU suite (tests/gpu/, the sm_90 kernel tests and the launch
tests that compare compiled kernels on a GPU). Without CUDA they skip or run their CPU parts, as in CI."""

import inspect
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_FILES = ("test_mxfp4_wgmma.py",)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (make test-all); `make test` and CI leave them out")


def pytest_configure(config):
    # one intra-op thread (here and, through OMP_NUM_THREADS, in the subprocesses tests start): the models are tiny,
    # and `make test` runs one pytest-xdist worker per core; two threads per worker on a busy 2-core machine made the
    # forwards several times slower
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture
def recorded_steps(monkeypatch):
    """Decode graphs "recorded" on the CPU: the recording keeps the step function and a replay runs it again, so the
    bookkeeping around graphs (pool, one graph per step shape, re-recording, fallbacks) is the real code; a real CUDA
    graph needs a GPU (tests/gpu). The returned list grows by one per recording."""
    from transformers_kimi3 import decode_graphs

    records = []

    class Replayed:
        def __init__(self, step, output):
            self.step, self.output, self.fresh = step, output, True

        def replay(self):
            # the recording ran the step once, and the first replay follows it with the same ids and position
            if not self.fresh:
                self.output.copy_(self.step())
            self.fresh = False

    def record(step):
        records.append(1)
        out = step()
        return Replayed(step, out), out

    monkeypatch.setattr(decode_graphs, "graph_device", lambda t: True)
    monkeypatch.setattr(decode_graphs, "cuda_warm_up", lambda step: (step(), step()))
    monkeypatch.setattr(decode_graphs, "cuda_record", record)
    return records


def _reads_the_oracle(item):
    """Whether the test or one of its fixtures names the oracle folder (kimi3_testing.ORACLE / ORACLE_A)."""
    funcs = [getattr(item, "function", None)] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values()
                                                  for d in defs]
    for fn in funcs:
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        if "ORACLE" in source:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    from kimi3_testing import ORACLE_A

    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow (make test-all)")
    skip_oracle = pytest.mark.skip(reason=f"needs the oracle folder {ORACLE_A} (../shared/oracle beside the checkout)")
    oracle_absent = not os.path.isdir(ORACLE_A)
    for item in items:
        if oracle_absent and _reads_the_oracle(item):
            item.add_marker(skip_oracle)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        path = str(item.fspath)
        if (path.startswith(os.path.join(HERE, "gpu") + os.sep) or os.path.basename(path) in GPU_FILES
                or item.name.split("[")[0].endswith("_on_gpu")):
            item.add_marker(pytest.mark.gpu)
