"""Routed-expert GEMMs at K3 shapes on one GPU: packed MXFP4 grouped GEMM (ours, Triton) vs bf16
`torch._grouped_mm` vs a per-expert bf16 loop. Time, weight memory and correctness in one run.

    python bench/moe.py --out DIR [--tokens 1 64 1024 16384] [--commit SHA] [--sweep]

Scope of the headline numbers is the anchor's (shared/anchors/anchor_gpu2.py): gate+up, GLU, down on tokens already
routed (bf16: tokens pre-gathered and sorted; ours: gathered inside the kernel, written back to (token, slot) order).
`full_forward_ms` adds routing (sort, offsets), the weighted sum over the top-k and, for bf16, gather and
scatter. Weights are random MXFP4 (uniform codes, E8M0 scales 2^-9..2^-6); the bf16 baseline uses their exact
dequantisation, so all paths compute the same function.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
E, TOPK, D, INTER = 896, 16, 3584, 3072
DEV = "cuda"  # --smoke: tiny shapes on the CPU under TRITON_INTERPRET=1, to check this script without a GPU
ANCHOR_MS = {1: 0.468, 64: 12.31, 1024: 17.74, 16384: 47.67}  # shared/anchors/anchor2.json, same H200 kind
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def load_modules():
    """kimi3_kernels.mxfp4_gemm (by package, else by path) and transformers_kimi3/mxfp4.py standalone (the
    package __init__ imports the whole model, which needs newer transformers than some GPU images carry)."""
    for p in (ROOT / "src", ROOT / "kernels"):
        sys.path.insert(0, str(p))
    note = ""
    try:
        from kimi3_kernels import mxfp4_gemm as G
    except Exception as ex:
        note = f"kimi3_kernels import failed ({ex!r}); mxfp4_gemm loaded by path"
        pkg = types.ModuleType("kimi3_kernels")
        pkg.__path__ = [str(ROOT / "kernels" / "kimi3_kernels")]
        sys.modules["kimi3_kernels"] = pkg
        spec = importlib.util.spec_from_file_location("kimi3_kernels.mxfp4_gemm", pkg.__path__[0] + "/mxfp4_gemm.py")
        G = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = G
        spec.loader.exec_module(G)
    # a stand-in package over the source folder, so mxfp4.py's relative imports resolve without the real __init__
    src = types.ModuleType("kimi3_src")
    src.__path__ = [str(ROOT / "src" / "transformers_kimi3")]
    sys.modules["kimi3_src"] = src
    spec = importlib.util.spec_from_file_location("kimi3_src.mxfp4", ROOT / "src" / "transformers_kimi3" / "mxfp4.py")
    M = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = M
    spec.loader.exec_module(M)
    M._GEMM[:] = [G]
    return G, M, note


def bench(fn, warm=3, rep=10):
    """The anchor's timing: CUDA events around each call, median."""
    if DEV == "cpu":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def graph_ms(fn, rep=50):
    from _timing import capture  # bench/_timing.py (this folder is on sys.path when run as a script)

    return bench(capture(fn).replay, warm=5, rep=rep)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ceilings():
    out = {}
    if DEV == "cpu":
        return {"copy_TBps": float("nan"), "bf16_mm_TFLOPs": float("nan")}
    a = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    out["copy_TBps"] = 2 * a.numel() / bench(lambda: b.copy_(a)) / 1e9
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    out["bf16_mm_TFLOPs"] = 2 * 8192 ** 3 / bench(lambda: x @ y) / 1e9
    return out


def make_mxfp4_weights(M, gen_seed=0):
    """The packed experts alone (random codes, scales 2^-9..2^-6), without the bf16 copies."""
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    mod = M.PackedMXFP4Experts(E, D, INTER, M.silu_glu, device=DEV)
    for n in ("w1", "w3", "w2"):
        p, s = getattr(mod, f"{n}_packed"), getattr(mod, f"{n}_scale")
        p.copy_(torch.randint(0, 256, p.shape, device=DEV, dtype=torch.uint8, generator=g))
        s.copy_(torch.randint(118, 122, s.shape, device=DEV, dtype=torch.uint8, generator=g))
    return mod


def make_weights(M, gen_seed=0):
    mod = make_mxfp4_weights(M, gen_seed)
    # bf16 baseline weights: exact dequantisation, chunked over experts
    w13 = torch.empty(E, 2 * INTER, D, device=DEV, dtype=torch.bfloat16)
    w2 = torch.empty(E, D, INTER, device=DEV, dtype=torch.bfloat16)
    for e0 in range(0, E, 8):  # small chunks: the decode's temporaries must fit beside 74 GB of weights (H100)
        sl = slice(e0, e0 + 8)
        w13[sl, :INTER] = M.dequantize_mxfp4(mod.w1_packed[sl], mod.w1_scale[sl])
        w13[sl, INTER:] = M.dequantize_mxfp4(mod.w3_packed[sl], mod.w3_scale[sl])
        w2[sl] = M.dequantize_mxfp4(mod.w2_packed[sl], mod.w2_scale[sl])
    return mod, w13, w2


def routing(n, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    idx = torch.rand(n, E, device=DEV, generator=g).topk(TOPK, dim=-1).indices
    w = torch.rand(n, TOPK, device=DEV, generator=g)
    return idx, w / w.sum(-1, keepdim=True)


def fp32_reference(mod, M, x, idx, w, act, tokens):
    """Dequantise-then-matmul in fp32 for the first `tokens` tokens (GLU output rounded to bf16 as the paths do)."""
    out = torch.zeros(tokens, D, device=DEV)
    for t in range(tokens):
        for j in range(TOPK):
            e = int(idx[t, j])
            w1 = M.dequantize_mxfp4(mod.w1_packed[e], mod.w1_scale[e], torch.float32)
            w3 = M.dequantize_mxfp4(mod.w3_packed[e], mod.w3_scale[e], torch.float32)
            w2 = M.dequantize_mxfp4(mod.w2_packed[e], mod.w2_scale[e], torch.float32)
            xf = x[t].float()
            h = act(w1 @ xf, w3 @ xf).bfloat16().float()
            out[t] += w[t, j] * (w2 @ h)
    return out


SWEEP = {  # (BM, BN, BK, num_warps, num_stages, DEQ); DEQ 0: own bit-twiddling dequant, 1: tl.dot_scaled
    # (a first run with DEQ=1 candidates is kept in bench/results/moe_h200.run1.json: DEQ=1 was slower everywhere)
    "small": [(16, 64, 64, 4, 4, 0), (16, 128, 64, 8, 4, 0), (16, 64, 64, 4, 6, 0), (16, 64, 128, 4, 4, 0)],
    "mid": [(64, 64, 128, 4, 3, 0), (64, 64, 64, 4, 4, 0), (64, 64, 128, 8, 3, 0), (32, 64, 64, 4, 4, 0)],
    "large": [(128, 64, 64, 8, 3, 0), (128, 64, 64, 8, 4, 0), (128, 64, 32, 8, 4, 0), (64, 64, 64, 4, 4, 0)],
}


def cfg_dict(c):
    return dict(BM=c[0], BN=c[1], BK=c[2], num_warps=c[3], num_stages=c[4], DEQ=c[5])


def run(args):
    G, M, note = load_modules()
    res = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke test)", "torch": torch.__version__, "triton": None,
           "commit": args.commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "shapes": dict(experts=E, top_k=TOPK, latent=D, expert_width=INTER),
           "anchor_grouped_mm_ms": ANCHOR_MS, "note": note, "rows": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    log("env", res["gpu"], res["torch"], res["triton"], note)
    res["ceilings"] = ceilings()
    log("ceilings", res["ceilings"])
    mod, w13, w2 = make_weights(M)
    res["kernel_path"] = mod.kernel_path
    mem = dict(mxfp4_bytes=mod.weight_bytes, bf16_bytes=(w13.numel() + w2.numel()) * 2)
    mem["ratio"] = mem["mxfp4_bytes"] / mem["bf16_bytes"]
    res["weight_memory"] = mem
    log("weights", mem)
    gmm = torch._grouped_mm
    situ = M.SiTUGLU(4.0, 25.0)
    per_expert_bytes = 3 * INTER * D * (0.5 + 1 / 32)
    for n in args.tokens:
        row = {"tokens": n}
        x = torch.randn(n, D, device=DEV, dtype=torch.bfloat16)
        idx, w = routing(n, seed=n)
        order, offsets = M._route(idx, E, sync_ok=False)
        tok = (order // TOPK).to(torch.int32)
        order32 = order.to(torch.int32)
        Mrows = n * TOPK
        counts = offsets[1:] - offsets[:-1]
        active = int((counts > 0).sum())
        row["active_experts"] = active
        row["mxfp4_weight_GB_read"] = active * per_expert_bytes / 1e9
        row["bf16_weight_GB_read"] = active * 3 * INTER * D * 2 / 1e9
        row["GFLOP"] = 2 * Mrows * 3 * INTER * D / 1e9
        # ---- bf16 grouped_mm baseline (anchor scope)
        xs = x[order // TOPK]
        offs = offsets[1:].contiguous()

        def grouped():
            h = gmm(xs, w13.transpose(1, 2), offs=offs)
            a, b = h.chunk(2, -1)
            return gmm(F.silu(a) * b, w2.transpose(1, 2), offs=offs)

        row["grouped_mm_ms"] = bench(grouped)

        def grouped_full():
            o, off = M._route(idx, E, sync_ok=False)
            xs_ = x[o // TOPK]
            y = grouped_impl(xs_, off[1:])
            return M._combine(torch.empty_like(y, dtype=torch.float32).index_copy_(0, o, y.float()), w, n, TOPK,
                              x.dtype)

        def grouped_impl(xs_, offs_):
            h = gmm(xs_, w13.transpose(1, 2), offs=offs_)
            a, b = h.chunk(2, -1)
            return gmm(F.silu(a) * b, w2.transpose(1, 2), offs=offs_)

        row["grouped_mm_full_forward_ms"] = bench(grouped_full)
        # ---- per-expert bf16 loop (anchor: up to 1024 tokens)
        if n <= 1024:
            cl = counts.tolist()
            starts = offsets[:-1].tolist()
            act_list = [(e, s, c) for e, (s, c) in enumerate(zip(starts, cl)) if c > 0]

            def loop():
                out = torch.empty_like(xs)
                for e, s, c in act_list:
                    h = xs[s:s + c] @ w13[e].T
                    a, b = h.chunk(2, -1)
                    out[s:s + c] = (F.silu(a) * b) @ w2[e].T
                return out

            row["per_expert_loop_ms"] = bench(loop, warm=1, rep=3)
        # ---- ours, kernel scope, config sweep
        regime = "small" if n <= 64 else ("mid" if n <= 4096 else "large")
        sweeps = {}
        for kname in ("gate_up", "down"):
            best = None
            for c in ([None] + SWEEP[regime]) if args.sweep else [None]:
                cfg = None if c is None else cfg_dict(c)
                # the default tile as the module runs it: activations copied into its K order where it takes them
                # so (the copy timed too); sweep tiles read them in stored order
                try:
                    if kname == "gate_up":
                        bk = G.kperm_bk(Mrows, E, INTER, D, "out") if cfg is None else 0
                        fn = lambda cfg=cfg, bk=bk: G.mxfp4_grouped_gemm(  # noqa: E731
                            G.permute_k(x, bk) if bk else x, mod.w1_packed, mod.w1_scale, offsets, a_rows=tok,
                            dual="out", act="silu", b_packed=mod.w3_packed, b_scale=mod.w3_scale,
                            out_dtype=torch.bfloat16, config=cfg, a_kperm=bk)
                    else:
                        bk = G.kperm_bk(Mrows, E, D, INTER) if cfg is None else 0
                        hh = torch.randn(Mrows, INTER, device=DEV, dtype=torch.bfloat16)
                        fn = lambda cfg=cfg, hh=hh, bk=bk: G.mxfp4_grouped_gemm(  # noqa: E731
                            G.permute_k(hh, bk) if bk else hh, mod.w2_packed, mod.w2_scale, offsets, c_rows=order32,
                            num_c_rows=Mrows, config=cfg, a_kperm=bk)
                    t = bench(fn, warm=2, rep=10)
                except Exception as ex:  # a config that does not compile or run
                    sweeps[f"{kname}:{c}"] = repr(ex)[:200]
                    continue
                sweeps[f"{kname}:{'default' if c is None else c}"] = t
                if best is None or t < best[0]:
                    best = (t, c)
            row[f"{kname}_best_ms"], row[f"{kname}_best_cfg"] = best if best else (None, None)
            row[f"{kname}_default_ms"] = sweeps.get(f"{kname}:default")
        row["sweep_ms"] = sweeps
        row["default_cfg_gate_up"] = G.default_config(Mrows, E, INTER, D, "out")
        row["default_cfg_down"] = G.default_config(Mrows, E, D, INTER)
        log(n, "sweep", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sweeps.items()})
        cfg_up = None if row["gate_up_best_cfg"] is None else cfg_dict(row["gate_up_best_cfg"])
        cfg_dn = None if row["down_best_cfg"] is None else cfg_dict(row["down_best_cfg"])

        def ours_kernels(cfg_up=cfg_up, cfg_dn=cfg_dn, act="silu", act_params=(1.0, 1.0), h_direct=True):
            # as the module calls them: default tiles that take K-permuted operands get x and h copied into that
            # order (timed here)
            # (and in the table-free decode's order where the Gluon tiles take it)
            bk_up, wg_up = G.kperm_tile(Mrows, E, INTER, D, "out") if cfg_up is None else (0, False)
            bk_dn, wg_dn = G.kperm_tile(Mrows, E, D, INTER) if cfg_dn is None else (0, False)
            nib_up = bool(bk_up) and wg_up and mod._table_free_ok()
            nib_dn = bool(bk_dn) and wg_dn and mod._table_free_ok()
            # h written in the down tile's K order by gate+up (as the module does), or h_direct=False: copied
            direct = h_direct and wg_up and wg_dn and bool(bk_dn)
            h = G.mxfp4_grouped_gemm(G.permute_k(x, bk_up, nib_up) if bk_up else x, mod.w1_packed, mod.w1_scale,
                                     offsets, a_rows=tok, dual="out", act=act, act_params=act_params,
                                     b_packed=mod.w3_packed, b_scale=mod.w3_scale, out_dtype=torch.bfloat16,
                                     config=cfg_up, a_kperm=bk_up, a_nib=nib_up, c_kperm=bk_dn if direct else 0,
                                     c_nib=nib_dn)
            return G.mxfp4_grouped_gemm(G.permute_k(h, bk_dn, nib_dn) if bk_dn and not direct else h,
                                        mod.w2_packed, mod.w2_scale,
                                        offsets, c_rows=order32, num_c_rows=Mrows, config=cfg_dn, a_kperm=bk_dn,
                                        a_nib=nib_dn)

        row["mxfp4_ms"] = bench(ours_kernels)
        row["mxfp4_default_cfg_ms"] = bench(lambda: ours_kernels(None, None))
        row["mxfp4_h_copied_ms"] = bench(lambda: ours_kernels(None, None, h_direct=False))
        row["mxfp4_situ_ms"] = bench(lambda: ours_kernels(act="situ", act_params=(4.0, 25.0)))
        row["mxfp4_full_forward_ms"] = bench(lambda: mod(x, idx, w))  # default configs, routing and combine
        if n <= 64 and DEV == "cuda":
            try:
                row["mxfp4_full_forward_graph_ms"] = graph_ms(lambda: mod(x, idx, w))
                row["grouped_mm_full_forward_graph_ms"] = graph_ms(grouped_full)
                # both decode paths whatever the default (KIMI3_MXFP4_UNSORTED_MAX_ROUTES, 32 routes): routes
                # sorted by expert, and the packed GEMM one route per program straight from topk_idx
                if n <= 16:
                    outs, saved = {}, os.environ.get("KIMI3_MXFP4_UNSORTED_MAX_ROUTES")
                    for name, limit in (("sorted", 0), ("unsorted", Mrows)):
                        os.environ["KIMI3_MXFP4_UNSORTED_MAX_ROUTES"] = str(limit)
                        try:
                            with torch.no_grad():
                                outs[name] = mod(x, idx, w)
                            row[f"mxfp4_{name}_full_forward_graph_ms"] = graph_ms(lambda: mod(x, idx, w))
                        finally:
                            if saved is None:
                                os.environ.pop("KIMI3_MXFP4_UNSORTED_MAX_ROUTES", None)
                            else:
                                os.environ["KIMI3_MXFP4_UNSORTED_MAX_ROUTES"] = saved
                    row["rel_mxfp4_unsorted_vs_sorted"] = rel(outs["unsorted"], outs["sorted"])
            except Exception as ex:
                row["graph_error"] = repr(ex)[:200]
        row["speedup_vs_grouped_mm"] = row["grouped_mm_ms"] / row["mxfp4_ms"]
        row["speedup_vs_anchor"] = ANCHOR_MS.get(n, float("nan")) / row["mxfp4_ms"]
        row["speedup_full_forward"] = row["grouped_mm_full_forward_ms"] / row["mxfp4_full_forward_ms"]
        if "per_expert_loop_ms" in row:
            row["speedup_vs_loop"] = row["per_expert_loop_ms"] / row["mxfp4_ms"]
        row["mxfp4_weight_TBps"] = row["mxfp4_weight_GB_read"] / row["mxfp4_ms"]
        row["mxfp4_TFLOPs"] = row["GFLOP"] / row["mxfp4_ms"]
        row["bf16_TFLOPs"] = row["GFLOP"] / row["grouped_mm_ms"]
        # ---- correctness at real shapes (first tokens against fp32 dequantise-then-matmul)
        nt = min(n, 4)
        y_ours = mod(x, idx, w).float()
        y_grp = grouped_full().float()
        ref = fp32_reference(mod, M, x, idx, w, M.silu_glu, nt)
        row["rel_err_mxfp4_vs_fp32"] = rel(y_ours[:nt], ref)
        row["rel_err_bf16_grouped_vs_fp32"] = rel(y_grp[:nt], ref)
        row["rel_err_mxfp4_vs_bf16_grouped_all_tokens"] = rel(y_ours, y_grp)
        ref_s = fp32_reference(mod, M, x, idx, w, situ, nt)
        mod.glu_act, mod._fused = situ, M.fused_act_spec(situ)
        row["rel_err_mxfp4_situ_vs_fp32"] = rel(mod(x, idx, w).float()[:nt], ref_s)
        row["mxfp4_situ_full_forward_ms"] = bench(lambda: mod(x, idx, w))  # K3's module forward (SiTU-GLU)
        mod.glu_act, mod._fused = M.silu_glu, M.fused_act_spec(M.silu_glu)
        res["rows"].append(row)
        log(n, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "sweep_ms"})
        del xs, x
        if DEV == "cuda":
            torch.cuda.empty_cache()
    # ---- backward at real shapes: Triton path vs the per-expert PyTorch path on the same GPU
    try:
        n = 16
        x = torch.randn(n, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        idx, w = routing(n, seed=7)
        w = w.requires_grad_()
        dy = torch.randn(n, D, device=DEV, dtype=torch.bfloat16)
        mod.glu_act, mod._fused = situ, M.fused_act_spec(situ)
        res["dot_scaled_ok"] = G._DOT_SCALED["ok"]
        y = mod(x, idx, w)
        y.backward(dy)
        order, offsets = M._route(idx, E, sync_ok=True)
        dx_t, dw_t = mod._backward_torch(x.detach(), w.detach(), dy, order, offsets, TOPK)
        y_t = M._combine(mod._forward_torch(x.detach(), order, offsets, TOPK), w.detach(), n, TOPK, x.dtype)
        bwd = {"tokens": n, "rel_err_y": rel(y, y_t), "rel_err_dx": rel(x.grad, dx_t.view(n, TOPK, -1).sum(1)),
               "rel_err_dtopk_w": rel(w.grad, dw_t.view(n, TOPK))}
        for n in (1024, 16384, 40):
            if n not in args.tokens:
                continue
            x = torch.randn(n, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            idx, w = routing(n, seed=8)
            dy = torch.randn(n, D, device=DEV, dtype=torch.bfloat16)
            bwd[f"fwd_bwd_ms_{n}"] = bench(lambda: mod(x, idx, w).backward(dy), warm=1, rep=3)
        res["backward"] = bwd
        log("backward", bwd)
    except Exception as ex:
        res["backward_error"] = repr(ex)[:300]
        log("backward error", ex)
    res["wall_s"] = time.time() - T0
    return res


def write(res, out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_h200.json").write_text(json.dumps(res, indent=1))
    mem = res["weight_memory"]
    lines = [
        "# MoE expert GEMMs at K3 shapes: packed MXFP4 (Triton) vs bf16 grouped GEMM",
        "",
        f"{res['gpu']}, torch {res['torch']}, triton {res['triton']}, commit `{res['commit']}`, {res['date']}. "
        f"Generated by `bench/moe.py`. Measured ceilings in the same run: copy {res['ceilings']['copy_TBps']:.2f} TB/s "
        f"(read+write), bf16 8192^3 matmul {res['ceilings']['bf16_mm_TFLOPs']:.0f} TFLOP/s.",
        "",
        f"Shapes: {E} experts, top-{TOPK}, latent {D}, expert width {INTER}; gate+up, SiLU-GLU, down "
        "(the anchor's scope: tokens already routed). Time is the median of CUDA-event-timed calls.",
        "",
        f"Weight memory (all {E} experts, one layer): MXFP4 {mem['mxfp4_bytes'] / 1e9:.2f} GB vs bf16 "
        f"{mem['bf16_bytes'] / 1e9:.2f} GB = **{mem['ratio']:.3f}x**.",
        "",
        "| tokens | active experts | bf16 grouped_mm ms | anchor ms | per-expert loop ms | MXFP4 ms | speed-up vs "
        "grouped_mm | MXFP4 weight TB/s | MXFP4 TFLOP/s | full fwd bf16 / MXFP4 ms | rel err MXFP4 / bf16 vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        loop = f"{r['per_expert_loop_ms']:.2f}" if "per_expert_loop_ms" in r else "-"
        lines.append(
            f"| {r['tokens']} | {r['active_experts']} | {r['grouped_mm_ms']:.3f} | {ANCHOR_MS.get(r['tokens'], '-')} | "
            f"{loop} | {r['mxfp4_ms']:.3f} | **{r['speedup_vs_grouped_mm']:.2f}x** | {r['mxfp4_weight_TBps']:.2f} | "
            f"{r['mxfp4_TFLOPs']:.0f} | {r['grouped_mm_full_forward_ms']:.3f} / {r['mxfp4_full_forward_ms']:.3f} | "
            f"{r['rel_err_mxfp4_vs_fp32']:.1e} / {r['rel_err_bf16_grouped_vs_fp32']:.1e} |")
    lines += ["", "Tile configurations chosen by the sweep (BM, BN, BK, warps, stages, DEQ) and default-config times:", ""]
    for r in res["rows"]:
        lines.append(f"- {r['tokens']} tokens: gate+up {r['gate_up_best_cfg']} ({r['gate_up_best_ms']:.3f} ms; "
                     f"default {r['gate_up_default_ms']}), down {r['down_best_cfg']} ({r['down_best_ms']:.3f} ms; "
                     f"default {r['down_default_ms']}); SiTU-GLU fused {r['mxfp4_situ_ms']:.3f} ms; "
                     f"default configs {r['mxfp4_default_cfg_ms']:.3f} ms")
    if "backward" in res:
        lines += ["", f"Backward (Triton) vs per-expert PyTorch at real shapes: {res['backward']}"]
    (out / "moe_h200.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        toks = [r["tokens"] for r in res["rows"]]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.loglog(toks, [r["grouped_mm_ms"] for r in res["rows"]], "o-", label="bf16 torch._grouped_mm")
        ax.loglog(toks, [r["mxfp4_ms"] for r in res["rows"]], "s-", label="packed MXFP4 (Triton)")
        lt = [r["tokens"] for r in res["rows"] if "per_expert_loop_ms" in r]
        ax.loglog(lt, [r["per_expert_loop_ms"] for r in res["rows"] if "per_expert_loop_ms" in r], "^--",
                  label="bf16 per-expert loop")
        ax.set_xlabel("tokens (top-16 of 896 experts)")
        ax.set_ylabel("ms (gate+up, GLU, down)")
        ax.set_title(f"K3 routed experts on {res['gpu']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "moe_h200.png", dpi=120)
    except Exception as ex:
        log("plot failed", ex)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 1024, 16384])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--sweep", action="store_true", help="also time a few tile configurations and keep the best")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global DEV, E, TOPK, D, INTER
    if args.smoke:
        DEV, E, TOPK, D, INTER = "cpu", 8, 2, 64, 96
        args.tokens = [1, 5, 40]
        for k in SWEEP:
            SWEEP[k] = [(16, 64, 64, 4, 2, 0), (16, 32, 64, 4, 2, 1)]
    elif not torch.cuda.is_available():
        sys.exit("bench/moe.py needs a CUDA GPU")
    res = run(args)
    write(res, args.out)
    log("done")
    for r in res["rows"]:
        print(f"{r['tokens']:>6} tok: grouped_mm {r['grouped_mm_ms']:.3f} ms | mxfp4 {r['mxfp4_ms']:.3f} ms "
              f"({r['speedup_vs_grouped_mm']:.2f}x) | loop {r.get('per_expert_loop_ms', float('nan')):.2f} ms | "
              f"full fwd {r['grouped_mm_full_forward_ms']:.3f}/{r['mxfp4_full_forward_ms']:.3f} | "
              f"err {r['rel_err_mxfp4_vs_fp32']:.1e}/{r['rel_err_bf16_grouped_vs_fp32']:.1e}")
    print("weight memory ratio", round(res["weight_memory"]["ratio"], 3))


if __name__ == "__main__":
    main()
