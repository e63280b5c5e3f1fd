"""The smallest end-to-end FlyDSL kernel: ``out = a + b``.

It shows the whole path a family follows (a ``@flyc.kernel``, a
``@flyc.jit`` launcher, a checked public function) and serves the runtime's
launch-overhead and timer measurements.
"""

from __future__ import annotations

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.checks import check_same_device, check_same_dtype, check_shape, check_tensor
from flydsl.errors import LayoutError

__all__ = ["vec_add", "build_vec_add_module", "VEC_ADD_DTYPES"]

VEC_ADD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)


# n stays specialized: its divisibility by 16 is what lets the masked accesses be 16-byte vectors.
@flyc.kernel
def _vec_add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: fx.constexpr, IS_FLOAT: fx.constexpr):
    offs = fx.program_id(0).to(fx.int64) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    a = fx.load(a_ptr + offs, mask=mask)
    b = fx.load(b_ptr + offs, mask=mask)
    if IS_FLOAT:
        # Add 16-bit floats in fp32 and round once: the correctly rounded sum
        # (and the interpreter has no bf16 arithmetic of its own).
        fx.store(out_ptr + offs, (a.to(fx.float32) + b.to(fx.float32)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        fx.store(out_ptr + offs, a + b, mask=mask)


_BLOCK = 4096  # 16 KB of fp32 per operand per program: long enough bursts, enough programs to fill the GPU


@flyc.jit
def _launch_vec_add(a, b, out, n: int, stream=None):
    grid = (flyc.cdiv(n, _BLOCK),)
    flyc.launch(_vec_add_kernel, grid, a, b, out, n, BLOCK=_BLOCK, IS_FLOAT=a.dtype.is_floating_point, num_warps=8)


def build_vec_add_module():
    """The seed's builder form: returns the launcher ``launch(a, b, out, n, stream=None)``
    for contiguous flat tensors (no argument checks: the caller owns buffers and streams)."""
    return _launch_vec_add


def vec_add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise ``a + b`` for two tensors of one shape, dtype and device.

    Non-contiguous inputs are copied to contiguous ones first. Example::

        c = vec_add(torch.ones(10, device="cuda"), torch.ones(10, device="cuda"))
    """
    check_tensor("a", a, dtypes=VEC_ADD_DTYPES)
    check_tensor("b", b, dtypes=VEC_ADD_DTYPES)
    check_same_dtype(a=a, b=b)
    check_same_device(a=a, b=b)
    check_shape("b", b, a.shape, "the shape of a")
    if out is None:
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    else:
        check_tensor("out", out, dtypes=(a.dtype,), device=a.device)
        check_shape("out", out, a.shape, "the shape of a")
        if not out.is_contiguous():
            raise LayoutError(f"out: must be contiguous, got strides {tuple(out.stride())}")
    if a.is_meta:  # shapes and dtypes only
        return out
    _launch_vec_add(a.contiguous(), b.contiguous(), out, a.numel())
    return out
