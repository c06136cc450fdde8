"""Host-side helpers for launches, in plain Python. Integer helpers for grids and block sizes: `triton.cdiv` and
`triton.next_power_of_2` are constexpr functions whose host calls cost microseconds each (their argument unwrapping),
and an eager decode step computes hundreds of grids."""

import os


def interpreter_enabled():
    """TRITON_INTERPRET set: Triton kernels run in its interpreter (on CPU tensors, in the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()
