"""``gemm``: C = A @ B^T with scales, bias and activation fused, for fp16, bf16, fp8 e4m3 and int8.

In the order of the family's files: the kernels live in :mod:`._kernels`
(``persistent``: the TMA kernel of Hopper, for operands TMA can address;
``tiled``: the pointer-based kernel that serves every shape, stride and GPU),
then the config choice (:mod:`.autotune`), then the host API below: argument
checks (every bad input is named before anything launches), output
allocation and dispatch.
"""

from __future__ import annotations

import torch

import flydsl.arch
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError
from flydsl_common.device import activation_code

from ._kernels.persistent import launch_persistent, tma_eligible
from ._kernels.tiled import launch_tiled
from .autotune import GemmConfig, config_valid, default_config

__all__ = ["gemm", "IN_DTYPES", "B_LAYOUTS"]

IN_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
_FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)
B_LAYOUTS = ("nk", "kn")  # b given as [N, K] (the seed's convention, C = A @ B^T) or as [K, N]


def _check_scale(name: str, s, length: int, what: str, device):
    """A scale: fp32, one element (per-tensor) or ``length`` elements (per row / column); flattened."""
    if s is None:
        return None
    check_tensor(name, s, dtypes=(torch.float32,), device=device)
    if s.numel() != 1 and (s.numel() != length or sum(d != 1 for d in s.shape) > 1):
        raise ShapeError(f"{name}: expected one value (per-tensor) or {length} values (one per {what}), "
                         f"got {describe(s)}")  # fmt: skip
    return s.reshape(-1)


def _out_dtype(in_dtype, out_dtype, out, scaled: bool, epilogue: bool) -> torch.dtype:
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else (in_dtype if in_dtype.itemsize == 2 else torch.bfloat16)
    if out_dtype in _FLOAT_OUT:
        return out_dtype
    if out_dtype == torch.int32 and in_dtype == torch.int8:
        if scaled or epilogue:
            raise ArgumentError("out_dtype: int32 output is the raw int8 product; it takes no scales, bias or "
                                "activation (ask for a float out_dtype to apply them)")  # fmt: skip
        return out_dtype
    allowed = [dtype_name(d) for d in _FLOAT_OUT] + (["int32"] if in_dtype == torch.int8 else [])
    raise DTypeError(f"out_dtype: expected one of {allowed} for {dtype_name(in_dtype)} inputs, got {out_dtype}")


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    b_layout: str = "nk",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``C = act((A @ B^T) * scale_a * scale_b + bias)``, accumulated in fp32 (int32 for int8).

    Args:
        a: ``[M, K]``, fp16 / bf16 / fp8 e4m3 / int8; any strides (read in place).
        b: same dtype as ``a``; ``[N, K]`` (``b_layout="nk"``, the default: C = A @ B^T) or ``[K, N]``
            (``b_layout="kn"``: C = A @ B); any strides.
        bias: optional ``[N]``, any float dtype, added in fp32.
        activation: None, ``"relu"``, ``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` (erf form), after the bias.
        out_dtype: output dtype: fp16 / bf16 / fp32 (default: ``a``'s for 16-bit inputs, bf16 for fp8 and
            int8), or int32 for the raw int8 product (no scales, bias or activation).
        scale_a: fp32, one value or ``[M]`` (per row of A); scale_b: fp32, one value or ``[N]`` (per column
            of C). Applied to the accumulator in fp32; the usual fp8 / int8 dequantization scales.
        out: optional ``[M, N]`` output to write (any strides).
        config: a :class:`~fly_gemm.autotune.GemmConfig` to launch with (default: chosen for the shape).

    Returns:
        ``[M, N]`` in ``out_dtype`` (``out`` when given). M = 0 or N = 0 give an empty result; K = 0
        gives ``act(bias)`` (or zeros).

    Example::

        c = gemm(x, w, bias=b, activation="gelu_tanh")   # x [M, K], w [N, K] bf16 -> [M, N] bf16
    """
    check_tensor("a", a, dtypes=IN_DTYPES, ndim=2)
    if b_layout not in B_LAYOUTS:
        raise ArgumentError(f"b_layout: expected one of {list(B_LAYOUTS)}, got {b_layout!r}")
    check_tensor("b", b, ndim=2)
    if b.dtype != a.dtype:
        raise DTypeError(f"b: expected dtype {dtype_name(a.dtype)} (a's), got {describe(b)}")
    b_nk = b if b_layout == "nk" else b.t()
    m, k = a.shape
    n = b_nk.shape[0]
    if b_nk.shape[1] != k:
        want = f"[N, {k}]" if b_layout == "nk" else f"[{k}, N]"
        raise ShapeError(f"b: expected {want} (a is [{m}, {k}], b_layout={b_layout!r}), got {describe(b)}")
    device = check_same_device(a=a, b=b, bias=bias, scale_a=scale_a, scale_b=scale_b, out=out)
    if bias is not None:
        check_tensor("bias", bias, dtypes=_FLOAT_OUT, ndim=1)
        if bias.shape[0] != n:
            raise ShapeError(f"bias: expected [{n}] (one per column of C), got {describe(bias)}")
    sa = _check_scale("scale_a", scale_a, m, "row of a", device)
    sb = _check_scale("scale_b", scale_b, n, "column of c", device)
    act = activation_code(activation)
    dtype = _out_dtype(a.dtype, out_dtype, out, sa is not None or sb is not None, bias is not None or act != 0)
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=device)
    else:
        check_tensor("out", out, dtypes=(dtype,), ndim=2)
        if tuple(out.shape) != (m, n):
            raise ShapeError(f"out: expected [{m}, {n}], got {describe(out)}")
    arch = flydsl.arch.current(device)
    cfg = config or default_config(m, n, k, a.dtype, arch)
    if not config_valid(cfg, a.dtype, arch, out.element_size()):
        raise ArgumentError(f"config: {cfg} is not a valid launch config for {dtype_name(a.dtype)} on {arch.name}")
    if cfg.tma and tma_eligible(a, b, out):
        launch_persistent(a, b, out, bias, sa, sb, act, b_layout == "kn", cfg)
    else:  # every other shape, stride and GPU: the pointer-based kernel
        launch_tiled(a, b_nk, out, bias, sa, sb, act, cfg)
    return out
