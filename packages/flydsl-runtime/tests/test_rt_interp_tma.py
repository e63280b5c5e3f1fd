"""The interpreter's tensor-descriptor check counts strides in bytes, as the GPU (flydsl._interp_gpu)."""

from __future__ import annotations

import numpy as np
import pytest

import flydsl  # noqa: F401  (before triton: the backend choice)
from flydsl import _interp_gpu

interpreter = pytest.importorskip("triton.runtime.interpreter")
tl = pytest.importorskip("triton.language")


def _desc(dtype, row_stride: int, base: int = 4096):
    h = interpreter.TensorHandle
    return interpreter.TensorDescHandle(
        h(np.array([base], dtype=np.uint64), tl.pointer_type(dtype)),
        [h(np.array([8], dtype=np.int64), tl.int64), h(np.array([row_stride], dtype=np.int64), tl.int64)],
        [h(np.array([row_stride], dtype=np.int64), tl.int64), h(np.array([1], dtype=np.int64), tl.int64)],
        [8, 16], None,
    )  # fmt: skip


@pytest.mark.skipif(not hasattr(interpreter, "TensorDescHandle"), reason="no descriptors in this interpreter")
def test_descriptor_strides_are_checked_in_bytes():
    assert _interp_gpu.apply()
    _desc(tl.float16, 40).validate()  # 80 bytes a row: the GPU takes it (Triton 3.5 refused 40 elements)
    _desc(tl.float8e4nv, 48).validate()
    with pytest.raises(AssertionError, match="16-byte"):
        _desc(tl.float16, 36).validate()  # 72 bytes
    with pytest.raises(AssertionError, match="16-byte"):
        _desc(tl.int8, 24).validate()
    with pytest.raises(AssertionError, match="base"):
        _desc(tl.float16, 40, base=4098).validate()
