"""The GPU suite (`pytest -m gpu tests`): every test here needs CUDA and is marked `gpu`; CI has no GPU, so there they
skip. Each test records what it measured with the `record` fixture; at the end of a run the results go to
bench/results/gpu_suite_<gpu>.json (GPU, commit, date, pass/fail, each check's worst error and its bound)."""

import datetime
import json
import os
import subprocess

import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # kimi3_testing
_RECORDS = []
_OUTCOMES = {}


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here) and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (the GPU suite: pytest -m gpu tests)"))


@pytest.fixture
def record(request):
    """record(check, error, bound): keep a measured error with the bound it must stay within, and assert it."""
    def rec(check, error, bound):
        _RECORDS.append({"test": request.node.nodeid, "check": check, "error": float(error), "bound": bound,
                         "ok": bool(error < bound)})
        assert error < bound, f"{check}: {error:.3e} >= {bound:.1e}"
    return rec


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        known = report.skipped and getattr(report, "wasxfail", None) is not None  # a known failure, marked xfail
        _OUTCOMES[report.nodeid] = "xfailed" if known else report.outcome


def pytest_sessionfinish(session, exitstatus):
    ours = {k: v for k, v in _OUTCOMES.items() if "tests/gpu/" in k or k.startswith("gpu/")}
    if not torch.cuda.is_available() or not ours:
        return
    name = torch.cuda.get_device_name()
    kind = "h200" if "H200" in name else "h100" if "H100" in name else name.lower().replace(" ", "_")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    out = os.environ.get("GPU_SUITE_OUT") or os.path.join(ROOT, "bench", "results")
    os.makedirs(out, exist_ok=True)
    failed = sorted(k for k, v in ours.items() if v == "failed")
    known = sorted(k for k, v in ours.items() if v == "xfailed")
    graded = [r for r in _RECORDS if r["test"] not in known]
    summary = {"gpu": name, "commit": commit, "date": datetime.date.today().isoformat(),
               "torch": torch.__version__, "passed": sum(v == "passed" for v in ours.values()),
               "failed": failed, "xfailed": known, "skipped": sum(v == "skipped" for v in ours.values()),
               "worst": max(graded, key=lambda r: r["error"] / r["bound"]) if graded else None,
               "checks": _RECORDS}
    with open(os.path.join(out, f"gpu_suite_{kind}.json"), "w") as f:
        json.dump(summary, f, indent=1)
