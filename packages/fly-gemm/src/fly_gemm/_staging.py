"""Aligned stand-ins for the operands the GEMM kernels would read slowly.

Both kernels are fast only on rows they can move in whole vectors:

- the persistent TMA kernel addresses a 2-D operand only when its row stride
  is a multiple of 16 bytes (and its base 16-byte aligned); anything else
  falls to the tiled kernel;
- the tiled kernel vectorizes a load only where Triton can prove the
  alignment, which it learns from ints divisible by 16 (its one divisibility
  specialization): K-major rows whose stride is not a multiple of 16
  elements, or a K that is not (every K step's mask then varies element by
  element), are read one element at a time and without the asynchronous
  copies of its pipeline.

On the H200 such shapes ran far below the aligned ones: bf16 at odd K 4-30x
slower than cuBLAS, a bf16 output whose rows are not 16-byte multiples 3x
slower (no TMA store), fp8 / int8 with K not a multiple of 16 30-100x slower
than the same bytes aligned. So :func:`plan` decides, from the operands'
shapes, strides and alignment alone, which of them get an aligned copy:

- A and B as K-major ``[rows, Kp]`` copies, ``Kp`` = K rounded up to 16, the
  pad columns zero (the product is unchanged); when K itself is ragged both
  are copied, so that the kernels run the padded K;
- C computed into the first N columns of an ``[M, Np]`` buffer of ours, then
  copied into the output.

A copy reads and writes its operand once: at the sizes staged (at least
``_MIN_ELEMENTS`` of A and B) a fraction of what the slow read costs.
Operands already aligned are never copied, and a transposed operand that a
kernel reads well as it is (A as ``[K, M]`` storage, B as ``[K, N]``) stays
in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flydsl_common.copy import copy_padded

from ._kernels.persistent import tma_rows

__all__ = ["Staging", "plan", "stage_operands"]

_ALIGN = 16  # elements: the divisibility Triton specializes ints on
# Below this many elements of A and B the slow read costs a few microseconds at most, less than the copies'
# own launches (a copy and a fill per operand).
_MIN_ELEMENTS = 1 << 16
# The tiled kernel at decode sizes (M up to 32: row tiles of at most 32) in 16 bits reads a misaligned weight
# one element at a time at 0.2-1.0x cuBLAS, and the weight's copy costs more: on the H200 sweep, staged calls
# of M 1-21 ran 1.9-3.3x slower than unstaged (10 x 15528 x 13981: 189 -> 620 us). Wider row tiles (M 37-57,
# 64-row tiles) and 8-bit operands read unaligned are 10-100x slower than aligned (int8 6 x 29112 x 5560:
# 6.1 ms unstaged, 0.4 ms staged; bf16 37 x 25107 x 23569: 11.6 ms, 1.7 ms), so they are staged.
_TILED_SMALL_M = 32
ENABLED = [True]  # tests switch staging off to reach the kernels' ragged paths through the public call


@dataclass(frozen=True)
class Staging:
    """Which operands a call copies: ``k`` is the K the kernels run (padded when A and B are copied with
    zero columns), ``copy_a`` / ``copy_b`` give K-major ``[rows, k]`` copies, ``copy_c`` a scratch output."""

    k: int
    copy_a: bool
    copy_b: bool
    copy_c: bool


def _k_major_aligned(t: torch.Tensor) -> bool:
    """A ``[rows, K]`` view the tiled kernel reads in vectors: unit last stride, row stride a multiple of 16
    elements, 16-byte aligned base."""
    return t.stride(1) == 1 and t.stride(0) % _ALIGN == 0 and t.data_ptr() % 16 == 0


def _read_in_place(t: torch.Tensor) -> bool:
    """A transposed operand (``[rows, K]`` as a view of ``[K, rows]`` storage) that the tiled kernel reads
    along its unit stride, rows a multiple of 16 elements apart."""
    return t.stride(0) == 1 and t.stride(1) % _ALIGN == 0 and t.data_ptr() % 16 == 0


def plan(a: torch.Tensor, b_nk: torch.Tensor, c: torch.Tensor, tma: bool) -> Staging | None:
    """The staging of ``c[M, N] = a[M, K] @ b_nk[N, K]^T`` for the TMA kernel (``tma``) or the tiled one,
    or None when every operand is read well as it is (or the call is too small for copies to pay).
    Reads only shapes, strides and the operands' addresses modulo 16."""
    m, k = a.shape
    n = b_nk.shape[0]
    if not ENABLED[0] or m == 0 or n == 0 or k == 0 or (m + n) * k < _MIN_ELEMENTS:
        return None
    kp = -(-k // _ALIGN) * _ALIGN
    if tma:  # a transposed operand is read as its [K, rows] storage: only K-major rows need 16-byte K
        copy_a = not (tma_rows(a) or tma_rows(a.t()))
        copy_b = not (tma_rows(b_nk) or tma_rows(b_nk.t()))
        copy_c = not tma_rows(c)
        pad = (k * a.element_size()) % 16 != 0 and (copy_a or copy_b)
    elif a.element_size() == 2 and m <= _TILED_SMALL_M:
        return None  # decode sizes in 16 bits: the tiled kernel's unvectorized read costs less than the copies
    else:
        copy_a = not (_k_major_aligned(a) or _read_in_place(a))
        copy_b = not (_k_major_aligned(b_nk) or _read_in_place(b_nk))
        copy_c = False  # the tiled kernel's masked stores are a small part of its time
        # a ragged K masks every K step element by element along a K-major read
        pad = kp != k and (copy_a or copy_b or a.stride(1) == 1 or b_nk.stride(1) == 1)
    # A K-major copy of a ragged K is padded, and then the kernels run the padded K: the other operand must
    # have its zero columns too (read in place, it would be read past its last row).
    if pad:
        copy_a = copy_b = True
    if not (copy_a or copy_b or copy_c):
        return None
    return Staging(kp if pad else k, copy_a, copy_b, copy_c)


def _k_major_copy(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` (``[rows, K]``, any strides) as a contiguous ``[rows, k]`` (k >= K), the columns past K zero:
    one launch of the shared strided copy, so a staged call stays replayable (allocations and launches)."""
    return copy_padded(t, torch.empty(t.shape[0], k, dtype=t.dtype, device=t.device))


def stage_operands(s: Staging, a: torch.Tensor, b_nk: torch.Tensor, c: torch.Tensor):
    """(a, b_nk, c) to launch with under staging ``s``; ``c`` is a scratch ``[M, N]`` view of an aligned
    ``[M, Np]`` buffer when ``s.copy_c`` (the caller copies it into the output after the launch, with
    :func:`flydsl_common.copy.copy_padded`)."""
    if s.copy_a:
        a = _k_major_copy(a, s.k)
    if s.copy_b:
        b_nk = _k_major_copy(b_nk, s.k)
    if s.copy_c:
        m, n = c.shape
        np_ = -(-n // _ALIGN) * _ALIGN
        c = torch.empty(m, np_, dtype=c.dtype, device=c.device)[:, :n]
    return a, b_nk, c
