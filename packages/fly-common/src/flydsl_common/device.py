"""Device building blocks shared by the kernel families.

Every helper here is a ``@flyc.func`` (a Triton device function), written
against ``flydsl.expr`` only, and runs both compiled and in the interpreter
(which is why nothing here uses libdevice: the interpreter has no libdevice; PTX inline
assembly is used only where kernels compile for NVIDIA, with a portable twin).

- row addressing in int64, so M x N past 2**31 never overflows;
- the absolute max of a row in fp32, and the quantizers' scale and inverse scale from it, correctly rounded;
- round-half-to-even and saturating casts to int8 and fp8 e4m3;
- epilogue activations on fp32 values, selected by a constexpr code;
- programmatic dependent launch (wait, let dependents launch) and L2 prefetch, on NVIDIA.

What lives here is used by several families or by this package's own quantization kernels; a helper
one family alone uses lives in that family (fly-norm keeps its exchange between the programs of a
resident wave and its packed bf16 pairs), one only tests use in the tests.
"""

from __future__ import annotations

import torch

import flydsl
import flydsl.compiler as flyc
import flydsl.expr as fx

__all__ = [
    "ACTIVATIONS",
    "ACT_GELU_ERF",
    "ACT_GELU_TANH",
    "ACT_NONE",
    "ACT_RELU",
    "ACT_SILU",
    "FP8_E4M3_MAX",
    "INT8_MAX",
    "INTERPRET",
    "PTX",
    "absmax_f32",
    "activation",
    "activation_code",
    "cast_sat_fp8e4m3",
    "cast_sat_int8",
    "fast_exp2",
    "fast_rcp",
    "inverse_scale",
    "maximum_nan",
    "normal_cdf",
    "pdl_launch_dependents",
    "pdl_wait",
    "prefetch_l2",
    "quant_scale",
    "round_half_even",
    "row_offset",
]

# Activation codes (constexpr ints in kernels; names on the host, see ACTIVATIONS).
ACT_NONE = 0
ACT_RELU = 1
ACT_SILU = 2
ACT_GELU_TANH = 3
ACT_GELU_ERF = 4

ACTIVATIONS = {
    None: ACT_NONE,
    "none": ACT_NONE,
    "relu": ACT_RELU,
    "silu": ACT_SILU,
    "gelu_tanh": ACT_GELU_TANH,
    "gelu": ACT_GELU_ERF,  # torch.nn.functional.gelu's default form
    "gelu_erf": ACT_GELU_ERF,
}

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
# Device-side copies: globals a kernel reads must be constexpr.
_INT8_MAX = fx.constexpr(INT8_MAX)
_FP8_MAX = fx.constexpr(FP8_E4M3_MAX)
# Adding and subtracting 1.5 * 2**23 rounds an fp32 of magnitude < 2**22 to the
# nearest integer, ties to even (the rounding of the fp32 add itself).
_RNE_MAGIC = fx.constexpr(12582912.0)
# Kernels run in Triton's interpreter (whose own conversions differ from the hardware's in places).
INTERPRET = fx.constexpr(flydsl.interpreting())
# Compiled for NVIDIA: device code may use PTX inline assembly (here: one-instruction conversions and
# approximations; the families' own kernels: their decodes and waits). One flag for every package.
PTX = fx.constexpr(not flydsl.interpreting() and torch.version.hip is None)


# ---------------------------------------------------------------- addressing


@flyc.func
def row_offset(row, stride):
    """Element offset of ``row`` for a row stride, computed in int64."""
    return fx.cast(row, fx.int64) * stride  # fx.cast: also a plain int (an interpreted loop index)


# ---------------------------------------------------------------- reductions


@flyc.func
def maximum_nan(a, b):
    """Elementwise max, NaN where either is NaN (to carry a row's max |x| across chunks: then
    :func:`absmax_f32` of the lanes)."""
    return fx.maximum(a, b, propagate_nan=fx.PropagateNan.ALL)


@flyc.func
def absmax_f32(x, axis: fx.constexpr):
    """max |x| along ``axis`` in fp32, NaN where x holds a NaN, in one integer max reduction: |x| has its sign
    bit clear, so its bits order as int32 as the values do, and a NaN's bits (exponent all ones, mantissa not
    0) sit above +inf's, where a float max would drop the NaN. Also the merge of partial maxima (values
    >= 0 or NaN, any NaN's sign cleared by the abs)."""
    bits = fx.abs(x.to(fx.float32)).to(fx.int32, bitcast=True)
    return fx.max(bits, axis=axis).to(fx.float32, bitcast=True)


# Both quotients are correctly rounded (div_rn), not Triton's `/` (the GPU's approximate division, within
# 2 ulp): the codes are round(x * inverse_scale), and 16-bit rows put many elements exactly on a rounding
# tie of x * QMAX / amax (a row's maximum is itself a 16-bit value: bf16 rows quantized to e4m3 have
# several percent of their elements on a tie), where one ulp of the inverse picks the code. Correctly
# rounded, the codes and scales are torch's ``x * (QMAX / amax)`` and ``amax / QMAX`` bit for bit, on
# every target; a downstream GEMM then matches its reference to the summation order, where a flipped code
# here moves a whole output row.
#
# A row whose amax is so small that QMAX / amax passes fp32's range (amax below QMAX / FLT_MAX: ~3.7e-37
# for int8, 1.3e-36 for e4m3) gets the inverse 0, so its codes are 0 and it dequantizes to 0, off by less
# than its own values' size. The infinite inverse would saturate every code and turn a zero into a NaN
# (0 * inf), and the scale of such a row, amax / QMAX, is subnormal anyway.
@flyc.func
def inverse_scale(amax, QMAX: fx.constexpr):
    """QMAX / amax in fp32, correctly rounded; 0 for amax = 0 (an all-zero row's codes are then 0) and where
    the quotient overflows (rows of values below ~1e-36: codes 0)."""
    safe = fx.where(amax > 0, amax, 1.0)
    inv = fx.div_rn(fx.zeros_like(safe) + QMAX, safe)
    return fx.where((amax > 0) & (inv < float("inf")), inv, 0.0)


@flyc.func
def quant_scale(amax, QMAX: fx.constexpr):
    """amax / QMAX in fp32, correctly rounded: the scale stored beside the codes."""
    return fx.div_rn(amax, fx.zeros_like(amax) + QMAX)


# ----------------------------------------------------------------- rounding


@flyc.func
def round_half_even(x):
    """Nearest integer (ties to even) of fp32 ``x`` with |x| < 2**22; larger values are returned unchanged."""
    r = (x + _RNE_MAGIC) - _RNE_MAGIC
    return fx.where(fx.abs(x) < 4194304.0, r, x)


@flyc.func
def cast_sat_int8(x):
    """fp32 -> int8: round half to even, saturate to [-127, 127] (symmetric, so -x quantizes to -q)."""
    if PTX:  # one cvt.rni (round to nearest, ties to even), which also saturates at 127
        return fx.inline_asm_elementwise(
            "cvt.rni.sat.s8.f32 $0, $1;", "=r,r", [fx.maximum(x, -_INT8_MAX)], dtype=fx.int32, is_pure=True, pack=1
        ).to(fx.int8)
    c = fx.minimum(fx.maximum(x, -_INT8_MAX), _INT8_MAX)
    return ((c + _RNE_MAGIC) - _RNE_MAGIC).to(fx.int8)  # |c| <= 127: exact, ties to even


@flyc.func
def _fp8e4m3_bits(c):
    """Round-half-even e4m3fn encoding (as int32) of fp32 ``c`` with |c| <= 448, by integer arithmetic."""
    bits = c.to(fx.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    a = fx.abs(c)
    # Normal range (a >= 2**-6): keep 3 of the 23 mantissa bits, rounding half to even;
    # a carry out of the mantissa correctly bumps the exponent.
    exp8 = (mag >> 23) - 127 + 7
    mant = mag & 0x7FFFFF
    m3 = mant >> 20
    rem = mant & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((m3 & 1) == 1))
    normal = (exp8 << 3) + m3 + up.to(fx.int32)
    # Subnormal range: multiples of 2**-9; scaling by 512 is exact.
    sub = round_half_even(a * 512.0).to(fx.int32)
    code = fx.where(a >= 0.015625, normal, sub)
    return sign | code


@flyc.func
def cast_sat_fp8e4m3(x):
    """fp32 -> fp8 e4m3 (fn), round half to even, saturating to +-448 (the hardware conversion gives NaN)."""
    c = fx.minimum(fx.maximum(x, -_FP8_MAX), _FP8_MAX)
    if INTERPRET:
        # The interpreter's own fp32 -> fp8 conversion is wrong for many values;
        # build the encoding exactly instead.
        return _fp8e4m3_bits(c).to(fx.uint8).to(fx.float8e4nv, bitcast=True)
    else:
        return c.to(fx.float8e4nv)


# --------------------------------------------------------------- activations


@flyc.func
def fast_exp2(x):
    """2**x in fp32. Compiled for NVIDIA: one ``ex2.approx.ftz`` (relative error ~2**-22; results below
    2**-126 flush to 0), where ``fx.exp2`` adds subnormal fix-ups around it; elsewhere ``fx.exp2``."""
    if PTX:
        return fx.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=fx.float32, is_pure=True, pack=1
        )
    else:
        return fx.exp2(x)


@flyc.func
def fast_rcp(x):
    """1 / x in fp32. Compiled for NVIDIA: one ``rcp.approx.ftz`` (within 1 ulp), where ``/`` is an IEEE
    division of a dozen instructions; elsewhere ``1 / x``."""
    if PTX:
        return fx.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=fx.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


# --------------------------------------------- programmatic dependent launch (sm_90+)


@flyc.func
def pdl_launch_dependents():
    """Let the next kernel on the stream launch once every program of this one has called this (or
    exited); a no-op unless this kernel was launched with ``launch_pdl`` (and outside NVIDIA)."""
    if PTX:
        fx.extra.cuda.gdc_launch_dependents()


@flyc.func
def pdl_wait():
    """Wait until the kernel before this one on the stream has finished and its writes are visible.
    A kernel launched with ``launch_pdl`` may start early: it must call this before it reads what that
    kernel may write, and before it writes anything."""
    if PTX:
        fx.extra.cuda.gdc_wait()


@flyc.func
def prefetch_l2(ptrs, ok, base):
    """Ask L2 for the 128-byte lines at ``ptrs`` where ``ok`` (elsewhere at ``base``, a valid address):
    nothing is loaded into registers or waited for. NVIDIA only; elsewhere nothing."""
    if PTX:
        addr = fx.where(ok, ptrs, base)
        fx.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr], dtype=fx.int32, is_pure=False, pack=1
        )


@flyc.func
def normal_cdf(x):
    """Phi(x), the standard normal CDF, in fp32: ``0.5 * erfc(|x| / sqrt(2))`` on the negative side,
    ``1 -`` that on the positive side, with erfc from Abramowitz & Stegun 7.1.26 (erf within 1.5e-7).

    Taking erfc directly keeps the negative tail's relative accuracy, which ``0.5 * (1 + erf(x/sqrt 2))``
    loses to cancellation (torch's fp32 formula: 100% relative error below x = -5). Against the exact
    value, x * Phi(x) is within 6e-7 relative for x >= 0, 5.3e-5 on [-3, 0] and 3.6e-3 on [-6, -3]
    (with PTX's approximate reciprocal and exp2, the tests hold it to 2e-6, 1e-4 and 5e-3).
    Costs one reciprocal and one exp2: in the sm_90 GEMM epilogue, about a third of the instructions of
    libdevice's erf."""
    t = fast_rcp(1.0 + 0.23164189758681058 * fx.abs(x))  # A&S's p = 0.3275911 over sqrt(2)
    # A&S's a1..a5 halved: q = 0.5 * erfc(|x| / sqrt 2) = Phi(-|x|)
    q = t * (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145))))
    q = q * fast_exp2(x * x * -0.7213475204444817)  # exp(-x^2 / 2)
    return fx.where(x < 0, q, 1.0 - q)


@flyc.func
def activation(x, ACT: fx.constexpr):
    """Apply activation ``ACT`` (an ACT_* code) to fp32 ``x``."""
    if ACT == 1:  # relu; NaN stays NaN as in torch (the GPU's plain max returns the other operand: 0)
        return fx.maximum(x, 0.0, propagate_nan=fx.PropagateNan.ALL)
    elif ACT == 2:  # silu
        return x * fast_rcp(1.0 + fast_exp2(x * -1.4426950408889634))
    elif ACT == 3:  # gelu, tanh approximation: 0.5 * (1 + tanh(u)) = sigmoid(2u), no cancellation for x < 0
        u2 = x * (-2.302208198144325 + x * x * -0.1029432395800235)  # -2u log2(e), u = sqrt(2/pi) (x + 0.044715 x^3)
        return x * fast_rcp(1.0 + fast_exp2(u2))
    elif ACT == 4:  # gelu, exact (erf) form
        return x * normal_cdf(x)
    else:
        return x


def activation_code(name) -> int:
    """Host side: activation name ("relu", "silu", "gelu_tanh", "gelu"/"gelu_erf", None) -> ACT_* code."""
    from flydsl.errors import ArgumentError

    try:
        return ACTIVATIONS[name if name is None else str(name).lower()]
    except KeyError:
        names = sorted(k for k in ACTIVATIONS if k is not None)
        raise ArgumentError(f"activation: expected None or one of {names}, got {name!r}") from None
