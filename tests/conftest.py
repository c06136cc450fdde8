"""The `gpu` marker: `pytest -m gpu tests` runs the GPU suite (tests/gpu/, the sm_90 kernel tests and the launch
tests that compare compiled kernels on a GPU). Without CUDA they skip or run their CPU parts, as in CI."""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_FILES = ("test_mxfp4_wgmma.py",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if (path.startswith(os.path.join(HERE, "gpu") + os.sep) or os.path.basename(path) in GPU_FILES
                or item.name.split("[")[0].endswith("_on_gpu")):
            item.add_marker(pytest.mark.gpu)
