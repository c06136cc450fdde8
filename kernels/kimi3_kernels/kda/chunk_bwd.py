"""Chunked KDA backward kernels (Triton).

Given dO and dS_final, with the forward quantities recomputed per chunk (see chunk_fwd.py):
  state_bwd  (sequential over chunks, reverse):
      dVn = Aqk^T dO + Kd dS1;   dS0 = Qg^T dO + Diag(exp(Gam_last)) dS1 - W^T dVn
  main_bwd   (parallel over chunks, and over K slices beside one V-side program per chunk):
      K slices: dQg = dO S0^T, dW = -dVn S0^T, dKd = Vn dS1^T, dKg = T^T dW,
          dGam_last += exp(Gam_last) * rowsum(S0 * dS1), and the elementwise chain rule through exp(+-Gam);
      V side: dAqk = dO Vn^T, dT = dVn (v - Kg S0)^T, dv = T^T dVn, dbeta from T = M Diag(beta) and
          L = Diag(beta) P, dL = -M^T dM M^T.
  intra_bwd  (parallel over chunks): the pairwise terms of Aqk and P (same 16-row sub-tiles and
      reference rows as the forward, so no exponential overflows).
The gate / L2 norm / sigmoid derivatives and the reverse cumsum are in gate.prep_bwd.
"""
from __future__ import annotations

import torch

from ._utils import CHUNK_SIZE, TRITON_AVAILABLE, launch_config, next_pow2
from .chunk_fwd import DENSE_MAX_SPAN, SAFE_LOWER_BOUND, _prec

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .chunk_fwd import _chunk_span, _ld, _ld_row, _tile_span

    @triton.jit
    def _state_bwd_kernel(W, Qg, Kd, Aqk, gc, do, dht, dh0, dhs, dvn, cu, chunk_off,
                          H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, BT: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                          PREC: tl.constexpr):
        # one grid axis, value tiles fastest (the axes after the first stop at 65,535 programs)
        i_v = tl.program_id(0) % tl.cdiv(V, BV)
        i_nh = tl.program_id(0) // tl.cdiv(V, BV)
        n = i_nh // H
        i_h = i_nh % H
        bos = tl.load(cu + n).to(tl.int64)
        eos = tl.load(cu + n + 1).to(tl.int64)
        c0 = tl.load(chunk_off + n).to(tl.int64)
        NTn = tl.cdiv(eos - bos, BT)
        o_k = tl.arange(0, BK)
        mk = o_k < K
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        o_t = tl.arange(0, BT)
        DT = W.dtype.element_ty
        s_off = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
        m_s = mk[:, None] & mv[None, :]
        dS = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_DHT:
            dS += tl.load(dht + s_off, mask=m_s, other=0.)
        for i in range(0, NTn):
            c = NTn - 1 - i
            t0 = bos + c * BT
            rows = t0 + o_t
            mr = rows < eos
            tl.store(dhs + ((c0 + c) * H * K + i_h * K + o_k[:, None]) * V + o_v[None, :], dS, mask=m_s)
            mrk = mr[:, None] & mk[None, :]
            mrv = mr[:, None] & mv[None, :]
            offk = (rows[:, None] * H + i_h) * K + o_k[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            bdo = tl.load(do + offv, mask=mrv, other=0.).to(DT)
            a = tl.load(Aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :],
                        mask=mr[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.).to(DT)
            kd = tl.load(Kd + offk, mask=mrk, other=0.)
            dSd = dS.to(DT)
            bdv = tl.dot(tl.trans(a), bdo, input_precision=PREC) + tl.dot(kd, dSd, input_precision=PREC)
            tl.store(dvn + offv, bdv, mask=mrv)
            qg = tl.load(Qg + offk, mask=mrk, other=0.)
            w = tl.load(W + offk, mask=mrk, other=0.)
            last = tl.minimum(eos, t0 + BT) - 1
            gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=mk, other=0.)
            dS = dS * tl.exp2(gl)[:, None] + tl.dot(tl.trans(qg), bdo, input_precision=PREC) \
                - tl.dot(tl.trans(w), bdv.to(DT), input_precision=PREC)
        if HAS_H0:
            tl.store(dh0 + s_off, dS, mask=m_s)

    @triton.jit
    def _main_bwd_kernel(qn, kn, v, gc, bs, Mo, Po, hs, dhs, vn, dvn, do, dv, dAs, dPs, dqn, dkn, dG, db,
                         tab, cu, scale, H, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                         KS: tl.constexpr):
        """Per chunk, KS + 1 programs side by side: program i_z < KS takes the K columns of slice i_z (the gradients
        that flow through the state terms: dq, dk, dG), program KS the V side and the WY form (dA, dv, dbeta, dL).
        Each keeps only its own accumulators, so none spills the way one program doing all of them did (sm_90: 255
        registers and a 1 KB spill stack per thread, one 8-warp program per SM, latency-bound under Nsight Compute).
        The V side needs dT = dVn (v - Kg S0)^T, which the K slices used to add up as dVn v^T + dW Kg^T: it forms
        v - Kg S0 itself from S0, which its neighbours are reading at the same time."""
        i_z = tl.program_id(0) % (KS + 1)
        i_c = tl.program_id(0) // (KS + 1)
        i_h = tl.program_id(1)
        _, t0, eos = _chunk_span(tab, cu, i_c)
        o_t = tl.arange(0, BT)
        rows = t0 + o_t
        mr = rows < eos
        mtt = mr[:, None] & (o_t[None, :] < BT)
        offA = (rows[:, None] * H + i_h) * BT + o_t[None, :]
        b = tl.load(bs + rows * H + i_h, mask=mr, other=0.)
        s_base = (i_c.to(tl.int64) * H + i_h) * K
        if i_z < KS:
            last = tl.minimum(eos, t0 + BT) - 1
            _main_bwd_kslice(qn, kn, gc, Mo, hs, dhs, vn, dvn, do, dqn, dkn, dG, i_z, i_h, rows, mr, last, b, offA,
                             mtt, s_base, scale, H, K, V, BK // KS, BV, BT, PREC)
        else:
            _main_bwd_vside(kn, v, gc, Mo, Po, hs, vn, dvn, do, dv, dAs, dPs, db, i_h, rows, mr, b, offA, mtt,
                            s_base, scale, H, K, V, BK, BV, BT, PREC)

    @triton.jit
    def _main_bwd_kslice(qn, kn, gc, Mo, hs, dhs, vn, dvn, do, dqn, dkn, dG, i_s, i_h, rows, mr, last, b, offA, mtt,
                         s_base, scale, H, K: tl.constexpr, V: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
                         BT: tl.constexpr, PREC: tl.constexpr):
        """K columns [i_s * BKS, (i_s + 1) * BKS): dQg = dO S0^T, dW = -dVn S0^T, dKd = Vn dS1^T, dKg = T^T dW,
        dGam_last += exp(Gam_last) * rowsum(S0 * dS1), and the elementwise chain rule through exp(+-Gam)."""
        o_t = tl.arange(0, BT)
        o_k = i_s * BKS + tl.arange(0, BKS)
        mk = o_k < K
        dQg = tl.zeros([BT, BKS], dtype=tl.float32)
        dW = tl.zeros([BT, BKS], dtype=tl.float32)
        dKd = tl.zeros([BT, BKS], dtype=tl.float32)
        dgl = tl.zeros([BKS], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            mv = o_v < V
            m_s = mk[:, None] & mv[None, :]
            s0 = tl.load(hs + (s_base + o_k[:, None]) * V + o_v[None, :], mask=m_s, other=0.)
            ds1 = tl.load(dhs + (s_base + o_k[:, None]) * V + o_v[None, :], mask=m_s, other=0.)
            mrv = mr[:, None] & mv[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            bvn = tl.load(vn + offv, mask=mrv, other=0.).to(tl.float32)
            bdvn = tl.load(dvn + offv, mask=mrv, other=0.)
            bdo = tl.load(do + offv, mask=mrv, other=0.).to(tl.float32)
            dQg += tl.dot(bdo, tl.trans(s0), input_precision=PREC)
            dW -= tl.dot(bdvn, tl.trans(s0), input_precision=PREC)
            dKd += tl.dot(bvn, tl.trans(ds1), input_precision=PREC)
            dgl += tl.sum(s0 * ds1, 1)
        Tm = tl.load(Mo + offA, mask=mtt & (o_t[None, :] <= o_t[:, None]), other=0.) * b[None, :]
        dKg = tl.dot(tl.trans(Tm), dW, input_precision=PREC)
        mrk = mr[:, None] & mk[None, :]
        offk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        bq = tl.load(qn + offk, mask=mrk, other=0.).to(tl.float32)
        bk = tl.load(kn + offk, mask=mrk, other=0.).to(tl.float32)
        g = tl.load(gc + offk, mask=mrk, other=0.)
        gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=mk, other=0.)
        # Qg = scale q e^G, Kg = k e^G, Kd = k e^(G_last - G)
        eg = tl.exp2(g)
        ed = tl.exp2(gl[None, :] - g)
        kdv = bk * ed
        dGam = dQg * bq * eg * scale + dKg * bk * eg - dKd * kdv
        extra = tl.sum(tl.where(mrk, dKd * kdv, 0.), 0) + dgl * tl.exp2(gl)
        dGam += tl.where((rows == last)[:, None], extra[None, :], 0.)
        tl.store(dqn + offk, dQg * eg * scale, mask=mrk)
        tl.store(dkn + offk, dKg * eg + dKd * ed, mask=mrk)
        tl.store(dG + offk, dGam, mask=mrk)

    @triton.jit
    def _main_bwd_vside(kn, v, gc, Mo, Po, hs, vn, dvn, do, dv, dAs, dPs, db, i_h, rows, mr, b, offA, mtt, s_base,
                        scale, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        BT: tl.constexpr, PREC: tl.constexpr):
        """dA = dO Vn^T, dT = dVn (v - Kg S0)^T, dv = T^T dVn; then dbeta and dL from T = M Diag(beta),
        L = Diag(beta) P, M = (I + L)^-1."""
        o_t = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        mk = o_k < K
        mrk = mr[:, None] & mk[None, :]
        offk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        kg = tl.load(kn + offk, mask=mrk, other=0.).to(tl.float32) * tl.exp2(tl.load(gc + offk, mask=mrk, other=0.))
        Tm = tl.load(Mo + offA, mask=mtt & (o_t[None, :] <= o_t[:, None]), other=0.) * b[None, :]
        DT = dv.dtype.element_ty
        dA = tl.zeros([BT, BT], dtype=tl.float32)
        dT = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            mv = o_v < V
            s0 = tl.load(hs + (s_base + o_k[:, None]) * V + o_v[None, :], mask=mk[:, None] & mv[None, :], other=0.)
            mrv = mr[:, None] & mv[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            x = tl.load(v + offv, mask=mrv, other=0.).to(tl.float32) - tl.dot(kg, s0, input_precision=PREC)
            bvn = tl.load(vn + offv, mask=mrv, other=0.).to(tl.float32)
            bdvn = tl.load(dvn + offv, mask=mrv, other=0.)
            bdo = tl.load(do + offv, mask=mrv, other=0.).to(tl.float32)
            dA += tl.dot(bdo, tl.trans(bvn), input_precision=PREC)
            dT += tl.dot(bdvn, tl.trans(x), input_precision=PREC)
            tl.store(dv + offv, tl.dot(tl.trans(Tm), bdvn, input_precision=PREC).to(DT), mask=mrv)
        M = tl.load(Mo + offA, mask=mtt & (o_t[None, :] <= o_t[:, None]), other=0.)
        dbeta = tl.sum(dT * M, 0)
        dM = dT * b[None, :]
        # M = (I + L)^-1  ->  dL = -M^T dM M^T (strictly lower)
        dL = -tl.dot(tl.trans(M), tl.dot(dM, tl.trans(M), input_precision=PREC), input_precision=PREC)
        dL = tl.where(o_t[:, None] > o_t[None, :], dL, 0.)
        P = tl.load(Po + offA, mask=mtt & (o_t[None, :] < o_t[:, None]), other=0.)
        # L = Diag(beta) P
        dbeta += tl.sum(dL * P, 1)
        tl.store(db + rows * H + i_h, dbeta, mask=mr)
        tl.store(dPs + offA, dL * b[:, None], mask=mtt)
        tl.store(dAs + offA, tl.where(o_t[:, None] >= o_t[None, :], dA, 0.) * scale, mask=mtt)

    @triton.jit
    def _ld_blk(ptr, rows, eos, H, i_h, col0, BT: tl.constexpr, BC: tl.constexpr):
        c = col0 + tl.arange(0, BC)
        return tl.load(ptr + (rows[:, None] * H + i_h) * BT + c[None, :], mask=(rows < eos)[:, None], other=0.)

    @triton.jit
    def _diag_bwd_loop(dq, dr, dc, dA, dP, q, k, g, q_ptr, k_ptr, g_ptr, row0, eos, H, i_h,
                       K: tl.constexpr, cols, mc, BC: tl.constexpr):
        """Diagonal tile, any gate, added to (dq, dr, dc). Rows: dq_i = sum_j dA_ij k_j e^(G_i-G_j),
        dkr_i = sum_j dP_ij k_j e^(..); columns: dkc_j = sum_i (dA_ij q_i + dP_ij k_i) e^(G_i - G_j)."""
        o = tl.arange(0, BC)
        rq = tl.zeros_like(q)
        rk = tl.zeros_like(q)
        ck = tl.zeros_like(q)
        for j in range(0, BC):
            kj = _ld_row(k_ptr, row0 + j, eos, H, i_h, K, cols, mc)
            qj = _ld_row(q_ptr, row0 + j, eos, H, i_h, K, cols, mc)
            gj = _ld_row(g_ptr, row0 + j, eos, H, i_h, K, cols, mc)
            # as column j: rows i >= j
            vi = ((row0 + o) < eos)[:, None]
            vj = (row0 + j) < eos
            e_r = tl.exp2(tl.where((o[:, None] >= j) & vi & vj, g - gj[None, :], -float("inf")))
            cA = tl.sum(tl.where(o[None, :] == j, dA, 0.), 1)
            cP = tl.sum(tl.where(o[None, :] == j, dP, 0.), 1)
            rq += cA[:, None] * kj[None, :] * e_r
            rk += cP[:, None] * kj[None, :] * e_r
            # as row j: columns i <= j
            e_c = tl.exp2(tl.where((o[:, None] <= j) & vi & vj, gj[None, :] - g, -float("inf")))
            rA = tl.sum(tl.where(o[:, None] == j, dA, 0.), 0)
            rP = tl.sum(tl.where(o[:, None] == j, dP, 0.), 0)
            ck += (rA[:, None] * qj[None, :] + rP[:, None] * kj[None, :]) * e_c
        return dq + rq, dr + rk, dc + ck

    @triton.jit
    def _diag_bwd_dense(dq, dr, dc, a, p, q, k, g, n, e, PREC: tl.constexpr):
        """Diagonal tile, gate span within fp32 range, added to (dq, dr, dc): relative to the tile's first row n,
        e = exp(G_i - G_n)."""
        kt = k * tl.exp2(n[None, :] - g)
        x = tl.dot(a, kt, input_precision=PREC) * e
        y = tl.dot(p, kt, input_precision=PREC) * e
        z = (tl.dot(tl.trans(a), q * e, input_precision=PREC)
             + tl.dot(tl.trans(p), k * e, input_precision=PREC)) * tl.exp2(n[None, :] - g)
        return dq + x, dr + y, dc + z

    @triton.jit
    def _intra_bwd_kernel(qn, kn, gc, dAs, dPs, dqn, dkn, dG, steep, tab, cu, max_span,
                          H, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr, STEEP: tl.constexpr):
        """SAFE: every diagonal tile by one matmul. STEEP 1 / 2: only the chunks that steep [NC, H] (from the
        forward's diagonal kernel) marks 0 / 1; unbounded gates run the unmarked chunks with SAFE, whose code has no
        per-column loop and far fewer registers, and the marked ones with the per-slice choice."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        if STEEP > 0:
            if (tl.load(steep + i_c * H + i_h) != 0) != (STEEP == 2):
                return
        _, t0, eos = _chunk_span(tab, cu, i_c)
        o_c = tl.arange(0, BC)
        r0 = t0 + o_c
        r1 = r0 + BC
        r2 = r1 + BC
        r3 = r2 + BC
        v0 = (r0 < eos)[:, None]
        v1 = (r1 < eos)[:, None]
        v2 = (r2 < eos)[:, None]
        v3 = (r3 < eos)[:, None]
        a00 = _ld_blk(dAs, r0, eos, H, i_h, 0, BT, BC)
        a10 = _ld_blk(dAs, r1, eos, H, i_h, 0, BT, BC)
        a11 = _ld_blk(dAs, r1, eos, H, i_h, BC, BT, BC)
        a20 = _ld_blk(dAs, r2, eos, H, i_h, 0, BT, BC)
        a21 = _ld_blk(dAs, r2, eos, H, i_h, BC, BT, BC)
        a22 = _ld_blk(dAs, r2, eos, H, i_h, 2 * BC, BT, BC)
        a30 = _ld_blk(dAs, r3, eos, H, i_h, 0, BT, BC)
        a31 = _ld_blk(dAs, r3, eos, H, i_h, BC, BT, BC)
        a32 = _ld_blk(dAs, r3, eos, H, i_h, 2 * BC, BT, BC)
        a33 = _ld_blk(dAs, r3, eos, H, i_h, 3 * BC, BT, BC)
        p00 = _ld_blk(dPs, r0, eos, H, i_h, 0, BT, BC)
        p10 = _ld_blk(dPs, r1, eos, H, i_h, 0, BT, BC)
        p11 = _ld_blk(dPs, r1, eos, H, i_h, BC, BT, BC)
        p20 = _ld_blk(dPs, r2, eos, H, i_h, 0, BT, BC)
        p21 = _ld_blk(dPs, r2, eos, H, i_h, BC, BT, BC)
        p22 = _ld_blk(dPs, r2, eos, H, i_h, 2 * BC, BT, BC)
        p30 = _ld_blk(dPs, r3, eos, H, i_h, 0, BT, BC)
        p31 = _ld_blk(dPs, r3, eos, H, i_h, BC, BT, BC)
        p32 = _ld_blk(dPs, r3, eos, H, i_h, 2 * BC, BT, BC)
        p33 = _ld_blk(dPs, r3, eos, H, i_h, 3 * BC, BT, BC)
        last = tl.minimum(eos, t0 + BT) - 1
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            mc = cols < K
            q0 = _ld(qn, r0, eos, H, i_h, K, cols, mc)
            q1 = _ld(qn, r1, eos, H, i_h, K, cols, mc)
            q2 = _ld(qn, r2, eos, H, i_h, K, cols, mc)
            q3 = _ld(qn, r3, eos, H, i_h, K, cols, mc)
            k0 = _ld(kn, r0, eos, H, i_h, K, cols, mc)
            k1 = _ld(kn, r1, eos, H, i_h, K, cols, mc)
            k2 = _ld(kn, r2, eos, H, i_h, K, cols, mc)
            k3 = _ld(kn, r3, eos, H, i_h, K, cols, mc)
            g0 = _ld(gc, r0, eos, H, i_h, K, cols, mc)
            g1 = _ld(gc, r1, eos, H, i_h, K, cols, mc)
            g2 = _ld(gc, r2, eos, H, i_h, K, cols, mc)
            g3 = _ld(gc, r3, eos, H, i_h, K, cols, mc)
            # first rows (row-side references) and last valid rows (column-side references)
            n0 = _ld_row(gc, t0, eos, H, i_h, K, cols, mc)
            n1 = _ld_row(gc, tl.minimum(t0 + BC, last), eos, H, i_h, K, cols, mc)
            n2 = _ld_row(gc, tl.minimum(t0 + 2 * BC, last), eos, H, i_h, K, cols, mc)
            n3 = _ld_row(gc, tl.minimum(t0 + 3 * BC, last), eos, H, i_h, K, cols, mc)
            m0 = _ld_row(gc, tl.minimum(t0 + BC - 1, last), eos, H, i_h, K, cols, mc)
            m1 = _ld_row(gc, tl.minimum(t0 + 2 * BC - 1, last), eos, H, i_h, K, cols, mc)
            m2 = _ld_row(gc, tl.minimum(t0 + 3 * BC - 1, last), eos, H, i_h, K, cols, mc)
            # ---- row sides: sum over earlier column tiles
            kt = k0 * tl.exp2(n1[None, :] - g0)
            dq1 = tl.dot(a10, kt, input_precision=PREC)
            dr1 = tl.dot(p10, kt, input_precision=PREC)
            kt = k0 * tl.exp2(n2[None, :] - g0)
            dq2 = tl.dot(a20, kt, input_precision=PREC)
            dr2 = tl.dot(p20, kt, input_precision=PREC)
            kt = k1 * tl.exp2(n2[None, :] - g1)
            dq2 += tl.dot(a21, kt, input_precision=PREC)
            dr2 += tl.dot(p21, kt, input_precision=PREC)
            kt = k0 * tl.exp2(n3[None, :] - g0)
            dq3 = tl.dot(a30, kt, input_precision=PREC)
            dr3 = tl.dot(p30, kt, input_precision=PREC)
            kt = k1 * tl.exp2(n3[None, :] - g1)
            dq3 += tl.dot(a31, kt, input_precision=PREC)
            dr3 += tl.dot(p31, kt, input_precision=PREC)
            kt = k2 * tl.exp2(n3[None, :] - g2)
            dq3 += tl.dot(a32, kt, input_precision=PREC)
            dr3 += tl.dot(p32, kt, input_precision=PREC)
            e1 = tl.exp2(tl.where(v1, g1 - n1[None, :], 0.))
            e2 = tl.exp2(tl.where(v2, g2 - n2[None, :], 0.))
            e3 = tl.exp2(tl.where(v3, g3 - n3[None, :], 0.))
            dq1 *= e1
            dr1 *= e1
            dq2 *= e2
            dr2 *= e2
            dq3 *= e3
            dr3 *= e3
            dq0 = tl.zeros([BC, BK], dtype=tl.float32)
            dr0 = tl.zeros([BC, BK], dtype=tl.float32)
            # ---- column sides: sum over later row tiles, relative to the column tile's last row
            x = tl.exp2(tl.where(v1, g1 - m0[None, :], 0.))
            dc0 = tl.dot(tl.trans(a10), q1 * x, input_precision=PREC) + tl.dot(tl.trans(p10), k1 * x, input_precision=PREC)
            x = tl.exp2(tl.where(v2, g2 - m0[None, :], 0.))
            dc0 += tl.dot(tl.trans(a20), q2 * x, input_precision=PREC) + tl.dot(tl.trans(p20), k2 * x, input_precision=PREC)
            x = tl.exp2(tl.where(v3, g3 - m0[None, :], 0.))
            dc0 += tl.dot(tl.trans(a30), q3 * x, input_precision=PREC) + tl.dot(tl.trans(p30), k3 * x, input_precision=PREC)
            x = tl.exp2(tl.where(v2, g2 - m1[None, :], 0.))
            dc1 = tl.dot(tl.trans(a21), q2 * x, input_precision=PREC) + tl.dot(tl.trans(p21), k2 * x, input_precision=PREC)
            x = tl.exp2(tl.where(v3, g3 - m1[None, :], 0.))
            dc1 += tl.dot(tl.trans(a31), q3 * x, input_precision=PREC) + tl.dot(tl.trans(p31), k3 * x, input_precision=PREC)
            x = tl.exp2(tl.where(v3, g3 - m2[None, :], 0.))
            dc2 = tl.dot(tl.trans(a32), q3 * x, input_precision=PREC) + tl.dot(tl.trans(p32), k3 * x, input_precision=PREC)
            dc0 *= tl.exp2(tl.where(v0, m0[None, :] - g0, 0.))
            dc1 *= tl.exp2(tl.where(v1, m1[None, :] - g1, 0.))
            dc2 *= tl.exp2(tl.where(v2, m2[None, :] - g2, 0.))
            dc3 = tl.zeros([BC, BK], dtype=tl.float32)
            # ---- diagonal tiles: one matmul each when the gate span allows (as in _diag_fwd_kernel)
            dense = SAFE
            if not SAFE:
                vc = mc[None, :]
                span = tl.maximum(tl.maximum(_tile_span(g0, n0, v0 & vc), _tile_span(g1, n1, v1 & vc)),
                                  tl.maximum(_tile_span(g2, n2, v2 & vc), _tile_span(g3, n3, v3 & vc)))
                dense = span <= max_span
            if dense:
                e0 = tl.exp2(tl.where(v0, g0 - n0[None, :], 0.))
                dq0, dr0, dc0 = _diag_bwd_dense(dq0, dr0, dc0, a00, p00, q0, k0, g0, n0, e0, PREC)
                dq1, dr1, dc1 = _diag_bwd_dense(dq1, dr1, dc1, a11, p11, q1, k1, g1, n1, e1, PREC)
                dq2, dr2, dc2 = _diag_bwd_dense(dq2, dr2, dc2, a22, p22, q2, k2, g2, n2, e2, PREC)
                dq3, dr3, dc3 = _diag_bwd_dense(dq3, dr3, dc3, a33, p33, q3, k3, g3, n3, e3, PREC)
            else:
                dq0, dr0, dc0 = _diag_bwd_loop(dq0, dr0, dc0, a00, p00, q0, k0, g0, qn, kn, gc, t0, eos, H, i_h, K,
                                               cols, mc, BC)
                dq1, dr1, dc1 = _diag_bwd_loop(dq1, dr1, dc1, a11, p11, q1, k1, g1, qn, kn, gc, t0 + BC, eos, H, i_h,
                                               K, cols, mc, BC)
                dq2, dr2, dc2 = _diag_bwd_loop(dq2, dr2, dc2, a22, p22, q2, k2, g2, qn, kn, gc, t0 + 2 * BC, eos, H,
                                               i_h, K, cols, mc, BC)
                dq3, dr3, dc3 = _diag_bwd_loop(dq3, dr3, dc3, a33, p33, q3, k3, g3, qn, kn, gc, t0 + 3 * BC, eos, H,
                                               i_h, K, cols, mc, BC)
            _acc(dqn, dkn, dG, r0, eos, H, i_h, K, cols, mc, q0, k0, dq0, dr0, dc0)
            _acc(dqn, dkn, dG, r1, eos, H, i_h, K, cols, mc, q1, k1, dq1, dr1, dc1)
            _acc(dqn, dkn, dG, r2, eos, H, i_h, K, cols, mc, q2, k2, dq2, dr2, dc2)
            _acc(dqn, dkn, dG, r3, eos, H, i_h, K, cols, mc, q3, k3, dq3, dr3, dc3)

    @triton.jit
    def _acc(dqn, dkn, dG, rows, eos, H, i_h, K: tl.constexpr, cols, mc, q, k, dq, dr, dc):
        m = (rows < eos)[:, None] & mc[None, :]
        off = (rows[:, None] * H + i_h) * K + cols[None, :]
        tl.store(dqn + off, tl.load(dqn + off, mask=m, other=0.) + dq, mask=m)
        tl.store(dkn + off, tl.load(dkn + off, mask=m, other=0.) + dr + dc, mask=m)
        tl.store(dG + off, tl.load(dG + off, mask=m, other=0.) + q * dq + k * (dr - dc), mask=m)


def _main_bwd_ksplit(BK):
    """KIMI3_KDA_MAIN_BWD_KSPLIT=KS (default 2): _main_bwd_kernel's K columns in KS slices, one program each beside the
    V-side one. On the H200 at 32:4:2 (4f6ee34) KS=4 took 8.40 against 7.29 ms per call at H=96 T=16K; KS=1 spills
    (sm_90: 2,968 bytes of stack per thread at 4 warps). Slices stay >= 16 wide."""
    import os
    ks = int(os.environ.get("KIMI3_KDA_MAIN_BWD_KSPLIT", "2"))
    while ks > 1 and (BK % ks or BK // ks < 16):
        ks //= 2
    return max(ks, 1)


def chunk_bwd_core(qn, kn, v, gc, bs, scale, lower_bound, h0, do, dht, info, saved=None):
    """Returns dqn, dkn (w.r.t. the normalised q, k), dv, dG (w.r.t. the chunk-local cumsum, natural
    log units), dbeta (w.r.t. sigmoid(beta)) in fp32, and dh0. `saved` = (I, hs, vn) kept by the forward
    (KIMI3_KDA_SAVE_FWD=1) skips recomputing the per-chunk quantities and the state scan."""
    from .chunk_fwd import intra_fwd, state_fwd
    TT, H, K = qn.shape
    V = v.shape[-1]
    dev = qn.device
    BT = CHUNK_SIZE
    if saved is not None:
        I, hs, vn = saved
    else:
        I = intra_fwd(qn, kn, v, gc, bs, scale, lower_bound, info, store_bwd=True)
        _, _, hs, vn = state_fwd(I, gc, h0, info, V, qn.dtype, False, True, True, False)
    dvn = torch.empty(TT, H, V, device=dev, dtype=torch.float32)
    dhs = torch.empty(max(info.NC, 1), H, K, V, device=dev, dtype=torch.float32)
    dh0 = torch.empty(info.N, H, K, V, device=dev, dtype=torch.float32) if h0 is not None else None
    BK = next_pow2(K)
    prec = _prec(qn.dtype)
    if info.N > 0:
        bv, warps, stages = launch_config("state_bwd")
        BV = min(bv, next_pow2(V))
        _state_bwd_kernel[(triton.cdiv(V, BV) * info.N * H,)](
            I["W"], I["Qg"], I["Kd"], I["Aqk"], gc, do, dht if dht is not None else do,
            dh0 if dh0 is not None else do, dhs, dvn, info.cu, info.chunk_off,
            H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, HAS_DHT=dht is not None, HAS_H0=h0 is not None,
            PREC=prec, num_warps=warps, num_stages=stages)
    # no zero fill: _main_bwd_kernel stores every row of every chunk before _intra_bwd_kernel adds to dqn / dkn / dG,
    # and rows after the last sequence are never read (ChunkKDAFunction zeroes their gradients). The fills took 0.52 of
    # 28.5 ms of kernel time in an H=96 T=16K forward+backward on the H200 (bench/results/kda_h200.md).
    dv = torch.empty(TT, H, V, device=dev, dtype=v.dtype)
    dqn = torch.empty(TT, H, K, device=dev, dtype=torch.float32)
    dkn = torch.empty_like(dqn)
    dG = torch.empty_like(dqn)
    db = torch.empty(TT, H, device=dev, dtype=torch.float32)
    dAs = torch.empty(TT, H, BT, device=dev, dtype=torch.float32)
    dPs = torch.empty_like(dAs)
    if info.NC > 0:
        bv, warps, stages = launch_config("main_bwd")
        ks = _main_bwd_ksplit(BK)
        _main_bwd_kernel[(info.NC * (ks + 1), H)](
            qn, kn, v, gc, bs, I["M"], I["P"], hs, dhs, vn, dvn, do, dv, dAs, dPs, dqn, dkn, dG, db,
            info.chunk_tab, info.cu, scale, H=H, K=K, V=V, BK=BK, BV=min(bv, next_pow2(V)), BT=BT,
            PREC=prec, KS=ks, num_warps=warps, num_stages=stages)
        safe = lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND
        # unbounded gates: two launches, the chunks whose diagonal tiles all take one matmul (most) without the
        # per-column loop's code and registers, then the steep ones (sm_90, Triton 3.6: 240 against 744 bytes of
        # spill stack per thread)
        passes = [("intra_bwd", True, 0)] if safe else [("intra_bwd", True, 1), ("intra_bwd_loop", False, 2)]
        for name, dense, sel in passes:
            bk, warps, stages = launch_config(name)
            _intra_bwd_kernel[(info.NC, H)](
                qn, kn, gc, dAs, dPs, dqn, dkn, dG, I["steep"] if sel else dAs, info.chunk_tab, info.cu, DENSE_MAX_SPAN,
                H=H, K=K, BK=min(bk, BK), BT=BT, BC=16, SAFE=dense, PREC=prec, STEEP=sel, num_warps=warps,
                num_stages=stages)
    return dqn, dkn, dv, dG, db, dh0
