"""Integer helpers for launch grids and block sizes, in plain Python: since Triton 3.5 `triton.cdiv` and
`triton.next_power_of_2` are constexpr functions whose host calls cost ~2.7 us each (their argument unwrapping),
and an eager decode step computes hundreds of grids."""


def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()
