"""Launch settings of the chunked KDA kernels, measured at K = V = 128 (bench/kda.py --sections tune times them;
bench/results/ keeps the figures).

Each entry is (tile, num_warps, num_stages[, maxnreg]). `tile` is the width the kernel is tiled over (its K slice or
value tile; None: whole rows, or the grid-dependent choice of `state_scan_tile`), capped at the head dim for smaller
heads; `maxnreg` caps registers per thread (Triton's launch option). Kernels with diagonal 16x16 tiles have one entry
for bounded gates (K3: one matmul per tile) and one for the per-column loop of unbounded ones (`_loop`, Kimi Linear).
"""
from __future__ import annotations

import contextlib

import torch

LAUNCH = {
    # forward preparation: the gate in 64-column blocks, the norms in 32-row blocks
    "prep_fwd": (64, 4, 1),
    "norm_fwd": (32, 4, 1),
    # diagonal 16x16 tiles: a quarter chunk per program, few registers
    "diag_fwd": (32, 1, 1),
    "diag_fwd_loop": (32, 2, 1),
    "diag_inv": (None, 1, 1),
    # the pairwise kernel sits at sm_90's 255-register cap at K = 128: narrow K slices
    "intra_fwd": (32, 2, 2),
    # inference forward: one-warp sub-chunk programs, capped at 160 registers so more fit on an SM
    "sub_fwd": (32, 1, 1, 160),
    # the sub-chunk recurrence on 3 stages: the next step's loads are waited for one step later
    "rec_fwd": (32, 4, 3),
    "wu_fwd": (128, 8, 2),
    "state_fwd": (None, 4, None),
    "output_fwd": (64, 4, 2),
    # the backward scan stays on 2 stages: 3 need more shared memory than sm_90 has with fp32 inputs
    "state_bwd": (None, 8, 2),
    # K slices and the V side as separate programs, two programs per SM
    "main_bwd": (32, 4, 3),
    "intra_bwd": (32, 1, 2),
    "intra_bwd_loop": (32, 1, 2),
    # K3's gate: one program per chunk and head; the softplus gate's part in 32-wide column slices
    "prep_bwd": (None, 4, 3),
    "prep_bwd_softplus": (32, 4, 3),
}

_OVERRIDES: dict = {}


def launch_config(name: str):
    """(tile, num_warps, num_stages, extra launch options) of chunk kernel `name`."""
    tile, warps, stages, *cap = _OVERRIDES.get(name) or LAUNCH[name]
    extra = {"maxnreg": cap[0]} if cap and cap[0] else {}
    return tile, warps, stages, extra


@contextlib.contextmanager
def launch_overrides(settings: dict):
    """Run the block with some kernels' launch settings replaced, e.g. {"intra_fwd": (32, 2, 1)} (a fourth field caps
    registers; 0 lifts a cap). For benchmarks that time the options in one process; nothing else reads them."""
    unknown = set(settings) - set(LAUNCH)
    if unknown:
        raise ValueError(f"launch_overrides: unknown kernels {sorted(unknown)}; known: {sorted(LAUNCH)}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update({k: tuple(v) for k, v in settings.items()})
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def sm_count(device) -> int:
    """The GPU's SM count; off the GPU (the interpreter) an H200's 132, so tests take the same branches."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def state_scan_tile(programs_at_64: int, device) -> tuple[int, int]:
    """(value-tile width, pipeline stages) of the forward state scan: (64, 2), or (32, 3) when 64-wide tiles give
    fewer programs than the GPU has SMs: the scan is latency-bound, so more, smaller programs win."""
    return (64, 2) if programs_at_64 >= sm_count(device) else (32, 3)
