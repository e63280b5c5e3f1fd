"""Measure the runtime itself on a GPU: launch overhead, compile times, and the timer.

    python packages/flydsl-runtime/benchmarks/perf_runtime.py [--out DIR]

Writes ``runtime-<gpu>.json`` and prints a summary. What it measures (the
numbers go to PERF.md):

1. host time per call of a ``@flyc.jit`` launch of a tiny kernel, against the
   same body launched with plain Triton, through ``flyc.launch`` (lean, bare
   and inside ``@flyc.jit``), and against ``torch.add`` on one
   element (enqueue time only: batches short enough never to fill the launch
   queue, synchronised between batches); and ``call_us`` of the same routes,
   one call at a time with the GPU drained before it, timed to its end;
2. cold compile time (empty cache) and the first call of a fresh process with
   a warm cache;
3. the runtime's timer against ``triton.testing.do_bench`` on a memory-bound
   kernel (fp32 a + b, the runtime's own copy of vec_add's body) from 4 KB to 3 GB of traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_T0 = time.perf_counter()
import torch  # noqa: E402 - import time is part of what --probe-compile measures

import flydsl  # noqa: E402
import flydsl.arch  # noqa: E402
import flydsl.compiler as flyc  # noqa: E402
import flydsl.expr as fx  # noqa: E402
from flydsl.autotune.timer import bench, rotating_copies  # noqa: E402

_IMPORT_S = time.perf_counter() - _T0


@flyc.kernel(do_not_specialize=["n"])
def _tiny_kernel(x_ptr, y_ptr, n, BLOCK: fx.constexpr):
    offs = fx.arange(0, BLOCK)
    fx.store(y_ptr + offs, fx.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


# A memory-bound kernel of the runtime's own (the runtime imports nothing of
# ours): out = a + b, the body of flydsl_common.vec_add, 4096 elements and 8
# warps per program.
@flyc.kernel
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: fx.constexpr):
    offs = fx.program_id(0).to(fx.int64) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    fx.store(out_ptr + offs, fx.load(a_ptr + offs, mask=mask) + fx.load(b_ptr + offs, mask=mask), mask=mask)


@flyc.jit
def add_launch(a, b, out, n, stream=None):
    _add_kernel[(flyc.cdiv(n, 4096),)](a, b, out, n, BLOCK=4096, num_warps=8)


def raw_launch(x, y):
    _tiny_kernel[(1,)](x, y, x.numel(), BLOCK=128)


@flyc.jit
def fly_launch(x, y, stream=None):
    _tiny_kernel[(1,)](x, y, x.numel(), BLOCK=128)


def lean_launch(x, y):
    flyc.launch(_tiny_kernel, (1,), x, y, x.numel(), BLOCK=128)


@flyc.jit
def fly_lean_launch(x, y, stream=None):
    flyc.launch(_tiny_kernel, (1,), x, y, x.numel(), BLOCK=128)


def host_us_per_call(fn, args, batch=200, batches=40) -> float:
    """Median over batches of the enqueue time per call (the GPU is synchronised between batches)."""
    for _ in range(3 * batch):
        fn(*args)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn(*args)
        per_call.append((time.perf_counter() - t0) / batch * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def call_us_per_call(fn, args, calls=400) -> float:
    """Median time of one call at a time, host included: the GPU drained before each call and timed to the end
    of its work (what every family bench reports as ``call_us``)."""
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(per_call)


def measure_launches(per_call) -> dict:
    """``per_call(fn, args)`` of each launch route of the 1-element kernel and of torch's eager add, the
    routes interleaved and repeated."""
    x = torch.randn(1, device="cuda")
    y = torch.empty_like(x)
    a, b, c = torch.randn(1, device="cuda"), torch.randn(1, device="cuda"), torch.empty(1, device="cuda")

    rows = {}
    # Interleave the providers and repeat, so drift in CPU clocks affects all alike.
    for _ in range(10):
        for name, fn, args in [
            ("triton_raw", raw_launch, (x, y)),
            ("flydsl_jit", fly_launch, (x, y)),
            ("lean", lean_launch, (x, y)),
            ("flydsl_jit_lean", fly_lean_launch, (x, y)),
            ("torch_add", lambda p, q, r: torch.add(p, q, out=r), (a, b, c)),
        ]:
            rows.setdefault(name, []).append(per_call(fn, args))
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["flydsl_minus_raw_us"] = out["flydsl_jit"] - out["triton_raw"]
    out["lean_minus_raw_us"] = out["lean"] - out["triton_raw"]
    return out


def launcher_breakdown() -> dict:
    """Host cost of the pieces of the @flyc.jit fast path on CUDA tensors (timeit, median of 5)."""
    import timeit

    x = torch.randn(1, device="cuda")
    y = torch.empty_like(x)

    def noop(a, b, stream=None):
        return None

    wrapped = flyc.jit(noop)
    probes = {
        "python_call": lambda: noop(x, y),
        "launcher_around_noop": lambda: wrapped(x, y),
        "isinstance": lambda: isinstance(x, torch.Tensor),
        "get_device": lambda: x.get_device(),
        "numel": lambda: x.numel(),
        "_cuda_getDevice": lambda: torch._C._cuda_getDevice(),
        "torch.cuda.current_device": lambda: torch.cuda.current_device(),
    }
    out = {}
    for name, fn in probes.items():
        n = 20000
        out[name] = statistics.median(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
    return out


def compile_probe() -> dict:
    """Run in a fresh process (``--probe-compile``): import time, first and second call of add_launch."""
    a = torch.randn(1 << 20, device="cuda")
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    add_launch(a, b, out, a.numel())
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    add_launch(a, b, out, a.numel())
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"import_s": _IMPORT_S, "first_call_s": t1 - t0, "second_call_s": t2 - t1}


def measure_compile() -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, FLYDSL_CACHE_DIR=cache_dir)
        env.pop("TRITON_CACHE_DIR", None)
        runs = {}
        for label in ("cold_cache", "warm_cache"):
            r = subprocess.run([sys.executable, __file__, "--probe-compile"], env=env,
                               capture_output=True, text=True, check=True)
            runs[label] = json.loads(r.stdout.strip().splitlines()[-1])
        return runs


def measure_timer() -> list[dict]:
    from triton.testing import do_bench

    launch = add_launch
    rows = []
    for log2n in (10, 14, 18, 22, 26, 28):
        n = 1 << log2n
        a = torch.randn(n, device="cuda")
        b = torch.randn(n, device="cuda")
        out = torch.empty_like(a)
        bytes_moved = 3 * 4 * n

        def fn(a, b, out, n=n):
            launch(a, b, out, n)

        # Our timer rotates copies of the inputs when they fit in L2; do_bench
        # instead flushes L2 before every call. Both then read from HBM.
        sets = rotating_copies((a, b, out), flydsl.arch.current().l2_bytes)
        ours = bench(fn, arg_sets=sets).median_us
        ours_again = bench(fn, arg_sets=sets).median_us
        theirs = do_bench(lambda a=a, b=b, out=out: fn(a, b, out), warmup=25, rep=200, return_mode="median") * 1e3
        rows.append({
            "n": n,
            "bytes": bytes_moved,
            "timer_us": ours,
            "timer_repeat_us": ours_again,
            "do_bench_us": theirs,
            "timer_over_do_bench": ours / theirs,
            "timer_GBps": bytes_moved / ours / 1e3,
            "do_bench_GBps": bytes_moved / theirs / 1e3,
        })
        del a, b, out, sets
    return rows


def timer_diagnostics() -> dict:
    """How the timer behaves on a launch-bound kernel, against a CUDA-graph replay of the same launches."""
    x = torch.randn(1, device="cuda")
    y = torch.empty_like(x)
    out: dict = {"has_sleep": hasattr(torch.cuda, "_sleep")}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(19_800_000)
    e.record()
    torch.cuda.synchronize()
    out["sleep_19.8M_cycles_ms"] = s.elapsed_time(e)
    for label, kw in [("backlog", {}), ("no_backlog", {"backlog": False})]:
        t = bench(lambda: raw_launch(x, y), **kw)
        out[label] = {"median_us": t.median_us, "calls": t.calls_per_window, "windows_us": list(t.windows_us)}
    g = torch.cuda.CUDAGraph()
    raw_launch(x, y)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(200):
            raw_launch(x, y)
    g.replay()
    torch.cuda.synchronize()
    s.record()
    for _ in range(10):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    out["graph_replay_us_per_launch"] = s.elapsed_time(e) * 1e3 / 2000
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--probe-compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe_compile:
        print(json.dumps(compile_probe()))
        return 0
    if not torch.cuda.is_available():
        print("perf_runtime: needs a GPU", file=sys.stderr)
        return 2
    import triton

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flydsl": flydsl.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_overhead_us": measure_launches(host_us_per_call),
        "call_us": measure_launches(call_us_per_call),
        "launcher_breakdown_us": launcher_breakdown(),
        "compile": measure_compile(),
        "timer_vs_do_bench": measure_timer(),
        "timer_diagnostics": timer_diagnostics(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "-" for ch in result["device"].lower()).strip("-")
    path = out / f"runtime-{slug}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["host_overhead_us"], indent=1))
    print(json.dumps(result["call_us"], indent=1))
    print(json.dumps(result["launcher_breakdown_us"], indent=1))
    print(json.dumps(result["compile"], indent=1))
    print(f"{'n':>12} {'timer us':>10} {'repeat':>10} {'do_bench':>10} {'ratio':>7} {'GB/s':>8}")
    for r in result["timer_vs_do_bench"]:
        print(f"{r['n']:>12} {r['timer_us']:10.2f} {r['timer_repeat_us']:10.2f} {r['do_bench_us']:10.2f} "
              f"{r['timer_over_do_bench']:7.3f} {r['timer_GBps']:8.0f}")
    print(json.dumps(result["timer_diagnostics"], indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
