#!/usr/bin/env python
"""A bf16 / fp32 checkpoint in the official layout (what `save_pretrained` of this package writes, or
kimi3-convert-k3 --dequantize) -> the same checkpoint with MXFP4 routed experts, as K3 is released.

    kimi3-quantize-mxfp4 ./k3-finetuned-bf16 ./k3-finetuned-mxfp4     # or: python conversion/quantize_mxfp4.py ...
    kimi3-quantize-mxfp4 ./k3-finetuned-fp32 ./k3-mxfp4 --non-expert-dtype official --dry-run

Every routed expert matrix `...experts.E.wN.weight` [out, in] becomes `weight_packed` (U8 [out, in/2], two E2M1
codes per byte, low nibble = even column) and `weight_scale` (U8 [out, in/32], E8M0), quantised with the OCP MX
v1.0 rule of `transformers_kimi3.mxfp4.quantize_mxfp4` (scale 2^(floor(log2 amax) - 2), round to nearest even,
saturating at 6); the result is byte-identical to compressed-tensors' `mxfp4-pack-quantized` packing. The
compressed-tensors `quantization_config` (the released keys and values) is written into `text_config` (K3) or
the top level (text-only configs). Experts that are already MXFP4 are copied byte for byte. Everything else is
copied unchanged, or with --non-expert-dtype official cast to the released dtypes (bf16; fp32 for the KDA
conv / A_log / dt_bias / o_norm tensors and the router bias).

Same safety as kimi3-convert-k3: every name, shape and dtype checked against the config before anything is
written, values checked while streaming (finite, in/32 whole groups), one tensor in memory at a time, a hidden
partial folder renamed into place at the end, --resume, and a final verification (each packed tensor equals the
quantisation of the source tensor, bit for bit; logits of the output equal those of the source model with its
experts quantised and dequantised in memory, when it fits in --forward-check-max-gb). Other files of the source
(tokenizer, processor, card, code) are carried over; our code files are refreshed from the installed package.
"""

import sys

from kimi3_conversion.cli import add_common_args, parser, run


def build_parser():
    ap = parser(__doc__)
    add_common_args(ap, "Default: keep the source's sharding (same file names; the files get smaller).")
    ap.add_argument("--non-expert-dtype", choices=("keep", "official"), default="keep",
                    help="keep: every other tensor unchanged (default); official: cast them to the released dtypes "
                         "(bf16, fp32 for the KDA conv/A_log/dt_bias/o_norm and the router bias) and set the "
                         "config's dtype to bfloat16")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    from kimi3_conversion.quantize_job import build_job  # torch and the model load only past argument parsing

    return run(build_job, args)


if __name__ == "__main__":
    sys.exit(main())
