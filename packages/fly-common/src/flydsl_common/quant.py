"""Dynamic quantization to int8 / fp8 e4m3: per token (per row) and per tensor.

    q, scale = quantize_per_token(x, torch.int8)          # scale: x.shape[:-1], fp32
    q, scale = quantize_per_tensor(x, torch.float8_e4m3fn) # scale: 0-d fp32
    x ~= q.float() * scale[..., None]                       # dequantization

Symmetric scheme: ``scale = amax / QMAX`` with QMAX = 127 (int8) or 448
(fp8 e4m3), ``q = saturate(round(x * QMAX / amax))``; a row (tensor) of zeros
gets scale 0 and q = 0, so dequantization is exact there.

One row kernel serves every mode (the row stays in registers between its
absolute-max reduction and the quantized write when it fits; wider rows are
read twice, the second time mostly from L2):

- per token: amax of each row -> its scale, then q;
- per tensor: (1) amax of each row, (2) one program reduces them to the
  scale, (3) q with that scale. A given ``scale=`` skips (1) and (2).
"""

from __future__ import annotations

import dataclasses

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.checks import check_last_dim_contiguous, check_tensor, describe
from flydsl.errors import DTypeError, ShapeError

from .device import (
    FP8_E4M3_MAX,
    INT8_MAX,
    absmax_f32,
    cast_sat_fp8e4m3,
    cast_sat_int8,
    inverse_scale,
    maximum_nan,
    quant_scale,
)
from .rows import RowConfig, as_rows, default_row_config

__all__ = [
    "quantize_per_token",
    "quantize_per_tensor",
    "QuantConfig",
    "default_quant_config",
    "QUANT_DTYPES",
    "INPUT_DTYPES",
]

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_MODE_TOKEN = 0  # write q and a per-row scale
_MODE_AMAX = 1  # write the per-row amax only
_MODE_STATIC = 2  # write q with the scale read from s_ptr[0]


# ------------------------------------------------------------------ kernels


@flyc.func
def _quant_chunk(x, inv, OUT_INT8: fx.constexpr):
    v = x * inv
    if OUT_INT8:
        return cast_sat_int8(v)
    else:
        return cast_sat_fp8e4m3(v)


@flyc.kernel(do_not_specialize=["M"])
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    N,
    stride_x,
    stride_q,
    QMAX: fx.constexpr,
    OUT_INT8: fx.constexpr,
    MODE: fx.constexpr,
    BLOCK_M: fx.constexpr,
    BLOCK_N: fx.constexpr,
    SINGLE_PASS: fx.constexpr,
):
    pid = fx.program_id(0)
    rows = pid * BLOCK_M + fx.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(fx.int64)
    cols = fx.arange(0, BLOCK_N)
    x_rows = x_ptr + rows64[:, None] * stride_x
    q_rows = q_ptr + rows64[:, None] * stride_q

    if MODE == 2:
        amax = fx.zeros([BLOCK_M], dtype=fx.float32)  # unused
        scale = fx.load(s_ptr).to(fx.float32)
        r = 1.0 / fx.where(scale > 0, scale, 1.0)
        # 0 where 1 / scale overflows (a scale below 2^-128), as device.inverse_scale: codes 0, not saturated
        inv = fx.where((scale > 0) & (r < float("inf")), r, 0.0) + fx.zeros([BLOCK_M], dtype=fx.float32)
    elif SINGLE_PASS:
        mask = row_ok[:, None] & (cols[None, :] < N)
        x = fx.load(x_rows + cols[None, :], mask=mask, other=0.0).to(fx.float32)
        amax = absmax_f32(x, 1)
        inv = inverse_scale(amax, QMAX)
    else:
        amax = fx.zeros([BLOCK_M], dtype=fx.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < N)
            xc = fx.load(x_rows + c[None, :], mask=mask, other=0.0)
            amax = maximum_nan(amax, absmax_f32(xc, 1))
        inv = inverse_scale(amax, QMAX)

    if MODE == 1:
        fx.store(s_ptr + rows, amax, mask=row_ok)
    else:
        if MODE == 0:
            fx.store(s_ptr + rows, quant_scale(amax, QMAX), mask=row_ok)
        if SINGLE_PASS and MODE == 0:
            mask = row_ok[:, None] & (cols[None, :] < N)
            fx.store(q_rows + cols[None, :], _quant_chunk(x, inv[:, None], OUT_INT8), mask=mask)
        else:
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_ok[:, None] & (c[None, :] < N)
                xc = fx.load(x_rows + c[None, :], mask=mask, other=0.0).to(fx.float32)
                fx.store(q_rows + c[None, :], _quant_chunk(xc, inv[:, None], OUT_INT8), mask=mask)


@flyc.kernel(do_not_specialize=["M"])
def _amax_to_scale_kernel(amax_ptr, scale_ptr, M, QMAX: fx.constexpr, BLOCK: fx.constexpr):
    """One program: scale = max(amax[0:M]) / QMAX."""
    offs = fx.arange(0, BLOCK)
    acc = fx.zeros([BLOCK], dtype=fx.float32)
    for start in range(0, M, BLOCK):
        acc = maximum_nan(acc, fx.load(amax_ptr + start + offs, mask=start + offs < M, other=0.0))
    fx.store(scale_ptr, quant_scale(absmax_f32(acc, 0), QMAX))


# ------------------------------------------------------------ config choice


# The row kernel's configuration space and its measured default ladder are
# shared with the other row kernels (flydsl_common.rows).
QuantConfig = RowConfig


def default_quant_config(n: int, elem_bytes: int, arch: str = "sm_90") -> RowConfig:
    """Pure heuristic of (row width, element size, arch) used when no config is given."""
    del elem_bytes  # one ladder serves every input width measured so far
    return default_row_config(n, arch)


# --------------------------------------------------------------- host launch


def _qmax(dtype: torch.dtype) -> float:
    return INT8_MAX if dtype == torch.int8 else FP8_E4M3_MAX


@flyc.jit(skip_empty=False)
def _launch_rows(x2, q2, s, mode: int, qdtype: torch.dtype, cfg: QuantConfig, stream=None):
    m, n = x2.shape
    grid = (flyc.cdiv(m, cfg.block_m),)
    flyc.launch(
        _quant_rows_kernel, grid,
        x2,
        q2,
        s,
        m,
        n,
        x2.stride(0),
        q2.stride(0),
        QMAX=_qmax(qdtype),
        OUT_INT8=qdtype == torch.int8,
        MODE=mode,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SINGLE_PASS=cfg.single_pass,
        **cfg.launch_options(),
    )


@flyc.jit(skip_empty=False)
def _launch_amax_to_scale(amax, scale, qdtype: torch.dtype, stream=None):
    flyc.launch(_amax_to_scale_kernel, (1,), amax, scale, amax.numel(), QMAX=_qmax(qdtype), BLOCK=1024, num_warps=4)


def _check(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    check_tensor("x", x, dtypes=INPUT_DTYPES, min_ndim=1)
    if dtype not in QUANT_DTYPES:
        raise DTypeError(f"dtype: expected torch.int8 or torch.float8_e4m3fn, got {dtype}")
    check_last_dim_contiguous("x", x)
    return x


def quantize_per_token(
    x: torch.Tensor, dtype: torch.dtype = torch.int8, *, config: QuantConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last dimension) of ``x`` with its own scale.

    Args:
        x: fp32/fp16/bf16 tensor ``[..., N]``; the last dim must be contiguous,
           rows may be strided.
        dtype: ``torch.int8`` (QMAX 127) or ``torch.float8_e4m3fn`` (QMAX 448).
        config: launch configuration (default: :func:`default_quant_config`).

    Returns:
        ``(q, scale)``: ``q`` of ``x``'s shape in ``dtype`` (contiguous) and
        ``scale`` of shape ``x.shape[:-1]`` in fp32, with ``x ~= q * scale[..., None]``.

    Example::

        q, s = quantize_per_token(torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16))
    """
    _check(x, dtype)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x.numel() == 0:  # rows of no columns: an all-zero row's scale, 0
        return q, scale.zero_()
    if x.is_meta:  # shapes and dtypes only
        return q, scale
    x2 = as_rows(x)
    cfg = config or default_quant_config(x2.shape[1], x.element_size())
    _launch_rows(x2, q.view(-1, x.shape[-1]), scale, _MODE_TOKEN, dtype, cfg)
    return q, scale


def quantize_per_tensor(
    x: torch.Tensor,
    dtype: torch.dtype = torch.int8,
    *,
    scale: torch.Tensor | None = None,
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale for the whole tensor.

    Args:
        x: fp32/fp16/bf16 tensor ``[..., N]`` (last dim contiguous).
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        scale: optional precomputed scale (one fp32 element, on x's device);
            given, x is read once (static quantization); otherwise the scale
            is ``amax(|x|) / QMAX`` (dynamic: x is read twice).

    Returns:
        ``(q, scale)`` with ``scale`` a 0-d fp32 tensor and ``x ~= q * scale``.
    """
    _check(x, dtype)
    if scale is not None:
        check_tensor("scale", scale, dtypes=(torch.float32,), device=x.device)
        if scale.numel() != 1:
            raise ShapeError(f"scale: expected a single element, got {describe(scale)}")
        scale_t = scale.reshape(())
    else:
        scale_t = torch.empty((), dtype=torch.float32, device=x.device)
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0 or x.is_meta:  # nothing to quantize (a dynamic scale of nothing is 0), or shapes only
        if scale is None and not x.is_meta:
            scale_t.zero_()
        return q, scale_t
    x2 = as_rows(x)
    q2 = q.view(-1, x.shape[-1])
    cfg = config or default_quant_config(x2.shape[1], x.element_size())
    if scale is None:
        amax = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        _launch_rows(x2, q2, amax, _MODE_AMAX, dtype, cfg)
        _launch_amax_to_scale(amax, scale_t, dtype)
    if cfg.single_pass:  # the static path always streams the row once
        cfg = dataclasses.replace(cfg, single_pass=False)
    _launch_rows(x2, q2, scale_t, _MODE_STATIC, dtype, cfg)
    return q, scale_t
