"""Latency of ``CustomAllReduce`` against NCCL, per message size, on the GPUs of this host.

    python packages/fly-comm/benchmarks/run.py [--world N] [--sizes 4K,64K,1M,...] [--dtype bf16]
                                               [--iters 50] [--repeats 3] [--no-graph] [--out DIR]

A standalone multi-process script, not the shared harness (``flydsl_common.bench``): that harness times
providers inside one process, and an all-reduce needs ``world`` processes timing the same calls together.
It starts one process a GPU (``torch.multiprocessing``, spawn) with an NCCL group; each rank builds one
``CustomAllReduce`` with ``max_size`` the largest size, so the chosen algorithm is the one a user gets
(``custom``: by the cutoffs, NCCL above them), and also times ``one_shot`` and ``two_shot`` forced
wherever they fit (``max_size``) and ``nccl`` (``torch.distributed.all_reduce``). Before timing, each
provider's result is checked against the fp32 sum (error relative to the sum of the ranks' magnitudes,
within a few units of the dtype's rounding).

Timing: a barrier, then ``iters`` back-to-back calls between two CUDA events, ``repeats`` times (the
median is reported, with the spread); by default the ``iters`` calls are captured once in a CUDA graph and
the graph replayed (the serving pattern, no host time), ``--no-graph`` times eager calls. Each rank's
median is reduced with MAX over the ranks (a collective is as slow as its slowest rank). Bus bandwidth is
``2 (world - 1) / world * bytes / time`` (NCCL's convention). Rank 0 prints a table and writes
``<out>/<stem>.json`` and ``.md``.

``--backend gloo`` runs the same plumbing on CPU processes (the fallback path only, times meaningless):
what the CPU test suite uses to keep this script working. On a machine with fewer than two GPUs the
NCCL run says so and exits 0 without timing anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "parse_size", "default_sizes", "bus_bandwidth"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}  # fmt: skip
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"1M"`` -> 1048576, ``"1000"`` -> 1000 (bytes; binary units)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Z]*)", text.strip().upper())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional K, M or G suffix")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def default_sizes() -> list[int]:
    """4 KiB to 64 MiB, every factor of 4 (the issue's range)."""
    return [4096 * 4**i for i in range(8)]


def bus_bandwidth(nbytes: int, world: int, seconds: float) -> float:
    """NCCL's bus bandwidth of an all-reduce, in GB/s."""
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_calls(fn, iters: int, repeats: int, cuda: bool, graph: bool, sync) -> list[float]:
    """Seconds a call, ``repeats`` times."""
    import torch

    if cuda and graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                fn()
        run = g.replay
    else:

        def run():
            for _ in range(iters):
                fn()

    out = []
    for _ in range(repeats):
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            run()
            out.append((time.perf_counter() - t0) / iters)
    return out


def _rank_main(rank: int, world: int, port: int, args: dict, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = args["backend"] == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from fly_comm import CustomAllReduce

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, _DTYPES[args["dtype"]])
    esize = torch.empty((), dtype=dtype).element_size()
    sizes = [s - s % esize for s in args["sizes"]]
    ar = CustomAllReduce(max_size=max(sizes), device=device)

    def sync():
        if cuda:
            torch.cuda.synchronize()
        token = torch.zeros(1, device=device)
        dist.all_reduce(token)
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for nbytes in sizes:
        n = nbytes // esize
        gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
        x = torch.randn(n, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        y = torch.empty_like(x)
        ref = x.float()
        dist.all_reduce(ref)  # fp32: the exact sum up to fp32 rounding
        scale = x.float().abs()
        dist.all_reduce(scale)  # sum of |x| over the ranks: what rounding errors are relative to
        scale.clamp_min_(torch.finfo(torch.float32).tiny)
        providers = {"custom": None, "nccl": "nccl"}
        if ar.kernels_enabled:
            providers.update(one_shot="one_shot", two_shot="two_shot")
        row = {"bytes": nbytes, "chosen": ar.algorithm(nbytes), "us": {}, "spread_us": {}, "rel_err": {}}
        for name, alg in providers.items():
            ar.all_reduce(x, out=y, algorithm=alg)  # compiles the kernel outside any capture
            err = ((y.float() - ref).abs() / scale).max().item() if n else 0.0
            def call(x=x, y=y, alg=alg):
                ar.all_reduce(x, out=y, algorithm=alg)

            times = _time_calls(call, args["iters"], args["repeats"], cuda, args["graph"], sync)
            med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            row["us"][name] = med.item() * 1e6
            row["spread_us"][name] = (max(times) - min(times)) * 1e6
            row["rel_err"][name] = err
        rows.append(row)
    ar.close()
    if rank == 0:
        Path(result_path).write_text(json.dumps({"world": world, "dtype": args["dtype"], "backend": args["backend"],
                                                 "graph": args["graph"] and cuda, "rows": rows}))  # fmt: skip
    dist.destroy_process_group()


def _markdown(result: dict) -> str:
    world = result["world"]
    names = ["custom", "one_shot", "two_shot", "nccl"]
    lines = [f"all-reduce, {world} ranks, {result['dtype']}, backend {result['backend']}, "
             f"{'CUDA graph replay' if result['graph'] else 'eager calls'}; us a call (median, MAX over ranks)",
             "", "| bytes | chosen | " + " | ".join(names) + " | nccl / custom | busbw custom GB/s | busbw nccl GB/s |",
             "| ---: | --- | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |"]  # fmt: skip
    for r in result["rows"]:
        us = r["us"]
        cells = [f"{us[n]:.1f}" if n in us else "-" for n in names]
        speed = us["nccl"] / us["custom"] if us.get("custom") else math.nan
        bw = [bus_bandwidth(r["bytes"], world, us[n] / 1e6) if us.get(n) else math.nan for n in ("custom", "nccl")]
        lines.append(f"| {r['bytes']} | {r['chosen']} | " + " | ".join(cells) + f" | {speed:.2f} | {bw[0]:.1f} | "
                     f"{bw[1]:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fly-comm bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU, 2, 4 or 8; gloo: 2)")
    ap.add_argument("--sizes", default=None, help="comma-separated bytes, K/M suffixes (default 4K..64M, x4)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-graph", dest="graph", action="store_false", help="time eager calls, not a graph replay")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--out", default=None, help="folder for <stem>.json / .md (default: print only)")
    ap.add_argument("--stem", default=None)
    args = ap.parse_args(list(argv or []))

    import torch
    import torch.multiprocessing as mp

    if args.backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < 2:
            print(f"fly-comm bench: needs >= 2 GPUs on this host, found {gpus}; nothing timed")
            return 0
        world = args.world or max(w for w in (2, 4, 8) if w <= gpus)
        if world > gpus:
            ap.error(f"--world {world}: only {gpus} GPUs")
        start_method = "spawn"  # CUDA cannot be used in a forked child
    else:
        world = args.world or 2
        start_method = "fork"  # CPU only: forked children skip re-importing torch (seconds each)
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else default_sizes()
    conf = {"backend": args.backend, "dtype": args.dtype, "iters": args.iters, "repeats": args.repeats,
            "graph": args.graph, "sizes": sizes}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fly-comm-bench-") as tmp:
        path = os.path.join(tmp, "result.json")
        mp.start_processes(_rank_main, args=(world, _free_port(), conf, path), nprocs=world,
                           start_method=start_method)  # fmt: skip
        result = json.loads(Path(path).read_text())
    text = _markdown(result)
    print(text, end="")
    tol = _tolerance(args.dtype, world)
    bad = [(r["bytes"], n, e) for r in result["rows"] for n, e in r["rel_err"].items() if not e <= tol]
    for nbytes, name, err in bad:
        print(f"MISMATCH {name} at {nbytes} bytes: error {err:.3g} (relative to sum |x|) > {tol:.3g}", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.stem or f"{args.backend}-{world}x-{args.dtype}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out / f"{stem}.md").write_text(text)
    return 1 if bad else 0


def _tolerance(dtype: str, world: int) -> float:
    # Relative to sum |x|: ours rounds the fp32 sum once to the dtype; NCCL may round after each of its
    # world - 1 additions in the dtype. Twice the unit roundoff a rounding covers both.
    unit = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}[dtype]
    return 2 * world * unit
