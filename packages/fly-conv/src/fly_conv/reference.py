"""fp64 reference of fly-conv's op, imported by tests and benchmarks alike."""

from __future__ import annotations

import torch
from torch import nn

from flydsl_common.reference import activation_ref

__all__ = ["conv_ref"]

_MODULES = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def conv_ref(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros",
             activation=None, input_layout=None, output_layout=None, *, x_scale=None,
             w_scale=None) -> torch.Tensor:  # fmt: skip
    """:func:`fly_conv.conv` in float64 through torch's own ``nn.Conv1d/2d/3d`` (its padding modes and
    ``"same"``), on x's device. ``input_layout`` / ``output_layout``: as :func:`fly_conv.conv`, where a
    channels-last name means dims ``[N, *spatial, C]``; the result is contiguous.

    ``x_scale`` / ``w_scale`` (the fp8 forward's dequantization scales): x and the weight are dequantized in
    float64 first, ``x.double() * x_scale`` and ``weight.double() * w_scale`` (a number or one element: per
    tensor; ``[K_out]``: per output channel), then convolved as above."""
    rank = weight.dim() - 2
    batched = x.dim() == rank + 2
    xd = x.double()
    if x_scale is not None:
        xd = xd * torch.as_tensor(x_scale, dtype=torch.float64, device=x.device).reshape(())
    if w_scale is not None:
        ws = torch.as_tensor(w_scale, dtype=torch.float64, device=weight.device)
        ws = ws.reshape(()) if ws.numel() == 1 else ws.reshape(-1, *([1] * (weight.dim() - 1)))
        weight = weight.double() * ws
    if not batched:
        xd = xd.unsqueeze(0)
    if input_layout is not None and input_layout.endswith("C"):
        xd = xd.movedim(-1, 1)
    k_out = weight.shape[0]
    module = _MODULES[rank](xd.shape[1], k_out, tuple(weight.shape[2:]), stride=stride, padding=padding,
                            dilation=dilation, groups=groups, bias=bias is not None, padding_mode=padding_mode,
                            device=x.device, dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        module.weight.copy_(weight.double())
        if bias is not None:
            module.bias.copy_(bias.double())
        y = activation_ref(module(xd), activation)
    layout = output_layout if output_layout is not None else input_layout
    if layout is not None and layout.endswith("C"):
        y = y.movedim(1, -1)
    y = y.contiguous()
    return y if batched else y.squeeze(0)
