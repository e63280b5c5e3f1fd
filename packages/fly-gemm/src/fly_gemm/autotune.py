"""Launch configurations of fly-gemm: :class:`GemmConfig`, its default heuristic and validity predicate,
and the tuning adopter (:data:`TUNABLE`, :func:`config_for`).

The default is a pure function of (M, N, K, input dtype, arch), unit-tested on
the CPU; a call is served the searched winner, the artifact shipped in
``fly_gemm/artifacts/`` (``flydsl tune gemm`` on the H200) or the default.
The default's large-M tiles are the published Hopper practice (128 x 128
tiles, BLOCK_K 64 for 16-bit inputs and 128 for 8-bit ones, 3-4 pipeline
stages, grouped tile order with GROUP_M = 8), except where an H200 measurement
chose otherwise (the 128 x 256 tile for many tiles: see :func:`default_config`);
shapes off the shipped artifact get that default. Small M takes tiles of 16-64
rows so that no program computes mostly padding.
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
from flydsl.autotune.timer import rotating_copies
from flydsl.checks import dtype_name, parse_dtype
from flydsl.testing import tolerance

from .reference import gemm_ref

__all__ = [
    "GemmConfig", "default_config", "config_valid", "smem_bytes", "TUNABLE", "config_for", "tuning_key",
    "candidates", "clear_memo",
]  # fmt: skip

_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16
_DOT_MIN_K_8BIT = 32  # and K at least 32 for 8-bit operands (Triton's NVIDIA backend rejects less)
_REGISTERS_PER_SM = 65536  # NVIDIA sm_70 and later
_SMEM_RESERVED = 1024  # shared memory the CUDA runtime reserves a program (sm_80+), outside smem_per_block
_SMEM_SLACK = 256  # the pipeline's barriers and alignment, past smem_bytes (sm_90 compiles: 24-40 bytes)


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
    epilogue_subtile: bool = False  # TMA kernel: store C in two column halves (half the store buffer)
    # The CUDA-core decode kernel (_kernels/gemv.py): block_m rows of A (1-8) against block_n rows of B.
    gemv: bool = False
    # Splits of K: too few C tiles to occupy the GPU, so K is split and the partial sums added by a second
    # kernel (deterministic).
    split_k: int = 1
    # Split-K: the tile's last split to finish adds the partial sums (one launch, no reduction kernel;
    # splits counted in with an integer atomic, per-stream counters).
    reduce_last: bool = False
    # Persistent TMA kernel: programs an SM. At 2, one program's epilogue (e.g. an erf GELU, run with the
    # tensor cores idle) runs while the other's main loop keeps them busy; registers are capped so that
    # both fit (128 a thread at 8 warps), shared memory must fit twice.
    occupancy: int = 1
    # Tiled kernel on sm_90+: programmatic dependent launch. The kernel may start while the one before it
    # on the stream finishes; its programs prefetch their first weight tiles into L2, then wait for that
    # kernel's results before reading A or writing anything (so decode GEMMs in a chain overlap).
    pdl: bool = False

    def launch_options(self) -> dict:
        """Triton's launch options of this config."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.occupancy > 1:
            opts["maxnreg"] = _REGISTERS_PER_SM // (self.occupancy * 32 * self.num_warps) // 8 * 8
        if self.pdl:
            opts["launch_pdl"] = True
        return opts


def smem_bytes(cfg: GemmConfig, in_dtype: torch.dtype, out_itemsize: int = 4) -> int:
    """Shared memory a config takes: an A and a B tile per pipeline stage, and for the TMA kernel the C
    tile its descriptor store goes through (checked against sm_90 compiles of the TMA kernel: 128 x 128 x
    64 bf16 at 4 stages takes 4 x 32 KB + 32 KB)."""
    loads = (cfg.block_m + cfg.block_n) * cfg.block_k * in_dtype.itemsize * cfg.num_stages
    store_n = cfg.block_n // 2 if cfg.epilogue_subtile else cfg.block_n
    return loads + (cfg.block_m * store_n * out_itemsize if cfg.tma else 0)


def config_valid(cfg: GemmConfig, in_dtype: torch.dtype, arch: flydsl.arch.Arch, out_itemsize: int = 4) -> bool:
    """The one validity predicate of the space (heuristic, tuner, tests): power-of-two tiles of at least
    16 (the dot's minimum; K at least 32 for 8-bit operands), a warp count Triton takes, shared memory
    within the arch's (for an output of ``out_itemsize`` bytes an element; 4, the default, bounds every
    output dtype)."""
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(t < 1 or t & (t - 1) for t in tiles) or cfg.group_m < 1:
        return False
    if cfg.gemv:  # per-lane accumulators of block_m x block_n x block_k: at most 64 a thread
        lanes = 32 * cfg.num_warps
        return (not (cfg.tma or cfg.epilogue_subtile or cfg.reduce_last or cfg.pdl) and cfg.split_k == 1
                and cfg.block_m <= 8 and cfg.block_m * cfg.block_n * cfg.block_k <= 64 * lanes)  # fmt: skip
    if min(tiles) < _DOT_MIN or (in_dtype.itemsize == 1 and cfg.block_k < _DOT_MIN_K_8BIT):
        return False
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1 or cfg.split_k < 1:
        return False
    if cfg.tma and cfg.split_k > 1 and cfg.epilogue_subtile:  # split-K stores partial sums, not the tile
        return False
    if cfg.reduce_last and cfg.split_k == 1:  # a split-K option
        return False
    if cfg.epilogue_subtile and (not cfg.tma or cfg.block_n < 2 * _DOT_MIN):  # a TMA-kernel option
        return False
    if cfg.pdl and (cfg.tma or arch.backend != "cuda" or (arch.capability or (0,))[0] < 9):
        return False  # the tiled kernel's option; griddepcontrol is sm_90's
    smem = smem_bytes(cfg, in_dtype, out_itemsize)
    if cfg.occupancy != 1:  # programs an SM: the TMA kernel's option, each within its share of the SM
        per_sm = arch.smem_per_block + _SMEM_RESERVED
        return (cfg.tma and cfg.occupancy == 2 and cfg.num_warps <= 8
                and cfg.occupancy * (smem + _SMEM_SLACK + _SMEM_RESERVED) <= per_sm)  # fmt: skip
    return smem <= arch.smem_per_block


# Programs a decode-size candidate aims for, an SM, when the search space splits K: enough bytes of the
# weights in flight on every SM (1.5 programs x 3 stages x 16 KB is ~70 KB an SM, over the ~32 KB that the
# H200's 4.2 TB/s at ~1 us memory latency needs across 132 SMs).
_DECODE_PROGRAMS_PER_SM = 1.5


def _split_k(tiles: int, k_steps: int, arch: flydsl.arch.Arch) -> int:
    """Splits of K that reach the candidates' target of programs, each split keeping at least 4 K steps (so
    the pipeline fills and the partial sums stay small against the weights read)."""
    split = 1
    while tiles * split < _DECODE_PROGRAMS_PER_SM * arch.sm_count and k_steps // (2 * split) >= 4:
        split *= 2
    return split


# The decode-size default, fitted to the searched winners of the shipped sm_90 artifact (the LLM projections at
# M = 1-64, H200). Column tiles of at least 32 (M <= 16) or 64 (wider row tiles) columns, as wide as still
# gives the target of programs (1.5 an SM for 16-row tiles, 0.8 for the heavier 32-64-row ones), then K split
# (reduced by the tile's last split: one launch) until the target is met. The rule it replaces narrowed the
# column tiles down to 16 before splitting: at M = 64 that ran 1.2-2x slower than the winners (4096 x 4096:
# 22.6 against 11.2 us; 4096 x 14336: 64.5 against 35.3 us; the winners take 64 x 64 tiles split in 2), at
# M <= 16 up to 1.25x (4096 x 4096: 14.4 against 11.5 us for 16 x 32 tiles split in 2). K steps of 128
# (16-bit) and 512 (8-bit, 256 for the wider row tiles, whose stages must still fit) as the winners take.
_DECODE_TARGET_16 = 1.5
_DECODE_TARGET_WIDE = 0.8


def _decode_default(m: int, n: int, k: int, wide: bool, arch: flydsl.arch.Arch, stages: int) -> GemmConfig:
    block_m = max(_DOT_MIN, flyc.next_power_of_2(max(m, 1)))
    small = block_m <= _DOT_MIN
    block_k = (512 if small else 256) if wide else 128
    floor_n = 32 if small else 64
    target = (_DECODE_TARGET_16 if small else _DECODE_TARGET_WIDE) * arch.sm_count
    row_tiles = flyc.cdiv(m, block_m)
    block_n = next((bn for bn in (128, 64, 32) if bn >= floor_n and row_tiles * flyc.cdiv(n, bn) >= target), floor_n)
    tiles = row_tiles * flyc.cdiv(n, block_n)
    k_steps, split = flyc.cdiv(k, block_k), 1
    while tiles * split < target and k_steps // (2 * split) >= 8:  # each split keeps >= 8 K steps (the fp8
        split *= 2  # winner at K = 4096, 8 steps of 512, is not split)
    return GemmConfig(block_m, block_n, block_k, group_m=1, num_warps=4, num_stages=stages, split_k=split,
                      reduce_last=split > 1)  # fmt: skip


# Past the decode sizes, 128 x 256 tiles against 128 x 128 ones by the waves each needs: a 128 x 256 tile does
# twice the work in ~1.8x the time (H200: 1.03-1.04x cuBLAS at 4096^3 and 8192^3 against 0.95-0.98x for
# 128 x 128), but a grid of few waves loses its last wave's idle SMs. This picks the searched winners' width
# on every bf16 key of the shipped artifact from M = 256 up (e.g. 256 x 14336 x 4096: 2 waves of 128 x 128
# against 1 of 128 x 256, which won; 1024 x 14336 x 4096: 7 against 4, where 128 x 128 won). Grids of
# 128 x 128 tiles under half a wave split K (_wave_split), as the winners at M = 256 and N = 4096 do. Not for
# int8, whose raw int32 tile of 128 x 256 leaves 3 stages (the int8 winners at M = 256 keep 128 x 128).
_WIDE_TILE_COST = 1.8


def _wide_tiles_win(m: int, n: int, arch: flydsl.arch.Arch) -> bool:
    sms = arch.sm_count
    narrow = flyc.cdiv(flyc.cdiv(m, 128) * flyc.cdiv(n, 128), sms)
    wide = flyc.cdiv(flyc.cdiv(m, 128) * flyc.cdiv(n, 256), sms)
    return _WIDE_TILE_COST * wide < narrow


# Split-K past the decode sizes: the most splits whose (split, tile) work units still fit in one wave of the
# SMs, each split keeping at least _MIN_SPLIT_STEPS K steps (the pipeline fills; the partial sums stay small
# against the operands read); a grid of half a wave or more is not split. The power-of-two doubling this
# replaces (while under 0.8 programs an SM) overshot into a second wave that is mostly idle SMs, on the rows
# that trail cuBLAS most in the H200 sweep of unseen shapes (seed 20261202, GPU time): 135 x 2448 x 2224
# (40 tiles split 4: 160 units for 132 SMs, 2 rounds of 9 K steps) at 0.33x, and 201 x 1400 x 4160 + bias
# + GELU (22 tiles split 8: 176 units, 2 rounds of 9) at 0.12x; here 3 and 6 splits, one round of 12 and
# 11 K steps. The searched winners at M = 256 keep theirs (4096 columns, 64 tiles: 2 splits; 8192 columns
# and up: none). The new splits are derived, not yet timed.
_MIN_SPLIT_STEPS = 8


def _wave_split(tiles: int, k_steps: int, arch: flydsl.arch.Arch) -> int:
    return max(1, min(arch.sm_count // max(tiles, 1), k_steps // _MIN_SPLIT_STEPS))


def default_config(m: int, n: int, k: int, in_dtype: torch.dtype, arch: flydsl.arch.Arch) -> GemmConfig:
    """The default launch config of C[M, N] = A[M, K] @ B[N, K]^T (pure: shape, dtype and arch only)."""
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        block_m = 16 if m <= 16 else 32
        return GemmConfig(block_m, 32, 32, group_m=4, num_warps=4, num_stages=1)
    wide = in_dtype.itemsize == 1  # fp8 / int8: twice the K per byte
    block_k = 128 if wide else 64
    stages = 4 if arch.backend == "cuda" else 2
    if m <= 64:  # decode-size batches: a tile of M rows; the weights stream through the column tiles
        cfg = _decode_default(m, n, k, wide, arch, stages)
    elif arch.is_hopper and n > 128 and in_dtype != torch.int8 and _wide_tiles_win(m, n, arch):
        # 128 x 256 (a third less operand traffic a flop than 128 x 128), the epilogue stored in two halves
        cfg = GemmConfig(128, 256, block_k, group_m=8, num_warps=8, num_stages=stages, tma=True,
                         epilogue_subtile=True, flatten=True)  # fmt: skip
    else:
        tiles = flyc.cdiv(m, 128) * flyc.cdiv(n, 128)
        # too few tiles for the SMs (256 x 4096 x 4096: 64): K split, reduced by the last split. The
        # reduction runs the epilogue (scales, bias, activation) once on the full sum, so every epilogue and
        # the raw int32 product split alike.
        split = _wave_split(tiles, flyc.cdiv(k, block_k), arch) if arch.is_hopper else 1
        cfg = GemmConfig(128, 128 if n > 64 else 64, block_k, group_m=8, num_warps=8, num_stages=stages,
                         tma=arch.is_hopper, split_k=split, reduce_last=split > 1)  # fmt: skip
    while not config_valid(cfg, in_dtype, arch) and cfg.num_stages > 1:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


# ------------------------------------------------------------------ tuning adopter
#
# Key: {"m_bucket": next power of two of M (capped at 8192), "n", "k", "dtype", "out", "epilogue"} and the
# arch. N and K are exact (weights have few shapes), M is bucketed (batch sizes vary call to call).

_M_CAP = 8192
# The offline tuning set (`flydsl tune gemm`): LLM projections (N, K) at decode and prefill batch sizes.
TUNE_NK = ((4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672))
TUNE_M = (1, 4, 16, 64, 256, 1024, 4096, 8192)
TUNE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)  # bf16 output, no epilogue
# Also searched: the MLP up projection's fused bias + erf GELU at prefill sizes (where the epilogue's
# registers and time weigh on the tile choice; other epilogues take the plain GEMM's config), and the
# raw int8 product (int32 out, as torch._int_mm) at decode-to-prefill sizes.
TUNE_GELU_M = (1024, 4096, 8192)
TUNE_INT8_M = (16, 32, 64, 256)


def parse_epilogue(epilogue: str) -> tuple[bool, str | None]:
    """(bias, activation) of a key's epilogue: "none", "bias", "bias_<act>" or "<act>" (the seed's names)."""
    if epilogue in ("none", "bias"):
        return epilogue == "bias", None
    if epilogue.startswith("bias_"):
        return True, epilogue[len("bias_") :]
    return False, epilogue


def tuning_key(m: int, n: int, k: int, in_dtype: torch.dtype, out_dtype: torch.dtype, epilogue: str) -> dict:
    """The bucketed key of one GEMM; ``epilogue`` is "none", "bias", "bias_<activation>" or "<activation>"
    (its register cost can change the best tile)."""
    bucket = min(flyc.next_power_of_2(max(m, 1)), _M_CAP)
    return {"m_bucket": bucket, "n": n, "k": k, "dtype": dtype_name(in_dtype), "out": dtype_name(out_dtype),
            "epilogue": epilogue}  # fmt: skip


def _key_dtype(key) -> torch.dtype:
    return parse_dtype("dtype", key["dtype"])


def _key_out_size(key) -> int:
    return parse_dtype("out", key["out"]).itemsize


def _default(key, arch: str) -> GemmConfig:
    """A fused epilogue adds register work, not operand traffic: its key takes the plain GEMM's config of
    the same shape (searched, cached, shipped or default), so the tuned LLM shapes serve every epilogue."""
    if key["epilogue"] != "none":
        return TUNABLE.explain({**key, "epilogue": "none"}, arch)[0]
    if key["out"] == "fp16" and _key_dtype(key).itemsize == 1:
        # 8-bit operands into fp16 (a 16-bit x against a quantized PackedWeight): the same kernel and output
        # bytes as into bf16, whose keys are the ones tuned
        return TUNABLE.explain({**key, "out": "bf16"}, arch)[0]
    return default_config(key["m_bucket"], key["n"], key["k"], _key_dtype(key), flydsl.arch.from_name(arch))


def candidates(key, arch: str) -> list[GemmConfig]:
    """A bounded space per key (6-30 configs): decode-size M over tile widths, K steps and splits of K
    (tiled kernel, both reductions) and the CUDA-core kernel; larger M over Hopper's tile shapes and
    stages, the TMA kernel's tile-loop options, two programs an SM, and split-K up to 512 rows."""
    m, n, k = key["m_bucket"], key["n"], key["k"]
    dtype = _key_dtype(key)
    a = flydsl.arch.from_name(arch)
    out: list[GemmConfig] = []
    if a.is_interpreter:
        return [_default(key, arch), GemmConfig(16, 16, 16, num_stages=1)]
    bk = 128 if dtype.itemsize == 1 else 64
    if m <= 8:  # the CUDA-core decode kernel: 1-8 rows of A, 8-32 rows of B, 256-512 bytes of K a row
        for block_n in (8, 16, 32):
            for block_k in (256 // dtype.itemsize, 512 // dtype.itemsize):
                out.append(GemmConfig(m, block_n, block_k, group_m=1, num_warps=4, num_stages=4, gemv=True))
    if m <= 64:
        block_m = max(_DOT_MIN, m)
        for block_n in (16, 32, 64, 128):
            for block_k in (2 * bk, 4 * bk):
                tiles = flyc.cdiv(m, block_m) * flyc.cdiv(n, block_n)
                split = _split_k(tiles, flyc.cdiv(k, block_k), a)
                for s in sorted({1, split, max(1, split // 2)}):
                    out.append(GemmConfig(block_m, block_n, block_k, group_m=1, num_warps=4, num_stages=4, split_k=s))
                    if s > 1:  # the same split reduced in the kernel: no second launch
                        out.append(dataclasses.replace(out[-1], reduce_last=True))
                        if m <= 16:  # fewer warps a program: more programs resident an SM
                            out.append(dataclasses.replace(out[-1], num_warps=2))
                    if m <= 16 and block_k == 2 * bk:  # launched early, weights prefetched (sm_90+)
                        out.append(dataclasses.replace(out[-1], pdl=True))
    else:
        hopper = a.is_hopper
        shapes = [(128, 128, 8), (128, 256, 8), (64, 128, 4), (128, 64, 4)]
        if m <= 512:  # few row tiles: narrower tiles fill more of the SMs
            shapes += [(64, 256, 4), (64, 64, 4)]
        for block_m, block_n, warps in shapes:
            for stages in (3, 4):
                out.append(GemmConfig(block_m, block_n, bk, group_m=8, num_warps=warps, num_stages=stages, tma=hopper))
        wide = dict(group_m=8, num_warps=8, num_stages=4)
        if hopper:  # the TMA kernel's tile-loop options; 128 x 256 x 64 is the 8-bit tile that fits 4 stages
            out += [GemmConfig(128, 256, bk, tma=True, epilogue_subtile=True, **wide),
                    GemmConfig(128, 256, bk, tma=True, epilogue_subtile=True, flatten=True, **wide),
                    GemmConfig(128, 256, 64, tma=True, epilogue_subtile=True, flatten=True, **wide),
                    GemmConfig(128, 128, bk, tma=True, flatten=True, **wide),
                    # Triton 3.6 specialises warps on sm_90 only from 4 warps (a producer group and two
                    # consumer groups: 12 warps launched); at 8 the option is silently dropped (sm_90 compiles)
                    GemmConfig(128, 128, bk, tma=True, warp_specialize=True, group_m=8, num_warps=4,
                               num_stages=4)]  # fmt: skip
            if m <= 512:  # few tiles against a long K: split K across the SMs
                out += [GemmConfig(128, 128, bk, tma=True, split_k=s, reduce_last=r, **wide)
                        for s in (2, 4) for r in (False, True)]  # fmt: skip
            # two programs an SM (3 stages, the epilogue in halves: 112 KB each)
            two = dict(group_m=8, num_warps=8, num_stages=3, tma=True, epilogue_subtile=True, occupancy=2)
            out += [GemmConfig(128, 128, bk, **two), GemmConfig(128, 128, bk, flatten=True, **two)]
        out.append(GemmConfig(128, 128, bk, **wide))  # the tiled kernel
        if m <= 512:
            out.append(GemmConfig(128, 128, bk, split_k=2, **wide))
    return [c for c in dict.fromkeys(out) if config_valid(c, dtype, a, _key_out_size(key))]


def _valid(cfg: GemmConfig, key, arch: str) -> bool:
    return config_valid(cfg, _key_dtype(key), flydsl.arch.from_name(arch), _key_out_size(key))


def _tune_keys(arch: str) -> list[dict]:
    bf16, int8 = torch.bfloat16, torch.int8
    keys = [tuning_key(m, n, k, dt, bf16, "none") for dt in TUNE_DTYPES for n, k in TUNE_NK for m in TUNE_M]
    keys += [tuning_key(m, n, k, bf16, bf16, "bias_gelu") for n, k in TUNE_NK for m in TUNE_GELU_M]
    keys += [tuning_key(m, n, k, int8, torch.int32, "none") for n, k in TUNE_NK for m in TUNE_INT8_M]
    return keys


def _make_task(key, device):
    """The offline search task of a key: random operands of its shape (M = the bucket), per-row x
    per-column scales for 8-bit inputs, the fp64 reference. Operands that fit in L2 are timed
    rotating over copies (as the benchmark does), so a decode key is searched reading its weights
    from memory, not from a warm L2."""
    from .gemm import _gemm  # here: gemm imports this module

    m, n, k = key["m_bucket"], key["n"], key["k"]
    dtype, out = _key_dtype(key), parse_dtype("out", key["out"])
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype)
    sa = sb = None
    if dtype.itemsize == 1 and out.is_floating_point:  # a raw int8 product (int32 out) takes no scales
        sa, sb = torch.rand(m, device=device) + 0.5, torch.rand(n, device=device) + 0.5
    has_bias, act = parse_epilogue(key["epilogue"])
    bias = torch.randn(n, device=device, dtype=torch.bfloat16) if has_bias else None
    c = torch.empty(m, n, device=device, dtype=out)
    l2 = flydsl.arch.current().l2_bytes if torch.device(device).type == "cuda" else 0
    sets = rotating_copies((a, b, bias, sa, sb, c), l2)  # identical copies: any one gives the same output
    turn = itertools.count()

    def run(cfg):
        a_, b_, bias_, sa_, sb_, c_ = sets[next(turn) % len(sets)]
        return _gemm(a_, b_, bias_, act, out, sa_, sb_, c_, "nk", cfg)

    return SearchTask(
        run=run,
        reference=lambda: gemm_ref(a, b, bias=bias, activation=act, scale_a=sa, scale_b=sb),
        rtol=0.0 if not out.is_floating_point else tolerance(out) if out != torch.float32 else 1e-4,
    )


def _make_tunable():
    return Tunable(
        name="gemm",
        config_type=GemmConfig,
        default=_default,
        candidates=candidates,
        is_valid=_valid,
        artifact_dir=Path(__file__).parent / "artifacts",
        max_candidates=48,
        tune_keys=_tune_keys,
        make_task=_make_task,
    )


TUNABLE = _make_tunable()
_FAST: dict = {}  # (m bucket, n, k, dtypes, epilogue, device) -> config: one dict lookup a call


def served_config(tunable: Tunable, memo: dict, fast_key, make_key, device, task=None):
    """``tunable``'s config for a call (the family's three adopters serve theirs through it): ``memo[fast_key]``
    once resolved (one dict lookup a call; ``fast_key`` holds the bucketed shape and the device), else
    :meth:`~flydsl.autotune.Tunable.select` of ``make_key()`` on the device's arch (searched winner, shipped
    artifact or default), memoized unless ``FLYDSL_AUTOTUNE=1`` asks for a search (with ``task()``)."""
    search = bool(env.get("FLYDSL_AUTOTUNE"))
    if not search:
        cfg = memo.get(fast_key)
        if cfg is not None:
            return cfg
    cfg = tunable.select(make_key(), flydsl.arch.name(device), task=task)
    if not search:
        memo[fast_key] = cfg
    return cfg


def config_for(m, n, k, in_dtype, out_dtype, epilogue: str, device, *, task=None) -> GemmConfig:
    """The launch config of a GEMM call: searched winner, shipped artifact or :func:`default_config`
    (``FLYDSL_AUTOTUNE=1`` searches with ``task()``)."""
    fast_key = (min(flyc.next_power_of_2(max(m, 1)), _M_CAP), n, k, in_dtype, out_dtype, epilogue, device)
    return served_config(TUNABLE, _FAST, fast_key, lambda: tuning_key(m, n, k, in_dtype, out_dtype, epilogue),
                         device, task)  # fmt: skip


def clear_memo() -> None:
    """Forget every resolved config of this process (tests; after tuning)."""
    _FAST.clear()
    TUNABLE.clear_memo()
