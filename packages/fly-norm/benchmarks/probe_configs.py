"""Probe: the shipped forward of one op with module configs overridden, variant by variant, in one process.

    python probe_configs.py --op softmax --widths 65536 262144 \\
        --variant "resident.RESIDENT=(1024, 10, 4, 2)" --variant "resident.RESIDENT=(2048, 6, 4, 2)"

A variant is ``NAME=VALUE[; NAME=VALUE...]``, each NAME a constant of ``fly_norm._kernels.split`` (or, as
``norm.NAME`` / ``resident.NAME``, of ``fly_norm._kernels.norm`` / ``.resident``) set to the Python literal
VALUE for that variant's runs (restored after). bf16 (``--dtype``: fp16, fp32), M * N = 2^27 as the
benchmark (``--rows``: other multiples of that M); each
variant's output (with ``--bwd`` the backward's dx, through autograd) against fp64 (relative error) and
against the first variant's (max difference); the time as a fraction of the device copy measured in the same
run (the rows' bytes: x and y, or x, dy and dx). Design probe, not the benchmark.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import torch

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_norm._kernels import norm, resident, split
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


_MODULES = {"split": split, "norm": norm, "resident": resident}


def _parse(variant: str) -> dict:
    """{(module, name): value} of a variant; a NAME without a module prefix is split's."""
    out = {}
    for item in filter(None, (p.strip() for p in variant.split(";"))):
        name, value = (t.strip() for t in item.split("=", 1))
        mod, _, attr = name.rpartition(".")
        module = _MODULES[mod or "split"]
        if not hasattr(module, attr):
            raise SystemExit(f"{mod or 'split'} has no {attr}")
        out[(module, attr)] = ast.literal_eval(value)
    return out


def _reference(op: str, x, w, b):
    xd = x.double()
    if op == "softmax":
        return torch.softmax(xd, -1)
    if op == "rms_norm":
        return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    return torch.nn.functional.layer_norm(xd, (x.shape[1],), w.double(), b.double(), 1e-5)


def main() -> None:
    import fly_norm

    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=("softmax", "rms_norm", "layer_norm"), required=True)
    ap.add_argument("--widths", nargs="*", type=int, default=[65536, 131072, 262144])
    ap.add_argument("--variant", action="append", default=[], help="NAME=VALUE[; NAME=VALUE...]")
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--residual", action="store_true",
                    help="the norms with a fused residual (with --bwd: the residual's gradient too)")
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="the rows' and operands' dtype")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tag", default="configs")
    ap.add_argument("--rows", nargs="*", type=float, default=[1.0],
                    help="row counts as multiples of the benchmark's M = 2^27 / N (each width, each count)")
    args = ap.parse_args()
    dt = _DTYPES[args.dtype]
    variants = [_parse(v) for v in args.variant] or [{}]
    ops = {
        "softmax": lambda x, w, b: fly_norm.softmax(x, -1),
        "rms_norm": lambda x, w, b, r=None: fly_norm.rms_norm(x, w, 1e-6, residual=r),
        "layer_norm": lambda x, w, b, r=None: fly_norm.layer_norm(x, w, b, 1e-5, residual=r),
    }
    f = ops[args.op]
    copy = copy_gbps(1 << 29)
    rows = [dict(copy_GBps=copy, op=args.op)]
    for n, scale in ((n, s) for n in args.widths for s in args.rows):
        m = round(scale * ((1 << 27) // n))
        x = torch.randn(m, n, dtype=dt, device="cuda") * 2 + 0.5
        w = torch.rand(n, dtype=dt, device="cuda") + 0.5
        b = torch.randn(n, dtype=dt, device="cuda")
        if args.residual and not args.bwd:
            raise SystemExit("--residual is a backward probe (with --bwd)")
        ref = _reference(args.op, x, w, b)
        run, rows_moved = (lambda x=x, w=w, b=b: f(x, w, b)), 2
        if args.bwd:
            leaves = [t.detach().requires_grad_() for t in (x, w, b)]
            dy = torch.randn_like(x)
            xd = x.double().requires_grad_()
            if args.residual:  # y and h = x + r, their gradients dy and dres: dx = the norm's + dres
                r = torch.randn_like(x)
                dres = torch.randn_like(x)
                y_graph, h_graph = f(*leaves, r)
                hd = xd + r.double()
                ref = torch.autograd.grad((_reference(args.op, hd, w, b), hd), xd, (dy.double(), dres.double()))[0]
                outs, grads, rows_moved = (y_graph, h_graph), (dy, dres), 4  # h, dy, dres read; dx written
            else:
                ref = torch.autograd.grad(_reference(args.op, xd, w, b), xd, dy.double())[0]
                outs, grads, rows_moved = f(*leaves), dy, 3

            def run(y=outs, x=leaves[0], g=grads):
                return torch.autograd.grad(y, x, g, retain_graph=True)[0]

        first = None
        for text, variant in zip(args.variant or ["shipped"], variants, strict=True):
            saved = {k: getattr(*k) for k in variant}
            try:
                for (module, attr), v in variant.items():
                    setattr(module, attr, v)
                y = run()
                torch.cuda.synchronize()
                err = ((y.double() - ref).norm() / ref.norm()).item()
                diff = 0.0 if first is None else (y.float() - first.float()).abs().max().item()
                first = y if first is None else first
                us = bench(run).median_us
                r = dict(N=n, M=m, dtype=args.dtype, variant=text, us=us,
                         frac_copy=rows_moved * x.element_size() * m * n / (us * 1e-6) / 1e9 / copy,
                         rel_err=err, max_diff_vs_first=diff)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
                r = dict(N=n, M=m, variant=text, error=repr(e)[:300])
            finally:
                for (module, attr), v in saved.items():
                    setattr(module, attr, v)
            print(r, flush=True)
            rows.append(r)
        del x, ref, run
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"probe-{args.tag}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
