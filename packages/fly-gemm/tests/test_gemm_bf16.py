"""bf16 end to end on every device, the CPU's interpreter included: gemm, linear and FlyLinear, forward and
backward, against fp64 references by relative error, and NaN / inf propagating as in torch.

The interpreter's own bf16 dot multiplies raw bit patterns (values around 1e10 where torch gives about 10);
``flydsl.expr.dot`` widens bf16 operands there, and these tests hold every public path to it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fly_gemm import FlyLinear, GemmConfig, gemm, gemm_ref, linear
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance

BF16 = torch.bfloat16
# (M, N, K): one row, a ragged tile in every dimension with K not a multiple of 16, and a tile boundary
SHAPES = [(1, 7, 16), (7, 33, 47), (32, 32, 64)]
# the kernels a CPU run can take: the default (tiled), the TMA kernel, split-K
CONFIGS = [None, GemmConfig(16, 32, 32, group_m=2, num_stages=1, tma=True),
           GemmConfig(16, 32, 32, group_m=1, num_stages=1, split_k=2)]  # fmt: skip
# backward through bf16 GEMMs: the output gradient is rounded to bf16 before them (2^-8 relative a value)
GRAD_TOL = 2e-2


def _rand(*shape, device, seed=0, scale=3.0, dtype=BF16):
    # values about 3: the products sum to about 10-40, where raw-bit products would give about 1e10
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "tma", "split-k"])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
def test_gemm_bf16(device, m, n, k, cfg, out_dtype):
    a, b = _rand(m, k, device=device), _rand(n, k, device=device, seed=1)
    bias = _rand(n, device=device, seed=2, dtype=torch.float32)
    out = empty_poisoned(m, n, dtype=out_dtype, device=device)
    c = gemm(a, b, bias=bias, activation="silu", out=out, config=cfg)
    want = gemm_ref(a, b, bias=bias, activation="silu")
    # the products of bf16 values are exact in the fp32 accumulator: the budget is the output's rounding
    assert_rel_close(c, want, tol=tolerance(out_dtype) if out_dtype == BF16 else 1e-5)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on NaN operands
def test_gemm_bf16_nan_and_inf_propagate_like_torch(device):
    m, n, k = 9, 20, 40
    a, b = _rand(m, k, device=device), _rand(n, k, device=device, seed=1)
    a[2, 5] = float("nan")  # row 2 of C: NaN
    a[4, 9] = float("inf")  # row 4: +-inf by the sign of b[:, 9], NaN where b[:, 9] is 0
    b[3, 9] = 0.0
    b[7, 11] = float("-inf")  # column 7: -+inf; NaN in row 4 if the signs clash, and where a[:, 11] is 0
    a[6, 11] = 0.0
    ref = (a.double() @ b.double().t()).cpu()
    assert torch.isnan(ref).any() and torch.isinf(ref).any()
    c = gemm(a, b, out_dtype=torch.float32).cpu().double()
    assert torch.equal(torch.isnan(c), torch.isnan(ref))
    assert torch.equal(torch.isposinf(c), torch.isposinf(ref)) and torch.equal(torch.isneginf(c), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert_rel_close(c[finite], ref[finite], tol=1e-5)
    # and in bf16 output
    c16 = gemm(a, b).cpu().double()
    assert torch.equal(torch.isnan(c16), torch.isnan(ref))
    assert torch.equal(torch.isinf(c16), torch.isinf(ref))


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_gemm_bf16_backward(device, activation, b_layout):
    m, n, k = 13, 24, 40
    a = _rand(m, k, device=device).requires_grad_()
    b = _rand(n, k, device=device, seed=1) if b_layout == "nk" else _rand(k, n, device=device, seed=1)
    b.requires_grad_()
    bias = _rand(n, device=device, seed=2).requires_grad_()
    dy = _rand(m, n, device=device, seed=3, scale=1.0)
    y = gemm(a, b, bias=bias, activation=activation, b_layout=b_layout)
    assert_rel_close(y, gemm_ref(a, b, bias=bias, activation=activation, b_layout=b_layout))
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    b_nk = leaves[1] if b_layout == "nk" else leaves[1].t()
    z = leaves[0] @ b_nk.t() + leaves[2]
    (F.gelu(z, approximate="tanh") if activation else z).backward(dy.double())
    for got, leaf, name in zip((a.grad, b.grad, bias.grad), leaves, ("a", "b", "bias"), strict=True):
        assert got.dtype == BF16
        assert_rel_close(got, leaf.grad, tol=GRAD_TOL, name=name)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_linear_and_fly_linear_bf16_forward_and_backward(device, activation):
    act = F.relu if activation else (lambda z: z)
    layer = FlyLinear(40, 24, activation=activation, device=device, dtype=BF16)
    with torch.no_grad():  # weights around 1, so the outputs are around 10 like the report
        layer.weight.copy_(_rand(24, 40, device=device, seed=5, scale=1.0))
        layer.bias.copy_(_rand(24, device=device, seed=6, scale=1.0))
    x = _rand(2, 5, 40, device=device).requires_grad_()
    dy = _rand(2, 5, 24, device=device, seed=4, scale=1.0)
    leaves = [t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias)]
    want = act(F.linear(*leaves))
    want.backward(dy.double())
    for fn in (layer, lambda t: linear(t, layer.weight, layer.bias, activation)):
        for t in (x, layer.weight, layer.bias):
            t.grad = None
        y = fn(x)
        assert y.shape == (2, 5, 24) and y.dtype == BF16
        assert_rel_close(y, want, name="y")
        y.backward(dy)
        for got, leaf, name in zip((x.grad, layer.weight.grad, layer.bias.grad), leaves, ("x", "weight", "bias"),
                                   strict=True):  # fmt: skip
            assert_rel_close(got, leaf.grad, tol=GRAD_TOL, name=name)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_fly_linear_bf16_nan_input_gives_nan_rows(device):
    layer = FlyLinear(32, 16, device=device, dtype=BF16)
    x = _rand(4, 32, device=device)
    x[1, 7] = float("nan")
    with torch.no_grad():
        y = layer(x).cpu()
        want = F.linear(x.cpu().double(), layer.weight.cpu().double(), layer.bias.cpu().double())
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()
    assert_rel_close(y[[0, 2, 3]], want[[0, 2, 3]])
