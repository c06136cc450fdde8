"""Does the packed weights' memory order bound the small-batch MXFP4 GEMMs? (K3 expert shapes, as bench/moe.py)

    python bench/mxfp4_layout_probe.py --tokens 64 1024

1. A read-only kernel streams every expert's packed bytes in the access pattern of one GEMM program (BN rows, BK/2
   bytes of each per K step) from the stored [E, N, K/2] order and from tile-major order (`tile_major`: each K step
   one contiguous block): the DRAM ceiling of each order, without decode or MMA.
2. The Gluon GEMMs (gate+up, down) in interleaved rounds, the default tiles and variants of them (tile keys, e.g.
   NIB=1: the table-free decode, with the activations in its K order), each output compared with the default's.

    python bench/mxfp4_layout_probe.py --tokens 1024 --variants nib:NIB=1

(982d8d9 also timed the GEMMs on tile-major copies and a TMA weight ring; bench/results/moe_h200.md.)
Prints one JSON line per row."""

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe  # noqa: E402


@triton.jit
def _stream(w_ptr, out_ptr, KH, TILED: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, BN)[:, None]
    c = tl.arange(0, BKH)[None, :]
    base = pid.to(tl.int64) * BN * KH
    acc = tl.zeros([BN, BKH], tl.int32)
    for k in range(KH // BKH):
        if TILED:
            off = base + k * (BN * BKH) + r * BKH + c
        else:
            off = base + r * KH + k * BKH + c
        acc ^= tl.load(w_ptr + off).to(tl.int32)
    tl.store(out_ptr + pid, tl.sum(acc))


def tile_major(packed, BN, BK):
    """[E, N, K/2] -> the same bytes as [E, N/BN, K/BK, BN, BK/2]: one contiguous block per program and K step."""
    E, N, Kh = packed.shape
    return packed.view(E, N // BN, BN, Kh * 2 // BK, BK // 2).permute(0, 1, 3, 2, 4).contiguous()


def stream_rows(w, BN=64, BK=128):
    E, N, KH = w.shape
    tiled = tile_major(w, BN, BK)
    out = torch.empty(E * N // BN, dtype=torch.int32, device=w.device)
    gb = w.numel() / 1e9
    for name, t, flag in (("stored", w, False), ("tile_major", tiled, True)):
        for stages in (3, 4, 6):
            ms = moe.bench(lambda: _stream[(E * N // BN,)](t, out, KH, TILED=flag, BN=BN, BKH=BK // 2,
                                                             num_warps=4, num_stages=stages))
            print(json.dumps(dict(kind="stream", order=name, BN=BN, BK=BK, stages=stages, GB=round(gb, 2),
                                  ms=round(ms, 3), TBps=round(gb / ms, 3))), flush=True)
    del tiled


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="nib:NIB=1", help="name:KEY=VAL:...,... (keys of the tile config)")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--base", default=None, help="a module in kimi3_kernels with another version of mxfp4_wgmma "
                    "(e.g. a commit's file copied in): variants named base* launch its kernel instead")
    args = ap.parse_args()
    G, M, _ = moe.load_modules()
    from kimi3_kernels import mxfp4_wgmma as W

    mod = moe.make_mxfp4_weights(M)
    E, D, INTER, TOPK = moe.E, moe.D, moe.INTER, moe.TOPK
    if not args.no_stream:
        stream_rows(mod.w2_packed)
        stream_rows(mod.w2_packed, BK=256)
    orig = W.prepare
    base = importlib.import_module(f"kimi3_kernels.{args.base}") if args.base else None
    state = {"cfg": {}, "name": ""}

    def patched(nblocks, meta, cfg, N, *K):  # K: this tree's prepare takes it, older copies do not
        cfg = dict(cfg, **state["cfg"])
        if not state["name"].startswith("base"):
            return orig(nblocks, meta, cfg, N, *K)
        if hasattr(base, "prepare"):
            takes_k = len(inspect.signature(base.prepare).parameters) > 4
            return base.prepare(nblocks, meta, cfg, N, *(K if takes_k else ()))
        return lambda a: base.launch(nblocks, a, meta, cfg)  # a copy from before the launch plans

    W.prepare = patched
    for n in args.tokens:
        x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
        idx, _ = moe.routing(n, seed=n)
        order, offsets = M._route(idx, E, sync_ok=False)
        tok = (order // TOPK).to(torch.int32)
        order32 = order.to(torch.int32)
        rows = n * TOPK
        h = torch.randn(rows, INTER, device="cuda", dtype=torch.bfloat16)
        cu = G.default_config(rows, E, INTER, D, "out")
        cd = G.default_config(rows, E, D, INTER)
        acts = {0: (G.permute_k(x, cu["BK"]), G.permute_k(h, cd["BK"])),
                1: (G.permute_k(x, cu["BK"], nib=True), G.permute_k(h, cd["BK"], nib=True))}

        def up():
            xp = acts[int(bool(state["cfg"].get("NIB")))][0]
            return G.mxfp4_grouped_gemm(xp, mod.w1_packed, mod.w1_scale, offsets, a_rows=tok, dual="out", act="silu",
                                        b_packed=mod.w3_packed, b_scale=mod.w3_scale, out_dtype=torch.bfloat16,
                                        a_kperm=cu["BK"])

        def down():
            hp = acts[int(bool(state["cfg"].get("NIB")))][1]
            return G.mxfp4_grouped_gemm(hp, mod.w2_packed, mod.w2_scale, offsets, c_rows=order32, num_c_rows=rows,
                                        a_kperm=cd["BK"])

        variants = [("default", {})]
        for v in args.variants.split(","):
            name, *kv = v.split(":")
            variants.append((name, {k: int(x) for k, x in (t.split("=") for t in kv if t)}))
        ref = {}
        times = {(v[0], g): [] for v in variants for g in ("gate_up", "down")}
        for r in range(args.rounds):
            for name, over in variants:
                state["cfg"], state["name"] = over, name
                G.clear_plans()  # the plans keep what `patched` returned for the last variant
                for g, fn in (("gate_up", up), ("down", down)):
                    out = fn()
                    if (g not in ref):
                        ref[g] = out
                    elif r == 0:
                        d = ((out.float() - ref[g].float()).norm() / ref[g].float().norm()).item()
                        print(json.dumps(dict(kind="check", tokens=n, variant=name, gemm=g,
                                              equal=bool(torch.equal(out, ref[g])), rel_diff=d)), flush=True)
                    times[name, g].append(moe.bench(fn))
        for (name, g), ts in times.items():
            print(json.dumps(dict(kind="gemm", tokens=n, variant=name, gemm=g, ms=[round(t, 3) for t in ts],
                                  cfg=cu if g == "gate_up" else cd)), flush=True)
        state["cfg"] = {}


if __name__ == "__main__":
    main()
