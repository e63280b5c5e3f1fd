"""Launch configurations of fly-conv: :class:`ConvProblem`, :class:`ConvConfig`, the pure default
(:func:`default_config`), the one validity predicate (:func:`config_valid`) and the tuning adopter
(:data:`TUNABLE`, :func:`tuning_key`, :func:`candidates`, :func:`config_for`).

Three kernel kinds share the config type:

- ``"implicit"``: the implicit GEMM (forward, and the input gradient as the same kernel transposed):
  ``block_m`` output positions x ``block_n`` output channels of a group, ``block_k`` input channels a step;
  the forward's K steps (taps x channel blocks) split ``split_k`` ways where its grid is short of the SMs
  (fp32 partial sums, added in a fixed order by a second pass that runs the epilogue);
- ``"direct"``: the direct kernel of depthwise layers and narrow groups (:func:`direct_kernel` routes):
  ``block_m`` positions x ``block_n`` output channels (no dot, so no tensor-core minimum; ``block_k`` unused);
- ``"wgrad"``: the weight gradient: ``block_m`` output channels x ``block_n`` input channels of each of
  ``taps`` filter taps, ``block_k`` positions a step, the positions split ``split_k`` ways (partial sums
  added in a fixed order).

``tma`` (the implicit GEMM unsplit, and the weight gradient; 16-bit, a GPU with tensor descriptors): where
the layer allows (stride 1, output the input's size, one group), the row-block kernels, whose operands are
plain blocks of rows that tensor descriptors load (:mod:`fly_conv._kernels.rows_gemm`, and the weight
gradient's in :mod:`fly_conv._kernels.wgrad`); other layers keep the gathering kernels under such a config.

The defaults are the published Hopper practice for 16-bit implicit GEMMs (128-row tiles, 64 channels a
step where the layer has them, 3-4 pipeline stages, grouped tile order), narrowed to the layer where its
channels are fewer (grouped and small-channel layers), with warps and fp32 tiles chosen by sm_90 compiles
(no spill, the K loop pipelined); they have not been timed on the H200 yet.

A launch is served (:func:`config_for`) the searched winner of its tuning key, the shipped artifact's
(``fly_conv/artifacts/conv.json``, written by ``flydsl tune conv`` on the GPU) or the problem's default. The
key holds what decides the tile (rank, kernel, stride, dilation, group structure, channel and position
buckets, dtype, kind), never the spatial sizes themselves: the kernels take D / H / W as runtime values, so one
compiled kernel and one tuned config serve every resolution of a layer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl import env
from flydsl.autotune import SearchTask, Tunable
from flydsl.autotune.timer import rotating_copies
from flydsl.checks import dtype_name, parse_dtype
from flydsl.testing import tolerance

__all__ = [
    "ConvProblem", "ConvConfig", "KINDS", "DIRECT_MAX_CG", "direct_kernel", "default_config", "config_valid",
    "smem_bytes", "wgrad_splits", "wgrad_over_taps", "depthwise_wgrad_config",
    "implicit_splits",
    "TUNABLE", "tuning_key", "candidates", "config_for", "key_problem", "clear_memo",
]  # fmt: skip

KINDS = ("implicit", "direct", "wgrad")
_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16
_DOT_MIN_K_8BIT = 32  # an 8-bit (fp8) dot's K is at least 32 (Hopper's fp8 wgmma: K = 32 an instruction)
_MAX_TILE = 256


@dataclass(frozen=True)
class ConvProblem:
    """What the config choice sees of one launch.

    ``m``: GEMM rows (positions: N * OD * OH * OW; for ``"wgrad"`` the positions reduced over), ``n``: output
    channels a group (``"direct"``: all output channels), ``cg``: channels a group of the gathered operand,
    ``taps``: KD * KH * KW, ``groups``, ``dtype``: the inputs' dtype.

    The layer's geometry, which the tuning key needs (the default does not): ``kernel``, ``stride`` and
    ``dilation``, one int a spatial dim (empty: unknown), and ``transposed``: an ``"implicit"`` launch run as
    the forward's input gradient (``m`` then counts the input's positions, ``n`` the layer's input channels a
    group and ``cg`` its output channels a group).
    """

    kind: str
    m: int
    n: int
    cg: int
    taps: int
    groups: int
    dtype: torch.dtype
    kernel: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    transposed: bool = False


@dataclass(frozen=True)
class ConvConfig:
    """Launch configuration of a fly-conv kernel (see the module docstring for each kind's tile)."""

    block_m: int
    block_n: int
    block_k: int = 32
    group_m: int = 8  # implicit GEMM: row-tiles a group of programs walks before moving right (L2 reuse)
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # wgrad: runs the positions are cut into; forward implicit GEMM: runs of the K steps
    taps: int = 1  # wgrad: filter taps a program covers (its output-gradient tile is loaded once for all)
    tma: bool = False  # implicit (unsplit) and wgrad: row blocks by tensor descriptors where the layer allows


def smem_bytes(cfg: ConvConfig, problem: ConvProblem) -> int:
    """Shared memory of a dot kernel's pipeline: an A and a B tile a stage (0 for the direct kernel)."""
    if problem.kind == "direct":
        return 0
    return (cfg.block_m + cfg.taps * cfg.block_n) * cfg.block_k * problem.dtype.itemsize * cfg.num_stages


def config_valid(cfg: ConvConfig, problem: ConvProblem, arch: flydsl.arch.Arch) -> bool:
    """The one validity predicate (default, tuner, tests): power-of-two tiles of at most 256 (at
    least 16 in every dot dimension), a warp count Triton takes, shared memory within the arch's, split-K for
    the weight gradient and the forward implicit GEMM (not its transposed form, the input gradient), several
    taps a program (a power of two, their channels a dot's N of at most 256) for the weight gradient only,
    ``tma`` for 16-bit weight gradients and unsplit implicit GEMMs (16-bit, or the fp8 forward) on a GPU with
    tensor descriptors."""
    if problem.kind not in KINDS:
        return False
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(t < 1 or t & (t - 1) or t > _MAX_TILE for t in tiles) or cfg.group_m < 1:
        return False
    if problem.kind != "direct" and min(tiles) < _DOT_MIN:
        return False
    if problem.dtype.itemsize == 1 and (problem.kind != "implicit" or cfg.block_k < _DOT_MIN_K_8BIT):
        return False  # fp8: the forward implicit GEMM only
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1 or cfg.split_k < 1:
        return False
    if cfg.split_k > 1 and not (problem.kind == "wgrad" or (problem.kind == "implicit" and not problem.transposed)):
        return False
    if cfg.taps < 1 or cfg.taps & (cfg.taps - 1) or (cfg.taps > 1 and problem.kind != "wgrad"):
        return False
    if cfg.taps * cfg.block_n > _MAX_TILE:  # the dot's N: every tap's input channels
        return False
    rows_fp8 = problem.dtype.itemsize == 1 and problem.kind == "implicit" and not problem.transposed
    if cfg.tma and not ((problem.dtype.itemsize == 2 or rows_fp8) and arch.has_tma and cfg.taps == 1
                        and (problem.kind == "wgrad" or (problem.kind == "implicit" and cfg.split_k == 1))):
        return False  # fmt: skip
    return smem_bytes(cfg, problem) <= arch.smem_per_block


# The direct kernel serves grouped layers of at most this many input channels a group: there an implicit
# GEMM's K (channels a group x taps, one channel block a tap) fills a fraction of a 16-deep tensor-core step
# and of its N tile, while the direct kernel's fp32 multiply-adds (CG a tap and output) stay near the bytes'
# time. From 16 channels a group the implicit GEMM is level with cuDNN (PERF.md).
DIRECT_MAX_CG = 8


def direct_kernel(c_in: int, k_out: int, groups: int, dtype: torch.dtype) -> bool:
    """Whether a forward runs the direct kernel (pure): depthwise layers (``groups == c_in``, ``k_out`` a
    multiple) and grouped ones of at most :data:`DIRECT_MAX_CG` input channels a group, in 16- and 32-bit
    floats (fp8 layers run the implicit GEMM, whose epilogue applies the scales)."""
    if groups < 2 or dtype.itemsize == 1 or c_in % groups or k_out % groups:
        return False
    return c_in // groups <= DIRECT_MAX_CG


def _pow2_in(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, flyc.next_power_of_2(max(v, 1))))


# Programs a weight-gradient launch aims for, an SM: its tiles are few (output x input channels x taps), so
# the positions are split until every SM has two programs, each split keeping >= 8 steps of positions.
_WGRAD_PROGRAMS_PER_SM = 2
_WGRAD_MIN_STEPS = 8


def wgrad_splits(cfg: ConvConfig, problem: ConvProblem, arch: flydsl.arch.Arch) -> int:
    """Splits of the positions for a weight gradient launched with tile ``cfg`` (pure)."""
    tiles = (flyc.cdiv(problem.n, cfg.block_m) * flyc.cdiv(problem.cg, cfg.block_n)
             * flyc.cdiv(problem.taps, cfg.taps) * problem.groups)  # fmt: skip
    steps = flyc.cdiv(problem.m, cfg.block_k)
    split = 1
    while tiles * split < _WGRAD_PROGRAMS_PER_SM * arch.sm_count and steps // (2 * split) >= _WGRAD_MIN_STEPS:
        split *= 2
    return split


# The depthwise weight gradient (one input channel a group): the wgrad kernel's tiles of 16 x 16 channel pairs
# would hold one useful pair, so it runs a kernel of its own (``_kernels/wgrad.py``): a program a tap, a block of
# groups and a run of positions, each step one [positions, channels] product summed in registers. Its grid is
# small (taps x channel blocks), and each program streams its positions from L2 (every tap's program reads the
# same output gradient): split the positions until there are 8 programs an SM, each run >= 8 steps.
_DW_WGRAD_PROGRAMS_PER_SM = 8


def depthwise_wgrad_config(problem: ConvProblem, arch: flydsl.arch.Arch) -> ConvConfig:
    """The depthwise weight gradient's launch (pure; not tuned yet): ``block_m`` positions a step, ``block_n``
    output channels a program (whole groups), ``split_k`` runs of the positions. ``problem``: the layer's
    ``"wgrad"`` problem (``n``: outputs a group, ``cg`` 1)."""
    k_out = problem.n * problem.groups
    block_n = max(_pow2_in(k_out, 1, 64), flyc.next_power_of_2(problem.n))
    block_m = 16 if arch.is_interpreter else max(16, min(_MAX_TILE, 4096 // block_n))
    groups_a_block = max(1, block_n // flyc.next_power_of_2(problem.n))
    programs = problem.taps * flyc.cdiv(problem.groups, groups_a_block)
    steps = flyc.cdiv(problem.m, block_m)
    split = 1
    while programs * split < _DW_WGRAD_PROGRAMS_PER_SM * arch.sm_count and steps // (2 * split) >= _WGRAD_MIN_STEPS:
        split *= 2
    return ConvConfig(block_m, block_n, 1, num_warps=4, num_stages=1, split_k=split)


# Split-K of the forward implicit GEMM (fly-gemm's rule): a grid of output tiles under one wave of the SMs
# splits its K steps (taps x channel blocks) into the most runs whose (tile, split) programs still fit in one
# wave, each run keeping at least _IMPLICIT_MIN_STEPS steps (the pipeline fills, and the fp32 partial sums stay
# small against the operands each run reads), at most _IMPLICIT_MAX_SPLITS. The 7x7 512 -> 512 3x3 layer at
# batch 32 (1568 x 512, 52 tiles of 128 x 128, K = 4608: 72 steps of 64) splits 2: 104 programs of 36 steps.
# Derived, not yet timed on the H200.
_IMPLICIT_MIN_STEPS = 8
_IMPLICIT_MAX_SPLITS = 8


def _k_steps(cfg: ConvConfig, problem: ConvProblem) -> int:
    return problem.taps * flyc.cdiv(problem.cg, cfg.block_k)


def implicit_splits(cfg: ConvConfig, problem: ConvProblem, arch: flydsl.arch.Arch) -> int:
    """Splits of the K steps for a forward implicit GEMM launched with tile ``cfg`` (pure): 1 unless its grid
    is under one wave and the steps are many (see ``_IMPLICIT_MIN_STEPS``)."""
    if problem.kind != "implicit" or problem.transposed:
        return 1
    tiles = flyc.cdiv(problem.m, cfg.block_m) * flyc.cdiv(problem.n, cfg.block_n) * problem.groups
    fill = arch.sm_count // max(tiles, 1)
    return max(1, min(fill, _k_steps(cfg, problem) // _IMPLICIT_MIN_STEPS, _IMPLICIT_MAX_SPLITS))


def default_config(problem: ConvProblem, arch: flydsl.arch.Arch) -> ConvConfig:
    """The default launch config of ``problem`` (pure: the problem and the arch only)."""
    if problem.kind not in KINDS:
        raise ValueError(f"default_config: kind must be one of {KINDS}, got {problem.kind!r}")
    wide = problem.dtype.itemsize <= 2
    fp8 = problem.dtype.itemsize == 1
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        if problem.kind == "direct":
            cfg = ConvConfig(32, _pow2_in(problem.n, 1, 32), 1, num_stages=1)
        elif problem.kind == "wgrad":
            cfg = ConvConfig(_pow2_in(problem.n, 16, 32), _pow2_in(problem.cg, 16, 32), 32, num_stages=1)
        else:
            k_lo = _DOT_MIN_K_8BIT if fp8 else 16
            cfg = ConvConfig(32, _pow2_in(problem.n, 16, 32), _pow2_in(problem.cg, k_lo, 32), group_m=4, num_stages=1)
    elif problem.kind == "direct":
        # memory bound: 4096 outputs a program (32 a thread at 4 warps), channels across the lanes so that
        # each tap's load of a position is contiguous; groups of 5-8 channels hold an input tile twice the
        # outputs' beside them: 8 warps (sm_90 compiles at 4 warps spilled 8-24 bytes at 1024-4096 outputs)
        block_n = _pow2_in(problem.n, 1, 64)
        cfg = ConvConfig(min(_MAX_TILE, 4096 // block_n), block_n, 1, num_warps=4 if problem.cg <= 4 else 8,
                         num_stages=1)  # fmt: skip
    elif problem.kind == "wgrad":
        cfg = ConvConfig(_pow2_in(problem.n, 16, 128), _pow2_in(problem.cg, 16, 128), 64 if wide else 32,
                         num_warps=8 if problem.n >= 128 and problem.cg >= 128 else 4, num_stages=3)  # fmt: skip
    elif wide:
        # Chosen by sm_90 compiles (no register spill, K loop pipelined: tests/conv_compile_sm90.py and
        # PERF.md), not by timings: 128-row tiles, 64 channels a step where the layer has them, 4 stages
        # (128 KB of shared memory at 128 x 128 x 64). 8 warps from 128 x 64 up: at 4 warps a 128 x 64 x 64
        # tile takes 191 registers in the forward, 252 in the strided input gradient and spills there with
        # int64 offsets; at 8 warps 112-166, no spill. A grid short of one wave (small batch, small images)
        # splits its K steps where they are many (implicit_splits: the 128-row tile keeps its operand reuse),
        # else takes 64-row tiles: twice the programs.
        # fp8 takes twice the channels a step (128: the same bytes a stage, and 128 KB at 4 stages, as 16-bit's
        # 64) and at least the 32 an 8-bit dot needs.
        block_n = _pow2_in(problem.n, 16, 128)
        block_k = _pow2_in(problem.cg, _DOT_MIN_K_8BIT, 128) if fp8 else _pow2_in(problem.cg, 16, 64)
        block_m, split = 128, implicit_splits(ConvConfig(128, block_n, block_k), problem, arch)
        if split == 1 and flyc.cdiv(problem.m, 128) * flyc.cdiv(problem.n, block_n) * problem.groups < arch.sm_count:
            block_m = 64
        cfg = ConvConfig(block_m, block_n, block_k, group_m=8, num_warps=8 if block_m * block_n >= 128 * 64 else 4,
                         num_stages=4, split_k=split)  # fmt: skip
    else:
        # fp32 runs the full-precision dot (IEEE products, no tensor cores): its operands live in registers,
        # so the tile is small. 64 x 64 x 16 at 4 warps compiles in at most 168 registers with int32 or int64
        # offsets; 128 x 64 x 16 and 64 x 128 x 16 spill (255 registers, 8-32 bytes of stack).
        cfg = ConvConfig(64, _pow2_in(problem.n, 16, 64), 16, group_m=8, num_warps=4, num_stages=3)
        cfg = dataclasses.replace(cfg, split_k=implicit_splits(cfg, problem, arch))
    while not config_valid(cfg, problem, arch) and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if problem.kind == "wgrad":
        cfg = dataclasses.replace(cfg, split_k=wgrad_splits(cfg, problem, arch))
    return cfg


# ------------------------------------------------------------------ tuning adopter
#
# Key: {"kind", "rank", "kernel", "stride", "dilation", "groups", "cin", "cout", "m_bucket", "dtype"} and the
# arch. "kind" is the launch's kernel: "implicit" (forward), "dgrad" (the implicit GEMM transposed: the input
# gradient), "direct" or "wgrad". "kernel" / "stride" / "dilation" are "3x3"-style text (keys hold JSON
# scalars only). "groups" is "dense", "depthwise" or "cg<bucket>" (the layer's input channels a group). "cin"
# and "cout" are the layer's input and output channels, "m_bucket" the launch's rows (N x output positions;
# the input gradient: N x input positions, the rows it writes), each the next power of two, capped: the tiles
# are bounded by the channels and the grid's fill by the rows, while the spatial sizes themselves (D, H, W)
# are runtime values of every kernel and stay out of the key.

_C_CAP = 2048  # channels: past this, every candidate's tile is far narrower than the layer
_M_CAP = 1 << 20  # rows: past ~8 waves of 128-row tiles on 132 SMs the tail wave no longer decides the tile
_KEY_KINDS = ("implicit", "dgrad", "direct", "wgrad")


def _bucket(v: int, cap: int) -> int:
    return min(flyc.next_power_of_2(max(int(v), 1)), cap)


def _dims(values: tuple[int, ...]) -> str:
    return "x".join(str(int(v)) for v in values)


def _parse_dims(key, field: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(v) for v in str(key[field]).split("x"))
    except (KeyError, ValueError):
        raise ValueError(f"key: expected {field!r} as '3x3'-style text, got {key.get(field)!r}") from None
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"key: {field!r} must hold 1-3 positive sizes, got {key[field]!r}")
    return dims


def _layer_channels(problem: ConvProblem) -> tuple[int, int, int]:
    """(input channels, output channels, input channels a group) of the layer a launch belongs to."""
    if problem.kind == "direct":
        return problem.cg * problem.groups, problem.n, problem.cg
    if problem.kind == "implicit" and problem.transposed:  # n: the layer's input channels a group
        return problem.n * problem.groups, problem.cg * problem.groups, problem.n
    return problem.cg * problem.groups, problem.n * problem.groups, problem.cg


def tuning_key(problem: ConvProblem, kind: str | None = None, dtype: torch.dtype | None = None) -> dict:
    """The bucketed tuning key of ``problem`` (``kind`` / ``dtype``: the problem's unless given; ``kind`` may
    also be ``"dgrad"``, the transposed implicit GEMM). The spatial sizes are not in it: every resolution of a
    layer shares its key."""
    if kind is not None or dtype is not None:
        transposed = problem.transposed if kind is None else kind == "dgrad"
        kind = problem.kind if kind is None else "implicit" if kind == "dgrad" else kind
        problem = dataclasses.replace(problem, kind=kind, dtype=dtype or problem.dtype, transposed=transposed)
    if problem.kind not in KINDS:
        raise ValueError(f"kind: expected one of {_KEY_KINDS}, got {problem.kind!r}")
    rank = len(problem.kernel)
    if not (1 <= rank <= 3 and len(problem.stride) == rank and len(problem.dilation) == rank):
        raise ValueError(f"problem: the tuning key needs the layer's kernel, stride and dilation (1-3 ints each, "
                         f"one a spatial dim), got {problem!r}")  # fmt: skip
    cin, cout, cg = _layer_channels(problem)
    if problem.kind == "direct" and problem.cg == 1:
        groups = "depthwise"
    elif problem.groups == 1:
        groups = "dense"
    else:
        groups = f"cg{_bucket(cg, _C_CAP)}"
    kind = "dgrad" if problem.kind == "implicit" and problem.transposed else problem.kind
    return {"kind": kind, "rank": rank, "kernel": _dims(problem.kernel), "stride": _dims(problem.stride),
            "dilation": _dims(problem.dilation), "groups": groups, "cin": _bucket(cin, _C_CAP),
            "cout": _bucket(cout, _C_CAP), "m_bucket": _bucket(problem.m, _M_CAP),
            "dtype": dtype_name(problem.dtype)}  # fmt: skip


def _key_groups(key) -> int:
    cin, cout, groups = int(key["cin"]), int(key["cout"]), str(key["groups"])
    if groups == "dense":
        return 1
    if groups == "depthwise":
        return cin
    if not groups.startswith("cg") or not groups[2:].isdigit() or int(groups[2:]) < 1:
        raise ValueError(f"key: expected groups 'dense', 'depthwise' or 'cg<channels a group>', got {groups!r}")
    return max(1, min(cin // int(groups[2:]), cout))


def key_problem(key) -> ConvProblem:
    """The representative problem of a tuning key: its buckets taken as the sizes (``tuning_key`` of it is
    ``key`` again). The default, validity and candidates of a key are those of this problem."""
    kind = key["kind"]
    if kind not in _KEY_KINDS:
        raise ValueError(f"key: expected kind one of {_KEY_KINDS}, got {kind!r}")
    kernel, stride, dilation = (_parse_dims(key, f) for f in ("kernel", "stride", "dilation"))
    if not len(kernel) == len(stride) == len(dilation) == int(key["rank"]):
        raise ValueError(f"key: kernel, stride and dilation must have rank = {key['rank']} sizes, got {key!r}")
    cin, cout, m = int(key["cin"]), int(key["cout"]), int(key["m_bucket"])
    dtype = parse_dtype("dtype", key["dtype"])
    groups = _key_groups(key)
    geo = {"kernel": kernel, "stride": stride, "dilation": dilation}
    taps = math.prod(kernel)
    if kind == "direct":
        return ConvProblem("direct", m, cout, cin // groups, taps, groups, dtype, **geo)
    if kind == "dgrad":
        return ConvProblem("implicit", m, cin // groups, cout // groups, taps, groups, dtype, **geo, transposed=True)
    return ConvProblem(kind, m, cout // groups, cin // groups, taps, groups, dtype, **geo)


def _default(key, arch: str) -> ConvConfig:
    return default_config(key_problem(key), flydsl.arch.from_name(arch))


def _valid(cfg: ConvConfig, key, arch: str) -> bool:
    return config_valid(cfg, key_problem(key), flydsl.arch.from_name(arch))


_MAX_CANDIDATES = 30


def _warps(area: int) -> tuple[int, ...]:
    """Warp counts worth trying for a dot tile of ``area`` elements: 4 for small tiles, 8 for large ones (4
    spills past 128 x 64 in the strided input gradient: see :func:`default_config`), both in between."""
    if area < 64 * 64:
        return (4,)
    return (4, 8) if area <= 128 * 64 else (8,)


def _implicit_candidates(p: ConvProblem, a: flydsl.arch.Arch) -> list[ConvConfig]:
    """Row tiles of 64 / 128 (256 for narrow layers), column tiles up to the output channels, K steps up to the
    channels a group, warps and stages by tile size; a forward whose grid is under a wave adds split-K (at most
    four configs: 128-row tiles of up to 128 and 256 columns at the long K step, each split to fill one wave
    (:func:`implicit_splits`) and twice that where the steps allow)."""
    fp8, fp32 = p.dtype.itemsize == 1, p.dtype.itemsize == 4
    if fp32:  # the IEEE dot keeps its operands in registers: small tiles only (see default_config)
        n_cap, k_cap = _pow2_in(p.n, 16, 64), _pow2_in(p.cg, 16, 32)
        shapes, steps, stages = [(32, 32), (32, 64), (64, 32), (64, 64), (128, 64), (64, 128)], (16, 32), (2, 3)
    else:
        n_cap = _pow2_in(p.n, 16, _MAX_TILE)
        k_cap = _pow2_in(p.cg, _DOT_MIN_K_8BIT, 128) if fp8 else _pow2_in(p.cg, 16, 64)
        rows = (64, 128, 256) if n_cap <= 32 else (64, 128)  # narrow outputs: taller tiles keep a program busy
        shapes, steps, stages = [(bm, bn) for bm in rows for bn in (64, 128, 256)], (64, 128) if fp8 else (32, 64), ()
    out = []
    for bm, bn in shapes:
        bn = min(bn, n_cap)
        for step in steps:
            bk = min(step, k_cap)
            if fp32:
                options = [(4 if bm * bn <= 64 * 64 else 8, s) for s in stages]
            else:  # the short K step pipelines deeper; the 128 x 256 tile keeps 3 stages (shared memory)
                tiers = (4,) if step == steps[0] else (3,) if bm * bn >= 128 * 256 else (3, 4)
                options = [(w, s) for w in _warps(bm * bn) for s in tiers]
            out += [ConvConfig(bm, bn, bk, group_m=8, num_warps=w, num_stages=s) for w, s in options]
    if not p.transposed:
        bk = min(steps[-1], k_cap)
        for bn in sorted({min(128, n_cap), min(256, n_cap)}):
            bm = 64 if fp32 else 128
            cfg = ConvConfig(bm, bn, bk, group_m=8, num_warps=4 if fp32 else 8, num_stages=3)
            fill = implicit_splits(cfg, p, a)
            if fill > 1:
                more = min(2 * fill, _IMPLICIT_MAX_SPLITS)
                more = more if _k_steps(cfg, p) // more >= _IMPLICIT_MIN_STEPS else fill
                out += [dataclasses.replace(cfg, split_k=s) for s in sorted({fill, more})]
    return out


_MAX_ROWS_CANDIDATES = 5


def _rows_candidates(p: ConvProblem) -> list[ConvConfig]:
    """The row-block kernel's configs (``tma``) of a stride-1 implicit GEMM of one group in 16 bits, or an fp8
    forward (the key's layer is 'same'), at most :data:`_MAX_ROWS_CANDIDATES`: the long K step (64 channels;
    fp8 128) at the tiles the gathering kernel's searches chose most (128 x 128, 128 x 256, 64 x 128; columns
    up to the output channels), 3 and 4 stages (3 for 128 x 256: shared memory). None for other layers."""
    fp8 = p.dtype.itemsize == 1
    if p.kind != "implicit" or p.groups != 1 or any(s != 1 for s in p.stride) or p.dtype.itemsize == 4:
        return []
    if fp8 and p.transposed:
        return []
    n_cap = _pow2_in(p.n, 16, _MAX_TILE)
    bk = _pow2_in(p.cg, _DOT_MIN_K_8BIT, 128) if fp8 else _pow2_in(p.cg, 16, 64)
    out = []
    for bm, bn in ((128, 128), (128, 256), (64, 128)):
        bn = min(bn, n_cap)
        for s in (3,) if bm * bn >= 128 * 256 else (3, 4):
            out.append(ConvConfig(bm, bn, bk, group_m=8, num_warps=_warps(bm * bn)[-1], num_stages=s, tma=True))
    return out


def _direct_candidates(p: ConvProblem) -> list[ConvConfig]:
    """Channel tiles of 8-128 (up to the output channels) against 2048-8192 outputs a program, 4 or 8 warps."""
    n_cap = _pow2_in(p.n, 1, 128)
    out = []
    for bn in sorted({min(b, n_cap) for b in (8, 16, 32, 64, 128)}):
        for outputs in (2048, 4096, 8192):
            for warps in (4, 8):
                out.append(ConvConfig(max(1, min(_MAX_TILE, outputs // bn)), bn, 1, num_warps=warps, num_stages=1))
    return out


def wgrad_over_taps(cfg: ConvConfig, taps: int) -> ConvConfig:
    """Weight-gradient tile ``cfg`` over ``taps`` taps a program (pure): its input channels halved until the
    dot's N (taps x channels) is at most 256, and 8 warps from a 64 x 256 accumulator (at 4 the 3x3 64 -> 64
    layer's tile over 4 taps takes 254 registers in sm_90 compiles, at 8 128)."""
    bn = cfg.block_n
    while taps * bn > _MAX_TILE and bn > _DOT_MIN:
        bn //= 2
    warps = 8 if cfg.block_m * bn * taps >= 64 * 256 else cfg.num_warps
    return dataclasses.replace(cfg, block_n=bn, num_warps=warps, taps=taps)


def _wgrad_candidates(p: ConvProblem, a: flydsl.arch.Arch) -> list[ConvConfig]:
    """The default's tile and its halves, two position steps (the one-channel tile: three, and 2 warps too),
    and each with the splits of the positions that fill the SMs (:func:`wgrad_splits`), half and twice that
    (where the positions allow), and none where filling takes fewer than 4; then, for one group of 16-bit
    channels, the default's tile on the row-block kernel (``tma``) at both steps; then the default's tile over
    2 and 4 taps a program (:func:`wgrad_over_taps`); these two at the filling split and half of it."""
    base = default_config(p, a)
    steps = (16, 32) if p.dtype.itemsize == 4 else (32, 64)
    warps = (None,)  # None: the tile's own count
    if base.block_m * base.block_n <= 16 * 16:  # the one-channel tile (depthwise): longer steps, fewer warps
        steps, warps = (*steps, 2 * steps[-1]), (None, 2)
    out = []
    for bm in sorted({base.block_m, max(16, base.block_m // 2)}, reverse=True):
        for bn in sorted({base.block_n, max(16, base.block_n // 2)}, reverse=True):
            for bk, nw in itertools.product(steps, warps):
                cfg = ConvConfig(bm, bn, bk, num_warps=nw or (8 if bm * bn >= 128 * 128 else 4), num_stages=3)
                fill = wgrad_splits(cfg, p, a)
                more = fill * 2 if flyc.cdiv(p.m, bk) // (fill * 2) >= _WGRAD_MIN_STEPS // 2 else fill
                splits = {fill, max(1, fill // 2), more} | ({1} if fill < 4 else set())
                out += [dataclasses.replace(cfg, split_k=s) for s in sorted(splits)]
    if p.groups == 1 and p.dtype.itemsize == 2:  # the row-block kernel (the key's layer is 'same', stride 1)
        for bk in steps:
            cfg = dataclasses.replace(base, block_k=bk, tma=True)
            fill = wgrad_splits(cfg, p, a)
            out += [dataclasses.replace(cfg, split_k=s) for s in sorted({fill, max(1, fill // 2)})]
    for taps in (2, 4):
        if taps >= 2 * p.taps:  # a tap block wholly past the filter's taps
            break
        cfg = wgrad_over_taps(base, taps)
        fill = wgrad_splits(cfg, p, a)
        out += [dataclasses.replace(cfg, split_k=s) for s in sorted({fill, max(1, fill // 2)})]
    return out


def candidates(key, arch: str) -> list[ConvConfig]:
    """A bounded space per key (each valid for the key's problem on ``arch``): at most 30 configs of the
    key's kernel, and for stride-1 implicit GEMMs of one group (16-bit, fp8 forward) the row-block kernel's
    (at most 5 more, first in line: :func:`_rows_candidates`)."""
    p, a = key_problem(key), flydsl.arch.from_name(arch)
    if a.is_interpreter:  # the interpreter executes every element of a tile: the default and one other
        if p.kind == "direct":
            other = ConvConfig(16, 16, 1, num_stages=1)
        else:
            other = ConvConfig(16, 16, _DOT_MIN_K_8BIT if p.dtype.itemsize == 1 else 16, group_m=1, num_stages=1)
        out = [default_config(p, a), other]
    elif p.kind == "direct":
        out = _direct_candidates(p)
    elif p.kind == "wgrad":
        out = _wgrad_candidates(p, a)
    else:
        gathering = [c for c in dict.fromkeys(_implicit_candidates(p, a)) if config_valid(c, p, a)]
        out = _rows_candidates(p) + gathering[:_MAX_CANDIDATES]
        return [c for c in dict.fromkeys(out) if config_valid(c, p, a)]
    return [c for c in dict.fromkeys(out) if config_valid(c, p, a)][:_MAX_CANDIDATES]


def _key_layer(key) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(batch, input spatial size, output spatial size, padding) of the layer a key's search times: its rows
    as a batch of images of up to 4096 positions (3D: 32768), each dim a power of two, 'same'-style padding."""
    p = key_problem(key)
    rank = len(p.kernel)
    rows = p.m // math.prod(p.stride) if key["kind"] == "dgrad" else p.m  # dgrad: m counts input positions
    bits = max(rows, 1).bit_length() - 1
    image = min(bits, 15 if rank == 3 else 12)
    out_size = tuple(1 << (image // rank + (i < image % rank)) for i in range(rank))
    pad = tuple(d * (k - 1) // 2 for k, d in zip(p.kernel, p.dilation, strict=True))
    in_size = tuple((o - 1) * s + d * (k - 1) + 1 - 2 * q
                    for o, s, d, k, q in zip(out_size, p.stride, p.dilation, p.kernel, pad, strict=True))  # fmt: skip
    return 1 << (bits - image), in_size, out_size, pad


def _make_task(key, device):
    """The offline search task of a key: the key's representative layer (:func:`_key_layer`) with seeded
    random operands, timed through the real host path and launch, rotating over copies of the operands where
    they fit in L2. Every candidate is first checked against :func:`fly_conv.reference.conv_ref` (the
    gradients: torch's fp64 ``conv*d_input`` / ``conv*d_weight``); the forward and input gradient on the first
    and last image only (small problems, whatever the batch: an indexing slip between images still shows)."""
    from .conv import _conv_forward, _conv_input_grad, _conv_weight_grad  # here: conv imports this module
    from .reference import conv_ref

    p, kind = key_problem(key), key["kind"]
    batch, in_size, out_size, pad = _key_layer(key)
    rank, groups = len(p.kernel), p.groups
    cin, cout = int(key["cin"]), int(key["cout"])
    gen = torch.Generator(device=device).manual_seed(0)

    def channels_last(c, size):  # NC* view of channels-last memory: the kernels' native layout
        return torch.randn(batch, *size, c, generator=gen, device=device).movedim(-1, 1)

    w = torch.randn(cout, cin // groups, *p.kernel, generator=gen, device=device)
    fan_in = (cin // groups) * p.taps
    geo = (p.stride, pad, p.dilation, groups)
    idx = sorted({0, batch - 1})
    grad_fns = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input, 3: torch.nn.grad.conv3d_input}
    wgrad_fns = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}

    def view(out):  # the run's output to the checked images (the reference already holds only those)
        return out[idx] if out.shape[0] == batch else out

    xs = ws = out_dtype = None
    if kind in ("implicit", "direct"):
        x = channels_last(cin, in_size)
        if p.dtype.itemsize == 1:  # fp8: raw e4m3 values, the scales carry the magnitudes
            xs = torch.full((1,), 0.5, device=device)
            ws = (torch.rand(cout, generator=gen, device=device) + 0.5) * fan_in**-0.5
            x, w, out_dtype = x.to(p.dtype), w.to(p.dtype), torch.bfloat16
        else:
            x, w = x.to(p.dtype), (w * fan_in**-0.5).to(p.dtype)
        operands = (x, w, xs, ws)

        def call(cfg, x, w, xs, ws):
            return _conv_forward(x, w, None, p.stride, pad, pad, p.dilation, groups, 0, True, cfg, xs, ws, out_dtype)

        def reference():
            return conv_ref(x[idx], w, None, *geo, x_scale=xs, w_scale=ws)

    elif kind == "dgrad":
        g, w = channels_last(cout, out_size).to(p.dtype), (w * fan_in**-0.5).to(p.dtype)
        operands = (g, w)

        def call(cfg, g, w):
            return _conv_input_grad(g, w, (batch, cin, *in_size), *geo, True, config=cfg)

        def reference():
            return grad_fns[rank]((len(idx), cin, *in_size), w.double(), g[idx].double(), *geo)

    else:  # wgrad: the whole gradient (it sums over every image)
        g, x = channels_last(cout, out_size).to(p.dtype), channels_last(cin, in_size).to(p.dtype)
        operands = (g, x)

        def call(cfg, g, x):
            return _conv_weight_grad(g, x, tuple(w.shape), *geo, config=cfg)

        def reference():
            return wgrad_fns[rank](x.double(), tuple(w.shape), g.double(), *geo)

    l2 = flydsl.arch.current().l2_bytes if torch.device(device).type == "cuda" else 0
    sets = rotating_copies(operands, l2)  # identical copies: any one gives the same output
    turn = iter(range(1 << 62))

    out = out_dtype or p.dtype
    if out == torch.float32:
        rtol = 1e-4  # fp32 accumulation over up to millions of products
    else:
        rtol = tolerance(out) * (2 if kind in ("dgrad", "wgrad") else 1)  # as the gradient tests budget
    return SearchTask(run=lambda cfg: call(cfg, *sets[next(turn) % len(sets)]), reference=reference, rtol=rtol,
                      view=view if kind in ("implicit", "direct", "dgrad") else None)  # fmt: skip


def _bench_problems(case, dtype: torch.dtype, train: bool) -> list[ConvProblem]:
    """The launches of one bench layer (``fly_conv.bench``'s case params): its forward, and for a training
    step its input and weight gradients too."""
    prm = case.params
    spatial, ks, s, groups = tuple(prm["spatial"]), prm["ks"], prm["stride"], prm["groups"]
    rank, c, k, n = len(spatial), prm["C"], prm["K"], prm["N"]
    out = tuple((i + 2 * (ks // 2) - ks) // s + 1 for i in spatial)
    geo = {"kernel": (ks,) * rank, "stride": (s,) * rank, "dilation": (1,) * rank}
    taps, rows = ks**rank, n * math.prod(out)
    cg, kg = c // groups, k // groups
    if direct_kernel(c, k, groups, dtype):
        problems = [ConvProblem("direct", rows, k, cg, taps, groups, dtype, **geo)]
    else:
        problems = [ConvProblem("implicit", rows, kg, cg, taps, groups, dtype, **geo)]
    if train:
        if s == 1 and direct_kernel(k, c, groups, dtype):  # the input gradient as a direct convolution
            dgrad = ConvProblem("direct", n * math.prod(spatial), c, kg, taps, groups, dtype, **geo)
        else:
            dgrad = ConvProblem("implicit", n * math.prod(spatial), cg, kg, taps, groups, dtype, **geo, transposed=True)
        problems.append(dgrad)
        if cg > 1 or groups == 1:  # a depthwise weight gradient runs its own kernel, not tuned (yet)
            problems.append(ConvProblem("wgrad", rows, kg, cg, taps, groups, dtype, **geo))
    return problems


def _tune_keys(arch: str) -> list[dict]:
    """The offline tuning set: ``fly_conv.bench``'s tuned layers (ResNet-50 / UNet 3x3 and 1x1, 3D 3x3x3, 1D
    k = 7, depthwise, grouped; the training layers' gradients; the fp8 forward's layers), one key each launch."""
    from . import bench  # here: bench imports conv, which imports this module

    problems = []
    for cases in (bench._CONV, bench._NCHW, bench._1X1, bench._DEPTHWISE, bench._GROUPED):
        problems += [p for case in cases for p in _bench_problems(case, torch.bfloat16, False)]
    problems += [p for case in bench._TRAIN for p in _bench_problems(case, torch.bfloat16, True)]
    problems += [p for case in bench._FP8_LAYERS for p in _bench_problems(case, torch.float8_e4m3fn, False)]
    keys = {}
    for problem in problems:
        key = tuning_key(problem)
        keys.setdefault(tuple(sorted(key.items())), key)
    return list(keys.values())


def _make_tunable():
    return Tunable(
        name="conv",
        config_type=ConvConfig,
        default=_default,
        candidates=candidates,
        is_valid=_valid,
        artifact_dir=Path(__file__).parent / "artifacts",
        max_candidates=_MAX_CANDIDATES + _MAX_ROWS_CANDIDATES + 1,  # the default and the candidates
        tune_keys=_tune_keys,
        make_task=_make_task,
    )


TUNABLE = _make_tunable()
_FAST: dict = {}  # (problem, arch name, default) -> config: one dict lookup a launch
_FAST_LIMIT = 4096


def config_for(problem: ConvProblem, kind: str | None = None, dtype: torch.dtype | None = None, device=None, *,
               arch: flydsl.arch.Arch | None = None, autotune: bool | None = None, task=None,
               default=None) -> ConvConfig:  # fmt: skip
    """The launch config of ``problem`` (``kind`` / ``dtype`` as in :func:`tuning_key`) on ``arch`` (default:
    ``device``'s): its key's searched winner, the shipped artifact's or the default.

    The default is the problem's own :func:`default_config` (``default``: the function to use instead): a key
    whose answer is its representative problem's default (nothing searched or shipped, or the default won)
    serves every problem of the key its own default, exact channels and positions rather than the key's
    rounded ones. ``autotune`` (default ``FLYDSL_AUTOTUNE``) searches the key once a process with ``task()``
    (default: the key's representative task, :func:`_make_task`). A served config is valid for ``problem``;
    answers are memoised per problem, so a launch pays one dict lookup."""
    if kind is not None or dtype is not None:
        transposed = problem.transposed if kind is None else kind == "dgrad"
        kind = problem.kind if kind is None else "implicit" if kind == "dgrad" else kind
        problem = dataclasses.replace(problem, kind=kind, dtype=dtype or problem.dtype, transposed=transposed)
    a = arch if arch is not None else flydsl.arch.current(device)
    choose = default_config if default is None else default
    search = env.get("FLYDSL_AUTOTUNE") if autotune is None else autotune
    fast_key = (problem, a.name, choose)
    if not search:
        cfg = _FAST.get(fast_key)
        if cfg is not None:
            return cfg
    if not problem.kernel:  # no geometry, no key: the problem's default
        cfg = choose(problem, a)
    else:
        key = tuning_key(problem)
        if task is None:
            device = device if device is not None else "cpu" if a.is_interpreter else "cuda"
            task = lambda: _make_task(key, device)  # noqa: E731
        cfg = TUNABLE.select(key, a.name, autotune=search, task=task)
        if cfg == TUNABLE.default(key, a.name) or not config_valid(cfg, problem, a):
            cfg = choose(problem, a)
    if not config_valid(cfg, problem, a):
        raise ValueError(f"config_for: the default {cfg!r} is not valid for {problem!r} on {a.name}")
    if not search:
        if len(_FAST) >= _FAST_LIMIT:
            _FAST.clear()
        _FAST[fast_key] = cfg
    return cfg


def clear_memo() -> None:
    """Forget every resolved config of this process (tests; after tuning)."""
    _FAST.clear()
    TUNABLE.clear_memo()
