"""Bad input classes of the runtime's tensor-facing surface, one test a class (the table of issue 40 cites
these names): ``flydsl.checks`` (the argument checks every family's host API calls), ``@flyc.jit`` launchers
(device guard, empty inputs) and ``flyc.launch`` over kernels defined here. The runtime has no kernels of its
own: where a class is about a result (strides, alignment, NaN), the result of a small kernel launched through
the runtime is compared with torch's."""

from __future__ import annotations

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl import checks
from flydsl.errors import DeviceError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance


@flyc.kernel
def _scale_rows_kernel(x_ptr, out_ptr, n_cols, sx_row, sx_col, so_row, alpha, BLOCK: fx.constexpr):
    """out[r, c] = alpha * x[r, c] for one row a program; row offsets in int64 (rows past 2^31 elements)."""
    row = fx.program_id(0).to(fx.int64)  # the runtime's own tests stay below flydsl-common
    cols = fx.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        mask = c < n_cols
        x = fx.load(x_ptr + row * sx_row + c * sx_col, mask=mask)
        fx.store(out_ptr + row * so_row + c, (x * alpha).to(out_ptr.dtype.element_ty), mask=mask)


calls: list = []


@flyc.jit
def scale_rows(x, out, alpha, stream=None):
    """``out = alpha * x`` for a 2-D x of any strides; out row-major with a unit last stride."""
    calls.append(x.shape)
    rows, cols = x.shape
    flyc.launch(_scale_rows_kernel, (rows,), x, out, cols, x.stride(0), x.stride(1), out.stride(0), alpha,
                BLOCK=64)  # fmt: skip


def _check_scaled(x, alpha=1.5):
    out = empty_poisoned(*x.shape, dtype=x.dtype, device=x.device)
    scale_rows(x, out, alpha)
    assert_rel_close(out, alpha * x.double(), tol=tolerance(x.dtype))
    return out


# ---------------------------------------------------------------- dtype


def test_dtype():
    """The checks name the argument first (see also test_rt_env_cache_arch.test_checks_name_the_argument)."""
    x = torch.zeros(2, 3, dtype=torch.float16)
    with pytest.raises(DTypeError, match=r"^x: expected dtype fp32 or bf16, got fp16"):
        checks.check_tensor("x", x, dtypes=(torch.float32, torch.bfloat16))
    with pytest.raises(DTypeError, match=r"^bias: expected dtype fp16 \(the dtype of x\), got int32"):
        checks.check_same_dtype(x=x, bias=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(DTypeError, match=r"^out_dtype: expected dtype fp16 or bf16, got fp8_e4m3"):
        checks.parse_dtype("out_dtype", "fp8", allowed=(torch.float16, torch.bfloat16))
    assert checks.check_tensor("x", x, dtypes=(torch.float16,)) is x


# ---------------------------------------------------------------- device


def test_device(device):
    """A launcher given tensors on two devices names both before anything launches (test_rt_compiler covers
    the argument order too); the checks name the odd tensor; a launcher on another GPU runs there."""
    calls.clear()
    x = torch.ones(2, 4, device=device)
    with pytest.raises(DeviceError, match=r"^scale_rows: tensor arguments are on different devices \(argument 0 on "):
        scale_rows(x, torch.empty(2, 4, device="meta"), 2.0)
    assert calls == []  # refused before the launcher's body ran
    with pytest.raises(DeviceError, match=r"^w: expected a tensor on .* \(like x\)"):
        checks.check_same_device(x=x, w=torch.zeros(1, device="meta"))
    with pytest.raises(DeviceError, match=r"^w: expected a tensor on meta"):
        checks.check_tensor("w", x, device=torch.device("meta"))
    if device.type == "cuda":
        with pytest.raises(DeviceError, match="different devices"):
            scale_rows(x, torch.empty(2, 4), 2.0)  # a CPU output for a GPU input
        if torch.cuda.device_count() >= 2:  # another GPU: the launch goes to the tensors' device
            x1 = torch.randn(3, 70, device="cuda:1")
            assert _check_scaled(x1).device == x1.device
            with pytest.raises(DeviceError, match="cuda:0.*cuda:1"):
                scale_rows(x, torch.empty(2, 4, device="cuda:1"), 2.0)


def test_device_meta_launcher():
    """A launcher given meta tensors says so (DeviceError), before Triton fails on them (it raised torch's
    NotImplementedError 'Cannot copy out of meta tensor')."""
    x = torch.empty(2, 4, device="meta")
    with pytest.raises(DeviceError, match="meta"):
        scale_rows(x, torch.empty(2, 4, device="meta"), 2.0)


# ---------------------------------------------------------------- shape


def test_shape():
    """Rank and exact-shape checks name the argument and say where the expected shape comes from."""
    x = torch.zeros(2, 3)
    with pytest.raises(ShapeError, match=r"^weight: expected a 1-D tensor, got fp32 tensor of shape \(2, 3\)"):
        checks.check_tensor("weight", x, ndim=1)
    with pytest.raises(ShapeError, match=r"^q: expected at least 3 dimension\(s\)"):
        checks.check_tensor("q", x, min_ndim=3)
    with pytest.raises(ShapeError, match=r"^residual: expected shape \(2, 4\) \(x's\), got .* shape \(2, 3\)"):
        checks.check_shape("residual", x, (2, 4), "x's")
    checks.check_shape("residual", x, (2, 3))  # the right shape passes


# ---------------------------------------------------------------- stride


def test_stride(device):
    """Kernels read any strides the launcher passes them: transposed and sliced views against torch; the check
    for kernels that need a dense last dimension names the argument."""
    base = torch.randn(70, 90, device=device)
    _check_scaled(base.t())  # last stride 90
    _check_scaled(base[3:50:3, 5:80:2])  # sliced both ways
    _check_scaled(base[:, 7:8])  # one column
    with pytest.raises(LayoutError, match=r"^x: the last dimension must be contiguous \(stride 1\)"):
        checks.check_last_dim_contiguous("x", base.t())
    checks.check_last_dim_contiguous("x", base[:, 7:8].t().t())  # a one-element last dim is dense


# ---------------------------------------------------------------- alignment


def test_alignment(device):
    """A base pointer one element off 16 bytes and odd row strides: the lean launch keys its compiled kernels
    by alignment (test_rt_compiler.test_lean_launch_matches_reference), so an aligned launch first and an
    unaligned one after must both be right; check_alignment reports the misalignment."""
    for dtype in (torch.float32, torch.float16):
        buf = torch.randn(9 * 67 + 1, device=device).to(dtype)
        aligned = buf[: 8 * 64].view(8, 64)
        _check_scaled(aligned)  # compiles the aligned specialization
        off = buf[1 : 1 + 8 * 67].view(8, 67)  # base one element off, row stride 67 (odd)
        assert not checks.check_alignment("x", off, 16)
        assert checks.check_alignment("x", aligned, 16)
        _check_scaled(off)
        _check_scaled(off[:, 2:61:3])  # odd column stride from an odd base too


# ---------------------------------------------------------------- empty


def test_empty(device):
    """Empty tensors (no rows, no columns): the launcher returns None without running its body or launching
    (test_rt_compiler.test_empty_input_returns_early_without_launch); the output stays as it was."""
    calls.clear()
    for shape in ((0, 5), (3, 0)):
        x = torch.empty(shape, device=device)
        out = torch.full(shape, 7.0, device=device)
        assert scale_rows(x, out, 2.0) is None
        assert torch.equal(out, torch.full(shape, 7.0, device=device))
    assert calls == []
    assert checks.check_tensor("x", torch.empty(0, 4), ndim=2).numel() == 0


# ---------------------------------------------------------------- huge dimension


@pytest.mark.gpu
def test_huge_dimension():
    """A 2-D tensor past 2^31 elements: row offsets in int64 reach the last
    rows; the last rows against torch on those rows only."""
    rows, cols = 2**16 + 3, 2**15  # 2^31 + 3 * 2^15 elements
    need = 2 * rows * cols * 2 + (1 << 30)  # x and out in fp16, and room to spare
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    x = torch.empty(rows, cols, dtype=torch.float16, device="cuda")
    x[-4:].normal_()
    x[:-4].fill_(1.0)
    out = torch.empty_like(x)
    out[-4:].fill_(float("nan"))
    scale_rows(x, out, 0.5)
    assert x.numel() > 2**31
    assert_rel_close(out[-4:], 0.5 * x[-4:].double(), tol=tolerance(torch.float16))
    assert torch.equal(out[0], torch.full((cols,), 0.5, dtype=torch.float16, device="cuda"))
    del x, out
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- NaN / Inf


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 * inf
def test_nan_inf(device):
    """NaN and +-Inf go through a launched kernel as through torch: the same elements non-finite, with the same
    values (0 * inf is NaN, not a finite 0); the testing helpers never pass a NaN."""
    x = torch.randn(4, 70, device=device)
    x[0, 3], x[1, 5], x[2, 69], x[3, 0] = float("nan"), float("inf"), float("-inf"), float("nan")
    for alpha in (2.0, -1.0, 0.0):
        out = empty_poisoned(*x.shape, dtype=x.dtype, device=device)
        scale_rows(x, out, alpha)
        ref = alpha * x
        assert torch.equal(torch.isnan(out), torch.isnan(ref)), alpha
        torch.testing.assert_close(out, ref, equal_nan=True)
    with pytest.raises(AssertionError, match="non-finite elements 4"):
        assert_rel_close(out, torch.zeros_like(out))
