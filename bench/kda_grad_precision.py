"""Gradient errors of the chunked KDA kernels against the fp32 PyTorch reference, by the precision of the matmuls
whose operands are fp32 (`input_precision`; bf16 inputs use one-pass TF32 there by default). The gate parameters'
gradients (dA_log, ddt_bias) are sums over every token: errors that do not cancel in the tokens' gate gradients add up.

    python bench/kda_grad_precision.py --out DIR [--T 1000 8192] [--variants default,tf32_diag,x3_intra] [--time 96:16384]

Variants: default (one-pass TF32 for bf16 inputs, 3xTF32 in the intra backward's diagonal tiles), tf32_diag (one pass
there too), x3_state / x3_main / x3_intra (3xTF32 in that whole backward kernel only),
bwd_tf32x3 (3xTF32 in every backward kernel), all_tf32x3 (forward too). `--time H:T` also times forward+backward. One JSON line per (gate, T, variant) with the relative errors ||x - ref|| / ||ref||, as bench/kda.py's check.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels"))
from kimi3_kernels.kda import chunk_bwd, chunk_fwd, chunk_kda  # noqa: E402
from kimi3_kernels.kda.reference import naive_chunk_kda  # noqa: E402

NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(fn, ins, lb, do, dS, cast=False):
    xs = [(x.float() if cast else x).detach().clone().requires_grad_() for x in ins]
    o, s = fn(*xs[:5], A_log=xs[5], dt_bias=xs[6], lower_bound=lb, initial_state=xs[7], output_final_state=True)
    ((o.float() * do.float()).sum() + (s * dS).sum()).backward()
    return [x.grad for x in xs]


DEFAULT_PREC = chunk_fwd._prec  # tf32x3 for fp32 inputs, one-pass tf32 otherwise


def x3(dtype):
    return "tf32x3"


def set_variant(name):
    chunk_bwd.BWD_PREC.clear()
    if name == "tf32_diag":  # one-pass TF32 in the intra backward's diagonal tiles too (the default before 3xTF32 there)
        chunk_bwd.BWD_PREC["intra_bwd_diag"] = "tf32"
    elif name.startswith("x3_"):  # 3xTF32 in one backward kernel only: x3_state / x3_main / x3_intra
        chunk_bwd.BWD_PREC[name[3:] + "_bwd"] = "tf32x3"
    chunk_fwd._prec = x3 if name == "all_tf32x3" else DEFAULT_PREC
    chunk_bwd._prec = x3 if name in ("bwd_tf32x3", "all_tf32x3") else DEFAULT_PREC


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--T", type=int, nargs="+", default=[1000, 8192])
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--variants", default="default,bwd_tf32x3,all_tf32x3")
    ap.add_argument("--lb", default="k3,softplus")
    ap.add_argument("--time", default="", help="'H:T' shapes at which to time forward+backward per variant (K3 gate)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    os.makedirs(args.out, exist_ok=True)
    out = Path(args.out, "kda_grad_precision.jsonl")
    for lb in [{"k3": -5.0, "softplus": None}[x] for x in args.lb.split(",") if x]:
        for T in args.T:
            g = torch.Generator(device=dev).manual_seed(2)
            r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
            B, H, K = 1, args.H, args.K
            q, k, v, f = (r(B, T, H, K).to(torch.bfloat16) for _ in range(4))
            beta = r(B, T, H).to(torch.bfloat16)
            ins = [q, k, v, f, beta, (r(H) * 0.5).float(), (r(H * K) * 0.3).float(), r(B, H, K, K)]
            do, dS = r(B, T, H, K).to(torch.bfloat16), r(B, H, K, K)
            ref = grads(naive_chunk_kda, ins, lb, do, dS, cast=True)
            for name in args.variants.split(","):
                set_variant(name)
                t0 = time.time()
                ours = grads(chunk_kda, ins, lb, do, dS)
                row = dict(lb=lb, T=T, H=H, K=K, variant=name, s=round(time.time() - t0, 1),
                           **{n: rel(a, b) for n, a, b in zip(NAMES, ours, ref)})
                rows.append(row)
                print(json.dumps(row), flush=True)
                out.write_text("".join(json.dumps(x) + "\n" for x in rows))  # a run cut short keeps its rows
    for shape in [x for x in args.time.split(",") if x]:
        H, T = (int(v) for v in shape.split(":"))
        g = torch.Generator(device=dev).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
        xs = [r(1, T, H, 128).to(torch.bfloat16).requires_grad_() for _ in range(4)]
        beta, A_log, dtb = r(1, T, H).to(torch.bfloat16), (r(H) * 0.5).float(), (r(H * 128) * 0.3).float()
        do = r(1, T, H, 128).to(torch.bfloat16)

        def step():
            o, _ = chunk_kda(*xs, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0)
            torch.autograd.grad(o, xs, do)
        for name in args.variants.split(","):
            set_variant(name)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            ts = []
            for _ in range(3):  # three rounds of 10 calls, CUDA events
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10):
                    step()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 10)
            row = dict(time="fwd_bwd", H=H, T=T, variant=name, ms=sorted(ts)[1], rounds=ts)
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write_text("".join(json.dumps(x) + "\n" for x in rows))
    set_variant("default")


if __name__ == "__main__":
    main()
