"""``nn.Module`` drop-ins: :class:`FlyLinear` (a subclass of ``nn.Linear``)."""

from __future__ import annotations

import torch
from torch import nn

from flydsl_common.device import activation_code

from .linear import linear

__all__ = ["FlyLinear"]


class FlyLinear(nn.Linear):
    """``nn.Linear`` with the GEMM, bias and an optional activation in one kernel (:func:`fly_gemm.linear`).

    Same parameters and state dict as ``nn.Linear``; ``activation`` (None, ``"relu"``, ``"silu"``,
    ``"gelu_tanh"``, ``"gelu"``) is applied to the output. fp16 / bf16 run the fused kernel; fp32 runs
    torch's.

    Example::

        layer = FlyLinear(4096, 14336, activation="silu", device="cuda", dtype=torch.bfloat16)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: str | None = None):  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        activation_code(activation)  # a bad name fails here, naming the argument
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")
