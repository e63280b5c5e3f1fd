"""Launch configurations of fly-gemm: :class:`GemmConfig`, its default heuristic and validity predicate.

The default is a pure function of (M, N, K, input dtype, arch), unit-tested on
the CPU; the tuning adopter (searched winners, shipped sm_90 artifacts) builds
on it. Tile shapes follow the published Hopper practice (128 x 128 tiles,
BLOCK_K 64 for 16-bit inputs and 128 for 8-bit ones, 3-4 pipeline stages,
grouped tile order with GROUP_M = 8) until measured on the H200; small M
takes tiles of 16-64 rows so that no program computes mostly padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flydsl.arch
import flydsl.compiler as flyc

__all__ = ["GemmConfig", "default_config", "config_valid", "smem_bytes"]

_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of a GEMM kernel: the C tile a program computes, its K step and pipeline."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # row-tiles a group of programs walks before moving right (L2 reuse of B)
    num_warps: int = 4
    num_stages: int = 3  # software-pipeline depth of the K loop (shared-memory buffers)

    def launch_options(self) -> dict:
        """Triton's launch options of this config."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def smem_bytes(cfg: GemmConfig, in_dtype: torch.dtype) -> int:
    """Shared memory the K loop's buffers take: A and B tiles, one pair per stage (an upper bound)."""
    return (cfg.block_m + cfg.block_n) * cfg.block_k * in_dtype.itemsize * cfg.num_stages


def config_valid(cfg: GemmConfig, in_dtype: torch.dtype, arch: flydsl.arch.Arch) -> bool:
    """The one validity predicate of the space (heuristic, tuner, tests): power-of-two tiles of at least
    16 (the dot's minimum), at most 8 warps a 128 x 128 tile can use, shared memory within the arch's."""
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(t < _DOT_MIN or t & (t - 1) for t in tiles) or cfg.group_m < 1:
        return False
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        return False
    return smem_bytes(cfg, in_dtype) <= arch.smem_per_block


def default_config(m: int, n: int, k: int, in_dtype: torch.dtype, arch: flydsl.arch.Arch) -> GemmConfig:
    """The default launch config of C[M, N] = A[M, K] @ B[N, K]^T (pure: shape, dtype and arch only)."""
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        block_m = 16 if m <= 16 else 32
        return GemmConfig(block_m, 32, 32, group_m=4, num_warps=4, num_stages=1)
    wide = in_dtype.itemsize == 1  # fp8 / int8: twice the K per byte
    block_k = 128 if wide else 64
    stages = 4 if arch.backend == "cuda" else 2
    if m <= 64:  # decode-size batches: a tile of M rows, wide in N (the weights stream)
        block_m = max(_DOT_MIN, flyc.next_power_of_2(max(m, 1)))
        cfg = GemmConfig(block_m, 64, block_k * 2 if wide else 128, group_m=1, num_warps=4, num_stages=stages)
    else:
        cfg = GemmConfig(128, 128 if n > 64 else 64, block_k, group_m=8, num_warps=8, num_stages=stages)
    while not config_valid(cfg, in_dtype, arch) and cfg.num_stages > 1:
        cfg = GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages - 1)
    return cfg
