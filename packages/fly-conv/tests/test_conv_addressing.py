"""The implicit GEMM's host-chosen addressing (``_index_meta``): int32 offsets only where every offset the kernel
forms fits, the alignment it may declare for its gathers, and the stride-1 input gradient's division-free taps.
A wrong choice here is a wrong result (an alignment the data does not have, an offset that wraps), so each
decision is checked on both sides of its boundary. Meta tensors: nothing is allocated."""

from __future__ import annotations

import importlib

import torch

implicit = importlib.import_module("fly_conv._kernels.implicit_gemm")
BF16, F32 = torch.bfloat16, torch.float32
G3 = ((1, 3, 3), (1, 1, 1), (0, 1, 1), (1, 1, 1))  # a 2D 3x3, stride 1, padding 1


def _cl(n, c, h, w, dtype=BF16):
    return torch.empty((n, 1, h, w, c), dtype=dtype, device="meta")


def _meta(x5, y5, geom=G3, groups=1, transposed=False, taps=9):
    cg = x5.shape[-1] // groups
    w2 = torch.empty((y5.shape[-1], taps * cg), dtype=x5.dtype, device="meta")
    return implicit._index_meta(x5, w2, y5, geom, transposed, cg)


def test_c_vec_is_the_alignment_of_channels_and_strides():
    assert _meta(_cl(2, 64, 9, 9), _cl(2, 64, 9, 9))["C_VEC"] == 8  # 16 bytes of bf16
    assert _meta(_cl(2, 64, 9, 9, F32), _cl(2, 64, 9, 9, F32))["C_VEC"] == 4  # 16 bytes of fp32
    assert _meta(_cl(2, 256, 9, 9), _cl(2, 256, 9, 9), groups=32)["C_VEC"] == 8  # 8 channels a group
    assert _meta(_cl(2, 64, 9, 9), _cl(2, 64, 9, 9), groups=32)["C_VEC"] == 2  # 2 channels a group
    assert _meta(_cl(2, 12, 9, 9), _cl(2, 12, 9, 9))["C_VEC"] == 4
    assert _meta(_cl(2, 17, 9, 9), _cl(2, 8, 9, 9))["C_VEC"] == 1
    # channels not contiguous (an NC* input read in place by the pointwise path): no vector along channels
    nchw = torch.empty((2, 64, 1, 9, 9), dtype=BF16, device="meta").movedim(1, -1)
    assert _meta(nchw, _cl(2, 64, 9, 9), geom=((1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1)), taps=1)["C_VEC"] == 1
    # a channel slice: the row stride (96) is a multiple of 8 but the channel count (40) only of 8 as well
    sliced = _cl(2, 96, 9, 9)[..., :40]
    assert _meta(sliced, _cl(2, 8, 9, 9))["C_VEC"] == 8
    assert _meta(_cl(2, 96, 9, 9)[..., :36], _cl(2, 8, 9, 9))["C_VEC"] == 4


def test_int64_offsets_only_past_int32():
    assert not _meta(_cl(32, 256, 56, 56), _cl(32, 256, 56, 56))["IDX64"]
    n = 2**31 // (64 * 64 * 256)  # x of 2^31 elements: its last pixel's offset does not fit
    assert _meta(_cl(n, 256, 64, 64), _cl(n, 16, 64, 64))["IDX64"]
    assert not _meta(_cl(n // 2, 256, 64, 64), _cl(n // 2, 16, 64, 64))["IDX64"]
    assert _meta(_cl(n, 16, 64, 64), _cl(n, 256, 64, 64))["IDX64"]  # y that large, x small
    # x just under 2^31 elements fits, until a dilation makes the taps reach far past the rows
    n = 2**31 // (64 * 64 * 64) - 1
    assert not _meta(_cl(n, 64, 64, 64), _cl(n, 16, 64, 64))["IDX64"]
    far = ((1, 3, 3), (1, 1, 1), (0, 1, 1), (1, 4096, 4096))
    assert _meta(_cl(n, 64, 64, 64), _cl(n, 16, 64, 64), geom=far)["IDX64"]
    assert _meta(_cl(n, 64, 64, 64), _cl(n, 16, 64, 64), geom=far, transposed=True)["IDX64"]
    # a weight of 2^31 elements
    x, y = _cl(1, 2**15, 4, 4), _cl(1, 2**16, 4, 4)
    w2 = torch.empty((2**16, 2**15), dtype=BF16, device="meta")
    assert implicit._index_meta(x, w2, y, ((1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1)), False, 2**15)["IDX64"]


def test_unit_stride_only_for_a_stride_1_input_gradient():
    s2 = ((1, 3, 3), (1, 2, 2), (0, 1, 1), (1, 1, 1))
    s12 = ((1, 3, 3), (1, 1, 2), (0, 1, 1), (1, 2, 2))
    x, y = _cl(2, 16, 9, 9), _cl(2, 16, 9, 9)
    assert _meta(x, y, transposed=True)["UNIT_STRIDE"]
    assert not _meta(x, y, geom=s2, transposed=True)["UNIT_STRIDE"]
    assert not _meta(x, y, geom=s12, transposed=True)["UNIT_STRIDE"]
    assert not _meta(x, y)["UNIT_STRIDE"]  # the forward has no divisions to skip
