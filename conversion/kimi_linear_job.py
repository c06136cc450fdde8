"""The plan of `convert_kimi_linear`: a Kimi Linear checkpoint -> what `Kimi3ForCausalLM.save_pretrained` writes,
converted one decoder layer at a time."""

import json
import math
import os
import re

import torch
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from transformers_kimi3 import Kimi3ForCausalLM
from transformers_kimi3.checkpoint import CheckpointError, to_memory_layout, to_official_layout

from kimi3_conversion.config_check import (
    allowed_float_dtypes,
    expected_tensors,
    load_config,
    majority_float_dtype,
    problems_error,
    shard_names,
    unquantized,
)
from kimi3_conversion.extra_files import LICENSE_FILES, TOKENIZER_FILES, auto_map_modules, copy_if_present
from kimi3_conversion.k3_job import TEXT_AUTO_MAP
from kimi3_conversion.plan import Job, OutTensor, Producer, shard_plan, unpacked_params
from kimi3_conversion.tensor_io import Source, st_dtype, torch_dtype
from kimi3_conversion.verify import make_forward_check, value_checks_for

_CONFIG_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _group_of(name):
    """The unit converted at once: one decoder layer, or the model-level tensors."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return f"layer.{int(m.group(1)):06d}" if m else "model"


def _layer_index(group):
    return int(group[len("layer."):]) if group.startswith("layer.") else None


def build_job(args):
    raw, config = load_config(args.source)
    if raw.get("model_type") == "kimi_k3" or isinstance(raw.get("text_config"), dict):
        raise CheckpointError(f"{args.source} is a Kimi K3 folder; use convert_k3_to_hf.py (kimi3-convert-k3)")
    if raw.get("model_type") == "kimi_k3_text":
        raise CheckpointError(f"{args.source} is a text-only Kimi K3 folder (model_type 'kimi_k3_text'), which "
                              "Kimi3ForCausalLM.from_pretrained loads as it is: there is nothing to convert")
    text = unquantized(config)
    source = Source(args.source, value_checks_for(text))
    strict = set(Kimi3ForCausalLM._keep_in_fp32_modules_strict or [])

    def transform(group, tensors):
        named = {n: (t, source.tensors[n].file) for n, t in tensors.items()}
        out = to_official_layout(to_memory_layout(named, text), text)
        return {k: (v.float() if strict & set(k.split(".")) else v) for k, v in out.items()}

    outs, origin, problems = _plan(source, raw, transform)
    problems += _config_problems(source, config, outs, origin)
    if problems:
        raise problems_error(source, problems)
    shards = shard_plan(outs, args.max_shard_size, None)
    embed = source.tensors.get("model.embed_tokens.weight")
    model_dtype = _CONFIG_DTYPES.get(embed.dtype if embed else "", "bfloat16")
    return Job(tool="convert_kimi_linear", source=source, output=args.output, shards=shards,
               producer=Producer(source, transform),
               write_extras=lambda folder: _write_extras(folder, source.folder, config, text),
               write_config=lambda folder: _write_config(folder, config, model_dtype),
               forward_check=make_forward_check(config, source.files, unpacked_params(shards)),
               options={"max_shard_size": args.max_shard_size}, notes=_notes(source, outs, text))


def _plan(source, raw, transform):
    """Each group converted on meta tensors: ([OutTensor], {output name: the source file it comes from}, the
    dtypes the config does not imply as problems). MXFP4 tensors are refused."""
    groups = {}
    for info in source.order():
        groups.setdefault(_group_of(info.name), []).append(info.name)
    problems, outs, origin = [], [], {}
    majority = majority_float_dtype(source)
    for key in sorted(groups):
        names = groups[key]
        for n in names:
            info = source.tensors[n]
            if info.dtype == "U8":
                raise CheckpointError(f"{n} in {info.file}: MXFP4-packed tensors in a Kimi Linear checkpoint are "
                                      "not supported here; load it with Kimi3ForCausalLM.from_pretrained and "
                                      "save_pretrained instead")
            allowed = allowed_float_dtypes(raw, n, majority)
            if info.dtype not in allowed:
                problems.append(f"{n} in {os.path.basename(info.file)}: dtype {info.dtype} but the config implies "
                                f"{' or '.join(allowed)}")
        metas = {n: torch.empty(source.tensors[n].shape, dtype=torch_dtype(source.tensors[n].dtype), device="meta")
                 for n in names}
        try:
            planned = transform(key, metas)
        except (RuntimeError, ValueError, IndexError) as e:
            files = sorted({os.path.basename(source.tensors[n].file) for n in names})
            where = "the model-level group" if _layer_index(key) is None else f"layer {_layer_index(key)}"
            raise CheckpointError(f"tensors of {where} ({names[0]}, ... in {', '.join(files)}) cannot be laid "
                                  f"out: {e}") from e
        for name, t in planned.items():
            outs.append(OutTensor(name, st_dtype(t.dtype), tuple(t.shape), "group", tuple(names), key))
            origin[name] = source.tensors[name if name in source.tensors else names[0]].file
    return outs, origin, problems


def _config_problems(source, config, outs, origin):
    """Every output name and shape against what the config implies: the problems found."""
    expected = expected_tensors(config)
    got = {o.name: o for o in outs}
    heads = config.get_text_config().kda_num_heads
    problems = []
    for name in sorted(set(expected) - set(got)):
        problems.append(f"{name}: missing (the config implies {list(expected[name])}; not in {shard_names(source)})")
    for name in sorted(set(got) - set(expected)):
        problems.append(f"{name} in {os.path.basename(origin[name])}: unexpected tensor (the config implies no "
                        "such tensor)")
    for name in sorted(set(got) & set(expected)):
        shape = got[name].shape
        if shape != expected[name] and not (name.endswith("self_attn.A_log") and math.prod(shape) == heads):
            problems.append(f"{name} in {os.path.basename(origin[name])}: shape {list(shape)} but the config "
                            f"implies {list(expected[name])}")
    return problems


def _notes(source, outs, text):
    notes = []
    layers = {_layer_index(_group_of(n)) for n in source.tensors} - {None}
    if any(i >= text.num_hidden_layers for i in layers):
        notes.append("multi-token-prediction layers (index >= num_hidden_layers) are not part of the model and "
                     "were left out")
    dropped = set(source.tensors) - {s for o in outs for s in o.sources}
    if dropped:
        notes.append(f"{len(dropped)} source tensors not used")
    return notes


def _write_extras(folder, src, config, text):
    """Tokenizer files (with any tokenizer code they reference), card and license files, our code files and a
    generation config."""
    tok_cfg = os.path.join(src, "tokenizer_config.json")
    tok_code = []
    if os.path.isfile(tok_cfg):
        tok_code = [m + ".py" for m in auto_map_modules(json.load(open(tok_cfg)))
                    if os.path.isfile(os.path.join(src, m + ".py"))]
    names = [f for f in TOKENIZER_FILES if f != "generation_config.json"] + list(LICENSE_FILES) + ["README.md"]
    written = copy_if_present(src, folder, names + tok_code)
    config.auto_map = None  # the source's auto_map names Moonshot's files, which are not carried over
    with torch.device("meta"):
        meta_model = Kimi3ForCausalLM(text)
    written += [str(p) for p in custom_object_save(meta_model, folder, config=config) or []]
    config.auto_map = dict(TEXT_AUTO_MAP)  # as Kimi3ForCausalLM.save_pretrained: AutoModel gives the base model
    try:
        gen = GenerationConfig.from_pretrained(src)
    except OSError:
        gen = GenerationConfig.from_model_config(config)
    gen.save_pretrained(folder)
    return written + [os.path.join(folder, "generation_config.json")]


def _write_config(folder, config, model_dtype):
    config.architectures = ["Kimi3ForCausalLM"]
    config.dtype = model_dtype
    config.save_pretrained(folder)
