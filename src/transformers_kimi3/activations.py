"""The gated linear unit of every feed-forward block (the dense MLP, the bf16 experts, the packed MXFP4 experts):

    SiLU-GLU (Kimi Linear):  h = SiLU(gate) * up
    SiTU-GLU (K3):           h = SiTU_b1(gate) * b2 tanh(up / b2),   SiTU_b(x) = b tanh(x / b) sigmoid(x)

SiTU is SiLU for small x and bounded by b, so |h| <= b1 b2; without `linear_beta` (b2) the up branch stays linear.
`GLUActivation.spec` is what the fused kernels need to compute the same function in their epilogues.
"""

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

KINDS = {"silu": "silu", "swish": "silu", "situ": "situ"}  # config.hidden_act -> the GLU it names


def situ(x, beta):
    """SiTU_beta(x) = beta tanh(x / beta) sigmoid(x): SiLU for small x, bounded by beta."""
    return beta * torch.tanh(x / beta) * torch.sigmoid(x)


def glu(gate, up, kind, beta=None, linear_beta=None):
    """The GLU of `kind` on gate and up as given (the callers pass fp32)."""
    if kind == "situ":
        if linear_beta is not None:
            up = linear_beta * torch.tanh(up / linear_beta)
        return situ(gate, beta) * up
    return F.silu(gate) * up


class GLUActivation(nn.Module):
    """act(gate) * up computed in fp32 and returned in gate's dtype (module docstring). kind "silu" (or "swish")
    or "situ" (with beta, and linear_beta or None)."""

    def __init__(self, kind="silu", beta=None, linear_beta=None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"GLU activation {kind!r} is unknown; supported: {sorted(KINDS)}")
        self.kind = KINDS[kind]
        if self.kind == "situ" and beta is None:
            raise ValueError("Kimi3 config: `activation_situ_beta` is required when hidden_act is 'situ'")
        self.beta = None if self.kind == "silu" else float(beta)
        self.linear_beta = None if self.kind == "silu" or linear_beta is None else float(linear_beta)

    @classmethod
    def from_config(cls, config):
        return cls(config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)

    @property
    def spec(self):
        """(kind, beta, linear_beta): the GLU as the fused kernels take it."""
        return self.kind, self.beta, self.linear_beta

    def extra_repr(self):
        return f"kind={self.kind!r}" + (f", beta={self.beta}, linear_beta={self.linear_beta}" if self.beta else "")

    def forward(self, gate, up):
        if gate.shape == up.shape and kernels.moe_ops is not None and kernels.inference_ok(gate, (up,)):
            with kernels.on_device(gate):  # inference: one launch instead of 5 (SiTU: 11)
                return kernels.moe_ops.glu_mul(gate, up, self.beta, self.linear_beta)
        return glu(gate.float(), up.float(), *self.spec).to(gate.dtype)
