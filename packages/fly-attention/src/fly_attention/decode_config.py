"""Launch configurations of the paged decode: :class:`DecodeConfig`, its pure default
(:func:`default_decode_config`), its validity predicate (:func:`decode_config_valid`) and the split-KV
count (:func:`decode_splits`), all pure functions of shapes, dtypes and an :class:`flydsl.arch.Arch`.

The decode is bound by reading the KV cache: the work a program does per key is a row of K and a row of
V, so the knobs are how many keys a program has in flight (``block_n`` x ``num_stages``) and how many
programs the grid has (batch x KV heads x query-row blocks x splits). The paged head-dim-128 tiles come
from the H200's timings; the rest keep the published practice of Triton decode kernels on Hopper (16 KB of
K and of V a step, 4 warps, 3 stages); split-KV aims at about two programs an SM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import flydsl.arch
import flydsl.compiler as flyc

__all__ = ["DecodeConfig", "default_decode_config", "decode_config_valid", "decode_splits", "decode_block_m",
           "MAX_SPLITS", "MIN_KEYS_PER_SPLIT"]  # fmt: skip

_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16
_MAX_BLOCK_M = 64  # query rows (GQA group x new tokens) a program holds; larger groups take several programs
_ACC_PER_THREAD = 128  # fp32 accumulator + score elements a thread may hold: decode keeps registers for loads
MAX_SPLITS = 64  # the merge kernel reads every split of a row at once; 64 covers 1 sequence x 1 KV head
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (its Q load, its partial's write) dominates
_WAVES = 2  # programs aimed at: two an SM, so one program's loads run while another's softmax does
# the smallest split count within this fraction of the best. Flash-attention 3 takes 85%; on the H200 (GQA
# 32/8, 16-token pages) that left the last wave part-filled: 29 splits at batch 1 (232 programs), 14 at batch
# 2, 7 at batch 4, where 32 / 16 / 8 (256 programs) ran 5-11% faster at 16K-128K keys.
_WAVE_EFFICIENCY = 0.95


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the decode kernel: the keys a loop step reads (``block_n``), warps and the
    pipeline depth of the key loop. The query rows of a program follow from the GQA group and the number
    of new tokens (:func:`decode_block_m`)."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def decode_block_m(rows: int) -> int:
    """Query rows of a program for ``rows = group * q_len`` rows a KV head: the next power of two, at
    least 16 (the dot's minimum), at most 64 (more rows take more programs on the same KV head)."""
    return min(_MAX_BLOCK_M, max(_DOT_MIN, flyc.next_power_of_2(max(rows, 1))))


def decode_config_valid(cfg: DecodeConfig, head_dim: int, rows: int, kv_dtype: torch.dtype,
                        arch: flydsl.arch.Arch) -> bool:  # fmt: skip
    """The one validity predicate: a power-of-two ``block_n`` of at least 16, a warp count Triton takes, at
    least one stage, K and V tiles of every stage within the arch's shared memory, and on a GPU the fp32
    output and score tiles within a thread's registers."""
    if not isinstance(cfg, DecodeConfig):
        return False
    b = cfg.block_n
    if b < _DOT_MIN or b & (b - 1) or cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        return False
    if head_dim < 1 or rows < 1:
        return False
    d = flyc.next_power_of_2(head_dim)
    block_m = decode_block_m(rows)
    # K and V per stage in the cache's dtype, plus their conversion to the query's (fp8: 2 bytes)
    smem = cfg.num_stages * 2 * b * d * kv_dtype.itemsize + block_m * d * 2
    if smem > arch.smem_per_block:
        return False
    if arch.is_interpreter:
        return True
    return block_m * (d + b) // (32 * cfg.num_warps) <= _ACC_PER_THREAD


def default_decode_config(head_dim: int, rows: int, kv_dtype: torch.dtype, arch: flydsl.arch.Arch, *,
                          paged: bool = False, programs: int | None = None) -> DecodeConfig:  # fmt: skip
    """The default config (pure: head dim, rows a KV head, the cache's dtype, arch; whether the cache is
    paged, and ``programs``, the grid before split-KV: batch x KV heads x query-row blocks, None if unknown).
    """
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    d = flyc.next_power_of_2(head_dim)
    # 16 KB of K and of V a step (64 keys at head dim 128), 4 warps, 3 stages: the published Triton tile
    cfg = DecodeConfig(block_n=max(_DOT_MIN, min(128, 8192 // d)), num_warps=4, num_stages=3)
    if d == 128 and paged:
        # The H200 (PERF.md; GQA 32/8, 16-token pages): 128 keys a step amortize the page walk. fp8 caches
        # with 4 warps: 0.99-1.16x (1.1x typical) at every batch. 16-bit ones with 8 warps and 2 stages (147 KB
        # of shared memory, one program an SM): 1.04-1.27x while the grid before splitting is under one program an SM
        # (batch 1-16), 0.80-0.97x at batch 64-256, where two 64-key programs an SM hide each other's loads.
        # The dense walk has no pages to amortize: 128 keys cost it 2-10% at every batch.
        if kv_dtype.itemsize == 1:
            cfg = DecodeConfig(128, 4, 3)
        elif programs is not None and programs < arch.sm_count:
            cfg = DecodeConfig(128, 8, 2)
    while not decode_config_valid(cfg, head_dim, rows, kv_dtype, arch) and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    while not decode_config_valid(cfg, head_dim, rows, kv_dtype, arch) and cfg.block_n > _DOT_MIN:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    if not decode_config_valid(cfg, head_dim, rows, kv_dtype, arch):  # 64 rows at head dim 256: more threads
        cfg = dataclasses.replace(cfg, num_warps=8)
    return cfg


def decode_splits(batch: int, heads_kv: int, max_seq_len: int, sm_count: int, *, row_blocks: int = 1,
                  block_n: int = 64) -> int:  # fmt: skip
    """The split-KV count: how many programs share one (sequence, KV head)'s keys.

    ``max_seq_len`` is the cache's capacity a sequence (block table width x block size, or the dense
    cache's length): a shape, so the choice needs no host sync and holds under CUDA graph capture.
    The grid without splits has ``batch * heads_kv * row_blocks`` programs; when that fills two programs
    an SM there is no split. Otherwise the candidates run from 1 to the count that reaches two an SM, each
    split keeping at least :data:`MIN_KEYS_PER_SPLIT` keys (and a whole ``block_n`` step), at most
    :data:`MAX_SPLITS`; the smallest candidate whose wave efficiency (programs over the waves they occupy)
    is within 85% of the best one's wins (fewer splits: less merge work and fewer partial writes).
    """
    if batch < 1 or heads_kv < 1 or max_seq_len < 1 or sm_count < 1 or row_blocks < 1:
        return 1
    base = batch * heads_kv * row_blocks
    slots = _WAVES * sm_count
    if base >= slots:
        return 1
    keys_per_split = max(MIN_KEYS_PER_SPLIT, block_n)
    most = min(MAX_SPLITS, max(1, max_seq_len // keys_per_split), -(-slots // base))
    if most <= 1:
        return 1

    def efficiency(s: int) -> float:
        programs = base * s
        waves = -(-programs // slots)
        return programs / (waves * slots)

    best = max(efficiency(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if efficiency(s) >= _WAVE_EFFICIENCY * best)
