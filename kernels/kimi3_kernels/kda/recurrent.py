"""Fused recurrent KDA (Triton): decode of one or a few tokens per sequence.

One program per (sequence, head, value tile) keeps its [K, BV] slice of the fp32 state in
registers and walks the tokens: gate, beta sigmoid and L2 norm are computed in the kernel, so a
decode step is a single launch with no host synchronisation (CUDA-graph friendly). With
`inplace_final_state=True` the state is read from and written back to `initial_state`.
The PyTorch reference is `reference.naive_recurrent_kda`.
"""
from __future__ import annotations

import torch

from .. import _launch
from ._utils import TRITON_AVAILABLE, cdiv, next_pow2

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _fused_recurrent_kernel(q, k, v, f, beta, A_log, dt_bias, o, h0, ht, cu, T, scale, lower_bound,
                                H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                                BV: tl.constexpr, USE_LB: tl.constexpr, L2: tl.constexpr,
                                HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, VARLEN: tl.constexpr):
        # one grid axis, value tiles fastest (the axes after the first stop at 65,535 programs)
        i_v = tl.program_id(0) % tl.cdiv(V, BV)
        i_nh = tl.program_id(0) // tl.cdiv(V, BV)
        n = i_nh // H
        i_h = i_nh % H
        if VARLEN:
            bos = tl.load(cu + n).to(tl.int64)
            eos = tl.load(cu + n + 1).to(tl.int64)
        else:
            bos = n.to(tl.int64) * T
            eos = bos + T
        o_k = tl.arange(0, BK)
        mk = o_k < K
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        s_off = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
        m_s = mk[:, None] & mv[None, :]
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            S += tl.load(h0 + s_off, mask=m_s, other=0.)
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + o_k, mask=mk, other=0.).to(tl.float32)
        for t in range(bos, eos):
            offk = (t * H + i_h) * K + o_k
            bq = tl.load(q + offk, mask=mk, other=0.).to(tl.float32)
            bk = tl.load(k + offk, mask=mk, other=0.).to(tl.float32)
            x = tl.load(f + offk, mask=mk, other=0.).to(tl.float32) + bias
            bv = tl.load(v + (t * H + i_h) * V + o_v, mask=mv, other=0.).to(tl.float32)
            b = tl.sigmoid(tl.load(beta + t * H + i_h).to(tl.float32))
            if USE_LB:
                g = lower_bound * tl.sigmoid(a * x)
            else:
                g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            if L2:
                bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6)
                bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
            bq = bq * scale
            S = S * tl.exp(g)[:, None]
            vn = b * (bv - tl.sum(bk[:, None] * S, 0))
            S += bk[:, None] * vn[None, :]
            ob = tl.sum(bq[:, None] * S, 0)
            tl.store(o + (t * H + i_h) * V + o_v, ob.to(o.dtype.element_ty), mask=mv)
        if STORE_FINAL:
            tl.store(ht + s_off, S, mask=m_s)


def fused_recurrent_fwd(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state,
                        output_final_state, cu_seqlens, use_l2, inplace_final_state):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError("cu_seqlens requires B == 1")
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    o = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    if cu_seqlens is not None:
        o.zero_()  # tokens past cu_seqlens[-1] belong to no sequence
    if inplace_final_state:
        if initial_state is None:
            raise ValueError("inplace_final_state=True needs initial_state")
        ht = initial_state
    elif output_final_state:
        ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32)
    else:
        ht = None
    BK = next_pow2(K)
    BV = min(next_pow2(V), 16 if N * H < 256 else 32)
    if N > 0:
        _launch.launch(
            _fused_recurrent_kernel, (cdiv(V, BV) * N * H,),
            (q, k, v, g, beta, A_log, dt_bias, o, initial_state if initial_state is not None else o,
             ht if ht is not None else o, cu_seqlens if cu_seqlens is not None else o, T, scale,
             float(lower_bound) if lower_bound is not None else 0.0),
            H=H, K=K, V=V, BK=BK, BV=BV, USE_LB=lower_bound is not None, L2=use_l2,
            HAS_H0=initial_state is not None, STORE_FINAL=ht is not None, VARLEN=cu_seqlens is not None,
            num_warps=4 if BK * BV >= 4096 else 2, num_stages=1)
    return o, ht


def fused_recurrent_kda(q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                        inplace_final_state=False):
    """Recurrent KDA for decode (T = 1) and short speculative-verification runs.

    Same arguments as `chunk_kda`. With `inplace_final_state=True` the final state is written into
    `initial_state` (which is returned as the final state); nothing synchronises with the host and
    all shapes are static, so the call can be captured in a CUDA graph. With cu_seqlens, N is
    len(cu_seqlens) - 1 (read from the shape, not the values).
    Inference only: when autograd is recording and an input requires grad, the call is routed to
    `chunk_kda` (same math, differentiable).
    """
    from ._utils import require_triton
    from .chunk import _check
    require_triton()
    _check(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)):
        if inplace_final_state:
            raise ValueError("inplace_final_state=True is inference-only")
        from .chunk import chunk_kda
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if initial_state is not None and inplace_final_state:
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("inplace_final_state needs a contiguous fp32 initial_state")
    elif initial_state is not None:
        initial_state = initial_state.contiguous().float()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, ht = fused_recurrent_fwd(q, k, v, g, beta, A_log.contiguous(), dt_bias.contiguous(), lower_bound,
                                float(scale), initial_state, output_final_state, cu_seqlens,
                                bool(use_qk_l2norm_in_kernel), inplace_final_state)
    return o, (ht if (output_final_state or inplace_final_state) else None)
