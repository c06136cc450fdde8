"""Grouped GEMV over expert-sorted rows with MXFP4 weights: the decode-size counterpart of `mxfp4_gemm`.

For every sorted row m, with expert e such that `expert_offsets[e] <= m < expert_offsets[e + 1]`:

    C[c_row(m)] = A[a_row(m)] @ W_e^T                    (b_packed=None)
    C[c_row(m)] = [A[a_row(m)] @ W_e^T | A[a_row(m)] @ B_e^T]   (gate and up in one launch)

Each program owns one row and BN output columns and streams its expert's packed weights once, multiplying in fp32
on the CUDA cores: at decode an expert sees one or two rows, and a tensor-core tile of 16 rows would be mostly
padding. Activations are rounded to bf16 as in `mxfp4_gemm`; products and sums are fp32. Even and odd columns are
reduced separately against the even and odd activations, so a byte's two nibbles never need interleaving.

Same semantics as `mxfp4_gemm.mxfp4_grouped_gemm` for its forward, non-transposed, no-activation modes; the PyTorch
reference is `mxfp4_gemm_ref.mxfp4_grouped_gemm_ref`. Runs under TRITON_INTERPRET=1 on CPU tensors (CI).
"""

import torch

from .mxfp4_gemm import HAS_TRITON, available  # noqa: F401 - `available` is part of this module's interface

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4_gemm import _e2m1_to_f32, _e8m0_to_f32

    @triton.jit
    def _dequant_halves(p, s, BN: tl.constexpr, BK: tl.constexpr):
        """p uint8 [BN, BK/2], s uint8 [BN, BK/32] -> (even columns, odd columns) fp32 [BN, BK/2]."""
        sf = _e8m0_to_f32(s)
        sf = tl.reshape(tl.broadcast_to(sf[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
        pi = p.to(tl.int32)
        return _e2m1_to_f32(pi & 15) * sf, _e2m1_to_f32(pi >> 4) * sf

    @triton.jit
    def _mxfp4_gemv_kernel(a_ptr, a_rows, w_ptr, ws_ptr, b_ptr, bs_ptr, c_ptr, c_rows, offs_ptr,
                           E, N, K, stride_am, stride_we, stride_wr, stride_se, stride_sr, stride_cm,
                           BN: tl.constexpr, BK: tl.constexpr, E_POW2: tl.constexpr, DUAL: tl.constexpr,
                           GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr):
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        # the row's expert: how many segment ends lie at or before it (no host-side expert ids)
        oe = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + 1 + oe, mask=oe < E, other=2147483647)
        e = tl.sum((ends <= m).to(tl.int32), 0)
        if e < E:  # rows past the last segment (e.g. routes to another rank's experts) are not computed
            e64 = e.to(tl.int64)
            row = tl.load(a_rows + m).to(tl.int64) if GATHER_A else m.to(tl.int64)
            offs_n = pid_n * BN + tl.arange(0, BN)
            n_mask = offs_n < N
            acc = tl.zeros([BN], dtype=tl.float32)
            acc2 = tl.zeros([BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                half = k0 // 2 + tl.arange(0, BK // 2)
                h_mask = half < K // 2
                x_even = tl.load(a_ptr + row * stride_am + 2 * half, mask=h_mask, other=0.)
                x_odd = tl.load(a_ptr + row * stride_am + 2 * half + 1, mask=h_mask, other=0.)
                x_even = x_even.to(tl.bfloat16).to(tl.float32)[None, :]
                x_odd = x_odd.to(tl.bfloat16).to(tl.float32)[None, :]
                sc = k0 // 32 + tl.arange(0, BK // 32)
                w_off = e64 * stride_we + offs_n[:, None] * stride_wr + half[None, :]
                s_off = e64 * stride_se + offs_n[:, None] * stride_sr + sc[None, :]
                m2 = n_mask[:, None] & h_mask[None, :]
                ms = n_mask[:, None] & (sc[None, :] < K // 32)
                lo, hi = _dequant_halves(tl.load(w_ptr + w_off, mask=m2, other=0),
                                         tl.load(ws_ptr + s_off, mask=ms, other=127), BN, BK)
                acc += tl.sum(lo * x_even + hi * x_odd, 1)
                if DUAL:
                    lo, hi = _dequant_halves(tl.load(b_ptr + w_off, mask=m2, other=0),
                                             tl.load(bs_ptr + s_off, mask=ms, other=127), BN, BK)
                    acc2 += tl.sum(lo * x_even + hi * x_odd, 1)
            out = tl.load(c_rows + m).to(tl.int64) if SCATTER_C else m.to(tl.int64)
            c = c_ptr + out * stride_cm + offs_n
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=n_mask)
            if DUAL:
                tl.store(c + N, acc2.to(c_ptr.dtype.element_ty), mask=n_mask)


def mxfp4_grouped_gemv(a, w_packed, w_scale, expert_offsets, *, a_rows=None, c_rows=None, num_c_rows=None,
                       b_packed=None, b_scale=None, out_dtype=torch.float32, BN=64, BK=128, num_warps=4):
    """See the module docstring. a [T, K] (any float dtype), w_packed uint8 [E, N, K/2], w_scale uint8 [E, N, K/32],
    expert_offsets int32 [E+1] over the M sorted rows; a_rows / c_rows int32 [M] map sorted rows to rows of a / c."""
    E, N, Kh = w_packed.shape
    K = 2 * Kh
    if a.shape[-1] != K or K % 32:
        raise ValueError(f"a has {a.shape[-1]} columns, the weights {K} (a multiple of 32 is required)")
    M = a_rows.numel() if a_rows is not None else a.shape[0]
    dual = b_packed is not None
    c = torch.zeros(num_c_rows if num_c_rows is not None else M, 2 * N if dual else N, dtype=out_dtype,
                    device=a.device)
    if M == 0:
        return c
    a = a.contiguous()
    BK = min(BK, triton.next_power_of_2(K))
    _mxfp4_gemv_kernel[(M, triton.cdiv(N, BN))](
        a, a_rows if a_rows is not None else a, w_packed, w_scale, b_packed if dual else w_packed,
        b_scale if dual else w_scale, c, c_rows if c_rows is not None else a, expert_offsets, E, N, K,
        a.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1), c.stride(0),
        BN=BN, BK=BK, E_POW2=triton.next_power_of_2(E), DUAL=dual, GATHER_A=a_rows is not None,
        SCATTER_C=c_rows is not None, num_warps=num_warps)
    return c
