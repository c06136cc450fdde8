"""The AttnRes mix on the GPU: kimi3_kernels.attn_res (one launch, a few tile widths) against the model's PyTorch
path, at K3's width (7168) for a decode token and prefill lengths, with n completed blocks plus the partial sum.

    PYTHONPATH=$PWD/src:$PWD/kernels python bench/attn_res.py --out DIR      # one H200, ~20 s
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "kernels"), str(ROOT / "bench")]

from _timing import graph_us, write_jsonl  # noqa: E402  (back-to-back replays: the GPU time of a short call)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from kimi3_kernels.attn_res import attn_res_mix
    from transformers_kimi3 import attn_res as A

    D, rows = 7168, []
    proj, norm = A.Kimi3AttnResProj(D).cuda(), A.Kimi3AttnResNorm(D, eps=1e-6).cuda()
    with torch.no_grad():
        proj.weight.normal_(0, 0.02)
        for T in (1, 2048, 8192):
            for n in (2, 4, 8):
                bank = torch.randn(1, T, n, D, device="cuda", dtype=torch.bfloat16)
                part = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
                A.KERNELS_ON_CPU, saved = False, A._kernel
                A._kernel = None  # the PyTorch path
                ref = A.attn_res_mix(bank, part, proj, norm)
                row = dict(T=T, n=n, D=D, torch_us=round(graph_us(lambda: A.attn_res_mix(bank, part, proj, norm),
                                                                 rep=20), 1))
                A._kernel = saved
                for bd, warps in ((256, 4), (512, 8), (1024, 8), (1024, 4)):
                    def f(bd=bd, warps=warps):
                        return attn_res_mix(bank, part, norm.weight, proj.weight, 1e-6, BD=bd, num_warps=warps)

                    y = f()
                    row[f"bd{bd}_w{warps}_us"] = round(graph_us(f, rep=20), 1)
                    row[f"bd{bd}_w{warps}_rel"] = float((y.float() - ref.float()).norm() / ref.float().norm())
                row["GBps_best"] = round((n + 1) * T * D * 2 * 2 / min(v for k, v in row.items()
                                                                        if k.endswith("_us") and k != "torch_us")
                                         / 1e3, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_jsonl(args.out, "attn_res.jsonl", rows)


if __name__ == "__main__":
    main()
