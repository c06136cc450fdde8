"""One forward+backward of chunk_kda under Nsight Compute: hardware counters of each chunk kernel at one shape.

    ncu --clock-control none --profile-from-start off --set full -o DIR/kda python bench/kda_ncu.py --shape 96:16384:k3
    ncu --import DIR/kda.ncu-rep --page details > DIR/kda.txt

A warm-up pass compiles every kernel first; only the second pass runs between cudaProfilerStart / Stop, so ncu sees
each kernel once. KIMI3_KDA_* variables change the kernels as usual.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda import backward, inputs  # noqa: E402  (puts this tree's kernels/ on the path)
from kimi3_kernels.kda import chunk_kda  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="96:16384:k3", help="H:T:gate (gate k3 or sp)")
    ap.add_argument("--fwd-only", action="store_true")
    args = ap.parse_args()
    H, T, gate = args.shape.split(":")
    H, T, lb = int(H), int(T), (-5.0 if gate == "k3" else None)
    q, k, v, f, beta, A_log, dtb = (x.requires_grad_(x.dtype == torch.bfloat16 and x.dim() == 4) for x in
                                    inputs(1, T, H, 128, 128, torch.bfloat16, seed=7))

    def step():
        o, _ = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)
        if not args.fwd_only:
            backward(o, (q, k, v, f))
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
