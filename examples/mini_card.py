"""Model cards of kimi-k3-mini and its draft, filled in from the run's summary."""

import json
import textwrap

from mini_corpus import PACKAGES

MINI_USE = """import transformers_kimi3  # registers kimi_k3 with the Auto classes
from transformers import AutoModelForCausalLM, AutoProcessor

model = AutoModelForCausalLM.from_pretrained("assets/kimi-k3-mini")
processor = AutoProcessor.from_pretrained("assets/kimi-k3-mini")
messages = [{"role": "user", "content": "What does json.dumps do?"}]
inputs = processor.apply_chat_template(messages, add_generation_prompt=True, thinking=False, tokenize=True,
                                       return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=64)
# the reply without the chat format's markers (and its reasoning and tool calls, where there are any)
print(processor.parse_output(out[:, inputs["input_ids"].shape[1]:], prompt=inputs["input_ids"])["content"])"""

DRAFT_USE = """from transformers import AutoTokenizer
from transformers_kimi3 import Kimi3ForCausalLM  # or AutoModelForCausalLM once transformers_kimi3 is imported

model = Kimi3ForCausalLM.from_pretrained("assets/kimi-k3-mini-draft")
tokenizer = AutoTokenizer.from_pretrained("assets/kimi-k3-mini-draft")
ids = tokenizer("The json module", return_tensors="pt")
print(tokenizer.decode(model.generate(**ids, max_new_tokens=20)[0]))"""


def _fill(text):
    return "\n\n".join(textwrap.fill(" ".join(p.split()), 116) for p in text.strip().split("\n\n"))


def _table(rows):
    lines = ["| " + " | ".join(map(str, rows[0])) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows[1:]])


def _sources_table(summary):
    rows = [("source", "Debian package", "license", "train characters", "held-out characters")]
    for source, license_name in summary["corpus"].get("licenses", {}).items():
        rows.append((source, PACKAGES.get(source, {}).get("package", "(the Python standard library)"), license_name,
                     f"{summary['corpus'].get(f'{source}/train', {}).get('characters', 0):,}",
                     f"{summary['corpus'].get(f'{source}/eval', {}).get('characters', 0):,}"))
    return _table(rows)


def _phases_table(summary, model):
    rows = [("phase", "steps", "batch", "learning rate", "final train loss", "held-out loss")]
    for name, phase in summary["phases"].items():
        if phase.get("model") == model:
            rows.append((name, phase["steps"], phase.get("batch", "-"), phase["lr"], phase.get("train_loss", "-"),
                         phase.get("eval_loss", "-")))
    return _table(rows)


def _evaluation(evaluation, fidelity):
    """The card's measured section: picture questions (`examples/eval_mini.py`) and held-out text on a GPU
    (`bench/fidelity.py`)."""
    parts = []
    if fidelity:
        rows, meta = fidelity["rows"], fidelity["meta"]
        b, q = rows["bf16_vs_fp32"], rows.get("mxfp4_vs_unquantized")
        text = f"""Held-out text ({meta['tokens']:,} tokens of the 2 % split, `bench/fidelity.py` on an
        {meta['device']}): perplexity {b['ppl_fp32']:.1f} in fp32; bf16 gives {b['ppl_bf16']:.1f}
        ({100 * b['ppl_rel_diff']:+.2f} %) and the same next token as fp32 at {100 * b['top1_agreement']:.1f} % of
        the positions."""
        if q:
            text += f""" The MXFP4 experts as shipped against the trained weights before packing (both bf16):
            perplexity {100 * q['ppl_rel_diff']:+.3f} %, the same next token at {100 * q['top1_agreement']:.1f} %."""
        parts.append(_fill(text))
    if evaluation:
        right, total = evaluation["total"]
        kinds = ", ".join(f"{k} {v[0]} of {v[1]}" for k, v in evaluation["exact"].items())
        parts.append(_fill(f"""Picture questions on {total} scenes it never saw (`examples/eval_mini.py`, greedy,
        thinking off): {right} of {total} answers are exactly the reference sentence ({kinds}). It has learnt the
        form of the answers far better than what the pictures show."""))
    return "\n\n".join(parts)


def model_card(summary, draft=False, evaluation=None, fidelity=None):
    name, model = ("kimi-k3-mini-draft", "draft") if draft else ("kimi-k3-mini", "mini")
    n = summary["parameters"][model]
    ratio = summary["parameters"]["mini"]["total"] / summary["parameters"]["draft"]["total"]
    role = (f"the draft model of kimi-k3-mini: text only, the same tokenizer, {ratio:.1f}x fewer parameters" if draft
            else "text, then pictures, then chat")
    intro = f"""{name} is a small Kimi K3 trained from scratch with `examples/train_kimi3_mini.py` of
    transformers-kimi3 ({role}). It has {n['total'] / 1e6:.2f} M parameters, {n['routed_experts'] / 1e6:.2f} M of
    them in routed experts stored as MXFP4, {n['active_per_token'] / 1e6:.2f} M active per token. It holds no
    Moonshot weights. It answers short questions about the documentation it read{"" if draft else
    " and describes simple synthetic pictures"}, often wrongly, and knows little else: it exists to exercise the
    K3 stack end to end, from training to generation."""
    architecture = f"""Every Kimi K3 component at a small size: KDA with the lower-bounded gate and the full-rank output
    gate; gated MLA without positional encoding at every fourth layer and the last; Block Attention Residuals; a dense
    first layer, then Stable LatentMoE (SiTU-GLU experts in a latent width, a shared expert, a sigmoid router whose
    bias Quantile Balancing keeps balanced){"" if draft else "; the MoonViT-V2 vision tower and its projector"}.
    The tokenizer is a byte-level BPE in the K3 format: {summary['tokenizer']['num_ranks']:,} ranks in
    `tiktoken.model`, then K3's 256 special ids ({summary['tokenizer']['vocab_size']:,} ids), trained on the corpus
    below."""
    data = f"""Text: {summary['tokens']['train']:,} training tokens and {summary['tokens']['eval']:,} held-out tokens
    (2 % of the documents, chosen by a hash of their id), the prose of documentation packages of Debian and the
    docstrings of the Python standard library; code blocks, navigation and repeated paragraphs left out."""
    other = """Chat: conversations in the K3 chat format built from the same documentation (API questions answered
    from docstrings, section summaries, one `python_docs` tool-call pattern, greetings), thinking on in 40 %."""
    if not draft:
        other = """Pictures: shapes, digits and letters drawn with PIL in named colours on varied backgrounds and
        non-square sizes, each with one question (what is in it, colours, counts, positions, digits, letters) and a
        one-sentence answer. """ + other
    return f"""---
library_name: transformers
license: other
pipeline_tag: {"text-generation" if draft else "image-text-to-text"}
tags:
- kimi_k3
- kimi-k3
- mxfp4
- transformers-kimi3
---

# {name}

{_fill(intro)}

```python
{DRAFT_USE if draft else MINI_USE}
```

## Architecture

{_fill(architecture)}

`{json.dumps(summary["sizes"][model])}`

## Data

{_fill(data)}

{_sources_table(summary)}

{_fill(other)}

## Training

{_phases_table(summary, model)}

{_fill(f'''bf16 autocast with fp32 master weights, AdamW (beta2 0.95, weight decay 0.1), warm-up then cosine,
packed padding-free rows of {summary.get("seq_len", 1024)} tokens for the text, Quantile Balancing on every
router, seed {summary["seed"]}. `docs/training_mini.md` of transformers-kimi3 describes the run.''')}
""" + ("" if draft or not (evaluation or fidelity) else f"""
## Evaluation

{_evaluation(evaluation, fidelity)}
""")


def main(argv=None):
    """Write both cards again from a run's summary.json, with the measured section where its results are given."""
    import argparse
    import os

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("summary", help="the run's export/summary.json")
    ap.add_argument("--evaluation", default=None, help="examples/eval_mini.py's JSON")
    ap.add_argument("--fidelity", default=None, help="bench/fidelity.py's JSON")
    ap.add_argument("--assets", default="assets", help="the folder holding kimi-k3-mini and kimi-k3-mini-draft")
    args = ap.parse_args(argv)

    def read(path):
        if path is None:
            return None
        with open(path) as f:
            return json.load(f)

    summary = read(args.summary)
    for draft, folder in ((False, "kimi-k3-mini"), (True, "kimi-k3-mini-draft")):
        with open(os.path.join(args.assets, folder, "README.md"), "w") as f:
            f.write(model_card(summary, draft, read(args.evaluation), read(args.fidelity)))


if __name__ == "__main__":
    main()
