"""``nn.Module`` drop-ins: :class:`FlyConv1d`, :class:`FlyConv2d`, :class:`FlyConv3d` (subclasses of torch's)."""

from __future__ import annotations

from torch import nn

from flydsl_common.device import activation_code

from .conv import conv

__all__ = ["FlyConv1d", "FlyConv2d", "FlyConv3d"]


class _FlyConvMixin:
    """The torch module's parameters, state dict and options; the forward through :func:`fly_conv.conv` (every
    padding mode, groups, an optional fused ``activation``), autograd included."""

    def _fly_init(self, activation) -> None:
        activation_code(activation)  # a bad name fails here, naming the argument
        self.activation = activation

    def _conv_forward(self, input, weight, bias):  # noqa: A002 - torch's own argument name
        return conv(input, weight, bias, self.stride, self.padding, self.dilation, self.groups,
                    padding_mode=self.padding_mode, activation=self.activation)  # fmt: skip

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")


class FlyConv1d(_FlyConvMixin, nn.Conv1d):
    """``nn.Conv1d`` on fly-conv's kernels; ``activation`` (None, "relu", "silu", "gelu", "gelu_tanh") is applied
    to the output. Example: ``FlyConv1d(80, 256, 7, padding=3, device="cuda", dtype=torch.bfloat16)``."""

    def __init__(self, *args, activation: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fly_init(activation)


class FlyConv2d(_FlyConvMixin, nn.Conv2d):
    """``nn.Conv2d`` on fly-conv's kernels; ``activation`` as :class:`FlyConv1d`. Example:
    ``FlyConv2d(64, 64, 3, padding=1, bias=False, device="cuda", dtype=torch.bfloat16)``."""

    def __init__(self, *args, activation: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fly_init(activation)


class FlyConv3d(_FlyConvMixin, nn.Conv3d):
    """``nn.Conv3d`` on fly-conv's kernels; ``activation`` as :class:`FlyConv1d`. Example:
    ``FlyConv3d(64, 64, 3, padding=1, device="cuda", dtype=torch.bfloat16)``."""

    def __init__(self, *args, activation: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fly_init(activation)
