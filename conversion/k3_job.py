"""The plan of `convert_k3_to_hf`: an official K3 folder -> the same layout plus our code, card and tokenizer."""

import copy
import os

import torch

from transformers_kimi3.checkpoint import CheckpointError

from kimi3_conversion.config_check import EXPERT_WEIGHT, load_config, match_source, model_class, unquantized
from kimi3_conversion.extra_files import (
    LICENSE_FILES,
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    copy_code,
    copy_if_present,
    write_tokenizer_and_processor,
)
from kimi3_conversion.plan import Job, OutTensor, Producer, shard_plan, unpacked_params
from kimi3_conversion.resume import MANIFEST
from kimi3_conversion.tensor_io import INDEX, Source, dump_json
from kimi3_conversion.verify import make_forward_check, value_checks_for

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


def build_job(args):
    raw, config = load_config(args.source)
    if raw.get("model_type") == "kimi_k3_text":
        raise CheckpointError(f"{args.source} is a text-only Kimi K3 folder (model_type 'kimi_k3_text'), which "
                              "Kimi3ForCausalLM.from_pretrained loads as it is: there is nothing to convert")
    if raw.get("model_type") != "kimi_k3":
        raise CheckpointError(f"{args.source}/config.json has model_type {raw.get('model_type')!r}, not "
                              "'kimi_k3'; for Kimi Linear / text-only checkpoints use convert_kimi_linear.py")
    if not os.path.isfile(args.model_card):
        raise CheckpointError(f"model card {args.model_card} not found")
    source = Source(args.source, value_checks_for(config.get_text_config()))
    match = match_source(source, raw, config)
    outs, keep = _outputs(source, match, args.dequantize)
    shards = shard_plan(outs, args.max_shard_size, keep)
    notes = _notes(source, match, args.dequantize)
    return Job(tool="convert_k3_to_hf", source=source, output=args.output, shards=shards,
               producer=Producer(source),
               write_extras=lambda folder: _write_extras(folder, source, config, args.model_card, notes),
               write_config=lambda folder: _write_config(folder, raw, args.dequantize),
               forward_check=make_forward_check(config, source.files, unpacked_params(shards)),
               options={"dequantize": args.dequantize, "max_shard_size": args.max_shard_size,
                        "index": source.has_index},
               notes=notes)


def _outputs(source, match, dequantize):
    """Every source tensor copied, in storage order; with `dequantize`, each MXFP4 expert becomes one bf16
    `.weight`. Returns ([OutTensor], {output name: source file name})."""
    outs, keep = [], {}
    for info in source.order():
        m = EXPERT_WEIGHT.match(info.name)
        if dequantize and m and m.group("base") in match.packed:
            if m.group("kind") == "weight_scale":
                continue
            base = m.group("base")
            p, s = match.packed[base]
            rows, half = source.tensors[p].shape
            o = OutTensor(base + ".weight", "BF16", (rows, half * 2), "dequant", (p, s))
        else:
            o = OutTensor(info.name, info.dtype, info.shape, "copy", (info.name,))
        outs.append(o)
        keep[o.name] = os.path.basename(info.file)
    return outs, keep


def _notes(source, match, dequantize):
    notes = []
    if match.packed:
        notes.append(f"{len(match.packed)} MXFP4 expert matrices " + (
            "dequantised to bf16" if dequantize else "kept packed, byte for byte"))
    if match.extra:
        notes.append(f"{len(match.extra)} multi-token-prediction tensors copied unchecked")
    known = TOKENIZER_FILES + PROCESSOR_FILES + LICENSE_FILES + ("config.json", INDEX, MANIFEST)
    skipped = sorted(f for f in os.listdir(source.folder) if os.path.isfile(os.path.join(source.folder, f))
                     and f not in known and os.path.join(source.folder, f) not in source.files)
    if skipped:
        notes.append(f"not carried over from the source: {', '.join(skipped)}")
    return notes


def _write_extras(folder, source, config, model_card, notes):
    """Tokenizer and processor files, our code, license files, a generation config and the card as README.md.
    The source's own code (Moonshot's .py files) and README are not carried over: ours replace them."""
    written = write_tokenizer_and_processor(source.folder, folder, notes)
    modules = ["modeling_kimi3"]
    if any(os.path.isfile(os.path.join(folder, f)) for f in PROCESSOR_FILES):
        modules.append("processing_kimi3")
    written += copy_code(folder, *modules)
    written += copy_if_present(source.folder, folder, LICENSE_FILES)
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):  # what save_pretrained would write
        with torch.device("meta"):
            model = model_class(config)(unquantized(config))
        model.generation_config.save_pretrained(folder)
        written.append(os.path.join(folder, "generation_config.json"))
        notes.append("generation_config.json: the source has none; wrote the model's default")
    readme = os.path.join(folder, "README.md")
    with open(model_card, "rb") as f, open(readme, "wb") as g:
        g.write(f.read())
    return sorted(set(written + [readme]))


def _write_config(folder, raw, dequantize):
    """The official config verbatim, with our auto_map (and without quantization_config when dequantised)."""
    data = copy.deepcopy(raw)
    data["auto_map"] = dict(K3_AUTO_MAP)
    text = data.get("text_config")
    if isinstance(text, dict) and "auto_map" in text:
        text["auto_map"] = dict(TEXT_AUTO_MAP)
    if dequantize:
        data.pop("quantization_config", None)
        if isinstance(text, dict):
            text.pop("quantization_config", None)
    dump_json(os.path.join(folder, "config.json"), data)
