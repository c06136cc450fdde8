"""MXFP4 quantiser, packing and dequantisation (CPU)."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "src", ROOT / "kernels"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from transformers_kimi3.mxfp4 import (  # noqa: E402
    E2M1_VALUES,
    _e2m1_codes,
    check_mxfp4,
    decode_mxfp4,
    dequantize_mxfp4,
    pack_fp4_codes,
    quantize_mxfp4,
    unpack_fp4_codes,
)

LUT = torch.tensor(E2M1_VALUES)


def bits(t):
    """Bit pattern of an fp32 tensor, so that -0.0 != 0.0 and exactness is exact."""
    return t.float().contiguous().view(torch.int32)


def block(*vals):
    v = torch.zeros(32)
    v[: len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return v


def q1(v):
    packed, scale = quantize_mxfp4(v.reshape(1, -1))
    return packed[0], scale[0]


# ---------------------------------------------------------------- hand-computed bytes


def test_bytes_rounding_ties_saturation_and_negative_zero():
    # amax 7 -> floor(log2 7) = 2 -> X = 2^0 -> scale byte 127
    v = block(1.0, -0.5, 6.0, 7.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -0.0, 0.0, -0.1, 4.0)
    packed, scale = q1(v)
    assert scale.tolist() == [127]
    # codes: 1->2, -0.5->9, 6->7, 7->7 (saturates), 0.25->0 (tie to even), 0.75->2 (tie to 1.0), 1.25->2,
    # 1.75->4, 2.5->4, 3.5->6, 5->6 (tie to 4), 5.5->7, -0->8, 0->0, -0.1->8 (negative zero), 4->6
    assert packed.tolist() == [0x92, 0x77, 0x20, 0x42, 0x64, 0x76, 0x08, 0x68] + [0] * 8
    deq = dequantize_mxfp4(packed[None], scale[None], torch.float32)[0]
    want = block(1.0, -0.5, 6.0, 6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, 0.0, -0.0, 4.0)
    assert torch.equal(bits(deq), bits(want))


def test_negative_ties_are_symmetric():
    v = -block(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0)
    packed, scale = q1(v)
    assert scale.tolist() == [127]  # amax 6 -> floor(log2 6) = 2
    codes = unpack_fp4_codes(packed)[:8].tolist()
    assert codes == [8, 10, 10, 12, 12, 14, 14, 15]


def test_all_zero_block_gets_smallest_scale():
    packed, scale = q1(torch.zeros(32))
    assert scale.tolist() == [0] and packed.tolist() == [0] * 16
    packed, scale = q1(torch.full((32,), -0.0))
    assert scale.tolist() == [0] and packed.tolist() == [0x88] * 16
    deq = dequantize_mxfp4(packed[None], scale[None], torch.float32)[0]
    assert torch.equal(bits(deq), bits(torch.full((32,), -0.0)))


@pytest.mark.parametrize("value, scale_byte, byte, back", [
    (1.0, 125, 0x66, 1.0),       # X = 2^-2, 1.0 / X = 4 -> code 6
    (-3.0, 126, 0xFF, -3.0),     # X = 2^-1, -6 -> code 15 (a 0xFF *packed* byte is fine)
    (0.3, 123, 0x66, 0.25),      # floor(log2 0.3) = -2, X = 2^-4, 4.8 -> 4 (code 6)
    (7.0, 127, 0x77, 6.0),       # 7 / 1 = 7 saturates to 6
])
def test_block_of_identical_values(value, scale_byte, byte, back):
    packed, scale = q1(torch.full((32,), value))
    assert scale.tolist() == [scale_byte]
    assert packed.tolist() == [byte] * 16
    deq = dequantize_mxfp4(packed[None], scale[None], torch.float32)[0]
    assert torch.equal(deq, torch.full((32,), back))


def test_subnormal_range_blocks():
    # amax = 2^-125: X = 2^-127 (not clamped), 2^-125 / X = 4 -> code 6
    packed, scale = q1(block(2.0 ** -125))
    assert scale.tolist() == [0] and packed.tolist()[0] == 0x06
    # fp32 subnormals 2^-127, 2^-128: the exponent -129 clamps to -127; they stay exact (codes 2 and 1)
    v = block(2.0 ** -127, -(2.0 ** -128))
    packed, scale = q1(v)
    assert scale.tolist() == [0] and packed.tolist()[0] == 0x92
    deq = dequantize_mxfp4(packed[None], scale[None], torch.float32)[0]
    assert torch.equal(bits(deq), bits(v))
    assert torch.equal(bits(dequantize_mxfp4(packed[None], scale[None], torch.bfloat16)[0]), bits(v))
    # far below the smallest scale: 2^-140 / 2^-127 = 2^-13 rounds to (signed) zero
    packed, scale = q1(block(2.0 ** -140, -(2.0 ** -141)))
    assert scale.tolist() == [0] and packed.tolist()[0] == 0x80


def test_largest_scale():
    packed, scale = q1(block(1.5 * 2.0 ** 127, 2.0 ** 125))
    assert scale.tolist() == [252]  # floor(log2) = 127 -> X = 2^125
    assert packed.tolist()[0] == 0x27  # 6 -> code 7, 1 -> code 2
    deq = dequantize_mxfp4(packed[None], scale[None], torch.float32)[0]
    assert deq[0].item() == 1.5 * 2.0 ** 127 and deq[1].item() == 2.0 ** 125


def test_exact_powers_of_two_and_frexp_boundaries():
    # amax just below / at a power of two must land on the right scale (no log2 rounding)
    below = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0)).item()
    assert q1(block(below))[1].tolist() == [127]  # floor(log2 7.99..) = 2
    assert q1(block(8.0))[1].tolist() == [128]


def test_refuses_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match="layer.w1: cannot quantise non-finite"):
        quantize_mxfp4(torch.tensor([float("nan")] + [0.0] * 31)[None], name="layer.w1")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(torch.tensor([float("inf")] + [0.0] * 31)[None])


# ---------------------------------------------------------------- packing


def test_pack_unpack_codes():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 8, 7]], dtype=torch.uint8)
    packed = pack_fp4_codes(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F, 0x78]]
    assert torch.equal(unpack_fp4_codes(packed), codes)
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    assert torch.equal(pack_fp4_codes(unpack_fp4_codes(all_bytes)), all_bytes)
    with pytest.raises(ValueError, match="0..15"):
        pack_fp4_codes(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="odd"):
        pack_fp4_codes(torch.zeros(3, dtype=torch.uint8))


def test_e2m1_codes_of_grid_values_are_identity():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(_e2m1_codes(LUT[codes.long()]), codes)


def test_dequantize_layout_low_nibble_even_column():
    packed = torch.tensor([[0x72] + [0] * 15], dtype=torch.uint8)  # even col code 2 (1.0), odd col code 7 (6.0)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # X = 2
    deq = dequantize_mxfp4(packed, scale, torch.float32)
    assert deq[0, :2].tolist() == [2.0, 12.0] and deq[0, 2:].abs().sum() == 0


def test_decode_builds_every_value_from_its_bits():
    """decode_mxfp4 (no checks, graph-safe) gives code * 2^(e-127) bit for bit for every byte and every finite
    scale, the subnormal scale 0 and the overflow 6 * 2^127 included, in fp32 and bf16; 0xFF (refused at load)
    decodes to inf instead of NaN."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [256 scales, 512 columns]
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
    codes = unpack_fp4_codes(packed).long()
    want = (LUT.double()[codes].unflatten(-1, (16, 32)) * torch.pow(2.0, scale.double() - 127)[..., None]).flatten(-2)
    for dtype in (torch.float32, torch.bfloat16):
        got = decode_mxfp4(packed, scale, dtype)
        assert torch.equal(bits(got[:255]), bits(want[:255].to(dtype))), dtype
        assert torch.isinf(got[255][LUT[codes[255]] != 0]).all()
    assert torch.equal(bits(dequantize_mxfp4(packed[:255], scale[:255], torch.float32)), bits(decode_mxfp4(
        packed[:255], scale[:255])))


# ---------------------------------------------------------------- round trips and error bounds


def test_roundtrip_bit_exact_on_dequantised_values():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 40, 64), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 253, (3, 40, 4), dtype=torch.uint8, generator=g)  # <= 252: finite after dequant
    scale[0, 0] = 0
    scale[0, 1] = 252
    for dtype in (torch.float32, torch.bfloat16):
        w = dequantize_mxfp4(packed, scale, dtype)
        p2, s2 = quantize_mxfp4(w)
        again = dequantize_mxfp4(p2, s2, dtype)
        assert torch.equal(bits(again), bits(w)), dtype


def test_quantise_error_bound():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-6, 2, 64)[:, None]
    w[0, :32] = 0.0
    packed, scale = quantize_mxfp4(w)
    deq = dequantize_mxfp4(packed, scale, torch.float32)
    X = torch.exp2(scale.float() - 127).repeat_interleave(32, -1)
    # E2M1 keeps one mantissa bit: |err| <= |w| / 4 on the normal range, <= X / 4 below it; saturation at 6X
    # (|w| < 8X) also stays within |w| / 4
    err = (deq - w).abs()
    assert bool((err <= torch.maximum(w.abs(), X) / 4).all())
    rel = ((deq - w).norm() / w.norm()).item()
    assert rel < 0.14, rel  # Gaussian blocks: about 0.12 (one mantissa bit, block-shared exponent)
    amax = w.abs().unflatten(-1, (-1, 32)).amax(-1)
    nz = amax > 0
    assert bool((4 * torch.exp2(scale.float() - 127)[nz] <= amax[nz]).all())  # X = 2^(floor(log2 amax) - 2)
    assert bool((amax[nz] < 8 * torch.exp2(scale.float() - 127)[nz]).all())


def test_quantise_leading_dims_and_dtypes():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 3, 8, 64, generator=g)
    p, s = quantize_mxfp4(w)
    assert p.shape == (2, 3, 8, 32) and s.shape == (2, 3, 8, 2) and p.dtype == s.dtype == torch.uint8
    p16, s16 = quantize_mxfp4(w.bfloat16())
    pe, se = quantize_mxfp4(w.bfloat16().float())
    assert torch.equal(p16, pe) and torch.equal(s16, se)


# ---------------------------------------------------------------- validation


def test_nan_scale_refused_with_tensor_name():
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    scale = torch.full((4, 1), 127, dtype=torch.uint8)
    scale[2, 0] = 0xFF
    name = "model.layers.3.mlp.experts.17.w2.weight_scale"
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.experts\.17\.w2.*0xFF"):
        dequantize_mxfp4(packed, scale, name=name)
    with pytest.raises(ValueError, match="uint8"):
        check_mxfp4(packed.float(), scale, "w")
    with pytest.raises(ValueError, match="do not"):
        check_mxfp4(packed[:, :8], scale, "w")


# ---------------------------------------------------------------- compressed-tensors


def test_matches_compressed_tensors_pack_unpack():
    ct = pytest.importorskip(
        "compressed_tensors.compressors.nvfp4.helpers",
        reason="compressed-tensors is not installed (optional; `pip install compressed-tensors` next to torch)")
    mx = pytest.importorskip("compressed_tensors.compressors.mx_utils")
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=g)
    values = LUT[codes.long()]  # includes -0.0 (code 8)
    ours = pack_fp4_codes(_e2m1_codes(values))
    theirs = ct.pack_fp4_to_uint8(values)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, pack_fp4_codes(codes))
    unpacked = ct.unpack_fp4_from_uint8(ours, 16, 64, dtype=torch.float32)
    assert torch.equal(bits(unpacked), bits(values))
    # E8M0 scale encoding and decoding
    w = torch.randn(8, 128, generator=g) * 3
    _, scale = quantize_mxfp4(w)
    X = torch.exp2(scale.float() - 127)
    assert torch.equal(mx.compress_mx_scale(X, torch.uint8), scale)
    assert torch.equal(mx.decompress_mx_scale(scale).float(), X)
