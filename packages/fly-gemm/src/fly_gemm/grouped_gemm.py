"""``grouped_gemm``: the grouped GEMM of a mixture-of-experts layer in training, tokens already grouped by
expert: ``C[rows of g] = A[rows of g] @ B[g]^T`` with fp32 accumulation, and its backward.

The layout of ``torch._grouped_mm`` with a 2-D A: ``offsets`` (int32 ``[G]``) are the cumulative END rows of
the groups, group g owning rows ``[offsets[g-1], offsets[g])`` (group 0 from row 0); our ``b`` is
``[G, N, K]`` (each expert's weight as in ``x @ w^T``), where ``torch._grouped_mm`` takes ``[G, K, N]``.
Rows past ``offsets[-1]`` belong to no group: their output (and gradient) rows are zeros.

In the order of the family's files: the kernels live in :mod:`._kernels.grouped_gemm` (the group table, the
grouped product, the per-group weight gradient), the config and its default below, the reference in
:mod:`.reference` (``grouped_gemm_ref``), then the host API: argument checks (every bad input named before
anything launches), allocation and launches, and the ``fly_gemm::grouped_gemm`` custom op with its fake
implementation and backward (``torch.compile(fullgraph=True)`` traces forward and backward):

- dA = ``grouped_gemm(dC, B^T)``: the same kernel over a transposed view of ``b`` (no copy);
- dB[g] = ``dC_g^T @ A_g``: one program a ``dB[g]`` tile reduces over its group's rows in order
  (deterministic, no atomics); a group with no rows gets zeros.

Nothing reads device data back to the host (the grid is sized by a bound on the row tiles; see the kernels'
module), so a call can be captured in a CUDA graph. ``offsets`` on a GPU is therefore trusted: it is not
checked for order or range; the kernels read it as running maxima clamped to ``[0, M]``, so decreasing or
out-of-range values give empty groups, never reads or writes out of bounds. On the CPU (where reading
costs no synchronization) offsets that decrease, are negative or pass M raise.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl.autotune import SearchTask, Tunable
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name, parse_dtype
from flydsl.errors import ArgumentError, DTypeError, ShapeError
from flydsl.testing import tolerance

from ._kernels.grouped_gemm import launch_group_table, launch_grouped_gemm, launch_grouped_wgrad
from .autotune import served_config

__all__ = [
    "grouped_gemm", "GroupedGemmConfig", "grouped_gemm_config_valid", "default_grouped_gemm_config",
    "GROUPED_DTYPES", "GROUPED_TUNABLE", "grouped_tuning_key", "grouped_candidates", "grouped_config_for",
]  # fmt: skip

GROUPED_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DOT_MIN = 16  # every dimension of a tensor-core dot is at least 16

# Every output and workspace is allocated through this name, so a test can make them poisoned (NaN) and see
# any element the kernels leave unwritten.
_empty = torch.empty


# ------------------------------------------------------------------ config


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiles of one grouped GEMM: a ``block_m x block_n`` output tile, reduced in ``block_k`` steps;
    ``group_m`` row tiles walked before moving right (L2 reuse of the weight tiles).

    For the product and dA the tile is rows x columns of C and the steps walk K (dA: N); for dB the tile
    is ``block_m`` rows of ``dB[g]`` (N) x ``block_n`` columns (K) and the steps walk the group's rows."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def grouped_smem_bytes(cfg: GroupedGemmConfig, in_dtype: torch.dtype) -> int:
    """Shared memory of the pipeline: one tile of each operand a stage."""
    return (cfg.block_m + cfg.block_n) * cfg.block_k * in_dtype.itemsize * cfg.num_stages


@functools.lru_cache(maxsize=1024)  # pure: every call asks it
def grouped_gemm_config_valid(cfg: GroupedGemmConfig, in_dtype: torch.dtype, arch: flydsl.arch.Arch) -> bool:
    """Power-of-two tiles of at least 16 (the dot's minimum), a warp count Triton takes, at least one stage,
    shared memory within the arch's."""
    tiles = (cfg.block_m, cfg.block_n, cfg.block_k)
    if any(not isinstance(t, int) or t < _DOT_MIN or t & (t - 1) for t in tiles) or cfg.group_m < 1:
        return False
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        return False
    return grouped_smem_bytes(cfg, in_dtype) <= arch.smem_per_block


@functools.lru_cache(maxsize=1024)  # pure: every call asks it
def default_grouped_gemm_config(
    m_total: int, groups: int, n: int, k: int, in_dtype: torch.dtype, arch: flydsl.arch.Arch, wgrad: bool = False
) -> GroupedGemmConfig:
    """The default config of a grouped GEMM over ``m_total`` rows in ``groups`` groups, ``n`` output columns
    and ``k`` reduced (for dA: n = K, k = N); ``wgrad``: the dB kernel, its tile over (N, K) (pure:
    arguments only).

    Not yet tuned: 128 x 128 tiles with K steps of 64, 8 warps and 4 stages on CUDA for groups of training
    size (the usual Hopper choice for 16-bit tensor-core GEMMs); narrower row tiles when groups are small,
    so that their partial tiles waste little."""
    if arch.is_interpreter:  # small tiles: the interpreter executes every element of a tile
        return GroupedGemmConfig(16, 32, 32, group_m=4, num_warps=4, num_stages=1)
    stages = 4 if arch.backend == "cuda" else 2
    if wgrad:
        block_m = 128 if n > 64 else 64
        block_n = 128 if k > 64 else 64
        block_k = 64
    else:
        rows = m_total / max(1, groups)
        block_m = 32 if rows <= 32 else 64 if rows <= 96 else 128
        block_n = 64 if block_m <= 32 or n <= 64 else 128
        block_k = 64
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    cfg = GroupedGemmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=stages)
    while not grouped_gemm_config_valid(cfg, in_dtype, arch) and cfg.num_stages > 1:
        cfg = GroupedGemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages - 1)
    return cfg


# ------------------------------------------------------------------ tuning adopter
#
# Key: {"kind": "fwd" (the product, b's K contiguous), "dgrad" (the same kernel over b's transposed view: dA of
# the backward), "wgrad" (dB); "rows": the rows a group, rounded up to a power of two (capped); "groups";
# "n" and "k" as the launch sees them (dgrad: the forward's K and N); "dtype"} and the arch. The rows are
# bucketed (the routing varies step to step), the rest exact (a model has one of each).

_ROWS_CAP = 16384  # rows a group past which every tile of the space is full: more rows only add waves
# the training shapes searched: the MoE models' routed rows at the grouped_gemm bench's token counts, both
# projections, the three launches of a training step
GROUPED_TUNE_TOKENS = (4096, 16384)
_MAX_GROUPED_CANDIDATES = 30


def grouped_tuning_key(kind: str, m_total: int, groups: int, n: int, k: int, in_dtype: torch.dtype) -> dict:
    """The bucketed key of one grouped GEMM launch (``kind`` "fwd", "dgrad" or "wgrad"; ``n``, ``k`` the
    launch's, see the comment above)."""
    if kind not in ("fwd", "dgrad", "wgrad"):
        raise ArgumentError(f"kind: expected 'fwd', 'dgrad' or 'wgrad', got {kind!r}")
    return {"kind": kind, "rows": _rows_bucket(m_total, groups), "groups": groups, "n": n, "k": k,
            "dtype": dtype_name(in_dtype)}  # fmt: skip


def _rows_bucket(m_total: int, groups: int) -> int:
    """The rows a group of the key: rounded up to a power of two, capped."""
    return min(flyc.next_power_of_2(max(1, -(-m_total // max(1, groups)))), _ROWS_CAP)


def _key_args(key) -> tuple[str, int, int, int, int, torch.dtype]:
    """(kind, m_total, groups, n, k, dtype) of a key's representative launch: every group ``rows`` rows."""
    g = int(key["groups"])
    return key["kind"], int(key["rows"]) * g, g, int(key["n"]), int(key["k"]), parse_dtype("dtype", key["dtype"])


def _grouped_default(key, arch: str) -> GroupedGemmConfig:
    kind, m, g, n, k, dtype = _key_args(key)
    return default_grouped_gemm_config(m, g, n, k, dtype, flydsl.arch.from_name(arch), wgrad=kind == "wgrad")


def _grouped_valid(cfg, key, arch: str) -> bool:
    return isinstance(cfg, GroupedGemmConfig) and grouped_gemm_config_valid(
        cfg, _key_args(key)[5], flydsl.arch.from_name(arch))  # fmt: skip


def grouped_candidates(key, arch: str) -> list[GroupedGemmConfig]:
    """A bounded space per key (at most 30, each valid for the key on ``arch``): tiles of 64 / 128 x 64-256
    (the product's rows x columns; dB's N x K), steps of 32 and 64, 3 and 4 stages, 4 warps up to 64 x 64, 8
    from 128 x 128, both between; for groups of at most 32 rows the 32-row tile too. The interpreter: the
    default and a 16 x 16 tile."""
    a = flydsl.arch.from_name(arch)
    default = _grouped_default(key, arch)
    if a.is_interpreter:
        out = [default, GroupedGemmConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1)]
    else:
        rows = (32, 64, 128) if key["kind"] != "wgrad" and int(key["rows"]) <= 32 else (64, 128)
        out = [default]
        for bm, bn, bk, stages in itertools.product(rows, (64, 128, 256), (64, 32), (4, 3)):
            area = bm * bn
            for w in (4,) if area <= 64 * 64 else (8,) if area >= 128 * 128 else (4, 8):
                out.append(GroupedGemmConfig(bm, bn, bk, group_m=8, num_warps=w, num_stages=stages))
    return [c for c in dict.fromkeys(out) if _grouped_valid(c, key, arch)][:_MAX_GROUPED_CANDIDATES]


def _grouped_tune_keys(arch: str) -> list[dict]:
    from .moe_config import MOE_TUNE_MODELS  # the MoE models; moe_config imports nothing of this module

    keys = []
    for e, topk, h, inter in MOE_TUNE_MODELS.values():
        for t in GROUPED_TUNE_TOKENS:
            m = t * topk
            for n, k in ((2 * inter, h), (h, inter)):  # gate/up, down
                keys += [grouped_tuning_key("fwd", m, e, n, k, torch.bfloat16),
                         grouped_tuning_key("dgrad", m, e, k, n, torch.bfloat16),
                         grouped_tuning_key("wgrad", m, e, n, k, torch.bfloat16)]  # fmt: skip
    return list({tuple(sorted(k.items())): k for k in keys}.values())


def _grouped_make_task(key, device) -> SearchTask:
    """One launch of the key's kind on random unit-scale operands, every group ``rows`` rows, checked against
    the fp32 loop over groups."""
    from .reference import grouped_gemm_ref

    kind, m, g, n, k, dtype = _key_args(key)
    gen = torch.Generator(device=device).manual_seed(0)
    offsets = (torch.arange(1, g + 1, dtype=torch.int32) * (m // g)).to(device)
    if kind == "wgrad":  # dB[g] = grad_g^T @ a_g: [G, n, k]
        grad = torch.randn(m, n, device=device, generator=gen).to(dtype)
        a = (torch.randn(m, k, device=device, generator=gen) * (m // g) ** -0.5).to(dtype)

        def reference():  # filled in place: stacking the parts would hold the fp32 result twice
            out, r = torch.empty(g, n, k, device=device), m // g
            for i in range(g):
                torch.mm(grad[i * r : (i + 1) * r].float().t(), a[i * r : (i + 1) * r].float(), out=out[i])
            return out

        return SearchTask(run=lambda cfg: _grouped_wgrad(grad, a, offsets, dtype, config=cfg), reference=reference,
                          rtol=tolerance(dtype))  # fmt: skip
    a = torch.randn(m, k, device=device, generator=gen).to(dtype)
    if kind == "fwd":
        b = (torch.randn(g, n, k, device=device, generator=gen) * k**-0.5).to(dtype)
    else:  # dgrad: b^T of the forward's [G, N, K] weight, a view
        b = (torch.randn(g, k, n, device=device, generator=gen) * k**-0.5).to(dtype).transpose(1, 2)
    return SearchTask(run=lambda cfg: _grouped_gemm(a, b, offsets, dtype, config=cfg),
                      reference=lambda: grouped_gemm_ref(a, b, offsets), rtol=tolerance(dtype))  # fmt: skip


GROUPED_TUNABLE = Tunable(
    name="grouped_gemm",
    config_type=GroupedGemmConfig,
    default=_grouped_default,
    candidates=grouped_candidates,
    is_valid=_grouped_valid,
    artifact_dir=Path(__file__).parent / "artifacts",
    max_candidates=_MAX_GROUPED_CANDIDATES + 1,  # the default, when the space lacks it
    tune_keys=_grouped_tune_keys,
    make_task=_grouped_make_task,
)
# (kind, rows bucket, groups, n, k, dtype, device) -> config: one dict lookup a call once resolved
_FAST: dict = {}


def grouped_config_for(kind: str, m_total: int, groups: int, n: int, k: int, in_dtype: torch.dtype,
                       device) -> GroupedGemmConfig:  # fmt: skip
    """The config of a grouped GEMM launch: searched winner, shipped artifact or the default (``FLYDSL_AUTOTUNE=1``
    searches once per key, on random operands of the key's shape)."""
    fast_key = (kind, _rows_bucket(m_total, groups), groups, n, k, in_dtype, device)  # the key, as a tuple

    def key():
        return grouped_tuning_key(kind, m_total, groups, n, k, in_dtype)

    return served_config(GROUPED_TUNABLE, _FAST, fast_key, key, device, lambda: _grouped_make_task(key(), device))


def clear_grouped_memo() -> None:
    """Forget every resolved grouped GEMM config of this process (tests; after tuning)."""
    _FAST.clear()
    GROUPED_TUNABLE.clear_memo()


# ------------------------------------------------------------------ checks


def _out_dtype(in_dtype: torch.dtype, out_dtype) -> torch.dtype:
    if out_dtype is None:
        return in_dtype
    if out_dtype not in _OUT_DTYPES:
        raise DTypeError(f"out_dtype: expected None or one of {[dtype_name(d) for d in _OUT_DTYPES]}, "
                         f"got {out_dtype!r}")  # fmt: skip
    return out_dtype


def _check(a, b, offsets, out_dtype) -> torch.dtype:
    """Every argument checked, naming it, from metadata alone (nothing read from the device); returns the
    output dtype."""
    check_tensor("a", a, ndim=2)
    if a.dtype not in GROUPED_DTYPES:
        raise DTypeError(f"a: expected dtype bf16 or fp16, got {describe(a)}")
    check_tensor("b", b, ndim=3)
    if b.dtype != a.dtype:
        raise DTypeError(f"b: expected dtype {dtype_name(a.dtype)} (a's), got {describe(b)}")
    m, k = a.shape
    if b.shape[2] != k:
        raise ShapeError(f"b: expected [G, N, {k}] (one [N, K] weight a group, K = a's {k} columns), "
                         f"got {describe(b)}")  # fmt: skip
    check_tensor("offsets", offsets, ndim=1)
    if offsets.dtype != torch.int32:
        raise DTypeError(f"offsets: expected dtype int32 (cumulative end rows of the groups, as torch._grouped_mm "
                         f"takes), got {describe(offsets)}")  # fmt: skip
    if offsets.shape[0] != b.shape[0]:
        raise ShapeError(f"offsets: expected [{b.shape[0]}] (one end row a group of b), got {describe(offsets)}")
    if m >= 2**31:
        raise ShapeError(f"a: at most 2^31 - 1 rows (int32 offsets), got {describe(a)}")
    check_same_device(a=a, b=b, offsets=offsets)
    return _out_dtype(a.dtype, out_dtype)


def _check_offset_values(offsets: torch.Tensor, m: int) -> None:
    """On the CPU only, where reading them costs no synchronization: non-decreasing, in [0, M]."""
    if offsets.device.type != "cpu" or offsets.shape[0] == 0:
        return
    v = offsets.tolist()
    if v[0] < 0 or v[-1] > m or any(x > y for x, y in zip(v, v[1:], strict=False)):
        raise ArgumentError(f"offsets: expected non-decreasing cumulative end rows in [0, {m}] (a's rows), got {v}")


def _table(offsets: torch.Tensor, m: int, block_m: int) -> torch.Tensor:
    table = _empty(2 * (offsets.shape[0] + 2), dtype=torch.int32, device=offsets.device)
    launch_group_table(offsets, table, m, block_m)
    return table


# ------------------------------------------------------------------ host bodies


def _grouped_gemm(a, b, offsets, out_dtype, config=None):
    """Check, allocate and launch (the body of :func:`grouped_gemm` and of its custom op)."""
    dtype = _check(a, b, offsets, out_dtype)
    m, k = a.shape
    groups, n = b.shape[0], b.shape[1]
    out = _empty(m, n, dtype=dtype, device=a.device)
    if m == 0 or n == 0 or a.device.type == "meta":
        return out
    _check_offset_values(offsets, m)
    arch = flydsl.arch.current(a.device)
    if config is None:  # b's K contiguous: the product; its transposed view: the backward's dA
        cfg = grouped_config_for("fwd" if b.stride(2) == 1 else "dgrad", m, groups, n, k, a.dtype, a.device)
    else:
        cfg = config
    if not isinstance(cfg, GroupedGemmConfig) or not grouped_gemm_config_valid(cfg, a.dtype, arch):
        raise ArgumentError(f"config: {cfg!r} is not a valid GroupedGemmConfig for {dtype_name(a.dtype)} on "
                            f"{arch.name}")  # fmt: skip
    launch_grouped_gemm(a, b, out, _table(offsets, m, cfg.block_m), cfg)
    return out


def _check_wgrad(grad, a, offsets, out_dtype) -> None:
    check_tensor("grad", grad, dtypes=GROUPED_DTYPES, ndim=2)
    check_tensor("a", a, dtypes=(grad.dtype,), ndim=2)
    if a.shape[0] != grad.shape[0]:
        raise ShapeError(f"a: expected {grad.shape[0]} rows (grad's), got {describe(a)}")
    check_tensor("offsets", offsets, dtypes=(torch.int32,), ndim=1)
    if out_dtype not in _OUT_DTYPES:
        raise DTypeError(f"out_dtype: expected one of {[dtype_name(d) for d in _OUT_DTYPES]}, got {out_dtype!r}")
    check_same_device(grad=grad, a=a, offsets=offsets)


def _grouped_wgrad(grad, a, offsets, out_dtype, config=None):
    """``dB[g] = grad[rows of g]^T @ a[rows of g]``, ``[G, N, K]`` (zeros for a group without rows)."""
    _check_wgrad(grad, a, offsets, out_dtype)
    m, k = a.shape
    groups, n = offsets.shape[0], grad.shape[1]
    d = _empty(groups, n, k, dtype=out_dtype, device=a.device)
    if d.numel() == 0 or a.device.type == "meta":
        return d
    _check_offset_values(offsets, m)
    arch = flydsl.arch.current(a.device)
    cfg = grouped_config_for("wgrad", m, groups, n, k, a.dtype, a.device) if config is None else config
    if not isinstance(cfg, GroupedGemmConfig) or not grouped_gemm_config_valid(cfg, a.dtype, arch):
        raise ArgumentError(f"config: {cfg!r} is not a valid GroupedGemmConfig for {dtype_name(a.dtype)} on "
                            f"{arch.name}")  # fmt: skip
    # the table's row starts do not depend on its tile size: any block_m serves
    launch_grouped_wgrad(grad, a, d, _table(offsets, m, cfg.block_m), cfg)
    return d


# ------------------------------------------------------------------ public API


def grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The grouped GEMM of tokens grouped by expert: row block g of the result is ``a_g @ b[g]^T``,
    accumulated in fp32; differentiable in ``a`` and ``b``.

    Args:
        a: ``[M_total, K]`` bf16 / fp16, any strides; the rows of group g are ``a[offsets[g-1]:offsets[g]]``.
        b: ``[G, N, K]``, a's dtype, any strides: each group's weight, row-major as ``w`` in ``x @ w^T``.
        offsets: int32 ``[G]``, the cumulative END rows of the groups (``torch._grouped_mm``'s ``offs``):
            non-decreasing, at most M_total; groups may be empty. Rows past ``offsets[-1]`` get zero output
            rows. Trusted on a GPU (not read back; see the module); checked on the CPU.
        out_dtype: bf16 / fp16 / fp32 (default: a's dtype).

    Returns:
        ``[M_total, N]`` in ``out_dtype``. M_total = 0 gives an empty result; K = 0 zeros.

    Backward: ``dA = dC_g @ b[g]`` (the same kernel over ``b``'s transposed view) and ``dB[g] = dC_g^T @ a_g``
    (a deterministic reduction over the group's rows; zeros for an empty group), in a's and b's dtypes.

    Raises:
        flydsl.errors.ArgumentError / DTypeError / ShapeError / DeviceError naming the argument, before
        anything launches.

    Example::

        y = grouped_gemm(x_sorted, w, offs)   # x_sorted [M, 4096], w [8, 14336, 4096], offs int32 [8]
    """
    dtype = _check(a, b, offsets, out_dtype)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        # traced code and autograd go through the custom op (fake implementation, registered backward)
        return torch.ops.fly_gemm.grouped_gemm(a, b, offsets, dtype)
    return _grouped_gemm(a, b, offsets, dtype)


# ------------------------------------------------------------------ custom ops and autograd

# Through torch.library.Library, as fly_gemm::gemm (see gemm.py: custom_op's kernel imports torch._dynamo on
# its first eager call); a fragment, since gemm.py defines the namespace.
_LIB = torch.library.Library("fly_gemm", "FRAGMENT")
_LIB.define(
    "grouped_gemm(Tensor a, Tensor b, Tensor offsets, ScalarType? out_dtype) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.define(
    "grouped_gemm_wgrad(Tensor grad, Tensor a, Tensor offsets, ScalarType out_dtype) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.impl("grouped_gemm", _grouped_gemm, "CompositeExplicitAutograd")
_LIB.impl("grouped_gemm_wgrad", _grouped_wgrad, "CompositeExplicitAutograd")


@torch.library.register_fake("fly_gemm::grouped_gemm", lib=_LIB)
def _(a, b, offsets, out_dtype):
    dtype = _check(a, b, offsets, out_dtype)
    return a.new_empty(a.shape[0], b.shape[1], dtype=dtype)


@torch.library.register_fake("fly_gemm::grouped_gemm_wgrad", lib=_LIB)
def _(grad, a, offsets, out_dtype):
    _check_wgrad(grad, a, offsets, out_dtype)
    return a.new_empty(offsets.shape[0], grad.shape[1], a.shape[1], dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    a, b, offsets, _ = inputs
    ctx.save_for_backward(a, b, offsets)


def _backward(ctx, grad):
    a, b, offsets = ctx.saved_tensors
    g = grad if grad.dtype == a.dtype else grad.to(a.dtype)
    da = db = None
    if ctx.needs_input_grad[0]:
        da = torch.ops.fly_gemm.grouped_gemm(g, b.transpose(1, 2), offsets, a.dtype)  # [M, N] @ b[g] [N, K]
    if ctx.needs_input_grad[1]:
        db = torch.ops.fly_gemm.grouped_gemm_wgrad(g, a, offsets, b.dtype)
    return da, db, None, None


torch.library.register_autograd("fly_gemm::grouped_gemm", _backward, setup_context=_setup_context, lib=_LIB)
