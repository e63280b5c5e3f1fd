"""Design probe of fly-gemm's kernels (not the benchmark): python probe.py [--out DIR] [--part NAME ...]

Each part times a few configs of one kernel at a few shapes on the GPU, against the torch peer in the same
run, after checking every config's output against the fp64 reference (a wrong config is reported, never
timed). Results print as they come and go to ``probe-gemm.json`` under ``--out``.

- ``tma``: the persistent TMA kernel's options at large M (tile shape, stages, flatten, warp
  specialization, epilogue subtiling) and the tiled kernel, bf16 and fp8, against cuBLAS /
  ``torch._scaled_mm``;
- ``decode``: M = 1 and 16 over the decode paths (narrow tensor-core tiles, split-K, the CUDA-core gemv
  kernel), as a fraction of the copy bandwidth spent reading the weights, against cuBLAS, and against a
  copy moving the weights' bytes and the read-only kernel below reading them (the memory system's rate there);
- ``pdl``: programmatic dependent launch in a chain of the same decode GEMM, each config with and without
  it: weights from memory (as the benchmark), weights in L2, and a tiny GEMM (the launch gap alone);
- ``read``: the memory system's read-only rate by size (32 MiB to 448 MiB, the decode weights' sizes): a
  streaming kernel that only reads (each program sums its chunks, one value out), from memory as in the
  benchmark, its best of a few configs; and the fit ``time = bytes / rate + fixed`` over the sizes;
- ``sweep``: a wider grid of split-K decode configs (column tile, splits, warps, stages) at the shapes
  nearest the decode bar;
- ``split_cost``: what splitting K costs at M = 16: 4096 x 14336 split 4 ways against the same bytes and
  program count without a split (16384 x 3584: 256 column tiles of a quarter of K each, no reduction),
  and 14336 x 4096, each plain and with PDL;
- ``narrow``: 4096 x 14336 at M = 1 and 16 without the split's end: narrow column tiles (16 or 32) over the
  whole K (256 or 128 programs) or split in two, with deep K steps (256-512) and 3-6 stages, so each
  program keeps enough of the weights in flight alone;
- ``swing``: the two 448 MiB decode shapes (28672 x 8192 and 8192 x 28672, M = 1 and 16) in one process,
  allocated in both orders, each with the searched config, cuBLAS and the read-only kernel over its
  weights: whether their speed follows the shape or where the weights landed in memory (v5 saw ours and
  cuBLAS's trade places between runs);
- ``tma_decode``: the TMA kernel at decode size (16- and 64-row tiles, K split 4-8, reduced in the kernel),
  against the tiled kernel's searched config, at 4096 x 4096 and 4096 x 14336: whether the tensor-memory
  accelerator keeps more of the weights in flight than the tiled kernel's per-thread loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch

import flydsl.arch  # flydsl first: compiled vs interpreted Triton
import flydsl.compiler as flyc
import flydsl.expr as fx
from fly_gemm import GemmConfig, gemm, gemm_ref
from flydsl.autotune.timer import bench, rotating_copies
from flydsl_common.bench import copy_gbps
from flydsl_common.device import row_offset

_L2 = flydsl.arch.current().l2_bytes if torch.cuda.is_available() else 0

_TMA = [
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=3, tma=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, tma=True, epilogue_subtile=True),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True, flatten=True),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True, warp_specialize=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, tma=True, epilogue_subtile=True, flatten=True),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),  # the tiled kernel at the same tile
]
_DECODE = [
    GemmConfig(16, 64, 128, group_m=1, num_stages=4, split_k=4),
    GemmConfig(16, 64, 128, group_m=1, num_stages=4, split_k=4, reduce_last=True),
    GemmConfig(16, 64, 128, group_m=1, num_stages=4, split_k=8, reduce_last=True),
    GemmConfig(16, 32, 128, group_m=1, num_stages=4, split_k=4, reduce_last=True),
    GemmConfig(16, 128, 128, group_m=1, num_stages=4, split_k=8, reduce_last=True),
    GemmConfig(16, 64, 256, group_m=1, num_stages=3, split_k=4, reduce_last=True),
    GemmConfig(16, 64, 128, group_m=1, num_stages=6, split_k=4, reduce_last=True),
    GemmConfig(16, 64, 128, group_m=1, num_warps=2, num_stages=4, split_k=4, reduce_last=True),
    GemmConfig(1, 16, 256, group_m=1, num_stages=1, gemv=True),
]


def _operands(m, n, k, dtype):
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype)
    if dtype.itemsize != 1:
        return a, b, (None, None)
    return a, b, (torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5)


def _peer(a, b, scales):
    if a.dtype.itemsize == 1:
        sa, sb = scales
        return lambda: torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)
    return lambda: torch.matmul(a, b.t())


def _part(shapes, configs, copy, decode: bool) -> list[dict]:
    out = []
    for m, n, k, dtype in shapes:
        a, b, (sa, sb) = _operands(m, n, k, dtype)
        ref = gemm_ref(a, b, scale_a=sa, scale_b=sb)
        sets = rotating_copies((a, b, sa, sb), _L2)  # weights from memory, as in the benchmark
        peer_us = bench(lambda *t: _peer(t[0], t[1], t[2:])(), arg_sets=sets).median_us
        flops, wbytes = 2 * m * n * k, n * k * dtype.itemsize
        head = dict(shape=(m, n, k), dtype=str(dtype), peer_us=peer_us)
        if decode:  # a copy moving the weights' bytes, and a read of them: the memory system at this size
            head["small_copy_frac"] = copy_gbps(wbytes) / copy
            head["read_frac"] = wbytes / (_read_us(b) * 1e-6) / 1e9 / copy
        print(head, flush=True)
        out.append(head)
        for cfg in configs:
            row = dict(shape=(m, n, k), dtype=str(dtype), cfg=repr(cfg))

            def run(a, b, sa, sb, cfg=cfg):
                return gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, config=cfg)

            try:
                c = run(a, b, sa, sb)
                row["rel_err"] = ((c.double() - ref).norm() / ref.norm()).item()
                if not row["rel_err"] <= 1e-2:
                    raise AssertionError(f"relative error {row['rel_err']:.3e}")
                us = bench(run, arg_sets=sets).median_us
                row.update(us=us, vs_peer=peer_us / us, tflops=flops / us / 1e6)
                if decode:
                    row["weight_bw_frac"] = wbytes / (us * 1e-6) / 1e9 / copy
            except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                row["error"] = repr(e)[:300]
            print(row, flush=True)
            out.append(row)
        torch.cuda.empty_cache()
    return out


def _pdl_part(copy) -> list[dict]:
    out = []
    split4 = GemmConfig(16, 64, 128, group_m=1, num_stages=4, split_k=4, reduce_last=True)
    cases = [((1, 4096, 4096), dataclasses.replace(split4, num_warps=2)), ((16, 4096, 14336), split4),
             ((1, 256, 256), GemmConfig(16, 64, 128, group_m=1, num_stages=4))]  # fmt: skip
    for (m, n, k), base in cases:
        a, b, _ = _operands(m, n, k, torch.bfloat16)
        ref = gemm_ref(a, b)
        cold = rotating_copies((a, b), _L2)
        for pdl in (False, True):
            cfg = dataclasses.replace(base, pdl=pdl)
            row = dict(shape=(m, n, k), cfg=repr(cfg))

            def run(a, b, cfg=cfg):
                return gemm(a, b, config=cfg)

            c = run(a, b)
            row["rel_err"] = ((c.double() - ref).norm() / ref.norm()).item()
            row["cold_us"] = bench(run, arg_sets=cold).median_us
            row["warm_us"] = bench(run, arg_sets=[(a, b)]).median_us
            row["cold_weight_bw_frac"] = n * k * 2 / (row["cold_us"] * 1e-6) / 1e9 / copy
            print(row, flush=True)
            out.append(row)
    return out


@flyc.kernel
def _read_kernel(x_ptr, out_ptr, chunks, BLOCK: fx.constexpr, STAGES: fx.constexpr):
    # A persistent program sums every num_programs-th chunk of BLOCK int32s: all reads, one store.
    acc = fx.zeros([BLOCK], dtype=fx.int32)
    offs = fx.arange(0, BLOCK)
    for c in fx.range(fx.program_id(0), chunks, fx.num_programs(0), num_stages=STAGES):
        acc += fx.load(x_ptr + row_offset(c, BLOCK) + offs)
    fx.store(out_ptr + fx.program_id(0), fx.sum(acc, axis=0))


_READ_CONFIGS = [(4096, 8, 4, 3), (8192, 8, 2, 3), (2048, 4, 8, 2), (4096, 4, 4, 1)]  # BLOCK, warps, a SM, stages


def _read_us(t, config=(2048, 4, 8, 2)) -> float:
    """Microseconds of the read-only kernel over ``t``'s bytes (whole chunks), from memory; checked."""
    block, warps, per_sm, stages = config
    x = t.reshape(-1).view(torch.int32)
    grid = flydsl.arch.current().sm_count * per_sm
    res = torch.empty(grid, dtype=torch.int32, device=x.device)

    def run(x):
        flyc.launch(_read_kernel, (grid,), x, res, x.numel() // block, BLOCK=block, STAGES=stages, num_warps=warps)

    run(x)
    if (res.sum().item() - x[: x.numel() // block * block].sum().item()) % 2**32:  # int32 sums wrap
        raise AssertionError(f"read kernel summed wrong ({config})")
    return bench(run, arg_sets=rotating_copies((x,), _L2)).median_us


def _read_part(copy) -> list[dict]:
    out, fits = [], []
    for mib in (32, 64, 112, 128, 224, 448):
        x = torch.randint(-100, 100, (mib << 18,), dtype=torch.int32, device="cuda")
        rows = [dict(read_mib=mib, config=c, us=_read_us(x, c)) for c in _READ_CONFIGS]
        for row in rows:
            row["read_frac"] = (mib << 20) / (row["us"] * 1e-6) / 1e9 / copy
            print(row, flush=True)
        out += rows
        fits.append(((mib << 20) / 1e9, min(r["us"] for r in rows)))
    n = len(fits)  # least squares of time (us) against GB: slope 1e6 / rate
    mx, my = sum(f[0] for f in fits) / n, sum(f[1] for f in fits) / n
    slope = sum((f[0] - mx) * (f[1] - my) for f in fits) / sum((f[0] - mx) ** 2 for f in fits)
    fit = dict(read_fit_gbps=1e6 / slope, read_fit_fixed_us=my - slope * mx)
    print(fit, flush=True)
    return [*out, fit]


def _sweep_configs():
    for block_n, splits, warps, stages in itertools.product((32, 64, 128), (3, 4, 6, 7, 8), (2, 4), (4, 6)):
        yield GemmConfig(
            16, block_n, 128, group_m=1, num_warps=warps, num_stages=stages, split_k=splits, reduce_last=True
        )


def _swing_part(copy) -> list[dict]:
    out = []
    shapes = [(28672, 8192), (8192, 28672)]
    for order in (shapes, shapes[::-1]):
        held = [(n, k, *_operands(16, n, k, torch.bfloat16)[:2]) for n, k in order]  # allocated in this order
        for n, k, a16, b in held:
            for m in (1, 16):
                a = a16[:m]
                sets = rotating_copies((a, b), _L2)
                row = dict(order=[f"{n}x{k}" for n, k in order], shape=(m, n, k), b_ptr=b.data_ptr())
                row["ours_us"] = bench(lambda a, b: gemm(a, b), arg_sets=sets).median_us
                row["cublas_us"] = bench(lambda a, b: torch.matmul(a, b.t()), arg_sets=sets).median_us
                row["read_us"] = _read_us(b)
                for key in ("ours", "cublas", "read"):
                    row[f"{key}_frac"] = n * k * 2 / (row[f"{key}_us"] * 1e-6) / 1e9 / copy
                print(row, flush=True)
                out.append(row)
        del held
        torch.cuda.empty_cache()
    return out


_TMA_DECODE = [
    GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4, tma=True, split_k=4, reduce_last=True),
    GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=6, tma=True, split_k=4, reduce_last=True),
    GemmConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=4, tma=True, split_k=8, reduce_last=True),
    GemmConfig(16, 64, 256, group_m=1, num_warps=4, num_stages=3, tma=True, split_k=4, reduce_last=True),
    GemmConfig(64, 64, 128, group_m=1, num_warps=4, num_stages=4, tma=True, split_k=4, reduce_last=True),
    GemmConfig(64, 128, 128, group_m=1, num_warps=4, num_stages=4, tma=True, split_k=8, reduce_last=True),
    # the TMA kernel is persistent (one program an SM by default): two an SM keep twice the tiles in flight
    GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4, tma=True, split_k=4, reduce_last=True, occupancy=2),
    GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4, tma=True, split_k=8, reduce_last=True, occupancy=2),
    GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4, split_k=4, reduce_last=True),  # tiled twin
]


def _narrow_configs():
    for block_n, block_k, stages, warps in itertools.product((16, 32), (256, 512), (3, 4, 6), (2, 4)):
        yield GemmConfig(16, block_n, block_k, group_m=1, num_warps=warps, num_stages=stages)
        if block_n == 32:
            yield GemmConfig(16, block_n, block_k, group_m=1, num_warps=warps, num_stages=stages, split_k=2,
                             reduce_last=True)  # fmt: skip
    yield GemmConfig(16, 64, 128, group_m=1, num_stages=4, split_k=4, reduce_last=True)  # the searched one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--part", nargs="*", default=["tma", "decode"])
    args = ap.parse_args()
    copy = copy_gbps(2 << 30)
    rows = [dict(copy_GBps=copy)]
    print(rows[0], flush=True)
    if "tma" in args.part:
        shapes = [(8192, 8192, 8192, torch.bfloat16), (4096, 4096, 4096, torch.bfloat16),
                  (8192, 8192, 8192, torch.float8_e4m3fn), (1024, 14336, 4096, torch.bfloat16)]  # fmt: skip
        rows += _part(shapes, _TMA, copy, decode=False)
    if "decode" in args.part:
        shapes = [(1, 4096, 4096, torch.bfloat16), (16, 4096, 4096, torch.bfloat16), (1, 8192, 8192, torch.bfloat16),
                  (16, 4096, 14336, torch.bfloat16), (1, 8192, 8192, torch.float8_e4m3fn)]  # fmt: skip
        rows += _part(shapes, _DECODE, copy, decode=True)
    if "pdl" in args.part:
        rows += _pdl_part(copy)
    if "read" in args.part:
        rows += _read_part(copy)
    if "sweep" in args.part:
        rows += _part([(16, 4096, 14336, torch.bfloat16), (4, 4096, 14336, torch.bfloat16)], list(_sweep_configs()),
                      copy, decode=True)  # fmt: skip
    if "split_cost" in args.part:
        tile = GemmConfig(16, 64, 128, group_m=1, num_stages=4)
        split = dataclasses.replace(tile, split_k=4, reduce_last=True)
        for shape, cfg in (((16, 4096, 14336), split), ((16, 16384, 3584), tile), ((16, 14336, 4096), tile)):
            rows += _part([(*shape, torch.bfloat16)], [cfg, dataclasses.replace(cfg, pdl=True)], copy, decode=True)
    if "narrow" in args.part:
        rows += _part([(16, 4096, 14336, torch.bfloat16), (1, 4096, 14336, torch.bfloat16)], list(_narrow_configs()),
                      copy, decode=True)  # fmt: skip
    if "tma_decode" in args.part:
        shapes = [(m, n, k, torch.bfloat16) for m in (1, 16) for n, k in ((4096, 4096), (4096, 14336))]
        rows += _part(shapes, _TMA_DECODE, copy, decode=True)
    if "swing" in args.part:
        rows += _swing_part(copy)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-gemm.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
