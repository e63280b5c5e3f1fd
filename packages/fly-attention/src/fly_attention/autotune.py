"""Launch configurations of the flash attention forward: :class:`AttnConfig`, its pure default
(:func:`default_config`) and its validity predicate (:func:`config_valid`); the backward's the same way:
:class:`AttnBwdConfig`, :func:`default_bwd_config`, :func:`bwd_config_valid`.

The 16-bit defaults come from a config grid timed on the H200 (the comments in :func:`_default_16bit`
and :func:`default_bwd_config` give the figures); the fp8 ones and the backward above head dim 128 from
sm_90 compiles only. A tuning adopter with shipped artifacts is to replace them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import flydsl.arch
import flydsl.compiler as flyc

__all__ = [
    "AttnConfig", "default_config", "config_valid", "smem_bytes", "tma_candidates", "AttnBwdConfig",
    "default_bwd_config", "bwd_config_valid", "bwd_smem_bytes",
]  # fmt: skip

_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16
# fp32 accumulator elements a thread may hold (output tile + score tile) before the registers spill: the
# register file is 255 a thread, and Q's fragment and the pointers need the rest.
_ACC_PER_THREAD = 192
_TMA_DTYPES = (torch.float16, torch.bfloat16)
_TMA_ELEMS = 8  # 16 bytes of a 16-bit dtype: TMA's unit of a row


@dataclass(frozen=True)
class AttnConfig:
    """Launch configuration of the forward: the query rows of a program, the key step, warps and stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2  # software-pipeline depth of the key loop (K and V tiles in shared memory)
    # The 16-bit TMA kernel (_kernels/flash_fwd_tma.py; sm_90+): Q, K and V tiles through tensor descriptors.
    # Tensors TMA cannot address (a base or a stride not a multiple of 16 bytes) run the pointer kernel with
    # the same tiles. Its option: store the output through a descriptor too (an output tile of shared memory).
    # (Triton 3.6's automatic warp specialisation of the key loop was tried: every such config gave NaN on
    # the H200, so it is not offered.)
    tma: bool = False
    tma_store: bool = False


# Shared memory of the TMA kernel past its tiles, from sm_90 compiles (tests/attn_tma_compile_sm90.py checks
# that smem_bytes bounds every candidate's): 1 KB of barriers and alignment.
_TMA_SMEM_SLACK = 1024


def smem_bytes(cfg: AttnConfig, head_dim: int, head_dim_v: int, dtype: torch.dtype) -> int:
    """Shared memory a config takes: the Q tile once, a K and a V tile per pipeline stage (padded dims); for
    the TMA kernel its barriers, with ``tma_store`` the output tile its descriptor store goes through (after
    the key loop, in the loop's freed buffers when it fits there, as sm_90 compiles place it)."""
    d, dv = flyc.next_power_of_2(head_dim), flyc.next_power_of_2(head_dim_v)
    tiles = cfg.block_m * d + cfg.num_stages * cfg.block_n * (d + dv)
    if cfg.tma_store:
        tiles = max(tiles, cfg.block_m * dv)
    return tiles * dtype.itemsize + (_TMA_SMEM_SLACK if cfg.tma else 0)


def _tma_valid(cfg: AttnConfig, head_dim: int, head_dim_v: int, dtype: torch.dtype, arch: flydsl.arch.Arch) -> bool:
    """The TMA kernel's own conditions: its option only with ``tma``; 16-bit inputs; head dims that are
    multiples of 8 elements (rows of whole 16-byte units: TMA's strides, and no descriptor store spilling into
    the next head); a GPU with TMA (sm_90+) or the interpreter."""
    if not cfg.tma:
        return not cfg.tma_store
    if dtype not in _TMA_DTYPES or head_dim % _TMA_ELEMS or head_dim_v % _TMA_ELEMS:
        return False
    if arch.is_interpreter:
        return True
    return arch.backend == "cuda" and (arch.capability or (0,)) >= (9, 0)


def _launchable(blocks: tuple, num_warps: int, num_stages: int, head_dim: int, head_dim_v: int) -> bool:
    """What both directions' configs need: power-of-two blocks of at least 16 (the dot's minimum), a warp
    count Triton takes, at least one stage, head dims of at least one."""
    return (all(b >= _DOT_MIN and not b & (b - 1) for b in blocks) and num_warps in (1, 2, 4, 8, 16)
            and num_stages >= 1 and head_dim >= 1 and head_dim_v >= 1)  # fmt: skip


def config_valid(cfg: AttnConfig, head_dim: int, head_dim_v: int, dtype: torch.dtype, arch: flydsl.arch.Arch) -> bool:
    """The one validity predicate: power-of-two blocks of at least 16 (the dot's minimum), a warp count
    Triton takes, at least one stage, the TMA kernel's conditions (16-bit, head dims multiples of 8, sm_90+;
    its options only with ``tma``), shared memory within the arch's, and on a GPU the fp32 output and score
    tiles within a thread's registers."""
    if not _launchable((cfg.block_m, cfg.block_n), cfg.num_warps, cfg.num_stages, head_dim, head_dim_v):
        return False
    if not _tma_valid(cfg, head_dim, head_dim_v, dtype, arch):
        return False
    if smem_bytes(cfg, head_dim, head_dim_v, dtype) > arch.smem_per_block:
        return False
    if arch.is_interpreter:
        return True
    threads = 32 * cfg.num_warps
    dv = flyc.next_power_of_2(head_dim_v)
    if dtype == torch.float8_e4m3fn:
        # fp8: P @ V is a second fp8 dot that reduces over the key block (at least 32 on sm_90's fp8
        # wgmma), and its block product is held beside the accumulator before the fp32 add
        return cfg.block_n >= 32 and cfg.block_m * (2 * dv + cfg.block_n) // threads <= _ACC_PER_THREAD
    per_thread = cfg.block_m * (dv + cfg.block_n) // threads
    return per_thread <= _ACC_PER_THREAD


def default_config(
    head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int, causal: bool, dtype: torch.dtype,
    arch: flydsl.arch.Arch,
) -> AttnConfig:  # fmt: skip
    """The default launch config (pure: shapes, dtype and arch only)."""
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        return AttnConfig(16 if seqlen_q <= 16 else 32, 16 if seqlen_k <= 16 else 32, num_warps=4, num_stages=1)
    d = max(head_dim, head_dim_v)
    if dtype == torch.float8_e4m3fn:
        cfg = _default_fp8(d)
    else:
        cfg = _default_16bit(d)
    if seqlen_q <= 64:  # decode-like queries: no program of mostly padded rows (the pointer kernel: the TMA
        # kernel's small-row tiles were never run on a GPU)
        cfg = AttnConfig(max(_DOT_MIN, flyc.next_power_of_2(max(seqlen_q, 1))), cfg.block_n, cfg.num_warps,
                         min(cfg.num_stages, 3))  # fmt: skip
    if cfg.tma and not _tma_valid(cfg, head_dim, head_dim_v, dtype, arch):  # no TMA here, or not for these dims
        cfg = dataclasses.replace(cfg, tma=False)
    # seqlen_k and causal take no part yet: nothing has been measured that would choose by them
    while not config_valid(cfg, head_dim, head_dim_v, dtype, arch) and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    while not config_valid(cfg, head_dim, head_dim_v, dtype, arch) and cfg.block_n > _DOT_MIN:
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    return cfg


def _default_16bit(d: int) -> AttnConfig:
    # Measured on the H200 (bf16, 16K tokens, seqlen 4096, causal and not; a grid of 64 / 128 query rows,
    # 32-128 keys, 4 / 8 warps, 2-4 stages): 128 x 64 with 8 warps led the pointer kernel at every head dim:
    # d 64 423 / 364 TFLOP/s (3 stages), d 128 463 / 406 (3 stages), d 256 451 / 394 (2 stages).
    # The TMA kernel at the same tiles, timed against it in one run (B 4, S 4096, 16 heads; non-causal /
    # causal): d 64 even (423 / 349 with 4 stages against 418 / 348), d 128 500 / 418 with 4 stages against
    # 455 / 402 (128 x 128 with 3 stages: 516 / 434, but its pointer twin, which serves layouts TMA cannot
    # address, was never measured), d 256 501 / 456 with 2 stages against 449 / 417. cuDNN in that run:
    # 475 / 411, 611 / 530, 667 / 593.
    if d <= 64:
        return AttnConfig(128, 64, num_warps=8, num_stages=3)
    if d <= 128:
        return AttnConfig(128, 64, num_warps=8, num_stages=4, tma=True)
    return AttnConfig(128, 64, num_warps=8, num_stages=2, tma=True)


def _default_fp8(d: int) -> AttnConfig:
    # fp8 tiles take half the bytes, so the key step doubles at d 128. sm_90 compiles of the fp8 kernel
    # (tests/attn_fp8_compile_sm90.py, every option off and on) use 221-237 registers at d 64 with
    # 128 x 128 / 8 warps / 3 stages, 253-255 at d 128 with the same (no spill, 112 KB of shared memory),
    # and at d 256 250-254 with 64 x 64 / 8 warps, where 128 x 64 spills 232 bytes. None of this is a
    # timing: the H200 search replaces it.
    if d <= 128:
        return AttnConfig(128, 128, num_warps=8, num_stages=3)
    return AttnConfig(64, 64, num_warps=8, num_stages=2)


def tma_candidates(head_dim: int, dtype: torch.dtype, arch: flydsl.arch.Arch) -> list[AttnConfig]:
    """The TMA configs worth timing against the default (head_dim_v = head_dim): 128 x 64 and 128 x 128
    tiles, 2-4 stages, 8 warps, and the 128 x 64 ones with the output stored through a descriptor; those
    :func:`config_valid` takes (shared memory bounds the stages at large head dims; none for fp8, head dims
    not multiples of 8, or a GPU without TMA). The default stays the pointer kernel until one of them wins
    on the H200."""
    out = []
    for block_n in (64, 128):
        for stages in (2, 3, 4):
            plain = AttnConfig(128, block_n, num_warps=8, num_stages=stages, tma=True)
            out.append(plain)
            if block_n == 64:
                out.append(dataclasses.replace(plain, tma_store=True))
    return [c for c in out if config_valid(c, head_dim, head_dim, dtype, arch)]


# ------------------------------------------------------------------ backward


@dataclass(frozen=True)
class AttnBwdConfig:
    """Launch configuration of the backward. The dK / dV kernel holds ``dkdv_block_n`` keys a program and
    steps the queries ``dkdv_block_m`` at a time; the dQ kernel (and the delta pass) holds ``dq_block_m``
    query rows and steps the keys ``dq_block_n`` at a time."""

    dkdv_block_m: int
    dkdv_block_n: int
    dq_block_m: int
    dq_block_n: int
    num_warps: int = 4
    num_stages: int = 2


def bwd_smem_bytes(cfg: AttnBwdConfig, head_dim: int, head_dim_v: int, dtype: torch.dtype) -> int:
    """Shared memory of the larger of the two kernels: the held tiles once, the streamed ones per stage."""
    d, dv = flyc.next_power_of_2(head_dim), flyc.next_power_of_2(head_dim_v)
    dkdv = (cfg.dkdv_block_n * (d + dv) + cfg.num_stages * cfg.dkdv_block_m * (d + dv)) * dtype.itemsize
    dq = (cfg.dq_block_m * (d + dv) + cfg.num_stages * cfg.dq_block_n * (d + dv)) * dtype.itemsize
    return max(dkdv, dq)


def bwd_config_valid(
    cfg: AttnBwdConfig, head_dim: int, head_dim_v: int, dtype: torch.dtype, arch: flydsl.arch.Arch
) -> bool:
    """The backward's validity predicate: power-of-two blocks of at least 16, a warp count Triton takes, at
    least one stage, shared memory within the arch's, and on a GPU each kernel's fp32 accumulators and score
    tiles within a thread's registers (dK + dV + two score tiles; dQ + two score tiles)."""
    blocks = (cfg.dkdv_block_m, cfg.dkdv_block_n, cfg.dq_block_m, cfg.dq_block_n)
    if not _launchable(blocks, cfg.num_warps, cfg.num_stages, head_dim, head_dim_v):
        return False
    if bwd_smem_bytes(cfg, head_dim, head_dim_v, dtype) > arch.smem_per_block:
        return False
    if arch.is_interpreter:
        return True
    threads = 32 * cfg.num_warps
    d, dv = flyc.next_power_of_2(head_dim), flyc.next_power_of_2(head_dim_v)
    dkdv = cfg.dkdv_block_n * (d + dv + 2 * cfg.dkdv_block_m) // threads
    dq = cfg.dq_block_m * (d + 2 * cfg.dq_block_n) // threads
    return max(dkdv, dq) <= _ACC_PER_THREAD


def default_bwd_config(
    head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int, causal: bool, dtype: torch.dtype,
    arch: flydsl.arch.Arch,
) -> AttnBwdConfig:  # fmt: skip
    """The backward's default launch config (pure: shapes, dtype and arch only), shrunk until
    :func:`bwd_config_valid` takes it."""
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        return AttnBwdConfig(16, 16 if seqlen_k <= 16 else 32, 16 if seqlen_q <= 16 else 32, 16, num_warps=4,
                             num_stages=1)  # fmt: skip
    d = max(head_dim, head_dim_v)
    # Measured on the H200 at d 128 (bf16, seqlen 4096, 16K tokens; ten configs): 64 keys a dK / dV
    # program stepping 32 queries, 64 rows a dQ program stepping 32 keys, 4 warps, 2 stages ran 300 / 282
    # TFLOP/s (non-causal / causal), level with the best of the others (128 keys stepping 64 queries, 8
    # warps, 3 stages: 301 / 264) and 3x the 8-warp tiles of 32 keys (95 / 92). d 64 takes the same (not
    # measured apart). At d 256 (same sizes; eleven configs): 32 x 32 tiles in both kernels, 4 warps, 2
    # stages ran 120 / 119 TFLOP/s, second to 64 x 64 tiles with 8 warps and 1 stage (132 / 123), whose dQ
    # kernel spills 360-544 bytes in sm_90 compiles where this one's spills none; the 16 x 32 tiles of 8 warps
    # this replaced ran 56 / 54 (cuDNN: 384 / 361).
    if d <= 128:
        cfg = AttnBwdConfig(32, 64, 64, 32, num_warps=4, num_stages=2)
    else:
        cfg = AttnBwdConfig(32, 32, 32, 32, num_warps=4, num_stages=2)
    # seqlen and causal take no part yet: nothing has been measured that would choose by them
    while not bwd_config_valid(cfg, head_dim, head_dim_v, dtype, arch) and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    while not bwd_config_valid(cfg, head_dim, head_dim_v, dtype, arch) and cfg.dkdv_block_n > _DOT_MIN:
        cfg = dataclasses.replace(
            cfg, dkdv_block_n=cfg.dkdv_block_n // 2, dq_block_m=max(_DOT_MIN, cfg.dq_block_m // 2)
        )
    return cfg
