"""Probe: softmax with each program's row slice resident in shared memory (Gluon), against the staged kernel.

    python benchmarks/probe_resident.py --compile             (offline sm_90: registers, shared memory)
    python benchmarks/probe_resident.py --widths 65536 --out DIR   (GPU: check against torch, then time)

The staged kernel (``_kernels/split.py``) splits a 64K row over four programs that exchange their partial
results through global memory, and keeps each slice's exponentials in registers. Here one program holds its
whole slice (up to 64K bf16 columns, 128 KB) in a ring of shared-memory chunks filled by ``cp.async``: the
max, the sum and the output are three passes over shared memory, and a chunk's slot is refilled with a
later row's chunk as soon as the output pass has read it. Written in Gluon (Triton's explicit-layout
language), which gives a kernel its own shared memory; the ``fx`` language does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from flydsl_common.device import _await_ptx, collect_pairs_from, peek

LOG2E = gl.constexpr(1.4426950408889634)


NEG_INF_PAIR = gl.constexpr(-8323200)  # 0xFF80FF80: two bf16 -inf


@gluon.jit
def _max_bf16x2(a, b):
    return gl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32, is_pure=True,
                                     pack=1)  # fmt: skip


@gluon.jit
def _pack_bf16x2(lo, hi):
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=gl.int32,
                                     is_pure=True, pack=1)  # fmt: skip


_AWAIT_PAIR = gl.constexpr(_await_ptx(2))
BIG = gl.constexpr(65536.0)  # maxima this large take e = 2^((x - m) log2(e)), exact at the max


@gluon.jit
def _issue(ring, xw_ptr, t, group, groups, col0, M, W, stride_xw, cols,
           CHUNK: gl.constexpr, CHUNKS: gl.constexpr, RING: gl.constexpr):  # fmt: skip
    """Queue the copy of chunk ``t`` of this program's sequence (row group + (t // CHUNKS) * groups, chunk t %
    CHUNKS of the slice from word col0; CHUNK int32 words of two columns) into slot t % RING, as one commit
    group (an empty group past the last row: the group counts stay the same every row)."""
    row = group + (t // CHUNKS) * groups
    c = col0 + (t % CHUNKS) * CHUNK + cols
    ok = (row < M) & (c < W)
    cp.async_copy_global_to_shared(ring.index(t % RING), xw_ptr + row.to(gl.int64) * stride_xw + c, mask=ok)
    cp.commit_group()


@gluon.jit
def _e(x, m, shift, SMALL: gl.constexpr):
    """2^(x log2(e) - shift), one FMA (SMALL: |m| < BIG), or 2^((x - m) log2(e)), exactly 1 at the max."""
    if SMALL:
        return gl.exp2(gl.fma(x, LOG2E, -shift))
    return gl.exp2((x - m) * LOG2E)


@gluon.jit
def _lo(w):
    return (w << 16).to(gl.float32, bitcast=True)


@gluon.jit
def _hi(w):
    return (w & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _mine_max_words(w):
    """Words [REPS, THREADS, 4] reduced over each thread's own (max of each half): [THREADS], no exchange."""
    return gl.reduce(gl.reduce(w, 2, _max_bf16x2), 0, _max_bf16x2)


@gluon.jit
def _mine_sum(x):
    return gl.sum(gl.sum(x, axis=2), axis=0)


@gluon.jit
def _slice_max(ring, base, col0, W, cols, layout: gl.constexpr, WAIT_FROM: gl.constexpr, CHUNK: gl.constexpr,
               CHUNKS: gl.constexpr, RING: gl.constexpr, EVEN: gl.constexpr, WAIT: gl.constexpr):  # fmt: skip
    """The max of the slice in chunks base.. of the sequence, each chunk read as soon as it lands (chunk base + j
    once at most WAIT_FROM - j copy groups are still in flight); -inf for an all -inf slice."""
    mx = gl.full(cols.shape, NEG_INF_PAIR, gl.int32, layout)
    for j in gl.static_range(CHUNKS):
        if WAIT:
            cp.wait_group(WAIT_FROM - j)
            gl.thread_barrier()
        w = ring.index((base + j) % RING).load(layout)
        if not EVEN:
            w = gl.where(col0 + j * CHUNK + cols < W, w, NEG_INF_PAIR)
        mx = _max_bf16x2(mx, w)
    mx = _mine_max_words(mx)
    return gl.max(gl.maximum(_lo(mx), _hi(mx)), axis=0)


@gluon.jit
def _slice_sum(ring, base, col0, W, cols, m, shift, layout: gl.constexpr, CHUNK: gl.constexpr,
               CHUNKS: gl.constexpr, RING: gl.constexpr, EVEN: gl.constexpr, SMALL: gl.constexpr):  # fmt: skip
    acc = gl.zeros(cols.shape, gl.float32, layout)
    for j in gl.static_range(CHUNKS):
        w = ring.index((base + j) % RING).load(layout)
        e = _e(_lo(w), m, shift, SMALL) + _e(_hi(w), m, shift, SMALL)
        if not EVEN:
            e = gl.where(col0 + j * CHUNK + cols < W, e, 0.0)
        acc += e
    return gl.sum(_mine_sum(acc), axis=0)


@gluon.jit
def _slice_online(ring, base, col0, W, cols, layout: gl.constexpr, WAIT_FROM: gl.constexpr, CHUNK: gl.constexpr,
                  CHUNKS: gl.constexpr, RING: gl.constexpr, EVEN: gl.constexpr):  # fmt: skip
    """Passes 1 and 2 in one, each chunk as it lands: every thread keeps the max of its own columns and their
    sum of 2^(x log2(e) - its shift), rescaled when its max grows; then one merge across the program.
    Returns (max or -inf, sum, the largest |max| of a thread: past BIG the caller takes the two passes)."""
    mt = gl.max(gl.full(cols.shape, float("-inf"), gl.float32, layout), axis=2)
    mt = gl.max(mt, axis=0)
    st = gl.zeros_like(mt)
    for j in gl.static_range(CHUNKS):
        cp.wait_group(WAIT_FROM - j)
        gl.thread_barrier()
        w = ring.index((base + j) % RING).load(layout)
        if not EVEN:
            w = gl.where(col0 + j * CHUNK + cols < W, w, NEG_INF_PAIR)
        cw = _mine_max_words(w)
        mnew = gl.maximum(mt, gl.maximum(_lo(cw), _hi(cw)))
        znew = gl.where(mnew > float("-inf"), mnew, 0.0)
        zold = gl.where(mt > float("-inf"), mt, 0.0)
        st = gl.where(mt > float("-inf"), st * gl.exp2(zold * LOG2E - znew * LOG2E), 0.0)
        sh = gl.expand_dims(gl.expand_dims(znew * LOG2E, 0), 2)
        e = gl.exp2(gl.fma(_lo(w), LOG2E, -sh)) + gl.exp2(gl.fma(_hi(w), LOG2E, -sh))
        if not EVEN:
            e = gl.where(col0 + j * CHUNK + cols < W, e, 0.0)
        st += _mine_sum(e)
        mt = mnew
    top = gl.max(mt, axis=0)
    z = gl.where(top > float("-inf"), top, 0.0)
    zt = gl.where(mt > float("-inf"), mt, 0.0)
    total = gl.sum(gl.where(mt > float("-inf"), st * gl.exp2(zt * LOG2E - z * LOG2E), 0.0), axis=0)
    return top, total, gl.max(gl.abs(zt), axis=0)


@gluon.jit
def _slice_out(ring, xw_ptr, yrow, base, group, groups, col0, M, W, stride_xw, cols, m, shift, inv,
               layout: gl.constexpr, CHUNK: gl.constexpr, CHUNKS: gl.constexpr, RING: gl.constexpr,
               SMALL: gl.constexpr):  # fmt: skip
    """Write the slice's y; each chunk's slot refilled (chunk + RING of the sequence) once every thread read it."""
    for j in gl.static_range(CHUNKS):
        w = ring.index((base + j) % RING).load(layout)
        lo = _e(_lo(w), m, shift, SMALL) * inv
        hi = _e(_hi(w), m, shift, SMALL) * inv
        c = col0 + j * CHUNK + cols
        gl.store(yrow + c, _pack_bf16x2(lo, hi), mask=c < W)
        gl.thread_barrier()
        _issue(ring, xw_ptr, base + j + RING, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)


@gluon.jit
def _slice_stats(ring, slot_ptr, row, M, part, base, col0, W, cols, layout: gl.constexpr, WAIT_FROM: gl.constexpr,
                 CHUNK: gl.constexpr, CHUNKS: gl.constexpr, RING: gl.constexpr, EVEN: gl.constexpr,
                 PP: gl.constexpr, FUSED: gl.constexpr):  # fmt: skip
    """Passes 1 and 2 of a slice: (max or -inf, sum of 2^(x log2(e) - shift)); with PP > 1 also published as
    one tagged word (the sum's sign bit the tag) in the row's slot ``part``."""
    if FUSED:
        mraw, total, widest = _slice_online(ring, base, col0, W, cols, layout, WAIT_FROM, CHUNK, CHUNKS, RING, EVEN)
        if widest >= BIG:  # rare: maxima past BIG, the exact two passes over the slice still held
            m = gl.where(mraw > float("-inf"), mraw, 0.0)
            total = _slice_sum(ring, base, col0, W, cols, m, m * LOG2E, layout, CHUNK, CHUNKS, RING, EVEN, False)
    else:
        mraw = _slice_max(ring, base, col0, W, cols, layout, WAIT_FROM, CHUNK, CHUNKS, RING, EVEN, True)
        m = gl.where(mraw > float("-inf"), mraw, 0.0)  # an all -inf slice: e = 0 everywhere
        if gl.abs(m) < BIG:
            total = _slice_sum(ring, base, col0, W, cols, m, m * LOG2E, layout, CHUNK, CHUNKS, RING, EVEN, True)
        else:
            total = _slice_sum(ring, base, col0, W, cols, m, m * LOG2E, layout, CHUNK, CHUNKS, RING, EVEN, False)
    if PP > 1:
        lo_bits = mraw.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF
        hi_bits = (total.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF) | 0x80000000
        gl.atomic_xchg(slot_ptr + row.to(gl.int64) * PP + part, lo_bits | (hi_bits << 32), mask=row < M,
                       sem="relaxed", scope="gpu")  # fmt: skip
    return mraw, total


@gluon.jit
def _row_stats(slot_ptr, row, P, k, small_layout: gl.constexpr, PP: gl.constexpr, SPIN_LIMIT: gl.constexpr,
               HELPERS: gl.constexpr = False):  # fmt: skip
    """The row's (max, sum) from its P slices' slots, each slice's sum rescaled to the row's max."""
    kmask = k < P
    if HELPERS:
        slots = slot_ptr + row.to(gl.int64) * PP + k
        mk, sk = collect_pairs_from(peek(slots), slots, kmask, SPIN_LIMIT)
        hk = sk.to(gl.int32, bitcast=True)
    else:
        mk, hk = gl.inline_asm_elementwise(
        _AWAIT_PAIR, "=r,=r,l,l,r,r",
            [gl.zeros([PP], gl.int64, small_layout), slot_ptr + row.to(gl.int64) * PP + k, kmask.to(gl.int32),
             gl.full([PP], SPIN_LIMIT, gl.int32, small_layout)],
            dtype=(gl.float32, gl.int32), is_pure=False, pack=1)  # fmt: skip
    sk = (hk & 0x7FFFFFFF).to(gl.float32, bitcast=True)
    mk = gl.where(kmask, mk, float("-inf"))
    top = gl.max(mk, axis=0)
    m = gl.where(top > float("-inf"), top, 0.0)
    if gl.abs(m) < BIG:
        wk = gl.exp2(mk * LOG2E - m * LOG2E)  # the slices' own shifts, as rounded there
    else:
        wk = gl.exp2((mk - m) * LOG2E)
    return top, gl.sum(gl.where(kmask, sk * wk, 0.0), axis=0)  # NaN where a wait gave up: the row poisoned


@gluon.jit
def _softmax_resident_kernel(
    x_ptr, y_ptr, slot_ptr, M, N, stride_x, stride_y, P,
    CHUNK: gl.constexpr, CHUNKS: gl.constexpr, RING: gl.constexpr, WARPS: gl.constexpr, EVEN: gl.constexpr,
    PP: gl.constexpr, SPIN_LIMIT: gl.constexpr, AHEAD: gl.constexpr, COPY: gl.constexpr = False,
    FUSED: gl.constexpr = False, HELPERS: gl.constexpr = False,
):  # fmt: skip
    # rows as int32 words of two bf16 columns (N and the strides even); CHUNK words a chunk, CHUNKS chunks a
    # slice; P programs a row (program = group * P + part), exchanging (max, sum) through int64 slots. AHEAD:
    # passes 1-2 of the next row run before this row's exchange is awaited (two slices resident). A chunk is
    # held as [REPS, THREADS, 4] words: four consecutive words a thread, REPS times
    THREADS: gl.constexpr = 32 * WARPS
    REPS: gl.constexpr = CHUNK // (4 * THREADS)
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
    small_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    ring = gl.allocate_shared_memory(gl.int32, [RING, REPS, THREADS, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    s0: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, layout))
    r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, REPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout))), 1), 2)
    t3 = gl.expand_dims(gl.expand_dims(gl.arange(0, THREADS, layout=s0), 0), 2)
    i3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout))), 0), 1)
    cols = (r3 * THREADS + t3) * 4 + i3
    xw_ptr = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    yw_ptr = y_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    W = N // 2
    stride_xw = stride_x // 2
    pid = gl.program_id(0)
    part = pid % P
    group = pid // P
    groups = gl.num_programs(0) // P
    col0 = part * (CHUNKS * CHUNK)
    rows_mine = gl.cdiv(M - group, groups)
    k = gl.arange(0, PP, layout=small_layout)
    for t in gl.static_range(RING):
        _issue(ring, xw_ptr, t, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)
    if AHEAD:
        mraw, total = _slice_stats(ring, slot_ptr, group, M, part, 0, col0, W, cols, layout, RING - 1, CHUNK,
                                   CHUNKS, RING, EVEN, PP, FUSED)  # fmt: skip
    for it in range(rows_mine):
        row = group + it * groups
        base = it * CHUNKS
        if AHEAD:
            mraw_nx, total_nx = _slice_stats(ring, slot_ptr, row + groups, M, part, base + CHUNKS, col0, W, cols,
                                             layout, RING - CHUNKS - 1, CHUNK, CHUNKS, RING, EVEN, PP,
                                             FUSED)  # fmt: skip
        else:
            mraw, total = _slice_stats(ring, slot_ptr, row, M, part, base, col0, W, cols, layout, RING - 1, CHUNK,
                                       CHUNKS, RING, EVEN, PP, FUSED)  # fmt: skip
        if PP > 1:
            mraw, total = _row_stats(slot_ptr, row, P, k, small_layout, PP, SPIN_LIMIT, HELPERS)
        m = gl.where(mraw > float("-inf"), mraw, 0.0)
        inv = 1.0 / total  # an all -inf row: 0 / 0, NaN as torch
        yrow = yw_ptr + row.to(gl.int64) * (stride_y // 2)
        if COPY:  # probe only: the ring's own rate (words copied through unchanged, the waits kept)
            for j in gl.static_range(CHUNKS):
                w = ring.index((base + j) % RING).load(layout)
                c = col0 + j * CHUNK + cols
                gl.store(yrow + c, w, mask=c < W)
                gl.thread_barrier()
                _issue(ring, xw_ptr, base + j + RING, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS,
                       RING)  # fmt: skip
        elif gl.abs(m) < BIG:
            _slice_out(ring, xw_ptr, yrow, base, group, groups, col0, M, W, stride_xw, cols, m, m * LOG2E, inv,
                       layout, CHUNK, CHUNKS, RING, True)  # fmt: skip
        else:
            _slice_out(ring, xw_ptr, yrow, base, group, groups, col0, M, W, stride_xw, cols, m, m * LOG2E, inv,
                       layout, CHUNK, CHUNKS, RING, False)  # fmt: skip
        if AHEAD:
            mraw = mraw_nx
            total = total_nx
    cp.wait_group(0)


def _parts(w, chunk, ring, ahead):
    """Slices a row of ``w`` words: one when it fits ring - 4 chunks; else slices of (ring - 4) // 2 chunks
    (AHEAD: two resident) or ring - 4."""
    if w <= chunk * (ring - 4):
        return 1
    return triton.cdiv(w, chunk * ((ring - 4) // 2 if ahead else ring - 4))


def launch(x2, y2, chunk=4096, ring=12, warps=16, ahead=True, slots=None, max_groups=None, copy=False, fused=False,
           helpers=False):
    """``chunk``: int32 words (two columns each) a chunk; ``max_groups``: programs at most."""
    m, n = x2.shape
    assert n % 2 == 0 and x2.stride(0) % 2 == 0 and y2.stride(0) % 2 == 0
    w = n // 2
    parts = _parts(w, chunk, ring, ahead)
    ahead = ahead and parts > 1
    chunks = triton.cdiv(triton.cdiv(w, parts), chunk)
    pp = triton.next_power_of_2(parts)
    sms = torch.cuda.get_device_properties(x2.device).multi_processor_count
    groups = min(m, sms // parts, (max_groups or sms) // parts)
    if pp > 1 and slots is None:
        slots = torch.zeros(m, pp, dtype=torch.int64, device=x2.device)
    _softmax_resident_kernel[(groups * parts,)](
        x2, y2, slots if pp > 1 else x2, m, n, x2.stride(0), y2.stride(0), parts, CHUNK=chunk, CHUNKS=chunks,
        RING=ring, WARPS=warps, EVEN=(w == parts * chunks * chunk), PP=pp, SPIN_LIMIT=1 << 20, AHEAD=ahead, COPY=copy,
        FUSED=fused, HELPERS=helpers, num_warps=warps,
    )  # fmt: skip


def _compile_offline(n=65536, chunk=4096, ring=12, warps=16, ahead=True, fused=False):
    os.environ.setdefault("FLYDSL_INTERPRET", "0")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    k = _softmax_resident_kernel
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "slot_ptr": "*i64", "M": "i32", "N": "i32", "stride_x": "i32",
           "stride_y": "i32", "P": "i32"}
    w = n // 2
    parts = _parts(w, chunk, ring, ahead)
    chunks = triton.cdiv(triton.cdiv(w, parts), chunk)
    consts = dict(CHUNK=chunk, CHUNKS=chunks, RING=ring, WARPS=warps, EVEN=w == parts * chunks * chunk,
                  PP=triton.next_power_of_2(parts), SPIN_LIMIT=1 << 20, AHEAD=ahead and parts > 1,
                  FUSED=fused)
    for name in consts:
        sig[name] = "constexpr"
    aligned = ("x_ptr", "y_ptr", "N", "stride_x", "stride_y")
    attrs = {(k.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(k, sig, consts, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(cuobjdump), "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", cubin], capture_output=True, text=True).stdout
    print(re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out).group(0), "smem", compiled.metadata.shared)
    return compiled, sass


def _check(n, m, device, strided=False, fused=False):
    """Largest |y - softmax(x)| / max softmax over rows with long -inf stretches, shifted rows and maxima
    past BIG (the slow branch), against fp64."""
    torch.manual_seed(n + m)
    x = torch.randn(m, n, device=device, dtype=torch.float32) * 3
    x[0, : n // 3] = float("-inf")
    if m > 1:
        x[1] += 200.0
    if m > 2:
        x[2, : n // 2] = float("-inf")  # a whole slice -inf, the rest far below 0
        x[2, n // 2 :] -= 200.0
    if m > 3:
        x[3] = x[3] * 1e4 + 3e5  # maxima past BIG
    if m > 4:
        x[4] -= 1e5
    xb = x.to(torch.bfloat16)
    if strided:
        wide = torch.zeros(m, n + 64, device=device, dtype=torch.bfloat16)
        wide[:, :n] = xb
        xb = wide[:, :n]
    y = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
    launch(xb, y, fused=fused)
    ref = torch.softmax(xb.double(), dim=-1)
    err = ((y.double() - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)).max().item()
    return err


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true")
    p.add_argument("--widths", default="65536")
    p.add_argument("--check", default="", help="widths only checked, not timed")
    p.add_argument("--out", default=None)
    p.add_argument("--variants", default="4096:12:16")
    args = p.parse_args(argv)
    if args.compile:
        for v in args.variants.split(","):
            fused = v.startswith("fused:")
            chunk, ring, warps, ahead = (list(map(int, v.removeprefix("fused:").split(":"))) + [1])[:4]
            for n in map(int, args.widths.split(",")):
                print(n, v, end=" ")
                _compile_offline(n, chunk, ring, warps, bool(ahead), fused)
        return
    import fly_norm
    from flydsl.autotune.timer import bench

    dev = torch.device("cuda")
    rows = []
    total = int(os.environ.get("PROBE_ELEMENTS", 1 << 27))
    src = torch.empty(total // 2, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_us = bench(lambda: dst.copy_(src)).median_us
    copy_gbs = 2 * src.numel() * 4 / copy_us / 1e3
    print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    for n in [int(c) for c in args.check.split(",") if c]:
        for m_chk, strided, fused in ((1, False, True), (5, True, True), (133, False, True), (133, False, False)):
            err = _check(n, m_chk, dev, strided, fused)
            print(f"check N={n} M={m_chk} strided={strided} fused={fused}: rel err {err:.2e}", flush=True)
            assert err < 1e-2, err
    for n in map(int, args.widths.split(",")):
        for m_chk, strided, fused in ((1, False, True), (5, True, True), (133, False, True), (133, False, False)):
            err = _check(n, m_chk, dev, strided, fused)
            print(f"check N={n} M={m_chk} strided={strided} fused={fused}: rel err {err:.2e}", flush=True)
            assert err < 1e-2, err
        m = max(1, total // n)
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        gbytes = 2 * x.numel() * 2 / 1e3
        row = {"N": n, "copy_gbs": copy_gbs}
        row["shipped"] = gbytes / bench(lambda x=x: fly_norm.softmax(x)).median_us / copy_gbs
        for v in args.variants.split(","):
            copy = v.startswith("copy:")
            fused = v.startswith("fused:")
            f = v.removeprefix("copy:").removeprefix("fused:").split(":")
            chunk, ring, warps, ahead, cap = (list(map(int, f)) + [1, 0][len(f) - 3 :])[:5]
            try:
                cfg = (chunk, ring, warps, bool(ahead))
                opts = dict(max_groups=cap, copy=copy, fused=fused)
                t = bench(lambda x=x, y=y, c=cfg, o=opts: launch(x, y, *c, **o)).median_us
                row[v] = gbytes / t / copy_gbs
            except Exception as e:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                row[v] = repr(e)[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(os.path.join(args.out, "probe-resident.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
