"""Block Attention Residuals: a softmax over earlier block summaries replaces the residual stream.

Each aggregation point owns a pseudo-query (`*_res_proj`, Linear d->1, checkpoint shape [1, d]) and an RMSNorm
(`*_res_norm`) whose gain multiplies the query; sources are RMS-normalised for the scores only and mixed raw, in
fp32 (SPEC 0.6 and 4): score = (k * norm.weight * proj.weight[0]).sum(-1) = proj(norm(v)).
Both run through their own modules' forward, so offloading hooks see every weight use; for inference on CUDA
`kernels.attn_res_ops` does the whole mix in one launch when the weights are already on the bank's device.
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


class Kimi3AttnResNorm(Kimi3RMSNorm):
    """The key norm: like Kimi3RMSNorm but kept in fp32 (the scores are computed in fp32)."""

    def forward(self, x):
        return rms(x, self.variance_epsilon) * self.weight.float()


class Kimi3AttnResProj(nn.Linear):
    """The pseudo-query, applied in fp32."""

    def __init__(self, hidden_size):
        super().__init__(hidden_size, 1, bias=False)

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
