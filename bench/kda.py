"""Our KDA kernels against fla's (flash-linear-attention) in the same process, on one GPU.

    python bench/kda.py --out bench/results/kda_h100.json                   # check, time, decode: ~8 min with fla
    python bench/kda.py --sections time --shapes 96:16384:k3 --no-fla        # one shape, ours only: ~1 min
    python bench/kda.py --sections tune,prof --out /tmp/kda_tune.json         # launch settings, per-kernel times

Sections (`--sections`, comma-separated; the JSON is rewritten after every row):
  check   forward outputs and final states (bf16 and fp32 inputs, both gates), gradients, a varlen batch with empty
          and length-1 sequences, decode steps and chunk-boundary states, each against an fp64 step-by-step
          recurrence of the same inputs; fla's errors on the same inputs beside ours
  time    per shape 'H:T:gate' (B=1, K=V=128, bf16): the forward without autograd (prefill, the 16-token kernels) and
          forward+backward (training), ours then fla; then a varlen batch of 10 sequences (H=96, K3 gate)
  decode  one recurrent step (B=1 and 64, T=1 and 4, H=96) replayed in a CUDA graph, ours and fla
  tune    each kernel's launch settings around the table in kimi3_kernels/kda/configs.py (one kernel at a time, through
          `launch_overrides`), then the per-kernel winners together
  prof    per-kernel CUDA time of one forward and one forward+backward, ours and fla

fla autotunes each new shape for minutes (its backward ~9 minutes per gradient shape): `--no-fla` times ours alone,
`--no-fla-grads` keeps fla out of the gradient rows. Relative errors are max |x - ref| / max |ref|.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "kernels")]
from _timing import Results, cuda_ms, graph_ms, rel  # noqa: E402

GATES = {"k3": -5.0, "sp": None}  # K3's bounded gate (lower bound -5) and Kimi Linear's softplus gate
DEFAULT_SHAPES = "32:4096:sp,32:16384:sp,32:65536:sp,96:4096:k3,96:16384:k3,96:65536:k3"
VARLEN = [37, 4096, 513, 9000, 1, 2047, 12000, 300, 64, 4700]


def kernels():
    from kimi3_kernels.kda import chunk_kda, fused_recurrent_kda

    return chunk_kda, fused_recurrent_kda


def fla_ops():
    """fla's (chunk_kda, fused_recurrent_kda), or None."""
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception:  # noqa: BLE001 - fla raises more than ImportError when triton is missing or broken
        return None
    return chunk_kda, fused_recurrent_kda


def fla_kw(lower_bound, A_log, dt_bias):
    """fla's arguments for our gate: the raw pre-activation in, gate and sigmoid(beta) formed in the kernel."""
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias)
    if lower_bound is not None:
        kw.update(safe_gate=True, lower_bound=lower_bound)
    return kw


def inputs(B, T, H, K, V, dtype, seed=0, A_scale=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v, f = r(B, T, H, K).to(dtype), r(B, T, H, K).to(dtype), r(B, T, H, V).to(dtype), r(B, T, H, K).to(dtype)
    beta = r(B, T, H).to(dtype)
    return q, k, v, f, beta, (r(H) * 0.5 + A_scale).float(), (r(H * K) * 0.3).float()


def fp64_recurrence(q, k, v, f, beta, A_log, dt_bias, lower_bound=None, initial_state=None, chunk_states=False):
    """KDA token by token in fp64, straight from the math (docs/kernels.md): gate g from the raw pre-activation f,
    alpha = exp(g) decays the key axis, S <- Diag(alpha) S + beta k (v - S^T k)^T, o = S^T q with q, k L2-normalised
    and q scaled by K^-0.5. Returns o, the final state [B, H, K, V] and (chunk_states) the state every 64 tokens."""
    B, T, H, K = q.shape
    d = (lambda x: x.double())
    x = d(f) + d(dt_bias).view(H, K)
    a = d(A_log)[:H].exp().view(H, 1)
    alpha = (lower_bound * torch.sigmoid(a * x) if lower_bound is not None else -a * F.softplus(x)).exp()
    norm = (lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6))
    qn, kn, vv, b = norm(d(q)) * K ** -0.5, norm(d(k)), d(v), torch.sigmoid(d(beta))
    S = d(initial_state) if initial_state is not None else q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    outs, states = [], []
    for t in range(T):
        if chunk_states and t % 64 == 0:
            states.append(S)
        S = S * alpha[:, t, :, :, None]
        err = vv[:, t] - torch.einsum("bhk,bhkv->bhv", kn[:, t], S)
        S = S + b[:, t, :, None, None] * kn[:, t, :, :, None] * err[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qn[:, t], S))
    o = torch.stack(outs, 1) if outs else vv.new_zeros(vv.shape)
    return (o, S, torch.stack(states, 1)) if chunk_states else (o, S)


def backward(o, leaves):
    """o.sum()'s gradients into fresh .grad of the leaves: nothing accumulates across timed calls."""
    for x in leaves:
        x.grad = None
    o.sum().backward()


# ------------------------------------------------------------------------------------------------ check


def check(res, args):
    chunk_kda, fused_recurrent_kda = kernels()
    fla = None if args.no_fla else fla_ops()
    # forward at a real shape: ours and fla against the fp64 recurrence on the same inputs
    for gate, lb in GATES.items():
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v, f, beta, A_log, dtb = inputs(1, 4096, 32, 128, 128, dtype, seed=1)
            h0 = torch.randn(1, 32, 128, 128, device="cuda")
            ro, rs = fp64_recurrence(q, k, v, f, beta, A_log, dtb, lb, h0)
            with torch.no_grad():
                o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                                 output_final_state=True)
            row = dict(check="forward", gate=gate, dtype=str(dtype), T=4096, H=32, o_rel=rel(o, ro), state_rel=rel(s, rs))
            if fla:
                with torch.no_grad():
                    fo, fs = fla[0](q, k, v, f, beta, initial_state=h0, output_final_state=True, **fla_kw(lb, A_log, dtb))
                row.update(fla_o_rel=rel(fo, ro), fla_state_rel=rel(fs, rs))
            res.add(**row)
    # gradients: ours (and fla's) against autograd through the fp64 recurrence
    for gate, lb in GATES.items():
        for dtype, T in ((torch.bfloat16, 1000), (torch.float32, 1000), (torch.bfloat16, 8192)):
            ins = list(inputs(1, T, 4, 128, 128, dtype, seed=2)) + [torch.randn(1, 4, 128, 128, device="cuda")]
            do, dS = torch.randn(1, T, 4, 128, device="cuda"), torch.randn(1, 4, 128, 128, device="cuda")

            def grads(fn):
                xs = [x.detach().clone().requires_grad_() for x in ins]
                o, s = fn(*xs[:5], A_log=xs[5], dt_bias=xs[6], lower_bound=lb, initial_state=xs[7])
                ((o.double() * do.double()).sum() + (s.double() * dS.double()).sum()).backward()
                return [x.grad for x in xs]

            ref = grads(lambda *a, A_log, dt_bias, lower_bound, initial_state: fp64_recurrence(
                *a, A_log, dt_bias, lower_bound, initial_state))
            ours = grads(lambda *a, **kw: chunk_kda(*a, **kw, output_final_state=True))
            names = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]
            row = dict(check="gradients", gate=gate, dtype=str(dtype), T=T, H=4,
                       **{n: rel(a, b) for n, a, b in zip(names, ours, ref)})
            if fla and not args.no_fla_grads:
                theirs = grads(lambda q, k, v, f, beta, A_log, dt_bias, lower_bound, initial_state: fla[0](
                    q, k, v, f, beta, initial_state=initial_state, output_final_state=True,
                    **fla_kw(lower_bound, A_log, dt_bias)))
                row.update({"fla_" + n: rel(a, b) for n, a, b in zip(names, theirs, ref) if a is not None})
            res.add(**row)
            torch.cuda.empty_cache()
    # a varlen batch (empty and length-1 sequences) per sequence against the recurrence; the recurrent kernel on it
    lens = [0, 1, 63, 64, 65, 1000, 0, 3000, 7]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    for gate, lb in GATES.items():
        q, k, v, f, beta, A_log, dtb = inputs(1, int(cu[-1]), 32, 128, 128, torch.bfloat16, seed=3)
        h0 = torch.randn(len(lens), 32, 128, 128, device="cuda")
        with torch.no_grad():
            o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                             output_final_state=True, cu_seqlens=cu)
            ro, rs = fused_recurrent_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                                         output_final_state=True, cu_seqlens=cu)
        o_err, s_err = [], []
        for n in range(len(lens)):
            a, b = int(cu[n]), int(cu[n + 1])
            po, ps = fp64_recurrence(*(x[:, a:b] for x in (q, k, v, f, beta)), A_log, dtb, lb, h0[n:n + 1])
            if b > a:
                o_err.append(rel(o[:, a:b], po))
            s_err.append(rel(s[n:n + 1], ps))
        res.add(check="varlen", gate=gate, lens=lens, o_rel_max=max(o_err), state_rel_max=max(s_err),
                recurrent_vs_chunk_o=rel(ro, o), recurrent_vs_chunk_state=rel(rs, s))
    # decode steps and speculative verification (T=4): the state updated in place
    for T in (1, 4):
        q, k, v, f, beta, A_log, dtb = inputs(64, T, 96, 128, 128, torch.bfloat16, seed=4)
        h0 = torch.randn(64, 96, 128, 128, device="cuda") * 0.1
        st = h0.clone()
        o, _ = fused_recurrent_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, initial_state=st,
                                   inplace_final_state=True)
        ro, rs = fp64_recurrence(q, k, v, f, beta, A_log, dtb, -5.0, h0)
        res.add(check="decode", B=64, H=96, T=T, o_rel=rel(o, ro), state_rel=rel(st, rs))
    # steep unbounded decay (the diagonal tiles' per-column path) and the chunk-boundary states, fp32
    q, k, v, f, beta, A_log, dtb = inputs(1, 2048, 8, 128, 128, torch.float32, seed=5, A_scale=3.0)
    with torch.no_grad():
        o, s, cs = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, output_final_state=True,
                             return_chunk_states=True)
    ro, rs, rcs = fp64_recurrence(q, k, v, f, beta, A_log, dtb, chunk_states=True)
    res.add(check="steep_decay_fp32", o_rel=rel(o, ro), state_rel=rel(s, rs), chunk_states_rel=rel(cs, rcs[0]),
            o_nan=bool(o.isnan().any()))


# ------------------------------------------------------------------------------------------------ time


def parse_shapes(spec):
    return [(int(h), int(t), g) for h, t, g in (x.split(":") for x in spec.split(",") if x)]


def time_shapes(res, args):
    """Ours for every shape first, then fla: a run cut short still has our rows."""
    chunk_kda, _ = kernels()
    fla = None if args.no_fla else fla_ops()
    impls = [("ours", chunk_kda)] + ([("fla", fla[0])] if fla else [])
    for impl, fn in impls:
        for H, T, gate in parse_shapes(args.shapes):
            lb = GATES[gate]
            q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
            kw = dict(A_log=A_log, dt_bias=dtb, lower_bound=lb) if impl == "ours" else fla_kw(lb, A_log, dtb)
            leaves = [x.clone().requires_grad_() for x in (q, k, v, f)]
            rep = 10 if T * H <= 16384 * 32 else 5
            with torch.no_grad():
                fwd_ms = cuda_ms(lambda: fn(q, k, v, f, beta, **kw), rep=rep)
            fwdbwd_ms = cuda_ms(lambda: backward(fn(*leaves, beta, **kw)[0], leaves), warm=1, rep=rep)
            res.add(section="time", impl=impl, H=H, T=T, gate=gate, fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms)
            del q, k, v, f, leaves
            torch.cuda.empty_cache()
    if args.no_varlen:
        return
    cu = torch.tensor([0] + VARLEN, device="cuda").cumsum(0).to(torch.int32)
    q, k, v, f, beta, A_log, dtb = inputs(1, int(cu[-1]), 96, 128, 128, torch.bfloat16, seed=8)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, f)]
    for impl, fn in impls:
        kw = (dict(A_log=A_log, dt_bias=dtb, lower_bound=-5.0, cu_seqlens=cu) if impl == "ours"
              else dict(fla_kw(-5.0, A_log, dtb), cu_seqlens=cu.long()))
        with torch.no_grad():
            fwd_ms = cuda_ms(lambda: fn(q, k, v, f, beta, **kw), rep=5)
        res.add(section="time", impl=impl, H=96, T=int(cu[-1]), gate="k3", varlen=VARLEN, fwd_ms=fwd_ms)
        res.rows[-1]["fwdbwd_ms"] = cuda_ms(lambda: backward(fn(*leaves, beta, **kw)[0], leaves), warm=1, rep=5)
        res.save()


def decode(res, args):
    _, fused_recurrent_kda = kernels()
    fla = None if args.no_fla else fla_ops()
    for B in (1, 64):
        for T in (1, 4):
            q, k, v, f, beta, A_log, dtb = inputs(B, T, 96, 128, 128, torch.bfloat16, seed=9)
            state = torch.randn(B, 96, 128, 128, device="cuda") * 0.1
            row = dict(section="decode", B=B, H=96, T=T, gate="k3")
            row["ours_graph_ms"] = graph_ms(lambda: fused_recurrent_kda(
                q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, initial_state=state,
                inplace_final_state=True))
            if fla:
                fla_state = state.clone()
                row["fla_graph_ms"] = graph_ms(lambda: fla[1](q, k, v, f, beta, initial_state=fla_state,
                                                              output_final_state=True, **fla_kw(-5.0, A_log, dtb)))
            row["ours_state_TBps"] = 2 * B * 96 * 128 * 128 * 4 / row["ours_graph_ms"] / 1e9
            res.add(**row)


# ------------------------------------------------------------------------------------------------ tune, prof

# kernels that run for one kind of gate only: timed at that gate's shape
GATE_ONLY = {"diag_fwd": "k3", "intra_bwd": "k3", "prep_bwd": "k3", "diag_fwd_loop": "sp", "intra_bwd_loop": "sp",
             "prep_bwd_softplus": "sp", "diag_inv": "sp"}
INFERENCE_KERNELS = {"sub_fwd", "rec_fwd"}  # the forward without autograd; every other kernel runs in training


def candidates(setting):
    """Launch settings around a table entry: tile, warps and stages halved and doubled, one at a time."""
    tile, warps, stages, *cap = setting
    out = []
    if tile:
        out += [(t, warps, stages, *cap) for t in (tile // 2, tile * 2) if 16 <= t <= 128]
    out += [(tile, w, stages, *cap) for w in (warps // 2, warps * 2) if 1 <= w <= 8]
    if stages:
        out += [(tile, warps, s, *cap) for s in (stages - 1, stages + 1) if 1 <= s <= 4]
    return out


def tune(res, args):
    """Each kernel's candidates against the table (one kernel at a time), at H=32 T=16K (softplus gate) and H=96 T=16K
    (K3 gate); the inference kernels on the forward without autograd, the others on forward+backward. Then the
    per-kernel winners (> 1% faster at every shape the kernel runs at) together against the table."""
    from kimi3_kernels.kda import configs

    chunk_kda, _ = kernels()
    table = {name: [tuple(c) for c in opts] for name, opts in args.tune.items()} if args.tune else {
        name: candidates(setting) for name, setting in configs.LAUNCH.items()}
    shapes = ((32, 16384, "sp"), (96, 16384, "k3"))
    ratios = {}
    for H, T, gate in shapes:
        q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, f)]
        kw = dict(A_log=A_log, dt_bias=dtb, lower_bound=GATES[gate])

        def fwd():
            with torch.no_grad():
                return chunk_kda(q, k, v, f, beta, **kw)[0]

        def fwdbwd():
            backward(chunk_kda(*leaves, beta, **kw)[0], leaves)
            return leaves[0].grad

        base = {"fwd": (fwd().clone(), cuda_ms(fwd, rep=5)), "fwdbwd": (fwdbwd().clone(), cuda_ms(fwdbwd, warm=1, rep=5))}
        res.add(section="tune", H=H, T=T, gate=gate, kernel=None, fwd_ms=base["fwd"][1], fwdbwd_ms=base["fwdbwd"][1])
        for name, opts in table.items():
            if GATE_ONLY.get(name, gate) != gate:
                continue
            pass_, fn = ("fwd", fwd) if name in INFERENCE_KERNELS else ("fwdbwd", fwdbwd)
            for opt in opts:
                row = dict(section="tune", H=H, T=T, gate=gate, kernel=name, setting=list(opt), pass_=pass_)
                try:
                    with configs.launch_overrides({name: opt}):
                        out = fn().clone()
                        row["ms"] = cuda_ms(fn, warm=1, rep=5)
                    row["rel_vs_table"] = rel(out, base[pass_][0])
                    row["speedup_vs_table"] = base[pass_][1] / row["ms"]
                    ratios.setdefault((name, opt), []).append(row["speedup_vs_table"])
                except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                res.add(**row)
        del q, k, v, f, leaves
        torch.cuda.empty_cache()
    picks = {}
    for (name, opt), rs in ratios.items():
        if len(rs) == (1 if name in GATE_ONLY else len(shapes)) and min(rs) > 1.01:
            if sum(rs) / len(rs) > picks.get(name, (None, 0.0))[1]:
                picks[name] = (opt, sum(rs) / len(rs))
    res.meta["tune_picks"] = {name: list(opt) for name, (opt, _) in picks.items()}
    if picks:
        for H, T, gate in shapes:
            q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
            leaves = [x.clone().requires_grad_() for x in (q, k, v, f)]
            kw = dict(A_log=A_log, dt_bias=dtb, lower_bound=GATES[gate])
            for label, settings in (("table", {}), ("picks", {n: o for n, (o, _) in picks.items()})):
                with configs.launch_overrides(settings), torch.no_grad():
                    fwd_ms = cuda_ms(lambda: chunk_kda(q, k, v, f, beta, **kw), rep=10)
                with configs.launch_overrides(settings):
                    fwdbwd_ms = cuda_ms(lambda: backward(chunk_kda(*leaves, beta, **kw)[0], leaves), warm=1, rep=5)
                res.add(section="tune_together", H=H, T=T, gate=gate, launch=label, fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms)


def kernel_ms(fn, n=3):
    """CUDA milliseconds per kernel name (mean of n calls after one warm-up), by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ks = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            ks[e.name[:80]] = ks.get(e.name[:80], 0.0) + e.device_time_total / (n * 1e3)
    return dict(sorted(ks.items(), key=lambda kv: -kv[1]))


def prof(res, args):
    chunk_kda, _ = kernels()
    fla = None if args.no_fla else fla_ops()
    for H, T, gate in ((32, 16384, "sp"), (96, 16384, "k3")):
        prof_shape(res, chunk_kda, fla, H, T, gate)
        torch.cuda.empty_cache()


def prof_shape(res, chunk_kda, fla, H, T, gate):
    lb = GATES[gate]
    q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, f)]
    impls = [("ours", chunk_kda, dict(A_log=A_log, dt_bias=dtb, lower_bound=lb))]
    impls += [("fla", fla[0], fla_kw(lb, A_log, dtb))] if fla else []
    for impl, fn, kw in impls:
        def fwd():
            with torch.no_grad():
                fn(q, k, v, f, beta, **kw)
        for pass_, run in (("fwd", fwd), ("fwdbwd", lambda: backward(fn(*leaves, beta, **kw)[0], leaves))):
            ks = kernel_ms(run)
            res.add(section="prof", impl=impl, H=H, T=T, gate=gate, pass_=pass_, total_ms=sum(ks.values()),
                    kernels_ms={n: round(t, 4) for n, t in list(ks.items())[:12]})


# ------------------------------------------------------------------------------------------------ main


def parse_tune(spec):
    """'name=tile:warps:stages[:maxnreg]/...,name=...' -> {name: [(tile, warps, stages[, maxnreg]), ...]}"""
    if not spec:
        return None
    out = {}
    for item in spec.split(","):
        name, opts = item.split("=", 1)
        out[name] = [tuple(int(x) if x not in ("", "None") else None for x in o.split(":")) for o in opts.split("/")]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results JSON; a run is added beside the file's earlier runs (default: printed only)")
    ap.add_argument("--label", default=None, help="what ran, stored in the file's meta (default: git describe)")
    ap.add_argument("--sections", default="check,time,decode")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="time: 'H:T:gate,...', gate k3 or sp; '' = varlen only")
    ap.add_argument("--no-fla", action="store_true", help="ours only")
    ap.add_argument("--no-fla-grads", action="store_true", help="check: fla in the forward rows only")
    ap.add_argument("--no-varlen", action="store_true", help="time: skip the varlen batch")
    ap.add_argument("--tune", type=parse_tune, default=None,
                    help="tune only these settings: 'name=tile:warps:stages[:maxnreg]/...,name=...'")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kda.py needs a CUDA GPU")
    res = Results(args.out, keep_runs=True, tree_label=args.label)
    sections = {"check": check, "time": time_shapes, "decode": decode, "tune": tune, "prof": prof}
    for name in args.sections.split(","):
        t = time.time()
        try:
            sections[name](res, args)
        except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
            traceback.print_exc()
            res.add(section=name, error=f"{type(e).__name__}: {e}"[:1000])
        res.meta.setdefault("section_s", {})[name] = round(time.time() - t, 1)
        res.save()


if __name__ == "__main__":
    main()
