"""Distributed fine-tuning with PyTorch's own machinery: FSDP2 (`torch.distributed.fsdp.fully_shard`) for Kimi K3 /
Kimi Linear models, PEFT models built on them, and the state-dict helpers a sharded run needs.

    dist.init_process_group()                      # torchrun sets RANK / WORLD_SIZE; NCCL on GPUs, gloo on CPUs
    model = Kimi3ForCausalLM.from_pretrained(...)  # or get_peft_model(model, LoraConfig(...))
    apply_fsdp2(model)                             # every decoder layer (and vision block) its own FSDP unit
    optimizer = build_per_head_muon(model, lr)     # after sharding: the optimizer must see the DTensor parameters
    ...
    save_pretrained_fsdp2(model, "out")            # gathers the full state dict; rank 0 writes the usual folder

Units (`apply_fsdp2`): each module whose class is named in a model's `_no_split_modules` (`Kimi3DecoderLayer`,
`Kimi3VisionBlock`: the blocks Accelerate's transformer auto-wrap picks too), the input embedding and the output
head (each alone, unless tied: a tied pair stays in the root unit), then the root (the final norm, the output
AttnRes pair, the vision patch embedding and the projector). A unit's parameters are all-gathered for its forward
and again for its backward (with `reshard_after_forward=True`), its gradients reduce-scattered and averaged over
the ranks. Frozen parameters (LoRA's base weights) are sharded but get no gradient and no reduce-scatter. Buffers
(the routers' `e_score_correction_bias`, the packed MXFP4 experts' `w*_packed` / `w*_scale`) are not sharded: each
rank keeps them whole on the mesh's device, as every rank computes with them. The parameters Kimi models keep in
fp32 get units of their own where needed (`apply_fsdp2`).

The code is device-agnostic: the mesh's device type (CUDA with NCCL, or the CPU with gloo) decides where the
shards live; nothing here names a device.

Context parallel (one sequence split along its length over the ranks) is `context_parallel.py`; its two entry
points, `context_parallel` and `shard_sequence`, are importable from here too.
"""

import torch
from torch import nn

from .context_parallel import context_parallel, shard_sequence

__all__ = ["apply_fsdp2", "context_parallel", "fsdp2_units", "gather_full_state_dict", "load_full_state_dict",
           "save_pretrained_fsdp2", "shard_sequence"]


def _require_distributed(what):
    if not torch.distributed.is_available():
        raise RuntimeError(f"{what} needs torch.distributed, which this PyTorch build does not have")


def default_mesh():
    """A 1-D mesh over the default process group: the accelerator's device type when the group has an
    accelerator backend (NCCL and the like), else the CPU (gloo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("mesh=None needs an initialised default process group (torch.distributed."
                         "init_process_group(), e.g. under torchrun); or pass mesh=init_device_mesh(...)")
    backend = str(dist.get_backend()).lower()
    device_type = "cpu"
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and backend != "gloo":
        device_type = accelerator.type
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _block_class_names(model):
    """Class names listed in `_no_split_modules` by any PreTrainedModel inside `model` (a PeftModel included)."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def _embeddings(model):
    """(input embedding, output head or None) of the first module that has `get_input_embeddings`."""
    for module in model.modules():
        if hasattr(module, "get_input_embeddings") and hasattr(module, "get_output_embeddings"):
            head = module.get_output_embeddings()
            return module.get_input_embeddings(), head if isinstance(head, nn.Module) else None
    return None, None


def _weight(module):
    """The weight a (possibly PEFT-wrapped) layer computes with: a LoRA wrapper's is its base layer's."""
    base = getattr(module, "base_layer", module)
    return getattr(base, "weight", None)


def _is_qat_experts(module):
    from .qat import QATExperts

    return isinstance(module, QATExperts)


def _qat_experts(model):
    return [m for m in model.modules() if _is_qat_experts(m)]


def fsdp2_units(model):
    """The modules `apply_fsdp2` shards as units of their own, in the order it shards them (inner first; the root
    `model` itself comes last and is not listed): the QAT experts (`prepare_qat`), the blocks, then the embedding and
    the head."""
    names = _block_class_names(model)
    if not names:
        raise ValueError(f"model ({type(model).__name__}) holds no module with `_no_split_modules`: apply_fsdp2 "
                         "shards Kimi3 / KimiLinear models and PEFT models built on them")
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    embed, head = _embeddings(model)
    tied = embed is not None and head is not None and _weight(embed) is _weight(head)
    extra = [] if tied else [m for m in (embed, head) if m is not None and any(True for _ in m.parameters())]
    return _qat_experts(model) + blocks + extra


def _kept_in_fp32(model):
    """Parameters that Kimi models keep in fp32 whatever the model's dtype (`_keep_in_fp32_modules_strict`: `A_log`,
    `dt_bias`, the KDA convs, `o_norm`), found by name component as Transformers matches them."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        names.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    return {p for name, p in model.named_parameters() if names & set(name.split("."))}


class _Sharder:
    """fully_shard with the fp32-kept parameters in units of their own where a unit would otherwise mix them with
    parameters of another dtype (FSDP2 needs one dtype per unit: a model loaded in bf16 keeps them fp32) or cast them
    (an mp_policy with a param_dtype): those units get no param_dtype, so they compute in fp32 as the model
    intends. A KDA layer then is three units: its projections, its fp32 part (A_log, dt_bias, convs, o_norm), and
    the rest of the layer."""

    def __init__(self, model, fully_shard, kw, keep_kw, param_dtype):
        self.fully_shard, self.kw, self.keep_kw = fully_shard, kw, keep_kw
        self.kept = _kept_in_fp32(model)
        self.param_dtype = param_dtype
        self.done = set()

    def _free(self, module):
        return [p for p in module.parameters() if p not in self.done]

    def _shard(self, modules, kw, **extra):
        self.fully_shard(modules if len(modules) > 1 else modules[0], **kw, **extra)
        for m in modules:
            self.done.update(m.parameters())

    def _needs_split(self, params):
        kept = [p for p in params if p in self.kept]
        other = [p for p in params if p not in self.kept]
        if not kept or not other:
            return False
        other_dtypes = {p.dtype for p in other if p.requires_grad} or {p.dtype for p in other}
        cast = self.param_dtype is not None and any(p.dtype != self.param_dtype for p in kept)
        return cast or any(p.dtype not in other_dtypes for p in kept)

    def unit(self, module, **extra):
        if _is_qat_experts(module):
            # QAT masters: a unit of their own, not cast (keep_kw): the forward quantises the masters themselves, as
            # save_pretrained packs them, and their dtype may differ from the rest of the layer's
            self._shard([module], self.keep_kw, **extra)
        elif self._needs_split(self._free(module)):
            self._split(module, **extra)
        else:
            self._shard([module], self.kw, **extra)

    def _split(self, module, **extra):
        """module's free parameters mix kept and other ones: split them into units of one kind each."""
        for child in module.children():  # afterwards each child's free parameters are all kept or all other
            if len({p in self.kept for p in self._free(child)}) > 1:
                self._split(child, **extra)
        direct = [p for p in module._parameters.values() if p is not None and p not in self.done]
        if direct:
            kinds = {p in self.kept for p in direct}
            if len(kinds) > 1:
                raise ValueError(f"{type(module).__name__} holds fp32-kept and other parameters itself; FSDP2 cannot "
                                 "put them in units of one dtype each")
            kept_unit = kinds.pop()
        else:
            free = self._free(module)
            kept_unit = sum(p.numel() for p in free if p in self.kept) > sum(p.numel() for p in free
                                                                             if p not in self.kept)
        others = [c for c in module.children() if self._free(c) and (self._free(c)[0] in self.kept) != kept_unit]
        if others:
            self._shard(others, self.kw if kept_unit else self.keep_kw, **extra)
        self._shard([module], self.keep_kw if kept_unit else self.kw, **extra)


def apply_fsdp2(model, mesh=None, reshard_after_forward=True, mp_policy=None, offload_policy=None):
    """Shard `model` in place with FSDP2 (`fully_shard`) and return it.

    model: a Kimi3 / KimiLinear model (`Kimi3ForCausalLM`, `Kimi3ForConditionalGeneration`, `Kimi3Model`) or a PEFT
        model around one. Call after `get_peft_model` / `prepare_qat` / `activation_checkpointing_enable`, and build
        the optimizer afterwards: sharding replaces every parameter by a DTensor parameter. Each `QATExperts`
        (`prepare_qat`) is a unit of its own that `mp_policy` does not cast: the forward quantises the masters in
        their own dtype (fp32 masters in a bf16 model included), as `save_pretrained_fsdp2` packs them.
    mesh: a `DeviceMesh` (1-D: FSDP over its ranks; 2-D: HSDP, replicate over dim 0 and shard over dim 1). None:
        all ranks of the default process group, on its accelerator (NCCL) or on the CPU (gloo).
    reshard_after_forward: for every unit but the root (FSDP2's meaning: True frees the gathered parameters after
        the forward and gathers them again for the backward; False keeps them; an int reshards to that smaller
        world size).
    mp_policy: a `torch.distributed.fsdp.MixedPrecisionPolicy`, e.g. `MixedPrecisionPolicy(param_dtype=
        torch.bfloat16, reduce_dtype=torch.float32)` for bf16 compute on fp32 shards. The parameters Kimi models
        keep in fp32 (`A_log`, `dt_bias`, the KDA convs, `o_norm`) are not cast: they form units of their own that
        compute in their own dtype. None: compute in the parameters' dtype (e.g. fp32 under `torch.autocast`).
    offload_policy: a `torch.distributed.fsdp.CPUOffloadPolicy` to keep the shards (and the optimizer step) on
        the CPU; None: on the mesh's device.

    A model loaded in bf16 (`from_pretrained(..., dtype=torch.bfloat16)`) keeps those parameters in fp32; FSDP2
    needs one dtype per unit, so they form units of their own there too. Each KDA layer is then three units (its
    projections, its fp32 part, the rest of the layer) where an MLA layer is one.
    """
    _require_distributed("apply_fsdp2")
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    except ImportError as e:  # FSDP2 is public from PyTorch 2.6
        raise RuntimeError(f"apply_fsdp2 needs torch.distributed.fsdp.fully_shard (PyTorch >= 2.6): {e}") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, FSDPModule):
        raise ValueError("model is already sharded (an FSDPModule): apply_fsdp2 shards a model once")
    if mesh is None:
        mesh = default_mesh()
    elif not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh must be 1-D (FSDP) or 2-D (HSDP: replicate, shard), got a {mesh.ndim}-D mesh; "
                         "pass the data-parallel sub-mesh (mesh['dp'])")
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    elif not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                        f"{type(mp_policy).__name__}")
    if offload_policy is None:
        offload_policy = OffloadPolicy()
    elif not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy (CPUOffloadPolicy) or "
                        f"None, got {type(offload_policy).__name__}")
    kw = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    # the fp32-kept units: no param_dtype (nor input casting); gradients reduced in their own dtype
    keep_kw = dict(kw, mp_policy=MixedPrecisionPolicy(output_dtype=mp_policy.output_dtype,
                                                      cast_forward_inputs=False))
    sharder = _Sharder(model, fully_shard, kw, keep_kw, mp_policy.param_dtype)
    for unit in fsdp2_units(model):
        sharder.unit(unit, reshard_after_forward=reshard_after_forward)
    # the root's parameters are gathered first in the backward anyway: FSDP2's default keeps them after forward
    sharder.unit(model)
    return model


def gather_full_state_dict(model, cpu_offload=True):
    """The unsharded state dict of a `fully_shard`-ed model (collective: every rank must call it). With cpu_offload
    (the default) rank 0 gets every tensor whole on the CPU and the other ranks get {}; without it every rank gets
    the whole tensors on the mesh's device. Keys are the model's own (`model.state_dict()`), e.g. PEFT's for a
    PeftModel; buffers included."""
    _require_distributed("gather_full_state_dict")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))


def load_full_state_dict(model, state_dict, broadcast_from_rank0=True, strict=True):
    """Load an unsharded state dict into a `fully_shard`-ed model, each rank keeping its shards (collective).

    state_dict: the model's keys or the official checkpoint layout (per-expert tensors, what `save_pretrained`
        writes: converted as `model.load_state_dict` converts it; packed MXFP4 experts are dequantised into the
        masters of a QAT model). With broadcast_from_rank0 (the default) only
        rank 0's is read and the other ranks may pass {}: the tensors are broadcast one by one, so only rank 0
        needs the whole model in host memory (the other ranks can build theirs on the meta device, shard it and
        `to_empty(device=...)` it before this call). Without it every rank passes the same whole state dict."""
    _require_distributed("load_full_state_dict")
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if state_dict and hasattr(model, "config"):
        from .checkpoint import state_dict_for_model
        from .qat import masters_from_packed

        # packed experts into QAT masters (prepare_qat): dequantised, as QATExperts' own loading does
        state_dict = masters_from_packed(model, state_dict_for_model(model, state_dict))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if (rank0 or not broadcast_from_rank0) and not state_dict:
        raise ValueError("state_dict is empty on a rank that must provide it (rank 0, or every rank without "
                         "broadcast_from_rank0)")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=strict)
    return set_model_state_dict(model, state_dict, options=options)


def save_pretrained_fsdp2(model, save_directory, **kwargs):
    """`model.save_pretrained(save_directory, **kwargs)` for a `fully_shard`-ed model (collective): the full state
    dict is gathered to rank 0's CPU and rank 0 writes the folder (the official layout for a Kimi model, the adapter
    for a PeftModel); the other ranks write nothing and wait for it."""
    import torch.distributed as dist

    if "state_dict" in kwargs:
        raise ValueError("save_pretrained_fsdp2 gathers the state dict itself: do not pass state_dict")
    full = gather_full_state_dict(model, cpu_offload=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        # a Kimi model's save_pretrained names its own class, not fully_shard's `FSDP<class>` (checkpoint.py); no
        # collective happens while it writes
        model.save_pretrained(save_directory, state_dict=full, **kwargs)
    if dist.is_initialized():
        dist.barrier()
