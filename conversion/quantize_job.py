"""The plan of `quantize_mxfp4`: float routed experts -> MXFP4 (compressed-tensors), everything else copied."""

import copy
import os
import shutil

import torch

from transformers_kimi3.checkpoint import CheckpointError
from transformers_kimi3.mxfp4 import GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4

from kimi3_conversion.config_check import EXPERT_WEIGHT, load_config, match_source
from kimi3_conversion.extra_files import auto_map_modules, copy_code
from kimi3_conversion.plan import Job, OutTensor, Producer, shard_plan, unpacked_params
from kimi3_conversion.resume import MANIFEST
from kimi3_conversion.tensor_io import FLOATS, INDEX, Source, dump_json
from kimi3_conversion.verify import make_forward_check, value_checks_for

# compressed-tensors description of K3's MXFP4 routed experts, as released (oracle A holds the same keys)
MXFP4_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                    "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# the tensors K3 releases in fp32 (the others in bf16), by a component of their name
FP32_NAMES = ("A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm", "e_score_correction_bias")
_PICKLES = (".bin", ".pt", ".pth", ".ckpt")


def official_dtype(name):
    return "F32" if any(part in FP32_NAMES for part in name.split(".")) else "BF16"


def build_job(args):
    raw, config = load_config(args.source)
    source = Source(args.source, value_checks_for(config.get_text_config()))
    match = match_source(source, raw, config)
    if not match.unpacked:
        raise CheckpointError(f"{args.source}: no unpacked routed experts (`experts.E.wN.weight`) to quantise"
                              + (" - they are already MXFP4" if match.packed else ""))
    outs, keep = [], {}
    for info in source.order():
        for o in _outputs_of(info, match, args.non_expert_dtype):
            outs.append(o)
            keep[o.name] = os.path.basename(info.file)
    shards = shard_plan(outs, args.max_shard_size, keep)
    notes = [f"{len(match.unpacked)} expert matrices quantised to MXFP4"
             + (f"; {len(match.packed)} already MXFP4, copied" if match.packed else "")]
    carried = sorted(f for f in os.listdir(source.folder) if os.path.isfile(os.path.join(source.folder, f))
                     and f not in ("config.json", INDEX, MANIFEST) and not f.endswith((".safetensors",) + _PICKLES))
    return Job(tool="quantize_mxfp4", source=source, output=args.output, shards=shards,
               producer=Producer(source),
               write_extras=lambda folder: _write_extras(folder, source.folder, carried, raw),
               write_config=lambda folder: _write_config(folder, raw, args.non_expert_dtype),
               forward_check=make_forward_check(config, source.files, unpacked_params(shards), _fake_quant),
               options={"max_shard_size": args.max_shard_size, "non_expert_dtype": args.non_expert_dtype,
                        "index": source.has_index},
               notes=notes)


def _outputs_of(info, match, non_expert_dtype):
    """The output tensors of one source tensor: an unpacked expert -> packed + scale; else a copy or a cast."""
    m = EXPERT_WEIGHT.match(info.name)
    base = m.group("base") if m else None
    if base in match.unpacked:
        rows, cols = info.shape
        if cols % GROUP_SIZE:
            raise CheckpointError(f"{info.name} in {info.file}: {cols} input columns are not whole MXFP4 groups of "
                                  f"{GROUP_SIZE}")
        return [OutTensor(base + ".weight_packed", "U8", (rows, cols // 2), "quant_packed", (info.name,)),
                OutTensor(base + ".weight_scale", "U8", (rows, cols // GROUP_SIZE), "quant_scale", (info.name,))]
    if non_expert_dtype == "official" and info.dtype in FLOATS and official_dtype(info.name) != info.dtype:
        return [OutTensor(info.name, official_dtype(info.name), info.shape, "cast", (info.name,))]
    return [OutTensor(info.name, info.dtype, info.shape, "copy", (info.name,))]


def _write_extras(folder, src, carried, raw):
    """The source's other files (tokenizer, processor, card, code) copied; our code refreshed in a folder of ours."""
    written = []
    for f in carried:
        shutil.copyfile(os.path.join(src, f), os.path.join(folder, f))
        written.append(os.path.join(folder, f))
    if "modeling_kimi3" in auto_map_modules(raw):
        modules = ["modeling_kimi3"] + (["processing_kimi3"] if "processing_kimi3.py" in carried else [])
        written += copy_code(folder, *modules)
    return sorted(set(written))


def _write_config(folder, raw, non_expert_dtype):
    data = copy.deepcopy(raw)
    target = data["text_config"] if isinstance(data.get("text_config"), dict) else data
    target["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    if non_expert_dtype == "official":
        for d in (data, target):
            d.pop("torch_dtype", None)
            d["dtype"] = "bfloat16"
    dump_json(os.path.join(folder, "config.json"), data)


def _fake_quant(sd):
    """The source model as the output computes: experts quantised and dequantised (for the forward check)."""
    for k, v in sd.items():
        if k.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".experts." in k + ".":
            sd[k] = dequantize_mxfp4(*quantize_mxfp4(v.float()), dtype=torch.float32)
    return sd
