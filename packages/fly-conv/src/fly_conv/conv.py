"""``conv``: convolution 1D / 2D / 3D as an implicit GEMM, with bias and activation fused; its backward.

In the order of the family's files: the kernels live in :mod:`._kernels` (``implicit_gemm``: the forward
and the input gradient, every group count; ``direct``: the forward of depthwise layers and narrow groups;
``wgrad``: the weight gradient), the config choice in :mod:`.autotune`, then the host code below: argument
checks (every bad input is named before anything launches), layouts, output allocation and dispatch, the
custom ops with their fake implementations and autograd, and the public functions.

Layouts. The kernels' native layout is channels-last (NWC / NHWC / NDHWC: channels contiguous, so a
pixel's channels load as whole vectors); every tensor is read and written through its strides. A
channels-first (NC*) input is copied to channels-last first, as cuDNN does internally, except where the
kernel reads it as fast in place (1x1 convolutions with stride 1 and no padding: a GEMM whose rows are
contiguous along the positions). Outputs are written in their final layout directly.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

import flydsl.arch
from flydsl import direct
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl_common.device import activation_code
from flydsl_common.reference import torch_activation

from ._kernels.direct import launch_direct
from ._kernels.implicit_gemm import geom_pointwise, k_splits, launch_implicit_gemm, launch_split_epilogue
from ._kernels.layout import MAX_BATCH, channel_sum_splits, launch_channel_sum, launch_sum_splits, launch_transpose
from ._kernels.rows_gemm import launch_rows_gemm, rows_gemm_applies
from ._kernels.wgrad import launch_depthwise_wgrad, launch_wgrad, launch_wgrad_rows, rows_kernel_applies
from .autotune import (
    ConvConfig,
    ConvProblem,
    config_for,
    config_valid,
    default_config,
    depthwise_wgrad_config,
    direct_kernel,
)

__all__ = ["conv", "conv1d", "conv2d", "conv3d", "IN_DTYPES", "FP8_DTYPES", "FP8_OUT_DTYPES", "PADDING_MODES"]

IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)  # the scaled forward (x_scale, w_scale): fp8 x fp8, fp32 accumulation
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)  # its outputs (out_dtype; bf16 by default)
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_CF_LAYOUTS = {1: "NCW", 2: "NCHW", 3: "NCDHW"}  # channels first: torch's logical order
_CL_LAYOUTS = {1: "NWC", 2: "NHWC", 3: "NDHWC"}  # channels last


# ------------------------------------------------------------------------------ argument checks


def _is_int(v) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _per_dim(name: str, value, rank: int, lo: int) -> tuple[int, ...]:
    """An int or a sequence of ``rank`` ints, each >= ``lo``, as a tuple of ``rank`` ints."""
    if type(value) is int and value >= lo:  # the common call, without the general checks below
        return (value,) * rank
    if type(value) is tuple and len(value) == rank and all(type(v) is int and v >= lo for v in value):
        return value
    vals = (value,) * rank if _is_int(value) else tuple(value) if isinstance(value, (tuple, list)) else None
    if vals is not None and len(vals) == 1 and rank > 1:
        vals = vals * rank
    if vals is None or len(vals) != rank or not all(_is_int(v) and v >= lo for v in vals):
        raise ArgumentError(f"{name}: expected an int >= {lo} or {rank} of them (one a spatial dim), got {value!r}")
    return tuple(int(v) for v in vals)


def _padding(padding, rank: int, kernel, stride, dilation) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(before, after) padding of each spatial dim from an int, a tuple, ``"valid"`` or ``"same"``."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * rank, (0,) * rank
        if padding == "same":
            if any(s != 1 for s in stride):
                raise ArgumentError(f"padding: 'same' needs stride 1 in every dim (as torch), got stride={stride}")
            total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
            # an odd total puts the extra element after, as torch does
            return tuple(t // 2 for t in total), tuple(t - t // 2 for t in total)
        raise ArgumentError(f"padding: expected an int, {rank} ints, 'valid' or 'same', got {padding!r}")
    p = _per_dim("padding", padding, rank, 0)
    return p, p


def _rank(weight) -> int:
    check_tensor("weight", weight)
    if not 3 <= weight.dim() <= 5:
        raise ShapeError(f"weight: expected [K_out, C_in / groups, *kernel] with 1-3 kernel dims (3-5 dims in "
                         f"all), got {describe(weight)}")  # fmt: skip
    return weight.dim() - 2


def _layout(name: str, layout, rank: int) -> str | None:
    if layout is None:
        return None
    if layout not in (_CF_LAYOUTS[rank], _CL_LAYOUTS[rank]):
        raise ArgumentError(f"{name}: expected None, {_CF_LAYOUTS[rank]!r} or {_CL_LAYOUTS[rank]!r} for a "
                            f"{rank}-D convolution (weight with {rank} kernel dims), got {layout!r}")  # fmt: skip
    return layout


def _channels_last_memory(x: torch.Tensor) -> bool:
    """An NC* tensor whose channels are contiguous (its memory is N*C), and not also plain contiguous."""
    return x.shape[1] > 1 and x.movedim(1, -1).is_contiguous() and not x.is_contiguous()


def _out_size(size, kernel, stride, lo, hi, dilation) -> tuple[int, ...]:
    return tuple((i + a + b - d * (k - 1) - 1) // s + 1
                 for i, k, s, a, b, d in zip(size, kernel, stride, lo, hi, dilation, strict=True))  # fmt: skip


def _check_problem(x, weight, bias, groups):
    """dtypes, devices and channel counts of a batched NC* ``x`` against ``weight`` and ``bias``."""
    check_tensor("x", x, dtypes=IN_DTYPES + FP8_DTYPES)
    if weight.dtype != x.dtype:
        raise DTypeError(f"weight: expected dtype {dtype_name(x.dtype)} (x's), got {describe(weight)}")
    if not _is_int(groups) or groups < 1:
        raise ArgumentError(f"groups: expected an int >= 1, got {groups!r}")
    c_in, k_out = x.shape[1], weight.shape[0]
    if c_in % groups:
        raise ShapeError(f"groups: x has C_in = {c_in} channels, not divisible by groups = {groups}")
    if k_out % groups:
        raise ShapeError(f"groups: weight has K_out = {k_out} output channels, not divisible by groups = {groups}")
    if weight.shape[1] != c_in // groups:
        raise ShapeError(f"weight: expected C_in / groups = {c_in // groups} input channels in dim 1 (x has "
                         f"{c_in} channels, groups = {groups}), got {describe(weight)}")  # fmt: skip
    if bias is not None:
        check_tensor("bias", bias, dtypes=_FLOAT, ndim=1)
        if bias.shape[0] != k_out:
            raise ShapeError(f"bias: expected [{k_out}] (one per output channel), got {describe(bias)}")
    check_same_device(x=x, weight=weight, bias=bias)


def _scale(name: str, value, x, count: int) -> torch.Tensor:
    """A dequantization scale as the kernel reads it: fp32, flat, on x's device; one element, or ``count``
    (one an output channel) where ``count`` > 1. A number becomes a one-element tensor (a fill each call)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.full((1,), float(value), dtype=torch.float32, device=x.device)
    if not isinstance(value, torch.Tensor):
        raise ArgumentError(f"{name}: expected a number or an fp32 tensor, got {type(value).__name__}")
    check_tensor(name, value, dtypes=(torch.float32,))
    check_same_device(x=x, **{name: value})
    if value.numel() == 1:
        return value.reshape(1)
    if count > 1 and value.dim() == 1 and value.shape[0] == count:
        return value if value.stride(0) == 1 else value.contiguous()
    want = f"one element or [{count}] (one an output channel)" if count > 1 else "one element (per tensor)"
    raise ShapeError(f"{name}: expected {want}, got {describe(value)}")


def _quant_args(x, weight, groups, x_scale, w_scale, out_dtype):
    """(output dtype, x's scale, the weight's scale) of a checked problem: fp8 inputs need both scales, other
    dtypes take none."""
    if x.dtype not in FP8_DTYPES:
        for name, v in (("x_scale", x_scale), ("w_scale", w_scale)):
            if v is not None:
                raise ArgumentError(f"{name}: a dequantization scale is for float8_e4m3fn inputs only, x is "
                                    f"{dtype_name(x.dtype)}")  # fmt: skip
        if out_dtype is not None and out_dtype != x.dtype:
            raise DTypeError(f"out_dtype: {dtype_name(x.dtype)} inputs give a {dtype_name(x.dtype)} output (out_dtype "
                             f"None or x's dtype), got {out_dtype!r}")  # fmt: skip
        return x.dtype, None, None
    if _is_depthwise(x.shape[1], weight.shape[0], groups):
        raise UnsupportedError(f"groups: depthwise fp8 (groups = C_in = {groups}) is not supported; the fp8 forward "
                               f"runs groups == 1 and grouped layers")  # fmt: skip
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if out_dtype not in FP8_OUT_DTYPES:
        raise DTypeError(f"out_dtype: the fp8 forward writes bf16 or fp16 (default bf16), got {out_dtype!r}")
    for name, v in (("x_scale", x_scale), ("w_scale", w_scale)):
        if v is None:
            raise ArgumentError(f"{name}: required for float8_e4m3fn inputs (the dequantization scale; pass 1.0 "
                                f"where the values need none)")  # fmt: skip
    return out_dtype, _scale("x_scale", x_scale, x, 1), _scale("w_scale", w_scale, x, weight.shape[0])


# ------------------------------------------------------------------------------ host launch


def _pad3(values, fill: int) -> tuple[int, int, int]:
    """A rank-1/2/3 tuple as the kernels' 3 dims (D, H, W): missing leading dims take ``fill``."""
    return (fill,) * (3 - len(values)) + tuple(values)


def _ndhwc(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A batched NC* tensor as a ``[N, D, H, W, C]`` view (size-1 dims added for 1D and 2D); no copy."""
    for _ in range(3 - rank):
        t = t.unsqueeze(2)
    return t.movedim(1, -1)


def _channels_last(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A batched, non-empty NC* ``t`` as an ``[N, D, H, W, C]`` view with contiguous channels (the gathers'
    fast layout): a copy only when they are not, by the transpose kernel for contiguous NC* memory (a launch
    that a replay redoes, where torch's copy would keep the call on the general path), else by torch."""
    t5 = _ndhwc(t, rank)
    if t5.stride(-1) == 1 or t5.shape[-1] == 1:
        return t5
    n, c = t.shape[:2]
    if t.is_contiguous() and n <= MAX_BATCH:
        out = torch.empty(t5.shape, dtype=t.dtype, device=t.device)
        launch_transpose(t.view(n, c, -1), out.view(n, -1, c))
        return out
    return t5.contiguous()


def _transposed(src3: torch.Tensor) -> torch.Tensor:
    """``src3`` ``[B, R, S]`` as a new contiguous ``[B, S, R]`` (the transpose kernel)."""
    b, r, s = src3.shape
    out = torch.empty((b, s, r), dtype=src3.dtype, device=src3.device)
    launch_transpose(src3, out)
    return out


def _forward_weight(weight: torch.Tensor, rank: int, taps: int) -> torch.Tensor:
    """The weight packed as ``[K_out, (kd, kh, kw, c)]`` with contiguous rows: a view for 1x1 and channels-last
    weights, the transpose kernel for a contiguous one, torch's copy for any other layout."""
    k_out, cg = weight.shape[:2]
    w2 = _ndhwc(weight, rank)
    if w2.stride(-1) != 1 and cg > 1 and taps > 1 and weight.is_contiguous() and k_out <= MAX_BATCH:
        return _transposed(weight.view(k_out, cg, taps)).view(k_out, taps * cg)
    w2 = w2.reshape(k_out, taps * cg)
    return w2 if w2.stride(-1) == 1 else w2.contiguous()


def _direct_weight(weight: torch.Tensor, taps: int) -> torch.Tensor:
    """The weight as the direct kernel reads it, ``[CG * taps, K_out]`` contiguous (a tap's weights of every
    output channel one vector): the transpose kernel for a contiguous weight, torch's copy for another."""
    k_out, cg = weight.shape[:2]
    if weight.is_contiguous():
        return _transposed(weight.view(1, k_out, cg * taps)).view(cg * taps, k_out)
    return weight.reshape(k_out, cg * taps).t().contiguous()


def _alloc(n: int, c: int, spatial, dtype, device, channels_last: bool) -> torch.Tensor:
    """An NC* tensor ``[n, c, *spatial]``; channels-last memory when asked."""
    if channels_last:
        return torch.empty((n, *spatial, c), dtype=dtype, device=device).movedim(-1, 1)
    return torch.empty((n, c, *spatial), dtype=dtype, device=device)


def _empty(shape, dtype, device) -> torch.Tensor:
    """A buffer every element of which a kernel writes (one place to allocate them: tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _geom(kernel, stride, lo, dilation):
    return _pad3(kernel, 1), _pad3(stride, 1), _pad3(lo, 0), _pad3(dilation, 1)


def _config(problem: ConvProblem, arch, config):
    """``config`` checked, or for None the tuned choice (:func:`~fly_conv.autotune.config_for`: searched winner,
    shipped artifact or this module's ``default_config``; memoised per problem, and never paid by a replayed
    call, which keeps its recorded launches)."""
    if config is None:
        return config_for(problem, arch=arch, default=default_config)
    return _checked(config, problem, arch)


def _checked(cfg, problem: ConvProblem, arch):
    if not isinstance(cfg, ConvConfig) or not config_valid(cfg, problem, arch):
        raise ArgumentError(f"config: {cfg!r} is not a valid launch config for a {problem.kind} convolution in "
                            f"{dtype_name(problem.dtype)} on {arch.name}")  # fmt: skip
    return cfg


def _is_depthwise(c_in: int, k_out: int, groups: int) -> bool:
    return groups > 1 and groups == c_in and k_out % c_in == 0


def _conv_forward(x, weight, bias, stride, lo, hi, dilation, groups, act, channels_last, config=None, x_scale=None,
                  w_scale=None, out_dtype=None):  # fmt: skip
    """The forward on a batched NC* ``x`` (any strides), zero padding ``lo`` before and ``hi`` after each dim;
    the output NC*, channels-last memory when ``channels_last``. fp8: ``x_scale`` / ``w_scale`` the checked
    fp32 scales, ``out_dtype`` the output's dtype (else x's)."""
    rank = weight.dim() - 2
    n, c_in = x.shape[:2]
    k_out, kernel = weight.shape[0], tuple(weight.shape[2:])
    out_size = _out_size(x.shape[2:], kernel, stride, lo, hi, dilation)
    y = _alloc(n, k_out, out_size, out_dtype or x.dtype, x.device, channels_last)
    if x.device.type == "meta" or y.numel() == 0:
        return y
    if x.numel() == 0:  # no input channels: every output is act(bias)
        y.copy_(torch_activation(_bias_plane(bias, y), _ACT_NAMES[act]))
        return y
    geom = _geom(kernel, stride, lo, dilation)
    taps = geom[0][0] * geom[0][1] * geom[0][2]
    y5 = _ndhwc(y, rank)
    arch = flydsl.arch.current(x.device)
    cg = c_in // groups
    if direct_kernel(c_in, k_out, groups, x.dtype):
        problem = ConvProblem("direct", y5.numel() // k_out, k_out, cg, taps, groups, x.dtype, kernel, stride,
                              dilation)  # fmt: skip
        cfg = _config(problem, arch, config)
        launch_direct(_channels_last(x, rank), _direct_weight(weight, taps), y5, bias, geom, groups, act, cfg)
        return y
    # 1x1 stride-1 layers read an NC* x in place (rows contiguous along the positions)
    x5 = _ndhwc(x, rank) if geom_pointwise(geom) else _channels_last(x, rank)
    w2 = _forward_weight(weight, rank, taps)
    problem = ConvProblem("implicit", y5.numel() // k_out, k_out // groups, cg, taps, groups, x.dtype, kernel, stride,
                          dilation)  # fmt: skip
    cfg = _config(problem, arch, config)
    splits = k_splits(x5, geom, groups, cfg)[0] if cfg.split_k > 1 else 1
    if cfg.tma and rows_gemm_applies(x5, w2, y5, geom, groups):  # else the gathering kernel, any layer
        launch_rows_gemm(x5, w2, y5, bias, geom, act, False, cfg, x_scale, w_scale)
        return y
    if splits == 1:
        launch_implicit_gemm(x5, w2, y5, bias, geom, act, False, groups, cfg, x_scale, w_scale)
        return y
    # split-K (a grid short of the SMs): fp32 partial sums of each split's run of K steps, then one pass adds
    # them in split order (deterministic) and applies the epilogue into y's final layout
    parts = _empty((splits, *y5.shape), torch.float32, x.device)
    launch_implicit_gemm(x5, w2, y5, bias, geom, act, False, groups, cfg, x_scale, w_scale, parts)
    launch_split_epilogue(parts, y5, bias, act, x_scale, w_scale)
    return y


_ACT_NAMES = {0: None, 1: "relu", 2: "silu", 3: "gelu_tanh", 4: "gelu"}


def _bias_plane(bias, y):
    """The bias broadcast over ``y`` (zeros without one), in fp32."""
    if bias is None:
        return torch.zeros_like(y, dtype=torch.float32)
    return bias.float().reshape(1, -1, *([1] * (y.dim() - 2))).expand(y.shape)


def _conv_input_grad(grad, weight, x_size, stride, lo, dilation, groups, channels_last, config=None):
    """dL/dx of the forward (``x_size``: x's NC* shape), as the implicit GEMM transposed: the output gradient
    gathered through the forward's taps against the weight packed as ``[C_in, (kd, kh, kw, k)]``; stride-1
    layers whose output groups are narrow (depthwise ones among them) as the direct kernel's convolution of
    the output gradient, taps reversed. ``config``: the launch's (the tuner's search), else chosen."""
    rank = weight.dim() - 2
    n, c_in = x_size[:2]
    dx = _alloc(n, c_in, x_size[2:], grad.dtype, grad.device, channels_last)
    if grad.device.type == "meta" or dx.numel() == 0:
        return dx
    if grad.numel() == 0:
        return dx.zero_()
    k_out, kernel = weight.shape[0], tuple(weight.shape[2:])
    geom = _geom(kernel, stride, lo, dilation)
    taps = geom[0][0] * geom[0][1] * geom[0][2]
    kg, cg = k_out // groups, c_in // groups
    direct = all(s == 1 for s in stride) and direct_kernel(k_out, c_in, groups, grad.dtype)
    g5 = _channels_last(grad, rank) if direct or not geom_pointwise(geom) else _ndhwc(grad, rank)
    if kg > 1 and weight.is_contiguous() and groups <= MAX_BATCH:  # [groups, kg, (c, tap)] -> [groups, (c, tap), kg]
        wd = _transposed(weight.view(groups, kg, cg * taps)).view(c_in, taps * kg)
    else:
        wd = weight.reshape(groups, kg, cg, taps).permute(0, 2, 3, 1).reshape(c_in, taps * kg)
        if wd.stride(-1) != 1:
            wd = wd.contiguous()
    dx5 = _ndhwc(dx, rank)
    arch = flydsl.arch.current(grad.device)
    if direct:
        # stride 1: the input gradient is the forward convolution of the output gradient (kg channels a group
        # into cg) with the taps reversed and padding dilation * (kernel - 1) - padding: the direct kernel's
        problem = ConvProblem("direct", dx5.numel() // c_in, c_in, kg, taps, groups, grad.dtype, kernel, stride,
                              dilation)  # fmt: skip
        lo_t = tuple(d * (k - 1) - p for k, p, d in zip(geom[0], geom[2], geom[3], strict=True))
        launch_direct(g5, wd, dx5, None, (geom[0], geom[1], lo_t, geom[3]), groups, 0,
                      _config(problem, arch, config), input_grad=True)  # fmt: skip
        return dx
    problem = ConvProblem("implicit", dx5.numel() // c_in, cg, kg, taps, groups, grad.dtype, kernel, stride, dilation,
                          transposed=True)  # fmt: skip
    cfg = _config(problem, arch, config)
    if cfg.tma and rows_gemm_applies(g5, wd, dx5, geom, groups, transposed=True):  # else the gathering kernel
        launch_rows_gemm(g5, wd, dx5, None, geom, 0, True, cfg)
    else:
        launch_implicit_gemm(g5, wd, dx5, None, geom, 0, True, groups, cfg)
    return dx


def _conv_weight_grad(grad, x, w_size, stride, lo, dilation, groups, config=None):
    """dL/dweight (``w_size``: the weight's shape): per tap and group, the output gradient's channels against
    the input's gathered pixels, summed over batch and positions (split runs added in a fixed order).
    ``config``: the launch's (the tuner's search), else chosen."""
    rank = len(w_size) - 2
    k_out, cg = w_size[:2]
    if grad.device.type == "meta":
        return torch.empty(w_size, dtype=grad.dtype, device=grad.device)
    if grad.numel() == 0 or x.numel() == 0:
        return torch.zeros(w_size, dtype=grad.dtype, device=grad.device)
    kernel = tuple(w_size[2:])
    geom = _geom(kernel, stride, lo, dilation)
    taps = geom[0][0] * geom[0][1] * geom[0][2]
    g5, x5 = _channels_last(grad, rank), _channels_last(x, rank)
    positions = g5.numel() // k_out
    arch = flydsl.arch.current(grad.device)
    problem = ConvProblem("wgrad", positions, k_out // groups, cg, taps, groups, grad.dtype, kernel, stride, dilation)
    if cg == 1 and groups > 1 and config is None:  # depthwise: its own kernel (a config names the tiled one)
        cfg = depthwise_wgrad_config(problem, arch)
        step = cfg.block_m

        def launch(out, splits, split_steps):
            launch_depthwise_wgrad(g5, x5, out.view(splits, k_out, taps), geom, splits, split_steps, cfg)
    else:
        cfg = _config(problem, arch, config)
        step = cfg.block_k
        rows = cfg.tma and rows_kernel_applies(g5, x5, geom, groups)  # else the gathering kernel, any layer

        def launch(out, splits, split_steps):
            view = out.view(splits, k_out, cg, taps)
            if rows:
                launch_wgrad_rows(g5, x5, view, geom, splits, split_steps, cfg)
            else:
                launch_wgrad(g5, x5, view, geom, groups, splits, split_steps, cfg)

    steps = -(-positions // step)
    split_steps = -(-steps // cfg.split_k)
    splits = -(-steps // split_steps)  # every split holds positions
    if splits == 1:
        dw = _empty(w_size, grad.dtype, grad.device)
        launch(dw, 1, split_steps)
        return dw
    parts = _empty((splits, k_out, cg, taps), torch.float32, grad.device)
    launch(parts, splits, split_steps)
    dw = _empty(w_size, grad.dtype, grad.device)
    launch_sum_splits(parts.view(splits, -1), dw.view(-1))  # a fixed order: deterministic
    return dw


# ------------------------------------------------------------------------------ custom ops and autograd

# Defined through torch.library.Library (as fly-gemm does): a custom_op-decorated kernel imports
# torch._dynamo on its first eager call, seconds of a first forward.
_LIB = torch.library.Library("fly_conv", "DEF")
_LIB.define(
    "conv(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] pad_lo, int[] pad_hi, int[] dilation, "
    "int groups, str? activation, bool channels_last) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.define(
    "conv_input_grad(Tensor grad, Tensor weight, int[] x_size, int[] stride, int[] pad_lo, int[] dilation, "
    "int groups, bool channels_last) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.define(
    "conv_weight_grad(Tensor grad, Tensor x, int[] w_size, int[] stride, int[] pad_lo, int[] dilation, "
    "int groups) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _conv_op(x, weight, bias, stride, pad_lo, pad_hi, dilation, groups, activation, channels_last):
    return _conv_forward(x, weight, bias, tuple(stride), tuple(pad_lo), tuple(pad_hi), tuple(dilation), groups,
                         activation_code(activation), channels_last)  # fmt: skip


def _input_grad_op(grad, weight, x_size, stride, pad_lo, dilation, groups, channels_last):
    return _conv_input_grad(grad, weight, tuple(x_size), tuple(stride), tuple(pad_lo), tuple(dilation), groups,
                            channels_last)  # fmt: skip


def _weight_grad_op(grad, x, w_size, stride, pad_lo, dilation, groups):
    return _conv_weight_grad(grad, x, tuple(w_size), tuple(stride), tuple(pad_lo), tuple(dilation), groups)


_LIB.impl("conv", _conv_op, "CompositeExplicitAutograd")
_LIB.impl("conv_input_grad", _input_grad_op, "CompositeExplicitAutograd")
_LIB.impl("conv_weight_grad", _weight_grad_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fly_conv::conv", lib=_LIB)
def _(x, weight, bias, stride, pad_lo, pad_hi, dilation, groups, activation, channels_last):
    size = _out_size(x.shape[2:], tuple(weight.shape[2:]), stride, pad_lo, pad_hi, dilation)
    return _alloc(x.shape[0], weight.shape[0], size, x.dtype, x.device, channels_last)


@torch.library.register_fake("fly_conv::conv_input_grad", lib=_LIB)
def _(grad, weight, x_size, stride, pad_lo, dilation, groups, channels_last):
    return _alloc(x_size[0], x_size[1], x_size[2:], grad.dtype, grad.device, channels_last)


@torch.library.register_fake("fly_conv::conv_weight_grad", lib=_LIB)
def _(grad, x, w_size, stride, pad_lo, dilation, groups):
    return grad.new_empty(w_size)


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, pad_lo, pad_hi, dilation, groups, activation, _cl = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.geom = (tuple(stride), tuple(pad_lo), tuple(pad_hi), tuple(dilation), groups)
    ctx.activation = activation
    ctx.x_channels_last = _channels_last_memory(x)
    ctx.eager = False  # through the op (traced): the backward goes through the ops too


def _backward(ctx, grad):
    """dx (transposed implicit GEMM), dweight (deterministic reduction), dbias (fp32 sum). With an activation
    (only a direct ``torch.ops.fly_conv.conv`` call with one: ``conv`` applies it in torch under autograd),
    the output gradient times the activation's derivative at the pre-activation, recomputed."""
    x, weight, bias = ctx.saved_tensors
    stride, lo, hi, dilation, groups = ctx.geom
    g = grad
    if ctx.activation is not None:
        fwd = _conv_op if ctx.eager else torch.ops.fly_conv.conv
        z = fwd(x, weight, bias, stride, lo, hi, dilation, groups, None, _channels_last_memory(grad))
        with torch.enable_grad():
            z = z.float().requires_grad_(True)
            (g,) = torch.autograd.grad(torch_activation(z, ctx.activation), z, grad.float())
        g = g.to(x.dtype)
    need_dx, need_dw = ctx.needs_input_grad[:2]
    db_dtype = bias.dtype if bias is not None and ctx.needs_input_grad[2] else None
    if ctx.eager:  # replayed where it can be (flydsl.direct), else the body itself
        dx, dw, db = _BWD_REPLAYS.eager(_eager_grads, g, x, weight, stride, lo, dilation, groups, need_dx, need_dw,
                                        db_dtype, ctx.x_channels_last)  # fmt: skip
    else:  # traced: the ops, and the bias gradient as torch's sum (the compiler fuses it)
        dx = dw = db = None
        if need_dx:
            dx = torch.ops.fly_conv.conv_input_grad(g, weight, list(x.shape), stride, lo, dilation, groups,
                                                    ctx.x_channels_last)  # fmt: skip
        if need_dw:
            dw = torch.ops.fly_conv.conv_weight_grad(g, x, list(weight.shape), stride, lo, dilation, groups)
        if db_dtype is not None:
            db = g.sum([0, *range(2, g.dim())], dtype=torch.float32).to(db_dtype)
    return dx, dw, db, None, None, None, None, None, None, None


torch.library.register_autograd("fly_conv::conv", _backward, setup_context=_setup_context, lib=_LIB)


def _eager_grads(g, x, weight, stride, lo, dilation, groups, need_dx: bool, need_dw: bool, db_dtype,
                 x_channels_last: bool):  # fmt: skip
    """(dx, dweight, dbias; each None where not needed, dbias where ``db_dtype`` names its dtype): the eager
    backward's kernels, one body so that one replay serves them all."""
    if need_dx and need_dw and g.numel() and x.numel():  # one channels-last copy of g (if any) for both kernels
        rank = weight.dim() - 2
        g = _channels_last(g, rank).movedim(-1, 1)
        for _ in range(3 - rank):
            g = g.squeeze(2)
    dx = dw = db = None
    if need_dx:
        dx = _conv_input_grad(g, weight, tuple(x.shape), stride, lo, dilation, groups, x_channels_last)
    if need_dw:
        dw = _conv_weight_grad(g, x, tuple(weight.shape), stride, lo, dilation, groups)
    if db_dtype is not None:
        db = _conv_bias_grad(g, db_dtype)
    return dx, dw, db


def _conv_bias_grad(g, dtype: torch.dtype):
    """dL/dbias: the output gradient ``[N, C, *positions]`` (any strides) summed over batch and positions per
    channel, in fp32, in a fixed order (row runs, then their split sum), cast once to ``dtype``."""
    nb, channels = g.shape[:2]
    if g.device.type == "meta":
        return torch.empty(channels, dtype=dtype, device=g.device)
    if g.numel() == 0:
        return torch.zeros(channels, dtype=dtype, device=g.device)
    g3 = g.flatten(2).transpose(1, 2)  # [N, positions, C]: a view where the positions collapse (copied if not)
    splits, _ = channel_sum_splits(g3.shape[0] * g3.shape[1], channels)
    parts = _empty((splits, channels), torch.float32, g.device)
    db = _empty((channels,), dtype, g.device)
    launch_channel_sum(g3, parts, db)
    return db


# Eager calls of a kind seen before replay the first one's launches and allocations (flydsl.direct): no
# argument checks, layout and config choice or launch keying. Plain calls replay the whole public call; under
# autograd the forward's body and the backward's kernels are replayed, the autograd bookkeeping is not.
_REPLAYS = direct.Replays("fly_conv.conv")
_FWD_REPLAYS = direct.Replays("fly_conv.conv forward")
_BWD_REPLAYS = direct.Replays("fly_conv.conv backward")


class _EagerConv(torch.autograd.Function):
    """The op's autograd outside tracing, without the dispatcher (its generated autograd rebuilds the
    arguments on every call). Its geometry arguments are tuples (the replay keys hash them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, pad_lo, pad_hi, dilation, groups, activation, channels_last):
        y = _FWD_REPLAYS.eager(_conv_forward, x, weight, bias, stride, pad_lo, pad_hi, dilation, groups,
                               activation_code(activation), channels_last)  # fmt: skip
        _setup_context(ctx, (x, weight, bias, stride, pad_lo, pad_hi, dilation, groups, activation, channels_last), y)
        ctx.eager = True
        return y

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad)


def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------ public functions


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # other tensor subclasses keep the general path


def _name(v) -> bool:
    return v is None or type(v) is str


def _geometry_key(v):
    """``v`` (stride, padding or dilation) as a replay key's part: an int, a string or a tuple of ints as it is,
    a list of ints as a tuple; None for anything else (the call keeps the general path, which checks it)."""
    t = type(v)
    if t is int or t is str:
        return v
    if (t is tuple or t is list) and all(type(e) is int for e in v):
        return tuple(v)
    return None


def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    padding_mode: str = "zeros",
    activation: str | None = None,
    input_layout: str | None = None,
    output_layout: str | None = None,
    *,
    config: ConvConfig | None = None,
    x_scale=None,
    w_scale=None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``act(conv(x, weight) + bias)``, 1D / 2D / 3D (the rank is ``weight.dim() - 2``), fp32 accumulation.

    Args:
        x: ``[N, C_in, *spatial]`` (or ``[C_in, *spatial]`` unbatched), fp16 / bf16 / fp32, any strides;
            channels-last memory (``torch.channels_last`` / ``channels_last_3d``, or an N*C tensor) is the
            kernels' native layout, NC* memory is copied to it first (1x1 stride-1 layers read it in place).
            With ``input_layout`` channels-last (``"NWC"``, ``"NHWC"``, ``"NDHWC"``) x's dims are
            ``[N, *spatial, C_in]`` instead.
        weight: ``[K_out, C_in / groups, *kernel]``, x's dtype.
        bias: optional ``[K_out]``, any float dtype, added in fp32.
        stride, dilation: an int or one a spatial dim, >= 1. padding: an int or one a dim (>= 0), ``"valid"``
            or ``"same"`` (stride 1; an odd total pads the extra element after, as torch).
        groups: divides C_in and K_out. Depthwise layers (``groups == C_in``) and groups of at most 8 input
            channels (:data:`~fly_conv.autotune.DIRECT_MAX_CG`) run a direct kernel's forward; other counts
            (and fp8) run the implicit GEMM with the group as a grid axis.
        padding_mode: ``"zeros"`` (in the kernel's masks), ``"reflect"``, ``"replicate"`` or ``"circular"``
            (padded on the host with ``torch.nn.functional.pad`` first, then convolved without padding).
        activation: None, ``"relu"``, ``"silu"``, ``"gelu"`` (erf form) or ``"gelu_tanh"``, in fp32 after the
            bias, before the downcast (under autograd: in torch after the kernel, so its backward keeps the
            pre-activation).
        input_layout: None (x is NC*) or the rank's NC* / N*C name.
        output_layout: None: the input's layout, and for NC* the input's memory format (channels-last memory
            in, channels-last memory out); or the rank's NC* name (contiguous NC*) or N*C name (dims
            ``[N, *spatial, K_out]``, contiguous).
        config: a :class:`~fly_conv.autotune.ConvConfig` for the forward kernel (default: the layer's tuned
            config, searched under ``FLYDSL_AUTOTUNE=1`` or shipped, else the shape's default:
            :func:`fly_conv.autotune.config_for`); not taken under autograd or torch.compile.
        x_scale, w_scale: the dequantization scales of fp8 (``torch.float8_e4m3fn``) ``x`` and ``weight``,
            both required for fp8 inputs (no default of 1.0: pass it explicitly) and refused for others.
            ``x_scale``: a number or a one-element fp32 tensor (per tensor); ``w_scale``: a number, a
            one-element fp32 tensor or an fp32 ``[K_out]`` (per output channel). The product is an fp8 x fp8
            implicit GEMM with fp32 accumulation, scaled by ``x_scale * w_scale`` before the bias and
            activation (fp32). fp8 runs the forward only (no autograd, no torch.compile) and no depthwise
            layers (``groups == C_in``); NC* inputs take the channels-last copy as 16-bit ones do. A number
            as a scale costs a one-element fill each call; a tensor is read in place.
        out_dtype: the output's dtype: fp8 inputs ``torch.bfloat16`` (default) or ``torch.float16``; other
            inputs None or x's dtype.

    Returns:
        the output in x's dtype (fp8 inputs: ``out_dtype``), ``[N, K_out, *out_spatial]`` (NC* layouts) or
        ``[N, *out_spatial, K_out]``;
        unbatched for an unbatched x.

    Raises:
        flydsl.errors.ArgumentError / ShapeError / DTypeError / DeviceError naming the argument, before
        anything launches: a weight of the wrong rank or channels, channels not divisible by groups, an
        output size <= 0, mixed dtypes or devices; scales given for non-fp8 inputs, missing for fp8 ones,
        or of the wrong shape or dtype. UnsupportedError: fp8 with gradients, under torch.compile, or depthwise.

    Example::

        y = conv(x, w, b, padding=1, activation="relu")   # x [8, 64, 56, 56] channels-last bf16, w [64, 64, 3, 3]
    """
    # A plain eager call (no gradient, no config): replayed by flydsl.direct where it allows (the key is every
    # argument, so only exact ints and names go there: 1.0 or True would key as 1 and skip the checks).
    if (
        config is None
        and type(x) in _PLAIN
        and type(weight) in _PLAIN
        and (bias is None or type(bias) in _PLAIN)
        and not _grad_needed(x, weight, bias)
        and type(groups) is int
        and _name(padding_mode) and _name(activation) and _name(input_layout) and _name(output_layout)
        # fp8: scales as tensors (a number's fill keeps the general path), out_dtype None or a dtype
        and (x_scale is None or type(x_scale) in _PLAIN) and (w_scale is None or type(w_scale) in _PLAIN)
        and (out_dtype is None or type(out_dtype) is torch.dtype)
    ):  # fmt: skip
        s, p, d = _geometry_key(stride), _geometry_key(padding), _geometry_key(dilation)
        if s is not None and p is not None and d is not None:
            return _REPLAYS.eager(_conv, x, weight, bias, s, p, d, groups, padding_mode, activation, input_layout,
                                  output_layout, None, x_scale, w_scale, out_dtype)  # fmt: skip
    return _conv(x, weight, bias, stride, padding, dilation, groups, padding_mode, activation, input_layout,
                 output_layout, config, x_scale, w_scale, out_dtype)  # fmt: skip


def _conv(x, weight, bias, stride, padding, dilation, groups, padding_mode, activation, input_layout, output_layout,
          config, x_scale=None, w_scale=None, out_dtype=None):  # fmt: skip
    """:func:`conv`'s general path (every check, then the forward; autograd and tracing through the op)."""
    rank = _rank(weight)
    check_tensor("x", x)
    in_layout = _layout("input_layout", input_layout, rank)
    out_layout = _layout("output_layout", output_layout, rank)
    if x.dim() not in (rank + 1, rank + 2):
        raise ShapeError(f"x: expected [N, C_in, *spatial] or [C_in, *spatial] with {rank} spatial dims (the "
                         f"weight's kernel dims), got {describe(x)}")  # fmt: skip
    batched = x.dim() == rank + 2
    x_nc = x if batched else x.unsqueeze(0)
    channels_last_in = in_layout == _CL_LAYOUTS[rank]
    if channels_last_in:
        x_nc = x_nc.movedim(-1, 1)
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise ArgumentError(f"bias: expected None or a torch.Tensor [K_out], got {type(bias).__name__}")
    _check_problem(x_nc, weight, bias, groups)
    out_dtype, x_scale, w_scale = _quant_args(x_nc, weight, groups, x_scale, w_scale, out_dtype)
    act = activation_code(activation)
    kernel = tuple(weight.shape[2:])
    stride = _per_dim("stride", stride, rank, 1)
    dilation = _per_dim("dilation", dilation, rank, 1)
    lo, hi = _padding(padding, rank, kernel, stride, dilation)
    if padding_mode not in PADDING_MODES:
        raise ArgumentError(f"padding_mode: expected one of {list(PADDING_MODES)}, got {padding_mode!r}")
    out_size = _out_size(x_nc.shape[2:], kernel, stride, lo, hi, dilation)
    if any(o <= 0 for o in out_size):
        raise ShapeError(f"x: spatial size {tuple(x_nc.shape[2:])} with padding {lo}/{hi}, kernel {kernel} and "
                         f"dilation {dilation} gives output size {out_size}; each must be >= 1")  # fmt: skip
    if out_layout is None:
        out_layout = in_layout
    if out_layout is None:
        channels_last = _channels_last_memory(x_nc)
    else:
        channels_last = out_layout == _CL_LAYOUTS[rank]
    if padding_mode != "zeros" and any(lo + hi):
        x_nc = _pad_host(x_nc, lo, hi, padding_mode)
        lo = hi = (0,) * rank

    compiling = torch.compiler.is_compiling()
    if x_scale is not None:  # fp8: the forward alone, eagerly
        if compiling:
            raise UnsupportedError("x: the fp8 forward does not run under torch.compile (no custom op takes its "
                                   "scales)")  # fmt: skip
        for name, t in (("x", x), ("weight", weight), ("bias", bias)):
            if _grad_needed(t):
                raise UnsupportedError(f"{name}: requires grad, and the fp8 forward has no backward (call it under "
                                       f"torch.no_grad() or on detached tensors)")  # fmt: skip
        y = _conv_forward(x_nc, weight, bias, stride, lo, hi, dilation, groups, act, channels_last, config, x_scale,
                          w_scale, out_dtype)  # fmt: skip
    elif compiling or _grad_needed(x, weight, bias):
        if config is not None:
            raise ArgumentError("config: not taken under torch.compile or autograd (the ops choose their configs)")
        args = (x_nc, weight, bias, stride, lo, hi, dilation, groups, None, channels_last)
        y = torch.ops.fly_conv.conv(*args) if compiling else _EagerConv.apply(*args)
        if activation is not None:
            y = torch_activation(y, activation)
    else:
        y = _conv_forward(x_nc, weight, bias, stride, lo, hi, dilation, groups, act, channels_last, config)
    if out_layout == _CL_LAYOUTS[rank]:
        y = y.movedim(1, -1)
    return y if batched else y.squeeze(0)


def _pad_host(x, lo, hi, mode: str) -> torch.Tensor:
    """x padded by torch (reflect / replicate / circular), checked against each mode's limit first."""
    for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
        size = x.shape[2 + i]
        limit = size - 1 if mode == "reflect" else size if mode == "circular" else None
        if limit is not None and max(a, b) > limit:
            raise ArgumentError(f"padding: {mode} padding of spatial dim {i} must be at most {limit} (its size is "
                                f"{size}), got {max(a, b)}")  # fmt: skip
        if mode == "replicate" and size == 0:
            raise ArgumentError(f"padding: replicate padding needs a non-empty spatial dim {i}")
    pads = [p for a, b in zip(reversed(lo), reversed(hi), strict=True) for p in (a, b)]
    if x.dtype in FP8_DTYPES:  # torch's reflect / replicate pads have no fp8 kernels: a copy of the bytes
        return F.pad(x.view(torch.uint8), pads, mode=mode).view(x.dtype)
    return F.pad(x, pads, mode=mode)


def _check_rank(fn: str, weight, rank: int) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != rank + 2:
        got = describe(weight) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ShapeError(f"weight: {fn} expects a {rank + 2}-D weight [K_out, C_in / groups, {rank} kernel "
                         f"dims], got {got}")  # fmt: skip


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, padding_mode="zeros",
           activation=None, x_scale=None, w_scale=None, out_dtype=None):  # fmt: skip
    """:func:`torch.nn.functional.conv1d`'s signature on :func:`conv` (``input`` ``[N, C_in, W]`` or
    unbatched ``[C_in, W]``; weight ``[K_out, C_in / groups, kW]``), plus ``padding_mode`` and a fused
    ``activation`` (and :func:`conv`'s fp8 keywords ``x_scale``, ``w_scale``, ``out_dtype``)."""
    _check_rank("conv1d", weight, 1)
    return conv(input, weight, bias, stride, padding, dilation, groups, padding_mode, activation, x_scale=x_scale,
                w_scale=w_scale, out_dtype=out_dtype)  # fmt: skip


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, padding_mode="zeros",
           activation=None, x_scale=None, w_scale=None, out_dtype=None):  # fmt: skip
    """:func:`torch.nn.functional.conv2d`'s signature on :func:`conv` (``input`` ``[N, C_in, H, W]`` or
    unbatched; weight ``[K_out, C_in / groups, kH, kW]``), plus ``padding_mode`` and a fused ``activation``
    (and :func:`conv`'s fp8 keywords)."""
    _check_rank("conv2d", weight, 2)
    return conv(input, weight, bias, stride, padding, dilation, groups, padding_mode, activation, x_scale=x_scale,
                w_scale=w_scale, out_dtype=out_dtype)  # fmt: skip


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, padding_mode="zeros",
           activation=None, x_scale=None, w_scale=None, out_dtype=None):  # fmt: skip
    """:func:`torch.nn.functional.conv3d`'s signature on :func:`conv` (``input`` ``[N, C_in, D, H, W]`` or
    unbatched; weight ``[K_out, C_in / groups, kD, kH, kW]``), plus ``padding_mode`` and a fused
    ``activation`` (and :func:`conv`'s fp8 keywords)."""
    _check_rank("conv3d", weight, 3)
    return conv(input, weight, bias, stride, padding, dilation, groups, padding_mode, activation, x_scale=x_scale,
                w_scale=w_scale, out_dtype=out_dtype)  # fmt: skip
