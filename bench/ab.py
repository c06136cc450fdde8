"""Two source trees timed in one GPU process: the tree before a change ("before") against this one ("after").

    mkdir -p .ab/base && git archive REV src kernels | tar -x -C .ab/base    # here, before the GPU run
    python bench/ab.py --base .ab/base --base-label REV --out bench/results/ab_h100.json    # ~6-8 min on an H100

The before tree's packages (`transformers_kimi3`, `kimi3_kernels`) are imported from BASE/src and BASE/kernels, this
tree's from src/ and kernels/. Each tree keeps its own module objects: sys.modules is swapped to a tree's modules
around every call into it, so imports made inside a call (lazy ones included) resolve to that tree. Every row times
the two trees alternately over `--rounds` rounds on the same inputs and weights, and records the medians, after /
before and whether after is within 3% of before (or faster), with the difference of the two trees' outputs.

Rows (`--rows`; split them over several calls if one call's time limit is short: rows already in `--out` are kept):
  kda_fwd, kda_fwdbwd   chunked KDA at H=96, T=16K, K3's gate, bf16: the forward without autograd (prefill) and
                        forward+backward (training)
  moe_64, moe_1024      the packed MXFP4 experts at K3's shapes (896 experts, top-16, latent 3584, width 3072), 64 and
                        1,024 tokens, the module's forward without autograd
  prefill_8k            the 4.3B Kimi Linear benchmark config (bf16, random weights saved once and loaded by both
                        trees): one 8,192-token forward
  decode_b1             the same models: greedy generate() with cache_implementation="static" after a 1,024-token
                        prompt, B=1, ms per new token (128 new tokens)

`--smoke` runs every row at toy sizes on the CPU (TRITON_INTERPRET=1 for the KDA rows), to check the harness.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _timing import cuda_ms, meta, rel, wall_ms  # noqa: E402
import e2e  # noqa: E402  (its module level imports neither tree)

PACKAGES = ("transformers_kimi3", "kimi3_kernels")
ROWS = ("kda_fwd", "kda_fwdbwd", "moe_64", "moe_1024", "prefill_8k", "decode_b1")
MXFP4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}


def _ours(name):
    return name.partition(".")[0] in PACKAGES


class Tree:
    """One source tree's packages, imported from `root`/src and `root`/kernels and kept apart from the other's."""

    def __init__(self, name, root):
        self.name, self.root = name, os.path.realpath(root)
        self.paths = [os.path.join(self.root, "src"), os.path.join(self.root, "kernels")]
        self.modules = {}
        for p in self.paths:
            if not os.path.isdir(p):
                sys.exit(f"{name} tree: {p} is missing (export it with: git archive REV src kernels | tar -x -C DIR)")

    @contextlib.contextmanager
    def active(self):
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(self.modules)
        sys.path[:0] = self.paths
        importlib.invalidate_caches()
        try:
            yield self
        finally:
            self.modules = {k: v for k, v in sys.modules.items() if _ours(k)}
            for k in self.modules:
                del sys.modules[k]
            for p in self.paths:
                sys.path.remove(p)

    def load(self, name):
        """Module `name` of this tree (call inside `active()`); refuses one imported from anywhere else."""
        mod = importlib.import_module(name)
        if not os.path.realpath(mod.__file__).startswith(self.root + os.sep):
            raise RuntimeError(f"{name} came from {mod.__file__}, not from the {self.name} tree at {self.root}: "
                               "an installed copy shadows it (run without it on sys.path)")
        return mod


# ------------------------------------------------------------------------------------------------ timing


def alternate(trees, fns, time_fn, rounds):
    """Each tree's `fns[name]` timed once per round, the trees in turn; medians per tree."""
    times = {t.name: [] for t in trees}
    for _ in range(rounds):
        for t in trees:
            with t.active():
                times[t.name].append(time_fn(fns[t.name]))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}, times


def record(results, row, medians, times, **extra):
    before, after = medians["before"], medians["after"]
    results["rows"][row] = dict(before_ms=before, after_ms=after, after_over_before=after / before,
                                within_3pct=after <= 1.03 * before, rounds_ms=times, **extra)
    print(row, json.dumps({k: v for k, v in results["rows"][row].items() if k != "rounds_ms"}), flush=True)


# ------------------------------------------------------------------------------------------------ rows


def kda_rows(trees, rows, results, args):
    H, T = (2, 64) if args.smoke else (96, 16384)
    device = args.device
    g = torch.Generator(device=device).manual_seed(7)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    q, k, v, f = (r(1, T, H, 128 if not args.smoke else 32).bfloat16() for _ in range(4))
    beta, A_log, dt_bias = r(1, T, H).bfloat16(), (r(H) * 0.5).float(), (r(H * q.shape[-1]) * 0.3).float()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, f)]
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    chunk = {}
    for t in trees:
        with t.active():
            chunk[t.name] = t.load("kimi3_kernels.kda").chunk_kda

    def fwd(fn):
        with torch.no_grad():
            return fn(q, k, v, f, beta, **kw)[0]

    def fwdbwd(fn):
        for x in leaves:
            x.grad = None
        fn(*leaves, beta, **kw)[0].sum().backward()
        return leaves[0].grad

    timer = timer_for(device, rep=5)
    for row, run in (("kda_fwd", fwd), ("kda_fwdbwd", fwdbwd)):
        if row not in rows:
            continue
        outs = {}
        for t in trees:
            with t.active():
                outs[t.name] = run(chunk[t.name]).float().clone()
        medians, times = alternate(trees, {n: (lambda fn=fn, run=run: run(fn)) for n, fn in chunk.items()}, timer,
                                   args.rounds)
        record(results, row, medians, times, H=H, T=T, gate="k3", output_rel_after_vs_before=rel(
            outs["after"], outs["before"]))


def build_experts(tree, device, smoke):
    """The packed MXFP4 experts of a two-layer K3-format model with K3's expert shapes (the rest of the model tiny),
    random codes and scales 2^-9..2^-6, the same bytes in both trees."""
    tk = tree.load("transformers_kimi3")
    shapes = dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=64, routed_expert_hidden_size=64) \
        if smoke else dict(num_experts=896, num_experts_per_token=16, moe_intermediate_size=3072,
                           routed_expert_hidden_size=3584)
    cfg = tk.Kimi3TextConfig.k3(
        quantization_config=MXFP4, num_hidden_layers=2, hidden_size=64, vocab_size=512, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=0, v_head_dim=16, intermediate_size=96, attn_res_block_size=1, **shapes,
        linear_attn_config=dict(num_heads=2, head_dim=32, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=[1], full_attn_layers=[2]))
    torch.manual_seed(0)
    with torch.device(device):
        model = tk.Kimi3ForCausalLM(cfg).to(torch.bfloat16).eval()
    experts = model.model.layers[1].block_sparse_moe.experts
    del model
    g = torch.Generator(device=device).manual_seed(0)
    for name, buf in sorted(experts.named_buffers()):
        if buf.dtype == torch.uint8:
            low, high = (118, 122) if "scale" in name else (0, 256)
            buf.copy_(torch.randint(low, high, buf.shape, generator=g, device=device, dtype=torch.uint8))
    return experts, cfg.routed_expert_hidden_size, cfg.num_experts, shapes["num_experts_per_token"]


def moe_rows(trees, rows, results, args):
    wanted = [(row, n) for row, n in (("moe_64", 64), ("moe_1024", 1024)) if row in rows]
    if not wanted:
        return
    experts = {}
    for t in trees:
        with t.active():
            experts[t.name], D, E, top_k = build_experts(t, args.device, args.smoke)
    timer = timer_for(args.device, rep=10)
    for row, n in wanted:
        n = min(n, 16) if args.smoke else n
        g = torch.Generator(device=args.device).manual_seed(n)
        x = torch.randn(n, D, device=args.device, generator=g).bfloat16()
        idx = torch.rand(n, E, device=args.device, generator=g).topk(top_k, dim=-1).indices
        w = torch.rand(n, top_k, device=args.device, generator=g)
        w = w / w.sum(-1, keepdim=True)

        def run(mod, x=x, idx=idx, w=w):
            with torch.no_grad():
                return mod(x, idx, w)

        outs = {}
        for t in trees:
            with t.active():
                outs[t.name] = run(experts[t.name]).float()
        medians, times = alternate(trees, {name: (lambda m=m: run(m)) for name, m in experts.items()}, timer,
                                   args.rounds)
        record(results, row, medians, times, tokens=n, experts=E, top_k=top_k,
               output_rel_after_vs_before=rel(outs["after"], outs["before"]))
    experts.clear()
    e2e.free(torch.device(args.device))


def model_rows(trees, rows, results, args):
    wanted = [row for row in ("prefill_8k", "decode_b1") if row in rows]
    if not wanted:
        return
    device = torch.device(args.device)
    config, dtype = (e2e.TINY_CONFIG, torch.float32) if args.smoke else (e2e.BENCH_CONFIG, torch.bfloat16)
    models = {}
    with e2e.native_folder(config, device, dtype) as (folder, native):
        del native
        e2e.free(device)
        for t in trees:
            with t.active():
                tk = t.load("transformers_kimi3")
                models[t.name] = tk.Kimi3ForCausalLM.from_pretrained(folder, dtype=dtype).eval().to(device)
    vocab = config["vocab_size"]
    if "prefill_8k" in wanted:
        T = 64 if args.smoke else 8192
        ids = torch.randint(3, vocab, (1, T), device=device)

        def prefill(m):
            with torch.no_grad():
                return m(input_ids=ids, use_cache=False, logits_to_keep=1).logits

        outs = {}
        for t in trees:
            with t.active():
                outs[t.name] = prefill(models[t.name]).float()
        medians, times = alternate(trees, {n: (lambda m=m: prefill(m)) for n, m in models.items()},
                                   lambda fn: wall_ms(fn, device, warm=1, rep=3), args.rounds)
        record(results, "prefill_8k", medians, times, T=T, tok_s_before=T / medians["before"] * 1e3,
               tok_s_after=T / medians["after"] * 1e3, last_logits_rel_after_vs_before=rel(outs["after"],
                                                                                            outs["before"]))
    if "decode_b1" in wanted:
        prompt, new = (16, 4) if args.smoke else (1024, 128)  # many steps: generate()'s fixed cost and jitter spread thin
        ids = torch.randint(3, vocab, (1, prompt), device=device)
        tokens = {}

        def step_ms(name):
            ms, tokens[name] = e2e.decode_ms_per_step(models[name], ids, new, device, cache_implementation="static")
            return ms

        medians, times = alternate(trees, {n: n for n in models}, step_ms, args.rounds)
        record(results, "decode_b1", medians, times, prompt=prompt, new_tokens=new,
               tok_s_before=1e3 / medians["before"], tok_s_after=1e3 / medians["after"],
               tokens_equal=bool(torch.equal(tokens["before"], tokens["after"])))
    models.clear()
    e2e.free(device)


def timer_for(device, rep):
    if torch.device(device).type == "cuda":
        return lambda fn: cuda_ms(fn, warm=2, rep=rep)
    return lambda fn: wall_ms(fn, device, warm=1, rep=1)


# ------------------------------------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the before tree: a folder with src/ and kernels/")
    ap.add_argument("--new", default=ROOT, help="the after tree (default: this checkout)")
    ap.add_argument("--base-label", default=None, help="what the before tree is, e.g. the exported revision")
    ap.add_argument("--label", default=None, help="what the after tree is (default: git describe)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file; rows already in it are kept unless measured again")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the harness, times nothing")
    args = ap.parse_args()
    rows = args.rows.split(",")
    unknown = set(rows) - set(ROWS)
    if unknown:
        sys.exit(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.device = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("bench/ab.py needs a CUDA GPU (or --smoke)")
    else:
        args.device = "cuda"
    for k in [k for k in sys.modules if _ours(k)]:  # anything imported before the trees would shadow both
        del sys.modules[k]
    trees = [Tree("before", args.base), Tree("after", args.new)]
    results = {"meta": meta(args.label, before=args.base_label or os.path.realpath(args.base), rounds=args.rounds),
               "rows": {}}
    if args.out and os.path.exists(args.out):
        results["rows"] = json.load(open(args.out)).get("rows", {})
    for section in (kda_rows, moe_rows, model_rows):
        section(trees, rows, results, args)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)
    print("row          before ms   after ms   after/before")
    for row, r in results["rows"].items():
        print(f"{row:12s} {r['before_ms']:10.3f} {r['after_ms']:10.3f} {r['after_over_before']:10.3f}"
              f"{'' if r['within_3pct'] else '   SLOWER by more than 3%'}")


if __name__ == "__main__":
    main()
