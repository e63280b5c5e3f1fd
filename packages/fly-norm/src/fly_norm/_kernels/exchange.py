"""Values exchanged between the programs of one resident wave that work on the same row, as tagged
int64 words in slots of global memory: the split paths' slices of a row (:mod:`.split`) and softmax's
resident forward (:mod:`.resident`) share a row's statistics this way.

- ``publish`` / ``collect``: one fp32 value a slot, a relaxed atomic and a bounded poll (no fences);
- ``collect_sum``: the sum of a row's slots, polled in a block no thread holds twice (its LANES from the
  host's :func:`fly_norm._exchange_host.slot_lanes`), with no read after the wait;
- ``peek`` + ``collect_from``: the wait inside one asm statement (NVIDIA), for loops the software
  pipeliner should still stage;
- ``publish_pair`` / ``collect_pairs_from``: two fp32 values in one slot (the high one non-negative or,
  with ``SIGNED``, of any sign).

Every wait gives up after SPIN_LIMIT reads and reports it (``ok`` False, or NaN values), so a grid
larger than one wave poisons its output instead of hanging the GPU. Only fly-norm's kernels exchange
values this way, so the helpers live here rather than in flydsl-common. They are usable from
``flydsl.gexpr`` kernels too: every block they make comes from their arguments.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import PTX

__all__ = ["collect", "collect_from", "collect_pairs_from", "collect_sum", "peek", "publish", "publish_pair"]


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


@flyc.func
def collect_sum(slot_ptr, count, SPIN_LIMIT: fx.constexpr, LANES: fx.constexpr):
    """(the fp32 sum of the ``count`` slots from int64 ``slot_ptr``, ok) once every one is published, as
    :func:`collect` and a sum, without its read after the wait.

    The slots are held in a block of LANES (:func:`fly_norm._exchange_host.slot_lanes`: at least twice the
    program's threads, the widest vector of int64 a thread loads), so that no thread holds a copy of
    another's: the poll's reduction, the tags' minimum and the values' sum in one, then covers every word
    any thread read, and the sum it returns is of the words that ended the wait. (:func:`collect` polls a
    block replicated over the threads, whose reduction judges one copy of each slot; it reads every slot
    again after its loop, an L2 round trip on the row's critical path.)
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
    if PTX:
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
    if PTX:
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
    if PTX:
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
