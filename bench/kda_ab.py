"""In-process A/B of the KDA chunk kernels: this tree's against a base copy (another commit's `kernels/` folder,
loaded under another package name) and against environment toggles, interleaved over rounds, plus each variant's
per-kernel CUDA time. One process, so launch overhead, clocks and caches are shared.

    mkdir -p .kbase && git archive BASE kernels | tar x -C .kbase   # here; .kbase in .git/info/exclude, carried
    python bench/kda_ab.py --base .kbase/kernels --variants "inv1:KIMI3_KDA_DIAG_INV=1" \
        --shapes 32:16384:sp,96:16384:k3 --out DIR                  # on the GPU machine (pass GIT_COMMIT there:
                                                                    # its copy's git HEAD can be stale)

Writes DIR/kda_ab.json (medians per round, the ratio of each variant to the base, kernel times).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda import HAVE_FLA, backward, bench, inputs, kernel_ms, rel  # noqa: E402  (puts this tree's kernels/ on the path)
from kimi3_kernels.kda import chunk_kda, naive_chunk_kda  # noqa: E402


def fla_fn(q, k, v, f, beta, A_log, dt_bias, lower_bound):
    """fla's chunk_kda with the same gate options (bench/kda.py's fla_kw), as one more variant."""
    from kda import fla_chunk, fla_kw
    return fla_chunk(q, k, v, f, beta, **fla_kw(lower_bound, A_log, dt_bias))


def compiled_resources():
    """Registers, spills and shared memory of every compiled variant of the KDA forward kernels in this process (what
    the compiler of the GPU's Triton made of them)."""
    from triton.runtime.jit import JITFunction

    from kimi3_kernels.kda import chunk_fwd, gate
    rows = []
    for mod in (chunk_fwd, gate):
        for name, fn in vars(mod).items():
            if not isinstance(fn, JITFunction):
                continue
            for cache in getattr(fn, "device_caches", {}).values():
                for key, kern in cache[0].items():
                    kern._init_handles()
                    rows.append(dict(kernel=name, key=str(key)[-160:], n_regs=kern.n_regs, n_spills=kern.n_spills,
                                     shared=kern.metadata.shared, num_warps=kern.metadata.num_warps))
    return rows


def fp32_ref(q, k, v, f, beta, A_log, dt_bias, lower_bound):
    """naive_chunk_kda's fp32 output, over groups of heads: it holds [H, T/64, 64, 64, K] fp32 tensors (2 MB per head
    and chunk), so a group is kept to ~8 GB of each."""
    K = q.shape[-1]
    step = max(1, 2**18 // q.shape[1])
    outs = []
    with torch.no_grad():
        for h in range(0, q.shape[2], step):
            hs = slice(h, h + step)
            outs.append(naive_chunk_kda(*(x[:, :, hs].float() for x in (q, k, v, f, beta)), A_log=A_log[hs],
                                        dt_bias=dt_bias[h * K:(h + step) * K], lower_bound=lower_bound)[0])
            torch.cuda.empty_cache()
    return torch.cat(outs, 2)


def load_base(folder, i=0):
    """`folder`/kimi3_kernels imported as kimi3_kernels_base (kimi3_kernels_base<i> for i > 0): its modules import
    each other relatively."""
    pkg = os.path.join(folder, "kimi3_kernels")
    top = "kimi3_kernels_base" + (str(i) if i else "")
    for name, path, sub in ((top, pkg, [pkg]), (top + ".kda", os.path.join(pkg, "kda"), [os.path.join(pkg, "kda")])):
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=sub)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[top + ".kda"].chunk_kda


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--base", default=None, help="a kernels/ folder to compare against (loaded as kimi3_kernels_base), "
                    "or several as 'name=folder,name=folder' (the first is the reference of the ratios)")
    ap.add_argument("--variants", default="", help="'name:ENV=VAL:ENV=VAL,...' run on this tree's kernels "
                    "('name@base:...' on that base's)")
    ap.add_argument("--shapes", default="32:16384:sp,96:16384:k3", help="'H:T:gate,...' (gate k3 or sp)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bwd", action="store_true", help="also forward+backward")
    ap.add_argument("--fla", action="store_true",
                    help="fla's chunk_kda as one more variant (forward only: fla autotunes its backward for minutes)")
    ap.add_argument("--regs", action="store_true", help="registers and spills of the compiled forward kernels")
    ap.add_argument("--ref", type=int, default=0, metavar="TOKENS",
                    help="each variant's output error against the fp32 PyTorch chunk reference (naive_chunk_kda) on "
                         "the same bf16 inputs, at shapes of at most TOKENS * H tokens x heads (0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel CUDA time of each variant's forward (and forward+backward with --bwd)")
    args = ap.parse_args()
    variants = [("new", {}, chunk_kda)]
    if args.base:
        bases = [b.split("=", 1) if "=" in b else ("base", b) for b in args.base.split(",")]
        variants[:0] = [(name, {}, load_base(folder, i)) for i, (name, folder) in enumerate(bases)]
    if args.fla and HAVE_FLA:
        variants.append(("fla", {}, fla_fn))
    fns = {name: fn for name, _, fn in variants}
    for item in filter(None, re.split(r",(?=[\w@-]+:[A-Z_][A-Z0-9_]*=)", args.variants)):
        name, _, rest = item.partition(":")
        envs = re.split(r":(?=[A-Z_][A-Z0-9_]*=)", rest) if rest else []  # values may hold ':' and ','
        # name@base runs that base's kernels with the variables set
        variants.append((name, dict(e.split("=", 1) for e in envs), fns[name.partition("@")[2] or "new"]))
    res = dict(gpu=torch.cuda.get_device_name(), git_commit=os.environ.get("GIT_COMMIT", ""), base=args.base,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=[])
    os.makedirs(args.out, exist_ok=True)
    for shape in args.shapes.split(","):
        H, T, gate = shape.split(":")
        H, T, lb = int(H), int(T), (-5.0 if gate == "k3" else None)
        q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
        qq, kk, vv, ff = (x.clone().requires_grad_() for x in (q, k, v, f))
        row = dict(H=H, T=T, gate=gate, fwd_ms={}, fwdbwd_ms={}, kernels_ms={}, out_rel_to_first={})
        ref = gref = None
        fref = fp32_ref(q, k, v, f, beta, A_log, dtb, lb) if T * H <= args.ref else None
        for rnd in range(args.rounds):
            for name, env, fn in variants:
                old = {e: os.environ.get(e) for e in env}
                os.environ.update(env)
                try:
                    def fwd():
                        return fn(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)

                    def fb():
                        o, _ = fn(qq, kk, vv, ff, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)
                        backward(o, (qq, kk, vv, ff))
                    row["fwd_ms"].setdefault(name, []).append(bench(fwd, rep=10 if T * H <= 2**19 else 5))
                    if args.bwd and name != "fla":
                        row["fwdbwd_ms"].setdefault(name, []).append(bench(fb, warm=1, rep=5))
                    if rnd == 0:
                        o = fwd()[0].float()
                        ref = o if ref is None else ref
                        row["out_rel_to_first"][name] = ((o - ref).norm() / ref.norm()).item()
                        if fref is not None:
                            row.setdefault("out_rel_to_fp32_ref", {})[name] = rel(o, fref)
                        if args.bwd and name != "fla":  # the gradients of q, k, v, g against the first variant's
                            fb()
                            gs = [x.grad.float() for x in (qq, kk, vv, ff)]
                            gref = gs if gref is None else gref
                            row.setdefault("grad_rel_to_first", {})[name] = {
                                n: ((a - b).norm() / b.norm()).item() for n, a, b in zip("qkvg", gs, gref)}
                            del gs
                        if args.profile:
                            row["kernels_ms"][name] = {n: round(t, 4) for n, t in kernel_ms(fwd).items()}
                            if args.bwd:
                                row.setdefault("kernels_fwdbwd_ms", {})[name] = {
                                    n: round(t, 4) for n, t in kernel_ms(fb).items()}
                finally:
                    for e, val in old.items():
                        if val is None:
                            os.environ.pop(e, None)
                        else:
                            os.environ[e] = val
            print(shape, "round", rnd, json.dumps({n: round(t[-1], 4) for n, t in row["fwd_ms"].items()}),
                  json.dumps({n: round(t[-1], 3) for n, t in row["fwdbwd_ms"].items()}), flush=True)
        first = variants[0][0]
        for key in ("fwd_ms", "fwdbwd_ms"):
            med = {n: sorted(ts)[len(ts) // 2] for n, ts in row[key].items()}
            row[key.replace("_ms", "_median_ms")] = med
            row[key.replace("_ms", "_speedup_vs_" + first)] = {n: med[first] / t for n, t in med.items()}
        print(shape, json.dumps({k: row[k] for k in row if "median" in k or "speedup" in k or "rel_to" in k}),
              flush=True)
        if args.profile:
            for key in ("kernels_ms", "kernels_fwdbwd_ms"):
                for n, ks in row.get(key, {}).items():
                    print(shape, key, n, json.dumps(ks)[:900], flush=True)
        res["rows"].append(row)
        if args.regs:
            res["compiled"] = compiled_resources()
        with open(os.path.join(args.out, "kda_ab.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        del q, k, v, f, qq, kk, vv, ff, ref, gref, fref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
