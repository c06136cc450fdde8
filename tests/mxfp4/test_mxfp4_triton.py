"""The Triton MXFP4 grouped GEMM (`kimi3_kernels.mxfp4`) under TRITON_INTERPRET=1 (CPU) equals its PyTorch
reference, and the packed experts' kernel path equals dequantise-then-matmul, gradients included.

Triton reads TRITON_INTERPRET when it launches, and other test files in the same pytest process may use Triton
compiled for real or set the variable differently, so the checks run in a subprocess with the variable set; this
file is also the subprocess's script (`python tests/test_mxfp4_triton.py` prints JSON results).
"""

import json
import sys
from pathlib import Path

import pytest
from kimi3_testing import interpreted_results, run_decode_ptx

ROOT = Path(__file__).resolve().parents[2]


def _setup_path():
    for p in (ROOT / "src", ROOT / "kernels"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _kernel_checks(G, R, torch):
    """Kernel vs reference on tiny shapes covering every mode. Returns {name: relative error}."""
    out = {}
    gen = torch.Generator().manual_seed(0)

    def weights(E, rows, cols):
        p = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, generator=gen)
        s = torch.randint(118, 128, (E, rows, cols // 32), dtype=torch.uint8, generator=gen)
        return p, s

    E, N, K, T, k = 5, 96, 96, 9, 3  # N, K not multiples of the 64-wide tiles used below: exercises masking
    counts_idx = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert E-1 unused
    counts_idx[:6, 0] = 0  # expert 0 gets more rows than BM=16 / 2 blocks at BM=... keeps multi-block segments
    flat = counts_idx.flatten()
    se, order = torch.sort(flat, stable=True)
    offs = torch.searchsorted(se, torch.arange(E + 1)).to(torch.int32)
    tok = (order // k).to(torch.int32)
    M = flat.numel()
    x = torch.randn(T, K, generator=gen).bfloat16()
    wp, ws = weights(E, N, K)
    bp, bs = weights(E, N, K)
    common = dict(a_rows=tok, c_rows=order.to(torch.int32), num_c_rows=M, b_packed=bp, b_scale=bs)
    cfgs = {"bk64": dict(BM=16, BN=64, BK=64), "bk32": dict(BM=16, BN=32, BK=32),
            # K permuted inside each tile (weights and activations alike); BK=128 > K=96: a half-masked tile
            "perm": dict(BM=16, BN=64, BK=64, PERM=1), "perm_bk128": dict(BM=16, BN=32, BK=128, PERM=1),
            "perm_bk32": dict(BM=16, BN=32, BK=32, PERM=1)}
    for mode, kw in {"plain": {}, "dual_out": dict(dual="out"), "silu": dict(dual="out", act="silu"),
                     "situ": dict(dual="out", act="situ", act_params=(4.0, 25.0)),
                     "situ_linear_up": dict(dual="out", act="situ", act_params=(4.0, None))}.items():
        for cname, cfg in cfgs.items():
            if cname in ("bk32", "perm_bk128", "perm_bk32") and mode not in ("plain", "situ"):
                continue
            c = G.mxfp4_grouped_gemm(x, wp, ws, offs, config=cfg, **common, **kw)
            r = R(x, wp, ws, offs, **common, **kw)
            out[f"fwd_{mode}_{cname}"] = _rel(c, r)
    # the routes unsorted: the packed GEMM one row per program, each row's expert read from the ids (topk_idx's
    # order, row m = token m // k), an id past the last expert leaves its row unwritten; plain and K-permuted
    # tiles, the GLU fused. One program per row makes these the interpreter's costliest launches, so the kernel
    # takes the first MU = 17 routes (tokens 0-5: every used expert, a token routed twice to one expert, and row 16,
    # past one BM=16 tile's rows); the reference's own expert_ids form (PyTorch, cheap) takes all 27
    eids = flat.to(torch.int32)
    MU = 17
    gl = dict(b_packed=bp, b_scale=bs)
    for mode, kw in {"plain": {}, "dual_out": dict(dual="out"), "situ": dict(dual="out", act="situ",
                                                                                   act_params=(4.0, 25.0))}.items():
        gkw = dict(gl, **kw) if kw else {}
        r = R(x, wp, ws, offs, **common, **kw)
        for cname, cfg in {"bk64": dict(BM=16, BN=64, BK=64), "perm_bk32": dict(BM=16, BN=32, BK=32, PERM=1)}.items():
            c = G.mxfp4_grouped_gemm(x, wp, ws, None, expert_ids=eids[:MU], a_row_div=k, config=cfg, **gkw)
            out[f"fwd_unsorted_{mode}_{cname}"] = _rel(c, r[:MU])
        # the reference takes the same arguments: rows one by one, each with its expert id
        out[f"ref_unsorted_{mode}"] = _rel(R(x, wp, ws, None, expert_ids=eids, a_row_div=k, **gkw), r)
    # an id past the last expert (another rank's, under expert parallelism) gets zeros from the kernel itself:
    # outputs come from torch.empty, here filled with NaN so that a row left unwritten shows
    off_rank = eids[:MU].clone()
    off_rank[4] = E
    keep = torch.arange(MU) != 4
    empty = torch.empty
    torch.empty = lambda *a, **kw: (lambda t: t.fill_(float("nan")) if t.is_floating_point() else t)(empty(*a, **kw))
    try:
        for mode, kw in {"plain": {}, "dual_out": dict(dual="out")}.items():
            c = G.mxfp4_grouped_gemm(x, wp, ws, None, expert_ids=off_rank, a_row_div=k,
                                     config=dict(BM=16, BN=64, BK=64), **(dict(gl, **kw) if kw else {}))
            r = R(x, wp, ws, offs, **common, **kw)[:MU]
            out[f"fwd_unsorted_off_rank_row_{mode}"] = _rel(c[keep], r[keep]) + float(c[4].abs().max())
    finally:
        torch.empty = empty
    for bad in (dict(), dict(expert_offsets=offs, expert_ids=eids), dict(expert_ids=eids, trans_w=True)):
        try:
            G.mxfp4_grouped_gemm(x, wp, ws, **dict(dict(expert_offsets=None), **bad))
            out[f"fwd_refused_{sorted(bad)}"] = 1.0  # accepted: fails the < tolerance check
        except ValueError:
            out[f"fwd_refused_{sorted(bad)}"] = 0.0
    # backward layouts: weights stored [E, K, N/2], used untransposed; sorted (non-gathered) rows
    wtp, wts = weights(E, K, N)
    btp, bts = weights(E, K, N)
    # fp32 activations (as dgate/dup are) that bf16 represents exactly: the kernel rounds operands to bf16, and the
    # interpreter's fp32->bf16 conversion truncates where the GPU rounds to nearest even
    a = torch.randn(M, K, generator=gen).bfloat16().float()
    a2 = torch.randn(M, K, generator=gen).bfloat16().float()
    for mode, kw in {"trans": {}, "trans_dual_in": dict(dual="in", a2=a2)}.items():
        c = G.mxfp4_grouped_gemm(a, wtp, wts, offs, trans_w=True, b_packed=btp, b_scale=bts,
                                 config=dict(BM=16, BN=64, BK=64), **kw)
        r = R(a, wtp, wts, offs, trans_w=True, b_packed=btp, b_scale=bts, **kw)
        out[f"bwd_{mode}"] = _rel(c, r)
    # activations stored in the K order of the PERM tiles (permute_k / a_kperm): gate+up and down, K a multiple of
    # BK, three tile widths (BK=64 from the default tile of another BM)
    K2, N2 = 128, 128
    x2 = torch.randn(T, K2, generator=gen).bfloat16()
    w1p, w1s = weights(E, N2, K2)
    w3p, w3s = weights(E, N2, K2)
    w2p, w2s = weights(E, K2, N2)
    up = dict(a_rows=tok, b_packed=w3p, b_scale=w3s, dual="out", act="silu")
    h_ref = R(x2, w1p, w1s, offs, **up)
    hb = h_ref.bfloat16()  # the down GEMM's input, exact in bf16 (see the backward layouts below)
    y_ref = R(hb, w2p, w2s, offs, c_rows=order.to(torch.int32), num_c_rows=M)
    for bk, cfg in ((64, None), (128, dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=1)),
                    (32, dict(BM=16, BN=32, BK=32, num_warps=4, num_stages=1))):
        h = G.mxfp4_grouped_gemm(G.permute_k(x2, bk), w1p, w1s, offs, a_kperm=bk, config=cfg, **up)
        out[f"kperm{bk}_gate_up"] = _rel(h, h_ref)
        out[f"ref_kperm{bk}_gate_up"] = _rel(R(G.permute_k(x2, bk), w1p, w1s, offs, a_kperm=bk, **up), h_ref)
        y = G.mxfp4_grouped_gemm(G.permute_k(hb, bk), w2p, w2s, offs, c_rows=order.to(torch.int32), num_c_rows=M,
                                 a_kperm=bk, config=cfg)
        out[f"kperm{bk}_down"] = _rel(y, y_ref)
    for bad in (dict(a_kperm=48), dict(a_kperm=256), dict(a_kperm=64, trans_w=True),
                dict(a_kperm=64, config=dict(BM=16, BN=32, BK=32))):
        try:
            G.mxfp4_grouped_gemm(x2, w1p, w1s, offs, a_rows=tok, **bad)
            out[f"kperm_refused_{bad}"] = 1.0  # accepted: fails the < tolerance check
        except ValueError:
            out[f"kperm_refused_{bad}"] = 0.0
    # default configuration (as the module calls it), and many rows per expert (several m-blocks)
    xm = torch.randn(70, K, generator=gen).bfloat16()
    offs2 = torch.tensor([0, 40, 40, 70, 70, 70], dtype=torch.int32)
    c = G.mxfp4_grouped_gemm(xm, wp, ws, offs2)
    out["fwd_default_multiblock"] = _rel(c, R(xm, wp, ws, offs2))
    # subnormal scale byte 0 and the largest finite scales are decoded exactly
    ws_edge = ws.clone()
    ws_edge[0, :, 0] = 0
    ws_edge[1, :, 1] = 130
    c = G.mxfp4_grouped_gemm(xm, wp, ws_edge, offs2, config=dict(BM=16, BN=32, BK=32))
    out["fwd_scale_edges"] = _rel(c, R(xm, wp, ws_edge, offs2))
    # tail launches: full BM-row blocks, then each expert's short last block in TAIL-row tiles. Segment lengths
    # around the block edges (0, 1, TAIL +- 1, BM +- 1, ...), gate+up with the GLU fused and down scattered, in
    # stored and pre-permuted K order; then the default tiles where they split (BM=128, TAIL=64)
    counts3 = torch.tensor([0, 1, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65])
    E3, K3, N3 = counts3.numel(), 64, 64
    offs3 = torch.cat([torch.zeros(1, dtype=torch.int64), counts3.cumsum(0)]).to(torch.int32)
    M3 = int(counts3.sum())
    x3 = torch.randn(M3, K3, generator=gen).bfloat16()
    perm3 = torch.randperm(M3, generator=gen).to(torch.int32)
    u1p, u1s = weights(E3, N3, K3)
    u3p, u3s = weights(E3, N3, K3)
    up3 = dict(b_packed=u3p, b_scale=u3s, dual="out", act="situ", act_params=(4.0, 25.0))
    h3 = R(x3, u1p, u1s, offs3, **up3)
    y3 = R(x3, u1p, u1s, offs3, c_rows=perm3, num_c_rows=M3)
    for name, cfg, bk in (("bm32_tail16", dict(BM=32, BN=32, BK=32, TAIL=16), 0),
                          ("bm32_tail16_kperm", dict(BM=32, BN=32, BK=32, TAIL=16), 32),
                          ("bm64_tail32", dict(BM=64, BN=64, BK=64, TAIL=32), 0),
                          ("bm64_tails32_16", dict(BM=64, BN=64, BK=64, TAIL=(32, 16)), 0)):
        a3 = G.permute_k(x3, bk) if bk else x3
        out[f"tail_{name}_gate_up"] = _rel(G.mxfp4_grouped_gemm(a3, u1p, u1s, offs3, config=cfg, a_kperm=bk, **up3),
                                           h3)
        out[f"tail_{name}_down"] = _rel(G.mxfp4_grouped_gemm(a3, u1p, u1s, offs3, c_rows=perm3, num_c_rows=M3,
                                                             config=cfg, a_kperm=bk), y3)
    # the backward layouts with tails: weights [E, K, N/2] used untransposed, two weights summed (dual="in")
    t1p, t1s = weights(E3, K3, N3)
    t3p, t3s = weights(E3, K3, N3)
    a3 = torch.randn(M3, K3, generator=gen).bfloat16().float()
    a32 = torch.randn(M3, K3, generator=gen).bfloat16().float()
    bw = dict(trans_w=True, dual="in", a2=a32, b_packed=t3p, b_scale=t3s, c_rows=perm3, num_c_rows=M3)
    out["tail_bwd_dual_in"] = _rel(G.mxfp4_grouped_gemm(a3, t1p, t1s, offs3, config=dict(BM=32, BN=32, BK=32,
                                                                                          TAIL=(16,)), **bw),
                                   R(a3, t1p, t1s, offs3, **bw))
    offs4 = torch.tensor([0, 270, 340], dtype=torch.int32)  # 2 x 128 + 14 rows (a 32-row tail), 70 (one 128 tile)
    x4 = torch.randn(340, K3, generator=gen).bfloat16()
    offs5 = torch.tensor([0, 300, 340], dtype=torch.int32)  # 2 x 128 + 44 rows (a 64-row tail), 40 (a 64-row tail)
    assert G.default_config(340, 2, N3, K3, "out")["TAIL"] == (64, 32)
    assert G.default_config(340, 2, N3, K3)["TAIL"] == (64,)
    assert G.default_config(340, 2, N3, K3, "in", trans_w=True)["TAIL"] == (64, 32)
    # one row per expert: down in K-permuted 128-wide tiles, but not one row per program (expert_ids), whose
    # 16-route layers need the programs of the plain 64-wide tile
    assert G.default_config(1024, 896, 3584, 3072)["PERM"] == 1
    assert "PERM" not in G.default_config(16, 16, 3584, 3072, row_expert=True)
    bw4 = dict(bw, a2=torch.randn(340, K3, generator=gen).bfloat16().float(), b_packed=t3p[:2], b_scale=t3s[:2],
               c_rows=None, num_c_rows=None)
    a4 = torch.randn(340, K3, generator=gen).bfloat16().float()
    out["tail_default_bwd_dual_in"] = _rel(G.mxfp4_grouped_gemm(a4, t1p[:2], t1s[:2], offs4, **bw4),
                                           R(a4, t1p[:2], t1s[:2], offs4, **bw4))
    w4, up4 = (u1p[:2], u1s[:2]), dict(up3, b_packed=u3p[:2], b_scale=u3s[:2])
    out["tail_default_gate_up"] = _rel(G.mxfp4_grouped_gemm(x4, *w4, offs4, **up4), R(x4, *w4, offs4, **up4))
    out["tail_default_down"] = _rel(G.mxfp4_grouped_gemm(x4, *w4, offs4), R(x4, *w4, offs4))
    out["tail_default_down_64"] = _rel(G.mxfp4_grouped_gemm(x4, *w4, offs5), R(x4, *w4, offs5))
    # the blocks' prefix sum the GEMMs search (one launch), against PyTorch: empty segments, several steps of the
    # kernel's running sum (block=64 over 300 experts), int64 offsets
    ok = []
    for E_, dt, block in ((5, torch.int32, 1024), (300, torch.int32, 64), (300, torch.int64, 1024)):
        n = torch.randint(0, 70, (E_,), generator=gen)
        n[::3] = 0
        off = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(dt)
        for BM in (16, 32, 128):
            want = torch.cat([torch.zeros(1, dtype=torch.int64), ((n + BM - 1) // BM).cumsum(0)]).to(torch.int32)
            ok.append(torch.equal(G.block_prefix(off[:-1], off[1:], BM, block=block), want))
    out["block_prefix_equal"] = ok
    return out


def _module_checks(G, torch):
    """PackedMXFP4Experts on the kernel path (interpreted) vs dequantise-then-matmul, forward and grads."""
    from transformers_kimi3 import kernels, mxfp4_experts
    from transformers_kimi3.activations import GLUActivation
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    from kimi3_kernels.mxfp4 import tiles

    kernels.kernel_device = lambda t: True  # the kernels on CPU tensors (this worker runs under the interpreter)
    out = {}
    E, D, I, T, k = 6, 64, 96, 7, 3
    gen = torch.Generator().manual_seed(1)
    w1, w3 = torch.randn(E, I, D, generator=gen) * 0.1, torch.randn(E, I, D, generator=gen) * 0.1
    w2 = torch.randn(E, D, I, generator=gen) * 0.1
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    tw = torch.rand(T, k, generator=gen)
    x0 = torch.randn(T, D, generator=gen).bfloat16()
    dy = torch.randn(T, D, generator=gen).bfloat16()
    situ = GLUActivation("situ", 4.0, 25.0)
    for name, act in {"silu": GLUActivation("silu"), "situ": situ,
                      "unfused": lambda g, u: torch.relu(g) * u}.items():
        mod = PackedMXFP4Experts.from_float(w1, w3, w2, act)
        out[f"path_{name}"] = mod.kernel_path
        d1, d3, d2 = mod.dequantize(torch.float32)
        x, w = x0.clone().requires_grad_(), tw.clone().requires_grad_()
        y = mod(x, idx, w)
        y.backward(dy)
        xr, wr = x0.float().requires_grad_(), tw.clone().requires_grad_()
        ref = 0
        for j in range(k):
            e = idx[:, j]
            with torch.enable_grad():
                h = act(torch.einsum("td,tid->ti", xr, d1[e]), torch.einsum("td,tid->ti", xr, d3[e]))
            h = h + (h.bfloat16().float() - h).detach()
            ref = ref + wr[:, j:j + 1] * torch.einsum("ti,tdi->td", h, d2[e])
        ref.backward(dy.float())
        out[f"module_{name}_y"] = _rel(y, ref)
        out[f"module_{name}_dx"] = _rel(x.grad, xr.grad)
        out[f"module_{name}_dw"] = _rel(w.grad, wr.grad)
        if name == "situ":  # forward and the backward's recompute of gate+up with x in K-permuted order
            saved = dict(tiles._PERM_TILES)
            tiles._PERM_TILES.update({(16, "out"): (32, 64, 4, 1, 1)})
            try:
                assert G.kperm_bk(T * k, E, I, D, "out") == 64
                x, w = x0.clone().requires_grad_(), tw.clone().requires_grad_()
                mod(x, idx, w).backward(dy)
            finally:
                tiles._PERM_TILES.clear()
                tiles._PERM_TILES.update(saved)
            out["module_situ_kperm_dx"] = _rel(x.grad, xr.grad)
            out["module_situ_kperm_dw"] = _rel(w.grad, wr.grad)
    # without autograd at decode sizes the packed GEMM reads the routes' experts from topk_idx, one route per
    # program (no sort; UNSORTED_MAX_ROUTES): two launches (SiTU fused into gate+up), the same result as the
    # reference
    sorts = []
    real_route = mxfp4_experts._route
    mxfp4_experts._route = lambda *a, **kw: sorts.append(1) or real_route(*a, **kw)
    gemm, gemm_calls = G.mxfp4_grouped_gemm, []
    G.mxfp4_grouped_gemm = lambda *a, **kw: gemm_calls.append(kw.get("expert_ids") is not None) or gemm(*a, **kw)
    mod = PackedMXFP4Experts.from_float(w1, w3, w2, situ)
    d1, d3, d2 = mod.dequantize(torch.float32)
    ref = 0
    for j in range(k):
        e = idx[:, j]
        h = situ(torch.einsum("td,tid->ti", x0.float(), d1[e]), torch.einsum("td,tid->ti", x0.float(), d3[e]))
        ref = ref + tw[:, j:j + 1] * torch.einsum("ti,tdi->td", h.bfloat16().float(), d2[e])
    try:
        mod.UNSORTED_MAX_ROUTES = 64
        with torch.no_grad():
            y = mod(x0, idx, tw)
        out["module_gemm_unsorted_y"] = _rel(y, ref)
        out["launches_gemm_unsorted"] = (sum(gemm_calls), len(gemm_calls))
        out["sorts_gemm_unsorted"] = len(sorts)
        # an expert id out of range is an error (checked on the device by route_expert_ids' flag)
        bad_idx = idx.clone()
        bad_idx[2, 1] = E
        try:
            with torch.no_grad():
                mod(x0, bad_idx, tw)
            out["module_unsorted_refuses_bad_id"] = False
        except RuntimeError as ex:
            out["module_unsorted_refuses_bad_id"] = "out-of-range" in str(ex)
        ids, ok = G.route_expert_ids(idx, E)
        _, bad_ok = G.route_expert_ids(bad_idx - 2 * E * (bad_idx == E), E)  # a negative id
        out["route_expert_ids"] = [bool(torch.equal(ids.long(), idx.reshape(-1))), int(ok), int(bad_ok)]
        # ... and with x in a tile's K order from the same launch (both orders), as permute_k gives it
        out["route_expert_ids_x"] = [
            bool(torch.equal(xp, G.permute_k(x0, 64, nib=nib)) and torch.equal(ids2, ids) and int(ok2))
            for nib in (False, True) for ids2, ok2, xp in [G.route_expert_ids(idx, E, x0, 64, nib)]]
        # one route per program with K-permuted tiles (x and h copied into their K order)
        saved = dict(tiles._PERM_TILES)
        tiles._PERM_TILES.update({(16, "out"): (32, 64, 4, 1, 1), (16, None): (32, 32, 4, 1, 1)})
        try:
            with torch.no_grad():
                out["module_gemm_kperm_unsorted_y"] = _rel(mod(x0, idx, tw), ref)
            # the module's cached tile choice follows the tables (gate+up K-permuted at BK 64 now, plain before)
            out["module_tiles_follow_tables"] = [mod._mlp_tiles(G, T * k, T * k, True, x0.device, x0.dtype)[::2]]
        finally:
            tiles._PERM_TILES.clear()
            tiles._PERM_TILES.update(saved)
        out["module_tiles_follow_tables"].append(mod._mlp_tiles(G, T * k, T * k, True, x0.device, x0.dtype)[::2])
        # the default: unsorted up to 32 routes without autograd; sorted above 32 routes or with autograd. Top-2
        # here, so 16 tokens are 32 routes; (GEMM launches with expert_ids, all GEMM launches, sorts)
        del mod.UNSORTED_MAX_ROUTES
        gen2 = torch.Generator().manual_seed(2)  # leaves `gen`'s draws below as they were
        xd = torch.randn(17, D, generator=gen2).bfloat16()
        idx2 = torch.stack([torch.randperm(E, generator=gen2)[:2] for _ in range(17)])
        tw2 = torch.rand(17, 2, generator=gen2)
        for name, n, grad in (("32", 16, False), ("34", 17, False), ("32_grad", 16, True)):
            gemm_calls.clear()
            sorts.clear()
            with torch.set_grad_enabled(grad):
                mod(xd[:n].clone().requires_grad_(grad), idx2[:n], tw2[:n])
            out[f"default_routes_{name}"] = [sum(gemm_calls), len(gemm_calls), len(sorts)]
        # fp32 activations (an fp32 model) never reach the packed GEMM (bf16 operands): the gathered exact path
        # without autograd at decode sizes, the sorted one otherwise, against the fp32 dequantise-then-matmul
        xf = xd.float()
        d1, d3, d2 = mod.dequantize(torch.float32)
        for name, n, grad in (("16", 16, False), ("17_grad", 17, True)):
            gemm_calls.clear()
            with torch.set_grad_enabled(grad):
                yf = mod(xf[:n].clone().requires_grad_(grad), idx2[:n], tw2[:n])
            ref_f = 0
            for j in range(2):
                e = idx2[:n, j]
                h = situ(torch.einsum("td,tid->ti", xf[:n], d1[e]), torch.einsum("td,tid->ti", xf[:n], d3[e]))
                ref_f = ref_f + tw2[:n, j:j + 1] * torch.einsum("ti,tdi->td", h, d2[e])
            out[f"fp32_{name}"] = [len(gemm_calls), _rel(yf, ref_f)]
    finally:
        mxfp4_experts._route = real_route
        G.mxfp4_grouped_gemm = gemm
    # K-permuted operands through the module (x and h copied into the tiles' K order), with K-permuted
    # default tiles at this size (BM=16: BK 64 for gate+up, 32 for down), against the module with plain tiles
    mod = PackedMXFP4Experts.from_float(w1, w3, w2)
    mod.UNSORTED_MAX_ROUTES = 0  # the sorted path
    with torch.no_grad():
        plain = mod(x0, idx, tw)
        saved = dict(tiles._PERM_TILES)
        tiles._PERM_TILES.update({(16, "out"): (32, 64, 4, 1, 1), (16, None): (32, 32, 4, 1, 1)})
        bks = G.kperm_bk(T * k, E, I, D, "out"), G.kperm_bk(T * k, E, D, I)
        try:
            permuted = mod(x0, idx, tw)
        finally:
            tiles._PERM_TILES.clear()
            tiles._PERM_TILES.update(saved)
    out["module_kperm_bks"] = list(bks)
    out["module_kperm_vs_plain"] = _rel(permuted, plain)
    # prefill: experts decoded to bf16 in chunks (two experts per chunk here) + torch._grouped_mm, against the
    # packed GEMMs on the same inputs; an unused expert (5) leaves its chunk's bounds empty
    mod = PackedMXFP4Experts.from_float(w1, w3, w2, situ)
    out["dequant_bits_equal"] = all(
        torch.equal(G.dequantize_bf16(getattr(mod, f"{n}_packed"), getattr(mod, f"{n}_scale")),
                    G.dequant_ref(getattr(mod, f"{n}_packed"), getattr(mod, f"{n}_scale")).bfloat16())
        for n in ("w1", "w3", "w2"))
    idx_p = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(40)])
    xp = torch.randn(40, D, generator=gen).bfloat16()
    with torch.no_grad():
        packed = mod(xp, idx_p, tw[:1].expand(40, k))
        mod.DEQUANT_MIN_ROWS_PER_EXPERT, mod.DEQUANT_CHUNK_BYTES = 1, 2 * 3 * I * D * 2
        deq = mod(xp, idx_p, tw[:1].expand(40, k))
    out["module_dequantized_vs_packed"] = _rel(deq, packed)
    return out


def _plan_checks(G, torch):
    """mxfp4_grouped_gemm's launch plans: made once per call signature, made again when a tile table or an option
    changes, never kept for a call that fails its checks."""
    from kimi3_kernels.mxfp4 import gemm, tiles

    out = {}
    gen = torch.Generator().manual_seed(5)
    E, N, K = 3, 64, 64
    wp = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    ws = torch.randint(118, 128, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    x = torch.randn(6, K, generator=gen).bfloat16()
    offs = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    made = []
    real = gemm._Plan

    class Counting(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    gemm._Plan = Counting
    saved = dict(tiles._PERM_TILES)
    try:
        G.clear_plans()
        first = G.mxfp4_grouped_gemm(x, wp, ws, offs)
        again = G.mxfp4_grouped_gemm(x, wp, ws, offs)
        out["plan_reused"] = [len(made), bool(torch.equal(first, again))]
        tiles._PERM_TILES[16, None] = (64, 128, 4, 4, 0)  # BN 128 -> 64: a new plan with the new tile
        narrow = G.mxfp4_grouped_gemm(x, wp, ws, offs)
        out["plan_table_change"] = [len(made), made[-1].steps[0][1].meta["BN"], bool(torch.equal(first, narrow))]
        tiles._PERM_TILES.update(saved)
        with G.variant(l2_prefetch=0):  # another option value: another plan (the Gluon kernel's; same bits here)
            other = G.mxfp4_grouped_gemm(x, wp, ws, offs)
        out["plan_option_change"] = [len(made), bool(torch.equal(other, first))]
        G.mxfp4_grouped_gemm(x, wp, ws, offs)  # the tables as at first: a plan from them
        rows = torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int32)
        gathered = G.mxfp4_grouped_gemm(x, wp, ws, offs, a_rows=rows)  # another signature: its own plan
        ref = G.mxfp4_grouped_gemm(x[rows.long()].contiguous(), wp, ws, offs)
        out["plan_gather"] = [len(made), _rel(gathered, ref)]
        refused = []
        for _ in range(2):
            try:
                G.mxfp4_grouped_gemm(x[:, :32], wp, ws, offs)
            except ValueError as ex:
                refused.append("columns" in str(ex))
        out["plan_refused_twice"] = refused + [len(made)]
    finally:
        gemm._Plan = real
        tiles._PERM_TILES.clear()
        tiles._PERM_TILES.update(saved)
        G.clear_plans()
    return out


def _worker():
    _setup_path()
    import torch

    import kimi3_kernels.mxfp4 as G

    res = {"interpreter": G.gemm.interpreter_enabled(), "available_cpu": G.available("cpu")}
    res.update(_kernel_checks(G, G.mxfp4_grouped_gemm_ref, torch))
    res.update(_plan_checks(G, torch))
    res.update(_module_checks(G, torch))
    print("RESULT " + json.dumps(res))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's results, once per test run (kimi3_testing.once_per_run): a second pytest-xdist worker that gets
    some of this file's tests reads them instead of running the interpreter for another minute."""
    pytest.importorskip("triton", reason="triton is not installed")
    return interpreted_results(tmp_path_factory, "mxfp4_triton", __file__)


def test_interpreter_active(results):
    assert results["interpreter"] and results["available_cpu"]


def test_kernel_matches_reference(results):
    # same bf16 operands, fp32 accumulation in another order; fused GLU outputs are fp32 here: 1e-5
    # (ref_: the reference's own K-order and expert_ids arguments against its sorted, stored-order form)
    kernel = {k: v for k, v in results.items() if k.startswith(("fwd_", "bwd_", "kperm", "tail_", "ref_"))}
    assert len(kernel) == 60, sorted(kernel)
    bad = {k: v for k, v in kernel.items() if not v < 1e-5}
    assert not bad, bad


def test_launch_plans(results):
    # one plan for repeated calls (same bits); a changed tile table or option gives a new plan that uses it (BN 64;
    # the L2 prefetch is the Gluon kernel's, so the same bits here); another signature has its own (the gathered
    # rows equal the reference on gathered inputs bit for bit in this order: < 1e-6); a call refused by the checks
    # is refused again and leaves no plan
    assert results["plan_reused"] == [1, True]
    assert results["plan_table_change"] == [2, 64, True]
    assert results["plan_option_change"] == [3, True]
    n, err = results["plan_gather"]
    assert n == 5 and err < 1e-6, results["plan_gather"]  # 4: the first tables again
    assert results["plan_refused_twice"] == [True, True, 5]


def test_block_prefix_matches_pytorch(results):
    assert results["block_prefix_equal"] == [True] * 9, results["block_prefix_equal"]


def test_prefill_dequantized_grouped_mm_path(results):
    # the one-launch decode gives the reference's bits (scale edges: the GEMM checks above, same decode function)
    assert results["dequant_bits_equal"]
    # bf16 rounding of the gate/up and down outputs (torch._grouped_mm's dtype) where the packed GEMMs keep fp32,
    # and the interpreter truncates: a few 1e-3 (a wrong expert or row would be O(1))
    assert results["module_dequantized_vs_packed"] < 1e-2, results


def test_module_triton_path_matches_dequantise_then_matmul(results):
    for name in ("silu", "situ", "unfused"):
        assert results[f"path_{name}"] == "triton"
        # forward: fp32 products of the same bf16 operands; y is bf16 (RMS rounding ~1e-3 against the fp32
        # reference) and the fused GLU output is rounded to bf16 in the kernel, which the interpreter does by
        # truncation (up to one bf16 ulp, 2^-8; measured ~4e-3 in total): bound 1e-2
        assert results[f"module_{name}_y"] < 1e-2, results
        # backward: the kernel also rounds dgate/dup (fp32) to bf16 operands (measured ~4e-3): bound 2e-2
        assert results[f"module_{name}_dx"] < 2e-2, results
        assert results[f"module_{name}_dw"] < 2e-2, results
    # with K-permuted gate+up tiles (x copied into their K order in the forward and in the backward's recompute)
    assert results["module_situ_kperm_dx"] < 2e-2 and results["module_situ_kperm_dw"] < 2e-2, results
    # no autograd, decode size: two launches straight from topk_idx (GEMMs one route per program), nothing
    # sorted; same bound as above (measured 6.5e-3: the weighted sum is stored to bf16 by a kernel too, which the
    # interpreter truncates)
    assert results["launches_gemm_unsorted"] == [2, 2] and results["sorts_gemm_unsorted"] == 0, results
    # the default: unsorted at 32 routes without autograd; sorted (no expert_ids launch, one sort) at 34 routes
    # and with autograd
    assert results["default_routes_32"] == [2, 2, 0], results
    assert results["default_routes_34"] == [0, 2, 1] and results["default_routes_32_grad"] == [0, 2, 1], results
    assert results["module_unsorted_refuses_bad_id"] and results["route_expert_ids"] == [True, 1, 0], results
    assert results["route_expert_ids_x"] == [True, True]
    # (bk_up, bk_dn, h_direct) while the tables give a K-permuted gate+up tile (down keeps its plain tile for one
    # row per program: `default_config`), then after they are restored
    assert results["module_tiles_follow_tables"] == [[64, 0, False], [0, 0, False]], results
    for name in ("gemm", "gemm_kperm"):
        assert results[f"module_{name}_unsorted_y"] < 1e-2, results
    # K-permuted operands in the module: the same products summed in another order, then rounded to bf16 (h and
    # y); measured 0.0 here, a wrong column order gives ~1.4
    assert results["module_kperm_bks"] == [64, 32]
    assert results["module_kperm_vs_plain"] < 1e-3, results


def test_module_fp32_runs_exact_not_the_bf16_gemm(results):
    """Issue 52: fp32 activations on a kernel device take the exact paths (no packed GEMM launch, whose operands
    are bf16): fp32 sums of the same products against dequantise-then-matmul in another order."""
    for name in ("16", "17_grad"):
        calls, err = results[f"fp32_{name}"]
        assert calls == 0 and err < 1e-6, (name, results[f"fp32_{name}"])


def test_host_grid_helpers_match_triton():
    """The plain-Python cdiv / next_pow2 the launch paths use instead of Triton's constexpr functions (host calls
    cost ~2.7 us each there) give Triton's values."""
    triton = pytest.importorskip("triton", reason="triton is not installed")
    from kimi3_kernels._host import cdiv, next_pow2

    assert [cdiv(x, y) for x in range(0, 300) for y in (1, 2, 3, 16, 64, 1024)] == \
        [triton.cdiv(x, y) for x in range(0, 300) for y in (1, 2, 3, 16, 64, 1024)]
    xs = list(range(1, 2100)) + [3584, 3072, 16384, 2 ** 20 + 1]
    assert [next_pow2(x) for x in xs] == [triton.next_power_of_2(x) for x in xs]
    assert next_pow2(0) == 1


def test_ptx_decode_emulated():
    """The inline-PTX E2M1 decode (GPU-only, so the interpreter cannot run it), executed instruction by instruction
    here, equals the exact decode for every byte value and the scale bytes that matter (subnormal 0 and 1,
    overflow at 253 and 254). On an sm_90 GPU tests/test_mxfp4_wgmma.py compares the kernels that run it with the
    reference."""
    pytest.importorskip("triton", reason="triton is not installed")
    import torch

    from kimi3_kernels.mxfp4 import decode as G
    lut = (0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6)

    def want(code, s):
        return torch.tensor(lut[code] * 2.0 ** (s - 127), dtype=torch.float64).to(torch.bfloat16).view(
            torch.int16).item() & 0xFFFF

    def scale_word(s):
        b = max(s << 7, 0x40)  # as _e8m0_to_bf16x2
        return b | (b << 16)

    pairs = G.E2M1_PTX
    # the table operands are exact only because a scale word's halves are equal: ZERO_PTX gives 0 for every one
    assert {run_decode_ptx(G.ZERO_PTX, scale_word(s), [], n_out=1)[0] for s in range(255)} == {0}
    assert run_decode_ptx(G.ZERO_PTX, 0x3F803F00, [], n_out=1)[0] != 0
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0)).tolist()
    for s0 in (0, 1, 2, 100, 127, 200, 252, 253, 254):
        sc = [s0, (s0 + 1) % 255, (s0 + 77) % 255, 254 - s0 % 3]  # distinct scales per byte: checks the routing
        for b in range(0, 256, 4):
            byts = perm[b:b + 4]  # all 256 values, in unrelated groups of 4
            x = sum(v << (8 * i) for i, v in enumerate(byts))
            lo = [want(v & 15, s) for v, s in zip(byts, sc)]
            hi = [want(v >> 4, s) for v, s in zip(byts, sc)]
            out = run_decode_ptx(pairs, x, [scale_word(s) for s in sc], G)
            assert out == [lo[i] | (hi[i] << 16) for i in range(4)], (s0, byts)


if __name__ == "__main__":
    _worker()
