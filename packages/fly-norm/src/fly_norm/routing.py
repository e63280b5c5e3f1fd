"""Which of fly-norm's kernel paths serves a call: one pure function, :func:`route`, from what the call is
(op, direction, dtypes, shape, operands present, alignment) and the device's :class:`flydsl.arch.Arch` to a
named :class:`Path` and its launch configuration. The host code (:mod:`fly_norm._norm_host`,
:mod:`fly_norm._split_host`, :mod:`fly_norm.softmax`) asks it and launches what it names; nothing else
decides.

The thresholds and configurations it reads stay beside their measurements in :mod:`fly_norm._split_host`
(SPLIT_MIN_N, SPLIT_MIN_N_BWD, SOFTMAX_SPLIT_MIN_N_BWD, FWD_STAGED_MIN_N, RESIDENT_MIN_N, the slice / tiled /
staged / resident configs), read at each call (tests replace them), never cached; the pipelined backward's
(PIPELINED_BWD) is here. :mod:`fly_norm.autotune` asks it too: which buckets the row kernels serve on a GPU
(the others are not tuned).

A split, staged or resident path needs its rows' slices to fit one resident wave, which is known only once
the kernel is compiled (its programs an SM): a launch that cannot fit takes the route's ``fallbacks`` in
order (the chunked or single-pass row kernel last). The row kernels' config (``Path.ROWS``, config None) is
the tuner's (:func:`fly_norm.autotune.row_config_for`); for it, :func:`fly_norm._row_plans.packed_plan`
then picks the packed single pass or the chunked passes (``CHUNKED``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from flydsl.arch import Arch
from flydsl.errors import ArgumentError
from flydsl_common.rows import RowConfig

__all__ = ["OPS", "Path", "Route", "ROW_KERNEL", "route", "split_route", "resident_config", "row_kernels_below",
           "PIPELINED_BWD", "PIPELINED_BWD_STAGES"]  # fmt: skip


class Path(enum.Enum):
    """A kernel path of fly-norm (the kernel each launches, by op)."""

    ROWS = "rows"  # norm_fwd_kernel / norm_bwd_kernel / softmax_fwd_kernel / softmax_bwd_kernel, tuned RowConfig
    PIPELINED = "pipelined"  # norm_bwd_kernel at PIPELINED_BWD, its row loop PIPELINED_BWD_STAGES deep
    SPLIT = "split"  # norm_fwd_split / norm_bwd_split / softmax_fwd_split / softmax_bwd_split kernels (SliceConfig)
    TILED = "tiled"  # norm_bwd_tiled_kernel (TiledConfig)
    STAGED = "staged"  # norm_fwd_staged_kernel / norm_bwd_staged_kernel (StagedConfig)
    RESIDENT = "resident"  # softmax_fwd_resident_kernel (ResidentConfig)


@dataclass(frozen=True)
class Route:
    """A call's path and its configuration (None for ``Path.ROWS``: the tuner's, chosen at launch); the routes
    taken in order when its launch cannot fit one wave (ending with ``Path.ROWS``); and whether a plain eager
    call of this shape may be served by a cached launch plan of the row kernel (:mod:`fly_norm._eager`)."""

    path: Path
    config: object | None = None
    fallbacks: tuple[Route, ...] = ()
    eager_plan: bool = False


OPS = ("rms_norm", "layer_norm", "softmax")

# RMSNorm's bf16 backward past the single pass's widths, up to PIPELINED_BWD.block_n columns, runs pipelined
# (_pipelined_bwd_rows): one 16-warp program an SM, the row loop PIPELINED_BWD_STAGES deep (192 KB of shared
# memory at 16K columns). H200 (bf16, 2^27 elements): 90% of copy at 16K against the tiled split kernel's 69%; 2
# stages 78%. LayerNorm's (also the bias gradient's sums) spills in this form and stays split.
PIPELINED_BWD = RowConfig(1, 16384, 16, True)
PIPELINED_BWD_STAGES = 3

_BF16 = torch.bfloat16
ROW_KERNEL = _ROWS = Route(Path.ROWS)  # the row kernels at the tuner's config, no fallback
_TO_ROWS = (_ROWS,)


def _stages_fit(arch: Arch, stages: int, stage_bytes: int) -> bool:
    """Whether a program on ``arch`` may take the shared memory of a row loop software-pipelined ``stages``
    deep (``fx.range(..., num_stages=)``) that stages ``stage_bytes`` an iteration: ``stages - 1`` buffers in
    flight. Not on AMD (its pipeliner stages otherwise, in 64 KB); the interpreter has Hopper's sizes."""
    return arch.backend != "hip" and arch.smem_per_block >= (stages - 1) * stage_bytes


def row_kernels_below() -> int:
    """Rows narrower than this take the row kernels (:attr:`Path.ROWS`) in every op, on every arch, whatever
    their dtypes, operands and alignment: the narrowest width of a split path (SPLIT_MIN_N, SPLIT_MIN_N_BWD,
    SOFTMAX_SPLIT_MIN_N_BWD), of the pipelined backward (SPLIT_MIN_N_BWD) and of the resident softmax
    (RESIDENT_MIN_N). The host asks :func:`route` (and looks the arch and the rows' alignment up) only from
    this width on; narrower calls' route is :data:`ROW_KERNEL`."""
    s = _split_host
    return min(s.SPLIT_MIN_N, s.SPLIT_MIN_N_BWD, s.SOFTMAX_SPLIT_MIN_N_BWD, s.RESIDENT_MIN_N)


def resident_config(arch: Arch, n: int):
    """The resident softmax's config for rows of ``n`` columns on ``arch``: RESIDENT, else RESIDENT_WIDE where
    RESIDENT's slices would be too many, the ring shrunk to the device's shared memory; None where the kernel
    cannot run (not NVIDIA sm_80+, room for too few chunks, or more than SPLIT_MAX_PARTS slices)."""
    s = _split_host
    if s.RESIDENT is None or arch.backend != "cuda" or (arch.capability or (0, 0)) < (8, 0):
        return None
    for cfg in (s.RESIDENT, s.RESIDENT_WIDE):
        ring = min(cfg.ring, arch.smem_per_block // (4 * cfg.chunk))
        if ring > cfg.left and -(-n // (2 * cfg.chunk * (ring - cfg.left))) <= s.SPLIT_MAX_PARTS:
            return replace(cfg, ring=ring)
    return None


def _fits_parts(r: Route, n: int, max_parts: int) -> Route:
    """``r`` when rows of ``n`` columns cut into at most ``max_parts`` of its slices, else the row kernel (rows
    of more slices: see SPLIT_MAX_PARTS)."""
    return r if -(-n // r.config.slice_cols) <= max_parts else _ROWS


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ArgumentError(f"op: expected one of {', '.join(OPS)}, got {op!r}")


def split_route(
    op: str,
    dtype: torch.dtype,
    n: int,
    arch: Arch,
    *,
    backward: bool = False,
    residual: bool = False,
    quant: torch.dtype | None = None,
    smooth: bool = False,
    row_dtypes: tuple = (),
    vector_dtypes: tuple = (),
    aligned: bool = True,
) -> Route:
    """Which split kernel serves rows that take the split paths (:func:`route` past its width and device
    gates; the split launchers of :mod:`fly_norm._split_host` when called directly): the staged kernels
    (bf16 word-aligned rows; the forward from FWD_STAGED_MIN_N columns, plain: no residual, smooth scale or
    quantized output, LayerNorm's weight and bias bf16 or absent; where a program may take the stages' shared
    memory), the tiled backward, else the register-resident slice kernels. Arguments as :func:`route`;
    ``aligned`` is always read. Softmax's forward: the slice kernel (the resident kernel is :func:`route`'s
    choice)."""
    _check_op(op)
    s = _split_host
    bf16 = dtype == _BF16 and all(d == _BF16 for d in row_dtypes)
    if op == "softmax":
        if backward:
            cfg = s.SOFTMAX_BWD_SLICE_WIDE if n >= s.SOFTMAX_BWD_WIDE_MIN_N else s.SOFTMAX_BWD_SLICE
        else:
            cfg = s.FWD_SLICE_WIDE if n >= s.WIDE_MIN_N else s.FWD_SLICE
        return Route(Path.SPLIT, cfg, _TO_ROWS)
    is_rms = op == "rms_norm"
    if backward:
        staged = s.BWD_STAGED
        loaded = 2 + int(residual)  # the rows the staged kernel loads: h and dy (and the residual gradient)
        if staged is not None and bf16 and aligned and _stages_fit(arch, staged.stages, 2 * staged.slice_cols * loaded):
            return Route(Path.STAGED, staged, _TO_ROWS)
        tiled = s.BWD_TILED if is_rms else s.LN_BWD_TILED
        if tiled is not None:
            return Route(Path.TILED, tiled, _TO_ROWS)
        return Route(Path.SPLIT, s.BWD_SLICE, _TO_ROWS)
    st = s.FWD_STAGED
    if (
        quant is None and not residual and not smooth and st is not None and n >= s.FWD_STAGED_MIN_N and bf16
        and aligned and (is_rms or all(d == _BF16 for d in vector_dtypes))
        and _stages_fit(arch, st.stages, 2 * st.slice_cols)
    ):  # fmt: skip
        return Route(Path.STAGED, st, _TO_ROWS)
    if is_rms:
        return Route(Path.SPLIT, s.FWD_SLICE_WIDE if n >= s.WIDE_MIN_N else s.FWD_SLICE, _TO_ROWS)
    return Route(Path.SPLIT, s.LN_FWD_SLICE, _TO_ROWS)


def route(
    op: str,
    dtype: torch.dtype,
    m: int,
    n: int,
    arch: Arch,
    *,
    backward: bool = False,
    residual: bool = False,
    quant: torch.dtype | None = None,
    smooth: bool = False,
    row_dtypes: tuple = (),
    vector_dtypes: tuple = (),
    aligned: bool = True,
) -> Route:
    """The path of one launch of ``op`` ("rms_norm", "layer_norm" or "softmax") over ``m`` rows of ``n``
    columns on ``arch`` (:func:`flydsl.arch.current`; the interpreter runs the row kernels, and the pipelined
    backward). ``m`` decides nothing today (every path takes any row count; a split path's wave is sized at
    launch).

    ``dtype``: the rows' input dtype (x; the saved h or y of a backward). ``backward``: the backward.
    ``residual``: a fused residual (forward) or a residual gradient (backward). ``quant``: the quantized
    output's dtype (int8, fp8 e4m3) or None. ``smooth``: a smooth scale. ``row_dtypes``: the other row
    operands' dtypes (y; dy, dx and the residual gradient). ``vector_dtypes``: LayerNorm's weight and bias
    dtypes (those present). ``aligned``: every row operand (with LayerNorm's forward, its weight and bias too)
    starts on a 4-byte boundary with even widths and strides (:func:`fly_norm._row_plans.word_aligned`).
    Rows narrower than :func:`row_kernels_below` route to the row kernels whatever the arguments.

    - softmax forward: the resident kernel (bf16 word-aligned rows of RESIDENT_MIN_N+ columns on NVIDIA sm_80+,
      :func:`resident_config`), then the split slices (SPLIT_MIN_N+ columns), then the row kernel;
    - softmax backward: the split slices from SOFTMAX_SPLIT_MIN_N_BWD columns (at most SOFTMAX_BWD_MAX_PARTS
      of them), else the row kernel;
    - norm forward: from SPLIT_MIN_N columns :func:`split_route` (staged or slices), else the row kernel;
    - norm backward: RMSNorm's bf16 word-aligned rows from SPLIT_MIN_N_BWD to PIPELINED_BWD's width with no
      residual gradient the pipelined row kernel; else from SPLIT_MIN_N_BWD columns :func:`split_route`
      (staged, tiled or slices); else the row kernel.

    Every path but the row kernel runs on a GPU only (the pipelined backward excepted). A split path whose
    rows would take more than SPLIT_MAX_PARTS slices (softmax's backward: SOFTMAX_BWD_MAX_PARTS) routes to the
    row kernel, as :func:`fly_norm._split_host.launch_split` would refuse it.
    """
    _check_op(op)
    s = _split_host
    gpu = not arch.is_interpreter
    kw = dict(backward=backward, residual=residual, quant=quant, smooth=smooth, row_dtypes=row_dtypes,
              vector_dtypes=vector_dtypes, aligned=aligned)  # fmt: skip
    if op == "softmax":
        if backward:
            if gpu and n >= s.SOFTMAX_SPLIT_MIN_N_BWD:
                return _fits_parts(split_route(op, dtype, n, arch, **kw), n, s.SOFTMAX_BWD_MAX_PARTS)
            return _ROWS
        bf16 = dtype == _BF16 and all(d == _BF16 for d in row_dtypes)
        if gpu and s.softmax_fwd_resident_kernel is not None and n >= s.RESIDENT_MIN_N and bf16 and aligned:
            cfg = resident_config(arch, n)
            if cfg is not None:
                split = _fits_parts(split_route(op, dtype, n, arch, **kw), n, s.SPLIT_MAX_PARTS)
                then = (split, _ROWS) if n >= s.SPLIT_MIN_N and split is not _ROWS else _TO_ROWS
                return Route(Path.RESIDENT, cfg, then)
        if gpu and n >= s.SPLIT_MIN_N:
            return _fits_parts(split_route(op, dtype, n, arch, **kw), n, s.SPLIT_MAX_PARTS)
        return Route(Path.ROWS, eager_plan=n < s.SPLIT_MIN_N)
    if backward:
        pipe, bf16 = PIPELINED_BWD, dtype == _BF16 and all(d == _BF16 for d in row_dtypes)
        if (
            op == "rms_norm" and not residual and s.SPLIT_MIN_N_BWD <= n <= pipe.block_n and bf16 and aligned
            and _stages_fit(arch, PIPELINED_BWD_STAGES, 4 * pipe.block_n)  # h and dy, bf16, a row each
        ):  # fmt: skip
            return Route(Path.PIPELINED, pipe)
        if gpu and n >= s.SPLIT_MIN_N_BWD:
            return _fits_parts(split_route(op, dtype, n, arch, **kw), n, s.SPLIT_MAX_PARTS)
        return _ROWS
    if gpu and n >= s.SPLIT_MIN_N:
        return _fits_parts(split_route(op, dtype, n, arch, **kw), n, s.SPLIT_MAX_PARTS)
    return Route(Path.ROWS, eager_plan=quant is None and n < s.SPLIT_MIN_N)


# The thresholds' home, read at each call (tests replace them). Imported last: it imports this module's names.
from . import _split_host  # noqa: E402
