"""vec_add, the smallest end-to-end kernel."""

from __future__ import annotations

import pytest
import torch

from flydsl.errors import DeviceError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned
from flydsl_common import build_vec_add_module, vec_add
from flydsl_common.reference import vec_add_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 4095, 4097, 10000])
def test_vec_add(device, dtype, n):
    a = torch.randn(n, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    out = empty_poisoned(n, dtype=dtype, device=device)
    vec_add(a, b, out=out)
    assert_rel_close(out, vec_add_ref(a, b), dtype=dtype)


def test_vec_add_int_and_nd_noncontiguous(device):
    a = torch.randint(-1000, 1000, (3, 50), device=device, dtype=torch.int32)
    b = torch.randint(-1000, 1000, (50, 3), device=device, dtype=torch.int32).t()
    assert torch.equal(vec_add(a, b), a + b)


def test_builder_form(device):
    launch = build_vec_add_module()
    a, b = torch.randn(100, device=device), torch.randn(100, device=device)
    out = empty_poisoned(100, dtype=torch.float32, device=device)
    launch(a, b, out, 100, stream=None)
    assert_rel_close(out, vec_add_ref(a, b))


def test_empty(device):
    assert vec_add(torch.empty(0, device=device), torch.empty(0, device=device)).numel() == 0


def test_bad_inputs(device):
    a = torch.randn(4, device=device)
    with pytest.raises(DTypeError, match="b: expected dtype fp32"):
        vec_add(a, a.half())
    with pytest.raises(ShapeError, match="b: expected shape"):
        vec_add(a, torch.randn(5, device=device))
    with pytest.raises(DeviceError, match="b: expected a tensor on"):
        vec_add(a, torch.randn(4, device="meta"))
    with pytest.raises(DTypeError, match="a: expected dtype"):
        vec_add(a.double(), a.double())
