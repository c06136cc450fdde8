"""examples/finetune_mini.py and examples/eval_mini.py on the bundled kimi-k3-mini, at toy sizes on the CPU: the
scripts run end to end, and what they report holds (a QAT model's packed reload evaluates as it trained; the
picture evaluation counts every scene once)."""
import json
import os
import sys

import numpy as np
import pytest

from kimi3_testing import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))
MINI = os.path.join(ROOT, "assets", "kimi-k3-mini")


def _held_out_split(folder, seed=0, docs=12, length=40):
    """A stand-in for `train_kimi3_mini.py prepare`'s held-out split: random ids of the mini vocabulary."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 7900, size=docs * length, dtype=np.uint16)
    tokens.tofile(os.path.join(folder, "text_eval.bin"))
    np.save(os.path.join(folder, "text_eval_offsets.npy"), np.arange(docs + 1, dtype=np.int64) * length)


def test_finetune_mini_runs_and_qat_reload_evaluates_as_trained(tmp_path):
    import finetune_mini

    _held_out_split(tmp_path)
    out = tmp_path / "ft.json"
    finetune_mini.main(["--model", MINI, "--data", str(tmp_path), "--runs", "adamw,qat", "--steps", "2",
                        "--batch", "2", "--seq-len", "16", "--eval-every", "1", "--eval-chunks", "4",
                        "--out", str(out)])
    runs = json.load(open(out))["runs"]
    assert [s for s, _ in runs["adamw"]["eval_loss"]] == [0, 1, 2]
    assert runs["adamw"]["eval_loss"][0] == runs["qat"]["eval_loss"][0]  # the same start and held-out chunks
    # what QAT trained through is what is saved: the packed reload's loss is the last evaluation's (rounded to 1e-4)
    assert runs["qat"]["packed_eval_loss"] == pytest.approx(runs["qat"]["eval_loss"][-1][1], abs=2e-4)


def test_eval_mini_counts_each_scene_once(tmp_path):
    import eval_mini

    out = tmp_path / "eval.json"
    eval_mini.main(["--model", MINI, "--scenes", "3", "--out", str(out)])
    result = json.load(open(out))
    assert result["total"][1] == 3 == sum(n for _, n in result["exact"].values())
    assert 0 <= result["total"][0] <= 3 and len(result["examples"]) == 3
