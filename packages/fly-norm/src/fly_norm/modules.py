"""nn.Module drop-ins: FlyLayerNorm, FlyRMSNorm, FlySoftmax.

Each subclasses the torch module it replaces (same constructor, parameters,
state_dict keys and ``extra_repr``), so swapping the class is the whole port:

    model.norm = FlyRMSNorm(4096, eps=1e-6)   # was nn.RMSNorm(4096, eps=1e-6)

A ``normalized_shape`` of several dimensions is served by viewing those
dimensions as one row (the kernels normalize the last dimension).

Dtypes follow the torch module's (tests compare every fp32/fp16/bf16 pair of
input and parameter dtypes with torch's module):

- ``FlyRMSNorm``: any fp32/fp16/bf16 weight with any such input, computed in
  fp32; the result has the dtype ``torch.nn.RMSNorm`` gives on the installed
  torch (x's dtype from torch 2.9 on; torch before it multiplied the weight
  after casting back to x's dtype, so the promoted dtype);
- ``FlyLayerNorm``: parameters in x's dtype or fp32 (fp16/bf16 input with fp32
  parameters, torch's rule on the CPU; torch on CUDA takes x's dtype only), the
  result in x's dtype; other pairs raise ``DTypeError``, as torch does.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from flydsl.errors import ArgumentError, ShapeError

__all__ = ["FlyLayerNorm", "FlyRMSNorm", "FlySoftmax"]


def _rows_view(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"input: expected a torch.Tensor, got {type(x).__name__}")
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[-k:]) != tuple(normalized_shape):
        raise ShapeError(
            f"input: expected trailing shape {tuple(normalized_shape)} (normalized_shape), got shape {tuple(x.shape)}"
        )
    n = math.prod(normalized_shape)
    return (x if k == 1 else x.reshape(*x.shape[: x.dim() - k], n)), n


def _flat(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.reshape(-1)


@functools.cache
def _torch_rms_norm_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``torch.nn.functional.rms_norm(x, shape, weight)`` on the installed torch, asked of torch on
    meta tensors (nothing computed; torch 2.9+ warns once that mixed dtypes skip its fused kernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.empty(1, 1, dtype=x_dtype, device="meta")
        return F.rms_norm(x, (1,), torch.empty(1, dtype=w_dtype, device="meta")).dtype


class FlyLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` computed by :func:`fly_norm.layer_norm` (forward and backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .layernorm import layer_norm

        rows, _ = _rows_view(x, self.normalized_shape)
        y = layer_norm(rows, _flat(self.weight), _flat(self.bias), self.eps)
        return y.view(x.shape)


class FlyRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed by :func:`fly_norm.rms_norm`; ``eps=None`` means the dtype's machine epsilon,
    as in torch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .rmsnorm import rms_norm

        rows, _ = _rows_view(x, self.normalized_shape)
        w = _flat(self.weight)
        # eps None: rms_norm takes the machine epsilon of x's dtype, as torch.
        y = rms_norm(rows, w, self.eps).view(x.shape)
        if w is not None and w.dtype != x.dtype:  # computed in fp32 and stored in x's dtype; torch's dtype then
            y = y.to(_torch_rms_norm_dtype(x.dtype, w.dtype))
        return y


class FlySoftmax(nn.Softmax):
    """``nn.Softmax(dim)`` computed by :func:`fly_norm.softmax`; ``dim`` must be given."""

    def __init__(self, dim: int | None = None) -> None:
        if dim is None:
            raise ValueError("dim: FlySoftmax needs an explicit dim (torch's implicit choice is deprecated)")
        super().__init__(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .softmax import softmax

        return softmax(x, self.dim)
