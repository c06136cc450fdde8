"""Grouped GEMV over expert-sorted rows with MXFP4 weights: the decode-size counterpart of `mxfp4_gemm`.

For every row m, with expert e = `expert_ids[m]`, or (sorted rows) e such that
`expert_offsets[e] <= m < expert_offsets[e + 1]`:

    C[c_row(m)] = A[a_row(m)] @ W_e^T                    (b_packed=None)
    C[c_row(m)] = [A[a_row(m)] @ W_e^T | A[a_row(m)] @ B_e^T]   (gate and up in one launch)
    C[c_row(m)] = act(A[a_row(m)] @ W_e^T, A[a_row(m)] @ B_e^T)  (act="silu" | "situ": the GLU fused)

Each program owns one row and BN output columns and streams its expert's packed weights once, multiplying in fp32
on the CUDA cores: at decode an expert sees one or two rows, and a tensor-core tile of 16 rows would be mostly
padding. With `expert_ids` the rows need no sorting at all (the routes of a decode step, read straight from
topk_idx: a_row(m) = m // a_row_div). Weights are decoded as in `mxfp4_gemm` (inline-PTX bf16x2 lookups on CUDA,
fp32 bit arithmetic under the interpreter; the same bits). Activations are rounded to bf16 as in `mxfp4_gemm`;
products and sums are fp32. Even and odd columns are reduced separately against the even and odd activations, so a
byte's two nibbles never need interleaving.

Same semantics as `mxfp4_gemm.mxfp4_grouped_gemm` for its forward, non-transposed modes; the PyTorch reference is
`mxfp4_gemm_ref.mxfp4_grouped_gemm_ref`. Runs under TRITON_INTERPRET=1 on CPU tensors (CI).
"""

import torch

from .mxfp4_gemm import HAS_TRITON, available  # noqa: F401 - `available` is part of this module's interface

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4_gemm import ACTS, _dequant_split, _glu, decode_mode

    @triton.jit
    def _mxfp4_gemv_kernel(a_ptr, a_rows, w_ptr, ws_ptr, b_ptr, bs_ptr, c_ptr, c_rows, offs_ptr, eid_ptr,
                           E, N, K, stride_am, stride_we, stride_wr, stride_se, stride_sr, stride_cm, beta1, beta2,
                           BN: tl.constexpr, BK: tl.constexpr, E_POW2: tl.constexpr, DUAL: tl.constexpr,
                           GATHER_A: tl.constexpr, A_DIV: tl.constexpr, SCATTER_C: tl.constexpr,
                           ROW_EXPERT: tl.constexpr, ACT: tl.constexpr, LINEAR_UP: tl.constexpr, PTX: tl.constexpr):
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if ROW_EXPERT:
            e = tl.load(eid_ptr + m)
        else:
            # the row's expert: how many segment ends lie at or before it (no host-side expert ids)
            oe = tl.arange(0, E_POW2)
            ends = tl.load(offs_ptr + 1 + oe, mask=oe < E, other=2147483647)
            e = tl.sum((ends <= m).to(tl.int32), 0)
        if e < E:  # rows past the last segment (e.g. routes to another rank's experts) are not computed
            e64 = e.to(tl.int64)
            row = tl.load(a_rows + m).to(tl.int64) if GATHER_A else (m // A_DIV).to(tl.int64)
            offs_n = pid_n * BN + tl.arange(0, BN)
            n_mask = offs_n < N
            # products summed elementwise over the K steps and reduced across lanes once, after the loop
            acc = tl.zeros([BN, BK // 2], dtype=tl.float32)
            acc2 = tl.zeros([BN, BK // 2], dtype=tl.float32)
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
                lo, hi = _dequant_split(tl.load(w_ptr + w_off, mask=m2, other=0),
                                        tl.load(ws_ptr + s_off, mask=ms, other=127), BN, BK, PTX)
                acc += lo.to(tl.float32) * x_even + hi.to(tl.float32) * x_odd
                if DUAL:
                    lo, hi = _dequant_split(tl.load(b_ptr + w_off, mask=m2, other=0),
                                            tl.load(bs_ptr + s_off, mask=ms, other=127), BN, BK, PTX)
                    acc2 += lo.to(tl.float32) * x_even + hi.to(tl.float32) * x_odd
            acc = tl.sum(acc, 1)
            acc2 = tl.sum(acc2, 1)
            out = tl.load(c_rows + m).to(tl.int64) if SCATTER_C else m.to(tl.int64)
            c = c_ptr + out * stride_cm + offs_n
            if ACT == 0:
                tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=n_mask)
                if DUAL:
                    tl.store(c + N, acc2.to(c_ptr.dtype.element_ty), mask=n_mask)
            else:
                tl.store(c, _glu(acc, acc2, beta1, beta2, ACT, LINEAR_UP).to(c_ptr.dtype.element_ty), mask=n_mask)


def mxfp4_grouped_gemv(a, w_packed, w_scale, expert_offsets=None, *, expert_ids=None, a_rows=None, a_row_div=1,
                       c_rows=None, num_c_rows=None, b_packed=None, b_scale=None, act=None, act_params=(4.0, 25.0),
                       out_dtype=torch.float32, BN=64, BK=128, num_warps=4):
    """See the module docstring. a [T, K] (any float dtype), w_packed uint8 [E, N, K/2], w_scale uint8 [E, N, K/32];
    the rows' experts from expert_offsets int32 [E+1] (sorted rows) or expert_ids int32 [M] (any order; an id of E
    or more leaves its row unwritten); a_rows / c_rows int32 [M] map rows to rows of a / c (a_row_div: without
    a_rows, row m reads row m // a_row_div of a). act None | "silu" | "situ" needs b_packed (act_params = (beta1,
    beta2 or None = linear up)) and returns [num_c_rows, N], else [num_c_rows, 2N] with b_packed."""
    E, N, Kh = w_packed.shape
    K = 2 * Kh
    if a.shape[-1] != K or K % 32:
        raise ValueError(f"a has {a.shape[-1]} columns, the weights {K} (a multiple of 32 is required)")
    if (expert_offsets is None) == (expert_ids is None):
        raise ValueError("give the rows' experts as exactly one of expert_offsets or expert_ids")
    dual = b_packed is not None
    if act is not None and not dual:
        raise ValueError("a fused activation needs the second weight (b_packed, b_scale)")
    M = (a_rows.numel() if a_rows is not None else expert_ids.numel() if expert_ids is not None
         else a.shape[0] * a_row_div)
    c = torch.zeros(num_c_rows if num_c_rows is not None else M, 2 * N if dual and act is None else N,
                    dtype=out_dtype, device=a.device)
    if M == 0:
        return c
    a = a.contiguous()
    BK = min(BK, triton.next_power_of_2(K))
    beta1, beta2 = act_params if act == "situ" else (1.0, 1.0)
    dummy = expert_ids if expert_offsets is None else expert_offsets
    _mxfp4_gemv_kernel[(M, triton.cdiv(N, BN))](
        a, a_rows if a_rows is not None else a, w_packed, w_scale, b_packed if dual else w_packed,
        b_scale if dual else w_scale, c, c_rows if c_rows is not None else a, dummy, dummy, E, N, K,
        a.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1), c.stride(0),
        float(beta1), float(beta2 if beta2 is not None else 1.0),
        BN=BN, BK=BK, E_POW2=triton.next_power_of_2(E), DUAL=dual, GATHER_A=a_rows is not None, A_DIV=a_row_div,
        SCATTER_C=c_rows is not None, ROW_EXPERT=expert_ids is not None, ACT=ACTS[act],
        LINEAR_UP=(act == "situ" and beta2 is None), PTX=decode_mode(a.device) == "ptx", num_warps=num_warps)
    return c
