"""The official checkpoint layout <-> our in-memory layout, with checks that name the tensor and the file.

On disk (official K3 / Kimi Linear, also what Transformers' native Kimi Linear saves): per-expert
`experts.{e}.w{1,2,3}.weight` (bf16) or `.weight_packed`/`.weight_scale` (MXFP4, compressed-tensors), separate
q/k/v convs, `A_log` padded ([head_dim], K3) or [1,1,H,1] (Kimi Linear), a `language_model.` prefix in K3 folders.
In memory: experts stacked per layer (`experts.w1` [E, I, D_in]), `A_log` [H].
What is MXFP4-packed is decided per tensor from the checkpoint itself: the released `ignore` list is incomplete.
"""

import json
import logging
import os
import re
from collections import defaultdict

import torch
from safetensors import SafetensorError, safe_open

from .mxfp4 import GROUP_SIZE, check_mxfp4, dequantize_mxfp4, quantize_mxfp4

logger = logging.getLogger("transformers_kimi3")

TEXT_PREFIX = "language_model."
HEAD = "lm_head."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|"
                     r"weight_scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class CheckpointError(ValueError):
    pass


# ----------------------------------------------------------------------------- reading
def resolve_folder(name_or_path, **hub_kwargs):
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    keys = ("cache_dir", "force_download", "local_files_only", "token", "revision")
    return snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors", "*.py", "*.model",
                                                                "*.jinja", "*.txt", "*.md"],
                             **{k: hub_kwargs[k] for k in keys if hub_kwargs.get(k) is not None})


def weight_files(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            weight_map = json.load(open(index))["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
        if missing:
            raise CheckpointError(f"{index} lists shards that are not in {folder}: {missing}")
        return [os.path.join(folder, f) for f in files]
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    pickles = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    raise CheckpointError(f"No safetensors weights in {folder}" + (
        f" (found {pickles}: pickled weights are never loaded; convert them to safetensors)" if pickles else ""))


def read_tensors(files, check_finite=True, num_experts=None):
    """name -> (tensor, file). Truncated or corrupt files raise an error naming the file; with `check_finite`, so
    does a floating-point tensor holding NaN or Inf (`check_finite_values`), checked as each tensor is read.

    Host memory: safetensors maps each file, and the map (every page of it that was read) lives as long as any tensor
    of the file does. With `num_experts` (`from_pretrained`), each routed expert's tensor (`experts.{e}.w{1,2,3}.*`)
    is copied as it is read into its slot of one [num_experts, ...] buffer per expert matrix, which `_stack_experts`
    then takes as it is, and the other tensors of a file holding such experts are copied too, so the file's map is
    released once it is read: resident memory grows by the model's bytes plus one file's pages, not by the whole
    folder on top of the model. A file without routed experts stays mapped (its pages are the model's tensors)."""
    out, slots = {}, {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
                copied = num_experts is not None and any(_stackable(n, num_experts) for n in names)
                for name in names:
                    if name in out:
                        raise CheckpointError(f"tensor {name} appears in both {out[name][1]} and {path}")
                    t = f.get_tensor(name)
                    if check_finite:
                        check_finite_values(name, t, path)
                    if copied:
                        t = _into_slot(slots, name, t, num_experts)
                    out[name] = (t, path)
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    return out


_ANY_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123]\.(?:weight|weight_packed|weight_scale))$")


def _stackable(name, num_experts):
    m = _ANY_EXPERT.match(name)
    return m is not None and int(m.group(2)) < num_experts


def _into_slot(slots, name, t, num_experts):
    """`t` copied into its expert's slot of the buffer of its expert matrix (made at the first expert read, of that
    expert's shape and dtype), or, where it has no slot (not a routed expert's tensor, an index past
    `num_experts`, a shape or dtype unlike the first expert's: `_stack_experts` names those), an owned copy. F16 / F64
    experts are converted afterwards (`convert_float_dtypes`), so they get owned copies too."""
    m = _ANY_EXPERT.match(name)
    if m is None or int(m.group(2)) >= num_experts or t.dtype in (torch.float16, torch.float64):
        return t.clone()
    key = (m.group(1), m.group(3))
    if key not in slots:
        # on the tensor's own device, not a device context's (from_pretrained under `torch.device("meta")` is refused
        # by Transformers with its own message)
        slots[key] = torch.empty((num_experts, *t.shape), dtype=t.dtype, device=t.device)
    buf = slots[key]
    if buf.shape[1:] != t.shape or buf.dtype != t.dtype:
        return t.clone()
    slot = buf[int(m.group(2))]
    slot.copy_(t)
    return slot


def _stack(tensors):
    """torch.stack(tensors), without a copy where they are the slots of one buffer in order (`read_tensors`)."""
    base = tensors[0]._base
    if base is not None and base.is_contiguous() and base.shape[0] == len(tensors) and all(
            t._base is base and t.dtype == base.dtype and t.shape == base.shape[1:]
            and t.data_ptr() == base[i].data_ptr() for i, t in enumerate(tensors)):
        return base
    return torch.stack(tensors)


def check_finite_values(name, t, path, note=""):
    """Refuse NaN / Inf in a floating-point tensor, naming the tensor and its file.

    `torch.aminmax` reads the tensor once and allocates nothing (NaN propagates to both ends, +-Inf lands on one);
    only a tensor that fails is scanned again to locate its first bad value. Cost on a 1.4 GB bf16 shard on a 2-core
    CPU: 0.4 s for aminmax against 9-11 s for `torch.isfinite(t).all()`; see `load_pretrained` for the share of
    the load time."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return
    bad = ~torch.isfinite(t)
    first = [int(i) for i in bad.nonzero()[0]]
    raise CheckpointError(f"{name} in {path}: {int(bad.sum())} non-finite values (NaN or Inf; first at {first})"
                          f"{note}; corrupt data")


# ----------------------------------------------------------------------------- official -> memory
def to_memory_layout(tensors, config):
    """Official text tensors (without the `language_model.` prefix) -> our text-model state dict.
    Packed experts stay packed when the config keeps them (`checkpoint_quantization_config`), else dequantised."""
    H, K = config.kda_num_heads, config.kda_head_dim
    sparse = set(i for i, t in enumerate(config.mlp_layer_types) if t == "sparse")
    out, experts = {}, defaultdict(dict)
    for name, (t, path) in tensors.items():
        m = _EXPERT.match(name)
        if m:
            experts[(m.group(1), m.group(3))][(int(m.group(2)), m.group(4))] = (t, path, name)
            continue
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            continue  # multi-token-prediction layers (num_nextn_predict_layers) are not part of the model
        if layer:
            i, rest = int(layer.group(1)), layer.group(2)
            for new, pats in _RENAMES:
                for pat in pats:
                    rest = re.sub(pat, new, rest)
            if i in sparse:
                rest = rest.replace("mlp.", "block_sparse_moe.", 1) if rest.startswith("mlp.") else rest
            else:  # native Kimi Linear saves the dense layer under block_sparse_moe.*
                rest = rest.replace("block_sparse_moe.", "mlp.", 1) if rest.startswith("block_sparse_moe.") else rest
            name = f"model.layers.{i}.{rest}"
            if rest.endswith("self_attn.A_log"):
                t = _narrow_a_log(t, H, name, path)
            elif rest.endswith("self_attn.conv1d.weight"):  # native in-memory layout: q|k|v stacked
                for part, chunk in zip("qkv", t.chunk(3, dim=0)):
                    out[name.replace("conv1d", f"{part}_conv1d")] = chunk.reshape(H * K, 1, -1)
                continue
            elif rest.endswith("experts.gate_up_proj"):  # native in-memory layout
                g, u = t.chunk(2, dim=1)
                out[name.replace("gate_up_proj", "w1")], out[name.replace("gate_up_proj", "w3")] = g, u
                continue
            elif rest.endswith("experts.down_proj"):
                name = name.replace("down_proj", "w2")
        out[name] = t
    keep_packed = bool(config.checkpoint_quantization_config)
    for (prefix, w), per_expert in experts.items():
        stacked = _stack_experts(per_expert, config, w, f"{prefix}.*.{w}", keep_packed)
        if isinstance(stacked, tuple):
            out[f"{prefix}.{w}_packed"], out[f"{prefix}.{w}_scale"] = stacked
        else:
            out[f"{prefix}.{w}"] = stacked
    return out


# native in-memory names -> checkpoint names (module paths after `model.layers.N.`)
_RENAMES = [
    ("self_attn.", [r"^self_attn\.forget_gate\."]),
]


def _narrow_a_log(t, H, name, path):
    flat = t.reshape(-1).float()
    if flat.numel() == H:
        return flat
    if t.dim() == 1 and flat.numel() > H:
        tail = flat[H:]
        if bool((tail != 0).any()):
            raise CheckpointError(f"{name} in {path}: stored [{flat.numel()}] with {H} heads, but the padded tail "
                                  f"holds non-zero values {tail[tail != 0][:4].tolist()}; refusing to guess "
                                  "which entries are live")
        return flat[:H].clone()
    raise CheckpointError(f"{name} in {path}: shape {tuple(t.shape)} does not hold one value per head ({H})")


def _expert_matrix(config, w):
    """[out, in] of one routed expert's `w1` / `w3` (gate / up) or `w2` (down)."""
    inner, width = config.moe_intermediate_size, config.expert_input_size
    return (width, inner) if w == "w2" else (inner, width)


def _check_expert_shapes(per_expert, config, w):
    """Every stored expert tensor against the shape the config implies (MXFP4: `weight_packed` [out, in/2],
    `weight_scale` [out, in/32]), so that one misshapen expert is named with its file, not met inside torch.stack."""
    rows, cols = _expert_matrix(config, w)
    want = {"weight": (rows, cols), "weight_packed": (rows, cols // 2), "weight_scale": (rows, cols // GROUP_SIZE)}
    for (_, kind), (t, path, name) in sorted(per_expert.items()):
        if tuple(t.shape) != want[kind]:
            what = "an MXFP4" if kind != "weight" else "a"
            raise CheckpointError(
                f"{name} in {path}: shape {list(t.shape)} but the config implies {list(want[kind])} for {what} "
                f"[{rows}, {cols}] expert matrix (config: moe_intermediate_size={config.moe_intermediate_size}, "
                f"routed_expert_hidden_size={config.routed_expert_hidden_size}, hidden_size={config.hidden_size})")


def _stack_experts(per_expert, config, w, label, keep_packed=False):
    num_experts = config.num_experts
    packed = any(kind == "weight_packed" for (_, kind) in per_expert)
    kinds = ("weight_packed", "weight_scale") if packed else ("weight",)
    missing = [f"{e}.{kind}" for e in range(num_experts) for kind in kinds if (e, kind) not in per_expert]
    extra = sorted(f"{e}.{kind}" for (e, kind) in per_expert if e >= num_experts or kind not in kinds)
    if missing or extra:
        raise CheckpointError(f"{label}: expected {num_experts} experts with {kinds}; missing {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}; unexpected {extra[:8]}")
    _check_expert_shapes(per_expert, config, w)
    if packed and keep_packed:
        pairs = [(per_expert[(e, "weight_packed")], per_expert[(e, "weight_scale")]) for e in range(num_experts)]
        for (p, path, name), (sc, _, _) in pairs:
            try:
                check_mxfp4(p, sc, name=name.rsplit(".", 1)[0])
            except ValueError as err:
                raise CheckpointError(f"{err} (in {path})") from err
        return _stack([p for (p, _, _), _ in pairs]), _stack([sc for _, (sc, _, _) in pairs])
    if not packed:
        return _stack([per_expert[(e, "weight")][0] for e in range(num_experts)])
    out = torch.empty((num_experts, *_expert_matrix(config, w)), dtype=torch.bfloat16,
                      device=per_expert[(0, "weight_packed")][0].device)
    for e in range(num_experts):  # one expert's bf16 at a time beside the result
        (p, path, name), (s, _, _) = per_expert[(e, "weight_packed")], per_expert[(e, "weight_scale")]
        try:
            out[e] = dequantize_mxfp4(p, s, torch.bfloat16, name=name.rsplit(".", 1)[0])
        except ValueError as err:
            raise CheckpointError(f"{err} (in {path})") from err
    return out


# ----------------------------------------------------------------------------- memory -> official
def to_official_layout(state_dict, config, pack_experts=False):
    """Our text-model state dict -> official tensor names and shapes (experts per expert, A_log as stored).
    `pack_experts` writes routed experts as compressed-tensors MXFP4 (`weight_packed` + `weight_scale`)."""
    H, K = config.kda_num_heads, config.kda_head_dim
    out = {}
    for name, t in state_dict.items():
        packed = re.match(r"^(.*\.experts)\.(w[123])_(packed|scale)$", name)
        if packed:  # already MXFP4: written byte for byte
            suffix = "weight_packed" if packed.group(3) == "packed" else "weight_scale"
            for e in range(t.shape[0]):
                out[f"{packed.group(1)}.{e}.{packed.group(2)}.{suffix}"] = t[e].contiguous()
            continue
        m = re.match(r"^(.*\.experts)\.(w[123])$", name)
        if m:
            for e in range(t.shape[0]):
                key = f"{m.group(1)}.{e}.{m.group(2)}"
                if pack_experts:
                    out[key + ".weight_packed"], out[key + ".weight_scale"] = quantize_mxfp4(t[e].float(), name=key)
                else:
                    out[key + ".weight"] = t[e].contiguous()
        elif name.endswith("self_attn.A_log"):
            if config.gate_lower_bound is not None and K >= H:  # K3 stores A_log padded to head_dim
                out[name] = torch.cat([t.float(), t.new_zeros(K - H, dtype=torch.float32)])
            else:  # Kimi Linear stores [1, 1, H, 1]
                out[name] = t.float().view(1, 1, H, 1)
        else:
            out[name] = t
    return out


# ----------------------------------------------------------------------------- model entry points
def _text_config(config):
    return config.get_text_config() if hasattr(config, "text_config") else config


def load_pretrained(cls, name_or_path, base_from_pretrained, *model_args, **kwargs):
    """`from_pretrained` for our classes: read any supported layout, convert, check names, shapes and values, then
    hand the state dict to Transformers' own `from_pretrained` (dtype, device_map, offloading stay theirs).

    Our keyword arguments: `dequantize=True` (MXFP4 experts to bf16) and `check_finite=False`, which skips the
    NaN / Inf check of every floating-point tensor. The check reads every byte at load: on a 1.4 GB bf16 checkpoint
    on a 2-core CPU it adds 0.4-0.8 s with the file in the page cache and 1.2-1.4 s from disk, to a
    `from_pretrained` of 0.1-0.4 s that maps the safetensors lazily (the first forward reads those pages anyway:
    load plus a first read of every weight takes 5.5-7 s either way).

    Host memory (`read_tensors`): the routed experts are copied into their stacked buffers as they are read, and the
    other tensors of each file holding experts are copied too, so that the file's map is released once it is read;
    files without routed experts stay mapped. Resident memory then peaks at the model's bytes plus at most one
    file's pages and ends at the model's bytes; the copies are what this costs over mapping every file, which would
    keep the experts' file pages resident beside their stacked copies (docs/performance.md, "Loading memory").

    With `output_loading_info=True` returns `(model, loading_info)` as Transformers does; which tensors may be
    missing or left over is `_match`'s rule."""
    hub_kwargs = {k: kwargs.get(k) for k in ("cache_dir", "force_download", "local_files_only", "token",
                                             "revision")}
    folder = resolve_folder(name_or_path, **hub_kwargs)
    config = kwargs.pop("config", None)
    dequantize = kwargs.pop("dequantize", False)
    check_finite = kwargs.pop("check_finite", True)
    output_loading_info = kwargs.pop("output_loading_info", False)
    saved = _saved_config(folder)
    if config is None and "vision_config" in getattr(cls.config_class, "sub_configs", {}) and \
            saved.get("model_type") not in (None, cls.config_class.model_type) and "text_config" not in saved:
        raise CheckpointError(
            f"{os.path.join(folder, 'config.json')} describes a text-only model (model_type "
            f"{saved.get('model_type')!r}, architectures {saved.get('architectures')}): load it with Kimi3ForCausalLM "
            f"or Kimi3Model; {cls.__name__} needs a K3 folder (model_type {cls.config_class.model_type!r}) with its "
            "vision tower")
    # text-model settings passed to from_pretrained, also where a K3 config nests them; the Auto classes build the
    # config first and pass what it did not take on to here
    config_kwargs = {k: kwargs.pop(k) for k in list(kwargs)
                     if k in ("kda_backend", "moe_activation_format", "fp32_logits")}
    if config is None or isinstance(config, (str, os.PathLike)):
        config = cls.config_class.from_pretrained(config if config is not None else folder)
    _text_config(config).update(config_kwargs)
    if hasattr(_text_config(config), "validate_kimi3"):  # a config object may have been edited since it was built
        _text_config(config).validate_kimi3()
    tensors = read_tensors(weight_files(folder), check_finite=check_finite,
                           num_experts=_text_config(config).num_experts)
    convert_float_dtypes(tensors, _load_dtype(config, kwargs), cls._keep_in_fp32_modules_strict or (), folder)
    # MXFP4 experts stay packed in memory unless asked otherwise; what is packed is read off the tensors
    if dequantize or not any(name.endswith(".weight_packed") for name in tensors):
        _text_config(config).checkpoint_quantization_config = None
    state_dict, skipped = _match(cls, config, tensors, saved.get("architectures"),
                                 ignore_mismatched_sizes=kwargs.get("ignore_mismatched_sizes", False))
    for k in ("cache_dir", "force_download", "local_files_only", "token", "revision", "use_safetensors",
              "trust_remote_code"):
        kwargs.pop(k, None)
    model, info = base_from_pretrained(None, *model_args, config=config, state_dict=state_dict,
                                       output_loading_info=True, **kwargs)
    # Transformers saw only the converted state dict: the tensors left out of it are the checkpoint's unexpected ones
    info["unexpected_keys"] = set(info["unexpected_keys"]) | skipped
    model.config._name_or_path = model.name_or_path = str(name_or_path)  # PEFT records it in adapters
    return (model, info) if output_loading_info else model


def _saved_config(folder):
    """The folder's config.json as saved (a dict; empty where there is none or it is unreadable, which the config
    classes report themselves)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _load_dtype(config, kwargs):
    """The dtype the model loads in: `dtype` / `torch_dtype` if given, else the config's, else bf16 (the official
    checkpoints' dtype)."""
    for d in (kwargs.get("dtype"), kwargs.get("torch_dtype"), getattr(config, "dtype", None)):
        if isinstance(d, str):
            d = getattr(torch, d, None)
        if isinstance(d, torch.dtype) and d.is_floating_point:
            return d
    return torch.bfloat16


def convert_float_dtypes(tensors, load_dtype, fp32_names=(), where="checkpoint"):
    """Convert, in `tensors` (name -> (tensor, file)), F16 and F64 tensors where the layout expects the model's
    dtype or fp32: to fp32 for the tensors kept in fp32 (`fp32_names`, module names) and for an fp32 model, else to
    the model's dtype. Without this a config that names no dtype would make the whole model fp16 / fp64. One log
    line says how many tensors went from which dtype to which."""
    counts, fp32_names = {}, set(fp32_names)
    for name, (t, path) in tensors.items():
        if t.dtype not in (torch.float16, torch.float64) or t.dtype in (load_dtype, torch.float32):
            continue
        fp32 = load_dtype == torch.float32 or not fp32_names.isdisjoint(name.split("."))
        converted = t.to(torch.float32 if fp32 else load_dtype)
        if t.dtype == torch.float64:  # finite float64 values beyond the fp32 / bf16 range become Inf
            check_finite_values(name, converted, path, note=f" after conversion from float64 to {converted.dtype}")
        tensors[name] = (converted, path)
        key = (str(t.dtype)[6:], str(converted.dtype)[6:])
        counts[key] = counts.get(key, 0) + 1
    if counts:
        done = ", ".join(f"{n} {src} tensors to {dst}" for (src, dst), n in sorted(counts.items()))
        logger.warning(f"{where}: converted {done} (the checkpoint layout stores the model's dtype, or float32)")
    return counts


def _convert(cls, config, tensors, expected):
    """name -> (tensor, file) in any supported layout -> (the state dict of `cls` (keys of `expected`), the checkpoint
    names of the tensors that belong to a part `cls` does not have: the language-model head of a folder loaded into
    the bare `Kimi3Model`, the vision tower and projector of a K3 folder loaded into a text-only class).

    The text model may be stored under `language_model.` (K3), under `model.` (Kimi Linear, our text classes) or
    without a prefix (what a Transformers base model such as the native `KimiLinearModel` writes); each class takes
    each layout, as `base_model_prefix` lets Transformers' base models and heads load each other's folders."""
    text, vision, origin = {}, {}, {}
    for name, value in tensors.items():
        if name.startswith(VISION_PREFIXES):
            vision[name] = value
            continue
        short = name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name
        text[short], origin[short] = value, name
    if text and not any(k.startswith("model.") for k in text):  # a base model's own names: no `model.` prefix
        renamed = {k: k if k.startswith(HEAD) else "model." + k for k in text}
        text = {renamed[k]: v for k, v in text.items()}
        origin = {renamed[k]: v for k, v in origin.items()}
    prefix = _text_prefix(expected)
    skipped = set()
    if prefix is None:  # the bare Kimi3Model: no `model.` prefix and no head
        skipped |= {origin[k] for k in text if k.startswith(HEAD)}
        text = {k: v for k, v in text.items() if not k.startswith(HEAD)}
        if skipped:
            logger.warning(f"{cls.__name__} has no language-model head: skipped {sorted(skipped)}")
    state_dict = {_place(k, prefix): v for k, v in to_memory_layout(text, _text_config(config)).items()}
    if any(k.startswith(VISION_PREFIXES) for k in expected):
        state_dict.update({k: v for k, (v, _) in vision.items()})
    elif vision:
        skipped |= set(vision)
        logger.warning(f"{cls.__name__} is text-only: skipped {len(vision)} vision tower / projector tensors")
    return state_dict, skipped


def state_dict_for_model(model, state_dict):
    """`model.load_state_dict` input in any supported layout (e.g. what save_pretrained wrote, as Trainer reloads
    it when resuming) -> the model's own keys. A state dict already in the model's layout passes unchanged."""
    own = model.state_dict()
    if set(state_dict) <= set(own) and all(state_dict[k].shape == own[k].shape for k in state_dict):
        return state_dict
    return _convert(type(model), model.config, {k: (v, "<state_dict>") for k, v in state_dict.items()}, own)[0]


def build_state_dict(cls, config, tensors):
    """The state dict of `cls` from name -> (tensor, file), by `_match`'s rule without a folder: every tensor of
    the class is required but a tied head (a conversion's check)."""
    return _match(cls, config, tensors)[0]


def _match(cls, config, tensors, architectures=None, ignore_mismatched_sizes=False):
    """(state dict of `cls`, checkpoint names of the tensors left out) from name -> (tensor, file).

    Every tensor of the official layout is required, with its shape and dtype, except where Transformers itself
    initialises a weight on purpose:
      - a tied head (`tie_word_embeddings`): Transformers ties it to the input embedding after loading;
      - the language-model head, when the folder's config.json names only base models (`architectures`
        ["Kimi3Model"], as `Kimi3Model.save_pretrained` writes): Transformers initialises it and lists it in
        `loading_info["missing_keys"]`;
      - with `ignore_mismatched_sizes=True`, a tensor whose shape differs from the config's: Transformers
        initialises it and lists it in `loading_info["mismatched_keys"]`.
    Tensors of a part the class does not have (the head in `Kimi3Model`, the vision tower in a text-only class) are
    left out and returned for `loading_info["unexpected_keys"]`; any other unexpected tensor is an error."""
    expected, tied = _expected_shapes(cls, config)
    state_dict, skipped = _convert(cls, config, tensors, expected)
    missing = sorted(set(expected) - set(state_dict))
    initialised = {k for k in missing if k in tied and tied[k] in state_dict}
    if _holds_base_model(architectures):
        initialised |= {k for k in missing if _is_head(k)}
    required = [k for k in missing if k not in initialised]
    unexpected = sorted(set(state_dict) - set(expected))
    if required or unexpected:
        hint = ""
        if required and all(_is_head(k) for k in required) and not unexpected:
            hint = (f" (the head may be absent only from a base model's folder, whose config.json names it in "
                    f"`architectures`, e.g. ['Kimi3Model']; this one names {architectures})")
        raise CheckpointError(f"Checkpoint does not match {cls.__name__}: {len(required)} missing tensors "
                              f"{_short(required)}; {len(unexpected)} unexpected tensors {_short(unexpected)}{hint}")
    for k, shape in expected.items():
        if k not in state_dict:
            continue
        if tuple(state_dict[k].shape) != shape and not ignore_mismatched_sizes:
            raise CheckpointError(f"{k}: checkpoint shape {tuple(state_dict[k].shape)} != {shape} from the config "
                                  "(ignore_mismatched_sizes=True initialises it instead, as Transformers does)")
        packed = k.endswith(("_packed", "_scale"))
        if packed != (state_dict[k].dtype == torch.uint8) or not (packed or state_dict[k].is_floating_point()):
            raise CheckpointError(f"{k}: stored as {state_dict[k].dtype}, expected "
                                  f"{'uint8 (MXFP4)' if packed else 'a floating-point tensor'}")
    return state_dict, skipped


def _is_head(name):
    return name == "lm_head.weight" or name.endswith(".lm_head.weight")


def _holds_base_model(architectures):
    """Whether config.json's `architectures` names only base models (no head): `Kimi3Model`, `KimiLinearModel`."""
    return isinstance(architectures, list) and bool(architectures) and all(
        isinstance(a, str) and a.endswith("Model") and "For" not in a and "LMHead" not in a for a in architectures)


def _short(names, n=12):
    return names[:n] + ([f"... {len(names) - n} more"] if len(names) > n else [])


def _expected_shapes(cls, config):
    """(name -> shape of every tensor of `cls`, tied target -> source: the weights Transformers ties after loading)."""
    with torch.device("meta"):
        model = cls(config)
    return ({k: tuple(v.shape) for k, v in model.state_dict().items()},
            dict(getattr(model, "all_tied_weights_keys", None) or {}))


def _text_prefix(expected):
    """Where the text model's `model.*` / `lm_head.*` tensors live in this class."""
    if any(k.startswith(TEXT_PREFIX) for k in expected):
        return TEXT_PREFIX
    if any(k.startswith("model.") for k in expected):
        return ""
    return None  # a bare Kimi3Model: no `model.` prefix and no head


def _place(name, prefix):
    if prefix is None:
        return name[len("model."):] if name.startswith("model.") else name
    return prefix + name


_MODELING_MODULE = __name__.rsplit(".", 1)[0] + ".modeling_kimi3"


def save_pretrained(model, save_directory, base_save_pretrained, *args, state_dict=None, **kwargs):
    """Write the official layout: official tensor names, per-expert weights, official config keys."""
    if state_dict is None:
        state_dict = model.state_dict()
    text_config = _text_config(model.config)
    prefix = _text_prefix({k: None for k in state_dict})
    text, other = {}, {}
    for k, v in state_dict.items():
        if prefix is None:  # the bare Kimi3Model writes the official text layout too: `model.*`, as a head's body
            text["model." + k] = v
        elif k.startswith(prefix):
            text[k[len(prefix):]] = v
        else:
            other[k] = v
    # float experts under an MXFP4 description (after `qat.prepare_qat`) are written as the MXFP4 they train through
    official = to_official_layout(text, text_config, pack_experts=bool(text_config.checkpoint_quantization_config))
    out = dict(other)
    for k, v in official.items():
        out[(prefix or "") + k] = v
    # unpacked experts must not travel with the compressed-tensors description of packed ones
    saved_q = text_config.checkpoint_quantization_config
    if not any(k.endswith("weight_packed") for k in out):
        text_config.checkpoint_quantization_config = None
    # our auto_map only: a folder loaded from Moonshot's release carries theirs, whose files we do not ship
    saved_maps = (getattr(model.config, "auto_map", None), getattr(text_config, "auto_map", None))
    model.config.auto_map = _auto_map(model)
    if text_config is not model.config and hasattr(text_config, "auto_map"):
        del text_config.auto_map
    # a wrapper's subclass (FSDP2's `FSDP<class>`, defined in torch) must not reach the folder: Transformers writes
    # the class it saves into auto_map and copies the file that defines it
    wrapper, model.__class__ = type(model), _kimi_class(model)
    try:
        return base_save_pretrained(save_directory, *args, state_dict=out, **kwargs)
    finally:
        model.__class__ = wrapper
        text_config.checkpoint_quantization_config = saved_q
        model.config.auto_map = saved_maps[0]
        if text_config is not model.config and saved_maps[1] is not None:
            text_config.auto_map = saved_maps[1]


def _kimi_class(model):
    """The model's own Kimi class: wrappers derive from it at run time (FSDP2's `fully_shard` makes the model an
    instance of a subclass `FSDP<class>` defined in torch)."""
    return next(c for c in type(model).__mro__ if c.__module__ == _MODELING_MODULE)


def _auto_map(model):
    cls = _kimi_class(model).__name__
    auto = {"AutoConfig": f"configuration_kimi3.{type(model.config).__name__}"}
    if hasattr(model, "language_model"):  # one class serves text and images, as for the official release
        auto.update({k: f"modeling_kimi3.{cls}" for k in ("AutoModel", "AutoModelForCausalLM",
                                                          "AutoModelForImageTextToText")})
    else:  # a text folder: AutoModel gives the base model, AutoModelForCausalLM the head, from either folder
        auto.update({"AutoModel": "modeling_kimi3.Kimi3Model",
                     "AutoModelForCausalLM": "modeling_kimi3.Kimi3ForCausalLM"})
    return auto
