"""Probes of the wide-row paths: python probe_pipeline.py [--out DIR] [--part NAME ...]

Design probes for PERF.md v4-v6, not the benchmark. bf16, M * N = 2**27, as a
fraction of a device copy of the same bytes measured in the same run. Parts
``rows`` and ``two_pass`` (round 1, software-pipelined cp.async loads):

- ``rows``: rows that fit one program (4K-16K), a persistent program walks
  its rows in a loop whose whole-row loads are pipelined STAGES deep through
  shared memory (``fx.range(..., num_stages=)``), so the next rows' bytes are
  in flight while the current row reduces, without holding them in registers;
- ``two_pass``: wider rows (16K-256K), one program a row at a time, pass 1
  streams the row in pipelined chunks for the statistics, pass 2 re-reads it
  (from L2 when the rows in flight fit there) and writes y.
- ``chunked``: the production chunked forwards (``norm._norm_fwd_kernel``,
  ``softmax._softmax_fwd_kernel``, per-lane since the fourth session) with
  the split routing switched off, over (BLOCK_N, warps) candidates at
  8K-256K, with the width fixed at compile time or read at run time (r4):
  which widths they should serve, and their default configs;
- ``split``: the production register-resident split kernels (norm and
  softmax forwards, softmax backward) over (slice, warps, register cap),
  32K-256K. (The fifth session's
  ``sliced`` part measured slices streamed in chunks and re-read from L2:
  50-72% of copy, below the split kernels everywhere; removed, results in
  ``results/probe-pipeline-r2-sliced-bwdtile.json``.)
- ``bwd_op``: the whole rms_norm / layer_norm backward through autograd (as
  the benchmark times it) with the tiled split kernel (with and without its
  lead, ``BWD_OP_CFGS``) and with the register-resident one, 16K-64K.
- ``quant``: rms_norm forward and int8 rms_norm_quant at 2K-32K through the
  production kernel at the same configs (what quantizing costs: 59-82% of
  copy against 94-98% in v6), and a persistent prototype that prefetches
  the next rows through the two reductions.
- ``packed``: int8 and fp8 rms_norm_quant at 32K through the production kernel: the chunked passes
  against the single pass, which holds bf16 rows packed two columns an int32 at 32K (v10), over warps
  and register caps (``PACKED_CONFIGS``); the same for the plain layer_norm (v11, ``PACKED_LN_CONFIGS``).
- ``bwd_ab``: the single-pass norm backward (256-8K columns) with its default config and with the
  searched one, alternated three times in one process, each timed two ways: the whole backward through
  autograd (as the benchmark) and the op's own launch (``backward_into``, as the tuner). The sixth
  session's search picked configs that it timed 5-9% faster than the defaults but that the benchmark
  measured up to 3x slower (rms_norm at 8K with a 64-register cap: tuned 207 us, benchmark 691 us).
- ``bwd_l2``: a prototype rms_norm backward for rows past the register-resident widths with no
  exchange between programs: each program walks its rows, re-reads each from L2 for dx, and keeps its
  fp32 weight-gradient row in L2 (read, added to, written back a row at a time), against the library's
  backward at 16K-64K.
- ``bwd_diag``: the tiled split backward at 16K/32K as shipped and with its waits cut short (v11): what
  the exchange's waits cost.
- ``bwd_tile``: the norm split backward, the register-resident kernel (v3)
  against the tiled one (``split.BWD_TILED``: a program owns a column slice
  and walks tiles of ROWS rows; pass 1 loads the tile (evict_last) and
  publishes its per-row partial sums, one exchange a tile, pass 2 re-reads
  the tile from L2 for dx and the dweight/dbias sums; nothing held in
  registers across the wait) over (slice, warps, cap, rows), 16K-64K.
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
from fly_norm._kernels.passes import inverse_scale, quantize
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.device import row_offset
from flydsl_common.rows import RowConfig

_DT = torch.bfloat16


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _rows_kernel(x_ptr, w_ptr, y_ptr, M, N, stride, eps,
                 IS_RMS: fx.constexpr, BLOCK_N: fx.constexpr, STAGES: fx.constexpr):
    cols = fx.arange(0, BLOCK_N)
    cmask = cols < N
    w = fx.load(w_ptr + cols, mask=cmask, other=0.0).to(fx.float32)
    for row in fx.range(fx.program_id(0), M, fx.num_programs(0), num_stages=STAGES):
        h = fx.load(x_ptr + row_offset(row, stride) + cols, mask=cmask, other=0.0).to(fx.float32)
        if IS_RMS:
            mean = 0.0
            var = fx.sum(h * h, axis=0) / N
        else:
            mean = fx.sum(h, axis=0) / N
            d = fx.where(cmask, h - mean, 0.0)
            var = fx.sum(d * d, axis=0) / N
        y = (h - mean) * fx.rsqrt(var + eps) * w
        fx.store(y_ptr + row_offset(row, stride) + cols, y.to(y_ptr.dtype.element_ty), mask=cmask)


@flyc.kernel(do_not_specialize=["M"])
def _two_pass_kernel(x_ptr, w_ptr, y_ptr, M, N, stride, eps,
                     IS_RMS: fx.constexpr, BLOCK_N: fx.constexpr, STAGES: fx.constexpr):
    cols = fx.arange(0, BLOCK_N)
    for row in range(fx.program_id(0), M, fx.num_programs(0)):
        xr = x_ptr + row_offset(row, stride)
        mean = 0.0
        acc = 0.0
        for start in fx.range(0, N, BLOCK_N, num_stages=STAGES):
            c = start + cols
            h = fx.load(xr + c, mask=c < N, other=0.0).to(fx.float32)
            if IS_RMS:
                acc += fx.sum(h * h, axis=0)
            else:  # Chan's merge of (count, mean, M2)
                n_a = start * 1.0
                n_b = fx.minimum(N * 1.0 - n_a, BLOCK_N * 1.0)
                mean_b = fx.sum(h, axis=0) / n_b
                d = fx.where(c < N, h - mean_b, 0.0)
                delta = mean_b - mean
                mean += delta * (n_b / (n_a + n_b))
                acc += fx.sum(d * d, axis=0) + delta * delta * (n_a * n_b / (n_a + n_b))
        rstd = fx.rsqrt(acc / N + eps)
        yr = y_ptr + row_offset(row, stride)
        for start in fx.range(0, N, BLOCK_N, num_stages=STAGES):
            c = start + cols
            h = fx.load(xr + c, mask=c < N, other=0.0).to(fx.float32)
            w = fx.load(w_ptr + c, mask=c < N, other=0.0).to(fx.float32)
            fx.store(yr + c, ((h - mean) * rstd * w).to(y_ptr.dtype.element_ty), mask=c < N)


@flyc.kernel(do_not_specialize=["M"])
def _quant_rows_kernel(x_ptr, w_ptr, q_ptr, s_ptr, M, N, eps, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr,
                       PREFETCH: fx.constexpr):
    # r6 prototype: int8 rms_norm_quant over dense rows, a persistent program a block of BLOCK_M rows at a time;
    # with PREFETCH the next block's x is loaded before this block's two reductions (rms, then amax), so
    # its bytes are in flight through them (the backward's pattern), at twice the registers.
    r = fx.arange(0, BLOCK_M)
    cols = fx.arange(0, BLOCK_N)
    cmask = cols < N
    w = fx.load(w_ptr + cols, mask=cmask, other=0.0).to(fx.float32)[None, :]
    pid = fx.program_id(0)
    step = fx.num_programs(0)
    rows = pid * BLOCK_M + r
    x_nx = fx.load(x_ptr + row_offset(rows, N)[:, None] + cols[None, :], mask=(rows < M)[:, None] & cmask[None, :],
                   other=0.0)
    for blk in fx.range(pid, fx.cdiv(M, BLOCK_M), step, disable_licm=True):
        rows = blk * BLOCK_M + r
        ok = rows < M
        mask = ok[:, None] & cmask[None, :]
        h = x_nx.to(fx.float32)
        nxt = rows + step * BLOCK_M
        if PREFETCH:
            x_nx = fx.load(x_ptr + row_offset(nxt, N)[:, None] + cols[None, :],
                           mask=(nxt < M)[:, None] & cmask[None, :], other=0.0)
        y = h * fx.rsqrt(fx.sum(h * h, axis=1) / N + eps)[:, None] * w
        amax = fx.max(fx.abs(y), axis=1)
        fx.store(s_ptr + rows, amax / 127.0, mask=ok)
        fx.store(q_ptr + row_offset(rows, N)[:, None] + cols[None, :], quantize(y, inverse_scale(amax, 127.0), 1),
                 mask=mask)
        if not PREFETCH:
            x_nx = fx.load(x_ptr + row_offset(nxt, N)[:, None] + cols[None, :],
                           mask=(nxt < M)[:, None] & cmask[None, :], other=0.0)


@flyc.func
def _bwd_l2_chunk(h_row, dy_row, w_ptr, c, N, EVICT: fx.constexpr):
    """h, dy, w of columns c (fp32), c and its mask: the rows' loads with cache hint EVICT."""
    cm = c < N
    h = fx.load(h_row + c, mask=cm, other=0.0, eviction_policy=EVICT).to(fx.float32)
    dy = fx.load(dy_row + c, mask=cm, other=0.0, eviction_policy=EVICT).to(fx.float32)
    return h, dy, fx.load(w_ptr + c, mask=cm, other=0.0).to(fx.float32), c, cm


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _bwd_l2_kernel(h_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dwp_ptr, M, N, rows_per_program,
                   BLOCK_N: fx.constexpr, N_FIXED: fx.constexpr):
    # fmt: on
    # r7 prototype (rms_norm backward, rows past the register-resident widths): one program walks its
    # rows one at a time; pass 1 reads the row (evict_last) for c1 = mean(g * xhat), pass 2 re-reads it
    # from L2, writes dx and adds dy * xhat into the program's fp32 weight-gradient row (read back from L2
    # from the previous row; the first row writes it): no exchange between programs, the row and the
    # partial row live in L2 (132 programs x (4 + 4) bytes x N: 17-34 MB at 16K-32K columns).
    if N_FIXED != 0:
        N = N_FIXED
    pid = fx.program_id(0)
    cols = fx.arange(0, BLOCK_N)
    r0 = pid * rows_per_program
    r1 = fx.minimum(r0 + rows_per_program, M)
    part = dwp_ptr + row_offset(pid, N)
    for row in range(r0, r1):
        h_row = h_ptr + row_offset(row, N)
        dy_row = dy_ptr + row_offset(row, N)
        rstd = fx.load(rstd_ptr + row)
        acc = fx.zeros([BLOCK_N], dtype=fx.float32)
        for start in range(0, N, BLOCK_N):
            h, dy, w, c, cm = _bwd_l2_chunk(h_row, dy_row, w_ptr, start + cols, N, "evict_last")
            acc += dy * w * h
        c1 = fx.sum(acc, axis=0) * rstd / N
        for start in range(0, N, BLOCK_N):
            h, dy, w, c, cm = _bwd_l2_chunk(h_row, dy_row, w_ptr, start + cols, N, "evict_first")
            xhat = h * rstd
            dx = (dy * w - xhat * c1) * rstd
            fx.store(dx_ptr + row_offset(row, N) + c, dx.to(dx_ptr.dtype.element_ty), mask=cm)
            prev = fx.load(part + c, mask=cm & (row > r0), other=0.0)
            fx.store(part + c, prev + dy * xhat, mask=cm)


def _bwd_l2_cases(copy: float) -> list[dict]:
    """The ``bwd_l2`` part: the prototype above against the library's rms_norm backward (the tiled split
    kernel at 16K-64K), both through the same weight-gradient column sum; gradients checked against it."""
    from fly_norm import rms_norm
    from fly_norm._kernels.norm import launch_sum_partials

    out = []
    for n in (16384, 32768, 65536):
        m = (1 << 27) // n
        x = torch.randn(m, n, dtype=_DT, device="cuda")
        w = (torch.rand(n, dtype=_DT, device="cuda") + 0.5)
        dy = torch.randn(m, n, dtype=_DT, device="cuda")
        rstd = torch.rsqrt(x.float().pow(2).mean(1) + 1e-6)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(xs, ws, 1e-6)
        ref_dx, ref_dw = torch.autograd.grad(y, (xs, ws), dy, retain_graph=True)
        nbytes = 2 * 3 * m * n + 2 * 2 * n + 4 * m
        us = bench(lambda: torch.autograd.grad(y, (xs, ws), dy, retain_graph=True)).median_us
        out.append(dict(N=n, op="rms_bwd_library", us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy))
        print(out[-1], flush=True)
        dx = torch.empty_like(x)
        dw = torch.empty(n, dtype=_DT, device="cuda")
        for block_n, warps, per_sm in ((2048, 8, 1), (4096, 8, 1), (4096, 16, 1), (2048, 4, 2), (4096, 8, 2),
                                       (8192, 16, 1)):  # fmt: skip

            def make_run(block_n=block_n, warps=warps, per_sm=per_sm):
                programs = min(m, flydsl.arch.current().sm_count * per_sm)
                per = flyc.cdiv(m, programs)
                programs = flyc.cdiv(m, per)
                dwp = torch.empty(programs, n, dtype=torch.float32, device="cuda")
                meta = dict(BLOCK_N=block_n, N_FIXED=n, num_warps=warps)

                def run():
                    flyc.launch(_bwd_l2_kernel, (programs,), x, w, dy, rstd, dx, dwp, m, n, per, **meta)
                    launch_sum_partials(dwp, dw)

                return run, {}

            def check():  # against the library's backward
                return max(_rel_err(dx, ref_dx), _rel_err(dw, ref_dw))

            out.append(_record(n, copy, nbytes, make_run, check, op="rms_bwd_l2", cfg=(block_n, warps, per_sm)))
        torch.cuda.empty_cache()
    return out


def _case(kernel, n, is_rms, block_n, warps, stages, per_sm, copy):
    """One round-1 kernel at one width, checked against an fp32 reference, timed; per_sm: programs an SM
    (None: as many as fit)."""
    m = (1 << 27) // n
    x = torch.randn(m, n, dtype=_DT, device="cuda") + 2.0  # a mean away from 0: LayerNorm's merge matters
    w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
    y = torch.full_like(x, float("nan"))
    meta = dict(IS_RMS=is_rms, BLOCK_N=block_n, STAGES=stages, num_warps=warps)
    args = (x, w, y, m, n, n, 1e-6)
    resident = flyc.programs_per_sm(kernel, *args, **meta)
    grid = min(m, flydsl.arch.current().sm_count * (resident if per_sm is None else min(per_sm, resident)))

    def run():
        flyc.launch(kernel, (grid,), *args, **meta)

    run()
    h = x.float()
    mean = 0.0 if is_rms else h.mean(1, keepdim=True)
    ref = (h - mean) * torch.rsqrt(((h - mean) ** 2).mean(1, keepdim=True) + 1e-6) * w.float()
    err = _rel_err(y, ref)
    us = bench(run).median_us
    return dict(
        N=n,
        op="rms" if is_rms else "ln",
        kernel=kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel),
        block_n=block_n,
        warps=warps,
        stages=stages,
        per_sm=per_sm,
        resident=resident,
        grid=grid,
        us=us,
        frac_copy=4 * m * n / (us * 1e-6) / 1e9 / copy,
        rel_err=err,
    )


def _wide_inputs(n: int):
    """(m, x, w, b, y, references per op) for rows of ``n`` columns, M * N = 2**27 (bf16)."""
    from fly_norm import reference as ref

    m = (1 << 27) // n
    x = torch.randn(m, n, dtype=_DT, device="cuda") + 1.0
    w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
    b = torch.randn(n, dtype=_DT, device="cuda")
    refs = {"rms": lambda: ref.rms_norm_ref(x, w, 1e-6), "ln": lambda: ref.layer_norm_ref(x, w, b, 1e-5),
            "softmax": lambda: ref.softmax_ref(x)}  # fmt: skip
    return m, x, w, b, torch.empty_like(x), refs


def _record(n, copy, nbytes, make_run, check, **fields) -> dict:
    """One probe row: ``make_run()`` gives ``(run, extra fields)`` (setup may raise), ``run`` runs once,
    ``check()`` gives its relative error (or None), then ``run`` is timed against the copy for ``nbytes``
    moved; a failure anywhere is recorded, not raised."""
    try:
        run, extra = make_run()
        run()
        err = check()
        us = bench(run).median_us
        row = dict(N=n, **fields, **extra, us=us, frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err=err)
    except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
        row = dict(N=n, **fields, error=repr(e)[:300])
    print(row, flush=True)
    return row


def _rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _measure(run, reference, y, m, n, copy, transfers=4, **fields) -> dict:
    """:func:`_record` of ``run`` writing a poisoned ``y``, checked against ``reference`` (``transfers``: bytes
    moved an element, as a multiple of m * n)."""
    y.fill_(float("nan"))
    return _record(n, copy, transfers * m * n, lambda: (run, {}), lambda: _rel_err(y, reference()), **fields)


CHUNKED_CONFIGS = ((1024, 8), (2048, 8), (2048, 16), (4096, 16), (4096, 32), (8192, 16))


def _production_chunked(copy: float) -> list[dict]:
    """The library's chunked forwards at wide rows, split routing off, as a fraction of copy."""
    import importlib

    from fly_norm._kernels import norm, passes

    sm = importlib.import_module("fly_norm.softmax")  # the module (the package exports the function)
    norm.split_applies = sm.split_applies = lambda *a, **k: False  # this process only
    out = []
    for n in (8192, 16384, 32768, 65536, 131072, 262144):
        m, x, w, b, y, refs = _wide_inputs(n)
        # r3: small chunks over many warps (torch.compile's choice for these ops at 16K-32K: 2048 columns,
        # 16 warps), against v5's default (4096, 16); single pass at 8K-16K for comparison
        # (config, width fixed at compile time): r4 adds the fixed widths (passes.row_meta)
        cfgs = [(RowConfig(1, bn, wp, False), True) for bn, wp in CHUNKED_CONFIGS if bn < n]
        cfgs += [(RowConfig(1, 4096, 16, False), False)]
        cfgs += [(RowConfig(1, n, 16, True), False)] if n <= 16384 else []
        for cfg, fixed in cfgs:
            block_n, warps = cfg.block_n, cfg.num_warps
            passes._FIXED_WIDTHS.clear()
            passes.FIXED_WIDTHS_MAX = 1 if fixed else 0
            runs = {
                "rms": lambda: norm.launch_fwd(x, None, w, None, None, y, None, None, None, None, 1e-6, 0.0, True,
                                               None, cfg),
                "ln": lambda: norm.launch_fwd(x, None, w, b, None, y, None, None, None, None, 1e-5, 0.0, False,
                                              None, cfg),
                "softmax": lambda: sm.softmax_fwd(x, y, cfg),
            }  # fmt: skip
            for op, run in runs.items():
                kernel = "single" if cfg.single_pass else "chunked-fixed" if fixed else "chunked"
                out.append(_measure(run, refs[op], y, m, n, copy, op=op, kernel=kernel, block_n=block_n,
                                    warps=warps))  # fmt: skip
    return out


def _bwd_tile_case(n, is_rms, cfg, copy):
    """The norm split backward at one width, through ``split.launch_bwd_split``: the tiled kernel with
    ``cfg`` = (slice, warps, register cap, rows a tile), or the register-resident one (``cfg`` None);
    dx and dweight checked against float64, timed (slot zeroing and partial buffers included)."""
    from fly_norm._kernels import split
    from fly_norm._kernels.norm import backward_reference

    m = (1 << 27) // n
    h = torch.randn(m, n, dtype=_DT, device="cuda") + (0.0 if is_rms else 1.0)
    dy = torch.randn(m, n, dtype=_DT, device="cuda")
    w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
    hf = h.float()
    mean = None if is_rms else hf.mean(1)
    rstd = torch.rsqrt(((hf * hf).mean(1) if is_rms else hf.var(1, unbiased=False)) + 1e-6)
    dx = torch.full_like(h, float("nan"))
    split.BWD_TILED = cfg

    def run():
        return split.launch_bwd_split(h, w, dy, None, mean, rstd, dx, True, not is_rms, 0.0, is_rms)

    dwp, _ = run()
    rdx, rdw, _ = backward_reference(h, w, dy, None, mean, rstd, 0.0, True, False)
    err_dx = ((dx.double() - rdx).norm() / rdx.norm()).item()
    err_dw = ((dwp.double().sum(0) - rdw).norm() / rdw.norm()).item()
    us = bench(run).median_us
    return dict(N=n, op="rms_bwd" if is_rms else "ln_bwd", kernel="tiled" if cfg else "resident", cfg=cfg, us=us,
                frac_copy=6 * m * n / (us * 1e-6) / 1e9 / copy, err_dx=err_dx, err_dw=err_dw)


# (slice, warps, register cap) candidates of the split kernels. (v5 also measured prefetching two rows
# ahead instead of one: 4-19 points worse everywhere, results/probe-pipeline-r3-split.json; removed.)
SPLIT_FWD_CFGS = [(4096, 4, None), (8192, 4, None), (2048, 4, None)]
SPLIT_LN_CFGS = [(4096, 4, 96), (8192, 8, None)]
SPLIT_SOFTMAX_BWD_CFGS = [(4096, 4, None), (8192, 8, None)]


def _quant_cases(copy: float) -> list[dict]:
    """r6: rms_norm forward and int8 rms_norm_quant at 2K-32K through the production kernel at the same
    configs (what the quantization costs), and the persistent prefetching prototype above."""
    from fly_norm._kernels import norm
    from fly_norm.autotune import candidates
    from fly_norm.reference import rms_norm_quant_ref

    out = []
    for n in (2048, 4096, 8192, 16384, 32768):
        m = (1 << 27) // n
        x = torch.randn(m, n, dtype=_DT, device="cuda")
        w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
        y = torch.empty_like(x)
        q = torch.empty(m, n, dtype=torch.int8, device="cuda")
        sc = torch.empty(m, dtype=torch.float32, device="cuda")
        q_ref, s_ref = rms_norm_quant_ref(x, w, 1e-6, dtype=torch.int8)
        deq_ref = q_ref.float() * s_ref[:, None]

        def check():
            return _rel_err(q.float() * sc[:, None], deq_ref)

        for cfg in candidates({"n_bucket": n, "dtype": "bf16"}, "sm_90"):
            if not cfg.single_pass and n <= 16384:
                continue
            for op, run, nbytes in (
                ("rms", lambda: norm.launch_fwd(x, None, w, None, None, y, None, None, None, None, 1e-6, 0.0, True,
                                                None, cfg), 4 * m * n),
                ("rms_quant", lambda: norm.launch_fwd(x, None, w, None, None, q, None, None, None, sc, 1e-6, 0.0,
                                                      True, torch.int8, cfg), 3 * m * n + 4 * m),
            ):  # fmt: skip
                quant_check = check if op == "rms_quant" else lambda: None
                out.append(_record(n, copy, nbytes, lambda run=run: (run, {}), quant_check, op=op, cfg=str(cfg)))
        for block_m, warps in ((1, 4), (1, 8), (2, 8), (1, 16)):
            if block_m * n > 16384 or block_m * n // (32 * warps) > 64:
                continue
            for prefetch in (False, True):
                meta = dict(BLOCK_M=block_m, BLOCK_N=n, PREFETCH=prefetch, num_warps=warps)
                args = (x, w, q, sc, m, n, 1e-6)

                def make_run(meta=meta, args=args, block_m=block_m):
                    resident = flyc.programs_per_sm(_quant_rows_kernel, *args, **meta)
                    grid = min(flyc.cdiv(m, block_m), flydsl.arch.current().sm_count * resident)
                    return (lambda: flyc.launch(_quant_rows_kernel, (grid,), *args, **meta)), {"resident": resident}

                out.append(_record(n, copy, 3 * m * n + 4 * m, make_run, check, op="rms_quant_persistent",
                                   cfg=(block_m, warps, prefetch)))  # fmt: skip
        torch.cuda.empty_cache()
    return out


# (rows a program, columns, warps, single pass, register cap): the shipped chunked config of v9, then the
# single pass (packed at 32K columns) at 8-32 warps with and without the caps that fit two programs an SM.
PACKED_CONFIGS = ((1, 4096, 16, False, None), (1, 32768, 8, True, 128), (1, 32768, 8, True, None),
                  (1, 32768, 16, True, 64), (1, 32768, 16, True, None), (1, 32768, 32, True, 40))  # fmt: skip


def _packed_cases(copy: float) -> list[dict]:
    """v10: the quantized RMSNorm at 32K, chunked against the packed single pass (``PACKED_CONFIGS``)."""
    from fly_norm._kernels import norm
    from fly_norm.reference import rms_norm_quant_ref

    n = 32768
    m = (1 << 27) // n
    x = torch.randn(m, n, dtype=_DT, device="cuda")
    w = torch.rand(n, dtype=_DT, device="cuda") + 0.5
    sc = torch.empty(m, dtype=torch.float32, device="cuda")
    out = []
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        q = torch.empty(m, n, dtype=qdtype, device="cuda")
        q_ref, s_ref = rms_norm_quant_ref(x, w, 1e-6, dtype=qdtype)
        deq_ref = q_ref.float() * s_ref[:, None]
        for c in PACKED_CONFIGS:
            cfg = RowConfig(*c)

            def run():
                norm.launch_fwd(x, None, w, None, None, q, None, None, None, sc, 1e-6, 0.0, True, qdtype, cfg)

            def check():
                return _rel_err(q.float() * sc[:, None], deq_ref)

            sc.fill_(float("nan"))
            out.append(_record(n, copy, 3 * m * n + 4 * m, lambda: (run, {}), check, op=str(qdtype), cfg=str(c)))
    return out + _packed_ln_cases(x, w, copy)


# The plain LayerNorm at 32K (v11): the shipped chunked config, chunked alternatives (8192-column chunks
# under caps that fit two programs an SM), and the packed single pass at 8 and 16 warps.
PACKED_LN_CONFIGS = ((1, 4096, 32, False, None), (1, 8192, 32, False, 32), (1, 8192, 16, False, 64),
                     (1, 32768, 8, True, 128), (1, 32768, 16, True, None), (1, 32768, 16, True, 64))  # fmt: skip


def _packed_ln_cases(x, w, copy: float) -> list[dict]:
    """v11: the plain LayerNorm forward at 32K over ``PACKED_LN_CONFIGS``, each checked against the reference."""
    from fly_norm._kernels import norm
    from fly_norm.reference import layer_norm_ref

    m, n = x.shape
    b = torch.randn(n, dtype=_DT, device="cuda")
    y = torch.empty_like(x)
    y_ref = layer_norm_ref(x, w, b, 1e-5)
    out = []
    for c in PACKED_LN_CONFIGS:
        cfg = RowConfig(*c)

        def run():
            norm.launch_fwd(x, None, w, b, None, y, None, None, None, None, 1e-5, 0.0, False, None, cfg)

        out.append(_measure(run, lambda: y_ref, y, m, n, copy, op="layer_norm", cfg=str(c)))
    return out


# The bwd_op part's split-backward configs: None (the register-resident kernel), else the tiled kernel's
# (slice, warps, register cap, rows a tile[, lead]); r5 adds the leads (1: pass 1 one tile ahead of the wait;
# 2: its loads also in flight through the wait and pass 2; sm_90: 2048 x 4 rows takes 168 registers without
# a lead, 184 with one, so 168 is tried as a cap).
BWD_OP_CFGS = (
    None, (2048, 4, None, 4), (2048, 4, None, 4, 1), (2048, 4, 168, 4, 1), (2048, 4, None, 2, 1),
    (1024, 4, None, 4, 1), (1024, 4, None, 8, 1), (4096, 4, None, 2, 1),
    (2048, 4, None, 2, 2), (1024, 4, None, 4, 2), (2048, 4, None, 1, 2),
)  # fmt: skip


def _bwd_op_case(n, cfg, copy, is_rms=True):
    """The whole norm backward as the benchmark times it (autograd through the public op: the split kernel,
    the weight-gradient column sums, the casts), with ``split.BWD_TILED`` / ``LN_BWD_TILED = cfg`` (None:
    the register-resident kernel); the gradients are checked against the register-resident kernel's."""
    from fly_norm import layer_norm, rms_norm
    from fly_norm._kernels import split

    m = (1 << 27) // n
    x = torch.randn(m, n, dtype=_DT, device="cuda").requires_grad_()
    w = (torch.rand(n, dtype=_DT, device="cuda") + 0.5).requires_grad_()
    b = torch.randn(n, dtype=_DT, device="cuda").requires_grad_()
    dy = torch.randn(m, n, dtype=_DT, device="cuda")
    params = (x, w) if is_rms else (x, w, b)

    def grads(c):
        split.BWD_TILED = split.LN_BWD_TILED = c
        y = rms_norm(x, w, 1e-6) if is_rms else layer_norm(x, w, b, 1e-5)
        return y, torch.autograd.grad(y, params, dy, retain_graph=True)

    try:
        _, ref = grads(None)
        y, got = grads(cfg)
        err = max(_rel_err(g, r) for g, r in zip(got, ref, strict=True))
        us = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)).median_us
    except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
        return dict(N=n, op="rms_bwd_op" if is_rms else "ln_bwd_op", cfg=cfg, error=repr(e)[:300])
    finally:
        split.BWD_TILED = split.LN_BWD_TILED = None
    # as the benchmark counts: x, dy, dx; w, dw (b, db); rstd (mean)
    nbytes = 2 * 3 * m * n + (2 if is_rms else 4) * 2 * n + (1 if is_rms else 2) * 4 * m
    return dict(N=n, op="rms_bwd_op" if is_rms else "ln_bwd_op", cfg=cfg, us=us,
                frac_copy=nbytes / (us * 1e-6) / 1e9 / copy, rel_err_vs_resident=err)  # fmt: skip


def _bwd_diag(copy: float) -> list[dict]:
    """v11 diagnosis of the tiled split backward at 16K/32K (shipped config): as shipped, then with its waits
    cut short (``split._SPIN_LIMIT`` = 0: a program reads its peers' row sums once and goes on, so dx is
    poisoned where they were not yet published, but no program stalls). The difference is what the
    exchange's waits cost; what remains is the kernel's own pace."""
    from fly_norm._kernels import split

    out = []
    limit, shipped = split._SPIN_LIMIT, {True: split.BWD_TILED, False: split.LN_BWD_TILED}
    for n in (16384, 32768):
        for is_rms in (True, False):
            for spin in (limit, 0):
                split._SPIN_LIMIT = spin
                try:
                    r = dict(_bwd_op_case(n, shipped[is_rms], copy, is_rms), spin_limit=spin)
                finally:
                    split._SPIN_LIMIT = limit
                    split.BWD_TILED, split.LN_BWD_TILED = shipped[True], shipped[False]
                print(r, flush=True)
                out.append(r)
    return out


def _bwd_ab(copy: float) -> list[dict]:
    """Default vs searched single-pass backward configs, alternated in one process (see the module doc)."""
    import dataclasses

    from fly_norm import autotune, layer_norm, rms_norm
    from fly_norm._kernels.norm import backward_into

    out = []
    capped_8k = RowConfig(1, 8192, 16, True, maxnreg=64)
    for is_rms in (True, False):
        op = "rmsnorm_bwd" if is_rms else "layernorm_bwd"
        for n in (256, 1024, 2048, 4096, 8192):
            m = (1 << 27) // n
            x = torch.randn(m, n, dtype=_DT, device="cuda").requires_grad_()
            w = torch.randn(n, dtype=_DT, device="cuda").requires_grad_()
            b = torch.randn(n, dtype=_DT, device="cuda").requires_grad_()
            dy = torch.randn(m, n, dtype=_DT, device="cuda")
            params = (x, w) if is_rms else (x, w, b)
            y = rms_norm(x, w, 1e-6) if is_rms else layer_norm(x, w, b, 1e-5)
            h = x.detach()
            rstd = torch.rand(m, dtype=torch.float32, device="cuda") + 0.5
            mean = None if is_rms else torch.randn(m, dtype=torch.float32, device="cuda")
            dx, dw, db = torch.empty_like(h), torch.empty_like(w), torch.empty_like(b)
            key = autotune.tuning_key(n, _DT)
            tun = autotune.TUNABLES[op]
            cfgs = {"default": tun.default(key, "sm_90"), "searched": tun.select(key, "sm_90")}
            if is_rms and n == 8192:
                cfgs["capped64"] = capped_8k
            nbytes = 2 * 3 * m * n + (2 if is_rms else 4) * 2 * n + (1 if is_rms else 2) * 4 * m
            for rep in range(3):
                for name, cfg in cfgs.items():
                    autotune._FAST[(op, n, _DT, x.device)] = cfg
                    try:
                        us_op = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True)).median_us
                        us_launch = bench(lambda: backward_into(
                            h, w, dy, None, mean, rstd, dx, dw, None if is_rms else db, 0.0, is_rms, cfg)).median_us
                        row = dict(N=n, op=op, which=name, rep=rep, cfg=dataclasses.astuple(cfg), us_autograd=us_op,
                                   us_launch=us_launch, frac_copy_autograd=nbytes / (us_op * 1e-6) / 1e9 / copy,
                                   frac_copy_launch=nbytes / (us_launch * 1e-6) / 1e9 / copy)
                    except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                        row = dict(N=n, op=op, which=name, rep=rep, error=repr(e)[:300])
                    print(row, flush=True)
                    out.append(row)
            autotune.clear_memo()
            torch.cuda.empty_cache()
    return out


def _production_split(copy: float) -> list[dict]:
    """The library's register-resident split kernels over (slice, warps, cap) candidates."""
    from fly_norm import reference as ref
    from fly_norm._kernels import split

    split.WIDE_MIN_N = 1 << 40  # FWD_SLICE serves every width while it is swept
    out = []
    for n in (32768, 65536, 131072, 262144):
        m, x, w, b, y, refs = _wide_inputs(n)
        dy = torch.randn_like(x)
        yx = ref.softmax_ref(x).to(_DT)
        refs["softmax_bwd"] = lambda: ref.softmax_bwd_ref(dy, yx)
        runs = {
            "rms": ("FWD_SLICE", SPLIT_FWD_CFGS, lambda: split.launch_fwd_split(
                x, None, w, None, None, y, None, None, None, None, 1e-6, 0.0, True, 0, 0.0)),
            "softmax": ("FWD_SLICE", SPLIT_FWD_CFGS, lambda: split.launch_softmax_fwd_split(x, y)),
            "ln": ("LN_FWD_SLICE", SPLIT_LN_CFGS, lambda: split.launch_fwd_split(
                x, None, w, b, None, y, None, None, None, None, 1e-5, 0.0, False, 0, 0.0)),
            "softmax_bwd": ("SOFTMAX_BWD_SLICE", SPLIT_SOFTMAX_BWD_CFGS,
                            lambda: split.launch_softmax_bwd_split(dy, yx, y)),
        }  # fmt: skip
        for op, (name, cfgs, run) in runs.items():
            default = getattr(split, name)
            for cfg in cfgs:
                setattr(split, name, cfg)
                out.append(_measure(run, refs[op], y, m, n, copy, transfers=6 if op == "softmax_bwd" else 4,
                                    op=op, kernel="split", cfg=cfg))  # fmt: skip
            setattr(split, name, default)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--part", nargs="*", default=["chunked", "split", "bwd_tile"])
    args = ap.parse_args()
    copy = copy_gbps(1 << 29)  # 2^27 bf16 elements copied
    rows = [dict(copy_GBps=copy)]
    print(rows[0])
    cases = []
    if "rows" in args.part:
        for n in (4096, 8192, 16384):
            for warps, stages in ((4, 2), (8, 2), (8, 3), (16, 2), (16, 3)):
                if n // (32 * warps) <= 64:
                    cases += [(_rows_kernel, n, is_rms, n, warps, stages, None) for is_rms in (True, False)]
    if "two_pass" in args.part:
        for n in (16384, 32768, 65536, 131072, 262144):
            for block_n, warps, stages, per_sm in (
                (4096, 4, 3, None),
                (4096, 8, 4, None),
                (8192, 8, 3, None),
                (8192, 8, 4, 1),
                (8192, 16, 4, 1),
                (4096, 8, 4, 2),
            ):
                cases += [(_two_pass_kernel, n, is_rms, block_n, warps, stages, per_sm) for is_rms in (True, False)]
    if "chunked" in args.part:
        rows += _production_chunked(copy)
    if "split" in args.part:
        rows += _production_split(copy)
    if "quant" in args.part:
        rows += _quant_cases(copy)
    if "packed" in args.part:
        rows += _packed_cases(copy)
    if "bwd_ab" in args.part:
        rows += _bwd_ab(copy)
    if "bwd_l2" in args.part:
        rows += _bwd_l2_cases(copy)
    if "bwd_op" in args.part:
        for n in (16384, 32768, 65536):
            for is_rms in (True, False):
                for cfg in (*BWD_OP_CFGS, None):  # the resident kernel twice: run-to-run spread
                    r = _bwd_op_case(n, cfg, copy, is_rms)
                    print(r, flush=True)
                    rows.append(r)
                    torch.cuda.empty_cache()
    if "bwd_diag" in args.part:
        rows += _bwd_diag(copy)
    if "bwd_tile" in args.part:
        for n in (16384, 32768, 65536):
            for cfg in (None, (1024, 4, None, 4), (2048, 4, None, 2), (1024, 4, None, 8), (2048, 4, None, 4),
                        (4096, 4, None, 1), (1024, 8, None, 8)):  # fmt: skip
                for is_rms in (True, False):
                    try:
                        r = _bwd_tile_case(n, is_rms, cfg, copy)
                    except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                        r = dict(N=n, case=(cfg, is_rms), error=repr(e)[:300])
                    print(r, flush=True)
                    rows.append(r)
                    torch.cuda.empty_cache()
    for case in cases:
        try:
            r = _case(*case, copy)
        except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
            r = dict(case=str(case[1:]), error=repr(e)[:300])
        print(r, flush=True)
        rows.append(r)
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-pipeline.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
