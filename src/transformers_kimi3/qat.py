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

The masters stay in the state dict (a Trainer checkpoint holds them, in the official layout packed: a run resumed
from such a checkpoint starts from the quantised values). Loading a checkpoint into a QAT model (`load_state_dict`
of packed experts) dequantises the packed tensors into the masters.
"""

import copy
import logging

import torch
from torch import nn

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


__all__ = ["QATExperts", "fake_quantize_mxfp4", "prepare_qat"]
