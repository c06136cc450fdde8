"""PyTorch reference of `mxfp4_gemm.mxfp4_grouped_gemm`: same signature and semantics, one expert dequantised at a
time (fp32 arithmetic on the operands as given; the Triton kernel rounds activations to bf16)."""

import torch
import torch.nn.functional as F

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_ref(packed, scale):
    """[R, C/2] uint8 + [R, C/32] uint8 -> fp32 [R, C] (low nibble = even column, 2^(s-127))."""
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).long()
    v = lut[codes].unflatten(-1, (scale.shape[-1], 32))
    return (v * torch.exp2(scale.float() - 127)[..., None]).flatten(-2)


def _act(g, u, act, act_params):
    if act == "silu":
        return F.silu(g) * u
    b1, b2 = act_params
    if b2 is not None:
        u = b2 * torch.tanh(u / b2)
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * u


def mxfp4_grouped_gemm_ref(a, w_packed, w_scale, expert_offsets, *, trans_w=False, a_rows=None, c_rows=None,
                           num_c_rows=None, a2=None, b_packed=None, b_scale=None, dual=None, act=None,
                           act_params=(4.0, 25.0), out_dtype=torch.float32, config=None):
    E = w_packed.shape[0]
    N = 2 * w_packed.shape[2] if trans_w else w_packed.shape[1]
    M = a_rows.numel() if a_rows is not None else a.shape[0]
    ncols = 2 * N if (dual == "out" and act is None) else N
    c = torch.zeros(num_c_rows if num_c_rows is not None else M, ncols, dtype=out_dtype, device=a.device)
    offs = expert_offsets.tolist()

    def weight(p, s, e):
        w = dequant_ref(p[e], s[e])
        return w if trans_w else w.T  # as the right operand [K, N]

    for e in range(E):
        lo, hi = offs[e], offs[e + 1]
        if hi == lo:
            continue
        idx = torch.arange(lo, hi, device=a.device)
        rows = a_rows[lo:hi].long() if a_rows is not None else idx
        y = a[rows].float() @ weight(w_packed, w_scale, e)
        if dual == "in":
            y = y + a2[rows].float() @ weight(b_packed, b_scale, e)
        elif dual == "out":
            y2 = a[rows].float() @ weight(b_packed, b_scale, e)
            y = torch.cat([y, y2], -1) if act is None else _act(y, y2, act, act_params)
        dest = c_rows[lo:hi].long() if c_rows is not None else idx
        c[dest] = y.to(out_dtype)
    return c
