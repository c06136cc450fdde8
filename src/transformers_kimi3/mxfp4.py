"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 scale per 32 values) as compressed-tensors packs it.

Layout of one weight [out, in]: `weight_packed` uint8 [out, in/2] holding two E2M1 codes per byte, the LOW
nibble being the even column (compressed-tensors `pack_fp4_to_uint8`), and `weight_scale` uint8 [out, in/32]
holding the E8M0 exponent e (value 2^(e-127); 0xFF is NaN).
"""

import torch

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_mxfp4(packed, scale, name="weight"):
    """Shape/dtype/NaN checks that turn a corrupt tensor into a clear error naming it."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 tensors must be uint8, got weight_packed {packed.dtype} and "
                         f"weight_scale {scale.dtype}")
    if packed.dim() < 2 or scale.shape[:-1] != packed.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * GROUP_SIZE:
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} do not "
                         f"describe one [out, in] matrix (expected in/2 packed bytes and in/{GROUP_SIZE} scales)")
    if bool((scale == 0xFF).any()):
        raise ValueError(f"{name}: weight_scale holds 0xFF (the E8M0 NaN encoding)")


def dequantize_mxfp4(packed, scale, dtype=torch.bfloat16, name="weight"):
    """[..., out, in/2] uint8 + [..., out, in/32] uint8 -> [..., out, in] `dtype`, exact (every MXFP4 value is
    representable in bf16 and fp32)."""
    check_mxfp4(packed, scale, name)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()  # low nibble = even column
    values = lut[codes]
    exp = scale.to(torch.int32) - 127
    values = values.unflatten(-1, (scale.shape[-1], GROUP_SIZE)) * torch.exp2(exp.float())[..., None]
    return values.flatten(-2).to(dtype)
