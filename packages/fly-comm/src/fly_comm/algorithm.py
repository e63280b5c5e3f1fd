"""Which all-reduce algorithm serves a message: a pure function of its size and the group's shape.

- ``one_shot``: every rank reads every peer's whole buffer and reduces it itself. One barrier, the
  lowest latency; each rank reads ``(world - 1) * nbytes`` over the links, so it loses to the others
  as messages grow (more so at larger world sizes).
- ``two_shot``: reduce-scatter then all-gather. Each rank reduces its ``1 / world`` slice from every
  peer, then gathers the reduced slices: ``2 * (world - 1) / world * nbytes`` read a rank, two barriers.
- ``nccl``: ``torch.distributed.all_reduce``. Above ``two_shot_max``, when the GPUs are not all
  peer-to-peer reachable (the kernels read peers' memory directly), and for world sizes other than
  2, 4 and 8.

The default cutoffs (:data:`DEFAULT_CUTOFFS`) are first estimates from that traffic model, not yet
measured on a multi-GPU machine (see the package README): ``benchmarks/run.py`` on 2, 4 and 8 GPUs
measures where each algorithm beats NCCL, and these numbers are to be replaced by what it finds.
"""

from __future__ import annotations

from typing import Literal

from flydsl.errors import ArgumentError

__all__ = ["Algorithm", "ALGORITHMS", "WORLD_SIZES", "DEFAULT_CUTOFFS", "choose_algorithm", "default_cutoffs"]

Algorithm = Literal["one_shot", "two_shot", "nccl"]
ALGORITHMS: tuple[str, ...] = ("one_shot", "two_shot", "nccl")

# The world sizes the kernels serve: the flag table and the peer loops are unrolled for at most 8 ranks, and
# the two-shot slices assume a power of two divides the work evenly (others go to NCCL).
WORLD_SIZES: tuple[int, ...] = (2, 4, 8)

KiB = 1 << 10
MiB = 1 << 20

# world size -> (one_shot_max, two_shot_max), in bytes, both inclusive. One-shot reads (world - 1) whole
# buffers a rank, so its window shrinks as the world grows; two-shot up to 8 MiB, the default buffer size
# (CustomAllReduce's max_size), beyond which NCCL's pipelined ring/tree is expected to win.
DEFAULT_CUTOFFS: dict[int, tuple[int, int]] = {
    2: (1 * MiB, 8 * MiB),
    4: (512 * KiB, 8 * MiB),
    8: (256 * KiB, 8 * MiB),
}


def default_cutoffs(world_size: int) -> tuple[int, int]:
    """``(one_shot_max, two_shot_max)`` for ``world_size`` (both 0 where the kernels do not serve it)."""
    return DEFAULT_CUTOFFS.get(world_size, (0, 0))


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ArgumentError(f"{name}: expected an int >= {low}, got {value}")
    return value


def choose_algorithm(
    nbytes: int,
    world_size: int,
    *,
    full_nvlink: bool,
    one_shot_max: int,
    two_shot_max: int,
) -> Algorithm:
    """The algorithm for an all-reduce of ``nbytes`` bytes over ``world_size`` ranks.

    ``full_nvlink``: every pair of GPUs in the group can read and write each other's memory (peer to
    peer); without it every size goes to ``"nccl"``. ``one_shot_max`` and ``two_shot_max`` are
    inclusive byte cutoffs (:func:`default_cutoffs` gives the defaults per world size): ``nbytes <=
    one_shot_max`` is one-shot, else ``nbytes <= two_shot_max`` two-shot, else NCCL. World sizes other
    than 2, 4 and 8 always get ``"nccl"``.
    """
    _check_int("nbytes", nbytes, 0)
    _check_int("world_size", world_size, 1)
    _check_int("one_shot_max", one_shot_max, 0)
    _check_int("two_shot_max", two_shot_max, 0)
    if not isinstance(full_nvlink, bool):
        raise ArgumentError(f"full_nvlink: expected a bool, got {type(full_nvlink).__name__} {full_nvlink!r}")
    if world_size not in WORLD_SIZES or not full_nvlink:
        return "nccl"
    if nbytes <= one_shot_max:
        return "one_shot"
    if nbytes <= two_shot_max:
        return "two_shot"
    return "nccl"
