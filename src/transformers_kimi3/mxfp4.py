"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 scale per 32 values) as compressed-tensors packs it: the format.

Layout of one weight [out, in]: `weight_packed` uint8 [out, in/2] holding two E2M1 codes per byte, the LOW
nibble being the even column (compressed-tensors `pack_fp4_to_uint8`), and `weight_scale` uint8 [out, in/32]
holding the E8M0 exponent e (value 2^(e-127); 0xFF is NaN).

- `check_mxfp4`, `dequantize_mxfp4`: validation and exact dequantisation (used by the loader); `decode_mxfp4`: the
  same values without the checks (no host synchronisation, for tensors checked at load).
- `quantize_mxfp4`, `pack_fp4_codes`, `unpack_fp4_codes`: the OCP MX v1.0 quantiser and the packing.
The routed experts kept in this format are `mxfp4_experts.PackedMXFP4Experts`.
"""

import torch

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_EMAX = 2  # exponent of the largest E2M1 value (6 = 1.5 * 2^2)
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # 0x00 .. 0xFE; 0xFF is NaN
ZERO_BLOCK_SCALE = 0  # E8M0 byte written for an all-zero block: the smallest scale, 2^-127


def check_mxfp4(packed, scale, name="weight"):
    """Shape/dtype/NaN checks that turn a corrupt tensor into a clear error naming it."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 tensors must be uint8, got weight_packed {packed.dtype} and "
                         f"weight_scale {scale.dtype}")
    if (packed.dim() < 2 or scale.shape[:-1] != packed.shape[:-1]
            or packed.shape[-1] * 2 != scale.shape[-1] * GROUP_SIZE):
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} do not "
                         f"describe one [out, in] matrix (expected in/2 packed bytes and in/{GROUP_SIZE} scales)")
    if bool((scale == 0xFF).any()):
        raise ValueError(f"{name}: weight_scale holds 0xFF (the E8M0 NaN encoding)")


def unpack_fp4_codes(packed):
    """uint8 [..., n/2] -> uint8 codes [..., n] (0..15, sign in bit 3); the low nibble is the even element."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_fp4_codes(codes):
    """uint8 codes [..., n] (n even, each 0..15) -> uint8 [..., n/2] as `idx0 | idx1 << 4` (compressed-tensors)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of FP4 codes per row")
    codes = codes.to(torch.uint8)
    if bool((codes > 15).any()):
        raise ValueError("FP4 codes must lie in 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_mxfp4(packed, scale, dtype=torch.bfloat16, name="weight"):
    """[..., out, in/2] uint8 + [..., out, in/32] uint8 -> [..., out, in] `dtype`, exact (every MXFP4 value is
    representable in bf16 and fp32), after `check_mxfp4`."""
    check_mxfp4(packed, scale, name)
    return decode_mxfp4(packed, scale, dtype)


def decode_mxfp4(packed, scale, dtype=torch.float32):
    """`dequantize_mxfp4` without the checks: elementwise ops only, so it runs inside a CUDA graph capture. The
    values are built from their bits, exact on every device: an E2M1 code sEEM as fp32 bits with EE and M placed low
    (EE == 0 lands on the subnormal M 2^-127) times 2^126, and 2^(e-127) as the fp32 exponent e (e == 0: the
    subnormal 2^-127); their product has at most two significant bits, so it is exact (6 * 2^127 overflows to inf).
    A 0xFF scale (NaN) gives 2^128 = inf instead: callers check at load."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).to(torch.int32)
    values = (((codes & 7) << 22) | ((codes & 8) << 28)).view(torch.float32) * 2.0 ** 126
    e = scale.to(torch.int32)
    scales = torch.where(e == 0, 0x00400000, e << 23).view(torch.float32)
    values = values.unflatten(-1, (scale.shape[-1], GROUP_SIZE)) * scales[..., None]
    return values.flatten(-2).to(dtype)


def _e2m1_codes(v):
    """fp32 values already divided by the block scale -> E2M1 codes: round to nearest, ties to even (the code
    whose mantissa bit is 0), saturating at 6; the sign goes to bit 3 (so -0.0 and negatives that round to zero
    give code 8, negative zero)."""
    a = v.abs()
    # thresholds are the midpoints between neighbours; '>' where the lower neighbour is even, '>=' where the upper is
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
            + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
            + (a > 5.0).to(torch.uint8))
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def quantize_mxfp4(w, name="weight"):
    """OCP MX v1.0 MXFP4 quantisation of `w` [..., out, in] (in % 32 == 0, finite) ->
    (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]).

    Per block of 32 values along `in`: X = 2^(floor(log2(amax)) - 2) with the exponent clamped to E8M0's range
    [-127, 127]; an all-zero block gets the smallest scale 2^-127 (byte 0x00). Elements are v / X rounded to the
    nearest E2M1 value, ties to even, saturating at +-6; the sign of v is kept (negative zero included). The input is
    first rounded to fp32. floor(log2) comes from frexp, so it is exact (also for fp32 subnormals).
    """
    if w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"{name}: the last dimension ({w.shape[-1]}) must be a multiple of {GROUP_SIZE}")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError(f"{name}: cannot quantise non-finite values to MXFP4")
    blocks = wf.unflatten(-1, (-1, GROUP_SIZE))
    amax = blocks.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2 amax) = e - 1
    exp = (e.to(torch.int32) - 1 - E2M1_EMAX).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    exp = torch.where(amax == 0, torch.full_like(exp, ZERO_BLOCK_SCALE - E8M0_BIAS), exp)
    scaled = torch.ldexp(blocks, (-exp).to(torch.float32)[..., None])  # exact: multiplies by a power of two
    codes = _e2m1_codes(scaled).flatten(-2)
    return pack_fp4_codes(codes), (exp + E8M0_BIAS).to(torch.uint8)


def weight_memory_bytes(num_experts, hidden_size, intermediate_size, dtype=None):
    """Bytes of one layer's routed expert weights: packed MXFP4 (dtype=None) or dense `dtype`."""
    n = 3 * num_experts * hidden_size * intermediate_size
    if dtype is None:
        return n // 2 + n // GROUP_SIZE
    return n * torch.tensor([], dtype=dtype).element_size()


__all__ = [
    "GROUP_SIZE", "E2M1_VALUES", "check_mxfp4", "dequantize_mxfp4", "decode_mxfp4", "quantize_mxfp4",
    "pack_fp4_codes", "unpack_fp4_codes", "weight_memory_bytes",
]
