"""One switch for the inference-only fast paths: KIMI3_INFERENCE_KERNELS=0 runs the PyTorch paths instead.

Covered: the decode router, expert and dense-MLP GEMVs, the GLU kernels, the grouped-GEMM MoE combine, the KDA
short-conv kernels (prefill and decode) and fused decode norm, the AttnRes mix, and the MXFP4 experts' decoded
bf16 prefill path. Each computes what the PyTorch path computes (tests/kernels_kda_cases.py); the switch is for
A/B checks on a GPU (bench/e2e.py's `check_kernels` stage) and for debugging. Not covered: the KDA chunk and
recurrent kernels (`kda_backend` / KIMI3_KDA_BACKEND) and the packed MXFP4 GEMMs, which have their own choices.
"""
import os

try:  # os.environ.get's answer at a fraction of its cost (the switches are read at every decode step, per layer)
    from kimi3_kernels._host import env
except ImportError:  # remote code without our kernels package
    def env(name, default=None):
        return os.environ.get(name, default)


def inference_kernels_enabled():
    return env("KIMI3_INFERENCE_KERNELS", "1") != "0"
