"""Fidelity on real weights: the trained kimi-k3-mini on its held-out text, teacher-forced.

    python bench/fidelity.py --model assets/kimi-k3-mini --data out/mini/inputs --out bench/results/fidelity_h100.json
    # add --unquantized out/mini/phases/chat/final to compare with the weights before MXFP4 packing (~1 min on a GPU)

Rows, each over the same held-out chunks (every document cut into pieces of at most --seq-len tokens, one forward per
piece, no padding):
  bf16 vs fp32     our bf16 model with the Triton kernels against our fp32 model (fp32 computes in fp32 on the GPU
                   too): top-1 agreement of the next-token prediction and the two perplexities
  mxfp4 vs bf16    the packed MXFP4 experts as shipped against the trained bf16/fp32 expert weights (--unquantized),
                   both run in bf16: perplexity
Goals (issue text): agreement >= 99.5 %, perplexity bf16 vs fp32 within 0.5 %, MXFP4 vs unquantized within 2 %.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import meta  # noqa: E402


def held_out_chunks(data_dir, seq_len, max_chunks):
    tokens = np.fromfile(os.path.join(data_dir, "text_eval.bin"), dtype=np.uint16)
    offsets = np.load(os.path.join(data_dir, "text_eval_offsets.npy")).tolist()
    chunks = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        for s in range(start, end, seq_len):
            if min(end, s + seq_len) - s >= 16:
                chunks.append(torch.from_numpy(tokens[s:min(end, s + seq_len)].astype(np.int64)))
    return chunks[:max_chunks]


def load(folder, dtype, device, **kw):
    from transformers_kimi3 import Kimi3ForCausalLM
    return Kimi3ForCausalLM.from_pretrained(folder, dtype=dtype, **kw).to(device).eval()


@torch.no_grad()
def predictions(model, chunks, device):
    """Per chunk: (argmax of each position's next-token logits, summed NLL of the next tokens, count)."""
    out = []
    for ids in chunks:
        logits = model(input_ids=ids[None].to(device)).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[1:].to(device), reduction="sum")
        out.append((logits.argmax(-1).cpu(), float(nll), ids.numel() - 1))
    return out


def perplexity(preds):
    return math.exp(sum(p[1] for p in preds) / sum(p[2] for p in preds))


def agreement(a, b):
    same = sum(int((x[0] == y[0]).sum()) for x, y in zip(a, b))
    return same / sum(x[0].numel() for x in a)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the exported folder (official layout, MXFP4 experts)")
    ap.add_argument("--data", required=True, help="folder with text_eval.bin and text_eval_offsets.npy")
    ap.add_argument("--unquantized", default=None, help="the same model before MXFP4 packing (a saved folder)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    chunks = held_out_chunks(args.data, args.seq_len, args.chunks)
    res = {"meta": meta(model=args.model, chunks=len(chunks), tokens=sum(c.numel() for c in chunks)), "rows": {}}
    fp32 = predictions(load(args.model, torch.float32, args.device), chunks, args.device)
    bf16 = predictions(load(args.model, torch.bfloat16, args.device), chunks, args.device)
    p32, p16 = perplexity(fp32), perplexity(bf16)
    res["rows"]["bf16_vs_fp32"] = {"top1_agreement": agreement(bf16, fp32), "ppl_fp32": p32, "ppl_bf16": p16,
                                   "ppl_rel_diff": p16 / p32 - 1}
    if args.unquantized:
        raw = predictions(load(args.unquantized, torch.bfloat16, args.device), chunks, args.device)
        res["rows"]["mxfp4_vs_unquantized"] = {"ppl_unquantized_bf16": perplexity(raw), "ppl_mxfp4_bf16": p16,
                                               "ppl_rel_diff": p16 / perplexity(raw) - 1,
                                               "top1_agreement": agreement(bf16, raw)}
    print(json.dumps(res["rows"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
