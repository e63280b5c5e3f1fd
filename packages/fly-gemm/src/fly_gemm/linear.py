"""``linear``: ``act(x @ weight^T + bias)`` on N-D inputs through :func:`fly_gemm.gemm`, with autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flydsl.checks import check_tensor, describe
from flydsl.errors import DTypeError
from flydsl_common.reference import torch_activation
from flydsl_common.rows import as_rows

from .gemm import gemm
from .prepack import PackedWeight

__all__ = ["linear"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None):
    """``act(x @ weight^T + bias)`` over the last dimension of ``x``, as ``F.linear`` then the activation.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` or a :class:`~fly_gemm.PackedWeight`; bias: optional ``[N]``.
            fp16 / bf16 run the fused GEMM kernel (leading dimensions are viewed as rows without a copy
            when they collapse); other dtypes (fp32, fp64) run ``F.linear`` and the activation in torch.
        activation: None, ``"relu"``, ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``, fused into the epilogue.

    Returns:
        ``[..., N]`` in x's dtype. Differentiable in x, weight and bias (the backward runs its two GEMMs
        through the same kernels).
    """
    check_tensor("x", x, min_ndim=1)
    if not isinstance(weight, PackedWeight):
        check_tensor("weight", weight, ndim=2)
    if x.dtype not in _KERNEL_DTYPES:
        if isinstance(weight, PackedWeight):
            raise DTypeError(f"x: a PackedWeight runs the fp16 / bf16 kernels, got {describe(x)}")
        z = F.linear(x, weight, bias)
        return torch_activation(z, activation)
    rows = as_rows(x)
    y = gemm(rows, weight, bias=bias, activation=activation)
    return y.view(*x.shape[:-1], weight.shape[0])
