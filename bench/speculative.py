"""Speculative decoding at batch 1 on one GPU: tokens/s of greedy decoding with the static cache (CUDA-graph decode
steps) against prompt lookup and against a draft model (Transformers' assisted decoding over a Kimi3Cache that rolls
its KDA states back), on a copy-heavy prompt and a free-generation prompt; and what one verification costs: a forward
of k + 1 tokens plus the rollback of rejected candidates, against k single decode steps.

    python bench/speculative.py --out bench/results/speculative_h100.json              # K3-shaped, random weights
    python bench/speculative.py --target FOLDER --draft FOLDER --out ...                # real checkpoints
    python bench/speculative.py --tiny                                                  # toy sizes, CPU smoke run

Stages (`--stages`, comma-separated; rows are written to `--out` as they are measured, beside earlier runs):
  verify    after a `--prompt`-token context, for each k in `--ks`: one forward of k + 1 tokens on a recording cache
            (`verify_ms`), the same plus a crop that rejects half the candidates (`verify_reject_ms`: the recurrence
            rerun over the accepted ones), against k eager decode steps (`steps_ms`) and k static-cache steps replayed
            as CUDA graphs (`graph_steps_ms`, CUDA only). Each timed call starts from the same state (a checkpoint).
  generate  `--new-tokens` greedy tokens after each prompt (`copy`: a block of random ids repeated up to `--prompt`
            tokens, or with a tokenizer a passage to repeat; `free`: random ids or an open question): static-cache
            greedy, dynamic-cache greedy, prompt lookup (`--lookup-tokens`), assisted (`--assistant-tokens` per round).
            tok_s counts the new tokens; `new_per_forward` is new tokens per target forward after the prefill
            (acceptance + 1 per round); `tokens_equal_static` compares with static greedy (bf16 rounding of a
            k-token verification against single steps can break a near-tie: a difference is reported, not fatal).

With random weights (the default) the draft is a random 2-layer model of the same widths: it agrees with the target
about as often as chance, so the assisted row measures the machinery's cost; prompt lookup still accepts what a
random model repeats. Speed-ups need real checkpoints (`--target`, `--draft`).
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
from _timing import Results, wall_ms  # noqa: E402
from e2e import K3_BENCH_CONFIG, K3_TINY_CONFIG, build_k3, free, guarded  # noqa: E402

COPY_TEXT = ("Repeat the following passage word for word.\n\n"
             "The hybrid model keeps two kinds of state: a compressed latent for every attended position and, for "
             "each linear-attention layer, one recurrent matrix that every new token updates. ") * 4
FREE_TEXT = "Tell me about the history of the printing press and how it changed the way ideas spread."


def commit():
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def load(folder, device, dtype):
    """A Kimi3 checkpoint folder: the K3 vision-language model through AutoModelForCausalLM (text prompts only
    here), a Kimi Linear text model through Kimi3ForCausalLM."""
    import transformers
    import transformers_kimi3

    with open(os.path.join(folder, "config.json")) as f:
        vlm = json.load(f).get("model_type") == "kimi_k3"
    cls = transformers.AutoModelForCausalLM if vlm else transformers_kimi3.Kimi3ForCausalLM
    return cls.from_pretrained(folder, dtype=dtype).to(device).eval()


def random_draft(config, device, dtype):
    """Two layers (KDA, MLA) at the target's widths, random weights."""
    lac = dict(config["linear_attn_config"], kda_layers=[1], full_attn_layers=[2])
    return build_k3(dict(config, num_hidden_layers=2, attn_res_block_size=1, linear_attn_config=lac), device, dtype)


def prompts(model, tokenizer, length, device, seed=0):
    """{"copy": ids, "free": ids} [1, T]."""
    if tokenizer is not None:
        enc = lambda text: tokenizer(text, return_tensors="pt").input_ids.to(device)  # noqa: E731
        return {"copy": enc(COPY_TEXT)[:, :length], "free": enc(FREE_TEXT)}
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(3, vocab, (1, max(length // 8, 4)), generator=g)
    copy = block.repeat(1, -(-length // block.shape[1]))[:, :length]
    return {"copy": copy.to(device), "free": torch.randint(3, vocab, (1, length), generator=g).to(device)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ stages


def stage_verify(res, model, device, context, ks):
    """Verification of k candidates against k decode steps, all from one checkpointed context."""
    from transformers_kimi3 import Kimi3Cache

    lm = getattr(model, "language_model", model)
    vocab = lm.config.vocab_size
    ids = torch.randint(3, vocab, (1, context + max(ks) + 1), device=device)
    with torch.no_grad():
        cache = lm(input_ids=ids[:, :context], use_cache=True, logits_to_keep=1).past_key_values
        start = cache.checkpoint()
        static = None
        if device.type == "cuda":
            static = Kimi3Cache(lm.config, max_length=context + max(ks) + 8)
            lm(input_ids=ids[:, :context], past_key_values=static, use_cache=True, logits_to_keep=1)
            static.checkpoint()
        for k in ks:
            cand = ids[:, context:context + k + 1]

            def verify(reject):
                cache.activate_past_recording(window=k + 2)
                lm(input_ids=cand, past_key_values=cache, use_cache=True)
                if reject:
                    cache.crop(-(k // 2))  # half the candidates rejected: the rest rerun from the base state
                cache.stop_past_recording()
                cache.crop(start)

            def steps(c):
                for t in range(k):
                    lm(input_ids=cand[:, t:t + 1], past_key_values=c, use_cache=True)
                c.crop(start)

            row = dict(stage="verify", k=k, context=context,
                       verify_ms=wall_ms(lambda: verify(False), device, warm=2, rep=10),
                       verify_reject_ms=wall_ms(lambda: verify(True), device, warm=2, rep=10),
                       steps_ms=wall_ms(lambda: steps(cache), device, warm=2, rep=10))
            if static is not None:
                row["graph_steps_ms"] = wall_ms(lambda: steps(static), device, warm=2, rep=10)
            row["verify_over_steps"] = row["verify_ms"] / row["steps_ms"]
            res.add(**row)


class ForwardCounter:
    """Calls of a model's forward (a pre-hook on the module)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self.count)

    def count(self, module, args):
        self.n += 1


def stage_generate(res, model, draft, tokenizer, device, length, new_tokens, lookup, assistant_tokens, deadline):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=model.generation_config.pad_token_id or 0)
    impls = [("static_greedy", model, dict(cache_implementation="static")), ("dynamic_greedy", model, {}),
             ("prompt_lookup", model, dict(prompt_lookup_num_tokens=lookup))]
    if draft is not None:
        draft.generation_config.num_assistant_tokens = assistant_tokens
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0  # a fixed k per round
        impls.append(("assisted", model, dict(assistant_model=draft)))
    for kind, ids in prompts(model, tokenizer, length, device).items():
        reference = None
        for name, m, extra in impls:
            if time.time() > deadline:
                return
            try:
                with torch.no_grad():
                    m.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4), **extra)  # warm-up, graphs
                    counter = ForwardCounter(m)
                    sync(device)
                    t = time.perf_counter()
                    out = m.generate(ids, **kw, **extra)
                    sync(device)
                    seconds = time.perf_counter() - t
                    counter.handle.remove()
            except Exception as e:  # noqa: BLE001 - a failing row is recorded, the others still run
                res.add(stage="generate", prompt=kind, impl=name, error=f"{type(e).__name__}: {e}"[:500])
                continue
            new = out[:, ids.shape[1]:]
            reference = new if reference is None else reference
            forwards = max(counter.n - 1, 1)  # the prefill aside (the draft's forwards are not counted)
            res.add(stage="generate", prompt=kind, impl=name, prompt_tokens=ids.shape[1], new_tokens=new.shape[1],
                    tok_s=new.shape[1] / seconds, new_per_forward=new.shape[1] / forwards,
                    tokens_equal_static=float((new == reference[:, :new.shape[1]]).float().mean()))


# ------------------------------------------------------------------------------------------------ main


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="results JSON; a run is added beside the file's earlier runs "
                                                "(default: printed only)")
    ap.add_argument("--label", default=None, help="what ran, stored in the file's meta (default: git describe)")
    ap.add_argument("--stages", default="verify,generate")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (a smoke run of the harness)")
    ap.add_argument("--target", default=None, help="target checkpoint folder (default: K3-shaped random weights)")
    ap.add_argument("--draft", default=None, help="draft checkpoint folder (default: a random 2-layer model; "
                                                  "'none' skips the assisted rows)")
    ap.add_argument("--prompt", type=int, default=1024, help="context / prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="4,8", help="candidates per verification (verify stage)")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--assistant-tokens", type=int, default=5, help="draft tokens per round")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting timed rows after this many seconds")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    deadline = time.time() + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.prompt, args.new_tokens, args.ks = min(args.prompt, 48), min(args.new_tokens, 12), "2,4"
    res = Results(args.out, keep_runs=True, tree_label=args.label, commit=commit(), tiny=args.tiny,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  target=args.target or ("k3_tiny" if args.tiny else "k3_bench"), draft=args.draft)
    config = K3_TINY_CONFIG if args.tiny else K3_BENCH_CONFIG
    tokenizer = None
    if args.target:
        model = load(args.target, device, dtype)
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.target)
        except Exception:  # noqa: BLE001 - no tokenizer in the folder: random-id prompts
            tokenizer = None
    else:
        model = build_k3(config, device, dtype)
    if args.draft == "none":
        draft = None
    elif args.draft:
        draft = load(args.draft, device, dtype)
    else:
        draft = random_draft(config, device, dtype)
    stages = args.stages.split(",")
    if "verify" in stages:
        guarded(res, "verify", stage_verify, res, model, device, args.prompt, [int(k) for k in args.ks.split(",")])
    if "generate" in stages:
        guarded(res, "generate", stage_generate, res, model, draft, tokenizer, device, args.prompt, args.new_tokens,
                args.lookup_tokens, args.assistant_tokens, deadline)
    del model, draft
    free(device)
    return res


def print_table(res):
    m = res.meta
    print(f"{m['device']} | torch {m['torch']} | transformers {m['transformers']} | {m['tree']} | {m['date']}")
    for r in res.rows:
        if "error" in r:
            print(f"{r['stage']:8s} {r.get('impl', '-'):15s}: {r['error']}")
        elif r["stage"] == "verify":
            graph = f", {r['graph_steps_ms']:.2f} ms as graphs" if "graph_steps_ms" in r else ""
            print(f"verify   k={r['k']:<2d} forward {r['verify_ms']:.2f} ms (rejecting half {r['verify_reject_ms']:.2f}"
                  f" ms) vs {r['k']} steps {r['steps_ms']:.2f} ms{graph}")
        else:
            print(f"generate {r['prompt']:5s} {r['impl']:15s} {r['tok_s']:>9.1f} tok/s  {r['new_per_forward']:.2f} "
                  f"new/forward  equal to static greedy: {r['tokens_equal_static']:.2f}")


if __name__ == "__main__":
    print_table(main())
