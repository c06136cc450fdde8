#!/usr/bin/env python
"""A Kimi Linear checkpoint -> this package's layout: what `Kimi3ForCausalLM.save_pretrained` writes (official
tensor names: per-expert `w1/w2/w3`, separate q/k/v convs, `A_log` [1, 1, H, 1], the dense layer under `mlp.`;
the official config keys; our remote-code files and `auto_map`), so that the folder loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` without this package, and in Moonshot's code
and the serving engines.

    python conversion/convert_kimi_linear.py /data/Kimi-Linear-48B-A3B-Instruct ./kimi-linear-kimi3
    python conversion/convert_kimi_linear.py ./saved-by-transformers-native ./kimi-linear-kimi3 --dry-run

Accepted sources: the official Kimi Linear release (model_type "kimi_linear", Moonshot's keys), and what
Transformers' native `KimiLinearForCausalLM.save_pretrained` writes (native config keys; the dense layer under
`block_sparse_moe.`; also the native in-memory forms: stacked q|k|v conv, `gate_up_proj` / `down_proj` expert
stacks, `forget_gate.` names). K3 folders (model_type "kimi_k3") are for convert_k3_to_hf.py.

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

import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402


def build_parser():
    ap = argparse.ArgumentParser(prog="convert_kimi_linear.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(ap, "Default: 50GB, as save_pretrained.")
    return ap


def _group_of(name):
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return f"layer.{int(m.group(1)):06d}" if m else "model"


def build_job(args):
    C._heavy()
    torch = C.torch
    from transformers import GenerationConfig
    from transformers.dynamic_module_utils import custom_object_save

    from transformers_kimi3 import Kimi3ForCausalLM
    from transformers_kimi3.checkpoint import to_memory_layout, to_official_layout

    raw, config = C.load_config(args.source)
    if raw.get("model_type") == "kimi_k3" or isinstance(raw.get("text_config"), dict):
        raise C.checkpoint_error(f"{args.source} is a Kimi K3 folder; use convert_k3_to_hf.py")
    text = C.unquantized(config)
    source = C.Source(args.source, C.value_checks_for(text))
    strict = set(Kimi3ForCausalLM._keep_in_fp32_modules_strict or [])

    def transform(group, tensors):
        named = {n: (t, source.tensors[n].file) for n, t in tensors.items()}
        out = to_official_layout(to_memory_layout(named, text), text)
        return {k: (v.float() if strict & set(k.split(".")) else v) for k, v in out.items()}

    groups = {}
    for info in source.order():
        groups.setdefault(_group_of(info.name), []).append(info.name)
    problems, outs, origin = [], [], {}
    majority = C.majority_float_dtype(source)
    for key in sorted(groups):
        names = groups[key]
        for n in names:
            info = source.tensors[n]
            if info.dtype == "U8":
                raise C.checkpoint_error(f"{n} in {info.file}: MXFP4-packed tensors in a Kimi Linear checkpoint are "
                                         "not supported here; load it with Kimi3ForCausalLM.from_pretrained and "
                                         "save_pretrained instead")
            allowed = C.allowed_float_dtypes(raw, n, majority)
            if info.dtype not in allowed:
                problems.append(f"{n} in {os.path.basename(info.file)}: dtype {info.dtype} but the config implies "
                                f"{' or '.join(allowed)}")
        metas = {n: torch.empty(source.tensors[n].shape, dtype=C.torch_dtype(source.tensors[n].dtype),
                                device="meta") for n in names}
        try:
            planned = transform(key, metas)
        except (RuntimeError, ValueError, IndexError) as e:
            files = sorted({os.path.basename(source.tensors[n].file) for n in names})
            where = f"layer {int(key[6:])}" if key.startswith("layer.") else "the model-level group"
            raise C.checkpoint_error(f"tensors of {where} ({names[0]}, ... in "
                                     f"{', '.join(files)}) cannot be laid out: {e}") from e
        for name, t in planned.items():
            outs.append(C.OutTensor(name, C.st_dtype(t.dtype), tuple(t.shape), "group", tuple(names), key))
            origin[name] = source.tensors[name].file if name in source.tensors else source.tensors[names[0]].file
    expected = C.expected_tensors(config)
    got = {o.name: o for o in outs}
    H = text.kda_num_heads
    for name in sorted(set(expected) - set(got)):
        problems.append(f"{name}: missing (the config implies {list(expected[name])}; not in "
                        f"{C.shard_names(source)})")
    for name in sorted(set(got) - set(expected)):
        problems.append(f"{name} in {os.path.basename(origin[name])}: unexpected tensor (the config implies no "
                        "such tensor)")
    for name in sorted(set(got) & set(expected)):
        shape = got[name].shape
        if shape != expected[name] and not (name.endswith("self_attn.A_log") and math.prod(shape) == H):
            problems.append(f"{name} in {os.path.basename(origin[name])}: shape {list(shape)} but the config "
                            f"implies {list(expected[name])}")
    if problems:
        raise C.checkpoint_error(f"{source.folder}: {len(problems)} problem(s) with the checkpoint:\n  "
                                 + "\n  ".join(problems[:40]))
    dropped = sorted(set(source.tensors) - {s for o in outs for s in o.sources})
    shards = C.shard_plan(outs, args.max_shard_size, None)
    notes = []
    embed = source.tensors.get("model.embed_tokens.weight")
    model_dtype = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(embed.dtype if embed else "",
                                                                              "bfloat16")
    if any(_group_of(n).startswith("layer.") and int(_group_of(n)[6:]) >= text.num_hidden_layers
           for n in source.tensors):
        notes.append("multi-token-prediction layers (index >= num_hidden_layers) are not part of the model and "
                     "were left out")
    if dropped:
        notes.append(f"{len(dropped)} source tensors not used")
    tok_cfg = os.path.join(source.folder, "tokenizer_config.json")
    tok_code = []
    if os.path.isfile(tok_cfg):
        tok_code = [m + ".py" for m in C.auto_map_modules(json.load(open(tok_cfg)))
                    if os.path.isfile(os.path.join(source.folder, m + ".py"))]

    def write_extras(tmp):
        written = C.copy_if_present(source.folder, tmp, [f for f in C.TOKENIZER_FILES if f != "generation_config.json"]
                                    + list(C.LICENSE_FILES) + ["README.md"] + tok_code)
        config.auto_map = None  # the source's auto_map names Moonshot's files, which are not carried over
        with torch.device("meta"):
            meta_model = Kimi3ForCausalLM(text)
        written += [str(p) for p in custom_object_save(meta_model, tmp, config=config) or []]
        try:
            gen = GenerationConfig.from_pretrained(source.folder)
        except OSError:
            gen = GenerationConfig.from_model_config(config)
        gen.save_pretrained(tmp)
        return written + [os.path.join(tmp, "generation_config.json")]

    def write_config(tmp):
        config.architectures = ["Kimi3ForCausalLM"]
        config.dtype = model_dtype
        config.save_pretrained(tmp)

    return C.Job(tool="convert_kimi_linear", source=source, output=args.output, shards=shards,
                 producer=C.Producer(source, transform), write_extras=write_extras, write_config=write_config,
                 forward_check=C.make_forward_check(config, source.files, C.unpacked_params(shards)),
                 options={"max_shard_size": args.max_shard_size}, notes=notes)


def main(argv=None):
    return C.cli_main(build_parser, build_job, argv)


if __name__ == "__main__":
    sys.exit(main())
