"""Kernel options that only benchmarks and tests change, to time or check the alternatives in one process. The
defaults are what the model runs; nothing here is read from the environment.

    with kimi3_kernels.mxfp4.variant(wgmma=False):   # the Triton tiles where the Gluon kernel would run
        ...

- wgmma: the forward tiles of one and two rows per expert run the Gluon kernel on sm_90 (`wgmma.py`).
- table_free: the Gluon tiles decode without tables where every scale exponent is <= 128 (the packed experts
  check their scales once; `gemm.scales_fit_table_free`).
- l2_prefetch: bytes of each weight row the Gluon kernel prefetches into L2 a run ahead (0: none).
"""

import contextlib

DEFAULTS = {"wgmma": True, "table_free": True, "l2_prefetch": 128}
_current = dict(DEFAULTS)
_key = [tuple(_current.values())]


def get(name):
    return _current[name]


def state():
    """The options as one hashable value: launch plans and cached tile choices key on it."""
    return _key[0]


@contextlib.contextmanager
def variant(**changes):
    """Run the with block under other values of some options (see the module docstring)."""
    unknown = set(changes) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown MXFP4 kernel options {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    pf = changes.get("l2_prefetch", 0)
    if not isinstance(pf, int) or pf < 0 or pf % 64:
        raise ValueError(f"l2_prefetch must be a number of bytes, a multiple of 64 (0: off), not {pf!r}")
    saved = dict(_current)
    _set({**_current, **changes})
    try:
        yield
    finally:
        _set(saved)


def _set(values):
    _current.update(values)
    _key[0] = tuple(_current[k] for k in DEFAULTS)
