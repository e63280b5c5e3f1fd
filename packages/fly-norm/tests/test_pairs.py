"""Values handled two at a time (:mod:`fly_norm._kernels.pairs`) against torch, exactly where the operation is
exact: bf16 pairs held as int32 words, two reductions in one, two saturated codes in one int16."""

from __future__ import annotations

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from fly_norm._kernels.pairs import (
    NEG_INF_BF16_PAIR,
    as_words,
    bf16_pairs,
    bf16_pairs_again,
    bf16_pairs_third,
    bf16_words,
    max_bf16_halves,
    offsets_after,
    sat_fp8e4m3_pairs,
    sat_int8_pairs,
    sum2_f32,
    sum_absmax_f32,
)
from flydsl.testing import assert_rel_close, empty_poisoned
from flydsl_common.device import row_offset


@flyc.kernel
def _reduce_kernel(x_ptr, out_ptr, n, stride, B: fx.constexpr):
    row = fx.program_id(0)
    cols = fx.arange(0, B)
    x = fx.load(x_ptr + row_offset(row, stride) + cols, mask=cols < n, other=0.0).to(fx.float32)
    s, sq = sum2_f32(x, x * x, 0)  # both sums in one reduction
    fx.store(out_ptr + row * 4 + 0, s)
    fx.store(out_ptr + row * 4 + 1, sq)
    sq2, amax2 = sum_absmax_f32(x * x, x * -2.0, 0)  # a sum and an abs-max in one reduction
    fx.store(out_ptr + row * 4 + 2, sq2)
    fx.store(out_ptr + row * 4 + 3, amax2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 100, 128])
def test_two_reductions_in_one_on_strided_rows(device, dtype, n):
    base = torch.randn(5, 160, device=device).to(dtype)
    x = base[:, 3 : 3 + n]  # row stride 160, offset start: strided rows
    out = empty_poisoned(5, 4, dtype=torch.float32, device=device)
    _reduce_kernel[(5,)](x, out, n, x.stride(0), 128)
    xd = x.double()
    sq, amax = (xd * xd).sum(1), xd.abs().amax(1)
    assert_rel_close(out, torch.stack([xd.sum(1), sq, sq, 2 * amax], 1), tol=1e-6)


@flyc.func
def _store_pair(ptr, c, even, odd):
    fx.store(ptr + 2 * c, even)
    fx.store(ptr + 2 * c + 1, odd)


@flyc.kernel
def _pairs_kernel(x_ptr, f_ptr, wide_ptr, out_ptr, B: fx.constexpr):
    """bf16 x (2B columns) read as B int32 words: the three widenings, and f (fp32) packed to bf16 words."""
    c = fx.arange(0, B)[None, :]
    words = fx.load(x_ptr.to(fx.pointer_type(fx.int32), bitcast=True) + c)
    e1, o1 = bf16_pairs(words)
    e2, o2 = bf16_pairs_again(words)
    zero = (fx.sum(e1 * e1, axis=1) + 1.0).to(fx.int32, bitcast=True) >> 31  # a positive value's sign bit
    e3, o3 = bf16_pairs_third(words, zero[:, None])
    _store_pair(wide_ptr, c, e1, o1)
    _store_pair(wide_ptr + 2 * B, c, e2, o2)
    _store_pair(wide_ptr + 4 * B, c, e3, o3)
    late = offsets_after(c + fx.zeros_like(words), words, 4)
    packed = bf16_words(fx.load(f_ptr + 2 * late), fx.load(f_ptr + 2 * late + 1))
    fx.store(out_ptr.to(fx.pointer_type(fx.int32), bitcast=True) + c, packed)


def test_packed_bf16_pairs_round_trip(device):
    """Each widening of bf16 pairs read as int32 words is exact; fp32 rounded to bf16 words (ties to even,
    as torch) through offsets ordered after another value."""
    b = 64
    x = torch.randn(2 * b, device=device).to(torch.bfloat16)
    f = torch.randn(2 * b, device=device)
    f[:4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3e38], device=device)  # ties, large
    wide = empty_poisoned((3, 2 * b), dtype=torch.float32, device=device)
    out = empty_poisoned((2 * b,), dtype=torch.bfloat16, device=device)
    _pairs_kernel[(1,)](x, f, wide, out, b)
    for k in range(3):
        assert torch.equal(wide[k], x.float()), k
    assert torch.equal(out, f.to(torch.bfloat16))


@flyc.func
def max_bf16_words(words, axis: fx.constexpr):
    """The max, in fp32, of the bf16 held two a word in int32 ``words`` along ``axis``: the words reduced half
    by half with max_bf16_halves (as the resident softmax reduces its rows), then their two halves."""
    even, odd = bf16_pairs(fx.reduce(words, axis, max_bf16_halves))
    return fx.maximum(even, odd)


@flyc.kernel
def _max_words_kernel(x_ptr, out_ptr, n_words, B: fx.constexpr):
    """out[r] = the max of row r's bf16 (rows of 2 * B columns read as B words, the first n_words of them:
    the rest as a masked load reads them, two -inf)."""
    r = fx.program_id(0)
    c = fx.arange(0, B)
    words = fx.load(as_words(x_ptr) + r * B + c, mask=c < n_words, other=NEG_INF_BF16_PAIR)
    fx.store(out_ptr + r, max_bf16_words(words, 0))


def test_max_bf16_words_is_the_max_of_every_half(device):
    """The max of bf16 rows held as words equals torch's max in every case: either half holding it, all
    negative, -inf entries, the masked-off tail (read as -inf pairs) beyond a larger value, the extremes."""
    b, n_words = 64, 50
    x = torch.randn(6, 2 * b, device=device).to(torch.bfloat16)
    x[1, 37] = 9.0  # an odd column (a word's high half)
    x[2] = -torch.rand(2 * b, device=device).to(torch.bfloat16) - 1.0  # all negative
    x[3, ::2] = float("-inf")
    x[4, 2 * n_words :] = 100.0  # past the masked load: not part of the row
    x[5, 11] = 3.0e38
    out = empty_poisoned((6,), dtype=torch.float32, device=device)
    _max_words_kernel[(6,)](x, out, n_words, b)
    assert torch.equal(out, x[:, : 2 * n_words].float().amax(-1))


@flyc.kernel
def _sat_pairs_kernel(x_ptr, i8_ptr, f8_ptr, n_pairs, B: fx.constexpr):
    """Columns 2k and 2k + 1 of fp32 x saturated to int8 and fp8 e4m3 codes, each pair stored as one int16."""
    k = fx.program_id(0) * B + fx.arange(0, B)
    m = k < n_pairs
    even = fx.load(x_ptr + 2 * k, mask=m, other=0.0)
    odd = fx.load(x_ptr + 2 * k + 1, mask=m, other=0.0)
    fx.store(i8_ptr.to(fx.pointer_type(fx.int16), bitcast=True) + k, sat_int8_pairs(even, odd), mask=m)
    fx.store(f8_ptr.to(fx.pointer_type(fx.int16), bitcast=True) + k, sat_fp8e4m3_pairs(even, odd), mask=m)


def test_saturated_pairs_are_the_codes_of_both_columns(device):
    """Each int16 holds the even column's code in its low byte and the odd column's in its high one, each the
    round-half-even saturated code torch gives: ties, out-of-range values and negatives in both halves (a
    negative low byte must not spill into the high one)."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].sort().values
    x = torch.cat([vals, (vals[1:] + vals[:-1]) / 2, torch.randn(3001) * 60,
                   torch.tensor([0.5, 1.5, -2.5, -127.5, 126.5, 1e6, -1e6, -3.0, -0.25, 500.0, -448.5])])  # fmt: skip
    x = x[: x.numel() // 2 * 2].to(device)
    x[-2:] = torch.tensor([-3.0, 5.0], device=device)  # the last pair: a negative low byte below a positive one
    n = x.numel()
    i8 = empty_poisoned(n, dtype=torch.int8, device=device)
    f8 = empty_poisoned(n, dtype=torch.float8_e4m3fn, device=device)
    _sat_pairs_kernel[(flyc.cdiv(n // 2, 512),)](x, i8, f8, n // 2, 512)
    assert torch.equal(i8.cpu(), torch.round(x.clamp(-127, 127)).to(torch.int8).cpu())
    ref8 = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    nonzero = x != 0  # the sign of zero is not part of the contract
    assert torch.equal(f8.view(torch.uint8)[nonzero].cpu(), ref8.view(torch.uint8)[nonzero].cpu())
