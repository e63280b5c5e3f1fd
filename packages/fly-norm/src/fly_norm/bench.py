"""Benchmarks of fly-norm: every op against torch eager and torch.compile, on the shared harness.

Run ``python packages/fly-norm/benchmarks/run.py [--quick] [--only NAME] [--sweep [--seed N]]`` or
``flydsl bench norm ...``. All ops are memory bound: the model is bytes (each input read once, each output
written once) and the ceiling is the device copy bandwidth measured in the same run.

Timings (:mod:`flydsl_common.bench.harness`): ``gpu_us`` (GPU time, host hidden; the rates come from it),
``call_us`` (one public call at a time, host included: what a user's loop sees) and, for the differentiable
ops, ``step_us``: one training step, forward then backward with a fixed upstream gradient, weight (and bias)
gradients filled. A step's leaves are made once, as a model's parameters are, and their ``.grad`` set to
None before each step (``optimizer.zero_grad``'s default), so every step builds a fresh graph and writes
fresh gradients. torch.compile's step is its compiled forward under autograd (the backward it compiled
with it), compiled once a case.

Tuned set (bf16, ``M * N = 2**27`` elements, 256 MiB per 16-bit tensor, far past L2, so every provider
streams from HBM; at 2**25 elements a device copy itself reaches only ~93% of its large-size bandwidth):

- ``rmsnorm_fwd``, ``layernorm_fwd``: read x and weight (and bias), write y; ``softmax_fwd``: read x,
  write y (also N = 2**20). gpu and call: inference (nothing requires grad). step: only at
  ``_FWD_STEP_WIDTHS`` here, since the ``_bwd`` bench of the same op times the same step at every width
  (one compile serves its backward and its step);
- ``rmsnorm_bwd``, ``layernorm_bwd``: read x, dy, weight, the per-row stats; write dx and dweight (dbias);
  ``softmax_bwd``: read y and dy, write dx. gpu and call: the backward alone (the graph is built once and
  its backward repeated with ``retain_graph``); step at every width;
- ``rmsnorm_quant``, ``rmsnorm_quant_fp8``: read x and weight, write int8 / fp8 q and fp32 row scales
  (gpu and call; not differentiable; fp8 at three of int8's seven widths);
- ``host``: the per-call host cost (``host_us``) of rms_norm (also with the fused residual), layer_norm and
  softmax at 4 x 4096, against the torch op each replaces, in three modes: ``no_grad`` (nothing requires
  grad), ``fwd_grad`` (the forward recording a graph) and ``backward`` (a graph built once, its
  ``torch.autograd.grad`` repeated with ``retain_graph``).

Sweep (``--sweep``, :func:`sweep_shapes`): unseen random shapes for the six forward and backward benches,
widths 256..262144 (mostly not powers of two, odd ones too), M from 1 up to ``2**27 / N``, bf16 with some
fp16 and fp32, every number drawn from the seeded generator. The forward benches' sweep times gpu and call
(one compile a shape: the inference graph); the backward benches' times gpu, call and step (one compile a
shape: the training graph).

Run time on an H200 (``--sweep``): torch.compile dominates, one compile a case: the tuned set's 31 inference
graphs, 31 training graphs and 10 quantizing graphs, then the sweep's 30 inference and 30 training graphs
(about 130 compiles of 1-4 s), besides our kernels' first compiles at each new width; about 8-9 minutes.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flydsl_common.bench import Bench, Case, CompiledPeer, Provider, Skip, main_for, results_dir

from . import reference as ref

__all__ = ["benches", "default_out_dir", "main", "sweep_shapes"]

_ELEMENTS = 1 << 27
_WIDTHS = (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
_SOFTMAX_WIDTHS = (*_WIDTHS, 1 << 20)
# The forward benches' tuned widths that also time the step. The _bwd bench of the same op times the same
# step at every width, on the compile its backward needs anyway; here each width would cost a second
# compile (the training graph beside the inference one) for a number the _bwd table already has.
_FWD_STEP_WIDTHS = frozenset((8192,))
# rmsnorm_quant_fp8's widths: the int8 bench has every width; fp8 differs only in its final cast (a compile
# of torch's peer a width, several seconds each, bounds the run).
_FP8_WIDTHS = (256, 4096, 32768)
_QUICK = ((4, 256), (2, 1000))  # tiny shapes: the CPU interpreter runs them in seconds
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The check against the fp64 reference: one rounding of the output dtype with room for the peers' own
# arithmetic in it (bf16 ~4e-3 a rounding, fp16 ~5e-4, fp32 ~6e-8).
_TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-3}
# The sweep's range: the widths of the models these ops serve (hidden sizes, vocabularies, sequence lengths)
# and up to the tuned set's elements.
SWEEP_WIDTHS = (256, 262144)
SWEEP_MAX_ELEMENTS = _ELEMENTS
# Shapes larger than this are skipped on the CPU: the interpreter would take minutes a call.
_CPU_MAX_ELEMENTS = 1 << 14
_HOST_SHAPE = (4, 4096)  # so small that the host's cost is most of a call


# ------------------------------------------------------------------ torch peers


def _torch_rms(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _torch_rms_residual(x, w, r):
    h = x + r
    return F.rms_norm(h, (x.shape[-1],), w, 1e-6), h


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


@dataclass(frozen=True)
class _Op:
    """A differentiable op: ours, the torch function it replaces, the fp64 reference, its per-column
    parameters (weight, bias) and per-row statistics saved for the backward (for the bytes model)."""

    name: str
    ours: Callable
    peer: Callable
    reference: Callable
    n_params: int
    stats_per_row: int


def _ops() -> dict[str, _Op]:
    from .layernorm import layer_norm
    from .rmsnorm import rms_norm
    from .softmax import softmax

    return {
        "rms_norm": _Op("rms_norm", lambda x, w: rms_norm(x, w, 1e-6), _torch_rms,
                        lambda x, w: ref.rms_norm_ref(x, w, 1e-6), 1, 1),
        "layer_norm": _Op("layer_norm", lambda x, w, b: layer_norm(x, w, b, 1e-5), _torch_ln,
                          lambda x, w, b: ref.layer_norm_ref(x, w, b, 1e-5), 2, 2),
        "softmax": _Op("softmax", lambda x: softmax(x, -1), _torch_softmax, lambda x: ref.softmax_ref(x, -1), 0, 0),
    }  # fmt: skip


# ------------------------------------------------------------------ cases and inputs


def _case(m: int, n: int, dtype: str = "bf16", step: bool = True) -> Case:
    name = f"{m}x{n}" + ("" if dtype == "bf16" else f" {dtype}")
    return Case(name, {"M": m, "N": n, "dtype": dtype, "step": step})


def _tuned(widths: Sequence[int], step_widths=None) -> list[Case]:
    return [_case(max(1, _ELEMENTS // n), n, step=step_widths is None or n in step_widths) for n in widths]


def _quick() -> list[Case]:
    return [_case(m, n) for m, n in _QUICK]


def _tolerance(case: Case) -> float:
    return _TOLERANCE[case.params.get("dtype", "bf16")]


def _esize(case: Case) -> int:
    return _DTYPES[case.params.get("dtype", "bf16")].itemsize


@dataclass(frozen=True)
class _Ctx:
    """The non-tensor part of a case's inputs (shared by the rotated copies): the compiled peers' case key,
    whether this case times the step, and why no provider runs it (empty: they all do)."""

    key: tuple
    step: bool
    skip: str = ""


def _setup(case: Case, device, n_params: int, with_dy: bool) -> tuple:
    """``(ctx, x, dy, *params)``: random x, upstream gradient and per-column parameters in the case's dtype."""
    m, n = case.params["M"], case.params["N"]
    dtype = _DTYPES[case.params.get("dtype", "bf16")]
    key = (m, n, str(dtype))
    step = bool(case.params.get("step", True))
    if torch.device(device).type != "cuda" and m * n > _CPU_MAX_ELEMENTS:
        why = f"the CPU interpreter runs shapes of at most {_CPU_MAX_ELEMENTS} elements here"
        return (_Ctx(key, step, why), None, None, *([None] * n_params))
    x = torch.randn(m, n, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype) if with_dy or step else None
    params = [torch.randn(n, device=device, dtype=dtype) for _ in range(n_params)]
    return (_Ctx(key, step), x, dy, *params)


def _unpack(inputs) -> tuple[_Ctx, torch.Tensor, torch.Tensor | None, list]:
    ctx, x, dy, *params = inputs
    if ctx.skip:
        raise Skip(ctx.skip)
    return ctx, x, dy, params


def _leaves(x: torch.Tensor, params) -> list[torch.Tensor]:
    return [x.detach().requires_grad_(), *(p.detach().requires_grad_() for p in params)]


def _zero_grads(leaves) -> None:
    for leaf in leaves:
        leaf.grad = None


# ------------------------------------------------------------------ providers


def _eager_step(fn: Callable) -> Callable:
    """``Provider.step`` of an eager function: forward on the leaves, backward of the upstream gradient."""

    def step(inputs):
        ctx, x, dy, params = _unpack(inputs)
        if not ctx.step:
            return None
        leaves = _leaves(x, params)

        def call():
            _zero_grads(leaves)
            fn(*leaves).backward(dy)

        call.leaves = leaves  # for tests: the gradients of the last step
        return call

    return step


def _compiled_step(peer: CompiledPeer) -> Callable:
    """``Provider.step`` of torch.compile: the compiled forward (its training graph: the leaves require
    grad) under autograd, so the backward is the one inductor compiled with it."""

    def step(inputs):
        ctx, x, dy, params = _unpack(inputs)
        if not ctx.step:
            return None
        leaves = _leaves(x, params)
        forward = peer.make(ctx.key, *leaves)  # compiles once a case, runs once

        def call():
            _zero_grads(leaves)
            forward().backward(dy)

        call.leaves = leaves
        return call

    return step


def _eager_backward(fn: Callable) -> Callable:
    """``Provider.make`` of a backward: the graph of ``fn`` built once, its backward timed."""

    def make(inputs):
        _, x, dy, params = _unpack(inputs)
        leaves = _leaves(x, params)
        y = fn(*leaves)
        return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)

    return make


def _compiled_backward(peer: CompiledPeer) -> Callable:
    def make(inputs):
        ctx, x, dy, params = _unpack(inputs)
        leaves = _leaves(x, params)
        # Inductor donates the saved activations to a backward it expects to run once; a backward timed
        # again and again over one graph (retain_graph) needs them kept: compiled (at the first call inside
        # make) with donation off, which changes the backward's memory, not its kernels.
        import torch._functorch.config as functorch_config

        with functorch_config.patch(donated_buffer=False):
            y = peer.make(ctx.key, *leaves)()
        return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)

    return make


def _forward(fn: Callable) -> Callable:
    def make(inputs):
        _, x, _, params = _unpack(inputs)
        return lambda: fn(x, *params)

    return make


def _compiled_forward(peer: CompiledPeer) -> Callable:
    def make(inputs):
        ctx, x, _, params = _unpack(inputs)
        return peer.make(ctx.key, x, *params)

    return make


# ------------------------------------------------------------------ the sweep


def sweep_shapes(
    rng: random.Random,
    count: int,
    *,
    widths: tuple[int, int] = SWEEP_WIDTHS,
    max_elements: int = SWEEP_MAX_ELEMENTS,
) -> list[tuple[int, int, str]]:
    """``count`` random ``(M, N, dtype)`` from the realistic range, every number drawn from ``rng``.

    N is log-uniform over ``widths``, then shaped: 35% a multiple of 64 that is not a power of two (model
    hidden sizes: 2880, 5120, 11008), 35% odd, 20% even but not a multiple of 64, 10% a power of two (with
    an M the tuned set does not have). M: 30% from 1 to 16 (decode, small batches), else log-uniform from 17
    up to ``max_elements // N``. dtype: 80% bf16, 10% fp16, 10% fp32.
    """
    lo, hi = widths
    if not 1 <= lo <= hi:
        raise ValueError(f"sweep_shapes: widths must be (lo, hi) with 1 <= lo <= hi, got {widths!r}")
    shapes = []
    for _ in range(count):
        u = rng.uniform(math.log2(lo), math.log2(hi))
        kind = rng.random()
        if kind < 0.35:
            n = 64 * max(1, round(2**u / 64))
            if n & (n - 1) == 0:
                n += 64
        elif kind < 0.70:
            n = round(2**u) | 1
        elif kind < 0.90:
            n = 2 * round(2**u / 2)
            if n % 64 == 0:
                n += 2 * rng.randint(1, 31)
        else:
            n = 1 << round(u)
        n = min(max(n, lo), hi)
        m_max = max(1, max_elements // n)
        if m_max <= 16 or rng.random() < 0.3:
            m = rng.randint(1, min(16, m_max))
        else:
            m = min(m_max, round(2 ** rng.uniform(math.log2(17), math.log2(m_max))))
        r = rng.random()
        dtype = "bf16" if r < 0.8 else "fp16" if r < 0.9 else "fp32"
        shapes.append((m, n, dtype))
    return shapes


def _sweep(step: bool) -> Callable[[random.Random, int], list[Case]]:
    return lambda rng, count: [_case(m, n, dtype, step) for m, n, dtype in sweep_shapes(rng, count)]


# ------------------------------------------------------------------ forward and backward benches


def _fwd_bench(op: _Op, widths: Sequence[int]) -> Bench:
    """The forward (inference) of ``op`` against torch eager and compiled; the step at ``_FWD_STEP_WIDTHS``."""
    name = f"{op.name.replace('_', '')}_fwd"
    compiled = CompiledPeer(op.peer)  # one for the forward and the step: one dynamo reset a case

    def nbytes(case):
        m, n = case.params["M"], case.params["N"]
        return _esize(case) * (2 * m * n + op.n_params * n)

    return Bench(
        name=name,
        cases=_tuned(widths, _FWD_STEP_WIDTHS),
        quick_cases=_quick(),
        setup=lambda case, device: _setup(case, device, op.n_params, with_dy=False),
        providers=[
            Provider("flydsl", _forward(op.ours), is_ours=True, step=_eager_step(op.ours)),
            Provider("torch", _forward(op.peer), step=_eager_step(op.peer)),
            Provider("torch.compile", _compiled_forward(compiled), step=_compiled_step(compiled)),
        ],
        bytes=nbytes,
        reference=lambda t: op.reference(t[1], *t[3:]),  # (ctx, x, dy, *params)
        tolerance=_tolerance,
        x_param="N",
        sweep=_sweep(step=False),
        description=(
            f"{op.name} forward, inference (nothing requires grad) for gpu and call; step: forward + backward "
            f"(at {', '.join(str(w) for w in sorted(_FWD_STEP_WIDTHS))} columns in the tuned set; every width "
            f"in {name.replace('_fwd', '_bwd')})."
        ),
    )


def _bwd_bench(op: _Op, widths: Sequence[int]) -> Bench:
    """The backward of ``op``: the graph built once, its backward timed (gpu, call); the step too."""
    name = f"{op.name.replace('_', '')}_bwd"
    compiled = CompiledPeer(op.peer)  # the training graph: its backward and the step share one compile

    def reference(inputs):
        _, x, dy, params = _unpack(inputs)
        x64 = x.detach().double().requires_grad_()
        y = op.peer(x64, *(p.double() for p in params))
        return torch.autograd.grad(y, x64, dy.double())[0]

    def nbytes(case):
        m, n = case.params["M"], case.params["N"]
        return _esize(case) * (3 * m * n + 2 * op.n_params * n) + 4 * op.stats_per_row * m

    return Bench(
        name=name,
        cases=_tuned(widths),
        quick_cases=_quick(),
        setup=lambda case, device: _setup(case, device, op.n_params, with_dy=True),
        providers=[
            Provider("flydsl", _eager_backward(op.ours), is_ours=True, step=_eager_step(op.ours)),
            Provider("torch", _eager_backward(op.peer), step=_eager_step(op.peer)),
            Provider("torch.compile", _compiled_backward(compiled), step=_compiled_step(compiled)),
        ],
        bytes=nbytes,
        reference=reference,
        output=lambda grads: grads[0],
        tolerance=_tolerance,
        x_param="N",
        sweep=_sweep(step=True),
        description=(
            f"{op.name} backward: gpu and call time the backward alone (dx and the weight gradients, the graph "
            "built once); step: forward + backward on a fresh graph."
        ),
    )


# ----------------------------------------------------------------------- quant


def _quant_bench(dtype: torch.dtype = torch.int8) -> Bench:
    """rms_norm_quant to int8 (``rmsnorm_quant``) or fp8 e4m3 (``rmsnorm_quant_fp8``) against torch's rms_norm
    and per-row quantization (eager and compiled)."""
    from .rmsnorm import rms_norm_quant

    name = "rmsnorm_quant" if dtype == torch.int8 else "rmsnorm_quant_fp8"
    peer = functools.partial(_torch_rms_quant, dtype=dtype)
    compiled = CompiledPeer(peer)

    def setup(case, device):
        m, n = case.params["M"], case.params["N"]
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        return (x, torch.randn(n, device=device, dtype=torch.bfloat16))

    def deq(ret):
        q, s = ret[0], ret[1]
        return q.double() * s.double().reshape(-1, 1)

    return Bench(
        name=name,
        cases=_tuned(_WIDTHS[:7] if dtype == torch.int8 else _FP8_WIDTHS),
        quick_cases=_quick()[:1],
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: rms_norm_quant(t[0], t[1], 1e-6, dtype=dtype), is_ours=True),
            Provider("torch", lambda t: lambda: peer(*t)),
            Provider("torch.compile", lambda t: compiled.make((tuple(t[0].shape),), *t)),
        ],
        bytes=lambda c: 3 * c.params["M"] * c.params["N"] + 2 * c.params["N"] + 4 * c.params["M"],
        # Judged against the reference's own quantization (fp64 norm, same rounding rule): the int8
        # grid's error (half a step of amax/127, ~2e-2 of the rms at 16K+ columns) is then common
        # to both, and only rounding flips of one step remain.
        reference=lambda t: deq(ref.rms_norm_quant_ref(t[0], t[1], 1e-6, dtype=dtype)),
        output=deq,
        tolerance=2e-2,
        x_param="N",
        timings=("gpu", "call"),
        description="inference only (integer outputs): gpu and call.",
    )


# ------------------------------------------------------------------ host cost


def _host_bench() -> Bench:
    """The per-call host cost of each public op against the torch op it replaces, in three modes."""
    from .rmsnorm import rms_norm

    base = _ops()
    # op -> (ours, torch's, fp64 reference, per-column parameters, takes a residual)
    ops = {name: (o.ours, o.peer, o.reference, o.n_params, False) for name, o in base.items()}
    ops["rms_norm+residual"] = (
        lambda x, w, r: rms_norm(x, w, 1e-6, residual=r),
        _torch_rms_residual,
        lambda x, w, r: ref.rms_norm_ref(x, w, 1e-6, r),
        1,
        True,
    )
    order = ("rms_norm", "rms_norm+residual", "layer_norm", "softmax")
    modes = ("no_grad", "fwd_grad", "backward")

    def setup(case, device):
        m, n = case.params["M"], case.params["N"]
        _, _, _, n_params, residual = ops[case.params["op"]]
        args = [torch.randn(m, n, device=device, dtype=torch.bfloat16)]
        args += [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(n_params)]
        if residual:
            args.append(torch.randn(m, n, device=device, dtype=torch.bfloat16))
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        return (case.params["op"], case.params["mode"], dy, *args)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def provider(which: int) -> Callable:
        def make(inputs):
            op, mode, dy, *args = inputs
            fn = ops[op][which]
            if mode == "no_grad":
                return lambda: fn(*args)
            leaves = [a.detach().requires_grad_() for a in args]
            if mode == "fwd_grad":
                return lambda: fn(*leaves)
            y = first(fn(*leaves))
            return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)

        return make

    def reference(inputs):
        op, mode, dy, *args = inputs
        if mode != "backward":
            return first(ops[op][2](*args))
        leaves = [a.detach().double().requires_grad_() for a in args]
        return torch.autograd.grad(first(ops[op][1](*leaves)), leaves[0], dy.double())[0]

    cases = [Case(f"{op} {mode}", {"op": op, "mode": mode, "M": _HOST_SHAPE[0], "N": _HOST_SHAPE[1]})
             for op in order for mode in modes]  # fmt: skip
    return Bench(
        name="host",
        cases=cases,
        quick_cases=cases[:3],
        setup=setup,
        providers=[Provider("flydsl", provider(0), is_ours=True), Provider("torch", provider(1))],
        reference=reference,
        output=first,  # y (of (y, residual_out)), or dx of the gradients
        tolerance=2e-2,
        group_by=("mode",),
        rotate=False,
        timings=("host",),
        interleave=10,  # host-bound: ours and torch's alternate window by window, so host drift hits both
        description=(
            f"per-call host cost at {_HOST_SHAPE[0]} x {_HOST_SHAPE[1]} bf16 (calls back to back, one "
            "synchronization a window): no_grad = nothing requires grad; fwd_grad = the forward recording a "
            "graph; backward = torch.autograd.grad of a graph built once (retain_graph). Providers alternate "
            "in 10 rounds of one window, medians."
        ),
    )


# ----------------------------------------------------------------------- all


def benches() -> list[Bench]:
    ops = _ops()
    rms, ln, sm = ops["rms_norm"], ops["layer_norm"], ops["softmax"]
    return [
        _fwd_bench(rms, _WIDTHS),
        _fwd_bench(ln, _WIDTHS),
        _fwd_bench(sm, _SOFTMAX_WIDTHS),
        _bwd_bench(rms, _WIDTHS),
        _bwd_bench(ln, _WIDTHS),
        _bwd_bench(sm, _SOFTMAX_WIDTHS),
        _quant_bench(),
        _quant_bench(torch.float8_e4m3fn),
        _host_bench(),
    ]


def default_out_dir() -> Path:
    return results_dir("fly-norm", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    return main_for(benches(), list(argv or []), default_out_dir())
