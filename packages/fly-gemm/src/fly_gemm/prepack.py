"""Prepared weights: :func:`prepack` turns a weight into a :class:`PackedWeight` once, for every later
:func:`fly_gemm.gemm`, :func:`fly_gemm.linear` and :class:`fly_gemm.FlyLinear` call.

Packing lays the weight out as the fast path reads it (``[N, K]``, contiguous: K-major rows that the TMA
kernel addresses and Hopper's 8-bit tensor cores take directly) and, optionally, quantizes it to fp8 e4m3
or int8 with one fp32 scale per output channel (per row of the ``[N, K]`` weight). A 16-bit activation
multiplied by a quantized weight is itself quantized per row on the fly (dynamic per-token scales, one
pass of :func:`flydsl_common.quant.quantize_per_token`) and both scales are applied in the GEMM's epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flydsl.checks import check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError
from flydsl_common.quant import quantize_per_token

__all__ = ["PackedWeight", "prepack", "B_LAYOUTS"]

_QUANT = (torch.float8_e4m3fn, torch.int8)
_GEMM_IN = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)  # what gemm multiplies
_FLOAT_IN = (torch.float16, torch.bfloat16, torch.float32)  # what quantize_per_token reads
B_LAYOUTS = ("nk", "kn")  # b given as [N, K] (the seed's convention, C = A @ B^T) or as [K, N]


@dataclass(frozen=True)
class PackedWeight:
    """A weight prepared by :func:`prepack`: ``weight`` ``[N, K]`` contiguous in its compute dtype and, when
    quantized, ``scale`` ``[N]`` fp32 (``weight * scale[:, None]`` approximates the original)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def quantized(self) -> bool:
        return self.scale is not None


def prepack(b: torch.Tensor, *, b_layout: str = "nk", quant: torch.dtype | None = None) -> PackedWeight:
    """Prepare weight ``b`` once for the GEMM's fast path.

    Args:
        b: ``[N, K]`` (``b_layout="nk"``) or ``[K, N]`` (``"kn"``); any strides. Without ``quant``: fp16 /
            bf16, or fp8 e4m3 / int8 taken as they are (no scale); with ``quant``: fp16 / bf16 / fp32.
        quant: None, ``torch.float8_e4m3fn`` or ``torch.int8``: quantize the weight per output channel (one
            fp32 scale a row of the ``[N, K]`` weight).

    Raises:
        flydsl.errors.DTypeError / ShapeError / ArgumentError naming the argument (for example an fp32 or
        fp64 weight without ``quant``: gemm has no kernel for it).

    Returns:
        A :class:`PackedWeight` (``[N, K]``, contiguous), reused by every call it is passed to.

    Example::

        w8 = prepack(w, quant=torch.float8_e4m3fn)   # w [N, K] bf16
        y = gemm(x, w8)                               # x [M, K] bf16: quantized per row on the fly
    """
    check_tensor("b", b, ndim=2)
    if b_layout not in B_LAYOUTS:
        raise ArgumentError(f"b_layout: expected one of {list(B_LAYOUTS)}, got {b_layout!r}")
    if quant is not None and quant not in _QUANT:
        raise DTypeError(f"quant: expected None, torch.float8_e4m3fn or torch.int8, got {quant!r}")
    allowed = _FLOAT_IN if quant is not None else _GEMM_IN
    if b.dtype not in allowed:
        names = " / ".join(dtype_name(d) for d in allowed)
        why = f"quantizing to {dtype_name(quant)} reads" if quant is not None else "gemm takes"
        raise DTypeError(f"b: expected dtype {names} ({why} these), got {describe(b)}")
    w = (b if b_layout == "nk" else b.t()).contiguous()
    if quant is None:
        return PackedWeight(w)
    if w.is_meta:  # shapes only: the quantized codes and one scale a row, as quantize_per_token gives
        return PackedWeight(torch.empty_like(w, dtype=quant), w.new_empty(w.shape[0], dtype=torch.float32))
    q, scale = quantize_per_token(w, quant)
    return PackedWeight(q, scale)
