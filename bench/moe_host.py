"""Host (CPU) time of the packed experts' eager decode step at K3 shapes, and where it goes:

    python bench/moe_host.py --tokens 1 2 8 --out DIR

Per token count: the module's forward (no autograd) as CUDA-graph replay (GPU time), eager with an event pair around
each call (what a user's eager decode waits), and its host microseconds per call when calls are queued without a
synchronisation; then a cProfile of 200 eager calls (top functions by own and by cumulative time, to
DIR/moe_host_profile_N.txt).
First an A/B of kimi3_kernels._launch: the module eager with direct launches and through Triton's launch path
(KIMI3_DIRECT_LAUNCH=0/1, --rounds interleaved rounds, outputs compared).
Floors in the same process: host microseconds of an empty Triton launch with 1 and with 40 arguments (and with 40
through the direct path), of the module's kernels launched alone, and of what the launch path computed at every call
before 2026-12-03 (the Gluon weight layout, `triton.cdiv`). One JSON line per row, to stdout and
DIR/moe_host_h200.jsonl."""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe  # noqa: E402  (bench/moe.py: shapes, weights, routing)
from _timing import graph_us, host_us, write_jsonl  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _empty1(a):
    pass


@triton.jit
def _empty40(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
             n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
             B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the direct-launch A/B")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    G, M, _ = moe.load_modules()
    mod = moe.make_mxfp4_weights(M)
    t = torch.empty(16, device="cuda")
    rows = []

    def emit(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    emit(part="empty_triton_1_arg", host_us=round(host_us(lambda: _empty1[(1,)](t)), 1))
    ts = [t] * 20
    ns = list(range(1, 17))
    emit(part="empty_triton_40_args", host_us=round(host_us(lambda: _empty40[(1,)](*ts, *ns, 1, 2, 3, 4)), 1))
    from kimi3_kernels import _launch
    emit(part="empty_40_args_direct", host_us=round(host_us(
        lambda: _launch.launch(_empty40, (1,), (*ts, *ns), B0=1, B1=2, B2=3, B3=4)), 1))
    # what the launch path computed at every call before they were cached / plain Python
    from kimi3_kernels import mxfp4_wgmma as W
    layout = getattr(W.byte_layout, "__wrapped__", W.byte_layout)
    emit(part="byte_layout_uncached", host_us=round(host_us(lambda: layout(64, 128, 4)), 1))
    emit(part="triton_cdiv", host_us=round(host_us(lambda: triton.cdiv(3584, 64)), 2))
    emit(part="torch_empty", host_us=round(host_us(lambda: torch.empty(16, 3584, device="cuda")), 1))
    with torch.no_grad():
        # direct launches (kimi3_kernels._launch) against Triton's launch path, interleaved rounds; same outputs
        for n in args.tokens:
            x = torch.randn(n, moe.D, device="cuda", dtype=torch.bfloat16)
            idx, w = moe.routing(n, seed=n)
            fn = lambda: mod(x, idx, w)  # noqa: E731
            outs = {}
            for r in range(args.rounds):
                for variant, flag in (("triton_launch", "0"), ("direct_launch", "1")):
                    os.environ["KIMI3_DIRECT_LAUNCH"] = flag
                    outs[variant] = fn()
                    ev = moe.bench(fn, warm=5, rep=50)
                    emit(tokens=n, part="module_ab", variant=variant, round=r, eager_event_us=round(ev * 1e3, 1),
                         host_us=round(host_us(fn), 1))
            os.environ.pop("KIMI3_DIRECT_LAUNCH")
            emit(tokens=n, part="module_ab_outputs_equal", equal=bool(torch.equal(*outs.values())),
                 direct=_launch.status())
        for n in args.tokens:
            x = torch.randn(n, moe.D, device="cuda", dtype=torch.bfloat16)
            idx, w = moe.routing(n, seed=n)
            fn = lambda: mod(x, idx, w)  # noqa: E731
            ev = moe.bench(fn, warm=5, rep=50)
            emit(tokens=n, part="module", graph_us=round(graph_us(fn, 100), 1), eager_event_us=round(ev * 1e3, 1),
                 host_us=round(host_us(fn), 1))
            ids, _ = G.route_expert_ids(idx, moe.E)
            emit(tokens=n, part="route_expert_ids", host_us=round(host_us(lambda: G.route_expert_ids(idx, moe.E)), 1))
            nib = mod._table_free_ok()
            emit(tokens=n, part="permute_k", host_us=round(host_us(lambda: G.permute_k(x, 128, nib=nib)), 1))
            xp = G.permute_k(x, 128, nib=nib)
            up = lambda: G.mxfp4_grouped_gemm(  # noqa: E731
                xp, mod.w1_packed, mod.w1_scale, None, expert_ids=ids, a_row_div=moe.TOPK, dual="out", act="silu",
                b_packed=mod.w3_packed, b_scale=mod.w3_scale, out_dtype=torch.bfloat16, a_kperm=128, a_nib=nib,
                c_kperm=128, c_nib=nib)
            emit(tokens=n, part="gate_up_gemm", host_us=round(host_us(up), 1))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
            Path(args.out, f"moe_host_profile_{n}.txt").write_text(s.getvalue())
    write_jsonl(args.out, "moe_host_h200.jsonl", rows)


if __name__ == "__main__":
    main()
