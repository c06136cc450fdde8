"""Quantisation-aware fine-tuning of the routed experts: master weights trained through the MXFP4 quantisation the
checkpoint stores them in (and, optionally, the MXFP8 activations of W4A8), so that what is saved is what was
trained.

    model = prepare_qat(model, weights="mxfp4", activations="mxfp8")   # or activations=None: activations as given
    ... full fine-tuning, Trainer, gradient checkpointing ...
    model.save_pretrained(folder)                                      # packed MXFP4 experts, compressed-tensors

`prepare_qat` replaces every routed-experts module (packed `PackedMXFP4Experts`, dequantised to the master dtype,
or float `Kimi3Experts`) by `QATExperts`: trainable master weights w1, w3, w2 whose forward uses
dequantise(quantise_mxfp4(w)) with a straight-through estimator (the gradient with respect to a master weight is
the gradient with respect to its quantised value). It sets `moe_activation_format` and, where the model had none,
the compressed-tensors MXFP4 description on the text config; `save_pretrained` then packs the masters with the same
`quantize_mxfp4` the forward used, so the reloaded packed model computes the QAT model's forward: in fp32 the
logits agree to rounding (the packed experts sum routes in another order).

Loading a checkpoint into a QAT model (`load_state_dict` of packed experts) dequantises the packed tensors into the
masters.

Resuming. A Trainer checkpoint is written by `save_pretrained` too, so its model weights hold the masters packed:
resumed from them alone, a run starts from the quantised values, every master's part below the MXFP4 step lost,
and no longer follows the run that was not interrupted. `QATMastersCallback` keeps the exact masters:

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[QATMastersCallback()])
    trainer.train(resume_from_checkpoint=True)                         # or a checkpoint folder

- on every checkpoint it writes `qat_masters.safetensors` (every QATExperts master under its parameter name, in
  its own dtype, the global step in the metadata) into the folder Trainer has just written, on the process that
  writes the checkpoint (`args.should_save`);
- on a resumed run (`on_train_begin`, which Trainer calls after it has loaded the checkpoint's weights, optimizer
  and scheduler, and before the first step) it loads them back: from `args.resume_from_checkpoint` when that names
  a folder, else from `<output_dir>/checkpoint-<global step>`, the file whose recorded step is the resumed one.
  Without such a file it logs a warning naming the folder, and the run continues from the quantised values.
  A file whose tensors do not match the model's masters (names, shapes, dtypes), or whose masters do not quantise
  to the weights the checkpoint loaded, is refused with an error naming the tensor and the file.

With the callback a resumed run gives the uninterrupted run's masters bit for bit (tests/mxfp4/test_qat.py). The
cost is the masters' size on disk per checkpoint (and in host memory while one is written or read): E·I·D·3
values per MoE layer, 32 bits each for fp32 masters (16 for bf16) against the checkpoint's 4.25 bits (MXFP4 and
one 8-bit scale per 32 values). `save_qat_masters` / `load_qat_masters` do the same in a loop of one's own.

FSDP2. `prepare_qat` comes first, then `distributed.apply_fsdp2` (which gives every QATExperts a unit of its own whose
masters an mp_policy does not cast), then the optimizer; `prepare_qat` refuses a model that is already sharded.
With sharded (DTensor) masters, `save_qat_masters` and `load_qat_masters` are collective: every rank of the default
process group calls them. Saving gathers each master whole, one at a time, and rank 0 (the callback: the process
with `args.should_save`) writes the same file as one process would. Loading: every rank reads the file, checks it
and takes its own shard of each master (`distribute_tensor` with the master's mesh and placements, no
communication); a refusal on any rank is raised on every rank, before any master changes.
"""

import copy
import logging
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .dtensors import full_tensor, is_dtensor, shard_like
from .moe import Kimi3Experts, Kimi3SparseMoeBlock
from .mxfp4 import GROUP_SIZE, decode_mxfp4, quantize_mxfp4
from .mxfp4_experts import PackedMXFP4Experts
from .mxfp8 import check_activation_format, straight_through

logger = logging.getLogger("transformers_kimi3")

_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down


def fake_quantize_mxfp4(w, name="weight"):
    """w [..., out, in] -> dequantise(quantise_mxfp4(w)) in w's dtype (every MXFP4 value is a bf16 and an fp32
    number); the gradient passes straight through to w."""
    return straight_through(lambda t: decode_mxfp4(*quantize_mxfp4(t, name), t.dtype), w)


class QATExperts(Kimi3Experts):
    """Routed experts with trainable master weights (`w1`, `w3` [E, I, D], `w2` [E, D, I], fp32 or bf16) that every
    forward fake-quantises to MXFP4 (`fake_quantize_mxfp4`); the activations follow `moe_activation_format` as in
    `Kimi3Experts`. Built by `prepare_qat`."""

    _activation_dtype = None  # set by `forward` for `_weights`

    def forward(self, x, topk_idx, topk_weights):
        # masters in another dtype than the activations (bf16 masters in an fp32 model, fp32 masters under bf16
        # activations) compute in the activations' dtype: every MXFP4 value is a bf16 and an fp32 number, so the
        # cast of the quantised weights is exact and the forward does not depend on the masters' dtype
        self._activation_dtype = x.dtype
        try:
            return super().forward(x, topk_idx, topk_weights)
        finally:
            self._activation_dtype = None

    def _weights(self):
        dtype = self._activation_dtype
        return tuple(fake_quantize_mxfp4(getattr(self, n), f"experts.{n}").to(dtype or getattr(self, n).dtype)
                     for n in _PROJECTIONS)

    @classmethod
    def from_experts(cls, experts, config, dtype=None):
        """From `PackedMXFP4Experts` (dequantised, exact, to `dtype`, default fp32) or `Kimi3Experts` (its
        weights, converted to `dtype` if given)."""
        if isinstance(experts, PackedMXFP4Experts):
            masters = experts.dequantize(dtype or torch.float32)
        else:
            masters = tuple(getattr(experts, n).detach().to(dtype or getattr(experts, n).dtype) for n in _PROJECTIONS)
        with torch.device("meta"):  # the masters replace the parameters: nothing to allocate
            mod = cls(config, masters[0].shape[-1])
        for n, w in zip(_PROJECTIONS, masters):
            setattr(mod, n, nn.Parameter(w.clone()))
            getattr(mod, n)._is_hf_initialized = True  # Transformers' init functions leave them alone
        return mod

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Packed experts (what `save_pretrained` writes) load into the masters, dequantised."""
        for n in _PROJECTIONS:
            packed, scale = state_dict.pop(f"{prefix}{n}_packed", None), state_dict.pop(f"{prefix}{n}_scale", None)
            if packed is not None and scale is not None:
                state_dict[f"{prefix}{n}"] = decode_mxfp4(packed, scale, getattr(self, n).dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def prepare_qat(model, weights="mxfp4", activations=None, master_dtype=None):
    """Make `model`'s routed experts trainable through their quantisation (module docstring), in place; returns the
    model. `weights`: "mxfp4"; `activations`: None (as given) or "mxfp8"; `master_dtype`: the masters' dtype (default:
    the model's dtype for packed experts, the float experts' own dtype otherwise). Call it before building the
    optimizer (or Trainer): the masters are new parameters."""
    if weights != "mxfp4":
        raise ValueError(f"prepare_qat: weights={weights!r} is not supported (only 'mxfp4')")
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError("prepare_qat: the model is already sharded (DTensor parameters: apply_fsdp2 / fully_shard); "
                         "call prepare_qat first, then apply_fsdp2, then build the optimizer")
    fmt = check_activation_format("bf16" if activations is None else activations)
    config = model.config.get_text_config()
    blocks = [m for m in model.modules() if isinstance(m, Kimi3SparseMoeBlock)]
    if not blocks:
        raise ValueError("prepare_qat: the model has no routed experts")
    for name, width in (("expert_input_size", config.expert_input_size),
                        ("moe_intermediate_size", config.moe_intermediate_size)):
        if width % GROUP_SIZE:
            raise ValueError(f"prepare_qat: {name} = {width} is not a multiple of the MXFP4 group size {GROUP_SIZE}")
    if config.moe_activation_format != fmt:
        logger.info(f"prepare_qat: routed expert activations {config.moe_activation_format} -> {fmt}")
    config.moe_activation_format = fmt  # read by the QATExperts built below, and saved
    dtype = master_dtype or model.dtype
    for block in blocks:
        packed = isinstance(block.experts, PackedMXFP4Experts)
        block.experts = QATExperts.from_experts(block.experts, config, dtype if packed else master_dtype)
    if not config.checkpoint_quantization_config:
        from kimi3_conversion.quantize_job import MXFP4_QUANTIZATION_CONFIG

        config.checkpoint_quantization_config = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    return model


# ----------------------------------------------------------------------------- exact masters in checkpoints
QAT_MASTERS_NAME = "qat_masters.safetensors"


def qat_masters(model):
    """{parameter name: master} of every `QATExperts` in `model` (`model.named_modules()` names: `<module>.w1` ...)."""
    return {f"{name}.{n}" if name else n: getattr(mod, n)
            for name, mod in model.named_modules() if isinstance(mod, QATExperts) for n in _PROJECTIONS}


def masters_from_packed(model, state_dict):
    """`state_dict` (the model's keys) with the packed experts of every `QATExperts` (`<experts>.w1_packed` /
    `_scale`, what `save_pretrained` writes) dequantised into the masters' keys and dtype, as
    `QATExperts._load_from_state_dict` does; for loaders that match tensors to parameters by key
    (`distributed.load_full_state_dict`)."""
    out = dict(state_dict)
    for name, p in qat_masters(model).items():
        packed, scale = out.pop(f"{name}_packed", None), out.pop(f"{name}_scale", None)
        if packed is not None and scale is not None:
            out[name] = decode_mxfp4(packed, scale, p.dtype)
    return out


def _sharded(masters):
    return any(is_dtensor(p) for p in masters.values())


def _checked_masters(model, what):
    masters = qat_masters(model)
    if not masters:
        raise ValueError(f"{what}: the model has no QATExperts (call prepare_qat before training)")
    return masters


def _local_part(t, p):
    """This rank's part of the whole tensor `t` for the DTensor `p` (no communication), on p's local device."""
    return shard_like(t, p).to_local().to(p.to_local().device)


def _process_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("the QAT masters are sharded (DTensor) but no default process group is initialised")
    return dist


@torch.no_grad()
def save_qat_masters(model, folder, global_step=None, write=None):
    """Write every QAT master of `model` to `folder/qat_masters.safetensors` in its own dtype (`global_step` in the
    metadata when given); returns the file's path. Written to a temporary name and renamed, so a reader never sees
    a partial file.

    Sharded (DTensor, FSDP2) masters: collective, every rank calls it; each master is gathered whole in turn and the
    writing process keeps it on the CPU; the ranks wait for the file before returning. `write`: whether this process
    writes the file (default: rank 0 when the masters are sharded, else True)."""
    masters = _checked_masters(model, "save_qat_masters")
    dist = _process_group() if _sharded(masters) else None
    if write is None:
        write = dist is None or dist.get_rank() == 0
    path = os.path.join(folder, QAT_MASTERS_NAME)
    tensors = {}
    for name, p in masters.items():
        t = full_tensor(p.detach())  # every rank takes part in the gather
        if write:
            tensors[name] = t.cpu().contiguous()
    if write:
        metadata = {"format": "pt"}
        if global_step is not None:
            metadata["global_step"] = str(int(global_step))
        save_file(tensors, path + ".tmp", metadata=metadata)
        os.replace(path + ".tmp", path)
    if dist is not None:
        dist.barrier()
    return path


def _masters_step(path):
    with safe_open(path, "pt") as f:
        step = (f.metadata() or {}).get("global_step")
    return None if step is None else int(step)


@torch.no_grad()
def load_qat_masters(model, path):
    """Load `path` (a `qat_masters.safetensors` file or the folder holding one) into `model`'s QAT masters, exactly.

    Load the checkpoint's model weights first (Trainer does, before `on_train_begin`): every master in the file must
    be the model's master or quantise to it (`fake_quantize_mxfp4`), so masters of another checkpoint are refused.
    Refused with a ValueError naming the tensor and the file, before any master changes: a file whose names, shapes
    or dtypes are not the model's masters', or whose values do not belong to the model's weights. Returns the path.

    Sharded (DTensor, FSDP2) masters: collective, every rank calls it and reads the file; each rank checks and takes
    its own shard of each master (the file's tensor cut by the master's mesh and placements). What one rank refuses
    every rank raises (naming that rank), and no rank changes a master."""
    masters = _checked_masters(model, "load_qat_masters")
    dist = _process_group() if _sharded(masters) else None
    if os.path.isdir(path):
        path = os.path.join(path, QAT_MASTERS_NAME)
    loaded, error = {}, None
    try:
        with safe_open(path, "pt") as f:
            names = set(f.keys())
            missing, unexpected = sorted(set(masters) - names), sorted(names - set(masters))
            if missing or unexpected:
                what = f"the model's master {missing[0]} is missing" if missing else f"{unexpected[0]} is no QAT master"
                raise ValueError(f"{path}: {what} ({len(missing)} missing, {len(unexpected)} unexpected): the file "
                                 "holds the masters of another model")
            for name, p in masters.items():
                t = f.get_tensor(name)
                if t.shape != p.shape or t.dtype != p.dtype:
                    raise ValueError(f"{path}: {name} is {t.dtype} {tuple(t.shape)} in the file, {p.dtype} "
                                     f"{tuple(p.shape)} in the model")
                if is_dtensor(p):  # this rank's shard of the file's tensor
                    own, got = p.to_local(), _local_part(t, p)
                    quantised = lambda: _local_part(fake_quantize_mxfp4(t, name), p)  # noqa: E731 (whole groups)
                else:
                    own, got = p, t.to(p.device)
                    quantised = lambda: fake_quantize_mxfp4(got, name)  # noqa: E731
                if not (torch.equal(got, own) or torch.equal(quantised(), own)):
                    raise ValueError(f"{path}: {name} does not quantise to the model's weights: the file belongs to "
                                     "another checkpoint than the one loaded")
                loaded[name] = got
    except Exception as e:  # noqa: BLE001 (sharded: every rank must learn of it before raising)
        if dist is None:
            raise
        error = e
    if dist is not None:  # one rank's refusal is every rank's: no rank may change its shards
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = next((r for r, e in enumerate(errors) if e), None)
        if failed is not None:
            raise ValueError(f"load_qat_masters: rank {failed} refused {path}: {errors[failed]}")
    for name, t in loaded.items():
        p = masters[name]
        (p.to_local() if is_dtensor(p) else p).copy_(t)
    return path


class QATMastersCallback(TrainerCallback):
    """Trainer checkpoints that resume QAT exactly (module docstring, "Resuming"): `on_save` writes the masters into
    the checkpoint folder Trainer has just written, `on_train_begin` of a resumed run loads them back.

    Use `Trainer(..., callbacks=[QATMastersCallback()])`; `QATMastersCallback.attach(trainer)` puts it first among
    the trainer's callbacks, so that the masters are in the folder before any other callback's `on_save` reads it
    (an integration uploading checkpoints). `loaded` is the masters file a resumed run loaded (None: none)."""

    def __init__(self):
        self.loaded = None

    @classmethod
    def attach(cls, trainer, **kwargs):
        cb = cls(**kwargs)
        trainer.callback_handler.callbacks.insert(0, cb)
        return cb

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("QATMastersCallback needs the model (Trainer passes it to callbacks)")
        masters = _checked_masters(model, "QATMastersCallback")
        self.loaded = None
        if state.global_step == 0:  # a fresh TrainerState: no checkpoint was resumed
            return
        folders = [os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")]
        if isinstance(args.resume_from_checkpoint, str) and os.path.isdir(args.resume_from_checkpoint):
            folders.insert(0, args.resume_from_checkpoint)
        paths = [os.path.join(folder, QAT_MASTERS_NAME) for folder in folders]
        found = [next((p for p in paths if os.path.isfile(p) and _masters_step(p) == state.global_step), None)]
        if _sharded(masters):  # loading is collective: every rank takes the file rank 0 found
            _process_group().broadcast_object_list(found, src=0)
        if found[0] is not None:
            self.loaded = load_qat_masters(model, found[0])
            logger.info(f"QATMastersCallback: masters loaded from {found[0]}")
            return
        logger.warning(f"QATMastersCallback: resumed at step {state.global_step}, but no {QAT_MASTERS_NAME} of that "
                       f"step is in {' or '.join(folders)}: the run continues from the quantised masters of the "
                       "checkpoint's weights")

    def on_save(self, args, state, control, model=None, **kwargs):
        """Sharded (DTensor, FSDP2) masters: every process takes part in gathering them (Trainer calls `on_save` on
        each), and the one with `args.should_save` writes the file."""
        if model is None:
            if not args.should_save:
                return
            raise ValueError("QATMastersCallback needs the model (Trainer passes it to callbacks)")
        sharded = _sharded(qat_masters(model))
        if not args.should_save and not sharded:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        write = args.should_save
        if write and not os.path.isdir(folder):
            logger.warning(f"QATMastersCallback: no checkpoint folder {folder}; the masters of step "
                           f"{state.global_step} are not saved")
            if not sharded:
                return
            write = False
        save_qat_masters(model, folder, global_step=state.global_step, write=write)


__all__ = ["QAT_MASTERS_NAME", "QATExperts", "QATMastersCallback", "fake_quantize_mxfp4", "load_qat_masters",
           "masters_from_packed", "prepare_qat", "qat_masters", "save_qat_masters"]
