"""Host-side helpers for launches, in plain Python. Integer helpers for grids and block sizes: since Triton 3.5
`triton.cdiv` and `triton.next_power_of_2` are constexpr functions whose host calls cost ~2.7 us each (their argument
unwrapping), and an eager decode step computes hundreds of grids."""

import os

_KEYS = {}  # variable name -> its key in os.environ's own mapping
_ENVIRON = getattr(os, "_Environ", None)  # CPython's type of os.environ


def env(name, default=None):
    """os.environ.get(name, default) at a fraction of its cost. The switches here are read at every launch (for A/B
    timing without restarts), and os.environ.get of an unset variable raises and catches a KeyError inside: ~1-2 us
    a read. This reads the mapping os.environ keeps (updated by its setters, pytest's monkeypatch included), so the
    answer is os.environ.get's."""
    environ = os.environ
    if type(environ) is not _ENVIRON:  # replaced by something else: ask it
        return environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = environ.encodekey(name)
    value = environ._data.get(key)
    return default if value is None else environ.decodevalue(value)


def env_values(names):
    """The raw values of these variables (None where unset), for cache keys: one pass, no decoding."""
    environ = os.environ
    if type(environ) is not _ENVIRON:
        return tuple([environ.get(n) for n in names])
    keys = _KEYS.get(names)
    if keys is None:
        keys = _KEYS[names] = [environ.encodekey(n) for n in names]
    data = environ._data
    return tuple([data.get(k) for k in keys])


def interpreter_enabled():
    """TRITON_INTERPRET set: Triton kernels run in its interpreter (on CPU tensors, in CI)."""
    return env("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()
