"""Launch configuration of the fused MoE's grouped GEMMs: :class:`MoeConfig`, its validity predicate and
its default (a pure function of the problem's shape, dtype and arch, unit-tested on the CPU).

One config serves both stages of a call: ``block_m`` is also the alignment's block (each block of rows
belongs to one expert), so the two stages must agree on it; the column tile and K step serve the gate/up
projection (two accumulators, two weight tiles a step) and the down projection alike.

The default follows the published Hopper practice for grouped MoE GEMMs (row tiles near the expected rows
an expert, 16 at decode; 64-128-wide column tiles; K steps of 64 for 16-bit inputs; 3-4 pipeline stages;
grouped tile order so the blocks of one expert share its weight tiles in L2); it is not yet measured on the
H200.

The tuning adopter (:data:`MOE_TUNABLE`, :func:`moe_config_for`) serves a call the searched winner, the
artifact shipped in ``fly_gemm/artifacts/moe.json`` (``flydsl tune gemm --only moe`` on the H200; none
shipped yet) or the default, as the dense GEMM's (:mod:`.autotune`) does.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl.autotune import SearchTask, Tunable
from flydsl.autotune.timer import rotating_copies
from flydsl.checks import dtype_name, parse_dtype
from flydsl.errors import ArgumentError
from flydsl.testing import tolerance

from .autotune import served_config

__all__ = [
    "MoeConfig", "moe_config_valid", "default_moe_config", "moe_smem_bytes", "MOE_TUNABLE", "moe_tuning_key",
    "moe_candidates", "moe_config_for", "clear_moe_memo", "MOE_TUNE_MODELS", "MOE_TUNE_TOKENS", "MOE_TUNE_QUANTS",
    "W4_MIN_BLOCK_K", "W4A8_MAX_BLOCK_K", "DOT_MIN_K_8BIT", "fit_block_k", "block_k_ok",
]  # fmt: skip

_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16
DOT_MIN_K_8BIT = 32  # and K at least 32 with 8-bit operands (fp8 / int8: Triton refuses less on sm_90)


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
    dot's minimum; K at least 32 for 8-bit operands), a warp count Triton takes, at least one stage, shared
    memory within the arch's."""
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(t < _DOT_MIN or t & (t - 1) for t in tiles) or cfg.group_m < 1:
        return False
    if in_dtype.itemsize == 1 and cfg.block_k < DOT_MIN_K_8BIT:
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
    if in_dtype.itemsize == 1:
        # 8-bit: BLOCK_K 128 beside the gated stage's two fp32 accumulators (gate, up). Compiled for sm_90,
        # 128-wide column tiles sit at the 255-register cap and spill (24-432 bytes; per-channel promoted and
        # block-scaled), 64-wide ones do not (128 rows, 8 warps: 186-231 registers; 64 rows, 4 warps: 251)
        block_n = 64
        warps = 8 if block_m >= 128 else 4
    cfg = MoeConfig(block_m, block_n, block_k, group_m=8 if block_m >= 64 else 1, num_warps=warps,
                    num_stages=4 if arch.backend == "cuda" else 2)  # fmt: skip
    while not moe_config_valid(cfg, in_dtype, arch) and cfg.num_stages > 1:
        cfg = MoeConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages - 1)
    if not moe_config_valid(cfg, in_dtype, arch):  # a small shared memory: narrower columns
        cfg = MoeConfig(cfg.block_m, max(_DOT_MIN, flyc.next_power_of_2(cfg.block_n // 2)), cfg.block_k,
                        cfg.group_m, cfg.num_warps, 1)  # fmt: skip
    return cfg


# ------------------------------------------------------------------ tuning adopter
#
# Key: {"tokens_bucket": next power of two of the tokens (capped), "experts", "inter", "hidden", "topk",
# "dtype": the dot's operand dtype, "quant": the weights' quantization} and the arch. E, I, H and k are exact
# (a model has one of each); the tokens are bucketed (the batch varies call to call). The quantization is
# part of the key because it changes the kernel (8-bit dots, per-step block scales, in-kernel 4-bit
# dequantization) and bounds the K step (it must lie in one scale block).

# The largest bucket: 16384 tokens route 16384 k rows, past which every expert's row tiles are full at any
# row tile of the space (Mixtral: 4096 rows an expert), so more tokens only add waves.
_TOKENS_CAP = 16384
_QUANT = re.compile(r"(none|channel)|block([1-9][0-9]*)x([1-9][0-9]*)|w4g([1-9][0-9]*)|mxfp4(?:g([1-9][0-9]*))?"
                    r"|w4a8g([1-9][0-9]*)|mxfp4a8(?:g([1-9][0-9]*))?")
_MXFP4_GROUP = 32  # the OCP MX format's block: "mxfp4" names it, other groups are "mxfp4g<group>"

# The offline tuning set (`flydsl tune gemm --only moe`): the models of moe_bench.MODELS, (E, k, H, I), at
# decode and prefill token counts, bf16 and DeepSeek-V3's block-scaled fp8.
MOE_TUNE_MODELS = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (256, 8, 7168, 2048),
}
MOE_TUNE_TOKENS = (1, 16, 64, 1024, 4096, 16384)
MOE_TUNE_QUANTS = ((torch.bfloat16, "none"), (torch.float8_e4m3fn, "block128x128"))


# 4-bit weights: the K step is at least 32 columns. A step of 16 (8 packed bytes a weight row) dequantized
# wrong on sm_90 (Triton 3.6; every case 100-400% off, whatever the group), 32 and up right (measured on
# the H200 over H, I 16-64, groups 16-64, column tiles 16-64). Groups smaller than the step read a scale an
# element.
W4_MIN_BLOCK_K = 32
# 4-bit weights with fp8 activations (w4a8): a K step of at most 32. At 64 and 128 the unpacked codes of the
# gate and up tiles, beside their two fp32 accumulators, spill on sm_90 (compiled offline at the 8-bit default
# 128 x 64 tiles, 8 warps: int4 16-128 bytes a thread); at 32 nothing spills (250 registers).
W4A8_MAX_BLOCK_K = 32


def fit_block_k(block_k: int, group: int | None, kind: str = "block") -> int:
    """The K step a config's ``block_k`` becomes for scale blocks of ``group`` columns (None: per channel).
    ``kind``: "block" (8-bit block scales: cut to the group, a step lies in one block), "w4" (4-bit
    weight-only: cut to the group, but not below :data:`W4_MIN_BLOCK_K`) or "w4a8" (cut to the group and to
    :data:`W4A8_MAX_BLOCK_K`)."""
    if group is None:
        return block_k
    if kind == "w4":
        return max(W4_MIN_BLOCK_K, min(block_k, group))
    return min(block_k, group, W4A8_MAX_BLOCK_K) if kind == "w4a8" else min(block_k, group)


def block_k_ok(block_k: int, group: int | None, kind: str = "block") -> bool:
    """Whether the kernel takes K step ``block_k`` for scale blocks of ``group`` columns (``kind`` as
    :func:`fit_block_k`'s): block scales, 8-bit or w4a8, need it to divide the group; 4-bit weight-only
    needs it at least :data:`W4_MIN_BLOCK_K` (a step within one group reads one scale a column, one over
    several groups a scale an element)."""
    if group is None:
        return True
    return block_k >= W4_MIN_BLOCK_K if kind == "w4" else group % block_k == 0


def _w4(quant: str) -> bool:
    """Weight-only 4-bit modes (w4a8 ones, with fp8 activations, bound the K step as block scales do)."""
    return quant.startswith(("w4g", "mxfp4")) and "a8" not in quant


def _k_kind(quant: str) -> str:
    """:func:`fit_block_k`'s kind of a quant mode."""
    return "w4" if _w4(quant) else "w4a8" if "a8" in quant else "block"


def _scale_k(quant: str) -> int | None:
    """The K extent of one scale block of a quant mode (the K step must divide it), None when unbounded."""
    m = _QUANT.fullmatch(quant) if isinstance(quant, str) else None
    if m is None:
        raise ArgumentError(f"quant: expected 'none', 'channel', 'block<bn>x<bk>', 'w4g<group>', 'mxfp4', "
                            f"'mxfp4g<group>', 'w4a8g<group>', 'mxfp4a8' or 'mxfp4a8g<group>', got "
                            f"{quant!r}")  # fmt: skip
    if m.group(1):
        return None
    bk = m.group(3) or m.group(4) or m.group(5) or m.group(6) or m.group(7)
    return int(bk) if bk else _MXFP4_GROUP


def moe_tuning_key(tokens: int, num_experts: int, inter: int, hidden: int, topk: int, in_dtype: torch.dtype,
                   quant: str) -> dict:  # fmt: skip
    """The bucketed key of one fused MoE call: ``tokens`` rounded up to a power of two (capped at 16384),
    ``num_experts``, ``inter`` (I), ``hidden`` (H) and ``topk`` exact, ``in_dtype`` the dot's operands (x's
    dtype; the 8-bit weights' for w8a8), ``quant`` one of "none", "channel" (fp8 / int8 per channel),
    "block<bn>x<bk>" (block-scaled), "w4g<group>" (int4), "mxfp4" (fp4 e2m1, groups of 32; "mxfp4g<group>"
    for other groups), and "w4a8g<group>", "mxfp4a8[g<group>]" for 4-bit weights with fp8 activations
    (``in_dtype`` fp8 e4m3)."""
    _scale_k(quant)  # names a bad mode
    bucket = min(flyc.next_power_of_2(max(tokens, 1)), _TOKENS_CAP)
    return {"tokens_bucket": bucket, "experts": num_experts, "inter": inter, "hidden": hidden, "topk": topk,
            "dtype": dtype_name(in_dtype), "quant": quant}  # fmt: skip


def _key_dtype(key) -> torch.dtype:
    return parse_dtype("dtype", key["dtype"])


def _fit_scale(cfg: MoeConfig, key) -> MoeConfig:
    """``cfg`` with its K step cut to the key's scale block where it is longer (as fused_moe cuts its own)."""
    bk = fit_block_k(cfg.block_k, _scale_k(key["quant"]), _k_kind(key["quant"]))
    return cfg if bk == cfg.block_k else dataclasses.replace(cfg, block_k=bk)


def _moe_default(key, arch: str) -> MoeConfig:
    cfg = default_moe_config(key["tokens_bucket"], key["experts"], key["inter"], key["hidden"], key["topk"],
                             _key_dtype(key), flydsl.arch.from_name(arch))  # fmt: skip
    return _fit_scale(cfg, key)


def _moe_valid(cfg: MoeConfig, key, arch: str) -> bool:
    ok = block_k_ok(cfg.block_k, _scale_k(key["quant"]), _k_kind(key["quant"]))
    return moe_config_valid(cfg, _key_dtype(key), flydsl.arch.from_name(arch)) and ok


_BLOCK_M = (16, 32, 64, 128)
_MAX_CANDIDATES = 30


def moe_candidates(key, arch: str) -> list[MoeConfig]:
    """A bounded space per key (at most 30 configs): the default's row tile and its two neighbours (the rows
    an expert gets decide it, and padding against tile efficiency is what a search settles), column tiles
    of 64-256, K steps of 64 and 128 for 16-bit operands (128 for 8-bit ones; cut to the scale block), 3 or
    4 stages; 4 warps for tiles up to 64 x 64, 8 from 128 x 128, both between. Every config passes the key's
    validity predicate (shared memory, scale block)."""
    a = flydsl.arch.from_name(arch)
    if a.is_interpreter:  # the interpreter runs every element of a tile: two small configs
        small = _fit_scale(MoeConfig(32, 32, 16, group_m=1, num_warps=4, num_stages=1), key)
        return [c for c in dict.fromkeys([_moe_default(key, arch), small]) if _moe_valid(c, key, arch)]
    dtype = _key_dtype(key)
    default = _moe_default(key, arch)
    i = _BLOCK_M.index(default.block_m) if default.block_m in _BLOCK_M else 0
    block_ms = _BLOCK_M[max(0, i - 1) : i + 2]
    sk = _scale_k(key["quant"])
    kind = _k_kind(key["quant"])
    block_ks = sorted({fit_block_k(bk, sk, kind) for bk in ((128,) if dtype.itemsize == 1 else (64, 128))})
    out = [default]
    for block_m, block_n, block_k, stages in itertools.product(block_ms, (64, 128, 256), block_ks, (3, 4)):
        tile = block_m * block_n
        warps = (4,) if tile <= 64 * 64 else (8,) if tile >= 128 * 128 else (4, 8)
        for w in warps:
            out.append(MoeConfig(block_m, block_n, block_k, group_m=8 if block_m >= 64 else 1, num_warps=w,
                                 num_stages=stages))  # fmt: skip
    return [c for c in dict.fromkeys(out) if _moe_valid(c, key, arch)][:_MAX_CANDIDATES]


def _moe_tune_keys(arch: str) -> list[dict]:
    return [moe_tuning_key(t, e, inter, h, k, dtype, quant) for dtype, quant in MOE_TUNE_QUANTS
            for e, k, h, inter in MOE_TUNE_MODELS.values() for t in MOE_TUNE_TOKENS]  # fmt: skip


def _random_layer(key, device, seed: int = 0):
    """Random inputs of a key's shape at its bucket's token count: unit-scale activations, quantized weights
    of unit-scale products (random codes, scales of 1 / (the codes' rms x sqrt(K))), uniform softmax routing
    (the ids drawn on the CPU). Weights are filled an expert at a time (DeepSeek-V3's bf16 w1 is 15 GB).
    Returns (fused_moe's positional arguments, its keyword arguments)."""
    from .moe_reference import topk_softmax_ref

    t, e, inter, h, k = (key[n] for n in ("tokens_bucket", "experts", "inter", "hidden", "topk"))
    dtype, quant = _key_dtype(key), key["quant"]
    m = _QUANT.fullmatch(quant)
    if m is None:
        raise ArgumentError(f"quant: not a quant mode: {quant!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed)
    w4 = bool(m.group(4) or m.group(6) or quant.startswith("mxfp4"))  # (w4a8 modes too: fp8 in_dtype)
    x_dtype = dtype if dtype.itemsize == 2 else torch.bfloat16  # 8-bit operands: bf16 x quantized on the fly
    x = torch.randn(t, h, device=device, generator=g).to(x_dtype)
    if w4:  # two 4-bit codes a byte along K
        w1 = torch.empty(e, 2 * inter, h // 2, device=device, dtype=torch.uint8)
        w2 = torch.empty(e, h, inter // 2, device=device, dtype=torch.uint8)
    else:
        wdt = dtype if quant != "none" else x_dtype
        w1 = torch.empty(e, 2 * inter, h, device=device, dtype=wdt)
        w2 = torch.empty(e, h, inter, device=device, dtype=wdt)
    for w in (w1, w2):
        for i in range(e):
            if w.dtype == torch.uint8:  # any two codes a byte
                w[i].random_(0, 256, generator=g)
            elif w.dtype == torch.int8:
                w[i].random_(-127, 128, generator=g)
            elif w.dtype.itemsize == 1:  # fp8: normal codes
                w[i] = torch.randn(w.shape[1:], device=device, generator=g).to(w.dtype)
            else:
                w[i].normal_(0.0, w.shape[2] ** -0.5, generator=g)
    kw = {}
    if quant != "none":
        # the codes' rms: fp8 normal 1, int8 uniform in [-127, 127] ~73.3, int4 uniform in [-8, 7] ~4.6, fp4 e2m1
        # uniform over its 16 codes ~2.9
        rms = 2.9 if quant.startswith("mxfp4") else 4.6 if w4 else 73.3 if dtype == torch.int8 else 1.0
        sk = _scale_k(quant)
        bn = int(m.group(2)) if m.group(2) else 1
        scales = []
        for n, kk in ((2 * inter, h), (h, inter)):
            if sk is None:  # per output channel
                shape = (e, n)
            else:
                shape = (e, -(-n // bn), -(-kk // sk))
            s = (torch.rand(shape, device=device, generator=g) + 0.5) / (rms * kk**0.5)
            if quant.startswith("mxfp4"):  # e8m0: powers of two
                s = torch.exp2(torch.round(torch.log2(s))).to(torch.float8_e8m0fnu)
            scales.append(s)
        kw = {"w1_scale": scales[0], "w2_scale": scales[1]}
        if sk is not None:
            kw["block_shape"] = [bn, sk]
        if w4 and dtype.itemsize == 1:
            kw["compute_dtype"] = torch.float8_e4m3fn
    w, ids = topk_softmax_ref(torch.randn(t, e, generator=gc), k)
    return (x, w1, w2, w.to(device), ids.to(device)), kw


def _moe_make_task(key, device):
    """The offline search task of a key: one full fused_moe call (routing alignment, both grouped GEMMs,
    the reduce; for w8a8 the activations' quantization) on random routing of the bucket's token count,
    checked against :func:`~fly_gemm.moe_reference.fused_moe_ref` within x's dtype's tolerance. Inputs that
    fit in L2 are timed rotating over copies (as the benchmarks do), so a decode key reads its experts'
    weights from memory, not from a warm L2."""
    from .moe import fused_moe  # here: moe imports this module
    from .moe_reference import fused_moe_ref

    args, kw = _random_layer(key, device)
    x = args[0]
    out = torch.empty_like(x)
    names = sorted(kw)
    l2 = flydsl.arch.current().l2_bytes if torch.device(device).type == "cuda" else 0
    # identical copies: any one gives the same output
    sets = rotating_copies((*args, out, *(kw[n] for n in names)), l2)
    turn = itertools.count()

    def run(cfg):
        x_, w1_, w2_, w_, ids_, out_, *rest = sets[next(turn) % len(sets)]
        return fused_moe(x_, w1_, w2_, w_, ids_, out=out_, config=cfg, **dict(zip(names, rest, strict=True)))

    return SearchTask(run=run, reference=lambda: fused_moe_ref(*args, **kw), rtol=tolerance(x.dtype))


MOE_TUNABLE = Tunable(
    name="moe",
    config_type=MoeConfig,
    default=_moe_default,
    candidates=moe_candidates,
    is_valid=_moe_valid,
    artifact_dir=Path(__file__).parent / "artifacts",
    max_candidates=_MAX_CANDIDATES + 1,  # the default, when the space lacks it
    tune_keys=_moe_tune_keys,
    make_task=_moe_make_task,
)
# (tokens bucket, E, I, H, k, dtype, quant, device) -> config: one dict lookup a call once resolved
_FAST: dict = {}


def moe_config_for(tokens, num_experts, inter, hidden, topk, in_dtype, quant: str, device, *,
                   task=None) -> MoeConfig:  # fmt: skip
    """The launch config of a fused MoE call: searched winner, shipped artifact or the default (cut to the
    scale block), as :func:`fly_gemm.autotune.config_for` serves the GEMM's (``FLYDSL_AUTOTUNE=1`` searches
    once per key with ``task()``, a :class:`~flydsl.autotune.SearchTask` of the call)."""
    bucket = 1 if tokens <= 1 else min(1 << (tokens - 1).bit_length(), _TOKENS_CAP)
    fast_key = (bucket, num_experts, inter, hidden, topk, in_dtype, quant, device)
    return served_config(MOE_TUNABLE, _FAST, fast_key, lambda: moe_tuning_key(tokens, num_experts, inter, hidden,
                         topk, in_dtype, quant), device, task)  # fmt: skip


def clear_moe_memo() -> None:
    """Forget every resolved MoE config of this process (tests; after tuning)."""
    _FAST.clear()
    MOE_TUNABLE.clear_memo()
