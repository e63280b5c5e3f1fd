"""Split-K for the GEMM kernels: how K is split, the partial sums' workspace, and their reduction.

A GEMM with too few C tiles to occupy the GPU (decode-size M; a few hundred rows against a long K)
splits K: each split writes its partial sums (fp32, int32 for int8) to ``workspace[split, M, N]``, and
they are added in split order (deterministic, no float atomics; exact for int32) before the epilogue
(:mod:`.epilogue`) runs once on the sum: by ``_splitk_reduce_kernel``, a second launch, or (the tiled
kernel's ``reduce_last``) by the tile's last split to finish, counted in with an integer atomic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .epilogue import epilogue_meta, store_c

__all__ = ["SplitLaunch", "split_launch", "store_split", "tile_counters"]

_REDUCE_TILE = (16, 128)  # the reduction's tile (M rows are few where split-K pays)


def split_plan(k: int, cfg) -> tuple[int, int]:
    """``(split_steps, splits)``: K steps of ``cfg.block_k`` a split, and the splits (at most
    ``cfg.split_k``, none empty; K = 0 is one split, which runs the epilogue on zeros)."""
    steps = max(1, flyc.cdiv(k, cfg.block_k))
    split_steps = flyc.cdiv(steps, max(1, min(cfg.split_k, steps)))
    return split_steps, flyc.cdiv(steps, split_steps)


class SplitLaunch(NamedTuple):
    """A launch's split of K: ``split_steps`` K steps a split, ``splits`` splits, the partial sums'
    ``workspace`` ``[splits, M, N]`` and the tile ``counters`` of a last-split reduction (``c``, a
    placeholder the kernel never touches, where unused)."""

    split_steps: int
    splits: int
    workspace: torch.Tensor
    counters: torch.Tensor
    reduce_last: bool

    def finish(self, c, bias, scale_a, scale_b, act: int) -> None:
        """After the GEMM's launch: the reduction kernel, where the splits were not reduced in it."""
        if self.splits > 1 and not self.reduce_last:
            reduce_splits(self.workspace, c, bias, scale_a, scale_b, act)


def split_launch(m: int, n: int, k: int, tiles: int, cfg, int_acc: bool, c: torch.Tensor) -> SplitLaunch:
    """The :class:`SplitLaunch` of ``cfg`` for C ``[m, n]`` (``tiles`` tiles) over K = ``k``."""
    split_steps, splits = split_plan(k, cfg)
    if splits == 1:
        return SplitLaunch(split_steps, 1, c, c, False)
    part = torch.empty(splits, m, n, dtype=torch.int32 if int_acc else torch.float32, device=c.device)
    counters = tile_counters(tiles, c.device) if cfg.reduce_last else None
    return SplitLaunch(split_steps, splits, part, c if counters is None else counters, counters is not None)


@flyc.func
def add_splits(
    p_ptr, M, N, splits, rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr, RAW: fx.constexpr,
    SPLITS_MAX: fx.constexpr,
):  # fmt: skip
    """``c[rm, rn] = epilogue(sum over s of partials[s, rm, rn])``, the splits added in order (deterministic,
    and exact for int32); the partials are read from L2 (``.cg``: other SMs wrote them). The loop is unrolled
    to ``SPLITS_MAX`` (>= ``splits``) so that every split's loads are in flight at once: one L2 round trip at
    the end of the GEMM instead of one every few splits. An absent split loads -0.0 (0 for int32), which
    leaves every sum as it was."""
    ok = m_ok[:, None] & n_ok[None, :]
    p_ptrs = p_ptr + row_offset(rm, N)[:, None] + rn[None, :]
    acc = fx.load(p_ptrs, mask=ok, other=0, cache_modifier=".cg")
    for s in fx.static_range(1, SPLITS_MAX):
        acc += fx.load(p_ptrs + row_offset(s, M) * N, mask=ok & (s < splits), other=-0.0, cache_modifier=".cg")
    store_c(acc, rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS,
            ACT, RAW)  # fmt: skip


@flyc.func
def add_splits_if_last(
    cnt_ptr, tile, p_ptr, M, N, splits, rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr,
    bias_ptr, SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr,
    RAW: fx.constexpr, SPLITS_MAX: fx.constexpr,
):  # fmt: skip
    """Called by each split of a tile once its partial sums are stored: counts the split in, and the
    tile's last split to arrive runs :func:`add_splits` and resets the count for the next call."""
    fx.debug_barrier()  # every thread's partial sums stored before the release below
    ticket = fx.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == splits - 1:
        add_splits(p_ptr, M, N, splits, rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr,
                   SCALE_A, SCALE_B, HAS_BIAS, ACT, RAW, SPLITS_MAX)  # fmt: skip
        fx.store(cnt_ptr + tile, 0)


@flyc.func
def store_split(
    acc, split, tile, p_ptr, cnt_ptr, M, N, splits, rm, rn, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr, RAW: fx.constexpr,
    REDUCE_LAST: fx.constexpr, SPLITS_MAX: fx.constexpr,
):  # fmt: skip
    """A kernel's split-K exit for C tile ``tile`` (rows ``rm``, columns ``rn``): its partial sums into
    ``workspace[split]`` (``p_ptr``); with ``REDUCE_LAST`` the tile's last split then adds them up
    (:func:`add_splits_if_last`), else the reduction kernel does after the launch."""
    m_ok = rm < M
    n_ok = rn < N
    p_ptrs = p_ptr + row_offset(split, M) * N + row_offset(rm, N)[:, None] + rn[None, :]
    fx.store(p_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    if REDUCE_LAST:
        add_splits_if_last(cnt_ptr, tile, p_ptr, M, N, splits, rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn,
                           sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS, ACT, RAW, SPLITS_MAX)  # fmt: skip


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _splitk_reduce_kernel(
    p_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr, M, N, SPLITS, stride_cm, stride_cn,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr, RAW: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, SPLITS_MAX: fx.constexpr,
):
    # fmt: on
    rm = fx.program_id(0) * BLOCK_M + fx.arange(0, BLOCK_M)
    rn = fx.program_id(1) * BLOCK_N + fx.arange(0, BLOCK_N)
    add_splits(p_ptr, M, N, SPLITS, rm, rn, rm < M, rn < N, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr,
               SCALE_A, SCALE_B, HAS_BIAS, ACT, RAW, SPLITS_MAX)  # fmt: skip


_COUNTERS: dict[tuple, torch.Tensor] = {}


def tile_counters(tiles: int, device) -> torch.Tensor | None:
    """Zeroed int32 counters, one a C tile, for :func:`add_splits_if_last`: one buffer a (device, stream),
    so that GEMMs running at once on two streams never share a count; the kernel leaves it zeroed (each
    tile's last split resets its count). None while a CUDA graph is being captured and the stream's
    buffer is too small (an allocation made in a capture belongs to the graph): reduce in a second kernel."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if cuda else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if cuda and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def reduce_splits(partials: torch.Tensor, c: torch.Tensor, bias, scale_a, scale_b, act: int) -> None:
    """``c = epilogue(sum over s of partials[s])``, the splits added in order."""
    splits, m, n = partials.shape
    bm, bn = _REDUCE_TILE
    flyc.launch(
        _splitk_reduce_kernel, (flyc.cdiv(m, bm), flyc.cdiv(n, bn)),
        partials, c, bias, scale_a, scale_b, m, n, splits, c.stride(0), c.stride(1),
        **epilogue_meta(scale_a, scale_b, bias, act), RAW=not c.dtype.is_floating_point, BLOCK_M=bm, BLOCK_N=bn,
        SPLITS_MAX=splits, num_warps=4,
    )  # fmt: skip
