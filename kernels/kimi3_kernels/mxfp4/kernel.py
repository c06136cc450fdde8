"""The Triton kernels of the MXFP4 grouped GEMM (`gemm.py` plans and launches them).

`_mxfp4_grouped_gemm_kernel` computes the transposed tile C^T = W A^T so that the decoded weight tile is the left
MMA operand (kept in registers on Hopper) and the token dimension can be as small as 16 (decode). Tiles map to
(expert, m-block) without a host synchronisation: a per-expert block count prefix sum (`_block_prefix_kernel`) is
searched inside the kernel. Programs of one m-block and all n-tiles are adjacent in launch order, so an expert's
weights are read from HBM about once per wave and activations are reused from L2. Operands are bf16 (A is rounded
to bf16 in registers), accumulation is fp32.

Forward tiles may take K in a permuted order inside each tile (PERM, `decode._perm_k`): the weight bytes one thread
of the MMA operand needs are then contiguous, and the activations are gathered in the same order (`_k_order`), or,
with A_KPERM, were stored in that order beforehand (`decode.permute_k`) and load contiguously. The sum over K does
not change, only its rounding order.
"""

from .decode import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .decode import _dequant

    @triton.jit
    def _k_order(BK: tl.constexpr):
        """Stored k (relative to the tile start) of MMA K index kappa under _perm_k: kappa = 2 L + e."""
        kap = tl.arange(0, BK)
        L = kap // 2
        return 2 * ((BK // 8) * (L % 4) + 2 * (L // 8) + (L // 4) % 2) + kap % 2

    @triton.jit
    def _dequant_kernel(p_ptr, s_ptr, out_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr, PTX: tl.constexpr):
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        mr = (r < R)[:, None]
        cb = tl.program_id(1) * (BC // 2) + tl.arange(0, BC // 2)
        cs = tl.program_id(1) * (BC // 32) + tl.arange(0, BC // 32)
        p = tl.load(p_ptr + r[:, None] * (C // 2) + cb[None, :], mask=mr & (cb < C // 2)[None, :], other=0)
        s = tl.load(s_ptr + r[:, None] * (C // 32) + cs[None, :], mask=mr & (cs < C // 32)[None, :], other=127)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        tl.store(out_ptr + r[:, None] * C + c[None, :], _dequant(p, s, BR, BC, PTX), mask=mr & (c < C)[None, :])

    @triton.jit
    def _load_s(s_ptr, e64, offs_n, n_mask, k0, N, K, stride_se, stride_sr, pid_n,
                BN: tl.constexpr, BK: tl.constexpr, TRANS_W: tl.constexpr, EVEN: tl.constexpr = False):
        """E8M0 scales of a weight tile: [BN, BK/32] (or [BK, BN/32] with TRANS_W). Out-of-range k gives 127.
        EVEN (not TRANS_W): BN divides N and BK divides K, so the tile needs no mask (k0 must be in range)."""
        if TRANS_W:
            offs_k = k0 + tl.arange(0, BK)
            sc = pid_n * (BN // 32) + tl.arange(0, BN // 32)
            return tl.load(s_ptr + e64 * stride_se + offs_k[:, None] * stride_sr + sc[None, :],
                           mask=(offs_k[:, None] < K) & (sc[None, :] < N // 32), other=127)
        else:
            sc = k0 // 32 + tl.arange(0, BK // 32)
            if EVEN:
                return tl.load(s_ptr + e64 * stride_se + offs_n[:, None] * stride_sr + sc[None, :])
            return tl.load(s_ptr + e64 * stride_se + offs_n[:, None] * stride_sr + sc[None, :],
                           mask=n_mask[:, None] & (sc[None, :] < K // 32), other=127)

    @triton.jit
    def _load_p(w_ptr, e64, offs_n, n_mask, k0, N, K, stride_we, stride_wr, pid_n,
                BN: tl.constexpr, BK: tl.constexpr, TRANS_W: tl.constexpr, EVEN: tl.constexpr = False):
        """Packed bytes of a weight tile: [BN, BK/2] from W_e [N, K/2], or [BK, BN/2] from W_e [K, N/2] (TRANS_W)."""
        if TRANS_W:
            offs_k = k0 + tl.arange(0, BK)
            pc = pid_n * (BN // 2) + tl.arange(0, BN // 2)
            return tl.load(w_ptr + e64 * stride_we + offs_k[:, None] * stride_wr + pc[None, :],
                           mask=(offs_k[:, None] < K) & (pc[None, :] < N // 2), other=0)
        else:
            pc = k0 // 2 + tl.arange(0, BK // 2)
            if EVEN:  # whole tiles (see _load_s): unmasked, so the copies need no per-step predicates
                return tl.load(w_ptr + e64 * stride_we + offs_n[:, None] * stride_wr + pc[None, :])
            return tl.load(w_ptr + e64 * stride_we + offs_n[:, None] * stride_wr + pc[None, :],
                           mask=n_mask[:, None] & (pc[None, :] < K // 2), other=0)

    @triton.jit
    def _load_w(w_ptr, s, e64, offs_n, n_mask, k0, N, K, stride_we, stride_wr, pid_n,
                BN: tl.constexpr, BK: tl.constexpr, TRANS_W: tl.constexpr, PTX: tl.constexpr,
                PERM: tl.constexpr = False, EVEN: tl.constexpr = False):
        """Decoded weight tile [BN, BK] from packed bytes and its scales `s` (from _load_s): element (n, k) is
        W_e[n, k] (or W_e[k, n] with TRANS_W); PERM (not with TRANS_W): k in _perm_k's order."""
        p = _load_p(w_ptr, e64, offs_n, n_mask, k0, N, K, stride_we, stride_wr, pid_n, BN, BK, TRANS_W, EVEN)
        if TRANS_W:
            return tl.trans(_dequant(p, s, BK, BN, PTX))
        else:
            return _dequant(p, s, BN, BK, PTX, PERM)

    @triton.jit
    def _load_at(a_ptr, rows, m_mask, k0, K, stride_am, BK: tl.constexpr, PERM: tl.constexpr = False,
                 A_KPERM: tl.constexpr = False, EVEN: tl.constexpr = False):
        """Activation tile, transposed, bf16: [BK, BM] at k = k0 + j; PERM: row j holds k = k0 + _k_order(BK)[j],
        gathered in pairs, unless A_KPERM: the caller stored the columns in that order already (`permute_k`), so
        they load contiguously."""
        if PERM and not A_KPERM:
            offs_k = k0 + _k_order(BK)
        else:
            offs_k = k0 + tl.arange(0, BK)
        if EVEN:  # BK divides K: only the rows need a mask
            mask = tl.broadcast_to(m_mask[None, :], (BK, m_mask.shape[0]))
        else:
            mask = (offs_k[:, None] < K) & m_mask[None, :]
        return tl.load(a_ptr + rows[None, :] * stride_am + offs_k[:, None], mask=mask, other=0.0).to(tl.bfloat16)

    @triton.jit
    def _dot(w, at, acc, OP_F32: tl.constexpr):
        if OP_F32:  # the interpreter's dot mishandles bf16; bf16 values are exact in fp32
            w, at = w.to(tl.float32), at.to(tl.float32)
        return tl.dot(w, at, acc)

    @triton.jit
    def _tanh(x):
        x = tl.minimum(tl.maximum(x, -20.0), 20.0)  # tanh(20) == 1 in fp32; keeps exp finite
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _glu(g, u, beta1, beta2, ACT: tl.constexpr, LINEAR_UP: tl.constexpr):
        """The fused GLU of the gate+up epilogues: SiLU (ACT 1) or K3's SiTU (ACT 2; LINEAR_UP: no tanh on up). Its
        bf16 output is what the fp32 tanh's absolute error (~1e-7) cannot reach."""
        if ACT == 1:
            return g * tl.sigmoid(g) * u
        if not LINEAR_UP:
            u = beta2 * _tanh(u / beta2)
        return beta1 * _tanh(g / beta1) * tl.sigmoid(g) * u

    @triton.jit
    def _route_ids_kernel(idx_ptr, ids_ptr, ok_ptr, M, E, x_ptr, order_ptr, xp_ptr, K, BLOCK: tl.constexpr,
                          HAS_X: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program 0: the routes' expert ids and their range flag. Programs 1..T with HAS_X: row p-1 of x with its
        columns in `order` (a `kperm_index`), the K-permuted input of the decode's gate+up GEMM."""
        pid = tl.program_id(0)
        if pid == 0:
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            for m0 in range(0, M, BLOCK):
                m = m0 + tl.arange(0, BLOCK)
                e = tl.load(idx_ptr + m, mask=m < M, other=0)
                tl.store(ids_ptr + m, e.to(tl.int32), mask=m < M)
                bad += ((e < 0) | (e >= E)).to(tl.int32)
            tl.store(ok_ptr, (tl.sum(bad, 0) == 0).to(tl.int32))
        elif HAS_X:
            row = (pid - 1).to(tl.int64) * K
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                src = tl.load(order_ptr + k, mask=k < K, other=0)
                tl.store(xp_ptr + row + k, tl.load(x_ptr + row + src, mask=k < K), mask=k < K)

    @triton.jit
    def _block_prefix_kernel(lo_ptr, hi_ptr, bcum_ptr, E, BM: tl.constexpr, BLOCK: tl.constexpr):
        carry = tl.full([], 0, tl.int32)
        tl.store(bcum_ptr, carry)
        for e0 in range(0, E, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            rows = tl.load(hi_ptr + e, mask=e < E, other=0) - tl.load(lo_ptr + e, mask=e < E, other=0)
            blocks = (rows.to(tl.int32) + BM - 1) // BM
            tl.store(bcum_ptr + 1 + e, tl.cumsum(blocks, 0) + carry, mask=e < E)
            carry += tl.sum(blocks, 0)

    @triton.jit
    def _rows_and_columns(a_rows_ptr, offs_m, m_mask, pid_n, N, BN: tl.constexpr, GATHER_A: tl.constexpr,
                          A_DIV: tl.constexpr):
        """(rows of A the program's routed rows read [BM] int64: gathered through a_rows, else route m's token
        m // A_DIV; its output columns [BN] and their mask)."""
        if GATHER_A:
            rows = tl.load(a_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        else:
            rows = (offs_m // A_DIV).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        return rows, offs_n, offs_n < N

    @triton.jit
    def _segment_rows(pid_m, lo_ptr, hi_ptr, bcum_ptr, E, BM: tl.constexpr, E_CHUNK: tl.constexpr,
                      NUM_E_CHUNKS: tl.constexpr):
        """(expert, sorted rows [BM], their mask) of row block pid_m (< bcum[E]): the expert is the number of experts
        whose block range ends at or before pid_m (`_block_prefix_kernel`'s sums, searched in chunks)."""
        e = pid_m * 0
        for i in range(NUM_E_CHUNKS):
            idx = 1 + i * E_CHUNK + tl.arange(0, E_CHUNK)
            ends = tl.load(bcum_ptr + idx, mask=idx <= E, other=2147483647)
            e += tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        blk0 = tl.load(bcum_ptr + e)
        seg_end = tl.load(hi_ptr + e)
        offs_m = tl.load(lo_ptr + e) + (pid_m - blk0) * BM + tl.arange(0, BM)
        return e, offs_m, offs_m < seg_end

    @triton.jit
    def _zero_route_row(pid_m, pid_n, c_ptr, c_rows_ptr, stride_cm, N, BN: tl.constexpr, DUAL: tl.constexpr,
                        ACT: tl.constexpr, SCATTER_C: tl.constexpr):
        """Zeros in the BN output columns of route row pid_m a program would have computed (its expert is another
        rank's)."""
        zn = pid_n * BN + tl.arange(0, BN)
        if SCATTER_C:
            zrow = tl.load(c_rows_ptr + pid_m).to(tl.int64)
        else:
            zrow = pid_m.to(tl.int64)
        z_ptrs = c_ptr + zrow * stride_cm + zn
        zero = tl.zeros([BN], dtype=c_ptr.dtype.element_ty)
        tl.store(z_ptrs, zero, mask=zn < N)
        if DUAL == 1 and ACT == 0:
            tl.store(z_ptrs + N, zero, mask=zn < N)

    @triton.jit
    def _store_ct(acc, acc2, c_ptr, c_rows_ptr, stride_cm, offs_m, m_mask, offs_n, n_mask, N, beta1, beta2,
                  TWO: tl.constexpr, ACT: tl.constexpr, LINEAR_UP: tl.constexpr, SCATTER_C: tl.constexpr):
        """Store the C^T tiles [BN, BM] of a program: acc (TWO: and acc2 beside it at column N, or the fused GLU of
        the two) into C's rows (c_rows[m] with SCATTER_C, else m) in C's dtype."""
        if SCATTER_C:
            crow = tl.load(c_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        else:
            crow = offs_m.to(tl.int64)
        c_mask = m_mask[:, None] & n_mask[None, :]
        c_ptrs = c_ptr + crow[:, None] * stride_cm + offs_n[None, :]
        if TWO:
            if ACT == 0:
                tl.store(c_ptrs, tl.trans(acc).to(c_ptr.dtype.element_ty), mask=c_mask)
                tl.store(c_ptrs + N, tl.trans(acc2).to(c_ptr.dtype.element_ty), mask=c_mask)
            else:
                h = _glu(acc, acc2, beta1, beta2, ACT, LINEAR_UP)
                tl.store(c_ptrs, tl.trans(h).to(c_ptr.dtype.element_ty), mask=c_mask)
        else:
            tl.store(c_ptrs, tl.trans(acc).to(c_ptr.dtype.element_ty), mask=c_mask)

    @triton.jit
    def _mxfp4_grouped_gemm_kernel(
        a_ptr, a2_ptr, a_rows_ptr, stride_am,
        w_ptr, ws_ptr, b_ptr, bs_ptr, stride_we, stride_wr, stride_se, stride_sr,
        lo_ptr, hi_ptr, bcum_ptr, eid_ptr, c_ptr, c_rows_ptr, stride_cm,
        N, K, E, beta1, beta2,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        E_CHUNK: tl.constexpr, NUM_E_CHUNKS: tl.constexpr,
        TRANS_W: tl.constexpr, DUAL: tl.constexpr, ACT: tl.constexpr, LINEAR_UP: tl.constexpr,
        GATHER_A: tl.constexpr, A_DIV: tl.constexpr, SCATTER_C: tl.constexpr,
        OP_F32: tl.constexpr, PTX: tl.constexpr, PERM: tl.constexpr, A_KPERM: tl.constexpr,
        EVEN: tl.constexpr, ROW_EXPERT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BN)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if ROW_EXPERT:
            # one row per program (decode sizes), its expert read from expert_ids: no sorted segments at all
            e = tl.load(eid_ptr + pid_m)
            if e >= E:  # another rank's expert: zeros, not computed (the output is not zero-filled beforehand)
                _zero_route_row(pid_m, pid_n, c_ptr, c_rows_ptr, stride_cm, N, BN, DUAL, ACT, SCATTER_C)
                return
            offs_m = pid_m + tl.arange(0, BM)
            m_mask = tl.arange(0, BM) < 1
        else:
            if pid_m >= tl.load(bcum_ptr + E):
                return
            e, offs_m, m_mask = _segment_rows(pid_m, lo_ptr, hi_ptr, bcum_ptr, E, BM, E_CHUNK, NUM_E_CHUNKS)
        rows, offs_n, n_mask = _rows_and_columns(a_rows_ptr, offs_m, m_mask, pid_n, N, BN, GATHER_A, A_DIV)
        e64 = e.to(tl.int64)

        # acc (and acc2 for dual="out") [BN, BM]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        acc2 = tl.zeros((BN, BM), dtype=tl.float32)
        # the scale tiles are too narrow for Triton's cp.async pipelining: prefetch them one step ahead by hand
        s_nxt = _load_s(ws_ptr, e64, offs_n, n_mask, 0, N, K, stride_se, stride_sr, pid_n, BN, BK, TRANS_W, EVEN)
        if DUAL != 0:
            s2_nxt = _load_s(bs_ptr, e64, offs_n, n_mask, 0, N, K, stride_se, stride_sr, pid_n, BN, BK, TRANS_W,
                             EVEN)
        else:
            s2_nxt = s_nxt
        for k0 in range(0, K, BK):
            s_cur = s_nxt
            s2_cur = s2_nxt
            # EVEN tiles have no mask: the prefetch after the last step re-reads the last tile instead
            k_nxt = tl.minimum(k0 + BK, K - BK) if EVEN else k0 + BK
            s_nxt = _load_s(ws_ptr, e64, offs_n, n_mask, k_nxt, N, K, stride_se, stride_sr, pid_n, BN, BK,
                            TRANS_W, EVEN)
            if DUAL != 0:
                s2_nxt = _load_s(bs_ptr, e64, offs_n, n_mask, k_nxt, N, K, stride_se, stride_sr, pid_n, BN, BK,
                                 TRANS_W, EVEN)
            at = _load_at(a_ptr, rows, m_mask, k0, K, stride_am, BK, PERM, A_KPERM, EVEN)
            wt = _load_w(w_ptr, s_cur, e64, offs_n, n_mask, k0, N, K, stride_we, stride_wr, pid_n, BN, BK,
                         TRANS_W, PTX, PERM, EVEN)
            acc = _dot(wt, at, acc, OP_F32)
            if DUAL != 0:
                bt = _load_w(b_ptr, s2_cur, e64, offs_n, n_mask, k0, N, K, stride_we, stride_wr, pid_n, BN, BK,
                             TRANS_W, PTX, PERM, EVEN)
                if DUAL == 2:
                    at2 = _load_at(a2_ptr, rows, m_mask, k0, K, stride_am, BK, PERM, A_KPERM, EVEN)
                    acc = _dot(bt, at2, acc, OP_F32)
                else:
                    acc2 = _dot(bt, at, acc2, OP_F32)

        _store_ct(acc, acc2, c_ptr, c_rows_ptr, stride_cm, offs_m, m_mask, offs_n, n_mask, N, beta1, beta2,
                  DUAL == 1, ACT, LINEAR_UP, SCATTER_C)
