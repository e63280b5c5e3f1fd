"""Probe: the row forwards at 32K-256K, split and staged (PERF.md v14c): python probe_fwd_wide.py [--ops 0 1 2 3]

Design probe, not the benchmark; bf16, M * N = 2^27, against the shipped forward in the same process.

The split forwards hold their slice of a row in registers through the exchange of the slices' statistics.
Staged as the v14b backward: a program's slice of each of its rows is read as int32 words (two columns
each) through the software pipeliner (the row loop STAGES deep: the next rows' bytes wait in shared memory),
pass 1 runs a row ahead (the next row's partial statistics are published before this row's are awaited),
and the wait starts from the slots as read before pass 1 (``peek`` / ``collect_from``). What a slice
publishes, by OP: RMSNorm its sum of squares (0); LayerNorm its sum and its M2 about its own mean, merged
with Chan's formula, from two reductions (1) or one, shifted by the slice's first value (2); softmax its
max and its sum of exponentials, rescaled to the row's max (3); LayerNorm its sum and M2 from one exchange
of the sum and the sum of squares, M2 = sum x^2 - (sum x)^2 / n, taken again about the mean where that
cancels more than 6 bits (4; 5 without that fallback, for its cost). Plain forward: no residual, no saved
statistics. r1 (PERF.md v14c) measured OP 0 and 1, r2 (v15) OP 2 and 3, r3-r5 (v16) OP 4 and 5 (op 4 with
the weight and bias held as words ships as split._norm_fwd_staged_kernel), r6 (v16) softmax holding its
exponentials (OP 6, commit 29a26ce; it ships as split._softmax_fwd_staged_kernel).
"""

# ruff: noqa: B023 - each closure runs within its own loop iteration

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import flydsl  # noqa: F401
import flydsl.arch
import flydsl.compiler as flyc
import flydsl.expr as fx
from fly_norm._kernels.affine import load_weight
from fly_norm._kernels.split import _my_words, _widened_each_row
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.device import (
    as_words,
    bf16_pairs,
    bf16_pairs_again,
    bf16_words,
    collect_from,
    collect_pairs_from,
    peek,
    publish,
    publish_pair,
    row_offset,
    sum2_f32,
)

_DT = torch.bfloat16
# (slice, warps, stages)
CASES = ((8192, 16, 3), (4096, 8, 4), (4096, 8, 3), (16384, 16, 3))


RMS, LAYER, LAYER_SHIFTED, SOFTMAX, LAYER_SUMS, LAYER_SUMS_BARE = 0, 1, 2, 3, 4, 5  # OP: what pass 1 publishes
LAYER_ONEWORD = 7  # OP 4 with a slice's (sum, M2) as one word (device.publish_pair): what ships (v16c)
_RMS, _LAYER, _LAYER_SHIFTED, _SOFTMAX, _LAYER_SUMS, _LAYER_SUMS_BARE, _LAYER_ONEWORD = (
    fx.constexpr(v) for v in (RMS, LAYER, LAYER_SHIFTED, SOFTMAX, LAYER_SUMS, LAYER_SUMS_BARE, LAYER_ONEWORD))
LAYERS = (LAYER, LAYER_SHIFTED, LAYER_SUMS, LAYER_SUMS_BARE, LAYER_ONEWORD)



@flyc.func
def _pass1(x_ptr, slot_ptr, row, M, c2, ok2, n_mine, part, stride_x, OP: fx.constexpr, PARTS_POW2: fx.constexpr):
    """Pass 1 of ``row`` (nothing past M): its slice as words; publishes the slice's sum of squares (RMS), its
    sum and its M2 about its own mean (LAYER: two reductions; LAYER_SHIFTED: one, of x - s and (x - s)^2
    with s the slice's first value, M2 = sum (x - s)^2 - (sum (x - s))^2 / n), or its max and its sum of
    exp(x - max) (SOFTMAX). Returns the words."""
    ok = row < M
    xw = fx.load(as_words(x_ptr) + row_offset(row, stride_x // 2) + c2, mask=ok2 & ok, other=0)
    xe, xo = bf16_pairs(xw)
    mine = slot_ptr + row_offset(row, 2 * PARTS_POW2) + 2 * part
    if OP == _RMS:
        publish(mine, fx.sum(xe * xe + xo * xo, axis=0), ok)
    elif OP == _LAYER:
        s = fx.sum(xe + xo, axis=0)
        m = s / n_mine
        de = fx.where(ok2, xe - m, 0.0)
        do = fx.where(ok2, xo - m, 0.0)
        publish(mine, s, ok)
        publish(mine + 1, fx.sum(de * de + do * do, axis=0), ok)
    elif OP == _LAYER_SHIFTED:
        first = fx.load(x_ptr + row_offset(row, stride_x) + part * 2 * (c2.shape[0]), mask=ok, other=0.0)
        shift = first.to(fx.float32)
        de = fx.where(ok2, xe - shift, 0.0)
        do = fx.where(ok2, xo - shift, 0.0)
        s1, s2 = sum2_f32(de + do, de * de + do * do, 0)
        publish(mine, n_mine * shift + s1, ok)
        publish(mine + 1, s2 - s1 * s1 / n_mine, ok)
    elif OP == _LAYER_SUMS or OP == _LAYER_SUMS_BARE or OP == _LAYER_ONEWORD:
        s1, s2 = sum2_f32(xe + xo, xe * xe + xo * xo, 0)  # one exchange; masked words read 0
        m2 = s2 - s1 * (s1 / n_mine)
        if OP != _LAYER_SUMS_BARE:
            if m2 * 64.0 < s2:  # more than 6 bits cancelled (|mean| > ~8 std): M2 about the mean, again
                mean = s1 / n_mine
                de = fx.where(ok2, xe - mean, 0.0)
                do = fx.where(ok2, xo - mean, 0.0)
                m2 = fx.sum(de * de + do * do, axis=0)
        if OP == _LAYER_ONEWORD:
            publish_pair(slot_ptr + row_offset(row, 2 * PARTS_POW2) + part, s1, m2, ok)
        else:
            publish(mine, s1, ok)
            publish(mine + 1, m2, ok)
    else:
        mx = fx.max(fx.where(ok2, fx.maximum(xe, xo), float("-inf")), axis=0)
        ex = fx.where(ok2, fx.exp(xe - mx) + fx.exp(xo - mx), 0.0)
        publish(mine, mx, ok)
        publish(mine + 1, fx.sum(ex, axis=0), ok)
    return xw


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _fwd_staged_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, slot_ptr, M, N, parts, stride_x, stride_y, eps,
    OP: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, STAGES: fx.constexpr,
    SPIN_LIMIT: fx.constexpr, PACKED_WB: fx.constexpr = False,
):
    # fmt: on
    group, groups, part, c2, ok2, _, _ = _my_words(N, parts, SLICE, PARTS_POW2)
    n_mine = fx.minimum(SLICE, N - part * SLICE).to(fx.float32)
    if PACKED_WB:  # bf16 weight and bias held as words, widened in place each row (half the registers)
        ww = fx.load(as_words(w_ptr) + c2, mask=ok2, other=0)
        bw = fx.load(as_words(b_ptr) + c2, mask=ok2, other=0)
    elif OP != _SOFTMAX:
        we = load_weight(w_ptr, 2 * c2, ok2, 0.0, True, "")
        wo = load_weight(w_ptr, 2 * c2 + 1, ok2, 0.0, True, "")
    if not PACKED_WB and (OP == _LAYER or OP == _LAYER_SHIFTED or OP == _LAYER_SUMS or OP == _LAYER_SUMS_BARE
                          or OP == _LAYER_ONEWORD):
        be = fx.load(b_ptr + 2 * c2, mask=ok2, other=0.0).to(fx.float32)
        bo = fx.load(b_ptr + 2 * c2 + 1, mask=ok2, other=0.0).to(fx.float32)
    if OP == _LAYER_ONEWORD:
        k = fx.arange(0, PARTS_POW2)  # a row's slots, one a part
        kmask = k < parts
        n_k = fx.maximum(fx.minimum(SLICE, N - k * SLICE), 1).to(fx.float32)
    else:
        k = fx.arange(0, 2 * PARTS_POW2)  # a row's slots, [part, value] flattened
        kp = k // 2
        first = k % 2 == 0
        kmask = (kp < parts) & (k % 2 < 2 - (OP == _RMS))
        n_k = fx.maximum(fx.minimum(SLICE, N - kp * SLICE), 1).to(fx.float32)  # each slot's slice width
    xw = _pass1(x_ptr, slot_ptr, group, M, c2, ok2, n_mine, part, stride_x, OP, PARTS_POW2)
    for row in fx.range(group, M, groups, num_stages=STAGES):
        slots = slot_ptr + row_offset(row, 2 * PARTS_POW2) + k
        early = peek(slots)
        xw_nx = _pass1(x_ptr, slot_ptr, row + groups, M, c2, ok2, n_mine, part, stride_x, OP, PARTS_POW2)
        if OP == _LAYER_ONEWORD:
            s1s, m2s = collect_pairs_from(early, slots, kmask, SPIN_LIMIT)
        else:
            vals = collect_from(early, slots, kmask, SPIN_LIMIT)
        xe, xo = bf16_pairs_again(xw)
        if OP == _SOFTMAX:
            mx = fx.max(fx.where(first & kmask, vals, float("-inf")), axis=0)
            # the slices' sums, each rescaled from its max to the row's (vals at odd k; its max one before)
            scale = fx.exp(fx.where(first & kmask, vals - mx, float("-inf")))
            total = fx.sum(fx.where(first, scale * _next(vals), 0.0), axis=0)
            ye = fx.exp(xe - mx) / total
            yo = fx.exp(xo - mx) / total
        else:
            if OP == _RMS:
                mean = 0.0
                rstd = fx.rsqrt(fx.sum(vals, axis=0) / N + eps)
            elif OP == _LAYER_ONEWORD:
                mean = fx.sum(s1s, axis=0) / N
                dev = fx.where(kmask, s1s / n_k - mean, 0.0)
                m2_row, spread = sum2_f32(m2s, n_k * dev * dev, 0)  # Chan: M2s + the means' spread
                rstd = fx.rsqrt((m2_row + spread) / N + eps)
            else:
                mean = fx.sum(fx.where(first, vals, 0.0), axis=0) / N
                dev = fx.where(first & kmask, vals / n_k - mean, 0.0)  # each slice's mean against the row's
                m2 = fx.sum(fx.where(first, n_k * dev * dev, vals), axis=0)  # Chan: M2s + the means' spread
                rstd = fx.rsqrt(m2 / N + eps)
            if PACKED_WB:
                we, wo = _widened_each_row(ww, rstd)  # not hoisted out of the loop (see there)
                be, bo = _widened_each_row(bw, rstd)
            ye = (xe - mean) * rstd * we
            yo = (xo - mean) * rstd * wo
            if OP != _RMS:
                ye += be
                yo += bo
        fx.store(as_words(y_ptr) + row_offset(row, stride_y // 2) + c2, bf16_words(ye, yo), mask=ok2)
        xw = xw_nx


@flyc.func
def _next(v):
    """v[k + 1] at each even k of a [2P] block of (max, sum) pairs, through a [P, 2] view."""
    pairs = fx.reshape(v, [v.shape[0] // 2, 2])
    sums = fx.sum(fx.where(fx.arange(0, 2)[None, :] == 1, pairs, 0.0), axis=1)
    return fx.reshape(fx.join(sums, sums), [v.shape[0]])


def launch_fwd_staged(x, w, b, y, eps, slice_cols=8192, warps=16, stages=3, packed_wb=0, maxnreg=0, spin=1 << 20,
                      op=None):  # fmt: skip
    m, n = x.shape
    op = (RMS if b is None else LAYER) if op is None else op
    parts = flyc.cdiv(n, slice_cols)
    pp = flyc.next_power_of_2(parts)
    slots = torch.zeros(m, 2 * pp, dtype=torch.int64, device=x.device)
    args = (x, w, w if b is None else b, y, slots, m, n, parts, x.stride(0), y.stride(0), float(eps))
    meta = dict(OP=op, SLICE=slice_cols, PARTS_POW2=pp, STAGES=stages, SPIN_LIMIT=spin, num_warps=warps,
                PACKED_WB=bool(packed_wb), **({"maxnreg": maxnreg} if maxnreg else {}))  # fmt: skip
    if flyc.interpreting():
        groups = m
    else:
        wave = flyc.programs_per_sm(_fwd_staged_kernel, *args, **meta) * flydsl.arch.current(x.device).sm_count
        assert wave >= parts, f"{parts} slices, a wave of {wave}"
        groups = min(m, wave // parts)
    flyc.launch(_fwd_staged_kernel, (groups * parts,), *args, **meta)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    from fly_norm import layer_norm, rms_norm, softmax

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ops", nargs="*", type=int, default=[RMS, LAYER, LAYER_SHIFTED, SOFTMAX])
    ap.add_argument("--cases", nargs="*", default=None,
                    help="SLICE,WARPS,STAGES[,PACKED_WB[,MAXNREG]] ... (default: CASES)")  # fmt: skip
    ap.add_argument("--offset", type=float, default=0.5, help="the inputs' mean (x = 2 randn + offset)")
    ap.add_argument("--widths", nargs="*", type=int, default=[32768, 65536, 131072, 262144])
    args = ap.parse_args()
    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]
    names = {RMS: "rms", LAYER: "layer", LAYER_SHIFTED: "layer_shifted", SOFTMAX: "softmax", LAYER_SUMS: "layer_sums",
             LAYER_SUMS_BARE: "layer_sums_bare", LAYER_ONEWORD: "layer_oneword"}  # fmt: skip
    cases = CASES if args.cases is None else [tuple(int(v) for v in c.split(",")) for c in args.cases]
    for n in args.widths:
        m = (1 << 27) // n
        x = torch.randn(m, n, dtype=_DT, device="cuda") * 2 + args.offset
        w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
        b = torch.randn(n, dtype=_DT, device="cuda")
        nbytes = 2 * 2 * m * n
        for op in args.ops:
            eps = 1e-6 if op == RMS else 1e-5

            def shipped():
                if op == RMS:
                    return rms_norm(x, w, eps)
                return softmax(x, -1) if op == SOFTMAX else layer_norm(x, w, b, eps)

            ref = shipped()
            us = bench(shipped).median_us
            r = dict(N=n, op=names[op], kernel="shipped", offset=args.offset, us=us,
                     frac_copy=nbytes / (us * 1e-6) / 1e9 / copy)
            print(r, flush=True)
            rows.append(r)
            for case in cases:
                y = torch.full_like(x, float("nan"))
                try:

                    def run():
                        launch_fwd_staged(x, w, b if op in LAYERS else None, y, eps, *case, op=op)

                    run()
                    torch.cuda.synchronize()
                    err = _rel(y, ref)
                    us = bench(run).median_us
                    r = dict(N=n, op=names[op], kernel="staged", case=case, offset=args.offset, us=us,
                             frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err_vs_shipped=err)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                    r = dict(N=n, op=names[op], kernel="staged", case=case, error=repr(e)[:300])
                print(r, flush=True)
                rows.append(r)
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-fwd-wide.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
