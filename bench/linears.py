"""A KDA layer's decode projections: `kimi3_kernels.linears` (two launches) against one F.linear (cuBLAS) per
projection, CUDA-graph replayed, at the 4.3B and K3 shapes; errors of both against an fp32 matmul of the same bf16
operands; and the kernel's tile options.

    python bench/linears.py --out DIR [--rows 1 2 8] [--tiles 32:128:4:3,64:128:4:3]

Shapes per config (hidden d, heads H, head dim K; full-rank output gate or not): the first launch is q, k, v
[H K, d], beta [H, d], the gate's first half [K, d] and the output gate ([H K, d] full rank, else [K, d]); the
second the gates' second halves [H K, K]. Writes linears_h200.jsonl."""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from _timing import graph_us, write_jsonl  # noqa: E402
from kimi3_kernels import linears as L  # noqa: E402

CONFIGS = {"4.3b": (2304, 32, 128, False), "k3": (7168, 96, 128, True)}


def weights(d, H, K, full, gen):
    D = H * K
    first = [(D, d), (D, d), (D, d), (H, d), (K, d), (D if full else K, d)]
    second = [(D, K)] if full else [(D, K), (D, K)]
    mk = lambda s: (torch.randn(s, device="cuda", generator=gen) / s[1] ** 0.5).bfloat16()  # noqa: E731
    return [mk(s) for s in first], [mk(s) for s in second]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--tiles", default="32:128:4:3,64:128:4:3,16:128:4:3,32:256:4:3,32:128:4:4,32:64:4:4,64:64:4:4")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")]
    rows = []
    for name, (d, H, K, full) in CONFIGS.items():
        w1, w2 = weights(d, H, K, full, gen)
        nbytes = sum(w.numel() * 2 for w in w1 + w2)
        for M in args.rows:
            x = torch.randn(M, d, device="cuda", generator=gen).bfloat16()
            fa_in = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
            xs2 = (fa_in,) * len(w2)

            def cublas():
                return [F.linear(x, w) for w in w1] + [F.linear(a, w) for a, w in zip(xs2, w2)]

            def ours(tile):
                BN, BK, warps, stages = tile
                kw = dict(BN=BN, BK=BK, num_warps=warps, num_stages=stages)
                return list(L.linears((x,) * 6, w1, **kw)) + list(L.linears(xs2, w2, **kw))

            exact = [F.linear(x.float(), w.float()) for w in w1] + [F.linear(a.float(), w.float())
                                                                    for a, w in zip(xs2, w2)]
            rel = lambda ys: max(float((y.float() - e).norm() / e.norm()) for y, e in zip(ys, exact))  # noqa: E731
            row = dict(config=name, rows=M, weight_MB=round(nbytes / 1e6, 2), cublas_us=round(graph_us(cublas), 2),
                       cublas_rel_err=rel(cublas()))
            for tile in tiles:
                key = "ours_" + ":".join(map(str, tile))
                try:
                    ys = ours(tile)
                    row[key + "_us"] = round(graph_us(lambda t=tile: ours(t)), 2)
                    row[key + "_rel_err"] = rel(ys)
                    row[key + "_max_abs_vs_cublas"] = max(float((a.float() - b.float()).abs().max())
                                                          for a, b in zip(ys, cublas()))
                except Exception as ex:  # noqa: BLE001 - a tile that does not compile: reported
                    row[key + "_error"] = repr(ex)[:200]
            best = min((v, k) for k, v in row.items() if k.startswith("ours_") and k.endswith("_us"))
            row.update(best=best[1], ratio_cublas_over_best=round(row["cublas_us"] / best[0], 3),
                       best_TBps=round(nbytes / best[0] / 1e6, 2))
            print(row, flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_jsonl(args.out, "linears_h200.jsonl", rows)


if __name__ == "__main__":
    main()
