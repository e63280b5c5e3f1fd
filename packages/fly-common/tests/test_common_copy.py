"""copy_padded against torch indexing: plain, transposed and batched views, padding in either dimension or
both (zeros), an empty source, every dtype the families stage (bf16, fp16, fp32, fp8 e4m3, int8), a dtype
conversion, and shapes refused by name; destinations start poisoned."""

from __future__ import annotations

import pytest
import torch

from flydsl.errors import DTypeError, ShapeError
from flydsl.testing import empty_poisoned
from flydsl_common.copy import copy_padded

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8]


def _rand(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8).to(device)
    return (torch.randn(shape, generator=g) * 4).to(device=device, dtype=dtype)


def _want(src, dst_shape):
    want = torch.zeros(dst_shape, dtype=src.dtype, device=src.device)
    want[..., : src.shape[-2], : src.shape[-1]] = src
    return want


def _same(a, b):
    """Bit for bit (fp8 has no torch.equal)."""
    return torch.equal(*(t.view(torch.uint8) if t.element_size() == 1 else t for t in (a, b)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rs,dst_rs", [((37, 50), (37, 50)), ((37, 50), (37, 64)), ((5, 3), (16, 17)), ((1, 1), (1, 16))]
)
def test_2d_copies_with_zero_padding(device, dtype, rs, dst_rs):
    src = _rand(rs, dtype, device)
    dst = empty_poisoned(dst_rs, dtype=dtype, device=device) if dtype.is_floating_point and dtype.itemsize > 1 else \
        torch.full(dst_rs, 7, dtype=torch.int8, device=device).view(dtype)  # fmt: skip
    assert copy_padded(src, dst) is dst
    assert _same(dst, _want(src, dst_rs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_transposes_and_strided_views(device, dtype):
    src = _rand((40, 70), dtype, device)
    dst = torch.empty(70, 40, dtype=dtype, device=device)
    copy_padded(src, dst.t())  # a transpose: a copy into the destination's transposed view
    assert _same(dst, src.t().contiguous())
    big = _rand((64, 96), dtype, device, seed=1)
    view = big[3:50:2, 5:80]  # strided rows, an offset base
    out = torch.empty(30, 80, dtype=dtype, device=device)
    copy_padded(view, out)
    assert _same(out, _want(view, (30, 80)))
    tsrc = _rand((70, 40), dtype, device, seed=2).t()  # a transposed source, padded on both sides
    out = torch.empty(48, 80, dtype=dtype, device=device)
    copy_padded(tsrc, out)
    assert _same(out, _want(tsrc, (48, 80)))


def test_batched_transpose_keeps_every_bit(device):
    src = _rand((3, 17, 33), torch.float32, device)
    src[0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")])
    dst = empty_poisoned((3, 33, 17), dtype=torch.float32, device=device)
    copy_padded(src, dst.transpose(1, 2))  # the conv layout change: [B, R, S] -> [B, S, R]
    assert torch.equal(dst.view(torch.int32), src.transpose(1, 2).contiguous().view(torch.int32))


def test_empty_source_zero_fills(device):
    dst = empty_poisoned((4, 16), dtype=torch.bfloat16, device=device)
    copy_padded(torch.empty(4, 0, dtype=torch.bfloat16, device=device), dst)
    assert (dst == 0).all()
    copy_padded(torch.empty(0, 3, device=device), torch.empty(0, 5, device=device))  # nothing to write


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_bad_shapes_named():
    with pytest.raises(ShapeError, match="^dst"):
        copy_padded(torch.zeros(4, 8), torch.zeros(4, 7))
    with pytest.raises(ShapeError, match="^dst"):
        copy_padded(torch.zeros(2, 4, 8), torch.zeros(3, 4, 8))
    with pytest.raises(ShapeError, match="^src"):
        copy_padded(torch.zeros(8), torch.zeros(8))
    with pytest.raises(DTypeError, match="^dst: expected src's dtype"):
        copy_padded(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_gpu_large_padded_copy():
    src = _rand((4352, 6777), torch.bfloat16, "cuda")
    dst = empty_poisoned((4352, 6784), dtype=torch.bfloat16, device="cuda")
    copy_padded(src, dst)
    assert _same(dst, _want(src, (4352, 6784)))
