"""One-shot and two-shot all-reduce kernels over buffers that every rank of one host can address.

Arguments every kernel takes:

- ``ptrs``: int64 ``[world]``, the base address of each rank's shared buffer as mapped in this process
  (:mod:`fly_comm.layout` gives the layout: flags, then two data halves);
- ``state``: int64 ``[STATE_LEN]``, local: one epoch counter a program, then a count of given-up waits;
- ``rank`` (runtime), ``WORLD`` (constexpr, 2, 4 or 8), ``n`` the message's elements.

The grid is fixed for a :class:`~fly_comm.CustomAllReduce` (``programs``, the same on every rank and every
call) and each program walks its elements in a grid-stride loop. Program ``b`` of every rank walks the
same element positions, so the ranks synchronise program by program: program ``b`` waits for program
``b`` of each peer only, never for the whole grid.

Synchronisation (one flag a (program, source rank) in each buffer, :data:`~fly_comm.layout.MAX_WORLD`
slots a program):

1. Program ``b`` reads its epoch ``e = state[b] + 1`` (every program counts every call, so ``e`` is the
   call's number on every rank) and stages in data half ``e % 2``.
2. *Signal*: after its stores, ``debug_barrier`` (``bar.sync``: every thread of the program has issued its
   stores, and they are ordered before what thread 0 does next at CTA scope), then one
   ``atomic_xchg(flag, value, sem="release", scope="sys")`` into slot ``(b, rank)`` of each peer's buffer
   (its own included). A release at system scope is cumulative: the stores the barrier ordered before it
   are visible to any thread, on any GPU, that observes the flag with an acquire.
3. *Wait*: spin on ``atomic_add(own slot (b, p), 0, sem="acquire", scope="sys")`` until it is at least
   ``value``, for each peer ``p``, then ``debug_barrier`` so that no thread of the program reads peer
   data before the acquire has completed. Peer data is read with ``cache_modifier=".cg"`` (L2, not L1:
   nothing of a peer's buffer may be served from a line cached before the acquire).
4. The program stores ``state[b] = e`` at the end of the call.

Values: call ``e`` signals ``2e`` after staging and, in two-shot, ``2e + 1`` after its reduced slice is
written. Waiting for *at least* the value (not for equality, and never resetting a flag) is what keeps a
late rank from deadlocking the others and an early one from deadlocking a late one: a peer can be at
most one call ahead (it cannot pass call ``e + 1``'s first wait before this rank signals in call
``e + 1``), and when it overwrites ``2e + 1`` with ``2e + 2`` the waiter for ``2e + 1`` still passes,
correctly, since that peer finished call ``e`` before it started ``e + 1``. int64 flags never wrap.

Why two halves and no closing barrier: rank ``r`` writes half ``e % 2`` in call ``e`` before any wait.
The last reader of that half was call ``e - 2``. Rank ``r`` has passed call ``e - 1``'s first wait, so
every peer had signalled in call ``e - 1``, so every peer's kernel for call ``e - 2`` had finished
(kernels on a stream run in order). Both algorithms of a call use the same epoch, halves and flags, so
calls may alternate between them. The ranks must issue the same sequence of calls (sizes included: the
algorithm follows from the size), as for any collective.

All programs of a launch must be resident at once (``programs`` <= the SM count, no co-running kernel
hogging SMs): program ``b`` waiting on peer program ``b`` that cannot be scheduled would hang.

Reduction: in fp32, over ranks ``0 .. world - 1`` in that order on every rank, so every rank gets the same
bits, and one-shot and two-shot give the same bits. ``SPIN_LIMIT`` (constexpr, 0 = wait forever) makes a
wait give up after that many polls and count it in ``state[TIMEOUT_SLOT]``: a debugging aid and what lets
the single-process simulation test a missing peer without hanging.

``STAGES`` (constexpr bit mask) runs parts of a call: bit 0 stages and signals, bit 1 waits and reduces
(two-shot: and signals its slice), bit 2 (two-shot) waits and gathers. GPU launches set every bit (one
kernel a call); the tests launch the stages of each simulated rank one after another in one process
(Triton's interpreter runs programs one at a time, so a real spin on a flag that a later launch sets would
never end).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx

from ..layout import DATA_OFFSET, MAX_PROGRAMS, MAX_WORLD, TIMEOUT_SLOT

__all__ = ["launch_one_shot", "launch_two_shot", "OPS", "ALL_STAGES_ONE_SHOT", "ALL_STAGES_TWO_SHOT"]

OPS = {"sum": 0, "max": 1, "min": 2}
ALL_STAGES_ONE_SHOT = 0b011
ALL_STAGES_TWO_SHOT = 0b111


@flyc.func
def _flag_ptr(base, program, src, MAX_W: fx.constexpr):
    """Pointer to flag (program, src) in the buffer at int64 address ``base``."""
    return (base + (program * MAX_W + src) * 8).to(fx.pointer_type(fx.int64))


@flyc.func
def _data_ptr(base, data_off, ety: fx.constexpr):
    """Typed pointer to the data half at byte offset ``data_off`` of the buffer at address ``base``."""
    return fx.multiple_of((base + data_off).to(fx.pointer_type(ety)), 16)


@flyc.func
def _signal(ptrs, rank, program, value, WORLD: fx.constexpr, MAX_W: fx.constexpr):
    fx.debug_barrier()  # every thread's stores of this program are issued before the release below
    for p in fx.static_range(WORLD):
        fx.atomic_xchg(_flag_ptr(fx.load(ptrs + p), program, rank, MAX_W), value, sem="release", scope="sys")


@flyc.func
def _wait_all(ptrs, state, rank, program, value, WORLD: fx.constexpr, MAX_W: fx.constexpr,
              SPIN_LIMIT: fx.constexpr, TIMEOUTS: fx.constexpr):  # fmt: skip
    own = fx.load(ptrs + rank)
    for p in fx.static_range(WORLD):
        flag = _flag_ptr(own, program, p, MAX_W)
        seen = fx.atomic_add(flag, 0, sem="acquire", scope="sys")
        if SPIN_LIMIT == 0:
            while seen < value:
                seen = fx.atomic_add(flag, 0, sem="acquire", scope="sys")
        else:
            spins = 0
            while (seen < value) & (spins < SPIN_LIMIT):
                seen = fx.atomic_add(flag, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < value:
                fx.atomic_add(state + TIMEOUTS, 1)
    fx.debug_barrier()  # no thread reads peer data before the acquires above


@flyc.func
def _combine(acc, x, OP: fx.constexpr):
    if OP == 0:
        return acc + x
    elif OP == 1:
        return fx.maximum(acc, x)
    else:
        return fx.minimum(acc, x)


@flyc.func
def _rounded(acc, ety: fx.constexpr):
    """fp32 accumulator -> the message's dtype (round to nearest even, as torch and NCCL round)."""
    if ety == fx.float32:
        return acc
    else:
        return acc.to(ety, fp_downcast_rounding="rtne")


@flyc.func
def _reduce_at(ptrs, data_off, offs, mask, ety: fx.constexpr, WORLD: fx.constexpr, OP: fx.constexpr):
    """fp32 reduction over ranks 0..WORLD-1 (this order on every rank) of the staged elements ``offs``."""
    acc = fx.load(_data_ptr(fx.load(ptrs), data_off, ety) + offs, mask=mask, other=0.0,
                  cache_modifier=".cg").to(fx.float32)  # fmt: skip
    for p in fx.static_range(1, WORLD):
        x = fx.load(_data_ptr(fx.load(ptrs + p), data_off, ety) + offs, mask=mask, other=0.0, cache_modifier=".cg")
        acc = _combine(acc, x.to(fx.float32), OP)
    return acc


# fmt: off
@flyc.kernel(do_not_specialize=["rank"])
def _one_shot_kernel(
    inp, out, ptrs, state, n, rank,
    WORLD: fx.constexpr, BLOCK: fx.constexpr, HALF_BYTES: fx.constexpr, OP: fx.constexpr,
    STAGES: fx.constexpr, SPIN_LIMIT: fx.constexpr,
    DATA_OFF: fx.constexpr, MAX_W: fx.constexpr, TIMEOUTS: fx.constexpr,
):
    # fmt: on
    pid = fx.program_id(0)
    step = fx.num_programs(0) * BLOCK
    ety = inp.dtype.element_ty
    e = fx.load(state + pid) + 1
    data_off = DATA_OFF + (e % 2) * HALF_BYTES
    lanes = fx.arange(0, BLOCK)
    if STAGES & 1:
        own = _data_ptr(fx.load(ptrs + rank), data_off, ety)
        for start in range(pid * BLOCK, n, step):
            offs = fx.max_contiguous(fx.multiple_of(start + lanes, BLOCK), BLOCK)
            m = offs < n
            fx.store(own + offs, fx.load(inp + offs, mask=m), mask=m)
        _signal(ptrs, rank, pid, 2 * e, WORLD, MAX_W)
    if STAGES & 2:
        _wait_all(ptrs, state, rank, pid, 2 * e, WORLD, MAX_W, SPIN_LIMIT, TIMEOUTS)
        for start in range(pid * BLOCK, n, step):
            offs = fx.max_contiguous(fx.multiple_of(start + lanes, BLOCK), BLOCK)
            m = offs < n
            acc = _reduce_at(ptrs, data_off, offs, m, ety, WORLD, OP)
            fx.store(out + offs, _rounded(acc, out.dtype.element_ty), mask=m)
        fx.store(state + pid, e)


# fmt: off
@flyc.kernel(do_not_specialize=["rank"])
def _two_shot_kernel(
    inp, out, ptrs, state, n, S, rank,
    WORLD: fx.constexpr, BLOCK: fx.constexpr, HALF_BYTES: fx.constexpr, OP: fx.constexpr,
    STAGES: fx.constexpr, SPIN_LIMIT: fx.constexpr,
    DATA_OFF: fx.constexpr, MAX_W: fx.constexpr, TIMEOUTS: fx.constexpr,
):
    # fmt: on
    # Slice s is elements [s * S, s * S + S) of the message (S a multiple of 16, from the host); program b
    # walks the same slice-local positions j in every slice, so its peers' program b staged (stage 1) and
    # reduced (stage 2) exactly the positions it reads.
    pid = fx.program_id(0)
    step = fx.num_programs(0) * BLOCK
    ety = inp.dtype.element_ty
    e = fx.load(state + pid) + 1
    data_off = DATA_OFF + (e % 2) * HALF_BYTES
    lanes = fx.arange(0, BLOCK)
    own = _data_ptr(fx.load(ptrs + rank), data_off, ety)
    if STAGES & 1:
        for j0 in range(pid * BLOCK, S, step):
            j = j0 + lanes
            for s in fx.static_range(WORLD):
                g = s * S + j
                m = (j < S) & (g < n)
                fx.store(own + g, fx.load(inp + g, mask=m), mask=m)
        _signal(ptrs, rank, pid, 2 * e, WORLD, MAX_W)
    if STAGES & 2:
        # Reduce-scatter: this rank's slice from every peer, written back over its own staged slice (no peer
        # reads this rank's own slice before the signal below; they read the slices they reduce).
        _wait_all(ptrs, state, rank, pid, 2 * e, WORLD, MAX_W, SPIN_LIMIT, TIMEOUTS)
        for j0 in range(pid * BLOCK, S, step):
            j = j0 + lanes
            g = rank * S + j
            m = (j < S) & (g < n)
            acc = _reduce_at(ptrs, data_off, g, m, ety, WORLD, OP)
            fx.store(own + g, _rounded(acc, ety), mask=m)
        _signal(ptrs, rank, pid, 2 * e + 1, WORLD, MAX_W)
    if STAGES & 4:
        # All-gather: slice s from rank s.
        _wait_all(ptrs, state, rank, pid, 2 * e + 1, WORLD, MAX_W, SPIN_LIMIT, TIMEOUTS)
        for j0 in range(pid * BLOCK, S, step):
            j = j0 + lanes
            for s in fx.static_range(WORLD):
                g = s * S + j
                m = (j < S) & (g < n)
                src = _data_ptr(fx.load(ptrs + s), data_off, ety)
                fx.store(out + g, fx.load(src + g, mask=m, cache_modifier=".cg"), mask=m)
        fx.store(state + pid, e)


def _meta(world: int, block: int, half_bytes: int, op: str, stages: int, spin_limit: int, num_warps: int) -> dict:
    return dict(WORLD=world, BLOCK=block, HALF_BYTES=half_bytes, OP=OPS[op], STAGES=stages, SPIN_LIMIT=spin_limit,
                DATA_OFF=DATA_OFFSET, MAX_W=MAX_WORLD, TIMEOUTS=TIMEOUT_SLOT, num_warps=num_warps)  # fmt: skip


def _check_grid(programs: int, world: int) -> None:
    if not 1 <= programs <= MAX_PROGRAMS:
        raise ValueError(f"programs must be in [1, {MAX_PROGRAMS}], got {programs}")
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world must be in [1, {MAX_WORLD}], got {world}")


@flyc.jit(skip_empty=False)
def launch_one_shot(inp, out, ptrs, state, rank: int, world: int, *, programs: int, block: int, half_bytes: int,
                    op: str = "sum", stages: int = ALL_STAGES_ONE_SHOT, spin_limit: int = 0, num_warps: int = 8,
                    stream=None):  # fmt: skip
    """One-shot all-reduce of contiguous ``inp`` into ``out`` (may be ``inp``); arguments as the module says."""
    _check_grid(programs, world)
    flyc.launch(_one_shot_kernel, (programs,), inp, out, ptrs, state, inp.numel(), rank,
                **_meta(world, block, half_bytes, op, stages, spin_limit, num_warps))  # fmt: skip


@flyc.jit(skip_empty=False)
def launch_two_shot(inp, out, ptrs, state, rank: int, world: int, slice_elems: int, *, programs: int, block: int,
                    half_bytes: int, op: str = "sum", stages: int = ALL_STAGES_TWO_SHOT, spin_limit: int = 0,
                    num_warps: int = 8, stream=None):  # fmt: skip
    """Two-shot all-reduce (``slice_elems``: :func:`fly_comm.layout.two_shot_slice`)."""
    _check_grid(programs, world)
    flyc.launch(_two_shot_kernel, (programs,), inp, out, ptrs, state, inp.numel(), slice_elems, rank,
                **_meta(world, block, half_bytes, op, stages, spin_limit, num_warps))  # fmt: skip
