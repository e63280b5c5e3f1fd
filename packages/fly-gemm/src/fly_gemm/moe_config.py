"""Launch configuration of the fused MoE's grouped GEMMs: :class:`MoeConfig`, its validity predicate and
its default (a pure function of the problem's shape, dtype and arch, unit-tested on the CPU).

One config serves both stages of a call: ``block_m`` is also the alignment's block (each block of rows
belongs to one expert), so the two stages must agree on it; the column tile and K step serve the gate/up
projection (two accumulators, two weight tiles a step) and the down projection alike.

Not yet tuned on the H200: the default follows the published Hopper practice for grouped MoE GEMMs (row
tiles near the expected rows an expert, 16 at decode; 64-128-wide column tiles; K steps of 64 for 16-bit
inputs; 3-4 pipeline stages; grouped tile order so the blocks of one expert share its weight tiles in L2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import flydsl.arch
import flydsl.compiler as flyc

__all__ = ["MoeConfig", "moe_config_valid", "default_moe_config", "moe_smem_bytes"]

_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the grouped GEMMs: ``block_m`` routed rows (one expert's) x ``block_n`` output columns,
    walking K in ``block_k`` steps; ``group_m`` row blocks walked before moving right."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def moe_smem_bytes(cfg: MoeConfig, in_dtype: torch.dtype) -> int:
    """Shared memory of the heavier stage, the gated one: an A tile and two B tiles (gate, up) a stage."""
    return (cfg.block_m + 2 * cfg.block_n) * cfg.block_k * in_dtype.itemsize * cfg.num_stages


@functools.lru_cache(maxsize=1024)  # pure: the general path of every call asks it
def moe_config_valid(cfg: MoeConfig, in_dtype: torch.dtype, arch: flydsl.arch.Arch) -> bool:
    """The one validity predicate (default, tests, a future tuner): power-of-two tiles of at least 16 (the
    dot's minimum), a warp count Triton takes, at least one stage, shared memory within the arch's."""
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(t < _DOT_MIN or t & (t - 1) for t in tiles) or cfg.group_m < 1:
        return False
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        return False
    return moe_smem_bytes(cfg, in_dtype) <= arch.smem_per_block


@functools.lru_cache(maxsize=1024)  # pure: the general path of every call asks it
def default_moe_config(
    tokens: int, num_experts: int, n: int, k: int, topk: int, in_dtype: torch.dtype, arch: flydsl.arch.Arch
) -> MoeConfig:
    """The default config of a fused MoE call: ``tokens`` x ``topk`` routed rows over ``num_experts``
    experts, the gate/up projection's ``n`` = intermediate columns and ``k`` = hidden (pure: arguments only)."""
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        return MoeConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=1)
    rows_per_expert = tokens * topk / max(1, num_experts)
    # a row tile near the rows an expert gets, so that blocks carry little padding (decode: 16)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64 if rows_per_expert <= 96 else 128
    block_n = 64 if block_m <= 32 else 128
    block_k = 64 if in_dtype.itemsize == 2 else 128
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    cfg = MoeConfig(block_m, block_n, block_k, group_m=8 if block_m >= 64 else 1, num_warps=warps,
                    num_stages=4 if arch.backend == "cuda" else 2)  # fmt: skip
    while not moe_config_valid(cfg, in_dtype, arch) and cfg.num_stages > 1:
        cfg = MoeConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages - 1)
    if not moe_config_valid(cfg, in_dtype, arch):  # a small shared memory: narrower columns
        cfg = MoeConfig(cfg.block_m, max(_DOT_MIN, flyc.next_power_of_2(cfg.block_n // 2)), cfg.block_k,
                        cfg.group_m, cfg.num_warps, 1)  # fmt: skip
    return cfg
