"""The one place that imports our Triton kernels (`kimi3_kernels`) and flash-linear-attention (`fla`), picks the
backend each layer runs, and holds the device helpers the layers share.

Layers import this module and call `kernels.<op>`; everything here degrades to `None` / the PyTorch path when a
package is missing, so the modules copied as remote code load without `kimi3_kernels`.

Settings (docs/kernels.md has the table):
- `config.kda_backend` ("triton", "fla", "fla_chunk", "torch"; None picks triton on CUDA, else torch);
  KIMI3_KDA_BACKEND gives the same choice where the config leaves it None.
- KIMI3_INFERENCE_KERNELS=0 turns every fused inference kernel off (router, GEMVs, GLU, convs, norms, AttnRes mix,
  the decoded-bf16 expert prefill): the PyTorch paths run instead, for debugging.
Nothing else is read from the environment.
"""

import contextlib
import importlib
import importlib.util
import logging
import os

import torch

from .configuration_kimi3 import KDA_BACKENDS
from .kda_reference import naive_chunk_kda, naive_recurrent_kda

logger = logging.getLogger("transformers_kimi3")

ENV_KDA_BACKEND = "KIMI3_KDA_BACKEND"
ENV_INFERENCE_KERNELS = "KIMI3_INFERENCE_KERNELS"

_IMPORT_ERRORS = {}


def _optional(name):
    """kimi3_kernels.<name> if it imports and Triton is there, else None (the error kept for kernel_status)."""
    try:
        mod = importlib.import_module(f"kimi3_kernels.{name}")
    except Exception as e:  # noqa: BLE001 - absent or broken kernels must not stop the model from loading
        _IMPORT_ERRORS[name] = f"{type(e).__name__}: {e}"
        return None
    if not (getattr(mod, "TRITON_AVAILABLE", False) or getattr(mod, "HAS_TRITON", False)):
        _IMPORT_ERRORS[name] = "triton is not importable"
        return None
    return mod


kda_ops = _optional("kda")  # chunk_kda, fused_recurrent_kda, short_conv(_update), gated_rms_norm
moe_ops = _optional("moe_decode")  # decode router, expert / MLP GEMVs, GLU, route combine
attn_res_ops = _optional("attn_res")  # the AttnRes mix in one launch
linear_ops = _optional("linears")  # several small projections in one launch (decode graphs)

_MXFP4 = []


def mxfp4_ops():
    """The packed MXFP4 grouped-GEMM kernels, or None; imported on first use (their import builds Gluon kernels)."""
    if not _MXFP4:
        _MXFP4.append(_optional("mxfp4"))
    return _MXFP4[0]


# ----------------------------------------------------------------------------------------------------------------
# device helpers


def on_device(t):
    """Triton launches on the current CUDA device; under a device_map a layer may live on another GPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def kernel_device(t):
    """Whether Triton kernels may run on `t`'s device: CUDA. (Tests patch this to run them on CPU tensors under
    Triton's interpreter.)"""
    return t.is_cuda


def inference_kernels_enabled():
    return os.environ.get(ENV_INFERENCE_KERNELS, "1") != "0"


def inference_ok(x, params=()):
    """A fused inference kernel may stand in for the PyTorch path on x: enabled, a kernel device, nothing recorded
    for autograd, plain parameters (DTensors under tensor parallelism keep the PyTorch path)."""
    return (inference_kernels_enabled() and kernel_device(x)
            and not any(hasattr(p, "device_mesh") for p in params)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))))


# ----------------------------------------------------------------------------------------------------------------
# KDA backends

_FLA = {}
_announced = set()


def _fla():
    """fla's KDA ops (chunk, recurrent), imported on first use: importing fla takes seconds."""
    if "ops" not in _FLA:
        try:
            from fla.ops.kda import chunk_kda, fused_recurrent_kda

            _FLA["ops"] = (chunk_kda, fused_recurrent_kda)
        except Exception:  # noqa: BLE001 - fla raises more than ImportError when triton is missing or broken
            _FLA["ops"] = None
    return _FLA["ops"]


def _fla_installed():
    return importlib.util.find_spec("fla") is not None


def resolve_kda_backend(device, requested=None, announce=True):
    """The KDA backend for `device`: `requested` (the config field), else KIMI3_KDA_BACKEND, else triton on CUDA
    when importable, else torch. Asking for one that cannot run is an error, never a silent fallback."""
    requested = requested or os.environ.get(ENV_KDA_BACKEND) or None
    if requested is not None and requested not in KDA_BACKENDS:
        source = "kda_backend" if requested != os.environ.get(ENV_KDA_BACKEND) else ENV_KDA_BACKEND
        raise ValueError(f"{source}={requested!r} is not a KDA backend; choose one of {KDA_BACKENDS}")
    on_cuda = device.type == "cuda"
    if requested in ("fla", "fla_chunk") and (not on_cuda or _fla() is None):
        raise RuntimeError(f"KDA backend {requested!r} was requested but flash-linear-attention is not importable "
                           f"or the device is {device.type}; install fla-core or choose another backend")
    if requested in ("triton", "fla_chunk") and not (kda_ops is not None and on_cuda):
        raise RuntimeError(f"KDA backend {requested!r} was requested but kimi3_kernels/triton cannot run on "
                           f"{device.type}")
    backend = requested or ("triton" if (kda_ops is not None and on_cuda) else "torch")
    if announce and (backend, device.type) not in _announced:
        _announced.add((backend, device.type))
        msg = f"Kimi3 KDA backend: {backend} on {device.type}"
        if backend == "torch" and on_cuda:
            logger.warning(msg + " (PyTorch reference: slow; install triton for the fast kernels)")
        else:
            logger.info(msg)
    return backend


def kda_chunk(q, k, v, g, beta, backend, **kw):
    """Chunked KDA (prefill, training) on `backend`; "fla_chunk" runs fla's chunked kernels."""
    if backend in ("fla", "fla_chunk"):
        return _fla_call(_fla()[0], q, k, v, g, beta, safe_gate=kw.get("lower_bound") is not None, **kw)
    if backend == "triton":
        with on_device(q):
            return kda_ops.chunk_kda(q, k, v, g, beta, **kw)
    return naive_chunk_kda(q, k, v, g, beta, **kw)


def kda_recurrent(q, k, v, g, beta, backend, **kw):
    """Recurrent KDA (decode, a few tokens) on `backend`; "fla_chunk" runs our recurrent kernel."""
    if backend == "fla":
        return _fla_call(_fla()[1], q, k, v, g, beta, **kw)
    if backend in ("triton", "fla_chunk"):
        with on_device(q):
            return kda_ops.fused_recurrent_kda(q, k, v, g, beta, **kw)
    return naive_recurrent_kda(q, k, v, g, beta, **kw)


def _fla_call(fn, q, k, v, g, beta, *, A_log, dt_bias, lower_bound=None, scale=None, initial_state=None,
              output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=True, **extra):
    extra.pop("inplace_final_state", None)
    return fn(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
              initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, **extra)


# ----------------------------------------------------------------------------------------------------------------
# status


def _mxfp4_status(device):
    g = mxfp4_ops()
    on = g is not None and g.available(device)
    status = {"mxfp4_experts": "triton" if on else "torch-per-expert", "triton": g is not None}
    if on and hasattr(g, "status"):
        status.update(g.status(device))
    return status


def kernel_status(device=None, requested=None):
    """What is importable here and which backend each part of the model runs on `device`."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    on_cuda = device.type == "cuda"
    fused = inference_kernels_enabled() and on_cuda
    return {
        "device": str(device),
        "kda": {"backend": resolve_kda_backend(device, requested, announce=False),
                "available": {"triton": kda_ops is not None and on_cuda,
                              "fla": on_cuda and _fla_installed() and _fla() is not None, "torch": True},
                "fla_installed": _fla_installed()},
        "moe": _mxfp4_status(device),
        "inference_kernels": {"enabled": inference_kernels_enabled(),
                              "router_gemv_glu": fused and moe_ops is not None,
                              "attn_res_mix": fused and attn_res_ops is not None,
                              "kda_convs_norm": fused and kda_ops is not None,
                              "decode_projections": fused and linear_ops is not None},
        "import_errors": dict(_IMPORT_ERRORS),
    }
