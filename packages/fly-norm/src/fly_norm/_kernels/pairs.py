"""Values handled two at a time, where one instruction or one exchange between warps can serve both:

- bf16 rows read and written as int32 words of two elements (``as_words``), widened to fp32 pairs
  (``bf16_pairs``, and ``bf16_pairs_again`` / ``bf16_pairs_third``: the same widening through
  instructions the compiler cannot match with the first, so that a row held packed through a reduction
  is widened again after it instead of held twice as large), rounded back to words (``bf16_words``), their
  max taken half by half (``max_bf16_halves``; ``NEG_INF_BF16_PAIR``, what a masked load reads for it), and
  offsets ordered after a value with their vector width kept (``offsets_after``);
- two fp32 reductions in one (``sum2_f32``, ``sum_absmax_f32``): one exchange between warps, not two;
- two saturated 8-bit codes packed in an int16 (``sat_int8_pairs``, ``sat_fp8e4m3_pairs``): two adjacent
  columns of a quantized row stored at once.

Only fly-norm's kernels work on rows this way, so the helpers live here rather than in flydsl-common; the
single-value casts they build on (``cast_sat_int8``, ``cast_sat_fp8e4m3``) are flydsl-common's, shared with
its quantization kernels. On NVIDIA most are one PTX instruction; elsewhere (the interpreter, AMD) each has
a portable twin with the same results.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import PTX, cast_sat_fp8e4m3, cast_sat_int8

__all__ = [
    "NEG_INF_BF16_PAIR",
    "as_words",
    "bf16_pairs",
    "bf16_pairs_again",
    "bf16_pairs_third",
    "bf16_words",
    "max_bf16_halves",
    "offsets_after",
    "sat_fp8e4m3_pairs",
    "sat_int8_pairs",
    "sum2_f32",
    "sum_absmax_f32",
]



# ------------------------------------------------------------ two reductions in one


@flyc.func
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@flyc.func
def sum2_f32(x, y, axis: fx.constexpr):
    """(sum of x, sum of y) in fp32 as one reduction: one exchange between warps instead of two."""
    return fx.reduce((x.to(fx.float32), y.to(fx.float32)), axis, _add_pairs)


@flyc.func
def _add_max(a0, a1, b0, b1):
    return a0 + b0, fx.maximum(a1, b1)


@flyc.func
def sum_absmax_f32(x, y, axis: fx.constexpr):
    """(sum of x, max of |y|) in fp32 as one reduction: one exchange between warps instead of two."""
    return fx.reduce((x.to(fx.float32), fx.abs(y.to(fx.float32))), axis, _add_max)


# ------------------------------------------------------------ packed bf16 pairs


@flyc.func
def as_words(ptr):
    """A 16-bit tensor's pointer viewed as int32 words (two elements each, the even one in the low half):
    how a kernel reads and writes bf16 rows as packed pairs (:func:`bf16_pairs`, :func:`bf16_words`)."""
    return ptr.to(fx.pointer_type(fx.int32), bitcast=True)


@flyc.func
def bf16_pairs(words):
    """(even, odd) elements in fp32 of int32 ``words`` that each hold two bf16 (the even one in the low
    half, as a bf16 row read through an int32 view): bf16 -> fp32 is exact, the bits shifted up by 16."""
    return (words << 16).to(fx.float32, bitcast=True), (words & -65536).to(fx.float32, bitcast=True)


@flyc.func
def bf16_pairs_again(words):
    """:func:`bf16_pairs` of the same words a second time, through instructions the compiler cannot match with
    the first (NVIDIA: two ``prmt``): a kernel that keeps a row packed through a reduction widens it again
    after it, rather than let the compiler hold the fp32 copy (twice the registers) from before. Elsewhere
    :func:`bf16_pairs`."""
    if PTX:
        return fx.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0; prmt.b32 $0, $2, z, 0x1044; prmt.b32 $1, $2, z, 0x3244; }",
            "=r,=r,r", [words], dtype=(fx.float32, fx.float32), is_pure=True, pack=1,
        )  # fmt: skip
    return bf16_pairs(words)


@flyc.func
def bf16_pairs_third(words, zero):
    """:func:`bf16_pairs_again` a third time, for a row held packed through two reductions: the same two
    ``prmt`` with their zero bytes taken from ``zero``, an int32 tensor (broadcasting to ``words``) that is
    0 without the compiler being able to prove it (the sign bit of a positive value, for example). The
    compiler can match neither of the other widenings with it (those shift, or permute a constant zero),
    and cannot compute it before ``zero``. Elsewhere :func:`bf16_pairs`."""
    if PTX:
        return fx.inline_asm_elementwise(
            "prmt.b32 $0, $2, $3, 0x1044; prmt.b32 $1, $2, $3, 0x3244;",
            "=r,=r,r,r", [words, zero], dtype=(fx.float32, fx.float32), is_pure=True, pack=1,
        )  # fmt: skip
    return bf16_pairs(words)


# bf16 -inf in both halves of a word: what a masked load of a row held packed reads for a max
NEG_INF_BF16_PAIR = fx.constexpr(-8323200)  # 0xFF80FF80 as int32


@flyc.func
def max_bf16_halves(a, b):
    """Half by half max of int32 words of two bf16 each. NVIDIA: one ``max.bf16x2`` (a NaN half yields the
    other operand's); elsewhere through fp32."""
    if PTX:
        return fx.inline_asm_elementwise(
            "max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=fx.int32, is_pure=True, pack=1
        )
    ae, ao = bf16_pairs(a)
    be, bo = bf16_pairs(b)
    return bf16_words(fx.maximum(ae, be), fx.maximum(ao, bo))


@flyc.func
def offsets_after(offs, after, VEC: fx.constexpr):
    """Integer offsets ``offs`` ([rows, columns]; along the columns, runs of VEC contiguous values, each
    starting on a multiple of VEC, as from an ``arange``), known to the compiler only once ``after`` is (a
    tensor of their shape, element for element; an operand the instruction does not read). Loads through
    them are then issued after ``after`` is computed, and stay VEC-wide: the hints restore what the opaque
    copy hides from the compiler. A kernel writing a row held in registers part by part orders each
    part's per-column reads after the previous part's results this way, rather than let the compiler
    issue them all at once and hold what they read (NVIDIA; elsewhere ``offs``)."""
    if PTX:
        o = fx.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [offs, after], dtype=fx.int32, is_pure=True,
                                      pack=1)  # fmt: skip
        return fx.max_contiguous(fx.multiple_of(o, [1, VEC]), [1, VEC])
    return offs


@flyc.func
def bf16_words(even, odd):
    """Two fp32 tensors rounded to bf16 (nearest, ties to even) and packed as int32 words, ``even`` in the low
    half: the inverse of :func:`bf16_pairs` (NVIDIA: one ``cvt.rn.bf16x2.f32`` a pair)."""
    if PTX:
        return fx.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [even, odd], dtype=fx.int32, is_pure=True, pack=1
        )
    return (_bf16_rne(even) >> 16) & 65535 | (_bf16_rne(odd) & -65536)


@flyc.func
def _bf16_rne(x):
    """fp32 ``x``'s bits rounded to bf16 in the high half (nearest, ties to even; NaN stays a quiet NaN),
    in integer arithmetic: the same on every backend (the interpreter's own cast truncates)."""
    bits = x.to(fx.int32, bitcast=True)
    rounded = bits + (32767 + ((bits >> 16) & 1))
    return fx.where(x != x, bits | 4194304, rounded)


# ------------------------------------------------- two saturated codes in one int16


@flyc.func
def _byte_pairs(lo, hi):
    """8-bit codes (int8 tensors) packed two to an int16: ``lo`` in the low byte, ``hi`` in the high one."""
    return (lo.to(fx.int16) & 255) | (hi.to(fx.int16) << 8)


@flyc.func
def sat_int8_pairs(even, odd):
    """:func:`cast_sat_int8` of two fp32 tensors, packed as int16: ``even``'s code in the low byte, ``odd``'s
    in the high one (two adjacent columns of an int8 row, stored as one int16)."""
    return _byte_pairs(cast_sat_int8(even), cast_sat_int8(odd))


@flyc.func
def sat_fp8e4m3_pairs(even, odd):
    """:func:`cast_sat_fp8e4m3` of two fp32 tensors, packed as int16 as :func:`sat_int8_pairs` packs (NVIDIA:
    one ``cvt.rn.satfinite.e4m3x2`` a pair, whose saturation at +-448 is the clamp's)."""
    if PTX:
        return fx.inline_asm_elementwise(
            "cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [even, odd], dtype=fx.int16, is_pure=True, pack=1
        )
    codes = [cast_sat_fp8e4m3(v).to(fx.int8, bitcast=True) for v in (even, odd)]
    return _byte_pairs(codes[0], codes[1])
