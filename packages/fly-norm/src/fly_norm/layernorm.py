"""LayerNorm: forward (plain, fused residual add, int8/fp8 quantized) and backward.

    y = (h - mean) / sqrt(var + eps) * (weight + weight_offset) + bias,   h = x (+ residual)

The device code is shared with RMSNorm (:mod:`fly_norm._kernels.norm`); rows
wider than one register-resident step merge per-chunk (mean, M2) pairs with
Chan's parallel formula, so a large |mean| never cancels the variance away.
Layout of this file (DESIGN 11.1): launch-config choice; low-level launches
on [M, N] row views; custom ops ``fly_norm::layer_norm_*`` and their fakes;
autograd; public functions; the seed's ``build_layernorm_module``.
"""

from __future__ import annotations

import functools

import torch

import flydsl.compiler as flyc
from flydsl import direct
from flydsl_common.rows import RowConfig

from . import _norm_host as shared
from .autotune import row_config_for
from .reference import layer_norm_quant_ref, layer_norm_ref

__all__ = ["layer_norm", "layer_norm_quant", "layernorm_fwd", "layernorm_bwd", "build_layernorm_module"]

# ---------------------------------------------------------------- config choice

_fwd_config = functools.partial(row_config_for, "layernorm_fwd")
_bwd_config = functools.partial(row_config_for, "layernorm_bwd")
_quant_config = functools.partial(row_config_for, "layernorm_quant")


# ---------------------------------------------------------------- host launch


def layernorm_fwd(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    rstd: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    config: RowConfig | None = None,
) -> None:
    """Low-level forward on [M, N] row views (row stride free, last dim contiguous), writing ``out``.

    With ``residual``, ``residual_out`` (required then) receives x + residual;
    ``mean`` and ``rstd`` (fp32 [M], both or neither) receive the row
    statistics. No checks beyond the launcher's: :func:`layer_norm` validates.
    """
    cfg = config or _fwd_config(x2.shape[1], x2.dtype, x2.device)
    stats = (mean, rstd) if rstd is not None else (None, None)
    shared.launch_fwd(
        x2, residual, weight, bias, None, out, residual_out, *stats, None, eps, weight_offset, False, None, cfg
    )


def layernorm_bwd(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    dy2: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dx2: torch.Tensor,
    dweight: torch.Tensor | None = None,
    dbias: torch.Tensor | None = None,
    *,
    dresidual_out: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    config: RowConfig | None = None,
) -> None:
    """Low-level backward on [M, N] row views: writes ``dx2`` and, when given, ``dweight``/``dbias`` ([N]).

    ``x2`` is the normalized input (x, or residual_out with a fused residual);
    ``mean``/``rstd`` the forward's fp32 [M] statistics.
    """
    cfg = config or _bwd_config(x2.shape[1], x2.dtype, x2.device)
    shared.backward_into(x2, weight, dy2, dresidual_out, mean, rstd, dx2, dweight, dbias, weight_offset, False, cfg)


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("fly_norm::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    store_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, residual_out or empty, mean or empty, rstd or empty)."""
    return _layer_norm_forward(x, weight, bias, residual, eps, weight_offset, store_stats, None)


@_layer_norm_fwd_op.register_fake
def _(x, weight, bias, residual, eps, weight_offset, store_stats):
    return shared.fake_forward(x, residual, store_stats, False)


def _layer_norm_forward(x, weight, bias, residual, eps, weight_offset, store_stats, autotune, placeholders=True):
    return shared.norm_forward(
        x, weight, bias, residual, eps, weight_offset, is_rms=False, store_stats=store_stats,
        config_for=_fwd_config, reference=lambda: layer_norm_ref(x, weight, bias, eps, residual, weight_offset),
        autotune=autotune, placeholders=placeholders,
    )  # fmt: skip


def _layer_norm_bwd(dy, dresidual_out, h, weight, mean, rstd, weight_offset, need_dweight, need_dbias, dx_dtype,
                    dweight_dtype, dbias_dtype):  # fmt: skip
    """(dx, dweight or empty, dbias or empty): the backward op's body, also run by the eager autograd path.
    dweight comes in ``dweight_dtype``, dbias in ``dbias_dtype`` (each its parameter's: an fp32 bias's
    gradient is not rounded through a 16-bit weight's dtype)."""
    return shared.norm_backward(
        dy, dresidual_out, h, weight, mean, rstd, weight_offset, is_rms=False, need_dw=need_dweight,
        need_db=need_dbias, dx_dtype=dx_dtype, dweight_dtype=dweight_dtype, config_for=_bwd_config,
        dbias_dtype=dbias_dtype,
    )  # fmt: skip


@torch.library.custom_op("fly_norm::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight_offset: float,
    need_dweight: bool,
    need_dbias: bool,
    dx_dtype: torch.dtype,
    dweight_dtype: torch.dtype,
    dbias_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty, dbias or empty). ``dbias_dtype`` None: ``dweight_dtype`` (the op's schema before
    it had the argument, which graphs compiled then and kept in Inductor's on-disk caches still call)."""
    return _layer_norm_bwd(
        dy, dresidual_out, h, weight, mean, rstd, weight_offset, need_dweight, need_dbias, dx_dtype, dweight_dtype,
        dbias_dtype,
    )


@_layer_norm_bwd_op.register_fake
def _(dy, dresidual_out, h, weight, mean, rstd, weight_offset, need_dweight, need_dbias, dx_dtype, dweight_dtype,
      dbias_dtype=None):  # fmt: skip
    return shared.fake_backward(h, need_dweight, need_dbias, dweight_dtype, dx_dtype, dbias_dtype)


@torch.library.custom_op("fly_norm::layer_norm_quant", mutates_args=())
def _layer_norm_quant_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    smooth_scale: torch.Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, per-row fp32 scale, residual_out or empty)."""
    return _layer_norm_quant(x, weight, bias, residual, smooth_scale, eps, dtype)


@_layer_norm_quant_op.register_fake
def _(x, weight, bias, residual, smooth_scale, eps, dtype):
    return shared.fake_quant_forward(x, residual, dtype)


def _layer_norm_quant(x, weight, bias, residual, smooth_scale, eps, dtype):
    def reference():
        return layer_norm_quant_ref(x, weight, bias, eps, dtype=dtype, smooth_scale=smooth_scale, residual=residual)

    return shared.norm_quant_forward(
        x, weight, bias, residual, smooth_scale, eps, dtype, is_rms=False, config_for=_quant_config,
        reference=reference,
    )


# ---------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _, weight_offset, _ = inputs
    _, h, mean, rstd = output
    # The backward needs the normalized input: x itself, or x + residual (residual_out).
    ctx.save_for_backward(x if residual is None else h, weight, mean, rstd)
    ctx.weight_offset = weight_offset
    ctx.x_dtype = x.dtype
    # The statistics' gradients are never used: unmaterialized, autograd fills no zeros for them (one or two
    # fill kernels a backward otherwise); dy and dh then come as None where their output went unused.
    ctx.set_materialize_grads(False)
    ctx.residual_dtype = None if residual is None else residual.dtype
    # dweight and dbias come back in their own parameter's dtype (fp32 when absent), each computed in it: dbias
    # is never rounded through a 16-bit weight's dtype when the bias is fp32.
    ctx.param_dtype = torch.float32 if weight is None else weight.dtype
    ctx.bias_dtype = torch.float32 if bias is None else bias.dtype
    ctx.eager = False  # through the custom op (traced, meta): its backward op too


def _backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    if dy is None:  # only residual_out reached the loss
        dy = h.new_zeros(h.shape, dtype=ctx.x_dtype)
    _, need_w, need_b, need_r = ctx.needs_input_grad[:4]
    need_w = need_w and weight is not None
    fused = ctx.residual_dtype is not None
    grad_dtype = torch.promote_types(ctx.x_dtype, ctx.residual_dtype) if fused else ctx.x_dtype
    args = (dy, dh if fused else None, h, weight, mean, rstd, ctx.weight_offset, need_w, need_b, grad_dtype,
            ctx.param_dtype, ctx.bias_dtype)  # fmt: skip
    if ctx.eager:  # replayed where it can be (flydsl.direct), else the body itself
        dx, dw, db = _BWD_REPLAYS.eager(_layer_norm_bwd, *args)
    else:
        dx, dw, db = torch.ops.fly_norm.layer_norm_bwd(*args)
    grads_w_b = (dw if need_w else None, db if need_b else None)
    # One gradient serves x and the residual (the residual's is dh plus the normalization's).
    dres = dx.to(ctx.residual_dtype) if fused and need_r else None
    return dx.to(ctx.x_dtype), *grads_w_b, dres, None, None, None


torch.library.register_autograd("fly_norm::layer_norm_fwd", _backward, setup_context=_setup_context)

# The eager autograd path's recorded calls (flydsl.direct), one table a direction.
_FWD_REPLAYS = direct.Replays("fly_norm.layer_norm forward")
_BWD_REPLAYS = direct.Replays("fly_norm.layer_norm backward")


class _EagerLayerNorm(torch.autograd.Function):
    """The custom op's autograd outside tracing, without the dispatcher: the first call of a custom op's
    implementation imports torch._dynamo (1.4 s on a CPU host; see rmsnorm._EagerRMSNorm)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, weight_offset, store_stats):  # ctx here: see _EagerRMSNorm
        out = _FWD_REPLAYS.eager(_layer_norm_forward, x, weight, bias, residual, eps, weight_offset,
                                store_stats, None)  # fmt: skip
        _setup_context(ctx, (x, weight, bias, residual, eps, weight_offset, store_stats), out)
        ctx.eager = True
        return out

    @staticmethod
    def backward(ctx, dy, dh, dmean, drstd):
        return _backward(ctx, dy, dh, dmean, drstd)


# ---------------------------------------------------------------- public functions


def layer_norm(x, weight, bias, eps=1e-5, residual=None, *, weight_offset=0.0, autotune=None):
    """LayerNorm over the last dimension: ``y = (h - mean) * rsqrt(var + eps) * (weight + weight_offset) + bias``.

    Args:
        x: fp32/fp16/bf16 ``[..., N]`` (any N >= 1; last dim contiguous, rows
           may be strided: no copy is made).
        weight, bias: ``[N]`` in x's dtype or fp32, or None (torch's rule for
           ``layer_norm`` on the CPU; on CUDA torch takes x's dtype only).
        eps: added to the (biased) variance (a finite number >= 0).
        residual: optional ``[..., N]`` (any float dtype) added to x first.
        weight_offset: the ``(1 + w)`` convention.
        autotune: search launch configs (default: ``FLYDSL_AUTOTUNE``).

    Returns:
        ``y`` (x's shape and dtype, contiguous) or ``(y, residual_out)`` with
        ``residual_out = x + residual`` (summed in fp32, stored in residual's
        dtype). Differentiable in x, weight, bias and residual; mean/rstd are
        saved only when a gradient is needed. Meta tensors give meta outputs of
        those shapes and dtypes.

    Example::

        y = layer_norm(torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16), w, b)
    """
    # Floats (the custom op's schema takes floats), finite, eps >= 0.
    eps, weight_offset = shared.check_eps(eps), shared.check_weight_offset(weight_offset)
    if not autotune:  # small eager calls: a cached launch plan (None: not such a call)
        out = shared.eager_forward(x, weight, bias, residual, eps, weight_offset, False, _fwd_config)
        if out is not None:
            return out
    shared.check_norm_args(x, weight, bias, residual)
    grad = shared.needs_grad(x, weight, bias, residual)
    if torch.compiler.is_compiling() or shared.on_meta(x):  # traced, or meta tensors: the op (and its fake)
        y, h, _, _ = torch.ops.fly_norm.layer_norm_fwd(x, weight, bias, residual, eps, weight_offset, grad)
    elif grad:
        y, h, _, _ = _EagerLayerNorm.apply(x, weight, bias, residual, eps, weight_offset, grad)
    elif autotune:  # eager inference that searches configs: the general path
        y, h, _, _ = _layer_norm_forward(x, weight, bias, residual, eps, weight_offset, False, autotune, False)
    else:
        # Eager inference the cached plan did not take (the split widths, layouts it does not cover): the
        # forward's replayed route, as the autograd forward's (the dispatcher costs microseconds per call)
        y, h, _, _ = _FWD_REPLAYS.eager(_layer_norm_forward, x, weight, bias, residual, eps, weight_offset, False,
                                        None)  # fmt: skip
    return y if residual is None else (y, h)


def layer_norm_quant(x, weight, bias, eps=1e-5, *, dtype=torch.int8, smooth_scale=None, residual=None):
    """LayerNorm then per-row dynamic int8 / fp8 e4m3 quantization (the seed's DynamicQuant / SmoothQuant).

    Same conventions as :func:`fly_norm.rmsnorm.rms_norm_quant`: weight, bias
    and residual must have x's dtype, smooth_scale fp32 or x's dtype; returns
    ``(q, scale)`` or ``(q, scale, residual_out)`` with fp32 per-row scales.
    """
    shared.check_norm_args(x, weight, bias, residual, smooth_scale, quant_dtype=dtype)
    eps = shared.check_eps(eps)
    # Inference only (integer outputs): detached operands keep autograd from
    # looking for a backward of the quantizing op.
    x, weight, bias, residual, smooth_scale = shared.detach_all(x, weight, bias, residual, smooth_scale)
    if torch.compiler.is_compiling() or shared.on_meta(x):  # traced, or meta tensors: the op (and its fake)
        q, scale, h = torch.ops.fly_norm.layer_norm_quant(x, weight, bias, residual, smooth_scale, eps, dtype)
    else:
        q, scale, h = _layer_norm_quant(x, weight, bias, residual, smooth_scale, eps, dtype)
    return (q, scale) if residual is None else (q, scale, h)


# ---------------------------------------------------------------- seed builder


def build_layernorm_module(N, dtype_str):
    """The seed's builder: ``launch(Input, Gamma, Beta, Output, m_in, stream=None)`` with eps = 1e-5.

    Buffers are contiguous ``[>= m_in, N]`` rows of ``dtype_str`` ("f32" /
    "f16" / "bf16"), Gamma and Beta ``[N]`` of the same dtype; ``m_in`` is
    the runtime row count.
    """
    dtype, _ = shared.builder_dtypes(dtype_str, None)

    @flyc.jit
    def launch_layernorm(Input, Gamma, Beta, Output, m_in, stream=None):  # noqa: N803 - the seed's names
        x2 = shared.builder_rows("Input", Input, N, m_in, dtype)
        y2 = shared.builder_rows("Output", Output, N, m_in, dtype)
        shared.builder_rows("Gamma", Gamma, N, 1, dtype)
        shared.builder_rows("Beta", Beta, N, 1, dtype)
        layernorm_fwd(x2, Gamma, Beta, y2)

    return launch_layernorm
