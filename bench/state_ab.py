"""A/B of the KDA state-scan kernel variants (KIMI3_KDA_STATE flags: split = the state's K rows in two 64-row
halves, prefetch = next chunk's operands into registers, bsplit = the same split in the backward scan) and of
KIMI3_KDA_DIAG_INV=2 against 1, in one process on the H200: per-kernel CUDA time from torch.profiler (3 forward+backward
calls per variant), then full forward / forward+backward timings of the defaults against the fastest variants.
Writes --out/state_ab.json after each row."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from kimi3_kernels.kda import chunk_kda  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from kda import bench, inputs  # noqa: E402

# defaults: forward variants, each with the default backward; then backward variants with the default forward.
# Format "flags:BV:warps:stages" (flags: base, split, prefetch, split+prefetch, bsplit).
FWD = ("base:64:4:2,split:64:4:3,split:32:4:3,base:64:4:3,base:32:4:3,split:64:4:4,split:64:8:3,prefetch:64:8:1,"
       "split+prefetch:64:8:1,base:64:4:2")
BWD = "base:32:8:2,bsplit:32:4:2,base:32:8:3"
FWD_DEFAULT, BWD_DEFAULT = "base:64:4:2", "base:32:8:2"
FLAGS = {"base": "", "split": "split", "prefetch": "prefetch", "split+prefetch": "split,prefetch", "bsplit": "bsplit"}
RES = {}


def save(out):
    with open(os.path.join(out, "state_ab.json"), "w") as fh:
        json.dump(RES, fh, indent=1)


def setenv(state, launch, inv="1"):
    os.environ["KIMI3_KDA_STATE"] = state
    os.environ["KIMI3_KDA_LAUNCH"] = launch
    os.environ["KIMI3_KDA_DIAG_INV"] = inv


def kernel_us(fn, n=3):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ks = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            ks[e.name[:40]] = ks.get(e.name[:40], 0.0) + e.device_time_total / n
    return ks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--fwd", default=FWD)
    ap.add_argument("--bwd", default=BWD)
    ap.add_argument("--shapes", default="32:16384:sp,96:16384:k3")
    ap.add_argument("--no-whole", action="store_true")
    args = ap.parse_args()
    RES.update(gpu=torch.cuda.get_device_name(), git_commit=os.environ.get("GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    shapes = [(int(h), int(t), -5.0 if g == "k3" else None) for h, t, g in (x.split(":") for x in args.shapes.split(","))]
    data = {}
    for H, T, lb in shapes:
        q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
        xs = [x.clone().requires_grad_() for x in (q, k, v, f)]
        do = torch.randn_like(v)

        def fb():
            for x in xs:
                x.grad = None
            o = chunk_kda(*xs, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)[0]
            o.backward(do)
            return o

        def fwd():
            return chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)[0]

        data[H] = (fwd, fb, xs)
        gate = "k3" if lb else "softplus"
        for _ in range(3):  # clocks up before the first row
            fb()
        ref = None
        runs = [(f, BWD_DEFAULT) for f in args.fwd.split(",") if f] + [(FWD_DEFAULT, b) for b in args.bwd.split(",") if b]
        for fv, bv in runs:
            fl, flaunch = fv.split(":", 1)
            bl, blaunch = bv.split(":", 1)
            setenv(",".join(filter(None, (FLAGS[fl], FLAGS[bl]))), f"state_fwd={flaunch},state_bwd={blaunch}")
            try:
                o = fb().detach().clone()
                dq = xs[0].grad.clone()
                if ref is None:
                    ref = (o, dq)
                ks = kernel_us(fb)
                row = dict(H=H, T=T, gate=gate, fwd=fv, bwd=bv,
                           state_fwd_us=sum(t for n, t in ks.items() if "_state_fwd" in n),
                           state_bwd_us=sum(t for n, t in ks.items() if "_state_bwd" in n),
                           total_us=sum(ks.values()),
                           o_diff=((o.float() - ref[0].float()).norm() / ref[0].float().norm()).item(),
                           dq_diff=((dq.float() - ref[1].float()).norm() / ref[1].float().norm()).item())
            except Exception as ex:  # noqa: BLE001
                row = dict(H=H, T=T, gate=gate, fwd=fv, bwd=bv, error=repr(ex)[:300])
            RES.setdefault("kernels", []).append(row)
            print("ab", json.dumps(row), flush=True)
            save(args.out)
            if "error" in row:  # a CUDA fault poisons the process
                sys.exit(1)
        for inv in ("1", "2"):
            setenv("", "", inv)
            ks = kernel_us(fwd)
            row = dict(H=H, T=T, gate=gate, diag_inv=inv, total_us=sum(ks.values()),
                       diag_us={n: round(t, 1) for n, t in ks.items() if "_diag" in n or "_intra" in n})
            RES.setdefault("diag_inv", []).append(row)
            print("ab", json.dumps(row), flush=True)
        save(args.out)
    # the fastest forward and backward variants (per-kernel time summed over both shapes), against the defaults,
    # whole calls
    def best(key, col):
        tot = {}
        for r in RES["kernels"]:
            if key in r:
                tot[r[col]] = tot.get(r[col], 0.0) + r[key]
        return min(tot, key=tot.get)
    bf, bb = best("state_fwd_us", "fwd"), best("state_bwd_us", "bwd")
    pick = (",".join(filter(None, (FLAGS[bf.split(":")[0]], FLAGS[bb.split(":")[0]]))),
            f"state_fwd={bf.split(':', 1)[1]},state_bwd={bb.split(':', 1)[1]}")
    RES["pick"] = pick
    print("ab pick", pick, flush=True)
    for H, T, lb in [] if args.no_whole else shapes:
        fwd, fb, _ = data[H]
        for rnd in range(2):
            for name, (state, launch) in (("default", ("", "")), ("pick", pick)):
                setenv(state, launch)
                row = dict(H=H, T=T, round=rnd, config=name, fwd_ms=bench(fwd, rep=10), fwdbwd_ms=bench(fb, warm=1,
                                                                                                         rep=5))
                RES.setdefault("whole", []).append(row)
                print("ab", json.dumps(row), flush=True)
        save(args.out)


if __name__ == "__main__":
    main()
