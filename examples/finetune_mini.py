#!/usr/bin/env python
"""Short fine-tunes of kimi-k3-mini on documents it never saw: Per-Head Muon against AdamW, and quantisation-aware
fine-tuning against fine-tuning the float experts and quantising afterwards.

    python examples/finetune_mini.py --data out/mini/inputs --out examples/results/finetune_mini_cpu.json   # CPU, minutes

The documents are the held-out split of the mini corpus (`train_kimi3_mini.py prepare`): the first 85 % of them are
fine-tuned on, the rest evaluated (chunks of `--seq-len` tokens, the mean token loss). Every run starts from the
bundled weights, fp32, the same batches in the same order, a constant learning rate after a short warm-up.

  muon      experts dequantised and trained, `build_per_head_muon(model, lr)`
  adamw     the same with `torch.optim.AdamW(lr, betas=(0.9, 0.95), weight_decay=0.1)`
  qat       packed experts made trainable by `prepare_qat` (MXFP4 in every forward), AdamW; saved packed, reloaded
  ptq       experts dequantised and trained in float, AdamW, then quantised to MXFP4 (`prepare_qat` then
            `save_pretrained`, which packs the weights with the QAT rounding), reloaded

The qat and ptq rows report the reloaded packed model's loss: what a user ships.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mini_data import chunk_spans, load_split  # noqa: E402

from transformers_kimi3 import Kimi3ForCausalLM, build_per_head_muon, prepare_qat  # noqa: E402

RUNS = ("muon", "adamw", "qat", "ptq")


def batches(data, seq_len, batch, steps, seed):
    """(fine-tune batches [steps x [batch, seq_len]], eval chunks): the first 85 % of the held-out documents for
    fine-tuning, the rest for evaluation."""
    tokens, offsets = load_split(data, "eval")
    cut = int(len(offsets) * 0.85)
    train = [tokens[s:e] for s, e in chunk_spans(offsets[:cut + 1], seq_len) if e - s == seq_len]
    held = [tokens[s:e] for s, e in chunk_spans(offsets[cut:], seq_len) if e - s == seq_len]
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(train)) for _ in range(steps * batch // len(train) + 1)])
    rows = [torch.tensor(np.stack([train[i] for i in order[k * batch:(k + 1) * batch]]).astype(np.int64))
            for k in range(steps)]
    return rows, torch.tensor(np.stack(held).astype(np.int64))


def eval_loss(model, held, batch=8):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(held), batch):
            ids = held[i:i + batch]
            total += model(input_ids=ids, labels=ids).loss.item() * len(ids)
    model.train()
    return total / len(held)


def load(model_dir, run):
    kw = {} if run == "qat" else {"dequantize": True}
    model = Kimi3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    if run == "qat":
        prepare_qat(model)
    return model.train()


def optimizer(model, run, lr):
    if run == "muon":
        return build_per_head_muon(model, lr=lr)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                             weight_decay=0.1)


def packed_loss(model, held):
    """Save with packed MXFP4 experts (a float model is quantised first), reload, evaluate."""
    if model.config.get_text_config().checkpoint_quantization_config is None:
        prepare_qat(model)  # float experts -> masters; save_pretrained packs them with the QAT rounding
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return eval_loss(Kimi3ForCausalLM.from_pretrained(tmp, dtype=torch.float32), held)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assets/kimi-k3-mini")
    ap.add_argument("--data", default="out/mini/inputs", help="train_kimi3_mini.py prepare's inputs folder")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-chunks", type=int, default=24, help="held-out chunks evaluated (the first ones)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows, held = batches(args.data, args.seq_len, args.batch, args.steps, args.seed)
    held = held[:args.eval_chunks]
    result = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "torch": torch.__version__, "device": "cpu, fp32", "model": args.model,
                       **{k: getattr(args, k) for k in ("steps", "batch", "seq_len", "lr", "seed")},
                       "eval_chunks": len(held)}, "runs": {}}
    for run in args.runs.split(","):
        torch.manual_seed(args.seed)
        model = load(args.model, run)
        opt = optimizer(model, run, args.lr)
        warm = max(1, args.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        curve, start = [[0, round(eval_loss(model, held), 4)]], time.perf_counter()
        for step, ids in enumerate(rows, 1):
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % args.eval_every == 0 or step == args.steps:
                curve.append([step, round(eval_loss(model, held), 4)])
                print(run, curve[-1], flush=True)
        entry = {"eval_loss": curve, "seconds": round(time.perf_counter() - start, 1)}
        if run in ("qat", "ptq"):
            entry["packed_eval_loss"] = round(packed_loss(model, held), 4)
            print(run, "packed", entry["packed_eval_loss"], flush=True)
        result["runs"][run] = entry
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result["runs"]))


if __name__ == "__main__":
    main()
