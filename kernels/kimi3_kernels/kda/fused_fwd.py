"""Inference forward of the chunked KDA with the per-chunk stages in one kernel (Triton), for bounded gates (K3).

Without autograd nothing per chunk has to be kept for a backward, so one program per 64-token chunk and head reads
the raw q, k, gate pre-activation, beta and v once and writes only what the state scan and the output kernel read
(W, U, Kd, Qg, Aqk and the chunk's total gate): the gate, its cumsum, the q/k norms, beta's sigmoid, the pairwise and
diagonal 16x16 tiles, the blockwise inverse and W/U never leave the chip. The multi-stage path (gate.prep_fwd ->
chunk_fwd._diag_fwd_kernel -> _intra_fwd_kernel -> _wu_fwd_kernel) computes the same quantities, with the same
16-row sub-tiles and reference rows, and stays for training (it keeps what the backward needs) and for unbounded gates
(whose steep diagonal tiles need a per-column loop). The math and symbols are those of chunk_fwd.py.

Two passes over K slices per chunk: the first forms the tiles of Aqk and P from the un-normalised q and k (the L2
norms are row scalings, applied once the K sum is complete), the second, with T = M Diag(beta) known, forms W, Qg and
Kd from the same raw inputs (the gate's cumsum is recomputed: cheaper than a round trip through memory), then U.
"""
from __future__ import annotations

import torch

from ._utils import CHUNK_SIZE, TRITON_AVAILABLE, launch_config, next_pow2
from .chunk_fwd import SAFE_LOWER_BOUND, _prec

LOG2E = 1.4426950408889634

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .chunk_fwd import _chunk_span, _inv_unit_lower, _ld, _mm, _st_blk

    @triton.jit
    def _gate(f, rows, eos, H, i_h, K: tl.constexpr, cols, mc, dtb, a, lower_bound):
        """K3 gate of one [BC, BK] tile in log2 units, 0 on rows past the sequence end."""
        x = _ld(f, rows, eos, H, i_h, K, cols, mc) + dtb[None, :]
        g = lower_bound * tl.sigmoid(a * x) * 1.4426950408889634
        return tl.where((rows < eos)[:, None] & mc[None, :], g, 0.)

    @triton.jit
    def _first_row(x, BC: tl.constexpr):
        return tl.sum(tl.where(tl.arange(0, BC)[:, None] == 0, x, 0.), 0)

    @triton.jit
    def _cum4(f, r0, r1, r2, r3, eos, H, i_h, K: tl.constexpr, cols, mc, dtb, a, lower_bound):
        """Chunk-local cumsum of the gate over the four 16-row sub-tiles of one K slice, and the chunk total."""
        x0 = _gate(f, r0, eos, H, i_h, K, cols, mc, dtb, a, lower_bound)
        x1 = _gate(f, r1, eos, H, i_h, K, cols, mc, dtb, a, lower_bound)
        x2 = _gate(f, r2, eos, H, i_h, K, cols, mc, dtb, a, lower_bound)
        x3 = _gate(f, r3, eos, H, i_h, K, cols, mc, dtb, a, lower_bound)
        s0 = tl.sum(x0, 0)
        s1 = s0 + tl.sum(x1, 0)
        s2 = s1 + tl.sum(x2, 0)
        g0 = tl.cumsum(x0, 0)
        g1 = tl.cumsum(x1, 0) + s0[None, :]
        g2 = tl.cumsum(x2, 0) + s1[None, :]
        g3 = tl.cumsum(x3, 0) + s2[None, :]
        return g0, g1, g2, g3, s2 + tl.sum(x3, 0)

    @triton.jit
    def _diag_tile(acc, x, k, g, n, valid, PREC: tl.constexpr):
        """A diagonal tile's product of rows x (q or k) with the keys, relative to the sub-tile's first row (bounded
        gate: exp2(n - g) stays inside fp32 range over 15 steps)."""
        e = tl.exp2(tl.where(valid[:, None], g - n[None, :], 0.))
        return tl.dot(x * e, tl.trans(k * tl.exp2(n[None, :] - g)), acc, input_precision=PREC)

    @triton.jit
    def _off_tile(acc, xe, kj, gj, n, PREC: tl.constexpr):
        """An off-diagonal tile (rows of sub-tile i, columns of an earlier sub-tile j): xe carries exp2(g_i - n_i),
        the columns exp2(n_i - g_j) <= 1."""
        return tl.dot(xe, tl.trans(kj * tl.exp2(n[None, :] - gj)), acc, input_precision=PREC)

    @triton.jit
    def _rnorm(ss, L2: tl.constexpr):
        if L2:
            return 1.0 / tl.sqrt(ss + 1e-6)
        return ss * 0. + 1.

    @triton.jit
    def _pass1(q, k, f, dt_bias, t0, eos, i_h, a_gate, lower_bound, H, K: tl.constexpr, BK: tl.constexpr,
               BC: tl.constexpr, ROLE: tl.constexpr, PREC: tl.constexpr):
        """The ten lower 16x16 tiles of one chunk's Aqk (ROLE 0: rows q) or P (ROLE 1: rows k), unscaled and from the
        raw q, k (each sub-tile relative to its first row, as chunk_fwd), and the rows' sums of squares of q and k."""
        o_c = tl.arange(0, BC)
        r0 = t0 + o_c
        r1 = r0 + BC
        r2 = r1 + BC
        r3 = r2 + BC
        z = tl.zeros([BC, BC], dtype=tl.float32)
        x00, x11, x22, x33, x10, x20, x21, x30, x31, x32 = z, z, z, z, z, z, z, z, z, z
        zr = tl.zeros([BC], dtype=tl.float32)
        sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3 = zr, zr, zr, zr, zr, zr, zr, zr
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            dtb = tl.load(dt_bias + i_h * K + cols, mask=mc, other=0.).to(tl.float32)
            g0, g1, g2, g3, gT = _cum4(f, r0, r1, r2, r3, eos, H, i_h, K, cols, mc, dtb, a_gate, lower_bound)
            n1 = _first_row(g1, BC)
            n2 = _first_row(g2, BC)
            n3 = _first_row(g3, BC)
            k0 = _ld(k, r0, eos, H, i_h, K, cols, mc)
            k1 = _ld(k, r1, eos, H, i_h, K, cols, mc)
            k2 = _ld(k, r2, eos, H, i_h, K, cols, mc)
            k3 = _ld(k, r3, eos, H, i_h, K, cols, mc)
            sk0 += tl.sum(k0 * k0, 1)
            sk1 += tl.sum(k1 * k1, 1)
            sk2 += tl.sum(k2 * k2, 1)
            sk3 += tl.sum(k3 * k3, 1)
            if ROLE == 0:
                y0 = _ld(q, r0, eos, H, i_h, K, cols, mc)
                y1 = _ld(q, r1, eos, H, i_h, K, cols, mc)
                y2 = _ld(q, r2, eos, H, i_h, K, cols, mc)
                y3 = _ld(q, r3, eos, H, i_h, K, cols, mc)
                sq0 += tl.sum(y0 * y0, 1)
                sq1 += tl.sum(y1 * y1, 1)
                sq2 += tl.sum(y2 * y2, 1)
                sq3 += tl.sum(y3 * y3, 1)
            else:
                y0, y1, y2, y3 = k0, k1, k2, k3
            x00 = _diag_tile(x00, y0, k0, g0, _first_row(g0, BC), r0 < eos, PREC)
            x11 = _diag_tile(x11, y1, k1, g1, n1, r1 < eos, PREC)
            x22 = _diag_tile(x22, y2, k2, g2, n2, r2 < eos, PREC)
            x33 = _diag_tile(x33, y3, k3, g3, n3, r3 < eos, PREC)
            x10 = _off_tile(x10, y1 * tl.exp2(tl.where((r1 < eos)[:, None], g1 - n1[None, :], 0.)), k0, g0, n1, PREC)
            ye = y2 * tl.exp2(tl.where((r2 < eos)[:, None], g2 - n2[None, :], 0.))
            x20 = _off_tile(x20, ye, k0, g0, n2, PREC)
            x21 = _off_tile(x21, ye, k1, g1, n2, PREC)
            ye = y3 * tl.exp2(tl.where((r3 < eos)[:, None], g3 - n3[None, :], 0.))
            x30 = _off_tile(x30, ye, k0, g0, n3, PREC)
            x31 = _off_tile(x31, ye, k1, g1, n3, PREC)
            x32 = _off_tile(x32, ye, k2, g2, n3, PREC)
        return x00, x11, x22, x33, x10, x20, x21, x30, x31, x32, sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3

    @triton.jit
    def _role_aqk(q, k, f, dt_bias, Aqk, Qg, Kd, gl, t0, eos, i_h, a_gate, lower_bound, scale, H, K: tl.constexpr,
                  BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr):
        """Aqk, then Qg = scale qn exp2(G), Kd = kn exp2(G_last - G) and G_last (at the chunk's last row, for the
        state scan)."""
        a00, a11, a22, a33, a10, a20, a21, a30, a31, a32, sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3 = _pass1(
            q, k, f, dt_bias, t0, eos, i_h, a_gate, lower_bound, H, K, BK, BC, 0, PREC)
        o_c = tl.arange(0, BC)
        r0 = t0 + o_c
        r1 = r0 + BC
        r2 = r1 + BC
        r3 = r2 + BC
        DT = Qg.dtype.element_ty
        # the L2 norms as row / column scalings of the finished sums
        rq0 = _rnorm(sq0, L2) * scale
        rq1 = _rnorm(sq1, L2) * scale
        rq2 = _rnorm(sq2, L2) * scale
        rq3 = _rnorm(sq3, L2) * scale
        rk0 = _rnorm(sk0, L2)
        rk1 = _rnorm(sk1, L2)
        rk2 = _rnorm(sk2, L2)
        rk3 = _rnorm(sk3, L2)
        incl = o_c[:, None] >= o_c[None, :]
        _st_blk(Aqk, tl.where(incl, a00, 0.) * rq0[:, None] * rk0[None, :], r0, eos, H, i_h, BT, 0, BC)
        _st_blk(Aqk, a10 * rq1[:, None] * rk0[None, :], r1, eos, H, i_h, BT, 0, BC)
        _st_blk(Aqk, tl.where(incl, a11, 0.) * rq1[:, None] * rk1[None, :], r1, eos, H, i_h, BT, BC, BC)
        _st_blk(Aqk, a20 * rq2[:, None] * rk0[None, :], r2, eos, H, i_h, BT, 0, BC)
        _st_blk(Aqk, a21 * rq2[:, None] * rk1[None, :], r2, eos, H, i_h, BT, BC, BC)
        _st_blk(Aqk, tl.where(incl, a22, 0.) * rq2[:, None] * rk2[None, :], r2, eos, H, i_h, BT, 2 * BC, BC)
        _st_blk(Aqk, a30 * rq3[:, None] * rk0[None, :], r3, eos, H, i_h, BT, 0, BC)
        _st_blk(Aqk, a31 * rq3[:, None] * rk1[None, :], r3, eos, H, i_h, BT, BC, BC)
        _st_blk(Aqk, a32 * rq3[:, None] * rk2[None, :], r3, eos, H, i_h, BT, 2 * BC, BC)
        _st_blk(Aqk, tl.where(incl, a33, 0.) * rq3[:, None] * rk3[None, :], r3, eos, H, i_h, BT, 3 * BC, BC)
        last = tl.minimum(eos, t0 + BT) - 1
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            dtb = tl.load(dt_bias + i_h * K + cols, mask=mc, other=0.).to(tl.float32)
            g0, g1, g2, g3, gT = _cum4(f, r0, r1, r2, r3, eos, H, i_h, K, cols, mc, dtb, a_gate, lower_bound)
            tl.store(gl + (last * H + i_h) * K + cols, gT, mask=mc)
            _st_blk(Qg, (_ld(q, r0, eos, H, i_h, K, cols, mc) * tl.exp2(g0) * rq0[:, None]).to(DT), r0, eos, H, i_h,
                    K, i_k * BK, BK)
            _st_blk(Qg, (_ld(q, r1, eos, H, i_h, K, cols, mc) * tl.exp2(g1) * rq1[:, None]).to(DT), r1, eos, H, i_h,
                    K, i_k * BK, BK)
            _st_blk(Qg, (_ld(q, r2, eos, H, i_h, K, cols, mc) * tl.exp2(g2) * rq2[:, None]).to(DT), r2, eos, H, i_h,
                    K, i_k * BK, BK)
            _st_blk(Qg, (_ld(q, r3, eos, H, i_h, K, cols, mc) * tl.exp2(g3) * rq3[:, None]).to(DT), r3, eos, H, i_h,
                    K, i_k * BK, BK)
            _st_blk(Kd, (_ld(k, r0, eos, H, i_h, K, cols, mc) * tl.exp2(gT[None, :] - g0) * rk0[:, None]).to(DT), r0,
                    eos, H, i_h, K, i_k * BK, BK)
            _st_blk(Kd, (_ld(k, r1, eos, H, i_h, K, cols, mc) * tl.exp2(gT[None, :] - g1) * rk1[:, None]).to(DT), r1,
                    eos, H, i_h, K, i_k * BK, BK)
            _st_blk(Kd, (_ld(k, r2, eos, H, i_h, K, cols, mc) * tl.exp2(gT[None, :] - g2) * rk2[:, None]).to(DT), r2,
                    eos, H, i_h, K, i_k * BK, BK)
            _st_blk(Kd, (_ld(k, r3, eos, H, i_h, K, cols, mc) * tl.exp2(gT[None, :] - g3) * rk3[:, None]).to(DT), r3,
                    eos, H, i_h, K, i_k * BK, BK)

    @triton.jit
    def _role_wu(q, k, v, f, beta, dt_bias, W, U, t0, eos, i_h, a_gate, lower_bound, H, K: tl.constexpr,
                 V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, L2: tl.constexpr,
                 PREC: tl.constexpr):
        """P, the blockwise inverse M = (I + Diag(beta) P)^-1, T = M Diag(beta), then W = T (kn exp2(G)), U = T v."""
        p00, p11, p22, p33, p10, p20, p21, p30, p31, p32, _q0, _q1, _q2, _q3, sk0, sk1, sk2, sk3 = _pass1(
            q, k, f, dt_bias, t0, eos, i_h, a_gate, lower_bound, H, K, BK, BC, 1, PREC)
        o_c = tl.arange(0, BC)
        r0 = t0 + o_c
        r1 = r0 + BC
        r2 = r1 + BC
        r3 = r2 + BC
        DT = W.dtype.element_ty
        rk0 = _rnorm(sk0, L2)
        rk1 = _rnorm(sk1, L2)
        rk2 = _rnorm(sk2, L2)
        rk3 = _rnorm(sk3, L2)
        strict = o_c[:, None] > o_c[None, :]
        b0 = tl.sigmoid(tl.load(beta + r0 * H + i_h, mask=r0 < eos, other=0.).to(tl.float32))
        b1 = tl.sigmoid(tl.load(beta + r1 * H + i_h, mask=r1 < eos, other=0.).to(tl.float32))
        b2 = tl.sigmoid(tl.load(beta + r2 * H + i_h, mask=r2 < eos, other=0.).to(tl.float32))
        b3 = tl.sigmoid(tl.load(beta + r3 * H + i_h, mask=r3 < eos, other=0.).to(tl.float32))
        # L = Diag(beta) P on the normalised keys
        m00 = _inv_unit_lower(tl.where(strict, p00, 0.) * (b0 * rk0)[:, None] * rk0[None, :], BC)
        m11 = _inv_unit_lower(tl.where(strict, p11, 0.) * (b1 * rk1)[:, None] * rk1[None, :], BC)
        m22 = _inv_unit_lower(tl.where(strict, p22, 0.) * (b2 * rk2)[:, None] * rk2[None, :], BC)
        m33 = _inv_unit_lower(tl.where(strict, p33, 0.) * (b3 * rk3)[:, None] * rk3[None, :], BC)
        l10 = p10 * (b1 * rk1)[:, None] * rk0[None, :]
        l20 = p20 * (b2 * rk2)[:, None] * rk0[None, :]
        l21 = p21 * (b2 * rk2)[:, None] * rk1[None, :]
        l30 = p30 * (b3 * rk3)[:, None] * rk0[None, :]
        l31 = p31 * (b3 * rk3)[:, None] * rk1[None, :]
        l32 = p32 * (b3 * rk3)[:, None] * rk2[None, :]
        m10 = -_mm(m11, _mm(l10, m00))
        m21 = -_mm(m22, _mm(l21, m11))
        m20 = -_mm(m22, _mm(l20, m00) + _mm(l21, m10))
        m32 = -_mm(m33, _mm(l32, m22))
        m31 = -_mm(m33, _mm(l31, m11) + _mm(l32, m21))
        m30 = -_mm(m33, _mm(l30, m00) + _mm(l31, m10) + _mm(l32, m20))
        # T = M Diag(beta), in the matmul dtype (as the multi-stage path stores it)
        t00 = (m00 * b0[None, :]).to(DT)
        t10 = (m10 * b0[None, :]).to(DT)
        t11 = (m11 * b1[None, :]).to(DT)
        t20 = (m20 * b0[None, :]).to(DT)
        t21 = (m21 * b1[None, :]).to(DT)
        t22 = (m22 * b2[None, :]).to(DT)
        t30 = (m30 * b0[None, :]).to(DT)
        t31 = (m31 * b1[None, :]).to(DT)
        t32 = (m32 * b2[None, :]).to(DT)
        t33 = (m33 * b3[None, :]).to(DT)
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            dtb = tl.load(dt_bias + i_h * K + cols, mask=mc, other=0.).to(tl.float32)
            g0, g1, g2, g3, gT = _cum4(f, r0, r1, r2, r3, eos, H, i_h, K, cols, mc, dtb, a_gate, lower_bound)
            kg0 = (_ld(k, r0, eos, H, i_h, K, cols, mc) * tl.exp2(g0) * rk0[:, None]).to(DT)
            kg1 = (_ld(k, r1, eos, H, i_h, K, cols, mc) * tl.exp2(g1) * rk1[:, None]).to(DT)
            kg2 = (_ld(k, r2, eos, H, i_h, K, cols, mc) * tl.exp2(g2) * rk2[:, None]).to(DT)
            kg3 = (_ld(k, r3, eos, H, i_h, K, cols, mc) * tl.exp2(g3) * rk3[:, None]).to(DT)
            _st_blk(W, tl.dot(t00, kg0, input_precision=PREC).to(DT), r0, eos, H, i_h, K, i_k * BK, BK)
            w = tl.dot(t11, kg1, tl.dot(t10, kg0, input_precision=PREC), input_precision=PREC)
            _st_blk(W, w.to(DT), r1, eos, H, i_h, K, i_k * BK, BK)
            w = tl.dot(t21, kg1, tl.dot(t20, kg0, input_precision=PREC), input_precision=PREC)
            w = tl.dot(t22, kg2, w, input_precision=PREC)
            _st_blk(W, w.to(DT), r2, eos, H, i_h, K, i_k * BK, BK)
            w = tl.dot(t31, kg1, tl.dot(t30, kg0, input_precision=PREC), input_precision=PREC)
            w = tl.dot(t33, kg3, tl.dot(t32, kg2, w, input_precision=PREC), input_precision=PREC)
            _st_blk(W, w.to(DT), r3, eos, H, i_h, K, i_k * BK, BK)
        for i_v in range(0, tl.cdiv(V, BV)):
            cols = i_v * BV + tl.arange(0, BV)
            mc = cols < V
            v0 = _ld(v, r0, eos, H, i_h, V, cols, mc).to(DT)
            v1 = _ld(v, r1, eos, H, i_h, V, cols, mc).to(DT)
            v2 = _ld(v, r2, eos, H, i_h, V, cols, mc).to(DT)
            v3 = _ld(v, r3, eos, H, i_h, V, cols, mc).to(DT)
            _st_blk(U, tl.dot(t00, v0, input_precision=PREC).to(DT), r0, eos, H, i_h, V, i_v * BV, BV)
            u = tl.dot(t11, v1, tl.dot(t10, v0, input_precision=PREC), input_precision=PREC)
            _st_blk(U, u.to(DT), r1, eos, H, i_h, V, i_v * BV, BV)
            u = tl.dot(t21, v1, tl.dot(t20, v0, input_precision=PREC), input_precision=PREC)
            u = tl.dot(t22, v2, u, input_precision=PREC)
            _st_blk(U, u.to(DT), r2, eos, H, i_h, V, i_v * BV, BV)
            u = tl.dot(t31, v1, tl.dot(t30, v0, input_precision=PREC), input_precision=PREC)
            u = tl.dot(t33, v3, tl.dot(t32, v2, u, input_precision=PREC), input_precision=PREC)
            _st_blk(U, u.to(DT), r3, eos, H, i_h, V, i_v * BV, BV)

    @triton.jit
    def _fused_intra_fwd_kernel(q, k, v, f, beta, A_log, dt_bias, Aqk, W, U, Qg, Kd, gl, tab, cu, scale, lower_bound,
                                H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                BT: tl.constexpr, BC: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr):
        """Two programs per chunk and head, adjacent in launch order so the second reads the raw inputs from L2: one
        forms Aqk, Qg, Kd (and the chunk's total gate), the other P, the inverse, W and U. One program holding both
        sets of sixteen-row tiles spilled at every launch setting (sm_90, Triton 3.9: 255 registers, 96-1,176 bytes
        of stack)."""
        i_c = tl.program_id(0) // 2
        i_h = tl.program_id(1)
        _, t0, eos = _chunk_span(tab, cu, i_c)
        a_gate = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if tl.program_id(0) % 2 == 0:
            _role_aqk(q, k, f, dt_bias, Aqk, Qg, Kd, gl, t0, eos, i_h, a_gate, lower_bound, scale, H, K, BK, BT, BC,
                      L2, PREC)
        else:
            _role_wu(q, k, v, f, beta, dt_bias, W, U, t0, eos, i_h, a_gate, lower_bound, H, K, V, BK, BV, BC, L2,
                     PREC)


def fused_enabled(lower_bound) -> bool:
    """The one-kernel inference path runs for bounded gates unless KIMI3_KDA_FUSED_FWD=0 (A/B timing, tests)."""
    import os
    if os.environ.get("KIMI3_KDA_FUSED_FWD", "1").strip() == "0":
        return False
    return lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND


def fused_intra_fwd(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, use_l2, info, inter_dtype):
    """q, k, g: [TT, H, K] raw (flattened tokens), v [TT, H, V], beta raw [TT, H]. Returns the dict state_fwd reads
    (W, U, Kd, Qg, Aqk) and gc, whose rows hold the chunk's total gate (log2 units) at each chunk's last token only:
    the state scan reads nothing else of it."""
    TT, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    BT = CHUNK_SIZE
    Aqk = torch.empty(TT, H, BT, device=dev, dtype=inter_dtype)
    W = torch.empty(TT, H, K, device=dev, dtype=inter_dtype)
    Qg = torch.empty_like(W)
    Kd = torch.empty_like(W)
    U = torch.empty(TT, H, V, device=dev, dtype=inter_dtype)
    gc = torch.empty(TT, H, K, device=dev, dtype=torch.float32)
    if info.NC > 0:
        bk, warps, stages = launch_config("fused_fwd")
        _fused_intra_fwd_kernel[(2 * info.NC, H)](
            q, k, v, g, beta, A_log, dt_bias, Aqk, W, U, Qg, Kd, gc, info.chunk_tab, info.cu, scale,
            float(lower_bound), H=H, K=K, V=V, BK=min(bk, next_pow2(K)), BV=min(bk, next_pow2(V)), BT=BT, BC=16,
            L2=use_l2, PREC=_prec(inter_dtype), num_warps=warps, num_stages=stages)
    return dict(Aqk=Aqk, W=W, U=U, Qg=Qg, Kd=Kd), gc
