"""The bundled tiny checkpoint (rebuilt bit for bit by its script) and the Transformers pipelines on it."""

import hashlib
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
