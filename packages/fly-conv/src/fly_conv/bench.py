"""Benchmarks of fly-conv against the peers a user would pick, on the shared harness.

Run ``python packages/fly-conv/benchmarks/run.py [--quick] [--only NAME] [--sweep] [--seed N]`` or
``flydsl bench conv ...``. Every case is checked against the fp64 reference (torch's convolution in float64)
before it is timed; the ceilings (device copy bandwidth, cuBLAS bf16 peak) are measured in the same run.

Flops model: ``2 * N * OD * OH * OW * K_out * K_gemm`` with ``K_gemm = KD * KH * KW * C_in / groups``.
Peers: cuDNN through ``torch.nn.functional.conv{1,2,3}d`` on the same tensors (channels-last unless the case
says NC*) and its ``torch.compile``.

Tuned set (issue 36's speed list), bf16, batch 8-64:

- ``conv_bf16``: ResNet-50 and UNet 3x3 layers, 3D video 3x3x3 and 1D audio k = 7 layers, channels-last;
- ``conv_nchw``: some of those layers on NC* tensors, end to end (our channels-last copy included), against
  cuDNN on the same NC* tensor;
- ``conv_1x1``: ResNet-50's pointwise layers, against cuDNN and against cuBLAS on the equivalent GEMM
  (``[N*H*W, C_in] @ [C_in, K_out]`` on the channels-last input);
- ``conv_depthwise``: 3x3 and 7x7 depthwise layers (MobileNet / ConvNeXt), a bytes model (input, weight and
  output once) against the device copy bandwidth;
- ``conv_grouped``: ResNeXt-style grouped 3x3 layers (4-64 channels a group);
- ``conv_train``: the backward of 3x3, 1x1 and depthwise layers against torch's (cuDNN's dgrad and wgrad):
  ``gpu_us`` and ``call_us`` the backward alone (the forward's graph built once, ``torch.autograd.grad`` of a
  fixed output gradient into x, the weight and the bias, flops 2x the forward's), ``step_us`` a training step
  (new leaves, forward, ``backward``) as timed; each gradient checked against fp64 autograd;
- ``conv_fp8``: the fp8 e4m3 forward (x per-tensor, weight per-output-channel scales, bf16 out) of 3x3 and
  1x1 layers, against our bf16 forward (``flydsl.bf16``) and cuDNN bf16 on the dequantized inputs.

Sweep (``--sweep``, ``--seed N``): layers drawn from the seeded ``random.Random`` only, never tuned on: rank
(1D / 2D / 3D), batch, channels (odd counts included), spatial sizes (odd included), kernel 1-7, stride 1-2,
and for the grouped and depthwise benches the group width.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from flydsl.testing import default_device
from flydsl_common.bench import (
    Bench,
    Case,
    CompiledPeer,
    GradCheck,
    Provider,
    Skip,
    log_uniform,
    main_for,
    results_dir,
)

from .conv import conv
from .reference import conv_ref

__all__ = ["benches", "main", "default_out_dir", "flops", "nbytes", "SweepRange", "GPU_SWEEP", "CPU_SWEEP"]

_BF16 = torch.bfloat16
_TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _case(n: int, c: int, k: int, spatial: tuple, ks: int, stride: int = 1, groups: int = 1, **extra) -> Case:
    """A layer: batch ``n``, ``c`` -> ``k`` channels over ``spatial``, a ``ks``-wide kernel in every dim with
    'same'-style padding ``ks // 2``."""
    rank = len(spatial)
    name = f"{rank}d-n{n}-c{c}-k{k}-{'x'.join(map(str, spatial))}-ks{ks}" + (f"-s{stride}" if stride > 1 else "")
    if groups > 1:
        name += f"-g{groups}"
    params = {"N": n, "C": c, "K": k, "spatial": tuple(spatial), "ks": ks, "stride": stride, "groups": groups,
              "layout": "cl", **extra}  # fmt: skip
    return Case(name, params)


def _geometry(case: Case):
    p = case.params
    rank = len(p["spatial"])
    pad = p["ks"] // 2
    out = tuple((s + 2 * pad - p["ks"]) // p["stride"] + 1 for s in p["spatial"])
    return rank, pad, out


def flops(case: Case) -> int:
    """``2 * N * OD * OH * OW * K_out * K_gemm`` (``K_gemm = taps * C_in / groups``)."""
    p = case.params
    rank, _, out = _geometry(case)
    return 2 * p["N"] * math.prod(out) * p["K"] * p["ks"] ** rank * (p["C"] // p["groups"])


def nbytes(case: Case) -> int:
    """The fewest bytes a forward moves: input, weight, bias and output once each (bf16)."""
    p = case.params
    rank, _, out = _geometry(case)
    x = p["N"] * p["C"] * math.prod(p["spatial"])
    w = p["K"] * (p["C"] // p["groups"]) * p["ks"] ** rank
    return 2 * (x + w + p["K"] + p["N"] * p["K"] * math.prod(out))


def _bwd_flops(case: Case) -> int:
    """The input and the weight gradients, each the forward's flops (the bias gradient's sum is not counted)."""
    return 2 * flops(case)


# ------------------------------------------------------------------------------ tuned set

# ResNet-50 (batch 32) and UNet (batch 8) 3x3 layers; 3D video (8 frames, batch 8) and 1D audio (batch 32)
_CONV = [_case(32, 64, 64, (56, 56), 3), _case(32, 128, 128, (28, 28), 3), _case(32, 256, 256, (14, 14), 3),
         _case(32, 512, 512, (7, 7), 3), _case(32, 128, 128, (56, 56), 3, stride=2),
         _case(8, 64, 64, (256, 256), 3), _case(8, 128, 128, (128, 128), 3), _case(8, 256, 256, (64, 64), 3),
         _case(8, 64, 64, (8, 56, 56), 3), _case(8, 128, 128, (4, 28, 28), 3),
         _case(32, 256, 256, (4000,), 7), _case(32, 512, 512, (1000,), 7)]  # fmt: skip
_NCHW = [_case(32, 64, 64, (56, 56), 3, layout="nc"), _case(32, 256, 256, (14, 14), 3, layout="nc"),
         _case(8, 128, 128, (128, 128), 3, layout="nc"), _case(8, 64, 64, (8, 56, 56), 3, layout="nc"),
         _case(32, 256, 64, (56, 56), 1, layout="nc")]  # fmt: skip
_1X1 = [_case(32, 256, 64, (56, 56), 1), _case(32, 64, 256, (56, 56), 1), _case(32, 512, 128, (28, 28), 1),
        _case(32, 1024, 256, (14, 14), 1), _case(32, 2048, 512, (7, 7), 1),
        _case(64, 256, 1024, (14, 14), 1)]  # fmt: skip
_DEPTHWISE = [_case(32, 96, 96, (112, 112), 3, groups=96), _case(32, 384, 384, (28, 28), 3, groups=384),
              _case(64, 128, 128, (56, 56), 7, groups=128), _case(64, 512, 512, (14, 14), 7, groups=512)]  # fmt: skip
_GROUPED = [_case(32, 128, 128, (56, 56), 3, groups=32), _case(32, 256, 256, (28, 28), 3, groups=32),
            _case(32, 512, 512, (14, 14), 3, groups=32), _case(32, 1024, 1024, (7, 7), 3, groups=32),
            _case(32, 512, 512, (28, 28), 3, groups=8), _case(32, 256, 256, (28, 28), 3, groups=64)]  # fmt: skip
_TRAIN = [_case(32, 64, 64, (56, 56), 3, train=True), _case(32, 256, 256, (14, 14), 3, train=True),
          _case(32, 256, 64, (56, 56), 1, train=True), _case(8, 64, 64, (8, 56, 56), 3, train=True),
          _case(32, 384, 384, (28, 28), 7, groups=384, train=True)]  # fmt: skip

# the interpreter's smoke cases: every kind at a size it runs in seconds
_QUICK = {
    "conv_bf16": [_case(2, 8, 16, (9, 7), 3)],
    "conv_nchw": [_case(2, 8, 16, (9, 7), 3, layout="nc")],
    "conv_1x1": [_case(2, 16, 16, (5, 6), 1)],
    "conv_depthwise": [_case(2, 8, 8, (9, 9), 3, groups=8)],
    "conv_grouped": [_case(2, 16, 16, (6, 7), 3, groups=4)],
    "conv_train": [_case(2, 8, 8, (6, 5), 3, train=True)],
    "conv_fp8": [_case(2, 16, 32, (9, 7), 3)],
}


# ------------------------------------------------------------------------------ sweep


@dataclass(frozen=True)
class SweepRange:
    """Where unseen layers come from: batch up to ``n_max``, channels ``c_min``-``c_max`` (log-uniform),
    spatial extent of a 2D layer ``s_min``-``s_max`` (3D and 1D scaled from it); ``max_flops`` caps a layer
    (its batch shrinks)."""

    n_max: int = 64
    c_min: int = 16
    c_max: int = 1024
    s_min: int = 7
    s_max: int = 128
    max_flops: float = 2e12


GPU_SWEEP = SweepRange()
CPU_SWEEP = SweepRange(n_max=2, c_min=3, c_max=24, s_min=3, s_max=9, max_flops=float("inf"))


def _channels(rng: random.Random, r: SweepRange, align: int = 8) -> int:
    c = log_uniform(rng, r.c_min, r.c_max)
    return c if rng.random() < 0.25 else max(align, c // align * align)  # a quarter odd-ish, the rest aligned


def _draw_layer(rng: random.Random, r: SweepRange, kind: str) -> Case:
    rank = 2 if kind in ("depthwise", "grouped", "1x1") else rng.choice((1, 2, 2, 2, 3))
    ks = 1 if kind == "1x1" else rng.choice((3, 3, 5, 7)) if rank != 1 else rng.choice((3, 5, 7, 11))
    stride = 1 if kind == "1x1" else rng.choice((1, 1, 2))
    n = rng.randint(1, r.n_max)
    side = log_uniform(rng, r.s_min, r.s_max) | (rng.random() < 0.5)
    if rank == 1:
        spatial = (side * rng.randint(4, 32),)
    elif rank == 2:
        spatial = (side, side if rng.random() < 0.5 else max(r.s_min, side - rng.randint(0, 5)))
    else:
        spatial = (rng.randint(2, 8), max(r.s_min, side // 2), max(r.s_min, side // 2))
    ks = min(ks, *[s + 2 * (ks // 2) for s in spatial])
    if kind == "depthwise":
        c = k = _channels(rng, r)
        groups = c
    elif kind == "grouped":
        width = rng.choice((4, 8, 16, 32, 64))
        groups = max(2, _channels(rng, r) // width)
        c = k = groups * width
    else:
        c, k, groups = _channels(rng, r), _channels(rng, r), 1
    case = _case(n, c, k, spatial, ks, stride, groups)
    while flops(case) > r.max_flops and n > 1:
        n = max(1, n // 2)
        case = _case(n, c, k, spatial, ks, stride, groups)
    return case


def _sweep(r: SweepRange, kind: str) -> Callable[[random.Random, int], list[Case]]:
    def sweep(rng: random.Random, count: int) -> list[Case]:
        cases, seen = [], set()
        while len(cases) < count:
            case = _draw_layer(rng, r, kind)
            if case.name not in seen:
                seen.add(case.name)
                cases.append(case)
        return cases

    return sweep


# ------------------------------------------------------------------------------ setup and providers


def _setup(case: Case, device):
    p = case.params
    rank, pad, _ = _geometry(case)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(p["N"], p["C"], *p["spatial"], generator=g).to(device=device, dtype=_BF16)
    if p["layout"] == "cl":
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels-last memory, NC* dims
    cg = p["C"] // p["groups"]
    w = (torch.randn(p["K"], cg, *([p["ks"]] * rank), generator=g) / math.sqrt(cg * p["ks"] ** rank)).to(
        device=device, dtype=_BF16
    )
    b = torch.randn(p["K"], generator=g).to(device=device, dtype=_BF16)
    dy = None
    if case.params.get("train"):
        _, _, out = _geometry(case)
        dy = torch.randn(p["N"], p["K"], *out, generator=g).to(device=device, dtype=_BF16)
        if p["layout"] == "cl":
            dy = dy.movedim(1, -1).contiguous().movedim(-1, 1)
    return x, w, b, dy, dict(stride=p["stride"], padding=pad, groups=p["groups"])


def _ours(t):
    x, w, b, _, kw = t
    return lambda: conv(x, w, b, **kw)


def _cudnn(t):
    x, w, b, _, kw = t
    return lambda: _torch_conv_kw(x, w, b, **kw)


def _torch_conv(x, w, b, stride: int, padding: int, groups: int):
    return _TORCH_CONV[w.dim() - 2](x, w, b, stride, padding, 1, groups)


_COMPILED = CompiledPeer(_torch_conv)


def _compiled(t):
    x, w, b, _, kw = t
    key = (tuple(x.shape), x.stride(), tuple(w.shape), tuple(sorted(kw.items())))
    return _COMPILED.make(key, x, w, b, kw["stride"], kw["padding"], kw["groups"])


def _cublas_gemm(t):
    """The 1x1 layer's GEMM on cuBLAS: ``[N*H*W, C_in] @ [C_in, K_out]`` on the channels-last input, no bias."""
    x, w, b, _, kw = t
    if w.shape[2:].numel() != 1 or kw["stride"] != 1:
        raise Skip("the equivalent GEMM is for 1x1 stride-1 layers")
    x2 = x.movedim(1, -1)
    if not x2.is_contiguous():
        raise Skip("the equivalent GEMM reads a channels-last input")
    a, bt = x2.reshape(-1, x.shape[1]), w.reshape(w.shape[0], -1).t()
    return lambda: torch.matmul(a, bt)


def _reference(t):
    x, w, b, _, kw = t
    return conv_ref(x, w, b, **kw)


def _leaves(t, dtype=None) -> list[torch.Tensor]:
    """New leaves x, weight and bias of a case's inputs (``dtype``: converted first), gradients required."""
    return [(v if dtype is None else v.to(dtype)).detach().requires_grad_(True) for v in t[:3]]


def _train_step(forward: Callable) -> Callable:
    def make(t):
        _, _, _, dy, kw = t
        leaves = _leaves(t)

        def step() -> None:
            for v in leaves:
                v.grad = None
            forward(*leaves, **kw).backward(dy)

        step()
        return step

    return make


def _backward(forward: Callable) -> Callable:
    """The backward alone: the forward's graph built once, then the gradients of a fixed output gradient into
    x, the weight and the bias each call (the graph kept, ``retain_graph``)."""

    def make(t):
        _, _, _, dy, kw = t
        leaves = _leaves(t)
        y = forward(*leaves, **kw)
        return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)

    return make


def _grads_ref(t):
    """dx, dweight and dbias in float64 through torch's autograd of its own convolution."""
    _, _, _, dy, kw = t
    leaves = _leaves(t, torch.float64)
    return torch.autograd.grad(_torch_conv_kw(*leaves, **kw), leaves, dy.double())


def _torch_conv_kw(x, w, b, **kw):
    return _TORCH_CONV[w.dim() - 2](x, w, b, **kw)


def _bench(name, cases, providers, description, sweep, *, bytes_model=None, flops_model=flops, timings=("gpu", "call"),
           x_param="C"):  # fmt: skip
    return Bench(
        name=name,
        cases=cases,
        quick_cases=_QUICK[name],
        setup=_setup,
        providers=providers,
        bytes=bytes_model,
        flops=flops_model,
        reference=_reference,
        tolerance=1e-2,
        x_param=x_param,
        description=description,
        sweep=sweep,
        timings=timings,
        rotate=False,  # the layers' tensors are past L2 or as a network's are: read as they come
    )


_FWD_PEERS = [Provider("flydsl", _ours, is_ours=True), Provider("cudnn", _cudnn), Provider("torch.compile", _compiled)]


def _train_cases(cases: list[Case]) -> list[Case]:
    return [Case(c.name, {**c.params, "train": True}) for c in cases]


def benches(sweep_range: SweepRange = GPU_SWEEP) -> list[Bench]:
    """Every bench of the family; ``sweep_range``: where the unseen layers come from (tests shrink it). Every
    bench has a sweep of its own (10 shapes a bench by default)."""
    r = sweep_range
    train_peers = [
        Provider("flydsl", _backward(conv), is_ours=True, step=_train_step(conv)),
        Provider("cudnn", _backward(_torch_conv_kw), step=_train_step(_torch_conv_kw)),
    ]
    grads = GradCheck(_grads_ref)

    def train_sweep(rng, count):
        return _train_cases(_sweep(r, "dense")(rng, count))

    return [
        _bench("conv_bf16", _CONV, _FWD_PEERS, "bf16 forward, channels-last, bias; 2 N P K_out K_gemm flops",
               _sweep(r, "dense")),
        _bench("conv_nchw", _NCHW, _FWD_PEERS, "bf16 forward on NC* tensors end to end (ours: a channels-last "
               "copy first, as cuDNN's own)", _sweep(r, "dense")),
        _bench("conv_1x1", _1X1, [*_FWD_PEERS, Provider("cublas_gemm", _cublas_gemm, check=False)],
               "1x1 layers (a GEMM on the channels-last input); cublas_gemm: the equivalent matmul, no bias",
               _sweep(r, "1x1")),
        _bench("conv_depthwise", _DEPTHWISE, _FWD_PEERS, "depthwise 3x3 / 7x7; bytes: input + weight + output",
               _sweep(r, "depthwise"), bytes_model=nbytes),
        _bench("conv_grouped", _GROUPED, _FWD_PEERS, "grouped 3x3 (ResNeXt-style, 4-64 channels a group)",
               _sweep(r, "grouped")),
        replace(_bench("conv_train", _TRAIN, train_peers, "backward into x, weight and bias (gpu, call: the "
                       "backward alone, 2x the forward's flops); step: forward and backward on new leaves",
                       train_sweep, flops_model=_bwd_flops, timings=("gpu", "call", "step")),
                reference=grads.reference, output=grads.output),
        _fp8_bench(r),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ fp8

_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # e4m3's largest finite value
_FP8_LAYERS = [_case(32, 64, 64, (56, 56), 3), _case(32, 128, 128, (28, 28), 3), _case(32, 256, 256, (14, 14), 3),
               _case(8, 128, 128, (128, 128), 3), _case(32, 256, 64, (56, 56), 1), _case(32, 1024, 256, (14, 14), 1),
               _case(64, 256, 1024, (14, 14), 1)]  # fmt: skip


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of two at or above ``amax / 448``: a scale whose dequantized values are exact in bf16 (so the
    bf16 peers convolve exactly the values the fp8 kernel does)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(1e-12) / _FP8_MAX)))


def _setup_fp8(case: Case, device):
    """``(x8, w8, b, x_scale [1], w_scale [K_out], x_bf16, w_bf16, kw)``: x quantized per tensor, the weight per
    output channel, and both dequantized in bf16 for the peers."""
    x, w, b, _, kw = _setup(case, device)
    xs = _pow2_scale(x.abs().amax()).reshape(1)
    ws = _pow2_scale(w.abs().flatten(1).amax(1))
    wshape = (-1, *([1] * (w.dim() - 1)))
    x8 = (x.float() / xs).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)  # keeps x's memory format
    w8 = (w.float() / ws.view(wshape)).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    xb = (x8.float() * xs).to(_BF16)
    wb = (w8.float() * ws.view(wshape)).to(_BF16)
    return x8, w8, b, xs, ws, xb, wb, kw


def _ours_fp8(t):
    x8, w8, b, xs, ws, _, _, kw = t
    return lambda: conv(x8, w8, b, **kw, x_scale=xs, w_scale=ws)


def _bf16_of_fp8(t):
    """The dequantized bf16 inputs as the bf16 benches' ``(x, w, b, dy, kw)``."""
    return t[5], t[6], t[2], None, t[7]


def _fp8_reference(t):
    x8, w8, b, xs, ws, _, _, kw = t
    return conv_ref(x8, w8, b, **kw, x_scale=xs, w_scale=ws)


def _fp8_bench(r: SweepRange) -> Bench:
    return Bench(
        name="conv_fp8",
        cases=_FP8_LAYERS,
        quick_cases=_QUICK["conv_fp8"],
        setup=_setup_fp8,
        providers=[
            Provider("flydsl", _ours_fp8, is_ours=True),
            Provider("flydsl.bf16", lambda t: _ours(_bf16_of_fp8(t))),
            Provider("cudnn", lambda t: _cudnn(_bf16_of_fp8(t))),
        ],
        flops=flops,
        reference=_fp8_reference,
        tolerance=1e-2,  # the inputs are the fp8 values themselves: only accumulation order and bf16 rounding
        x_param="C",
        description="fp8 e4m3 forward (x per tensor, weight per output channel scales), bf16 out, channels-last, "
        "bias; flydsl.bf16 (our bf16 forward) and cudnn (bf16) on the dequantized inputs",
        sweep=_sweep(r, "dense"),
        timings=("gpu", "call"),
        rotate=False,
    )


def default_out_dir() -> Path:
    return results_dir("fly-conv", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    # Without a GPU the kernels run in the interpreter: its sweep draws from CPU_SWEEP (interpreter sizes).
    on_gpu = default_device().type == "cuda"
    return main_for(benches(GPU_SWEEP if on_gpu else CPU_SWEEP), list(argv or []), default_out_dir())
