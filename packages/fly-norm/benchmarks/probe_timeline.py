"""Probe: where a backward call's device time goes, kernel by kernel.

    python probe_timeline.py --ops layer_norm rms_norm --widths 16384 32768 --out DIR [--forward]

For each op and width (bf16, M * N = 2^27), the backward through autograd (``--forward``: the forward
without gradients) as the benchmark times it: the
time a call (the benchmark's timer: back to back, the host's launch overhead hidden) and, from
torch.profiler, every device activity a call launches (kernels and memsets) with its mean duration. What is
left of the call after the activities is the gaps between them (launch latency, a grid's ramp and tail).
``--variants`` times the same calls with one of v24-v25's host changes undone in this process (``nopdl``:
the column sums launched plainly; ``twosums``: dweight's and dbias's sums in two launches; ``materialize``:
the statistics' gradients materialized by autograd; ``nopool``: the staged backward's slots fresh zeros, a
memset a call; ``nofwdpool``: the same for the staged forward, v25; ``nofwdpdl``: the staged forward
launched plainly; ``v24sums``: v24's column sums, three
dependent [32, 64] steps a program at 16K, before v25's one step). Design probe, not the benchmark.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

import fly_norm
from fly_norm import layernorm, rmsnorm
from fly_norm._kernels import norm, split
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps

_OPS = {
    "layer_norm": (2, lambda x, p: fly_norm.layer_norm(x, p[0], p[1])),
    "rms_norm": (1, lambda x, p: fly_norm.rms_norm(x, p[0])),
    "softmax": (0, lambda x, p: fly_norm.softmax(x)),
}


def _forward(f, x, params):
    return lambda: f(x, params)


def _backward(y, leaves, dy):
    return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)


def _undo(variant: str, mp) -> None:
    """Undo one v24 change in this process (``mp``: a list collecting (object, name, old value))."""

    def patch(obj, name, value):
        mp.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if variant == "nopdl":
        patch(norm, "pdl_options", lambda device: {})
    elif variant == "nofwdpdl":
        patch(split, "pdl_options", lambda device: {})
    elif variant == "twosums":
        one = norm.launch_sum_partials

        def two(partials, out, partials2=None, out2=None, clear=None, stream=None):
            one(partials, out, clear=clear)
            if partials2 is not None:
                one(partials2, out2)

        patch(norm, "launch_sum_partials", two)
    elif variant == "materialize":
        for mod in (layernorm, rmsnorm):
            setup = mod._setup_context

            def again(ctx, inputs, output, setup=setup):
                setup(ctx, inputs, output)
                ctx.set_materialize_grads(True)

            name = "layer_norm_fwd" if mod is layernorm else "rms_norm_fwd"
            torch.library.register_autograd(f"fly_norm::{name}", mod._backward, setup_context=again)
            mp.append((None, name, (mod, setup)))
    elif variant == "v24sums":  # v24's column sums: bands of 16-128 columns, [2048 / band, band] steps

        def v24_sums(partials, out, partials2=None, out2=None, clear=None, stream=None):
            import flydsl.arch
            import flydsl.compiler as flyc

            p, n = partials.shape
            sms = flydsl.arch.current(partials.device).sm_count
            band = max(16, min(128, flyc.next_power_of_2(flyc.cdiv(n, 2 * sms))))
            two = partials2 is not None
            flyc.launch(
                norm._sum_partials_kernel, (flyc.cdiv(n, band), 2 if two else 1), partials, out,
                partials2 if two else partials, out2 if two else out, partials if clear is None else clear, p, n,
                0 if clear is None else clear.numel(), BLOCK_P=2048 // band, BLOCK_N=band, num_warps=4,
                **norm.pdl_options(partials.device),
            )  # fmt: skip

        patch(norm, "launch_sum_partials", v24_sums)
    elif variant == "nopool":
        patch(split, "take_slots", lambda words, device: None)
    elif variant == "nofwdpool":
        patch(split, "take_fwd_slots", lambda words, device: None)
    elif variant != "shipped":
        raise SystemExit(f"unknown variant {variant}")


def _redo(mp) -> None:
    for obj, name, old in reversed(mp):
        if obj is None:
            mod, setup = old
            torch.library.register_autograd(f"fly_norm::{name}", mod._backward, setup_context=setup)
        else:
            setattr(obj, name, old)
    mp.clear()


def _activities(fn, iters: int) -> list[dict]:
    """Each device activity's name, count an iteration and mean duration (us)."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    count = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    return [
        {"name": k[:120], "per_iter": count[k] / iters, "mean_us": total[k] / count[k]}
        for k in sorted(total, key=total.get, reverse=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", nargs="+", default=list(_OPS))
    ap.add_argument("--widths", nargs="+", type=int, default=[16384, 32768])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--variants", nargs="+", default=["shipped"])
    ap.add_argument("--forward", action="store_true", help="time the forward (no gradient) instead")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy = copy_gbps(2 * 2 * (1 << 27), torch.device("cuda"))
    rows = []
    for op, n, variant in [(o, n, v) for o in args.ops for n in args.widths for v in args.variants]:
        n_params, f = _OPS[op]
        m = (1 << 27) // n
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        params = [torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n_params)]
        dy = torch.randn_like(x)
        undo: list = []
        _undo(variant, undo)
        if args.forward:
            fn = _forward(f, x.detach(), [p.detach() for p in params])
            nbytes = 2 * 2 * m * n + 2 * n_params * n
        else:
            fn = _backward(f(x, params), [x, *params], dy)
            nbytes = 2 * 3 * m * n + 2 * 2 * n_params * n + 8 * m
        it = bench(fn).median_us
        acts = _activities(fn, args.iters)
        _redo(undo)
        busy = sum(a["per_iter"] * a["mean_us"] for a in acts)
        pct = 100 * nbytes / (it * 1e-6) / (copy * 1e9)
        rows.append({"variant": variant, "op": op, "pass": "forward" if args.forward else "backward", "N": n,
                     "M": m, "call_us": it, "activities_us": busy, "gaps_us": it - busy, "pct_of_copy": pct,
                     "activities": acts})  # fmt: skip
        print(f"{variant} {op} N={n}: call {it:.1f} us ({pct:.1f}% of copy), activities {busy:.1f}")
        for a in acts:
            print(f"    {a['per_iter']:.0f} x {a['mean_us']:7.2f} us  {a['name']}")
        del x, params, dy, fn
        torch.cuda.empty_cache()
    (args.out / "probe-timeline.json").write_text(json.dumps({"copy_gbps": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
