#!/usr/bin/env python
"""Picture questions answered by kimi-k3-mini: exact answers per question kind on scenes it never saw.

    python examples/eval_mini.py --model assets/kimi-k3-mini --scenes 96 --out examples/results/eval_mini_cpu.json

Scenes come from `mini_vision.scene_example` with a seed the training never drew from (training draws seed 1234
and, for its held-out loss, 11234), greedy answers with thinking off, parsed with `processor.parse_output`. An
answer counts when it equals the reference sentence. Text perplexity and the bf16 / MXFP4 comparisons are
`bench/fidelity.py`'s.
"""
import argparse
import collections
import datetime
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mini_vision  # noqa: E402
from transformers import AutoProcessor  # noqa: E402

from transformers_kimi3 import Kimi3ForConditionalGeneration  # noqa: E402

EVAL_SEED = 777


def kind_of(question):
    for start, kind in (("What is in", "describe"), ("Describe", "describe"), ("What do you see", "describe"),
                        ("How many objects", "count all"), ("How many", "count"), ("What colour is the background",
                        "background"), ("What colour", "colour"), ("Where", "where")):
        if question.startswith(start):
            return kind
    return "digit or letter"


def colour_probe(model, processor, scenes=160, seed=EVAL_SEED + 1):
    """How much of the picture the vision tower and projector pass on: the held-out R^2 (per RGB channel) of a
    least-squares linear map from each image token's feature to the mean colour of the pixels it covers, fitted on
    3/4 of the tokens of `scenes` pictures. Near 1: the colours reach the language model, which must learn to read
    them; near 0: the tower loses them."""
    import numpy as np

    feats, colours = [], []
    ip = processor.image_processor
    side = ip.patch_size * ip.merge_kernel_size  # the pixels one image token covers, per side
    for i in range(scenes):
        image, _, _ = mini_vision.scene_example(seed, i)
        enc = ip([image], return_tensors="pt")
        with torch.no_grad():
            f = model.get_image_features(enc["pixel_values"], enc["grid_thws"])
        f = torch.cat(list(f)) if isinstance(f, (list, tuple)) else f
        pixels = ip._resize_and_pad(image.convert("RGB"), ip.resize_plan(image.width, image.height)) / 255.0
        h, w = pixels.shape[0] // side, pixels.shape[1] // side
        rgb = pixels.reshape(h, side, w, side, 3).mean(axis=(1, 3)).reshape(-1, 3)
        feats.append(f.double().numpy())
        colours.append(rgb)
    x, y = np.concatenate(feats), np.concatenate(colours)
    x = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    n = len(x) * 3 // 4
    weights = np.linalg.lstsq(x[:n], y[:n], rcond=None)[0]
    residual = ((x[n:] @ weights - y[n:]) ** 2).sum(0)
    return [round(float(r), 3) for r in 1 - residual / ((y[n:] - y[n:].mean(0)) ** 2).sum(0)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assets/kimi-k3-mini")
    ap.add_argument("--scenes", type=int, default=96)
    ap.add_argument("--probe-scenes", type=int, default=160, help="pictures of the colour probe (0: no probe)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    processor = AutoProcessor.from_pretrained(args.model)
    model = Kimi3ForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32).eval()
    per_kind = collections.defaultdict(lambda: [0, 0])
    examples = []
    for i in range(args.scenes):
        image, question, answer = mini_vision.scene_example(EVAL_SEED, i)
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt", thinking=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        reply = processor.parse_output(out[:, inputs["input_ids"].shape[1]:], prompt=inputs["input_ids"])["content"]
        kind = kind_of(question)
        per_kind[kind][0] += reply.strip() == answer
        per_kind[kind][1] += 1
        if i < 8:
            examples.append({"question": question, "answer": reply.strip(), "reference": answer})
    total = [sum(v[0] for v in per_kind.values()), args.scenes]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None,
            "torch": torch.__version__, "device": "cpu, fp32"}
    result = {"meta": meta, "model": args.model, "seed": EVAL_SEED, "exact": {k: v for k, v in sorted(per_kind.items())},
              "total": total, "examples": examples,
              "colour_probe_r2": colour_probe(model, processor, args.probe_scenes) if args.probe_scenes else None}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
