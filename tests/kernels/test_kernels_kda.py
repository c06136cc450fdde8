"""Runs tests/kernels_kda_cases.py (the Triton KDA kernels under TRITON_INTERPRET=1) in its own process: the
interpreter setting is process-wide and must not reach the other test modules of this run."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


SHARDS = 6  # the interpreter runs the cases slowly; six processes let pytest-xdist spread them over the workers


@pytest.mark.parametrize("shard", range(SHARDS))
def test_triton_kda_kernels_under_the_interpreter(shard, request):
    pytest.importorskip("triton")
    slow = ["--run-slow"] if request.config.getoption("--run-slow") else []
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "shard_plugin",
                           f"--shard={shard}/{SHARDS}", *slow, os.path.join(HERE, "kernels_kda_cases.py")],
                          capture_output=True, text=True, env=env, cwd=HERE, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
