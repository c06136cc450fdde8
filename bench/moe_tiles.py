"""A/B of Gluon MXFP4 tiles in the module's own expert path (K3 shapes, as bench/moe.py), interleaved in one process:

    python bench/moe_tiles.py --tokens 64 1024 --rounds 5 --out DIR \\
        --variant bk64=32:out:64:64:4:6:0,32:down:64:64:4:6:1 --variant w8=32:out:128:64:8:6:0

A variant replaces entries of `mxfp4_gemm._WGMMA_TILES` ('BM:out|down:BN:BK:warps:stages:PAIR', comma-separated;
BM 'r16': `_WGMMA_ROW_TILES`, the one-route-per-program tiles of 1-2 tokens); "default" is the tables as committed.
Each round times every variant once (CUDA-graph replay of the module's expert path: `_forward_triton`, gate+up
with the GLU fused, h in the down tile's K order, down, the operands' K-order copies included; or
`_forward_unsorted` up to `unsorted_max_routes()` routes), so a drift of the GPU's clocks over the run hits all
variants alike. Also per variant: the two GEMMs apart on the sorted path (same calls), the error of the first
tokens against an fp32 dequantise-then-matmul, and the compiled kernels' registers and shared memory (what sets
the CTAs per SM). --bf16 adds torch._grouped_mm on the exact bf16
weights to every round (59 GB), for the ratio of the issue's goal. Writes moe_tiles_h200.jsonl to --out."""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe  # noqa: E402  (bench/moe.py: shapes, weights, routing, timing)
from _timing import graph_us, write_jsonl  # noqa: E402

GEMM = {"out": "out", "down": None}


def parse_variant(spec):
    """'name=BM:out:BN:BK:warps:stages:PAIR,...,env:NAME=VALUE' -> (name, {(row, BM, dual): (BN, BK, warps, stages,
    PAIR)}, {NAME: VALUE}): tiles, and environment variables set while the variant runs (KIMI3_MXFP4_WG_TAIL...)"""
    name, _, body = spec.partition("=")
    tiles, env = {}, {}
    for c in filter(None, body.split(",")):
        if c.startswith("env:"):
            k, _, v = c[4:].partition("=")
            env[k] = v
            continue
        bm, gemm, *rest = c.split(":")
        if gemm not in GEMM or len(rest) != 5:
            raise SystemExit(f"bad tile {c!r}: want BM:out|down:BN:BK:warps:stages:PAIR or env:NAME=VALUE")
        tiles[bm.startswith("r"), int(bm.lstrip("r")), GEMM[gemm]] = tuple(int(v) for v in rest)
    return name, (tiles, env)


def compiled_kernels(W):
    """(constants, registers, spills, shared bytes) of every compiled Gluon kernel so far (best effort: the cache's
    layout is Triton's own; Triton 3.6 keys the constants by argument position)."""
    names = W.mxfp4_wgmma_kernel.arg_names
    out = []
    try:
        for cache in W.mxfp4_wgmma_kernel.device_caches.values():
            for k in cache[0].values():
                const = {}
                for key, v in getattr(getattr(k, "src", None), "constants", {}).items():
                    name = names[key[0]] if isinstance(key, tuple) else key
                    if name in ("BM", "BN", "BK", "STAGES", "DUAL", "PAIR", "NIB", "ROW_EXPERT"):
                        const[name] = int(v)
                out.append(dict(const=const, n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared))
    except Exception as ex:  # noqa: BLE001 - a report, not a check
        out.append(dict(error=repr(ex)[:200]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--variant", action="append", default=[], help="name=tiles (see above); repeatable")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.smoke:
        moe.DEV, moe.E, moe.TOPK, moe.D, moe.INTER = "cpu", 8, 2, 128, 256
    G, M, _ = moe.load_modules()
    from kimi3_kernels import mxfp4_wgmma as W

    tables = {False: G._WGMMA_TILES, True: G._WGMMA_ROW_TILES}
    base = {row: dict(t) for row, t in tables.items()}
    variants = [("default", ({}, {}))] + [parse_variant(v) for v in args.variant]
    env_names = {k for _, (_, env) in variants for k in env}
    mod, w13, w2 = moe.make_weights(M) if args.bf16 else (moe.make_mxfp4_weights(M), None, None)
    E, D, INTER, TOPK = moe.E, moe.D, moe.INTER, moe.TOPK
    timer = (lambda fn: moe.bench(fn, warm=1, rep=2) * 1e3) if moe.DEV == "cpu" else (lambda fn: graph_us(fn, 50))
    rows = []
    for n in args.tokens:
        x = torch.randn(n, D, device=moe.DEV, dtype=torch.bfloat16)
        idx, w = moe.routing(n, seed=n)
        order, offsets = M._route(idx, E, sync_ok=False)
        Mr = order.numel()
        one_route = Mr <= M.unsorted_max_routes()  # one route per program (the module's path without autograd)
        Ec = Mr if one_route else E  # the expert count its tiles are chosen for
        ref_tok = min(n, 4)
        ref = moe.fp32_reference(mod, M, x, idx, w, M.silu_glu, ref_tok)

        def setup(variant):
            tiles, env = variant
            for k in env_names:
                os.environ.pop(k, None)
            os.environ.update(env)
            for r, table in tables.items():
                table.clear()
                table.update(base[r])
            for (r, bm, dual), tile in tiles.items():
                tables[r][bm, dual] = tile

        def fns():
            bk_dn, _ = G.kperm_tile(Mr, E, D, INTER)
            h = mod._forward_triton(x, order, offsets, TOPK)  # warm + compile (the tables' checks too)
            up_rows = dict(a_rows=(order // TOPK).to(torch.int32))
            xk, bk_up, nib_up = mod._up_input(G, x, Mr, E)
            hh = torch.randn(Mr, INTER, device=moe.DEV, dtype=torch.bfloat16)

            def full():
                if one_route:
                    return mod._forward_unsorted(x, idx)
                return mod._forward_triton(x, order, offsets, TOPK)

            def up():
                return G.mxfp4_grouped_gemm(xk, mod.w1_packed, mod.w1_scale, offsets, act="silu",
                                            out_dtype=torch.bfloat16, b_packed=mod.w3_packed, b_scale=mod.w3_scale,
                                            dual="out", a_kperm=bk_up, a_nib=nib_up, **up_rows)

            def down():
                return G.mxfp4_grouped_gemm(hh, mod.w2_packed, mod.w2_scale, offsets, a_kperm=bk_dn,
                                            a_nib=bool(bk_dn) and mod._table_free_ok(),
                                            c_rows=order.to(torch.int32), num_c_rows=Mr)
            del h
            return dict(full=full, gate_up=up, down=down)

        def error():  # the whole module (routing, both GEMMs, weighted sum) on the first tokens
            return moe.rel(mod(x, idx, w).float()[:ref_tok], ref)

        res = {}
        for name, tiles in variants:
            setup(tiles)
            try:
                res[name] = dict(fns=fns(), ms={k: [] for k in ("full", "gate_up", "down")}, err=error(),
                                 cfg_up=G.default_config(Mr, Ec, INTER, D, "out", row_expert=one_route),
                                 cfg_dn=G.default_config(Mr, Ec, D, INTER, row_expert=one_route))
            except Exception as ex:  # noqa: BLE001 - a tile that does not compile or fit: reported, not timed
                rows.append(dict(tokens=n, variant=name, error=repr(ex)[:300]))
                print(rows[-1], flush=True)
        bf16 = []
        if w13 is not None:
            xs, offs = x[order // TOPK], offsets[1:].contiguous()

            def grouped():
                g, u = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, -1)
                return torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)
        for _ in range(args.rounds):
            for name, tiles in variants:
                if name not in res:
                    continue
                setup(tiles)
                for k, fn in res[name]["fns"].items():
                    res[name]["ms"][k].append(timer(fn) / 1e3)
            if w13 is not None:
                bf16.append(timer(grouped) / 1e3)
        setup(({}, {}))
        bf16_ms = sorted(bf16)[len(bf16) // 2] if bf16 else None
        for name, v in res.items():
            med = {k: sorted(t)[len(t) // 2] for k, t in v["ms"].items()}
            row = dict(tokens=n, variant=name, full_ms=round(med["full"], 4), gate_up_ms=round(med["gate_up"], 4),
                       down_ms=round(med["down"], 4), rounds_full_ms=[round(t, 4) for t in v["ms"]["full"]],
                       rel_err_vs_fp32=v["err"], cfg_up=v["cfg_up"], cfg_dn=v["cfg_dn"])
            if bf16_ms:
                row.update(bf16_grouped_mm_ms=round(bf16_ms, 4), ratio=round(bf16_ms / med["full"], 3),
                           rounds_bf16_ms=[round(t, 4) for t in bf16])
            print(row, flush=True)
            rows.append(row)
    rows.append(dict(compiled=compiled_kernels(W)))
    print(rows[-1], flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_jsonl(args.out, "moe_tiles_h200.jsonl", rows)


if __name__ == "__main__":
    main()
