"""Fidelity on real weights: the trained kimi-k3-mini on its held-out text, teacher-forced.

    python bench/fidelity.py --model assets/kimi-k3-mini --data out/mini/inputs --out bench/results/fidelity_h100.json
    # add --unquantized out/mini/phases/chat/final to compare with the weights before MXFP4 packing (~1 min on a GPU)

Rows, each over the same held-out chunks (every document cut into pieces of at most --seq-len tokens, one forward per
piece, no padding):
  bf16 vs fp32     our bf16 model with the Triton kernels against our fp32 model (fp32 computes in fp32 on the GPU
                   too): top-1 agreement of the next-token prediction and the two perplexities
  mxfp4 vs bf16    the packed MXFP4 experts as shipped against the trained bf16/fp32 expert weights (--unquantized),
                   both run in bf16: perplexity
  fp32 logits      (--fp32-logits) the bf16 model with `fp32_logits=True` (the LM head's output in fp32) against
                   the fp32 model: the agreement that bf16 rounding of the logits alone costs
  mxfp8 vs bf16    (--mxfp8) the same bf16 model with MXFP8 routed-expert activations (`moe_activation_format`,
                   the W4A8 kernels on a GPU with FP8 tensor cores) against bf16 activations: perplexity, agreement
Goals (issue text): agreement >= 99.5 %, perplexity bf16 vs fp32 within 0.5 %, MXFP4 vs unquantized within 2 %,
MXFP8 activations vs bf16 within 1 %.

Against Transformers' native Kimi Linear (a model in the Kimi Linear layout, e.g. the "linear-text" phase of
examples/train_kimi3_mini.py):

    python bench/fidelity.py --model WORK/phases/linear-text/final --native WORK/phases/linear-text/final-native \
        --data WORK/inputs --out fidelity_linear.json

`--native` is the same weights as saved by native `KimiLinearForCausalLM` (it runs fla's KDA kernels when fla is
usable, on the GPU; its PyTorch path otherwise). Greedy rows: `--prompts` prompts (the first `--prompt-len` tokens of
held-out chunks), `--new-tokens` new tokens each, batched, with the cache; per pair the tokens identical up to the
first difference, the sequences identical throughout, and at each first difference the logit gap
|logit(a's token) - logit(b's token)| in a's logits and in b's (the two runs' logits at that step, over the same
prefix). Added rows:
  ours_vs_native_bf16   both bf16 (ours: Triton kernels): teacher-forced top-1 agreement, perplexities, greedy
  native_bf16_vs_fp32   native's own bf16 against its fp32: the same, the bar the goal sets
  ours_vs_native_fp32   both fp32: top-1 agreement, max logits relative error over the chunks, greedy
  bf16_vs_fp32          (ours) gains its greedy comparison
  goal                  ours_vs_native_bf16 at least as close as native_bf16_vs_fp32 (teacher-forced and greedy)
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
from _timing import meta, rel  # noqa: E402


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


def load_native(folder, dtype, device):
    """Transformers' native KimiLinearForCausalLM (fla's kernels on the GPU when fla is usable; its PyTorch path on
    the CPU, where fla is hidden while the module is imported: bench/e2e.py)."""
    from e2e import native_class
    return native_class(torch.device(device)).from_pretrained(folder, dtype=dtype).to(device).eval()


def kernel_status(model, device):
    """Whether the packed experts' W4A8 kernels run for this bf16 model on `device` (else the emulated path)."""
    from transformers_kimi3.mxfp4_experts import PackedMXFP4Experts

    probe = torch.zeros(1, 1, dtype=torch.bfloat16, device=device)
    experts = [m for m in model.modules() if isinstance(m, PackedMXFP4Experts)]
    return bool(experts) and all(m._kernels(probe) is not None for m in experts)


@torch.no_grad()
def predictions(model, chunks, device):
    """Per chunk: (argmax of each position's next-token logits, summed NLL of the next tokens, count)."""
    out = []
    for ids in chunks:
        logits = model(input_ids=ids[None].to(device), use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[1:].to(device), reduction="sum")
        out.append((logits.argmax(-1).cpu(), float(nll), ids.numel() - 1))
    return out


def perplexity(preds):
    return math.exp(sum(p[1] for p in preds) / sum(p[2] for p in preds))


def agreement(a, b):
    same = sum(int((x[0] == y[0]).sum()) for x, y in zip(a, b))
    return same / sum(x[0].numel() for x in a)


@torch.no_grad()
def logits_rel_err(a, b, chunks, device):
    """max over the chunks of max |a - b| / max |b| of the two models' logits."""
    return max(rel(a(input_ids=ids[None].to(device), use_cache=False).logits,
                   b(input_ids=ids[None].to(device), use_cache=False).logits) for ids in chunks)


def prompts_of(data_dir, n, length):
    """The first `length` tokens of the first `n` held-out chunks that have that many, as one (n, length) batch."""
    chunks = [c[:length] for c in held_out_chunks(data_dir, 1024, 1 << 30) if c.numel() >= length]
    return torch.stack(chunks[:n])


@torch.no_grad()
def greedy(model, prompts, new_tokens, device):
    """Greedy continuation of the batch with the cache: (tokens (B, N), the logits each token was chosen from
    (B, N, vocab), fp32 on the CPU)."""
    out = model(input_ids=prompts.to(device), use_cache=True, logits_to_keep=1)
    tokens, logits = [], []
    for step in range(new_tokens):
        lg = out.logits[:, -1].float()
        nxt = lg.argmax(-1)
        tokens.append(nxt.cpu())
        logits.append(lg.cpu())
        if step + 1 < new_tokens:
            out = model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(tokens, 1), torch.stack(logits, 1)


def greedy_agreement(a, b):
    """Two greedy runs (`greedy` results) of the same prompts: tokens identical up to the first difference, sequences
    identical throughout, and where they part the logit gap between the two chosen tokens in each run's logits."""
    (ta, la), (tb, lb) = a, b
    n_prompts, n_new = ta.shape
    differ = ta != tb
    first = torch.where(differ.any(1), differ.int().argmax(1), torch.full((n_prompts,), n_new))
    parts = []
    for row in differ.any(1).nonzero()[:, 0].tolist():
        step, x, y = int(first[row]), int(ta[row, first[row]]), int(tb[row, first[row]])
        parts.append({"prompt": row, "step": step, "token_a": x, "token_b": y,
                      "gap_in_a": float((la[row, step, x] - la[row, step, y]).abs()),
                      "gap_in_b": float((lb[row, step, x] - lb[row, step, y]).abs()),
                      "logit_std_a": float(la[row, step].std())})
    gaps = sorted(max(p["gap_in_a"], p["gap_in_b"]) for p in parts)
    return {"prompts": n_prompts, "new_tokens": n_new, "identical_sequences": int((first == n_new).sum()),
            "tokens_to_first_difference": int(first.sum()), "token_fraction_to_first_difference":
            float(first.sum()) / (n_prompts * n_new), "mean_tokens_to_first_difference": float(first.float().mean()),
            "max_gap_at_first_difference": gaps[-1] if gaps else None,
            "median_gap_at_first_difference": gaps[len(gaps) // 2] if gaps else None, "first_differences": parts}


def native_rows(args, chunks, ours32, ours16, fp32, bf16, res):
    """The rows against Transformers' native Kimi Linear (`--native`), added to `res["rows"]`."""
    from e2e import fla_usable
    prompts = prompts_of(args.data, args.prompts, args.prompt_len)
    res["meta"].update(prompts=int(prompts.shape[0]), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                       native=args.native, native_kda="fla" if fla_usable(torch.device(args.device)) else "torch")
    nat32 = load_native(args.native, torch.float32, args.device)
    nat16 = load_native(args.native, torch.bfloat16, args.device)
    n32, n16 = predictions(nat32, chunks, args.device), predictions(nat16, chunks, args.device)
    g = {name: greedy(m, prompts, args.new_tokens, args.device)
         for name, m in (("ours32", ours32), ("ours16", ours16), ("nat32", nat32), ("nat16", nat16))}
    rows = res["rows"]
    rows["bf16_vs_fp32"]["greedy"] = greedy_agreement(g["ours16"], g["ours32"])
    rows["ours_vs_native_bf16"] = {"top1_agreement": agreement(bf16, n16), "ppl_ours_bf16": perplexity(bf16),
                                   "ppl_native_bf16": perplexity(n16), "greedy": greedy_agreement(g["ours16"],
                                                                                                  g["nat16"])}
    rows["native_bf16_vs_fp32"] = {"top1_agreement": agreement(n16, n32), "ppl_fp32": perplexity(n32),
                                   "ppl_bf16": perplexity(n16), "greedy": greedy_agreement(g["nat16"], g["nat32"])}
    rows["ours_vs_native_fp32"] = {"top1_agreement": agreement(fp32, n32),
                                   "logits_max_rel_err": logits_rel_err(ours32, nat32, chunks, args.device),
                                   "greedy": greedy_agreement(g["ours32"], g["nat32"])}
    ours, native = rows["ours_vs_native_bf16"], rows["native_bf16_vs_fp32"]
    rows["goal"] = {
        "top1_ours_vs_native_bf16": ours["top1_agreement"], "top1_native_bf16_vs_fp32": native["top1_agreement"],
        "greedy_tokens_ours_vs_native_bf16": ours["greedy"]["tokens_to_first_difference"],
        "greedy_tokens_native_bf16_vs_fp32": native["greedy"]["tokens_to_first_difference"],
        "met_teacher_forced": ours["top1_agreement"] >= native["top1_agreement"],
        "met_greedy": ours["greedy"]["tokens_to_first_difference"] >= native["greedy"]["tokens_to_first_difference"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the exported folder (official layout, MXFP4 experts)")
    ap.add_argument("--data", required=True, help="folder with text_eval.bin and text_eval_offsets.npy")
    ap.add_argument("--unquantized", default=None, help="the same model before MXFP4 packing (a saved folder)")
    ap.add_argument("--native", default=None,
                    help="the same weights as written by Transformers' native KimiLinearForCausalLM: adds the rows "
                         "against native (teacher-forced and greedy), and native's own bf16 vs fp32")
    ap.add_argument("--prompts", type=int, default=64, help="greedy rows (--native): prompts")
    ap.add_argument("--prompt-len", type=int, default=32, help="greedy rows (--native): tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy rows (--native): new tokens per prompt")
    ap.add_argument("--mxfp8", action="store_true", help="add the MXFP8-activation (W4A8) row")
    ap.add_argument("--fp32-logits", action="store_true", help="add the row of the bf16 model with fp32 logits")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    chunks = held_out_chunks(args.data, args.seq_len, args.chunks)
    res = {"meta": meta(model=args.model, chunks=len(chunks), tokens=sum(c.numel() for c in chunks)), "rows": {}}
    ours32, ours16 = load(args.model, torch.float32, args.device), load(args.model, torch.bfloat16, args.device)
    fp32, bf16 = predictions(ours32, chunks, args.device), predictions(ours16, chunks, args.device)
    p32, p16 = perplexity(fp32), perplexity(bf16)
    res["rows"]["bf16_vs_fp32"] = {"top1_agreement": agreement(bf16, fp32), "ppl_fp32": p32, "ppl_bf16": p16,
                                   "ppl_rel_diff": p16 / p32 - 1}
    if args.native:
        native_rows(args, chunks, ours32, ours16, fp32, bf16, res)
    if args.unquantized:
        raw = predictions(load(args.unquantized, torch.bfloat16, args.device), chunks, args.device)
        res["rows"]["mxfp4_vs_unquantized"] = {"ppl_unquantized_bf16": perplexity(raw), "ppl_mxfp4_bf16": p16,
                                               "ppl_rel_diff": p16 / perplexity(raw) - 1,
                                               "top1_agreement": agreement(bf16, raw)}
    if args.fp32_logits:
        wide = predictions(load(args.model, torch.bfloat16, args.device, fp32_logits=True), chunks, args.device)
        res["rows"]["bf16_fp32_logits_vs_fp32"] = {"top1_agreement": agreement(wide, fp32), "ppl_fp32": p32,
                                                   "ppl_bf16_fp32_logits": perplexity(wide),
                                                   "ppl_rel_diff": perplexity(wide) / p32 - 1}
    if args.mxfp8:
        a8 = load(args.model, torch.bfloat16, args.device, moe_activation_format="mxfp8")
        res["meta"]["w4a8_kernels"] = kernel_status(a8, args.device)
        q = predictions(a8, chunks, args.device)
        res["rows"]["mxfp8_vs_bf16"] = {"ppl_bf16_activations": p16, "ppl_mxfp8_activations": perplexity(q),
                                        "ppl_rel_diff": perplexity(q) / p16 - 1, "top1_agreement": agreement(q, bf16)}
    print(json.dumps(res["rows"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
