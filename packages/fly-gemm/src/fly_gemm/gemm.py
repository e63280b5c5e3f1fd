"""``gemm``: C = A @ B^T with scales, bias and activation fused, for fp16, bf16, fp8 e4m3 and int8.

In the order of the family's files: the kernels live in :mod:`._kernels`
(``persistent``: the TMA kernel of Hopper, for operands TMA can address;
``tiled``: the pointer-based kernel that serves every shape, stride and GPU;
``gemv``: CUDA cores for a few rows of A, when a config asks for it),
then the config choice (:mod:`.autotune`), then the host API below: argument
checks (every bad input is named before anything launches), output
allocation and dispatch.
"""

from __future__ import annotations

import numbers

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl import direct
from flydsl.autotune import SearchTask
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError
from flydsl.testing import tolerance
from flydsl_common.copy import copy_padded
from flydsl_common.device import activation_code
from flydsl_common.quant import quantize_per_token
from flydsl_common.reference import torch_activation

from . import _staging
from ._kernels.gemv import launch_gemv
from ._kernels.persistent import launch_persistent, tma_operand_a
from ._kernels.tiled import launch_tiled
from .autotune import GemmConfig, config_for, config_valid
from .prepack import B_LAYOUTS, PackedWeight
from .reference import gemm_ref

__all__ = ["gemm", "IN_DTYPES", "B_LAYOUTS"]

IN_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
_FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _act_name(activation) -> str:
    """The canonical name of an activation for tuning keys ("gelu_erf" and "gelu" are one)."""
    name = str(activation).lower()
    return "gelu" if name == "gelu_erf" else name


def _scale_tensor(name: str, s, device):
    """A scale given as one Python number (per-tensor) as a one-element fp32 tensor on ``device``; a tensor
    or None as it is; anything else refused, naming the argument."""
    if s is None or isinstance(s, torch.Tensor):
        return s
    if isinstance(s, numbers.Real) and not isinstance(s, bool):
        # torch.full fills on the device (no host-to-device copy); a tensor scale saves even that launch
        return torch.full((1,), float(s), dtype=torch.float32, device=device)
    per = "row of a" if name == "scale_a" else "column of c"
    raise ArgumentError(f"{name}: expected None, a number or an fp32 tensor (one value or one per {per}), "
                        f"got {type(s).__name__} {s!r}")  # fmt: skip


def _check_scale(name: str, s, length: int, what: str, device):
    """A scale: fp32, one element (per-tensor) or ``length`` elements (per row / column); flattened."""
    if s is None:
        return None
    check_tensor(name, s, dtypes=(torch.float32,), device=device)
    if s.numel() != 1 and (s.numel() != length or sum(d != 1 for d in s.shape) > 1):
        raise ShapeError(f"{name}: expected one value (per-tensor) or {length} values (one per {what}), "
                         f"got {describe(s)}")  # fmt: skip
    return s.reshape(-1)


def _out_dtype(in_dtype, out_dtype, out, scaled: bool, epilogue: bool) -> torch.dtype:
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else (in_dtype if in_dtype.itemsize == 2 else torch.bfloat16)
    if out_dtype in _FLOAT_OUT:
        return out_dtype
    if out_dtype == torch.int32 and in_dtype == torch.int8:
        if scaled or epilogue:
            raise ArgumentError("out_dtype: int32 output is the raw int8 product; it takes no scales, bias or "
                                "activation (ask for a float out_dtype to apply them)")  # fmt: skip
        return out_dtype
    allowed = [dtype_name(d) for d in _FLOAT_OUT] + (["int32"] if in_dtype == torch.int8 else [])
    raise DTypeError(f"out_dtype: expected one of {allowed} for {dtype_name(in_dtype)} inputs, got {out_dtype}")


def _gemm(a, b, bias, activation, out_dtype, scale_a, scale_b, out, b_layout, config):
    """Check, allocate and launch (the body of :func:`gemm` and of its custom op)."""
    check_tensor("a", a, dtypes=IN_DTYPES, ndim=2)
    if b_layout not in B_LAYOUTS:
        raise ArgumentError(f"b_layout: expected one of {list(B_LAYOUTS)}, got {b_layout!r}")
    check_tensor("b", b, ndim=2)
    if b.dtype != a.dtype:
        raise DTypeError(f"b: expected dtype {dtype_name(a.dtype)} (a's), got {describe(b)}")
    b_nk = b if b_layout == "nk" else b.t()
    m, k = a.shape
    n = b_nk.shape[0]
    if b_nk.shape[1] != k:
        want = f"[N, {k}]" if b_layout == "nk" else f"[{k}, N]"
        raise ShapeError(f"b: expected {want} (a is [{m}, {k}], b_layout={b_layout!r}), got {describe(b)}")
    device = check_same_device(a=a, b=b, bias=bias, scale_a=scale_a, scale_b=scale_b, out=out)
    if bias is not None:
        check_tensor("bias", bias, dtypes=_FLOAT_OUT, ndim=1)
        if bias.shape[0] != n:
            raise ShapeError(f"bias: expected [{n}] (one per column of C), got {describe(bias)}")
    sa = _check_scale("scale_a", scale_a, m, "row of a", device)
    sb = _check_scale("scale_b", scale_b, n, "column of c", device)
    act = activation_code(activation)
    dtype = _out_dtype(a.dtype, out_dtype, out, sa is not None or sb is not None, bias is not None or act != 0)
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=device)
    else:
        check_tensor("out", out, dtypes=(dtype,), ndim=2)
        if tuple(out.shape) != (m, n):
            raise ShapeError(f"out: expected [{m}, {n}], got {describe(out)}")
    if device.type == "meta":  # shapes only, as torch's own ops on meta tensors: nothing to launch
        return out
    if config is not None and not isinstance(config, GemmConfig):
        raise ArgumentError(f"config: expected None or a fly_gemm.GemmConfig, got {type(config).__name__} "
                            f"{config!r}")  # fmt: skip
    arch = flydsl.arch.current(device)
    if config is None:
        epilogue = "_".join(["bias"] * (bias is not None) + [_act_name(activation)] * (act != 0)) or "none"

        def task():  # the search task of this call (FLYDSL_AUTOTUNE=1): its own operands, the fp64 reference
            return SearchTask(
                run=lambda cfg: _gemm(a, b, bias, activation, dtype, scale_a, scale_b, out, b_layout, cfg),
                reference=lambda: gemm_ref(
                    a, b, bias=bias, activation=activation, scale_a=scale_a, scale_b=scale_b, b_layout=b_layout
                ),
                rtol=tolerance(dtype) if dtype.is_floating_point and dtype != torch.float32 else 1e-4,
            )

        config = config_for(m, n, k, a.dtype, dtype, epilogue, device, task=task)
    cfg = config
    if not config_valid(cfg, a.dtype, arch, out.element_size()):
        raise ArgumentError(f"config: {cfg} is not a valid launch config for {dtype_name(a.dtype)} on {arch.name}")
    # Every operand is on one device (checked above): on the current one, the launchers' own checks are
    # skipped (their __wrapped__), which is most of their host cost.
    direct = flyc.on_current_device(out)
    if cfg.gemv:
        (launch_gemv.__wrapped__ if direct else launch_gemv)(a, b_nk, out, bias, sa, sb, act, cfg)
        return out
    c = out
    staging = _staging.plan(a, b_nk, out, cfg.tma and arch.has_tma)
    if staging is not None:  # aligned copies of what the kernels would read slowly (see _staging)
        a, b_nk, c = _staging.stage_operands(staging, a, b_nk, out)
        if staging.copy_b:
            b, b_layout = b_nk, "nk"
    if cfg.tma and (tma_a := tma_operand_a(a, b, c, c_scratch=c is not out)) is not None:
        (launch_persistent.__wrapped__ if direct else launch_persistent)(
            *tma_a, b, c, bias, sa, sb, act, b_layout == "kn", cfg
        )
    else:  # every other shape, stride and GPU: the pointer-based kernel
        (launch_tiled.__wrapped__ if direct else launch_tiled)(a, b_nk, c, bias, sa, sb, act, cfg)
    if c is not out:
        copy_padded(c, out)  # a launch, not a torch copy: the staged call stays replayable
    return out


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    b_layout: str = "nk",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``C = act((A @ B^T) * scale_a * scale_b + bias)``, accumulated in fp32 (int32 for int8).

    Args:
        a: ``[M, K]``, fp16 / bf16 / fp8 e4m3 / int8; any strides. Operands (and an output) whose rows the
            kernels cannot read in whole vectors (K or a row stride not a multiple of 16 elements, a
            misaligned base, a strided last dim) are copied into aligned, zero-padded buffers first, when
            the call is large enough for that to pay (``fly_gemm._staging``); others are read in place.
        b: same dtype as ``a``; ``[N, K]`` (``b_layout="nk"``, the default: C = A @ B^T) or ``[K, N]``
            (``b_layout="kn"``: C = A @ B); any strides. Or a :class:`~fly_gemm.PackedWeight` from
            :func:`~fly_gemm.prepack` (its scale is scale_b; a 16-bit ``a`` against a quantized weight is
            quantized per row on the fly).
        bias: optional ``[N]``, any float dtype, added in fp32.
        activation: None, ``"relu"``, ``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` (erf form), after the bias.
        out_dtype: output dtype: fp16 / bf16 / fp32 (default: ``a``'s for 16-bit inputs, also when a quantized
            PackedWeight has it quantized on the fly; bf16 for fp8 and int8), or int32 for the raw int8
            product (no scales, bias or activation).
        scale_a: one value (a Python number, or an fp32 tensor of one element) or an fp32 ``[M]`` (per row of
            A); scale_b: one value or fp32 ``[N]`` (per column of C). Applied to the accumulator in fp32; the
            usual fp8 / int8 dequantization scales. A number costs a one-element fill on the device each call.
        out: optional ``[M, N]`` output to write (any strides).
        config: a :class:`~fly_gemm.autotune.GemmConfig` to launch with (default: chosen for the shape).

    Returns:
        ``[M, N]`` in ``out_dtype`` (``out`` when given). M = 0 or N = 0 give an empty result; K = 0
        gives ``act(bias)`` (or zeros). Meta tensors give a meta result of the right shape and dtype.

    Raises:
        flydsl.errors.ArgumentError / DTypeError / ShapeError / DeviceError naming the argument, before
        anything launches.

    Example::

        c = gemm(x, w, bias=b, activation="gelu_tanh")   # x [M, K], w [N, K] bf16 -> [M, N] bf16
    """
    if not isinstance(a, torch.Tensor):
        raise ArgumentError(f"a: expected a torch.Tensor, got {type(a).__name__}")
    if isinstance(b, PackedWeight):
        if out_dtype is None and out is None and b.quantized and a.dtype in (torch.float16, torch.bfloat16):
            # the default follows the a given: _unpack quantizes a 16-bit a to the weight's 8-bit dtype, whose
            # own default (bf16) is not the contract of a 16-bit call
            out_dtype = a.dtype
        a, b, scale_a, scale_b, b_layout = _unpack(a, b, scale_a, scale_b, b_layout)
    elif not isinstance(b, torch.Tensor):
        raise ArgumentError(f"b: expected a torch.Tensor or a fly_gemm.PackedWeight, got {type(b).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise ArgumentError(f"bias: expected None or a torch.Tensor [N], got {type(bias).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise ArgumentError(f"out: expected None or a torch.Tensor [M, N], got {type(out).__name__}")
    scale_a = _scale_tensor("scale_a", scale_a, a.device)
    scale_b = _scale_tensor("scale_b", scale_b, a.device)
    compiling = torch.compiler.is_compiling()
    if compiling or _grad_needed(a, b, bias, scale_a, scale_b):
        # traced code and autograd go through the custom op (fake implementation, registered backward)
        if config is not None:
            raise ArgumentError("config: not taken under torch.compile or autograd (the op serves its tuned config)")
        if out is not None and not compiling:
            raise ArgumentError("out: not supported when a gradient is needed (autograd allocates the output)")
        # With an activation, the product and the activation are two steps here: torch's activation keeps the
        # pre-activation for its backward, where a fused epilogue would leave the backward to recompute the
        # whole product (on the H200 that made a 4096^3 bias+gelu training step 1.45x torch's).
        activation_code(activation)  # a bad name fails here, naming the argument
        if compiling:
            c = torch.ops.fly_gemm.gemm(a, b, bias, None, out_dtype, scale_a, scale_b, b_layout)
        else:
            c = _EagerGemm.apply(a, b, bias, None, out_dtype, scale_a, scale_b, b_layout)
        if activation is not None:
            c = torch_activation(c, activation)
        return c if out is None else out.copy_(c)
    if out is None and config is None:
        return _gemm_call(a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout)
    return _gemm(a, b, bias, activation, out_dtype, scale_a, scale_b, out, b_layout, config)


# Eager calls of a kind seen before replay the first one's launches (flydsl.direct): no argument checks,
# config lookup or launch keying of the general path, which cost ~35 us of a small call's ~49 us of host time
# on the H200 host (torch.matmul's whole call: 14 us).
_REPLAYS = direct.Replays("fly_gemm.gemm")


def _gemm_call(a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout):
    """The op's body for an eager call (plain, with grad, or a backward's GEMM): replayed where
    :meth:`flydsl.direct.Replays.eager` allows it (keyed on every operand's layout, the options and the
    stream, as split-K keeps per-stream counters), else the general path."""
    return _REPLAYS.eager(_gemm, a, b, bias, activation, out_dtype, scale_a, scale_b, None, b_layout, None)


def _unpack(a, packed: PackedWeight, scale_a, scale_b, b_layout):
    """(a, b, scale_a, scale_b, b_layout) for a :class:`PackedWeight` B: its ``[N, K]`` weight and scale; a
    16-bit ``a`` against a quantized weight is quantized per row here (dynamic per-token scales)."""
    if b_layout != "nk":
        raise ArgumentError("b_layout: a PackedWeight is [N, K] already; leave b_layout at 'nk'")
    if scale_b is not None:
        raise ArgumentError("scale_b: a PackedWeight carries its own scale; pass none")
    w = packed.weight
    if packed.quantized and a.dtype in (torch.float16, torch.bfloat16):
        if scale_a is not None:
            raise ArgumentError("scale_a: a 16-bit a is quantized per row against a quantized PackedWeight; "
                                "pass a quantized a to give its scale")  # fmt: skip
        if _grad_needed(a):
            raise ArgumentError("a: gemm computes no gradient through a quantized PackedWeight (the product "
                                "runs on a quantized a); fly_gemm.linear does (gradient to x), or call under "
                                "torch.no_grad()")  # fmt: skip
        if a.is_meta:
            a, scale_a = torch.empty_like(a, dtype=w.dtype), a.new_empty(a.shape[:-1], dtype=torch.float32)
        else:
            a, scale_a = quantize_per_token(a, w.dtype)
    return a, w, scale_a, packed.scale, "nk"


# ------------------------------------------------------------------ custom op and autograd


def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The op is defined through torch.library.Library rather than torch.library.custom_op: custom_op wraps its
# kernel in torch._disable_dynamo, which imports torch._dynamo on the op's first eager call. That import took
# 1.3-3.9 s of a FlyLinear's first forward (CPU host: 3.9 s against 0.07 s for the first call without
# autograd; 1.3-2.3 s on the H200 host); a Library kernel is called without it (first call: 8 ms).
_LIB = torch.library.Library("fly_gemm", "DEF")
_LIB.define(
    "gemm(Tensor a, Tensor b, Tensor? bias, str? activation, ScalarType? out_dtype, Tensor? scale_a, "
    "Tensor? scale_b, str b_layout) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _gemm_op(a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout):
    return _gemm(a, b, bias, activation, out_dtype, scale_a, scale_b, None, b_layout, None)


_LIB.impl("gemm", _gemm_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fly_gemm::gemm", lib=_LIB)
def _(a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout):
    n = b.shape[0] if b_layout == "nk" else b.shape[1]
    scaled = scale_a is not None or scale_b is not None
    dtype = _out_dtype(a.dtype, out_dtype, None, scaled, bias is not None or activation is not None)
    return a.new_empty(a.shape[0], n, dtype=dtype)


def _setup_context(ctx, inputs, output):
    a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout = inputs
    if a.dtype.itemsize != 2 or scale_a is not None or scale_b is not None:
        given = dtype_name(a.dtype) + (" with scales" if scale_a is not None or scale_b is not None else "")
        raise DTypeError(f"gemm backward: gradients are computed for fp16 / bf16 inputs without scales, got {given}")
    ctx.save_for_backward(a, b, bias)
    ctx.activation = activation
    ctx.b_layout = b_layout
    ctx.eager = False  # through the op (traced, meta): its backward goes through the op too


def _backward(ctx, grad):
    """dA = G @ B, dB = G^T @ A (in B's layout), dbias = sum of G over rows, through the same kernels. G is
    the output gradient; with an activation (only a direct ``torch.ops.fly_gemm.gemm`` call with one: gemm
    and linear apply it in torch under autograd), times the activation's derivative at the pre-activation,
    recomputed in fp32."""
    a, b, bias = ctx.saved_tensors
    # Traced: the op, not its body (the backward is traced too, torch.compile); eager: the body, no dispatcher.
    op = _gemm_call if ctx.eager else torch.ops.fly_gemm.gemm
    g = grad
    if ctx.activation is not None:
        z = op(a, b, bias, None, torch.float32, None, None, ctx.b_layout)
        with torch.enable_grad():
            z.requires_grad_(True)
            (g,) = torch.autograd.grad(torch_activation(z, ctx.activation), z, grad.float())
    g16 = g.to(a.dtype)
    b_nk = b if ctx.b_layout == "nk" else b.t()
    da = db = dbias = None
    if ctx.needs_input_grad[0]:
        da = op(g16, b_nk, None, None, a.dtype, None, None, "kn")  # [M, N] @ [N, K]
    if ctx.needs_input_grad[1]:
        db_nk = op(g16.t(), a, None, None, b.dtype, None, None, "kn")  # [N, M] @ [M, K]
        db = db_nk if ctx.b_layout == "nk" else db_nk.t()
    if bias is not None and ctx.needs_input_grad[2]:
        dbias = g.sum(0, dtype=torch.float32).to(bias.dtype)  # fp32 sums without an fp32 copy of g
    return da, db, dbias, None, None, None, None, None


torch.library.register_autograd("fly_gemm::gemm", _backward, setup_context=_setup_context, lib=_LIB)


class _EagerGemm(torch.autograd.Function):
    """The op's autograd outside tracing, without the dispatcher: the op's generated autograd redispatches
    through it and rebuilds its arguments on every call (on the H200, a differentiable call's host time was
    195 us against torch.matmul's 21 at 16 x 256 x 256)."""

    # forward takes ctx itself (no separate setup_context): with one, Function.apply binds its arguments
    # through inspect.signature on every call.
    @staticmethod
    def forward(ctx, a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout):
        c = _gemm_call(a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout)
        _setup_context(ctx, (a, b, bias, activation, out_dtype, scale_a, scale_b, b_layout), c)
        ctx.eager = True
        return c

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad)
