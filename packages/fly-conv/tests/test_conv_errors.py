"""Bad input raises flydsl.errors naming the argument, before anything launches."""

from __future__ import annotations

import pytest
import torch
from conv_helpers import rand, weight

from fly_conv import FlyConv2d, conv, conv1d, conv2d, conv3d
from flydsl.errors import ArgumentError, DTypeError, ShapeError

F16 = torch.float16


def _x(*shape, dtype=F16):
    return rand(*shape, dtype=dtype, device="cpu")


def _w(k, c, *kernel, dtype=F16):
    return weight(k, c, kernel, dtype=dtype, device="cpu")


# (what, call, error type, text the message must hold)
BAD = [
    ("channels not divisible by groups", lambda: conv(_x(1, 6, 5, 5), _w(4, 3, 3, 3), groups=4), ShapeError,
     "groups: x has C_in = 6"),
    ("output channels not divisible by groups", lambda: conv(_x(1, 6, 5, 5), _w(5, 3, 3, 3), groups=2), ShapeError,
     "groups: weight has K_out = 5"),
    ("weight channels do not match", lambda: conv(_x(1, 6, 5, 5), _w(4, 4, 3, 3), groups=2), ShapeError, "weight:"),
    ("weight rank for conv2d", lambda: conv2d(_x(1, 3, 5, 5), _w(4, 3, 3)), ShapeError, "weight: conv2d expects"),
    ("weight rank for conv3d", lambda: conv3d(_x(1, 3, 5, 5, 5), _w(4, 3, 3, 3)), ShapeError, "weight: conv3d"),
    ("weight rank for conv1d", lambda: conv1d(_x(1, 3, 5), _w(4, 3, 3, 3)), ShapeError, "weight: conv1d"),
    ("weight of rank 2", lambda: conv(_x(1, 3, 5), torch.ones(4, 3, dtype=F16)), ShapeError, "weight:"),
    ("x rank against the weight's", lambda: conv(_x(3, 5), _w(4, 3, 3, 3)), ShapeError, "x: expected"),
    ("output size 0", lambda: conv(_x(1, 3, 2, 5), _w(4, 3, 3, 3)), ShapeError, "x: spatial size"),
    ("output size 0 by dilation", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), dilation=3), ShapeError, "x:"),
    ("dtype mix", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3, dtype=torch.float32)), DTypeError, "weight: expected"),
    ("int input", lambda: conv(torch.ones(1, 3, 5, 5, dtype=torch.int32), _w(4, 3, 3, 3)), DTypeError, "x: expected"),
    ("bias shape", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), torch.ones(5, dtype=F16)), ShapeError, "bias:"),
    ("bias type", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), [1.0] * 4), ArgumentError, "bias:"),
    ("stride 0", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), stride=0), ArgumentError, "stride:"),
    ("stride of the wrong length", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), stride=(1, 1, 1)), ArgumentError,
     "stride:"),
    ("negative padding", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), padding=-1), ArgumentError, "padding:"),
    ("padding name", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), padding="full"), ArgumentError, "padding:"),
    ("same with stride", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), padding="same", stride=2), ArgumentError,
     "padding: 'same'"),
    ("dilation 0", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), dilation=0), ArgumentError, "dilation:"),
    ("groups 0", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), groups=0), ArgumentError, "groups:"),
    ("padding mode", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), padding=1, padding_mode="mirror"), ArgumentError,
     "padding_mode:"),
    ("reflect past the size", lambda: conv(_x(1, 3, 3, 5), _w(4, 3, 3, 3), padding=3, padding_mode="reflect"),
     ArgumentError, "padding: reflect"),
    ("activation", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), activation="tanh"), ArgumentError, "activation:"),
    ("input layout", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), input_layout="NDHWC"), ArgumentError,
     "input_layout:"),
    ("output layout", lambda: conv(_x(1, 3, 5, 5), _w(4, 3, 3, 3), output_layout="nchw"), ArgumentError,
     "output_layout:"),
    ("x not a tensor", lambda: conv([[1.0]], _w(4, 3, 3, 3)), ArgumentError, "x: expected a torch.Tensor"),
    ("weight not a tensor", lambda: conv(_x(1, 3, 5, 5), None), ArgumentError, "weight: expected a torch.Tensor"),
    ("module activation", lambda: FlyConv2d(3, 4, 3, activation="swish"), ArgumentError, "activation:"),
]  # fmt: skip


@pytest.mark.parametrize("call,error,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_named(call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


def test_config_refused_under_autograd():
    x = _x(1, 3, 5, 5).requires_grad_(True)
    from fly_conv import ConvConfig

    with pytest.raises(ArgumentError, match="config:"):
        conv(x, _w(4, 3, 3, 3), config=ConvConfig(16, 16, 16))
