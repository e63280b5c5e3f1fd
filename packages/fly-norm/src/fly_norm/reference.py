"""fp32/fp64 references of every fly-norm op, used by tests and benchmarks alike.

Forward references compute in float64 and return float64; gradients come
from torch autograd through these same functions (so a test compares a
kernel's backward with the exact derivative of the reference).
"""

from __future__ import annotations

import torch

from flydsl_common.reference import quantize_per_token_ref

__all__ = [
    "rms_norm_ref",
    "layer_norm_ref",
    "softmax_ref",
    "softmax_bwd_ref",
    "rms_norm_quant_ref",
    "layer_norm_quant_ref",
]


def _pre_add(x: torch.Tensor, residual: torch.Tensor | None, h_dtype: torch.dtype | None) -> torch.Tensor:
    """h = x (+ residual) in fp64; with a residual, rounded to the dtype residual_out stores it in (``h_dtype``,
    default the residual's): the kernels normalize the stored sum, as torch's ``norm(x + residual)`` does. The
    gradient passes through the rounding unchanged (fp64 leaves with ``h_dtype`` give the gradient of what the
    kernels compute)."""
    h = x.double()
    if residual is None:
        return h
    h = h + residual.double()
    return h + (h.to(h_dtype or residual.dtype).double() - h).detach()


def rms_norm_ref(x, weight, eps=1e-6, residual=None, weight_offset=0.0, *, h_dtype=None):
    """y = h / sqrt(mean(h^2) + eps) * (weight + weight_offset), h = x (+ residual) rounded to ``h_dtype``
    (residual_out's dtype, default the residual's); returns y or (y, h)."""
    h = _pre_add(x, residual, h_dtype)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = h * rstd
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    return y if residual is None else (y, h)


def layer_norm_ref(x, weight, bias, eps=1e-5, residual=None, weight_offset=0.0, *, h_dtype=None):
    """y = (h - mean) / sqrt(var + eps) * (weight + weight_offset) + bias, h as in :func:`rms_norm_ref`;
    returns y or (y, h). The mean is the fp64 sum divided by the width, correctly rounded: torch's CUDA mean
    multiplies by a rounded 1 / n, which leaves rows of one value an ulp from their mean (y ~1e-16 where the
    kernels give the exact 0), and so does its division by a Python number (a multiply by its reciprocal):
    the width is divided as a tensor."""
    h = _pre_add(x, residual, h_dtype)
    total = h.sum(-1, keepdim=True)
    mean = total / total.new_full((), h.shape[-1])
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    if bias is not None:
        y = y + bias.double()
    return y if residual is None else (y, h)


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x.double(), dim=dim)


def softmax_bwd_ref(dy: torch.Tensor, y: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) in float64."""
    y64, dy64 = y.double(), dy.double()
    return y64 * (dy64 - (dy64 * y64).sum(dim, keepdim=True))


def _quantized(y64: torch.Tensor, dtype: torch.dtype, smooth_scale=None):
    if smooth_scale is not None:
        y64 = y64 * smooth_scale.double()
    return quantize_per_token_ref(y64.float(), dtype)


def rms_norm_quant_ref(x, weight, eps=1e-6, *, dtype=torch.int8, smooth_scale=None, residual=None):
    """(q, row scale[, residual_out]) of the normalized (and optionally smoothed) rows."""
    out = rms_norm_ref(x, weight, eps, residual)
    y, h = (out, None) if residual is None else out
    q, s = _quantized(y, dtype, smooth_scale)
    return (q, s) if residual is None else (q, s, h)


def layer_norm_quant_ref(x, weight, bias, eps=1e-5, *, dtype=torch.int8, smooth_scale=None, residual=None):
    out = layer_norm_ref(x, weight, bias, eps, residual)
    y, h = (out, None) if residual is None else out
    q, s = _quantized(y, dtype, smooth_scale)
    return (q, s) if residual is None else (q, s, h)
