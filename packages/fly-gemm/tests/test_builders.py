"""The seed's builder, compile_preshuffle_gemm: runtime M, every epilogue, flat buffers, bad input."""

from __future__ import annotations

import pytest
import torch

from fly_gemm import compile_preshuffle_gemm, gemm_ref, prepack
from fly_gemm.builders import EPILOGUES
from flydsl.errors import ArgumentError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned


def _rand(*shape, device, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_builder_runtime_m_and_epilogues(device, epilogue):
    n, k = 48, 64
    launch = compile_preshuffle_gemm(N=n, K=k, tile_m=16, tile_n=32, tile_k=32, in_dtype="fp16", out_dtype="f32",
                                     epilogue=epilogue, lds_stage=1)  # fmt: skip
    b = _rand(n, k, device=device, seed=1)
    bias = _rand(n, device=device, seed=2)
    has_bias, act = EPILOGUES[epilogue]
    for m in (1, 7, 40):  # one launcher, any M
        a = _rand(m, k, device=device, seed=m)
        c = empty_poisoned(m, n, dtype=torch.float32, device=device)
        launch(c, a, b, None, None, bias, m, n)
        assert_rel_close(c, gemm_ref(a, b, bias=bias if has_bias else None, activation=act), tol=1e-5)


@pytest.mark.parametrize("in_dtype", ["fp8", "int8"])
def test_builder_scaled_flat_buffers(device, in_dtype):
    n, k, m = 32, 64, 9
    dt = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[in_dtype]
    a = (_rand(m, k, device=device) * 20).to(dt)
    b = (_rand(n, k, device=device, seed=1) * 20).to(dt)
    sa, sb = torch.rand(m, device=device) + 0.5, torch.rand(n, device=device) + 0.5
    launch = compile_preshuffle_gemm(N=n, K=k, tile_m=16, tile_n=32, tile_k=32, in_dtype=in_dtype, lds_stage=1)
    c = empty_poisoned(m * n + 5, dtype=torch.bfloat16, device=device)  # a flat buffer with room to spare
    launch(c, a.view(-1), b.view(-1), sa, sb, None, m, n)
    assert_rel_close(c[: m * n].view(m, n), gemm_ref(a, b, scale_a=sa, scale_b=sb))
    assert torch.isnan(c[m * n :].float()).all()  # nothing written past M x N
    packed = prepack(_rand(n, k, device=device, seed=3), quant=dt)  # a prepacked weight carries scale_b
    c2 = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    launch(c2, a, packed, sa, None, None, m, n)
    assert_rel_close(c2, gemm_ref(a, packed.weight, scale_a=sa, scale_b=packed.scale))


def test_builder_bad_input_is_named(device):
    with pytest.raises(ArgumentError, match="epilogue"):
        compile_preshuffle_gemm(N=8, K=8, epilogue="bias_tanh")
    with pytest.raises(ArgumentError, match="in_dtype"):
        compile_preshuffle_gemm(N=8, K=8, in_dtype="fp4")
    with pytest.raises(ArgumentError, match="tile_m"):
        compile_preshuffle_gemm(N=8, K=8, tile_m=24)
    with pytest.raises(ArgumentError, match="K: expected a positive int"):
        compile_preshuffle_gemm(N=8, K=0)
    launch = compile_preshuffle_gemm(N=16, K=32, tile_m=16, tile_n=16, tile_k=16, in_dtype="fp16", epilogue="bias")
    a, b = _rand(4, 32, device=device), _rand(16, 32, device=device)
    c = torch.empty(4, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ArgumentError, match="arg_bias"):
        launch(c, a, b, None, None, None, 4, 16)
    with pytest.raises(ShapeError, match="N_val"):
        launch(c, a, b, None, None, None, 4, 17)
    with pytest.raises(DTypeError, match="arg_a"):
        launch(c, a.float(), b, None, None, torch.zeros(16, device=device), 4, 16)
    with pytest.raises(ShapeError, match="arg_b"):
        launch(c, a, b[:8], None, None, torch.zeros(16, device=device), 4, 16)
