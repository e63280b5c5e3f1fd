"""Measurements behind PERF.md's decisions (not the benchmark): python probe.py [--out DIR] [--part NAME ...].

Parts:
- ``bwd_grid``: the norm backward's programs per SM (1, 2, 4 and the
  default) at each row width, bf16, M * N = 2**25, as a fraction of copy,
  with how many programs of the compiled kernel an SM holds at once;
- ``size``: forward rms_norm and a device copy of the same bytes at M * N =
  2**25 and 2**27: how much of a gap to the copy ceiling is the size itself;
- ``split``: the split paths' (slice, warps, register cap) candidates on
  wide rows, bf16, M * N = 2**27, each op as a fraction of copy; then the
  defaults with and without cache hints (``split.SPLIT_EVICT``);
- ``latency``: per op (rms_norm, layer_norm, softmax) and M in (1, 4, 64) rows of 4096: end to end
  (no backlog, what the latency bench sees), device time (backlogged), host time a call, ours (the C
  path launching through the driver; ``ours_triton``: through Triton's launch function; ``ours_python``:
  the Python path) and torch's; the floor of our launch mechanism (``torch.empty_like`` + Triton's C launch with every
  argument prepared) and the driver's share of it (the C launch with an empty grid).
"""

# ruff: noqa: B023 - each closure is timed within its own loop iteration

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import flydsl  # noqa: F401
import flydsl.arch
import flydsl.compiler as flyc
from fly_norm import layer_norm, rms_norm, softmax
from fly_norm._kernels import norm as shared
from fly_norm.autotune import bwd_default_row_config
from flydsl import native
from flydsl.autotune.timer import bench, rotating_copies
from flydsl_common.bench import copy_gbps

_DT = torch.bfloat16


def part_bwd_grid() -> dict:
    out = {"copy_GBps": copy_gbps(1 << 29)}
    rows = []
    for n in (256, 1024, 2048, 4096, 8192, 16384, 32768):
        m = (1 << 25) // n
        x = torch.randn(m, n, device="cuda", dtype=_DT)
        dy = torch.randn_like(x)
        w = torch.randn(n, device="cuda", dtype=_DT)
        rstd = torch.rand(m, device="cuda") + 0.5
        dx = torch.empty_like(x)
        dw = torch.empty(n, device="cuda", dtype=_DT)
        cfg = bwd_default_row_config(n)
        nbytes = 3 * 2 * m * n + 4 * m + 2 * 2 * n
        for per_sm in (None, 1, 2, 4):
            scratch = None if cfg.single_pass else torch.empty(2, m, dtype=torch.float32, device="cuda")
            programs = shared.bwd_programs(m, cfg, x.device, per_sm)
            dwp = torch.empty(programs, n, dtype=torch.float32, device="cuda")
            args, meta = shared._bwd_call(x, w, dy, None, None, rstd, dx, dwp, None, scratch, 0.0, True, cfg)
            resident = flyc.programs_per_sm(shared._norm_bwd_kernel, *args, **meta)

            def run():
                shared.launch_bwd(x, w, dy, None, None, rstd, dx, dwp, None, scratch, 0.0, True, programs, cfg)
                shared.launch_sum_partials(dwp, dw)

            t = bench(run).median_us * 1e-6
            t_sum = bench(lambda: shared.launch_sum_partials(dwp, dw)).median_us
            rows.append({"N": n, "cfg": repr(cfg), "per_sm": per_sm or "default", "programs": programs,
                         "resident_per_sm": resident,
                         "us": t * 1e6, "sum_us": t_sum, "frac_copy": nbytes / t / 1e9 / out["copy_GBps"]})
            print(rows[-1], flush=True)

    out["rows"] = rows
    return out


def part_size() -> dict:
    rows = []
    copy_big = copy_gbps(1 << 29)
    for elems in (1 << 25, 1 << 27):
        for n in (1024, 4096, 16384):
            m = elems // n
            sets = rotating_copies((torch.randn(m, n, device="cuda", dtype=_DT),
                                    torch.randn(n, device="cuda", dtype=_DT)), 50 << 20)
            t = bench(lambda x, w: rms_norm(x, w, 1e-6), arg_sets=sets).median_us * 1e-6
            nbytes = 4 * m * n
            tc = nbytes / (copy_gbps(nbytes) * 1e9)  # a copy of x's size
            rows.append({"elements": elems, "N": n, "rms_us": t * 1e6, "copy_us": tc * 1e6,
                         "rms_frac_big_copy": nbytes / t / 1e9 / copy_big, "rms_over_same_copy": tc / t})
            print(rows[-1], flush=True)

    return {"copy_big_GBps": copy_big, "rows": rows}


def _host_us(fn, batch=200, batches=30) -> float:
    for _ in range(2 * batch):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        per.append((time.perf_counter() - t0) / batch * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def part_latency() -> dict:
    """Small-batch latency and its pieces (the v2-v5 ``host`` part, which timed the eager path's pieces
    before the plans, is in git history; its results in results/probe-host-*.json): ours through the C path
    (``eager.fast``; with the C++ tensor API, and reading tensors through their methods) and through the
    Python path alone, torch's, and the floor of the mechanism."""
    from fly_norm._kernels import eager
    from fly_norm.softmax import _EAGER_PLANS as softmax_plans

    rows = []
    for m in (1, 4, 64):
        x = torch.randn(m, 4096, device="cuda", dtype=_DT)
        w = torch.randn(4096, device="cuda", dtype=_DT)
        b = torch.randn(4096, device="cuda", dtype=_DT)
        y = torch.empty_like(x)
        xp, wp, bp, yp = (t.data_ptr() for t in (x, w, b, y))
        ops = {  # op: (ours, torch's, our plans, the plan's operands: weight, bias, eps)
            "rms_norm": (lambda: rms_norm(x, w, 1e-6), lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6),
                         shared._EAGER_PLANS, (wp, None, 1e-6)),
            "layer_norm": (lambda: layer_norm(x, w, b, 1e-5),
                           lambda: torch.nn.functional.layer_norm(x, (4096,), w, b, 1e-5), shared._EAGER_PLANS,
                           (wp, bp, 1e-5)),
            "softmax": (lambda: softmax(x, -1), lambda: torch.softmax(x, -1), softmax_plans, (None, None, None)),
        }  # fmt: skip
        for op, (ours, theirs, plans, (pw, pb, eps)) in ops.items():
            r = dict(op=op, M=m)
            ours()
            fast = eager.fast
            native_mod = getattr(fast, "__self__", None)  # eager_native's module (its driver switch)
            cap = native.tensor_api(wait=True)  # the C++ tensor API (v21), or None where it cannot be built
            r["tensor_api"] = native_mod is not None and native_mod.tensor_api_in_use()
            cases = (("ours", ours), ("ours_methods", ours), ("ours_triton", ours), ("ours_python", ours),
                     ("torch", theirs))  # fmt: skip
            for who, f in cases:
                eager.fast = eager._no_fast if who == "ours_python" else fast
                if who == "ours_triton" and native_mod is not None:
                    native_mod.driver(0, 0)  # the C path through Triton's launch function (v15e)
                if who == "ours_methods" and native_mod is not None:
                    native_mod.set_tensor_api(None)  # the C path reading tensors through their methods (v16)
                try:
                    f()
                    r[who + "_latency"] = bench(f, backlog=False, sync_each=True).median_us
                    r[who + "_rate"] = bench(f, backlog=False).median_us
                    r[who + "_device"] = bench(f).median_us
                    r[who + "_host"] = _host_us(f, batch=100, batches=20)
                finally:
                    eager.fast = fast
                    if native_mod is not None:
                        r["driver_path"] = native_mod.driver()
                        native_mod.set_tensor_api(cap)
            r["c_path"] = fast.__name__ == "call"
            # the floor of the mechanism: the output's allocation and the plan's launch, nothing else
            plans.clear()
            ours()
            (plan,) = plans.values()
            c_launch, fn, coop, pdl, packed, tail, _, _, layout, r["driver_signature"] = plan
            values = (None, xp, pw, pb, yp, m, 4096, eps, 0)
            args = [values[i] for i in layout]

            def floor():
                torch.empty_like(x)
                eager.launch(plan, m, 4096, xp, pw, pb, yp, eps)

            r["floor_latency"] = bench(floor, backlog=False, sync_each=True).median_us
            r["floor_rate"] = bench(floor, backlog=False).median_us
            r["floor_host"] = _host_us(floor, batch=100, batches=20)
            r["launch_host"] = _host_us(lambda: eager.launch(plan, m, 4096, xp, pw, pb, yp, eps), batch=100,
                                        batches=20)  # fmt: skip
            r["c_launch_grid0"] = _host_us(
                lambda: c_launch(0, 1, 1, 0, fn, coop, pdl, None, None, packed, None, None, None, *args, *tail),
                batch=100, batches=20)  # fmt: skip
            r["empty_like"] = _host_us(lambda: torch.empty_like(x), batch=100, batches=20)
            r["sync_alone"] = bench(lambda: None, backlog=False, sync_each=True).median_us
            r["block_m"] = plan[7]
            print(r, flush=True)
            rows.append(r)
    return {"latency": rows}


def part_latency_ab(rounds: int = 60, batch: int = 200) -> dict:
    """The C path with the C++ tensor API against the same path reading tensors through their methods, and
    torch's op, interleaved round by round (the host's speed drifts by tens of percent within a run, so
    back-to-back blocks per variant are not comparable): per round and variant, ``batch`` calls' host time
    (no synchronization; the GPU keeps up) and ``batch`` calls each followed by a synchronization (the
    latency bench's measure). Medians and minima over the rounds, us a call."""
    from fly_norm._kernels import eager

    cap = native.tensor_api(wait=True)
    rows = []
    for m in (1, 4, 64):
        x = torch.randn(m, 4096, device="cuda", dtype=_DT)
        w = torch.randn(4096, device="cuda", dtype=_DT)
        b = torch.randn(4096, device="cuda", dtype=_DT)
        ops = {
            "rms_norm": (lambda: rms_norm(x, w, 1e-6), lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6)),
            "layer_norm": (lambda: layer_norm(x, w, b, 1e-5),
                           lambda: torch.nn.functional.layer_norm(x, (4096,), w, b, 1e-5)),
            "softmax": (lambda: softmax(x, -1), lambda: torch.softmax(x, -1)),
        }  # fmt: skip
        for op, (ours, theirs) in ops.items():
            ours()
            mod = eager.fast.__self__
            whos = {"api": (ours, cap), "methods": (ours, None), "torch": (theirs, cap)}
            host = {k: [] for k in whos}
            lat = {k: [] for k in whos}
            for _ in range(rounds):
                for who, (f, api) in whos.items():
                    mod.set_tensor_api(api)
                    f()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(batch):
                        f()
                    host[who].append((time.perf_counter() - t0) / batch * 1e6)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(batch):
                        f()
                        torch.cuda.synchronize()
                    lat[who].append((time.perf_counter() - t0) / batch * 1e6)
            mod.set_tensor_api(cap)
            r = dict(op=op, M=m, tensor_api=cap is not None)
            for who in whos:
                r[f"{who}_host_med"], r[f"{who}_host_min"] = statistics.median(host[who]), min(host[who])
                r[f"{who}_lat_med"], r[f"{who}_lat_min"] = statistics.median(lat[who]), min(lat[who])
            # per round, torch's latency over ours (> 1: ours faster), its median over the rounds
            r["lat_ratio_med"] = statistics.median(t / o for t, o in zip(lat["torch"], lat["api"], strict=True))
            r["lat_ratio_methods_med"] = statistics.median(
                t / o for t, o in zip(lat["torch"], lat["methods"], strict=True))  # fmt: skip
            print(r, flush=True)
            rows.append(r)
    return {"latency_ab": rows}


# rounds r1-r3 (PERF.md, v3) measured (16384, 16), (8192, 8), (4096, 4), (4096, 8), (2048, 4), (1024, 4) forward,
# (8192, 16), (4096, 8), (4096, 4), (2048, 4), (2048, 8), (1024, 4), (1024, 2) backward. Next: register caps
# that buy a resident program an SM at the cost of some spilling (sm90_compile: the norm backward at
# (4096, 4) needs ~230 registers, 2 programs an SM; capped at 168, 3 programs, 216-448 bytes spilled).
SPLIT_FWD = [(4096, 4, None), (4096, 4, 72)]
SPLIT_LN_FWD = [(4096, 4, 96), (4096, 4, 80), (4096, 4, None)]
# backward: (slice, warps, register cap, rows a tile): tiles of several rows share the per-column weight
# slice and gradient sums (sm90_compile: (1024, 4) x 4 rows capped at 168 spills 48-80 bytes where a
# 4096-column slice spills 216-448)
SPLIT_BWD = [(4096, 4, None, 1), (4096, 4, 168, 1), (1024, 4, 168, 4), (1024, 4, None, 4), (2048, 4, 168, 2),
             (2048, 4, None, 1)]
SPLIT_SOFTMAX_BWD = [(4096, 4, None), (4096, 4, 96)]


def part_split() -> dict:
    from fly_norm._kernels import split

    split.WIDE_MIN_N = 1 << 40  # FWD_SLICE serves every width while it is swept
    out = {"copy_GBps": copy_gbps(1 << 29)}
    rows = []
    for n in (16384, 32768, 65536, 262144):
        m = (1 << 27) // n
        x = torch.randn(m, n, device="cuda", dtype=_DT)
        dy = torch.randn_like(x)
        y = torch.empty_like(x)
        w = torch.randn(n, device="cuda", dtype=_DT)
        rstd = torch.rand(m, device="cuda") + 0.5
        mean = torch.randn(m, device="cuda")
        dw = torch.empty(n, device="cuda", dtype=torch.float32)
        fwd = {
            "rms": lambda: split.launch_fwd_split(x, None, w, None, None, y, None, None, None, None, 1e-6, 0.0,
                                                  True, 0, 127.0),
            "ln": lambda: split.launch_fwd_split(x, None, w, w, None, y, None, None, None, None, 1e-5, 0.0,
                                                 False, 0, 127.0),
            "softmax": lambda: split.launch_softmax_fwd_split(x, y),
        }

        def norm_bwd(is_rms):
            def run():
                dwp, dbp = split.launch_bwd_split(x, w, dy, None, None if is_rms else mean, rstd, y, True,
                                                  not is_rms, 0.0, is_rms)
                shared.launch_sum_partials(dwp, dw)
                if dbp is not None:
                    shared.launch_sum_partials(dbp, dw)
            return run

        norm_ln = fwd.pop("ln")
        bwd = {"rms_bwd": norm_bwd(True), "ln_bwd": norm_bwd(False)}
        smb = {"softmax_bwd": lambda: split.launch_softmax_bwd_split(dy, x, y)}
        for table, cfgs, ops, nbytes in ((fwd, SPLIT_FWD, "FWD_SLICE", 2 * 2 * m * n),
                                         ({"ln": norm_ln}, SPLIT_LN_FWD, "LN_FWD_SLICE", 2 * 2 * m * n),
                                         (bwd, SPLIT_BWD, "BWD_SLICE", 3 * 2 * m * n),
                                         (smb, SPLIT_SOFTMAX_BWD, "SOFTMAX_BWD_SLICE", 3 * 2 * m * n)):
            if "BWD" not in ops and n < 32768:
                continue
            default, default_rows = getattr(split, ops), split.BWD_ROWS
            for cfg in cfgs:
                setattr(split, ops, cfg[:3])
                split.BWD_ROWS = cfg[3] if len(cfg) > 3 else 1
                for name, run in table.items():
                    try:
                        t = bench(run).median_us
                        row = {"N": n, "op": name, "cfg": cfg, "us": t,
                               "frac_copy": nbytes / (t * 1e-6) / 1e9 / out["copy_GBps"]}
                    except Exception as e:  # noqa: BLE001 - a config that does not fit: report, go on
                        row = {"N": n, "op": name, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    rows.append(row)
                    print(row, flush=True)
            setattr(split, ops, default)
            split.BWD_ROWS = default_rows
        # cache hints at the defaults' slices: rows evict_first, per-column operands evict_last
        for table, nbytes, forward in ((fwd | {"ln": norm_ln}, 4 * m * n, True), (bwd | smb, 6 * m * n, False)):
            if not (forward and n < 32768):
                for hints in (("", ""), ("evict_first", "evict_last")):
                    split.SPLIT_EVICT = hints
                    for name, run in table.items():
                        t = bench(run).median_us
                        row = {"N": n, "op": name, "hints": hints, "us": t,
                               "frac_copy": nbytes / (t * 1e-6) / 1e9 / out["copy_GBps"]}
                        rows.append(row)
                        print(row, flush=True)
                split.SPLIT_EVICT = ("", "")
    out["rows"] = rows
    return out


PARTS = {"latency": part_latency, "latency_ab": part_latency_ab, "bwd_grid": part_bwd_grid, "size": part_size,
         "split": part_split}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--part", nargs="+", default=list(PARTS))
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "sms": flydsl.arch.current(torch.device("cuda")).sm_count}
    for p in args.part:
        result[p] = PARTS[p]()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
