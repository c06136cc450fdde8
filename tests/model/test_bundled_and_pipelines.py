"""The bundled tiny checkpoint (rebuilt bit for bit by its script) and the Transformers pipelines on it."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoProcessor, pipeline

from kimi3_testing import ROOT

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_script_rebuilds_the_bundled_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "conversion", "make_tiny_checkpoint.py"), "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == sorted(os.listdir(TINY))
    # bit for bit where our code writes the bytes; Transformers' own json (config defaults, tokenizer/processor)
    # may be written differently by another Transformers version, so the config is compared as read back
    for f in ("model.safetensors", "tiktoken.model", "generation_config.json"):
        assert sha(out / f) == sha(os.path.join(TINY, f)), f
    from transformers_kimi3 import Kimi3Config

    def config(folder):
        d = Kimi3Config.from_pretrained(folder).to_dict()
        d.pop("_name_or_path", None)
        return d

    assert config(out) == config(TINY)


@pytest.fixture(scope="module")
def model():
    import transformers_kimi3  # noqa: F401  registers kimi_k3

    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()


def test_bundled_checkpoint_holds_mxfp4_experts_in_official_layout():
    from safetensors import safe_open

    with safe_open(os.path.join(TINY, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        packed = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed")
    assert packed.dtype == torch.uint8 and packed.shape == (64, 32)
    assert "language_model.model.layers.0.self_attn.A_log" in keys
    assert any(k.startswith("vision_tower.") for k in keys) and any(k.startswith("mm_projector.") for k in keys)


def test_text_generation_pipeline_matches_generate(model):
    processor = AutoProcessor.from_pretrained(TINY)
    messages = [{"role": "user", "content": "Hello there"}]
    pipe = pipeline("text-generation", model=model, tokenizer=processor.tokenizer)
    got = pipe(messages, max_new_tokens=6, do_sample=False)[0]["generated_text"][-1]
    ids = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=511)[0, ids.shape[1]:]
    assert got["role"] == "assistant"
    assert got["content"] == processor.tokenizer.decode(ref, skip_special_tokens=True)


def test_image_text_to_text_pipeline_matches_generate(model):
    processor = AutoProcessor.from_pretrained(TINY)
    y, x = np.mgrid[0:56, 0:84]
    image = np.stack([x * 3, y * 4, (x + y) * 2], -1).astype(np.uint8)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    got = pipe(text=messages, max_new_tokens=6, do_sample=False)[0]["generated_text"][-1]["content"]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.media_placeholder_token_id).sum()) == 1
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=511)
    assert got == processor.decode(ref[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, top_k=5)])
def test_static_cache_generation_with_an_image_equals_dynamic(model, sampling):
    """The static cache is sized for the prompt as the model sees it: the image placeholder expands to the image's
    rows inside the model, so a static cache sized from input_ids alone overflows at the first step."""
    processor = AutoProcessor.from_pretrained(TINY)
    y, x = np.mgrid[0:56, 0:84]
    image = np.stack([x * 5, y * 2, (x * y) % 255], -1).astype(np.uint8)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    outs = []
    with torch.no_grad():
        for impl in (None, "static"):
            torch.manual_seed(0)
            outs.append(model.generate(**inputs, max_new_tokens=4, pad_token_id=511, cache_implementation=impl,
                                       **sampling))
    assert outs[0].shape[1] == inputs["input_ids"].shape[1] + 4
    assert torch.equal(outs[0], outs[1])


def test_demo_runs():
    proc = subprocess.run([sys.executable, "-m", "transformers_kimi3", "demo", "--model", TINY,
                           "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "KDA backend: torch on cpu" in proc.stdout
    assert "image question: 'What colour is the circle?'" in proc.stdout and "\nanswer: " in proc.stdout
    assert "chat: 'What does the json module do?'" in proc.stdout and "\nreply: " in proc.stdout


def test_bench_entry_point_runs_on_cpu(tmp_path):
    # a quick timing on this machine that writes nothing: the temp folder stays empty (torch's own inductor cache
    # folder, made when Transformers imports torch._dynamo, aside)
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "transformers_kimi3", "bench", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "decode, static cache" in proc.stdout and "prefill" in proc.stdout
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")] == []


def test_bench_k3_shaped_mxfp4_runs_on_cpu(tmp_path):
    # bench/e2e.py's K3-shaped run (ours only, MXFP4 experts) at toy sizes: every prefill and decode row is measured,
    # and the static greedy path returns the eager path's tokens
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--tiny", "--model", "k3",
                           "--stages", "prefill,decode", "--prefill", "64", "--batches", "1,2", "--prompt", "16",
                           "--new-tokens", "4", "--out", str(tmp_path / "k.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.load(open(tmp_path / "k.json"))["runs"][-1]["rows"]
    assert not [r for r in rows if "error" in r], rows
    assert {(r["stage"], r.get("impl")) for r in rows} == {("prefill", "ours"), ("decode", "ours"),
                                                           ("decode", "ours_static_graph")}
    assert all(r["tokens_equal_to_ours"] == 1.0 for r in rows if r.get("impl") == "ours_static_graph")


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="the LoRA variants need PEFT")
def test_bench_finetune_stage_runs_on_cpu(tmp_path):
    # bench/e2e.py --stages finetune at toy sizes (the H200 run's code path): LoRA on the packed MXFP4 experts, LoRA
    # on the same experts in float, QAT of the packed experts' masters; what each row reports is checked against
    # counts taken here from the model's shapes
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(ROOT, "bench", "e2e.py"))
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    out = tmp_path / "ft.json"
    e2e.main(["--tiny", "--model", "k3", "--stages", "finetune", "--ft-steps", "3", "--out", str(out)])
    run = json.loads(out.read_text())["runs"][-1]
    rows = {r["variant"]: r for r in run["rows"]}
    assert set(rows) == {"packed_lora", "bf16_lora", "packed_qat"}
    assert not [r for r in rows.values() if "error" in r], rows

    model = e2e.build_k3(e2e.K3_TINY_CONFIG, torch.device("cpu"), torch.float32)  # the stage's weights
    r = 16
    kinds = {"q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj",  # KDA
             "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA
             "gate_proj", "up_proj", "down_proj", "routed_expert_down_proj", "routed_expert_up_proj"}
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in kinds]
    experts = [m for m in model.modules() if isinstance(m, PackedMXFP4Experts)]
    assert len(linears) > 40 and len(experts) == 7
    adapters = (sum(r * (m.in_features + m.out_features) for m in linears)
                + sum(3 * m.num_experts * r * (m.hidden_size + m.intermediate_size) for m in experts))
    masters = sum(3 * m.num_experts * m.hidden_size * m.intermediate_size for m in experts)
    for variant in ("packed_lora", "bf16_lora"):  # only the adapters train; the experts stay as they were
        assert rows[variant]["trainable_params"] == rows[variant]["adapter_params"] == adapters, rows[variant]
        assert rows[variant]["experts_changed_fraction"] == 0.0
    assert rows["packed_qat"]["trainable_params"] == masters and rows["packed_qat"]["adapter_params"] == 0
    assert rows["packed_qat"]["experts_changed_fraction"] > 0.5  # the masters moved
    assert rows["packed_lora"]["expert_gib"] < rows["bf16_lora"]["expert_gib"] / 3  # packed vs float experts
    for row in rows.values():
        assert len(row["losses"]) == 4 and len(row["step_ms"]) == 3
        assert row["loss_last"] < row["loss_first"] - 1e-2, row["losses"]  # a frozen setup would not move
    # the same weights and batch everywhere: the first step's loss is one function of them (fp32, exact experts)
    firsts = [row["loss_first"] for row in rows.values()]
    assert max(firsts) - min(firsts) < 1e-5, firsts
    if run["meta"]["device"] == "cpu":
        assert all(row["peak_allocated_gib"] is None and "CPU" in row["memory_note"] for row in rows.values())
