"""MXFP8 (OCP Microscaling v1.0: E4M3 elements, one E8M0 scale per 32 values along K), the routed experts'
activation format when `config.moe_activation_format` is "mxfp8" (W4A8: MXFP4 weights, MXFP8 activations).

Per block of 32 values along the last dimension: X = 2^(floor(log2(amax)) - 8) (8 = the exponent of E4M3's
largest value, 448 = 1.75 * 2^8), the exponent clamped to E8M0's range [-127, 127]; an all-zero block gets the
smallest scale 2^-127 (byte 0x00). Elements are v / X rounded to the nearest E4M3 value, ties to even, saturating at
+-448 (v / X lies below 512, so only [448, 512) saturates); the sign is kept (negative zero included). NaN and
+-Inf are refused with an error naming the tensor: E4M3 (the `fn` variant) has no Inf, and a NaN activation is a
bug upstream that a quantiser must not hide.

What is quantised: the routed experts' input x and the GLU output rounded to x's dtype (the tensors the bf16 path
feeds the gate/up and the down GEMMs), each in blocks of 32 along the GEMM's K dimension.

This module is the emulation, and the reference of the W4A8 GPU kernels (`kimi3_kernels.mxfp4.w4a8`): their
quantiser produces the codes and scales of `quantize_mxfp8` bit for bit. The emulated expert GEMMs run on the
fake-quantised activations (`fake_quantize_mxfp8`, the dequantised values) and the exactly decoded MXFP4 weights in
fp32: every E2M1 weight is an E4M3 value and every E4M3 x E4M3 product is exact in fp32, so this is an FP8 x FP8
GEMM with fp32 accumulation; the kernels' outputs equal it up to the order (and, on the FP8 tensor cores, the
precision) of that accumulation. Training and fp32 activations run this emulation.

The values are built from their bits (powers of two as fp32 exponents, E4M3 codes through the fp32 subnormal
range), so they are exact on every device and need no float8 support; `quantize_mxfp8` returns its elements as
`torch.float8_e4m3fn` where PyTorch has that dtype, else as uint8 codes (sign, 4 exponent bits, 3 mantissa bits).
"""

import torch

GROUP_SIZE = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of the largest E4M3 value
E4M3_EMIN = -6  # exponent of the smallest normal E4M3 value; subnormals are multiples of 2^-9
E4M3_MANTISSA_BITS = 3
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # bytes 0x00 .. 0xFE; 0xFF is NaN
FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)
ACTIVATION_FORMATS = ("bf16", "mxfp8")  # config.moe_activation_format: "bf16" = the activations' own dtype


def check_activation_format(fmt):
    """`fmt` if it names a routed-expert activation format (`ACTIVATION_FORMATS`), else a ValueError."""
    if fmt not in ACTIVATION_FORMATS:
        raise ValueError(f"Kimi3 config: `moe_activation_format` = {fmt!r} must be one of {ACTIVATION_FORMATS} "
                         "(the format of the routed experts' GEMM inputs)")
    return fmt


def _pow2(e):
    """2^e as fp32 from its bits, int32 e in [-127, 127] (e = -127: the subnormal 2^-127)."""
    return torch.where(e == -127, 0x00400000, (e + 127) << 23).view(torch.float32)


def _check_finite(x, name):
    """NaN / Inf refused: a ValueError naming the tensor (an asynchronous assert while a CUDA graph is captured)."""
    bad = ~torch.isfinite(x)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        torch._assert_async(~bad.any(), f"{name}: non-finite values cannot be quantised to MXFP8")
        return
    if bool(bad.any()):
        nan = int(torch.isnan(x).sum())
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{name}: cannot quantise to MXFP8: {nan} NaN and {int(bad.sum()) - nan} infinite values "
                         f"(first at index {first})")


def _round_e4m3(v):
    """fp32 values already divided by the block scale -> the nearest E4M3 value (fp32), ties to even, saturating at
    +-448, sign kept. The quantum is 2^(floor(log2|v|) - 3), 2^-9 below the normal range; scaling by it and back is
    exact, and torch.round rounds half to even."""
    a = v.abs().clamp(max=E4M3_MAX)
    _, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    quantum = (e.to(torch.int32) - 1).clamp(min=E4M3_EMIN) - E4M3_MANTISSA_BITS
    return torch.copysign(torch.round(a * _pow2(-quantum)) * _pow2(quantum), v)


def _quantize(x, name):
    """x [..., K] -> (E4M3 values as fp32 [..., K/32, 32], block exponents int32 [..., K/32])."""
    if x.shape[-1] % GROUP_SIZE:
        raise ValueError(f"{name}: the last dimension ({x.shape[-1]}) must be a multiple of {GROUP_SIZE} for MXFP8")
    xf = x.detach().float()
    _check_finite(xf, name)
    blocks = xf.unflatten(-1, (-1, GROUP_SIZE))
    amax = blocks.abs().amax(-1)
    _, e = torch.frexp(amax)  # exact, also for fp32 subnormals
    exp = (e.to(torch.int32) - 1 - E4M3_EMAX).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    exp = torch.where(amax == 0, E8M0_MIN_EXP, exp)
    return _round_e4m3(blocks * _pow2(-exp)[..., None]), exp


def e4m3_codes(values):
    """fp32 E4M3 values -> uint8 codes: |v| * 2^-120 moves E4M3's exponent field onto fp32's low exponent bits (its
    subnormals onto fp32 subnormals), so the top 7 bits below the sign are the code; the sign goes to bit 7."""
    body = (values.abs() * 2.0 ** -120).view(torch.int32) >> 20
    return (body | (torch.signbit(values).to(torch.int32) << 7)).to(torch.uint8)


def e4m3_values(codes):
    """uint8 E4M3 codes -> fp32 values (the inverse of `e4m3_codes`); the NaN codes 0x7F / 0xFF give +-480, so
    callers check them (`dequantize_mxfp8`)."""
    c = codes.to(torch.int32)
    return (((c & 0x7F) << 20) | ((c & 0x80) << 24)).view(torch.float32) * 2.0 ** 120


def quantize_mxfp8(x, name="activation"):
    """OCP MX v1.0 MXFP8 (E4M3) of `x` [..., K] (K % 32 == 0, finite) -> (elements [..., K] as
    torch.float8_e4m3fn, or uint8 codes without that dtype; scales uint8 [..., K/32], E8M0 bytes e meaning
    2^(e-127)). The module docstring has the rules."""
    q, exp = _quantize(x, name)
    codes = e4m3_codes(q.flatten(-2))
    return (codes.view(FP8_E4M3) if FP8_E4M3 is not None else codes), (exp + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(elements, scales, dtype=torch.float32):
    """(elements [..., K] float8_e4m3fn or uint8 codes, scales uint8 [..., K/32]) -> [..., K] `dtype`; NaN
    encodings (E4M3 0x7F / 0xFF, E8M0 0xFF) are refused."""
    codes = elements.view(torch.uint8) if elements.dtype != torch.uint8 else elements
    if bool(((codes & 0x7F) == 0x7F).any()) or bool((scales == 0xFF).any()):
        raise ValueError("MXFP8 tensor holds NaN encodings (E4M3 0x7F / 0xFF or an E8M0 0xFF scale)")
    return mxfp8_values(codes, scales, dtype)


def mxfp8_values(elements, scales, dtype=torch.float32):
    """`dequantize_mxfp8` of codes known to hold no NaN encodings (a quantiser's own output): no check, so no host
    synchronisation (it runs inside recorded decode graphs). Each value is an E4M3 value times a power of two: exact
    in bf16 as in fp32 (both keep 8 exponent bits; E4M3 has 4 significant bits)."""
    codes = elements.view(torch.uint8) if elements.dtype != torch.uint8 else elements
    values = e4m3_values(codes).unflatten(-1, (-1, GROUP_SIZE))
    return (values * _pow2(scales.to(torch.int32) - E8M0_BIAS)[..., None]).flatten(-2).to(dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(fn, x):
    """fn(x) in the forward, the identity in the backward (the straight-through estimator): d fn(x) / dx := 1."""
    return _StraightThrough.apply(x, fn)


def _fake_quantize(x, name):
    q, exp = _quantize(x, name)
    return (q * _pow2(exp)[..., None]).flatten(-2).to(x.dtype)


def fake_quantize_mxfp8(x, name="activation"):
    """x -> the values of its MXFP8 quantisation, in x's dtype (for fp32 and bf16 inputs every such value is a
    number of that dtype); the gradient passes straight through (`straight_through`)."""
    return straight_through(lambda t: _fake_quantize(t, name), x)


__all__ = ["ACTIVATION_FORMATS", "check_activation_format", "quantize_mxfp8", "dequantize_mxfp8",
           "fake_quantize_mxfp8", "straight_through", "e4m3_codes", "e4m3_values"]
