"""Launch configurations of the flash attention forward: :class:`AttnConfig`, its pure default
(:func:`default_config`) and its validity predicate (:func:`config_valid`); the backward's the same way:
:class:`AttnBwdConfig`, :func:`default_bwd_config`, :func:`bwd_config_valid`; and the tuning adopter of both
(:data:`FWD_TUNABLE`, :data:`BWD_TUNABLE`, :func:`tuning_key`, :func:`candidates`, :func:`bwd_candidates`,
:func:`config_for`, :func:`bwd_config_for`).

The 16-bit defaults come from a config grid timed on the H200 (the comments in :func:`_default_16bit`
and :func:`default_bwd_config` give the figures); the fp8 ones and the backward above head dim 128 from
sm_90 compiles only. They serve every shape no search or artifact covers.

A launch is served (:func:`config_for`, :func:`bwd_config_for`) the searched winner of its tuning key (on this
machine, under the cache root), the shipped artifact's (``fly_attention/artifacts/flash_fwd.json`` and
``flash_bwd.json``, written by ``flydsl tune attention`` on the GPU) or its default. The key holds what decides
the tile: the head dims, causal, the dtype and the two sequence lengths' buckets (see :func:`tuning_key`);
batch and heads are not in it (they only multiply the grid of a long sequence).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl import env
from flydsl.autotune import SearchTask, Tunable
from flydsl.checks import dtype_name, parse_dtype
from flydsl.testing import tolerance

__all__ = [
    "AttnConfig", "default_config", "config_valid", "smem_bytes", "tma_candidates", "AttnBwdConfig",
    "default_bwd_config", "bwd_config_valid", "bwd_smem_bytes",
    "FWD_TUNABLE", "BWD_TUNABLE", "SEQLEN_CAP", "tuning_key", "key_args", "candidates", "bwd_candidates",
    "config_for", "bwd_config_for", "clear_memo",
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
    return arch.has_tma


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


# ------------------------------------------------------------------ tuning adopter
#
# Key: {"head_dim", "head_dim_v", "causal", "dtype", "seqlen_q", "seqlen_k"} and the arch, one key space a
# direction (the backward's dtypes are the 16-bit ones). The head dims are exact: they decide the tiles'
# registers and shared memory and whether the TMA kernel can run (rows of whole 16-byte units), and a model
# has one or two of them. The sequence lengths are bucketed to the next power of two (as the default always
# took them), capped at SEQLEN_CAP. Batch and heads stay out: they multiply the grid, and at the tuned lengths
# the grid is many waves of the SMs whatever they are. GQA stays out too: the kernels walk a query head's KV
# head the same way whatever the ratio.

# The top of the tuned lengths (fly_attention.bench's 16K): longer sequences take its answer, their programs
# walking more key blocks with the same tiles.
SEQLEN_CAP = 1 << 14
_FWD_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
_BWD_DTYPES = (torch.float16, torch.bfloat16)
_KEY_FIELDS = ("head_dim", "head_dim_v", "causal", "dtype", "seqlen_q", "seqlen_k")


def _bucket(seqlen: int) -> int:
    return min(flyc.next_power_of_2(max(int(seqlen), 1)), SEQLEN_CAP)


def tuning_key(head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int, causal: bool,
               dtype: torch.dtype) -> dict:  # fmt: skip
    """The tuning key of a flash attention launch (either direction): the head dims and causal as given, the
    dtype's short name ("bf16", "fp16", "fp8_e4m3"), each sequence length to the next power of two, at most
    :data:`SEQLEN_CAP` (a varlen call's: its max_seqlen)."""
    return {"head_dim": int(head_dim), "head_dim_v": int(head_dim_v), "causal": bool(causal),
            "dtype": dtype_name(dtype), "seqlen_q": _bucket(seqlen_q), "seqlen_k": _bucket(seqlen_k)}  # fmt: skip


def key_args(key) -> tuple[int, int, int, int, bool, torch.dtype]:
    """(head_dim, head_dim_v, seqlen_q, seqlen_k, causal, dtype) of a key: its representative launch, whose
    default, validity and candidates are the key's. Raises ValueError on a malformed key."""
    missing = [f for f in _KEY_FIELDS if f not in key]
    if missing:
        raise ValueError(f"key: expected the fields {_KEY_FIELDS}, missing {missing} in {dict(key)!r}")
    dims = [key[f] for f in ("head_dim", "head_dim_v", "seqlen_q", "seqlen_k")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in dims):
        raise ValueError(f"key: head dims and sequence lengths must be ints >= 1, got {dict(key)!r}")
    if not isinstance(key["causal"], bool):
        raise ValueError(f"key: causal must be a bool, got {key['causal']!r}")
    try:
        dtype = parse_dtype("dtype", key["dtype"], _FWD_DTYPES)
    except TypeError as exc:
        raise ValueError(f"key: {exc}") from None
    d, dv, sq, sk = dims
    return d, dv, sq, sk, key["causal"], dtype


def _fwd_default(key, arch: str) -> AttnConfig:
    d, dv, sq, sk, causal, dtype = key_args(key)
    return default_config(d, dv, sq, sk, causal, dtype, flydsl.arch.from_name(arch))


def _fwd_valid(cfg: AttnConfig, key, arch: str) -> bool:
    d, dv, _, _, _, dtype = key_args(key)
    return config_valid(cfg, d, dv, dtype, flydsl.arch.from_name(arch))


def _bwd_key_args(key) -> tuple[int, int, int, int, bool, torch.dtype]:
    d, dv, sq, sk, causal, dtype = key_args(key)
    if dtype not in _BWD_DTYPES:
        raise ValueError(f"key: the backward's dtype is fp16 or bf16, got {key['dtype']!r}")
    return d, dv, sq, sk, causal, dtype


def _bwd_default(key, arch: str) -> AttnBwdConfig:
    d, dv, sq, sk, causal, dtype = _bwd_key_args(key)
    return default_bwd_config(d, dv, sq, sk, causal, dtype, flydsl.arch.from_name(arch))


def _bwd_valid(cfg: AttnBwdConfig, key, arch: str) -> bool:
    d, dv, _, _, _, dtype = _bwd_key_args(key)
    return bwd_config_valid(cfg, d, dv, dtype, flydsl.arch.from_name(arch))


# A key's search times at most this many configs, the default included: every config compiles once for each
# (head dims, causal, dtype), and the tuned set's ~55 keys are to be searched in minutes on one GPU.
_MAX_CANDIDATES = 16
_ROW_TILES = (128, 64)
_KEY_STEPS = (64, 128, 32)  # in order of promise: 64 led every head dim of the H200 grid, 128 next


def candidates(key, arch: str) -> list[AttnConfig]:
    """The forward's bounded space of a key (pure; at most 16 configs with the default, each valid for the
    key on ``arch``), most promising first, cut there: the default; for 16-bit inputs with more than 64
    queries, the TMA configs (:func:`tma_candidates`: 128 x 64 / 128 x 128 at 2-4 stages, the descriptor
    store); then the pointer kernel's grid, 128 or 64 query rows (8 and 4 warps; 8 where 4 cannot hold the
    tiles) x 64, 128 or 32 keys x 3 or 2 stages. Decode-like queries (at most 64) take one row tile, theirs.
    The interpreter: the default, a 16 x 16 tile and the default's TMA form where the dims allow it."""
    d, dv, sq, sk, causal, dtype = key_args(key)
    a = flydsl.arch.from_name(arch)
    default = default_config(d, dv, sq, sk, causal, dtype, a)
    if a.is_interpreter:  # the interpreter executes every element of a tile: a few small configs
        out = [default, AttnConfig(16, 16, num_warps=4, num_stages=1), dataclasses.replace(default, tma=True)]
    else:
        rows = sorted({min(bm, max(_DOT_MIN, flyc.next_power_of_2(sq))) for bm in _ROW_TILES}, reverse=True)
        out = [default]
        if rows[0] >= 128:  # the TMA kernel's tiles are 128 rows (its small-row tiles were never run)
            out += [c for c in tma_candidates(d, dtype, a) if config_valid(c, d, dv, dtype, a)]
        for bn, bm, stages in itertools.product(_KEY_STEPS, rows, (3, 2)):
            # 8 warps for 128 rows, 4 for fewer unless their registers need 8 (fp8 at d 256)
            tiles = [AttnConfig(bm, bn, num_warps=w, num_stages=stages) for w in ((8,) if bm >= 128 else (4, 8))]
            out.append(next((c for c in tiles if config_valid(c, d, dv, dtype, a)), tiles[0]))
    return [c for c in dict.fromkeys(out) if config_valid(c, d, dv, dtype, a)][:_MAX_CANDIDATES]


# The backward's tiles as (queries a dK / dV step, keys a dK / dV program) with warps, in order of promise;
# the dQ kernel takes the same pair mirrored (keys-a-program rows, stepping queries-a-step keys), as the
# defaults do. From the H200 grid at d 128: 32 x 64 with 4 warps (the default) and 64 x 128 with 8 led; the
# 64 x 64 tiles of 8 warps were the best at d 256 (they spill there in sm_90 compiles); the rest fills in.
_BWD_TILES = (((32, 64), 4), ((64, 128), 8), ((64, 64), 4), ((64, 64), 8), ((32, 128), 8), ((32, 32), 4),
              ((32, 32), 8), ((16, 64), 4), ((16, 32), 4))  # fmt: skip


def bwd_candidates(key, arch: str) -> list[AttnBwdConfig]:
    """The backward's bounded space of a key (pure; at most 16 configs with the default, each valid for the
    key on ``arch``): the default, then :data:`_BWD_TILES` at 2 and 3 stages, most promising first, cut
    there. The interpreter: the default and 16 x 16 tiles."""
    d, dv, sq, sk, causal, dtype = _bwd_key_args(key)
    a = flydsl.arch.from_name(arch)
    default = default_bwd_config(d, dv, sq, sk, causal, dtype, a)
    if a.is_interpreter:
        out = [default, AttnBwdConfig(16, 16, 16, 16, num_warps=4, num_stages=1)]
    else:
        out = [default]
        for (step, held), warps in _BWD_TILES:
            out += [AttnBwdConfig(step, held, held, step, num_warps=warps, num_stages=s) for s in (2, 3)]
    return [c for c in dict.fromkeys(out) if bwd_config_valid(c, d, dv, dtype, a)][:_MAX_CANDIDATES]


def _bench_keys(bwd: bool) -> list[dict]:
    """The keys of fly_attention.bench's tuned cases: the forward's bf16 head dims 64 / 128 / 256, causal
    and not, at 1K-16K; the fp8 forward's (d 128); the varlen bench's longest sequences (d 128); the
    backward's d 128 at 1K-16K and d 64 / 256 at 4K. Deduplicated, in the bench's order."""
    from . import bench  # here: bench imports attention, which imports this module

    def key(d, sq, sk, causal, dtype):
        return tuning_key(d, d, sq, sk, causal, dtype)

    if bwd:
        found = [key(c.params["D"], c.params["Sq"], c.params["Sk"], c.params["causal"], torch.bfloat16)
                 for c in bench._bwd_cases()]  # fmt: skip
    else:
        found = [key(c.params["D"], c.params["Sq"], c.params["Sk"], c.params["causal"], torch.bfloat16)
                 for c in bench._tuned_cases()]  # fmt: skip
        found += [key(c.params["D"], max(c.params["lens"]), max(c.params["lens"]), c.params["causal"],
                      torch.bfloat16) for c in bench._varlen_cases()]  # fmt: skip
        found += [key(c.params["D"], c.params["Sq"], c.params["Sk"], c.params["causal"], bench._FP8)
                  for c in bench._fp8_cases()]  # fmt: skip
    return list({tuple(sorted(k.items())): k for k in found}.values())


def _fwd_tune_keys(arch: str) -> list[dict]:
    return _bench_keys(bwd=False)


def _bwd_tune_keys(arch: str) -> list[dict]:
    return _bench_keys(bwd=True)


def _task_shape(key, device) -> tuple[int, int]:
    """(batch, heads) of a key's search problem: on a GPU the bench's budget (batch x longest sequence =
    16K tokens, heads x head_dim = 2048), so a tuned key is timed on its bench case; on the CPU (the
    interpreter, tests) one sequence of two heads."""
    from .bench import _HIDDEN, _TOKENS

    d, _, sq, sk, _, _ = key_args(key)
    if torch.device(device).type == "cpu":
        return 1, 2
    return max(1, _TOKENS // max(sq, sk)), max(1, _HIDDEN // d)


def _random_qkv(key, device, gen):
    """fp32 q ``[B, Sq, H, D]``, k ``[B, Sk, H, D]``, v ``[B, Sk, H, Dv]`` of unit normals (MHA: the bench's)."""
    d, dv, sq, sk, _, _ = key_args(key)
    b, h = _task_shape(key, device)
    return tuple(torch.randn(b, s, h, e, generator=gen, device=device) for s, e in ((sq, d), (sk, d), (sk, dv)))


def _fwd_task(key, device) -> SearchTask:
    """The forward's search task of a key: the key's representative problem (:func:`_task_shape`, the key's
    bucketed lengths, seeded unit-normal inputs; fp8: quantized per tensor as the fp8 bench does), run through
    the host path of a public call with the candidate as its config (checks, allocation, the TMA or pointer
    kernel), checked against the fp32 reference on the same inputs (fp8: the dequantized ones) within the
    tests' tolerance of the output dtype (fp8: the fp8 tests' 2^-4 for P's rounding). The inputs are
    ~64 MB each on a GPU, past L2, and the kernel is compute bound: no rotation of copies."""
    from . import attention, bench, reference

    d, dv, sq, sk, causal, dtype = key_args(key)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = _random_qkv(key, device, gen)
    left, right = attention._options(causal, None, (-1, -1), 0.0)
    if dtype == torch.float8_e4m3fn:
        (q8, qs), (k8, ks), (v8, vs) = (bench.quantize_fp8(x * m) for x, m in zip((q, k, v), bench._FP8_MAGNITUDES,
                                                                                  strict=True))  # fmt: skip

        def run(cfg):
            return attention._flash_attn_fp8(q8, k8, v8, qs, ks, vs, causal, None, left, right, 0.0, False,
                                             config=cfg)[0]  # fmt: skip

        def ref():
            return reference.flash_attn_fp8_ref(q8, k8, v8, qs, ks, vs, causal=causal)

        return SearchTask(run=run, reference=ref, rtol=bench._FP8_TOLERANCE)
    q, k, v = (t.to(dtype) for t in (q, k, v))

    def run(cfg):
        return attention._flash_attn(q, k, v, causal, None, left, right, 0.0, False, config=cfg)[0]

    return SearchTask(run=run, reference=lambda: reference.flash_attn_ref(q, k, v, causal=causal),
                      rtol=tolerance(dtype))  # fmt: skip


def _bwd_task(key, device) -> SearchTask:
    """The backward's search task of a key: dq, dk, dv of the key's representative problem (as the forward's,
    with a unit-normal output gradient) from the fp32 reference's output (rounded to the dtype, as a forward
    stores it) and lse, through the backward's host path with the candidate as its config, each gradient
    checked against the bench's chunked fp32 backward (:func:`fly_attention.bench.attn_grads_ref`) within
    twice the dtype's tolerance: the reference's row terms come from the exact output, the kernels' from
    the rounded one."""
    from . import attention, bench, reference

    d, dv, sq, sk, causal, dtype = _bwd_key_args(key)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (t.to(dtype) for t in _random_qkv(key, device, gen))
    dout = torch.randn(q.shape[:-1] + (dv,), generator=gen, device=device).to(dtype)
    left, right = attention._options(causal, None, (-1, -1), 0.0)
    out, lse = reference.flash_attn_ref(q, k, v, causal=causal, return_lse=True)
    out = out.to(dtype)

    def run(cfg):
        return attention._flash_attn_bwd(dout, q, k, v, out, lse, causal, None, left, right, 0.0, config=cfg)

    return SearchTask(run=run, reference=lambda: bench.attn_grads_ref(q, k, v, dout, causal),
                      rtol=2 * tolerance(dtype))  # fmt: skip


_ARTIFACTS = Path(__file__).parent / "artifacts"

FWD_TUNABLE = Tunable(
    name="flash_fwd",
    config_type=AttnConfig,
    default=_fwd_default,
    candidates=candidates,
    is_valid=_fwd_valid,
    artifact_dir=_ARTIFACTS,
    max_candidates=_MAX_CANDIDATES,
    tune_keys=_fwd_tune_keys,
    make_task=_fwd_task,
)
BWD_TUNABLE = Tunable(
    name="flash_bwd",
    config_type=AttnBwdConfig,
    default=_bwd_default,
    candidates=bwd_candidates,
    is_valid=_bwd_valid,
    artifact_dir=_ARTIFACTS,
    max_candidates=_MAX_CANDIDATES,
    tune_keys=_bwd_tune_keys,
    make_task=_bwd_task,
)

# (head dims, lengths as given, causal, dtype, arch name) -> config, a direction: one dict lookup a launch. The
# arch's name, not the Arch (hashing its fields would double the lookup): a compute capability fixes the
# shared memory and registers a program may take, all the validity predicates read of it.
_FAST: dict = {}
_FAST_BWD: dict = {}
_FAST_LIMIT = 4096


def _serve(fast, tunable, default_fn, valid_fn, make_task, d, dv, sq, sk, causal, dtype, arch, autotune, task):
    search = env.get("FLYDSL_AUTOTUNE") if autotune is None else autotune
    fast_key = (d, dv, sq, sk, causal, dtype, arch.name)
    if not search:
        cfg = fast.get(fast_key)
        if cfg is not None:
            return cfg
    key = tuning_key(d, dv, sq, sk, causal, dtype)
    if task is None:
        device = "cpu" if arch.is_interpreter else "cuda"
        task = lambda: make_task(key, device)  # noqa: E731
    cfg = tunable.select(key, arch.name, autotune=search, task=task)
    # A key answering its default serves the launch its own default (the same config: the head dims and dtype
    # are exact in the key, and the lengths decide the default only up to 64 queries, far under the cap); an
    # answer the launch cannot take (a GPU of the same arch name with less shared memory) falls back to it.
    if cfg == tunable.default(key, arch.name) or not valid_fn(cfg, d, dv, dtype, arch):
        cfg = default_fn(d, dv, sq, sk, causal, dtype, arch)
    if not search:
        if len(fast) >= _FAST_LIMIT:
            fast.clear()
        fast[fast_key] = cfg
    return cfg


def config_for(head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int, causal: bool, dtype: torch.dtype,
               arch: flydsl.arch.Arch, *, autotune: bool | None = None, task=None) -> AttnConfig:  # fmt: skip
    """The forward's launch config on ``arch``: its key's (:func:`tuning_key`) searched winner, the shipped
    artifact's, or :func:`default_config` of the launch (``seqlen_q`` / ``seqlen_k`` as the launch path
    passes them: their next powers of two). ``autotune`` (default ``FLYDSL_AUTOTUNE``) searches the key once a
    process with ``task()`` (default: the key's representative task). A served config is valid for the
    launch's head dims and dtype on ``arch``; answers are memoised, so a launch pays one dict lookup."""
    return _serve(_FAST, FWD_TUNABLE, default_config, config_valid, _fwd_task, head_dim, head_dim_v, seqlen_q,
                  seqlen_k, causal, dtype, arch, autotune, task)  # fmt: skip


def bwd_config_for(head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int, causal: bool, dtype: torch.dtype,
                   arch: flydsl.arch.Arch, *, autotune: bool | None = None, task=None) -> AttnBwdConfig:  # fmt: skip
    """The backward's launch config, served as :func:`config_for` serves the forward's (from
    :data:`BWD_TUNABLE`, falling back to :func:`default_bwd_config`)."""
    return _serve(_FAST_BWD, BWD_TUNABLE, default_bwd_config, bwd_config_valid, _bwd_task, head_dim, head_dim_v,
                  seqlen_q, seqlen_k, causal, dtype, arch, autotune, task)  # fmt: skip


def clear_memo() -> None:
    """Forget every resolved config of this process, both directions (tests; after tuning)."""
    _FAST.clear()
    _FAST_BWD.clear()
    FWD_TUNABLE.clear_memo()
    BWD_TUNABLE.clear_memo()
