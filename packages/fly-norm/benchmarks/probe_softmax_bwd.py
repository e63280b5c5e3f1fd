"""Probe: the softmax backward at 2K-16K columns, launch configs and chunk orders against torch.compile's.

    python probe_softmax_bwd.py --widths 2048 4096 8192 16384 --out DIR

torch.compile's backward at these widths (PERF.md v23) is a two-loop reduction: one pass over the row's
chunks accumulates sum(dy * y), a second reads the row again (from L2) and writes dx. fly-norm's chunked
pass has the same shape (``_softmax_bwd_kernel`` with ``single_pass=False``) but its configs were never
searched below 16K (the backward's tuning space holds single-pass configs only), and it walks the second
pass backwards (the chunks read last first). This probe times, per width (bf16, M * N = 2^27):

- ``autograd``: fly_norm.softmax's backward and torch.compile's, as the benchmark times them;
- ``shipped``: the low-level ``softmax_bwd`` with the shipped config;
- ``chunked B x W``: the shipped kernel's chunked pass at chunk B and W warps (in v23's second round also
  ``chunked2``, two rows a program, outside the row configs' space: 183.6 us at 2K, 16 warps, as
  torch.compile's launch; the chunked pass now holds one row a program);
- ``fwd B x W [hints]``: the probe kernel below, the second pass in forward order, with the shipped
  eviction hints or none; ``1read N x W [evict_first]``: the same kernel at one chunk, the single pass (its
  loads with or without evict_first);

and the mix's ceiling (``torch.add(dy, y, out=dx)``: the same bytes, no reduction; its "error" is
meaningless); each dx against fp64 (relative error), the time as a fraction of the copy measured in the same run (dy, y
read, dx written), and the launch config inductor chose (its autotuner's launchers). Design probe, not the
benchmark.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.rows import RowConfig


@flyc.kernel
def _probe_bwd_fwd_order(
    dy_ptr, y_ptr, dx_ptr, stride, N: fx.constexpr, BLOCK_N: fx.constexpr, FIRST: fx.constexpr,
    SECOND: fx.constexpr,
):  # fmt: skip
    """One row a program: sum(dy * y) over the row's chunks, then dx chunk by chunk in forward order; the
    first read's loads with eviction policy FIRST, the second's with SECOND ("": none). With ``BLOCK_N >=
    N``, one read: the single pass (its loads with SECOND)."""
    row = fx.program_id(0).to(fx.int64)
    cols = fx.arange(0, BLOCK_N)
    dy_row = dy_ptr + row * stride
    y_row = y_ptr + row * stride
    dx_row = dx_ptr + row * stride
    dot = 0.0
    if BLOCK_N < N:
        acc = fx.zeros([BLOCK_N], dtype=fx.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            dy = fx.load(dy_row + c, mask=c < N, other=0.0, eviction_policy=FIRST)
            y = fx.load(y_row + c, mask=c < N, other=0.0, eviction_policy=FIRST)
            acc += dy.to(fx.float32) * y.to(fx.float32)
        dot = fx.sum(acc, axis=0)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        dy = fx.load(dy_row + c, mask=c < N, other=0.0, eviction_policy=SECOND).to(fx.float32)
        y = fx.load(y_row + c, mask=c < N, other=0.0, eviction_policy=SECOND).to(fx.float32)
        if BLOCK_N >= N:
            dot = fx.sum(dy * y, axis=0)
        fx.store(dx_row + c, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=c < N)


def _inductor_configs() -> list[str]:
    """The launch configs of every inductor autotuner alive in the process (kernel name: config)."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError as e:
        return [f"unavailable: {e!r}"]
    out = []
    for obj in gc.get_objects():
        try:
            tuner = isinstance(obj, CachingAutotuner)
        except ReferenceError:  # a dead weak proxy
            continue
        if tuner:
            name = getattr(getattr(obj, "fn", None), "__name__", "?")
            launchers = getattr(obj, "launchers", []) or []
            chosen = [str(getattr(lc, "config", lc)) for lc in launchers]
            out.append(f"{name}: launchers {chosen}; candidates {len(getattr(obj, 'configs', []) or [])}")
    return out


def _width(n: int, m: int, warps_list, copy: float, dev: str, rows: list) -> None:
    """Every variant at rows of ``n`` columns (``m`` rows), appended to ``rows``."""
    import fly_norm
    from fly_norm.softmax import softmax_bwd, softmax_bwd_config

    x = torch.randn(m, n, dtype=torch.bfloat16, device=dev) * 2
    dy = torch.randn_like(x)
    y = torch.softmax(x.float(), -1).bfloat16()
    dx = torch.empty_like(x)
    yd = y.double()
    ref = yd * (dy.double() - (dy.double() * yd).sum(-1, keepdim=True))

    def record(name, run, out):
        out.fill_(float("nan"))
        got = run()
        got = out if got is None else got
        err = ((got.double() - ref).norm() / ref.norm()).item()
        us = bench(run).median_us
        r = dict(N=n, M=m, variant=name, us=us, frac_copy=3 * 2 * m * n / (us * 1e-6) / 1e9 / copy, rel_err=err)
        print(r, flush=True)
        rows.append(r)

    def attempt(name, run, out):
        try:
            record(name, run, out)
        except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
            rows.append(dict(N=n, variant=name, error=repr(e)[:300]))
            print(rows[-1], flush=True)

    # autograd, as the benchmark times it: softmax's graph over x, its backward with dy (its y, the op's own
    # output, rounds as y above)
    compiled = torch.compile(lambda t: torch.softmax(t, -1), fullgraph=True, dynamic=False)  # one width each
    for name, f in (("autograd flydsl", lambda t: fly_norm.softmax(t, -1)), ("autograd torch.compile", compiled)):
        leaf = x.detach().requires_grad_()
        yg = f(leaf)
        record(name, lambda yg=yg, leaf=leaf: torch.autograd.grad(yg, leaf, dy, retain_graph=True)[0], dx)
    rows.append(dict(N=n, inductor=_inductor_configs()))
    print(rows[-1], flush=True)

    # The ceiling of this mix (two rows read, one written, no reduction): torch's elementwise add
    record("ceiling: torch.add(dy, y, out=dx)", lambda: torch.add(dy, y, out=dx), dx)
    shipped = softmax_bwd_config(n, x.dtype, x.device)
    record(f"shipped {shipped}", lambda: softmax_bwd(dy, y, dx, shipped), dx)
    for warps in warps_list:
        for block in (b for b in (1024, 2048, 4096, 8192, 16384) if b <= n and b >= 32 * warps * 2):
            cfg = RowConfig(1, block, warps, False)
            attempt(f"chunked {block} x {warps}", lambda c=cfg: softmax_bwd(dy, y, dx, c), dx)
            for hints in (True, False):
                name = f"fwd {block} x {warps}{' hints' if hints else ''}"
                if block == n:
                    name = f"1read {block} x {warps}{' evict_first' if hints else ''}"

                first, second = ("evict_last", "evict_first") if hints else ("", "")

                def launch(block=block, warps=warps, first=first, second=second):
                    flyc.launch(_probe_bwd_fwd_order, (m,), dy, y, dx, y.stride(0), N=n, BLOCK_N=block,
                                FIRST=first, SECOND=second, num_warps=warps)  # fmt: skip

                attempt(name, launch, dx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", nargs="*", type=int, default=[2048, 4096, 8192, 16384])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--elements", type=int, default=1 << 27, help="M * N (a smoke run on the CPU: small)")
    ap.add_argument("--warps", nargs="*", type=int, default=[4, 8, 16])
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    copy = copy_gbps(1 << 29) if dev == "cuda" else float("nan")
    rows = [dict(copy_GBps=copy)]
    for n in args.widths:
        _width(n, args.elements // n, args.warps, copy, dev, rows)
        if dev == "cuda":
            torch.cuda.empty_cache()
    (args.out / "probe-softmax-bwd-configs.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
