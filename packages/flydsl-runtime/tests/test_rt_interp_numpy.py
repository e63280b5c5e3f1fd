"""Triton's interpreter on current numpy: scalar tensors used as Python ints.

Before flydsl._interp_numpy, a kernel looping over a runtime count failed on
numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars")
and warned once per conversion on older numpy 2.x; both are checked here by
turning numpy's deprecation into an error.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import triton

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl import _interp_numpy
from flydsl.testing import empty_poisoned

pytestmark = pytest.mark.skipif(not flyc.interpreting(), reason="the interpreter's numpy conversions")


@flyc.kernel
def _row_sum_kernel(x_ptr, out_ptr, n_chunks, BLOCK: fx.constexpr):
    # range() over a runtime scalar: the interpreter converts it with __index__.
    row = fx.program_id(0)
    acc = fx.zeros([BLOCK], dtype=fx.float32)
    for c in range(n_chunks):
        acc += fx.load(x_ptr + row * n_chunks * BLOCK + c * BLOCK + fx.arange(0, BLOCK))
    fx.store(out_ptr + row, fx.sum(acc, axis=0))


@pytest.mark.parametrize("chunks", [1, 3])
def test_runtime_loop_count_runs_without_numpy_scalar_conversion(chunks):
    x = torch.randn(5, chunks * 16, dtype=torch.float32, generator=torch.Generator().manual_seed(chunks))
    out = empty_poisoned(5, dtype=torch.float32, device="cpu")
    with warnings.catch_warnings():
        # numpy 1.25-2.3 warn on int(array with ndim > 0); 2.4 raises TypeError.
        warnings.filterwarnings("error", message=".*ndim > 0 to a scalar", category=DeprecationWarning)
        _row_sum_kernel[(5,)](x, out, chunks, BLOCK=16)
    ref = x.double().sum(dim=1)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_patch_is_in_place_exactly_for_triton_before_the_upstream_fix():
    fixed = _interp_numpy._triton_version(triton.__version__) >= _interp_numpy._FIXED_IN
    assert _interp_numpy.apply() is (not fixed)
    if not fixed:
        from triton.runtime import interpreter

        assert getattr(interpreter._patch_lang_tensor, "__wrapped__", None) is not None
        assert _interp_numpy.apply() is True  # idempotent: wrapped once
        assert getattr(interpreter._patch_lang_tensor.__wrapped__, "__wrapped__", None) is None


class _Handle:
    def __init__(self, data):
        self.data = data


class _Tensor:
    def __init__(self, data):
        self.handle = _Handle(np.asarray(data))


@pytest.mark.parametrize("data", [np.int32(7), np.array([7], dtype=np.int64), np.array([[7]], dtype=np.int32)])
def test_index_takes_the_single_element_of_any_ndim(data):
    assert _interp_numpy._index(_Tensor(data)) == 7


def test_index_refuses_more_than_one_element():
    with pytest.raises(ValueError, match="size"):
        _interp_numpy._index(_Tensor(np.array([1, 2])))


@pytest.mark.parametrize(("text", "want"), [("3.6.0", (3, 6)), ("3.8.0+git1234", (3, 8)), ("4.0", (4, 0)),
                                            ("nightly", (0, 0))])
def test_triton_version_parse(text, want):
    assert _interp_numpy._triton_version(text) == want
