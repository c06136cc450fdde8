#!/usr/bin/env python
"""Official Kimi K3 folder -> a folder ready to publish: the same official layout (tensor names, dtypes, MXFP4
routed experts, config keys), plus this package's remote-code files and `auto_map`, the K3 model card as README.md,
and the tokenizer / processor files.

    python conversion/convert_k3_to_hf.py /data/Kimi-K3 /data/Kimi-K3-hf
    python conversion/convert_k3_to_hf.py /data/Kimi-K3 /data/Kimi-K3-bf16 --dequantize --max-shard-size 10GB
    python conversion/convert_k3_to_hf.py /data/Kimi-K3 /data/Kimi-K3-hf --dry-run
    python conversion/convert_k3_to_hf.py /data/Kimi-K3 /data/Kimi-K3-hf --resume     # after an interruption

What it does, in order:
  1. reads config.json (model_type "kimi_k3") and the header of every shard, and checks every tensor's name,
     shape and dtype against what the config implies (our model built on the meta device, in the official layout;
     routed experts either bf16 `weight` or MXFP4 `weight_packed` [out, in/2] + `weight_scale` [out, in/32] U8,
     decided per expert). Every problem is listed with the tensor and the file. Nothing is written before this
     passes;
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
     quantization_config is dropped) and renames the folder into place.

The source folder is only ever opened for reading. Pickled weights (.bin/.pt) are never loaded. The source's own
remote code (Moonshot's .py files) and README are not carried over: our code and card replace them.
"""

import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

K3_AUTO_MAP = {
    "AutoConfig": "configuration_kimi3.Kimi3Config",
    "AutoModel": "modeling_kimi3.Kimi3ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi3.Kimi3ForConditionalGeneration",
    "AutoModelForImageTextToText": "modeling_kimi3.Kimi3ForConditionalGeneration",
}
TEXT_AUTO_MAP = {
    "AutoConfig": "configuration_kimi3.Kimi3TextConfig",
    "AutoModel": "modeling_kimi3.Kimi3Model",
    "AutoModelForCausalLM": "modeling_kimi3.Kimi3ForCausalLM",
}
PROCESSOR_AUTO_MAP = {"AutoProcessor": "processing_kimi3.Kimi3Processor"}
IMAGE_PROCESSOR_AUTO_MAP = {"AutoImageProcessor": "image_processing_kimi3.Kimi3ImageProcessor",
                            "AutoProcessor": "processing_kimi3.Kimi3Processor"}


def build_parser():
    ap = argparse.ArgumentParser(prog="convert_k3_to_hf.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap, "Default: keep the source's sharding (same file names).")
    ap.add_argument("--dequantize", action="store_true",
                    help="write the MXFP4 routed experts as bf16 `experts.E.wN.weight` (exact: every MXFP4 value is "
                         "a bf16 value; about 3.8x the bytes) and drop the quantization_config")
    ap.add_argument("--model-card", default=os.path.join(C.MODEL_CARDS, "kimi-k3.md"), metavar="FILE",
                    help="markdown file written as README.md (default: model_cards/kimi-k3.md)")
    return ap


def _fix_processor_auto_map(data):
    """Processor JSON: point AutoProcessor / AutoImageProcessor at our classes, drop references to other code."""
    if "processor_class" in data or "image_processor" in data:
        data["auto_map"] = dict(PROCESSOR_AUTO_MAP)
    else:
        data["auto_map"] = dict(IMAGE_PROCESSOR_AUTO_MAP)
    if isinstance(data.get("image_processor"), dict):
        data["image_processor"]["auto_map"] = dict(IMAGE_PROCESSOR_AUTO_MAP)
    return data


def write_tokenizer_and_processor(src, tmp, notes):
    written = []
    tok_cfg_path = os.path.join(src, "tokenizer_config.json")
    tok_cfg = json.load(open(tok_cfg_path)) if os.path.isfile(tok_cfg_path) else {}
    official_tok = os.path.isfile(os.path.join(src, "tiktoken.model")) and (
        not os.path.isfile(os.path.join(src, "tokenizer.json")) or C.auto_map_modules(tok_cfg))
    from transformers_kimi3 import tokenization_kimi3

    if official_tok and hasattr(tokenization_kimi3, "convert_kimi3_tokenizer"):
        tokenization_kimi3.convert_kimi3_tokenizer(src, tmp)
        notes.append("tokenizer: converted from tiktoken.model with convert_kimi3_tokenizer (fast tokenizer.json, "
                     "no remote code needed)")
        written += [os.path.join(tmp, f) for f in os.listdir(tmp) if f in C.TOKENIZER_FILES]
        written += C.copy_if_present(src, tmp, ["generation_config.json"])
    else:
        written += C.copy_if_present(src, tmp, C.TOKENIZER_FILES)
    has_tokenizer = any(os.path.isfile(os.path.join(tmp, f)) for f in ("tokenizer.json", "tiktoken.model"))
    for name in C.PROCESSOR_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            C.dump_json(os.path.join(tmp, name), _fix_processor_auto_map(json.load(open(p))))
            written.append(os.path.join(tmp, name))
    if has_tokenizer and not any(os.path.isfile(os.path.join(tmp, f)) for f in C.PROCESSOR_FILES):
        written += _write_default_processor(tmp, notes)
    if not has_tokenizer:
        notes.append("the source has no tokenizer files: none were written")
    return written


def _write_default_processor(tmp, notes):
    import tempfile

    from transformers import AutoTokenizer

    from transformers_kimi3 import Kimi3ImageProcessor, Kimi3Processor

    with tempfile.TemporaryDirectory() as scratch:
        try:
            proc = Kimi3Processor(image_processor=Kimi3ImageProcessor(), tokenizer=AutoTokenizer.from_pretrained(tmp))
            proc.save_pretrained(scratch)
        except (ValueError, OSError) as e:
            notes.append(f"no processor config written: {e}")
            return []
        data = _fix_processor_auto_map(json.load(open(os.path.join(scratch, "processor_config.json"))))
    C.dump_json(os.path.join(tmp, "processor_config.json"), data)
    notes.append("processor_config.json: the source has none; wrote Kimi3Processor's defaults (SPEC 0.10)")
    return [os.path.join(tmp, "processor_config.json")]


def build_job(args):
    C._heavy()
    raw, config = C.load_config(args.source)
    if raw.get("model_type") != "kimi_k3":
        raise C.checkpoint_error(f"{args.source}/config.json has model_type {raw.get('model_type')!r}, not "
                                 "'kimi_k3'; for Kimi Linear / text-only checkpoints use convert_kimi_linear.py")
    if not os.path.isfile(args.model_card):
        raise C.checkpoint_error(f"model card {args.model_card} not found")
    text = C.text_config_of(config)
    source = C.Source(args.source, C.value_checks_for(text))
    match = C.match_source(source, raw, config)
    outs, keep = [], {}
    for info in source.order():
        m = C._EXPERT_WEIGHT.match(info.name)
        if args.dequantize and m and m.group("base") in match.packed:
            if m.group("kind") == "weight_scale":
                continue
            base = m.group("base")
            p, s = match.packed[base]
            rows, half = source.tensors[p].shape
            o = C.OutTensor(base + ".weight", "BF16", (rows, half * 2), "dequant", (p, s))
        else:
            o = C.OutTensor(info.name, info.dtype, info.shape, "copy", (info.name,))
        outs.append(o)
        keep[o.name] = os.path.basename(info.file)
    shards = C.shard_plan(outs, args.max_shard_size, keep)
    notes = []
    if match.packed:
        notes.append(f"{len(match.packed)} MXFP4 expert matrices " + (
            "dequantised to bf16" if args.dequantize else "kept packed, byte for byte"))
    if match.extra:
        notes.append(f"{len(match.extra)} multi-token-prediction tensors copied unchecked")
    skipped = sorted(f for f in os.listdir(source.folder) if os.path.isfile(os.path.join(source.folder, f))
                     and f not in C.TOKENIZER_FILES + C.PROCESSOR_FILES + C.LICENSE_FILES + ("config.json", C.INDEX)
                     and os.path.join(source.folder, f) not in source.files)
    if skipped:
        notes.append(f"not carried over from the source: {', '.join(skipped)}")

    def write_extras(tmp):
        written = write_tokenizer_and_processor(source.folder, tmp, notes)
        modules = ["modeling_kimi3"]
        if any(os.path.isfile(os.path.join(tmp, f)) for f in C.PROCESSOR_FILES):
            modules.append("processing_kimi3")
        written += C.copy_code(tmp, *modules)
        written += C.copy_if_present(source.folder, tmp, C.LICENSE_FILES)
        if not os.path.isfile(os.path.join(tmp, "generation_config.json")):  # what save_pretrained would write
            with C.torch.device("meta"):
                model = C.model_class(config)(C.unquantized(config))
            model.generation_config.save_pretrained(tmp)
            written.append(os.path.join(tmp, "generation_config.json"))
            notes.append("generation_config.json: the source has none; wrote the model's default")
        readme = os.path.join(tmp, "README.md")
        with open(args.model_card, "rb") as f, open(readme, "wb") as g:
            g.write(f.read())
        return sorted(set(written + [readme]))

    def write_config(tmp):
        data = copy.deepcopy(raw)
        data["auto_map"] = dict(K3_AUTO_MAP)
        if isinstance(data.get("text_config"), dict) and "auto_map" in data["text_config"]:
            data["text_config"]["auto_map"] = dict(TEXT_AUTO_MAP)
        if args.dequantize:
            data.pop("quantization_config", None)
            if isinstance(data.get("text_config"), dict):
                data["text_config"].pop("quantization_config", None)
        C.dump_json(os.path.join(tmp, "config.json"), data)

    return C.Job(tool="convert_k3_to_hf", source=source, output=args.output, shards=shards,
                 producer=C.Producer(source), write_extras=write_extras, write_config=write_config,
                 forward_check=C.make_forward_check(config, source.files, C.unpacked_params(shards)),
                 options={"dequantize": args.dequantize, "max_shard_size": args.max_shard_size,
                          "index": source.has_index},
                 notes=notes)


def main(argv=None):
    return C.cli_main(build_parser, build_job, argv)


if __name__ == "__main__":
    sys.exit(main())
