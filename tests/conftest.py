"""The `gpu` marker: `pytest -m gpu tests` runs the GPU suite (tests/gpu/, the sm_90 kernel tests and the launch
tests that compare compiled kernels on a GPU). Without CUDA they skip or run their CPU parts, as in CI."""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_FILES = ("test_mxfp4_wgmma.py",)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (make test-all); `make test` and CI leave them out")


def pytest_configure(config):
    # one intra-op thread per pytest-xdist worker: `make test` runs one worker per core, and two threads per worker
    # on a busy 2-core machine made the tiny models' forwards several times slower
    # (OMP_NUM_THREADS: the same for the subprocesses tests start)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow (make test-all)")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        path = str(item.fspath)
        if (path.startswith(os.path.join(HERE, "gpu") + os.sep) or os.path.basename(path) in GPU_FILES
                or item.name.split("[")[0].endswith("_on_gpu")):
            item.add_marker(pytest.mark.gpu)
