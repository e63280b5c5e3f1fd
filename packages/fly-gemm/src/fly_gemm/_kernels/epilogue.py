"""The GEMM kernels' shared epilogue, in fp32 on the accumulator before the one downcast::

    c = act(acc * scale_a[m] * scale_b[n] + bias[n])

Each scale is per-tensor (one value), per-row of A / per-column of C, or absent; the bias is per column.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import activation, row_offset

__all__ = ["SCALE_NONE", "SCALE_TENSOR", "SCALE_VECTOR", "scale_mode", "epilogue_meta", "epilogue", "store_c"]

SCALE_NONE = 0  # no scale
SCALE_TENSOR = 1  # one value for the whole operand
SCALE_VECTOR = 2  # one value a row of A (scale_a[M]) or a column of C (scale_b[N])


def scale_mode(s) -> int:
    """Host side: the SCALE_* code of a scale tensor (flattened, fp32) or None."""
    if s is None:
        return SCALE_NONE
    return SCALE_TENSOR if s.numel() == 1 else SCALE_VECTOR


def epilogue_meta(scale_a, scale_b, bias, act: int) -> dict:
    """Host side: the epilogue's constexprs (SCALE_A, SCALE_B, HAS_BIAS, ACT) for a launch."""
    return {"SCALE_A": scale_mode(scale_a), "SCALE_B": scale_mode(scale_b), "HAS_BIAS": bias is not None, "ACT": act}


@flyc.func
def _scaled(acc, s_ptr, idx, ok, MODE: fx.constexpr, AXIS: fx.constexpr):
    """acc times the scale of its rows (AXIS 0) or columns (AXIS 1)."""
    if MODE == 1:
        acc = acc * fx.load(s_ptr).to(fx.float32)
    elif MODE == 2:
        s = fx.load(s_ptr + idx, mask=ok, other=0.0).to(fx.float32)
        if AXIS == 0:
            acc = acc * s[:, None]
        else:
            acc = acc * s[None, :]
    return acc


@flyc.func
def epilogue(
    acc, rm, rn, m_ok, n_ok, sa_ptr, sb_ptr, bias_ptr,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr,
):  # fmt: skip
    """The fp32 tile ``act(acc * scale_a[rm] * scale_b[rn] + bias[rn])`` (rows ``rm``, columns ``rn``)."""
    out = _scaled(acc.to(fx.float32), sa_ptr, rm, m_ok, SCALE_A, 0)
    out = _scaled(out, sb_ptr, rn, n_ok, SCALE_B, 1)
    if HAS_BIAS:
        out += fx.load(bias_ptr + rn, mask=n_ok, other=0.0).to(fx.float32)[None, :]
    return activation(out, ACT)


@flyc.func
def store_c(
    acc, rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr, RAW: fx.constexpr,
):  # fmt: skip
    """Store the accumulator tile at rows ``rm``, columns ``rn`` of C through pointers (masked): as it is
    (``RAW``: the int8 product as int32), else through :func:`epilogue` and one downcast to C's dtype."""
    c_ptrs = c_ptr + row_offset(rm, stride_cm)[:, None] + row_offset(rn, stride_cn)[None, :]
    c_ok = m_ok[:, None] & n_ok[None, :]
    if RAW:
        fx.store(c_ptrs, acc, mask=c_ok)
    else:
        out = epilogue(acc, rm, rn, m_ok, n_ok, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS, ACT)
        fx.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=c_ok)
