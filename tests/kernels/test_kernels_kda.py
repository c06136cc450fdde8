"""Runs tests/kernels_kda_cases.py (the Triton KDA kernels under TRITON_INTERPRET=1) in its own process: the
interpreter setting is process-wide and must not reach the other test modules of this run."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# `make test` (CI): every case in one process. A process pays ~4 s to start (torch, Triton, the kernel modules
# reloaded for the interpreter) and the interpreter's first call of each kernel, ~7 s in all, so each extra process
# costs that much; and pytest-xdist hands out consecutive tests in chunks, so processes of one file mostly land on one
# worker anyway. `make test-all` adds the slow launch variants (each as costly as its default case): six processes
# there, which the workers can share.
SHARDS_SLOW = 6


def pytest_generate_tests(metafunc):
    if "shard" in metafunc.fixturenames:
        n = SHARDS_SLOW if metafunc.config.getoption("--run-slow") else 1
        metafunc.parametrize("shard", [(i, n) for i in range(n)], ids=[f"{i}of{n}" for i in range(n)])


def test_triton_kda_kernels_under_the_interpreter(shard, request):
    pytest.importorskip("triton")
    i, n = shard
    slow = ["--run-slow"] if request.config.getoption("--run-slow") else []
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "shard_plugin",
                           f"--shard={i}/{n}", *slow, os.path.join(HERE, "kernels_kda_cases.py")],
                          capture_output=True, text=True, env=env, cwd=HERE, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
