"""Benchmarks of fly-gemm against the peers a user would pick, on the shared harness.

Run ``python packages/fly-gemm/benchmarks/run.py [--quick] [--only NAME] [--sweep] [--seed N]`` or
``flydsl bench gemm ...``. Every case is checked against the fp64 reference before it is timed; the
ceilings (device copy bandwidth, cuBLAS bf16 peak) are measured in the same run. Each (case, provider)
gets ``gpu_us`` (the GPU time, host hidden) and ``call_us`` (one public call at a time, host
included); ``linear`` adds ``step_us`` (forward + backward on a fresh graph).

Tuned set (the LLM projections the shipped artifact was searched on, ``autotune.TUNE_NK``):

- ``gemm_bf16``: C = A @ B^T in bf16 at M = 256, 1024, 8192, against ``torch.matmul`` (cuBLAS);
  TFLOP/s (2 M N K flops);
- ``gemm_bf16_decode``: M = 1 and 16 on the same weights: the read of the weights dominates, so the
  model is bytes (weights, activations, output) and the ceiling the copy bandwidth;
- ``gemm_fp8``: fp8 e4m3 with per-row x per-column fp32 scales, bf16 output, against
  ``torch._scaled_mm`` (row-wise scales);
- ``gemm_int8``: int8 to the raw int32 product, against ``torch._int_mm``;
- ``linear``: ``fly_gemm.linear`` with bias and exact GELU fused at M = 4096, against
  ``F.gelu(F.linear(x, w, b))`` eager and under ``torch.compile``; ``step_us`` is one training step
  (forward, then backward with a fixed upstream gradient into x, weight and bias);
- ``host``: the per-call host cost (``host_us``) of ``gemm``, ``linear`` and ``FlyLinear`` against
  ``torch.matmul``, ``F.linear`` and ``nn.Linear`` at 16 x 256 x 256, where the host dominates, in three
  modes: ``no_grad`` (inference), ``fwd_grad`` (a forward that records the graph) and ``backward``
  (``torch.autograd.grad`` over a graph built once, ``retain_graph=True``).

Sweep (``--sweep``, ``--seed N``): shapes nobody tuned for, drawn from the seeded ``random.Random``
only and never used for tuning; 12 a bench over the five benches above ``host``. M: 1-16 for
``gemm_bf16_decode``, 17-8192 (odd half the time) for ``gemm_bf16``, either (a third at 1-16) for
fp8, int8 and ``linear``; N and K log-uniform in 1024-32768 in four alignment classes (multiples of
128, of 16, of 8 but not 16, and odd), so K not a multiple of 16 is always among them; ``linear`` also
draws bias or not and its activation. ``gemm`` serves every such shape; a peer that refuses one
(``torch._int_mm``: M > 16, K and N multiples of 8; ``torch._scaled_mm``: K and N multiples of 16)
is skipped with its rule as the reason.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from flydsl.testing import default_device
from flydsl_common.bench import Bench, Case, CompiledPeer, Provider, Skip, log_uniform, main_for, results_dir

from . import moe_bench
from .autotune import TUNE_NK
from .gemm import gemm
from .linear import linear
from .modules import FlyLinear
from .reference import gemm_ref

__all__ = ["benches", "main", "default_out_dir", "SweepRange", "GPU_SWEEP", "CPU_SWEEP", "sweep_shapes"]

# (N, K) of LLM projections (Llama-3 8B and 70B: hidden 4096 / 8192, MLP 14336 / 28672): the shipped
# artifact's tuning shapes, so every tuned case is a searched one.
_NK = TUNE_NK
# M of the tuned set, cut to what bounds the full run (tuned set and sweep) to about 7 minutes on an
# H200: one size under the ridge (256), one a wave or two (1024), one long (8192).
_M_LARGE = (256, 1024, 8192)
_M_DECODE = (1, 16)
_M_FP8 = (16, 256, 8192)
_M_INT8 = (32, 256, 8192)  # torch._int_mm needs M > 16
# 4096 tokens, a training micro-batch: every case compiles two torch.compile graphs (inference and the
# training step's), a few seconds each, so linear keeps one M on the six projections.
_M_LINEAR = (4096,)
_HOST_SHAPE = (16, 256, 256)  # tiny: the GPU work is a few us, the host's share of a call dominates
_BF16 = torch.bfloat16  # the interpreter's dot is exact for bf16 too, so CPU smoke runs use it as well


# ------------------------------------------------------------------------------ cases


def _case(m: int, n: int, k: int, **extra) -> Case:
    name = f"{m}x{n}x{k}"
    if extra.get("bias"):
        name += "+bias"
    if extra.get("activation"):
        name += f"+{extra['activation']}"
    return Case(name, {"M": m, "N": n, "K": k, **extra})


def _cases(ms: Sequence[int], nks=_NK, **extra) -> list[Case]:
    return [_case(m, n, k, **extra) for m in ms for n, k in nks]


# The interpreter's smoke case (N and K multiples of 16 so every peer could serve it on a GPU)
_QUICK = [_case(48, 48, 32)]


def _mnk(case: Case) -> tuple[int, int, int]:
    return case.params["M"], case.params["N"], case.params["K"]


def _flops(case: Case) -> int:
    m, n, k = _mnk(case)
    return 2 * m * n * k


# ------------------------------------------------------------------------------ sweep


@dataclass(frozen=True)
class SweepRange:
    """The range unseen shapes are drawn from.

    ``m_max``: the largest M; ``nk_min`` / ``nk_max``: N and K, log-uniform; ``max_flops``: a shape past it
    gets a smaller M (bounds one case's time: 4e12 flops is about 6 ms a bf16 call at cuBLAS's rate and
    under 0.1 s for the fp64 reference on an H200).
    """

    m_max: int = 8192
    nk_min: int = 1024
    nk_max: int = 32768
    max_flops: float = 4e12


GPU_SWEEP = SweepRange()
# The interpreter's range (CPU smoke runs and tests): the same M, N and K classes at sizes it runs in seconds.
CPU_SWEEP = SweepRange(m_max=64, nk_min=16, nk_max=96, max_flops=float("inf"))
_DECODE_M = 16  # M = 1..16: the decode sizes (every shape of a "decode" sweep, every third of a "mixed" one)
# Alignment classes of N and K: multiples of 128 (what tuned models use), of 16 (TMA-addressable bf16
# and fp8 rows), of 8 but not 16 (bf16 TMA rows, not fp8 / _scaled_mm) and odd (the pointer kernel only).
_ALIGNS = (128, 16, 8, 1)
_ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu", "relu")



def _in_class(v: int, align: int) -> bool:
    if align == 1:
        return v % 2 == 1
    if align == 8:
        return v % 16 == 8
    return v % align == 0


def _aligned(x: int, align: int, lo: int, hi: int) -> int:
    """The value of ``align``'s class (a multiple of it; for 8 not of 16; for 1 odd) in [lo, hi] nearest ``x``
    (a smaller class where the range holds none of this one)."""
    for a in _ALIGNS[_ALIGNS.index(align) :]:
        base = x // a * a
        near = [v for v in (base + j * a for j in range(-2, 4)) if lo <= v <= hi and _in_class(v, a)]
        if not near:
            near = [v for v in range(lo, hi + 1) if _in_class(v, a)]
        if near:
            return min(near, key=lambda v: (abs(v - x), v))
    raise ValueError(f"_aligned: no integer in [{lo}, {hi}]")


_M_KINDS = ("mixed", "decode", "large")


def sweep_shapes(
    rng: random.Random, count: int, rng_range: SweepRange = GPU_SWEEP, m_kind: str = "mixed"
) -> list[tuple[int, int, int]]:
    """``count`` distinct (M, N, K) drawn from ``rng`` alone.

    ``m_kind``: "decode" (M in 1-16), "large" (M from 17 to ``m_max``, odd half the time) or "mixed" (every
    third shape a decode one). The classes are stratified by the shape's index, so every sweep of four or
    more shapes holds each K alignment class (K not a multiple of 16 among them); the values inside a
    class are the rng's.
    """
    if m_kind not in _M_KINDS:
        raise ValueError(f"sweep_shapes: m_kind must be one of {_M_KINDS}, got {m_kind!r}")
    r = rng_range
    shapes: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int, int]] = set()
    i = 0
    while len(shapes) < count:
        if i > 100 * count + 100:
            raise ValueError(f"sweep_shapes: cannot draw {count} distinct shapes from {r}")
        k_align = _ALIGNS[i % len(_ALIGNS)]
        decode = m_kind == "decode" or (m_kind == "mixed" and i % 3 == 0)
        i += 1
        n = _aligned(log_uniform(rng, r.nk_min, r.nk_max), rng.choice(_ALIGNS), r.nk_min, r.nk_max)
        k = _aligned(log_uniform(rng, r.nk_min, r.nk_max), k_align, r.nk_min, r.nk_max)
        if decode:
            m = rng.randint(1, min(_DECODE_M, r.m_max))
        else:
            lo = min(_DECODE_M + 1, r.m_max)
            m = log_uniform(rng, lo, r.m_max)
            if rng.random() < 0.5:
                m |= 1
            if 2 * m * n * k > r.max_flops:  # the largest odd M under the cap
                cap = int(r.max_flops // (2 * n * k))
                m = max(lo, cap - 1 + cap % 2)
            m = min(m, r.m_max)
        if (m, n, k) in seen:
            continue
        seen.add((m, n, k))
        shapes.append((m, n, k))
    return shapes


def _gemm_sweep(rng_range: SweepRange, m_kind: str) -> Callable[[random.Random, int], list[Case]]:
    def sweep(rng: random.Random, count: int) -> list[Case]:
        return [_case(m, n, k) for m, n, k in sweep_shapes(rng, count, rng_range, m_kind)]

    return sweep


def _linear_sweep(rng_range: SweepRange) -> Callable[[random.Random, int], list[Case]]:
    def sweep(rng: random.Random, count: int) -> list[Case]:
        shapes = sweep_shapes(rng, count, rng_range, "mixed")
        return [_case(m, n, k, bias=rng.random() < 0.7, activation=rng.choice(_ACTIVATIONS)) for m, n, k in shapes]

    return sweep


# ------------------------------------------------------------------------------ peers


def _cuda_only(name: str, t) -> None:
    if t[0].device.type != "cuda":
        raise Skip(f"{name} runs on CUDA only")


def _refused_by_torch(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` after one trial call: a shape rule of torch's that the checks above do not know shows as a
    skip with torch's own words, not as an error of the run."""
    try:
        fn()
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise Skip(f"{name} refuses this shape: {first}") from e
    return fn


def _scaled_mm(t, fast_accum: bool = False):
    a, b, sa, sb = t
    k, n = a.shape[1], b.shape[0]
    if k % 16 or n % 16:
        raise Skip(f"torch._scaled_mm needs K and N multiples of 16 (K = {k}, N = {n})")
    _cuda_only("torch._scaled_mm", t)
    sa2, sb2, bt = sa[:, None], sb[None, :], b.t()  # outside the timed call: views cost host time
    return _refused_by_torch(
        "torch._scaled_mm",
        lambda: torch._scaled_mm(a, bt, scale_a=sa2, scale_b=sb2, out_dtype=torch.bfloat16, use_fast_accum=fast_accum),
    )


def _scaled_mm_fast(t):
    """Both accumulations: ours adds into Hopper's fp8 MMA accumulator for the whole K (Triton's sm_90
    default, narrower than fp32), which ``use_fast_accum=True`` is; torch's default promotes to fp32."""
    return _scaled_mm(t, fast_accum=True)


def _int_mm(t):
    a, b = t
    (m, k), n = a.shape, b.shape[0]
    if m <= 16:
        raise Skip(f"torch._int_mm needs M > 16 (M = {m})")
    if k % 8 or n % 8:
        raise Skip(f"torch._int_mm needs K and N multiples of 8 (K = {k}, N = {n})")
    _cuda_only("torch._int_mm", t)
    bt = b.t()
    return _refused_by_torch("torch._int_mm", lambda: torch._int_mm(a, bt))


# ------------------------------------------------------------------------------ gemm benches


def _setup_16bit(case, device):
    m, n, k = _mnk(case)
    dt = _BF16
    return torch.randn(m, k, device=device, dtype=dt), torch.randn(n, k, device=device, dtype=dt)


def _bf16_bench(name: str, ms, decode: bool, sweep) -> Bench:
    def nbytes(case):
        m, n, k = _mnk(case)
        return 2 * (n * k + m * k + m * n)

    def matmul(t):
        a, bt = t[0], t[1].t()
        return lambda: torch.matmul(a, bt)

    return Bench(
        name=name,
        cases=_cases(ms),
        quick_cases=_QUICK,
        setup=_setup_16bit,
        providers=[
            Provider("flydsl", lambda t: lambda: gemm(*t), is_ours=True),
            Provider("torch.matmul", matmul),
        ],
        bytes=nbytes if decode else None,
        flops=_flops,
        reference=lambda t: gemm_ref(*t),
        tolerance=1e-2,
        x_param="M",
        group_by=("N", "K"),
        description="C = A @ B^T, B [N, K]; " + ("bytes: weights + activations + output" if decode else "2MNK flops"),
        sweep=sweep,
        timings=("gpu", "call"),
    )


def _fp8_bench(sweep) -> Bench:
    def setup(case, device):
        m, n, k = _mnk(case)
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        return a, b, torch.rand(m, device=device) + 0.5, torch.rand(n, device=device) + 0.5

    return Bench(
        name="gemm_fp8",
        cases=_cases(_M_FP8),
        quick_cases=_QUICK,
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: gemm(t[0], t[1], scale_a=t[2], scale_b=t[3]), is_ours=True),
            Provider("torch._scaled_mm", _scaled_mm),
            Provider("torch._scaled_mm.fast_accum", _scaled_mm_fast),
        ],
        flops=_flops,
        reference=lambda t: gemm_ref(t[0], t[1], scale_a=t[2], scale_b=t[3]),
        tolerance=1e-2,
        x_param="M",
        group_by=("N", "K"),
        description="fp8 e4m3, per-row x per-column fp32 scales, bf16 output",
        sweep=sweep,
        timings=("gpu", "call"),
    )


def _int8_bench(sweep) -> Bench:
    def setup(case, device):
        m, n, k = _mnk(case)
        a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        return a, torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)

    return Bench(
        name="gemm_int8",
        cases=_cases(_M_INT8),
        quick_cases=_QUICK,
        setup=setup,
        providers=[
            Provider("flydsl", lambda t: lambda: gemm(t[0], t[1], out_dtype=torch.int32), is_ours=True),
            Provider("torch._int_mm", _int_mm),
        ],
        flops=_flops,
        reference=lambda t: gemm_ref(*t),
        tolerance=1e-9,  # the int32 product is exact
        x_param="M",
        group_by=("N", "K"),
        description="int8 x int8 -> int32 (raw product)",
        sweep=sweep,
        timings=("gpu", "call"),
    )


# ------------------------------------------------------------------------------ linear (differentiable)


_TORCH_ACTS = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu}


def _torch_linear(x, w, b, act: str | None):
    """What a user writes: ``F.linear``, then the activation (plain branches on a constant, so torch.compile
    traces it into one graph)."""
    y = F.linear(x, w, b)
    if act is None:
        return y
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return _TORCH_ACTS[act](y)


def _eager_linear(act: str | None) -> Callable[..., torch.Tensor]:
    """:func:`_torch_linear` with the activation resolved once, outside the timed call."""
    if act is None:
        return F.linear
    if act == "gelu_tanh":
        return lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")
    fn = _TORCH_ACTS[act]
    return lambda x, w, b: fn(F.linear(x, w, b))


def _leaves(t) -> list[torch.Tensor]:
    """x, weight (and bias) as leaves that need a gradient, sharing the inputs' storage."""
    x, w, b = t[0], t[1], t[2]
    return [v.detach().requires_grad_(True) for v in (x, w, b) if v is not None]


def _train_step(forward: Callable[..., torch.Tensor], t) -> Callable[[], None]:
    """One training step of ``forward(x, w, b)``: the leaves' gradients cleared (as
    ``zero_grad(set_to_none=True)`` does), a fresh graph, backward with the case's fixed upstream gradient
    (x, weight and bias gradients filled). Run once here, so a lazy compile stays out of the timing."""
    leaves = _leaves(t)
    g = t[3]
    args = leaves if len(leaves) == 3 else [*leaves, None]

    def step() -> None:
        for p in leaves:
            p.grad = None
        forward(*args).backward(g)

    step()
    step.leaves = leaves  # x, weight (bias): their .grad holds the last step's gradients (tests read them)
    return step


_COMPILED_LINEAR = CompiledPeer(_torch_linear)


def _compiled_key(t) -> tuple:
    x, w, b, _, act = t
    return (tuple(x.shape), tuple(w.shape), b is not None, act, x.dtype)


def _compiled_fwd(t):
    x, w, b, _, act = t
    return _COMPILED_LINEAR.make(_compiled_key(t), x, w, b, act)


def _compiled_step(t):
    # the same compiled function as the forward's (one dynamo cache a case): leaves that need a gradient
    # add the joint graph beside the inference one, and the first backward compiles the backward graph
    leaves = _leaves(t)
    args = leaves if len(leaves) == 3 else [*leaves, None]
    call = _COMPILED_LINEAR.make(_compiled_key(t), *args, t[4])
    g = t[3]

    def step() -> None:
        for p in leaves:
            p.grad = None
        call().backward(g)

    step()
    step.leaves = leaves
    return step


def _linear_bench(sweep) -> Bench:
    def setup(case, device):
        m, n, k = _mnk(case)
        dt = _BF16
        x = torch.randn(m, k, device=device, dtype=dt)
        w = torch.randn(n, k, device=device, dtype=dt) / math.sqrt(k)  # unit-scale outputs, as a trained layer
        b = torch.randn(n, device=device, dtype=dt) if case.params.get("bias") else None
        g = torch.randn(m, n, device=device, dtype=dt)  # the fixed upstream gradient of the step
        return x, w, b, g, case.params.get("activation")

    def ours(t):
        x, w, b, _, act = t
        return lambda: linear(x, w, b, act)

    def eager(t):
        x, w, b, _, act = t
        fn = _eager_linear(act)
        return lambda: fn(x, w, b)

    def ref(t):
        x, w, b, _, act = t
        return gemm_ref(x, w, bias=b, activation=act)

    return Bench(
        name="linear",
        cases=_cases(_M_LINEAR, bias=True, activation="gelu"),
        quick_cases=[_case(48, 48, 32, bias=True, activation="gelu")],
        setup=setup,
        providers=[
            Provider(
                "flydsl", ours, is_ours=True, step=lambda t: _train_step(lambda x, w, b: linear(x, w, b, t[4]), t)
            ),
            Provider("torch", eager, step=lambda t: _train_step(_eager_linear(t[4]), t)),
            Provider("torch.compile", _compiled_fwd, step=_compiled_step),
        ],
        flops=_flops,
        reference=ref,
        tolerance=1e-2,
        x_param="M",
        group_by=("N", "K"),
        description="act(x @ W^T + b), bf16; step: forward + backward (x, weight, bias gradients), 3x the flops",
        sweep=sweep,
        timings=("gpu", "call", "step"),
    )


# ------------------------------------------------------------------------------ host cost

_HOST_OPS = ("gemm", "linear", "FlyLinear")
_HOST_MODES = ("no_grad", "fwd_grad", "backward")


def _host_setup(case, device):
    m, n, k = _mnk(case)
    dt = _BF16
    return SimpleNamespace(
        op=case.params["op"],
        mode=case.params["mode"],
        x=torch.randn(m, k, device=device, dtype=dt),
        w=torch.randn(n, k, device=device, dtype=dt) / math.sqrt(k),
        b=torch.randn(n, device=device, dtype=dt),
        g=torch.randn(m, n, device=device, dtype=dt),
    )


def _host_fn(inp, ours: bool) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """The op of ``inp`` (ours or the torch one it replaces) and the leaves it differentiates, fresh for this
    provider (its own graph). The weights need a gradient in every mode, as a model's parameters do; x
    (an activation) only where a graph is recorded."""
    x = inp.x.detach().requires_grad_(inp.mode != "no_grad")
    if inp.op == "FlyLinear":
        n, k = inp.w.shape
        module = (FlyLinear if ours else nn.Linear)(k, n, device=inp.x.device, dtype=inp.x.dtype)
        with torch.no_grad():
            module.weight.copy_(inp.w)
            module.bias.copy_(inp.b)
        return (lambda: module(x)), [x, module.weight, module.bias]
    w = inp.w.detach().requires_grad_(True)
    if inp.op == "gemm":
        if ours:
            return (lambda: gemm(x, w)), [x, w]
        wt = w.t()
        return (lambda: torch.matmul(x, wt)), [x, w]
    b = inp.b.detach().requires_grad_(True)
    fn = linear if ours else F.linear
    return (lambda: fn(x, w, b)), [x, w, b]


def _host_make(ours: bool):
    def make(inp):
        fn, leaves = _host_fn(inp, ours)
        if inp.mode == "no_grad":

            def no_grad():
                with torch.no_grad():
                    return fn()

            return no_grad
        if inp.mode == "fwd_grad":
            return fn
        y, g = fn(), inp.g  # backward: one graph, kept (retain_graph) and differentiated again each call
        return lambda: torch.autograd.grad(y, leaves, g, retain_graph=True)

    return make


def _host_ref(inp) -> torch.Tensor:
    bias = None if inp.op == "gemm" else inp.b
    if inp.mode != "backward":
        return gemm_ref(inp.x, inp.w, bias=bias)
    g, x, w = inp.g.double(), inp.x.double(), inp.w.double()
    grads = [g @ w, g.t() @ x] + ([g.sum(0)] if bias is not None else [])
    return torch.cat([v.reshape(-1) for v in grads])


def _host_output(ret) -> torch.Tensor:
    if isinstance(ret, torch.Tensor):
        return ret
    return torch.cat([v.reshape(-1) for v in ret])  # the gradients, in the reference's order


def _host_bench() -> Bench:
    def cases(shape) -> list[Case]:
        m, n, k = shape
        return [
            Case(f"{op}/{mode}", {"M": m, "N": n, "K": k, "op": op, "mode": mode})
            for op in _HOST_OPS
            for mode in _HOST_MODES
        ]

    return Bench(
        name="host",
        cases=cases(_HOST_SHAPE),
        quick_cases=cases((8, 32, 32)),
        setup=_host_setup,
        providers=[
            Provider("flydsl", _host_make(True), is_ours=True),
            Provider("torch", _host_make(False)),
        ],
        reference=_host_ref,
        output=_host_output,
        tolerance=1e-2,
        x_param="mode",
        group_by=("op",),
        description=(
            "per-call host cost at {}x{}x{} (no synchronization, no GPU backlog): gemm vs torch.matmul, "
            "linear vs F.linear, FlyLinear vs nn.Linear; no_grad, fwd_grad (graph recorded), backward "
            "(autograd.grad over one retained graph)".format(*_HOST_SHAPE)
        ),
        timings=("host",),
    )


# ------------------------------------------------------------------------------ entry points


def benches(sweep_range: SweepRange = GPU_SWEEP) -> list[Bench]:
    """Every bench of the family; ``sweep_range``: where the unseen shapes come from (tests shrink it).

    Five benches have a sweep, so the family's 60 shapes split 12 a bench: bf16 at M > 16, bf16 decode
    (M = 1-16), fp8 and int8 (a third of each at M = 1-16) and ``linear`` (bias and activation drawn too).
    The MoE benches (:mod:`.moe_bench`) time fixed model shapes only.
    """
    return [
        _bf16_bench("gemm_bf16", _M_LARGE, decode=False, sweep=_gemm_sweep(sweep_range, "large")),
        _bf16_bench("gemm_bf16_decode", _M_DECODE, decode=True, sweep=_gemm_sweep(sweep_range, "decode")),
        _fp8_bench(_gemm_sweep(sweep_range, "mixed")),
        _int8_bench(_gemm_sweep(sweep_range, "mixed")),
        _linear_bench(_linear_sweep(sweep_range)),
        *moe_bench.benches(interpreter=sweep_range == CPU_SWEEP),
        _host_bench(),
    ]


def default_out_dir() -> Path:
    return results_dir("fly-gemm", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    # Without a GPU the kernels run in the interpreter, where a sweep shape of the GPU's range (N, K >= 1024)
    # takes minutes: there the sweep draws from CPU_SWEEP, the same classes at interpreter sizes.
    on_gpu = default_device().type == "cuda"
    return main_for(benches(GPU_SWEEP if on_gpu else CPU_SWEEP), list(argv or []), default_out_dir())
