"""Released sizes on one GPU, weights drawn at random directly on the device (the checkpoints are larger than the
GPU machine's disk): Kimi-Linear-48B-A3B ours against native Transformers (fla's KDA), a K3 slice at the released
widths with per-layer times and a projection to the full 93 layers on 16 GPUs, and expert offloading on that slice;
on the CPU, the host memory of `from_pretrained` on a many-shard MXFP4 folder of that slice.

    python bench/released.py --stages kimi_linear --parts check,prefill,decode --out bench/results/released_h200.json
    python bench/released.py --stages kimi_linear --parts longest --impls native --out ...
    python bench/released.py --stages kimi_linear --parts longest --impls ours --longest 131072,262144,524288 --out ...
    python bench/released.py --stages kimi_linear --parts longest --impls ours --longest 1048576 --out ...
    python bench/released.py --stages k3_slice --out ...
    python bench/released.py --stages offload --out ...
    python bench/released.py --tiny                    # the three GPU stages at toy widths on the CPU, ~30 s
    python bench/released.py --stages memory --experts 64 --layers 3 --shard-gb 2 --work /tmp/rss_work \
        --out bench/results/released_cpu.json           # CPU, ~2 min: 11.4 GB on disk, 12 GB of RAM

Stages (`--stages`, comma-separated; each row is written to `--out` as soon as it is measured, one more run beside
the file's earlier ones; `--deadline-minutes` stops starting measurements before one device call's 10 minutes):

  kimi_linear  `KimiLinearConfig()` (the released 48B-A3B: 27 layers, 256 experts top-8), bf16. Native is built on
               the device first and measured; its tensors then become ours' (`state_dict_for_model`, views of the
               same memory, the fp32 modules cast up as `from_pretrained` keeps them), so both run the same weights
               and one model is on the device at a time. `--parts`: check (ours' last logits against native's on one
               prompt), prefill (one pass at `--prefill` lengths: tokens/s, peak memory), decode (greedy after a
               `--prompt`-token prompt at `--batches`: native on its own cache, ours on the static cache with CUDA
               graphs; tokens compared), longest (the longest prompt each prefills: native in one pass, ours in
               `--chunk`-token pieces; ascending `--longest`, stopping at the first out-of-memory, skipping a length
               whose time, extrapolated quadratically from the last, would pass the deadline). A `goals` row sets
               decode B=1 against 8x native, prefill at the first length against 1.5x, and the largest `--longest`.
  k3_slice     the K3 text model at the released widths (hidden 7168, layer 0 dense, 96-head KDA and MLA, 896
               packed MXFP4 experts top-16 in the 3584 latent, 2 shared experts, AttnRes) with `--layers` layers
               (default: as many as the free device memory holds): per layer (and its attention, feed-forward and
               routed experts) the device time of a `--slice-prefill`-token prefill and of a decode step at each
               `--slice-batches` after a `--prompt`-token prompt, and its weight and activation memory; the whole
               slice's prefill and CUDA-graph decode step. Then `projection`: the full model's tokens/s on `--gpus`
               GPUs, as arithmetic with its inputs, for the `device_map` placement `plan_device_map` gives and for
               expert parallel (its assumptions are fields of the row).
  offload      decode tokens/s of a K3 slice (`--offload-layers`, default what host memory holds pinned) with all
               experts on the device (CUDA-graph and eager steps), then with `--host-fractions` of each layer's
               routed experts kept only on the host (`offload_experts`, an LRU cache of the rest on the device), the
               greedy tokens compared with all-on-device's.
  memory       (only when named: a CPU run that needs ~12 GB of RAM and 11.4 GB of disk at its defaults) the peak
               host memory of `Kimi3ForCausalLM.from_pretrained` on a many-shard MXFP4 folder: the K3 slice with
               `--experts` routed experts (default 64; the release has 896, 15.7 GB per layer) and `--layers` layers
               (default 3: layer 0 dense, the last one MLA, the others KDA), written shard by shard (`--shard-gb`
               GB each) under `--work` in the official layout (per-expert `weight_packed` / `weight_scale`, the
               compressed-tensors `quantization_config`), then loaded in a fresh interpreter for each of `--dtypes`
               (`default`: no dtype, as users call it; `bfloat16`) after the folder's files were read once (`load_s`
               is a load from the page cache). The goal: the load's peak resident memory above the interpreter's
               (torch, Transformers and this package imported) is at most the loaded model plus 1.2 x the largest
               shard. Resident memory counts the pages of the memory-mapped safetensors files that the process has
               touched (`RssFile`) as well as its own allocations (`RssAnon`); both are sampled from
               /proc/self/status every 10 ms and reported at the sampled peak, beside the kernel's exact peak
               (`VmHWM`) and `ru_maxrss`. The folder is removed afterwards unless `--keep`; an existing one of the
               same shape is reused. With `--tiny`, toy widths (the test's scale).

A failing or out-of-memory measurement is a row (`{"oom": true}` / `{"error": ...}`) and the run goes on. On the CPU
(`--tiny`, fp32) native runs its PyTorch fallback, the offload copies are plain, and device times are wall times.
"""

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

import torch

START = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import e2e  # noqa: E402  (native_class, chunked_prefill, decode_ms_per_step, fla_usable, kernel_status)
from _timing import Results, rel  # noqa: E402

GIB, GB = 2**30, 10**9
TINY_K3_EXPERTS = 20  # 25 / 50 / 90 % of 20 experts are whole numbers
# the K3 slice's toy widths (`--tiny`): every K3 mechanism, sizes that build and load in a second
TINY_K3 = dict(hidden_size=256, vocab_size=4096, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512, moe_intermediate_size=256,
               routed_expert_hidden_size=256, num_shared_experts=1, num_experts_per_token=2, head_dim=64, heads=4)
# k3_slice and offload run it with narrower experts (the CPU path decodes every MXFP4 expert at each call); the memory
# stage keeps TINY_K3's, where the packed experts are most of the bytes as in the release
TINY_K3_RUN = dict(TINY_K3, moe_intermediate_size=64, routed_expert_hidden_size=64)
SCALE_BYTES = (119, 122)  # E8M0 exponents of the random scales: 2^-8 .. 2^-6 (finite; 0xFF would be NaN)
SPIN_CYCLES = 20_000_000  # ~10 ms of GPU spin before each timed module (ModuleTimer)


# ------------------------------------------------------------------------------------------------ helpers


class Clock:
    """The time left before `--deadline-minutes` (counted from the interpreter's start)."""

    def __init__(self, minutes, start=START):
        self.start, self.deadline = start, start + minutes * 60

    def left(self):
        return self.deadline - time.time()

    def allows(self, seconds=0.0):
        return self.left() > seconds


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def free_bytes(device):
    """Free device memory, or the host's MemAvailable on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available()


def proc_bytes(path, keys):
    """{key: bytes} of the `key: N kB` lines of a /proc file (/proc/meminfo, /proc/self/status)."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) * 1024
    return out


def host_available():
    return proc_bytes("/proc/meminfo", ("MemAvailable",)).get("MemAvailable", 0)


def measured(res, row, fn, device):
    """`fn()` -> fields of `row`; an out-of-memory adds `oom: True`, another failure `error`; the run goes on."""
    try:
        fields = fn()
    except torch.OutOfMemoryError:
        fields = {"oom": True}
    except Exception as e:  # noqa: BLE001 - one failing measurement must not end the run
        import traceback

        traceback.print_exc()
        fields = {"error": f"{type(e).__name__}: {e}"[:500]}
    e2e.free(device)
    res.add(**row, **fields)
    return fields


def once_s(fn, device):
    """Seconds of one `fn()` between two synchronisations."""
    e2e.sync(device)
    t = time.perf_counter()
    fn()
    e2e.sync(device)
    return time.perf_counter() - t


def timed_s(fn, device, long_s=20.0):
    """Seconds of `fn()`: the faster of two passes after a first one, or the first alone where it took more than
    `long_s` (a 128K-token prefill of the 48B model: the time limit has no room for three). Returns (s, passes)."""
    first = once_s(fn, device)
    if first > long_s:
        return first, 1
    return min(once_s(fn, device), once_s(fn, device)), 2


@contextlib.contextmanager
def default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_on_device(make, device, dtype, seed=0):
    """`make()` constructed on `device` with its floating-point tensors created in `dtype` (no float32 copy first:
    the 48B model is 98 GB in bf16) and drawn there by the model's own seeded initialisation. Returns (model, s)."""
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.device(device), default_dtype(dtype):
        model = make().eval()
    e2e.sync(device)
    return model, time.perf_counter() - t


def keep_fp32(model):
    """The tensors the model keeps in float32 (`_keep_in_fp32_modules_strict`) cast up, as `from_pretrained` loads
    them."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.dtype != torch.float32 and not keep.isdisjoint(name.split(".")):
            t.data = t.data.float()
    return model


def weight_bytes(module):
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def ids_for(vocab, shape, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(3, vocab, shape, device=device, generator=gen)


def ints(text):
    return [int(x) for x in text.split(",") if x]


# ------------------------------------------------------------------------------------------------ kimi_linear


def kimi_linear_config(tiny):
    """`KimiLinearConfig()` (the released 48B-A3B), or e2e's toy config."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(**(dict(e2e.TINY_CONFIG, pad_token_id=0, bos_token_id=1, eos_token_id=2) if tiny else {}))


def build_native(tiny, device, dtype):
    config = kimi_linear_config(tiny)
    return build_on_device(lambda: e2e.native_class(device)(config), device, dtype)


def build_ours(tiny, device, dtype):
    """Ours with weights of its own, where native cannot be built."""
    from transformers_kimi3 import Kimi3ForCausalLM, Kimi3TextConfig

    config = Kimi3TextConfig(**kimi_linear_config(tiny).to_dict())
    model, s = build_on_device(lambda: Kimi3ForCausalLM(config), device, dtype)
    return keep_fp32(model), s


def native_to_ours(native_holder):
    """Ours on the native model's tensors: built on the meta device, then given native's state dict in our layout
    (`state_dict_for_model`: views; the split expert halves made contiguous one tensor at a time, so at most one
    layer's experts are copied at once), the fp32 modules cast up. `native_holder` is a list holding the native model,
    emptied here so that its memory becomes ours'."""
    from transformers_kimi3 import Kimi3ForCausalLM, Kimi3TextConfig
    from transformers_kimi3.checkpoint import state_dict_for_model

    native = native_holder.pop()
    config = Kimi3TextConfig(**native.config.to_dict())
    with torch.device("meta"):
        ours = Kimi3ForCausalLM(config)
    state = native.state_dict()
    del native
    converted = state_dict_for_model(ours, state)
    state.clear()
    for name in list(converted):
        converted[name] = converted[name].contiguous()
    ours.load_state_dict(converted, assign=True)
    del converted
    return keep_fp32(ours).eval()


def prefill_once(model, ids, chunk=None):
    """One prefill: a pass without a cache (last logits only), or `chunk`-token pieces through the cache."""
    with torch.no_grad():
        if chunk is None:
            return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
        return e2e.chunked_prefill(model, ids, chunk)


def kl_check(res, name, model, device, prompt, reference):
    """Last 64 positions' logits of one prompt; against `reference` (native's) for ours."""
    ids = ids_for(model.config.vocab_size, (1, prompt), device, seed=1)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=64).logits.float().cpu()
    if reference is not None:
        res.add(stage="kimi_linear", part="check", impl=name, T=prompt, logits_rel_err_vs_native=rel(logits, reference),
                argmax_agree=float((logits.argmax(-1) == reference.argmax(-1)).float().mean()))
    return logits


def kl_prefill(res, name, model, device, lengths, clock):
    """One pass per length (last logits only): tokens/s and peak memory. A length whose time, extrapolated
    quadratically from the last one measured (three passes), would pass the deadline is skipped."""
    last = None
    for T in lengths:
        row = dict(stage="kimi_linear", part="prefill", impl=name, T=T)
        if last is not None and not clock.allows(3 * last[1] * (T / last[0]) ** 2):
            res.add(**row, skipped="deadline")
            continue
        reset_peak(device)

        def run():
            ids = ids_for(model.config.vocab_size, (1, T), device, seed=T)
            s, passes = timed_s(lambda: prefill_once(model, ids), device)
            return dict(ms=s * 1e3, tok_s=T / s, passes=passes, peak_gib=peak_gib(device))

        fields = measured(res, row, run, device)
        if "ms" in fields:
            last = (T, fields["ms"] / 1e3)


def kl_decode(res, name, model, device, batches, prompt, new_tokens, clock, tokens_of):
    """Greedy tokens/s of the new tokens (e2e.decode_ms_per_step); ours on the static cache. `tokens_of`: batch ->
    native's tokens, filled by native's rows and compared in ours'."""
    extra = {} if name == "native" else {"cache_implementation": "static"}
    for B in batches:
        row = dict(stage="kimi_linear", part="decode", impl=name, batch=B, prompt=prompt, new_tokens=new_tokens,
                   cache="native default" if name == "native" else "static (CUDA graphs on the GPU)")
        if not clock.allows(30):
            res.add(**row, skipped="deadline")
            continue
        reset_peak(device)

        def run():
            ids = ids_for(model.config.vocab_size, (B, prompt), device, seed=100 + B)
            ms, tokens = e2e.decode_ms_per_step(model, ids, new_tokens, device, **extra)
            out = dict(ms_per_step=ms, tok_s=B / ms * 1e3, peak_gib=peak_gib(device))
            if name == "native":
                tokens_of[B] = tokens.cpu()
            elif B in tokens_of:
                out.update(compare_tokens(model, ids, tokens, tokens_of[B], "native"))
            return out

        measured(res, row, run, device)
        if hasattr(model, "release_static_caches"):
            model.release_static_caches()


def compare_tokens(model, ids, tokens, reference, name):
    """The share of greedy tokens equal to `reference`'s and, where they part, e2e.first_difference: the step and
    how far apart the two tokens' logits are there (a gap far below the logits' spread is a near-tie that bf16
    rounding decides, not a defect)."""
    reference = reference.to(tokens.device)
    out = {f"tokens_equal_{name}": float((tokens == reference).float().mean())}
    if not torch.equal(tokens, reference):
        out[f"first_difference_vs_{name}"] = e2e.first_difference(model, ids, tokens, reference)
    return out


def kl_longest(res, name, model, device, lengths, chunk, clock):
    """The longest prompt: ascending lengths until one does not fit (native in one pass, ours in `chunk`-token
    pieces). A length whose time, extrapolated quadratically from the last, would pass the deadline is skipped.
    Ends with a `longest_fit` row."""
    chunk = None if name == "native" else chunk
    fit, failed, last = None, None, None
    for T in lengths:
        row = dict(stage="kimi_linear", part="longest", impl=name, T=T, chunk=chunk)
        estimate = None if last is None else last[1] * (T / last[0]) ** 2
        if estimate is not None and not clock.allows(estimate):
            res.add(**row, skipped="deadline", estimated_s=estimate)
            failed = {"T": T, "why": "deadline"}
            break
        reset_peak(device)

        def run():
            ids = ids_for(model.config.vocab_size, (1, T), device, seed=T)
            s = once_s(lambda: prefill_once(model, ids, chunk), device)
            return dict(s=s, tok_s=T / s, peak_gib=peak_gib(device))

        fields = measured(res, row, run, device)
        if "s" not in fields:
            failed = {"T": T, "why": "out of memory" if fields.get("oom") else fields.get("error")}
            break
        fit, last = T, (T, fields["s"])
    res.add(stage="kimi_linear", part="longest_fit", impl=name, chunk=chunk, longest_T=fit,
            first_failed_T=failed and failed["T"], failed_because=failed and failed["why"])


def kl_goals(res, prefill_T, batch, longest_goal):
    """The issue's goals, from this run's rows: decode B=1 >= 8x native, prefill at 8K >= 1.5x, the largest
    `--longest` prompt prefilled by ours. None where this run did not measure both sides."""
    rows = [r for r in res.rows if r.get("stage") == "kimi_linear"]

    def tok_s(part, impl, **key):
        for r in rows:
            if r["part"] == part and r["impl"] == impl and all(r.get(k) == v for k, v in key.items()):
                return r.get("tok_s")
        return None

    def ratio(part, **key):
        a, b = tok_s(part, "ours", **key), tok_s(part, "native", **key)
        return a / b if a and b else None

    fits = [r for r in rows if r["part"] == "longest_fit" and r["impl"] == "ours"]
    longest = fits[-1]["longest_T"] if fits else None
    dec, pre = ratio("decode", batch=batch), ratio("prefill", T=prefill_T)
    res.add(stage="kimi_linear", part="goals", decode_batch=batch, decode_ratio=dec, decode_goal=8.0,
            decode_met=None if dec is None else dec >= 8.0, prefill_T=prefill_T, prefill_ratio=pre, prefill_goal=1.5,
            prefill_met=None if pre is None else pre >= 1.5, longest_goal_T=longest_goal, ours_longest_T=longest,
            longest_met=None if not fits else (longest or 0) >= longest_goal)


def stage_kimi_linear(res, args, device, dtype, clock):
    parts, impls = args.parts.split(","), args.impls.split(",")
    lengths, batches, longest = ints(args.prefill), ints(args.batches), ints(args.longest)
    holder, reference, tokens_of = [], None, {}
    try:
        native, build_s = build_native(args.tiny, device, dtype)
    except Exception as e:  # noqa: BLE001 - native cannot be built here: recorded, ours is built on its own
        res.add(stage="kimi_linear", part="build", impl="native", error=f"{type(e).__name__}: {e}"[:500])
    else:
        res.add(stage="kimi_linear", part="build", impl="native", s=build_s, weight_gib=weight_bytes(native) / GIB,
                params_b=sum(p.numel() for p in native.parameters()) / 1e9, layers=native.config.num_hidden_layers,
                experts=native.config.num_experts, kda="fla" if e2e.fla_usable(device) else "PyTorch fallback")
        if "native" in impls:
            reference = run_parts(res, "native", native, device, args, parts, clock, None, tokens_of)
        elif "check" in parts:
            reference = kl_check(res, "native", native, device, args.check_prompt, None)
        holder.append(native)
        del native
    t, shared = time.perf_counter(), bool(holder)
    ours = native_to_ours(holder) if shared else build_ours(args.tiny, device, dtype)[0]
    e2e.free(device)
    res.add(stage="kimi_linear", part="build", impl="ours", s=time.perf_counter() - t, from_native_tensors=shared,
            weight_gib=weight_bytes(ours) / GIB, kernel_status=e2e.kernel_status(device))
    if "ours" in impls:
        run_parts(res, "ours", ours, device, args, parts, clock, reference, tokens_of)
    del ours
    e2e.free(device)
    kl_goals(res, lengths[0] if lengths else None, batches[0] if batches else None, max(longest) if longest else None)


def run_parts(res, name, model, device, args, parts, clock, reference, tokens_of):
    logits = None
    if "check" in parts:
        logits = kl_check(res, name, model, device, args.check_prompt, reference)
    if "prefill" in parts:
        kl_prefill(res, name, model, device, ints(args.prefill), clock)
    if "decode" in parts:
        kl_decode(res, name, model, device, ints(args.batches), args.prompt, args.new_tokens, clock, tokens_of)
    if "longest" in parts:
        kl_longest(res, name, model, device, ints(args.longest), args.chunk, clock)
    return logits


# ------------------------------------------------------------------------------------------------ the K3 slice

KINDS = ("dense", "kda_moe", "mla_moe")


def layer_kind(config, i):
    """dense (layer 0: KDA with the dense MLP), kda_moe or mla_moe."""
    if config.mlp_layer_types[i] == "dense":
        return "dense"
    return "kda_moe" if config.layer_types[i] == "linear_attention" else "mla_moe"


def conversion_importable():
    """slice_config takes the release's MXFP4 settings from kimi3_conversion, which an installed package provides but
    `PYTHONPATH=src:kernels` (how a GPU machine without the package runs the tree) does not: there the folder
    conversion/ is registered under that name."""
    if importlib.util.find_spec("kimi3_conversion") is None:
        folder = os.path.join(ROOT, "conversion")
        spec = importlib.util.spec_from_file_location("kimi3_conversion", os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
        sys.modules["kimi3_conversion"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["kimi3_conversion"])


def slice_config(layers, tiny, experts=None, toy=TINY_K3_RUN):
    """The K3 text config at the released widths (hidden 7168, 96 KDA / MLA heads, latent MoE 3584 with expert width
    3072, top-16, vocabulary 163840), or at `toy`'s with `tiny`, with `experts` routed experts (default 896, or
    TINY_K3_EXPERTS with `tiny`) and `layers` layers: layer 0 dense, layers 0 .. layers-2 KDA, the last one MLA; the
    routed experts MXFP4, described as the release describes them. Every stage's K3 slice is this config."""
    conversion_importable()
    from kimi3_conversion.quantize_job import MXFP4_QUANTIZATION_CONFIG
    from transformers_kimi3 import Kimi3TextConfig

    if layers < 2:
        raise SystemExit("--layers must be at least 2 (the dense layer 0 and one MoE layer)")
    sizes = dict(toy) if tiny else {}
    heads, head_dim = sizes.pop("heads", 96), sizes.pop("head_dim", 128)
    config = Kimi3TextConfig.k3(
        num_hidden_layers=layers, num_experts=experts or (TINY_K3_EXPERTS if tiny else 896), **sizes,
        linear_attn_config=dict(num_heads=heads, head_dim=head_dim, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=list(range(1, layers)), full_attn_layers=[layers]),
        quantization_config=copy.deepcopy(MXFP4_QUANTIZATION_CONFIG))
    config.architectures = ["Kimi3ForCausalLM"]
    return config


def slice_sizes(tiny):
    """Bytes, from the meta model of a 3-layer slice: `fixed` (embeddings, head, norms and the dense layer 0),
    `layer` (the larger MoE layer) and `experts` (one MoE layer's routed experts)."""
    from transformers_kimi3.placement import meta_model, tensor_bytes

    sizes = tensor_bytes(meta_model(slice_config(3, tiny)))
    per, routed = {}, 0
    for name, b in sizes.items():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "fixed"
        per[key] = per.get(key, 0) + b
        routed += b if name.startswith("model.layers.1.") and ".experts." in name else 0
    return dict(fixed=per["fixed"] + per["model.layers.0"],
                layer=max(per["model.layers.1"], per["model.layers.2"]), experts=routed)


def slice_layers(args, device):
    """`--layers`, else as many as the free memory holds after `--reserve-gib` (at least 3: one of each kind)."""
    if args.layers:
        return args.layers, None
    if args.tiny:
        return 4, None
    sizes = slice_sizes(False)
    room = free_bytes(device) - args.reserve_gib * GIB - sizes["fixed"]
    return max(3, 1 + int(room // sizes["layer"])), free_bytes(device) / GIB


def build_slice(layers, tiny, device, dtype):
    """The K3 slice (slice_config: layer 0 dense, KDA layers, the last one MLA) built on the device, its
    packed experts random (codes uniform, E8M0 scales 2^-8..2^-6, as e2e.build_k3 draws them)."""
    from transformers_kimi3 import Kimi3ForCausalLM

    config = slice_config(layers, tiny)
    model, s = build_on_device(lambda: Kimi3ForCausalLM(config), device, dtype)
    keep_fp32(model)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, buf in model.named_buffers():
        if buf.dtype == torch.uint8:
            buf.random_(*((0, 256) if "packed" in name else SCALE_BYTES), generator=gen)
    return model, s


class ModuleTimer:
    """The time of each call of some modules, through forward hooks (the modules must not nest). On CUDA a GPU spin
    (`torch.cuda._sleep`) is queued before each module's start event, so that the host has queued the whole module
    before the GPU reaches it: the events then time the GPU's work without the host's launch gaps (what a
    CUDA-graph replay of the step costs). `host_ms` is the host's time between the hooks (the eager launch cost);
    on CUDA, `act_gib` is the module's peak allocation above what was allocated at its start. On the CPU the time is
    the wall time."""

    def __init__(self, modules, device):
        self.modules, self.device, self.calls, self.open = modules, device, {n: [] for n in modules}, None

    def __enter__(self):
        self.handles = []
        for name, m in self.modules.items():
            self.handles.append(m.register_forward_pre_hook(lambda mod, args: self._pre()))
            self.handles.append(m.register_forward_hook(lambda mod, args, out, name=name: self._post(name)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _pre(self):
        start = base = None
        if self.device.type == "cuda":
            torch.cuda._sleep(SPIN_CYCLES)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        self.open = (start, base, time.perf_counter())

    def _post(self, name):
        start, base, t0 = self.open
        call = dict(host_ms=(time.perf_counter() - t0) * 1e3, events=None, act_gib=None)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            call.update(events=(start, end), act_gib=(torch.cuda.max_memory_allocated(self.device) - base) / GIB)
        self.calls[name].append(call)

    def result(self):
        """{name: {"ms": median device ms, "host_ms": median host ms, "act_gib": the largest peak}}."""
        e2e.sync(self.device)

        def median(xs):
            return sorted(xs)[len(xs) // 2]

        out = {}
        for name, calls in self.calls.items():
            ms = [c["host_ms"] if c["events"] is None else c["events"][0].elapsed_time(c["events"][1]) for c in calls]
            acts = [c["act_gib"] for c in calls if c["act_gib"] is not None]
            out[name] = dict(ms=median(ms), host_ms=median([c["host_ms"] for c in calls]),
                             act_gib=max(acts) if acts else None)
        return out


def spin_ms(device):
    """How long ModuleTimer's spin holds the GPU (None on the CPU): a module's device time is free of launch gaps
    where its `host_ms` stays below this."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SPIN_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def timer_groups(model):
    """Three passes of modules that do not nest: the decoder layers; their attention and feed-forward blocks;
    their routed experts."""
    layers, blocks, routed = {}, {}, {}
    for i, layer in enumerate(model.model.layers):
        layers[f"{i}"] = layer
        blocks[f"{i}.attn"] = layer.self_attn
        moe = getattr(layer, "block_sparse_moe", None)
        blocks[f"{i}.ffn"] = moe if moe is not None else layer.mlp
        if moe is not None:
            routed[f"{i}.routed"] = moe.experts
    return [layers, blocks, routed]


def per_layer(model, device, step, calls):
    """{layer: {ms, attn_ms, ffn_ms, routed_ms, host_ms, act_gib}} from `calls` calls of `step()` per pass."""
    times = {}
    for group in timer_groups(model):
        with ModuleTimer(group, device) as timer:
            for _ in range(calls):
                step()
        times.update(timer.result())
    out = {}
    for i in range(len(model.model.layers)):
        t = times[f"{i}"]
        out[i] = dict(ms=t["ms"], host_ms=t["host_ms"], act_gib=t["act_gib"], attn_ms=times[f"{i}.attn"]["ms"],
                      ffn_ms=times[f"{i}.ffn"]["ms"], routed_ms=times.get(f"{i}.routed", {}).get("ms", 0.0))
    return out


def slice_prefill(model, device, T):
    """The whole slice's prefill of T tokens (ms without hooks, peak GiB), then each layer's."""
    ids = ids_for(model.config.vocab_size, (1, T), device, seed=7)
    step = (lambda: prefill_once(model, ids))
    reset_peak(device)
    s, _ = timed_s(step, device)
    return s * 1e3, peak_gib(device), per_layer(model, device, step, calls=1)


def slice_decode(model, device, B, prompt, new_tokens, steps):
    """A decode step at batch B after a `prompt`-token prompt: the whole step replayed as a CUDA graph (static cache,
    e2e.decode_ms_per_step; ms, peak GiB), then each layer's time over `steps` eager steps of a cache holding the
    prompt."""
    ids = ids_for(model.config.vocab_size, (B, prompt), device, seed=B)
    reset_peak(device)
    step_ms, _ = e2e.decode_ms_per_step(model, ids, new_tokens, device, cache_implementation="static")
    peak = peak_gib(device)
    model.release_static_caches()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits.argmax(-1)
        step = (lambda: model(input_ids=tok, past_key_values=cache, use_cache=True))
        step()
        return step_ms, peak, per_layer(model, device, step, calls=steps)


def stage_k3_slice(res, args, device, dtype, clock):
    layers, free_gib = slice_layers(args, device)
    model, build_s = build_slice(layers, args.tiny, device, dtype)
    config = model.config
    kinds = [layer_kind(config, i) for i in range(layers)]
    res.add(stage="k3_slice", part="build", layers=layers, kinds=kinds, experts=config.num_experts,
            experts_per_token=config.num_experts_per_token, hidden=config.hidden_size, s=build_s,
            free_gib_before=free_gib, weight_gib=weight_bytes(model) / GIB, peak_gib=peak_gib(device),
            spin_ms=spin_ms(device))
    rows = [dict(stage="k3_slice", part="layer", layer=i, kind=kinds[i], prefill=None, decode={},
                 weight_gib=weight_bytes(model.model.layers[i]) / GIB) for i in range(layers)]
    totals = {}  # regime -> (tokens, the whole slice's ms)
    T = args.slice_prefill

    def prefill():
        ms, peak, per = slice_prefill(model, device, T)
        totals["prefill"] = (T, ms)
        for i, t in per.items():
            rows[i]["prefill"] = dict(t, T=T)
        return dict(ms=ms, tok_s=T / ms * 1e3, peak_gib=peak)

    def decode(B):
        ms, peak, per = slice_decode(model, device, B, args.prompt, args.slice_new_tokens, args.steps)
        totals[f"decode_b{B}"] = (B, ms)
        for i, t in per.items():
            rows[i]["decode"][str(B)] = t
        return dict(graph_step_ms=ms, tok_s=B / ms * 1e3, peak_gib=peak)

    with torch.no_grad():
        measured(res, dict(stage="k3_slice", part="prefill", T=T), prefill, device)
        for B in ints(args.slice_batches):
            row = dict(stage="k3_slice", part="decode", batch=B, prompt=args.prompt)
            if clock.allows(30):
                measured(res, row, lambda: decode(B), device)
            else:
                res.add(**row, skipped="deadline")
    for row in rows:
        res.add(**row)
    model = None  # the slice's memory freed before the projection
    e2e.free(device)
    e2e.guarded(res, "k3_slice", lambda: res.add(stage="k3_slice", part="projection",
                                               **projection(rows, totals, args)))


# ------------------------------------------------------------------------------------------------ projection


def kind_inputs(layer_rows, totals):
    """Per regime ("prefill", "decode_b{B}"): the tokens, each kind's mean layer time (and its attention,
    feed-forward, routed-experts parts) and `other_ms`: the whole slice's time less its layers' (embeddings, head,
    final norm and AttnRes mix, launch gaps; 0 if negative)."""
    out = {}
    for regime, (tokens, total_ms) in totals.items():
        times = [(r["kind"], r["prefill"] if regime == "prefill" else r["decode"].get(regime.split("_b")[1]))
                 for r in layer_rows]
        if any(t is None for _, t in times):
            continue
        mean = {}
        for kind in KINDS:
            ts = [t for k, t in times if k == kind]
            mean[kind] = {f: sum(t[f] for t in ts) / len(ts) for f in ("ms", "attn_ms", "ffn_ms", "routed_ms")}
        summed = sum(t["ms"] for _, t in times)
        out[regime] = dict(tokens=tokens, layer_ms={k: v["ms"] for k, v in mean.items()}, parts_ms=mean,
                           slice_ms=total_ms, slice_layers_ms=summed, other_ms=max(total_ms - summed, 0.0))
    return out


def hop_ms(tokens, hidden, cross_node, a):
    """One stage-to-stage transfer of the hidden states (bf16): latency plus bytes over the link."""
    gbs = a.ib_gbs if cross_node else a.nvlink_gbs
    return a.latency_us / 1e3 + tokens * hidden * 2 / (gbs * 1e9) * 1e3


def stages_of(kinds_per_stage, layer_ms, other_ms, extra_ms=None):
    """Each stage's time: its layers' times (plus `extra_ms[kind]` per layer), `other_ms` on the last stage."""
    extra = extra_ms or {}
    out = [sum(n * (layer_ms[k] + extra.get(k, 0.0)) for k, n in kinds.items()) for kinds in kinds_per_stage]
    out[-1] += other_ms
    return out


def pipeline_times(stage, hops, tokens, width, regime, m):
    """Sequential (one stage busy at a time, as `device_map` runs) and pipelined: prefill split into m chunks
    (GPipe: (m + p - 1) chunk-slots of the slowest stage), decode with p micro-batches in flight (each stage busy
    every step: the slowest stage sets the pace). `width`: sequences served side by side per stage (expert
    parallel's data-parallel attention), 1 for `device_map`."""
    p = len(stage)
    sequential = sum(stage) + sum(hops)
    slowest = max(s + (hops[i] if i < len(hops) else 0.0) for i, s in enumerate(stage))
    out = dict(stage_ms=stage, hop_ms=hops, sequential_ms=sequential,
               tok_s_sequential=width * tokens * 1e3 / sequential,
               idle_fraction_sequential=1 - sum(stage) / (p * sequential), slowest_stage_ms=slowest)
    if regime == "prefill":
        total = (m + p - 1) * slowest / m
        out.update(microbatches=m, pipelined_ms=total, tok_s_pipelined=width * tokens * 1e3 / total,
                   bubble_pipelined=(p - 1) / (m + p - 1))
    else:
        out.update(microbatches=p, sequences_in_flight=p * width * tokens,
                   tok_s_pipelined=width * tokens * 1e3 / slowest, bubble_pipelined=0.0)
    return out


def kinds_count(kind_of, layer_ids):
    counts = {k: 0 for k in KINDS}
    for i in layer_ids:
        counts[kind_of[i]] += 1
    return counts


def projection(layer_rows, totals, a):
    """The full K3 (93 layers) on `a.gpus` GPUs from the slice's per-layer times, as arithmetic with its inputs."""
    from transformers_kimi3 import Kimi3TextConfig
    from transformers_kimi3.placement import DEFAULT_RESERVE, RELEASED_MXFP4, parse_size, plan_device_map

    full = Kimi3TextConfig.k3(quantization_config=copy.deepcopy(RELEASED_MXFP4))
    L = full.num_hidden_layers
    kind_of = [layer_kind(full, i) for i in range(L)]
    gpu_b = parse_size(a.gpu_memory, "gpu_memory")
    budget = gpu_b * (1 - DEFAULT_RESERVE)
    inputs = kind_inputs(layer_rows, totals)
    plan = plan_device_map(full, gpus=a.gpus, gpu_memory=gpu_b)
    total_b, expert_b = plan.total_bytes, plan.expert_bytes
    gpu_kinds = [kinds_count(kind_of, plan.layers.get(g, [])) for g in range(a.gpus)]
    hidden, latent, top_k = full.hidden_size, full.routed_expert_hidden_size, full.num_experts_per_token
    node = (lambda gpu: gpu // a.gpus_per_node)

    pipeline = dict(layers_per_gpu=[sum(k.values()) for k in gpu_kinds], kinds_per_gpu=gpu_kinds, regimes={})
    for regime, x in inputs.items():
        stage = stages_of(gpu_kinds, x["layer_ms"], x["other_ms"])
        hops = [hop_ms(x["tokens"], hidden, node(g) != node(g + 1), a) for g in range(a.gpus - 1)]
        pipeline["regimes"][regime] = pipeline_times(stage, hops, x["tokens"], 1, regime, a.microbatches)

    tried, chosen = [], None
    for p in (d for d in range(1, a.gpus + 1) if a.gpus % d == 0):
        per_gpu = (total_b - expert_b) / p + expert_b / a.gpus
        tried.append(dict(stages=p, group=a.gpus // p, per_gpu_bytes=per_gpu, fits=per_gpu <= budget))
        if per_gpu <= budget:
            chosen = tried[-1]
            break
    ep = dict(tried=tried, budget_bytes=budget, regimes={})
    if chosen is not None:
        p, g = chosen["stages"], chosen["group"]
        cut = [round(L * s / p) for s in range(p + 1)]
        stage_kinds = [kinds_count(kind_of, range(cut[s], cut[s + 1])) for s in range(p)]
        a2a_bytes = 2 * top_k * latent * 2 * (g - 1) / g
        link = a.nvlink_gbs if g <= a.gpus_per_node else a.ib_gbs
        ep.update(stages=p, group=g, per_gpu_bytes=chosen["per_gpu_bytes"], kinds_per_stage=stage_kinds,
                  a2a_bytes_per_token_per_moe_layer=a2a_bytes, link_gbs=link)
        for regime, x in inputs.items():
            a2a = 2 * a.latency_us / 1e3 + a2a_bytes * x["tokens"] / (link * 1e9) * 1e3
            stage = stages_of(stage_kinds, x["layer_ms"], x["other_ms"], {"kda_moe": a2a, "mla_moe": a2a})
            hops = [hop_ms(x["tokens"], hidden, node((s + 1) * g - 1) != node((s + 1) * g), a) for s in range(p - 1)]
            ep["regimes"][regime] = dict(a2a_ms_per_moe_layer=a2a,
                                         **pipeline_times(stage, hops, x["tokens"], g, regime, a.microbatches))
    return dict(
        gpus=a.gpus, gpu_memory_bytes=gpu_b, reserve_fraction=DEFAULT_RESERVE, gpus_per_node=a.gpus_per_node,
        nvlink_gbs=a.nvlink_gbs, ib_gbs=a.ib_gbs, latency_us=a.latency_us, hidden=hidden, latent=latent, top_k=top_k,
        layers=L, layer_counts=kinds_count(kind_of, range(L)), weight_bytes=total_b, expert_bytes=expert_b,
        inputs=inputs, pipeline=pipeline, expert_parallel=ep,
        assumptions=[
            "a full-model layer of a kind costs the slice's mean for that kind, at the slice's prompt length and "
            "batch (the MLA layers' cost grows with the context; the slice's is --slice-prefill tokens / --prompt)",
            "other_ms (embeddings, head, final norm) is the slice's whole time less its layers', once per model",
            "device_map: stages run one after another (one GPU busy at a time, Accelerate's hooks); hops move "
            "tokens x hidden bf16 values at latency_us plus the link (ib_gbs between nodes, nvlink_gbs inside)",
            "pipelined: prefill in `microbatches` chunks with the GPipe bubble (p-1)/(m+p-1) and chunk time = "
            "stage time / m (linear in tokens); decode with p micro-batches in flight, paced by the slowest stage",
            "expert parallel: non-expert weights replicated inside each group of `group` GPUs and split over "
            "`stages` pipeline stages, routed experts split over all GPUs; the fewest stages whose weights fit "
            "gpu_memory less reserve_fraction",
            "expert parallel: attention data-parallel (each GPU of a group serves `tokens` of its own), balanced "
            "routing (each GPU computes as many routes as its tokens send, so its routed-expert time is the "
            "slice's at that batch); per MoE layer a dispatch and a combine of top_k latent bf16 vectors per token, "
            "(group-1)/group of them leaving the GPU, at link_gbs plus 2 x latency_us",
        ])


# ------------------------------------------------------------------------------------------------ offload


def offload_layers(args, device):
    """`--offload-layers`, else: the routed experts of as many MoE layers as 60 % of the host's available memory
    holds pinned, within what the device holds."""
    if args.offload_layers:
        return args.offload_layers
    if args.tiny:
        return 3
    sizes = slice_sizes(False)
    host = max(1, int(0.6 * host_available() // sizes["experts"]))
    return max(3, min(1 + host, slice_layers(args, device)[0]))


def set_resident(model, handle, n):
    """Every layer's expert cache rebuilt with n slots (the host copies kept, the old slots freed)."""
    from transformers_kimi3.expert_offload import ExpertCache

    for name, old in list(handle.caches.items()):
        if old.num_slots == n:
            continue
        new = ExpertCache(old.name, old.experts, old.device, n, old.copy_stream)
        model.get_submodule(name).expert_cache = handle.caches[name] = new


def offload_stats(model, ids, new_tokens):
    """Cache traffic of the decode steps alone: one generate of the prompt and one token, then one with
    `new_tokens` more (each after a reset); per MoE layer and step."""
    handle = model.expert_offload
    kw = dict(do_sample=False, pad_token_id=0, cache_implementation="static")
    counts = []
    for n in (1, new_tokens + 1):
        handle.reset_stats()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        stats = handle.stats()
        counts.append({f: sum(s[f] for s in stats) for f in ("hits", "misses", "bytes_copied")})
    per = new_tokens * len(handle.caches)
    return dict(decode_hits_per_layer_step=(counts[1]["hits"] - counts[0]["hits"]) / per,
                decode_misses_per_layer_step=(counts[1]["misses"] - counts[0]["misses"]) / per,
                decode_gib_copied_per_step=(counts[1]["bytes_copied"] - counts[0]["bytes_copied"]) / new_tokens / GIB,
                resident_after_min=min(len(s["resident"]) for s in handle.stats()))


def forced_steps(model, ids, steps, device):
    """Eager decode steps fed random tokens after the prompt (a random-weight model's greedy tokens may repeat and
    route the same experts every step; random inputs route as varied inputs do): ms per step, the steps' logits and,
    with offloaded experts, the steps' cache traffic per MoE layer and step."""
    tokens = ids_for(model.config.vocab_size, (ids.shape[0], steps), device, seed=13)
    handle = getattr(model, "expert_offload", None)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        if handle is not None:
            handle.reset_stats()
        logits = []
        e2e.sync(device)
        t = time.perf_counter()
        for s in range(steps):
            logits.append(model(input_ids=tokens[:, s:s + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        e2e.sync(device)
        ms = (time.perf_counter() - t) / steps * 1e3
    out = dict(forced_ms_per_step=ms, forced_tok_s=ids.shape[0] / ms * 1e3)
    if handle is not None:
        stats, per = handle.stats(), steps * len(handle.caches)
        out.update(forced_misses_per_layer_step=sum(s["misses"] for s in stats) / per,
                   forced_gib_copied_per_step=sum(s["bytes_copied"] for s in stats) / steps / GIB)
    return out, torch.stack(logits).float().cpu()


def stage_offload(res, args, device, dtype, clock):
    from transformers_kimi3 import offload_experts

    layers = offload_layers(args, device)
    model, build_s = build_slice(layers, args.tiny, device, dtype)
    E = model.config.num_experts
    moe_layers = sum(t == "sparse" for t in model.config.mlp_layer_types)
    res.add(stage="offload", part="build", layers=layers, moe_layers=moe_layers, experts=E, s=build_s,
            weight_gib=weight_bytes(model) / GIB, host_available_gib=host_available() / GIB)
    B, new = args.offload_batch, args.offload_new_tokens
    ids = ids_for(model.config.vocab_size, (B, args.prompt), device, seed=11)
    base = dict(stage="offload", part="decode", batch=B, prompt=args.prompt, new_tokens=new, num_experts=E,
                moe_layers=moe_layers)
    reference = {}

    def decode(label):
        """Greedy decode on the static cache, then the forced steps; both compared with all-on-device eager."""
        def run():
            ms, tokens = e2e.decode_ms_per_step(model, ids, new, device, cache_implementation="static")
            out = dict(ms_per_step=ms, tok_s=B / ms * 1e3)
            forced, logits = forced_steps(model, ids, new, device) if label != "all_on_device_graph" else ({}, None)
            out.update(forced)
            if label == "all_on_device_eager":
                reference.update(tokens=tokens.cpu(), logits=logits)
            elif reference:
                out.update(compare_tokens(model, ids, tokens, reference["tokens"], "all_on_device"))
                if logits is not None:
                    out.update(forced_logits_equal_all_on_device=bool(torch.equal(logits, reference["logits"])),
                               forced_logits_rel_err=rel(logits, reference["logits"]))
            return out
        return run

    for graphs in ((False, True) if device.type == "cuda" else (False,)):  # eager first: the reference
        model.decode_cuda_graph = graphs
        label = "all_on_device_graph" if graphs else "all_on_device_eager"
        measured(res, dict(base, config=label, host_fraction=0.0, resident_experts=E), decode(label), device)
        model.release_static_caches()
    fractions = [float(f) for f in args.host_fractions.split(",")]
    handle = offload_experts(model, device, resident_experts=resident_for(E, fractions[0]))
    e2e.free(device)
    for f in fractions:
        n = resident_for(E, f)
        row = dict(base, config=f"host_{round(f * 100)}%", host_fraction_target=f, resident_experts=n,
                   host_fraction=(E - n) / E, experts_on_host_only=E - n, slots_gib=n * moe_layers *
                   next(iter(handle.caches.values())).expert_bytes / GIB)
        if not clock.allows(30):
            res.add(**row, skipped="deadline")
            continue
        set_resident(model, handle, n)
        e2e.free(device)

        def run():
            out = decode(row["config"])()
            out.update(offload_stats(model, ids, new))
            out["device_gib"] = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
            return out

        measured(res, row, run, device)
    model = handle = None
    e2e.free(device)


def resident_for(E, host_fraction):
    """Experts per layer kept on the device for `host_fraction` of them only on the host (at least one)."""
    return min(E, max(1, round(E * (1 - host_fraction))))


# ------------------------------------------------------------------------------------------------ memory


def official_plan(config):
    """[(official name, shape, dtype)] in the model's order: what `save_pretrained` writes, from the meta model.
    Floating-point tensors are stored in bf16 except those the model keeps in fp32 (and `A_log`, stored padded)."""
    from transformers_kimi3.checkpoint import to_official_layout
    from transformers_kimi3.placement import meta_model

    model = meta_model(config)
    fp32 = set(model._keep_in_fp32_modules_strict)
    plan = []
    for name, t in to_official_layout(model.state_dict(), config).items():
        dtype = t.dtype if not t.is_floating_point() else (
            torch.float32 if not fp32.isdisjoint(name.split(".")) else torch.bfloat16)
        plan.append((name, tuple(t.shape), dtype))
    return plan


def random_tensor(name, shape, dtype, config, gen):
    """A tensor the loader accepts: random MXFP4 codes, E8M0 scales in `SCALE_BYTES`, N(0, 0.02) floats; `A_log`
    holds one value per head and zeros in its padded tail (the loader refuses anything else there)."""
    if name.endswith("weight_scale"):
        return torch.empty(shape, dtype=dtype).random_(*SCALE_BYTES, generator=gen)
    if dtype == torch.uint8:
        return torch.empty(shape, dtype=dtype).random_(0, 256, generator=gen)
    if name.endswith("A_log"):
        t = torch.zeros(shape, dtype=dtype)
        t[:config.kda_num_heads].uniform_(-1, 1, generator=gen)
        return t
    return torch.empty(shape, dtype=dtype).normal_(0, 0.02, generator=gen)


def build_folder(config, folder, shard_bytes, seed=0):
    """Write the official-layout folder tensor by tensor, one shard in memory at a time (shards of at most
    `shard_bytes`, or one tensor where a tensor is larger), with `model.safetensors.index.json` and config.json.
    Returns {"tensors", "total_bytes", "shard_bytes": [...]}."""
    from safetensors.torch import save_file

    plan = official_plan(config)
    shards, current, size = [], [], 0
    for name, shape, dtype in plan:
        n = dtype.itemsize * int(torch.Size(shape).numel())
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape, dtype))
        size += n
    shards.append(current)
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, sizes = {}, []
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shape, dtype, config, gen) for name, shape, dtype in shard}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        sizes.append(sum(t.nbytes for t in tensors.values()))
        weight_map.update({name: file for name in tensors})
        del tensors
        gc.collect()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=1)
    config.save_pretrained(folder)
    return {"tensors": len(plan), "total_bytes": sum(sizes), "shard_bytes": sizes}


def proc_status():
    """{field: bytes} of the memory lines of /proc/self/status."""
    return proc_bytes("/proc/self/status", ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"))


class Sampler(threading.Thread):
    """/proc/self/status every `period` seconds: the sample with the largest VmRSS, and the largest RssAnon."""

    def __init__(self, period=0.01):
        super().__init__(daemon=True)
        self.period, self.stop, self.peak, self.anon = period, threading.Event(), proc_status(), 0

    def run(self):
        while not self.stop.is_set():
            s = proc_status()
            if s["VmRSS"] > self.peak["VmRSS"]:
                self.peak = s
            self.anon = max(self.anon, s["RssAnon"])
            self.stop.wait(self.period)


def measure_load(folder, dtype=None):
    """In this interpreter (a fresh one): resident memory before and during `from_pretrained(folder)`, and the bytes
    of the loaded model's parameters and buffers."""
    importlib.import_module("transformers")  # imported before the baseline, as this package is
    from transformers_kimi3 import Kimi3ForCausalLM

    gc.collect()
    before = proc_status()
    sampler = Sampler()
    sampler.start()
    t = time.perf_counter()
    kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    model = Kimi3ForCausalLM.from_pretrained(folder, **kwargs)
    seconds = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    after = proc_status()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    dtypes = {}
    for v in tensors.values():
        dtypes[str(v.dtype)[6:]] = dtypes.get(str(v.dtype)[6:], 0) + v.nbytes
    return {"dtype_arg": dtype, "model_bytes": sum(v.nbytes for v in tensors.values()), "bytes_by_dtype": dtypes,
            "baseline_rss": before["VmRSS"], "peak_rss": after["VmHWM"],
            "baseline": {k: before[k] for k in ("VmRSS", "RssAnon", "RssFile")},
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "sampled_peak": {k: sampler.peak[k] for k in ("VmRSS", "RssAnon", "RssFile")},
            "max_rss_anon": max(sampler.anon, after["RssAnon"]),
            "after_load": {k: after[k] for k in ("VmRSS", "RssAnon", "RssFile")}, "load_s": round(seconds, 2)}


def read_through(folder, chunk=1 << 26):
    """Read every file of `folder` once, so that `load_s` times a load from the page cache (which is no part of a
    process's resident memory until it maps the pages)."""
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(chunk):
                pass


def measure_in_subprocess(folder, dtype=None, timeout=3600):
    """`measure_load` in a fresh interpreter (this file's `--measure`, which returns before anything else is
    imported or measured); the dict it prints."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", folder] + (["--dtype", dtype] if dtype else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def verdict(row, largest_shard, allowance=0):
    """The goal: peak - baseline <= model + 1.2 x the largest shard (+ `allowance`)."""
    bound = row["model_bytes"] + 1.2 * largest_shard + allowance
    return {"load_bytes": row["peak_rss"] - row["baseline_rss"], "bound_bytes": int(bound),
            "within_goal": row["peak_rss"] - row["baseline_rss"] <= bound}


def memory_folder(args, config, layers):
    """The folder of this shape under `--work`: reused where an earlier run left it whole (its `built.json`), else
    written. Returns (folder, what build_folder returned)."""
    shape = f"{'tiny' if args.tiny else 'k3'}-e{args.experts}-l{layers}-s{args.shard_gb:g}"
    folder = os.path.join(args.work, shape)
    stamp = os.path.join(folder, "built.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            return folder, json.load(f)
    shutil.rmtree(folder, ignore_errors=True)
    t = time.perf_counter()
    built = build_folder(config, folder, int(args.shard_gb * GB))
    built["build_s"] = round(time.perf_counter() - t, 1)
    with open(stamp, "w") as f:
        json.dump(built, f)
    return folder, built


def stage_memory(res, args, device, dtype, clock):
    layers = args.layers or 3
    config = slice_config(layers, args.tiny, experts=args.experts, toy=TINY_K3)
    folder, built = memory_folder(args, config, layers)
    largest = max(built["shard_bytes"])
    res.add(stage="memory", part="folder", shards=len(built["shard_bytes"]), folder_bytes=built["total_bytes"],
            largest_shard_bytes=largest, build_s=built.get("build_s"), cpu_cores=os.cpu_count(),
            slice=dict(hidden_size=config.hidden_size, vocab_size=config.vocab_size, layers=layers,
                       dense_layers=config.first_k_dense_replace, kda_layers=layers - 1, mla_layers=1,
                       num_attention_heads=config.num_attention_heads, kda_heads=config.kda_num_heads,
                       routed_experts=args.experts, experts_per_token=config.num_experts_per_token,
                       routed_expert_hidden_size=config.routed_expert_hidden_size,
                       moe_intermediate_size=config.moe_intermediate_size, shared_experts=config.num_shared_experts,
                       intermediate_size=config.intermediate_size))
    try:
        for name in args.dtypes.split(","):
            read_through(folder)
            row = measure_in_subprocess(folder, None if name == "default" else name)
            row.update(verdict(row, largest))
            row["GB"] = {k: round(v / GB, 3) for k, v in (
                ("model", row["model_bytes"]), ("largest_shard", largest), ("baseline", row["baseline_rss"]),
                ("peak", row["peak_rss"]), ("load", row["load_bytes"]), ("bound", row["bound_bytes"]),
                ("peak_anon", row["max_rss_anon"]))}
            res.add(stage="memory", part="load", **row)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ main

STAGES = {"kimi_linear": stage_kimi_linear, "k3_slice": stage_k3_slice, "offload": stage_offload,
          "memory": stage_memory}
# (released sizes on one GPU, toy sizes on the CPU) of the size options
SIZES = dict(prefill=("8192,32768,131072", "64,128"), batches=("1,8,32", "1,2"), prompt=(1024, 32),
             new_tokens=(32, 4), longest=("65536,131072,262144,524288,1048576", "128,256,512"), chunk=(65536, 64),
             check_prompt=(512, 32), slice_prefill=(8192, 32), slice_batches=("1,32", "1,2"),
             slice_new_tokens=(16, 4), steps=(4, 2), offload_new_tokens=(16, 4))


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results JSON; a run is added beside the file's earlier runs")
    ap.add_argument("--label", default=None, help="what ran, stored in the file's meta (default: git describe)")
    ap.add_argument("--stages", default="kimi_linear,k3_slice,offload",
                    help="comma-separated, of kimi_linear, k3_slice, offload and memory (a CPU run needing ~12 GB of "
                         "RAM and 11.4 GB of disk: only when named)")
    ap.add_argument("--tiny", action="store_true", help="toy widths (a CPU smoke run of any stage)")
    ap.add_argument("--deadline-minutes", type=float, default=9.0,
                    help="start no measurement after this many minutes from the interpreter's start")
    ap.add_argument("--parts", default="check,prefill,decode,longest", help="kimi_linear's parts")
    ap.add_argument("--impls", default="native,ours", help="kimi_linear's implementations measured")
    for name, (full, tiny) in SIZES.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(full), default=None,
                        help=f"default {full} ({tiny} with --tiny)")
    ap.add_argument("--layers", type=int, default=None,
                    help="K3 slice layers (default: what the device holds; memory: 3)")
    ap.add_argument("--reserve-gib", type=float, default=16.0, help="device memory left free by the default --layers")
    ap.add_argument("--gpus", type=int, default=16, help="projection: GPUs")
    ap.add_argument("--gpu-memory", default="139GiB", help="projection: memory per GPU (an H200 reports ~139 GiB)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nvlink-gbs", type=float, default=450.0,
                    help="projection: GB/s per GPU and direction inside a node")
    ap.add_argument("--ib-gbs", type=float, default=50.0, help="projection: GB/s per GPU between nodes (400 Gb/s NIC)")
    ap.add_argument("--latency-us", type=float, default=20.0, help="projection: per transfer")
    ap.add_argument("--microbatches", type=int, default=16, help="projection: prefill chunks in a pipelined prefill")
    ap.add_argument("--offload-layers", type=int, default=None, help="default: what host memory holds pinned")
    ap.add_argument("--host-fractions", default="0.25,0.5,0.9")
    ap.add_argument("--offload-batch", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64, help="memory: routed experts per MoE layer")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="memory: the shards' target size in GB")
    ap.add_argument("--work", default="/tmp/rss_work", help="memory: where the folder goes")
    ap.add_argument("--dtypes", default="default,bfloat16",
                    help="memory: comma-separated: default (no dtype), bfloat16, ...")
    ap.add_argument("--keep", action="store_true", help="memory: keep the folder")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # memory's fresh interpreter
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, sizes in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, sizes[1] if args.tiny else sizes[0])
    return args


def main(argv=None):
    args = parse(argv)
    if args.measure:  # the memory stage's fresh interpreter: nothing else imported or measured
        print(json.dumps(measure_load(args.measure, args.dtype)), flush=True)
        return None
    clock = Clock(args.deadline_minutes, START if argv is None else time.time())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        torch.set_num_threads(1)  # toy models run faster on one thread than on two contending ones
    res = Results(args.out, keep_runs=True, tree_label=args.label, stages=args.stages, tiny=args.tiny,
                  dtype=str(dtype).replace("torch.", ""), fla_usable=e2e.fla_usable(device), args=vars(args))
    for name in args.stages.split(","):
        if not clock.allows():
            res.add(stage=name, skipped="deadline")
            continue
        e2e.guarded(res, name, STAGES[name], res, args, device, dtype, clock)
        e2e.free(device)
    skipped = sum("skipped" in r for r in res.rows)
    res.add(stage="run", wall_s=time.time() - clock.start, left_s=clock.left(), skipped_rows=skipped,
            stopped_by_deadline=skipped > 0 and clock.left() < 30)
    return res


if __name__ == "__main__":
    main()
