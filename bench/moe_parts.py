"""Where the packed experts' sorted path spends its GPU time, kernel by kernel (K3 shapes, as bench/moe.py):

    python bench/moe_parts.py --tokens 1024 --rounds 4 --out DIR

Each round profiles (torch.profiler, CUDA kernels) `calls` eager calls of each variant, variants interleaved, so a
drift of the clocks under the power cap hits them alike:
- `full`: the module's `_forward_triton` (x into the K order, gate+up with the GLU fused, h written in the down
  tile's K order, down with its rows scattered to (token, slot) order);
- `h_copied`: the same with h written in plain order and copied into the K order by `permute_k`;
- `gate_up` / `down`: the two GEMMs apart (as bench/moe_tiles.py times them).
Writes moe_parts_h200.jsonl: per variant and round, each kernel's name, launches and microseconds per call."""

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe  # noqa: E402  (bench/moe.py: shapes, weights, routing)
from _timing import write_jsonl  # noqa: E402


def kernel_times(fn, calls):
    """{kernel name: (launches per call, us per call)} over `calls` calls of fn."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = out[e.name[:90]]
            k[0] += 1
            k[1] += e.device_time
    return {name: (n / calls, round(us / calls, 1)) for name, (n, us) in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    G, M, _ = moe.load_modules()
    mod = moe.make_mxfp4_weights(M)
    E, D, INTER, TOPK = moe.E, moe.D, moe.INTER, moe.TOPK
    rows = []
    for n in args.tokens:
        x = torch.randn(n, D, device=moe.DEV, dtype=torch.bfloat16)
        idx, _ = moe.routing(n, seed=n)
        order, offsets = M._route(idx, E, sync_ok=False)
        Mr = order.numel()
        tiles = mod._mlp_tiles(G, Mr, E, False, x.device)
        xk = G.permute_k(x, tiles[0], nib=tiles[1]) if tiles[0] else x
        hh = torch.randn(Mr, INTER, device=moe.DEV, dtype=torch.bfloat16)
        up_rows = dict(a_rows=(order // TOPK).to(torch.int32))
        dn_rows = dict(c_rows=order.to(torch.int32), num_c_rows=Mr)
        copied = tiles[:4] + (False,)
        fns = dict(
            full=lambda: mod._forward_triton(x, order, offsets, TOPK),
            h_copied=lambda: mod._expert_mlp(G.permute_k(x, tiles[0], nib=tiles[1]) if tiles[0] else x, offsets,
                                             copied, up_rows, dn_rows),
            gate_up=lambda: G.mxfp4_grouped_gemm(
                xk, mod.w1_packed, mod.w1_scale, offsets, act=mod._fused[0], act_params=mod._fused[1:] or (1., 1.),
                out_dtype=x.dtype, b_packed=mod.w3_packed, b_scale=mod.w3_scale, dual="out", a_kperm=tiles[0],
                a_nib=tiles[1], c_kperm=tiles[2] if tiles[4] else 0, c_nib=tiles[3], **up_rows),
            down=lambda: G.mxfp4_grouped_gemm(hh, mod.w2_packed, mod.w2_scale, offsets, a_kperm=tiles[2],
                                              a_nib=tiles[3], **dn_rows),
        )
        ref = fns["full"]()
        alt = fns["h_copied"]()
        rows.append(dict(tokens=n, h_copied_equal_full=bool(torch.equal(ref, alt)), tiles=list(tiles)))
        print(rows[-1], flush=True)
        for r in range(args.rounds):
            for name, fn in fns.items():
                k = kernel_times(fn, args.calls)
                rows.append(dict(tokens=n, round=r, variant=name, total_us=round(sum(v[1] for v in k.values()), 1),
                                 kernels=k))
                print(rows[-1], flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_jsonl(args.out, "moe_parts_h200.jsonl", rows)


if __name__ == "__main__":
    main()
