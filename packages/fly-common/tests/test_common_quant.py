"""Per-token and per-tensor quantization against the fp32 reference of the same scheme."""

from __future__ import annotations

import pytest
import torch

from flydsl.errors import DTypeError, LayoutError, ShapeError
from flydsl_common import quantize_per_tensor, quantize_per_token
from flydsl_common.quant import QuantConfig, default_quant_config
from flydsl_common.reference import quantize_per_tensor_ref, quantize_per_token_ref
from flydsl_common.testing import assert_quant_close

QDTYPES = [torch.int8, torch.float8_e4m3fn]
IN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (leading shape, N): N = 1 and odd widths, a width past one block, a single row, several rows.
SHAPES = [((1,), 1), ((3,), 7), ((5,), 33), ((2, 3), 100), ((4,), 257), ((1,), 1000)]


def _assert_matches(q, s, qr, sr, x, per_token):
    assert q.shape == x.shape
    assert_quant_close(q, s, qr, sr, per_token=per_token, x=x)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("lead,n", SHAPES)
def test_per_token(device, qdtype, in_dtype, lead, n):
    x = (torch.randn(*lead, n, device=device) * 3).to(in_dtype)
    q, s = quantize_per_token(x, qdtype)
    assert s.shape == x.shape[:-1] and s.dtype == torch.float32
    qr, sr = quantize_per_token_ref(x, qdtype)
    _assert_matches(q, s, qr, sr, x, True)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_per_token_two_pass_path_and_strided_rows(device, qdtype):
    base = torch.randn(6, 300, device=device, dtype=torch.bfloat16)
    x = base[:, 10:260]  # strided rows, no copy
    cfg = QuantConfig(block_m=2, block_n=64, num_warps=2, single_pass=False)
    q, s = quantize_per_token(x, qdtype, config=cfg)
    qr, sr = quantize_per_token_ref(x, qdtype)
    _assert_matches(q, s, qr, sr, x, True)


def test_zero_rows_and_extremes(device):
    x = torch.zeros(3, 16, device=device)
    x[1] = torch.linspace(-1e4, 1e4, 16)
    x[2, 5] = -7.0
    for qdtype in QDTYPES:
        q, s = quantize_per_token(x, qdtype)
        assert s[0].item() == 0.0 and (q[0].float() == 0).all()
        qmax = 127.0 if qdtype == torch.int8 else 448.0
        assert q[1].float().abs().max().item() == qmax and q[2, 5].float().item() == -qmax


def test_empty_inputs(device):
    q, s = quantize_per_token(torch.empty(0, 64, device=device))
    assert q.shape == (0, 64) and s.shape == (0,)
    q, s = quantize_per_tensor(torch.empty(0, 64, device=device))
    assert q.shape == (0, 64) and s.item() == 0.0


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("lead,n", [((7,), 33), ((2, 5), 300), ((1,), 1)])
def test_per_tensor_dynamic(device, qdtype, in_dtype, lead, n):
    x = (torch.randn(*lead, n, device=device) * 2).to(in_dtype)
    q, s = quantize_per_tensor(x, qdtype)
    assert s.shape == () and s.dtype == torch.float32
    qr, sr = quantize_per_tensor_ref(x, qdtype)
    _assert_matches(q, s, qr, sr, x, False)


def test_per_tensor_static_scale(device):
    x = torch.randn(9, 70, device=device)
    scale = torch.tensor([0.01], device=device)
    q, s = quantize_per_tensor(x, torch.int8, scale=scale)
    qr, sr = quantize_per_tensor_ref(x, torch.int8, scale=scale)
    assert s.item() == pytest.approx(0.01)
    _assert_matches(q, s, qr, sr, x, False)
    assert (q.abs() == 127).any()  # saturation happened for |x| > 1.27


def test_bad_inputs_are_named(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(DTypeError, match="dtype: expected torch.int8 or torch.float8_e4m3fn"):
        quantize_per_token(x, torch.float16)
    with pytest.raises(DTypeError, match="x: expected dtype"):
        quantize_per_token(x.to(torch.int32))
    with pytest.raises(LayoutError, match="x: the last dimension must be contiguous"):
        quantize_per_token(x.t())
    with pytest.raises(ShapeError, match="scale: expected a single element"):
        quantize_per_tensor(x, scale=torch.ones(2, device=device))
    with pytest.raises(DTypeError, match="scale: expected dtype fp32"):
        quantize_per_tensor(x, scale=torch.ones(1, device=device, dtype=torch.float16))


@pytest.mark.parametrize("n", [1, 7, 256, 4096, 8192, 16384, 16385, 262144])
def test_default_config_is_valid(n):
    assert default_quant_config(n, 2, "gfx942").num_warps <= 16  # 64-wide wavefronts: 1024 threads at most
    cfg = default_quant_config(n, 2)
    assert cfg.block_n & (cfg.block_n - 1) == 0 and 1 <= cfg.num_warps <= 32 and cfg.block_m >= 1
    assert cfg.single_pass == (cfg.block_n >= n)
    assert cfg.block_m * cfg.block_n <= 32768  # bounded registers per program
    assert cfg.block_m * cfg.block_n // (32 * cfg.num_warps) <= 64  # at most 64 values per thread


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("m,n", [(1, 4096), (127, 8192), (64, 16384), (3, 65537), (2048, 1000)])
def test_gpu_shapes(qdtype, m, n):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_per_token(x, qdtype)
    qr, sr = quantize_per_token_ref(x, qdtype)
    _assert_matches(q, s, qr, sr, x, True)
    q, s = quantize_per_tensor(x, qdtype)
    qr, sr = quantize_per_tensor_ref(x, qdtype)
    _assert_matches(q, s, qr, sr, x, False)
