"""Parity with Moonshot's own code on the official-format oracle checkpoint (../shared/oracle/A)."""

import json
import os
import subprocess
import sys

import pytest

from kimi3_testing import ORACLE, ORACLE_A

pytestmark = pytest.mark.skipif(not os.path.isdir(ORACLE_A), reason="../shared/oracle/A is not present")


def _check(tmp_path, only):
    out = tmp_path / "oracle.json"
    proc = subprocess.run([sys.executable, os.path.join(ORACLE, "check_oracle.py"), ORACLE_A, "--only", only,
                           "--strict", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.load(open(out))["results"]


def test_oracle_text_and_generation(tmp_path):
    res = _check(tmp_path, "text,gen")
    assert res["text_logits(valid pos)"]["rel"] < 1e-4
    for key in ("gen_single", "gen_batch"):
        assert res[key]["tokens_match"] is True
        assert res[key]["rel"] < 1e-4


def test_oracle_multimodal(tmp_path):
    res = _check(tmp_path, "mm")
    assert res["mm_logits"]["rel"] < 1e-4
    assert res["gen_mm"]["tokens_match"] is True and res["gen_mm"]["rel"] < 1e-4
