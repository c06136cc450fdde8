#!/usr/bin/env python
"""Official Kimi K3 folder -> a folder ready to publish: the same official layout (tensor names, dtypes, MXFP4
routed experts, config keys), plus this package's remote-code files and `auto_map`, the K3 model card as README.md,
and the tokenizer / processor files.

    kimi3-convert-k3 /data/Kimi-K3 /data/Kimi-K3-hf          # or: python conversion/convert_k3_to_hf.py ...
    kimi3-convert-k3 /data/Kimi-K3 /data/Kimi-K3-bf16 --dequantize --max-shard-size 10GB
    kimi3-convert-k3 /data/Kimi-K3 /data/Kimi-K3-hf --dry-run
    kimi3-convert-k3 /data/Kimi-K3 /data/Kimi-K3-hf --resume     # after an interruption

What it does, in order:
  1. reads config.json (model_type "kimi_k3") and the header of every shard, and checks every tensor's name,
     shape and dtype against what the config implies (our model built on the meta device, in the official layout;
     routed experts either bf16 `weight` or MXFP4 `weight_packed` [out, in/2] + `weight_scale` [out, in/32] U8,
     decided per expert). Every problem is listed with the tensor and the file. Nothing is written before this
     passes, nor before the output path is found free (or, with --overwrite, an earlier output of these
     converters) and its file system has room for the planned shards and the other files;
  2. streams the tensors shard by shard (one tensor in memory at a time) into a hidden `.<output>.partial` folder
     next to the output, checking values on the way (finite floats, no E8M0 scale 0xFF = NaN, zero `A_log`
     padding). A manifest there records every finished shard with its sha256, for --resume;
  3. copies the tokenizer / processor files (an official tokenizer of `tiktoken.model` and Moonshot's remote
     class is converted to ours with `convert_kimi3_tokenizer`; a processor config is written when the source
     has none), our code files (the flat modules `save_pretrained` copies) and the model card
     (model_cards/kimi-k3.md, or --model-card) as README.md, and LICENSE / NOTICE files;
  4. verifies (unless --no-verify): every output tensor is read back and compared bit for bit with the source
     (with --dequantize: with the exact dequantisation of the source's MXFP4 bytes), and, when two fp32 copies of
     the model fit in --forward-check-max-gb, the logits of source and output on random tokens are compared;
  5. writes the index and config.json (auto_map -> configuration_kimi3 / modeling_kimi3; with --dequantize the
     quantization_config is dropped) and renames the folder into place, its manifest kept as the mark that
     --overwrite looks for.

A file-system error (disk full, no permission) ends in one line, 'error: <what>: <path>: <reason>', with exit
status 1; the partial folder is kept and --resume continues it.

The source folder is only ever opened for reading. Pickled weights (.bin/.pt) are never loaded. The source's own
remote code (Moonshot's .py files) and README are not carried over: our code and card replace them.
"""

import os
import sys

from kimi3_conversion.cli import add_common_args, parser, run

MODEL_CARDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards")


def build_parser():
    ap = parser(__doc__)
    add_common_args(ap, "Default: keep the source's sharding (same file names).")
    ap.add_argument("--dequantize", action="store_true",
                    help="write the MXFP4 routed experts as bf16 `experts.E.wN.weight` (exact: every MXFP4 value is "
                         "a bf16 value; about 3.8x the bytes) and drop the quantization_config")
    ap.add_argument("--model-card", default=os.path.join(MODEL_CARDS, "kimi-k3.md"), metavar="FILE",
                    help="markdown file written as README.md (default: model_cards/kimi-k3.md)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    from kimi3_conversion.k3_job import build_job  # torch and the model load only past argument parsing

    return run(build_job, args)


if __name__ == "__main__":
    sys.exit(main())
