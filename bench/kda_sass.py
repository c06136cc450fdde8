"""Compile-only census of the KDA chunk kernels for sm_90, no GPU needed: registers, spill stack, shared memory, SASS
instructions by class, and an estimate of the warp-instructions each kernel issues per 64-token chunk and head.

The launches are the ones chunk_kda makes (recorded as tests/test_kda_launch_resources.py does, on CPU tensors), so
they follow LAUNCH_DEFAULTS and the KIMI3_KDA_* variables of this process. Run it under the GPU machine's Triton
(3.6), whose ptxas decides the registers:

    PYTHONPATH=/path/to/triton-3.6:src:kernels python bench/kda_sass.py [--softplus] [--bwd] [--kernels a,b]
    KIMI3_KDA_LAUNCH=rec_fwd=32:4:2 PYTHONPATH=... python bench/kda_sass.py --kernels _rec_fwd_kernel

The dynamic estimate multiplies each loop body (a backward branch in the SASS) by its trip count: K / BK for the
loops over K slices, 15 for `_inv_unit_lower`'s substitution and 14 for `_inv_rows`' (TRIPS below; a kernel whose
loops do not match its entry gets no estimate). "floor" is that count at 4 warp-instructions per cycle per SM on 132
SMs at 1.98 GHz, for H=96 T=16K: a kernel far above its floor is bound by latency or bytes, not by issue. These are
static figures: time them on the device (bench/kda_ab.py) before believing them.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

CLASSES = {"mma": ("HMMA", "HGMMA"), "mufu": ("MUFU",), "fp32": ("FFMA", "FMUL", "FADD", "FSEL", "FMNMX", "FSETP"),
           "mov": ("MOV", "IMAD.MOV", "CS2R"), "ldg": ("LDG",), "stg": ("STG",), "smem": ("LDS", "STS", "LDSM"),
           "bar": ("BAR",), "shfl": ("SHFL",), "cvt": ("F2F", "F2FP", "I2F", "F2I", "PRMT")}
# trip counts of each kernel's loops, in address order: "k" = cdiv(K, BK); "chunk" = once per BC-token step of a
# scan (BC = 64, or the constexpr BC: 16 for _rec_fwd_kernel). _sub_fwd_kernel: the norms'
# pass, the main one, the inverse (ptxas may unroll the first: then no estimate)
TRIPS = {"_diag_fwd_kernel": ("k", 15), "_diag_inv_kernel": (14,), "_intra_fwd_kernel": ("k",),
         "_output_fwd_kernel": ("k",), "_state_fwd_kernel": ("chunk",),
         "_wu_fwd_kernel": (), "_gate_fwd_kernel": (), "_norm_fwd_kernel": (),
         "_sub_fwd_kernel": ("k", "k", 15), "_rec_fwd_kernel": ("chunk",)}
T_REC, K_REC = 128, 128  # the recorded call: two chunks, K = V = 128


def record(H, lower_bound, backward):
    from triton.runtime.jit import JITFunction
    from kimi3_kernels.kda import chunk_bwd, chunk_fwd, chunk_kda, gate
    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((self.fn, grid, a, kw))

    swapped = [(m, n, o) for m in (chunk_fwd, chunk_bwd, gate) for n, o in list(vars(m).items())
               if isinstance(o, JITFunction)]
    try:
        for m, n, o in swapped:
            setattr(m, n, Recorder(o))
        xs = [torch.randn(1, T_REC, H, K_REC, dtype=torch.bfloat16, requires_grad=backward) for _ in range(4)]
        beta = torch.randn(1, T_REC, H, dtype=torch.bfloat16)
        with torch.set_grad_enabled(backward):
            o, _ = chunk_kda(*xs, beta, A_log=torch.zeros(H), dt_bias=torch.zeros(H * K_REC),
                             lower_bound=lower_bound)
            if backward:
                o.float().sum().backward()
    finally:
        for m, n, o in swapped:
            setattr(m, n, o)
    return launches


def compile_sass(fn, args, kwargs):
    """(resource usage text, SASS text, options) of one recorded launch, compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
           torch.int64: "*i64", torch.uint8: "*u8", torch.int8: "*i8"}
    vals = dict(zip(fn.arg_names, args), **kwargs)
    opts = dict(num_warps=vals.pop("num_warps", 4), num_stages=vals.pop("num_stages", 3))
    if "maxnreg" in vals:
        opts["maxnreg"] = vals.pop("maxnreg")
    sig, consts, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = vals[name]
        if param.is_constexpr or v is None:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = ptr[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i1" if isinstance(v, bool) else "i32" if isinstance(v, int) else "fp32"
    c = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        res, sass = (subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                     for flag in ("-res-usage", "-sass"))
    return res, sass, opts, consts, c.metadata.shared


def census(sass):
    """Opcode counts and loop bodies (first, last instruction index) of a SASS listing."""
    ops, code = collections.Counter(), []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*)", line)
        if m:
            code.append((int(m.group(1), 16) // 16, m.group(3), m.group(4)))
    loops = []
    for idx, op, rest in code:
        ops[op] += 1
        target = re.match(r"\s*0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) // 16 < idx:
            loops.append((int(target.group(1), 16) // 16, idx))
    classes = {name: sum(n for op, n in ops.items() if op.startswith(prefixes)) for name, prefixes in CLASSES.items()}
    return sum(ops.values()), classes, loops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--softplus", action="store_true", help="the Kimi Linear gate (default: K3's, lower bound -5)")
    ap.add_argument("--bwd", action="store_true", help="also the backward's launches (no estimate for them)")
    ap.add_argument("--H", type=int, default=2, help="heads of the recorded call (grid sizes, the scans' tiles)")
    ap.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    args = ap.parse_args()
    only = set(filter(None, args.kernels.split(",")))
    nc = T_REC // 64
    seen = set()
    for fn, grid, a, kw in record(args.H, None if args.softplus else -5.0, args.bwd):
        name = fn.__name__
        if only and name not in only:
            continue
        res, sass, opts, consts, shared = compile_sass(fn, a, kw)
        total, classes, loops = census(sass)
        key = (name, total, tuple(loops))
        if key in seen:
            continue
        seen.add(key)
        regs, stack = (re.search(rf"{f}:(\d+)", res).group(1) for f in ("REG", "STACK"))
        programs = 1
        for g in grid:
            programs *= g
        per_ch = programs / (nc * args.H)  # programs per chunk and head
        trips = TRIPS.get(name)
        est = ""
        if trips is not None and len(trips) == len(loops):
            dyn = total
            for (first, last), t in zip(loops, trips):
                body = last - first + 1
                if t == "chunk":  # a scan: its program walks the chunks; its body runs 64 / BC times per chunk
                    dyn = body * 64 // consts.get("BC", 64)
                else:
                    dyn += ((-(-K_REC // consts["BK"]) if t == "k" else t) - 1) * body
            warp_instr = dyn * opts["num_warps"] * (per_ch if trips != ("chunk",) else programs / args.H)
            floor_ms = warp_instr * 256 * 96 / (4 * 132 * 1.98e9) * 1e3
            est = f" warp-instr/chunk-head={warp_instr:.0f} floor(H96,16K)={floor_ms:.3f}ms"
        bodies = ",".join(str(last - first + 1) for first, last in loops)
        print(f"{name:20s} {opts} regs={regs} stack={stack} shared={shared} sass={total} loop_bodies=[{bodies}] "
              + " ".join(f"{k}={v}" for k, v in classes.items()) + est)


if __name__ == "__main__":
    main()
