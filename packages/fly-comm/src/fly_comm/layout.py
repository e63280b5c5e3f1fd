"""The layout of the buffer each rank shares with its peers, and the two-shot slicing.

One allocation a rank, the same layout on every rank (peers compute addresses in each other's buffers
from their own copy of the layout)::

    [0, FLAGS_BYTES)                    flags: int64 [MAX_PROGRAMS][MAX_WORLD]; slot (program, src)
                                        holds the last value rank ``src``'s program signalled here
    [DATA_OFFSET, + half_bytes)         data, half 0 (calls with an even epoch)
    [DATA_OFFSET + half_bytes, + ...)   data, half 1 (calls with an odd epoch)

Each call stages its input in the half of its epoch's parity, so a rank that starts call ``e + 1``
writes the half its peers are not reading in call ``e`` (see :mod:`fly_comm._kernels.allreduce` for why
no peer can still be reading call ``e - 1``'s). Flags only grow: call ``e`` signals ``2e`` (inputs
staged) and, in two-shot, ``2e + 1`` (slice reduced); a waiter waits for a value at least the one it
needs, so it never misses a signal that a faster peer has already overwritten with the next.

The epoch counters live in a separate, local tensor (``state``: int64 ``[MAX_PROGRAMS + 1]``, one
counter a program, then a count of waits that gave up under a spin limit); they never leave the device,
which is what lets a CUDA graph replay a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from flydsl.errors import ArgumentError

__all__ = [
    "MAX_WORLD", "MAX_PROGRAMS", "FLAG_BYTES", "FLAGS_BYTES", "DATA_OFFSET", "ALIGN", "SLICE_ALIGN", "STATE_LEN",
    "TIMEOUT_SLOT", "BufferLayout", "flag_value", "two_shot_slice", "slice_range",
]  # fmt: skip

MAX_WORLD = 8  # flag slots a program: one a possible peer
MAX_PROGRAMS = 64  # programs a launch at most (each owns a row of flags and an epoch counter)
FLAG_BYTES = 8  # int64 flags: 2 * epoch + phase never wraps
FLAGS_BYTES = MAX_PROGRAMS * MAX_WORLD * FLAG_BYTES
ALIGN = 4096  # data halves start on 4 KiB boundaries (any vector width the kernels use divides it)
DATA_OFFSET = -(-FLAGS_BYTES // ALIGN) * ALIGN
SLICE_ALIGN = 16  # elements: two-shot slices start at multiples of 16 elements (>= 16 bytes for every dtype)
STATE_LEN = MAX_PROGRAMS + 1
TIMEOUT_SLOT = MAX_PROGRAMS  # state[TIMEOUT_SLOT]: waits that gave up (only with a spin limit)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def flag_value(epoch: int, phase: int) -> int:
    """The value a program signals in call ``epoch`` (1, 2, ...): phase 0 after staging its input, phase 1
    (two-shot) after writing its reduced slice."""
    if epoch < 1 or phase not in (0, 1):
        raise ArgumentError(f"flag_value: epoch must be >= 1 and phase 0 or 1, got epoch={epoch}, phase={phase}")
    return 2 * epoch + phase


def two_shot_slice(numel: int, world: int) -> int:
    """Elements in each rank's two-shot slice: ``ceil(numel / world)`` rounded up to :data:`SLICE_ALIGN`.

    Rank ``r`` reduces elements ``[r * S, min((r + 1) * S, numel))``; the last slices may be short or
    empty (masked in the kernel). Every slice starts on a multiple of 16 elements, so the kernels' vector
    loads stay aligned.
    """
    if numel < 0 or world < 1:
        raise ArgumentError(f"two_shot_slice: numel must be >= 0 and world >= 1, got numel={numel}, world={world}")
    return _round_up(-(-numel // world), SLICE_ALIGN)


def slice_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the elements rank ``rank`` reduces in a two-shot all-reduce (may be empty)."""
    if not 0 <= rank < world:
        raise ArgumentError(f"slice_range: rank must be in [0, {world}), got {rank}")
    s = two_shot_slice(numel, world)
    return min(rank * s, numel), min((rank + 1) * s, numel)


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets in a rank's shared buffer for messages of at most ``max_size`` bytes."""

    max_size: int
    half_bytes: int
    total_bytes: int
    data_offset: int = DATA_OFFSET

    @classmethod
    def for_max_size(cls, max_size: int) -> BufferLayout:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ArgumentError(f"max_size: expected a positive int (bytes), got {max_size!r}")
        # Both algorithms touch only the message's own elements (two-shot masks its slices' padding).
        half = _round_up(max_size, ALIGN)
        return cls(max_size=max_size, half_bytes=half, total_bytes=DATA_OFFSET + 2 * half)

    def flag_offset(self, program: int, src_rank: int) -> int:
        """Byte offset of the flag that rank ``src_rank``'s program ``program`` sets in this buffer."""
        if not 0 <= program < MAX_PROGRAMS or not 0 <= src_rank < MAX_WORLD:
            raise ArgumentError(f"flag_offset: program in [0, {MAX_PROGRAMS}) and src_rank in [0, {MAX_WORLD}), "
                                f"got {program}, {src_rank}")  # fmt: skip
        return (program * MAX_WORLD + src_rank) * FLAG_BYTES

    def half_offset(self, epoch: int) -> int:
        """Byte offset of the data half that call ``epoch`` stages its input in."""
        return self.data_offset + (epoch % 2) * self.half_bytes
