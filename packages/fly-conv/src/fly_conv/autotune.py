"""Launch configurations of fly-conv: :class:`ConvProblem`, :class:`ConvConfig`, the pure default
(:func:`default_config`) and the one validity predicate (:func:`config_valid`).

Three kernel kinds share the config type:

- ``"implicit"``: the implicit GEMM (forward, and the input gradient as the same kernel transposed):
  ``block_m`` output positions x ``block_n`` output channels of a group, ``block_k`` input channels a step;
- ``"depthwise"``: the direct depthwise kernel: ``block_m`` positions x ``block_n`` channels (no dot, so no
  tensor-core minimum; ``block_k`` unused);
- ``"wgrad"``: the weight gradient: ``block_m`` output channels x ``block_n`` input channels of one tap,
  ``block_k`` positions a step, the positions split ``split_k`` ways (partial sums added in a fixed order).

The defaults are the published Hopper practice for 16-bit implicit GEMMs (128-row tiles, 64 channels a
step where the layer has them, 3-4 pipeline stages, grouped tile order), narrowed to the layer where its
channels are fewer (grouped and small-channel layers), with warps and fp32 tiles chosen by sm_90 compiles
(no spill, the K loop pipelined); they have not been timed on the H200 yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import flydsl.arch
import flydsl.compiler as flyc

__all__ = ["ConvProblem", "ConvConfig", "KINDS", "default_config", "config_valid", "smem_bytes", "wgrad_splits"]

KINDS = ("implicit", "depthwise", "wgrad")
_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16
_DOT_MIN_K_8BIT = 32  # an 8-bit (fp8) dot's K is at least 32 (Hopper's fp8 wgmma: K = 32 an instruction)
_MAX_TILE = 256


@dataclass(frozen=True)
class ConvProblem:
    """What the config choice sees of one launch.

    ``m``: GEMM rows (positions: N * OD * OH * OW; for ``"wgrad"`` the positions reduced over), ``n``: output
    channels a group (``"depthwise"``: all output channels), ``cg``: channels a group of the gathered operand,
    ``taps``: KD * KH * KW, ``groups``, ``dtype``: the inputs' dtype.
    """

    kind: str
    m: int
    n: int
    cg: int
    taps: int
    groups: int
    dtype: torch.dtype


@dataclass(frozen=True)
class ConvConfig:
    """Launch configuration of a fly-conv kernel (see the module docstring for each kind's tile)."""

    block_m: int
    block_n: int
    block_k: int = 32
    group_m: int = 8  # implicit GEMM: row-tiles a group of programs walks before moving right (L2 reuse)
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # wgrad: runs the positions are cut into (each its own fp32 partial sums)


def smem_bytes(cfg: ConvConfig, problem: ConvProblem) -> int:
    """Shared memory of a dot kernel's pipeline: an A and a B tile a stage (0 for the depthwise kernel)."""
    if problem.kind == "depthwise":
        return 0
    return (cfg.block_m + cfg.block_n) * cfg.block_k * problem.dtype.itemsize * cfg.num_stages


def config_valid(cfg: ConvConfig, problem: ConvProblem, arch: flydsl.arch.Arch) -> bool:
    """The one validity predicate (default, tests, a future tuner): power-of-two tiles of at most 256 (at
    least 16 in every dot dimension), a warp count Triton takes, shared memory within the arch's, split-K for
    the weight gradient only."""
    if problem.kind not in KINDS:
        return False
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(t < 1 or t & (t - 1) or t > _MAX_TILE for t in tiles) or cfg.group_m < 1:
        return False
    if problem.kind != "depthwise" and min(tiles) < _DOT_MIN:
        return False
    if problem.dtype.itemsize == 1 and (problem.kind != "implicit" or cfg.block_k < _DOT_MIN_K_8BIT):
        return False  # fp8: the forward implicit GEMM only
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1 or cfg.split_k < 1:
        return False
    if cfg.split_k > 1 and problem.kind != "wgrad":
        return False
    return smem_bytes(cfg, problem) <= arch.smem_per_block


def _pow2_in(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, flyc.next_power_of_2(max(v, 1))))


# Programs a weight-gradient launch aims for, an SM: its tiles are few (output x input channels x taps), so
# the positions are split until every SM has two programs, each split keeping >= 8 steps of positions.
_WGRAD_PROGRAMS_PER_SM = 2
_WGRAD_MIN_STEPS = 8


def wgrad_splits(cfg: ConvConfig, problem: ConvProblem, arch: flydsl.arch.Arch) -> int:
    """Splits of the positions for a weight gradient launched with tile ``cfg`` (pure)."""
    tiles = flyc.cdiv(problem.n, cfg.block_m) * flyc.cdiv(problem.cg, cfg.block_n) * problem.taps * problem.groups
    steps = flyc.cdiv(problem.m, cfg.block_k)
    split = 1
    while tiles * split < _WGRAD_PROGRAMS_PER_SM * arch.sm_count and steps // (2 * split) >= _WGRAD_MIN_STEPS:
        split *= 2
    return split


def default_config(problem: ConvProblem, arch: flydsl.arch.Arch) -> ConvConfig:
    """The default launch config of ``problem`` (pure: the problem and the arch only)."""
    if problem.kind not in KINDS:
        raise ValueError(f"default_config: kind must be one of {KINDS}, got {problem.kind!r}")
    wide = problem.dtype.itemsize <= 2
    fp8 = problem.dtype.itemsize == 1
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        if problem.kind == "depthwise":
            cfg = ConvConfig(32, _pow2_in(problem.n, 1, 32), 1, num_stages=1)
        elif problem.kind == "wgrad":
            cfg = ConvConfig(_pow2_in(problem.n, 16, 32), _pow2_in(problem.cg, 16, 32), 32, num_stages=1)
        else:
            k_lo = _DOT_MIN_K_8BIT if fp8 else 16
            cfg = ConvConfig(32, _pow2_in(problem.n, 16, 32), _pow2_in(problem.cg, k_lo, 32), group_m=4, num_stages=1)
    elif problem.kind == "depthwise":
        # memory bound: 4096 outputs a program (32 a thread at 4 warps), channels across the lanes so that
        # each tap's load of a position is contiguous
        block_n = _pow2_in(problem.n, 1, 64)
        cfg = ConvConfig(min(_MAX_TILE, 4096 // block_n), block_n, 1, num_warps=4, num_stages=1)
    elif problem.kind == "wgrad":
        cfg = ConvConfig(_pow2_in(problem.n, 16, 128), _pow2_in(problem.cg, 16, 128), 64 if wide else 32,
                         num_warps=8 if problem.n >= 128 and problem.cg >= 128 else 4, num_stages=3)  # fmt: skip
    elif wide:
        # Chosen by sm_90 compiles (no register spill, K loop pipelined: tests/conv_compile_sm90.py and
        # PERF.md), not by timings: 128-row tiles, 64 channels a step where the layer has them, 4 stages
        # (128 KB of shared memory at 128 x 128 x 64). 8 warps from 128 x 64 up: at 4 warps a 128 x 64 x 64
        # tile takes 191 registers in the forward, 252 in the strided input gradient and spills there with
        # int64 offsets; at 8 warps 112-166, no spill. A grid short of one wave (small batch, small images)
        # takes 64-row tiles: twice the programs.
        # fp8 takes twice the channels a step (128: the same bytes a stage, and 128 KB at 4 stages, as 16-bit's
        # 64) and at least the 32 an 8-bit dot needs.
        block_n = _pow2_in(problem.n, 16, 128)
        block_k = _pow2_in(problem.cg, _DOT_MIN_K_8BIT, 128) if fp8 else _pow2_in(problem.cg, 16, 64)
        block_m = 128
        if flyc.cdiv(problem.m, 128) * flyc.cdiv(problem.n, block_n) * problem.groups < arch.sm_count:
            block_m = 64
        cfg = ConvConfig(block_m, block_n, block_k, group_m=8, num_warps=8 if block_m * block_n >= 128 * 64 else 4,
                         num_stages=4)  # fmt: skip
    else:
        # fp32 runs the full-precision dot (IEEE products, no tensor cores): its operands live in registers,
        # so the tile is small. 64 x 64 x 16 at 4 warps compiles in at most 168 registers with int32 or int64
        # offsets; 128 x 64 x 16 and 64 x 128 x 16 spill (255 registers, 8-32 bytes of stack).
        cfg = ConvConfig(64, _pow2_in(problem.n, 16, 64), 16, group_m=8, num_warps=4, num_stages=3)
    while not config_valid(cfg, problem, arch) and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if problem.kind == "wgrad":
        cfg = dataclasses.replace(cfg, split_k=wgrad_splits(cfg, problem, arch))
    return cfg
