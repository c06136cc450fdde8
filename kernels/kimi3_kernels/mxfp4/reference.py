"""PyTorch reference of `gemm.mxfp4_grouped_gemm`: the same signature and semantics, one expert decoded at a time,
in fp32 arithmetic on the operands as given (the kernels round activations to bf16). `config` (a tile) has no
effect here."""

import torch
import torch.nn.functional as F

from .decode import kperm_index, kperm_position

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_ref(packed, scale):
    """[..., R, C/2] uint8 + [..., R, C/32] uint8 -> fp32 [..., R, C] (low nibble = even column, 2^(s-127))."""
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


def _stored_order(a, bk, nib):
    """Columns given in a kernel's K order (`permute_k(a, bk, nib)`) back in stored order."""
    return a if not bk or a is None else a.index_select(-1, kperm_position(a.shape[-1], bk, a.device, nib).long())


def mxfp4_grouped_gemm_ref(a, w_packed, w_scale, expert_offsets, *, trans_w=False, a_rows=None, c_rows=None,
                           num_c_rows=None, a2=None, b_packed=None, b_scale=None, dual=None, act=None,
                           act_params=(4.0, 25.0), out_dtype=torch.float32, config=None, a_kperm=0, expert_ids=None,
                           a_row_div=1, a_nib=False, c_kperm=0, c_nib=False):
    a, a2 = _stored_order(a, a_kperm, a_nib), _stored_order(a2, a_kperm, a_nib)
    E = w_packed.shape[0]
    N = 2 * w_packed.shape[2] if trans_w else w_packed.shape[1]
    M = (a_rows.numel() if a_rows is not None else expert_ids.numel() if expert_ids is not None
         else a.shape[0] * a_row_div)
    ncols = 2 * N if (dual == "out" and act is None) else N
    c = torch.zeros(num_c_rows if num_c_rows is not None else M, ncols, dtype=out_dtype, device=a.device)
    if expert_ids is not None:  # rows in any order: each row its own segment
        row_e = expert_ids.long().tolist()
        segments = [(e, [m]) for m, e in enumerate(row_e) if e < E]
    else:
        offs = expert_offsets.tolist()
        segments = [(e, list(range(offs[e], offs[e + 1]))) for e in range(E) if offs[e + 1] > offs[e]]

    def weight(p, s, e):
        w = dequant_ref(p[e], s[e])
        return w if trans_w else w.T  # as the right operand [K, N]

    for e, ms in segments:
        idx = torch.tensor(ms, device=a.device)
        rows = a_rows[idx].long() if a_rows is not None else idx // a_row_div
        y = a[rows].float() @ weight(w_packed, w_scale, e)
        if dual == "in":
            y = y + a2[rows].float() @ weight(b_packed, b_scale, e)
        elif dual == "out":
            y2 = a[rows].float() @ weight(b_packed, b_scale, e)
            y = torch.cat([y, y2], -1) if act is None else _act(y, y2, act, act_params)
        dest = c_rows[idx].long() if c_rows is not None else idx
        c[dest] = y.to(out_dtype)
    if c_kperm:
        c = c.index_select(-1, kperm_index(c.shape[-1], c_kperm, c.device, c_nib))
    return c
