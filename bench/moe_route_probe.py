"""The decode path of the packed experts (1-2 tokens: one route per program, experts read from topk_idx) at K3
shapes, kernel by kernel, CUDA-graph replayed:

    python bench/moe_route_probe.py --tokens 1 2 [--configs up:BN:BK:warps:stages:PERM,...]

Times route_expert_ids, the gate+up GEMM (SiLU fused), the down GEMM and combine_routes apart, then the whole
module (each also its host time per eager call), and each tile of --configs (`up:` or `down:` prefix) against the
default tile, outputs compared. The GEMMs as the module runs them: activations copied into the tile's K order where
it takes them (timed with the GEMM). One JSON line per timing, with the weight bytes read per second (272 MB per
token at K3: 16 experts x 17 MB)."""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe  # noqa: E402  (bench/moe.py: shapes, weights, routing)
from _timing import graph_us, host_us  # noqa: E402

# spec: which:BN:BK:warps:stages:PERM[:WG[:PAIR]]; WG=1: the Gluon kernel (the defaults since this script's first
# run; the first two are the Triton tiles they replaced)
DEFAULT_CONFIGS = ",".join([
    "up:64:128:4:4:1", "down:64:128:4:4:0",
    "up:64:128:4:4:1:1", "up:64:128:4:6:1:1", "down:64:128:4:4:1:1:1", "down:64:128:4:5:1:1",
])


def parse(spec):
    out = []
    for c in spec.split(","):
        which, *v = c.split(":")
        bn, bk, w, st, perm, wg, pair = ([int(x) for x in v] + [0, 0])[:7]
        cfg = dict(BM=16, BN=bn, BK=bk, num_warps=w, num_stages=st, DEQ=0, PERM=perm)
        if wg:
            cfg.update(WG=1, PAIR=pair)
        out.append((which, cfg))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--rep", type=int, default=200)
    args = ap.parse_args()
    G, M, _ = moe.load_modules()
    D_ = M._decode_module()
    mod = moe.make_mxfp4_weights(M)
    E, D, INTER, TOPK = moe.E, moe.D, moe.INTER, moe.TOPK
    per_expert = (2 * INTER * D + D * INTER) * (0.5 + 1 / 32)
    print(json.dumps(dict(meta=True, device=torch.cuda.get_device_name(), kernel_status=M.kernel_status())),
          flush=True)
    for n in args.tokens:
        x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
        idx, w = moe.routing(n, seed=n)
        ids, _ = G.route_expert_ids(idx, E)
        R = ids.numel()
        active = int(idx.unique().numel())
        nb_up, nb_dn = active * 2 * INTER * D * (0.5 + 1 / 32), active * INTER * D * (0.5 + 1 / 32)
        h = torch.randn(R, INTER, device="cuda", dtype=torch.bfloat16)
        o = torch.randn(R, D, device="cuda", dtype=torch.float32)

        nib = mod._table_free_ok()

        def operand(a, cfg, N, K, dual=None):  # (a, keyword arguments) as the tile takes them
            bk, wg = G.kperm_tile(R, R, N, K, dual, row_expert=True) if cfg is None else (
                cfg["BK"] if cfg.get("WG") else 0, bool(cfg.get("WG")))
            if bk:
                return G.permute_k(a, bk, nib=nib and wg), dict(a_kperm=bk, a_nib=nib and wg)
            return a, {}

        def up(cfg=None):
            a, kw = operand(x, cfg, INTER, D, "out")
            return G.mxfp4_grouped_gemm(a, mod.w1_packed, mod.w1_scale, None, expert_ids=ids, a_row_div=TOPK,
                                        dual="out", act="silu", b_packed=mod.w3_packed, b_scale=mod.w3_scale,
                                        out_dtype=torch.bfloat16, config=cfg, **kw)

        def down(cfg=None):
            a, kw = operand(h, cfg, D, INTER)
            return G.mxfp4_grouped_gemm(a, mod.w2_packed, mod.w2_scale, None, expert_ids=ids, config=cfg, **kw)

        with torch.no_grad():
            parts = dict(route_ids=(lambda: G.route_expert_ids(idx, E), 0),
                         permute_x=(lambda: G.permute_k(x, 128, nib=nib), 0), gate_up=(up, nb_up), down=(down, nb_dn),
                         combine=(lambda: D_.combine_routes(o, w, torch.bfloat16), 0),
                         module=(lambda: mod(x, idx, w), active * per_expert))
            for name, (fn, nbytes) in parts.items():
                us = graph_us(fn, args.rep)
                print(json.dumps(dict(tokens=n, part=name, us=round(us, 2), host_us=round(host_us(fn, 50), 1),
                                      weight_TBps=round(nbytes / us / 1e6, 3) if nbytes else None)), flush=True)
            refs = dict(up=up().float(), down=down().float())
            for which, cfg in parse(args.configs):
                fn, nbytes = (up, nb_up) if which == "up" else (down, nb_dn)
                try:
                    us = graph_us(lambda: fn(cfg), args.rep)
                    diff = ((fn(cfg).float() - refs[which]).norm() / refs[which].norm()).item()
                    base = graph_us(fn, args.rep)  # the default again, interleaved, against clock drift
                except Exception as ex:  # noqa: BLE001 - a tile that does not compile or fit
                    print(json.dumps(dict(tokens=n, part=which, cfg=cfg, error=repr(ex)[:200])), flush=True)
                    continue
                print(json.dumps(dict(tokens=n, part=which, cfg=cfg, us=round(us, 2), default_us=round(base, 2),
                                      weight_TBps=round(nbytes / us / 1e6, 3), rel_diff_vs_default=diff)),
                      flush=True)


if __name__ == "__main__":
    main()
