#!/usr/bin/env python
"""Train kimi-k3-mini (and its draft model) from scratch with Transformers' Trainer and transformers-kimi3.

    python examples/train_kimi3_mini.py prepare --work out/mini           # CPU, needs the Debian mirror
    python examples/train_kimi3_mini.py train --work out/mini --max-minutes 9    # GPU; run again to resume
    python examples/train_kimi3_mini.py sizes                            # parameter counts and stored sizes
    python examples/train_kimi3_mini.py all --smoke --work /tmp/smoke     # the CPU smoke run: tiny everything

`prepare` builds the corpus (`mini_corpus`), trains the K3-format tokenizer (`mini_tokenizer`) and writes what
training reads into `WORK/inputs/`: the token files of both splits, the chat sources and the tokenizer. `train` runs
the phases in order (text, vision, chat for the mini model; text and chat for the draft), each a Trainer run in
`WORK/phases/NAME/` that starts from the previous phase's final weights, then exports both models in the official
layout with MXFP4 experts into `WORK/export/`. Each invocation stops cleanly, with a checkpoint, when
`--max-minutes` (less `--reserve-minutes` for saving) or `--max-steps-per-call` is reached; the next invocation
resumes the phase from its last checkpoint and goes on. Results are deterministic for a seed, resumed or not.
Exit status: 0 when the phases asked for are done (and exported, when all were asked for), 3 when the budget paused
the run.

    python examples/train_kimi3_mini.py train --work out/mini --phases linear-text    # GPU, about 2 minutes

runs the extra phase "linear-text" (never part of the default list): a text-only model in the Kimi Linear layout
(`mini_model.linear_config`: no AttnRes, no latent MoE, Kimi Linear's KDA gate) trained from scratch on the text data;
`WORK/phases/linear-text/final` is ours, `final-native` the same weights written by Transformers' native
`KimiLinearForCausalLM` (compare them with `bench/fidelity.py --native`).
"""

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import mini_chat  # noqa: E402
import mini_corpus  # noqa: E402
import mini_data  # noqa: E402
import mini_model  # noqa: E402
import mini_tokenizer  # noqa: E402
from mini_card import model_card, write_card  # noqa: E402
from transformers_kimi3 import Kimi3ForCausalLM, Kimi3ForConditionalGeneration, Kimi3ImageProcessor  # noqa: E402
from transformers_kimi3 import Kimi3Processor  # noqa: E402
from transformers_kimi3.training import QuantileBalancingCallback  # noqa: E402

# "text": pieces of training documents of at most TEXT_PIECE tokens, so that the language model does not forget
VISION_MIX = {"vision": 5, "text": 1}
CHAT_MIX = {"vision": 3, "api": 3, "section": 2, "tool": 1, "talk": 1, "text": 2}
DRAFT_CHAT_MIX = {"api": 3, "section": 2, "tool": 1, "talk": 1, "text": 2}
TEXT_PIECE = 256
SMOKE_MODULES = ("json", "textwrap", "string", "shlex", "fnmatch", "bisect", "heapq", "colorsys")


def phase_plan(smoke, steps_scale=1.0):
    """[(name, model, data, steps, batch, lr)]: the phases in run order. The batch counts packed rows of `seq_len`
    tokens (text) or conversations (vision, chat). `steps_scale` multiplies every phase's steps (the learning-rate
    schedule follows), to fit a run into a fixed GPU time."""
    if steps_scale != 1.0:
        return [(n, m, d, max(1, round(steps * steps_scale)), b, lr) for n, m, d, steps, b, lr in phase_plan(smoke)]
    if smoke:
        return [("text", "mini", "text", 6, 2, 3e-3), ("vision", "mini", "vision", 1, 2, 1e-3),
                ("chat", "mini", "chat", 1, 2, 1e-3), ("draft-text", "draft", "text", 1, 2, 3e-3),
                ("draft-chat", "draft", "chat", 1, 2, 1e-3)]
    # text: 5,733 rows of 1,024 tokens per epoch (5.7 M tokens), so 540 steps of 64 rows are 6 epochs. The vision
    # tower and projector start from random weights and must learn colours, counts and places from the answers
    # alone, so the vision phase has the most steps.
    return [("text", "mini", "text", 540, 64, 3e-3), ("vision", "mini", "vision", 1500, 64, 1e-3),
            ("chat", "mini", "chat", 400, 64, 5e-4), ("draft-text", "draft", "text", 360, 64, 3e-3),
            ("draft-chat", "draft", "chat", 200, 64, 1e-3)]


def extra_phases(smoke, steps_scale=1.0):
    """Phases run only when `--phases` names them: "linear-text", a text-only model in the Kimi Linear layout
    (`mini_model.linear_config`) trained from scratch on the text data, to compare with Transformers' native
    KimiLinearForCausalLM (bench/fidelity.py --native)."""
    steps = 6 if smoke else 200  # 200 x 64 rows of 1,024 tokens (13 M tokens, 2.3 epochs): ~0.45 s a step on an H100
    return [("linear-text", "linear", "text", max(1, round(steps * steps_scale)), 2 if smoke else 64, 3e-3)]


def sizes(smoke):
    return {"mini": "smoke", "draft": "smoke-draft"} if smoke else {"mini": "mini", "draft": "draft"}


# ----------------------------------------------------------------------------- prepare
def prepare(args):
    t0 = time.monotonic()
    corpus_dir, inputs = os.path.join(args.work, "corpus"), os.path.join(args.work, "inputs")
    if args.smoke:
        summary = mini_corpus.build_corpus(corpus_dir, sources=("stdlib-docstrings",), stdlib_modules=SMOKE_MODULES)
    else:
        summary = mini_corpus.build_corpus(corpus_dir)
    t1 = time.monotonic()
    corpus = mini_corpus.read_jsonl(os.path.join(corpus_dir, "corpus.jsonl"))
    tok_dir = os.path.join(inputs, "tokenizer")
    ids = mini_tokenizer.build_tokenizer(tok_dir, [d["text"] for d in corpus if d["split"] == "train"],
                                         768 if args.smoke else args.vocab_size)
    t2 = time.monotonic()
    tokens = mini_data.encode_corpus(AutoTokenizer.from_pretrained(tok_dir), corpus, inputs, ids["eos_text_token_id"])
    records = mini_chat.usable_records(mini_corpus.read_jsonl(os.path.join(corpus_dir, "records.jsonl")))
    _write_jsonl(os.path.join(inputs, "chat_records.jsonl"), records)
    _write_jsonl(os.path.join(inputs, "chat_sections.jsonl"), mini_chat.usable_sections(corpus))
    info = {"corpus": summary, "tokenizer": ids, "tokens": tokens, "seconds": {
        "corpus": round(t1 - t0, 1), "tokenizer": round(t2 - t1, 1), "encode": round(time.monotonic() - t2, 1)}}
    _write_json(os.path.join(inputs, "prepare.json"), info)
    print(json.dumps({k: info[k] for k in ("tokens", "seconds")}))
    return info


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _write_json(path, data):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- train
class CallBudget(TrainerCallback):
    """Stops the run with a checkpoint once the invocation's deadline or step budget is reached."""

    def __init__(self, deadline, max_steps_per_call):
        self.deadline, self.max_steps, self.first = deadline, max_steps_per_call, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.first = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        over_steps = self.max_steps is not None and state.global_step - self.first >= self.max_steps
        if (over_steps or time.monotonic() > self.deadline) and state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = True


class StepClock(TrainerCallback):
    """Wall time of each optimizer step (the step time that fits a run into a GPU budget: `--steps-scale`)."""

    def __init__(self):
        self.last, self.seconds = None, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.last = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.monotonic() - self.last)

    def summary(self):
        s = sorted(self.seconds[2:] or self.seconds)  # the first steps compile and autotune the kernels
        return {"steps_timed": len(s), "p25": round(s[len(s) // 4], 4), "median": round(s[len(s) // 2], 4),
                "total": round(sum(self.seconds), 1)} if s else {}


def processor_of(inputs):
    return Kimi3Processor(image_processor=Kimi3ImageProcessor(),
                          tokenizer=AutoTokenizer.from_pretrained(os.path.join(inputs, "tokenizer")))


def phase_mix(kind, model):
    """The item kinds and weights of a vision or chat phase (None for the packed text phases)."""
    if kind == "text":
        return None
    return VISION_MIX if kind == "vision" else (CHAT_MIX if model == "mini" else DRAFT_CHAT_MIX)


def datasets(kind, inputs, processor, args, seq_len, steps, batch, model):
    """(train, eval, collator) of a phase."""
    if kind == "text":
        rows = 2 if args.smoke else None  # the smoke run repeats one batch, so its loss must fall
        train = mini_data.PackedRows(inputs, "train", seq_len, args.seed, max_rows=rows)
        held_out = mini_data.PackedRows(inputs, "eval", seq_len, args.seed, max_rows=2 if args.smoke else 256)
        return train, held_out, mini_data.PackedRowCollator()
    records = mini_corpus.read_jsonl(os.path.join(inputs, "chat_records.jsonl"))
    sections = mini_corpus.read_jsonl(os.path.join(inputs, "chat_sections.jsonl"))
    mix = phase_mix(kind, model)
    max_len = 128 if args.smoke else 1024

    def data(seed, size, split):
        tokens, offsets = mini_data.load_split(inputs, split)
        text = (tokens, mini_data.chunk_spans(offsets, min(TEXT_PIECE, max_len)))
        return mini_chat.ChatData(processor, seed, size, mix, records, sections, max_len=max_len, text=text)

    collator = mini_chat.PaddedCollator(processor.tokenizer.pad_token_id)
    return data(args.seed, steps * batch, "train"), data(args.seed + 10_000, 2 if args.smoke else 256, "eval"), collator


def initial_model(name, model, plan, work, ids, args):
    earlier = [p for p in plan[:[p[0] for p in plan].index(name)] if p[1] == model]
    if earlier:
        src = os.path.join(work, "phases", earlier[-1][0], "final")
        cls = Kimi3ForConditionalGeneration if model == "mini" else Kimi3ForCausalLM
        return cls.from_pretrained(src, dtype=torch.float32)
    if model == "linear":
        size = "smoke-linear" if args.smoke else "linear"
        return mini_model.new_model(mini_model.linear_config(size, ids), args.seed)
    size = sizes(args.smoke)[model]
    config = mini_model.mini_config(size, ids) if model == "mini" else mini_model.text_config(size, ids)
    return mini_model.new_model(config, args.seed)


def save_native(final, out):
    """The Kimi Linear model saved in `final` (ours) written again by Transformers' native KimiLinearForCausalLM into
    `out`, after checking that native reads every weight of ours and no other."""
    from transformers import KimiLinearForCausalLM

    native, info = KimiLinearForCausalLM.from_pretrained(final, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"native KimiLinearForCausalLM does not read {final} as written: {bad}")
    if hasattr(native.config, "auto_map"):  # ours' remote-code entry points: not for the native folder
        del native.config.auto_map
    native.save_pretrained(out)


def training_arguments(out, steps, batch, lr, args, cuda):
    eval_every = None if args.smoke else max(1, steps // 6)
    return TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20), weight_decay=0.1,
        adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1 if args.smoke else 10, save_strategy="steps",
        save_steps=steps if args.smoke else max(1, steps // 8), save_total_limit=1, seed=args.seed,
        data_seed=args.seed, bf16=cuda, use_cpu=not cuda, dataloader_num_workers=0 if args.smoke else args.workers,
        eval_strategy="no" if eval_every is None else "steps", eval_steps=eval_every, remove_unused_columns=False,
        report_to="none", disable_tqdm=True, label_names=["labels"])


def run_phase(phase, plan, work, ids, args, deadline):
    """Train one phase to its end or the budget; returns its summary, with "done" true once it has finished."""
    name, model, kind, steps, batch, lr = phase
    out = os.path.join(work, "phases", name)
    summary_path = os.path.join(out, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    if time.monotonic() > deadline:
        return {"done": False}
    inputs = os.path.join(work, "inputs")
    processor = processor_of(inputs)
    seq_len = 64 if args.smoke else args.seq_len
    train, held_out, collator = datasets(kind, inputs, processor, args, seq_len, steps, batch, model)
    cuda = torch.cuda.is_available()
    net = initial_model(name, model, plan, work, ids, args)
    if args.gradient_checkpointing:
        net.gradient_checkpointing_enable()
    clock = StepClock()
    trainer = Trainer(model=net,
                      args=training_arguments(out, steps, batch, lr, args, cuda), train_dataset=train,
                      eval_dataset=held_out, data_collator=collator,
                      callbacks=[QuantileBalancingCallback(), CallBudget(deadline, args.max_steps_per_call), clock])
    resume = get_last_checkpoint(out) if os.path.isdir(out) else None
    trainer.train(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(f"{name}: step seconds {json.dumps(clock.summary())}")
    if trainer.state.global_step < steps:
        print(f"{name}: paused at step {trainer.state.global_step} of {steps}; run again to resume")
        return {"done": False}
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(out, "final"))
    if model == "linear":
        save_native(os.path.join(out, "final"), os.path.join(out, "final-native"))
    mix = phase_mix(kind, model)
    summary = {"done": True, "model": model, "steps": steps, "batch": batch, "lr": lr, "mix": mix,
               "text_piece": TEXT_PIECE if "text" in (mix or {}) else None,
               "train_loss": round(losses[-1], 4) if losses else None,
               "eval_loss": round(metrics["eval_loss"], 4), "losses": losses, "step_seconds": clock.summary()}
    for ckpt in os.listdir(out):
        if ckpt.startswith("checkpoint-"):
            shutil.rmtree(os.path.join(out, ckpt))
    _write_json(summary_path, summary)
    print(f"{name}: done, eval loss {summary['eval_loss']}")
    return summary


def export(work, plan, info, phases, args):
    inputs, export_dir = os.path.join(work, "inputs"), os.path.join(work, "export")
    processor = processor_of(inputs)
    size = sizes(args.smoke)
    final = {m: os.path.join(work, "phases", [p[0] for p in plan if p[1] == m][-1], "final") for m in size}
    models = {"mini": Kimi3ForConditionalGeneration.from_pretrained(final["mini"], dtype=torch.float32),
              "draft": Kimi3ForCausalLM.from_pretrained(final["draft"], dtype=torch.float32)}
    summary = {**info, "seed": args.seed, "seq_len": 64 if args.smoke else args.seq_len, "phases": phases,
               "sizes": {m: mini_model.TEXT_SIZES[s] for m, s in size.items()},
               "parameters": {m: mini_model.parameter_counts(models[m]) for m in models}}
    for m, folder in (("mini", "kimi-k3-mini"), ("draft", "kimi-k3-mini-draft")):
        mini_model.export_folder(models[m], processor if m == "mini" else processor.tokenizer,
                                 os.path.join(inputs, "tokenizer"), os.path.join(export_dir, folder),
                                 model_card(summary, draft=m == "draft"),
                                 stop_ids=(info["tokenizer"]["eos_token_id"], info["tokenizer"]["eos_text_token_id"]))
        write_card(os.path.join(export_dir, folder), summary, draft=m == "draft")  # the card with its loss curves
    _write_json(os.path.join(export_dir, "summary.json"), summary)
    return summary


def train(args):
    deadline = time.monotonic() + 60 * (args.max_minutes - args.reserve_minutes)
    work = args.work
    with open(os.path.join(work, "inputs", "prepare.json")) as f:
        info = json.load(f)
    default = phase_plan(args.smoke, args.steps_scale)
    plan = default + extra_phases(args.smoke, args.steps_scale)
    chosen = args.phases.split(",") if args.phases else [p[0] for p in default]
    unknown = set(chosen) - {p[0] for p in plan}
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}; the phases are {[p[0] for p in plan]}")
    phases = {}
    for phase in plan:
        if phase[0] in chosen:
            phases[phase[0]] = run_phase(phase, plan, work, info["tokenizer"], args, deadline)
            if not phases[phase[0]]["done"]:
                return False
    if any(p[0] not in phases for p in default):
        print(f"phases {sorted(phases)} done")
        return True
    if not os.path.isfile(os.path.join(work, "export", "summary.json")):
        export(work, default, info, {k: v for k, v in phases.items() if k in {p[0] for p in default}}, args)
    print(f"all phases done; exported to {os.path.join(work, 'export')}")
    return True


def print_sizes(args):
    ids = mini_tokenizer.token_ids(args.vocab_size - 256)
    for model, size in sizes(args.smoke).items():
        config = mini_model.mini_config(size, ids) if model == "mini" else mini_model.text_config(size, ids)
        print(model, json.dumps(mini_model.parameter_counts(mini_model.new_model(config, args.seed))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("prepare", "train", "all", "sizes"))
    ap.add_argument("--work", default="out/mini", help="folder of the corpus, inputs, phases and export")
    ap.add_argument("--smoke", action="store_true", help="tiny corpus, tokenizer, models and step counts (CPU)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=8192, help="ids in all: BPE ranks + K3's 256 special ids")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per packed row of the text phases")
    ap.add_argument("--workers", type=int, default=12, help="data loader processes (vision and chat draw on the fly)")
    ap.add_argument("--max-minutes", type=float, default=float("inf"), help="wall-clock budget of this invocation")
    ap.add_argument("--reserve-minutes", type=float, default=1.0, help="part of the budget kept for saving")
    ap.add_argument("--max-steps-per-call", type=int, default=None, help="optimizer steps per phase per invocation")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward")
    ap.add_argument("--steps-scale", type=float, default=1.0,
                    help="multiply every phase's steps (and so its schedule), e.g. 0.5 to fit a shorter GPU run")
    ap.add_argument("--phases", default=None,
                    help="comma-separated phases to run (default: all but linear-text, then the export)")
    args = ap.parse_args(argv)
    if args.command == "sizes":
        return print_sizes(args)
    if args.command in ("prepare", "all"):
        prepare(args)
    if args.command in ("train", "all"):
        return 0 if train(args) else 3


if __name__ == "__main__":
    sys.exit(main())
