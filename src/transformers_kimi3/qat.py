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
Sharded (DTensor, FSDP2) masters are refused.
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


def _checked_masters(model, what):
    masters = qat_masters(model)
    if not masters:
        raise ValueError(f"{what}: the model has no QATExperts (call prepare_qat before training)")
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        DTensor = ()
    sharded = [n for n, p in masters.items() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(f"{what}: the masters are sharded (DTensor, e.g. FSDP2: {sharded[0]}); only whole masters "
                         "(one process, DDP) are supported")
    return masters


def save_qat_masters(model, folder, global_step=None):
    """Write every QAT master of `model` to `folder/qat_masters.safetensors` in its own dtype (`global_step` in the
    metadata when given); returns the file's path. Written to a temporary name and renamed, so a reader never sees
    a partial file."""
    masters = _checked_masters(model, "save_qat_masters")
    path = os.path.join(folder, QAT_MASTERS_NAME)
    metadata = {"format": "pt"}
    if global_step is not None:
        metadata["global_step"] = str(int(global_step))
    save_file({n: p.detach().cpu().contiguous() for n, p in masters.items()}, path + ".tmp", metadata=metadata)
    os.replace(path + ".tmp", path)
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
    or dtypes are not the model's masters', or whose values do not belong to the model's weights. Returns the path."""
    masters = _checked_masters(model, "load_qat_masters")
    if os.path.isdir(path):
        path = os.path.join(path, QAT_MASTERS_NAME)
    loaded = {}
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
            t = t.to(p.device)
            if not (torch.equal(t, p) or torch.equal(fake_quantize_mxfp4(t, name), p)):
                raise ValueError(f"{path}: {name} does not quantise to the model's weights: the file belongs to "
                                 "another checkpoint than the one loaded")
            loaded[name] = t
    for name, t in loaded.items():
        masters[name].copy_(t)
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
        _checked_masters(model, "QATMastersCallback")
        self.loaded = None
        if state.global_step == 0:  # a fresh TrainerState: no checkpoint was resumed
            return
        folders = [os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")]
        if isinstance(args.resume_from_checkpoint, str) and os.path.isdir(args.resume_from_checkpoint):
            folders.insert(0, args.resume_from_checkpoint)
        for folder in folders:
            path = os.path.join(folder, QAT_MASTERS_NAME)
            if os.path.isfile(path) and _masters_step(path) == state.global_step:
                self.loaded = load_qat_masters(model, path)
                logger.info(f"QATMastersCallback: masters loaded from {path}")
                return
        logger.warning(f"QATMastersCallback: resumed at step {state.global_step}, but no {QAT_MASTERS_NAME} of that "
                       f"step is in {' or '.join(folders)}: the run continues from the quantised masters of the "
                       "checkpoint's weights")

    def on_save(self, args, state, control, model=None, **kwargs):
        if not args.should_save:
            return
        if model is None:
            raise ValueError("QATMastersCallback needs the model (Trainer passes it to callbacks)")
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):
            logger.warning(f"QATMastersCallback: no checkpoint folder {folder}; the masters of step "
                           f"{state.global_step} are not saved")
            return
        save_qat_masters(model, folder, global_step=state.global_step)


__all__ = ["QAT_MASTERS_NAME", "QATExperts", "QATMastersCallback", "fake_quantize_mxfp4", "load_qat_masters",
           "prepare_qat", "qat_masters", "save_qat_masters"]
