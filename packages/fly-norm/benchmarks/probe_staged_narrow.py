"""Probe: the staged norm forward on rows narrower than it ships for (8K-32K columns, one or two slices a row).

    python probe_staged_narrow.py --widths 8192 16384 32768 --out DIR

The staged forward (split.FWD_STAGED: a program's slice of each of its rows read as words through the
software pipeliner, the weight and bias held as words for the whole launch) ships from 64K columns. At
16K-32K layer_norm's forward runs at 94-95% of the copy, as torch.compile's does, while rms_norm's reaches
97-98%: a persistent program holding the weight and bias would read 64 KB less from L2 a row at 16K. For
each width (bf16, M * N = 2^27) and op: the shipped forward, torch.compile's, and the staged kernel called
directly (split._launch_fwd_staged) at a few (slice, warps, stages) configs; each output against fp64
(relative error), each time as a fraction of the device copy measured in the same run. Design probe, not
the benchmark.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_norm._kernels import split
from fly_norm.reference import layer_norm_ref, rms_norm_ref
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps

_CONFIGS = [(16384, 16, 3), (8192, 16, 3), (8192, 8, 3), (16384, 16, 4)]


def main() -> None:
    import fly_norm

    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", nargs="+", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--ops", nargs="+", default=["layer_norm", "rms_norm"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    copy = copy_gbps(1 << 29)
    rows = [{"copy_GBps": copy}]
    for op in args.ops:
        is_rms = op == "rms_norm"
        eps = 1e-6 if is_rms else 1e-5

        def shipped(x, w, b, is_rms=is_rms, eps=eps):
            return fly_norm.rms_norm(x, w, eps) if is_rms else fly_norm.layer_norm(x, w, b, eps)

        def eager(x, w, b, is_rms=is_rms, eps=eps):
            if is_rms:
                return torch.nn.functional.rms_norm(x, (x.shape[1],), w, eps)
            return torch.nn.functional.layer_norm(x, (x.shape[1],), w, b, eps)

        compiled = torch.compile(eager, dynamic=False)  # (v26 r4 ran without: later widths recompiled dynamic)
        for n in args.widths:
            m = (1 << 27) // n
            x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda") * 2 + 0.5
            w = torch.rand(n, dtype=torch.bfloat16, device="cuda") + 0.5
            b = None if is_rms else torch.randn(n, dtype=torch.bfloat16, device="cuda")
            ref = rms_norm_ref(x, w, eps) if is_rms else layer_norm_ref(x, w, b, eps)
            y = torch.empty_like(x)
            runs = [("shipped", lambda x=x, w=w, b=b: shipped(x, w, b)),
                    ("torch.compile", lambda x=x, w=w, b=b, c=compiled: c(x, w, b))]  # fmt: skip
            for cfg in _CONFIGS:

                def staged(cfg=cfg, x=x, w=w, b=b, y=y, is_rms=is_rms, eps=eps):
                    split.FWD_STAGED = cfg
                    if not split._launch_fwd_staged(x, w, b, y, None, None, eps, 0.0, is_rms):
                        raise RuntimeError("not launched")
                    return y

                runs.append((f"staged {cfg}", staged))
            saved = split.FWD_STAGED
            for name, run in runs:
                try:
                    out = run()
                    torch.cuda.synchronize()
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    us = bench(run).median_us
                    r = {"op": op, "N": n, "M": m, "run": name, "us": us, "rel_err": err,
                         "frac_copy": 2 * 2 * m * n / (us * 1e-6) / 1e9 / copy}  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                    r = {"op": op, "N": n, "run": name, "error": repr(e)[:300]}
                finally:
                    split.FWD_STAGED = saved
                print(r, flush=True)
                rows.append(r)
            del x, y, ref
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe-staged-narrow.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
