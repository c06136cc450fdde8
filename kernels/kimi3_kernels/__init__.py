"""kimi3_kernels: Triton kernels for transformers-kimi3 (Kimi K3 / Kimi Linear).

`import kimi3_kernels` works without Triton; the kernel entry points then raise a clear error.
"""
from . import kda  # noqa: F401

TRITON_AVAILABLE = kda.TRITON_AVAILABLE

__all__ = ["kda", "TRITON_AVAILABLE"]
