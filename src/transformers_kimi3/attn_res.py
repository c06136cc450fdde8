"""Block Attention Residuals: a softmax over earlier block summaries replaces the residual stream.

Each aggregation point owns a pseudo-query (`*_res_proj`, Linear d->1, checkpoint shape [1, d]) and an RMSNorm
(`*_res_norm`) whose gain multiplies the query; sources are RMS-normalised for the scores only and mixed raw, in
fp32 (SPEC 0.6 and 4): score = (k * norm.weight * proj.weight[0]).sum(-1) = proj(norm(v)).
Both run through their own modules' forward, so offloading hooks see every weight use; for inference on CUDA
`kernels.attn_res_ops` does the whole mix in one launch when the weights are already on the bank's device.
Layer 0 has an attention-side pair too (the official checkpoint holds it) but its mix never runs: the bank is empty
there, so attention reads the embedding itself. That pair is built with `trainable=False` (requires_grad=False,
kept through loading): every trainable tensor then gets a gradient, as DistributedDataParallel without
find_unused_parameters requires.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .norms import Kimi3RMSNorm, rms


def kernel_used(bank, proj, norm):
    """The one-launch mix runs for inference when importable, with both weights already on the bank's device
    (under Accelerate offloading they arrive only inside their module's forward: the PyTorch path then)."""
    return (kernels.attn_res_ops is not None and not torch.is_grad_enabled() and kernels.inference_ok(bank)
            and proj.weight.device == bank.device == norm.weight.device
            and not any(hasattr(w, "device_mesh") for w in (proj.weight, norm.weight)))


class Trainability:
    """For a module whose weights no output depends on (`trainable=False`): every Parameter it is given is made
    requires_grad=False, the one created at init and the ones assigned later (from_pretrained's loader replaces each
    weight by a new Parameter that requires grad). `requires_grad_(True)` still unfreezes them explicitly."""

    trainable = True

    def register_parameter(self, name, param):
        if param is not None and not self.trainable:
            param.requires_grad_(False)
        super().register_parameter(name, param)

    def set_trainable(self, trainable):
        self.trainable = trainable
        if not trainable:
            self.requires_grad_(False)


class Kimi3AttnResNorm(Trainability, Kimi3RMSNorm):
    """The key norm: like Kimi3RMSNorm but kept in fp32 (the scores are computed in fp32)."""

    def __init__(self, hidden_size, eps=1e-6, trainable=True):
        super().__init__(hidden_size, eps=eps)
        self.set_trainable(trainable)

    def forward(self, x):
        return rms(x, self.variance_epsilon) * self.weight.float()


class Kimi3AttnResProj(Trainability, nn.Linear):
    """The pseudo-query, applied in fp32."""

    def __init__(self, hidden_size, trainable=True):
        super().__init__(hidden_size, 1, bias=False)
        self.set_trainable(trainable)

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())


def attn_res_mix(bank, partial, proj, norm):
    """bank [B,T,n,d] (n >= 1 completed blocks), partial [B,T,d] or None -> mix [B,T,d] in bank's dtype."""
    if kernel_used(bank, proj, norm):
        with kernels.on_device(bank):
            return kernels.attn_res_ops.attn_res_mix(bank, partial, norm.weight, proj.weight, norm.variance_epsilon)
    sources = bank if partial is None else torch.cat([bank, partial[:, :, None].to(bank.dtype)], dim=2)
    v = sources.float()
    weights = torch.softmax(proj(norm(v))[..., 0], dim=-1)
    return (weights[..., None] * v).sum(2).to(bank.dtype)
