"""The fp8 (e4m3) forward against the fp64 reference of the dequantized inputs (``conv_ref`` with ``x_scale`` /
``w_scale``): ranks, channels, kernel sizes, strides, padding, dilation, groups, per-tensor and per-channel
scales, bias and activation, layouts, output dtypes; and its argument checks.

The inputs are fp8 values (exactly what the kernel reads), so the only error is the fp32 accumulation's order and
the output's rounding: the bf16 (fp16) budget. Every output starts poisoned (NaN). CPU runs go through Triton's
interpreter at small shapes; ``gpu`` tests add ResNet-like layers.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conv_helpers import rand, weight

from fly_conv import conv, conv1d, conv2d, conv3d, conv_ref
from fly_conv.autotune import ConvConfig
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, tolerance

F8, BF16, F16, F32 = torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32

# (rank, N, C_in, K_out, spatial, kernel, stride, padding, dilation, groups): each line says why it is here
CASES = [
    (2, 2, 16, 32, (7, 9), 3, 1, 1, 1, 1),  # 3x3, odd spatial sizes
    (2, 1, 48, 16, (9, 8), 3, 2, 2, 2, 1),  # 48 channels (a ragged second block of 32), stride 2, dilation 2
    (2, 2, 32, 48, (5, 5), 1, 1, 0, 1, 1),  # 1x1 pointwise: the GEMM path
    (2, 1, 16, 16, (7, 6), 1, 2, 0, 1, 1),  # 1x1 with stride: the general path
    (2, 2, 32, 32, (6, 7), 3, 1, 1, 1, 2),  # groups 2 (16 channels a group)
    (2, 1, 48, 32, (5, 7), 3, 1, 0, 1, 2),  # groups 2, 24 channels a group (ragged), no padding
    (1, 2, 32, 16, (19,), 3, 2, 1, 1, 1),  # 1D strided
    (1, 2, 16, 48, (23,), 3, 1, 3, 3, 1),  # 1D dilation 3
    (3, 1, 16, 16, (3, 5, 4), 3, 1, 1, 1, 1),  # 3D 3x3x3, odd sizes
    (3, 1, 32, 16, (4, 3, 5), 1, 1, 0, 1, 2),  # 3D pointwise, grouped
    (3, 1, 16, 32, (5, 6, 5), 3, 2, 1, (1, 2, 1), 1),  # 3D strided, per-dim dilation
]


def _fp8_inputs(case, device):
    """fp8 x and weight (unit-scale values, exactly representable: the reference reads what the kernel reads)."""
    rank, n, c, k, spatial, ks, _, _, _, groups = case
    x = rand(n, c, *spatial, dtype=F32, device=device).to(F8)
    w = weight(k, c // groups, (ks,) * rank, dtype=F32, device=device).mul(4).to(F8)
    return x, w


def _scales(kind: str, k_out: int, device):
    g = torch.Generator().manual_seed(7)
    xs = (torch.rand(1, generator=g) + 0.5).to(device)
    if kind == "tensor":
        return xs, (torch.rand((), generator=g) * 0.25 + 0.125).to(device)
    return xs, (torch.rand(k_out, generator=g) * 0.25 + 0.125).to(device)


def _geometry(case) -> dict:
    _, _, _, _, _, _, stride, padding, dilation, groups = case
    return dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def _ids(c):
    return f"{c[0]}d-c{c[2]}-k{c[3]}-ks{c[5]}-s{c[6]}-d{c[8]}-g{c[9]}"


@pytest.mark.parametrize("scale", ["tensor", "channel"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fp8_forward_cases(case, scale, device, poisoned):
    x, w = _fp8_inputs(case, device)
    xs, ws = _scales(scale, w.shape[0], device)
    b = rand(w.shape[0], dtype=F32, device=device, seed=2)
    y = conv(x, w, b, **_geometry(case), x_scale=xs, w_scale=ws)
    ref = conv_ref(x, w, b, **_geometry(case), x_scale=xs, w_scale=ws)
    assert y.dtype == BF16 and y.shape == ref.shape
    assert_rel_close(y, ref, tol=tolerance(BF16))


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu", "gelu_tanh"])
def test_fp8_bias_activation(activation, device, poisoned):
    case = CASES[4]
    x, w = _fp8_inputs(case, device)
    xs, ws = _scales("channel", w.shape[0], device)
    b = rand(w.shape[0], dtype=BF16, device=device, seed=3)  # a bf16 bias, added in fp32
    y = conv(x, w, b, **_geometry(case), activation=activation, x_scale=xs, w_scale=ws)
    ref = conv_ref(x, w, b, **_geometry(case), activation=activation, x_scale=xs, w_scale=ws)
    assert_rel_close(y, ref, tol=tolerance(BF16))


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["implicit", "pointwise"])
def test_fp8_fp16_output_numbers_and_no_bias(case, device, poisoned):
    """out_dtype fp16; scales as plain numbers; no bias."""
    x, w = _fp8_inputs(case, device)
    y = conv(x, w, None, **_geometry(case), x_scale=0.75, w_scale=0.25, out_dtype=F16)
    ref = conv_ref(x, w, None, **_geometry(case), x_scale=0.75, w_scale=0.25)
    assert y.dtype == F16
    assert_rel_close(y, ref, tol=tolerance(F16))


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "nhwc"])
def test_fp8_layouts(layout, device, poisoned):
    """An NC* input takes the same channels-last copy as a 16-bit one; channels-last memory and N*C read in
    place; the output follows the input's layout."""
    case = CASES[0]
    x, w = _fp8_inputs(case, device)
    xs, ws = _scales("channel", w.shape[0], device)
    kw = dict(**_geometry(case), x_scale=xs, w_scale=ws)
    if layout == "channels_last":
        xl = x.float().to(memory_format=torch.channels_last).to(F8)
        assert xl.dtype == F8
        y = conv(xl, w, **kw)
        assert y.is_contiguous(memory_format=torch.channels_last)
        ref = conv_ref(x, w, **kw)
    elif layout == "nhwc":
        xl = x.movedim(1, -1).contiguous()
        y = conv(xl, w, **kw, input_layout="NHWC")
        ref = conv_ref(xl, w, **kw, input_layout="NHWC")
    else:
        y = conv(x, w, **kw)
        ref = conv_ref(x, w, **kw)
    assert y.shape == ref.shape
    assert_rel_close(y, ref, tol=tolerance(BF16))


def test_fp8_padding_mode_unbatched_and_rank_functions(device, poisoned):
    x, w = _fp8_inputs(CASES[0], device)
    xs, ws = _scales("tensor", w.shape[0], device)
    y = conv(x, w, padding=1, padding_mode="reflect", x_scale=xs, w_scale=ws)
    ref = conv_ref(x, w, padding=1, padding_mode="reflect", x_scale=xs, w_scale=ws)
    assert_rel_close(y, ref, tol=tolerance(BF16))
    y = conv2d(x[0], w, None, 1, 1, x_scale=xs, w_scale=ws)  # unbatched
    assert_rel_close(y, conv_ref(x[0], w, None, 1, 1, x_scale=xs, w_scale=ws), tol=tolerance(BF16))
    x1, w1 = _fp8_inputs(CASES[6], device)
    y = conv1d(x1, w1, None, 2, 1, x_scale=xs, w_scale=0.5, out_dtype=F16)
    assert y.dtype == F16
    assert_rel_close(y, conv_ref(x1, w1, None, 2, 1, x_scale=xs, w_scale=0.5), tol=tolerance(F16))
    x3, w3 = _fp8_inputs(CASES[8], device)
    y = conv3d(x3, w3, None, 1, 1, x_scale=xs, w_scale=ws)
    assert_rel_close(y, conv_ref(x3, w3, None, 1, 1, x_scale=xs, w_scale=ws), tol=tolerance(BF16))


def test_fp8_given_config(device, poisoned):
    x, w = _fp8_inputs(CASES[1], device)
    xs, ws = _scales("channel", w.shape[0], device)
    y = conv(x, w, **_geometry(CASES[1]), x_scale=xs, w_scale=ws, config=ConvConfig(16, 16, 32, num_stages=1))
    assert_rel_close(y, conv_ref(x, w, **_geometry(CASES[1]), x_scale=xs, w_scale=ws), tol=tolerance(BF16))
    with pytest.raises(ArgumentError, match="config"):  # an 8-bit dot's K is at least 32
        conv(x, w, **_geometry(CASES[1]), x_scale=xs, w_scale=ws, config=ConvConfig(16, 16, 16, num_stages=1))


@pytest.mark.parametrize("scale", ["tensor", "channel"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[8], (2, 1, 48, 40, (7, 6), 3, 1, 2, 2, 1)],
                         ids=["3x3", "1x1", "3d", "48-to-40-dilated"])  # fmt: skip
def test_fp8_row_block_forward(case, scale, device, poisoned, monkeypatch):
    """The row-block forward on fp8 operands (a tap's input rows one shift away, loaded as blocks; the
    padding's wrapped rows zeroed) with the dequantization scales in its epilogue, under a ``tma`` config:
    the dequantized reference's output, and the row-block kernel ran. 48 channels: a ragged channel step."""
    conv_mod = importlib.import_module("fly_conv.conv")  # the module: the package's ``conv`` is the function
    real, launches = conv_mod.launch_rows_gemm, []
    monkeypatch.setattr(conv_mod, "launch_rows_gemm", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    x, w = _fp8_inputs(case, device)
    x = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels-last: the kernel's rows
    xs, ws = _scales(scale, w.shape[0], device)
    b = rand(w.shape[0], dtype=F32, device=device, seed=2)
    cfg = ConvConfig(16, 16, 32, num_stages=1, tma=True)
    y = conv(x, w, b, **_geometry(case), x_scale=xs, w_scale=ws, activation="silu", config=cfg)
    ref = conv_ref(x, w, b, **_geometry(case), x_scale=xs, w_scale=ws, activation="silu")
    assert_rel_close(y, ref, tol=tolerance(BF16))
    assert launches


# ------------------------------------------------------------------------------ bad input


def _small(device):
    x = rand(1, 16, 5, 5, dtype=F32, device=device).to(F8)
    w = rand(8, 16, 3, 3, dtype=F32, device=device, seed=1).to(F8)
    return x, w


def test_fp8_needs_both_scales(device):
    x, w = _small(device)
    with pytest.raises(ArgumentError, match="x_scale: required for float8_e4m3fn"):
        conv(x, w, w_scale=1.0)
    with pytest.raises(ArgumentError, match="w_scale: required for float8_e4m3fn"):
        conv(x, w, x_scale=1.0)


def test_scales_refused_for_16_bit_inputs(device):
    x, w = rand(1, 16, 5, 5, dtype=BF16, device=device), rand(8, 16, 3, 3, dtype=BF16, device=device)
    with pytest.raises(ArgumentError, match="x_scale: a dequantization scale is for float8_e4m3fn inputs only"):
        conv(x, w, x_scale=1.0)
    with pytest.raises(ArgumentError, match="w_scale: a dequantization scale is for float8_e4m3fn inputs only"):
        conv(x, w, w_scale=torch.ones(8, device=device))
    with pytest.raises(DTypeError, match="out_dtype"):
        conv(x, w, out_dtype=F16)


def test_fp8_scale_shapes_dtypes_and_types(device):
    x, w = _small(device)
    with pytest.raises(ShapeError, match=r"x_scale: expected one element \(per tensor\)"):
        conv(x, w, x_scale=torch.ones(8, device=device), w_scale=1.0)
    with pytest.raises(ShapeError, match=r"w_scale: expected one element or \[8\]"):
        conv(x, w, x_scale=1.0, w_scale=torch.ones(16, device=device))
    with pytest.raises(ShapeError, match="w_scale"):
        conv(x, w, x_scale=1.0, w_scale=torch.ones(8, 1, device=device))
    with pytest.raises(DTypeError, match="w_scale"):
        conv(x, w, x_scale=1.0, w_scale=torch.ones(8, dtype=torch.float64, device=device))
    with pytest.raises(DTypeError, match="x_scale"):
        conv(x, w, x_scale=torch.ones(1, dtype=BF16, device=device), w_scale=1.0)
    with pytest.raises(ArgumentError, match="x_scale: expected a number or an fp32 tensor, got str"):
        conv(x, w, x_scale="1", w_scale=1.0)
    with pytest.raises(ArgumentError, match="w_scale"):
        conv(x, w, x_scale=1.0, w_scale=True)


def test_fp8_out_dtype_and_mixed_dtypes(device):
    x, w = _small(device)
    with pytest.raises(DTypeError, match="out_dtype: the fp8 forward writes bf16 or fp16"):
        conv(x, w, x_scale=1.0, w_scale=1.0, out_dtype=F32)
    with pytest.raises(DTypeError, match="out_dtype"):
        conv(x, w, x_scale=1.0, w_scale=1.0, out_dtype=F8)
    with pytest.raises(DTypeError, match="weight: expected dtype"):
        conv(x, w.float().to(BF16), x_scale=1.0, w_scale=1.0)
    with pytest.raises(DTypeError, match="x"):
        conv(x.float().to(torch.float8_e5m2), w.float().to(torch.float8_e5m2), x_scale=1.0, w_scale=1.0)


def test_fp8_depthwise_and_backward_are_unsupported(device):
    x = rand(1, 16, 5, 5, dtype=F32, device=device).to(F8)
    w = rand(16, 1, 3, 3, dtype=F32, device=device, seed=1).to(F8)
    with pytest.raises(UnsupportedError, match="groups: depthwise fp8"):
        conv(x, w, groups=16, x_scale=1.0, w_scale=1.0)
    x, w = _small(device)
    b = torch.zeros(8, device=device, requires_grad=True)
    with pytest.raises(UnsupportedError, match="bias: requires grad, and the fp8 forward has no backward"):
        conv(x, w, b, x_scale=1.0, w_scale=1.0)
    with torch.no_grad():  # no gradient asked: the forward runs
        assert conv(x, w, b, x_scale=1.0, w_scale=1.0).dtype == BF16


# ------------------------------------------------------------------------------ GPU: ResNet-like layers

# (N, C_in, K_out, size, kernel, stride, groups)
GPU_LAYERS = [
    (8, 64, 64, 56, 3, 1, 1),  # ResNet stage 1 3x3
    (8, 128, 128, 28, 3, 2, 1),  # a strided 3x3
    (8, 256, 1024, 14, 1, 1, 1),  # bottleneck expansion 1x1
    (8, 256, 256, 28, 3, 1, 8),  # ResNeXt-style grouped, 32 channels a group
]


@pytest.mark.gpu
@pytest.mark.parametrize("layer", GPU_LAYERS, ids=lambda v: f"c{v[1]}-k{v[2]}-{v[3]}-ks{v[4]}-s{v[5]}-g{v[6]}")
@pytest.mark.parametrize("scale", ["tensor", "channel"])
def test_fp8_gpu_layers(layer, scale, device, poisoned):
    n, c, k, size, ks, stride, groups = layer
    x = rand(n, c, size, size, dtype=F32, device=device).to(memory_format=torch.channels_last).to(F8)
    w = weight(k, c // groups, (ks, ks), dtype=F32, device=device).mul(4).to(F8)
    xs, ws = _scales(scale, k, device)
    b = rand(k, dtype=F32, device=device, seed=2)
    kw = dict(stride=stride, padding=ks // 2, groups=groups, activation="relu", x_scale=xs, w_scale=ws)
    y = conv(x, w, b, **kw)
    assert y.dtype == BF16 and y.is_contiguous(memory_format=torch.channels_last)
    assert_rel_close(y, conv_ref(x, w, b, **kw), tol=tolerance(BF16))
    y2 = conv(x, w, b, **kw)  # a second call of the kind: the replay
    assert torch.equal(y2, y)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [GPU_LAYERS[0], GPU_LAYERS[2]], ids=["3x3-c64", "1x1-c256-k1024"])
def test_fp8_row_block_gpu_layers(layer, device, poisoned):
    """The row-block fp8 forward at ResNet sizes on a tile of the tuning space (128 x 128, K steps of 128)."""
    n, c, k, size, ks, stride, groups = layer
    x = rand(n, c, size, size, dtype=F32, device=device).to(memory_format=torch.channels_last).to(F8)
    w = weight(k, c, (ks, ks), dtype=F32, device=device).mul(4).to(F8)
    xs, ws = _scales("channel", k, device)
    kw = dict(padding=ks // 2, activation="relu", x_scale=xs, w_scale=ws)
    cfg = ConvConfig(128, 128, 128, num_warps=8, num_stages=3, tma=True)
    y = conv(x, w, None, **kw, config=cfg)
    assert_rel_close(y, conv_ref(x, w, None, **kw), tol=tolerance(BF16))
