"""``nn.Module`` drop-ins: :class:`FlyLinear` (a subclass of ``nn.Linear``)."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from flydsl.checks import describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError
from flydsl_common.device import activation_code

from .linear import _check_args, linear, packed_linear
from .prepack import prepack

__all__ = ["FlyLinear"]


class FlyLinear(nn.Linear):
    """``nn.Linear`` with the GEMM, bias and an optional activation in one kernel (:func:`fly_gemm.linear`).

    Same parameters and state dict as ``nn.Linear``; ``activation`` (None, ``"relu"``, ``"silu"``,
    ``"gelu_tanh"``, ``"gelu"``) is applied to the output. fp16 / bf16 run the fused kernel; fp32 runs
    torch's. Meta-device layers give meta outputs of the right shape and dtype.

    :meth:`prepack` makes the layer an inference layer: its forward reads a packed (optionally quantized)
    snapshot of the weight, in any grad mode; gradients still reach the input and the bias (QLoRA-style
    frozen bases), but a backward that needs the weight's gradient raises
    :class:`~flydsl.errors.UnsupportedError`: freeze the weight, or :meth:`unpack` to train it.

    Example::

        layer = FlyLinear(4096, 14336, activation="silu", device="cuda", dtype=torch.bfloat16)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: str | None = None):  # fmt: skip
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ArgumentError(f"{name}: expected an integer >= 0, got {type(value).__name__} {value!r}")
        activation_code(activation)  # a bad name fails here, naming the argument
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation
        self.packed = None

    def prepack(self, quant: torch.dtype | None = None) -> FlyLinear:
        """Pack the weight once for inference (:func:`fly_gemm.prepack`; ``quant``: None, fp8 e4m3 or int8
        per output channel); later forwards read the packed copy. Returns self.

        The packed copy is a snapshot: changes to ``weight`` after this call are not seen until the next
        ``prepack()``. Forward works with grad mode on and trainable parameters; the backward reaches the
        input and the bias, and refuses the weight's gradient (:meth:`unpack` to train the weight). Needs an
        fp16 / bf16 layer (the packed path runs the 16-bit kernels).
        """
        if self.weight.dtype not in (torch.float16, torch.bfloat16):
            raise DTypeError(f"weight: FlyLinear.prepack packs fp16 / bf16 layers (the kernels it feeds), got "
                             f"{describe(self.weight)}; convert the layer (.to(torch.bfloat16)) first")  # fmt: skip
        self.packed = prepack(self.weight.detach(), quant=quant)
        return self

    def unpack(self) -> FlyLinear:
        """Drop the packed copy: forwards read ``weight`` again, with its gradient. Returns self."""
        self.packed = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed", None)
        if packed is not None:
            _check_args(x, packed, self.bias)
            if x.dtype != self.weight.dtype:
                raise DTypeError(f"x: expected dtype {dtype_name(self.weight.dtype)} (the prepacked layer's), got "
                                 f"{describe(x)}")  # fmt: skip
            return packed_linear(x, packed, self.bias, self.activation, weight=self.weight)
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")
