"""Softmax forward over wide bf16 rows, each program's slice of a row resident in shared memory (GPU only).

From 64K columns (bf16, word aligned, on NVIDIA sm_80+) a row is cut into ``parts`` slices of at most
``ring - left`` chunks (RESIDENT, or RESIDENT_WIDE past 1M columns: :mod:`fly_norm._split_host`; a chunk is ``chunk``
int32 words, two columns each), one slice a program, as the split paths do
(:mod:`fly_norm._kernels.split`: one resident wave of ``groups * parts`` programs, program ``pid`` on slice
``pid % parts`` of rows ``group, group + groups, ...``). Each program owns a ring of ``ring`` chunk slots in
shared memory, filled by ``cp.async`` in the order it will read them (its rows one after the other, chunk by
chunk). For each row it

1. reads each chunk of its slice as soon as it lands, every thread keeping the max of its own columns and
   their sum of exponentials (rescaled when its max grows), then merges the threads' pairs;
2. when ``parts > 1``, publishes the slice's (max, sum) in the row's slot and awaits the other slices'
   (:func:`.exchange.publish_pair`, :func:`~.exchange.collect_pairs_from`);
3. reads the slice again from shared memory, writes y = e / sum, and refills each chunk's slot with the
   chunk RING places later in its sequence as soon as every thread has read it.

So every element is read from memory once and written once (the copy's floor), with up to ``left`` chunks
of later rows in flight while a slice is held. The split paths instead hold a slice in registers (or let
Triton's software pipeliner stage the next rows) and exchange the sums from registers; here the slice stays
in shared memory, so a slice can be up to 64K columns. Small programs win: five 4-warp programs an SM, each
with a 40 KB ring and 16K-column slices, run 88-91% of the copy from 64K to 1M columns, where one 16-warp
program an SM with 64K-column slices (no exchange at 64K) ran 75-86% (H200, bf16, 2^27 elements): one program's
exponential passes overlap the others' copies and waits.

Written in the explicit-layout language (``flydsl.gexpr``: Triton's Gluon), which lets a kernel allocate
its shared memory and issue and await its copies; ``flydsl.expr`` leaves both to the compiler. It compiles
for a GPU only: the interpreter and other GPUs take the split paths.

Exponentials are 2^(x log2(e) - s) with s = m log2(e) rounded, m the thread's max (one FMA an element);
merging rescales by 2^(s_thread - s_row) from the same rounded shifts, so the result is consistent. Where
some thread's |max| reaches BIG, s's rounding residual could be large: the slice's sum is taken again
from shared memory as 2^((x - m) log2(e)) (exactly 1 at the max), and the outputs are where the row's max
reaches BIG.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.gexpr as gx

from .exchange import collect_pairs_from, publish_pair
from .pairs import NEG_INF_BF16_PAIR, bf16_pairs, bf16_words, max_bf16_halves
from .passes import LOG2E

BIG = gx.constexpr(65536.0)  # a thread max this large in magnitude: the slice taken again, exactly


@flyc.gluon_kernel
def chunk_words(REPS: gx.constexpr, THREADS: gx.constexpr, layout: gx.constexpr):
    """A chunk's int32 word offsets as [REPS, THREADS, 4] in ``layout`` (four consecutive words a thread, REPS
    times, THREADS * 4 words apart): a thread's own reductions over it need no exchange."""
    reps = gx.arange(0, REPS, layout=gx.SliceLayout(1, gx.SliceLayout(2, layout)))
    lanes = gx.arange(0, THREADS, layout=gx.SliceLayout(0, gx.SliceLayout(2, layout)))
    quad = gx.arange(0, 4, layout=gx.SliceLayout(0, gx.SliceLayout(1, layout)))
    cols = (gx.expand_dims(gx.expand_dims(reps, 1), 2) * THREADS + gx.expand_dims(gx.expand_dims(lanes, 0), 2)) * 4
    return cols + gx.expand_dims(gx.expand_dims(quad, 0), 1)


@flyc.gluon_kernel
def _issue(ring, xw_ptr, t, group, groups, col0, M, W, stride_xw, cols,
           CHUNK: gx.constexpr, CHUNKS: gx.constexpr, RING: gx.constexpr):  # fmt: skip
    """Queue the copy of chunk ``t`` of this program's sequence (row group + (t // CHUNKS) * groups, chunk t %
    CHUNKS of the slice from word col0) into slot t % RING, as one commit group (an empty group past the last
    row, so that the group counts are the same every row)."""
    row = group + (t // CHUNKS) * groups
    c = col0 + (t % CHUNKS) * CHUNK + cols
    ptrs = xw_ptr + row.to(gx.int64) * stride_xw + c
    gx.async_copy.async_copy_global_to_shared(ring.index(t % RING), ptrs, mask=(row < M) & (c < W))
    gx.async_copy.commit_group()


@flyc.gluon_kernel
def _mine_max(words):
    """bf16 words [REPS, THREADS, 4] reduced over each thread's own (half by half): [THREADS], no exchange."""
    return gx.reduce(gx.reduce(words, 2, max_bf16_halves), 0, max_bf16_halves)


@flyc.gluon_kernel
def _mine_sum(x):
    return gx.sum(gx.sum(x, axis=2), axis=0)


@flyc.gluon_kernel
def _slice_stats(ring, base, col0, W, cols, layout: gx.constexpr, WAIT_FROM: gx.constexpr, CHUNK: gx.constexpr,
                 CHUNKS: gx.constexpr, RING: gx.constexpr, EVEN: gx.constexpr):  # fmt: skip
    """(max or -inf, sum of 2^(x log2(e) - s)) of the slice in chunks ``base``.. of the sequence, each chunk
    read as soon as it lands (chunk base + j once at most WAIT_FROM - j copy groups are in flight), one pass:
    every thread keeps its own max and sum, rescaled when its max grows, merged at the end. Also returns the
    largest |max| of a thread (at BIG and past it the caller takes the sum again exactly)."""
    ninf = float("-inf")
    mt = gx.max(gx.max(gx.full(cols.shape, ninf, gx.float32, layout), axis=2), axis=0)
    st = gx.zeros_like(mt)
    for j in gx.static_range(CHUNKS):
        gx.async_copy.wait_group(WAIT_FROM - j)
        gx.thread_barrier()
        w = ring.index((base + j) % RING).load(layout)
        if not EVEN:
            w = gx.where(col0 + j * CHUNK + cols < W, w, NEG_INF_BF16_PAIR)
        ce, co = bf16_pairs(_mine_max(w))
        mnew = gx.maximum(mt, gx.maximum(ce, co))
        znew = gx.where(mnew > ninf, mnew, 0.0)  # all -inf so far: e = 0 whatever the shift
        # a thread with no finite column yet holds 0, or NaN from a NaN column: kept as it is
        st = st * gx.where(mt > ninf, gx.exp2(mt * LOG2E - znew * LOG2E), 1.0)
        shift = gx.expand_dims(gx.expand_dims(znew * LOG2E, 0), 2)
        xe, xo = bf16_pairs(w)
        e = gx.exp2(gx.fma(xe, LOG2E, -shift)) + gx.exp2(gx.fma(xo, LOG2E, -shift))
        if not EVEN:
            e = gx.where(col0 + j * CHUNK + cols < W, e, 0.0)
        st += _mine_sum(e)
        mt = mnew
    top = gx.max(mt, axis=0)
    z = gx.where(top > ninf, top, 0.0)
    zt = gx.where(mt > ninf, mt, 0.0)
    total = gx.sum(gx.where(mt > ninf, st * gx.exp2(zt * LOG2E - z * LOG2E), st), axis=0)
    return top, total, gx.max(gx.abs(zt), axis=0)


@flyc.gluon_kernel
def _slice_sum_exact(ring, base, col0, W, cols, m, layout: gx.constexpr, CHUNK: gx.constexpr,
                     CHUNKS: gx.constexpr, RING: gx.constexpr, EVEN: gx.constexpr):  # fmt: skip
    """The sum of 2^((x - m) log2(e)) over the slice held in chunks ``base``.."""
    acc = gx.zeros(cols.shape, gx.float32, layout)
    for j in gx.static_range(CHUNKS):
        xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
        e = gx.exp2((xe - m) * LOG2E) + gx.exp2((xo - m) * LOG2E)
        if not EVEN:
            e = gx.where(col0 + j * CHUNK + cols < W, e, 0.0)
        acc += e
    return gx.sum(_mine_sum(acc), axis=0)


@flyc.gluon_kernel
def _row_stats(slot_ptr, row, P, k, PP: gx.constexpr, SPIN_LIMIT: gx.constexpr):
    """The row's (max, sum) from its P slices' slots: each slice's sum rescaled to the row's max (from the
    slices' shifts as rounded there, or exactly at BIG and past it); NaN where a wait gave up. The wait starts
    from words read as unpublished, not from a :func:`~.exchange.peek` just after this program's
    publish: that first read measured 6-9 us a call slower at 128K-256K (H200, bf16)."""
    slots = slot_ptr + row.to(gx.int64) * PP + k
    kmask = k < P
    mk, sk = collect_pairs_from((k * 0).to(gx.int64), slots, kmask, SPIN_LIMIT)
    mk = gx.where(kmask, mk, float("-inf"))
    top = gx.max(mk, axis=0)
    m = gx.where(top > float("-inf"), top, 0.0)
    if gx.abs(m) < BIG:
        wk = gx.exp2(mk * LOG2E - m * LOG2E)
    else:
        wk = gx.exp2((mk - m) * LOG2E)
    return top, gx.sum(gx.where(kmask, sk * wk, 0.0), axis=0)


@flyc.gluon_kernel
def _slice_out(ring, xw_ptr, yrow, base, group, groups, col0, M, W, stride_xw, cols, m, inv,
               layout: gx.constexpr, CHUNK: gx.constexpr, CHUNKS: gx.constexpr, RING: gx.constexpr,
               SMALL: gx.constexpr):  # fmt: skip
    """Write the slice's y = e * inv (SMALL: e = 2^(x log2(e) - m log2(e) rounded), else 2^((x - m) log2 e)),
    each chunk's slot refilled with the chunk RING places later once every thread has read it."""
    shift = m * LOG2E
    for j in gx.static_range(CHUNKS):
        xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
        if SMALL:
            ye = gx.exp2(gx.fma(xe, LOG2E, -shift)) * inv
            yo = gx.exp2(gx.fma(xo, LOG2E, -shift)) * inv
        else:
            ye = gx.exp2((xe - m) * LOG2E) * inv
            yo = gx.exp2((xo - m) * LOG2E) * inv
        c = col0 + j * CHUNK + cols
        gx.store(yrow + c, bf16_words(ye, yo), mask=c < W)
        gx.thread_barrier()
        _issue(ring, xw_ptr, base + j + RING, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)


@flyc.gluon_kernel(do_not_specialize=["M", "groups"])
def softmax_fwd_resident_kernel(
    x_ptr, y_ptr, slot_ptr, M, N, P, groups, stride_x, stride_y,
    CHUNK: gx.constexpr, CHUNKS: gx.constexpr, RING: gx.constexpr, WARPS: gx.constexpr, EVEN: gx.constexpr,
    PP: gx.constexpr, SPIN_LIMIT: gx.constexpr,
):  # fmt: skip
    # rows as int32 words of two bf16 columns, a chunk held as chunk_words lays it out; EVEN: every slice of
    # every row is CHUNKS whole chunks (no column masks)
    THREADS: gx.constexpr = 32 * WARPS
    REPS: gx.constexpr = CHUNK // (4 * THREADS)
    layout: gx.constexpr = gx.BlockedLayout([1, 1, 4], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
    ring = gx.allocate_shared_memory(gx.int32, [RING, REPS, THREADS, 4], gx.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    cols = chunk_words(REPS, THREADS, layout)
    xw_ptr = x_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    yw_ptr = y_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    W = N // 2
    stride_xw = stride_x // 2
    pid = gx.program_id(0)
    part = pid % P
    group = pid // P
    col0 = part * (CHUNKS * CHUNK)
    k = gx.arange(0, PP, layout=gx.BlockedLayout([1], [32], [WARPS], [0]))
    for t in gx.static_range(RING):
        _issue(ring, xw_ptr, t, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)
    for it in range(gx.cdiv(M - group, groups)):
        row = group + it * groups
        base = it * CHUNKS
        # chunks issued so far: base + RING (one for each chunk of earlier rows read by the output pass)
        top, total, widest = _slice_stats(ring, base, col0, W, cols, layout, RING - 1, CHUNK, CHUNKS, RING, EVEN)
        if widest >= BIG:  # rare: the slice's sum again, exactly, from the chunks still held
            total = _slice_sum_exact(ring, base, col0, W, cols, gx.where(top > float("-inf"), top, 0.0), layout,
                                     CHUNK, CHUNKS, RING, EVEN)  # fmt: skip
        if PP > 1:
            publish_pair(slot_ptr + row.to(gx.int64) * PP + part, top, total, row < M)
            top, total = _row_stats(slot_ptr, row, P, k, PP, SPIN_LIMIT)
        m = gx.where(top > float("-inf"), top, 0.0)
        inv = 1.0 / total  # an all -inf row: 0 / 0, NaN as torch.softmax
        yrow = yw_ptr + row.to(gx.int64) * (stride_y // 2)
        if gx.abs(m) < BIG:
            _slice_out(ring, xw_ptr, yrow, base, group, groups, col0, M, W, stride_xw, cols, m, inv, layout, CHUNK,
                       CHUNKS, RING, True)  # fmt: skip
        else:
            _slice_out(ring, xw_ptr, yrow, base, group, groups, col0, M, W, stride_xw, cols, m, inv, layout, CHUNK,
                       CHUNKS, RING, False)  # fmt: skip
    gx.async_copy.wait_group(0)
