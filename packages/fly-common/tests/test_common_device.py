"""Device building blocks against torch references, through whatever backend this process uses. (fly-norm's own
helpers, its exchange between programs and its packed bf16 pairs, are tested in fly-norm.)"""

from __future__ import annotations

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.errors import ArgumentError
from flydsl.testing import assert_rel_close, empty_poisoned
from flydsl_common import device as dev
from flydsl_common.reference import activation_ref


@flyc.func
def load_row_f32(ptr, cols, n, other):
    """``ptr[cols]`` where ``cols < n`` as fp32 (``other`` elsewhere)."""
    return fx.load(ptr + cols, mask=cols < n, other=other).to(fx.float32)


@flyc.func
def store_row(ptr, cols, n, value):
    """``value`` converted to the pointer's element type, stored at ``ptr[cols]`` where ``cols < n``."""
    fx.store(ptr + cols, value.to(ptr.dtype.element_ty), mask=cols < n)


@flyc.kernel
def _act_kernel(x_ptr, y_ptr, n, ACT: fx.constexpr, B: fx.constexpr):
    offs = fx.program_id(0) * B + fx.arange(0, B)
    x = load_row_f32(x_ptr, offs, n, 0.0)
    store_row(y_ptr, offs, n, dev.activation(x, ACT))


@pytest.mark.parametrize("name", ["none", "relu", "silu", "gelu_tanh", "gelu", "gelu_erf"])
def test_activations_match_fp64(device, name):
    x = torch.cat([torch.randn(1000, device=device) * 4, torch.tensor([0.0, -30.0, 30.0, 1e-3], device=device)])
    y = empty_poisoned(x.shape, dtype=torch.float32, device=device)
    _act_kernel[(flyc.cdiv(x.numel(), 256),)](x, y, x.numel(), dev.activation_code(name), 256)
    assert_rel_close(y, activation_ref(x, name), tol=2e-6)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_activations_keep_relative_accuracy_in_the_tails(device, name):
    # element by element, not in norm: the negative tail of GELU is where 0.5 * (1 + erf) cancels
    x = torch.linspace(-6.0, 6.0, 12001, device=device)
    y = empty_poisoned(x.shape, dtype=torch.float32, device=device)
    _act_kernel[(flyc.cdiv(x.numel(), 256),)](x, y, x.numel(), dev.activation_code(name), 256)
    ref = activation_ref(x, name)
    rel = ((y.double() - ref) / ref.abs().clamp_min(1e-300)).abs()
    rel = torch.where(ref == 0, (y.double() - ref).abs(), rel).cpu()
    xs = x.cpu()
    bounds = [(0.0, 6.01, 2e-6), (-3.0, 0.0, 1e-4), (-6.01, -3.0, 5e-3)] if name == "gelu" else [(-6.01, 6.01, 1e-5)]
    for lo, hi, bound in bounds:
        sel = (xs >= lo) & (xs < hi)
        assert rel[sel].max().item() <= bound, (name, lo, hi, rel[sel].max().item())


def test_activation_names_are_checked():
    assert dev.activation_code(None) == dev.ACT_NONE
    assert dev.activation_code("GELU") == dev.ACT_GELU_ERF
    with pytest.raises(ArgumentError, match="activation: expected None or one of"):
        dev.activation_code("swish")


@flyc.kernel
def _absmax_kernel(x_ptr, out_ptr, n, stride, B: fx.constexpr):
    row = fx.program_id(0)
    cols = fx.arange(0, B)
    x = load_row_f32(x_ptr + dev.row_offset(row, stride), cols, n, 0.0)
    fx.store(out_ptr + row, dev.absmax_f32(x, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 100, 128])
def test_absmax_in_fp32_on_strided_rows(device, dtype, n):
    base = torch.randn(5, 160, device=device).to(dtype)
    x = base[:, 3 : 3 + n]  # row stride 160, offset start: strided rows
    out = empty_poisoned(5, dtype=torch.float32, device=device)
    _absmax_kernel[(5,)](x, out, n, x.stride(0), 128)
    assert_rel_close(out, x.double().abs().amax(1), tol=1e-6)


@flyc.kernel
def _cast_kernel(x_ptr, i8_ptr, f8_ptr, r_ptr, n, B: fx.constexpr):
    offs = fx.program_id(0) * B + fx.arange(0, B)
    m = offs < n
    x = fx.load(x_ptr + offs, mask=m, other=0.0)
    fx.store(i8_ptr + offs, dev.cast_sat_int8(x), mask=m)
    fx.store(f8_ptr + offs, dev.cast_sat_fp8e4m3(x), mask=m)
    fx.store(r_ptr + offs, dev.round_half_even(x), mask=m)


def test_saturating_casts_are_exact(device):
    # Every fp8 value, every midpoint between neighbours (ties), out-of-range values, randoms.
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].sort().values
    x = torch.cat([vals, (vals[1:] + vals[:-1]) / 2, torch.randn(3000) * 60,
                   torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, -127.5, 1e6, -1e6, 5e6])]).to(device)
    n = x.numel()
    i8 = empty_poisoned(n, dtype=torch.int8, device=device)
    f8 = empty_poisoned(n, dtype=torch.float8_e4m3fn, device=device)
    r = empty_poisoned(n, dtype=torch.float32, device=device)
    _cast_kernel[(flyc.cdiv(n, 1024),)](x, i8, f8, r, n, 1024)
    assert torch.equal(r.cpu(), torch.where(x.abs() < 2**22, torch.round(x), x).cpu())
    assert torch.equal(i8.cpu(), torch.round(x.clamp(-127, 127)).to(torch.int8).cpu())
    ref8 = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    nonzero = x != 0  # the sign of zero is not part of the contract
    assert torch.equal(f8.view(torch.uint8)[nonzero].cpu(), ref8.view(torch.uint8)[nonzero].cpu())


@flyc.kernel
def _scales_kernel(a_ptr, inv_ptr, s_ptr, n, QMAX: fx.constexpr, B: fx.constexpr):
    offs = fx.program_id(0) * B + fx.arange(0, B)
    amax = fx.load(a_ptr + offs, mask=offs < n, other=1.0)
    fx.store(inv_ptr + offs, dev.inverse_scale(amax, QMAX), mask=offs < n)
    fx.store(s_ptr + offs, dev.quant_scale(amax, QMAX), mask=offs < n)


@pytest.mark.parametrize("qmax", [dev.FP8_E4M3_MAX, dev.INT8_MAX])
def test_quantizer_scales_are_correctly_rounded(device, qmax):
    _check_scales(device, qmax)


@pytest.mark.gpu
def test_quantizer_scales_are_correctly_rounded_on_the_gpu():
    # where `/` would be the approximate division: the GPU run of the suite selects gpu-marked tests
    for qmax in (dev.FP8_E4M3_MAX, dev.INT8_MAX):
        _check_scales("cuda", qmax)


def _check_scales(device, qmax):
    # bit for bit torch's tensor division (correctly rounded): the codes x * inverse_scale sit on rounding
    # ties often (16-bit rows), where one ulp of the inverse picks the code. Every bf16 magnitude from 2**-20
    # to 2**20 as a row maximum (what 16-bit rows give), random fp32 ones, and 0 (an all-zero row: 0, 0).
    bf16 = torch.arange(0x3580, 0x4980, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    amax = torch.cat([bf16, torch.rand(4000) * 1e3, torch.tensor([0.0])]).to(device)
    inv, s = (empty_poisoned(amax.shape, dtype=torch.float32, device=device) for _ in range(2))
    _scales_kernel[(flyc.cdiv(amax.numel(), 256),)](amax, inv, s, amax.numel(), qmax, 256)
    q = torch.full_like(amax, qmax)
    want_inv = torch.where(amax > 0, q / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    assert torch.equal(inv, want_inv), (inv != want_inv).sum().item()
    assert torch.equal(s, amax / q), (s != amax / q).sum().item()
