"""RMS norms as Moonshot's code computes them (fp32 statistics; the plain norm casts back before the gain)."""

import torch
import torch.nn.functional as F
from torch import nn


def rms(x, eps):
    """x / sqrt(mean(x^2) + eps) in fp32. F.rms_norm without a gain is exactly this op chain on CPU (checked bit for
    bit) and may dispatch to PyTorch's fused kernel on GPUs; a decode step runs dozens of norms."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


class Kimi3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        # F.rms_norm upcasts to fp32 internally and rounds the result back to x's dtype: the same as
        # rms(x).to(x.dtype), bit for bit on CPU, without a separate cast kernel
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class Kimi3GatedRMSNorm(nn.Module):
    """KDA output norm: RMSNorm(x) * weight * sigmoid(gate), all in fp32 (fla FusedRMSNormGated)."""

    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x, gate):
        return (rms(x, self.variance_epsilon) * self.weight.float() * torch.sigmoid(gate.float())).to(x.dtype)
