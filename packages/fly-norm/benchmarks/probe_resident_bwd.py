"""Probe (not yet measured): the norms' backward at 16K-32K with each slice of a row resident in shared memory.

    python benchmarks/probe_resident_bwd.py --compile                 (offline sm_90: registers, shared memory)
    python benchmarks/probe_resident_bwd.py --widths 16384 32768 --out DIR     (GPU: check, then time)

The resident softmax forward (``_kernels/resident.py``, PERF.md v18) applied to the backward, whose staged
kernel holds 16 columns a thread a row at 8192 x 16 warps and spends 31 instructions an element (v17): here
a program owns one slice of CHUNK words (2 * CHUNK columns) of its rows; the ring holds its rows' x and dy
chunks in turn (two slots a row), filled by ``cp.async``. For each row it

1. waits for the row's two chunks, sums g * (x - mean) and g (g = dy * w) over its slice (one exchange
   between warps), and with P slices a row publishes both sums and awaits the others';
2. reads x and dy again from shared memory, writes dx = (g - c0 - xhat * c1) * rstd, and adds dy * xhat
   and dy to its columns' weight-gradient sums (held in registers across its rows, stored once at the end as
   [groups, N] partials); the two slots are then refilled with the chunks RING places later.

LayerNorm and RMSNorm with a weight, no residual gradient, no weight offset: the probe's scope. Variants
CHUNK:RING: 4096 words (8K columns, 16 a thread, as the staged kernel's slices; offline sm_90: 101 / 127
registers, no spill) with a ring of 12 or 6 slots (6 or 3 rows in flight), and 8192 words (one slice a 16K
row, no exchange; 32 columns a thread: it spills 160-224 bytes offline). Prediction (written before any
run): layer_norm 16K / 32K 79 / 77% (v17) -> 84-88% for 4096:12, rms_norm 87 / 85% -> 88-90%: a pass over
shared memory with the row's statistics taken in one exchange, in place of the staged pipeline's row
overhead; 8192:6 slower (its spills).
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
from flydsl_common.device import bf16_pairs, bf16_words, collect_from, publish, sum2_f32


@flyc.gluon_kernel
def _issue(ring, w_ptr, stride_w, row, slot, col0, M, W, cols):
    """Queue the copy of ``row``'s slice (words from col0) of one tensor into ``slot``, as one commit group."""
    c = col0 + cols
    gx.async_copy.async_copy_global_to_shared(ring.index(slot), w_ptr + row.to(gx.int64) * stride_w + c,
                                              mask=(row < M) & (c < W))  # fmt: skip
    gx.async_copy.commit_group()


@flyc.gluon_kernel(do_not_specialize=["M", "groups"])
def _norm_bwd_resident_kernel(
    x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dwp_ptr, dbp_ptr, slot_ptr,
    M, N, P, groups, stride_x, stride_dy, stride_dx,
    CHUNK: gx.constexpr, RING: gx.constexpr, WARPS: gx.constexpr, PP: gx.constexpr, SPIN_LIMIT: gx.constexpr,
    IS_RMS: gx.constexpr,
):  # fmt: skip
    THREADS: gx.constexpr = 32 * WARPS
    REPS: gx.constexpr = CHUNK // (4 * THREADS)
    ROWS: gx.constexpr = RING // 2  # rows in the ring: x and dy of each
    layout: gx.constexpr = gx.BlockedLayout([1, 1, 4], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
    ring = gx.allocate_shared_memory(gx.int32, [RING, REPS, THREADS, 4], gx.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    cols = chunk_words(REPS, THREADS, layout)
    xw_ptr = x_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    dyw_ptr = dy_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    dxw_ptr = dx_ptr.to(gx.pointer_type(gx.int32), bitcast=True)
    W = N // 2
    pid = gx.program_id(0)
    part = pid % P
    group = pid // P
    col0 = part * CHUNK
    ok = col0 + cols < W
    ww = gx.load(w_ptr.to(gx.pointer_type(gx.int32), bitcast=True) + col0 + cols, mask=ok, other=0)
    we, wo = bf16_pairs(ww)
    dwe = gx.zeros(cols.shape, gx.float32, layout)
    dwo = gx.zeros(cols.shape, gx.float32, layout)
    dbe = gx.zeros(cols.shape, gx.float32, layout)
    dbo = gx.zeros(cols.shape, gx.float32, layout)
    k = gx.arange(0, 2 * PP, layout=gx.BlockedLayout([1], [32], [WARPS], [0]))  # [part, (g * xhat, g)]
    kmask = (k // 2 < P) & (k % 2 < 2 - IS_RMS)
    for r in gx.static_range(ROWS):
        _issue(ring, xw_ptr, stride_x // 2, group + r * groups, 2 * r, col0, M, W, cols)
        _issue(ring, dyw_ptr, stride_dy // 2, group + r * groups, 2 * r + 1, col0, M, W, cols)
    for it in range(gx.cdiv(M - group, groups)):
        row = group + it * groups
        sx = (2 * it) % RING
        sdy = sx + 1
        rstd = gx.load(rstd_ptr + row)
        mean = 0.0 if IS_RMS else gx.load(mean_ptr + row)
        gx.async_copy.wait_group(RING - 2)  # issued so far: 2 * it + RING; this row's two are the oldest
        gx.thread_barrier()
        # pass 1: the slice's sums of g * (x - mean) and g (masked columns read 0: dy = 0 there, g too)
        xe, xo = bf16_pairs(ring.index(sx).load(layout))
        de, do = bf16_pairs(ring.index(sdy).load(layout))
        ge = de * we
        go = do * wo
        if IS_RMS:
            s_gh = gx.sum(gx.sum(gx.sum(ge * xe + go * xo, axis=2), axis=0), axis=0)
            s_g = s_gh * 0.0
        else:
            a, b = sum2_f32(ge * (xe - mean) + go * (xo - mean), ge + go, 2)
            s_gh, s_g = sum2_f32(a, b, 0)
            s_gh, s_g = sum2_f32(s_gh, s_g, 0)
        c1 = s_gh * rstd
        c0 = s_g
        if PP > 1:
            mine = slot_ptr + row.to(gx.int64) * (2 * PP) + 2 * part
            publish(mine, c1, row < M)
            if not IS_RMS:
                publish(mine + 1, c0, row < M)
            sums = collect_from((k * 0).to(gx.int64), slot_ptr + row.to(gx.int64) * (2 * PP) + k, kmask,
                                SPIN_LIMIT)  # fmt: skip
            c1, c0 = sum2_f32(gx.where(k % 2 == 0, sums, 0.0), gx.where(k % 2 == 1, sums, 0.0), 0)
        c1 = c1 / N  # mean(g * xhat)
        c0 = c0 / N  # mean(g); 0 for RMSNorm
        # pass 2: dx, and the columns' weight-gradient sums; then the row's two slots refilled
        xe, xo = bf16_pairs(ring.index(sx).load(layout))
        de, do = bf16_pairs(ring.index(sdy).load(layout))
        he = (xe - mean) * rstd
        ho = (xo - mean) * rstd
        dxe = (de * we - c0 - he * c1) * rstd
        dxo = (do * wo - c0 - ho * c1) * rstd
        gx.store(dxw_ptr + row.to(gx.int64) * (stride_dx // 2) + col0 + cols, bf16_words(dxe, dxo), mask=ok)
        dwe += de * he
        dwo += do * ho
        dbe += de
        dbo += do
        gx.thread_barrier()
        _issue(ring, xw_ptr, stride_x // 2, row + ROWS * groups, sx, col0, M, W, cols)
        _issue(ring, dyw_ptr, stride_dy // 2, row + ROWS * groups, sdy, col0, M, W, cols)
    gx.async_copy.wait_group(0)
    out = group.to(gx.int64) * N + 2 * (col0 + cols)
    gx.store(dwp_ptr + out, dwe, mask=ok)
    gx.store(dwp_ptr + out + 1, dwo, mask=ok)
    if not IS_RMS:
        gx.store(dbp_ptr + out, dbe, mask=ok)
        gx.store(dbp_ptr + out + 1, dbo, mask=ok)


def launch(h, w, dy, mean, rstd, is_rms, chunk=8192, ring=6, warps=16):
    """dx and the [groups, N] weight-gradient partials (dw, db or None) of bf16 rows [M, N], N <= 64 * 2 *
    chunk, word aligned. One program an SM (the ring's shared memory)."""
    m, n = h.shape
    assert word_aligned(h, dy, w) and h.dtype == dy.dtype == w.dtype == torch.bfloat16
    parts = triton.cdiv(n // 2, chunk)
    pp = triton.next_power_of_2(parts)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    groups = min(m, sms // parts)
    dx = torch.empty_like(h)
    dwp = torch.empty(groups, n, dtype=torch.float32, device=h.device)
    dbp = None if is_rms else torch.empty_like(dwp)
    slots = torch.zeros(m, 2 * pp, dtype=torch.int64, device=h.device) if parts > 1 else dwp
    _norm_bwd_resident_kernel[(groups * parts,)](
        h, w, dy, mean if mean is not None else rstd, rstd, dx, dwp, dbp if dbp is not None else dwp, slots,
        m, n, parts, groups, h.stride(0), dy.stride(0), dx.stride(0),
        CHUNK=chunk, RING=ring, WARPS=warps, PP=pp, SPIN_LIMIT=1 << 20, IS_RMS=is_rms, num_warps=warps,
    )  # fmt: skip
    return dx, dwp, dbp


def compile_sm90(kernel, sig: dict, consts: dict, aligned, warps: int):
    """('REG:n STACK:n', shared bytes) of a Gluon kernel compiled offline for sm_90 (no GPU needed)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**sig, **{name: "constexpr" for name in consts}}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})  # fmt: skip
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(cuobjdump), "-res-usage", cubin], capture_output=True, text=True).stdout
    return re.search(r"REG:(\d+) STACK:(\d+)", out).group(0), compiled.metadata.shared


def _compile_offline(n, is_rms, chunk=8192, ring=6, warps=16):
    ptrs = ("x_ptr", "w_ptr", "dy_ptr", "dx_ptr")
    sig = {p: "*bf16" for p in ptrs}
    sig.update({p: "*fp32" for p in ("mean_ptr", "rstd_ptr", "dwp_ptr", "dbp_ptr")}, slot_ptr="*i64")
    sig.update({a: "i32" for a in ("M", "N", "P", "groups", "stride_x", "stride_dy", "stride_dx")})
    parts = triton.cdiv(n // 2, chunk)
    consts = dict(CHUNK=chunk, RING=ring, WARPS=warps, PP=triton.next_power_of_2(parts), SPIN_LIMIT=1 << 20,
                  IS_RMS=is_rms)  # fmt: skip
    if parts == 1:
        consts["P"] = 1
    aligned = (*ptrs, "mean_ptr", "rstd_ptr", "dwp_ptr", "dbp_ptr", "slot_ptr", "N", "stride_x", "stride_dy",
               "stride_dx")  # fmt: skip
    return compile_sm90(_norm_bwd_resident_kernel, sig, consts, aligned, warps)


def _reference(h, w, dy, is_rms, eps):
    """(dx, dw, db) in fp64 through autograd, and the fp32 (mean, rstd) the kernel takes."""
    hd = h.double().requires_grad_()
    wd = w.double().requires_grad_()
    if is_rms:
        rstd = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
        y, mean = hd * rstd * wd, None
    else:
        mean = hd.mean(-1, keepdim=True)
        rstd = torch.rsqrt(hd.var(-1, unbiased=False, keepdim=True) + eps)
        y = (hd - mean) * rstd * wd
    dx, dw = torch.autograd.grad(y, (hd, wd), dy.double())
    db = None if is_rms else dy.double().sum(0)
    stats = (None if mean is None else mean.squeeze(-1).float(), rstd.squeeze(-1).float())
    return dx, dw, db, stats


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--widths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--out", default=None)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192], help="words a slice (--compile)")
    ap.add_argument("--variants", nargs="+", default=["4096:12", "4096:6", "8192:6"], help="CHUNK:RING")
    args = ap.parse_args(argv)
    if args.compile:
        for n in args.widths:
            for chunk in args.chunks:
                for is_rms in (False, True):
                    print(n, chunk, "rms" if is_rms else "layer", *_compile_offline(n, is_rms, chunk), flush=True)
        return
    import fly_norm
    from flydsl.autotune.timer import bench
    from flydsl_common.bench import copy_gbps

    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]
    for n in args.widths:
        for is_rms in (False, True):
            variants = [tuple(map(int, v.split(":"))) for v in args.variants]
            for chunk, ring in variants:
                for m_chk in (3, 301):  # a row per program, and programs taking several rows
                    h = torch.randn(m_chk, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
                    w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
                    dy = torch.randn_like(h)
                    rdx, rdw, rdb, (mean, rstd) = _reference(h, w, dy, is_rms, 1e-5)
                    dx, dwp, dbp = launch(h, w, dy, mean, rstd, is_rms, chunk, ring)
                    pairs = ((dx, rdx), (dwp.sum(0), rdw)) + (() if is_rms else ((dbp.sum(0), rdb),))
                    errs = [((a.double() - b).norm() / b.norm()).item() for a, b in pairs]
                    print(dict(check=n, rms=is_rms, chunk=chunk, ring=ring, M=m_chk, rel_err=errs), flush=True)
                    assert max(errs) < 1e-2, errs
            m = (1 << 27) // n
            h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
            w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn_like(h)
            hl, wl, bl = (t.detach().requires_grad_() for t in (h, w, b))
            y = fly_norm.rms_norm(hl, wl) if is_rms else fly_norm.layer_norm(hl, wl, bl)
            moved = 3 * 2 * m * n
            for _rep in range(2):
                us = bench(lambda y=y, hl=hl, dy=dy: torch.autograd.grad(y, hl, dy, retain_graph=True)).median_us
                r = dict(N=n, rms=is_rms, variant="shipped", us=us, frac=moved / (us * 1e-6) / 1e9 / copy)
                print(r, flush=True)
                rows.append(r)
                stats = torch.zeros(m, device="cuda"), torch.ones(m, device="cuda")
                for chunk, ring in variants:

                    def probe(h=h, w=w, dy=dy, stats=stats, is_rms=is_rms, cfg=(chunk, ring)):
                        dx, dwp, dbp = launch(h, w, dy, None if is_rms else stats[0], stats[1], is_rms, *cfg)
                        return dx, dwp.sum(0), None if dbp is None else dbp.sum(0)

                    us = bench(probe).median_us
                    r = dict(N=n, rms=is_rms, variant=f"{chunk}:{ring}", us=us, frac=moved / (us * 1e-6) / 1e9 / copy)
                    print(r, flush=True)
                    rows.append(r)
    if args.out:
        with open(os.path.join(args.out, "probe-resident-bwd.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
