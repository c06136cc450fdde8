"""Where the packed MXFP4 experts' forward + backward time goes at K3 shapes (896 experts, top-16, latent 3584,
width 3072, SiTU-GLU), per kernel (torch.profiler), with the backward GEMMs' tail launches off and on
(KIMI3_MXFP4_TAIL_BWD), interleaved in one process:

    PYTHONPATH=$PWD/src:$PWD/kernels python bench/moe_backward_profile.py --tokens 4096 16384 --out DIR

Writes DIR/moe_backward_profile.json: per token count and setting, the median forward+backward ms (CUDA events) and
the kernels of one profiled call grouped by name (ms per call), and the relative difference of dx between settings.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe  # noqa: E402  (bench/moe.py: shapes, weights, routing, timing)


def kernels_of(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:90]
            rows[name] = rows.get(name, 0.0) + ev.device_time_total / 1e3
    return dict(sorted(((k, round(v, 3)) for k, v in rows.items()), key=lambda kv: -kv[1])[:20])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tails", nargs="+", default=["0", "64,32"], help="KIMI3_MXFP4_TAIL_BWD settings to compare")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    G, M, _ = moe.load_modules()
    mod = moe.make_mxfp4_weights(M)
    situ = M.SiTUGLU(4.0, 25.0)
    mod.glu_act, mod._fused = situ, M.fused_act_spec(situ)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
               commit=os.environ.get("GIT_COMMIT", "unknown"), rows=[])
    for n in args.tokens:
        x = torch.randn(n, moe.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        idx, w = moe.routing(n, seed=8)
        w = w.requires_grad_()
        dy = torch.randn(n, moe.D, device="cuda", dtype=torch.bfloat16)

        def step():
            x.grad = w.grad = None
            mod(x, idx, w).backward(dy)

        times, grads = {t: [] for t in args.tails}, {}
        for _ in range(3):
            for t in args.tails:
                os.environ["KIMI3_MXFP4_TAIL_BWD"] = t
                times[t].append(moe.bench(step, warm=1, rep=3))
        for t in args.tails:
            os.environ["KIMI3_MXFP4_TAIL_BWD"] = t
            step()
            grads[t] = x.grad.float().clone()
            with torch.no_grad():
                fwd = moe.bench(lambda: mod(x, idx, w), warm=1, rep=3)
            row = dict(tokens=n, tail_bwd=t, fwd_bwd_ms=round(sorted(times[t])[1], 3),
                       rounds=[round(v, 3) for v in times[t]], fwd_ms_no_grad=round(fwd, 3),
                       dx_rel_diff_vs_first=float((grads[t] - grads[args.tails[0]]).norm()
                                                  / grads[args.tails[0]].norm()),
                       kernels_ms=kernels_of(step))
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        os.environ.pop("KIMI3_MXFP4_TAIL_BWD", None)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "moe_backward_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
