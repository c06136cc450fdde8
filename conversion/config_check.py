"""What a config implies for a checkpoint (tensor names, shapes, dtypes), and a source checked against it.

The expectation is computed, not written down: our model is built on the meta device from the config and its
state dict mapped through `transformers_kimi3.checkpoint.to_official_layout`, so it follows the model exactly.
"""

import copy
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from transformers_kimi3 import Kimi3Config, Kimi3ForCausalLM, Kimi3ForConditionalGeneration, Kimi3TextConfig
from transformers_kimi3.checkpoint import CheckpointError, to_official_layout

from kimi3_conversion.tensor_io import FLOATS

CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
EXPERT_WEIGHT = re.compile(r"^(?P<base>.*\.experts\.\d+\.w[123])\.(?P<kind>weight|weight_packed|weight_scale)$")
_LAYER = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
_MAX_LISTED = 40  # problems listed in one error


def load_config(folder):
    """(raw config.json, our config object): Kimi3Config for an official K3 folder, else Kimi3TextConfig."""
    path = os.path.join(folder, "config.json")
    try:
        raw = json.load(open(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the config ({e})") from e
    try:
        if raw.get("model_type") == "kimi_k3":
            return raw, Kimi3Config.from_pretrained(folder)
        return raw, Kimi3TextConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def model_class(config):
    return Kimi3ForConditionalGeneration if isinstance(config, Kimi3Config) else Kimi3ForCausalLM


def unquantized(config):
    """A copy of `config` whose model holds float experts (the layout every expectation is stated in)."""
    cfg = copy.deepcopy(config)
    cfg.get_text_config().checkpoint_quantization_config = None
    return cfg


def expected_tensors(config):
    """Official tensor name -> shape, from the config alone. Routed experts appear unpacked
    (`experts.E.wN.weight` [out, in]) whatever the checkpoint stores."""
    cfg = unquantized(config)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    sd = model.state_dict()
    prefix = "language_model." if any(k.startswith("language_model.") for k in sd) else ""
    text = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    out = {prefix + k: tuple(v.shape) for k, v in to_official_layout(text, cfg.get_text_config()).items()}
    out.update({k: tuple(v.shape) for k, v in sd.items() if not k.startswith(prefix)})
    return out


def allowed_float_dtypes(raw_config, name, fallback=None):
    """What the config implies for a floating-point tensor: its `dtype` (or F32, which every tensor may keep). When
    the config names no dtype, the checkpoint's majority dtype (`fallback`) takes its place."""
    cfg = raw_config
    text = raw_config.get("text_config")
    if not name.startswith(("vision_tower.", "mm_projector.")) and isinstance(text, dict):
        cfg = text if (text.get("dtype") or text.get("torch_dtype")) else raw_config
    d = cfg.get("dtype") or cfg.get("torch_dtype") or raw_config.get("dtype") or raw_config.get("torch_dtype")
    if d in CONFIG_DTYPES:
        return tuple(dict.fromkeys((CONFIG_DTYPES[d], "F32")))
    if fallback is not None:
        return tuple(dict.fromkeys((fallback, "F32")))
    return FLOATS


def majority_float_dtype(source):
    """The dtype most tensors are stored in, F32 aside (for configs that do not say)."""
    counts = {}
    for t in source.tensors.values():
        if t.dtype in FLOATS and t.dtype != "F32":
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else None


def shard_names(source):
    """'a.safetensors, b.safetensors ... of <folder>', for 'not in ...' messages."""
    names = [os.path.basename(f) for f in source.files]
    listed = ", ".join(names[:3]) + (f" or {len(names) - 3} more shards" if len(names) > 3 else "")
    return f"{listed} of {source.folder}"


def problems_error(source, problems):
    """One error listing every problem found (each names the tensor and its file)."""
    more = f"\n  ... {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return CheckpointError(f"{source.folder}: {len(problems)} problem(s) with the checkpoint:\n  "
                           + "\n  ".join(problems[:_MAX_LISTED]) + more)


@dataclass
class Match:
    """Source tensors matched with the config's expectation."""
    plain: list  # source names of non-expert (or unpacked expert) tensors
    packed: dict  # expert base -> (packed name, scale name)
    unpacked: dict  # expert base -> weight name
    extra: list  # tensors passed through unchecked (multi-token-prediction layers)


class _Matcher:
    def __init__(self, source, raw_config, config):
        text = config.get_text_config()
        self.source, self.raw = source, raw_config
        self.heads = text.kda_num_heads
        self.majority = majority_float_dtype(source)
        self.expert_note = (f" (config: moe_intermediate_size={text.moe_intermediate_size}, routed_expert_hidden_"
                            f"size={text.routed_expert_hidden_size}, hidden_size={text.hidden_size})")
        self.problems, self.seen = [], set()
        self.match = Match([], {}, {}, [])

    def where(self, name):
        return f"{name} in {os.path.basename(self.source.tensors[name].file)}"

    def check_float(self, name, shape, note=""):
        info = self.source.tensors[name]
        if info.shape != tuple(shape):
            self.problems.append(f"{self.where(name)}: shape {list(info.shape)} but the config implies "
                                 f"{list(shape)}{note}")
        allowed = allowed_float_dtypes(self.raw, name, self.majority)
        if info.dtype not in allowed:
            self.problems.append(f"{self.where(name)}: dtype {info.dtype} but the config implies "
                                 f"{' or '.join(allowed)}")

    def expert(self, name, base, shape):
        """An expert matrix [out, in]: bf16 `.weight`, or MXFP4 `.weight_packed` [out, in/2] + `.weight_scale`
        [out, in/32] U8, decided per expert."""
        tensors = self.source.tensors
        p, s = base + ".weight_packed", base + ".weight_scale"
        if p in tensors or s in tensors:
            self.seen.update((p, s))
            for n, want in ((p, (shape[0], shape[1] // 2)), (s, (shape[0], shape[1] // 32))):
                if n not in tensors:
                    partner = os.path.basename(tensors[p if n == s else s].file)
                    self.problems.append(f"{n}: missing (its MXFP4 partner is in {partner})")
                    continue
                info = tensors[n]
                if shape[1] % 32 or info.shape != want:
                    self.problems.append(f"{self.where(n)}: shape {list(info.shape)} but the config implies "
                                         f"{list(want)} for an MXFP4 [{shape[0]}, {shape[1]}] expert matrix"
                                         f"{self.expert_note}")
                if info.dtype != "U8":
                    self.problems.append(f"{self.where(n)}: dtype {info.dtype} but MXFP4 tensors are U8")
            self.match.packed[base] = (p, s)
        elif name in tensors:
            self.seen.add(name)
            self.check_float(name, shape, self.expert_note)
            self.match.unpacked[base] = name
        else:
            self.problems.append(f"{name}: missing (the config implies a {list(shape)} expert matrix, stored as "
                                 f".weight or MXFP4 .weight_packed/.weight_scale; not in {shard_names(self.source)})")

    def plain(self, name, shape):
        tensors = self.source.tensors
        if name not in tensors:
            self.problems.append(f"{name}: missing (the config implies {list(shape)}; not in "
                                 f"{shard_names(self.source)})")
            return
        self.seen.add(name)
        if name.endswith("self_attn.A_log") and math.prod(tensors[name].shape) == self.heads:
            shape = tensors[name].shape  # [H] or [1, 1, H, 1] instead of the padded [head_dim]: all read
        self.check_float(name, shape)
        self.match.plain.append(name)

    def leftovers(self, num_layers, num_nextn):
        for name in sorted(set(self.source.tensors) - self.seen):
            layer = _LAYER.match(name)
            if layer and num_layers <= int(layer.group(1)) < num_layers + num_nextn:
                self.match.extra.append(name)  # multi-token-prediction layers: kept, not checked
            else:
                self.problems.append(f"{self.where(name)}: unexpected tensor (the config implies no such tensor)")


def match_source(source, raw_config, config):
    """Check every source tensor's name, shape and dtype against the config; one error lists every problem."""
    m = _Matcher(source, raw_config, config)
    for name, shape in expected_tensors(config).items():
        expert = EXPERT_WEIGHT.match(name)
        if expert:
            m.expert(name, expert.group("base"), shape)
        else:
            m.plain(name, shape)
    text = config.get_text_config()
    m.leftovers(text.num_hidden_layers, getattr(text, "num_nextn_predict_layers", 0) or 0)
    if m.problems:
        raise problems_error(source, m.problems)
    return m.match
