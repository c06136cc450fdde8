"""Chunked KDA forward kernels (Triton).

Per 64-token chunk (rows i, j), with Gam = chunk-local cumsum of the log decay, and incoming state S:
  P[i,j]   = sum_d k_id k_jd exp(Gam_id - Gam_jd)        j < i    (key-key, unscaled)
  Aqk[i,j] = scale * sum_d q_id k_jd exp(Gam_id - Gam_jd) j <= i
  M = (I + Diag(beta) P)^-1,  T = M Diag(beta)
  W = T (k * exp(Gam)),  U = T v,  Qg = scale q * exp(Gam),  Kd = k * exp(Gam_last - Gam)
  Vn = U - W S;  O = Qg S + Aqk Vn;  S <- Diag(exp(Gam_last)) S + Kd^T Vn

`intra_fwd` computes the per-chunk quantities (fully parallel over chunks and heads): the pairwise kernel
`_intra_fwd_kernel` (Aqk, P, the blockwise inverse, T = M Diag(beta)) and `_wu_fwd_kernel` (W, U, Qg, Kd). The
pairwise products are formed on 16-row sub-tiles, each relative to its sub-tile's first row, so no exponential
ever exceeds 1 off the diagonal. Diagonal 16x16 tiles use one dense matmul when the gate is bounded
(lower_bound >= SAFE_LOWER_BOUND: |Gam| span < 80 nats inside a sub-tile, inside fp32 range) or, for unbounded
gates, when the tile's measured span is at most DENSE_MAX_SPAN, and a per-column loop otherwise; they have their own
kernel, `_diag_fwd_kernel`, and the pairwise kernel takes the rest.
`state_fwd` runs the sequential scan over chunks (parallel over sequences, heads and value tiles) and writes the
state entering each chunk; `_output_fwd_kernel` then forms the output, parallel over chunks.
The PyTorch reference is `reference.naive_chunk_kda`.
"""
from __future__ import annotations

import contextlib

import torch

from ._utils import CHUNK_SIZE, TRITON_AVAILABLE, cdiv, next_pow2
from .configs import launch_config, sm_count, state_scan_tile

# K3's bound (-5): 15 steps inside a 16-row sub-tile stay above -75 nats, so exp(+span) < 4e32.
SAFE_LOWER_BOUND = -5.5
# Unbounded gates: a diagonal tile (one K slice) whose gate span is at most this many log2 units (75 nats, K3's worst
# case) takes the one-matmul path too; only steeper tiles need the per-column loop.
DENSE_MAX_SPAN = 75.0 * 1.4426950408889634

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .gate import _softplus

    @triton.jit
    def _ld(ptr, rows, eos, H, i_h, D: tl.constexpr, cols, mc):
        m = (rows < eos)[:, None] & mc[None, :]
        return tl.load(ptr + (rows[:, None] * H + i_h) * D + cols[None, :], mask=m, other=0.).to(tl.float32)

    @triton.jit
    def _ld_row(ptr, row, eos, H, i_h, D: tl.constexpr, cols, mc):
        return tl.load(ptr + (row * H + i_h) * D + cols, mask=mc & ((cols * 0 + row) < eos), other=0.).to(tl.float32)

    @triton.jit
    def _diag_loop(aI, kI, gI, k_ptr, g_ptr, row0, eos, H, i_h, K: tl.constexpr, cols, mc,
                   BC: tl.constexpr):
        """Diagonal 16x16 tile, any gate: column by column with per-pair exponents (all <= 1)."""
        o_i = tl.arange(0, BC)
        acc_a = tl.zeros([BC, BC], dtype=tl.float32)
        acc_k = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(0, BC):
            kj = _ld_row(k_ptr, row0 + j, eos, H, i_h, K, cols, mc)
            gj = _ld_row(g_ptr, row0 + j, eos, H, i_h, K, cols, mc)
            ok = (o_i[:, None] >= j) & ((row0 + o_i) < eos)[:, None]
            e = tl.exp2(tl.where(ok, gI - gj[None, :], -float("inf"))) * kj[None, :]
            ca = tl.sum(aI * e, 1)
            ck = tl.sum(kI * e, 1)
            acc_a += tl.where(o_i[None, :] == j, ca[:, None], 0.)
            acc_k += tl.where(o_i[None, :] == j, ck[:, None], 0.)
        return acc_a, acc_k

    @triton.jit
    def _acc_pair(a, p, qe, ke, kt, PREC: tl.constexpr):
        """One tile pair's query-key (a) and key-key (p) products."""
        return a + tl.dot(qe, kt, input_precision=PREC), p + tl.dot(ke, kt, input_precision=PREC)

    @triton.jit
    def _inv_unit_lower(L, BC: tl.constexpr):
        """(I + L)^-1 for strictly lower-triangular L [BC, BC], by forward substitution in fp32."""
        o = tl.arange(0, BC)
        M = tl.where(o[:, None] == o[None, :], 1., 0.)
        for i in range(1, BC):
            li = tl.sum(tl.where(o[:, None] == i, L, 0.), 0)
            new = -tl.sum(li[:, None] * M, 0)
            M = tl.where(o[:, None] == i, M + new[None, :], M)
        return M

    @triton.jit
    def _inv_rows(Pd, row0, eos, H, i_h, bs, BC: tl.constexpr):
        """(I + Diag(beta) P)^-1 of the diagonal block whose strictly lower P sits in memory at rows row0.. ([TT, H,
        BC]): forward substitution on N = M - I, each row of P loaded again from memory
        (as fla's solve_tril does), so a step needs one cross-lane reduction where _inv_unit_lower needs two, and
        row 1 of N is -L's own."""
        o = tl.arange(0, BC)
        rows = row0 + o
        b = tl.load(bs + rows * H + i_h, mask=rows < eos, other=0.)
        N = -b[:, None] * tl.where(o[:, None] > o[None, :], _ld(Pd, rows, eos, H, i_h, BC, o, o < BC), 0.)
        for i in range(2, BC):
            r = row0 + i
            ok = (o < i) & ((o * 0 + r) < eos)
            li = -tl.load(bs + r * H + i_h, mask=r < eos, other=0.) * tl.load(Pd + (r * H + i_h) * BC + o, mask=ok,
                                                                                other=0.)
            N = tl.where(o[:, None] == i, (li + tl.sum(li[:, None] * N, 0))[None, :], N)
        return N + tl.where(o[:, None] == o[None, :], 1., 0.)

    @triton.jit
    def _mm(a, b):
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _st_blk(ptr, X, rows, eos, H, i_h, D: tl.constexpr, col0, BC: tl.constexpr):
        c = col0 + tl.arange(0, BC)
        # the column mask matters when D is not a multiple of BC (head dims such as 96): without it the tile's
        # spare columns land in the next row
        tl.store(ptr + (rows[:, None] * H + i_h) * D + c[None, :], X, mask=(rows < eos)[:, None] & (c < D)[None, :])

    @triton.jit
    def _st_lower(ptr, x00, x10, x11, x20, x21, x22, x30, x31, x32, x33, r0, eos, H, i_h, D: tl.constexpr,
                  BC: tl.constexpr):
        """The ten blocks on and below the diagonal of a [4 BC, 4 BC] chunk matrix, block rows from r0."""
        r1 = r0 + BC
        r2 = r1 + BC
        r3 = r2 + BC
        _st_blk(ptr, x00, r0, eos, H, i_h, D, 0, BC)
        _st_blk(ptr, x10, r1, eos, H, i_h, D, 0, BC)
        _st_blk(ptr, x11, r1, eos, H, i_h, D, BC, BC)
        _st_blk(ptr, x20, r2, eos, H, i_h, D, 0, BC)
        _st_blk(ptr, x21, r2, eos, H, i_h, D, BC, BC)
        _st_blk(ptr, x22, r2, eos, H, i_h, D, 2 * BC, BC)
        _st_blk(ptr, x30, r3, eos, H, i_h, D, 0, BC)
        _st_blk(ptr, x31, r3, eos, H, i_h, D, BC, BC)
        _st_blk(ptr, x32, r3, eos, H, i_h, D, 2 * BC, BC)
        _st_blk(ptr, x33, r3, eos, H, i_h, D, 3 * BC, BC)

    @triton.jit
    def _scan_program(cu, chunk_off, H, V: tl.constexpr, BV: tl.constexpr):
        """A scan program's place on its one grid axis, value tiles fastest (the axes after the first stop at 65,535
        programs): (value tile, sequence * H + head, head, the sequence's first token and end, its first chunk)."""
        i_v = tl.program_id(0) % tl.cdiv(V, BV)
        i_nh = tl.program_id(0) // tl.cdiv(V, BV)
        n = i_nh // H
        return (i_v, i_nh, i_nh % H, tl.load(cu + n).to(tl.int64), tl.load(cu + n + 1).to(tl.int64),
                tl.load(chunk_off + n).to(tl.int64))

    @triton.jit
    def _seg_span(chunk_off, i_nh, H, c0, bos, eos, c_lo, c_hi, o_v, BT: tl.constexpr, BC: tl.constexpr,
                  SEG: tl.constexpr):
        """A 16-token recurrence program's part of the segment of global chunks [c_lo, c_hi): its first and end
        sub-chunk (relative to the sequence), and as vectors over o_v (the interpreter refuses a scalar bool in a
        mask) whether it runs at all (an empty sequence runs in the first segment, to carry its initial state to the
        final one) and whether the sequence starts / ends in the segment. Not SEG: one segment, the whole sequence."""
        n_sub = tl.cdiv(eos - bos, BC)
        if SEG:
            n = i_nh // H
            c1 = tl.load(chunk_off + n + 1)
            lo = tl.maximum(c0, c_lo)
            hi = tl.minimum(c1, c_hi)
            s_lo = (lo - c0) * (BT // BC)
            s_hi = tl.minimum(n_sub, (hi - c0) * (BT // BC))
            empty = c0 == c1
            run_v = (o_v * 0 + ((lo < hi) | (empty & (c_lo == 0))).to(tl.int32)) > 0
            first_v = run_v & ((o_v * 0 + ((c0 >= c_lo) | empty).to(tl.int32)) > 0)
            last_v = run_v & ((o_v * 0 + ((c1 <= c_hi) | empty).to(tl.int32)) > 0)
        else:
            s_lo = n_sub * 0
            s_hi = n_sub
            run_v = o_v >= 0
            first_v = run_v
            last_v = run_v
        return s_lo, s_hi, run_v, first_v, last_v

    @triton.jit
    def _chunk_span(tab, cu, i_c):
        """Chunk i_c of the packed batch: (its sequence, first token, end of that sequence), from SeqInfo's tables."""
        n = tl.load(tab + 2 * i_c)
        return n, tl.load(tab + 2 * i_c + 1).to(tl.int64), tl.load(cu + n + 1).to(tl.int64)

    @triton.jit
    def _solve(p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, bs, Mo, Tm, Md, r0, eos, H, i_h, BT: tl.constexpr,
               BC: tl.constexpr, STORE_BWD: tl.constexpr):
        """M = (I + Diag(beta) P)^-1 blockwise from P's ten lower 16x16 blocks (strictly lower on the diagonal) and
        the diagonal blocks' inverses in Md ([TT, H, BC]), and T = M Diag(beta) into Tm."""
        o_c = tl.arange(0, BC)
        r1 = r0 + BC
        r2 = r1 + BC
        r3 = r2 + BC
        DT = Tm.dtype.element_ty
        b0 = tl.load(bs + r0 * H + i_h, mask=r0 < eos, other=0.)
        b1 = tl.load(bs + r1 * H + i_h, mask=r1 < eos, other=0.)
        b2 = tl.load(bs + r2 * H + i_h, mask=r2 < eos, other=0.)
        b3 = tl.load(bs + r3 * H + i_h, mask=r3 < eos, other=0.)
        # M = (I + Diag(beta) P)^-1, blockwise, from the diagonal blocks' inverses
        m00 = _ld(Md, r0, eos, H, i_h, BC, o_c, o_c < BC)
        m11 = _ld(Md, r1, eos, H, i_h, BC, o_c, o_c < BC)
        m22 = _ld(Md, r2, eos, H, i_h, BC, o_c, o_c < BC)
        m33 = _ld(Md, r3, eos, H, i_h, BC, o_c, o_c < BC)
        l10 = b1[:, None] * p10
        l20 = b2[:, None] * p20
        l21 = b2[:, None] * p21
        l30 = b3[:, None] * p30
        l31 = b3[:, None] * p31
        l32 = b3[:, None] * p32
        m10 = -_mm(m11, _mm(l10, m00))
        m21 = -_mm(m22, _mm(l21, m11))
        m20 = -_mm(m22, _mm(l20, m00) + _mm(l21, m10))
        m32 = -_mm(m33, _mm(l32, m22))
        m31 = -_mm(m33, _mm(l31, m11) + _mm(l32, m21))
        m30 = -_mm(m33, _mm(l30, m00) + _mm(l31, m10) + _mm(l32, m20))
        if STORE_BWD:
            _st_lower(Mo, m00, m10, m11, m20, m21, m22, m30, m31, m32, m33, r0, eos, H, i_h, BT, BC)
        # T = M Diag(beta) for _wu_fwd_kernel, block rows of [BT, BT] (zeros above the diagonal)
        z = tl.zeros([BC, BC], dtype=tl.float32)
        _st_blk(Tm, (m00 * b0[None, :]).to(DT), r0, eos, H, i_h, BT, 0, BC)
        _st_blk(Tm, z.to(DT), r0, eos, H, i_h, BT, BC, BC)
        _st_blk(Tm, z.to(DT), r0, eos, H, i_h, BT, 2 * BC, BC)
        _st_blk(Tm, z.to(DT), r0, eos, H, i_h, BT, 3 * BC, BC)
        _st_blk(Tm, (m10 * b0[None, :]).to(DT), r1, eos, H, i_h, BT, 0, BC)
        _st_blk(Tm, (m11 * b1[None, :]).to(DT), r1, eos, H, i_h, BT, BC, BC)
        _st_blk(Tm, z.to(DT), r1, eos, H, i_h, BT, 2 * BC, BC)
        _st_blk(Tm, z.to(DT), r1, eos, H, i_h, BT, 3 * BC, BC)
        _st_blk(Tm, (m20 * b0[None, :]).to(DT), r2, eos, H, i_h, BT, 0, BC)
        _st_blk(Tm, (m21 * b1[None, :]).to(DT), r2, eos, H, i_h, BT, BC, BC)
        _st_blk(Tm, (m22 * b2[None, :]).to(DT), r2, eos, H, i_h, BT, 2 * BC, BC)
        _st_blk(Tm, z.to(DT), r2, eos, H, i_h, BT, 3 * BC, BC)
        _st_blk(Tm, (m30 * b0[None, :]).to(DT), r3, eos, H, i_h, BT, 0, BC)
        _st_blk(Tm, (m31 * b1[None, :]).to(DT), r3, eos, H, i_h, BT, BC, BC)
        _st_blk(Tm, (m32 * b2[None, :]).to(DT), r3, eos, H, i_h, BT, 2 * BC, BC)
        _st_blk(Tm, (m33 * b3[None, :]).to(DT), r3, eos, H, i_h, BT, 3 * BC, BC)

    @triton.jit
    def _intra_fwd_kernel(qn, kn, gc, bs, Aqk, Mo, Po, Tm, Pd, Md, tab, cu, scale,
                          H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                          STORE_BWD: tl.constexpr, PREC: tl.constexpr):
        """The six off-diagonal 16x16 tiles of Aqk and P for one chunk and head, then the blockwise inverse and
        T = M Diag(beta); the diagonal tiles come from _diag_fwd_kernel (Aqk's written, P's in Pd), the inverses of
        the diagonal blocks of I + Diag(beta) P from _diag_inv_kernel (Md)."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        _, t0, eos = _chunk_span(tab, cu, i_c)
        o_c = tl.arange(0, BC)
        r0 = t0 + o_c
        r1 = r0 + BC
        r2 = r1 + BC
        r3 = r2 + BC

        a10 = tl.zeros([BC, BC], dtype=tl.float32)
        a20 = tl.zeros([BC, BC], dtype=tl.float32)
        a21 = tl.zeros([BC, BC], dtype=tl.float32)
        a30 = tl.zeros([BC, BC], dtype=tl.float32)
        a31 = tl.zeros([BC, BC], dtype=tl.float32)
        a32 = tl.zeros([BC, BC], dtype=tl.float32)
        p10 = tl.zeros([BC, BC], dtype=tl.float32)
        p20 = tl.zeros([BC, BC], dtype=tl.float32)
        p21 = tl.zeros([BC, BC], dtype=tl.float32)
        p30 = tl.zeros([BC, BC], dtype=tl.float32)
        p31 = tl.zeros([BC, BC], dtype=tl.float32)
        p32 = tl.zeros([BC, BC], dtype=tl.float32)

        last = tl.minimum(eos, t0 + BT) - 1
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            k0 = _ld(kn, r0, eos, H, i_h, K, cols, mc)
            k1 = _ld(kn, r1, eos, H, i_h, K, cols, mc)
            k2 = _ld(kn, r2, eos, H, i_h, K, cols, mc)
            k3 = _ld(kn, r3, eos, H, i_h, K, cols, mc)
            q1 = _ld(qn, r1, eos, H, i_h, K, cols, mc)
            q2 = _ld(qn, r2, eos, H, i_h, K, cols, mc)
            q3 = _ld(qn, r3, eos, H, i_h, K, cols, mc)
            g0 = _ld(gc, r0, eos, H, i_h, K, cols, mc)
            g1 = _ld(gc, r1, eos, H, i_h, K, cols, mc)
            g2 = _ld(gc, r2, eos, H, i_h, K, cols, mc)
            g3 = _ld(gc, r3, eos, H, i_h, K, cols, mc)
            # reference rows: the first row of each sub-tile
            n1 = _ld_row(gc, tl.minimum(t0 + BC, last), eos, H, i_h, K, cols, mc)
            n2 = _ld_row(gc, tl.minimum(t0 + 2 * BC, last), eos, H, i_h, K, cols, mc)
            n3 = _ld_row(gc, tl.minimum(t0 + 3 * BC, last), eos, H, i_h, K, cols, mc)
            # row sides, exp(Gam_i - Gam_ref) <= 1 on valid rows (0 elsewhere)
            e1 = tl.exp2(tl.where((r1 < eos)[:, None], g1 - n1[None, :], 0.))
            e2 = tl.exp2(tl.where((r2 < eos)[:, None], g2 - n2[None, :], 0.))
            e3 = tl.exp2(tl.where((r3 < eos)[:, None], g3 - n3[None, :], 0.))
            qe1 = q1 * e1
            ke1 = k1 * e1
            qe2 = q2 * e2
            ke2 = k2 * e2
            qe3 = q3 * e3
            ke3 = k3 * e3
            # column sides exp(Gam_ref - Gam_j) <= 1
            kt = tl.trans(k0 * tl.exp2(n1[None, :] - g0))
            a10, p10 = _acc_pair(a10, p10, qe1, ke1, kt, PREC)
            kt = tl.trans(k0 * tl.exp2(n2[None, :] - g0))
            a20, p20 = _acc_pair(a20, p20, qe2, ke2, kt, PREC)
            kt = tl.trans(k1 * tl.exp2(n2[None, :] - g1))
            a21, p21 = _acc_pair(a21, p21, qe2, ke2, kt, PREC)
            kt = tl.trans(k0 * tl.exp2(n3[None, :] - g0))
            a30, p30 = _acc_pair(a30, p30, qe3, ke3, kt, PREC)
            kt = tl.trans(k1 * tl.exp2(n3[None, :] - g1))
            a31, p31 = _acc_pair(a31, p31, qe3, ke3, kt, PREC)
            kt = tl.trans(k2 * tl.exp2(n3[None, :] - g2))
            a32, p32 = _acc_pair(a32, p32, qe3, ke3, kt, PREC)

        _st_blk(Aqk, a10 * scale, r1, eos, H, i_h, BT, 0, BC)
        _st_blk(Aqk, a20 * scale, r2, eos, H, i_h, BT, 0, BC)
        _st_blk(Aqk, a21 * scale, r2, eos, H, i_h, BT, BC, BC)
        _st_blk(Aqk, a30 * scale, r3, eos, H, i_h, BT, 0, BC)
        _st_blk(Aqk, a31 * scale, r3, eos, H, i_h, BT, BC, BC)
        _st_blk(Aqk, a32 * scale, r3, eos, H, i_h, BT, 2 * BC, BC)
        # strictly lower diagonal key-key tiles from _diag_fwd_kernel, [TT, H, BC]
        p00 = _ld(Pd, r0, eos, H, i_h, BC, o_c, o_c < BC)
        p11 = _ld(Pd, r1, eos, H, i_h, BC, o_c, o_c < BC)
        p22 = _ld(Pd, r2, eos, H, i_h, BC, o_c, o_c < BC)
        p33 = _ld(Pd, r3, eos, H, i_h, BC, o_c, o_c < BC)
        if STORE_BWD:  # before the solve, so the P tiles need not stay live through it (~8% faster)
            _st_lower(Po, p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, r0, eos, H, i_h, BT, BC)
        _solve(p00, p10, p11, p20, p21, p22, p30, p31, p32, p33, bs, Mo, Tm, Md, r0, eos, H, i_h, BT, BC,
               STORE_BWD)

    @triton.jit
    def _tile_span(g, ref, valid):
        """Largest Gam_ref - Gam_i over a tile's valid entries (log2 units; Gam decreases down a chunk)."""
        return tl.max(tl.max(tl.where(valid, ref[None, :] - g, 0.), 1), 0)

    @triton.jit
    def _diag_fwd_kernel(qn, kn, gc, Aqk, Pd, steep, tab, cu, scale, max_span, H, K: tl.constexpr,
                         BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SAFE: tl.constexpr,
                         PREC: tl.constexpr):
        """The four diagonal 16x16 tiles of a chunk, one program per tile (4x the parallelism of the pairwise
        kernel, a fraction of its registers): Aqk's go straight to Aqk, the key-key ones to Pd [TT, H, BC].
        Without a static bound (SAFE) each K slice checks its gate span: one matmul when the span is at most
        max_span, the per-column loop otherwise, and marks the chunk in steep [NC, H] (int8, zeroed by the caller) for
        the backward."""
        i_s = tl.program_id(0)
        i_h = tl.program_id(1)
        i_c = i_s // (BT // BC)
        sub = i_s % (BT // BC)
        _, t0, eos = _chunk_span(tab, cu, i_c)
        t0 += sub * BC
        o_c = tl.arange(0, BC)
        rows = t0 + o_c
        last = tl.maximum(tl.minimum(eos, t0 + BC) - 1, t0)
        acc_a = tl.zeros([BC, BC], dtype=tl.float32)
        acc_k = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            q = _ld(qn, rows, eos, H, i_h, K, cols, mc)
            k = _ld(kn, rows, eos, H, i_h, K, cols, mc)
            g = _ld(gc, rows, eos, H, i_h, K, cols, mc)
            ref = _ld_row(gc, tl.minimum(t0, last), eos, H, i_h, K, cols, mc)
            dense = SAFE
            if not SAFE:
                dense = _tile_span(g, ref, (rows < eos)[:, None] & mc[None, :]) <= max_span
                if not dense:
                    tl.store(steep + i_c * H + i_h, 1)
            if dense:
                e = tl.exp2(tl.where((rows < eos)[:, None], g - ref[None, :], 0.))
                kt = tl.trans(k * tl.exp2(ref[None, :] - g))
                acc_a += tl.dot(q * e, kt, input_precision=PREC)
                acc_k += tl.dot(k * e, kt, input_precision=PREC)
            else:
                x, y = _diag_loop(q, k, g, kn, gc, t0, eos, H, i_h, K, cols, mc, BC)
                acc_a += x
                acc_k += y
        incl = o_c[:, None] >= o_c[None, :]
        strict = o_c[:, None] > o_c[None, :]
        _st_blk(Aqk, tl.where(incl, acc_a, 0.) * scale, rows, eos, H, i_h, BT, sub * BC, BC)
        _st_blk(Pd, tl.where(strict, acc_k, 0.), rows, eos, H, i_h, BC, 0, BC)

    @triton.jit
    def _diag_inv_kernel(Pd, bs, Md, tab, cu, H, BT: tl.constexpr, BC: tl.constexpr):
        """(I + Diag(beta) P_dd)^-1 for each diagonal 16x16 block, one block per program: the 15-step forward
        substitution leaves the register-bound pairwise kernel (which then loads the result) and runs in many small
        programs instead. Pd: the diagonal tiles ([TT, H, BC]). Rows past the sequence end are not written."""
        i_s = tl.program_id(0)
        i_h = tl.program_id(1)
        _, t0, eos = _chunk_span(tab, cu, i_s // (BT // BC))
        o_c = tl.arange(0, BC)
        sub = i_s % (BT // BC)
        rows = t0 + sub * BC + o_c
        m = _inv_rows(Pd, t0 + sub * BC, eos, H, i_h, bs, BC)
        _st_blk(Md, m, rows, eos, H, i_h, BC, 0, BC)

    @triton.jit
    def _wu_fwd_kernel(qn, kn, v, gc, Tm, W, U, Qg, Kd, tab, cu, scale, H, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
        """W = T (k * exp(Gam)), U = T v, Qg, Kd for one chunk and head: whole-chunk [BT, BT] x [BT, BK] products
        (the pairwise kernel above keeps only the 16-row tiles it must)."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        _, t0, eos = _chunk_span(tab, cu, i_c)
        o_t = tl.arange(0, BT)
        rows = t0 + o_t
        last = tl.minimum(eos, t0 + BT) - 1
        DT = W.dtype.element_ty
        t = tl.load(Tm + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=(rows < eos)[:, None], other=0.)
        t = t.to(DT)
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            k = _ld(kn, rows, eos, H, i_h, K, cols, mc)
            g = _ld(gc, rows, eos, H, i_h, K, cols, mc)
            gl = _ld_row(gc, last, eos, H, i_h, K, cols, mc)
            eg = tl.exp2(g)
            _st_blk(W, tl.dot(t, (k * eg).to(DT), input_precision=PREC).to(DT), rows, eos, H, i_h, K, i_k * BK, BK)
            _st_blk(Kd, (k * tl.exp2(gl[None, :] - g)).to(DT), rows, eos, H, i_h, K, i_k * BK, BK)
            q = _ld(qn, rows, eos, H, i_h, K, cols, mc)
            _st_blk(Qg, (q * eg * scale).to(DT), rows, eos, H, i_h, K, i_k * BK, BK)
        for i_v in range(0, tl.cdiv(V, BV)):
            cols = i_v * BV + tl.arange(0, BV)
            vv = _ld(v, rows, eos, H, i_h, V, cols, cols < V).to(DT)
            _st_blk(U, tl.dot(t, vv, input_precision=PREC).to(DT), rows, eos, H, i_h, V, i_v * BV, BV)

    @triton.jit
    def _state_fwd_kernel(W, U, Kd, gc, h0, ht, hs, vn, cu, chunk_off,
                          H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, BT: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                          STORE_STATES: tl.constexpr, STORE_VN: tl.constexpr, PREC: tl.constexpr):
        i_v, i_nh, i_h, bos, eos, c0 = _scan_program(cu, chunk_off, H, V, BV)
        NTn = tl.cdiv(eos - bos, BT)
        o_k = tl.arange(0, BK)
        mk = o_k < K
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        o_t = tl.arange(0, BT)
        DT = W.dtype.element_ty
        s_off = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
        m_s = mk[:, None] & mv[None, :]
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            S += tl.load(h0 + s_off, mask=m_s, other=0.)
        for c in range(0, NTn):
            t0 = bos + c * BT
            rows = t0 + o_t
            mr = rows < eos
            if STORE_STATES:
                tl.store(hs + ((c0 + c) * H * K + i_h * K + o_k[:, None]) * V + o_v[None, :],
                         S.to(hs.dtype.element_ty), mask=m_s)
            mrk = mr[:, None] & mk[None, :]
            mrv = mr[:, None] & mv[None, :]
            offk = (rows[:, None] * H + i_h) * K + o_k[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            w = tl.load(W + offk, mask=mrk, other=0.)
            u = tl.load(U + offv, mask=mrv, other=0.).to(tl.float32)
            Sd = S.to(DT)
            vnew = u - tl.dot(w, Sd, input_precision=PREC)
            if STORE_VN:
                tl.store(vn + offv, vnew.to(vn.dtype.element_ty), mask=mrv)
            vd = vnew.to(DT)
            kd = tl.load(Kd + offk, mask=mrk, other=0.)
            last = tl.minimum(eos, t0 + BT) - 1
            gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=mk, other=0.)
            S = S * tl.exp2(gl)[:, None] + tl.dot(tl.trans(kd), vd, input_precision=PREC)
        if STORE_FINAL:
            tl.store(ht + s_off, S, mask=m_s)


    @triton.jit
    def _output_fwd_kernel(Qg, Aqk, vn, hs, o, tab, cu, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
        """O = Qg S_c + Aqk Vn for one chunk, head and value tile; S_c = the state entering the chunk."""
        i_c = tl.program_id(0).to(tl.int64)  # chunks on the first grid axis: the others stop at 65,535
        i_v = tl.program_id(1)
        i_h = tl.program_id(2)
        _, t0, eos = _chunk_span(tab, cu, i_c)
        o_t = tl.arange(0, BT)
        rows = t0 + o_t
        mr = rows < eos
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        DT = Qg.dtype.element_ty
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mk = o_k < K
            qg = tl.load(Qg + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mr[:, None] & mk[None, :], other=0.)
            h = tl.load(hs + ((i_c * H + i_h) * K + o_k[:, None]) * V + o_v[None, :],
                        mask=mk[:, None] & mv[None, :], other=0.)
            acc += tl.dot(qg, h.to(DT), input_precision=PREC)
        a = tl.load(Aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :],
                    mask=mr[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.)
        offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        vv = tl.load(vn + offv, mask=mr[:, None] & mv[None, :], other=0.)
        acc += tl.dot(a.to(DT), vv, input_precision=PREC)
        tl.store(o + offv, acc.to(o.dtype.element_ty), mask=mr[:, None] & mv[None, :])


    @triton.jit
    def _row(x, i, o_c):
        """Row i of a register tile (a masked reduction: for the rare per-column loop and the reference rows)."""
        return tl.sum(tl.where(o_c[:, None] == i, x, 0.), 0)

    @triton.jit
    def _sub_fwd_kernel(q, k, f, beta, A_log, dt_bias, Kg, Qg, Kd, Gl, Ts, As, tab, cu, scale, lower_bound,
                        max_span, s_first, H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        SAFE: tl.constexpr, USE_LB: tl.constexpr, L2: tl.constexpr, SEG: tl.constexpr,
                        PREC: tl.constexpr):
        """Inference forward in 16-token sub-chunks, one program per sub-chunk and head,
        from the raw inputs: the L2 norms, sigmoid(beta), the gate and its cumsum Gam from the sub-chunk's start (no
        preparation kernels, nothing per 64-token chunk); the diagonal tile's Aqk and P (one matmul per K slice, or
        the per-column loop for a steep unbounded gate, as _diag_fwd_kernel), T = (I + Diag(beta) P)^-1 Diag(beta);
        Kg = k exp(Gam), Qg = scale q exp(Gam), Kd = k exp(Gam_last - Gam) and Gam_last, for _rec_fwd_kernel.
        SEG: the launch starts at sub-chunk s_first (a segment of the chunks, see sub16_fwd)."""
        i_s = tl.program_id(0)
        if SEG:
            i_s += s_first
        i_h = tl.program_id(1)
        _, t0, eos = _chunk_span(tab, cu, i_s // (BT // BC))
        s0 = t0 + (i_s % (BT // BC)) * BC
        o_c = tl.arange(0, BC)
        rows = s0 + o_c
        mr = rows < eos
        n_valid = tl.minimum(eos - s0, BC)
        DT = Kg.dtype.element_ty
        a_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        rq = tl.full([BC], 1., tl.float32)
        rk = tl.full([BC], 1., tl.float32)
        if L2:  # a first pass over K for the norms (the second reads the same rows again, from cache)
            sq = tl.zeros([BC], dtype=tl.float32)
            sk = tl.zeros([BC], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                cols = i_k * BK + tl.arange(0, BK)
                mc = cols < K
                x = _ld(q, rows, eos, H, i_h, K, cols, mc)
                y = _ld(k, rows, eos, H, i_h, K, cols, mc)
                sq += tl.sum(x * x, 1)
                sk += tl.sum(y * y, 1)
            rq = 1.0 / tl.sqrt(sq + 1e-6)
            rk = 1.0 / tl.sqrt(sk + 1e-6)
        acc_a = tl.zeros([BC, BC], dtype=tl.float32)
        acc_k = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            m = mr[:, None] & mc[None, :]
            qq = _ld(q, rows, eos, H, i_h, K, cols, mc) * rq[:, None]
            kk = _ld(k, rows, eos, H, i_h, K, cols, mc) * rk[:, None]
            x = _ld(f, rows, eos, H, i_h, K, cols, mc) + tl.load(dt_bias + i_h * K + cols, mask=mc, other=0.)[None, :]
            if USE_LB:
                gv = lower_bound * tl.sigmoid(a_h * x)
            else:
                gv = -a_h * _softplus(x)
            g = tl.cumsum(tl.where(m, gv, 0.) * 1.4426950408889634, axis=0)  # log2 units, from the sub-chunk start
            ref = _row(g, 0, o_c)
            gl = _row(g, n_valid - 1, o_c)
            dense = SAFE
            if not SAFE:
                dense = _tile_span(g, ref, m) <= max_span
            if dense:
                e = tl.exp2(tl.where(mr[:, None], g - ref[None, :], 0.))
                kt = tl.trans(kk * tl.exp2(ref[None, :] - g))
                acc_a += tl.dot(qq * e, kt, input_precision=PREC)
                acc_k += tl.dot(kk * e, kt, input_precision=PREC)
            else:  # column by column with per-pair exponents (all <= 1), the columns taken from registers
                for j in range(0, BC):
                    kj = _row(kk, j, o_c)
                    ok = (o_c[:, None] >= j) & mr[:, None]
                    ee = tl.exp2(tl.where(ok, g - _row(g, j, o_c)[None, :], -float("inf"))) * kj[None, :]
                    acc_a += tl.where(o_c[None, :] == j, tl.sum(qq * ee, 1)[:, None], 0.)
                    acc_k += tl.where(o_c[None, :] == j, tl.sum(kk * ee, 1)[:, None], 0.)
            eg = tl.exp2(g)
            _st_blk(Kg, (kk * eg).to(DT), rows, eos, H, i_h, K, i_k * BK, BK)
            _st_blk(Qg, (qq * eg * scale).to(DT), rows, eos, H, i_h, K, i_k * BK, BK)
            _st_blk(Kd, (kk * tl.exp2(tl.where(mr[:, None], gl[None, :] - g, 0.))).to(DT), rows, eos, H, i_h, K,
                    i_k * BK, BK)
            tl.store(Gl + (i_s.to(tl.int64) * H + i_h) * K + cols, gl, mask=mc)
        b = tl.where(mr, tl.sigmoid(tl.load(beta + rows * H + i_h, mask=mr, other=0.).to(tl.float32)), 0.)
        tm = _inv_unit_lower(b[:, None] * tl.where(o_c[:, None] > o_c[None, :], acc_k, 0.), BC) * b[None, :]
        _st_blk(Ts, tm.to(DT), rows, eos, H, i_h, BC, 0, BC)
        _st_blk(As, (tl.where(o_c[:, None] >= o_c[None, :], acc_a, 0.) * scale).to(DT), rows, eos, H, i_h, BC, 0,
                BC)

    @triton.jit
    def _rec_fwd_kernel(Kg, Qg, Kd, Gl, Ts, As, v, h0, ht, hs, hc, o, cu, chunk_off, c_lo, c_hi, H, K: tl.constexpr,
                        V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
                        HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_STATES: tl.constexpr,
                        SEG: tl.constexpr, PREC: tl.constexpr):
        """The recurrence over 16-token sub-chunks with the output formed on the way, one program per sequence,
        head and value tile, the state S [K, BV] in registers throughout:
            Vn = T (v - Kg S);  O = Qg S + Aqk Vn;  S <- Diag(exp(Gam_last)) S + Kd^T Vn.
        STORE_STATES: S entering every 64-token chunk (hs, as _state_fwd_kernel). SEG: only the global chunks
        [c_lo, c_hi) are walked; a sequence that goes on past them leaves its state in hc for the next segment's
        launch, one that began before them takes it from there."""
        i_v, i_nh, i_h, bos, eos, c0 = _scan_program(cu, chunk_off, H, V, BV)
        o_k = tl.arange(0, BK)
        mk = o_k < K
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        o_c = tl.arange(0, BC)
        DT = Kg.dtype.element_ty
        s_off = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
        m_s = mk[:, None] & mv[None, :]
        s_lo, s_hi, run_v, first_v, last_v = _seg_span(chunk_off, i_nh, H, c0, bos, eos, c_lo, c_hi, o_v, BT, BC,
                                                        SEG)
        S = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            S += tl.load(h0 + s_off, mask=m_s & first_v[None, :], other=0.)
        if SEG:
            S += tl.load(hc + s_off, mask=m_s & (run_v & ~first_v)[None, :], other=0.)
        # the sub-chunk's global index in Gl: 4 per 64-token chunk of the sequence. Loaded a step ahead: the pipeliner
        # leaves this load in place, and its latency sat on every step's chain before the state update
        gl_row = Gl + (c0 * (BT // BC) * H + i_h) * K + o_k
        gl = tl.load(gl_row + s_lo * H * K, mask=mk & (o_k * 0 + s_lo < s_hi), other=0.)
        for c in range(s_lo, s_hi):
            gl_next = tl.load(gl_row + (c + 1) * H * K, mask=mk & (o_k * 0 + c + 1 < s_hi), other=0.)
            rows = bos + c * BC + o_c
            mr = rows < eos
            if STORE_STATES:
                if c % (BT // BC) == 0:
                    tl.store(hs + ((c0 + c // (BT // BC)) * H * K + i_h * K + o_k[:, None]) * V + o_v[None, :],
                             S.to(hs.dtype.element_ty), mask=m_s)
            offk = (rows[:, None] * H + i_h) * K + o_k[None, :]
            offc = (rows[:, None] * H + i_h) * BC + o_c[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            mrk = mr[:, None] & mk[None, :]
            mrv = mr[:, None] & mv[None, :]
            Sd = S.to(DT)
            x = tl.dot(tl.load(Kg + offk, mask=mrk, other=0.), Sd, input_precision=PREC)
            u = tl.load(v + offv, mask=mrv, other=0.).to(tl.float32)
            t = tl.load(Ts + offc, mask=mr[:, None], other=0.).to(tl.float32)
            vd = tl.dot(t, u - x, input_precision=PREC).to(DT)
            a = tl.load(As + offc, mask=mr[:, None], other=0.)
            out = tl.dot(tl.load(Qg + offk, mask=mrk, other=0.), Sd, input_precision=PREC)
            out = tl.dot(a, vd, acc=out, input_precision=PREC)
            tl.store(o + offv, out.to(o.dtype.element_ty), mask=mrv)
            kd = tl.load(Kd + offk, mask=mrk, other=0.)
            S = S * tl.exp2(gl)[:, None] + tl.dot(tl.trans(kd), vd, input_precision=PREC)
            gl = gl_next
        if STORE_FINAL:
            tl.store(ht + s_off, S, mask=m_s & last_v[None, :])
        if SEG:
            tl.store(hc + s_off, S, mask=m_s & (run_v & ~last_v)[None, :])


def _prec(dtype):
    # fp32 inputs: 3xTF32 matmuls (about fp32 accuracy); bf16/fp16: one pass
    return "tf32x3" if dtype == torch.float32 else "tf32"


def intra_fwd(qn, kn, v, gc, bs, scale, lower_bound, info, store_bwd=False):
    TT, H, K = qn.shape
    V = v.shape[-1]
    dev = qn.device
    DT = qn.dtype
    BT = CHUNK_SIZE
    # the output kernel and the backward scan round Aqk to the matmul dtype as they load it: stored in that dtype
    # (half the bytes written and read back, the same results)
    Aqk = torch.empty(TT, H, BT, device=dev, dtype=DT)
    W = torch.empty(TT, H, K, device=dev, dtype=DT)
    Qg = torch.empty_like(W)
    Kd = torch.empty_like(W)
    U = torch.empty(TT, H, V, device=dev, dtype=DT)
    Mo = torch.empty(TT, H, BT, device=dev, dtype=torch.float32) if store_bwd else Aqk
    Po = torch.empty(TT, H, BT, device=dev, dtype=torch.float32) if store_bwd else Aqk
    safe = lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND
    # unbounded gates: the chunks with a diagonal tile too steep for one matmul (the backward runs them apart)
    steep = None if safe else torch.zeros(max(info.NC, 1), H, device=dev, dtype=torch.int8)
    Tm = torch.empty(TT, H, BT, device=dev, dtype=DT)
    if info.NC > 0:
        Pd = torch.empty(TT, H, 16, device=dev, dtype=torch.float32)  # the diagonal tiles' key-key products
        # The diagonal 16x16 tiles in their own kernel (a quarter of a chunk per program, few registers), the
        # off-diagonal ones and the solve in the pairwise kernel: faster than either inside the pairwise kernel or
        # the pairwise kernel split in two launches.
        Md = torch.empty_like(Pd)  # the inverses of the diagonal blocks of I + Diag(beta) P
        bk, warps, stages, regs = launch_config("diag_fwd" if safe else "diag_fwd_loop")
        _diag_fwd_kernel[(info.NC * (BT // 16), H)](
            qn, kn, gc, Aqk, Pd, steep if steep is not None else Pd, info.chunk_tab, info.cu, scale,
            DENSE_MAX_SPAN, H=H, K=K,
            BK=min(bk, next_pow2(K)), BT=BT, BC=16, SAFE=safe, PREC=_prec(DT), num_warps=warps,
            num_stages=stages, **regs)
        # the 15-step forward substitutions in many small programs, out of the register-bound pairwise kernel
        _, warps, stages, regs = launch_config("diag_inv")
        _diag_inv_kernel[(info.NC * (BT // 16), H)](Pd, bs, Md, info.chunk_tab, info.cu, H=H, BT=BT, BC=16,
                                                     num_warps=warps, num_stages=stages, **regs)
        # at K = 128 the pairwise kernel sits at sm_90's 255-register cap
        bk, warps, stages, regs = launch_config("intra_fwd")
        _intra_fwd_kernel[(info.NC, H)](
            qn, kn, gc, bs, Aqk, Mo, Po, Tm, Pd, Md, info.chunk_tab, info.cu, scale,
            H=H, K=K, BK=min(bk, next_pow2(K)), BT=BT, BC=16, STORE_BWD=store_bwd, PREC=_prec(DT),
            num_warps=warps, num_stages=stages, **regs)
    if info.NC > 0:
        bk, warps, stages, regs = launch_config("wu_fwd")
        _wu_fwd_kernel[(info.NC, H)](
            qn, kn, v, gc, Tm, W, U, Qg, Kd, info.chunk_tab, info.cu, scale, H=H, K=K, V=V,
            BK=min(bk, next_pow2(K)), BV=min(bk, next_pow2(V)), BT=BT, PREC=_prec(DT), num_warps=warps,
            num_stages=stages, **regs)
    out = dict(Aqk=Aqk, W=W, U=U, Qg=Qg, Kd=Kd, steep=steep)
    if store_bwd:
        out.update(M=Mo, P=Po)
    return out


def state_fwd(I, gc, h0, info, V, out_dtype, output_final_state, states_dtype, store_vn, compute_o, o=None):
    """The sequential scan over chunks (state entering each chunk, v_new), then, with compute_o, the output by
    `_output_fwd_kernel`, parallel over chunks: the scan stays short (computing the output inside the scan is
    slower). states_dtype: keep the states entering each chunk in that dtype
    and return them (None: not returned)."""
    W = I["W"]
    TT, H, K = W.shape
    dev = W.device
    N = info.N
    if compute_o and o is None:  # every row belongs to a chunk of some sequence (varlen callers pass zeros)
        o = torch.empty(TT, H, V, device=dev, dtype=out_dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    store_vn = store_vn or compute_o
    # the output kernel reads the entry states in the matmul dtype unless another one is asked for
    hs = (torch.empty(max(info.NC, 1), H, K, V, device=dev, dtype=states_dtype or W.dtype)
          if states_dtype is not None or compute_o else None)
    vn = torch.empty(TT, H, V, device=dev, dtype=W.dtype) if store_vn else None
    if N > 0:
        BK = next_pow2(K)
        bv, warps, stages, regs = launch_config("state_fwd")
        auto_bv, auto_stages = state_scan_tile(cdiv(V, 64) * N * H, dev)
        BV = min(bv or auto_bv, next_pow2(V))
        stages = stages or auto_stages
        dummy = W
        _state_fwd_kernel[(cdiv(V, BV) * N * H,)](
            W, I["U"], I["Kd"], gc, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
            hs if hs is not None else dummy, vn if vn is not None else dummy, info.cu, info.chunk_off,
            H=H, K=K, V=V, BK=BK, BV=BV, BT=CHUNK_SIZE, HAS_H0=h0 is not None,
            STORE_FINAL=output_final_state, STORE_STATES=hs is not None, STORE_VN=store_vn, PREC=_prec(W.dtype),
            num_warps=warps, num_stages=stages, **regs)
        if compute_o and info.NC > 0:
            bv, warps, stages, regs = launch_config("output_fwd")
            BVo = min(bv, next_pow2(V))
            _output_fwd_kernel[(info.NC, cdiv(V, BVo), H)](
                I["Qg"], I["Aqk"], vn, hs, o, info.chunk_tab, info.cu, H=H, K=K, V=V, BK=min(64, next_pow2(K)),
                BV=BVo, BT=CHUNK_SIZE, PREC=_prec(W.dtype), num_warps=warps, num_stages=stages, **regs)
    hs = hs[:info.NC] if states_dtype is not None else None
    return o, ht, hs, vn


def fwd16_segments(n_chunks, programs, device):
    """The 16-token forward's segments of the chunks, [(first, end), ...]: each a sub-chunk launch on a side stream
    and a recurrence launch on the caller's, so that the next segment's sub-chunk kernel runs beside this segment's
    recurrence. That pays where the recurrence leaves SMs idle: with at most one program per SM (H=32 at B=1) each is
    bound by its steps' latency, not by the SM. Then one segment per 64 chunks (4K tokens), at most 16; else one."""
    n = max(1, min(16, n_chunks // 64)) if programs <= sm_count(device) else 1
    size = cdiv(n_chunks, n)
    return [(lo, min(lo + size, n_chunks)) for lo in range(0, n_chunks, max(size, 1))] or [(0, 0)]


_SIDE_STREAMS = {}


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def sub16_fwd(q, k, v, f, beta, A_log, dt_bias, scale, lower_bound, use_l2, info, h0, inter_dtype, out_dtype,
              output_final_state, states_dtype, o=None):
    """The forward in 16-token sub-chunks, from the raw (flattened) inputs: `_sub_fwd_kernel` (per sub-chunk: norms,
    gate, the diagonal tile and its 16x16 inverse T, Kg, Qg, Kd; fully parallel), then the recurrence with the output
    (parallel over sequences, heads and value tiles): `_rec_fwd_kernel`, segment by segment (`fwd16_segments`).
    Returns (o, final state, the states at 64-token chunk boundaries or None)."""
    TT, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    DT = inter_dtype
    BT, BC = CHUNK_SIZE, 16
    if o is None:
        o = torch.empty(TT, H, V, device=dev, dtype=out_dtype)
    ht = torch.empty(info.N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    hs = torch.empty(max(info.NC, 1), H, K, V, device=dev, dtype=states_dtype) if states_dtype is not None else None
    Kg = torch.empty(TT, H, K, device=dev, dtype=DT)
    Qg = torch.empty_like(Kg)
    Kd = torch.empty_like(Kg)
    As = torch.empty(TT, H, BC, device=dev, dtype=DT)
    Ts = torch.empty_like(As)
    Gl = torch.empty(max(info.NC, 1) * (BT // BC), H, K, device=dev, dtype=torch.float32)
    bv, r_warps, r_stages, r_regs = launch_config("rec_fwd")
    BV = min(bv, next_pow2(V))
    segs = fwd16_segments(info.NC, cdiv(V, BV) * info.N * H, dev) if info.N > 0 else []
    # the state between segments (a sequence may span several)
    hc = torch.empty(info.N, H, K, V, device=dev, dtype=torch.float32) if len(segs) > 1 else Gl
    side = _side_stream(dev) if len(segs) > 1 and dev.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(dev))
    sb, s_warps, s_stages, s_regs = launch_config("sub_fwd")
    for c_lo, c_hi in segs:
        if c_hi > c_lo:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                _sub_fwd_kernel[((c_hi - c_lo) * (BT // BC), H)](
                    q, k, f, beta, A_log, dt_bias, Kg, Qg, Kd, Gl, Ts, As, info.chunk_tab, info.cu, scale,
                    float(lower_bound) if lower_bound is not None else 0.0, DENSE_MAX_SPAN, c_lo * (BT // BC), H=H,
                    K=K, BK=min(sb, next_pow2(K)), BT=BT, BC=BC,
                    SAFE=lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND, USE_LB=lower_bound is not None,
                    L2=use_l2, SEG=len(segs) > 1, PREC=_prec(DT), num_warps=s_warps, num_stages=s_stages, **s_regs)
            if side is not None:
                torch.cuda.current_stream(dev).wait_stream(side)
        _rec_fwd_kernel[(cdiv(V, BV) * info.N * H,)](
            Kg, Qg, Kd, Gl, Ts, As, v, h0 if h0 is not None else Gl, ht if ht is not None else Gl,
            hs if hs is not None else Gl, hc, o, info.cu, info.chunk_off, c_lo, c_hi, H=H, K=K, V=V,
            BK=next_pow2(K), BV=BV, BC=BC, BT=BT, HAS_H0=h0 is not None, STORE_FINAL=output_final_state,
            STORE_STATES=hs is not None, SEG=len(segs) > 1, PREC=_prec(DT), num_warps=r_warps, num_stages=r_stages,
            **r_regs)
    return o, ht, (hs[:info.NC] if hs is not None else None)
