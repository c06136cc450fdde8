"""Public chunked KDA entry point (autograd Function over the Triton kernels)."""
from __future__ import annotations

import torch

from ._utils import CHUNK_SIZE, SeqInfo, interpreter_enabled, require_triton


def _flat(x):
    B, T = x.shape[:2]
    return x.reshape(B * T, *x.shape[2:])


def _check(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share [B,T,H,K]: {tuple(q.shape)} {tuple(k.shape)} {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v must be [B,T,H,V] and beta [B,T,H]: {tuple(v.shape)} {tuple(beta.shape)}")
    if A_log is None or dt_bias is None:
        raise ValueError("A_log [H] and dt_bias [H*K] are required (the gate is computed in the kernel)")
    if A_log.numel() < H or dt_bias.numel() != H * K:
        raise ValueError(f"A_log needs >= {H} entries and dt_bias {H * K}: {A_log.numel()} {dt_bias.numel()}")
    if K > 256 or V > 256:
        raise ValueError("head dims up to 256 are supported")
    if cu_seqlens is not None and B != 1:
        raise ValueError("cu_seqlens requires B == 1 (sequences packed along T)")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be [N={N}, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}")


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, lower_bound, output_final_state,
                cu_seqlens, use_l2, return_chunk_states):
        from .chunk_fwd import intra_fwd, state_fwd, sub16_fwd
        from .gate import prep_fwd
        B, T, H, K = q.shape
        V = v.shape[-1]
        info = SeqInfo.get(B, T, cu_seqlens, q.device)
        qf, kf, vf, gf, bf = (_flat(x).contiguous() for x in (q, k, v, g, beta))
        A_log_c = A_log.contiguous()
        dt_c = dt_bias.contiguous()
        h0 = initial_state.contiguous().float() if initial_state is not None else None
        # intermediates (normalised q/k, W, U, ...) are kept in the input dtype; the Triton CPU interpreter
        # cannot multiply bf16 matrices, so it keeps them in fp32
        inter = torch.float32 if (interpreter_enabled() or q.dtype == torch.float32) else q.dtype
        # With autograd the forward keeps what the backward needs (per-chunk M, P, W, U, ..., the chunk states and
        # v_new) instead of recomputing it: ~(2 * 64 * 4 + 8 K) bytes per token and head buy a faster backward.
        # The chunk states are kept in the matmul dtype, as the output kernel reads them (fp32 when asked for).
        grad = any(ctx.needs_input_grad)
        save = grad
        o = torch.zeros(B * T, H, V, device=q.device, dtype=q.dtype) if info.tokens < B * T else None
        if not grad:  # inference: 16-token sub-chunks straight from the raw inputs, no preparation kernels
            o, ht, hs = sub16_fwd(qf, kf, vf, gf, bf, A_log_c, dt_c, scale, lower_bound, use_l2, info, h0, inter,
                                  q.dtype, output_final_state, torch.float32 if return_chunk_states else None, o=o)
            qn = kn = gc = bs = rq = rk = None
        else:
            qn, kn, gc, bs, rq, rk = prep_fwd(qf, kf, gf, bf, A_log_c, dt_c, lower_bound, use_l2, info, inter)
            states = torch.float32 if return_chunk_states else (qn.dtype if save else None)
            I = intra_fwd(qn, kn, vf, gc, bs, scale, lower_bound, info, store_bwd=save)
            o, ht, hs, vn = state_fwd(I, gc, h0, info, V, q.dtype, output_final_state, states, save, True, o=o)
        ctx.saved_fwd = (I, hs, vn) if save else None
        hs = hs if return_chunk_states else None
        ctx.save_for_backward(qf, kf, vf, gf, bf, A_log_c, dt_c, h0, qn, kn, gc, bs, rq, rk)
        ctx.info = info
        ctx.meta = (B, T, H, K, V, scale, lower_bound, use_l2, initial_state is not None)
        ctx.mark_non_differentiable(*([hs] if hs is not None else []))
        o = o.view(B, T, H, V)
        if return_chunk_states:
            return o, ht, hs
        return o, ht

    @staticmethod
    def backward(ctx, do, dht, *unused):
        from .chunk_bwd import chunk_bwd_core
        from .gate import prep_bwd
        qf, kf, vf, gf, bf, A_log, dt_bias, h0, qn, kn, gc, bs, rq, rk = ctx.saved_tensors
        B, T, H, K, V, scale, lower_bound, use_l2, has_h0 = ctx.meta
        info = ctx.info
        do = _flat(do).contiguous()
        dht = dht.contiguous().float() if dht is not None else None
        dqn, dkn, dv, dG, db, dh0 = chunk_bwd_core(qn, kn, vf, gc, bs, scale, lower_bound, h0, do, dht, info,
                                                   saved=ctx.saved_fwd)
        ctx.saved_fwd = None
        dq, dk, df, dbeta, dA, ddt = prep_bwd(qf, kf, gf, A_log, dt_bias, bs, rq, rk, dG, dqn, dkn, db,
                                              lower_bound, use_l2, info, bf.dtype)
        if info.tokens < B * T:  # tokens after the last packed sequence get no gradient
            for x in (dq, dk, df, dbeta, dv):
                x[info.tokens:] = 0
        dA_full = torch.zeros_like(A_log, dtype=torch.float32)
        dA_full[:H] = dA
        return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, H, V), df.view(B, T, H, K),
                dbeta.view(B, T, H), dA_full.to(A_log.dtype), ddt.to(dt_bias.dtype),
                dh0 if has_h0 else None, None, None, None, None, None, None)


def chunk_kda(q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, scale=None, initial_state=None,
              output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True, return_chunk_states=False):
    """Chunked Kimi Delta Attention (prefill / training), Triton kernels with autograd.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (bf16, fp16 or fp32).
        g: the RAW forget-gate pre-activation [B, T, H, K] (f_b_proj(f_a_proj(x)), dt_bias not added).
        beta: RAW logits [B, T, H] (sigmoid applied in the kernel).
        A_log: [H] fp32 (per head; a longer zero-padded vector is read at [:H]); dt_bias: [H*K] fp32.
        lower_bound: K3 gate g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) when given (e.g. -5.0);
            otherwise the Kimi Linear gate g = -exp(A_log) * softplus(f + dt_bias).
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, H, K, V] fp32 (K first; see `state_vk_to_kv` for the official [V, K] layout).
        output_final_state: also return the final state [N, H, K, V] fp32.
        cu_seqlens: int32/int64 [N+1] offsets of N sequences packed along T (B must be 1).
        use_qk_l2norm_in_kernel: x / sqrt(sum(x^2) + 1e-6) on q and k, in fp32.
        return_chunk_states: also return the states at every 64-token chunk boundary,
            fp32 [NC, H, K, V] with NC = sum_n ceil(L_n / 64); row `chunk_off[n] + c` holds sequence n's
            state after its first 64*c tokens (c = 0 is the initial state). For a fixed-length batch it
            reshapes to [B, ceil(T/64), H, K, V]. Not differentiable.
    Returns:
        (o [B, T, H, V] in q's dtype, final_state or None) and, with return_chunk_states, chunk_states.
    """
    require_triton()
    _check(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    lb = float(lower_bound) if lower_bound is not None else None
    out = ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, float(scale), lb,
                                 bool(output_final_state), cu_seqlens, bool(use_qk_l2norm_in_kernel),
                                 bool(return_chunk_states))
    return out


__all__ = ["chunk_kda", "ChunkKDAFunction", "CHUNK_SIZE"]
