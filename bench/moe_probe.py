"""Where the packed MXFP4 grouped GEMM's time goes at one token count (K3 expert shapes, as bench/moe.py):

    python bench/moe_probe.py --tokens 1024 --sweep           # wider tile sweep, gate+up and down apart
    python bench/moe_probe.py --tokens 64 1024 --configs 16:64:64:4:4:1/32:64:64:4:4:1   # given tiles per count
    ncu --clock-control none --kernel-name regex:mxfp4 --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python bench/moe_probe.py --tokens 1024 --reps 3      # hardware counters of one gate+up and one down

Prints one JSON line per timing: config, ms, and the weight bytes read per second (the bound at small token counts,
where each expert's packed weights are read once and reused by ~18 rows)."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe  # noqa: E402  (bench/moe.py: shapes, weights, routing, timing)

# (BM, BN, BK, num_warps, num_stages): around the defaults for ~18 rows per expert
SWEEP = [(32, 64, 64, 4, 4), (32, 64, 128, 4, 3), (32, 128, 64, 4, 4), (32, 128, 64, 8, 4), (32, 128, 128, 8, 3),
         (32, 64, 64, 4, 6), (32, 64, 256, 4, 2), (16, 64, 128, 4, 4), (16, 128, 128, 8, 4), (32, 256, 64, 8, 3)]


def parse_configs(spec):
    """'BM:BN:BK:warps:stages:PERM[:AK[:WG[:PAIR]]],...' -> list of config dicts; AK=1: the activations stored in the
    tile's K order beforehand (`permute_k`, a_kperm=BK; implies PERM); WG=1: the Gluon kernel with asynchronous
    wgmma (`kimi3_kernels.mxfp4_wgmma`; needs AK); PAIR=1: its programs take two BN-row tiles (single GEMMs)"""
    out = []
    for c in spec.split(","):
        bm, bn, bk, w, st, perm, ak, wg, pair = ([int(v) for v in c.split(":")] + [0, 0, 0])[:9]
        out.append(dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st, DEQ=0, PERM=perm, AK=ak, WG=wg, PAIR=pair))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--reps", type=int, default=0, help="plain calls of the default configs (for ncu)")
    ap.add_argument("--sweep", action="store_true", help="the SWEEP tiles, SPLIT off and on")
    ap.add_argument("--configs", default=None, help="'BM:BN:BK:warps:stages:PERM,...' timed after the default "
                    "(one list per token count, separated by '/'); each output is compared with the default's")
    ap.add_argument("--bf16", action="store_true", help="also time the whole routed MLP (gate+up, GLU, down) with "
                    "the default tiles against bf16 torch._grouped_mm on the exact dequantised weights (moe.py's "
                    "kernel scope; 59 GB of bf16 weights at K3 shapes)")
    ap.add_argument("--tails", nargs="+", default=None, help="time the default tiles at each of these "
                    "KIMI3_MXFP4_TAIL values ('64,32'; 0: one launch), outputs compared with the first's")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.smoke:
        moe.DEV, moe.E, moe.TOPK, moe.D, moe.INTER = "cpu", 8, 2, 64, 96
        SWEEP[:] = [(16, 32, 64, 4, 2)]
    G, M, _ = moe.load_modules()
    mod, w13, w2 = moe.make_weights(M) if args.bf16 else (moe.make_mxfp4_weights(M), None, None)
    lists = (args.configs.split("/") if args.configs else [None] * len(args.tokens))
    for n, spec in zip(args.tokens, lists):
        probe(G, M, mod, n, args, parse_configs(spec) if spec else [], w13, w2)


def probe(G, M, mod, n, args, configs, w13=None, w2=None):
    """Times at n tokens; w13 / w2: the exact bf16 weights for the whole-MLP comparison (--bf16), else None."""
    E, D, INTER, TOPK = moe.E, moe.D, moe.INTER, moe.TOPK
    x = torch.randn(n, D, device=moe.DEV, dtype=torch.bfloat16)
    idx, _ = moe.routing(n, seed=n)
    order, offsets = M._route(idx, E, sync_ok=False)
    tok = (order // TOPK).to(torch.int32)
    order32 = order.to(torch.int32)
    rows = n * TOPK
    h = torch.randn(rows, INTER, device=moe.DEV, dtype=torch.bfloat16)
    active = int(((offsets[1:] - offsets[:-1]) > 0).sum())
    bytes_up = active * 2 * INTER * D * (0.5 + 1 / 32)
    bytes_dn = active * INTER * D * (0.5 + 1 / 32)

    def kperm(cfg, a, N, K, dual):
        """(a, a_kperm, tile) for a config: AK=1 (or "kperm" for the default tile) permutes a's columns here, so the
        copy is timed with the kernel (the module makes it once per GEMM, as here)"""
        if cfg == "kperm":
            bk = G.kperm_bk(rows, E, N, K, dual)
            return (G.permute_k(a, bk), bk, None) if bk else (a, 0, None)
        if cfg and cfg.get("AK"):
            return G.permute_k(a, cfg["BK"]), cfg["BK"], {k: v for k, v in cfg.items() if k != "AK"}
        return a, 0, ({k: v for k, v in cfg.items() if k != "AK"} if cfg else None)

    def up(cfg=None):
        a, bk, cfg = kperm(cfg, x, INTER, D, "out")
        return G.mxfp4_grouped_gemm(a, mod.w1_packed, mod.w1_scale, offsets, a_rows=tok, dual="out", act="silu",
                                    b_packed=mod.w3_packed, b_scale=mod.w3_scale, out_dtype=torch.bfloat16,
                                    config=cfg, a_kperm=bk)

    def down(cfg=None):
        a, bk, cfg = kperm(cfg, h, D, INTER, None)
        return G.mxfp4_grouped_gemm(a, mod.w2_packed, mod.w2_scale, offsets, c_rows=order32, num_c_rows=rows,
                                    config=cfg, a_kperm=bk)

    for _ in range(args.reps):  # as the module runs them (K-permuted activations where the tiles take them)
        up("kperm")
        down("kperm")
    if w13 is not None:
        xs, offs = x[order // TOPK], offsets[1:].contiguous()

        def grouped():
            g, u = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, -1)
            return torch._grouped_mm(torch.nn.functional.silu(g) * u, w2.transpose(1, 2), offs=offs)

        def ours():  # the module's own GEMM path (K-permuted x and h where the default tiles take them)
            return mod._forward_triton(x, order, offsets, TOPK)

        t_bf16, t_ours = moe.bench(grouped), moe.bench(ours)
        print(json.dumps(dict(kernel="routed_mlp", tokens=n, bf16_grouped_mm_ms=round(t_bf16, 4),
                              mxfp4_default_ms=round(t_ours, 4), ratio=round(t_bf16 / t_ours, 3),
                              default_cfg_gate_up=G.default_config(rows, E, INTER, D, "out"),
                              default_cfg_down=G.default_config(rows, E, D, INTER))), flush=True)
    if moe.DEV == "cuda":
        torch.cuda.synchronize()
    if args.tails:
        tail_ab(G, n, args.tails, (("gate_up", up, bytes_up), ("down", down, bytes_dn)), rows, E, INTER, D)
    cands = []
    if args.sweep:
        cands += [dict(BM=c[0], BN=c[1], BK=c[2], num_warps=c[3], num_stages=c[4], DEQ=0, SPLIT=split)
                  for c in SWEEP for split in (0, 1)]
    cands += configs
    if not cands:
        return
    for name, fn, nbytes in (("gate_up", up, bytes_up), ("down", down, bytes_dn)):
        ref = fn().float()
        for cfg in [None, "kperm"] + cands:
            try:
                ms = moe.bench(lambda: fn(cfg), warm=2, rep=10)
                diff = ((fn(cfg).float() - ref).norm() / ref.norm()).item()
            except Exception as ex:  # a tile that does not fit
                print(json.dumps(dict(kernel=name, tokens=n, cfg=cfg, error=repr(ex)[:160])), flush=True)
                continue
            print(json.dumps(dict(kernel=name, tokens=n, cfg=cfg or "default", ms=round(ms, 4),
                                  weight_TBps=round(nbytes / ms / 1e9, 3), rel_diff_vs_default=diff)), flush=True)


def tail_ab(G, n, tails, kernels, rows, E, INTER, D):
    """The default (K-permuted) tiles with their short last blocks in a second launch of smaller tiles or not,
    interleaved: each tail setting once per round, three rounds, the median of each setting's rounds."""
    saved = os.environ.get("KIMI3_MXFP4_TAIL")
    try:
        for name, fn, nbytes in kernels:
            ref, times = None, {t: [] for t in tails}
            for _ in range(3):
                for t in tails:
                    os.environ["KIMI3_MXFP4_TAIL"] = str(t)
                    times[t].append(moe.bench(lambda: fn("kperm"), warm=2, rep=10))
            for t in tails:
                os.environ["KIMI3_MXFP4_TAIL"] = str(t)
                y = fn("kperm").float()
                ref = y if ref is None else ref
                ms = sorted(times[t])[1]
                print(json.dumps(dict(kernel=name, tokens=n, tail=t, ms=round(ms, 4), rounds=[round(v, 4) for v in
                                      times[t]], weight_TBps=round(nbytes / ms / 1e9, 3),
                                      rel_diff_vs_first=((y - ref).norm() / ref.norm()).item(),
                                      cfg_gate_up=G.default_config(rows, E, INTER, D, "out"))), flush=True)
    finally:
        if saved is None:
            os.environ.pop("KIMI3_MXFP4_TAIL", None)
        else:
            os.environ["KIMI3_MXFP4_TAIL"] = saved


if __name__ == "__main__":
    main()
