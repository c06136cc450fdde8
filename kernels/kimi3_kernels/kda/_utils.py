"""Shared helpers: the optional Triton import, chunk tables for (variable-length) packing."""
from __future__ import annotations

import torch

from .._host import cdiv, env, interpreter_enabled, next_pow2  # noqa: F401  (re-exported for the kda modules)

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


def sm_count(device) -> int:
    """The GPU's SM count; off the GPU (the interpreter) an H200's 132, so tests take the same branches."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def state_scan_tile(programs_at_64: int, device) -> tuple[int, int]:
    """(value-tile width, pipeline stages) of the forward state scan: (64, 2), or (32, 3) when 64-wide tiles give
    fewer programs than the GPU has SMs (H=32, B=1: 64 programs on an H200's 132 SMs; the scan is latency-bound, so
    more, smaller programs win)."""
    return (64, 2) if programs_at_64 >= sm_count(device) else (32, 3)


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
        the host, so every call would stall the GPU until Python had launched its kernels (at 6ca64d8 an H=32 T=16K
        forward took 2.89 ms on an H200 against 2.66 ms of kernel time). Fixed-length tables are not cached while a CUDA
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


# Launch settings of the chunk kernels at K = V = 128: name -> (tile, num_warps, num_stages). `tile` is the width the
# kernel is tiled over (its K slice or value tile: see the launch in chunk_fwd.py / chunk_bwd.py / gate.py; None:
# whole rows), capped at the head dim for smaller heads. The kernels with diagonal 16x16 tiles have one entry for
# bounded gates (K3: one matmul per tile) and one for the per-column loop of unbounded ones (`_loop`, Kimi Linear).
# From `bench/kda.py --sections tune` on an H200 (bench/results/kda_h200.md): at 22fef45, one kernel at a time against
# the settings before, H=32 T=16K softplus gate and H=96 T=16K K3 gate, forward 3.92 -> 3.31 and 9.21 -> 7.18 ms,
# forward+backward 16.04 -> 14.53 and 33.92 -> 31.69 ms with the round's picks together; a second round around those
# picks (91aea39) kept them but the per-column loop's tile (64,4,1 -> 128,4,1: H=32 forward 3.18 -> 3.04 ms). Since
# unbounded gates' diagonal tiles mostly take the one-matmul path too (fcfd66e), their kernel runs best on 32-wide
# slices and 2 warps (6ca64d8: H=32 forward 2.89 -> 2.73 ms; 1 warp 0.97x, 64:2:1 1.04x), and their backward like
# K3's (9b2537d: H=32 forward+backward 12.23 -> 11.06 ms with 32,4,2). The forward's preparation: the gate in
# 64-column blocks on 4 warps (`prep_fwd`; 32-512 columns on 1-8 warps tried) and the norms in 32-row blocks on 4 warps
# (`norm_fwd`; 16-128 rows): per call at H=96 T=16K 0.354 + 0.391 ms against 0.996 ms for the single kernel per chunk
# and head before, at T=64K 1.40 + 1.56 against 4.60 ms (16th session). The forward state scan's tile and stages
# by grid size (None: `state_scan_tile`): at H=32 T=16K 32-wide value tiles on 3 stages, 707 -> 394 us per call
# (training forward, 359a6df) and forward 2.44 -> 2.24 ms (2e8a4d2); at H=96 64-wide on 2 stages (3 stages: 6.05 /
# 5.67 ms). The backward scan stays on 2 stages: 3 were 885 -> 852 and 2,700 -> 2,582 us per call (359a6df), but
# need 294,912 bytes of shared memory with fp32 inputs (sm_90 has 232,448; the fp32 gradient check failed, 446ae1e).
# The main backward kernel, since its K slices and V side run as separate programs (1d870a5), on 4 warps and 3 stages
# (two programs per SM): at H=96 / H=32 T=16K 6.83 / 2.24 ms per call against 8.96 / 2.99 for the single-program kernel
# on 32:8:1 (its best: 32:4:2 took it to 13.9 ms); 32:4:2 7.29, 32:8:1 9.67, 16:4:3 7.39, 32:8:4 8.43 at H=96
# (bench/results/kda_h200.md, 4f6ee34). The prep backward of the Kimi Linear (softplus) gate runs the gate's part in
# 32-wide column slices apart from the norms' (fe825ec, in one process: H=32 T=16K kernel 0.711 -> 0.565 ms, forward+
# backward 7.89 -> 7.74 ms); K3's gate keeps one program per chunk and head (H=96: 1.597 against 1.622-1.906 ms sliced).
# The inference forward's two kernels (an H100 A/B in one process against fla, 93dfac0, kda_h200.md): the recurrence on
# 3 stages, so the loads for step c+1 are waited for one step later (DEPBAR.LE SB0, 0x6 in the sm_90 SASS, 0x0 on 2):
# per call 1.71 -> 1.50 ms at H=96 T=16K, 1.32 -> 0.89 ms at H=32 T=16K (4 stages the same, 16-wide value tiles
# 1.9x slower at H=96); the sub-chunk kernel capped at 160 registers (a fourth field: Triton's maxnreg), so more of its
# one-warp programs fit on an SM: 1.86 -> 1.64 ms at H=96 T=16K (128: slower; 2 or 4 warps: 1.2x / 1.6x slower).
LAUNCH_DEFAULTS = {
    "prep_fwd": (64, 4, 1),
    "norm_fwd": (32, 4, 1),
    "diag_fwd": (32, 1, 1),
    "diag_fwd_loop": (32, 2, 1),
    "diag_inv": (None, 1, 1),
    "intra_fwd": (32, 2, 2),
    "sub_fwd": (32, 1, 1, 160),
    "rec_fwd": (32, 4, 3),
    "wu_fwd": (128, 8, 2),
    "state_fwd": (None, 4, None),
    "output_fwd": (64, 4, 2),
    "state_bwd": (None, 8, 2),
    "main_bwd": (32, 4, 3),
    "intra_bwd": (32, 1, 2),
    "intra_bwd_loop": (32, 1, 2),
    "prep_bwd": (None, 4, 3),
    "prep_bwd_softplus": (32, 4, 3),
}


def launch_config(name: str):
    """(tile, num_warps, num_stages, extra launch options) of chunk kernel `name`: LAUNCH_DEFAULTS, or what
    KIMI3_KDA_LAUNCH says, e.g. KIMI3_KDA_LAUNCH="intra_fwd=32:2:1,state_fwd=:4:" (an empty field keeps the default).
    An optional fourth field caps the kernel's registers per thread (Triton's `maxnreg`; "wu_fwd=:::128"; 0 lifts a
    default cap), for timing what the compiler's register allocation costs (bench/results/kda_h200.md). Read at every
    call, so bench/kda.py --sections tune can time the options in one process."""
    tile, warps, stages, *cap = LAUNCH_DEFAULTS[name]
    extra = {"maxnreg": cap[0]} if cap else {}
    spec = env("KIMI3_KDA_LAUNCH", "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, vals = item.partition("=")
        fields = vals.split(":")
        if key.strip() not in LAUNCH_DEFAULTS or len(fields) not in (3, 4) or not all(
                f.strip().isdigit() or not f.strip() for f in fields):
            raise ValueError(f"KIMI3_KDA_LAUNCH: cannot read {item!r}; expected name=tile:warps:stages[:maxnreg] with "
                             f"name in {sorted(LAUNCH_DEFAULTS)} (empty fields keep the default)")
        if key.strip() == name:
            new = [int(f) if f.strip() else None for f in fields]
            tile = new[0] if new[0] is not None else tile
            warps = new[1] or warps
            stages = new[2] or stages
            if len(new) == 4 and new[3] is not None:  # 0 lifts a default cap
                extra = {"maxnreg": new[3]} if new[3] else {}
    return tile, warps, stages, extra
