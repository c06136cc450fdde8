"""Shared helpers: the optional Triton import, chunk tables for (variable-length) packing."""
from __future__ import annotations

import torch

from .._host import cdiv, interpreter_enabled, next_pow2  # noqa: F401  (re-exported for the kda modules)

try:  # Triton is optional: the package must import without it
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    TRITON_AVAILABLE = True
    TRITON_IMPORT_ERROR = None
except Exception as ex:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    TRITON_AVAILABLE = False
    TRITON_IMPORT_ERROR = ex

CHUNK_SIZE = 64


def require_triton():
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "kimi3_kernels.kda: Triton is not importable "
            f"({TRITON_IMPORT_ERROR!r}); install triton>=3.4 or use the PyTorch references "
            "kimi3_kernels.kda.naive_chunk_kda / naive_recurrent_kda")




class SeqInfo:
    """Flattened packing of a batch: sequences along one token axis.

    cu: int32 [N+1] token offsets (device); chunk_tab: int32 [NC, 2] (sequence id, first token) for
    every 64-token chunk of every sequence, in order; chunk_off: int32 [N+1] first chunk of each
    sequence. Fixed-length batches are built without a device-to-host copy; varlen ones read
    cu_seqlens on the host once (chunked prefill/training only, never the decode path).
    """

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None, device, chunk: int = CHUNK_SIZE):
        if cu_seqlens is None:
            N = B
            lens = [T] * B
            cu_host = [i * T for i in range(B + 1)]
        else:
            if B != 1:
                raise ValueError(f"cu_seqlens requires B == 1 (packed sequences), got B={B}")
            cu_host = [int(x) for x in cu_seqlens.tolist()]
            N = len(cu_host) - 1
            lens = [cu_host[i + 1] - cu_host[i] for i in range(N)]
            if any(L < 0 for L in lens) or cu_host[0] != 0 or cu_host[-1] > T:
                raise ValueError(f"bad cu_seqlens {cu_host} for T={T}")
        nch = [(L + chunk - 1) // chunk for L in lens]
        tab = []
        for n in range(N):
            for c in range(nch[n]):
                tab.append((n, cu_host[n] + c * chunk))
        off = [0]
        for c in nch:
            off.append(off[-1] + c)
        self.N = N
        self.NC = off[-1]
        self.tokens = cu_host[-1]  # tokens covered by the sequences; any after them are outside every sequence
        # one host-to-device copy for the three tables (each copy from pageable memory waits for the stream), each
        # table starting on a 16-byte boundary like a tensor of its own
        cu_p, off_p = (list(xs) + [0] * (-len(xs) % 4) for xs in (cu_host, off))
        buf = torch.tensor(cu_p + off_p + [x for row in tab for x in row], dtype=torch.int32).to(device)
        self.cu = buf[:N + 1]
        self.chunk_off = buf[len(cu_p):len(cu_p) + N + 1]
        self.chunk_tab = buf[len(cu_p) + len(off_p):].view(-1, 2)

    _FIXED: dict = {}
    _LAST_VARLEN: tuple = ()

    @classmethod
    def get(cls, B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> "SeqInfo":
        """SeqInfo(...), with fixed-length batches' tables built once per (B, T, device), and a varlen batch's reused
        while the same, unchanged cu_seqlens tensor comes back (the layers of a forward pass one tensor). Building
        them copies host lists to the device, which waits for the stream, and a varlen batch's also reads cu_seqlens on
        the host, so every call would stall the GPU until Python had launched its kernels. Fixed-length tables are not cached while a CUDA
        graph is being captured: tensors made then are filled only when it replays."""
        device = torch.device(device)
        if cu_seqlens is not None:
            # same object and version counter; the reference kept here stops its id from being reused
            if cu_seqlens.is_inference():  # no version counter to notice in-place changes: no reuse
                return cls(B, T, cu_seqlens, device)
            last = cls._LAST_VARLEN
            key = (B, T, str(device), cu_seqlens._version)
            if last and last[0] is cu_seqlens and last[1] == key:
                return last[2]
            info = cls(B, T, cu_seqlens, device)
            cls._LAST_VARLEN = (cu_seqlens, key, info)
            return info
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return cls(B, T, cu_seqlens, device)
        key = (B, T, str(device))
        info = cls._FIXED.get(key)
        if info is None:
            if len(cls._FIXED) >= 64:
                cls._FIXED.clear()
            info = cls._FIXED[key] = cls(B, T, None, device)
        return info
