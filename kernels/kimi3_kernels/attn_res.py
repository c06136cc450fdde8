"""Block Attention Residuals' mix in one launch (inference).

For every token, the n + 1 sources (n completed block summaries and the current partial sum) are scored by
RMSNorm(v) . (norm_weight * proj_weight), softmaxed over the sources and mixed raw, all in fp32:

    score_s = rsqrt(mean(v_s^2) + eps) * sum_d v_s[d] * norm_w[d] * proj_w[d]
    out     = sum_s softmax(score)_s * v_s                     (rounded to the bank's dtype)

`transformers_kimi3.attn_res.attn_res_mix` is the PyTorch path (and the reference): a concatenation, an fp32 copy
of every source, a norm, a projection, a softmax, a product and a sum, ~12 launches and several fp32 copies of
[B, T, n + 1, d] per aggregation point, two aggregation points per layer. Runs under TRITON_INTERPRET=1 (CI).
"""
import torch

from . import _launch
from ._host import next_pow2

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # noqa: BLE001 - optional
    HAS_TRITON = False

if HAS_TRITON:
    @triton.jit
    def _sources(bank, partial, row, n, s, d, md, D, HAS_PARTIAL: tl.constexpr):
        """[NP, BD] fp32: the completed blocks in rows s < n, the partial sum in row n, zeros below."""
        v = tl.load(bank + (row * n + s[:, None]) * D + d[None, :], mask=(s < n)[:, None] & md[None, :],
                    other=0.).to(tl.float32)
        if HAS_PARTIAL:
            v += tl.load(partial + row * D + d[None, :] + s[:, None] * 0, mask=(s == n)[:, None] & md[None, :],
                         other=0.).to(tl.float32)
        return v

    @triton.jit
    def _attn_res_mix_kernel(bank, partial, nw, pw, y, n, D, eps, HAS_PARTIAL: tl.constexpr, NP: tl.constexpr,
                             BD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, NP)
        valid = (s < n) | (HAS_PARTIAL & (s == n))
        ss = tl.zeros([NP], dtype=tl.float32)
        dot = tl.zeros([NP], dtype=tl.float32)
        for d0 in range(0, D, BD):  # pass 1: both sums the scores need
            d = d0 + tl.arange(0, BD)
            md = d < D
            v = _sources(bank, partial, row, n, s, d, md, D, HAS_PARTIAL)
            q = tl.load(nw + d, mask=md, other=0.).to(tl.float32) * tl.load(pw + d, mask=md, other=0.).to(tl.float32)
            ss += tl.sum(v * v, 1)
            dot += tl.sum(v * q[None, :], 1)
        score = tl.where(valid, dot / tl.sqrt(ss / D + eps), float("-inf"))
        p = tl.exp(score - tl.max(score, 0))
        p = p / tl.sum(p, 0)
        for d0 in range(0, D, BD):  # pass 2: the mix
            d = d0 + tl.arange(0, BD)
            md = d < D
            v = _sources(bank, partial, row, n, s, d, md, D, HAS_PARTIAL)
            tl.store(y + row * D + d, tl.sum(p[:, None] * v, 0).to(y.dtype.element_ty), mask=md)


def attn_res_mix(bank, partial, norm_weight, proj_weight, eps, BD=1024, num_warps=4):
    """bank [B, T, n, d] (n >= 1 completed blocks); partial [B, T, d] or None; norm_weight [d]; proj_weight [1, d]
    or [d]. Returns [B, T, d] in bank's dtype. No autograd. BD / num_warps: the fastest of four settings measured at K3
    shapes (about 10x the PyTorch path at 2048 tokens x 5 sources x 7168, near the memory bandwidth)."""
    B, T, n, D = bank.shape
    if n < 1 or norm_weight.numel() != D or proj_weight.numel() != D or (
            partial is not None and partial.shape != (B, T, D)):
        raise ValueError(f"attn_res_mix: bank {tuple(bank.shape)}, partial "
                         f"{None if partial is None else tuple(partial.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}, proj weight {tuple(proj_weight.shape)}")
    bank = bank.contiguous()
    part = partial.to(bank.dtype).contiguous() if partial is not None else bank  # mixed in the bank's dtype
    y = torch.empty(B, T, D, device=bank.device, dtype=bank.dtype)
    if B * T:
        _launch.launch(_attn_res_mix_kernel, (B * T,),
                       (bank, part, norm_weight.contiguous(), proj_weight.reshape(-1).contiguous(), y, n, D,
                        float(eps)), HAS_PARTIAL=partial is not None, NP=next_pow2(n + 1), BD=BD, num_warps=num_warps)
    return y
