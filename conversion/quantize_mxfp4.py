#!/usr/bin/env python
"""A bf16 / fp32 checkpoint in the official layout (what `save_pretrained` of this package writes, or
convert_k3_to_hf.py --dequantize) -> the same checkpoint with MXFP4 routed experts, as K3 is released.

    python conversion/quantize_mxfp4.py ./k3-finetuned-bf16 ./k3-finetuned-mxfp4
    python conversion/quantize_mxfp4.py ./k3-finetuned-fp32 ./k3-mxfp4 --non-expert-dtype official --dry-run

Every routed expert matrix `...experts.E.wN.weight` [out, in] becomes `weight_packed` (U8 [out, in/2], two E2M1
codes per byte, low nibble = even column) and `weight_scale` (U8 [out, in/32], E8M0), quantised with the OCP MX
v1.0 rule of `transformers_kimi3.mxfp4.quantize_mxfp4` (scale 2^(floor(log2 amax) - 2), round to nearest even,
saturating at 6); the result is byte-identical to compressed-tensors' `mxfp4-pack-quantized` packing. The
compressed-tensors `quantization_config` (the released keys and values) is written into `text_config` (K3) or
the top level (text-only configs). Experts that are already MXFP4 are copied byte for byte. Everything else is
copied unchanged, or with --non-expert-dtype official cast to the released dtypes (bf16; fp32 for the KDA
conv / A_log / dt_bias / o_norm tensors and the router bias).

Same safety as convert_k3_to_hf.py: every name, shape and dtype checked against the config before anything is
written, values checked while streaming (finite, in/32 whole groups), one tensor in memory at a time, a hidden
partial folder renamed into place at the end, --resume, and a final verification (each packed tensor equals the
quantisation of the source tensor, bit for bit; logits of the output equal those of the source model with its
experts quantised and dequantised in memory, when it fits in --forward-check-max-gb). Other files of the source
(tokenizer, processor, card, code) are carried over; our code files are refreshed from the installed package.
"""

import argparse
import copy
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

FP32_NAMES = ("A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm", "e_score_correction_bias")


def build_parser():
    ap = argparse.ArgumentParser(prog="quantize_mxfp4.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap, "Default: keep the source's sharding (same file names; the files get smaller).")
    ap.add_argument("--non-expert-dtype", choices=("keep", "official"), default="keep",
                    help="keep: every other tensor unchanged (default); official: cast them to the released dtypes "
                         "(bf16, fp32 for the KDA conv/A_log/dt_bias/o_norm and the router bias) and set the "
                         "config's dtype to bfloat16")
    return ap


def _official_dtype(name):
    return "F32" if any(part in FP32_NAMES for part in name.split(".")) else "BF16"


def build_job(args):
    C._heavy()
    raw, config = C.load_config(args.source)
    text = C.text_config_of(config)
    source = C.Source(args.source, C.value_checks_for(text))
    match = C.match_source(source, raw, config)
    if not match.unpacked:
        raise C.checkpoint_error(f"{args.source}: no unpacked routed experts (`experts.E.wN.weight`) to quantise"
                                 + (" - they are already MXFP4" if match.packed else ""))
    outs, keep = [], {}
    for info in source.order():
        m = C._EXPERT_WEIGHT.match(info.name)
        base = m.group("base") if m else None
        if base in match.unpacked:
            rows, cols = info.shape
            if cols % 32:
                raise C.checkpoint_error(f"{info.name} in {info.file}: {cols} input columns are not whole MXFP4 "
                                         "groups of 32")
            new = [C.OutTensor(base + ".weight_packed", "U8", (rows, cols // 2), "quant_packed", (info.name,)),
                   C.OutTensor(base + ".weight_scale", "U8", (rows, cols // 32), "quant_scale", (info.name,))]
        elif args.non_expert_dtype == "official" and info.dtype in C.FLOATS \
                and _official_dtype(info.name) != info.dtype:
            new = [C.OutTensor(info.name, _official_dtype(info.name), info.shape, "cast", (info.name,))]
        else:
            new = [C.OutTensor(info.name, info.dtype, info.shape, "copy", (info.name,))]
        for o in new:
            outs.append(o)
            keep[o.name] = os.path.basename(info.file)
    shards = C.shard_plan(outs, args.max_shard_size, keep)
    notes = [f"{len(match.unpacked)} expert matrices quantised to MXFP4"
             + (f"; {len(match.packed)} already MXFP4, copied" if match.packed else "")]
    carried = sorted(f for f in os.listdir(source.folder) if os.path.isfile(os.path.join(source.folder, f))
                     and f not in ("config.json", C.INDEX) and not f.endswith(".safetensors")
                     and not f.endswith((".bin", ".pt", ".pth", ".ckpt")))

    def write_extras(tmp):
        written = []
        for f in carried:
            shutil.copyfile(os.path.join(source.folder, f), os.path.join(tmp, f))
            written.append(os.path.join(tmp, f))
        if "modeling_kimi3" in C.auto_map_modules(raw):  # a folder of ours: refresh its code
            modules = ["modeling_kimi3"] + (["processing_kimi3"] if "processing_kimi3.py" in carried else [])
            written += C.copy_code(tmp, *modules)
        return sorted(set(written))

    def write_config(tmp):
        data = copy.deepcopy(raw)
        target = data["text_config"] if isinstance(data.get("text_config"), dict) else data
        target["quantization_config"] = copy.deepcopy(C.MXFP4_QUANTIZATION_CONFIG)
        if args.non_expert_dtype == "official":
            for d in (data, target):
                d.pop("torch_dtype", None)
                d["dtype"] = "bfloat16"
        C.dump_json(os.path.join(tmp, "config.json"), data)

    def fake_quant(sd):  # the source model as the output should compute: experts quantised and dequantised
        from transformers_kimi3.mxfp4 import dequantize_mxfp4, quantize_mxfp4

        for k, v in sd.items():
            if k.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".experts." in k + ".":
                sd[k] = dequantize_mxfp4(*quantize_mxfp4(v.float()), dtype=C.torch.float32)
        return sd

    return C.Job(tool="quantize_mxfp4", source=source, output=args.output, shards=shards,
                 producer=C.Producer(source), write_extras=write_extras, write_config=write_config,
                 forward_check=C.make_forward_check(config, source.files, C.unpacked_params(shards), fake_quant),
                 options={"max_shard_size": args.max_shard_size, "non_expert_dtype": args.non_expert_dtype,
                          "index": source.has_index},
                 notes=notes)


def main(argv=None):
    return C.cli_main(build_parser, build_job, argv)


if __name__ == "__main__":
    sys.exit(main())
