"""Decode-size routed experts (bf16, SiLU-GLU) on the GPU: the per-route GEMVs of kimi3_kernels.moe_decode
against the model's grouped-GEMM path (sort + torch._grouped_mm), both CUDA-graph-captured as in a decode step.

    PYTHONPATH=$PWD/src:$PWD/kernels python bench/moe_decode.py --out DIR

Shapes: the 4.3B Kimi Linear benchmark config of bench/e2e.py (64 experts, width 1024, hidden 2304, top-8) at
1, 2 and 8 tokens. One JSON object per line on stdout and in DIR/moe_decode.jsonl.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "kernels")]

from _timing import graph_us, write_jsonl  # noqa: E402
from kimi3_kernels import moe_decode  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from transformers_kimi3.benchmark import BENCH_CONFIG
    from transformers_kimi3.configuration_kimi3 import Kimi3TextConfig
    from transformers_kimi3.moe import Kimi3Experts

    cfg = Kimi3TextConfig(**BENCH_CONFIG)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ex = Kimi3Experts(cfg, cfg.hidden_size).to(torch.bfloat16).eval()
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.02)
    E, I, D = ex.w1.shape
    k = cfg.num_experts_per_token
    bytes_per_expert = 3 * I * D * 2
    rows = []
    with torch.no_grad():
        for T in (1, 2, 8):
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
            w = torch.rand(T, k, device="cuda")
            os.environ["KIMI3_MOE_GEMV_MAX_ROUTES"] = "0"
            ref = ex(x, idx, w)
            grouped = graph_us(lambda: ex(x, idx, w))
            uniq = int(idx.unique().numel())
            row = dict(tokens=T, experts_read=uniq, grouped_mm_us=round(grouped, 1),
                       grouped_mm_TBps=round(uniq * bytes_per_expert / grouped / 1e6, 2))
            for bn, bk in ((16, 256), (32, 128), (8, 512), (16, 128), (32, 256)):
                y = moe_decode.expert_gemv(x, ex.w1, ex.w3, ex.w2, idx, w, BN=bn, BK=bk)
                us = graph_us(lambda: moe_decode.expert_gemv(x, ex.w1, ex.w3, ex.w2, idx, w, BN=bn, BK=bk))
                row[f"gemv_bn{bn}_bk{bk}_us"] = round(us, 1)
                row[f"gemv_bn{bn}_bk{bk}_TBps"] = round(T * k * bytes_per_expert / us / 1e6, 2)
                row[f"gemv_bn{bn}_bk{bk}_rel_vs_grouped"] = float((y - ref).norm() / ref.norm())
            rows.append(row)
            print(json.dumps(row), flush=True)
        rows += mlp_rows(cfg)
    write_jsonl(args.out, "moe_decode.jsonl", rows)


def mlp_rows(cfg):
    """One token through a dense SiLU-GLU MLP: cuBLAS (three projections + the GLU kernel) against mlp_gemv's two
    launches, at the 4.3B config's shared expert (width 1024), twice that, and its dense MLP (9216)."""
    from transformers_kimi3.moe import Kimi3MLP

    rows = []
    for width in (1024, 2048, cfg.intermediate_size):
        with torch.device("cuda"):
            mlp = Kimi3MLP(cfg, width).to(torch.bfloat16).eval()
        x = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        os.environ["KIMI3_MOE_GEMV_MAX_ROUTES"] = "0"
        ref = mlp(x)
        us = graph_us(lambda: mlp(x))
        row = dict(mlp_width=width, hidden=cfg.hidden_size, cublas_us=round(us, 1),
                   cublas_TBps=round(3 * width * cfg.hidden_size * 2 / us / 1e6, 2))
        for bn, bnd in ((8, 16), (16, 16), (8, 8), (4, 8), (16, 32)):
            y = moe_decode.mlp_gemv(x, *weights, BN=bn, BN_DOWN=bnd)
            us = graph_us(lambda: moe_decode.mlp_gemv(x, *weights, BN=bn, BN_DOWN=bnd))
            row[f"gemv_bn{bn}_{bnd}_us"] = round(us, 1)
            row[f"gemv_bn{bn}_{bnd}_rel_vs_cublas"] = float((y.float() - ref.float()).norm() / ref.float().norm())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
