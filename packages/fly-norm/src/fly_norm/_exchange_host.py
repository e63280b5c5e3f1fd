"""Host side of the slot exchange between the programs of one resident wave
(:mod:`fly_norm._kernels.exchange`): the sizes a launcher picks for it. Kept out of ``_kernels``, which
holds device code only.
"""

from __future__ import annotations

__all__ = ["slot_lanes"]


def slot_lanes(slots: int, warps: int, warp_size: int) -> int:
    """The LANES of :func:`fly_norm._kernels.exchange.collect_sum` for ``slots`` slots in a program of ``warps``
    warps: a power of two of at least ``slots`` and twice the program's threads."""
    return max(slots, 2 * warps * warp_size)
