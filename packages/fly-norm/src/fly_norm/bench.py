"""Benchmarks of fly-norm: every op against torch eager and torch.compile, on the shared harness.

Run ``python packages/fly-norm/benchmarks/run.py [--quick] [--only NAME]`` or
``flydsl bench norm ...``. All ops are memory bound: the model is bytes (each
input read once, each output written once) and the ceiling is the device copy
bandwidth measured in the same run.

Benches (bf16, ``M * N = 2**27`` elements, 256 MiB per 16-bit tensor, far
past L2, so every provider streams from HBM; at 2**25 elements a device copy
itself reaches only ~93% of its large-size bandwidth, see PERF.md):

- ``rmsnorm_fwd``, ``layernorm_fwd``: read x and weight (and bias), write y;
- ``softmax_fwd``: read x, write y (also N = 2**20);
- ``rmsnorm_bwd``, ``layernorm_bwd``: read x, dy, weight, the per-row stats;
  write dx and dweight (dbias); timed: the backward alone (the forward graph
  is built once and reused with ``retain_graph``);
- ``softmax_bwd``: read y and dy, write dx;
- ``rmsnorm_quant``: read x and weight, write int8 q and fp32 row scales;
- ``latency``: rms_norm, layer_norm and softmax at M <= 64 rows of N = 4096, each call's end-to-end
  latency (the call, then its device work, then the synchronization's return: host and device in
  series) against torch eager;
- ``call_rate``: the same calls back to back with no synchronization and no GPU backlog (the host's
  rate of calls: each provider's host time a call where it exceeds the device time).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from flydsl import native
from flydsl_common.bench import Bench, Case, CompiledPeer, Provider, main_for, results_dir

from . import reference as ref

__all__ = ["benches", "main", "default_out_dir"]

_ELEMENTS = 1 << 27
_WIDTHS = (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
_SOFTMAX_WIDTHS = (*_WIDTHS, 1 << 20)
_QUICK = ((4, 256), (2, 1000))  # tiny shapes: the CPU interpreter runs them in seconds
_DT = torch.bfloat16


def _cases(widths: Sequence[int], quick: bool) -> list[Case]:
    shapes = _QUICK if quick else tuple((max(1, _ELEMENTS // n), n) for n in widths)
    return [Case(f"{m}x{n}", {"M": m, "N": n}) for m, n in shapes]


def _mn(case: Case) -> tuple[int, int]:
    return case.params["M"], case.params["N"]


# ------------------------------------------------------------------ torch peers


def _torch_rms(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _torch_ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _torch_softmax(x):
    return torch.softmax(x, -1)


def _torch_rms_quant(x, w, dtype=torch.int8):
    """torch's rms_norm, then per-row quantization to int8 (rounded half to even, clamped to 127) or fp8
    e4m3 (clamped to 448; the cast rounds)."""
    qmax = 127.0 if dtype == torch.int8 else 448.0
    y = F.rms_norm(x, (x.shape[-1],), w, 1e-6).float()
    scale = y.abs().amax(-1, keepdim=True) / qmax
    q = y / scale
    if dtype == torch.int8:
        q = q.round()
    return q.clamp(-qmax, qmax).to(dtype), scale


_PEERS: dict[str, CompiledPeer] = {}


def _compiled(name: str, fn: Callable) -> CompiledPeer:
    return _PEERS.setdefault(name, CompiledPeer(fn))


# --------------------------------------------------------------------- forward


def _fwd_bench(name: str, ours: Callable, peer: Callable, reference: Callable, widths, n_params: int) -> Bench:
    """A forward bench: inputs (x, params...), ours(*inputs) vs the torch peer (eager and compiled)."""

    def setup(case, device):
        m, n = _mn(case)
        x = torch.randn(m, n, device=device, dtype=_DT)
        params = [torch.randn(n, device=device, dtype=_DT) for _ in range(n_params)]
        return (x, *params)

    def nbytes(case):
        m, n = _mn(case)
        return 2 * (2 * m * n + n_params * n)

    return Bench(
        name=name,
        cases=_cases(widths, False),
        quick_cases=_cases(widths, True),
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: ours(*t), is_ours=True),
            Provider("torch", lambda t: lambda: peer(*t)),
            Provider("torch.compile", lambda t: _compiled(name, peer).make(tuple(t[0].shape), *t)),
        ],
        bytes=nbytes,
        reference=lambda t: reference(*t),
        tolerance=2e-2,  # bf16 output: one rounding (~4e-3) plus the peer's own bf16 arithmetic
        x_param="N",
    )


# -------------------------------------------------------------------- backward


def _bwd_bench(name: str, fwd: Callable, peer: Callable, widths, n_params: int, stats_per_row: int) -> Bench:
    """A backward bench: the graph of fwd(x, params) is built once; the backward is timed."""

    def setup(case, device):
        m, n = _mn(case)
        x = torch.randn(m, n, device=device, dtype=_DT)
        params = [torch.randn(n, device=device, dtype=_DT) for _ in range(n_params)]
        dy = torch.randn(m, n, device=device, dtype=_DT)
        return (x, params, dy)

    def backward_of(f):
        def make(inputs):
            x, params, dy = inputs
            leaves = [x.detach().requires_grad_(), *(p.detach().requires_grad_() for p in params)]
            y = f(*leaves)
            return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)[0]

        return make

    def compiled_backward(inputs):
        x, params, dy = inputs
        make_fwd = _compiled(name, peer)
        leaves = [x.detach().requires_grad_(), *(p.detach().requires_grad_() for p in params)]
        fn = make_fwd.make(tuple(x.shape), *leaves)
        y = fn()
        return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)[0]

    def reference(inputs):
        x, params, dy = inputs
        x64 = x.detach().double().requires_grad_()
        y = peer(x64, *(p.double() for p in params))
        return torch.autograd.grad(y, x64, dy.double())[0]

    def nbytes(case):
        m, n = _mn(case)
        return 2 * 3 * m * n + 2 * 2 * n_params * n + 4 * stats_per_row * m

    return Bench(
        name=name,
        cases=_cases(widths, False),
        quick_cases=_cases(widths, True),
        setup=setup,
        providers=[
            Provider("flydsl", backward_of(fwd), is_ours=True),
            Provider("torch", backward_of(peer)),
            Provider("torch.compile", compiled_backward),
        ],
        bytes=nbytes,
        reference=reference,
        tolerance=2e-2,
        x_param="N",
        rotate=False,  # the graph holds its own inputs; 256 MiB tensors are past L2 anyway
    )


# ----------------------------------------------------------------------- quant


def _quant_bench(dtype: torch.dtype = torch.int8) -> Bench:
    """rms_norm_quant to int8 (``rmsnorm_quant``) or fp8 e4m3 (``rmsnorm_quant_fp8``) against torch's rms_norm
    and per-row quantization (eager and compiled)."""
    from .rmsnorm import rms_norm_quant

    name = "rmsnorm_quant" if dtype == torch.int8 else "rmsnorm_quant_fp8"
    peer = functools.partial(_torch_rms_quant, dtype=dtype)

    def setup(case, device):
        m, n = _mn(case)
        return (torch.randn(m, n, device=device, dtype=_DT), torch.randn(n, device=device, dtype=_DT))

    def deq(ret):
        q, s = ret[0], ret[1]
        return q.double() * s.double().reshape(-1, 1)

    return Bench(
        name=name,
        cases=_cases(_WIDTHS[:7], False),
        quick_cases=_cases(_WIDTHS[:7], True),
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: rms_norm_quant(t[0], t[1], 1e-6, dtype=dtype), is_ours=True),
            Provider("torch", lambda t: lambda: peer(*t)),
            Provider("torch.compile", lambda t: _compiled(name, peer).make(t[0].shape, *t)),
        ],
        bytes=lambda c: 3 * c.params["M"] * c.params["N"] + 2 * c.params["N"] + 4 * c.params["M"],
        # Judged against the reference's own quantization (fp64 norm, same rounding rule): the int8
        # grid's error (half a step of amax/127, ~2e-2 of the rms at 16K+ columns) is then common
        # to both, and only rounding flips of one step remain.
        reference=lambda t: deq(ref.rms_norm_quant_ref(t[0], t[1], 1e-6, dtype=dtype)),
        output=deq,
        tolerance=2e-2,
        x_param="N",
    )


# --------------------------------------------------------------------- latency


def _latency_bench(name: str, sync_each: bool) -> Bench:
    from .layernorm import layer_norm
    from .rmsnorm import rms_norm
    from .softmax import softmax

    # op -> (ours, torch's, reference, per-column parameters)
    ops = {
        "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6), _torch_rms, lambda x, w: ref.rms_norm_ref(x, w, 1e-6), 1),
        "layer_norm": (lambda x, w, b: layer_norm(x, w, b, 1e-5), _torch_ln,
                       lambda x, w, b: ref.layer_norm_ref(x, w, b, 1e-5), 2),
        "softmax": (lambda x: softmax(x, -1), _torch_softmax, lambda x: ref.softmax_ref(x, -1), 0),
    }

    def setup(case, device):
        m, n = _mn(case)
        if torch.device(device).type == "cuda":
            native.tensor_api(wait=True)  # the steady state: the C path's C++ tensor API built (once a torch)
        params = [torch.randn(n, device=device, dtype=_DT) for _ in range(ops[case.params["op"]][3])]
        return (case.params["op"], torch.randn(m, n, device=device, dtype=_DT), *params)

    def provider(which):
        return lambda t: (lambda f, args: lambda: f(*args))(ops[t[0]][which], t[1:])

    cases = [Case(f"{op} {m}x4096", {"op": op, "M": m, "N": 4096}) for op in ops for m in (1, 4, 16, 64)]
    what = ("each call's latency: the call, its device work and the synchronization's return, in series"
            if sync_each else "calls back to back, no synchronization, no GPU backlog: the rate of calls")
    return Bench(
        name=name,
        cases=cases,
        quick_cases=cases[:1],
        setup=setup,
        providers=[Provider("flydsl", provider(0), is_ours=True), Provider("torch", provider(1))],
        bytes=lambda c: 2 * (2 * c.params["M"] * c.params["N"] + ops[c.params["op"]][3] * c.params["N"]),
        reference=lambda t: ops[t[0]][2](*t[1:]),
        tolerance=2e-2,
        x_param="M",
        group_by=("op",),
        rotate=False,
        timer_kwargs={"backlog": False, "sync_each": sync_each},
        interleave=15,  # host-bound: ours and torch's alternate window by window, so host drift hits both
        description=f"small batches, {what}; providers timed in 15 alternating rounds of one window, medians.",
    )


def benches() -> list[Bench]:
    from .layernorm import layer_norm
    from .rmsnorm import rms_norm
    from .softmax import softmax

    return [
        _fwd_bench("rmsnorm_fwd", lambda x, w: rms_norm(x, w, 1e-6), _torch_rms,
                   lambda x, w: ref.rms_norm_ref(x, w, 1e-6), _WIDTHS, 1),
        _fwd_bench("layernorm_fwd", lambda x, w, b: layer_norm(x, w, b, 1e-5), _torch_ln,
                   lambda x, w, b: ref.layer_norm_ref(x, w, b, 1e-5), _WIDTHS, 2),
        _fwd_bench("softmax_fwd", lambda x: softmax(x, -1), _torch_softmax, lambda x: ref.softmax_ref(x, -1),
                   _SOFTMAX_WIDTHS, 0),
        _bwd_bench("rmsnorm_bwd", lambda x, w: rms_norm(x, w, 1e-6), _torch_rms, _WIDTHS, 1, 1),
        _bwd_bench("layernorm_bwd", lambda x, w, b: layer_norm(x, w, b, 1e-5), _torch_ln, _WIDTHS, 2, 2),
        _bwd_bench("softmax_bwd", lambda x: softmax(x, -1), _torch_softmax, _SOFTMAX_WIDTHS, 0, 0),
        _quant_bench(),
        _quant_bench(torch.float8_e4m3fn),
        _latency_bench("latency", sync_each=True),
        _latency_bench("call_rate", sync_each=False),
    ]


def default_out_dir() -> Path:
    return results_dir("fly-norm", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    return main_for(benches(), list(argv or []), default_out_dir())
