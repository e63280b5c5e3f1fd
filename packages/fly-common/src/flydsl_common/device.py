"""Device building blocks shared by the kernel families.

Every helper here is a ``@flyc.func`` (a Triton device function), written
against ``flydsl.expr`` only, and runs both compiled and in the interpreter
(which is why nothing here uses libdevice: the interpreter has no libdevice; PTX inline
assembly is used only where kernels compile for NVIDIA, with a portable twin).

- row addressing in int64, so M x N past 2**31 never overflows;
- masked, vectorizable row loads/stores (upcast to fp32 on load, downcast on store);
- fp32 reductions (sum, sum of squares, max, absolute max);
- bf16 pairs packed in int32 words, widened to fp32;
- round-half-to-even and saturating casts to int8 and fp8 e4m3;
- epilogue activations on fp32 values, selected by a constexpr code;
- programmatic dependent launch (wait, let dependents launch) and L2 prefetch, on NVIDIA;
- tagged-word exchange (``publish`` / ``collect`` / ``peek`` + ``collect_from``) between programs of one
  resident wave that work on the same row (compiled only: the interpreter
  runs programs one after another).
"""

from __future__ import annotations

import torch

import flydsl
import flydsl.compiler as flyc
import flydsl.expr as fx

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
_INTERPRET = fx.constexpr(flydsl.interpreting())
# Compiled for NVIDIA: helpers may use PTX inline assembly (one-instruction conversions and approximations).
_PTX = fx.constexpr(not flydsl.interpreting() and torch.version.hip is None)


# ---------------------------------------------------------------- addressing


@flyc.func
def row_offset(row, stride):
    """Element offset of ``row`` for a row stride, computed in int64."""
    return fx.cast(row, fx.int64) * stride  # fx.cast: also a plain int (an interpreted loop index)


@flyc.func
def load_row_f32(ptr, cols, n, other, VEC: fx.constexpr):
    """Load ``ptr[cols]`` where ``cols < n`` as fp32 (``other`` elsewhere).

    ``VEC`` (a power of two dividing n and the row start) lets the compiler
    issue 16-byte accesses: it declares runs of VEC contiguous, VEC-aligned
    columns. Pass 1 when nothing is known.
    """
    if VEC > 1:
        cols = fx.max_contiguous(fx.multiple_of(cols, VEC), VEC)
    return fx.load(ptr + cols, mask=cols < n, other=other).to(fx.float32)


@flyc.func
def store_row(ptr, cols, n, value, VEC: fx.constexpr):
    """Store ``value`` (converted to the pointer's element type) at ``ptr[cols]`` where ``cols < n``."""
    if VEC > 1:
        cols = fx.max_contiguous(fx.multiple_of(cols, VEC), VEC)
    fx.store(ptr + cols, value.to(ptr.dtype.element_ty), mask=cols < n)


# ---------------------------------------------------------------- reductions


@flyc.func
def sum_f32(x, axis: fx.constexpr):
    return fx.sum(x.to(fx.float32), axis=axis)


@flyc.func
def sumsq_f32(x, axis: fx.constexpr):
    xf = x.to(fx.float32)
    return fx.sum(xf * xf, axis=axis)


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


@flyc.func
def max_f32(x, axis: fx.constexpr):
    return fx.max(x.to(fx.float32), axis=axis)


@flyc.func
def absmax_f32(x, axis: fx.constexpr):
    return fx.max(fx.abs(x.to(fx.float32)), axis=axis)


# ------------------------------------------------- programs of one resident wave

# A kernel whose programs wait on each other must be launched with a grid no
# larger than what the GPU holds at once (flyc.programs_per_sm x SMs), so that
# every program it waits for is running. The interpreter executes programs one
# at a time: there a wait ends only when the awaited programs ran earlier (or
# at its spin limit), so production paths take another route there; tests use
# it to check a kernel's arithmetic and its give-up path.


_PUBLISHED = fx.constexpr(1 << 32)  # the tag in a slot's upper half: the lower half holds the fp32 bits


@flyc.func
def publish(slot_ptr, value, mask):
    """Store fp32 ``value`` at the int64 ``slot_ptr`` (zeroed beforehand) as one tagged word, where ``mask``
    (scalars, or blocks of one slot an element).

    A relaxed atomic and no fence: the word carries its own "written" tag, so
    a reader needs no ordering against this program's other stores (a release
    fence would wait for every store the program still has in flight).
    """
    bits = value.to(fx.int32, bitcast=True).to(fx.int64) & 0xFFFFFFFF
    fx.atomic_xchg(slot_ptr, bits | _PUBLISHED, mask=mask, sem="relaxed", scope="gpu")


@flyc.func
def collect(slot_ptrs, mask, SPIN_LIMIT: fx.constexpr):
    """Poll the masked int64 slots (a block of any shape) until every one holds a published word;
    returns (fp32 values, ok). One poll loop for every slot: a caller exchanging several values per
    program collects them together rather than waiting once per value.

    ``ok`` is False when SPIN_LIMIT polls passed first: a program of the wave
    never published (a grid larger than one wave, or SMs taken away). Callers
    poison their output instead of hanging the GPU. Masked-off slots read as
    published zeros.
    """
    w = fx.load(slot_ptrs, mask=mask, other=_PUBLISHED, volatile=True)
    spins = 0
    while (fx.min(w >> 32, axis=None) == 0) & (spins < SPIN_LIMIT):
        w = fx.load(slot_ptrs, mask=mask, other=_PUBLISHED, volatile=True)
        spins += 1
    ok = fx.min(w >> 32, axis=None) > 0
    # Read once more after the loop: a small block is replicated over the program's threads, each
    # copy loaded on its own, and the reduction above may have judged the slots by other threads'
    # copies than those this thread holds (measured: a stale, unpublished copy read as 0 now and
    # then, a slice left out of a row). Every slot was published before this read (the reduction's
    # barrier orders it after the poll that saw them all), so every copy now holds its word.
    # (Reading again only the copies still unpublished, a load predicated copy by copy, measured slower:
    # fly-norm's softmax backward 2-30% slower at 32K-256K columns on an H200.)
    w = fx.load(slot_ptrs, mask=mask, other=_PUBLISHED, volatile=True)
    return w.to(fx.int32).to(fx.float32, bitcast=True), ok


@flyc.func
def _min_add(t0, v0, t1, v1):
    return fx.minimum(t0, t1), v0 + v1


@flyc.func
def _poll_sum(slot_ptrs, live):
    """One read of the slots, reduced: (the smallest tag, the sum of the values); masked off: published 0."""
    w = fx.load(slot_ptrs, mask=live, other=_PUBLISHED, volatile=True)
    return fx.reduce(((w >> 32).to(fx.int32), w.to(fx.int32).to(fx.float32, bitcast=True)), 0, _min_add)


def slot_lanes(slots: int, warps: int, warp_size: int) -> int:
    """The LANES of :func:`collect_sum` for ``slots`` slots in a program of ``warps`` warps: a power of two of at
    least ``slots`` and twice the program's threads."""
    return max(slots, 2 * warps * warp_size)


@flyc.func
def collect_sum(slot_ptr, count, SPIN_LIMIT: fx.constexpr, LANES: fx.constexpr):
    """(the fp32 sum of the ``count`` slots from int64 ``slot_ptr``, ok) once every one is published, as
    :func:`collect` and a sum, without its read after the wait.

    The slots are held in a block of LANES (:func:`slot_lanes`: at least twice the program's threads, the
    widest vector of int64 a thread loads), so that no thread holds a copy of another's: the poll's
    reduction, the tags' minimum and the values' sum in one, then covers every word any thread read, and the
    sum it returns is of the words that ended the wait. (:func:`collect` polls a block replicated over the
    threads, whose reduction judges one copy of each slot; it reads every slot again after its loop, an L2
    round trip on the row's critical path.)
    """
    i = fx.arange(0, LANES)
    tag, total = _poll_sum(slot_ptr + i, i < count)
    spins = 0
    while (tag == 0) & (spins < SPIN_LIMIT):
        tag, total = _poll_sum(slot_ptr + i, i < count)
        spins += 1
    return total, tag > 0


def _await_ptx(outs: int) -> str:
    """The wait of collect_from (``outs`` 1) and collect_pairs_from (2) inside one asm statement (NVIDIA): the
    word at ``$outs+1``, starting from ``$outs``, the word read earlier, polled until its high half is
    nonzero (the tag), then $0 <- its low half (and $1 <- its high half); zeros where the mask
    ``$outs+2`` is 0; quiet NaNs once ``$outs+3`` further reads found it unpublished. Labels are unique per
    statement (${:uid})."""
    w, ptr, m, lim = (f"${outs + k}" for k in range(4))
    lines = [".reg .pred %p;", ".reg .b32 %lo, %hi, %n;", ".reg .b64 %w;"]
    lines += [f"mov.b32 ${o}, 0;" for o in range(outs)]
    lines += [f"setp.eq.s32 %p, {m}, 0;", "@%p bra DONE${:uid};", f"mov.b64 %w, {w};", "mov.u32 %n, 0;",
              "CHECK${:uid}:", "mov.b64 {%lo, %hi}, %w;"]  # fmt: skip
    lines += [f"mov.b32 ${o}, {half};" for o, half in enumerate(("%lo", "%hi")[:outs])]
    lines += ["setp.ne.b32 %p, %hi, 0;", "@%p bra DONE${:uid};", f"setp.ge.u32 %p, %n, {lim};",
              "@%p bra FAIL${:uid};", "add.u32 %n, %n, 1;", f"ld.relaxed.gpu.global.b64 %w, [{ptr}];",
              "bra CHECK${:uid};", "FAIL${:uid}:"]  # fmt: skip
    lines += [f"mov.b32 ${o}, 0x7FC00000;" for o in range(outs)]
    return "{\n" + "\n".join([*lines, "DONE${:uid}:"]) + "\n}"


_AWAIT_PTX = fx.constexpr(_await_ptx(1))


@flyc.func
def _spin_limits(like, SPIN_LIMIT: fx.constexpr):
    """SPIN_LIMIT in an int32 block of ``like``'s shape and layout, made from ``like`` (no ``full``), so that
    kernels in the explicit-layout language (``flydsl.gexpr``), whose blocks all carry a layout, can wait too."""
    return like * 0 + SPIN_LIMIT


@flyc.func
def peek(slot_ptrs):
    """One read of the int64 slots (a block of any shape), for :func:`collect_from`. NVIDIA: a relaxed load in
    an asm statement, issued where it is written (the compiler neither moves it nor merges it with another)."""
    if _PTX:
        return fx.inline_asm_elementwise(
            "ld.relaxed.gpu.global.b64 $0, [$1];", "=l,l", [slot_ptrs], dtype=fx.int64, is_pure=False, pack=1
        )
    return fx.load(slot_ptrs, volatile=True)


@flyc.func
def collect_from(words, slot_ptrs, mask, SPIN_LIMIT: fx.constexpr):
    """:func:`collect` for a loop the software pipeliner should still stage: the fp32 values of the masked
    slots (0 where masked off; NaN where SPIN_LIMIT more reads found a slot unpublished, which poisons what
    is computed from it), waiting from ``words``, the slots as :func:`peek` read them earlier, so that when
    they were published by then no read is on the critical path. NVIDIA: each thread waits for its copies in
    one asm statement (no loop in the kernel's IR: Triton pipelines only loops without nested loops).
    Elsewhere :func:`collect`."""
    if _PTX:
        m32 = mask.to(fx.int32)
        bits = fx.inline_asm_elementwise(
            _AWAIT_PTX, "=r,l,l,r,r", [words, slot_ptrs, m32, _spin_limits(m32, SPIN_LIMIT)], dtype=fx.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
        return bits.to(fx.float32, bitcast=True)
    values, ok = collect(slot_ptrs, mask, SPIN_LIMIT)
    return fx.where(ok, fx.where(mask, values, 0.0), float("nan"))


# A pair of fp32 values in one slot (publish_pair): the high half's sign bit is the tag, so the high value
# must be >= 0 or NaN (a variance, a sum of squares). Masked-off slots read as a published pair of zeros.
# A signed pair (SIGNED=True) takes any high value: its own bits are the tag (nonzero: +0 is sent as -0).
_PAIR_TAG = fx.constexpr(0x80000000)
_PAIR_ZEROS = fx.constexpr(-(1 << 63))  # the tag alone: (0.0, 0.0) published

_AWAIT_PAIR_PTX = fx.constexpr(_await_ptx(2))


@flyc.func
def publish_pair(slot_ptr, lo, hi, mask, SIGNED: fx.constexpr = False):
    """:func:`publish` of two fp32 values in one int64 slot (zeroed beforehand): ``lo`` in the low half,
    ``hi`` (>= 0 or NaN) in the high half with its sign bit set as the tag. One relaxed atomic where two
    :func:`publish` calls would take two, and half the slots for a reader to poll. ``SIGNED``: ``hi`` of
    any sign, its own bits the tag (+0 sent as -0, the one value whose bits are 0); read back with
    :func:`collect_pairs_from`'s ``SIGNED``."""
    lo_bits = lo.to(fx.int32, bitcast=True).to(fx.int64) & 0xFFFFFFFF
    if SIGNED:
        hi_bits = hi.to(fx.int32, bitcast=True).to(fx.int64) & 0xFFFFFFFF
        hi_bits = fx.where(hi_bits == 0, _PAIR_TAG, hi_bits)
    else:
        hi_bits = (hi.to(fx.int32, bitcast=True).to(fx.int64) & 0xFFFFFFFF) | _PAIR_TAG
    fx.atomic_xchg(slot_ptr, lo_bits | (hi_bits << 32), mask=mask, sem="relaxed", scope="gpu")


@flyc.func
def collect_pairs_from(words, slot_ptrs, mask, SPIN_LIMIT: fx.constexpr, SIGNED: fx.constexpr = False):
    """:func:`collect_from` of :func:`publish_pair` slots: (low values, high values) in fp32, 0 where masked
    off (-0 for a signed pair's high value), NaN where SPIN_LIMIT more reads found a slot unpublished.
    ``SIGNED`` as the slots were published. NVIDIA: one asm statement; elsewhere a poll loop as
    :func:`collect`."""
    if _PTX:
        m32 = mask.to(fx.int32)
        lo, hi = fx.inline_asm_elementwise(
            _AWAIT_PAIR_PTX, "=r,=r,l,l,r,r", [words, slot_ptrs, m32, _spin_limits(m32, SPIN_LIMIT)],
            dtype=(fx.float32, fx.int32), is_pure=False, pack=1,
        )  # fmt: skip
        return lo, (hi if SIGNED else hi & 0x7FFFFFFF).to(fx.float32, bitcast=True)
    w = fx.load(slot_ptrs, mask=mask, other=_PAIR_ZEROS, volatile=True)
    spins = 0
    while (fx.min(((w >> 32) != 0).to(fx.int32), axis=None) == 0) & (spins < SPIN_LIMIT):
        w = fx.load(slot_ptrs, mask=mask, other=_PAIR_ZEROS, volatile=True)
        spins += 1
    ok = fx.min(((w >> 32) != 0).to(fx.int32), axis=None) > 0
    w = fx.load(slot_ptrs, mask=mask, other=_PAIR_ZEROS, volatile=True)  # every copy, as collect
    lo = w.to(fx.int32).to(fx.float32, bitcast=True)
    hi_bits = (w >> 32).to(fx.int32)
    hi = (hi_bits if SIGNED else hi_bits & 0x7FFFFFFF).to(fx.float32, bitcast=True)
    return fx.where(ok, lo, float("nan")), fx.where(ok, hi, float("nan"))


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
    if _PTX:
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
    if _PTX:
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
    if _PTX:
        return fx.inline_asm_elementwise(
            "max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=fx.int32, is_pure=True, pack=1
        )
    ae, ao = bf16_pairs(a)
    be, bo = bf16_pairs(b)
    return bf16_words(fx.maximum(ae, be), fx.maximum(ao, bo))


@flyc.func
def max_bf16_words(words, axis: fx.constexpr):
    """The max, in fp32, of the bf16 held two a word in int32 ``words`` along ``axis``: the words reduced half
    by half (one instruction a word, where widening first costs one a column), then their two halves. A NaN
    is passed over (NVIDIA) or kept (elsewhere): callers that go on to sum exponentials of the row see it
    there either way."""
    even, odd = bf16_pairs(fx.reduce(words, axis, max_bf16_halves))
    return fx.maximum(even, odd)


@flyc.func
def offsets_after(offs, after, VEC: fx.constexpr):
    """Integer offsets ``offs`` ([rows, columns]; along the columns, runs of VEC contiguous values, each
    starting on a multiple of VEC, as from an ``arange``), known to the compiler only once ``after`` is (a
    tensor of their shape, element for element; an operand the instruction does not read). Loads through
    them are then issued after ``after`` is computed, and stay VEC-wide: the hints restore what the opaque
    copy hides from the compiler. A kernel writing a row held in registers part by part orders each
    part's per-column reads after the previous part's results this way, rather than let the compiler
    issue them all at once and hold what they read (NVIDIA; elsewhere ``offs``)."""
    if _PTX:
        o = fx.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [offs, after], dtype=fx.int32, is_pure=True,
                                      pack=1)  # fmt: skip
        return fx.max_contiguous(fx.multiple_of(o, [1, VEC]), [1, VEC])
    return offs


@flyc.func
def bf16_words(even, odd):
    """Two fp32 tensors rounded to bf16 (nearest, ties to even) and packed as int32 words, ``even`` in the low
    half: the inverse of :func:`bf16_pairs` (NVIDIA: one ``cvt.rn.bf16x2.f32`` a pair)."""
    if _PTX:
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


# ----------------------------------------------------------------- rounding


@flyc.func
def round_half_even(x):
    """Nearest integer (ties to even) of fp32 ``x`` with |x| < 2**22; larger values are returned unchanged."""
    r = (x + _RNE_MAGIC) - _RNE_MAGIC
    return fx.where(fx.abs(x) < 4194304.0, r, x)


@flyc.func
def cast_sat_int8(x):
    """fp32 -> int8: round half to even, saturate to [-127, 127] (symmetric, so -x quantizes to -q)."""
    if _PTX:  # one cvt.rni (round to nearest, ties to even), which also saturates at 127
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
    if _INTERPRET:
        # The interpreter's own fp32 -> fp8 conversion is wrong for many values;
        # build the encoding exactly instead.
        return _fp8e4m3_bits(c).to(fx.uint8).to(fx.float8e4nv, bitcast=True)
    else:
        return c.to(fx.float8e4nv)


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
    if _PTX:
        return fx.inline_asm_elementwise(
            "cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [even, odd], dtype=fx.int16, is_pure=True, pack=1
        )
    codes = [cast_sat_fp8e4m3(v).to(fx.int8, bitcast=True) for v in (even, odd)]
    return _byte_pairs(codes[0], codes[1])


# --------------------------------------------------------------- activations


@flyc.func
def fast_exp2(x):
    """2**x in fp32. Compiled for NVIDIA: one ``ex2.approx.ftz`` (relative error ~2**-22; results below
    2**-126 flush to 0), where ``fx.exp2`` adds subnormal fix-ups around it; elsewhere ``fx.exp2``."""
    if _PTX:
        return fx.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=fx.float32, is_pure=True, pack=1
        )
    else:
        return fx.exp2(x)


@flyc.func
def fast_rcp(x):
    """1 / x in fp32. Compiled for NVIDIA: one ``rcp.approx.ftz`` (within 1 ulp), where ``/`` is an IEEE
    division of a dozen instructions; elsewhere ``1 / x``."""
    if _PTX:
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
    if _PTX:
        fx.extra.cuda.gdc_launch_dependents()


@flyc.func
def pdl_wait():
    """Wait until the kernel before this one on the stream has finished and its writes are visible.
    A kernel launched with ``launch_pdl`` may start early: it must call this before it reads what that
    kernel may write, and before it writes anything."""
    if _PTX:
        fx.extra.cuda.gdc_wait()


@flyc.func
def prefetch_l2(ptrs, ok, base):
    """Ask L2 for the 128-byte lines at ``ptrs`` where ``ok`` (elsewhere at ``base``, a valid address):
    nothing is loaded into registers or waited for. NVIDIA only; elsewhere nothing."""
    if _PTX:
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
    if ACT == 1:  # relu
        return fx.maximum(x, 0.0)
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
