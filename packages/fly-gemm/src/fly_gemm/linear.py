"""``linear``: ``act(x @ weight^T + bias)`` on N-D inputs through :func:`fly_gemm.gemm`, with autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl_common.device import activation_code
from flydsl_common.reference import torch_activation
from flydsl_common.rows import as_rows

from .gemm import gemm
from .prepack import PackedWeight

__all__ = ["linear"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _check_args(x, weight, bias) -> bool:
    """Check linear's tensors, naming each; True when ``weight`` is a :class:`PackedWeight`."""
    check_tensor("x", x, min_ndim=1)
    packed = isinstance(weight, PackedWeight)
    if not packed:
        if not isinstance(weight, torch.Tensor):
            raise ArgumentError(f"weight: expected a torch.Tensor [N, K] or a fly_gemm.PackedWeight, "
                                f"got {type(weight).__name__}")  # fmt: skip
        check_tensor("weight", weight, ndim=2)
    n, k = weight.shape
    if k != x.shape[-1]:
        given = f"PackedWeight of {describe(weight.weight)}" if packed else describe(weight)
        raise ShapeError(f"weight: expected [N, {x.shape[-1]}] (K = x's last dimension), got {given}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != n:
            raise ShapeError(f"bias: expected [{n}] (one per output feature), got {describe(bias)}")
    check_same_device(x=x, weight=weight.weight if packed else weight, bias=bias)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None):
    """``act(x @ weight^T + bias)`` over the last dimension of ``x``, as ``F.linear`` then the activation.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` or a :class:`~fly_gemm.PackedWeight`; bias: optional ``[N]``.
            fp16 / bf16 run the fused GEMM kernel (leading dimensions are viewed as rows without a copy
            when they collapse); other dtypes (fp32, fp64) run ``F.linear`` and the activation in torch.
        activation: None, ``"relu"``, ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``: fused into the epilogue for
            inference; under autograd applied in torch after the GEMM (its backward then keeps the
            pre-activation instead of recomputing the product).

    Returns:
        ``[..., N]`` in x's dtype (meta tensors give a meta result). Differentiable in x, weight and bias
        (the backward runs its two GEMMs through the same kernels); with a PackedWeight, in x and bias
        only (a quantized weight's input gradient uses the dequantized weight, built in the backward).
    """
    packed = _check_args(x, weight, bias)
    if x.dtype not in _KERNEL_DTYPES:
        if packed:
            raise DTypeError(f"x: a PackedWeight runs the fp16 / bf16 kernels, got {describe(x)}")
        activation_code(activation)  # a bad name fails here, naming the argument, as on the kernel path
        z = F.linear(x, weight, bias)
        return torch_activation(z, activation)
    if packed:
        return packed_linear(x, weight, bias, activation)
    if weight.dtype != x.dtype:
        raise DTypeError(f"weight: expected dtype {dtype_name(x.dtype)} (x's), got {describe(weight)}")
    rows = as_rows(x)
    y = gemm(rows, weight, bias=bias, activation=activation)
    return y.view(*x.shape[:-1], weight.shape[0])


def packed_linear(x, packed: PackedWeight, bias, activation, weight: torch.Tensor | None = None):
    """:func:`linear` on a :class:`PackedWeight` (arguments checked by the caller). ``weight``: the module
    parameter the packed copy was made from, if any: a backward that needs its gradient is refused (the
    packed copy is a snapshot for inference, with no gradient path to the parameter)."""
    if not packed.quantized and packed.dtype != x.dtype:
        raise DTypeError(f"weight: expected a PackedWeight of dtype {dtype_name(x.dtype)} (x's), got "
                         f"{dtype_name(packed.dtype)}")  # fmt: skip
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, bias, weight)):
        activation_code(activation)  # a bad name fails here, naming the argument
        # the activation in torch, which keeps the pre-activation for the backward (as gemm does)
        return torch_activation(_PackedLinear.apply(x, bias, weight, packed), activation)
    y = gemm(as_rows(x), packed, bias=bias, activation=activation)
    return y.view(*x.shape[:-1], packed.shape[0])


class _PackedLinear(torch.autograd.Function):
    """Forward through the packed weight, without activation; backward to x and bias only (see
    :func:`packed_linear`)."""

    @staticmethod
    def forward(ctx, x, bias, weight, packed):
        y = gemm(as_rows(x), packed, bias=bias)
        ctx.save_for_backward(x, bias)
        ctx.packed = packed
        return y.view(*x.shape[:-1], packed.shape[0])

    @staticmethod
    def backward(ctx, grad):
        if ctx.needs_input_grad[2]:
            raise UnsupportedError(
                "weight: a prepacked FlyLinear has no weight gradient (its forward reads a packed copy made for "
                "inference); call unpack() before training the weight, or freeze it "
                "(weight.requires_grad_(False)) to backpropagate to the input and bias"
            )
        x, bias = ctx.saved_tensors
        packed = ctx.packed
        g = as_rows(grad)
        dx = dbias = None
        if ctx.needs_input_grad[0]:
            w = packed.weight
            if packed.quantized:  # dx = G @ (codes * scale): the dequantized weight, for this backward only
                w = (w.float() * packed.scale[:, None]).to(x.dtype)
            dx = gemm(g.to(x.dtype), w, b_layout="kn").view(x.shape)  # [M, N] @ [N, K]
        if ctx.needs_input_grad[1]:
            dbias = g.sum(0, dtype=torch.float32).to(bias.dtype)  # fp32 sums without an fp32 copy of g
        return dx, dbias, None, None
