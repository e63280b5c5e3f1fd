"""``nn.Module`` drop-ins: :class:`FlyLinear` (a subclass of ``nn.Linear``)."""

from __future__ import annotations

import torch
from torch import nn

from flydsl.errors import ArgumentError
from flydsl_common.device import activation_code

from .linear import linear
from .prepack import prepack

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
        self.packed = None

    def prepack(self, quant: torch.dtype | None = None) -> FlyLinear:
        """Prepare the weight once for inference (:func:`fly_gemm.prepack`; ``quant``: fp8 e4m3 or int8
        per output channel). Later forwards use it; training (a gradient for the weight) needs the plain
        weight, so :meth:`unpack` drops it. Returns self."""
        self.packed = prepack(self.weight.detach(), quant=quant)
        return self

    def unpack(self) -> FlyLinear:
        self.packed = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed", None)
        if packed is not None:
            if torch.is_grad_enabled() and self.weight.requires_grad:
                raise ArgumentError("FlyLinear: a prepacked layer serves inference only; call unpack() to train, "
                                    "or run under torch.no_grad() / with weight.requires_grad_(False)")  # fmt: skip
            return linear(x, packed, self.bias, self.activation)
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")
