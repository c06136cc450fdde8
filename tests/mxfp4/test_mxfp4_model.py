"""Packed MXFP4 experts inside the model: kept packed by default, dequantised on request, saved byte for byte."""

import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kimi3_testing import ORACLE_A, needs_oracle, rel_err

pytestmark = needs_oracle
from transformers_kimi3 import Kimi3ForConditionalGeneration, kernel_status
from transformers_kimi3.moe import Kimi3Experts
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts


def _experts(model):
    return [m for m in model.modules() if isinstance(m, (PackedMXFP4Experts, Kimi3Experts))]


def test_packed_by_default_and_dequantized_on_request():
    o = load_file(os.path.join(ORACLE_A, "inputs_and_logits.safetensors"))
    packed = Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A, dtype=torch.float32).eval()
    plain = Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A, dtype=torch.float32, dequantize=True).eval()
    assert all(isinstance(e, PackedMXFP4Experts) for e in _experts(packed)) and _experts(packed)
    assert all(isinstance(e, Kimi3Experts) for e in _experts(plain))
    assert all(e.w1_packed.dtype == torch.uint8 for e in _experts(packed))
    packed_bytes = sum(e.weight_bytes for e in _experts(packed))
    plain_bytes = sum(p.numel() * 2 for e in _experts(plain) for p in e.parameters())  # as bf16
    assert packed_bytes < 0.3 * plain_bytes
    ids, mask = o["text_input_ids"], o["text_attention_mask"]
    with torch.no_grad():
        a = packed(input_ids=ids, attention_mask=mask).logits
        b = plain(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert rel_err(a[valid], b[valid]) < 1e-5
    assert rel_err(a[valid], o["text_logits"][valid]) < 1e-4
    assert kernel_status("cpu")["moe"]["mxfp4_experts"] in ("torch-per-expert", "triton")


def test_packed_save_writes_the_source_bytes(tmp_path):
    model = Kimi3ForConditionalGeneration.from_pretrained(ORACLE_A, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    import json
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    src = safe_open(os.path.join(ORACLE_A, "model.safetensors"), "pt")
    out_files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    out = {}
    for f in out_files:
        with safe_open(tmp_path / f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    for key in src.keys():
        if "experts." in key and key.endswith(("weight_packed", "weight_scale")):
            assert torch.equal(out[key], src.get_tensor(key)), key
    again = Kimi3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 448, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_bf16_autocast_with_packed_experts_on_cpu():
    """bf16 autocast over a model whose experts stay packed: forward, backward and generate run (the experts keep their
    own fp32 arithmetic), the loss is finite, gradients reach the layers before the experts, and the name the model
    was loaded from is kept (PEFT writes it into adapters)."""
    import math

    from transformers_kimi3 import Kimi3ForCausalLM

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets",
                        "kimi-k3-tiny")
    model = Kimi3ForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert model.name_or_path == tiny and model.config._name_or_path == tiny
    assert any(isinstance(e, PackedMXFP4Experts) for e in _experts(model))
    ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        gen = model.generate(ids[:, :5], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert math.isfinite(out.loss.item()) and gen.shape == (2, 8)
    down = model.model.layers[1].block_sparse_moe.routed_expert_down_proj.weight.grad
    assert down is not None and down.abs().max() > 0  # the gradient crossed the packed experts
