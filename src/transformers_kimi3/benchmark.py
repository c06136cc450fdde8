"""End-to-end prefill / decode benchmark: our Kimi3ForCausalLM vs Transformers' native KimiLinearForCausalLM on
the same weights (the 4.3B Kimi Linear config of ../shared/anchors), checked equal in the same run.

    python bench/e2e.py --out bench/results/e2e_h200.json [--stages check,prefill,decode] [--budget-s 240]
    python -m transformers_kimi3 bench       # a small version on whatever device is present, printed as a table

Each stage appends its rows to the JSON as soon as it finishes, so a run cut short keeps what it measured.
`python -m transformers_kimi3 bench` runs a tiny version of the same on whatever device is present.
"""

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

BENCH_CONFIG = dict(hidden_size=2304, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32,
                    num_local_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, intermediate_size=9216,
                    vocab_size=163840, linear_num_heads=32, linear_head_dim=128)
TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
                   num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                   vocab_size=512, linear_num_heads=2, linear_head_dim=32, kv_lora_rank=32, qk_rope_head_dim=16,
                   qk_nope_head_dim=32, v_head_dim=32)


# K3-shaped (issue 7): the released layer widths (hidden 7168, 96 KDA heads, MLA, SiTU LatentMoE in the 3584
# latent, 2 shared experts, AttnRes) with 8 layers in the KDA x3 + MLA pattern and 64 routed experts (top-16) kept
# as MXFP4, so it fits one GPU; the official remote code was measured on the same shape (../shared/anchors).
K3_BENCH_CONFIG = dict(num_hidden_layers=8, num_experts=64, attn_res_block_size=4,
                       linear_attn_config=dict(num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                               gate_lower_bound=-5.0, use_full_rank_gate=True,
                                               full_attn_layers=[4, 8], kda_layers=[1, 2, 3, 5, 6, 7]))
K3_TINY_CONFIG = dict(K3_BENCH_CONFIG, hidden_size=64, vocab_size=512, num_attention_heads=2, q_lora_rank=32,
                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, intermediate_size=96,
                      moe_intermediate_size=64, routed_expert_hidden_size=32, num_experts=8,
                      num_experts_per_token=2,
                      linear_attn_config=dict(K3_BENCH_CONFIG["linear_attn_config"], num_heads=2, head_dim=32))
# what Moonshot's remote code (with fla) reached on the K3-shaped config on an H200 (issue 7 / ../shared/anchors)
K3_OFFICIAL_ANCHOR = {"prefill_tok_s": {2048: 9500, 8192: 17900}, "decode_tok_s_b1": 12.3}


def build_k3(config_kwargs, device, dtype):
    """Our model at the K3-shaped config with random weights and random MXFP4 experts (packed bytes uniform,
    E8M0 scales 2^-8..2^-6): weights do not change the speed, and no 22B-parameter bf16 copy is ever built."""
    from .configuration_kimi3 import Kimi3TextConfig
    from .modeling_kimi3 import Kimi3ForCausalLM
    from .mxfp4 import PackedMXFP4Experts

    cfg = Kimi3TextConfig.k3(quantization_config={"quant_method": "compressed-tensors",
                                                  "format": "mxfp4-pack-quantized"}, **config_kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = Kimi3ForCausalLM(cfg).to(dtype).eval()
    for mod in model.modules():
        if isinstance(mod, PackedMXFP4Experts):
            for name, buf in mod.named_buffers(recurse=False):
                buf.random_(0, 256) if name.endswith("_packed") else buf.random_(119, 122)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps=3):
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def guarded(res, stage, fn, *args):
    """A failing stage is recorded, not fatal: the other rows of the run still count."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        impl = args[1] if len(args) > 1 and isinstance(args[1], str) else "-"
        res.add(stage=stage, impl=impl, error=f"{type(e).__name__}: {e}"[:500])


def median_time(fn, device, reps=3):
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


class Results:
    def __init__(self, path, device):
        self.path, self.rows = path, []
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        self.meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     # a copied work tree may carry a stale .git: an explicit GIT_COMMIT wins
                     "commit": os.environ.get("GIT_COMMIT") or commit or "unknown",
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "torch": torch.__version__}
        import transformers
        self.meta["transformers"] = transformers.__version__

    def add(self, **row):
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            json.dump({"meta": self.meta, "rows": self.rows}, open(self.path, "w"), indent=1)


def native_classes(device):
    """Transformers' native Kimi Linear. On CPU it must not bind fla's GPU-only kernels, so fla is hidden while
    its module is imported."""
    import importlib

    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if device.type != "cpu" or name in sys.modules:
        mod = importlib.import_module(name)
    else:
        saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
        for k in saved:
            del sys.modules[k]
        sys.modules["fla"] = None
        try:
            mod = importlib.import_module(name)
        finally:
            del sys.modules["fla"]
            sys.modules.update(saved)
    from transformers import KimiLinearConfig

    return KimiLinearConfig, mod.KimiLinearForCausalLM


def build_pair(config_kwargs, device, dtype):
    """The native model (random init, seed 0) and ours loaded from its save_pretrained folder."""
    KimiLinearConfig, KimiLinearForCausalLM = native_classes(device)

    from transformers_kimi3 import Kimi3ForCausalLM

    torch.manual_seed(0)
    cfg = KimiLinearConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **config_kwargs)
    with torch.device(device):
        native = KimiLinearForCausalLM(cfg).to(dtype).eval()
    folder = tempfile.mkdtemp(prefix="kimi3_bench_")
    native.save_pretrained(folder)
    ours = Kimi3ForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device.type if device.type != "cpu"
                                            else None).eval()
    return native, ours.to(device)


def stage_check(res, native, ours, device, T):
    ids = torch.randint(3, native.config.vocab_size, (1, T), device=device)
    with torch.no_grad():
        a = native(input_ids=ids, use_cache=False).logits.float()
        b = ours(input_ids=ids, use_cache=False).logits.float()
        g_eager = ours.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0)
        g_static = ours.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0,
                                 cache_implementation="static")
        g_native = native.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0)
        g_static = ours.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0,
                                 cache_implementation="static")  # graph-replayed decode, fused kernels
    from transformers_kimi3 import kernel_status
    res.add(stage="check", T=T, logits_rel_err_vs_native=float((a - b).abs().max() / a.abs().max()),
            argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            static_graph_tokens_equal_eager=bool(torch.equal(g_eager, g_static)),
            tokens_equal_native=float((g_eager == g_native).float().mean()), kernel_status=kernel_status(device))


@contextlib.contextmanager
def _env(name, value):
    """Set an environment variable for the block (None: leave it as it is), then restore it."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _prefill_models(native, ours, device):
    models = {k: v for k, v in (("native", native), ("ours", ours)) if v is not None}
    from .kda import kernel_status
    available = kernel_status(device)["available"]
    if available["fla"] and available["triton"]:
        models["ours_fla_chunk"] = (ours, "fla_chunk")  # fla's chunked kernels inside our model
    return models


def stage_prefill(res, models, device, lengths, deadline):
    """`models`: name -> model, or name -> (model, KDA backend to force through KIMI3_KDA_BACKEND)."""
    for T in lengths:
        for name, m in models.items():
            m, backend = m if isinstance(m, tuple) else (m, None)
            if time.time() > deadline:
                return
            ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                with torch.no_grad(), _env("KIMI3_KDA_BACKEND", backend or None):
                    s = timed(lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1), device, reps=2)
            except torch.OutOfMemoryError:
                res.add(stage="prefill", impl=name, T=T, error="out of memory")
                continue
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            res.add(stage="prefill", impl=name, T=T, ms=s * 1e3, tok_s=T / s, peak_gib=peak)


def stage_decode(res, models, device, batches, prompt, new_tokens, deadline):
    for B in batches:
        ids = torch.randint(3, models[0][1].config.vocab_size, (B, prompt), device=device)
        first = {}  # tokens of the rows so far: each row says which fraction of its tokens equals theirs
        for name, m, extra in models:
            if time.time() > deadline:
                return
            guarded(res, "decode", _decode_one, res, name, m, extra, ids, B, prompt, new_tokens, device, first)


def _decode_one(res, name, m, extra, ids, B, prompt, new_tokens, device, earlier):
    """generate(new + 1) minus generate(1): the decode steps as a user of generate() sees them."""
    def run(n):
        return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)

    with torch.no_grad():
        run(4)
        t_all = median_time(lambda: run(new_tokens + 1), device)
        t_pre = median_time(lambda: run(1), device)
        tokens = run(new_tokens + 1)[:, ids.shape[1]:]
    rate = B * new_tokens / max(t_all - t_pre, 1e-9)
    check = {f"tokens_equal_to_{n}": float((tokens == t).float().mean()) for n, t in earlier.items()}
    for n, t in earlier.items():
        if not torch.equal(tokens, t):
            check[f"first_difference_vs_{n}"] = _first_difference(m, ids, tokens, t)
    earlier[name] = tokens
    res.add(stage="decode", impl=name, batch=B, prompt=prompt, tok_s=rate,
            ms_per_step=(t_all - t_pre) / new_tokens * 1e3, **check)


def _first_difference(m, ids, a, b):
    """Where two greedy continuations part: the step, and how far apart the two chosen tokens' logits are there
    (one uncached forward over the shared prefix). A gap far below the logits' spread is a near-tie that rounding
    decides, not a defect of either path."""
    row = int((a != b).any(1).nonzero()[0])
    step = int((a[row] != b[row]).nonzero()[0])
    with torch.no_grad():
        prefix = torch.cat([ids[row:row + 1], a[row:row + 1, :step]], 1)
        lg = m(input_ids=prefix, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    return dict(row=row, step=step, logit_gap=float((lg[a[row, step]] - lg[b[row, step]]).abs()),
                logit_std=float(lg.std()), top1_minus_top2=float(lg.topk(2).values.diff().abs()))


def stage_profile(res, m, device, prompt, steps=8):
    """Where a decode step's time goes (B=1): the replayed CUDA graph alone (no generate() around it), and the
    CUDA kernels of eager steps grouped by name (torch.profiler)."""
    from .cache import Kimi3Cache

    ids = torch.randint(3, m.config.vocab_size, (1, prompt), device=device)
    with torch.no_grad():
        cache = Kimi3Cache(m.config, max_length=prompt + 64)
        tok = m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        m(input_ids=tok, past_key_values=cache)  # captures the graph
        graph_ms = timed(lambda: m(input_ids=tok, past_key_values=cache), device, reps=20) * 1e3
        cache = Kimi3Cache(m.config)
        m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step = lambda: m(input_ids=tok, past_key_values=cache)  # noqa: E731
        step()
        eager_ms = timed(step, device, reps=5) * 1e3
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            sync(device)
    res.add(stage="profile", impl="ours", batch=1, prompt=prompt, graph_step_ms=graph_ms, eager_step_ms=eager_ms,
            **_kernel_table(prof, steps, "step"), **_generate_loop_profile(m, ids, device))


def _kernel_table(prof, calls, per):
    """CUDA kernels of a torch.profiler run grouped by name, per call of what was profiled: count, total, top 25."""
    kernels = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return {f"kernels_per_{per}": sum(v[0] for v in kernels.values()) / calls,
            f"kernel_us_per_{per}": sum(v[1] for v in kernels.values()) / calls,
            "top_kernels": [dict(name=n, calls=c / calls, us=t / calls) for n, (c, t) in top]}


def stage_prefill_profile(res, models, device, T):
    """Where one prefill's GPU time goes, per implementation: kernels grouped by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for name, m in models.items():
        m, backend = m if isinstance(m, tuple) else (m, None)
        ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
        with torch.no_grad(), _env("KIMI3_KDA_BACKEND", backend or None):
            step = lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
            ms = timed(step, device, reps=2) * 1e3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                sync(device)
        res.add(stage="prefill_profile", impl=name, T=T, ms=ms, **_kernel_table(prof, 1, "prefill"))


def _generate_loop_profile(m, ids, device, n=32):
    """What a static-cache generate() step costs beyond its graph replay: the step as the decode rows time it, the
    host (CPU) time per step, and the host ops that take it."""
    from torch.profiler import ProfilerActivity, profile

    def run(k):
        return m.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0,
                          cache_implementation="static")

    with torch.no_grad():
        run(4)
        step_ms = (median_time(lambda: run(n + 1), device) - median_time(lambda: run(1), device)) / n * 1e3
        per_op = {}
        for k, sign in ((n + 1, 1), (1, -1)):  # the decode steps' share: generate(n + 1) minus generate(1)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(k)
                sync(device)
            for e in prof.key_averages():
                c, t = per_op.get(e.key, (0, 0.0))
                per_op[e.key] = (c + sign * e.count, t + sign * e.self_cpu_time_total)
    ops = sorted(per_op.items(), key=lambda kv: -kv[1][1])[:12]
    return dict(generate_step_ms=step_ms, host_ms_per_step=sum(t for _, t in per_op.values()) / n / 1e3,
                generate_host_ops=[dict(name=k[:60], calls=c / n, self_cpu_us_per_step=t / n) for k, (c, t) in ops])


def stage_check_kernels(res, device, dtype, T):
    """Our model with its inference kernels (convs, GLU, router, GEMVs, MoE combine, ...) against itself with
    KIMI3_INFERENCE_KERNELS=0 (the PyTorch paths), same weights: prefill logits and greedy static-cache tokens. fp32
    isolates the kernels' arithmetic; bf16 exercises the paths that only bf16 takes (grouped-GEMM combine)."""
    config = dict(BENCH_CONFIG, num_local_experts=16, vocab_size=32768) if device.type == "cuda" else TINY_CONFIG
    native, ours = build_pair(config, device, dtype)
    del native
    ids = torch.randint(3, ours.config.vocab_size, (1, T), device=device)
    out = {}
    for on in (True, False):
        with torch.no_grad(), _env("KIMI3_INFERENCE_KERNELS", "1" if on else "0"):
            out[on] = (ours(input_ids=ids, use_cache=False).logits.double(),
                       ours.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0,
                                     cache_implementation="static"))
            ours.release_static_caches()  # the next run captures its own graph
    (a, ga), (b, gb) = out[True], out[False]
    row = dict(stage="check_kernels", dtype=str(dtype).replace("torch.", ""), T=T,
               logits_rel_err=float((a - b).abs().max() / b.abs().max()),
               argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
               tokens_equal=float((ga == gb).float().mean()))
    if not torch.equal(ga, gb):
        row["first_difference"] = _first_difference(ours, ids[:, :64], ga[:, 64:], gb[:, 64:])
    res.add(**row)
    del ours
    if device.type == "cuda":
        torch.cuda.empty_cache()


def stage_check_fp32(res, device, T):
    """The same comparison as `check` with both models in fp32: separates implementation differences from bf16
    rounding (on a random model many logits are near-ties)."""
    # the benchmark's layer stack and widths with fewer experts and a smaller vocabulary: quick to build in fp32
    native, ours = build_pair(dict(BENCH_CONFIG, num_local_experts=16, vocab_size=32768), device, torch.float32)
    ids = torch.randint(3, native.config.vocab_size, (1, T), device=device)
    with torch.no_grad():
        a = native(input_ids=ids, use_cache=False).logits.double()
        b = ours(input_ids=ids, use_cache=False).logits.double()
        g_ours = ours.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0)
        g_native = native.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0)
        g_static = ours.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0,
                                 cache_implementation="static")  # graph-replayed decode, fused kernels
    res.add(stage="check_fp32", T=T, logits_rel_err_vs_native=float((a - b).abs().max() / a.abs().max()),
            argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            tokens_equal_native=float((g_ours == g_native).float().mean()),
            static_graph_tokens_equal_eager=bool(torch.equal(g_static, g_ours)))
    del native, ours
    torch.cuda.empty_cache()


@torch.no_grad()
def chunked_prefill(m, ids, chunk):
    """Prefill `ids` `chunk` tokens at a time through one cache (KDA state and MLA latents carried); the last
    position's logits."""
    from .cache import Kimi3Cache

    cache = Kimi3Cache(m.config)
    for s in range(0, ids.shape[1], chunk):
        out = m(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def stage_longest(res, models, device, lengths, chunk, deadline):
    """Largest prompt each model prefills: native in one pass, ours in `chunk`-token pieces through its cache
    (KDA state and MLA latents carried); peak memory and time per length (`chunk_check` compares the logits)."""
    for name, m in models.items():
        for T in lengths:
            if time.time() > deadline:
                return
            ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    if name == "native":
                        m(input_ids=ids, use_cache=False, logits_to_keep=1)
                    else:
                        chunked_prefill(m, ids, chunk)
                sync(device)
            except torch.OutOfMemoryError:
                res.add(stage="longest", impl=name, T=T, chunk=chunk if name != "native" else None,
                        error="out of memory")
                break
            dt = time.perf_counter() - t0
            res.add(stage="longest", impl=name, T=T, chunk=chunk if name != "native" else None, s=dt,
                    tok_s=T / dt, peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def stage_chunk_check(res, m, device, T, chunk):
    ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
    with torch.no_grad():
        one = m(input_ids=ids, use_cache=False).logits[:, -1].double()
    last = chunked_prefill(m, ids, chunk).double()
    res.add(stage="chunk_check", T=T, chunk=chunk, last_logits_rel_err=float((one - last).abs().max() /
                                                                          one.abs().max()),
            argmax_equal=bool(one.argmax() == last.argmax()))


def stage_block_check(res, m, device, T, chunk):
    """Chunked prefill over a long cache: blockwise attention (KEY_BLOCK keys at a time, merged by log-sum-exp)
    against expanding the whole cache at once, same weights and prompt."""
    from .mla import Kimi3MLAAttention

    ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
    last, default = {}, Kimi3MLAAttention.KEY_BLOCK
    try:
        for name, block in (("blockwise", chunk), ("whole", 1 << 40)):
            Kimi3MLAAttention.KEY_BLOCK = block
            last[name] = chunked_prefill(m, ids, chunk).double()
    finally:
        Kimi3MLAAttention.KEY_BLOCK = default
    a, b = last["blockwise"], last["whole"]
    res.add(stage="block_check", T=T, chunk=chunk, key_block=chunk,
            last_logits_rel_err=float((a - b).abs().max() / b.abs().max()), argmax_equal=bool(a.argmax() == b.argmax()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stages", default="check,prefill,decode")
    ap.add_argument("--tiny", action="store_true", help="a toy config (CPU smoke run)")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--prefill", default="2048,8192,32768")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--longest", default="131072,262144,524288,1048576")
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="decode stage: generate(prefill_chunk_size=N) for every implementation (long prompts at B>1)")
    ap.add_argument("--impls", default=None, help="decode rows to run, e.g. ours_static_graph")
    ap.add_argument("--model", default="kimi_linear", choices=["kimi_linear", "k3"],
                    help="kimi_linear: the 4.3B config vs native Transformers; k3: K3-shaped with MXFP4 experts, ours")
    args = ap.parse_args(argv)
    deadline = time.time() + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res = Results(args.out, device)
    if args.model == "k3":  # ours only (no native K3); the official code's figures go into each row
        native, ours = None, build_k3(K3_TINY_CONFIG if args.tiny else K3_BENCH_CONFIG, device, dtype)
        res.meta.update(model="k3-shaped, MXFP4 experts", official_anchor=K3_OFFICIAL_ANCHOR,
                        parameters=sum(p.numel() for p in ours.parameters()),
                        packed_expert_bytes=sum(b.numel() for b in ours.buffers() if b.dtype == torch.uint8))
    else:
        native, ours = build_pair(TINY_CONFIG if args.tiny else BENCH_CONFIG, device, dtype)
    stages = args.stages.split(",")
    if "check" in stages:
        guarded(res, "check", stage_check, res, native, ours, device, 64 if args.tiny else 2048)
    if "prefill" in stages:
        stage_prefill(res, _prefill_models(native, ours, device), device, [int(x) for x in args.prefill.split(",")],
                      deadline)
    if "profile" in stages:
        guarded(res, "profile", stage_profile, res, ours, device, args.prompt)
    if "prefill_profile" in stages:
        guarded(res, "prefill_profile", stage_prefill_profile, res, _prefill_models(native, ours, device), device,
                int(args.prefill.split(",")[0]))
    if "chunk_check" in stages:
        guarded(res, "chunk_check", stage_chunk_check, res, ours, device, 4 * args.chunk // 16, args.chunk // 16)
    if "block_check" in stages:
        guarded(res, "block_check", stage_block_check, res, ours, device, 5 * args.chunk // 2, args.chunk // 2)
    if "longest" in stages:
        guarded(res, "longest", stage_longest, res, {k: v for k, v in (("ours", ours), ("native", native))
                                                     if v is not None}, device,
                [int(x) for x in args.longest.split(",")], args.chunk, deadline)
    if "decode" in stages:
        chunk = {"prefill_chunk_size": args.prefill_chunk} if args.prefill_chunk else {}
        static = {"cache_implementation": "static", **chunk}
        impls = [("native", native, chunk), ("ours", ours, chunk), ("ours_static_graph", ours, static)]
        impls = [i for i in impls if i[1] is not None]
        if args.impls:
            impls = [i for i in impls if i[0] in args.impls.split(",")]
        stage_decode(res, impls,
                     device, [int(x) for x in args.batches.split(",")], args.prompt, args.new_tokens, deadline)
    if "check_fp32" in stages or "check_kernels" in stages:  # last: they free the bf16 pair to build their own
        del native, ours
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "check_fp32" in stages:
        guarded(res, "check_fp32", stage_check_fp32, res, device, 512)
    if "check_kernels" in stages:
        for dtype in (torch.float32, torch.bfloat16):
            guarded(res, "check_kernels", stage_check_kernels, res, device, dtype, 64 if args.tiny else 512)
    return res


def print_table(res):
    print(f"{res.meta['device']} | torch {res.meta['torch']} | transformers {res.meta['transformers']}")
    for r in res.rows:
        if "error" in r:
            print(f"{r['stage']:8s} {r.get('impl', '-'):18s} T={r.get('T')}: {r['error']}")
        elif r["stage"] == "check":
            print(f"check: logits vs native rel err {r['logits_rel_err_vs_native']:.2e}, static graph tokens equal "
                  f"eager: {r['static_graph_tokens_equal_eager']}, KDA backend {r['kernel_status']['kda']['kda_backend']}")
        elif r["stage"] == "prefill":
            print(f"prefill  {r['impl']:18s} T={r['T']:>6d}  {r['tok_s']:>10.0f} tok/s")
        elif r["stage"] == "decode":
            print(f"decode   {r['impl']:18s} B={r['batch']:>3d}  {r['tok_s']:>10.1f} tok/s "
                  f"({r['ms_per_step']:.2f} ms/step)")
        else:
            print(json.dumps(r)[:300])
