"""Chunked KDA backward kernels (Triton).

Given dO and dS_final, with the forward quantities recomputed per chunk (see chunk_fwd.py):
  state_bwd  (sequential over chunks, reverse):
      dVn = Aqk^T dO + Kd dS1;   dS0 = Qg^T dO + Diag(exp(Gam_last)) dS1 - W^T dVn
  main_bwd   (parallel over chunks, and over K slices beside one V-side program per chunk):
      K slices: dQg = dO S0^T, dW = -dVn S0^T, dKd = Vn dS1^T, dKg = T^T dW,
          dGam_last += exp(Gam_last) * rowsum(S0 * dS1), and the elementwise chain rule through exp(+-Gam);
      V side: dAqk = dO Vn^T, dT = dVn (v - Kg S0)^T, dv = T^T dVn, dbeta from T = M Diag(beta) and
          L = Diag(beta) P, dL = -M^T dM M^T.
  intra_bwd  (parallel over 16-row sub-tiles and K slices): the pairwise terms of Aqk and P (same sub-tiles and
      reference rows as the forward, so no exponential overflows).
The gate / L2 norm / sigmoid derivatives and the reverse cumsum are in gate.prep_bwd.
"""
from __future__ import annotations

import torch

from ._utils import CHUNK_SIZE, TRITON_AVAILABLE, cdiv, next_pow2
from .configs import launch_config, state_scan_tile
from .chunk_fwd import DENSE_MAX_SPAN, SAFE_LOWER_BOUND, _prec

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .chunk_fwd import _chunk_span, _ld, _ld_row, _scan_program, _tile_span

    @triton.jit
    def _state_bwd_kernel(W, Qg, Kd, Aqk, gc, do, dht, dh0, dhs, dvn, cu, chunk_off,
                          H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, BT: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
                          PREC: tl.constexpr):
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
        dS = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_DHT:
            dS += tl.load(dht + s_off, mask=m_s, other=0.)
        for i in range(0, NTn):
            c = NTn - 1 - i
            t0 = bos + c * BT
            rows = t0 + o_t
            mr = rows < eos
            dSd = dS.to(DT)
            tl.store(dhs + ((c0 + c) * H * K + i_h * K + o_k[:, None]) * V + o_v[None, :],
                     dSd.to(dhs.dtype.element_ty), mask=m_s)
            mrk = mr[:, None] & mk[None, :]
            mrv = mr[:, None] & mv[None, :]
            offk = (rows[:, None] * H + i_h) * K + o_k[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            bdo = tl.load(do + offv, mask=mrv, other=0.).to(DT)
            a = tl.load(Aqk + (rows[:, None] * H + i_h) * BT + o_t[None, :],
                        mask=mr[:, None] & (o_t[None, :] <= o_t[:, None]), other=0.).to(DT)
            kd = tl.load(Kd + offk, mask=mrk, other=0.)
            bdv = tl.dot(tl.trans(a), bdo, input_precision=PREC) + tl.dot(kd, dSd, input_precision=PREC)
            tl.store(dvn + offv, bdv.to(dvn.dtype.element_ty), mask=mrv)
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
        Each keeps only its own accumulators. One program doing all of them runs at 255 registers with spills, one
        latency-bound 8-warp program per SM; the split runs two 4-warp programs per SM, about 1.3x faster.
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
        DT = qn.dtype.element_ty
        dQg = tl.zeros([BT, BKS], dtype=tl.float32)
        dW = tl.zeros([BT, BKS], dtype=tl.float32)
        dKd = tl.zeros([BT, BKS], dtype=tl.float32)
        dgl = tl.zeros([BKS], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            mv = o_v < V
            m_s = mk[:, None] & mv[None, :]
            s0 = tl.load(hs + (s_base + o_k[:, None]) * V + o_v[None, :], mask=m_s, other=0.).to(DT)
            ds1 = tl.load(dhs + (s_base + o_k[:, None]) * V + o_v[None, :], mask=m_s, other=0.).to(DT)
            mrv = mr[:, None] & mv[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            bvn = tl.load(vn + offv, mask=mrv, other=0.).to(DT)
            bdvn = tl.load(dvn + offv, mask=mrv, other=0.).to(DT)
            bdo = tl.load(do + offv, mask=mrv, other=0.).to(DT)
            dQg += tl.dot(bdo, tl.trans(s0), input_precision=PREC)
            dW -= tl.dot(bdvn, tl.trans(s0), input_precision=PREC)
            dKd += tl.dot(bvn, tl.trans(ds1), input_precision=PREC)
            dgl += tl.sum(s0.to(tl.float32) * ds1.to(tl.float32), 1)
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
        DT = kn.dtype.element_ty
        kg = (tl.load(kn + offk, mask=mrk, other=0.).to(tl.float32)
              * tl.exp2(tl.load(gc + offk, mask=mrk, other=0.))).to(DT)
        Tm = (tl.load(Mo + offA, mask=mtt & (o_t[None, :] <= o_t[:, None]), other=0.) * b[None, :]).to(DT)
        dA = tl.zeros([BT, BT], dtype=tl.float32)
        dT = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            mv = o_v < V
            s0 = tl.load(hs + (s_base + o_k[:, None]) * V + o_v[None, :], mask=mk[:, None] & mv[None, :],
                         other=0.).to(DT)
            mrv = mr[:, None] & mv[None, :]
            offv = (rows[:, None] * H + i_h) * V + o_v[None, :]
            x = tl.load(v + offv, mask=mrv, other=0.).to(tl.float32) - tl.dot(kg, s0, input_precision=PREC)
            bvn = tl.load(vn + offv, mask=mrv, other=0.).to(DT)
            bdvn = tl.load(dvn + offv, mask=mrv, other=0.).to(DT)
            bdo = tl.load(do + offv, mask=mrv, other=0.).to(DT)
            dA += tl.dot(bdo, tl.trans(bvn), input_precision=PREC)
            dT += tl.dot(bdvn, tl.trans(x.to(DT)), input_precision=PREC)
            tl.store(dv + offv, tl.dot(tl.trans(Tm), bdvn, input_precision=PREC).to(dv.dtype.element_ty), mask=mrv)
        tl.store(dAs + offA, tl.where(o_t[:, None] >= o_t[None, :], dA, 0.) * scale, mask=mtt)  # dA dies here
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
                          BC: tl.constexpr, SAFE: tl.constexpr, PREC: tl.constexpr, STEEP: tl.constexpr,
                          DPREC: tl.constexpr):
        """One program per 16-row sub-tile i of a chunk and K slice: the rows of sub-tile i against the earlier
        sub-tiles (row side, relative to its first row), its columns against the later ones (column side, relative to
        its last row), and its diagonal tile, added to sub-tile i's rows of dqn / dkn / dG. A program for the whole
        chunk kept its 20 blocks of dA and dP live (sm_90: 255 registers, spilling, two 4-warp programs per SM).
        SAFE: the diagonal tile by one matmul. Otherwise by one matmul when its gate span is at most max_span, else by
        the per-column loop. STEEP 1 / 2: only the chunks that steep [NC, H] (from the forward's diagonal kernel) marks
        0 / 1; unbounded gates run the unmarked chunks with SAFE (no per-column loop in their code) and the marked ones
        without."""
        NS: tl.constexpr = BT // BC
        NKB: tl.constexpr = (K + BK - 1) // BK
        i_k = tl.program_id(0) % NKB
        i_i = (tl.program_id(0) // NKB) % NS
        i_c = tl.program_id(0) // (NKB * NS)
        i_h = tl.program_id(1)
        if STEEP > 0:
            if (tl.load(steep + i_c * H + i_h) != 0) != (STEEP == 2):
                return
        _, t0, eos = _chunk_span(tab, cu, i_c)
        r0 = t0 + i_i * BC
        if r0 >= eos:
            return
        o_c = tl.arange(0, BC)
        rows = r0 + o_c
        vi = (rows < eos)[:, None]
        cols = i_k * BK + tl.arange(0, BK)
        mc = cols < K
        q = _ld(qn, rows, eos, H, i_h, K, cols, mc)
        k = _ld(kn, rows, eos, H, i_h, K, cols, mc)
        g = _ld(gc, rows, eos, H, i_h, K, cols, mc)
        n = _ld_row(gc, r0, eos, H, i_h, K, cols, mc)
        m = _ld_row(gc, tl.minimum(r0 + BC, eos) - 1, eos, H, i_h, K, cols, mc)
        # ---- row side: dq_i = sum_{j<i} dA_ij (k_j e^(G_n - G_j)) e^(G_i - G_n), dr_i the same with dP
        dq = tl.zeros([BC, BK], dtype=tl.float32)
        dr = tl.zeros([BC, BK], dtype=tl.float32)
        for j in range(0, i_i):
            rj = t0 + j * BC + o_c
            kt = _ld(kn, rj, eos, H, i_h, K, cols, mc) * tl.exp2(n[None, :] - _ld(gc, rj, eos, H, i_h, K, cols, mc))
            dq += tl.dot(_ld_blk(dAs, rows, eos, H, i_h, j * BC, BT, BC), kt, input_precision=PREC)
            dr += tl.dot(_ld_blk(dPs, rows, eos, H, i_h, j * BC, BT, BC), kt, input_precision=PREC)
        e = tl.exp2(tl.where(vi, g - n[None, :], 0.))
        dq *= e
        dr *= e
        # ---- column side: dc_i = sum_{j>i} (dA_ji^T q_j + dP_ji^T k_j) e^(G_j - G_m) e^(G_m - G_i)
        dc = tl.zeros([BC, BK], dtype=tl.float32)
        for j in range(i_i + 1, NS):
            rj = t0 + j * BC + o_c
            x = tl.exp2(tl.where((rj < eos)[:, None], _ld(gc, rj, eos, H, i_h, K, cols, mc) - m[None, :], 0.))
            dc += tl.dot(tl.trans(_ld_blk(dAs, rj, eos, H, i_h, i_i * BC, BT, BC)),
                         _ld(qn, rj, eos, H, i_h, K, cols, mc) * x, input_precision=PREC)
            dc += tl.dot(tl.trans(_ld_blk(dPs, rj, eos, H, i_h, i_i * BC, BT, BC)),
                         _ld(kn, rj, eos, H, i_h, K, cols, mc) * x, input_precision=PREC)
        dc *= tl.exp2(tl.where(vi, m[None, :] - g, 0.))
        # ---- diagonal tile (as in _diag_fwd_kernel)
        a = _ld_blk(dAs, rows, eos, H, i_h, i_i * BC, BT, BC)
        p = _ld_blk(dPs, rows, eos, H, i_h, i_i * BC, BT, BC)
        dense = SAFE
        if not SAFE:
            dense = _tile_span(g, n, vi & mc[None, :]) <= max_span
        if dense:
            dq, dr, dc = _diag_bwd_dense(dq, dr, dc, a, p, q, k, g, n, e, DPREC)
        else:
            dq, dr, dc = _diag_bwd_loop(dq, dr, dc, a, p, q, k, g, qn, kn, gc, r0, eos, H, i_h, K, cols, mc, BC)
        _acc(dqn, dkn, dG, rows, eos, H, i_h, K, cols, mc, q, k, dq, dr, dc)

    @triton.jit
    def _acc(dqn, dkn, dG, rows, eos, H, i_h, K: tl.constexpr, cols, mc, q, k, dq, dr, dc):
        m = (rows < eos)[:, None] & mc[None, :]
        off = (rows[:, None] * H + i_h) * K + cols[None, :]
        tl.store(dqn + off, tl.load(dqn + off, mask=m, other=0.) + dq, mask=m)
        tl.store(dkn + off, tl.load(dkn + off, mask=m, other=0.) + dr + dc, mask=m)
        tl.store(dG + off, tl.load(dG + off, mask=m, other=0.) + q * dq + k * (dr - dc), mask=m)


def _main_bwd_ksplit(BK):
    """_main_bwd_kernel's K columns in slices of their own programs beside the V-side one: 2 slices (4 spill less
    but run slower; 1 spills on sm_90 at 4 warps), each at least 16 wide."""
    ks = MAIN_BWD_KSPLIT
    while ks > 1 and (BK % ks or BK // ks < 16):
        ks //= 2
    return max(ks, 1)


MAIN_BWD_KSPLIT = 2


def _intra_diag_prec(prec):
    """The intra backward's diagonal 16x16 tiles take 3xTF32 even for bf16 inputs. Their row and column sides are
    one-pass TF32 matmuls whose errors do not cancel the way the exact terms do in the gate's gradient (q dq + k (dr -
    dc)), and the gate parameters' gradients sum that over every token (bf16, K3 gate, T=8192: ddt_bias 4.2e-2 from
    the fp32 reference with one pass, 4.1e-3 with 3xTF32) for ~2.5% more forward+backward time. 3xTF32 in the
    off-diagonal tiles changes nothing and costs 7%."""
    return "tf32x3" if prec == "tf32" else prec


def chunk_bwd_core(qn, kn, v, gc, bs, scale, lower_bound, h0, do, dht, info, saved=None):
    """Returns dqn, dkn (w.r.t. the normalised q, k), dv, dG (w.r.t. the chunk-local cumsum, natural
    log units), dbeta (w.r.t. sigmoid(beta)) in fp32, and dh0. `saved` = (I, hs, vn) kept by the forward
    skips recomputing the per-chunk quantities and the state scan (None, e.g. a second backward through a retained
    graph: recomputed)."""
    from .chunk_fwd import intra_fwd, state_fwd
    TT, H, K = qn.shape
    V = v.shape[-1]
    dev = qn.device
    BT = CHUNK_SIZE
    if saved is not None:
        I, hs, vn = saved
    else:
        I = intra_fwd(qn, kn, v, gc, bs, scale, lower_bound, info, store_bwd=True)
        _, _, hs, vn = state_fwd(I, gc, h0, info, V, qn.dtype, False, qn.dtype, True, False)
    # dv_new and the chunk states' gradients in the matmul dtype, as their readers' matmuls take them (fla does the same)
    dvn = torch.empty(TT, H, V, device=dev, dtype=qn.dtype)
    dhs = torch.empty(max(info.NC, 1), H, K, V, device=dev, dtype=qn.dtype)
    dh0 = torch.empty(info.N, H, K, V, device=dev, dtype=torch.float32) if h0 is not None else None
    BK = next_pow2(K)
    prec = _prec(qn.dtype)
    if info.N > 0:
        bv, warps, stages, regs = launch_config("state_bwd")
        BV = min(bv or state_scan_tile(cdiv(V, 64) * info.N * H, dev)[0], next_pow2(V))
        if min(BK, BV) < 32:
            # the [BK, BV] state products of heads narrower than 32 at 8 warps: Triton on sm_90 reads shared memory
            # out of bounds with 2 stages (compute-sanitizer) and returns wrong gradients with 1; 4 warps are exact
            warps = min(warps, 4)
        _state_bwd_kernel[(cdiv(V, BV) * info.N * H,)](
            I["W"], I["Qg"], I["Kd"], I["Aqk"], gc, do, dht if dht is not None else do,
            dh0 if dh0 is not None else do, dhs, dvn, info.cu, info.chunk_off,
            H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, HAS_DHT=dht is not None, HAS_H0=h0 is not None,
            PREC=prec, num_warps=warps, num_stages=stages, **regs)
    # no zero fill: _main_bwd_kernel stores every row of every chunk before _intra_bwd_kernel adds to dqn / dkn / dG,
    # and rows after the last sequence are never read (ChunkKDAFunction zeroes their gradients): ~2% of the kernel
    # time saved.
    dv = torch.empty(TT, H, V, device=dev, dtype=v.dtype)
    dqn = torch.empty(TT, H, K, device=dev, dtype=torch.float32)
    dkn = torch.empty_like(dqn)
    dG = torch.empty_like(dqn)
    db = torch.empty(TT, H, device=dev, dtype=torch.float32)
    dAs = torch.empty(TT, H, BT, device=dev, dtype=torch.float32)
    dPs = torch.empty_like(dAs)
    if info.NC > 0:
        bv, warps, stages, regs = launch_config("main_bwd")
        ks = _main_bwd_ksplit(BK)
        _main_bwd_kernel[(info.NC * (ks + 1), H)](
            qn, kn, v, gc, bs, I["M"], I["P"], hs, dhs, vn, dvn, do, dv, dAs, dPs, dqn, dkn, dG, db,
            info.chunk_tab, info.cu, scale, H=H, K=K, V=V, BK=BK, BV=min(bv, next_pow2(V)), BT=BT,
            PREC=prec, KS=ks, num_warps=warps, num_stages=stages, **regs)
        safe = lower_bound is not None and lower_bound >= SAFE_LOWER_BOUND
        # unbounded gates: two launches, the chunks whose diagonal tiles all take one matmul (most) without the
        # per-column loop's code and registers, then the steep ones (sm_90, Triton 3.6: 240 against 744 bytes of
        # spill stack per thread)
        passes = [("intra_bwd", True, 0)] if safe else [("intra_bwd", True, 1), ("intra_bwd_loop", False, 2)]
        intra_prec = prec
        for name, dense, sel in passes:
            bk, warps, stages, regs = launch_config(name)
            bk = min(bk, BK)
            _intra_bwd_kernel[(info.NC * (BT // 16) * cdiv(K, bk), H)](
                qn, kn, gc, dAs, dPs, dqn, dkn, dG, I["steep"] if sel else dAs, info.chunk_tab, info.cu, DENSE_MAX_SPAN,
                H=H, K=K, BK=bk, BT=BT, BC=16, SAFE=dense, PREC=intra_prec, STEEP=sel,
                DPREC=_intra_diag_prec(intra_prec), num_warps=warps,
                num_stages=stages, **regs)
    return dqn, dkn, dv, dG, db, dh0
