"""End to end on one GPU: our Kimi3ForCausalLM against Transformers' native KimiLinearForCausalLM (which runs fla's
KDA kernels) on the same weights, at the 4.3B Kimi Linear benchmark config; or, with `--model k3`, the K3-shaped
config with packed MXFP4 experts (ours only: Transformers has no native K3).

    python bench/e2e.py --out bench/results/e2e_h100.json                         # check, prefill, decode
    python bench/e2e.py --stages fidelity --out bench/results/e2e_h100.json       # fp32: ours and fla vs the CPU
    python bench/e2e.py --model k3 --stages prefill,decode --impls ours,ours_static_graph
    python bench/e2e.py --tiny --stages check,prefill,decode                       # toy sizes, runs on the CPU
    python bench/e2e.py --model k3 --stages finetune --out bench/results/e2e_h200.json   # LoRA / QAT memory

Stages (`--stages`, comma-separated; each row is written to `--out` as soon as it is measured, as one more run
beside the file's earlier ones):
  check            bf16 logits against native at 2K tokens; static-cache tokens equal the eager ones
  prefill          one forward pass per prompt length (`--prefill`): native, ours, ours with kda_backend="fla_chunk"
  decode           generate() after a `--prompt`-token prompt at each batch (`--batches`): native, ours (dynamic
                   cache), ours with cache_implementation="static" (CUDA-graph replay); tokens/s of the new tokens
  profile          one decode step: graph replay alone, eager, and its kernels by name
  prefill_profile  the kernels of one prefill per implementation, by name
  longest          the longest prompt each prefills: native in one pass, ours in `--chunk`-token pieces
  chunk_check      chunked prefill against one pass (last logits)
  block_check      blockwise MLA over a long cache against the whole cache at once
  check_fp32       the `check` comparison with both models in fp32
  check_kernels    ours with its fused inference kernels against KIMI3_INFERENCE_KERNELS=0, fp32 and bf16
  fidelity         fp32, 5 layers at the 4.3B widths: ours on the GPU (triton and fla KDA) and native (fla) against
                   ours on the CPU, the reference that equals Moonshot's code; each MoE router's top-k is compared
                   too (`route_fields`: tokens routed otherwise, the error before the first reroute)
  finetune         the K3-shaped config (always K3), a few AdamW steps with gradient checkpointing on one fixed batch
                   (`--ft-batch` x `--ft-seq-len`), one model on the device at a time: LoRA on the packed MXFP4
                   experts, LoRA on the same experts dequantised to bf16, QAT of the packed experts' masters; peak
                   memory, step time, trainable parameters, losses, whether the experts moved (`stage_finetune`)
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Results, rel, wall_ms  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The 4.3B Kimi Linear benchmark config: hidden 2304, 8 layers (KDA:MLA 7:1), 64 experts top-8 of width 1024.
BENCH_CONFIG = dict(hidden_size=2304, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32,
                    num_local_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, intermediate_size=9216,
                    vocab_size=163840, linear_num_heads=32, linear_head_dim=128)
TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
                   num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                   vocab_size=512, linear_num_heads=2, linear_head_dim=32, kv_lora_rank=32, qk_rope_head_dim=16,
                   qk_nope_head_dim=32, v_head_dim=32)
# K3-shaped: the released layer widths (hidden 7168, 96 KDA heads, MLA, SiTU latent MoE in the 3584 latent, 2 shared
# experts, AttnRes) with 8 layers as KDA x3 + MLA and 64 routed experts (top-16) kept as MXFP4, so it fits one GPU.
K3_BENCH_CONFIG = dict(num_hidden_layers=8, num_experts=64, attn_res_block_size=4,
                       linear_attn_config=dict(num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                               gate_lower_bound=-5.0, use_full_rank_gate=True,
                                               full_attn_layers=[4, 8], kda_layers=[1, 2, 3, 5, 6, 7]))
K3_TINY_CONFIG = dict(K3_BENCH_CONFIG, hidden_size=64, vocab_size=512, num_attention_heads=2, q_lora_rank=32,
                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, intermediate_size=96,
                      moe_intermediate_size=64, routed_expert_hidden_size=32, num_experts=8,
                      num_experts_per_token=2,
                      linear_attn_config=dict(K3_BENCH_CONFIG["linear_attn_config"], num_heads=2, head_dim=32))
MXFP4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}


# ------------------------------------------------------------------------------------------------ models


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def native_class(device):
    """Transformers' native Kimi Linear. On the CPU it must not bind fla's GPU-only kernels, so fla is hidden while
    its module is imported."""
    import importlib

    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if device.type != "cpu" or name in sys.modules:
        return importlib.import_module(name).KimiLinearForCausalLM
    saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None
    try:
        return importlib.import_module(name).KimiLinearForCausalLM
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


def build_native(config_kwargs, device, dtype):
    """The native model with random weights (seed 0)."""
    from transformers import KimiLinearConfig

    torch.manual_seed(0)
    cfg = KimiLinearConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **config_kwargs)
    with torch.device(device):
        return native_class(device)(cfg).to(dtype).eval()


@contextlib.contextmanager
def native_folder(config_kwargs, device, dtype=torch.bfloat16):
    """A temporary folder holding the native model's `save_pretrained`, removed afterwards; yields (folder, model)."""
    native = build_native(config_kwargs, device, dtype)
    with tempfile.TemporaryDirectory(prefix="kimi3_e2e_") as folder:
        native.save_pretrained(folder)
        yield folder, native


def load_ours(folder, device, dtype, **kwargs):
    from transformers_kimi3 import Kimi3ForCausalLM

    model = Kimi3ForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    return model.to(device)


def build_k3(config_kwargs, device, dtype, **overrides):
    """Ours at the K3-shaped config, random weights and random MXFP4 experts (codes uniform, E8M0 scales 2^-8..2^-6):
    weights do not change the speed, and no bf16 copy of the experts is ever built."""
    from transformers_kimi3 import Kimi3ForCausalLM, Kimi3TextConfig

    cfg = Kimi3TextConfig.k3(quantization_config=MXFP4, **config_kwargs, **overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = Kimi3ForCausalLM(cfg).to(dtype).eval()
    for name, buf in model.named_buffers():
        if buf.dtype == torch.uint8:
            buf.random_(0, 256) if "packed" in name else buf.random_(119, 122)
    return model


def fla_usable(device):
    if device.type != "cuda":
        return False
    try:
        import fla.ops.kda  # noqa: F401
    except Exception:  # noqa: BLE001 - fla raises more than ImportError when triton is missing or broken
        return False
    return True


def kernel_status(device):
    import transformers_kimi3

    return json.loads(json.dumps(transformers_kimi3.kernel_status(device), default=str))


# ------------------------------------------------------------------------------------------------ stages


@contextlib.contextmanager
def record_routes(model):
    """Yields (routes, gaps), one entry per MoE router call in call order (per MoE layer of one forward): the top-k
    expert ids [tokens, k], sorted per token, and per token the gap between the k-th and (k+1)-th selection scores
    (sigmoid + correction bias), both on the CPU. Ours' `Kimi3TopkRouter` and native's `KimiLinearTopkRouter` both
    return (logits, weights, ids) and hold `top_k` and `e_score_correction_bias`."""
    routes, gaps = [], []

    def hook(module, args, out):
        logits, ids = out[0].detach(), out[2].detach()
        routes.append(ids.reshape(-1, ids.shape[-1]).sort(-1).values.cpu())
        choice = logits.float().reshape(-1, logits.shape[-1]).sigmoid() + module.e_score_correction_bias.float()
        top = choice.topk(module.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).cpu())

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    try:
        yield routes, gaps
    finally:
        for h in handles:
            h.remove()


def route_fields(got, ref, got_routes, ref_routes, ref_gaps=None):
    """Logits compared with the routes in view (one sequence). With random weights and 64 experts top-8, a router's
    8th and 9th scores are near ties for a few tokens, and rounding (GPU against CPU) may swap one expert for one
    token: that token's logits change by ~0.1 of max |logit| (forcing one such swap on the CPU gives 0.08-0.17), and
    through attention the later tokens' by ~1e-3, with more swaps downstream. The max-based `rel` then reports that
    token. Fields: `tokens_routed_otherwise` (share of tokens whose expert set differs in any MoE layer),
    `route_pairs_differing` (such token-layer pairs), `logits_rel_err_same_routes` (max-based, over the tokens routed
    alike in every layer: still ~1e-3 after the first swap), `first_rerouted_token` with the reference's k-th minus
    (k+1)-th score gap there (`first_reroute_score_gap`, the earliest layer) and `logits_rel_err_before_first_reroute`
    (max-based over the tokens before it, which no swap can reach: the rounding alone), and per token
    max |diff| / max |ref| over its row: `logits_rel_err_token_median`, `_token_p99`."""
    got = got.detach().double().cpu().reshape(-1, got.shape[-1])
    ref = ref.detach().double().cpu().reshape(-1, ref.shape[-1])
    per_token = (got - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    out = dict(logits_rel_err_token_median=float(per_token.median()),
               logits_rel_err_token_p99=float(per_token.quantile(0.99)))
    if not ref_routes or len(got_routes) != len(ref_routes) or any(
            a.shape != b.shape for a, b in zip(got_routes, ref_routes)):
        out["routes_error"] = f"{len(got_routes)} router calls against {len(ref_routes)} in the reference"
        return out
    differ = torch.stack([(a != b).any(-1) for a, b in zip(got_routes, ref_routes)])  # [layers, tokens]
    rerouted = differ.any(0)
    same = ~rerouted
    out.update(tokens_routed_otherwise=float(rerouted.float().mean()), route_pairs_differing=int(differ.sum()),
               moe_layers=len(ref_routes),
               logits_rel_err_same_routes=rel(got[same], ref[same]) if bool(same.any()) else None)
    if bool(rerouted.any()):
        first = int(rerouted.nonzero()[0])
        layer = int(differ[:, first].nonzero()[0])
        out.update(first_rerouted_token=first, first_reroute_moe_layer=layer,
                   logits_rel_err_before_first_reroute=rel(got[:first], ref[:first]) if first else None)
        if ref_gaps is not None:
            out["first_reroute_score_gap"] = float(ref_gaps[layer][first])
    else:
        out["logits_rel_err_before_first_reroute"] = rel(got, ref)
    if ref_gaps is not None:
        out["ref_min_score_gap"] = float(torch.stack(ref_gaps).min())
    return out


def guarded(res, stage, fn, *args):
    """A failing stage is recorded, not fatal: the other rows of the run still count."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        res.add(stage=stage, error=f"{type(e).__name__}: {e}"[:500])


def stage_check(res, native, ours, device, T):
    ids = torch.randint(3, native.config.vocab_size, (1, T), device=device)
    with torch.no_grad():
        a = native(input_ids=ids, use_cache=False).logits
        b = ours(input_ids=ids, use_cache=False).logits
        kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
        g_eager = ours.generate(ids[:, :64], **kw)
        g_static = ours.generate(ids[:, :64], cache_implementation="static", **kw)
        g_native = native.generate(ids[:, :64], **kw)
    res.add(stage="check", T=T, dtype=str(b.dtype), logits_rel_err_vs_native=rel(b, a),
            argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            static_graph_tokens_equal_eager=bool(torch.equal(g_eager, g_static)),
            tokens_equal_native=float((g_eager == g_native).float().mean()), kernel_status=kernel_status(device))


def stage_prefill(res, models, device, lengths, deadline):
    for T in lengths:
        for name, m in models.items():
            if time.time() > deadline:
                return
            ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                with torch.no_grad():
                    ms = wall_ms(lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1), device, rep=2)
            except torch.OutOfMemoryError:
                res.add(stage="prefill", impl=name, T=T, error="out of memory")
                continue
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            res.add(stage="prefill", impl=name, T=T, ms=ms, tok_s=T / ms * 1e3, peak_gib=peak)


def decode_ms_per_step(m, ids, new_tokens, device, **extra):
    """generate(new + 1) minus generate(1), per new token: the decode steps as a user of generate() sees them."""
    def run(n):
        return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)

    with torch.no_grad():
        run(4)
        full = wall_ms(lambda: run(new_tokens + 1), device, warm=0)
        first = wall_ms(lambda: run(1), device, warm=0)
        tokens = run(new_tokens + 1)[:, ids.shape[1]:]
    return max(full - first, 1e-6) / new_tokens, tokens


def stage_decode(res, impls, device, batches, prompt, new_tokens, deadline):
    """`impls`: (name, model, generate kwargs). Each row says which fraction of its tokens equals the earlier rows'."""
    for B in batches:
        ids = torch.randint(3, impls[0][1].config.vocab_size, (B, prompt), device=device)
        earlier = {}
        for name, m, extra in impls:
            if time.time() > deadline:
                return
            try:
                ms, tokens = decode_ms_per_step(m, ids, new_tokens, device, **extra)
            except Exception as e:  # noqa: BLE001
                res.add(stage="decode", impl=name, batch=B, error=f"{type(e).__name__}: {e}"[:500])
                continue
            check = {f"tokens_equal_to_{n}": float((tokens == t).float().mean()) for n, t in earlier.items()}
            for n, t in earlier.items():
                if not torch.equal(tokens, t):
                    check[f"first_difference_vs_{n}"] = first_difference(m, ids, tokens, t)
            earlier[name] = tokens
            res.add(stage="decode", impl=name, batch=B, prompt=prompt, tok_s=B / ms * 1e3, ms_per_step=ms, **check)


def first_difference(m, ids, a, b):
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


def kernel_table(prof, calls, per):
    """CUDA kernels of a torch.profiler run grouped by name, per call of what was profiled: count, total, top 25."""
    kernels = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return {f"kernels_per_{per}": sum(v[0] for v in kernels.values()) / calls,
            f"kernel_us_per_{per}": sum(v[1] for v in kernels.values()) / calls,
            "top_kernels": [dict(name=n, calls=c / calls, us=t / calls) for n, (c, t) in top]}


def stage_profile(res, m, device, prompt, steps=8):
    """Where a decode step's time goes (B=1): the step replayed through the static cache's graph, eager steps, and
    the CUDA kernels of eager steps by name."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, m.config.vocab_size, (1, prompt), device=device)
    graph_ms, _ = decode_ms_per_step(m, ids, 32, device, cache_implementation="static")
    eager_ms, _ = decode_ms_per_step(m, ids, 16, device)
    with torch.no_grad():
        out = m(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits.argmax(-1)
        m(input_ids=tok, past_key_values=cache)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                m(input_ids=tok, past_key_values=cache)
            sync(device)
    res.add(stage="profile", impl="ours", batch=1, prompt=prompt, static_step_ms=graph_ms, eager_step_ms=eager_ms,
            **kernel_table(prof, steps, "step"))


def stage_prefill_profile(res, models, device, T):
    from torch.profiler import ProfilerActivity, profile

    for name, m in models.items():
        ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
        with torch.no_grad():
            ms = wall_ms(lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1), device, rep=2)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                m(input_ids=ids, use_cache=False, logits_to_keep=1)
                sync(device)
        res.add(stage="prefill_profile", impl=name, T=T, ms=ms, **kernel_table(prof, 1, "prefill"))


@torch.no_grad()
def chunked_prefill(m, ids, chunk):
    """Prefill `ids` `chunk` tokens at a time through one cache (KDA state and MLA latents carried); last logits."""
    cache = None
    for s in range(0, ids.shape[1], chunk):
        out = m(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
    return out.logits[:, -1]


def stage_longest(res, models, device, lengths, chunk, deadline):
    """The largest prompt each model prefills: native in one pass, ours in `chunk`-token pieces through its cache."""
    for name, m in models.items():
        for T in lengths:
            if time.time() > deadline:
                return
            ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
            free(device)
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
                res.add(stage="longest", impl=name, T=T, error="out of memory")
                break
            s = time.perf_counter() - t0
            res.add(stage="longest", impl=name, T=T, chunk=None if name == "native" else chunk, s=s, tok_s=T / s,
                    peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def stage_chunk_check(res, m, device, T, chunk):
    ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
    with torch.no_grad():
        one = m(input_ids=ids, use_cache=False).logits[:, -1]
    last = chunked_prefill(m, ids, chunk)
    res.add(stage="chunk_check", T=T, chunk=chunk, last_logits_rel_err=rel(last, one),
            argmax_equal=bool(one.argmax() == last.argmax()))


def stage_block_check(res, m, device, T, chunk):
    """Chunked prefill over a long cache: blockwise MLA (KEY_BLOCK keys at a time, merged by log-sum-exp) against the
    whole cache at once, same weights and prompt."""
    from transformers_kimi3.mla import Kimi3MLAAttention

    ids = torch.randint(3, m.config.vocab_size, (1, T), device=device)
    last, default = {}, Kimi3MLAAttention.KEY_BLOCK
    try:
        for name, block in (("blockwise", chunk), ("whole", 1 << 40)):
            Kimi3MLAAttention.KEY_BLOCK = block
            last[name] = chunked_prefill(m, ids, chunk)
    finally:
        Kimi3MLAAttention.KEY_BLOCK = default
    res.add(stage="block_check", T=T, chunk=chunk, key_block=chunk,
            last_logits_rel_err=rel(last["blockwise"], last["whole"]),
            argmax_equal=bool(last["blockwise"].argmax() == last["whole"].argmax()))


def stage_check_fp32(res, device, T):
    """`check` with both models in fp32 (the benchmark's widths, 16 experts, a 32K vocabulary: quick to build)."""
    with native_folder(dict(BENCH_CONFIG, num_local_experts=16, vocab_size=32768), device, torch.float32) as (
            folder, native):
        ours = load_ours(folder, device, torch.float32)
        ids = torch.randint(3, native.config.vocab_size, (1, T), device=device)
        kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            with record_routes(native) as (routes_a, gaps_a):
                a = native(input_ids=ids, use_cache=False).logits
            with record_routes(ours) as (routes_b, _):
                b = ours(input_ids=ids, use_cache=False).logits
            g_ours = ours.generate(ids[:, :64], **kw)
            g_native = native.generate(ids[:, :64], **kw)
            g_static = ours.generate(ids[:, :64], cache_implementation="static", **kw)
        res.add(stage="check_fp32", T=T, logits_rel_err_vs_native=rel(b, a),
                argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                tokens_equal_native=float((g_ours == g_native).float().mean()),
                static_graph_tokens_equal_eager=bool(torch.equal(g_static, g_ours)),
                **route_fields(b, a, routes_b, routes_a, gaps_a))
    del native, ours
    free(device)


@contextlib.contextmanager
def env(name, value):
    """Set an environment variable for the block, then restore it (a compared configuration)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def stage_check_kernels(res, device, dtype, T, tiny):
    """Ours with its fused inference kernels against itself with KIMI3_INFERENCE_KERNELS=0 (the PyTorch paths), same
    weights: prefill logits and greedy static-cache tokens. fp32 isolates the kernels' arithmetic."""
    config = TINY_CONFIG if tiny else dict(BENCH_CONFIG, num_local_experts=16, vocab_size=32768)
    with native_folder(config, device, dtype) as (folder, native):
        del native
        ours = load_ours(folder, device, dtype)
    ids = torch.randint(3, ours.config.vocab_size, (1, T), device=device)
    out = {}
    for on in ("1", "0"):
        with torch.no_grad(), env("KIMI3_INFERENCE_KERNELS", on):
            out[on] = (ours(input_ids=ids, use_cache=False).logits,
                       ours.generate(ids[:, :64], max_new_tokens=16, do_sample=False, pad_token_id=0,
                                     cache_implementation="static"))
            ours.release_static_caches()  # the next configuration captures its own graph
    (a, ga), (b, gb) = out["1"], out["0"]
    row = dict(stage="check_kernels", dtype=str(dtype).replace("torch.", ""), T=T, logits_rel_err=rel(a, b),
               argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
               tokens_equal=float((ga == gb).float().mean()))
    if not torch.equal(ga, gb):
        row["first_difference"] = first_difference(ours, ids[:, :64], ga[:, 64:], gb[:, 64:])
    res.add(**row)
    del ours
    free(device)


def stage_fidelity(res, device, T, tiny):
    """fp32 logits of one prompt, 5 layers at the 4.3B widths (weights drawn in bf16, loaded in fp32), against ours
    on the CPU (which equals Moonshot's code to ~5e-6): ours on the GPU with our Triton KDA, ours with
    kda_backend="fla", and the native model (fla's KDA). Every MoE router's top-k is recorded in both runs:
    `route_fields` separates the tokens an expert swap (a near tie that rounding decides) reaches from the rest."""
    config = TINY_CONFIG if tiny else dict(BENCH_CONFIG, num_hidden_layers=5)
    cpu = torch.device("cpu")
    with native_folder(config, device, torch.bfloat16) as (folder, native):
        del native
        free(device)
        ids = torch.randint(3, config["vocab_size"], (1, T))
        ref_model = load_ours(folder, cpu, torch.float32)
        with torch.no_grad(), record_routes(ref_model) as (ref_routes, ref_gaps):
            ref = ref_model(input_ids=ids, use_cache=False).logits
        del ref_model
        gc.collect()
        candidates = (("ours_triton", lambda: load_ours(folder, device, torch.float32, kda_backend="triton")),
                      ("ours_fla", lambda: load_ours(folder, device, torch.float32, kda_backend="fla")),
                      ("native_fla", lambda: native_class(device).from_pretrained(folder, dtype=torch.float32)
                       .eval().to(device)))
        for name, load in candidates:
            try:
                model = load()
                with torch.no_grad(), record_routes(model) as (routes, _):
                    got = model(input_ids=ids.to(device), use_cache=False).logits
                res.add(stage="fidelity", impl=name, T=T, layers=config["num_hidden_layers"],
                        logits_rel_err_vs_cpu=rel(got, ref),
                        argmax_agree=float((got.argmax(-1).cpu() == ref.argmax(-1)).float().mean()),
                        **route_fields(got, ref, routes, ref_routes, ref_gaps))
                del model, got
            except Exception as e:  # noqa: BLE001 - e.g. fla not installed: the other rows still count
                res.add(stage="fidelity", impl=name, error=f"{type(e).__name__}: {e}"[:500])
            free(device)


# ------------------------------------------------------------------------------------------------ finetune

# LoRA targets of the `finetune` stage besides the routed experts: docs/finetuning.md's list (KDA and MLA
# projections, the output / forget / beta gates, the dense and shared-expert MLPs, the latent MoE projections).
FT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
              "g_proj", "f_a_proj", "f_b_proj", "b_proj", "gate_proj", "up_proj", "down_proj",
              "routed_expert_down_proj", "routed_expert_up_proj"]
FT_VARIANTS = {
    "packed_lora": "LoRA r=16 on the packed MXFP4 experts (PackedExpertsLoraLayer, grouped-GEMM path) and FT_MODULES",
    "bf16_lora": "the experts dequantised to bf16 Kimi3Experts; LoRA r=16 on them (PEFT target_parameters) and "
                 "FT_MODULES",
    "packed_qat": "prepare_qat on the packed experts: their masters (w1, w3, w2) trained in full, the rest frozen",
}
FT_RANK, FT_LR = 16, 1e-3


def moe_blocks(model):
    from transformers_kimi3.moe import Kimi3SparseMoeBlock

    return [m for m in model.modules() if isinstance(m, Kimi3SparseMoeBlock)]


def to_float_experts(model, dtype):
    """Every `PackedMXFP4Experts` replaced by the float `Kimi3Experts` holding its exact values in `dtype`, one layer
    at a time (the bf16 experts of a `dequantize=True` load)."""
    from transformers_kimi3.moe import Kimi3Experts

    config = model.config.get_text_config()
    for block in moe_blocks(model):
        packed = block.experts
        with torch.device("meta"):
            plain = Kimi3Experts(config, packed.hidden_size)
        for n, w in zip(("w1", "w3", "w2"), packed.dequantize(dtype)):
            setattr(plain, n, torch.nn.Parameter(w))
        block.experts = plain
    config.checkpoint_quantization_config = None


def ft_prepare(variant, model, dtype):
    """`model` made trainable as `variant` says (FT_VARIANTS), gradient checkpointing on. Returns (the model to
    train, the routed experts' tensors: packed buffers, bf16 weights or QAT masters)."""
    if hasattr(model, "activation_checkpointing_enable"):  # every decoder layer recomputed, non-reentrant
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # Transformers before 5.2x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "packed_qat":
        from transformers_kimi3.qat import prepare_qat, qat_masters

        prepare_qat(model)
        model.requires_grad_(False)
        masters = list(qat_masters(model).values())
        for p in masters:
            p.requires_grad_(True)
        return model, masters
    from peft import LoraConfig, get_peft_model  # optional: without PEFT this variant is an error row

    lora = dict(r=FT_RANK, lora_alpha=2 * FT_RANK)
    if variant == "packed_lora":
        from transformers_kimi3.expert_lora import packed_experts_lora_config

        experts = [t for b in moe_blocks(model) for t in b.experts.buffers()]
        config = packed_experts_lora_config(target_modules=FT_MODULES + ["experts"], **lora)
    else:
        to_float_experts(model, dtype)
        experts = [p for b in moe_blocks(model) for p in (b.experts.w1, b.experts.w3, b.experts.w2)]
        config = LoraConfig(target_modules=FT_MODULES, target_parameters=["experts.w1", "experts.w2", "experts.w3"],
                            **lora)
    return get_peft_model(model, config), experts


def timed_ms(fn, device):
    """fn() and its milliseconds: between two CUDA events on the GPU, wall time on the CPU."""
    if device.type != "cuda":
        t = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    b.record()
    torch.cuda.synchronize()
    return out, a.elapsed_time(b)


def ft_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def ft_steps(model, params, ids, steps, device):
    """A warm-up step and `steps` timed ones of AdamW (no weight decay: only a gradient moves a weight) on the same
    batch. Returns (the loss of every step, warm-up first; the timed steps' milliseconds; optimizer state bytes)."""
    opt = torch.optim.AdamW(params, lr=FT_LR, weight_decay=0.0, fused=device.type == "cuda")
    losses, times = [], []
    for i in range(steps + 1):
        loss, ms = timed_ms(lambda: ft_step(model, opt, ids), device)
        losses.append(loss)
        times += [ms] if i else []
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return losses, times, state


def tensor_gib(model):
    """Parameters and buffers of `model` (each storage once), GiB."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    return sum(tensors.values()) / 2**30


def changed_fraction(tensors, before):
    """The share of the elements of `tensors` that differ from their copies `before` (on the host)."""
    changed = sum(int((t.detach() != b.to(t.device)).sum()) for t, b in zip(tensors, before))
    return changed / max(1, sum(b.numel() for b in before))


def cuda_memory(device, **fields):
    """The peak allocated / reserved memory since the last reset (GiB), or None on the CPU with the reason."""
    if device.type != "cuda":
        return dict({k: None for k in ("peak_allocated_gib", "peak_reserved_gib", *fields)},
                    memory_note="CPU run: no CUDA memory counters (step times are wall time)")
    return dict(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                **{k: v / 2**30 for k, v in fields.items()})


def finetune_variant(row, variant, config, device, dtype, batch, seq_len, steps):
    """One variant on a freshly built model (seed 0: the same weights every time), its fields written into `row`."""
    model = build_k3(config, device, dtype).train()
    ids = torch.randint(3, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    model, experts = ft_prepare(variant, model, dtype)
    before = [t.detach().to("cpu", copy=True) for t in experts]
    params = [p for p in model.parameters() if p.requires_grad]
    row.update(trainable_params=sum(p.numel() for p in params), weight_gib=tensor_gib(model),
               adapter_params=sum(p.numel() for n, p in model.named_parameters() if "lora_" in n and p.requires_grad),
               expert_gib=sum(b.numel() * b.element_size() for b in before) / 2**30)
    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times, state = ft_steps(model, params, ids.to(device), steps, device)
    row.update(cuda_memory(device, allocated_before_steps_gib=allocated), optimizer_state_gib=state / 2**30,
               step_ms_median=sorted(times)[len(times) // 2], step_ms=times, losses=losses, loss_first=losses[0],
               loss_last=losses[-1], experts_changed_fraction=changed_fraction(experts, before))


def stage_finetune(res, device, dtype, tiny, batch, seq_len, steps, deadline):
    """LoRA with packed experts against LoRA with bf16 experts, and QAT (FT_VARIANTS), on the K3-shaped config: peak
    allocated / reserved memory over the training steps (warm-up included: AdamW's states appear there), memory
    before the steps, weight and optimizer-state memory, trainable and adapter parameter counts, the median step
    time (warm-up excluded), the loss of every step and the share of the routed experts' elements that changed.
    One model on the device at a time; a failure, an out-of-memory included, is a row with what was measured
    until then."""
    config = K3_TINY_CONFIG if tiny else K3_BENCH_CONFIG
    for variant, trains in FT_VARIANTS.items():
        row = dict(stage="finetune", variant=variant, trains=trains, config="K3_TINY_CONFIG" if tiny else
                   "K3_BENCH_CONFIG", dtype=str(dtype).replace("torch.", ""), batch=batch, seq_len=seq_len,
                   steps=steps, lr=FT_LR, timer="cuda events" if device.type == "cuda" else "wall")
        if time.time() > deadline:
            res.add(**row, error="not run: --budget-s reached")
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            finetune_variant(row, variant, config, device, dtype, batch, seq_len, steps)
        except Exception as e:  # noqa: BLE001 - an out-of-memory (or PEFT missing) is a row; the next variant runs
            traceback.print_exc()
            kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            row.update(cuda_memory(device), error=f"{kind}: {str(e)[:400]}")
        res.add(**row)
        free(device)


# ------------------------------------------------------------------------------------------------ main


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results JSON; a run is added beside the file's earlier runs (default: printed only)")
    ap.add_argument("--label", default=None, help="what ran, stored in the file's meta (default: git describe)")
    ap.add_argument("--stages", default="check,prefill,decode")
    ap.add_argument("--model", default="kimi_linear", choices=["kimi_linear", "k3"])
    ap.add_argument("--tiny", action="store_true", help="toy sizes (a CPU smoke run)")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting timed rows after this many seconds")
    ap.add_argument("--prefill", default="2048,8192,32768")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--longest", default="131072,262144,524288,1048576")
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="decode: generate(prefill_chunk_size=N) for every implementation (long prompts at B>1)")
    ap.add_argument("--impls", default=None, help="rows to run, e.g. ours,ours_static_graph (default: all)")
    ap.add_argument("--ft-batch", type=int, default=None, help="finetune: rows per step (default 1; --tiny 2)")
    ap.add_argument("--ft-seq-len", type=int, default=None, help="finetune: tokens per row (default 4096; --tiny 32)")
    ap.add_argument("--ft-steps", type=int, default=4, help="finetune: timed steps after the warm-up step")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    deadline = time.time() + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res = Results(args.out, keep_runs=True, tree_label=args.label, model=args.model, tiny=args.tiny)
    stages = args.stages.split(",")
    pick = (lambda name: args.impls is None or name in args.impls.split(","))
    models = {}
    bf16_stages = {"check", "prefill", "decode", "profile", "prefill_profile", "longest", "chunk_check",
                   "block_check"}
    with contextlib.ExitStack() as stack:
        if bf16_stages & set(stages):
            if args.model == "k3":
                config = K3_TINY_CONFIG if args.tiny else K3_BENCH_CONFIG
                models["ours"] = build_k3(config, device, dtype)
                if fla_usable(device) and pick("ours_fla_chunk"):
                    models["ours_fla_chunk"] = build_k3(config, device, dtype, kda_backend="fla_chunk")
            else:
                folder, native = stack.enter_context(
                    native_folder(TINY_CONFIG if args.tiny else BENCH_CONFIG, device, dtype))
                models["native"] = native
                models["ours"] = load_ours(folder, device, dtype)
                if fla_usable(device) and pick("ours_fla_chunk"):
                    models["ours_fla_chunk"] = load_ours(folder, device, dtype, kda_backend="fla_chunk")
        run_bf16_stages(res, args, stages, models, device, deadline, pick)
    models.clear()
    free(device)
    if "check_fp32" in stages:
        guarded(res, "check_fp32", stage_check_fp32, res, device, 64 if args.tiny else 512)
    if "check_kernels" in stages:
        for dt in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
            guarded(res, "check_kernels", stage_check_kernels, res, device, dt, 64 if args.tiny else 512, args.tiny)
    if "fidelity" in stages:
        guarded(res, "fidelity", stage_fidelity, res, device, 64 if args.tiny else 512, args.tiny)
    if "finetune" in stages:
        stage_finetune(res, device, dtype, args.tiny, args.ft_batch or (2 if args.tiny else 1),
                       args.ft_seq_len or (32 if args.tiny else 4096), args.ft_steps, deadline)
    return res


def run_bf16_stages(res, args, stages, models, device, deadline, pick):
    chosen = {k: v for k, v in models.items() if pick(k)}
    ours, native = models.get("ours"), models.get("native")
    if "check" in stages and native is not None:
        guarded(res, "check", stage_check, res, native, ours, device, 64 if args.tiny else 2048)
    if "prefill" in stages:
        stage_prefill(res, chosen, device, [int(x) for x in args.prefill.split(",")], deadline)
    if "decode" in stages:
        chunk = {"prefill_chunk_size": args.prefill_chunk} if args.prefill_chunk else {}
        impls = [("native", native, chunk), ("ours", ours, chunk),
                 ("ours_static_graph", ours, {"cache_implementation": "static", **chunk})]
        impls = [i for i in impls if i[1] is not None and pick(i[0])]
        stage_decode(res, impls, device, [int(x) for x in args.batches.split(",")], args.prompt, args.new_tokens,
                     deadline)
    if "profile" in stages:
        guarded(res, "profile", stage_profile, res, ours, device, args.prompt)
    if "prefill_profile" in stages:
        guarded(res, "prefill_profile", stage_prefill_profile, res, chosen, device, int(args.prefill.split(",")[0]))
    if "longest" in stages:
        longest = {k: chosen[k] for k in ("ours", "native") if k in chosen}
        guarded(res, "longest", stage_longest, res, longest, device, [int(x) for x in args.longest.split(",")],
                args.chunk, deadline)
    if "chunk_check" in stages:
        guarded(res, "chunk_check", stage_chunk_check, res, ours, device, 4 * args.chunk // 16, args.chunk // 16)
    if "block_check" in stages:
        guarded(res, "block_check", stage_block_check, res, ours, device, 5 * args.chunk // 2, args.chunk // 2)


def print_table(res):
    m = res.meta
    print(f"{m['device']} | torch {m['torch']} | transformers {m['transformers']} | {m['tree']}")
    for r in res.rows:
        if "error" in r:
            print(f"{r['stage']:8s} {r.get('impl', r.get('variant', '-')):18s}: {r['error']}")
        elif r["stage"] == "prefill":
            print(f"prefill  {r['impl']:18s} T={r['T']:>7d}  {r['tok_s']:>10.0f} tok/s")
        elif r["stage"] == "decode":
            print(f"decode   {r['impl']:18s} B={r['batch']:>3d}  {r['tok_s']:>10.1f} tok/s ({r['ms_per_step']:.2f} "
                  "ms/step)")
        elif r["stage"] == "fidelity":
            same = r.get("logits_rel_err_same_routes")
            print(f"fidelity {r['impl']:18s} logits vs CPU reference {r['logits_rel_err_vs_cpu']:.1e}; "
                  f"tokens routed otherwise {r.get('tokens_routed_otherwise', float('nan')):.3f}, same routes "
                  f"{float('nan') if same is None else same:.1e}, before the first reroute "
                  f"{r.get('logits_rel_err_before_first_reroute') or float('nan'):.1e}, token median "
                  f"{r.get('logits_rel_err_token_median', float('nan')):.1e}")
        elif r["stage"] == "finetune":
            mem = r["peak_allocated_gib"]
            print(f"finetune {r['variant']:18s} peak {float('nan') if mem is None else mem:6.1f} GiB, step "
                  f"{r['step_ms_median']:9.1f} ms, trainable {r['trainable_params']:,}, loss {r['loss_first']:.3f} "
                  f"-> {r['loss_last']:.3f}, experts changed {r['experts_changed_fraction']:.3f}")
        else:
            print(json.dumps({k: v for k, v in r.items() if k != "kernel_status"}, default=str)[:300])


if __name__ == "__main__":
    print_table(main())
