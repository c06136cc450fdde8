"""Forward + backward of packed MXFP4 experts at K3 widths with many rows per expert (BM=128 tiles), on a GPU:
the backward GEMM layouts must compile within shared memory (bench/results/moe_h200.md, run of 2ac0c97), and the
gradients must match the per-expert PyTorch path.

    PYTHONPATH=$PWD/src:$PWD/kernels python bench/mxfp4_backward_check.py      # one H200, ~30 s
"""
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "kernels")]


def main():
    from kimi3_kernels import mxfp4_gemm as G
    from transformers_kimi3 import mxfp4 as M

    E, D, I, k = 32, 3584, 3072, 16
    torch.manual_seed(0)
    mod = M.PackedMXFP4Experts(E, D, I, M.SiTUGLU(4.0, 25.0), device="cuda")
    for n in ("w1", "w3", "w2"):
        getattr(mod, f"{n}_packed").random_(0, 256)
        getattr(mod, f"{n}_scale").random_(118, 124)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    for T in (16, 512, 4096):  # rows per expert: 8, 256, 2048 (BM 16, 128, 128)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, device="cuda", requires_grad=True)
        dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        t0 = time.time()
        y = mod(x, idx, w)
        y.backward(dy)
        torch.cuda.synchronize()
        row = dict(tokens=T, rows_per_expert=T * k // E, first_fwd_bwd_s=round(time.time() - t0, 2))
        if T <= 512:  # the per-expert PyTorch backward as reference
            order, offsets = M._route(idx, E, sync_ok=True)
            dx_t, dw_t = mod._backward_torch(x.detach(), w.detach(), dy, order, offsets, k)
            row.update(rel_err_dx=rel(x.grad, dx_t.view(T, k, -1).sum(1)), rel_err_dw=rel(w.grad, dw_t.view(T, k)))
        row["num_stages_used"] = sorted(set(G._STAGES_THAT_FIT.values()))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
