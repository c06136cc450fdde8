"""Kimi Delta Attention kernels.

    from kimi3_kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda, naive_chunk_kda

`chunk_kda` (prefill/training, autograd) and `fused_recurrent_kda` (decode) run Triton kernels and
raise a clear error when Triton is missing (`TRITON_AVAILABLE` says which). `naive_*` are the PyTorch
references with the same signatures. State layout [N, H, K, V] fp32; `state_vk_to_kv` /
`state_kv_to_vk` convert from / to the official K3 [V, K] layout. `short_conv_update` and
`gated_rms_norm` (layer_ops.py) fuse the layer's per-token convs and output norm for decode.
"""
from ._utils import CHUNK_SIZE, TRITON_AVAILABLE
from .chunk import chunk_kda
from .layer_ops import gated_rms_norm, short_conv, short_conv_update
from .recurrent import fused_recurrent_kda
from .reference import (kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda, state_kv_to_vk,
                        state_vk_to_kv)

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_chunk_kda", "naive_recurrent_kda", "kda_gate", "l2norm",
           "state_kv_to_vk", "state_vk_to_kv", "short_conv", "short_conv_update", "gated_rms_norm", "TRITON_AVAILABLE",
           "CHUNK_SIZE"]
