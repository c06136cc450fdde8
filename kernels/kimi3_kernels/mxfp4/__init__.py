"""MXFP4 kernels: the grouped GEMM of packed MXFP4 experts (Triton, and Gluon on sm_90), their decode, and a
PyTorch reference with the same signature.

- `decode.py`: the E2M1 decodes (inline PTX, shared by both GEMMs) and the K orders they feed the MMAs in.
- `kernel.py`: the Triton kernels; `wgmma.py`: the Gluon kernel for Hopper; `w4a8.py`: MXFP8 activations (the
  quantiser and the FP8 tensor-core GEMM).
- `tiles.py`: the measured tile tables and the tile choice; `options.py`: the alternatives bench/ and tests time.
- `gemm.py`: `mxfp4_grouped_gemm` (checks, launch plans, launches) and the small helper launches.
- `reference.py`: `mxfp4_grouped_gemm_ref`, `dequant_ref`.

`import kimi3_kernels.mxfp4` works without Triton (HAS_TRITON is then False; `available` says where the kernels
run). transformers_kimi3 reaches this package through `transformers_kimi3.kernels.mxfp4_ops()`.
"""

from .. import _launch
from . import options
from .decode import HAS_TRITON, decode_mode, kperm_index, kperm_position, permute_k
from .gemm import (
    available,
    block_prefix,
    clear_plans,
    dequantize_bf16,
    mxfp4_grouped_gemm,
    route_expert_ids,
    scales_fit_table_free,
    tail_split,
)
from .options import variant
from .reference import dequant_ref, mxfp4_grouped_gemm_ref
from .tiles import default_config, kperm_bk, kperm_tile, tile_state, wgmma_enabled
from .w4a8 import fp8_capable, quantize_mxfp8


def w4a8_available(device):
    """Whether the W4A8 kernels (MXFP8 activations on FP8 tensor cores) run on `device`."""
    return available(device) and fp8_capable(device)


def table_free_enabled():
    """Whether the Gluon tiles may use the decode without tables (the packed experts also check their scales)."""
    return options.get("table_free")


def status(device):
    """What `transformers_kimi3.kernels.kernel_status()["moe"]` reports about these kernels on `device`."""
    wg = available(device) and wgmma_enabled(device)
    out = {
        "weight_decode": decode_mode(device) if available(device) else None,
        # up to ~1,000 tokens (one or two rows per expert): the Gluon kernel with asynchronous wgmma (Hopper)
        "async_wgmma_small_batches": bool(wg),
        # ... decoding without tables, for experts whose scale exponents are all <= 128 (checked per module)
        "table_free_decode": bool(wg and table_free_enabled()),
        # ... reading each weight row's next 128-byte line into L2 ahead of its copies (bytes)
        "l2_prefetch_bytes": options.get("l2_prefetch") if wg else None,
        # routed experts with moe_activation_format="mxfp8", without autograd: FP8 tensor cores (sm_89+)
        "w4a8": bool(w4a8_available(device)),
    }
    if hasattr(_launch, "status"):  # later launches straight to the compiled kernel (host time)
        out.update(_launch.status())
    return out


__all__ = [
    "HAS_TRITON", "available", "status", "mxfp4_grouped_gemm", "mxfp4_grouped_gemm_ref", "dequant_ref",
    "dequantize_bf16", "route_expert_ids", "block_prefix", "tail_split", "scales_fit_table_free", "permute_k",
    "kperm_index", "kperm_position", "kperm_tile", "kperm_bk", "default_config", "tile_state", "wgmma_enabled",
    "decode_mode", "clear_plans", "variant", "table_free_enabled", "w4a8_available", "quantize_mxfp8",
]
