"""RMSNorm: forward (plain, fused residual add, int8/fp8 quantized) and backward.

    y = h / sqrt(mean(h^2) + eps) * (weight + weight_offset),   h = x (+ residual)

The device code is shared with LayerNorm (:mod:`fly_norm._kernels.norm`, its host side
:mod:`fly_norm._norm_host`);
this module holds, in order: config choice, host launch on 2-D row views,
the ``fly_norm::`` custom ops with their fake implementations, autograd,
the public functions and the seed's builder API.
"""

from __future__ import annotations

import functools

import torch

import flydsl.compiler as flyc
from flydsl import direct
from flydsl_common.rows import RowConfig

from . import _norm_host as shared
from .autotune import row_config_for
from .reference import rms_norm_quant_ref, rms_norm_ref

__all__ = [
    "rms_norm",
    "rms_norm_quant",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "build_rmsnorm_module",
    "build_rmsnorm_bwd_module",
]

# ---------------------------------------------------------------- config choice

# row_config_for(op, n, dtype, device, autotune=, task=): searched winner, shipped artifact or default ladder.
_fwd_config = functools.partial(row_config_for, "rmsnorm_fwd")
_bwd_config = functools.partial(row_config_for, "rmsnorm_bwd")
_quant_config = functools.partial(row_config_for, "rmsnorm_quant")


# ---------------------------------------------------------------- host launch


def rmsnorm_fwd(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    out: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    rstd: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    config: RowConfig | None = None,
) -> None:
    """Low-level forward on [M, N] row views (row stride free, last dim contiguous), writing ``out``.

    With ``residual``, ``residual_out`` (required then) receives x + residual;
    ``rstd`` (fp32 [M]) receives the reciprocal std when given. No checks
    beyond the launcher's device checks: the public :func:`rms_norm` validates.
    """
    cfg = config or _fwd_config(x2.shape[1], x2.dtype, x2.device)
    shared.launch_fwd(
        x2, residual, weight, None, None, out, residual_out, None, rstd, None, eps, weight_offset, True, None, cfg
    )


def rmsnorm_bwd(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    dy2: torch.Tensor,
    rstd: torch.Tensor,
    dx2: torch.Tensor,
    dweight: torch.Tensor | None = None,
    *,
    dresidual_out: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    config: RowConfig | None = None,
) -> None:
    """Low-level backward on [M, N] row views: writes ``dx2`` and, when given, ``dweight`` ([N]).

    ``x2`` is the normalized input (x, or residual_out with a fused residual),
    ``rstd`` the forward's fp32 [M] statistics; ``dresidual_out`` the
    gradient reaching residual_out, added to dx2.
    """
    cfg = config or _bwd_config(x2.shape[1], x2.dtype, x2.device)
    shared.backward_into(x2, weight, dy2, dresidual_out, None, rstd, dx2, dweight, None, weight_offset, True, cfg)


# ---------------------------------------------------------------- custom ops


def _rms_norm_fwd(x, weight, residual, eps, weight_offset, store_stats):
    """(y, residual_out or empty, rstd or empty): the forward op's body, also run by the eager autograd path."""
    y, h, _, rstd = shared.norm_forward(
        x, weight, None, residual, eps, weight_offset, is_rms=True, store_stats=store_stats,
        config_for=_fwd_config, reference=lambda: rms_norm_ref(x, weight, eps, residual, weight_offset),
    )  # fmt: skip
    return y, h, rstd


def _rms_norm_bwd(dy, dresidual_out, h, weight, rstd, weight_offset, need_dweight, dx_dtype):
    """(dx, dweight or empty): the backward op's body, also run by the eager autograd path."""
    dx, dw, _ = shared.norm_backward(
        dy, dresidual_out, h, weight, None, rstd, weight_offset, is_rms=True, need_dw=need_dweight, need_db=False,
        dx_dtype=dx_dtype, dweight_dtype=None if weight is None else weight.dtype, config_for=_bwd_config,
    )  # fmt: skip
    return dx, dw


@torch.library.custom_op("fly_norm::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    store_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, residual_out or empty, rstd or empty)."""
    return _rms_norm_fwd(x, weight, residual, eps, weight_offset, store_stats)


@_rms_norm_fwd_op.register_fake
def _(x, weight, residual, eps, weight_offset, store_stats):
    y, h, _, rstd = shared.fake_forward(x, residual, store_stats, True)
    return y, h, rstd


@torch.library.custom_op("fly_norm::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    weight_offset: float,
    need_dweight: bool,
    dx_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty) in (dx_dtype, weight's dtype)."""
    return _rms_norm_bwd(dy, dresidual_out, h, weight, rstd, weight_offset, need_dweight, dx_dtype)


@_rms_norm_bwd_op.register_fake
def _(dy, dresidual_out, h, weight, rstd, weight_offset, need_dweight, dx_dtype):
    dx, dw, _ = shared.fake_backward(h, need_dweight, False, None if weight is None else weight.dtype, dx_dtype)
    return dx, dw


@torch.library.custom_op("fly_norm::rms_norm_quant", mutates_args=())
def _rms_norm_quant_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    smooth_scale: torch.Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, per-row fp32 scale, residual_out or empty)."""
    return _rms_norm_quant(x, weight, residual, smooth_scale, eps, dtype)


def _rms_norm_quant(x, weight, residual, smooth_scale, eps, dtype):
    return shared.norm_quant_forward(
        x, weight, None, residual, smooth_scale, eps, dtype, is_rms=True, config_for=_quant_config,
        reference=lambda: rms_norm_quant_ref(x, weight, eps, dtype=dtype, smooth_scale=smooth_scale, residual=residual),
    )  # fmt: skip


@_rms_norm_quant_op.register_fake
def _(x, weight, residual, smooth_scale, eps, dtype):
    return shared.fake_quant_forward(x, residual, dtype)


# ---------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, residual, _, weight_offset, _ = inputs
    _, h, rstd = output
    # The backward needs the normalized input: x itself, or x + residual (residual_out).
    ctx.save_for_backward(x if residual is None else h, weight, rstd)
    ctx.weight_offset = weight_offset
    ctx.x_dtype = x.dtype
    # The statistics' gradients are never used: unmaterialized, autograd fills no zeros for them (one or two
    # fill kernels a backward otherwise); dy and dh then come as None where their output went unused.
    ctx.set_materialize_grads(False)
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.eager = False  # through the custom op (traced, meta): its backward op too


def _backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    if dy is None:  # only residual_out reached the loss
        dy = h.new_zeros(h.shape, dtype=ctx.x_dtype)
    need_dw = weight is not None and ctx.needs_input_grad[1]
    fused = ctx.residual_dtype is not None
    # With a residual, one gradient is both x's and the residual's: computed in
    # the wider of their dtypes, then cast (a no-op when the dtypes agree).
    grad_dtype = torch.promote_types(ctx.x_dtype, ctx.residual_dtype) if fused else ctx.x_dtype
    args = (dy, dh if fused else None, h, weight, rstd, ctx.weight_offset, need_dw, grad_dtype)
    if ctx.eager:  # replayed where it can be (flydsl.direct), else the body itself
        dx, dw = _BWD_REPLAYS.eager(_rms_norm_bwd, *args)
    else:
        dx, dw = torch.ops.fly_norm.rms_norm_bwd(*args)
    dres = dx.to(ctx.residual_dtype) if fused and ctx.needs_input_grad[2] else None
    return dx.to(ctx.x_dtype), dw if need_dw else None, dres, None, None, None


torch.library.register_autograd("fly_norm::rms_norm_fwd", _backward, setup_context=_setup_context)

# The eager autograd path's recorded calls (flydsl.direct), one table a direction.
_FWD_REPLAYS = direct.Replays("fly_norm.rms_norm forward")
_BWD_REPLAYS = direct.Replays("fly_norm.rms_norm backward")


class _EagerRMSNorm(torch.autograd.Function):
    """The custom op's autograd outside tracing, without the dispatcher: torch wraps a custom op's
    implementation so that its first call imports torch._dynamo (1.4 s on a CPU host), which
    made the first differentiable call, and so every module's first call, take seconds."""

    # forward takes ctx itself (no separate setup_context): with one, Function.apply binds its arguments
    # through inspect.signature every call, ~25 us of host time a call on a CPU host.
    @staticmethod
    def forward(ctx, x, weight, residual, eps, weight_offset, store_stats):
        out = _FWD_REPLAYS.eager(_rms_norm_fwd, x, weight, residual, eps, weight_offset, store_stats)
        _setup_context(ctx, (x, weight, residual, eps, weight_offset, store_stats), out)
        ctx.eager = True
        return out

    @staticmethod
    def backward(ctx, dy, dh, drstd):
        return _backward(ctx, dy, dh, drstd)


# ---------------------------------------------------------------- public functions


def rms_norm(x, weight, eps=1e-6, residual=None, *, weight_offset=0.0, autotune=None):
    """RMSNorm over the last dimension: ``y = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset)``.

    Args:
        x: fp32/fp16/bf16 ``[..., N]`` (any N >= 1; last dim contiguous, rows
           may be strided: no copy is made).
        weight: ``[N]`` fp32/fp16/bf16 (any of them, whatever x's dtype: it is
           read into fp32), or None (no affine).
        eps: added to the mean square (a finite number >= 0); None takes the
           machine epsilon of x's dtype, as ``torch.nn.functional.rms_norm``.
        residual: optional ``[..., N]`` (any float dtype) added to x first.
        weight_offset: the ``(1 + w)`` convention: weight + weight_offset multiplies.
        autotune: search launch configs (default: ``FLYDSL_AUTOTUNE``).

    Returns:
        ``y`` (x's shape and dtype, contiguous, computed in fp32 whatever the
        weight's dtype, as ``torch.nn.functional.rms_norm`` on torch 2.9 and
        later) or, with ``residual``, ``(y, residual_out)`` where
        ``residual_out = x + residual`` (summed in fp32, stored in residual's
        dtype). Differentiable in x, weight and residual (the weight's gradient
        in its dtype); the row statistics are saved only when a gradient is
        needed. Meta tensors give meta outputs of those shapes and dtypes.

    Example::

        y = rms_norm(torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16), w)
    """
    if eps is None:  # torch's convention: the machine epsilon of x's dtype
        shared.check_norm_args(x, weight, None, residual, any_weight_dtype=True)
        eps = torch.finfo(x.dtype).eps
    # Floats (the custom op's schema takes floats), finite, eps >= 0.
    eps, weight_offset = shared.check_eps(eps), shared.check_weight_offset(weight_offset)
    if not autotune:  # small eager calls: a cached launch plan (None: not such a call)
        out = shared.eager_forward(x, weight, None, residual, eps, weight_offset, True, _fwd_config)
        if out is not None:
            return out
    shared.check_norm_args(x, weight, None, residual, any_weight_dtype=True)
    grad = shared.needs_grad(x, weight, residual)
    if torch.compiler.is_compiling() or shared.on_meta(x):  # traced, or meta tensors: the op (and its fake)
        y, h, _ = torch.ops.fly_norm.rms_norm_fwd(x, weight, residual, eps, weight_offset, grad)
    elif grad:
        y, h, _ = _EagerRMSNorm.apply(x, weight, residual, eps, weight_offset, grad)
    elif autotune:  # eager inference that searches configs: the general path
        y, h, _, _ = shared.norm_forward(
            x, weight, None, residual, eps, weight_offset, is_rms=True, store_stats=False, config_for=_fwd_config,
            reference=lambda: rms_norm_ref(x, weight, eps, residual, weight_offset), autotune=autotune,
            placeholders=False,
        )  # fmt: skip
    else:
        # Eager inference the cached plan did not take (the split widths, layouts it does not cover): the
        # forward's replayed route, as the autograd forward's (the dispatcher costs microseconds per call)
        y, h, _ = _FWD_REPLAYS.eager(_rms_norm_fwd, x, weight, residual, eps, weight_offset, False)
    return y if residual is None else (y, h)


def rms_norm_quant(x, weight, eps=1e-6, *, dtype=torch.int8, smooth_scale=None, residual=None):
    """RMSNorm then per-row dynamic quantization (the seed's DynamicQuant / SmoothQuant).

    ``z = rms_norm(x (+ residual), weight) (* smooth_scale)``, ``scale = amax(|z|) / QMAX``
    (QMAX 127 for int8, 448 for fp8 e4m3), ``q = saturate(round(z / scale))``.

    Args:
        x: fp32/fp16/bf16 ``[..., N]`` (last dim contiguous).
        weight: ``[N]`` in x's dtype, or None.
        dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        smooth_scale: optional per-column ``[N]`` scale (fp32 or x's dtype).
        residual: optional ``[..., N]`` in x's dtype, added first.

    Returns:
        ``(q, scale)`` or ``(q, scale, residual_out)``; ``scale`` is fp32 of
        shape ``x.shape[:-1]`` and ``q * scale[..., None]`` approximates z.
        Operand dtypes must match x's (raises DTypeError before any launch).
    """
    shared.check_norm_args(x, weight, None, residual, smooth_scale, quant_dtype=dtype)
    eps = shared.check_eps(eps)
    # Inference only (integer outputs): detached operands keep autograd from
    # looking for a backward of the quantizing op.
    x, weight, residual, smooth_scale = shared.detach_all(x, weight, residual, smooth_scale)
    if torch.compiler.is_compiling() or shared.on_meta(x):  # traced, or meta tensors: the op (and its fake)
        q, scale, h = torch.ops.fly_norm.rms_norm_quant(x, weight, residual, smooth_scale, eps, dtype)
    else:
        q, scale, h = _rms_norm_quant(x, weight, residual, smooth_scale, eps, dtype)
    return (q, scale) if residual is None else (q, scale, h)


# ---------------------------------------------------------------- seed builders


def build_rmsnorm_module(N, dtype_str, store_rstd=False, eps=1e-5, weight_dtype_str=None):
    """The seed's builder: a launcher for rows of ``N`` elements of ``dtype_str`` ("f32"/"f16"/"bf16").

    Returns ``launch(Input, Gamma, Output, m_in, stream=None)`` or, with
    ``store_rstd``, ``launch(Input, Gamma, Output, Rstd, m_in, stream=None)``;
    buffers are contiguous ``[>= m_in, N]`` (Rstd fp32 ``[>= m_in]``), ``m_in``
    is the runtime row count. Gamma may be fp32 with 16-bit activations.
    """
    dtype, wdtype = shared.builder_dtypes(dtype_str, weight_dtype_str)

    def run(inp, gamma, out, rstd, m_in):
        x2 = shared.builder_rows("Input", inp, N, m_in, dtype)
        y2 = shared.builder_rows("Output", out, N, m_in, dtype)
        shared.builder_rows("Gamma", gamma, N, 1, wdtype)
        rmsnorm_fwd(x2, gamma, y2, eps=eps, rstd=None if rstd is None else rstd.view(-1)[:m_in])

    if store_rstd:

        @flyc.jit
        def launch_rmsnorm(Input, Gamma, Output, Rstd, m_in, stream=None):  # noqa: N803 - the seed's names
            run(Input, Gamma, Output, Rstd, m_in)

    else:

        @flyc.jit
        def launch_rmsnorm(Input, Gamma, Output, m_in, stream=None):  # noqa: N803
            run(Input, Gamma, Output, None, m_in)

    return launch_rmsnorm


def build_rmsnorm_bwd_module(N, dtype_str, weight_dtype_str=None):
    """The seed's backward builder: ``launch(Input, Gamma, DY, Rstd, DX, DWeight, m_in, stream=None)``.

    Reads the forward's fp32 ``Rstd`` (eps is baked into it), writes ``DX``
    and the fp32 weight gradient ``DWeight`` ([N], fully overwritten,
    reduced deterministically).
    """
    dtype, wdtype = shared.builder_dtypes(dtype_str, weight_dtype_str)

    @flyc.jit
    def launch_rmsnorm_bwd(Input, Gamma, DY, Rstd, DX, DWeight, m_in, stream=None):  # noqa: N803
        x2 = shared.builder_rows("Input", Input, N, m_in, dtype)
        dy2 = shared.builder_rows("DY", DY, N, m_in, dtype)
        dx2 = shared.builder_rows("DX", DX, N, m_in, dtype)
        shared.builder_rows("Gamma", Gamma, N, 1, wdtype)
        shared.builder_rows("DWeight", DWeight, N, 1, torch.float32)
        rmsnorm_bwd(x2, Gamma, dy2, Rstd.view(-1)[:m_in], dx2, DWeight.view(-1))

    return launch_rmsnorm_bwd
