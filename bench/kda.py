"""KDA kernels on the GPU: correctness at real shapes, then timings against fla 0.6.0 and SDPA.

    python bench/kda.py --out DIR [--quick] [--sections check,time,decode]

Writes DIR/kda_h200.json (+ kda_h200.png). Every section is guarded: an error is recorded in the
JSON and the run goes on. Relative errors are ||x - ref|| / ||ref||.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

# KDA_BENCH_KERNELS: another kernels folder (e.g. an older commit's, for an A/B in the same session)
sys.path.insert(0, os.environ.get("KDA_BENCH_KERNELS") or
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))
from kimi3_kernels.kda import chunk_kda, fused_recurrent_kda, naive_chunk_kda, naive_recurrent_kda  # noqa: E402

try:
    from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_rec
    HAVE_FLA = True
except Exception as ex:  # noqa: BLE001
    HAVE_FLA = False
    FLA_ERR = repr(ex)

RES: dict = {}
T0 = time.time()


def save(out):
    RES["elapsed_s"] = time.time() - T0
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kda_h200.json"), "w") as fh:
        json.dump(RES, fh, indent=1)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench(fn, warm=2, rep=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def backward(o, xs):
    """o.sum()'s gradients into fresh .grad of the leaves xs: nothing accumulates across timed calls (in a model q, k,
    v and g are not leaves, and the accumulation's add kernels, 1.1 ms at H=96 T=16K, would be timed too)."""
    for x in xs:
        x.grad = None
    o.sum().backward()


def inputs(B, T, H, K, V, dtype, seed=0, A_scale=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v = r(B, T, H, K).to(dtype), r(B, T, H, K).to(dtype), r(B, T, H, V).to(dtype)
    f = r(B, T, H, K).to(dtype)
    beta = r(B, T, H).to(dtype)
    A_log = (r(H) * 0.5 + A_scale).float()
    dt_bias = (r(H * K) * 0.3).float()
    return q, k, v, f, beta, A_log, dt_bias


def fla_kw(lb, A_log, dt_bias):
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias)
    if lb is not None:
        kw.update(safe_gate=True, lower_bound=lb)
    return kw


def section(name, fn, out):
    t = time.time()
    try:
        fn()
    except Exception as ex:  # noqa: BLE001
        RES.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
        print(f"[{name}] ERROR {ex!r}", flush=True)
    RES.setdefault("section_s", {})[name] = time.time() - t
    save(out)


# ---------------------------------------------------------------- ceilings
def ceilings():
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), warm=2, rep=10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = bench(lambda: a @ b, warm=3, rep=10)
    RES["ceilings"] = {"copy_TBps": 2 * x.numel() / ms / 1e9, "bf16_mm_TFLOPs": 2 * 8192**3 / mm / 1e9}
    del x, y, a, b
    torch.cuda.empty_cache()
    print("ceilings", RES["ceilings"], flush=True)


# ---------------------------------------------------------------- correctness
def check():
    C = RES.setdefault("check", [])

    def rec(**kw):
        C.append(kw)
        print(kw, flush=True)
        save(ARGS.out)  # a run cut by its time limit keeps the rows it has

    # 1) forward at real shapes vs the fp32 PyTorch chunk reference and vs fla (same bf16 inputs)
    for lb in (-5.0, None):
        for dtype in (torch.bfloat16, torch.float32):
            B, T, H, K = 1, 4096, 32, 128
            q, k, v, f, beta, A_log, dtb = inputs(B, T, H, K, K, dtype, seed=1)
            h0 = torch.randn(B, H, K, K, device="cuda")
            o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                             output_final_state=True)
            with torch.no_grad():
                ro, rs = naive_chunk_kda(*(x.float() for x in (q, k, v, f, beta)), A_log=A_log, dt_bias=dtb,
                                         lower_bound=lb, initial_state=h0, output_final_state=True)
            row = dict(test="fwd_vs_fp32_ref", lb=lb, dtype=str(dtype), T=T, H=H,
                       o_rel=rel(o, ro), state_rel=rel(s, rs), o_nan=bool(o.isnan().any()))
            if HAVE_FLA:
                fo, fs = fla_chunk(q, k, v, f, beta, initial_state=h0, output_final_state=True,
                                   **fla_kw(lb, A_log, dtb))
                row.update(fla_o_rel_vs_ref=rel(fo, ro), fla_state_rel_vs_ref=rel(fs, rs), ours_vs_fla_o=rel(o, fo))
            rec(**row)
            del ro, rs
            torch.cuda.empty_cache()
    # 2) gradients vs PyTorch reference autograd (fp32 reference on the same inputs), fla's beside ours; bf16 also at
    #    a longer sequence, where rounding in the carried states (h, dh in bf16, as fla keeps them) accumulates
    def fla_fn(q, k, v, f, beta, A_log, dt_bias, lower_bound, initial_state, output_final_state):
        return fla_chunk(q, k, v, f, beta, initial_state=initial_state, output_final_state=output_final_state,
                         **fla_kw(lower_bound, A_log, dt_bias))

    for lb in (-5.0, None):
        for dtype, T in ((torch.bfloat16, 1000), (torch.float32, 1000), (torch.bfloat16, 8192)):
            B, H, K = 1, 4, 128
            ins = list(inputs(B, T, H, K, K, dtype, seed=2)) + [torch.randn(B, H, K, K, device="cuda")]
            do = torch.randn(B, T, H, K, device="cuda").to(dtype)
            dS = torch.randn(B, H, K, K, device="cuda")
            with_fla = HAVE_FLA and not ARGS.no_fla_grads
            fns = [(chunk_kda, False), (naive_chunk_kda, True)] + ([(fla_fn, False)] if with_fla else [])
            grads = []
            for fn, cast in fns:
                xs = [(x.float() if cast else x).detach().clone().requires_grad_() for x in ins]
                o, s = fn(*xs[:5], A_log=xs[5], dt_bias=xs[6], lower_bound=lb, initial_state=xs[7],
                          output_final_state=True)
                ((o.float() * do.float()).sum() + (s * dS).sum()).backward()
                grads.append([x.grad for x in xs])
            names = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]
            row = {n: rel(a, b) for n, a, b in zip(names, grads[0], grads[1])}
            if with_fla:
                row.update({"fla_" + n: rel(a, b) for n, a, b in zip(names, grads[2], grads[1])
                            if a is not None})
            rec(test="grad_vs_fp32_ref", lb=lb, dtype=str(dtype), T=T, H=H, **row)
            del grads, xs, o, s
            torch.cuda.empty_cache()
    # 3) varlen (empty and length-1 sequences) vs per-sequence calls, and the recurrent kernel
    H, K = 32, 128
    lens = [0, 1, 63, 64, 65, 1000, 0, 3000, 7]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    TT = int(cu[-1])
    for lb in (-5.0, None):
        q, k, v, f, beta, A_log, dtb = inputs(1, TT, H, K, K, torch.bfloat16, seed=3)
        h0 = torch.randn(len(lens), H, K, K, device="cuda")
        o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                         output_final_state=True, cu_seqlens=cu)
        errs_o, errs_s = [], []
        for n in range(len(lens)):
            a, b = int(cu[n]), int(cu[n + 1])
            sl = lambda x: x[:, a:b]  # noqa: E731
            if b > a:
                on, sn = chunk_kda(*(sl(x) for x in (q, k, v, f, beta)), A_log=A_log, dt_bias=dtb, lower_bound=lb,
                                   initial_state=h0[n:n + 1], output_final_state=True)
                errs_o.append(rel(o[:, a:b], on))
            else:
                sn = h0[n:n + 1]
            errs_s.append(rel(s[n:n + 1], sn))
        ro, rs = fused_recurrent_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, initial_state=h0,
                                     output_final_state=True, cu_seqlens=cu)
        row = dict(test="varlen_vs_per_sequence", lb=lb, lens=lens, o_rel_max=max(errs_o), state_rel_max=max(errs_s),
                   recurrent_vs_chunk_o=rel(ro, o), recurrent_vs_chunk_state=rel(rs, s))
        if HAVE_FLA:
            fo, fs = fla_chunk(q, k, v, f, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu.long(),
                               **fla_kw(lb, A_log, dtb))
            row.update(ours_vs_fla_o=rel(o, fo), ours_vs_fla_state=rel(s, fs))
        rec(**row)
    # 4) decode step and speculative verify: ours vs fp32 recurrence reference (in place)
    for T in (1, 4):
        B, H = 64, 96
        q, k, v, f, beta, A_log, dtb = inputs(B, T, H, K, K, torch.bfloat16, seed=4)
        h0 = torch.randn(B, H, K, K, device="cuda") * 0.1
        st = h0.clone()
        o, _ = fused_recurrent_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, initial_state=st,
                                   inplace_final_state=True)
        ro, rs = naive_recurrent_kda(*(x.float() for x in (q, k, v, f, beta)), A_log=A_log, dt_bias=dtb,
                                     lower_bound=-5.0, initial_state=h0, output_final_state=True)
        rec(test="decode_vs_fp32_recurrence", B=B, H=H, T=T, o_rel=rel(o, ro), state_rel=rel(st, rs))
    # 5) strong decay (plain gate, large A_log): the per-column diagonal path
    q, k, v, f, beta, A_log, dtb = inputs(1, 2048, 8, 128, 128, torch.float32, seed=5, A_scale=3.0)
    o, s = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, output_final_state=True)
    ro, rs = naive_chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, output_final_state=True)
    rec(test="strong_decay_fp32", o_rel=rel(o, ro), state_rel=rel(s, rs), o_nan=bool(o.isnan().any()))
    # 5b) moderate decay (plain gate): diagonal tiles on both sides of chunk_fwd.DENSE_MAX_SPAN, gradients
    ins = list(inputs(1, 1000, 4, 128, 128, torch.float32, seed=9, A_scale=1.6))
    grads = []
    for fn in (chunk_kda, naive_chunk_kda):
        xs = [x.detach().clone().requires_grad_() for x in ins]
        o, _ = fn(*xs[:5], A_log=xs[5], dt_bias=xs[6])
        o.pow(2).sum().backward()
        grads.append([x.grad for x in xs])
    rec(test="moderate_decay_grads_fp32", **{n: rel(a, b) for n, a, b in
                                             zip(["q", "k", "v", "g", "beta", "A_log", "dt_bias"], *grads)})
    # 6) chunk states for prefix caching
    q, k, v, f, beta, A_log, dtb = inputs(1, 1000, 8, 128, 128, torch.float32, seed=6)
    _, _, cs = chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, return_chunk_states=True)
    _, _, rcs = naive_chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0,
                                return_chunk_states=True)
    rec(test="chunk_states_fp32", shape=list(cs.shape), rel=rel(cs, rcs))


# ---------------------------------------------------------------- timings
def flops_bytes(T, H, K, V, bwd=False):
    C = 64
    NT = T / C
    # per chunk: Aqk + Akk (2 C^2 K), W, U (C^2 (K + V)), Vn = U - W S (C K V), O (C K V + C^2 V), S update (C K V)
    fwd = 2 * H * NT * (2 * C * C * K + C * C * (K + V) + 3 * C * K * V + C * C * V)
    # minimal bytes: q, k, g, v read (bf16) + beta + o written
    byt = H * T * (3 * K + V + 1) * 2 + H * T * V * 2
    if bwd:
        return fwd * 3.5, byt * 2.5
    return fwd, byt


def stage_bytes(K=128, V=128, C=64, e=2, aqk=2, inv_in_diag=True):
    """Bytes each forward kernel moves per token and head, each tensor counted once (a value tile's re-reads of W
    and Kd assumed to hit L2): the traffic of our six-stage design, against which a kernel's time gives its achieved
    bandwidth. e: bytes of the input / intermediate dtype; aqk: of Aqk (fp32 when the backward keeps it); f32 cumsum
    gc; 64-token chunks. inv_in_diag: the diagonal blocks' inverses formed in the diagonal kernel (bounded gates) or
    in _diag_inv_kernel (unbounded)."""
    f = 4
    b = {
        "_gate_fwd_kernel": K * e + K * f,  # g -> gc
        "_norm_fwd_kernel": 2 * K * e + 2 * K * e + 4 * f,  # q, k -> qn, kn; beta -> bs, rq, rk
        "_diag_fwd_kernel": 2 * K * e + K * f + 16 * aqk + 16 * f + (16 * f if inv_in_diag else 0),  # -> Aqk, Pd, Md
        "_intra_fwd_kernel": 1.75 * K * e + K * f + 2 * 16 * f + f + 24 * aqk + C * e,  # -> off-diagonal Aqk, T
        "_wu_fwd_kernel": C * e + 2 * K * e + K * f + V * e + 3 * K * e + V * e,  # T, kn, qn, gc, v -> W, Kd, Qg, U
        "_state_fwd_kernel": 2 * K * e + V * e + K * V * e / C + V * e,  # W, Kd, U -> entry states, v_new
        "_output_fwd_kernel": K * e + K * V * e / C + C * aqk + V * e + V * e,  # Qg, states, Aqk, v_new -> o
    }
    if not inv_in_diag:
        b["_diag_inv_kernel"] = 16 * f + f + 16 * f
    return b


def stage_bytes_bwd(K=128, V=128, C=64, e=2):
    """The backward kernels' traffic per token and head, counted like stage_bytes: fp32 gradient buffers, per-chunk
    fp32 states (K V 4 / C bytes per token) and the forward's kept fp32 M, P, Aqk."""
    f = 4
    S = K * V * f / C
    return {
        # W, Qg, Kd, Aqk, dO -> dS per chunk, dVn
        "_state_bwd_kernel": 3 * K * e + C * f + V * e + S + V * f,
        # qn, kn, v, gc, beta, M, P, S, dS, Vn, dVn, dO -> dv, dA, dP, dqn, dkn, dG, dbeta
        "_main_bwd_kernel": 2 * K * e + V * e + K * f + f + 2 * C * f + 2 * S + V * e + V * f + V * e
        + V * e + 2 * C * f + 3 * K * f + f,
        # qn, kn, gc, dA, dP; dqn, dkn, dG read and written back (the main backward's V side reads S, kn and gc again,
        # and each 16-row sub-tile of the pairwise one its neighbours' rows: cache hits, not counted)
        "_intra_bwd_kernel": 2 * K * e + K * f + 2 * C * f + 2 * 3 * K * f,
        # dG, g, q, k, dqn, dkn, rq, rk, beta, dbeta -> dg, dq, dk, dbeta_raw
        "_prep_bwd_kernel": K * f + 3 * K * e + 2 * K * f + 4 * f + K * e + 2 * K * e + f,
    }


def timings():
    cfgs = [(32, T, None) for T in (4096, 16384, 65536)] + [(96, T, -5.0) for T in (4096, 16384, 65536)]
    if ARGS.quick:
        cfgs = [(32, 4096, None), (32, 16384, None), (96, 8192, -5.0), (96, 32768, -5.0)]
    extra = [(96, 8192, -5.0), (96, 32768, -5.0), (32, 16384, -5.0), (96, 16384, None)]
    if not ARGS.quick:
        cfgs += extra
    if ARGS.shapes is not None:  # "H:T:gate,..." with gate k3 (lower bound -5) or sp (softplus); "" = none
        cfgs = [(int(h), int(t), -5.0 if g == "k3" else None)
                for h, t, g in (x.split(":") for x in ARGS.shapes.split(",") if x)]
    K = V = 128
    # our kernels first for every shape, then fla: a run cut short still returns our numbers
    impls = [("ours", None)] + ([("fla", None)] if HAVE_FLA else [])
    rows = {}
    for impl, _ in impls:
        for H, T, lb in cfgs:
            q, k, v, f, beta, A_log, dtb = inputs(1, T, H, K, V, torch.bfloat16, seed=7)
            key = (H, T, lb)
            row = rows.setdefault(key, dict(H=H, T=T, gate="k3_lower_bound_-5" if lb is not None else "softplus",
                                            dtype="bf16"))
            if impl == "ours":
                fwd = lambda: chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)  # noqa: E731
            else:
                kw = fla_kw(lb, A_log, dtb)
                fwd = lambda: fla_chunk(q, k, v, f, beta, **kw)  # noqa: E731
            qq, kk, vv, ff = (x.clone().requires_grad_() for x in (q, k, v, f))

            def fb():
                if impl == "ours":
                    o, _ = chunk_kda(qq, kk, vv, ff, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)
                else:
                    o, _ = fla_chunk(qq, kk, vv, ff, beta, **fla_kw(lb, A_log, dtb))
                backward(o, (qq, kk, vv, ff))
            rep = 10 if T * H <= 16384 * 32 else 5
            t = time.time()
            fwd()
            torch.cuda.synchronize()
            row[f"{impl}_first_fwd_call_s"] = time.time() - t
            row[f"{impl}_fwd_ms"] = bench(fwd, rep=rep)
            t = time.time()
            fb()
            torch.cuda.synchronize()
            row[f"{impl}_first_fwdbwd_call_s"] = time.time() - t
            row[f"{impl}_fwdbwd_ms"] = bench(fb, warm=1, rep=rep)
            if impl == "ours":
                qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
                try:
                    row["sdpa_causal_fwd_ms"] = bench(
                        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), rep=rep)
                except Exception as ex:  # noqa: BLE001
                    row["sdpa_error"] = repr(ex)[:200]
                fl, by = flops_bytes(T, H, K, V)
                row["ours_fwd_TFLOPs"] = fl / row["ours_fwd_ms"] / 1e9
                row["ours_fwd_min_bytes_TBps"] = by / row["ours_fwd_ms"] / 1e9
                fl2, _ = flops_bytes(T, H, K, V, bwd=True)
                row["ours_fwdbwd_TFLOPs"] = fl2 / row["ours_fwdbwd_ms"] / 1e9
            else:
                row["fwd_speedup_vs_fla"] = row["fla_fwd_ms"] / row["ours_fwd_ms"]
                row["fwdbwd_speedup_vs_fla"] = row["fla_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
            print(impl, row, flush=True)
            RES["timings"] = list(rows.values())
            del q, k, v, f, beta, qq, kk, vv, ff
            torch.cuda.empty_cache()
            save(ARGS.out)
    if ARGS.no_varlen:
        return
    # varlen batch of mixed lengths (K3 gate, H=96)
    lens = [37, 4096, 513, 9000, 1, 2047, 12000, 300, 64, 4700]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    TT = int(cu[-1])
    H = 96
    q, k, v, f, beta, A_log, dtb = inputs(1, TT, H, K, V, torch.bfloat16, seed=8)
    row = dict(H=H, T=TT, varlen=lens, gate="k3_lower_bound_-5", dtype="bf16")
    row["ours_fwd_ms"] = bench(lambda: chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0,
                                                 cu_seqlens=cu), rep=5)
    kw, cul = fla_kw(-5.0, A_log, dtb), cu.long()
    if HAVE_FLA:  # the forwards first and saved: fla's backward may autotune for minutes
        row["fla_fwd_ms"] = bench(lambda: fla_chunk(q, k, v, f, beta, cu_seqlens=cul, **kw), rep=5)
        row["fwd_speedup_vs_fla"] = row["fla_fwd_ms"] / row["ours_fwd_ms"]
    RES.setdefault("timings_varlen", []).append(row)
    print(row, flush=True)
    save(ARGS.out)
    qq, kk, vv, ff = (x.clone().requires_grad_() for x in (q, k, v, f))

    def ofb():
        o, _ = chunk_kda(qq, kk, vv, ff, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0, cu_seqlens=cu)
        backward(o, (qq, kk, vv, ff))
    row["ours_fwdbwd_ms"] = bench(ofb, rep=5)
    if HAVE_FLA:
        def ffb():
            o, _ = fla_chunk(qq, kk, vv, ff, beta, cu_seqlens=cul, **kw)
            backward(o, (qq, kk, vv, ff))
        row["fla_fwdbwd_ms"] = bench(ffb, rep=5)
        row["fwdbwd_speedup_vs_fla"] = row["fla_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
    print(row, flush=True)


def kernel_ms(fn, n=3):
    """CUDA time per kernel name (ms, mean of n calls after one warm-up) of fn, by torch.profiler."""
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


def kernel_profile():
    """Per-kernel CUDA time of one forward and one forward+backward (torch.profiler), ours and fla, at two shapes:
    where the time goes, for the roofline discussion."""
    rows = RES.setdefault("kernel_profile", [])
    for H, T, lb in ((32, 16384, None), (96, 16384, -5.0)):
        q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
        qq, kk, vv, ff = (x.clone().requires_grad_() for x in (q, k, v, f))
        for name in ["ours"] + (["fla"] if HAVE_FLA else []):
            def run(bwd):
                if name == "ours":
                    o, _ = chunk_kda(qq if bwd else q, kk if bwd else k, vv if bwd else v, ff if bwd else f, beta,
                                     A_log=A_log, dt_bias=dtb, lower_bound=lb)
                else:
                    o, _ = fla_chunk(qq if bwd else q, kk if bwd else k, vv if bwd else v, ff if bwd else f, beta,
                                     **fla_kw(lb, A_log, dtb))
                if bwd:
                    backward(o, (qq, kk, vv, ff))
            for bwd in (False, True):
                ks = kernel_ms(lambda: run(bwd))
                row = dict(impl=name, H=H, T=T, gate="k3" if lb else "softplus", pass_="fwdbwd" if bwd else "fwd",
                           total_ms=sum(ks.values()), kernels_ms={n: round(t, 4) for n, t in list(ks.items())[:12]})
                if name == "ours":  # achieved bandwidth of each stage on the design's own traffic
                    sb = stage_bytes_bwd() if bwd else stage_bytes(inv_in_diag=lb is not None)
                    row["kernels_TBps"] = {n: round(sb[n] * T * H / (ks[n] * 1e9), 3) for n in sb if ks.get(n)}
                    if not bwd:
                        row["design_bytes_floor_ms"] = sum(sb.values()) * T * H / (RES.get("ceilings", {}).get(
                            "copy_TBps", 4.19) * 1e9)
                rows.append(row)
                print("prof", json.dumps(row), flush=True)
        del q, k, v, f, qq, kk, vv, ff
        torch.cuda.empty_cache()


# Launch options tried per kernel (KIMI3_KDA_LAUNCH "name=tile:warps:stages", empty = default; kimi3_kernels.kda._utils
# .LAUNCH_DEFAULTS), each against the defaults: forward kernels timed on the forward, backward ones on forward+backward.
# The first round (22fef45) tried 1-8 warps and other tiles for every kernel; this second one looks around its picks.
TUNE_FWD = {
    "prep_fwd": ["128:4:1", "512:8:1", "256:8:1"],
    "norm_fwd": ["32:4:1", "128:8:1", "64:8:1"],
    "diag_fwd": ["16:1:1", "32:1:2", "64:1:2", "128:2:1", "32:2:1"],
    "diag_fwd_loop": ["64:8:1", "128:4:1", "128:8:1", "32:8:1", "32:4:1"],
    "diag_inv": [":2:1", ":4:1"],
    "intra_fwd": ["32:2:3", "32:1:3", "16:1:2", "32:1:2", "32:4:2"],
    "wu_fwd": ["128:8:3", "128:4:2", "128:8:1", "64:8:3", "64:4:2"],
    "state_fwd": ["64:4:3", "64:2:2", "128:8:2", "32:2:2", "16:4:2", "32:8:2"],
    "output_fwd": ["64:4:1", "128:4:2", "64:8:1"],
}
# The backward rows look around the picks of the fourth session's sweeps (bedee9b: one program per K slice / V side
# and per 16-row sub-tile).
TUNE_BWD = {
    "intra_bwd": ["32:1:3", "32:1:1", "32:2:2", "64:2:2"],
    "intra_bwd_loop": ["32:1:3", "32:2:2", "64:2:2"],
    "main_bwd": ["32:4:2", "16:4:3", "32:4:4", "64:4:2"],
    "state_bwd": ["32:8:2", "64:8:2", "64:4:2"],
    "prep_bwd": [":4:2", ":8:3"],
    "prep_bwd_softplus": ["64::", "16::", "32:8:3", ":4:3"],
}
# kernels that only run for one kind of gate: timed on that shape only
GATE_ONLY = {"diag_fwd": "k3", "intra_bwd": "k3", "prep_bwd": "k3", "diag_fwd_loop": "softplus",
             "intra_bwd_loop": "softplus", "prep_bwd_softplus": "softplus"}


def tune():
    """Every kernel's launch options against the defaults (TUNE_FWD / TUNE_BWD), one kernel at a time, at H=32
    T=16K (softplus gate) and H=96 T=16K (K3 gate); then the per-kernel winners (> 1% faster on every shape the kernel
    runs at) together. Rows: ms, and the output's (forward) or dq's (backward) difference to the defaults' result."""
    rows = RES.setdefault("tune", [])
    shapes = ((32, 16384, None), (96, 16384, -5.0))
    best = {}
    for H, T, lb in shapes:
        q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
        xs = [x.clone().requires_grad_() for x in (q, k, v, f)]
        gate = "k3" if lb else "softplus"

        def fwd():
            return chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)[0]

        fb = _fwdbwd(xs, beta, A_log, dtb, lb)

        def one(kernel, opt, fn, key):
            os.environ["KIMI3_KDA_LAUNCH"] = f"{kernel}={opt}" if kernel else ""
            try:
                out = fn().clone()
                ms = bench(fn, warm=1, rep=5)
                row = dict(H=H, T=T, gate=gate, kernel=kernel, option=opt, pass_=key, ms=ms)
            except Exception as ex:  # noqa: BLE001
                out, row = None, dict(H=H, T=T, gate=gate, kernel=kernel, option=opt, error=repr(ex)[:300])
            os.environ.pop("KIMI3_KDA_LAUNCH", None)
            return out, row

        for table, fn, key in ((TUNE_FWD, fwd, "fwd"), (TUNE_BWD, fb, "fwdbwd")):
            ref, base = one(None, "default", fn, key)
            rows.append(base)
            print("tune", json.dumps(base), flush=True)
            for kernel, opts in table.items():
                if GATE_ONLY.get(kernel, gate) != gate:
                    continue
                for opt in opts:
                    out, row = one(kernel, opt, fn, key)
                    if out is not None:
                        row["rel_vs_default"] = rel(out, ref)
                        row["ratio_vs_default"] = base["ms"] / row["ms"]
                        best.setdefault((kernel, opt), []).append(row["ratio_vs_default"])
                    rows.append(row)
                    print("tune", json.dumps(row), flush=True)
                save(ARGS.out)
        del q, k, v, f, xs
        torch.cuda.empty_cache()
    # winners: best option per kernel among those > 1% faster at every shape it runs at
    picks = {}
    for (kernel, opt), ratios in best.items():
        if len(ratios) == (1 if kernel in GATE_ONLY else len(shapes)) and min(ratios) > 1.01:
            score = sum(ratios) / len(ratios)
            if score > picks.get(kernel, ("", 0.0))[1]:
                picks[kernel] = (opt, score)
    spec = ",".join(f"{kernel}={opt}" for kernel, (opt, _) in sorted(picks.items()))
    RES["tune_picks"] = spec
    print("tune picks", spec, flush=True)
    if spec:
        for H, T, lb in shapes:
            q, k, v, f, beta, A_log, dtb = inputs(1, T, H, 128, 128, torch.bfloat16, seed=7)
            fb = _fwdbwd([x.clone().requires_grad_() for x in (q, k, v, f)], beta, A_log, dtb, lb)
            for env in ("", spec):
                os.environ["KIMI3_KDA_LAUNCH"] = env
                row = dict(H=H, T=T, gate="k3" if lb else "softplus", launch=env or "default",
                           fwd_ms=bench(lambda: chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb,
                                                          lower_bound=lb), rep=10),
                           fwdbwd_ms=bench(fb, warm=1, rep=5))
                rows.append(row)
                print("tune", json.dumps(row), flush=True)
            os.environ.pop("KIMI3_KDA_LAUNCH", None)
            del q, k, v, f, fb
            torch.cuda.empty_cache()


def _fwdbwd(xs, beta, A_log, dtb, lb):
    """A forward+backward of chunk_kda on the leaf tensors xs = (q, k, v, f); returns dq."""
    def fb():
        backward(chunk_kda(*xs, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb)[0], xs)
        return xs[0].grad
    return fb


def graph_time(f):
    from _timing import capture  # bench/_timing.py (this folder is on sys.path when run as a script)

    gr = capture(f)
    # 20 replays per timed region to amortise the event overhead
    def rep20():
        for _ in range(20):
            gr.replay()
    return bench(rep20, warm=3, rep=20) / 20


def decode():
    Rd = RES.setdefault("decode", [])
    H = K = V = None
    H, K, V = 96, 128, 128
    for B in (1, 64):
        for T in (1, 4):
            q, k, v, f, beta, A_log, dtb = inputs(B, T, H, K, V, torch.bfloat16, seed=9)
            st = torch.randn(B, H, K, V, device="cuda") * 0.1
            row = dict(B=B, H=H, T=T, gate="k3_lower_bound_-5")
            ours = lambda: fused_recurrent_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0,  # noqa
                                               initial_state=st, inplace_final_state=True)
            row["ours_eager_ms"] = bench(ours, warm=3, rep=50)
            row["ours_graph_ms"] = graph_time(ours)
            if HAVE_FLA:
                st2 = st.clone()
                fl = lambda: fla_rec(q, k, v, f, beta, initial_state=st2, output_final_state=True,  # noqa
                                     **fla_kw(-5.0, A_log, dtb))
                try:
                    row["fla_eager_ms"] = bench(fl, warm=3, rep=50)
                    row["fla_graph_ms"] = graph_time(fl)
                    row["graph_speedup_vs_fla"] = row["fla_graph_ms"] / row["ours_graph_ms"]
                except Exception as ex:  # noqa: BLE001
                    row["fla_error"] = repr(ex)[:300]
            byt = 2 * B * H * K * V * 4
            row["state_MB_rw"] = byt / 1e6
            row["ours_graph_TBps"] = byt / row["ours_graph_ms"] / 1e9
            Rd.append(row)
            print(row, flush=True)


def plot(out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in RES.get("timings", []) if "fla_fwd_ms" in r and "varlen" not in r]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"H{r['H']} T{r['T'] // 1024}K\n{'K3' if r['gate'].startswith('k3') else 'sp'}" for r in rows]
    x = range(len(rows))
    for i, (key, title) in enumerate((("fwd", "forward"), ("fwdbwd", "forward+backward"))):
        ax[i].bar([j - 0.2 for j in x], [r[f"fla_{key}_ms"] for r in rows], 0.4, label="fla 0.6.0")
        ax[i].bar([j + 0.2 for j in x], [r[f"ours_{key}_ms"] for r in rows], 0.4, label="kimi3_kernels")
        ax[i].set_xticks(list(x))
        ax[i].set_xticklabels(labels, fontsize=7)
        ax[i].set_yscale("log")
        ax[i].set_ylabel("ms (log)")
        ax[i].set_title(f"KDA {title}, bf16, K=V=128, H200")
        ax[i].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "kda_h200.png"), dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None, help="timing shapes 'H:T:gate,...' (gate k3 or sp); '' = only the "
                    "varlen batch")
    ap.add_argument("--sections", default="ceil,check,time,decode")
    ap.add_argument("--warmup", default=None, help="compile-only run for one gate: 'k3' or 'softplus'")
    ap.add_argument("--no-fla", action="store_true", help="time ours only (fla autotunes for minutes per shape)")
    ap.add_argument("--no-varlen", action="store_true", help="time: skip the varlen batch (H=96)")
    ap.add_argument("--no-fla-grads", action="store_true", help="check: fla in the forward rows only (its backward "
                    "autotunes ~9 minutes per gradient shape)")
    ap.add_argument("--tune", default=None, help="tune only these: 'kernel=opt/opt,...' (else TUNE_FWD / TUNE_BWD)")
    ap.add_argument("--calls", default=None, help="'H:T:gate:N': N plain forward calls and nothing else (for ncu)")
    ARGS = ap.parse_args()
    if ARGS.no_fla:
        HAVE_FLA = False
    if ARGS.tune:
        picked = dict(item.split("=", 1) for item in ARGS.tune.split(","))
        for table in (TUNE_FWD, TUNE_BWD):
            for name in list(table):
                if name in picked:
                    table[name] = picked[name].split("/")
                else:
                    del table[name]
    if ARGS.calls:
        H, T, gate, n = ARGS.calls.split(":")
        q, k, v, f, beta, A_log, dtb = inputs(1, int(T), int(H), 128, 128, torch.bfloat16, seed=7)
        with torch.no_grad():
            for _ in range(int(n)):
                chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=-5.0 if gate == "k3" else None)
        torch.cuda.synchronize()
        sys.exit(0)
    if ARGS.warmup:  # populate the Triton cache (H is a runtime argument: H=16 compiles the H=32/96 binaries)
        lb = -5.0 if ARGS.warmup == "k3" else None
        for cu in (None, torch.tensor([0, 70, 200], device="cuda", dtype=torch.int32)):
            q, k, v, f, beta, A_log, dtb = inputs(1, 200, 16, 128, 128, torch.bfloat16)
            xs = [x.clone().requires_grad_() for x in (q, k, v, f)]
            o, _ = chunk_kda(*xs, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, cu_seqlens=cu)
            o.sum().backward()
            with torch.no_grad():
                chunk_kda(q, k, v, f, beta, A_log=A_log, dt_bias=dtb, lower_bound=lb, cu_seqlens=cu)
        torch.cuda.synchronize()
        sys.exit(0)
    import triton
    RES.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               git_commit=os.environ.get("GIT_COMMIT") or subprocess.run(
                   ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
               fla=("0.6.0" if HAVE_FLA else ("off (--no-fla)" if ARGS.no_fla else f"missing: {FLA_ERR}")))
    secs = ARGS.sections.split(",")
    if "ceil" in secs:
        section("ceilings", ceilings, ARGS.out)
    if "check" in secs:
        section("check", check, ARGS.out)
    if "tune" in secs:
        section("tune", tune, ARGS.out)
    if "prof" in secs:
        section("kernel_profile", kernel_profile, ARGS.out)
    if "decode" in secs:
        section("decode", decode, ARGS.out)
    if "time" in secs:
        section("timings", timings, ARGS.out)
    section("plot", lambda: plot(ARGS.out), ARGS.out)
    print(json.dumps(RES.get("errors", {}), indent=1)[:3000])
