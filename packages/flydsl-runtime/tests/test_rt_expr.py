"""fx index helpers against plain-Python references, in the interpreter (and compiled on a GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx


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
