"""Feed-forward blocks: the dense MLP, the sigmoid router and the (latent) mixture of experts. The GLU they share
is `activations.GLUActivation`; the packed MXFP4 experts are `mxfp4_experts.PackedMXFP4Experts`. Decode-size
kernels (router, expert and MLP GEMVs, the grouped-GEMM combine) come from `kernels.moe_ops`."""

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .activations import GLUActivation
from .mxfp4_experts import PackedMXFP4Experts
from .mxfp8 import check_activation_format, fake_quantize_mxfp8
from .norms import Kimi3RMSNorm

try:  # Transformers' experts interface: `model.set_experts_implementation("grouped_mm" | "batched_mm" | "eager")`
    from transformers.integrations.moe import use_experts_implementation

    EXPERTS_INTERFACE = True
except ImportError:  # a Transformers without it: the experts' own path only
    EXPERTS_INTERFACE = False

    def use_experts_implementation(experts_class=None, **kwargs):
        return experts_class if experts_class is not None else (lambda cls: cls)

# Up to this many routes (tokens x top_k) the router runs as two launches and SiLU experts as per-route GEMVs, no
# sorting: at 1 and 8 tokens of Kimi Linear (top-8) 45 vs 122 us and 178 vs 290 us against the grouped GEMM,
# CUDA-graph-replayed.
GEMV_MAX_ROUTES = 64


def _decode_kernels(x, params, routes=0):
    """Whether a `kernels.moe_ops` kernel may stand in for the PyTorch path: importable, at most GEMV_MAX_ROUTES
    routes, and `kernels.inference_ok` (a kernel device, no autograd recording, plain parameters)."""
    return kernels.moe_ops is not None and routes <= GEMV_MAX_ROUTES and kernels.inference_ok(x, params)


class Kimi3MLP(nn.Module):
    def __init__(self, config, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = GLUActivation.from_config(config)

    def forward(self, x):
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if self.act_fn.kind == "silu" and x.numel() == x.shape[-1] and _decode_kernels(x, weights, 1) \
                and all(w.is_contiguous() for w in weights):
            with kernels.on_device(x):  # one token: two launches, and no slow cuBLAS tile for narrow projections
                return kernels.moe_ops.mlp_gemv(x.reshape(1, -1), *weights).view(x.shape)
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class Kimi3TopkRouter(nn.Module):
    """fp32 sigmoid scores; top-k on scores + correction bias (selection only); weights are the unbiased scores,
    renormalised when top_k > 1, times routed_scaling_factor."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.num_group = config.num_expert_group
        self.topk_group = config.topk_group
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x):
        if self.num_group <= 1 and _decode_kernels(x, (self.weight,), x.shape[0] * self.top_k):
            # a few tokens (decode): two launches instead of ~12 small ones
            with kernels.on_device(x):
                return kernels.moe_ops.route_topk(x, self.weight, self.e_score_correction_bias, self.top_k,
                                                  self.renormalize, self.routed_scaling_factor)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.num_group > 1:
            grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(self.num_experts // self.num_group, 1),
                                        float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        if self.renormalize and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, idx


@use_experts_implementation
class Kimi3Experts(nn.Module):
    """Routed experts as 3-D weights (checkpoint names w1 = gate, w3 = up, w2 = down, stacked over experts).

    Built on Transformers' experts interface: `config._experts_implementation` picks the forward. "eager" (the
    default of our models, `Kimi3PreTrainedModel.get_correct_experts_implementation`) is this class's own path below;
    "batched_mm" and "grouped_mm" are Transformers' functions, which read `gate_up_proj` [E, 2I, D] and `down_proj`
    [E, D, I] (computed from `_weights()`: w1 | w3 and w2) and call `_apply_gate` for the GLU. They compute on the
    activations as given: `moe_activation_format="mxfp8"` needs the own path and is refused there.

    Computed as index-sorted segments: assignments are sorted by expert and each expert's tokens go through one
    matmul; `torch._grouped_mm` does all experts in one launch on CUDA (bf16). At decode sizes on CUDA (SiLU
    experts, up to GEMV_MAX_ROUTES routes) per-route Triton GEMVs skip the sort; elsewhere small batches gather the
    chosen experts' weights. Neither synchronises with the host.

    Hook points: `_weights()` gives the (w1, w3, w2) every path computes with (`qat.QATExperts` returns them
    fake-quantised to MXFP4; an adapter would return them with its update added) and `_gemm_input` the activations
    as the GEMMs read them: as given, or fake-quantised to MXFP8 with `config.moe_activation_format` "mxfp8" (then
    the fused decode GEMVs, which compute the GLU between their GEMMs, are skipped).
    """

    GATHER_MAX_ASSIGNMENTS = 32  # copying the chosen experts' weights only pays for a handful of tokens

    def __init__(self, config, input_size):
        super().__init__()
        E, inter = config.num_experts, config.moe_intermediate_size
        self.num_experts = E
        self.w1 = nn.Parameter(torch.empty(E, inter, input_size))
        self.w3 = nn.Parameter(torch.empty(E, inter, input_size))
        self.w2 = nn.Parameter(torch.empty(E, input_size, inter))
        self.act_fn = GLUActivation.from_config(config)
        self.activation_format = check_activation_format(config.moe_activation_format)

    def _weights(self):
        return self.w1, self.w3, self.w2

    # ---- Transformers' experts interface (batched_mm / grouped_mm)
    @property
    def gate_up_proj(self):
        """Gate and up projections stacked, [E, 2I, D] (a new tensor each call: the checkpoint keeps w1 and w3)."""
        w1, w3, _ = self._weights()
        return torch.cat([w1, w3], dim=1)

    @property
    def down_proj(self):
        return self._weights()[2]

    def _apply_gate(self, gate_up_out):
        if self.activation_format != "bf16":
            raise ValueError(f"moe_activation_format={self.activation_format!r} fake-quantises the experts' GEMM "
                             "inputs on their own path only: use experts_implementation='eager' "
                             "(model.set_experts_implementation('eager'))")
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate, up)

    def _gemm_input(self, a):
        return fake_quantize_mxfp8(a, "routed expert activations") if self.activation_format == "mxfp8" else a

    def forward(self, x, topk_idx, topk_weights):
        """Under expert parallelism (Transformers' `ep_router` / `ep_dispatch_experts`) `num_experts` is this rank's
        count and a route to another rank's expert arrives as index `num_experts` with weight 0: it is skipped."""
        T, k = topk_idx.shape
        weights = self._weights()
        if (self.act_fn.kind == "silu" and self.activation_format == "bf16" and all(w.is_contiguous() for w in weights)
                and _decode_kernels(x, weights, T * k)):
            with kernels.on_device(x):
                return kernels.moe_ops.expert_gemv(x, *weights, topk_idx, topk_weights)
        if kernels.kernel_device(x) and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16:
            out, order, offs = self._grouped_mm(x, topk_idx, weights)
            if _decode_kernels(x, weights):  # inference: the weighted sum straight from the sorted rows, one launch
                with kernels.on_device(x):
                    return kernels.moe_ops.combine_sorted(out, order, topk_idx, topk_weights, self.num_experts)
            y = self._unsort(out, order, offs)
        elif T * k <= self.GATHER_MAX_ASSIGNMENTS or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            y = self._gathered(x, topk_idx, weights)  # no host synchronisation (a graph capture has no other way)
        else:
            y = self._segments(x, topk_idx, weights)
        return (y.float().view(T, k, -1) * topk_weights.float()[..., None]).sum(1)

    def _gathered(self, x, topk_idx, weights=None):
        w1, w3, w2 = weights if weights is not None else self._weights()
        flat = topk_idx.reshape(-1).clamp(max=self.num_experts - 1)  # off-rank routes (weight 0) read any expert
        xs = self._gemm_input(x).repeat_interleave(topk_idx.shape[1], dim=0)[:, :, None]
        h = self._gemm_input(self.act_fn(torch.bmm(w1[flat], xs)[..., 0], torch.bmm(w3[flat], xs)[..., 0]))
        return torch.bmm(w2[flat], h[:, :, None])[..., 0]

    def _sorted(self, x, topk_idx):
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)
        # scatter_add, not bincount: bincount(minlength=...) copies to the host, which a CUDA graph cannot hold
        counts = torch.zeros(self.num_experts + 1, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))[: self.num_experts]  # off-rank routes (index num_experts) sort last
        return order, counts, x[order // topk_idx.shape[1]]

    def _segments(self, x, topk_idx, weights=None):
        w1, w3, w2 = weights if weights is not None else self._weights()
        order, counts, xs = self._sorted(self._gemm_input(x), topk_idx)
        out = torch.zeros(xs.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)  # off-rank rows stay 0
        start = 0
        for e, n in enumerate(counts.tolist()):  # one host sync; experts with no token are skipped
            if n:
                seg = xs[start:start + n]
                h = self._gemm_input(self.act_fn(seg @ w1[e].T, seg @ w3[e].T))
                out[start:start + n] = h @ w2[e].T
                start += n
        return out.new_empty(out.shape).index_copy_(0, order, out)

    def _grouped_mm(self, x, topk_idx, weights=None):
        # torch._grouped_mm is outside autocast: bf16 activations reaching float weights (Trainer's bf16=True) get
        # the weights cast as autocast casts a Linear's (no copy when they already are bf16)
        w1, w3, w2 = (w.to(x.dtype) for w in (weights if weights is not None else self._weights()))
        order, counts, xs = self._sorted(self._gemm_input(x), topk_idx)
        offs = counts.cumsum(0).to(torch.int32)
        g = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)
        u = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs)
        h = self._gemm_input(self.act_fn(g, u))
        return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), order, offs

    @staticmethod
    def _unsort(out, order, offs):
        """Expert-sorted rows back to route order; off-rank routes sort last, are not computed and become 0."""
        rows = torch.arange(out.shape[0], device=out.device)[:, None]
        out = out.masked_fill(rows >= offs[-1], 0)
        return out.new_empty(out.shape).index_copy_(0, order, out)


class Kimi3SparseMoeBlock(nn.Module):
    """Stable LatentMoE (K3): router and shared experts on the full width; routed experts in the latent width
    between `routed_expert_down_proj` and `routed_expert_norm` -> `routed_expert_up_proj`. Without a latent width
    (Kimi Linear) the experts work on x directly. With offloaded experts (`expert_offload.offload_experts`) the
    routed experts run through `expert_cache`, this layer's cache of them on the device."""

    expert_cache = None

    def __init__(self, config):
        super().__init__()
        self.gate = Kimi3TopkRouter(config)
        latent = config.routed_expert_hidden_size
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, config.hidden_size, bias=False)
        if config.latent_moe_use_norm:
            self.routed_expert_norm = Kimi3RMSNorm(config.expert_input_size, eps=config.rms_norm_eps)
        if config.checkpoint_quantization_config:  # routed experts stay MXFP4 as on disk (4x less memory)
            self.experts = PackedMXFP4Experts(config.num_experts, config.expert_input_size,
                                              config.moe_intermediate_size, glu_act=GLUActivation.from_config(config),
                                              activation_format=config.moe_activation_format)
        else:
            self.experts = Kimi3Experts(config, config.expert_input_size)
        if config.num_shared_experts:
            self.shared_experts = Kimi3MLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_logits, weights, idx = self.gate(x)
        # offloaded experts: the step's missing experts start copying here, before the projections below are enqueued
        experts = self.experts if self.expert_cache is None else self.expert_cache.fetch(idx)
        z = self.routed_expert_down_proj(x) if hasattr(self, "routed_expert_down_proj") else x
        shared = self.shared_experts(x) if hasattr(self, "shared_experts") else None
        y = experts(z, idx, weights).to(x.dtype)
        if hasattr(self, "routed_expert_norm"):
            y = self.routed_expert_norm(y)
        if hasattr(self, "routed_expert_up_proj"):
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared
        return y.view(shape), router_logits
