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


def loss_curves_svg(summary, model, width=720, height=220):
    """An SVG of the training loss of each phase of `model` ("mini" or "draft"), one panel per phase (the phases'
    losses differ in scale: packed text against answer tokens only), the held-out loss as a dot at the end. Plain
    SVG, so the card needs no plotting library."""
    phases = [(n, p) for n, p in summary["phases"].items() if p.get("model") == model and p.get("losses")]
    if not phases:
        return None
    pw, top, bottom, left = width / len(phases), 28, 30, 38
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>']
    for i, (name, phase) in enumerate(phases):
        losses, steps = phase["losses"], phase["steps"]
        values = losses + ([phase["eval_loss"]] if phase.get("eval_loss") is not None else [])
        lo, hi = min(values), max(values)
        lo, hi = (lo - 0.5, hi + 0.5) if hi - lo < 1e-9 else (lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        x0, x1, y0, y1 = i * pw + left, (i + 1) * pw - 10, height - bottom, top

        def xy(step, loss):
            return x0 + (x1 - x0) * step / steps, y0 + (y1 - y0) * (loss - lo) / (hi - lo)

        points = " ".join("%.1f,%.1f" % xy(steps * (j + 1) / len(losses), v) for j, v in enumerate(losses))
        parts += [f'<text x="{(x0 + x1) / 2:.1f}" y="16" text-anchor="middle" font-weight="bold">{name}</text>',
                  f'<polyline points="{x0:.1f},{y1} {x0:.1f},{y0} {x1:.1f},{y0}" fill="none" stroke="#888"/>',
                  f'<text x="{x0 - 4:.1f}" y="{y1 + 4}" text-anchor="end">{hi:.2f}</text>',
                  f'<text x="{x0 - 4:.1f}" y="{y0}" text-anchor="end">{lo:.2f}</text>',
                  f'<text x="{x1:.1f}" y="{y0 + 14}" text-anchor="end">{steps} steps</text>',
                  f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>']
        if phase.get("eval_loss") is not None:
            x, y = xy(steps, phase["eval_loss"])
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="#d62728"/>')
    parts.append(f'<text x="{width - 6}" y="{height - 4}" text-anchor="end" fill="#555">training loss (line), '
                 f'held-out loss (dot)</text></svg>')
    return "\n".join(parts) + "\n"


def _text_share(summary, model):
    """A sentence on the document pieces mixed into the later phases, where the run mixed them in."""
    phases = [(n, p) for n, p in summary["phases"].items()
              if p.get("model") == model and (p.get("mix") or {}).get("text")]
    if not phases:
        return ""
    parts = ", ".join(f"{100 * p['mix']['text'] / sum(p['mix'].values()):.0f} % of the {n} items" for n, p in phases)
    return (f" Pieces of the training documents (at most {phases[0][1]['text_piece']} tokens) make up {parts}, so the"
            " language model keeps its text.")


def _probe(evaluation):
    r2 = evaluation.get("colour_probe_r2")
    if not r2:
        return ""
    return (f"A linear map from each image token's feature to the mean colour of its pixels explains "
            f"{100 * min(r2):.0f}-{100 * max(r2):.0f} % of each colour channel's variance on held-out tokens: the "
            "pictures' colours reach the language model.")


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
        thinking off): {right} of {total} answers are exactly the reference sentence ({kinds}).{
        " It has learnt the form of the answers far better than what the pictures show." if right < total / 2 else ""}
        {_probe(evaluation)}"""))
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

![Training loss of each phase](loss_curves.svg)

{_fill(f'''bf16 autocast with fp32 master weights, AdamW (beta2 0.95, weight decay 0.1), warm-up then cosine,
packed padding-free rows of {summary.get("seq_len", 1024)} tokens for the text, Quantile Balancing on every
router, seed {summary["seed"]}.{_text_share(summary, model)} `docs/training_mini.md` of transformers-kimi3
describes the run.''')}
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
    fidelity = read(args.fidelity)
    if fidelity and "runs" in fidelity:  # a results file of several runs: each row as last measured
        fidelity = {"meta": fidelity["runs"][-1]["meta"],
                    "rows": {k: v for run in fidelity["runs"] for k, v in run["rows"].items()}}
    for draft, folder in ((False, "kimi-k3-mini"), (True, "kimi-k3-mini-draft")):
        write_card(os.path.join(args.assets, folder), summary, draft, read(args.evaluation), fidelity)


def write_card(folder, summary, draft=False, evaluation=None, fidelity=None):
    """README.md and loss_curves.svg of one exported folder."""
    import os

    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(model_card(summary, draft, evaluation, fidelity))
    svg = loss_curves_svg(summary, "draft" if draft else "mini")
    if svg:
        with open(os.path.join(folder, "loss_curves.svg"), "w") as f:
            f.write(svg)


if __name__ == "__main__":
    main()
