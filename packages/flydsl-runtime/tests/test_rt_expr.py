"""fx index helpers against plain-Python references, in the interpreter (and compiled on a GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.testing import assert_rel_close, tolerance


@flyc.kernel
def _crd_kernel(out_ptr, SHAPE: fx.constexpr, STRIDE: fx.constexpr, N: fx.constexpr):
    i = fx.arange(0, N)
    crd = fx.idx2crd(i, SHAPE)
    fx.store(out_ptr + i, fx.crd2idx(crd, SHAPE))
    fx.store(out_ptr + N + i, fx.crd2idx(crd, SHAPE, STRIDE))
    fx.store(out_ptr + 2 * N + i, crd[len(SHAPE) - 1])
    fx.store(out_ptr + 3 * N + i, crd[0])


SHAPES = [
    ((16,), (3,)),
    ((4, 4), (1, 4)),  # column-major strides
    ((2, 2, 4), (100, 10, 1)),
    ((2, 2, 2, 2), (1, 2, 4, 8)),
    ((1, 8, 2), (0, 2, 1)),  # broadcast (stride 0) mode
]


def _ref_crd(i, shape):
    crd = []
    for extent in reversed(shape[1:]):
        crd.append(i % extent)
        i //= extent
    crd.append(i)
    return tuple(reversed(crd))


@pytest.mark.parametrize("shape,stride", SHAPES)
def test_idx2crd_crd2idx(device, shape, stride):
    n = 16
    out = torch.full((4 * n,), -7, dtype=torch.int32, device=device)
    _crd_kernel[(1,)](out, shape, stride, n)
    out = out.cpu().view(4, n)
    for i in range(n):
        crd = _ref_crd(i, shape)
        assert out[0, i] == i
        assert out[1, i] == sum(c * s for c, s in zip(crd, stride, strict=True))
        assert out[2, i] == crd[-1]
        assert out[3, i] == crd[0]


@flyc.kernel
def _tile_kernel(out_ptr, num_m, num_n, GROUP_M: fx.constexpr, N: fx.constexpr):
    pid = fx.arange(0, N)
    # Lanes past the last tile are clamped (they are masked out of the store).
    pm, pn = fx.grouped_tile(fx.minimum(pid, num_m * num_n - 1), num_m, num_n, GROUP_M)
    fx.store(out_ptr + pid, pm * 1000 + pn, mask=pid < num_m * num_n)


@pytest.mark.parametrize("num_m,num_n,group", [(5, 3, 2), (8, 8, 8), (7, 1, 4), (1, 9, 8), (9, 4, 1)])
def test_grouped_tile_is_a_grouped_permutation(device, num_m, num_n, group):
    n = 128
    out = torch.full((n,), -1, dtype=torch.int32, device=device)
    _tile_kernel[(1,)](out, num_m, num_n, group, n)
    got = [(v // 1000, v % 1000) for v in out[: num_m * num_n].tolist()]
    assert sorted(got) == list(itertools.product(range(num_m), range(num_n)))  # every tile exactly once
    for pid, (pm, pn) in enumerate(got):
        # Reference: groups of `group` rows, walked column by column.
        g = pid // (group * num_n)
        first = g * group
        size = min(num_m - first, group)
        assert (pm, pn) == (first + (pid % (group * num_n)) % size, (pid % (group * num_n)) // size)


def test_fx_exposes_triton_language_and_helpers():
    for name in ("load", "store", "arange", "constexpr", "dot", "program_id", "float8e4nv"):
        assert hasattr(fx, name), name
    for name in ("idx2crd", "crd2idx", "grouped_tile"):
        assert name in fx.__all__ and name in dir(fx)
    with pytest.raises(AttributeError):
        fx.no_such_thing  # noqa: B018


def test_every_exported_name_resolves():
    # `from flydsl.expr import *` reads each name of __all__: a listed name the module lacks breaks it
    missing = [name for name in fx.__all__ if not hasattr(fx, name)]
    assert missing == []


# ------------------------------------------------------------------ fx.dot
# Triton 3.6's interpreter multiplies bf16 blocks as raw uint16 bit patterns (results ~1e10 for values ~10,
# NaN and inf lost); fx.dot must be exact for bf16 there and give what the GPU's fp32 accumulation gives.


@flyc.kernel
def _dot_kernel(a_ptr, b_ptr, c_ptr, ACC: fx.constexpr, B: fx.constexpr, M: fx.constexpr, N: fx.constexpr,
                K: fx.constexpr):  # fmt: skip
    # a [B, M, K], b [B, K, N] contiguous; c [B, M, N] fp32. B > 1: the batched (3-D) dot.
    rb = fx.arange(0, B)[:, None, None]
    rm = fx.arange(0, M)
    rn = fx.arange(0, N)
    rk = fx.arange(0, K)
    a = fx.load(a_ptr + rb * (M * K) + rm[None, :, None] * K + rk[None, None, :])
    b = fx.load(b_ptr + rb * (K * N) + rk[None, :, None] * N + rn[None, None, :])
    c_ptrs = c_ptr + rb * (M * N) + rm[None, :, None] * N + rn[None, None, :]
    if B == 1:
        a = fx.reshape(a, (M, K))
        b = fx.reshape(b, (K, N))
        c_ptrs = fx.reshape(c_ptrs, (M, N))
    if ACC:  # accumulate onto what c holds, as a K loop does
        c = fx.dot(a, b, fx.load(c_ptrs))
    else:
        c = fx.dot(a, b)
    fx.store(c_ptrs, c)


def _run_dot(a, b, acc=None):
    shape = (a.shape[0], a.shape[1], b.shape[2])
    c = acc.clone() if acc is not None else torch.full(shape, float("nan"), device=a.device)
    _dot_kernel[(1,)](a, b, c, acc is not None, a.shape[0], a.shape[1], b.shape[2], a.shape[2])
    return c


def _dot_ref(a, b, acc=None):
    ref = a.double() @ b.double()
    return ref if acc is None else ref + acc.double()


def _assert_same_specials_and_close(out, ref, tol):
    """NaN where the reference has NaN, inf of the same sign where it has inf, finite values within tol."""
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN positions differ from the fp64 reference"
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref)), "+inf positions differ"
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "-inf positions differ"
    finite = torch.isfinite(ref)
    assert finite.any()
    assert_rel_close(out[finite], ref[finite], tol=tol)


DOT_CASES = [  # (batch, M, N, K, acc): the smallest dot (16), unequal sides, a batched dot, an accumulator
    (1, 16, 16, 16, False),
    (1, 32, 16, 64, False),
    (1, 16, 32, 32, True),
    (2, 16, 16, 32, False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,m,n,k,acc", DOT_CASES)
def test_dot_matches_fp64(device, dtype, batch, m, n, k, acc):
    g = torch.Generator().manual_seed(batch * 1000 + m + n + k)
    # values around 10 in the result, as in a real layer; products of bf16 values are exact in fp32
    a = (torch.randn(batch, m, k, generator=g) * 2).to(dtype)
    b = (torch.randn(batch, k, n, generator=g) * 2).to(dtype)
    c0 = torch.randn(batch, m, n, generator=g) if acc else None
    out = _run_dot(a.to(device), b.to(device), None if c0 is None else c0.to(device)).cpu()
    # fp32 accumulation of exact products: fp32 budget (not the bf16 one: any operand error is a bug)
    assert_rel_close(out, _dot_ref(a, b, c0), tol=tolerance(torch.float32))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on the NaN operands
@pytest.mark.parametrize("acc", [False, True])
def test_dot_bf16_propagates_nan_and_inf_like_torch(device, acc):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(1, 16, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(1, 32, 16, generator=g).to(torch.bfloat16)
    a[0, 1, 3] = float("nan")  # row 1 of the result is NaN
    a[0, 2, 5] = float("inf")  # row 2: +-inf, NaN where b's row 5 has a zero or an opposite inf
    b[0, 5, 4] = 0.0
    b[0, 7, 9] = float("-inf")  # column 9: -+inf, and NaN in row 2 (inf - inf) and row 1
    a[0, 4, 7] = 0.0  # 0 * -inf: NaN at (4, 9)
    b[0, 11, 12] = float("nan")  # column 12 NaN
    c0 = torch.randn(1, 16, 16, generator=g) if acc else None
    if acc:
        c0[0, 0, 0] = float("nan")  # a NaN accumulator stays NaN
    ref = _dot_ref(a, b, c0)
    assert torch.isnan(ref).any() and torch.isinf(ref).any()  # the case exercises both
    out = _run_dot(a.to(device), b.to(device), None if c0 is None else c0.to(device)).cpu()
    _assert_same_specials_and_close(out.double(), ref, tolerance(torch.float32))


def test_dot_is_tritons_own_when_compiling(fresh_python):
    # compiled kernels get tl.dot itself (no wrapper); the interpreter gets the bf16-exact one
    code = """
        import flydsl.expr as fx
        import triton.language as tl
        print(fx.dot is tl.dot, "dot" in vars(fx))
    """
    compiled = fresh_python(code, env_extra={"FLYDSL_INTERPRET": "0"}, env_drop=("TRITON_INTERPRET",))
    assert compiled.returncode == 0, compiled.stderr
    assert compiled.stdout.split() == ["True", "False"]
    interp = fresh_python(code, env_extra={"FLYDSL_INTERPRET": "1"}, env_drop=("TRITON_INTERPRET",))
    assert interp.returncode == 0, interp.stderr
    assert interp.stdout.split() == ["False", "True"]
