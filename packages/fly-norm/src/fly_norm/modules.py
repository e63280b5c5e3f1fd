"""nn.Module drop-ins: FlyLayerNorm, FlyRMSNorm, FlySoftmax.

Each subclasses the torch module it replaces (same constructor, parameters,
state_dict keys and ``extra_repr``), so swapping the class is the whole port:

    model.norm = FlyRMSNorm(4096, eps=1e-6)   # was nn.RMSNorm(4096, eps=1e-6)

A ``normalized_shape`` of several dimensions is served by viewing those
dimensions as one row (the kernels normalize the last dimension).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["FlyLayerNorm", "FlyRMSNorm", "FlySoftmax"]


def _rows_view(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    k = len(normalized_shape)
    if tuple(x.shape[-k:]) != tuple(normalized_shape):
        raise ValueError(f"input: expected trailing shape {tuple(normalized_shape)}, got shape {tuple(x.shape)}")
    n = math.prod(normalized_shape)
    return (x if k == 1 else x.reshape(*x.shape[: x.dim() - k], n)), n


def _flat(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.reshape(-1)


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
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        y = rms_norm(rows, _flat(self.weight), eps)
        return y.view(x.shape)


class FlySoftmax(nn.Softmax):
    """``nn.Softmax(dim)`` computed by :func:`fly_norm.softmax`; ``dim`` must be given."""

    def __init__(self, dim: int | None = None) -> None:
        if dim is None:
            raise ValueError("dim: FlySoftmax needs an explicit dim (torch's implicit choice is deprecated)")
        super().__init__(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .softmax import softmax

        return softmax(x, self.dim)
