"""Gate, beta and L2-norm preparation for the chunked KDA kernels.

Forward (`prep_fwd`), in fp32: the gate per 64-token chunk, the norms per row,
  g  = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))      (K3, lower_bound given)
  g  = -exp(A_log[h]) * softplus(f + dt_bias)                     (Kimi Linear)
  gc = chunk-local inclusive cumsum of g, stored in log2 units (x 1/ln2)
  qn, kn = l2norm(q), l2norm(k)   (x / sqrt(sum x^2 + 1e-6)), beta = sigmoid(beta_raw)
The PyTorch reference of the same math is `reference.kda_gate` / `reference.l2norm`.

Backward (`prep_bwd`): from dgc (gradient w.r.t. the chunk-local cumsum, natural-log units),
dqn, dkn, dbeta: reverse cumsum, gate derivative, l2norm and sigmoid derivatives, and per-chunk
partial sums for dA_log and ddt_bias.
"""
from __future__ import annotations

import torch

from ._utils import CHUNK_SIZE, TRITON_AVAILABLE, cdiv, next_pow2
from .configs import launch_config

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _softplus(x):
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))

    @triton.jit
    def _gate_fwd_kernel(f, A_log, dt_bias, gc, tab, cu, lower_bound, HK, K: tl.constexpr, BT: tl.constexpr,
                         BS: tl.constexpr, USE_LB: tl.constexpr):
        """One chunk, BS columns of the gate input viewed as [TT, H * K] (the heads side by side: any BS, a block may
        span heads): the per-step log decay and its chunk-local cumsum, in log2 units (exp2 is cheaper)."""
        i_c = tl.program_id(0)
        n = tl.load(tab + 2 * i_c)
        t0 = tl.load(tab + 2 * i_c + 1)
        eos = tl.load(cu + n + 1)
        rows = (t0 + tl.arange(0, BT)).to(tl.int64)
        cols = tl.program_id(1) * BS + tl.arange(0, BS)
        mc = cols < HK
        m = (rows < eos)[:, None] & mc[None, :]
        off = rows[:, None] * HK + cols[None, :]
        x = tl.load(f + off, mask=m, other=0.).to(tl.float32)
        x = x + tl.load(dt_bias + cols, mask=mc, other=0.).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + cols // K, mask=mc, other=0.).to(tl.float32))[None, :]
        if USE_LB:
            gv = lower_bound * tl.sigmoid(a * x)
        else:
            gv = -a * _softplus(x)
        tl.store(gc + off, tl.cumsum(tl.where(m, gv, 0.) * 1.4426950408889634, axis=0), mask=m)

    @triton.jit
    def _norm_fwd_kernel(q, k, beta, qn, kn, bo, rq, rk, R, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                         L2: tl.constexpr):
        """BR rows of q and k viewed as [TT * H, K] (contiguous, no chunk tables: the norms are per row): their L2
        norms, and beta's sigmoid. Rows outside every sequence are normalised too; no kernel reads them."""
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        mr = rows < R
        cols = tl.arange(0, BK)
        m = mr[:, None] & (cols < K)[None, :]
        off = rows[:, None] * K + cols[None, :]
        bq = tl.load(q + off, mask=m, other=0.).to(tl.float32)
        bk = tl.load(k + off, mask=m, other=0.).to(tl.float32)
        if L2:
            r_q = 1.0 / tl.sqrt(tl.sum(bq * bq, 1) + 1e-6)
            r_k = 1.0 / tl.sqrt(tl.sum(bk * bk, 1) + 1e-6)
            tl.store(rq + rows, r_q, mask=mr)
            tl.store(rk + rows, r_k, mask=mr)
            bq = bq * r_q[:, None]
            bk = bk * r_k[:, None]
        tl.store(qn + off, bq.to(qn.dtype.element_ty), mask=m)
        tl.store(kn + off, bk.to(kn.dtype.element_ty), mask=m)
        b = tl.load(beta + rows, mask=mr, other=0.).to(tl.float32)
        tl.store(bo + rows, tl.sigmoid(b), mask=mr)

    @triton.jit
    def _prep_bwd_kernel(q, k, f, A_log, dt_bias, beta_s, rq, rk, dgc, dqn, dkn, dbeta_s,
                         dq, dk, df, dbeta, dA_part, ddt_part, tab, cu,
                         lower_bound, H, K: tl.constexpr, BK: tl.constexpr, BKG: tl.constexpr,
                         BT: tl.constexpr, USE_LB: tl.constexpr, L2: tl.constexpr, GATE: tl.constexpr,
                         NORM: tl.constexpr):
        """One chunk and head: the gate's backward (GATE; columns in slices of BKG along grid axis 2, each slice its own
        dA_log partial) and/or the norms' and beta's (NORM)."""
        i_c = tl.program_id(0)
        i_h = tl.program_id(1)
        n = tl.load(tab + 2 * i_c)
        t0 = tl.load(tab + 2 * i_c + 1)
        eos = tl.load(cu + n + 1)
        rows = (t0 + tl.arange(0, BT)).to(tl.int64)
        mr = rows < eos
        if GATE:
            i_s = tl.program_id(2)
            _prep_bwd_gate(f, A_log, dt_bias, dgc, df, dA_part + (i_c * H + i_h) * tl.num_programs(2) + i_s,
                           ddt_part, rows, mr, i_c, i_h, i_s * BKG + tl.arange(0, BKG), lower_bound, H, K, USE_LB)
        if NORM:
            _prep_bwd_norm(q, k, beta_s, rq, rk, dqn, dkn, dbeta_s, dq, dk, dbeta, rows, mr, i_h, H, K, BK, L2)

    @triton.jit
    def _prep_bwd_gate(f, A_log, dt_bias, dgc, df, dA_out, ddt_part, rows, mr, i_c, i_h, cols, lower_bound, H,
                       K: tl.constexpr, USE_LB: tl.constexpr):
        mc = cols < K
        m = mr[:, None] & mc[None, :]
        off = (rows[:, None] * H + i_h) * K + cols[None, :]
        # gate: dg_t = sum_{i >= t} dG_i (reverse cumsum inside the chunk)
        dG = tl.load(dgc + off, mask=m, other=0.)
        dg = dG - tl.cumsum(dG, axis=0) + tl.sum(dG, axis=0)[None, :]
        x = tl.load(f + off, mask=m, other=0.).to(tl.float32)
        x = x + tl.load(dt_bias + i_h * K + cols, mask=mc, other=0.).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if USE_LB:
            s = tl.sigmoid(a * x)
            ds = dg * lower_bound * s * (1.0 - s)
            dx = ds * a
            da = tl.sum(tl.sum(tl.where(m, ds * a * x, 0.), 1), 0)
        else:
            sp = _softplus(x)
            dx = -dg * a * tl.sigmoid(x)
            da = tl.sum(tl.sum(tl.where(m, -dg * a * sp, 0.), 1), 0)
        dx = tl.where(m, dx, 0.)
        tl.store(df + off, dx.to(df.dtype.element_ty), mask=m)
        tl.store(ddt_part + (i_c * H + i_h) * K + cols, tl.sum(dx, 0), mask=mc)
        tl.store(dA_out, da)

    @triton.jit
    def _prep_bwd_norm(q, k, beta_s, rq, rk, dqn, dkn, dbeta_s, dq, dk, dbeta, rows, mr, i_h, H, K: tl.constexpr,
                       BK: tl.constexpr, L2: tl.constexpr):
        cols = tl.arange(0, BK)
        mc = cols < K
        m = mr[:, None] & mc[None, :]
        off = (rows[:, None] * H + i_h) * K + cols[None, :]
        # l2norm: y = x r, dx = r (dy - y (y . dy))
        bdq = tl.load(dqn + off, mask=m, other=0.)
        bdk = tl.load(dkn + off, mask=m, other=0.)
        bq = tl.load(q + off, mask=m, other=0.).to(tl.float32)
        bk = tl.load(k + off, mask=m, other=0.).to(tl.float32)
        if L2:
            r_q = tl.load(rq + rows * H + i_h, mask=mr, other=0.)
            r_k = tl.load(rk + rows * H + i_h, mask=mr, other=0.)
            yq = bq * r_q[:, None]
            yk = bk * r_k[:, None]
            bdq = r_q[:, None] * (bdq - yq * tl.sum(yq * bdq, 1)[:, None])
            bdk = r_k[:, None] * (bdk - yk * tl.sum(yk * bdk, 1)[:, None])
        tl.store(dq + off, bdq.to(dq.dtype.element_ty), mask=m)
        tl.store(dk + off, bdk.to(dk.dtype.element_ty), mask=m)
        b = tl.load(beta_s + rows * H + i_h, mask=mr, other=0.)
        db = tl.load(dbeta_s + rows * H + i_h, mask=mr, other=0.)
        tl.store(dbeta + rows * H + i_h, (db * b * (1.0 - b)).to(dbeta.dtype.element_ty), mask=mr)


def _launches(tile, K):
    """(gate, norm, gate column width) of each launch of the prep backward: a tile narrower than the head runs the
    gate's part in column slices of that width and the norms' in a second launch (more programs, fewer registers
    each); else one program per chunk and head does both."""
    BK = next_pow2(K)
    return [(True, True, BK)] if tile is None or tile >= K else [(True, False, tile), (False, True, BK)]


def prep_fwd(q, k, g, beta, A_log, dt_bias, lower_bound, use_l2, info, inter_dtype):
    """q, k, g: [TT, H, K] (flattened tokens); beta: [TT, H]. Returns qn, kn, gc, beta_s, rq, rk."""
    TT, H, K = q.shape
    dev = q.device
    qn = torch.empty(TT, H, K, device=dev, dtype=inter_dtype)
    kn = torch.empty_like(qn)
    gc = torch.empty(TT, H, K, device=dev, dtype=torch.float32)
    bs = torch.empty(TT, H, device=dev, dtype=torch.float32)
    rq = torch.empty(TT, H, device=dev, dtype=torch.float32) if use_l2 else bs
    rk = torch.empty(TT, H, device=dev, dtype=torch.float32) if use_l2 else bs
    if info.NC > 0:
        bs_cols, warps, stages, regs = launch_config("prep_fwd")
        _gate_fwd_kernel[(info.NC, cdiv(H * K, bs_cols))](
            g, A_log, dt_bias, gc, info.chunk_tab, info.cu, float(lower_bound) if lower_bound is not None else 0.0,
            H * K, K=K, BT=CHUNK_SIZE, BS=bs_cols, USE_LB=lower_bound is not None, num_warps=warps,
            num_stages=stages, **regs)
        br, warps, stages, regs = launch_config("norm_fwd")
        _norm_fwd_kernel[(cdiv(TT * H, br),)](q, k, beta, qn, kn, bs, rq, rk, TT * H, K=K, BR=br, BK=next_pow2(K),
                                              L2=use_l2, num_warps=warps, num_stages=stages, **regs)
    return qn, kn, gc, bs, (rq if use_l2 else None), (rk if use_l2 else None)


def prep_bwd(q, k, g, A_log, dt_bias, beta_s, rq, rk, dgc, dqn, dkn, dbeta_s, lower_bound, use_l2, info,
             beta_raw_dtype):
    TT, H, K = q.shape
    dev = q.device
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    df = torch.empty_like(g)
    dbeta = torch.empty(TT, H, device=dev, dtype=beta_raw_dtype)
    NC = max(info.NC, 1)
    tile, warps, stages, regs = launch_config("prep_bwd" if lower_bound is not None else "prep_bwd_softplus")
    BK = next_pow2(K)
    parts = _launches(tile, K)
    slices = cdiv(K, parts[0][2])  # each gate slice writes its own dA_log partial
    dA_part = torch.zeros(NC, H, slices, device=dev, dtype=torch.float32)
    ddt_part = torch.zeros(NC, H, K, device=dev, dtype=torch.float32)
    if info.NC > 0:
        for gate, norm, bkg in parts:
            _prep_bwd_kernel[(info.NC, H, slices if gate and not norm else 1)](
                q, k, g, A_log, dt_bias, beta_s, rq if use_l2 else beta_s, rk if use_l2 else beta_s,
                dgc, dqn, dkn, dbeta_s, dq, dk, df, dbeta, dA_part, ddt_part, info.chunk_tab, info.cu,
                float(lower_bound) if lower_bound is not None else 0.0,
                H=H, K=K, BK=BK, BKG=bkg, BT=CHUNK_SIZE, USE_LB=lower_bound is not None, L2=use_l2, GATE=gate,
                NORM=norm, num_warps=warps, num_stages=stages, **regs)
    # tokens outside every sequence (T beyond cu_seqlens[-1]) get zero gradients
    return dq, dk, df, dbeta, dA_part.sum((0, 2)), ddt_part.sum(0).reshape(H * K)
