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
    # the bundled model's image tokens carry their pixels' colours (R^2 0.95-0.98 per channel); noise carries none
    assert min(result["colour_probe_r2"]) > 0.8, result["colour_probe_r2"]


def test_colour_probe_finds_nothing_in_noise():
    import torch
    from transformers import AutoProcessor

    import eval_mini

    class Noise:
        def get_image_features(self, pixel_values, grid_thws):
            return torch.randn(int(grid_thws[0].prod()) // 4, 256, generator=torch.Generator().manual_seed(0))

    assert max(eval_mini.colour_probe(Noise(), AutoProcessor.from_pretrained(MINI), 40)) < 0.1


def _linear_inputs(inputs):
    """A stand-in for `prepare`'s WORK/inputs: random ids of the mini vocabulary as both splits, the bundled
    mini model's tokenizer and its ids."""
    import shutil

    os.makedirs(os.path.join(inputs, "tokenizer"))
    for name in ("chat_template.jinja", "special_tokens_map.json", "tiktoken.model", "tokenizer.json",
                 "tokenizer_config.json"):
        shutil.copy(os.path.join(MINI, name), os.path.join(inputs, "tokenizer", name))
    rng = np.random.default_rng(1)
    for split, docs in (("train", 8), ("eval", 12)):
        rng.integers(3, 7900, size=docs * 80, dtype=np.uint16).tofile(os.path.join(inputs, f"text_{split}.bin"))
        np.save(os.path.join(inputs, f"text_{split}_offsets.npy"), np.arange(docs + 1, dtype=np.int64) * 80)
    text = json.load(open(os.path.join(MINI, "config.json")))["text_config"]
    ids = {k: text[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    json.dump({"tokenizer": ids}, open(os.path.join(inputs, "prepare.json"), "w"))


def test_linear_phase_and_fidelity_against_native(tmp_path):
    """The smoke "linear-text" phase (a model in the Kimi Linear layout: no AttnRes, no latent MoE, no KDA gate
    bound) trains and writes ours and native's folders; bench/fidelity.py --native then finds ours and native
    Transformers' KimiLinearForCausalLM equal in fp32 (top-1, logits, greedy tokens) on the CPU."""
    from kimi3_testing import native_kimi_linear_module

    native_kimi_linear_module()  # native's PyTorch path (fla hidden) is the one this process imports
    import train_kimi3_mini

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import fidelity

    _linear_inputs(tmp_path / "inputs")
    assert train_kimi3_mini.main(["train", "--work", str(tmp_path), "--smoke", "--phases", "linear-text"]) == 0
    phase = tmp_path / "phases" / "linear-text"
    assert not (tmp_path / "phases" / "text").exists()  # only the phase asked for; nothing exported
    config = json.load(open(phase / "final" / "config.json"))
    assert config.get("attn_res_block_size") is None and not config.get("routed_expert_hidden_size")
    assert "gate_lower_bound" not in config["linear_attn_config"]
    native_config = json.load(open(phase / "final-native" / "config.json"))
    assert native_config["architectures"] == ["KimiLinearForCausalLM"] and "auto_map" not in native_config

    res = fidelity.main(["--model", str(phase / "final"), "--native", str(phase / "final-native"),
                         "--data", str(tmp_path / "inputs"), "--seq-len", "40", "--chunks", "3", "--prompts", "3",
                         "--prompt-len", "12", "--new-tokens", "5", "--device", "cpu",
                         "--out", str(tmp_path / "fid.json")])
    rows = json.load(open(tmp_path / "fid.json"))["rows"]
    assert rows == json.loads(json.dumps(res["rows"]))
    fp32 = rows["ours_vs_native_fp32"]
    assert fp32["top1_agreement"] == 1.0 and fp32["logits_max_rel_err"] < 1e-4
    assert fp32["greedy"]["identical_sequences"] == 3 and fp32["greedy"]["tokens_to_first_difference"] == 15
    for name in ("ours_vs_native_bf16", "native_bf16_vs_fp32"):
        g = rows[name]["greedy"]
        assert 0 <= rows[name]["top1_agreement"] <= 1 and g["prompts"] == 3 and g["new_tokens"] == 5
        assert len(g["first_differences"]) == 3 - g["identical_sequences"]
    assert rows["goal"]["met_teacher_forced"] == (rows["ours_vs_native_bf16"]["top1_agreement"]
                                                 >= rows["native_bf16_vs_fp32"]["top1_agreement"])


def test_greedy_agreement_counts_to_the_first_difference():
    import torch

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import fidelity

    ta = torch.tensor([[1, 2, 3], [4, 5, 6]])
    tb = torch.tensor([[1, 2, 3], [4, 7, 6]])
    la, lb = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8)
    la[1, 1, 5], la[1, 1, 7] = 2.0, 1.5
    lb[1, 1, 5], lb[1, 1, 7] = 1.0, 1.25
    g = fidelity.greedy_agreement((ta, la), (tb, lb))
    assert g["identical_sequences"] == 1 and g["tokens_to_first_difference"] == 3 + 1
    assert g["first_differences"] == [{"prompt": 1, "step": 1, "token_a": 5, "token_b": 7, "gap_in_a": 0.5,
                                       "gap_in_b": 0.25, "logit_std_a": g["first_differences"][0]["logit_std_a"]}]


def test_fidelity_mxfp8_row_on_the_mini_model(tmp_path):
    """bench/fidelity.py --mxfp8 on the bundled mini (CPU: the emulated W4A8 path): the row's fields agree with each
    other, and MXFP8 activations stay close to bf16 ones (random held-out ids; the trained model's held-out text is
    the GPU run's)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import fidelity

    _held_out_split(tmp_path, docs=3, length=48)
    res = fidelity.main(["--model", MINI, "--data", str(tmp_path), "--mxfp8", "--device", "cpu", "--seq-len", "48"])
    row = res["rows"]["mxfp8_vs_bf16"]
    assert res["meta"]["w4a8_kernels"] is False  # no FP8 tensor cores here: the emulation
    assert row["ppl_bf16_activations"] == res["rows"]["bf16_vs_fp32"]["ppl_bf16"]
    assert abs(row["ppl_rel_diff"] - (row["ppl_mxfp8_activations"] / row["ppl_bf16_activations"] - 1)) < 1e-12
    # the setting reached the experts (an unapplied one gives the bf16 perplexity exactly) and MXFP8's rounding of
    # the experts' inputs (up to 2^-4 relative) moves this model's perplexity of random ids by well under 5 %; the
    # quantiser's own rules are tested bit for bit in tests/mxfp4 (this model's logits move ~1 % with MXFP8)
    assert row["ppl_rel_diff"] != 0 and abs(row["ppl_rel_diff"]) < 0.05 and row["top1_agreement"] > 0.9, row


def test_chat_data_text_items_are_document_pieces_labelled_throughout():
    import mini_chat

    tokens = np.arange(1000, dtype=np.uint16)
    spans = [(0, 10), (10, 300), (300, 1000)]
    data = mini_chat.ChatData(None, 5, 40, {"text": 1}, text=(tokens, spans), max_len=64)
    for i in range(len(data)):
        item = data[i]
        ids = item["input_ids"]
        assert item["labels"] == ids and 1 <= len(ids) <= 64
        assert any(ids == list(range(s, min(e, s + 64))) for s, e in spans), ids[:4]
    with pytest.raises(ValueError, match="'text' items needs `text`"):
        mini_chat.ChatData(None, 5, 4, {"talk": 1, "text": 1})


def test_loss_curves_svg_has_one_panel_per_phase_of_the_model():
    import xml.etree.ElementTree as ET

    import mini_card

    phase = {"model": "mini", "steps": 30, "losses": [3.0, 2.0, 1.5], "eval_loss": 1.7}
    summary = {"phases": {"text": phase, "vision": dict(phase, losses=[0.5, 0.4, 0.4]),
                          "draft-text": dict(phase, model="draft")}}
    root = ET.fromstring(mini_card.loss_curves_svg(summary, "mini"))
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in root.iter(ns + "text") if t.get("font-weight") == "bold"]
    assert titles == ["text", "vision"]
    lines = [p for p in root.iter(ns + "polyline") if p.get("stroke") != "#888"]
    assert [len(p.get("points").split()) for p in lines] == [3, 3]
    # the highest loss of a panel is drawn highest (the smallest y)
    ys = [float(xy.split(",")[1]) for xy in lines[0].get("points").split()]
    assert ys[0] < ys[1] < ys[2]
    assert mini_card.loss_curves_svg({"phases": {}}, "mini") is None
