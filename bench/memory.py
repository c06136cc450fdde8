"""Peak host memory of `Kimi3ForCausalLM.from_pretrained` on a many-shard MXFP4 folder, on the CPU: a K3 slice at the
released widths (hidden 7168, 96 KDA / MLA heads, latent MoE 3584 with expert width 3072, top-16, vocabulary 163840,
dense layer 0) with fewer routed experts and layers, written shard by shard in the official layout (per-expert
`weight_packed` / `weight_scale`, the compressed-tensors `quantization_config`), then loaded in a fresh interpreter.

    python bench/memory.py --experts 64 --layers 3 --shard-gb 2 --work /tmp/rss_work \
        --out bench/results/memory_cpu.json

The goal: the load's peak resident memory above the interpreter's (torch, Transformers and this package imported)
is at most the loaded model plus 1.2 x the largest shard. Resident memory counts the pages of the memory-mapped
safetensors files that the process has touched (`RssFile`) as well as its own allocations (`RssAnon`); both are
sampled from /proc/self/status every 10 ms and reported at the sampled peak, beside the kernel's exact peak (`VmHWM`)
and `ru_maxrss`. Each of `--dtypes` (`default`: no dtype, as users call it; `bfloat16`) is loaded in its own
interpreter, after the folder's files were read once (`load_s` is a load from the page cache). The folder is removed
afterwards unless `--keep`; an existing one of the same shape is reused.

Options: `--experts` (routed experts per MoE layer; the release has 896, 15.7 GB per layer), `--layers` (layer 0
dense, the last one MLA, the others KDA), `--shard-gb` (the shards' target size in GB), `--work` (where the folder
goes), `--out` (JSON, one more run beside the file's earlier ones), `--tiny` (toy widths: the test's scale). The
defaults (64 experts, 3 layers, 2 GB shards: 11.4 GB) load within a 23 GB host.
"""

import argparse
import copy
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Results  # noqa: E402

GB = 10**9
SCALE_BYTES = (119, 122)  # E8M0 exponents of the random scales: 2^-8 .. 2^-6 (finite; 0xFF would be NaN)
# toy widths (the test's scale): every K3 mechanism, sizes that load in a second
TINY = dict(hidden_size=256, vocab_size=4096, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512, moe_intermediate_size=256,
            routed_expert_hidden_size=256, num_shared_experts=1, num_experts_per_token=2, head_dim=64, heads=4)


def slice_config(experts, layers, tiny=False):
    """The K3 text config at the released widths with `experts` routed experts and `layers` layers: layer 0 dense,
    layers 0 .. layers-2 KDA, the last one MLA; MXFP4 routed experts described as the release describes them."""
    from kimi3_conversion.quantize_job import MXFP4_QUANTIZATION_CONFIG
    from transformers_kimi3 import Kimi3TextConfig

    if layers < 2:
        raise SystemExit("--layers must be at least 2 (the dense layer 0 and one MoE layer)")
    sizes = dict(TINY) if tiny else {}
    heads, head_dim = sizes.pop("heads", 96), sizes.pop("head_dim", 128)
    config = Kimi3TextConfig.k3(
        num_hidden_layers=layers, num_experts=experts, **sizes,
        linear_attn_config=dict(num_heads=heads, head_dim=head_dim, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=list(range(1, layers)), full_attn_layers=[layers]),
        quantization_config=copy.deepcopy(MXFP4_QUANTIZATION_CONFIG))
    config.architectures = ["Kimi3ForCausalLM"]
    return config


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


# ------------------------------------------------------------------------------------------------ measurement
def _status():
    """{field: bytes} of the memory lines of /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """/proc/self/status every `period` seconds: the sample with the largest VmRSS, and the largest RssAnon."""

    def __init__(self, period=0.01):
        super().__init__(daemon=True)
        self.period, self.stop, self.peak, self.anon = period, threading.Event(), _status(), 0

    def run(self):
        while not self.stop.is_set():
            s = _status()
            if s["VmRSS"] > self.peak["VmRSS"]:
                self.peak = s
            self.anon = max(self.anon, s["RssAnon"])
            self.stop.wait(self.period)


def measure(folder, dtype=None):
    """In this interpreter (a fresh one): resident memory before and during `from_pretrained(folder)`, and the bytes
    of the loaded model's parameters and buffers."""
    import transformers  # noqa: F401
    from transformers_kimi3 import Kimi3ForCausalLM

    gc.collect()
    before = _status()
    sampler = Sampler()
    sampler.start()
    t = time.perf_counter()
    kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    model = Kimi3ForCausalLM.from_pretrained(folder, **kwargs)
    seconds = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    after = _status()
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
    """`measure` in a fresh interpreter (this file's `--measure`); the dict it prints."""
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


def _gb(n):
    return round(n / GB, 3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--work", default="/tmp/rss_work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtypes", default="default,bfloat16", help="comma-separated: default (no dtype), bfloat16, ...")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--label", default=None)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.dtype)), flush=True)
        return None

    config = slice_config(args.experts, args.layers, tiny=args.tiny)
    shape = f"{'tiny' if args.tiny else 'k3'}-e{args.experts}-l{args.layers}-s{args.shard_gb:g}"
    folder = os.path.join(args.work, shape)
    stamp = os.path.join(folder, "built.json")
    if os.path.exists(stamp):
        built = json.load(open(stamp))
    else:
        shutil.rmtree(folder, ignore_errors=True)
        t = time.perf_counter()
        built = build_folder(config, folder, int(args.shard_gb * GB))
        built["build_s"] = round(time.perf_counter() - t, 1)
        json.dump(built, open(stamp, "w"))
    largest = max(built["shard_bytes"])
    slice_shape = dict(hidden_size=config.hidden_size, vocab_size=config.vocab_size, layers=args.layers,
                       dense_layers=config.first_k_dense_replace, kda_layers=args.layers - 1, mla_layers=1,
                       num_attention_heads=config.num_attention_heads, kda_heads=config.kda_num_heads,
                       routed_experts=args.experts, experts_per_token=config.num_experts_per_token,
                       routed_expert_hidden_size=config.routed_expert_hidden_size,
                       moe_intermediate_size=config.moe_intermediate_size, shared_experts=config.num_shared_experts,
                       intermediate_size=config.intermediate_size)
    res = Results(args.out, keep_runs=True, tree_label=args.label, device_kind="cpu", slice=slice_shape,
                  shards=len(built["shard_bytes"]), folder_bytes=built["total_bytes"], largest_shard_bytes=largest,
                  cpu_cores=os.cpu_count())
    rows = []
    try:
        for dtype in args.dtypes.split(","):
            read_through(folder)
            row = measure_in_subprocess(folder, None if dtype == "default" else dtype)
            row.update(verdict(row, largest))
            row["GB"] = {k: _gb(v) for k, v in (("model", row["model_bytes"]), ("largest_shard", largest),
                                                ("baseline", row["baseline_rss"]), ("peak", row["peak_rss"]),
                                                ("load", row["load_bytes"]), ("bound", row["bound_bytes"]),
                                                ("peak_anon", row["max_rss_anon"]))}
            res.add(**row)
            rows.append(row)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
