"""Probe (not yet measured): the norms' forward at 64K-256K with each slice of a row resident in shared memory.

    python benchmarks/probe_resident_fwd.py --compile                   (offline sm_90: registers, shared memory)
    python benchmarks/probe_resident_fwd.py --widths 65536 131072 262144 --out DIR   (GPU: check, then time)

The resident softmax forward's scheme (``_kernels/resident.py``, PERF.md v18) for layer_norm, whose staged
forward holds 16K-column slices in registers (84 / 82% of the copy at 128K / 256K, v17): a program owns a
slice of CHUNKS chunks (CHUNK int32 words each) of its rows; its weight and bias for the slice sit in shared
memory, loaded once (a program's columns never change), beside a ring of RING chunks of its rows' x filled
by ``cp.async``. For each row it

1. sums x and x^2 over its slice elementwise as the chunks land, reduces both once, and takes the slice's
   M2 as sum x^2 - sum x * mean (where that cancels more than 6 bits, about the mean again from the chunks
   still held, as the staged kernel does); publishes (sum, M2) in one word and merges the slices' with
   Chan's formula (rms_norm: the sum of squares alone);
2. writes y = (x - mean) * (rstd * w) + b from shared memory, each chunk's slot refilled with the chunk
   RING places later once every thread has read it.

Scope: bf16, weight and bias present (rms_norm: weight), no residual, no weight offset; mean and rstd stored.
Variants CHUNK:CHUNKS:RING (words a chunk, chunks a slice, ring slots; the weight and bias take 2 * CHUNKS
more chunk-sized buffers). Prediction (written before any run): 4096:2:10 (16K-column slices as the staged
kernel's, 8 chunks of later rows in flight) layer_norm 128K / 256K 84 / 82% -> 86-88%; 4096:4:6 (32K
slices, 2 in flight) lower (too little in flight).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
import flydsl.compiler as flyc
import flydsl.gexpr as gx
from fly_norm._kernels.passes import word_aligned
from fly_norm._kernels.resident import chunk_words
from flydsl_common.device import (
    bf16_pairs,
    bf16_words,
    collect_from,
    collect_pairs_from,
    publish,
    publish_pair,
    sum2_f32,
)


@flyc.gluon_kernel
def _issue(ring, xw_ptr, t, group, groups, col0, M, W, stride_xw, cols,
           CHUNK: gx.constexpr, CHUNKS: gx.constexpr, RING: gx.constexpr):  # fmt: skip
    row = group + (t // CHUNKS) * groups
    c = col0 + (t % CHUNKS) * CHUNK + cols
    gx.async_copy.async_copy_global_to_shared(ring.index(t % RING), xw_ptr + row.to(gx.int64) * stride_xw + c,
                                              mask=(row < M) & (c < W))  # fmt: skip
    gx.async_copy.commit_group()


@flyc.gluon_kernel
def _all_sum2(a, b):
    """Sums of two [REPS, THREADS, 4] blocks over the program: the threads' own elements first, one exchange."""
    a, b = sum2_f32(a, b, 2)
    a, b = sum2_f32(a, b, 0)
    return sum2_f32(a, b, 0)


@flyc.gluon_kernel(do_not_specialize=["M", "groups"])
def _norm_fwd_resident_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, slot_ptr, M, N, P, groups, stride_x, stride_y, eps,
    CHUNK: gx.constexpr, CHUNKS: gx.constexpr, RING: gx.constexpr, WARPS: gx.constexpr, PP: gx.constexpr,
    SPIN_LIMIT: gx.constexpr, IS_RMS: gx.constexpr,
):  # fmt: skip
    THREADS: gx.constexpr = 32 * WARPS
    REPS: gx.constexpr = CHUNK // (4 * THREADS)
    layout: gx.constexpr = gx.BlockedLayout([1, 1, 4], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
    smem: gx.constexpr = gx.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    ring = gx.allocate_shared_memory(gx.int32, [RING, REPS, THREADS, 4], smem)
    wb = gx.allocate_shared_memory(gx.int32, [2 * CHUNKS, REPS, THREADS, 4], smem)  # weight, then bias words
    cols = chunk_words(REPS, THREADS, layout)
    xw_ptr = x_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    yw_ptr = y_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    W = N // 2
    stride_xw = stride_x // 2
    pid = gx.program_id(0)
    part = pid % P
    group = pid // P
    col0 = part * (CHUNKS * CHUNK)
    for j in gx.static_range(CHUNKS):
        c = col0 + j * CHUNK + cols
        wb.index(j).store(gx.load(w_ptr.to(gx.pointer_type(gx.int32), bitcast=True) + c, mask=c < W, other=0))
        if not IS_RMS:
            wb.index(CHUNKS + j).store(gx.load(b_ptr.to(gx.pointer_type(gx.int32), bitcast=True) + c, mask=c < W,
                                               other=0))  # fmt: skip
    n_mine = gx.minimum(W - col0, CHUNKS * CHUNK) * 2.0  # the slice's columns
    k = gx.arange(0, PP, layout=gx.BlockedLayout([1], [32], [WARPS], [0]))
    n_k = gx.maximum(gx.minimum(W - k * (CHUNKS * CHUNK), CHUNKS * CHUNK), 1) * 2.0  # each slice's columns
    kmask = k < P
    for t in gx.static_range(RING):
        _issue(ring, xw_ptr, t, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)
    for it in range(gx.cdiv(M - group, groups)):
        row = group + it * groups
        base = it * CHUNKS
        # pass 1, each chunk as it lands (issued so far: base + RING); masked columns read 0
        s1 = gx.zeros(cols.shape, gx.float32, layout)
        s2 = gx.zeros(cols.shape, gx.float32, layout)
        for j in gx.static_range(CHUNKS):
            gx.async_copy.wait_group(RING - 1 - j)
            gx.thread_barrier()
            xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
            s1 += xe + xo
            s2 += xe * xe + xo * xo
        t1, t2 = _all_sum2(s1, s2)
        if IS_RMS:
            if PP > 1:
                slots = slot_ptr + row.to(gx.int64) * PP + k
                publish(slot_ptr + row.to(gx.int64) * PP + part, t2, row < M)
                t2 = gx.sum(collect_from((k * 0).to(gx.int64), slots, kmask, SPIN_LIMIT), axis=0)
            mean = 0.0
            rstd = gx.rsqrt(t2 / N + eps)
        else:
            m_mine = t1 / n_mine
            m2 = t2 - t1 * m_mine
            if m2 * 64.0 < t2:  # cancellation: M2 about the slice's mean again, from the chunks held
                acc = gx.zeros(cols.shape, gx.float32, layout)
                for j in gx.static_range(CHUNKS):
                    xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
                    ok = col0 + j * CHUNK + cols < W
                    de = gx.where(ok, xe - m_mine, 0.0)
                    do = gx.where(ok, xo - m_mine, 0.0)
                    acc += de * de + do * do
                m2 = gx.sum(gx.sum(gx.sum(acc, axis=2), axis=0), axis=0)
            if PP > 1:
                slots = slot_ptr + row.to(gx.int64) * PP + k
                publish_pair(slot_ptr + row.to(gx.int64) * PP + part, t1, m2, row < M)
                sums, m2s = collect_pairs_from((k * 0).to(gx.int64), slots, kmask, SPIN_LIMIT)
                mean = gx.sum(sums, axis=0) / N
                dev = gx.where(kmask, sums / n_k - mean, 0.0)
                m2, spread = sum2_f32(m2s, n_k * dev * dev, 0)  # Chan: the slices' M2s and their means' spread
                m2 = m2 + spread
            else:
                mean = m_mine
            rstd = gx.rsqrt(m2 / N + eps)
            gx.store(mean_ptr + row, mean, mask=(part == 0) & (row < M))
        gx.store(rstd_ptr + row, rstd, mask=(part == 0) & (row < M))
        # pass 2: y from the chunks and the weight and bias held; each slot refilled once read
        yrow = yw_ptr + row.to(gx.int64) * (stride_y // 2)
        for j in gx.static_range(CHUNKS):
            xe, xo = bf16_pairs(ring.index((base + j) % RING).load(layout))
            we, wo = bf16_pairs(wb.index(j).load(layout))
            if IS_RMS:
                ye = xe * rstd * we
                yo = xo * rstd * wo
            else:
                be, bo = bf16_pairs(wb.index(CHUNKS + j).load(layout))
                ye = gx.fma(xe - mean, we * rstd, be)
                yo = gx.fma(xo - mean, wo * rstd, bo)
            c = col0 + j * CHUNK + cols
            gx.store(yrow + c, bf16_words(ye, yo), mask=c < W)
            gx.thread_barrier()
            _issue(ring, xw_ptr, base + j + RING, group, groups, col0, M, W, stride_xw, cols, CHUNK, CHUNKS, RING)
    gx.async_copy.wait_group(0)


def launch(x, w, b, eps, is_rms, chunk=4096, chunks=2, ring=10, warps=16):
    """(y, mean, rstd) of bf16 rows [M, N] (word aligned), slices of ``chunks`` chunks of ``chunk`` words."""
    m, n = x.shape
    assert word_aligned(x, w) and x.dtype == w.dtype == torch.bfloat16
    parts = triton.cdiv(n // 2, chunk * chunks)
    pp = triton.next_power_of_2(parts)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    groups = min(m, sms // parts)
    y = torch.empty_like(x)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    slots = torch.zeros(m, pp, dtype=torch.int64, device=x.device) if parts > 1 else mean
    _norm_fwd_resident_kernel[(groups * parts,)](
        x, w, b if b is not None else w, y, mean, rstd, slots, m, n, parts, groups, x.stride(0), y.stride(0),
        float(eps), CHUNK=chunk, CHUNKS=chunks, RING=ring, WARPS=warps, PP=pp, SPIN_LIMIT=1 << 20, IS_RMS=is_rms,
        num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


def _compile_offline(n, is_rms, chunk, chunks, ring, warps=16):
    from probe_resident_bwd import compile_sm90

    sig = {p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
    sig.update({p: "*fp32" for p in ("mean_ptr", "rstd_ptr")}, slot_ptr="*i64", eps="fp32")
    sig.update({a: "i32" for a in ("M", "N", "P", "groups", "stride_x", "stride_y")})
    parts = triton.cdiv(n // 2, chunk * chunks)
    consts = dict(CHUNK=chunk, CHUNKS=chunks, RING=ring, WARPS=warps, PP=triton.next_power_of_2(parts),
                  SPIN_LIMIT=1 << 20, IS_RMS=is_rms)  # fmt: skip
    if parts == 1:
        consts["P"] = 1
    aligned = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "mean_ptr", "rstd_ptr", "slot_ptr", "N", "stride_x", "stride_y")
    return compile_sm90(_norm_fwd_resident_kernel, sig, consts, aligned, warps)


def main(argv=None):
    from fly_norm.reference import layer_norm_ref, rms_norm_ref

    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--widths", type=int, nargs="+", default=[65536, 131072, 262144])
    ap.add_argument("--variants", nargs="+", default=["4096:2:10", "4096:4:6", "2048:4:12"],
                    help="CHUNK:CHUNKS:RING")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = [tuple(map(int, v.split(":"))) for v in args.variants]
    if args.compile:
        for n in args.widths:
            for cfg in variants:
                for is_rms in (False, True):
                    print(n, cfg, "rms" if is_rms else "layer", *_compile_offline(n, is_rms, *cfg), flush=True)
        return
    import fly_norm
    from flydsl.autotune.timer import bench
    from flydsl_common.bench import copy_gbps

    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]
    for n in args.widths:
        for is_rms in (False, True):
            for cfg in variants:
                for m_chk, scale, shift in ((3, 2.0, 0.5), (301, 2.0, 0.5), (5, 1.0, 3000.0)):  # the last cancels
                    x = (torch.randn(m_chk, n, device="cuda") * scale + shift).bfloat16()
                    w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
                    b = torch.randn(n, device="cuda").bfloat16()
                    y, mean, rstd = launch(x, w, None if is_rms else b, 1e-5, is_rms, *cfg)
                    ref = rms_norm_ref(x, w, 1e-5) if is_rms else layer_norm_ref(x, w, b, 1e-5)
                    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
                    print(dict(check=n, rms=is_rms, cfg=cfg, M=m_chk, shift=shift, rel_err=err), flush=True)
                    assert err < 1e-2, err
            m = (1 << 27) // n
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
            w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
            b = torch.randn(n, device="cuda").bfloat16()
            moved = 2 * 2 * m * n
            bias = None if is_rms else b

            def shipped(x=x, w=w, b=bias):
                return fly_norm.rms_norm(x, w) if b is None else fly_norm.layer_norm(x, w, b)

            for _rep in range(2):
                us = bench(shipped).median_us
                r = dict(N=n, rms=is_rms, variant="shipped", us=us, frac=moved / (us * 1e-6) / 1e9 / copy)
                print(r, flush=True)
                rows.append(r)
                for cfg in variants:
                    us = bench(lambda c=cfg, x=x, w=w, b=bias, r=is_rms: launch(x, w, b, 1e-5, r, *c)).median_us
                    r = dict(N=n, rms=is_rms, variant=":".join(map(str, cfg)), us=us,
                             frac=moved / (us * 1e-6) / 1e9 / copy)  # fmt: skip
                    print(r, flush=True)
                    rows.append(r)
    if args.out:
        with open(os.path.join(args.out, "probe-resident-fwd.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
