"""Where the weights of a Kimi K3 model go on N GPUs (and host memory), planned on the meta device.

`plan_device_map(config_or_folder, gpus=8, gpu_memory="140GiB", ...)` builds the model on the meta device (no
memory, about a second for the full 2.78T-parameter K3), sizes every parameter and buffer in the dtype
`from_pretrained(..., dtype=dtype)` gives it, and returns a `DevicePlan`:

- `device_map`: module name -> GPU index or "cpu", for `from_pretrained(..., device_map=...)`. Decoder layers stay
  whole on one GPU (the model's `_no_split_modules`); the vision tower and projector go with the embeddings on GPU 0,
  the final norm, AttnRes output mix and LM head with the last layer. Consecutive layers share a GPU; the split keeps
  the most layers on one GPU as small as it can (each layer adds its caches to its GPU), then the fullest GPU's
  bytes.
- `device_bytes`: bytes of weights per device; `str(plan)` prints them as a table.
- When the weights exceed what the GPUs may hold and `offload_experts=True`, the routed experts
  (`PackedMXFP4Experts`, 15.7 GB per layer of the full K3, or float `Kimi3Experts`) of as few MoE layers as make the
  rest fit go to host memory: their key in `device_map` is "cpu" and the rest of each such layer stays on its GPU.
  Accelerate runs offloaded modules on the main GPU (GPU 0), copying their weights there for each forward, so GPU 0
  keeps room for one layer's experts (`staging_bytes`) on top of its own weights. Packed experts are buffers, so the
  map is loaded with `offload_buffers=True` (`plan.from_pretrained_kwargs()` includes it); without it Accelerate
  would put them on GPU 0 whole. Every offloaded layer then moves its experts over PCIe per forward (~16 GB per
  layer): this makes the model fit, at a cost in speed.

Sizes are exact for the model this package builds: parameters and buffers (the packed MXFP4 experts are uint8
buffers, 0.53125 bytes per weight: a 4-bit code plus one E8M0 scale byte per 32 weights), floating-point tensors in
`dtype` except the ones the model keeps in fp32 (`_keep_in_fp32_modules_strict`: A_log, dt_bias, the KDA short
convolutions, o_norm, the router's correction bias). Accelerate's `compute_module_sizes` counts buffers too and keeps
integer tensors at their size, but sizes every floating-point tensor of the meta model in `dtype` unless each fp32 one
is named in its `special_dtypes`; `tensor_bytes` applies the model's own fp32 rule instead, as loading does.

`reserve` (default 10% of each GPU) is memory kept free of weights: the CUDA context, activations of a prefill chunk,
the MLA latent cache (27.6 KB per token over the 24 MLA layers in bf16), the KDA state (0.43 GB per sequence), the
MXFP4 kernels' bf16 decode chunk (2 GiB) and the allocator's fragmentation. Raise it for long contexts or large
batches.
"""

import copy
import json
import os
import re
from dataclasses import dataclass, field

import torch

from .configuration_kimi3 import Kimi3Config, Kimi3TextConfig
from .modeling_kimi3 import Kimi3ForCausalLM, Kimi3ForConditionalGeneration
from .moe import Kimi3Experts
from .mxfp4_experts import PackedMXFP4Experts

# The compressed-tensors settings of the released checkpoint's routed experts (MXFP4, 32-value groups).
RELEASED_MXFP4 = {"format": "mxfp4-pack-quantized", "quant_method": "compressed-tensors",
                  "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                                "weights": {"group_size": 32, "num_bits": 4, "type": "float"}}}}
DEFAULT_RESERVE = 0.10
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*$", re.I)
_FIRST = ("vision_tower", "mm_projector")  # modules placed before the text stack (their output enters the embeddings)


def released_k3_config():
    """The released Kimi K3 config (text model of SPEC section 1, MoonViT-V2 vision tower, MXFP4 routed experts)."""
    return Kimi3Config(text_config=Kimi3TextConfig.k3(quantization_config=copy.deepcopy(RELEASED_MXFP4)))


def parse_size(value, name):
    """Bytes from an int or a string such as "140GiB", "1.5TB" (GB = 10^9 bytes, GiB = 2^30)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} = {value!r} must be a number of bytes or a string such as '140GiB'")
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"{name} = {value!r} is not a size: use bytes or a number with B, KB, MB, GB, TB, KiB, "
                             "MiB, GiB or TiB (e.g. '140GiB')")
        value = float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]
    if value <= 0:
        raise ValueError(f"{name} = {value!r} must be positive")
    return int(value)


def _load_config(config_or_folder):
    if isinstance(config_or_folder, (Kimi3Config, Kimi3TextConfig)):
        return config_or_folder
    if isinstance(config_or_folder, (str, os.PathLike)):
        path = os.path.join(config_or_folder, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"config_or_folder = {str(config_or_folder)!r} has no config.json")
        with open(path, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
        cls = Kimi3Config if model_type == Kimi3Config.model_type else Kimi3TextConfig
        return cls.from_pretrained(config_or_folder)
    raise ValueError(f"config_or_folder must be a Kimi3Config, a Kimi3TextConfig or a model folder, got "
                     f"{type(config_or_folder).__name__}")


def meta_model(config_or_folder):
    """The model of a config (or a folder's config.json) built on the meta device: shapes without memory."""
    config = _load_config(config_or_folder)
    cls = Kimi3ForConditionalGeneration if isinstance(config, Kimi3Config) else Kimi3ForCausalLM
    with torch.device("meta"):
        return cls(config)


def tensor_bytes(model, dtype=torch.bfloat16):
    """{name: bytes} of every parameter and buffer of `model` as `from_pretrained(..., dtype=dtype)` stores it:
    floating-point tensors in `dtype`, except those the model keeps in fp32 when loaded in bf16 / fp16; integer
    tensors (the packed MXFP4 experts and their E8M0 scales) as they are."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype = {dtype} must be torch.bfloat16, torch.float16 or torch.float32")
    keep = sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    fp32 = re.compile("|".join(k.replace("*", ".*") for k in keep)) if keep and dtype != torch.float32 else None
    out = {}
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        if t.is_floating_point():
            size = 4 if fp32 is not None and fp32.search(name) else dtype.itemsize
        else:
            size = t.element_size()
        out[name] = t.numel() * size
    return out


def _children_holding(module, cls_names):
    return any(type(m).__name__ in cls_names for m in module.modules())


def _atoms(model):
    """[(module name, module)] in placement order: the units that stay whole on one device. A module is split into
    its children only while it holds a no-split layer and is not one itself."""
    no_split = set(model._no_split_modules or [])
    text_layers = {n for n in no_split if n.endswith("DecoderLayer")} or no_split
    atoms = []

    def walk(prefix, module):
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if type(child).__name__ in text_layers or not _children_holding(child, text_layers):
                atoms.append((full, child))
            else:
                walk(full + ".", child)
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n, _ in module.named_buffers(recurse=False)]
        if own:
            raise ValueError(f"{prefix or 'the model'} holds tensors of its own ({own}); plan_device_map places "
                             "modules")

    walk("", model)
    first = [a for a in atoms if a[0].split(".")[0] in _FIRST]
    return first + [a for a in atoms if a not in first]


def _partition(sizes, is_layer, experts, caps):
    """Split the atoms (`sizes`, in order) into len(caps) contiguous runs, one per GPU, each within its cap after
    moving the routed experts of some of its atoms to the host (`experts`: atom index -> expert bytes; empty: none may
    move). Minimises the number of atoms whose experts move, then the most decoder layers (`is_layer`) on one GPU (each
    layer adds its cache and state to its GPU), then the fullest GPU's bytes: dynamic programming over (GPU, first atom
    of the next run), exact for the first two criteria (both are monotone in a run's extension); the third breaks
    ties among the states kept.
    Returns [(start, end, moved atom indices)] per GPU, or None if nothing fits."""
    n = len(sizes)
    prefix, count = [0], [0]
    for s, layer in zip(sizes, is_layer):
        prefix.append(prefix[-1] + s)
        count.append(count[-1] + bool(layer))

    def run_cost(i, j, cap):
        """(moved atoms, bytes left) of atoms i..j-1 on one GPU of `cap` bytes, or None."""
        load = prefix[j] - prefix[i]
        moved = []
        movable = sorted((k for k in range(i, j) if k in experts), key=lambda k: -experts[k])
        while load > cap and len(moved) < len(movable):
            k = movable[len(moved)]
            moved.append(k)
            load -= experts[k]
        return (moved, load) if load <= cap else None

    # best[g][i]: ((moved, most layers, fullest), (previous i, moved)) with the atoms before i on the first g GPUs
    best = [{0: ((0, 0, 0), None)}]
    for g, cap in enumerate(caps):
        nxt = {}
        for i, ((moved_so_far, most, fullest), _) in best[g].items():
            for j in range(i, n + 1):
                cost = run_cost(i, j, cap)
                if cost is None:
                    if prefix[j] - prefix[i] - sum(experts.get(k, 0) for k in range(i, j)) > cap:
                        break  # longer runs only get heavier
                    continue
                value = (moved_so_far + len(cost[0]), max(most, count[j] - count[i]), max(fullest, cost[1]))
                if j not in nxt or value < nxt[j][0]:
                    nxt[j] = (value, (i, cost[0]))
        best.append(nxt)
    if n not in best[-1]:
        return None
    runs, j = [], n
    for g in range(len(caps), 0, -1):
        _, (i, moved) = best[g][j]
        runs.append((i, j, sorted(moved)))
        j = i
    return runs[::-1]


def _gib(n):
    """A size for the plan's text: GiB, or MiB below 1 GiB (small models would read 0.0 GiB)."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 or n == 0 else f"{n / 2**20:,.1f} MiB"


def _ranges(layers):
    """[3, 4, 5, 9] -> '3-5, 9'."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


@dataclass
class DevicePlan:
    """A placement from `plan_device_map`. Bytes are weights only (parameters and buffers as loaded)."""

    device_map: dict  # module name -> GPU index or "cpu"
    device_bytes: dict  # GPU index or "cpu" -> bytes of weights placed there
    layers: dict  # GPU index -> decoder layer indices it holds
    offloaded_layers: list  # decoder layers whose routed experts are in host memory
    gpus: int
    gpu_memory: int  # bytes per GPU
    reserve_bytes: int  # bytes per GPU kept free of weights
    staging_bytes: int  # room on GPU 0 for one offloaded layer's experts while it runs (0 without offloading)
    total_bytes: int  # all weights
    expert_bytes: int  # the routed experts among them
    model_name: str
    dtype: torch.dtype
    other: dict = field(default_factory=dict)  # GPU index -> names of the non-layer modules it holds

    @property
    def weight_budget(self):
        """Bytes of weights each GPU may hold (GPU 0: less `staging_bytes`)."""
        return self.gpu_memory - self.reserve_bytes

    @property
    def host_bytes(self):
        return self.device_bytes.get("cpu", 0)

    def from_pretrained_kwargs(self):
        """The `from_pretrained` arguments for this plan: `device_map`, and `offload_buffers=True` when experts (which
        are buffers) are in host memory."""
        kw = {"device_map": dict(self.device_map)}
        if self.offloaded_layers:
            kw["offload_buffers"] = True
        return kw

    def __str__(self):
        lines = [f"{self.model_name}, {str(self.dtype).replace('torch.', '')}: "
                 f"{self.total_bytes / 1e9:,.1f} GB = {_gib(self.total_bytes)} of weights, "
                 f"{self.expert_bytes / 1e9:,.1f} GB of them routed experts",
                 f"{self.gpus} GPUs x {_gib(self.gpu_memory)}, {_gib(self.reserve_bytes)} each kept for activations "
                 f"and caches: {_gib(self.weight_budget)} for weights per GPU",
                 "",
                 f"{'device':<7} {'weights':>12} {'free':>11}  holds"]
        for g in range(self.gpus):
            used = self.device_bytes.get(g, 0)
            extra = self.staging_bytes if g == 0 else 0
            holds = []
            if self.layers.get(g):
                holds.append(f"layers {_ranges(self.layers[g])}")
            holds += self.other.get(g, [])
            if extra:
                holds.append(f"+ {_gib(extra)} staging for offloaded experts")
            free = self.gpu_memory - used - extra
            lines.append(f"{'cuda:' + str(g):<7} {_gib(used):>12} {_gib(free):>11}  {', '.join(holds) or '-'}")
        if self.offloaded_layers:
            lines.append(f"{'cpu':<7} {_gib(self.host_bytes):>12} {'':>11}  routed experts of "
                         f"{len(self.offloaded_layers)} layers: {_ranges(self.offloaded_layers)}")
        gpu = sum(v for k, v in self.device_bytes.items() if k != "cpu")
        lines.append("")
        lines.append(f"on the GPUs: {_gib(gpu)}; in host memory: {_gib(self.host_bytes)}")
        return "\n".join(lines)


def plan_device_map(config_or_folder=None, gpus=8, gpu_memory="140GiB", reserve=DEFAULT_RESERVE, host_memory=None,
                    offload_experts=False, dtype=torch.bfloat16):
    """Plan where a Kimi K3 model's weights go on `gpus` GPUs of `gpu_memory` each (module docstring).

    config_or_folder: a Kimi3Config / Kimi3TextConfig, a folder with a config.json, or None for the released K3.
    gpu_memory: per GPU, bytes or a string ("140GiB": about an H200's HBM; pass the total that
        `torch.cuda.mem_get_info()` reports on the machine: the H200s this package runs on report about 139 GiB).
    reserve: kept free of weights on every GPU, a fraction of gpu_memory in [0, 1) or a size ("12GiB").
    host_memory: if given, the host memory the offloaded experts may use (checked).
    offload_experts: allow routed experts in host memory when the GPUs cannot hold every weight; without it such a
    plan is refused with the numbers.
    dtype: the dtype the model is loaded in (non-expert weights)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus = {gpus!r} must be a positive integer")
    gpu_memory = parse_size(gpu_memory, "gpu_memory")
    if isinstance(reserve, float) and not isinstance(reserve, bool):
        if not 0 <= reserve < 1:
            raise ValueError(f"reserve = {reserve!r} as a fraction of gpu_memory must be in [0, 1)")
        reserve_bytes = int(reserve * gpu_memory)
    elif reserve == 0:
        reserve_bytes = 0
    else:
        reserve_bytes = parse_size(reserve, "reserve")
        if reserve_bytes >= gpu_memory:
            raise ValueError(f"reserve = {reserve!r} leaves nothing of gpu_memory ({_gib(gpu_memory)}) for weights")
    host = parse_size(host_memory, "host_memory") if host_memory is not None else None
    if not isinstance(offload_experts, bool):
        raise ValueError(f"offload_experts = {offload_experts!r} must be True or False")

    model = meta_model(released_k3_config() if config_or_folder is None else config_or_folder)
    sizes = tensor_bytes(model, dtype)
    atoms = _atoms(model)
    names = [n for n, _ in atoms]

    per_module = {}  # module name -> bytes of every tensor under it
    for name, b in sizes.items():
        parts = name.split(".")
        for k in range(1, len(parts)):
            key = ".".join(parts[:k])
            per_module[key] = per_module.get(key, 0) + b

    atom_bytes = [per_module.get(n, 0) for n in names]
    experts = {}  # atom index -> (experts module name, bytes) for layers with routed experts
    for i, (name, module) in enumerate(atoms):
        for sub, m in module.named_modules():
            if sub and isinstance(m, (PackedMXFP4Experts, Kimi3Experts)):
                experts[i] = (f"{name}.{sub}", per_module.get(f"{name}.{sub}", 0))
    total = sum(sizes.values())
    assert total == sum(atom_bytes), "every tensor belongs to one placed module"
    budget = gpu_memory - reserve_bytes
    packed = any(isinstance(m, PackedMXFP4Experts) for m in model.modules())
    model_name = (f"{type(model).__name__} ({model.config.get_text_config().num_hidden_layers} layers"
                  f"{', routed experts MXFP4' if packed else ''})")

    is_layer = [name.rsplit(".", 1)[-1].isdigit() for name in names]
    split = _partition(atom_bytes, is_layer, {}, [budget] * gpus)
    staging = 0
    if split is None:
        if not offload_experts:
            raise ValueError(
                f"the weights ({total / 1e9:,.1f} GB) do not fit {gpus} GPUs with {_gib(budget)} each for weights "
                f"(gpu_memory {_gib(gpu_memory)} less reserve {_gib(reserve_bytes)}); pass offload_experts=True "
                "(CLI: --offload-experts) to keep some layers' routed experts in host memory, or more gpus")
        if not experts:
            raise ValueError(f"the weights ({total / 1e9:,.1f} GB) do not fit {gpus} GPUs with {_gib(budget)} each for "
                             "weights and the model has no routed experts to offload")
        staging = max(b for _, b in experts.values())
        split = _partition(atom_bytes, is_layer, {i: b for i, (_, b) in experts.items()},
                           [budget - staging] + [budget] * (gpus - 1))
        if split is None:
            least = [b - experts[i][1] if i in experts else b for i, b in enumerate(atom_bytes)]
            biggest = max(range(len(names)), key=lambda i: least[i])
            raise ValueError(f"the weights do not fit {gpus} GPUs with {_gib(budget)} each for weights even with every "
                             f"layer's routed experts in host memory ({_gib(staging)} of GPU 0 kept to run them; "
                             f"largest module left: {names[biggest]}, {_gib(least[biggest])})")
    offloaded = {k for _, _, moved in split for k in moved}

    device_map, device_bytes, layers, other = {}, {}, {}, {}
    for g, (start, end, _) in enumerate(split):
        for i in range(start, end):
            name, module = atoms[i]
            device_bytes[g] = device_bytes.get(g, 0) + atom_bytes[i] - (experts[i][1] if i in offloaded else 0)
            if is_layer[i]:
                layers.setdefault(g, []).append(int(name.rsplit(".", 1)[-1]))
            else:
                other.setdefault(g, []).append(name.rsplit(".", 1)[-1])
            if i in offloaded:
                ename = experts[i][0]
                _split_around(device_map, name, module, ename, g)
                device_map[ename] = "cpu"
                device_bytes["cpu"] = device_bytes.get("cpu", 0) + experts[i][1]
            else:
                device_map[name] = g
    offloaded_layers = [int(names[i].rsplit(".", 1)[-1]) for i in sorted(offloaded)]
    if host is not None and device_bytes.get("cpu", 0) > host:
        raise ValueError(f"host_memory = {_gib(host)} is less than the {_gib(device_bytes['cpu'])} of routed experts "
                         "the plan puts in host memory")
    return DevicePlan(device_map=device_map, device_bytes=device_bytes, layers=layers,
                      offloaded_layers=offloaded_layers, gpus=gpus, gpu_memory=gpu_memory,
                      reserve_bytes=reserve_bytes, staging_bytes=staging, total_bytes=total,
                      expert_bytes=sum(b for _, b in experts.values()), model_name=model_name, dtype=dtype,
                      other=other)


def _split_around(device_map, name, module, target, device):
    """Map every part of `module` (called `name`) except the submodule `target` to `device`: the children on the path
    to `target`, split one level at a time, and any tensor a module on that path holds itself."""
    rest = target[len(name) + 1:].split(".")
    prefix, current = name, module
    for part in rest:
        for n, _ in list(current.named_parameters(recurse=False)) + list(current.named_buffers(recurse=False)):
            device_map[f"{prefix}.{n}"] = device
        for child_name, _ in current.named_children():
            if child_name != part:
                device_map[f"{prefix}.{child_name}"] = device
        prefix, current = f"{prefix}.{part}", getattr(current, part)


__all__ = ["DevicePlan", "plan_device_map", "meta_model", "tensor_bytes", "released_k3_config", "parse_size"]
