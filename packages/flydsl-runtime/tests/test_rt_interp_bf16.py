"""fp32 <-> bf16 in kernels as torch converts, interpreted (flydsl._interp_gpu) or compiled.

Triton's interpreter truncated fp32 -> bf16 (a casted or stored bf16 value one
unit below the GPU's for about half of all inputs) and lost bf16 subnormals on
the way back; the same kernel checked here runs on the GPU too, where the
hardware's conversions must give the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl import _interp_gpu
from flydsl.testing import default_device, empty_poisoned

# Halfway cases (both parities), the largest finite bf16 and the fp32 values that round past it, infinities,
# signed zero and fp32 subnormals rounding up and down.
_EDGES = [1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -(1.0 + 3 * 2**-8), 3.3895313892515355e38,
          3.4e38, float("inf"), float("-inf"), -0.0, 1e-40, 2**-133, 2**-134, 3 * 2**-135]  # fmt: skip


def _inputs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # random fp32 bit patterns cover every exponent; normal draws the common range
    bits = torch.randint(0, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    values = torch.cat([torch.tensor(_EDGES, dtype=torch.float32), torch.randn(n, generator=g), bits])
    return values[torch.isfinite(values) | torch.isinf(values)]  # NaN payloads compared apart


def test_bits_match_torch_rounding():
    x = _inputs(20000, 1)
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(_interp_gpu.fp32_to_bf16_bits(x.numpy()), want)


def test_bf16_to_fp32_is_exact():
    b = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)  # every bf16 bit pattern
    want = b.view(torch.bfloat16).float()
    got = torch.from_numpy(_interp_gpu.bf16_bits_to_fp32(b.numpy().view(np.uint16)))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_nan_stays_nan():
    x = torch.tensor([float("nan"), -float("nan")], dtype=torch.float32)
    assert torch.isnan(torch.from_numpy(_interp_gpu.fp32_to_bf16_bits(x.numpy()).view(np.int16))
                       .view(torch.bfloat16)).all()  # fmt: skip


@flyc.kernel
def _round_kernel(x_ptr, cast_ptr, store_ptr, n, BLOCK: fx.constexpr):
    offs = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    x = fx.load(x_ptr + offs, mask=mask, other=0.0)
    fx.store(cast_ptr + offs, x.to(fx.bfloat16).to(fx.float32), mask=mask)  # an explicit cast
    fx.store(store_ptr + offs, x, mask=mask)  # the implicit cast of a store through a bf16 pointer


def test_kernel_cast_and_store_round_to_nearest_even():
    dev = default_device()
    x = _inputs(5000, 2).to(dev)
    cast = empty_poisoned(x.shape, dtype=torch.float32, device=dev)
    stored = empty_poisoned(x.shape, dtype=torch.bfloat16, device=dev)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, cast, stored, x.numel(), BLOCK=256)
    want = x.to(torch.bfloat16)
    assert torch.equal(stored.view(torch.int16), want.view(torch.int16))
    assert torch.equal(cast, want.float())


@pytest.mark.skipif(not flyc.interpreting(), reason="the interpreter's cast")
def test_patch_is_in_place_and_idempotent():
    from triton.runtime import interpreter

    assert _interp_gpu.apply() is True
    wrapped = interpreter.InterpreterBuilder.cast_impl.__wrapped__
    assert _interp_gpu.apply() is True
    assert interpreter.InterpreterBuilder.cast_impl.__wrapped__ is wrapped
