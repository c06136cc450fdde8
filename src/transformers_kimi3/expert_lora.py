"""LoRA on the packed MXFP4 routed experts: low-rank adapters trained while the experts' MXFP4 weights stay packed
and frozen, computed inside the routed (grouped-GEMM) path, and a PEFT LoRA layer for them.

For each expert e and projection p in (w1 gate, w3 up, w2 down), with the projection's input a (the routed rows of
expert e, as the expert GEMMs read them) and s = lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA):

    out_p = a @ W_p,e^T + s * (dropout(a) @ A_p,e^T) @ B_p,e^T       A_p,e [r, in_p], B_p,e [out_p, r]

Only the routes that reach expert e go through its adapter; no expert is dequantised beyond the one being computed
(exact paths) or the tile in registers (kernels). Which code computes it:
- exact paths (fp32 activations, no kernels, MXFP8 activations): the routes sorted by expert, one expert at a time,
  its weights decoded to fp32, in fp32 arithmetic (the arithmetic of `PackedMXFP4Experts`), adapters in fp32 too;
- bf16 / fp16 activations on a kernel device: the grouped MXFP4 GEMMs of `kimi3_kernels.mxfp4` for the frozen
  weights (forward, and the activation gradient with the transposed weights) and `torch._grouped_mm` in bf16 for
  the adapters (r a multiple of 8; other ranks take one matmul pair per expert).
Gradients reach the activations, the routing weights and the adapters; the packed weights are buffers. With no
adapter update (B = 0) the outputs equal `PackedMXFP4Experts`' bit for bit on the exact paths.

PEFT: `PackedExpertsLoraLayer` is a LoRA layer for `PackedMXFP4Experts`, registered through PEFT's custom-module
mapping (`LoraConfig._register_custom_module`; `target_parameters` needs `nn.Parameter` targets and the packed
weights are buffers):

    config = packed_experts_lora_config(r=16, lora_alpha=32, target_modules=["experts", "q_proj", ...])
    model = get_peft_model(model, config)                          # train, save_pretrained: a normal adapter
    model = load_packed_experts_adapter(base, folder)                # PeftModel.from_pretrained with the mapping
    merged = model.merge_and_unload()                                # requantised to MXFP4; merge_errors(merged)

The adapter of one experts module is `lora_A.<adapter>.{w1,w3,w2}` [E, r, in] and `lora_B.<adapter>.{w1,w3,w2}`
[E, out, r] (in / out of w1, w3: hidden, intermediate; of w2: intermediate, hidden), fp32 unless converted.
Merging adds s * B_e A_e to each decoded expert in fp32 and quantises the sum with `quantize_mxfp4`, the rounding
that QAT trains through and `save_pretrained` packs with (`qat.fake_quantize_mxfp4`), one expert at a time. The
requantisation error of every merged module is logged and kept as `PackedMXFP4Experts.merge_error`; `merge_errors`
collects them. `unmerge` restores the packed bytes the experts had before the merge.
"""

import logging
import math

import torch
from torch import nn

from . import kernels
from .mxfp4 import decode_mxfp4, quantize_mxfp4
from .mxfp4_experts import PackedMXFP4Experts, _combine, _route

logger = logging.getLogger("transformers_kimi3")

_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down


def _segments(bounds):
    """(expert, start, end) of the non-empty segments of host offsets [E+1]."""
    return [(e, s, t) for e, (s, t) in enumerate(zip(bounds[:-1], bounds[1:])) if t > s]


class _PackedGEMM(torch.autograd.Function):
    """C[m] = a[m] @ [W_n,e^T for n in names] (concatenated) for the rows m of expert e's segment: the frozen packed
    weights of `mod`, rows sorted by expert (`offsets` int32 [E+1], `bounds` its host copy or None on the kernels).
    fp32 output; the backward gives the gradient with respect to a only."""

    @staticmethod
    def forward(ctx, a, mod, names, offsets, bounds, ops):
        ctx.mod, ctx.names, ctx.bounds, ctx.ops = mod, names, bounds, ops
        ctx.save_for_backward(offsets)
        ctx.a_dtype = a.dtype
        packed = [(getattr(mod, f"{n}_packed"), getattr(mod, f"{n}_scale")) for n in names]
        if ops is not None:
            extra = dict(dual="out", b_packed=packed[1][0], b_scale=packed[1][1]) if len(names) == 2 else {}
            return ops.mxfp4_grouped_gemm(a, *packed[0], offsets, **extra)
        n_out = sum(p.shape[1] for p, _ in packed)
        out = a.new_zeros(a.shape[0], n_out, dtype=torch.float32)
        af = a.float()
        for e, s, t in _segments(bounds):
            col = 0
            for p, sc in packed:
                w = decode_mxfp4(p[e], sc[e])
                out[s:t, col:col + w.shape[0]] = af[s:t] @ w.T
                col += w.shape[0]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dc):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        (offsets,) = ctx.saved_tensors
        mod, names, ops = ctx.mod, ctx.names, ctx.ops
        packed = [(getattr(mod, f"{n}_packed"), getattr(mod, f"{n}_scale")) for n in names]
        widths = [p.shape[1] for p, _ in packed]
        parts = dc.split(widths, dim=1)
        if ops is not None:
            with kernels.on_device(dc):
                extra = (dict(dual="in", a2=parts[1].contiguous(), b_packed=packed[1][0], b_scale=packed[1][1])
                         if len(names) == 2 else {})
                da = ops.mxfp4_grouped_gemm(parts[0].contiguous(), *packed[0], offsets, trans_w=True, **extra)
        else:
            K = packed[0][1].shape[-1] * 32
            da = dc.new_zeros(dc.shape[0], K, dtype=torch.float32)
            for e, s, t in _segments(ctx.bounds):
                for part, (p, sc) in zip(parts, packed):
                    da[s:t] += part[s:t].float() @ decode_mxfp4(p[e], sc[e])
        return da.to(ctx.a_dtype), None, None, None, None, None


def _adapter_delta(a, adapters, name, offsets, bounds, grouped):
    """sum over adapters of s * (dropout(a) @ A_e^T) @ B_e^T for the sorted rows a [M, in] -> [M, out] fp32.
    `grouped`: torch._grouped_mm in bf16 (the kernel path), else one expert at a time in fp32."""
    total = None
    for factors_a, factors_b, scaling, dropout in adapters:
        A, B = getattr(factors_a, name), getattr(factors_b, name)  # [E, r, in], [E, out, r]
        x = dropout(a)
        if grouped and A.shape[1] % 8 == 0:
            ends = offsets[1:]
            t = torch._grouped_mm(x.to(torch.bfloat16), A.to(torch.bfloat16).transpose(1, 2), offs=ends)
            d = torch._grouped_mm(t, B.to(torch.bfloat16).transpose(1, 2), offs=ends).float()
        else:
            if bounds is None:
                bounds = offsets.tolist()
            xf, Af, Bf = x.float(), A.float(), B.float()
            parts = [(xf[s:t] @ Af[e].T) @ Bf[e].T for e, s, t in _segments(bounds)]
            d = torch.cat(parts) if parts else xf.new_zeros(0, B.shape[1])
        d = d * scaling
        total = d if total is None else total + d
    return total


def packed_experts_lora_forward(experts, x, topk_idx, topk_w, adapters):
    """`PackedMXFP4Experts.forward` with LoRA adapters on w1, w3 and w2 (module docstring): x [T, D], topk_idx [T, k],
    topk_w [T, k] -> [T, D] in x's dtype. `adapters`: [(A, B, scaling, dropout)], A / B modules holding w1, w3, w2
    factors ([E, r, in] / [E, out, r]), dropout a callable on the projection's input."""
    experts.check_inputs(x, topk_idx, topk_w)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    T, k = topk_idx.shape
    I = experts.intermediate_size
    ops = experts._kernels(x)  # None: exact fp32 paths
    order, offsets = _route(topk_idx, experts.num_experts, sync_ok=ops is None)
    bounds = offsets.tolist() if ops is None else None
    grouped = ops is not None and hasattr(torch, "_grouped_mm")
    with kernels.on_device(x), torch.autocast(x.device.type, enabled=False):
        xs = x[order // k]
        a = experts._gemm_input(xs) if ops is None else xs.contiguous()
        gu = _PackedGEMM.apply(a, experts, ("w1", "w3"), offsets, bounds, ops)
        gate = gu[:, :I] + _adapter_delta(a, adapters, "w1", offsets, bounds, grouped)
        up = gu[:, I:] + _adapter_delta(a, adapters, "w3", offsets, bounds, grouped)
        h = experts._act(gate, up).to(x.dtype)
        h = experts._gemm_input(h) if ops is None else h
        o = _PackedGEMM.apply(h, experts, ("w2",), offsets, bounds, ops)
        o = o + _adapter_delta(h, adapters, "w2", offsets, bounds, grouped)
        routed = o.new_zeros(o.shape).index_copy(0, order, o)
        return _combine(routed, topk_w, T, k, x.dtype)


# ----------------------------------------------------------------------------- merging
@torch.no_grad()
def merge_into_packed(experts, adapters, name=""):
    """Add every adapter's s * B_e A_e to `experts`' weights and requantise with `quantize_mxfp4`, one expert at a
    time, in place. Returns (and sets as `experts.merge_error`) the requantisation error: per projection and over all
    three, `relative` = ||Q(W + dW) - (W + dW)|| / ||W + dW|| and `of_update` = ||Q(W + dW) - (W + dW)|| / ||dW||
    (Frobenius norms; `of_update` above 1 means the rounding moved the experts more than the adapters did)."""
    sums = {}
    for n in _PROJECTIONS:
        packed, scale = getattr(experts, f"{n}_packed"), getattr(experts, f"{n}_scale")
        err2 = ref2 = upd2 = 0.0
        new_packed, new_scale = torch.empty_like(packed), torch.empty_like(scale)
        for e in range(experts.num_experts):
            w = decode_mxfp4(packed[e], scale[e])
            dw = sum((s * getattr(B, n)[e].float() @ getattr(A, n)[e].float() for A, B, s, _ in adapters),
                     torch.zeros_like(w))
            merged = w + dw
            if not bool(torch.isfinite(merged).all()):
                raise ValueError(f"{name or 'experts'}.{n}[{e}]: merging the LoRA adapter gives non-finite weights")
            new_packed[e], new_scale[e] = quantize_mxfp4(merged, name=f"{name or 'experts'}.{n}[{e}]")
            err2 += float((decode_mxfp4(new_packed[e], new_scale[e]) - merged).double().pow(2).sum())
            ref2 += float(merged.double().pow(2).sum())
            upd2 += float(dw.double().pow(2).sum())
        packed.copy_(new_packed)
        scale.copy_(new_scale)
        sums[n] = (err2, ref2, upd2)

    def ratios(err2, ref2, upd2):
        return {"relative": math.sqrt(err2 / ref2) if ref2 else 0.0,
                "of_update": math.sqrt(err2 / upd2) if upd2 else (0.0 if err2 == 0 else math.inf)}

    report = {n: ratios(*v) for n, v in sums.items()}
    report["all"] = ratios(*(sum(v[i] for v in sums.values()) for i in range(3)))
    experts.merge_error = report
    return report


def merge_errors(model):
    """{module name: `merge_error`} of every `PackedMXFP4Experts` of `model` that a LoRA merge requantised."""
    return {n: m.merge_error for n, m in model.named_modules()
            if isinstance(m, PackedMXFP4Experts) and getattr(m, "merge_error", None) is not None}


# ----------------------------------------------------------------------------- the PEFT layer
try:  # PEFT is optional: without it the computation and merging above still work
    from peft import PeftConfig, PeftModel
    from peft.tuners.lora import LoraConfig, LoraLayer
    from peft.tuners.tuners_utils import check_adapters_to_merge
except ImportError:
    LoraLayer = None


def _need_peft():
    if LoraLayer is None:
        raise ImportError("LoRA on the packed MXFP4 experts through PEFT needs the `peft` package (pip install peft)")


class _Factors(nn.Module):
    """One adapter's A (or B) factors of the three projections: parameters w1, w3, w2."""

    def __init__(self, shapes, device):
        super().__init__()
        for n, shape in shapes.items():
            setattr(self, n, nn.Parameter(torch.zeros(shape, device=device)))


if LoraLayer is not None:
    class PackedExpertsLoraLayer(nn.Module, LoraLayer):
        """PEFT LoRA layer for `PackedMXFP4Experts` (module docstring): `lora_A[adapter].{w1,w3,w2}` [E, r, in],
        `lora_B[adapter].{w1,w3,w2}` [E, out, r], fp32. Supports dropout, rsLoRA, several active adapters (their
        updates add up), merging (requantised to MXFP4) and unmerging; not DoRA or other LoRA variants,
        `lora_bias`, `fan_in_fan_out` or mixed-adapter batches."""

        def __init__(self, base_layer, adapter_name, config, r=0, lora_alpha=1, **kwargs):
            super().__init__()
            LoraLayer.__init__(self, base_layer, **kwargs)
            base = self.get_base_layer()
            if not isinstance(base, PackedMXFP4Experts):
                raise TypeError(f"PackedExpertsLoraLayer wraps PackedMXFP4Experts, got {type(base).__name__}")
            for field in ("use_dora", "lora_bias", "fan_in_fan_out"):
                if getattr(config, field):
                    raise ValueError(f"LoRA on the packed MXFP4 experts ({kwargs.get('target_name', 'experts')}): "
                                     f"LoraConfig.{field}=True is not supported")
            self._active_adapter = adapter_name
            self._unmerged = None  # the packed bytes before the first merge, for `unmerge`
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def _get_in_out_features(self, module):
            return module.hidden_size, module.hidden_size

        def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
            if r <= 0:
                raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
            if self.resolve_lora_variant(config=config) is not None:
                raise ValueError("LoRA on the packed MXFP4 experts does not support LoRA variants (DoRA and others)")
            base = self.get_base_layer()
            E, D, I = base.num_experts, base.hidden_size, base.intermediate_size
            dims = {"w1": (D, I), "w3": (D, I), "w2": (I, D)}  # (in, out)
            device = base.w1_packed.device
            self.r[adapter_name] = r
            self.lora_alpha[adapter_name] = lora_alpha
            self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
            self.use_rslora[adapter_name] = config.use_rslora
            self.use_dora[adapter_name] = False
            self.lora_bias[adapter_name] = False
            self.lora_dropout[adapter_name] = (nn.Dropout(config.lora_dropout) if config.lora_dropout > 0
                                               else nn.Identity())
            self.lora_A[adapter_name] = _Factors({n: (E, r, i) for n, (i, _) in dims.items()}, device)
            self.lora_B[adapter_name] = _Factors({n: (E, o, r) for n, (_, o) in dims.items()}, device)
            self._init_factors(adapter_name, config.init_lora_weights, dims)
            self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

        @torch.no_grad()
        def _init_factors(self, adapter_name, init, dims):
            """As PEFT's Linear: A ~ kaiming-uniform (bound 1/sqrt(in)) per expert, or N(0, 1/r) with "gaussian";
            B = 0; init_lora_weights=False: B drawn like A too (bound 1/sqrt(r)), so the adapter acts at once."""
            A, B, r = self.lora_A[adapter_name], self.lora_B[adapter_name], self.r[adapter_name]
            if init not in (True, False, "gaussian"):
                raise ValueError(f"LoRA on the packed MXFP4 experts: init_lora_weights={init!r} is not supported "
                                 "(True, False or 'gaussian')")
            for n, (i, _) in dims.items():
                if init == "gaussian":
                    getattr(A, n).normal_(0, 1 / r)
                else:
                    getattr(A, n).uniform_(-1 / math.sqrt(i), 1 / math.sqrt(i))
                if init is False:
                    getattr(B, n).uniform_(-1 / math.sqrt(r), 1 / math.sqrt(r))

        def _active(self):
            return [(self.lora_A[a], self.lora_B[a], self.scaling[a], self.lora_dropout[a])
                    for a in self.active_adapters if a in self.lora_A]

        def forward(self, x, topk_idx, topk_weights, *args, **kwargs):
            self._check_forward_args(x, *args, **kwargs)
            if kwargs.get("adapter_names") is not None:
                raise ValueError("LoRA on the packed MXFP4 experts does not support mixed-adapter batches "
                                 "(`adapter_names`)")
            if self.disable_adapters:
                if self.merged:
                    self.unmerge()
                return self.base_layer(x, topk_idx, topk_weights)
            adapters = self._active()
            if self.merged or not adapters:
                return self.base_layer(x, topk_idx, topk_weights)
            return packed_experts_lora_forward(self.get_base_layer(), x, topk_idx, topk_weights, adapters)

        def merge(self, safe_merge=False, adapter_names=None):
            """Merge the adapters into the packed experts, requantised (`merge_into_packed`); the merged weights
            are checked for non-finite values either way, so `safe_merge` changes nothing."""
            adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
            if not adapter_names:
                return
            base = self.get_base_layer()
            if self._unmerged is None:
                self._unmerged = {n: (getattr(base, f"{n}_packed").clone(), getattr(base, f"{n}_scale").clone())
                                  for n in _PROJECTIONS}
            name = self.kwargs.get("target_name") or "experts"
            adapters = [(self.lora_A[a], self.lora_B[a], self.scaling[a], None) for a in adapter_names]
            report = merge_into_packed(base, adapters, name)
            logger.info(f"{name}: LoRA adapter(s) {adapter_names} merged into the MXFP4 experts and requantised: "
                        f"error {report['all']['relative']:.3e} of the merged weights, "
                        f"{report['all']['of_update']:.3e} of the adapter update")
            self.merged_adapters.extend(adapter_names)

        def unmerge(self):
            """Restore the packed bytes from before the first merge (requantisation is not invertible)."""
            if not self.merged:
                return
            base = self.get_base_layer()
            with torch.no_grad():
                for n, (packed, scale) in self._unmerged.items():
                    getattr(base, f"{n}_packed").copy_(packed)
                    getattr(base, f"{n}_scale").copy_(scale)
            base.merge_error = None
            self._unmerged = None
            self.merged_adapters.clear()

        def get_delta_weight(self, adapter, projection="w1"):
            """s * B_e A_e of one projection for every expert: [E, out, in] fp32."""
            A, B = getattr(self.lora_A[adapter], projection), getattr(self.lora_B[adapter], projection)
            return self.scaling[adapter] * torch.bmm(B.float(), A.float())

        def __repr__(self):
            return "lora." + super().__repr__()
else:
    PackedExpertsLoraLayer = None


def register_packed_experts_lora(config):
    """Register `PackedExpertsLoraLayer` for `PackedMXFP4Experts` on a PEFT `LoraConfig` (its custom-module mapping,
    which PEFT does not save with the adapter: register it again on the config you load with). Returns the
    config."""
    _need_peft()
    config._register_custom_module({PackedMXFP4Experts: PackedExpertsLoraLayer})
    return config


def packed_experts_lora_config(**kwargs):
    """A PEFT `LoraConfig(**kwargs)` with `PackedExpertsLoraLayer` registered: target the packed experts with
    `target_modules=[..., "experts"]`."""
    _need_peft()
    return register_packed_experts_lora(LoraConfig(**kwargs))


def load_packed_experts_adapter(model, adapter_path, config=None, **kwargs):
    """`PeftModel.from_pretrained(model, adapter_path, config=..., **kwargs)` with the adapter's saved `LoraConfig`
    (or `config`) registered for the packed experts."""
    _need_peft()
    if config is None:
        config = PeftConfig.from_pretrained(adapter_path, **{k: kwargs[k] for k in ("subfolder", "revision", "token")
                                                             if k in kwargs})
    return PeftModel.from_pretrained(model, adapter_path, config=register_packed_experts_lora(config), **kwargs)


__all__ = ["PackedExpertsLoraLayer", "packed_experts_lora_forward", "merge_into_packed", "merge_errors",
           "register_packed_experts_lora", "packed_experts_lora_config", "load_packed_experts_adapter"]
