"""Speculative decoding at batch 1: tokens/s of greedy decoding on the static cache (CUDA-graph decode steps) against
prompt lookup and against assisted decoding with a draft model (both on the static cache, every step shape replayed
as a CUDA graph), on a prompt that is mostly copied and on free generation, with the tokens checked equal; what one
verification costs against the single steps it replaces; and, per KDA layer, the two ways to roll a rejected
candidate back (keep the state after every position, or keep the state before the round and rerun the accepted
positions: what the cache does).

    python bench/speculative.py --out bench/results/speculative_h100.json             # 4.3B config, random weights
    python bench/speculative.py --model FOLDER --draft FOLDER --out ...               # real checkpoints
    python bench/speculative.py --config tiny --out /tmp/spec.json                    # toy sizes, a CPU smoke run

Options: `--model PATH` (a Kimi3 / Kimi Linear checkpoint; default: `--config`, random weights), `--draft PATH`
(default: a random 2-layer model at the target's widths; `none`: no assisted rows), `--config 4.3b|k3|tiny` (the
built-in configs of bench/e2e.py), `--dtype` (bf16 on CUDA, fp32 on the CPU by default), `--out JSON` (rows added as
one more run beside the file's earlier ones; meta: device, commit, date, versions).

Stages (`--stages`, comma-separated):
  rollback  one KDA layer at the model's widths, a round of k + 1 tokens (`--ks`): the verification's recurrence,
            then (a) "keep every state": writing the k + 1 states plus restoring one, a lower bound of that scheme
            (its kernel would write them from inside the recurrence), against (b) "rerun": the base-state copy plus
            the rerun over the kept positions (Kimi3Cache.keep_rows). CUDA: each captured in a CUDA graph.
  verify    after a `--prompt`-token context on the static cache: one speculation round of k + 1 tokens (begin_round,
            the forward, keep_rows keeping all / keeping half: the rerun) against k single decode steps, each the way
            generate() runs it (CUDA: replayed graphs); and keep_rows rejecting half alone, until it returns to the
            host and until the device is done.
  generate  `--new-tokens` greedy tokens after each prompt (`copy`: a passage repeated, or random ids in a repeated
            block; `free`: an open question, or random ids) with static-cache greedy, prompt lookup
            (`--lookup-tokens`) and assisted decoding (`--assistant-tokens` per round): tok/s of the new tokens,
            new tokens per target forward, speed-up over static greedy, and whether the tokens equal static
            greedy's. Any difference makes the script exit with status 1 after writing the results (in bf16 a
            verification of k + 1 tokens can round a near-tie differently from single steps: rerun with
            `--dtype float32` to tell that from a bug).

With random weights the draft agrees with the target about as often as chance and the target copies nothing, so the
rows measure the machinery's overhead; speed-ups need trained checkpoints (`--model`, `--draft`).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Results, graph_ms, wall_ms  # noqa: E402

COPY_TEXT = ("Repeat the following passage word for word.\n\n"
             "The hybrid model keeps two kinds of state: a compressed latent for every attended position and, for "
             "each linear-attention layer, one recurrent matrix that every new token updates. ") * 4
FREE_TEXT = "Tell me about the history of the printing press and how it changed the way ideas spread."


def commit():
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ models


def built_in(name, device, dtype, layers=None, config_only=False):
    """A built-in config (bench/e2e.py) with random weights; `layers`: only that many (KDA then MLA), for a draft;
    `config_only`: its text config, no weights."""
    from e2e import BENCH_CONFIG, K3_BENCH_CONFIG, MXFP4, TINY_CONFIG, build_k3

    from transformers_kimi3 import Kimi3ForCausalLM, Kimi3TextConfig

    if config_only:
        if name == "k3":
            return Kimi3TextConfig.k3(quantization_config=MXFP4, **K3_BENCH_CONFIG)
        return Kimi3TextConfig(**(BENCH_CONFIG if name == "4.3b" else TINY_CONFIG))
    if name == "k3":
        config = dict(K3_BENCH_CONFIG)
        if layers:
            lac = dict(config["linear_attn_config"], kda_layers=list(range(1, layers)), full_attn_layers=[layers])
            config.update(num_hidden_layers=layers, attn_res_block_size=1, linear_attn_config=lac)
        return build_k3(config, device, dtype)
    config = dict(BENCH_CONFIG if name == "4.3b" else TINY_CONFIG)
    if layers:
        config.update(num_hidden_layers=layers, linear_attn_config=dict(
            num_heads=config["linear_num_heads"], head_dim=config["linear_head_dim"], short_conv_kernel_size=4,
            kda_layers=list(range(1, layers)), full_attn_layers=[layers]))
    torch.manual_seed(1 if layers else 0)
    with torch.device(device):
        model = Kimi3ForCausalLM(Kimi3TextConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, **config))
    return model.to(dtype).eval()


def load(folder, device, dtype):
    """A Kimi3 checkpoint folder: the K3 vision-language model through AutoModelForCausalLM (text prompts here), a
    Kimi Linear text model through Kimi3ForCausalLM."""
    import transformers

    import transformers_kimi3

    with open(os.path.join(folder, "config.json")) as f:
        vlm = json.load(f).get("model_type") == "kimi_k3"
    cls = transformers.AutoModelForCausalLM if vlm else transformers_kimi3.Kimi3ForCausalLM
    return cls.from_pretrained(folder, dtype=dtype).to(device).eval()


def text_model(model):
    return getattr(model, "language_model", model)


def prompts(model, tokenizer, length, device, seed=0):
    """{"copy": ids, "free": ids} [1, T]: with a tokenizer, a passage to repeat and an open question (chat template
    when there is one); else random ids, the copy prompt a block repeated up to `length` tokens."""
    if tokenizer is not None:
        def enc(text):
            if getattr(tokenizer, "chat_template", None):
                return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     return_tensors="pt", return_dict=True)["input_ids"].to(device)
            return tokenizer(text, return_tensors="pt").input_ids.to(device)
        return {"copy": enc(COPY_TEXT), "free": enc(FREE_TEXT)}
    vocab = text_model(model).config.vocab_size
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(3, vocab, (1, max(length // 8, 4)), generator=g)
    copy = block.repeat(1, -(-length // block.shape[1]))[:, :length]
    return {"copy": copy.to(device), "free": torch.randint(3, vocab, (1, length), generator=g).to(device)}


# ------------------------------------------------------------------------------------------------ stages


def stage_rollback(res, cfg, device, dtype, ks, timed):
    """Per KDA layer of text config `cfg`: keep every position's state (a lower bound) against keep the base and
    rerun (ours)."""
    from transformers_kimi3 import kernels
    from transformers_kimi3.kda import kda_state_after

    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    backend = kernels.resolve_kda_backend(device, getattr(cfg, "kda_backend", None), announce=False)
    lower = getattr(cfg, "gate_lower_bound", None)
    gate = (torch.zeros(H, device=device), torch.zeros(H * K, device=device), lower, backend)
    g = torch.Generator(device="cpu").manual_seed(0)
    for k in ks:
        T = k + 1
        q, kk, gg = (torch.randn(1, T, H, K, generator=g).to(device, dtype) for _ in range(3))
        v, beta = (torch.randn(1, T, H, K, generator=g).to(device, dtype),
                   torch.randn(1, T, H, generator=g).to(device, dtype))
        live = torch.randn(1, H, K, K, generator=g).to(device) * 0.1
        base, states = live.clone(), torch.empty(T, 1, H, K, K, device=device)
        keep = torch.arange(T, device=device)[None, :] < (T // 2)  # half the round kept
        g_kept = gg.masked_fill(~keep[..., None, None], float("-inf"))
        beta_kept = beta.masked_fill(~keep[..., None], float("-inf"))
        kw = dict(A_log=gate[0], dt_bias=gate[1], lower_bound=lower, use_qk_l2norm_in_kernel=True)

        def verify():  # the layer's recurrence over the round; the cache copies the final state in place
            _, final = kernels.kda_recurrent(q, kk, v, gg, beta, backend, initial_state=live, output_final_state=True,
                                             **kw)
            live.copy_(final)

        def keep_every_state():  # lower bound: the k + 1 states written, one restored
            verify()
            states.copy_(live.expand(T, -1, -1, -1, -1))
            live.copy_(states[T // 2])

        def rerun():  # ours: the base copied at the round's start, the kept positions rerun from it
            base.copy_(live)
            verify()
            kda_state_after(gate, base, kk, v, g_kept, beta_kept, out=live)

        row = dict(stage="rollback", k=k, H=H, K=K, backend=backend, state_mib=H * K * K * 4 / 2 ** 20,
                   unit="ms, one layer, CUDA graph" if device.type == "cuda" else "ms, one layer, eager")
        for name, fn in (("verify_ms", verify), ("keep_every_state_lower_bound_ms", keep_every_state),
                         ("rerun_ms", rerun)):
            row[name] = graph_ms(fn) if device.type == "cuda" else timed(fn)
        row["faster"] = ("rerun" if row["rerun_ms"] < row["keep_every_state_lower_bound_ms"] else
                         "undecided: the lower bound of keeping every state is below the rerun")
        res.add(**row)


def static_runner(model, context_ids, extra):
    """A Kimi3Runner on a fresh static cache holding `context_ids` but its last token (as in generate()'s loop, the
    last token goes in with the next step), `extra` positions to spare."""
    from transformers_kimi3 import Kimi3Cache
    from transformers_kimi3.speculative import Kimi3Runner

    lm = text_model(model)
    cache = Kimi3Cache(lm.config, max_length=context_ids.shape[1] + extra)
    runner = Kimi3Runner(model, cache)
    runner.prefill(context_ids, model.generation_config, {})
    return runner


def host_and_total(fn, reset, device, timed):
    """(median ms until `fn` returns, median ms until the device is done), `reset` untimed before each call."""
    host = []

    def call():
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)

    total = timed(call, reset)
    host = host[1:]  # timed() runs one warm-up call first
    return sorted(host)[len(host) // 2], total


def stage_verify(res, model, device, context, ks, timed):
    """A speculation round of k + 1 tokens against k single decode steps, as generate() runs them."""
    vocab = text_model(model).config.vocab_size
    ids = torch.randint(3, vocab, (1, context + max(ks) + 2), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    with torch.no_grad():
        runner = static_runner(model, ids[:, :context], max(ks) + 8)
        cache = runner.cache
        start = (cache.seen_tokens, cache.source_tokens, cache.snapshot())

        def reset():
            cache.seen_tokens, cache.source_tokens = start[:2]
            cache.restore(start[2])
            cache.valid[:, start[0]:] = False

        for k in ks:
            new = ids[:, context - 1:context + k]

            def round_(kept):
                runner.begin(k + 1)
                runner.forward(new)
                runner.keep([kept])

            def steps():
                for t in range(k):
                    runner.forward(new[:, t:t + 1])

            def after_forward():
                reset()
                runner.begin(k + 1)
                runner.forward(new)

            row = dict(stage="verify", k=k, context=context)
            for name, fn in (("round_keep_all_ms", lambda: round_(k + 1)),
                             ("round_keep_half_ms", lambda: round_(k // 2 + 1)), ("steps_ms", steps)):
                row[name] = timed(fn, reset)
            # the rollback alone (keep_rows rejecting half, after an untimed forward): until it returns to the host
            # and until the device is done; host time near the total means the host's launches are what it costs
            row["keep_half_host_ms"], row["keep_half_ms"] = host_and_total(lambda: runner.keep([k // 2 + 1]),
                                                                           after_forward, device, timed)
            row["round_over_steps"] = row["round_keep_half_ms"] / row["steps_ms"]
            row["round_over_one_step"] = row["round_keep_half_ms"] / (row["steps_ms"] / k)
            res.add(**row)
        runner.finish()


class TargetForwards:
    """Counts the target's forwards inside speculative loops (Kimi3Runner.forward of the target model)."""

    def __init__(self, model):
        from transformers_kimi3 import speculative

        self.n, self.model, self.cls = 0, model, speculative.Kimi3Runner
        self.original = self.cls.forward
        counter = self

        def forward(runner, ids):
            if runner.model is counter.model and runner.layers is None:
                counter.n += 1
            return counter.original(runner, ids)

        self.cls.forward = forward

    def close(self):
        self.cls.forward = self.original


def stage_generate(res, model, draft, tokenizer, device, length, new_tokens, lookup, assistant_tokens, reps,
                   mismatches):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
              pad_token_id=model.generation_config.pad_token_id or 0)
    impls = [("static_greedy", {}), ("prompt_lookup", dict(prompt_lookup_num_tokens=lookup))]
    if draft is not None:
        impls.append(("assisted", dict(assistant_model=draft, num_assistant_tokens=assistant_tokens,
                                       assistant_confidence_threshold=0.0)))  # k drafted tokens every round
    for kind, ids in prompts(model, tokenizer, length, device).items():
        reference, base_tok_s = None, None
        for name, extra in impls:
            with torch.no_grad():
                if device.type == "cuda":  # warm-up: records the graphs, fills the cache pools
                    model.generate(ids, **kw, **extra)
                counter = TargetForwards(model)
                times = []
                for _ in range(reps):
                    counter.n = 0
                    sync(device)
                    t = time.perf_counter()
                    out = model.generate(ids, **kw, **extra)
                    sync(device)
                    times.append(time.perf_counter() - t)
                counter.close()
            seconds = sorted(times)[len(times) // 2]
            new = out[:, ids.shape[1]:]
            reference = new if reference is None else reference
            tok_s = new.shape[1] / seconds
            base_tok_s = tok_s if base_tok_s is None else base_tok_s
            equal = bool(torch.equal(new, reference))
            row = dict(stage="generate", prompt=kind, impl=name, prompt_tokens=ids.shape[1], new_tokens=new.shape[1],
                       tok_s=tok_s, speedup_vs_static_greedy=tok_s / base_tok_s,
                       new_per_target_forward=(new.shape[1] / counter.n if counter.n else 1.0),
                       tokens_equal_static_greedy=equal)
            if not equal:
                mismatches.append(f"{kind}/{name}")
                row.update(first_difference(model, ids, reference, new))
            res.add(**row)


def first_difference(model, ids, reference, new):
    """Where `new` first leaves `reference`, and how far apart the model puts the two tokens there (one forward
    over the shared prefix): a gap far below the logits' spread is a near-tie that rounding decides."""
    t = int((new != reference).nonzero()[0, 1])
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, reference[:, :t]], 1), logits_to_keep=1).logits[0, -1].float()
    a, b = int(reference[0, t]), int(new[0, t])
    return dict(first_difference=t, first_difference_gap=float(logits[a] - logits[b]),
                logit_spread=float(logits.max() - logits.min()))


# ------------------------------------------------------------------------------------------------ main


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results JSON (default: printed only)")
    ap.add_argument("--label", default=None, help="what ran, stored in meta (default: git describe)")
    ap.add_argument("--stages", default="rollback,verify,generate")
    ap.add_argument("--model", default=None, help="target checkpoint folder (default: --config, random weights)")
    ap.add_argument("--draft", default=None, help="draft checkpoint folder; 'none': no assisted rows (default: a "
                                                  "random 2-layer model of --config's widths)")
    ap.add_argument("--config", default="4.3b", choices=("4.3b", "k3", "tiny"),
                    help="built-in config when --model is not given")
    ap.add_argument("--device", default=None, help="default: cuda if available")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--prompt", type=int, default=1024, help="context tokens (verify) / random prompt length")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="4,8", help="candidates per verification (rollback, verify)")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--assistant-tokens", type=int, default=5, help="draft tokens per round")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    ks = [int(k) for k in args.ks.split(",")]
    res = Results(args.out, keep_runs=True, tree_label=args.label, commit=commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  model=args.model or f"{args.config} (random weights)", dtype=str(dtype).replace("torch.", ""),
                  draft=args.draft or (None if args.model else f"{args.config}, 2 layers (random weights)"))
    stages, mismatches = args.stages.split(","), []
    tokenizer = model = draft = None
    if stages == ["rollback"]:  # one KDA layer's widths: no weights needed
        config = (built_in(args.config, device, dtype, config_only=True) if not args.model else
                  __import__("transformers").AutoConfig.from_pretrained(args.model).get_text_config())
    elif args.model:
        model = load(args.model, device, dtype)
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except Exception:  # noqa: BLE001 - no tokenizer in the folder: random-id prompts
            tokenizer = None
    else:
        model = built_in(args.config, device, dtype)
    if model is not None:
        config = text_model(model).config
        if args.draft == "none" or (args.draft is None and args.model):
            draft = None
        else:
            draft = load(args.draft, device, dtype) if args.draft else built_in(args.config, device, dtype, layers=2)

    def timed(fn, reset=None):
        """Median ms of `reps` synchronised calls after one warm-up, `reset` (untimed) before each."""
        times = []
        for i in range(args.reps + 1):
            if reset is not None:
                reset()
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            if i:
                times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        if "rollback" in stages:
            stage_rollback(res, config, device, dtype, ks, lambda fn: wall_ms(fn, device, warm=1, rep=args.reps))
        if "verify" in stages:
            stage_verify(res, model, device, args.prompt, ks, timed)
    if "generate" in stages:
        stage_generate(res, model, draft, tokenizer, device, args.prompt, args.new_tokens, args.lookup_tokens,
                       args.assistant_tokens, args.reps, mismatches)
    res.mismatches = mismatches
    return res


def print_table(res):
    m = res.meta
    print(f"{m['device']} | torch {m['torch']} | transformers {m['transformers']} | {m['tree']} | {m['date']}")
    for r in res.rows:
        if r["stage"] == "rollback":
            print(f"rollback k={r['k']:<2d} H={r['H']} one KDA layer: verify {r['verify_ms']:.4f} ms, keep every state "
                  f">= {r['keep_every_state_lower_bound_ms']:.4f} ms, rerun {r['rerun_ms']:.4f} ms: {r['faster']}")
        elif r["stage"] == "verify":
            print(f"verify   k={r['k']:<2d} round {r['round_keep_all_ms']:.2f} ms (rejecting half "
                  f"{r['round_keep_half_ms']:.2f} ms) vs {r['k']} steps {r['steps_ms']:.2f} ms: "
                  f"{r['round_over_one_step']:.2f} steps' worth; keep_rows rejecting half {r['keep_half_ms']:.2f} ms "
                  f"({r['keep_half_host_ms']:.2f} ms on the host)")
        else:
            print(f"generate {r['prompt']:5s} {r['impl']:14s} {r['tok_s']:>9.1f} tok/s "
                  f"x{r['speedup_vs_static_greedy']:.2f}  {r['new_per_target_forward']:.2f} new/forward  "
                  f"tokens equal: {r['tokens_equal_static_greedy']}")


if __name__ == "__main__":
    result = main()
    print_table(result)
    if result.mismatches:
        sys.exit(f"tokens differ from static greedy: {', '.join(result.mismatches)}")
