"""MXFP8 activations (W4A8, `moe_activation_format="mxfp8"`): the OCP MX v1.0 quantiser worked by hand, checked
against PyTorch's own float8_e4m3fn rounding, the experts' forward and backward against a hand-computed
reference, and the config field."""

import json
import math
import os

import pytest
import torch

from kimi3_testing import ROOT, tiny_k3_text_config
from transformers_kimi3 import Kimi3ForCausalLM, Kimi3TextConfig, KimiK3ForConditionalGeneration
from transformers_kimi3.activations import glu
from transformers_kimi3.moe import Kimi3Experts, Kimi3SparseMoeBlock
from transformers_kimi3.mxfp4 import decode_mxfp4, quantize_mxfp4
from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts
from transformers_kimi3.mxfp8 import (
    dequantize_mxfp8,
    e4m3_codes,
    e4m3_values,
    fake_quantize_mxfp8,
    quantize_mxfp8,
)

TINY = os.path.join(ROOT, "assets", "kimi-k3-tiny")


def block(*vals):
    v = torch.zeros(32)
    v[: len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return v


def q1(*vals):
    """(uint8 codes [32], scale byte, dequantised fp32 [32]) of one block."""
    elems, scale = quantize_mxfp8(block(*vals)[None])
    codes = elems.view(torch.uint8)[0]
    return codes, int(scale[0, 0]), fake_quantize_mxfp8(block(*vals))


def bits(t):
    return t.float().contiguous().view(torch.int32)


# ---------------------------------------------------------------- hand-worked OCP examples
def test_scale_saturation_and_ties_to_even():
    # amax 500: floor(log2 500) = 8 -> X = 2^(8-8) = 1, byte 127; 500 and 460 saturate to 448 (0x7E), -500 to -448
    # ties: 1.0625 between 1.0 (mantissa 000) and 1.125 (001) -> 1.0; 1.1875 between 1.125 and 1.25 (010) -> 1.25
    codes, scale, deq = q1(500.0, 460.0, -500.0, 448.0, 1.0, 1.0625, 1.1875, -1.0625, 0.0, -0.0, 3.0, 17.0)
    assert scale == 127
    assert codes[:12].tolist() == [0x7E, 0x7E, 0xFE, 0x7E, 0x38, 0x38, 0x3A, 0xB8, 0x00, 0x80, 0x44, 0x58]
    want = block(448.0, 448.0, -448.0, 448.0, 1.0, 1.0, 1.25, -1.0, 0.0, -0.0, 3.0, 16.0)  # 17: tie -> 16 (even)
    assert torch.equal(bits(deq), bits(want))


def test_subnormals_and_the_normal_boundary():
    # amax 256: X = 2^(8-8) = 1 (byte 127); E4M3 subnormals are m * 2^-9, m = 1..7
    # 2^-10 ties 0 and 2^-9 -> 0 (even); 3 * 2^-10 ties 2^-9 (m=1) and 2^-8 (m=2) -> 2^-8; 7 * 2^-9 is the largest
    # subnormal (0x07); 15 * 2^-10 ties 7 * 2^-9 and 2^-6 (the smallest normal, 0x08) -> 2^-6
    s = 2.0 ** -10
    codes, scale, deq = q1(256.0, s, 3 * s, 2 * s, 14 * s, 15 * s, 16 * s, -3 * s, 0.4 * s)
    assert scale == 127
    assert codes[:9].tolist() == [0x78, 0x00, 0x02, 0x01, 0x07, 0x08, 0x08, 0x82, 0x00]
    want = block(256.0, 0.0, 4 * s, 2 * s, 14 * s, 16 * s, 16 * s, -4 * s, 0.0)
    assert torch.equal(bits(deq), bits(want))


def test_power_of_two_amax_all_equal_blocks_and_zeros():
    # amax 1024 = 2^10: X = 2^2, the block maximum becomes 256 (0x78), not 448: the OCP scale leaves headroom
    codes, scale, deq = q1(1024.0, 3.0, -1024.0)
    assert scale == 127 + 2 and codes[:3].tolist() == [0x78, 0x34, 0xF8]
    assert torch.equal(deq, block(1024.0, 3.0, -1024.0))
    # all equal 5.0: X = 2^(2-8), 5 * 64 = 320 = 1.25 * 2^8 (0x7A), exact
    elems, scale = quantize_mxfp8(torch.full((1, 32), 5.0))
    assert scale.tolist() == [[127 - 6]] and set(elems.view(torch.uint8)[0].tolist()) == {0x7A}
    assert torch.equal(fake_quantize_mxfp8(torch.full((32,), 5.0)), torch.full((32,), 5.0))
    # all equal 0.3: X = 2^(-2-8), 307.2 rounds to 320 (quantum 32 in [256, 512)): 0.3125
    assert torch.equal(fake_quantize_mxfp8(torch.full((32,), 0.3)), torch.full((32,), 0.3125))
    # all zero (signs kept): the smallest scale, byte 0
    z = torch.tensor([0.0, -0.0] * 16)
    elems, scale = quantize_mxfp8(z[None])
    assert scale.tolist() == [[0]] and elems.view(torch.uint8)[0].tolist() == [0x00, 0x80] * 16
    assert torch.equal(bits(fake_quantize_mxfp8(z)), bits(z))


def test_tiny_blocks_clamp_the_scale_at_2_to_the_minus_127():
    # amax 2^-130 (fp32 subnormal): floor(log2) - 8 = -138 is clamped to -127; 2^-130 / 2^-127 = 0.125 (0x20),
    # 2^-140 / 2^-127 = 2^-13 < 2^-10: 0
    codes, scale, deq = q1(2.0 ** -130, 2.0 ** -140)
    assert scale == 0 and codes[:2].tolist() == [0x20, 0x00]
    assert torch.equal(deq, block(2.0 ** -130, 0.0))


def test_nan_inf_and_ragged_widths_are_refused():
    for bad, what in ((float("nan"), "1 NaN"), (float("inf"), "1 infinite"), (float("-inf"), "1 infinite")):
        x = torch.ones(2, 64)
        x[1, 40] = bad
        with pytest.raises(ValueError, match=rf"expert input: cannot quantise to MXFP8: .*{what}.*index \[1, 40\]"):
            quantize_mxfp8(x, name="expert input")
        with pytest.raises(ValueError, match="cannot quantise to MXFP8"):
            fake_quantize_mxfp8(x)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.ones(4, 48))


# ---------------------------------------------------------------- against PyTorch's float8 rounding
def _reference(x):
    """OCP MXFP8 with math.frexp for the scales and PyTorch's float8_e4m3fn conversion (round to nearest even) for
    the elements, after saturating at 448."""
    blocks = x.float().reshape(-1, 32)
    out = torch.empty_like(blocks)
    for i, b in enumerate(blocks):
        amax = float(b.abs().max())
        e = max(math.frexp(amax)[1] - 1 - 8, -127) if amax else -127
        scaled = (b.double() / 2.0 ** e).clamp(-448, 448).float()
        out[i] = (scaled.to(torch.float8_e4m3fn).double() * 2.0 ** e).float()
    return out.reshape(x.shape)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this PyTorch has no float8_e4m3fn")
def test_matches_pytorch_float8_rounding_over_many_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-40, 40, (64, 1), generator=g).float())
    x[::7] = torch.randint(-600, 600, (10, 96), generator=g).float() / 8  # ties and saturation
    x[3, :32] = 2.0 ** -135 * torch.randint(-9, 9, (32,), generator=g)  # fp32 subnormals
    fq = fake_quantize_mxfp8(x)
    assert torch.equal(bits(fq), bits(_reference(x)))
    elems, scales = quantize_mxfp8(x)
    assert elems.dtype == torch.float8_e4m3fn
    assert torch.equal(bits(dequantize_mxfp8(elems, scales)), bits(fq))
    assert torch.equal(bits(dequantize_mxfp8(elems.view(torch.uint8), scales)), bits(fq))  # uint8 codes too


def test_every_code_round_trips_and_nan_codes_are_refused():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    values = e4m3_values(codes[finite])
    assert torch.equal(e4m3_codes(values), codes[finite])
    if hasattr(torch, "float8_e4m3fn"):
        assert torch.equal(bits(values), bits(codes[finite].view(torch.float8_e4m3fn).float()))
    with pytest.raises(ValueError, match="NaN encodings"):
        dequantize_mxfp8(torch.full((1, 32), 0x7F, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8))


def test_bf16_inputs_give_bf16_numbers_exactly():
    """Every finite bf16 value, in shuffled blocks: fake quantisation in bf16 equals it in fp32."""
    raw = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = raw[torch.isfinite(raw)]
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))][: x.numel() // 32 * 32]
    x = x.reshape(-1, 32)
    assert torch.equal(bits(fake_quantize_mxfp8(x)), bits(fake_quantize_mxfp8(x.float())))


def test_gradient_passes_straight_through():
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, 64)
    fake_quantize_mxfp8(x).backward(g)
    assert torch.equal(x.grad, g)


# ---------------------------------------------------------------- the experts
E, D, I = 4, 64, 32


def _weights(seed=0):
    """MXFP4-exact float weights (w1, w3 [E, I, D], w2 [E, D, I])."""
    g = torch.Generator().manual_seed(seed)
    return [decode_mxfp4(*quantize_mxfp4(torch.randn(E, *s, generator=g) * 0.3)) for s in ((I, D), (I, D), (D, I))]


def _inputs(T=24, k=2, seed=1):
    """Small integers (exact in MXFP8 and in every fp32 sum with the weights), routes and routing weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-16, 17, (T, D), generator=g).float()
    x[:, ::5] *= 0.25
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, idx, torch.rand(T, k, generator=g)


def _modules(w1, w3, w2):
    config = tiny_k3_text_config(num_experts=E, moe_intermediate_size=I, moe_activation_format="mxfp8")
    packed = PackedMXFP4Experts.from_float(w1, w3, w2, Kimi3Experts(config, D).act_fn)
    packed.activation_format = "mxfp8"
    plain = Kimi3Experts(config, D)
    with torch.no_grad():
        for p, w in zip((plain.w1, plain.w3, plain.w2), (w1, w3, w2)):
            p.copy_(w)
    return packed, plain


def _by_hand(x, idx, tw, w1, w3, w2, act):
    """y[t] = sum_j w[t, j] W2_e Q(GLU(W1_e Q(x[t]), W3_e Q(x[t]))), e = idx[t, j], Q = MXFP8 through its codes,
    in float64 (the pre-activations are exact sums; the GLU is the model's fp32 one)."""
    def q(v):
        return dequantize_mxfp8(*quantize_mxfp8(v)).double()
    xq = q(x)
    gate, up = (torch.einsum("tkid,td->tki", w[idx].double(), xq).float() for w in (w1, w3))
    h = q(glu(gate, up, *act.spec))
    return torch.einsum("tk,tkdi,tki->td", tw.double(), w2[idx].double(), h)


@pytest.mark.parametrize("which", ["packed", "float"])
def test_experts_forward_equals_the_hand_reference(which):
    w = _weights()
    x, idx, tw = _inputs()
    packed, plain = _modules(*w)
    mod = packed if which == "packed" else plain
    with torch.no_grad():
        got = mod(x, idx, tw).double()
    ref = _by_hand(x, idx, tw, *w, plain.act_fn)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6
    with torch.no_grad():  # and MXFP8 is really on: the bf16 format gives another result
        mod.activation_format = "bf16"
        assert float((mod(x, idx, tw).double() - ref).abs().max() / ref.abs().max()) > 1e-3


def test_packed_backward_equals_autograd_through_the_straight_through_reference():
    w = _weights(2)
    x, idx, tw = _inputs(T=40, seed=3)
    x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(4))  # generic values now
    packed, plain = _modules(*w)
    grads = []
    for mod in (packed, plain):
        xr, twr = x.clone().requires_grad_(), tw.clone().requires_grad_()
        y = mod(xr, idx, twr)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        grads.append((y.detach(), xr.grad, twr.grad))
    for a, b in zip(*grads):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


# ---------------------------------------------------------------- the config field
def _experts_formats(model):
    return {b.experts.activation_format for b in model.modules() if isinstance(b, Kimi3SparseMoeBlock)}


def test_config_field_validates_and_round_trips(tmp_path):
    assert tiny_k3_text_config().moe_activation_format == "bf16"
    with pytest.raises(ValueError, match="`moe_activation_format` = 'fp8' must be one of"):
        tiny_k3_text_config(moe_activation_format="fp8")
    config = tiny_k3_text_config(moe_activation_format="mxfp8")
    config.save_pretrained(tmp_path)
    assert json.load(open(tmp_path / "config.json"))["moe_activation_format"] == "mxfp8"
    assert Kimi3TextConfig.from_pretrained(tmp_path).moe_activation_format == "mxfp8"
    config.moe_activation_format = "int8"  # edited after construction: refused where it is used
    with pytest.raises(ValueError, match="moe_activation_format"):
        config.validate_kimi3()
    with pytest.raises(ValueError, match="moe_activation_format"):
        Kimi3ForCausalLM(config)


def test_from_pretrained_takes_the_format_also_for_a_nested_k3_config():
    model = KimiK3ForConditionalGeneration.from_pretrained(TINY, moe_activation_format="mxfp8")
    assert model.config.text_config.moe_activation_format == "mxfp8" and _experts_formats(model) == {"mxfp8"}
    assert _experts_formats(Kimi3ForCausalLM.from_pretrained(TINY)) == {"bf16"}
    with pytest.raises(ValueError, match="moe_activation_format"):
        Kimi3ForCausalLM.from_pretrained(TINY, moe_activation_format="e4m3")
