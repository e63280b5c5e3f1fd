"""conv forward against the fp64 reference (torch's own convolutions): ranks, channels, kernel sizes, strides,
dilations, groups (depthwise included), padding forms and modes, layouts in and out, bias and activations.

CPU runs go through Triton's interpreter at small shapes (fp16 and fp32; bf16 in a few cases: flydsl.expr.dot
widens it there); ``gpu`` tests add bf16 at real layer sizes. Every output starts poisoned (NaN).
"""

from __future__ import annotations

import pytest
import torch
from conv_helpers import rand, weight

import fly_conv
from fly_conv import conv, conv1d, conv2d, conv3d, conv_ref
from flydsl.testing import assert_rel_close, tolerance

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# (rank, N, C_in, K_out, spatial, kernel, stride, padding, dilation, groups): each line says why it is here
CASES = [
    (2, 2, 3, 8, (7, 9), 3, 1, 1, 1, 1),  # RGB stem-like, odd spatial sizes
    (2, 1, 1, 4, (6, 5), 3, 1, 0, 1, 1),  # one input channel, no padding
    (2, 2, 17, 5, (9, 8), 3, 2, 2, 2, 1),  # 17 channels (a ragged channel block), stride 2, dilation 2
    (2, 1, 64, 16, (5, 5), 1, 1, 0, 1, 1),  # 1x1 pointwise: the GEMM path
    (2, 2, 6, 8, (7, 5), 1, 2, 0, 1, 1),  # 1x1 with stride: the general path
    (2, 1, 5, 7, (11, 10), 5, 3, 2, 1, 1),  # kernel 5, stride 3
    (2, 1, 4, 6, (15, 13), 7, 1, 3, 3, 1),  # kernel 7, dilation 3
    (2, 2, 8, 12, (7, 7), 3, 1, 1, 1, 2),  # groups 2 (4 channels a group: the direct kernel)
    (2, 1, 64, 64, (5, 4), 3, 1, 1, 1, 32),  # groups 32 (ResNeXt-style: 2 channels a group)
    (2, 2, 8, 8, (9, 9), 3, 1, 1, 1, 8),  # depthwise 3x3
    (2, 1, 6, 12, (10, 9), 7, 2, 3, 1, 6),  # depthwise 7x7, multiplier 2, stride 2
    (1, 2, 17, 9, (23,), 11, 3, 5, 2, 1),  # 1D: kernel 11, stride 3, dilation 2
    (1, 2, 8, 16, (19,), 7, 1, 3, 1, 1),  # 1D audio-style k = 7
    (1, 2, 6, 6, (15,), 3, 1, 1, 1, 6),  # 1D depthwise
    (3, 1, 4, 6, (3, 5, 4), 3, 1, 1, 1, 2),  # 3D 3x3x3, grouped, odd sizes
    (3, 2, 5, 3, (4, 3, 5), 1, 1, 0, 1, 1),  # 3D pointwise
    (2, 2, 16, 24, (9, 8), 3, 2, 1, 2, 2),  # 8 channels a group (the direct kernel's widest), 12 out, strided
    (2, 1, 18, 8, (7, 6), 3, 1, 1, 1, 2),  # 9 channels a group: the implicit GEMM again
    (1, 2, 12, 6, (17,), 5, 2, 2, 1, 3),  # 1D, 4 channels a group into 2 each, stride 2
    (2, 2, 9, 15, (6, 7), 3, 1, 1, 1, 3),  # 3 channels a group into 5: both padded to powers of two
    (3, 1, 3, 4, (5, 6, 5), 3, 2, 1, (1, 2, 1), 1),  # 3D strided, per-dim dilation
]


def _run(case, dtype, device, bias=True, activation=None, **kw):
    rank, n, c, k, spatial, ks, stride, padding, dilation, groups = case
    x = rand(n, c, *spatial, dtype=dtype, device=device)
    w = weight(k, c // groups, (ks,) * rank, dtype=dtype, device=device)
    b = rand(k, dtype=dtype, device=device, seed=2) if bias else None
    args = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, activation=activation, **kw)
    return conv(x, w, b, **args), conv_ref(x, w, b, **args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}d-c{c[2]}-k{c[3]}-ks{c[5]}-s{c[6]}-d{c[8]}-g{c[9]}")
def test_forward_cases(case, device, poisoned):
    y, ref = _run(case, F16, device)
    assert y.dtype == F16 and y.shape == ref.shape
    assert_rel_close(y, ref, tol=tolerance(F16))


@pytest.mark.parametrize("case", [CASES[2], CASES[9], CASES[11], CASES[17]], ids=["implicit", "depthwise", "1d",
                                                                               "narrow-groups"])
def test_forward_fp32(case, device, poisoned):
    y, ref = _run(case, F32, device)
    assert_rel_close(y, ref, tol=1e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[9]], ids=["implicit", "pointwise", "depthwise"])
def test_forward_bf16(case, device, poisoned):
    y, ref = _run(case, BF16, device)
    assert_rel_close(y, ref, tol=tolerance(BF16))


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("case", [CASES[0], CASES[9], CASES[19]], ids=["implicit", "depthwise", "narrow-groups"])
def test_bias_activation(case, activation, device, poisoned):
    y, ref = _run(case, F16, device, activation=activation)
    assert_rel_close(y, ref, tol=tolerance(F16))


def test_no_bias(device, poisoned):
    y, ref = _run(CASES[2], F16, device, bias=False)
    assert_rel_close(y, ref, tol=tolerance(F16))


# padding modes: every rank, symmetric and per-dim padding, "same" with an even kernel (one extra after)
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")  # the reference's (torch)
@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize(
    "case,padding",
    [((2, 2, 4, 6, (6, 7), 3, 1, 1, 1, 1), (1, 2)), ((2, 1, 4, 6, (6, 7), 4, 1, 0, 1, 1), "same"),
     ((1, 2, 3, 5, (9,), 5, 2, 2, 1, 1), 2), ((3, 1, 2, 3, (3, 4, 5), 3, 1, 1, 1, 1), 1)],
    ids=["2d-tuple", "2d-same-even", "1d-strided", "3d"],
)  # fmt: skip
def test_padding_modes(case, padding, mode, device, poisoned):
    case = case[:7] + (padding,) + case[8:]
    y, ref = _run(case, F16, device, padding_mode=mode)
    assert_rel_close(y, ref, tol=tolerance(F16))


def test_padding_valid_and_same(device, poisoned):
    for padding in ("valid", "same"):
        y, ref = _run((2, 2, 5, 4, (7, 6), 3, 1, padding, 2, 1), F16, device)
        assert_rel_close(y, ref, tol=tolerance(F16))


# ------------------------------------------------------------------------------ layouts

LAYOUT_CASES = [(2, 2, 5, 6, (6, 7), 3, 1, 1, 1, 1), (2, 1, 8, 6, (5, 5), 1, 1, 0, 1, 1),
                (2, 1, 6, 6, (5, 6), 3, 1, 1, 1, 6), (1, 2, 4, 5, (9,), 3, 1, 1, 1, 1),
                (3, 1, 3, 4, (3, 4, 5), 3, 1, 1, 1, 1)]  # fmt: skip
_CL_FORMAT = {2: torch.channels_last, 3: torch.channels_last_3d}


def _inputs(case, device, dtype=F16):
    rank, n, c, k, spatial, ks, stride, padding, dilation, groups = case
    x = rand(n, c, *spatial, dtype=dtype, device=device)
    w = weight(k, c // groups, (ks,) * rank, dtype=dtype, device=device)
    b = rand(k, dtype=dtype, device=device, seed=2)
    return x, w, b, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def _channels_last_memory(x):
    return x.movedim(1, -1).contiguous().movedim(-1, 1)


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=["2d", "2d-1x1", "2d-depthwise", "1d", "3d"])
def test_memory_format_follows_input(case, device, poisoned):
    x, w, b, kw = _inputs(case, device)
    ref = conv_ref(x, w, b, **kw)
    y = conv(x, w, b, **kw)  # NC* contiguous in, NC* contiguous out
    assert y.is_contiguous()
    assert_rel_close(y, ref, tol=tolerance(F16))
    xc = _channels_last_memory(x)  # channels-last memory in: channels-last memory out
    y = conv(xc, w, b, **kw)
    assert y.movedim(1, -1).is_contiguous() and not y.is_contiguous()
    if x.dim() - 2 in _CL_FORMAT:
        assert y.is_contiguous(memory_format=_CL_FORMAT[x.dim() - 2])
    assert_rel_close(y, ref, tol=tolerance(F16))


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=["2d", "2d-1x1", "2d-depthwise", "1d", "3d"])
def test_explicit_layouts(case, device, poisoned):
    x, w, b, kw = _inputs(case, device)
    rank = w.dim() - 2
    cf, cl = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}[rank]
    x_cl = x.movedim(1, -1).contiguous()  # dims [N, *spatial, C]
    for in_layout, xin in ((cf, x), (cl, x_cl)):
        for out_layout in (None, cf, cl):
            y = conv(xin, w, b, input_layout=in_layout, output_layout=out_layout, **kw)
            ref = conv_ref(xin, w, b, input_layout=in_layout, output_layout=out_layout, **kw)
            assert y.shape == ref.shape and y.is_contiguous(), (in_layout, out_layout)
            assert_rel_close(y, ref, tol=tolerance(F16), name=f"{in_layout}->{out_layout}")


def test_strided_input_views(device, poisoned):
    """Non-contiguous inputs (a channel slice, a spatial step) are read through their strides."""
    x = rand(2, 12, 9, 10, dtype=F16, device=device)[:, 2:9, ::2, 1:]
    for x_in in (x, x.movedim(1, -1).contiguous()[:, :, :, 1:6].movedim(-1, 1)):
        w = weight(6, x_in.shape[1], (3, 3), dtype=F16, device=device)
        assert_rel_close(conv(x_in, w, padding=1), conv_ref(x_in, w, padding=1), tol=tolerance(F16))


@pytest.mark.parametrize("groups", [8, 2], ids=["depthwise", "narrow-groups"])
def test_direct_kernel_non_contiguous_weight(groups, device, poisoned):
    """The direct kernel's weight is transposed on the host: a strided weight (every other filter of a larger
    one, a 3x3 window of 3x4 taps) takes torch's copy instead of the transpose kernel, with the same result."""
    x = rand(2, 8, 7, 6, dtype=F16, device=device)
    big = weight(16, 8 // groups, (3, 3), dtype=F16, device=device)
    for w in (big[::2], weight(8, 8 // groups, (3, 4), dtype=F16, device=device)[..., 1:]):
        assert not w.is_contiguous()
        assert_rel_close(conv(x, w, padding=1, groups=groups), conv_ref(x, w, padding=1, groups=groups),
                         tol=tolerance(F16))  # fmt: skip


def test_unbatched(device, poisoned):
    x = rand(5, 7, 6, dtype=F16, device=device)
    w = weight(4, 5, (3, 3), dtype=F16, device=device)
    y = conv(x, w, padding=1, stride=(2, 1))
    assert y.shape == (4, 4, 6)
    assert_rel_close(y, conv_ref(x, w, padding=1, stride=(2, 1)), tol=tolerance(F16))


def test_wrappers_match_torch_signatures(device, poisoned):
    for fn, rank in ((conv1d, 1), (conv2d, 2), (conv3d, 3)):
        x = rand(2, 4, *([5] * rank), dtype=F16, device=device)
        w = weight(6, 2, (3,) * rank, dtype=F16, device=device)
        b = rand(6, dtype=F16, device=device)
        y = fn(x, w, b, 1, 1, 1, 2)  # positional, as torch.nn.functional.conv{1,2,3}d
        assert_rel_close(y, conv_ref(x, w, b, padding=1, groups=2), tol=tolerance(F16))


def test_zero_sizes(device):
    w = weight(4, 3, (3, 3), dtype=F16, device=device)
    y = conv(rand(0, 3, 5, 5, dtype=F16, device=device), w, padding=1)
    assert y.shape == (0, 4, 5, 5)
    b = rand(4, dtype=F16, device=device)
    y = conv(rand(2, 0, 5, 5, dtype=F16, device=device), weight(4, 0, (3, 3), dtype=F16, device=device), b,
             activation="relu")  # fmt: skip
    assert_rel_close(y, torch.relu(b.double()).reshape(1, 4, 1, 1).expand(2, 4, 3, 3), tol=tolerance(F16))


def test_meta_tensors():
    x = torch.empty(2, 3, 9, 9, dtype=F16, device="meta").to(memory_format=torch.channels_last)
    y = conv(x, torch.empty(8, 3, 3, 3, dtype=F16, device="meta"), stride=2, padding=1)
    assert y.device.type == "meta" and y.shape == (2, 8, 5, 5) and y.is_contiguous(memory_format=torch.channels_last)


def test_config_taken_and_checked(device, poisoned):
    x = rand(2, 5, 6, 7, dtype=F16, device=device)
    w = weight(6, 5, (3, 3), dtype=F16, device=device)
    y = conv(x, w, padding=1, config=fly_conv.ConvConfig(16, 16, 16, group_m=1, num_stages=1))
    assert_rel_close(y, conv_ref(x, w, padding=1), tol=tolerance(F16))
    with pytest.raises(ValueError, match="config"):
        conv(x, w, padding=1, config=fly_conv.ConvConfig(16, 16, 8))


# ------------------------------------------------------------------------------ GPU sizes

GPU_CASES = [
    (2, 8, 64, 64, (56, 56), 3, 1, 1, 1, 1),  # ResNet-50 stage 1 3x3
    (2, 8, 256, 64, (56, 56), 1, 1, 0, 1, 1),  # ResNet-50 1x1 reduce
    (2, 4, 128, 128, (57, 55), 3, 2, 1, 1, 1),  # odd sizes, stride 2
    (2, 4, 1000, 24, (9, 9), 3, 1, 1, 1, 1),  # 1000 channels
    (2, 8, 256, 256, (28, 28), 3, 1, 1, 1, 32),  # ResNeXt grouped 3x3 (8 channels a group: direct)
    (2, 4, 128, 128, (56, 55), 3, 1, 1, 1, 32),  # 4 channels a group (direct), odd width
    (2, 4, 512, 512, (14, 14), 3, 2, 1, 1, 32),  # 16 channels a group (implicit GEMM), stride 2
    (2, 8, 256, 256, (28, 28), 7, 1, 3, 1, 256),  # depthwise 7x7
    (3, 2, 64, 64, (8, 28, 28), 3, 1, 1, 1, 1),  # video 3x3x3
    (1, 8, 256, 256, (1000,), 7, 1, 3, 1, 1),  # audio k = 7
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("channels_last", [True, False])
def test_forward_gpu(case, channels_last, device, poisoned):
    x, w, b, kw = _inputs(case, device, BF16)
    if channels_last:
        x = _channels_last_memory(x)
    y = conv(x, w, b, activation="relu", **kw)
    assert_rel_close(y, conv_ref(x, w, b, activation="relu", **kw), tol=tolerance(BF16))
