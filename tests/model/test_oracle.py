"""Parity with Moonshot's own code on the official-format oracle checkpoint (../shared/oracle/A)."""

import json
import os
import subprocess
import sys

import pytest

from kimi3_testing import ORACLE, ORACLE_A, once_per_run

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLE_A), reason="../shared/oracle/A is not present")

# what each test reads from the checker's results: the entries its sections write (each must pass)
SECTIONS = {"text,gen": ("text_logits", "text_logits(valid pos)", "text_logits(row0, no pad)", "gen_single",
                         "gen_batch"),
            "mm": ("mm_logits", "gen_mm")}


@pytest.fixture(scope="module")
def oracle_results(tmp_path_factory):
    """One run of the checker over every section (text, gen, mm) for both tests, once per test run
    (kimi3_testing.once_per_run): the same model loaded once instead of once per test. Its exit status passes
    only when every entry passes; each test checks its own sections' entries, so one section's failure fails only
    its test. Returns (exit status, output, results)."""
    def run(folder):
        proc = subprocess.run([sys.executable, os.path.join(ORACLE, "check_oracle.py"), ORACLE_A, "--only",
                               "text,gen,mm", "--strict", "--json", str(folder / "oracle.json")],
                              capture_output=True, text=True, timeout=600)
        (folder / "run.json").write_text(json.dumps([proc.returncode, proc.stdout[-4000:] + proc.stderr[-4000:]]))

    folder = once_per_run(tmp_path_factory, "oracle", run)
    rc, output = json.loads((folder / "run.json").read_text())
    results = json.load(open(folder / "oracle.json"))["results"] if (folder / "oracle.json").exists() else None
    return rc, output, results


def _check(oracle_results, only):
    """The results of the sections in `only`, each entry passed (the checker's --strict exit status, per section)."""
    rc, output, results = oracle_results
    assert results is not None, output
    mine = {k: v for k, v in results.items() if k in SECTIONS[only]}
    assert mine and all("error" not in v and v.get("pass", True) and v.get("tokens_match", True)
                        for v in mine.values()), (mine, output)
    if rc != 0:  # another section failed: that is the other test's failure
        assert any(k not in SECTIONS[only] for k, v in results.items()
                   if "error" in v or not v.get("pass", True) or not v.get("tokens_match", True)), output
    return mine


def test_oracle_text_and_generation(oracle_results):
    res = _check(oracle_results, "text,gen")
    assert res["text_logits(valid pos)"]["rel"] < 1e-4
    for key in ("gen_single", "gen_batch"):
        assert res[key]["tokens_match"] is True
        assert res[key]["rel"] < 1e-4


def test_oracle_multimodal(oracle_results):
    res = _check(oracle_results, "mm")
    assert res["mm_logits"]["rel"] < 1e-4
    assert res["gen_mm"]["tokens_match"] is True and res["gen_mm"]["rel"] < 1e-4
