#!/usr/bin/env python
"""A Kimi Linear checkpoint -> this package's layout: what `Kimi3ForCausalLM.save_pretrained` writes (official
tensor names: per-expert `w1/w2/w3`, separate q/k/v convs, `A_log` [1, 1, H, 1], the dense layer under `mlp.`;
the official config keys; our remote-code files and `auto_map`), so that the folder loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` without this package, and in Moonshot's code
and the serving engines.

    kimi3-convert-kimi-linear /data/Kimi-Linear-48B-A3B-Instruct ./kimi-linear-kimi3
    kimi3-convert-kimi-linear ./saved-by-transformers-native ./kimi-linear-kimi3 --dry-run
    python conversion/convert_kimi_linear.py ...                  # the same, from a checkout

Accepted sources: the official Kimi Linear release (model_type "kimi_linear", Moonshot's keys), and what
Transformers' native `KimiLinearForCausalLM.save_pretrained` writes (native config keys; the dense layer under
`block_sparse_moe.`; also the native in-memory forms: stacked q|k|v conv, `gate_up_proj` / `down_proj` expert
stacks, `forget_gate.` names). K3 folders (model_type "kimi_k3") are for kimi3-convert-k3.

The conversion runs one decoder layer at a time (`transformers_kimi3.checkpoint.to_memory_layout` then
`to_official_layout`, first on meta tensors to plan and check every output name and shape against the config, then
on the real tensors while streaming), keeps the source dtypes (the fp32-kept KDA/router tensors are upcast to fp32,
as `save_pretrained` writes them), and shards like `save_pretrained` (50GB unless --max-shard-size). Tokenizer
files, generation config, card and license files are carried over (with any tokenizer code they reference).

Verification (unless --no-verify): every output tensor is read back and compared bit for bit with the
conversion of the source, and, when two fp32 copies fit in --forward-check-max-gb, the logits of the model loaded
from the source and from the output are compared on random tokens. Same safety as the other converters: checks
before writing, a hidden partial folder renamed into place, --resume, --dry-run, source opened read-only.
"""

import sys

from kimi3_conversion.cli import add_common_args, parser, run


def build_parser():
    ap = parser(__doc__)
    add_common_args(ap, "Default: 50GB, as save_pretrained.")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    from kimi3_conversion.kimi_linear_job import build_job  # torch and the model load only past argument parsing

    return run(build_job, args)


if __name__ == "__main__":
    sys.exit(main())
