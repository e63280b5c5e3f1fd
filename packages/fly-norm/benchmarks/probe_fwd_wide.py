"""Probe: the norm forward at 32K-256K columns, split and staged (PERF.md v14c): python probe_fwd_wide.py

Design probe, not the benchmark; bf16, M * N = 2^27, against the shipped forward in the same process.

The split forwards hold their slice of a row in registers through the exchange of the slices' statistics.
Staged as the v14b backward: a program's slice of each of its rows is read as int32 words (two columns
each) through the software pipeliner (the row loop STAGES deep: the next rows' bytes wait in shared memory),
pass 1 runs a row ahead (the next row's partial statistics are published before this row's are awaited),
and the wait starts from the slots as read before pass 1 (``peek`` / ``collect_from``). RMSNorm publishes a
slice's sum of squares; LayerNorm its sum and its M2 about its own mean (merged with Chan's formula).
Plain forward: no residual, no saved statistics.
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
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.device import (
    as_words,
    bf16_pairs,
    bf16_pairs_again,
    bf16_words,
    collect_from,
    peek,
    publish,
    row_offset,
)

_DT = torch.bfloat16
# (slice, warps, stages)
CASES = ((8192, 16, 3), (4096, 8, 4), (4096, 8, 3), (16384, 16, 3))


@flyc.func
def _pass1(x_ptr, slot_ptr, row, M, c2, ok2, n_mine, part, stride_x, IS_RMS: fx.constexpr, PARTS_POW2: fx.constexpr):
    """Pass 1 of ``row`` (nothing past M): its slice as words; publishes the slice's sum of squares (RMSNorm)
    or its sum and M2 about its own mean (LayerNorm). Returns the words."""
    ok = row < M
    xw = fx.load(as_words(x_ptr) + row_offset(row, stride_x // 2) + c2, mask=ok2 & ok, other=0)
    xe, xo = bf16_pairs(xw)
    mine = slot_ptr + row_offset(row, 2 * PARTS_POW2) + 2 * part
    if IS_RMS:
        publish(mine, fx.sum(xe * xe + xo * xo, axis=0), ok)
    else:
        s = fx.sum(xe + xo, axis=0)
        m = s / n_mine
        de = fx.where(ok2, xe - m, 0.0)
        do = fx.where(ok2, xo - m, 0.0)
        publish(mine, s, ok)
        publish(mine + 1, fx.sum(de * de + do * do, axis=0), ok)
    return xw


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _fwd_staged_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, slot_ptr, M, N, parts, stride_x, stride_y, eps,
    IS_RMS: fx.constexpr, SLICE: fx.constexpr, PARTS_POW2: fx.constexpr, STAGES: fx.constexpr,
    SPIN_LIMIT: fx.constexpr,
):
    # fmt: on
    pid = fx.program_id(0)
    groups = fx.num_programs(0) // parts
    group = pid // parts
    part = pid - group * parts
    c2 = part * (SLICE // 2) + fx.arange(0, SLICE // 2)
    ok2 = c2 < N // 2
    n_mine = fx.minimum(SLICE, N - part * SLICE).to(fx.float32)
    we = load_weight(w_ptr, 2 * c2, ok2, 0.0, True, "")
    wo = load_weight(w_ptr, 2 * c2 + 1, ok2, 0.0, True, "")
    if not IS_RMS:
        be = fx.load(b_ptr + 2 * c2, mask=ok2, other=0.0).to(fx.float32)
        bo = fx.load(b_ptr + 2 * c2 + 1, mask=ok2, other=0.0).to(fx.float32)
    k = fx.arange(0, 2 * PARTS_POW2)  # a row's slots, [part, value] flattened
    kp = k // 2
    first = k % 2 == 0
    kmask = (kp < parts) & (k % 2 < 2 - IS_RMS)
    n_k = fx.maximum(fx.minimum(SLICE, N - kp * SLICE), 1).to(fx.float32)  # each slot's slice width
    xw = _pass1(x_ptr, slot_ptr, group, M, c2, ok2, n_mine, part, stride_x, IS_RMS, PARTS_POW2)
    for row in fx.range(group, M, groups, num_stages=STAGES):
        slots = slot_ptr + row_offset(row, 2 * PARTS_POW2) + k
        early = peek(slots)
        xw_nx = _pass1(x_ptr, slot_ptr, row + groups, M, c2, ok2, n_mine, part, stride_x, IS_RMS, PARTS_POW2)
        vals = collect_from(early, slots, kmask, SPIN_LIMIT)
        if IS_RMS:
            mean = 0.0
            rstd = fx.rsqrt(fx.sum(vals, axis=0) / N + eps)
        else:
            mean = fx.sum(fx.where(first, vals, 0.0), axis=0) / N
            dev = fx.where(first & kmask, vals / n_k - mean, 0.0)  # each slice's mean against the row's
            m2 = fx.sum(fx.where(first, n_k * dev * dev, vals), axis=0)  # Chan: sum of M2s + the means' spread
            rstd = fx.rsqrt(m2 / N + eps)
        xe, xo = bf16_pairs_again(xw)
        ye = (xe - mean) * rstd * we
        yo = (xo - mean) * rstd * wo
        if not IS_RMS:
            ye += be
            yo += bo
        fx.store(as_words(y_ptr) + row_offset(row, stride_y // 2) + c2, bf16_words(ye, yo), mask=ok2)
        xw = xw_nx


def launch_fwd_staged(x, w, b, y, eps, slice_cols=8192, warps=16, stages=3, spin=1 << 20):
    m, n = x.shape
    is_rms = b is None
    parts = flyc.cdiv(n, slice_cols)
    pp = flyc.next_power_of_2(parts)
    slots = torch.zeros(m, 2 * pp, dtype=torch.int64, device=x.device)
    args = (x, w, w if is_rms else b, y, slots, m, n, parts, x.stride(0), y.stride(0), float(eps))
    meta = dict(IS_RMS=is_rms, SLICE=slice_cols, PARTS_POW2=pp, STAGES=stages, SPIN_LIMIT=spin, num_warps=warps)
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
    from fly_norm import layer_norm, rms_norm

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy)]
    for n in (32768, 65536, 131072, 262144):
        m = (1 << 27) // n
        x = torch.randn(m, n, dtype=_DT, device="cuda") * 2 + 0.5
        w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
        b = torch.randn(n, dtype=_DT, device="cuda")
        nbytes = 2 * 2 * m * n
        for is_rms in (True, False):
            op = "rms" if is_rms else "layer"
            eps = 1e-6 if is_rms else 1e-5

            def shipped():
                return rms_norm(x, w, eps) if is_rms else layer_norm(x, w, b, eps)

            ref = shipped()
            us = bench(shipped).median_us
            r = dict(N=n, op=op, kernel="shipped", us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy)
            print(r, flush=True)
            rows.append(r)
            for case in CASES:
                y = torch.full_like(x, float("nan"))
                try:

                    def run():
                        launch_fwd_staged(x, w, None if is_rms else b, y, eps, *case)

                    run()
                    torch.cuda.synchronize()
                    err = _rel(y, ref)
                    us = bench(run).median_us
                    r = dict(N=n, op=op, kernel="staged", case=case, us=us,
                             frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err_vs_shipped=err)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                    r = dict(N=n, op=op, kernel="staged", case=case, error=repr(e)[:300])
                print(r, flush=True)
                rows.append(r)
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-fwd-wide.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
