"""Launch configurations of fly-gemm: :class:`GemmConfig`, its default heuristic and validity predicate.

The default is a pure function of (M, N, K, input dtype, arch), unit-tested on
the CPU; the tuning adopter (searched winners, shipped sm_90 artifacts) builds
on it. Tile shapes follow the published Hopper practice (128 x 128 tiles,
BLOCK_K 64 for 16-bit inputs and 128 for 8-bit ones, 3-4 pipeline stages,
grouped tile order with GROUP_M = 8) until measured on the H200; small M
takes tiles of 16-64 rows so that no program computes mostly padding.
"""

from __future__ import annotations

import dataclasses
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
    # The persistent TMA kernel (sm_90+, operands TMA can address; others take the tiled kernel) and
    # its tile-loop options: fuse the tile loop with the K loop, let Triton specialize warp groups.
    tma: bool = False
    flatten: bool = False
    warp_specialize: bool = False
    # Splits of K (tiled kernel): decode-size M has too few C tiles to occupy the GPU, so K is split and
    # the partial sums added by a second kernel (deterministic).
    split_k: int = 1

    def launch_options(self) -> dict:
        """Triton's launch options of this config."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def smem_bytes(cfg: GemmConfig, in_dtype: torch.dtype, out_itemsize: int = 4) -> int:
    """Shared memory a config takes: an A and a B tile per pipeline stage, and for the TMA kernel the C
    tile its descriptor store goes through (sm_90, ``tools``-style offline compiles of the TMA kernel:
    128 x 128 x 64 bf16 at 4 stages takes 4 x 32 KB + 32 KB)."""
    loads = (cfg.block_m + cfg.block_n) * cfg.block_k * in_dtype.itemsize * cfg.num_stages
    return loads + (cfg.block_m * cfg.block_n * out_itemsize if cfg.tma else 0)


def config_valid(cfg: GemmConfig, in_dtype: torch.dtype, arch: flydsl.arch.Arch, out_itemsize: int = 4) -> bool:
    """The one validity predicate of the space (heuristic, tuner, tests): power-of-two tiles of at least
    16 (the dot's minimum), a warp count Triton takes, shared memory within the arch's (for an output of
    ``out_itemsize`` bytes an element; 4, the default, bounds every output dtype)."""
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(t < _DOT_MIN or t & (t - 1) for t in tiles) or cfg.group_m < 1:
        return False
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1 or cfg.split_k < 1:
        return False
    if cfg.tma and cfg.split_k > 1:  # the TMA kernel has no split-K
        return False
    return smem_bytes(cfg, in_dtype, out_itemsize) <= arch.smem_per_block


def _split_k(tiles: int, k_steps: int, arch: flydsl.arch.Arch) -> int:
    """Splits of K that give about two programs an SM, each split keeping at least 4 K steps (so the
    pipeline fills and the partial sums stay small against the weights read)."""
    split = 1
    while tiles * split < 2 * arch.sm_count and k_steps // (2 * split) >= 4:
        split *= 2
    return split


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
        block_k = block_k * 2 if wide else 128
        cfg = GemmConfig(block_m, 64, block_k, group_m=1, num_warps=4, num_stages=stages,
                         split_k=_split_k(flyc.cdiv(m, block_m) * flyc.cdiv(n, 64), flyc.cdiv(k, block_k), arch))
    else:
        cfg = GemmConfig(128, 128 if n > 64 else 64, block_k, group_m=8, num_warps=8, num_stages=stages,
                         tma=arch.is_hopper)  # fmt: skip
    while not config_valid(cfg, in_dtype, arch) and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg
