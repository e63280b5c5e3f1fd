"""Softmax forward and backward against the fp64 reference (fly_norm.reference).

CPU runs go through Triton's interpreter on small shapes; realistic shapes
are ``gpu``-marked. Outputs are poisoned (NaN) first wherever the test owns
the output buffer, so an element the kernel never writes fails.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import flydsl.arch
from fly_norm.autotune import TUNABLES, clear_memo, tuning_key
from fly_norm.reference import softmax_bwd_ref, softmax_ref
from fly_norm.softmax import (
    build_softmax_bwd_module,
    build_softmax_module,
    softmax,
    softmax_bwd,
    softmax_fwd,
)
from flydsl.errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned, poison, seeded_generator, tolerance
from flydsl_common.rows import MAX_SINGLE_PASS, RowConfig, row_config_valid

# The package exports the function `softmax`, which shadows the submodule as an attribute.
sm = importlib.import_module("fly_norm.softmax")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Row counts: none (empty result), one, and a count that leaves padding rows
# in a multi-row program.
ROWS = [0, 1, 3]
# Row widths: 1 (softmax is exactly 1), odd widths below and across a warp,
# the two sides of a power of two (255 fills its block, 257 spills into a
# 512 block), and a wide odd row.
WIDTHS = [1, 7, 33, 255, 257, 1000]
# A tiny chunked config: several chunks per row, the last one partial.
CHUNKED = RowConfig(1, 64, 2, False)
# Row widths past the single-pass limit, served by the default ladder's
# chunked configs (2 and 3 chunks of 16K / 32K).
WIDE = [MAX_SINGLE_PASS + 1, 65537]


def _randn(*shape, dtype=torch.float32, scale=3.0, seed=0, device="cpu"):
    g = seeded_generator(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def _grad_tol(dtype):
    # dx = y * (dy - dot) cancels when dy is nearly constant along the row;
    # 16-bit y and dy carry their own rounding into it.
    return 2 * tolerance(dtype)


# ------------------------------------------------------------------ forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", WIDTHS)
def test_forward_matches_reference(device, dtype, m, n):
    x = _randn(m, n, dtype=dtype, device=device)
    y = softmax(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert_rel_close(y, softmax_ref(x))
    if m:
        ones = torch.ones(m, dtype=torch.float64, device=y.device)
        torch.testing.assert_close(y.double().sum(-1), ones, rtol=0, atol=n * 2e-3)
    # The same rows through the low-level launcher into a poisoned buffer:
    # every element must be written.
    y2 = empty_poisoned(m, n, dtype=dtype, device=device)
    softmax_fwd(x, y2, sm.softmax_config(n, dtype, device))
    assert_rel_close(y2, softmax_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [257, 1000])
def test_chunked_forward_and_backward(device, dtype, n):
    # Strided rows (a column window of a wider buffer) and strided outputs.
    base = _randn(5, n + 24, dtype=dtype, device=device)
    x = base[:, 16 : 16 + n]
    y_buf = empty_poisoned(5, n + 8, dtype=dtype, device=device)
    y = y_buf[:, :n]
    softmax_fwd(x, y, CHUNKED)
    assert_rel_close(y, softmax_ref(x))
    assert y_buf[:, n:].isnan().all()  # nothing written past the row

    dy = _randn(5, n, dtype=dtype, seed=1, device=device)
    dx = empty_poisoned(5, n, dtype=dtype, device=device)
    softmax_bwd(dy, y, dx, CHUNKED)
    assert_rel_close(dx, softmax_bwd_ref(dy, y), tol=_grad_tol(dtype))


@pytest.mark.parametrize("fixed", [True, False], ids=["n_fixed", "n_runtime"])
@pytest.mark.parametrize("n", [1, 63, 64, 257, 1000])
def test_chunked_backward_one_row_a_program(device, n, fixed, monkeypatch):
    """The chunked backward (one row a program, no row mask): strided dy, y and dx rows of widths under,
    at and past a chunk (the last chunk partial), the width fixed at compile time or read at run time;
    nothing written past a row."""
    from fly_norm import _row_plans as passes

    monkeypatch.setattr(passes, "FIXED_WIDTHS_MAX", 16 if fixed else 0)
    monkeypatch.setattr(passes, "_FIXED_WIDTHS", set())
    assert passes.row_meta(CHUNKED, n)["N_FIXED"] == (n if fixed else 0)
    m = 7
    y = softmax_ref(_randn(m, n, device=device)).float()
    y_buf = torch.zeros(m, n + 5, device=device)
    y_buf[:, 3 : 3 + n] = y
    dy_buf = _randn(m, n + 9, seed=3, device=device)
    dx_buf = empty_poisoned(m, n + 4, dtype=torch.float32, device=device)
    dy, y, dx = dy_buf[:, 9:], y_buf[:, 3 : 3 + n], dx_buf[:, :n]
    softmax_bwd(dy, y, dx, CHUNKED)
    assert_rel_close(dx, softmax_bwd_ref(dy, y), tol=_grad_tol(torch.float32))
    assert dx_buf[:, n:].isnan().all()


@pytest.mark.parametrize("n", WIDE)
def test_wide_rows_take_the_default_chunked_path(device, n):
    cfg = sm.softmax_config(n, torch.float32, device)
    assert not cfg.single_pass
    x = _randn(2, n, device=device, scale=5.0)
    y = softmax(x)
    assert_rel_close(y, softmax_ref(x))
    dy = _randn(2, n, seed=3, device=device)
    dx = empty_poisoned(2, n, dtype=torch.float32, device=device)
    softmax_bwd(dy, y, dx, sm.softmax_bwd_config(n, torch.float32, device))
    assert_rel_close(dx, softmax_bwd_ref(dy, y), tol=_grad_tol(torch.float32))


def _extreme_rows(n):
    x = torch.randn(6, n, dtype=torch.float64)
    x[0] = torch.linspace(-1e4, 1e4, n)  # large magnitudes: exp must be taken of x - max
    x[1, ::3] = float("-inf")  # masked entries (attention-style)
    x[2] = 42.0  # a constant row: uniform output
    x[3] = -1e4
    x[4, : n // 2] = float("-inf")  # -inf in the first chunks: the online max starts at -inf
    x[5, -1] = 1e4  # a spike in the last chunk rescales the running sum
    return x


@pytest.mark.parametrize("cfg", [None, CHUNKED], ids=["default", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_inputs(device, cfg, dtype):
    n = 200
    x = _extreme_rows(n).to(device=device, dtype=dtype)
    if cfg is None:
        y = softmax(x)
    else:
        y = empty_poisoned(x.shape, dtype=dtype, device=device)
        softmax_fwd(x, y, cfg)
    ref = softmax_ref(x)
    assert torch.isfinite(y).all()
    assert_rel_close(y, ref)
    uniform = torch.full((n,), 1.0 / n, dtype=torch.float64, device=y.device)
    torch.testing.assert_close(y[2].double(), uniform, rtol=1e-2, atol=0)
    assert (y[1, ::3] == 0).all()


@pytest.mark.parametrize("cfg", [None, CHUNKED], ids=["default", "chunked"])
def test_all_minus_inf_row_is_nan_like_torch(device, cfg):
    x = torch.randn(3, 100, device=device)
    x[1] = float("-inf")
    if cfg is None:
        y = softmax(x)
    else:
        y = torch.empty_like(x)
        softmax_fwd(x, y, cfg)
    assert y[1].isnan().all()  # torch.softmax gives NaN for such a row too
    assert_rel_close(y[[0, 2]], softmax_ref(x[[0, 2]]))


# Rows under the packed 32K config: (width, row stride, first column of x's view, packs). Packed: bf16, an
# even width and stride from a 4-byte boundary; other calls run the chunked passes.
PACKED_CASES = [(32768, 32768, 0, True), (20000, 20004, 0, True), (20001, 20001, 0, False),
                (20000, 20001, 0, False), (20000, 20002, 1, False)]  # fmt: skip


@pytest.mark.parametrize("n,stride,first,packs", PACKED_CASES)
def test_packed_rows(device, monkeypatch, n, stride, first, packs):
    """The single pass with bf16 rows held packed (two columns an int32), and the calls that config cannot
    serve packed, against the reference: -inf entries, an all -inf row (NaN, as torch), a large row."""
    cfg = RowConfig(1, 32768, 8, True, maxnreg=128)
    monkeypatch.setattr(sm, "softmax_config", lambda *a, **k: cfg)
    monkeypatch.setattr(sm, "_EAGER_PLANS", {})  # plans made under other configs must not serve these calls
    seen = []
    real = sm.packed_plan
    monkeypatch.setattr(sm, "packed_plan", lambda *a: seen.append(real(*a)[1]) or real(*a))
    base = _randn(4, stride + first, device=device).to(torch.bfloat16) * 4
    x = base[:, first : first + n]
    x[0, ::3] = float("-inf")
    x[1] = float("-inf")
    x[2, n - 1] = 60.0  # the row's max in the last column (even widths: the high half of a word)
    x[3] += 1000.0
    y = softmax(x)
    assert seen == [packs]
    assert y[1].isnan().all()
    assert_rel_close(y[[0, 2, 3]], softmax_ref(x[[0, 2, 3]]))


# ------------------------------------------------------------ layouts, dims


def test_strided_rows_are_read_in_place(device, monkeypatch):
    base = _randn(4, 3, 300, device=device)
    x = base[:, :, 5:262]  # [4, 3, 257]: strided rows whose leading dims collapse into one row stride
    seen = []
    launch = sm._run_fwd

    def spy(x2, y2, cfg):
        seen.append(x2)
        launch(x2, y2, cfg)

    monkeypatch.setattr(sm, "_run_fwd", spy)
    y = softmax(x)
    assert seen[0].data_ptr() == x.data_ptr() and seen[0].stride(0) == 300  # no copy
    assert_rel_close(y, softmax_ref(x))


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_any_dim(device, dim):
    x = _randn(3, 5, 7, device=device)
    y = softmax(x, dim=dim)
    assert_rel_close(y, softmax_ref(x, dim=dim))


def test_non_contiguous_last_dim_and_scalar(device):
    x = _randn(9, 6, device=device).t()  # last dim has stride 6: copied once, then served
    assert_rel_close(softmax(x), softmax_ref(x))
    s = torch.tensor(3.0, device=device)
    assert softmax(s).item() == 1.0 and softmax(s).shape == ()


@pytest.mark.parametrize("shape", [(0, 7), (2, 0, 5), (4, 0)])
def test_empty(device, shape):
    x = torch.empty(shape, device=device)
    y = softmax(x)
    assert y.shape == x.shape
    x.requires_grad_(True)
    softmax(x).sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [8193, 12345, 16384])
def test_backward_of_rows_up_to_16k_takes_the_chunked_pass(dtype, n, monkeypatch):
    """Softmax's backward from 8K to 16K columns on a GPU: the chunked pass, not the split path
    (split.SOFTMAX_SPLIT_MIN_N_BWD), through autograd, against fp64."""
    from fly_norm import _split_host as split

    def no_split(*args):
        raise AssertionError("the split path took a row of at most 16K columns")

    monkeypatch.setattr(sm, "launch_softmax_bwd_split", no_split)
    assert n < split.SOFTMAX_SPLIT_MIN_N_BWD
    x = _randn(37, n, dtype=dtype, device="cuda").requires_grad_(True)
    g = _randn(37, n, dtype=dtype, seed=4, device="cuda")
    softmax(x).backward(g)
    xr = x.detach().double().requires_grad_(True)
    softmax_ref(xr).backward(g.double())
    assert_rel_close(x.grad, xr.grad, tol=_grad_tol(dtype))


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 257])
def test_gradients_match_autograd_on_reference(device, dtype, n):
    x = _randn(3, 2, n, dtype=dtype, device=device).requires_grad_(True)
    g = _randn(3, 2, n, dtype=dtype, seed=2, device=device)
    y = softmax(x)
    y.backward(g)
    xr = x.detach().double().requires_grad_(True)
    softmax_ref(xr).backward(g.double())
    assert x.grad.dtype == dtype
    assert_rel_close(x.grad, xr.grad, tol=_grad_tol(dtype))


def test_gradients_dim0_expanded_grad_and_chunked(device, monkeypatch):
    # A forced chunked config on the public path, dim != -1, and the
    # all-stride-0 gradient of .sum().
    monkeypatch.setattr(sm, "row_config_for", lambda *a, **k: CHUNKED)
    x = _randn(300, 4, device=device).requires_grad_(True)
    w = _randn(300, 4, seed=5, device=device)
    (softmax(x, dim=0) * w).sum().backward()
    xr = x.detach().double().requires_grad_(True)
    (softmax_ref(xr, dim=0) * w.double()).sum().backward()
    assert_rel_close(x.grad, xr.grad, tol=_grad_tol(torch.float32))

    x.grad = None
    softmax(x, dim=0).sum().backward()  # d/dx sum(softmax) = 0
    assert x.grad.abs().max().item() < 1e-6


def test_eager_calls_skip_the_dispatcher(device, monkeypatch):
    """Per call: whether it went through the custom op (the dispatcher). Eager calls never do: inference on
    a GPU takes the eager plan (_eager_fwd), elsewhere _fwd_rows directly; training the autograd.Function
    that runs the op's body (the op's first call would import torch._dynamo); torch.compile the op."""
    via_op = []
    rows, eager = sm._fwd_rows, sm._eager_fwd

    def through_op():
        return any("torch/_library" in f.filename.replace("\\", "/") for f in inspect.stack())

    def spy_rows(x, autotune):
        via_op.append(through_op())
        return rows(x, autotune)

    def spy_eager(x):
        y = eager(x)
        if y is not None:
            via_op.append(through_op())
        return y

    monkeypatch.setattr(sm, "_fwd_rows", spy_rows)
    monkeypatch.setattr(sm, "_eager_fwd", spy_eager)
    x = torch.randn(2, 8, device=device)
    assert softmax(x).grad_fn is None
    y = softmax(x.requires_grad_(True))
    assert y.grad_fn is not None and "EagerSoftmax" in type(y.grad_fn).__name__
    assert via_op == [False, False]


# ------------------------------------------------------------------ builders


@pytest.mark.parametrize("dtype_str,dtype", [("f32", torch.float32), ("bf16", torch.bfloat16)])
def test_seed_builders(device, dtype_str, dtype):
    n = 100
    x = _randn(5, n, dtype=dtype, device=device)
    y = empty_poisoned(5, n, dtype=dtype, device=device)
    launch = build_softmax_module(M=1234, N=n, dtype_str=dtype_str)
    launch(x, y, 3)  # runtime row count: rows 3 and 4 are left alone
    assert_rel_close(y[:3], softmax_ref(x[:3]))
    assert y[3:].isnan().all()
    launch(x, y, 0)

    dy = _randn(5, n, dtype=dtype, seed=4, device=device)
    dx = empty_poisoned(5, n, dtype=dtype, device=device)
    bwd = build_softmax_bwd_module(N=n, dtype_str=dtype_str)
    bwd(dy, y, dx, 3)
    assert_rel_close(dx[:3], softmax_bwd_ref(dy[:3], y[:3]), tol=_grad_tol(dtype))
    assert dx[3:].isnan().all()


def test_seed_builder_errors(device):
    launch = build_softmax_module(M=4, N=16, dtype_str="f16")
    x = torch.randn(4, 16, device=device)
    with pytest.raises(DTypeError, match="^A: "):
        launch(x, x, 4)
    h = x.half()
    with pytest.raises(ShapeError, match="^C: "):
        launch(h, torch.empty(4, 8, dtype=torch.float16, device=device), 4)
    with pytest.raises(ShapeError, match="m_in=5"):
        launch(h, h.clone(), 5)
    with pytest.raises(ArgumentError, match="^N: "):
        build_softmax_module(M=4, N=0)
    with pytest.raises(DTypeError, match="dtype_str"):
        build_softmax_bwd_module(N=16, dtype_str="int8")


# ---------------------------------------------------------------- bad input


def test_bad_inputs_name_the_argument(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(DTypeError, match="^x: .*int32"):
        softmax(torch.ones(4, 16, dtype=torch.int32, device=device))
    with pytest.raises(ArgumentError, match="^dim: "):
        softmax(x, dim=2)
    assert softmax(torch.randn(4, 16, device="meta")).is_meta  # meta in, meta out (test_norm_api)
    with pytest.raises(LayoutError, match="^x2d: "):
        softmax_fwd(x.t(), torch.empty(16, 4, device=device), CHUNKED)
    with pytest.raises(ShapeError, match="^y2d: "):
        softmax_fwd(x, torch.empty(4, 15, device=device), CHUNKED)
    with pytest.raises(ArgumentError, match="^cfg: "):
        softmax_fwd(x, torch.empty_like(x), RowConfig(4, 8, 4, True))  # block_n < N
    y = torch.empty_like(x)
    with pytest.raises(ShapeError, match="^dy2d: "):
        softmax_bwd(torch.randn(4, 8, device=device), y, y.clone(), CHUNKED)
    with pytest.raises(DTypeError, match="^dy2d: "):
        softmax_bwd(x.half(), y, y.clone(), CHUNKED)
    with pytest.raises(DeviceError):
        softmax_bwd(torch.randn(4, 16, device="meta"), y, y.clone(), CHUNKED)
    with pytest.raises(DTypeError, match="^dx2d: "):
        softmax_bwd(x, y, y.half(), CHUNKED)


# ---------------------------------------------------------------- autotune


def test_forced_search_returns_a_valid_config(device, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    n = 7
    x = _randn(8, n, device=device)
    key = tuning_key(n, torch.float32)
    clear_memo()
    try:
        y = softmax(x.requires_grad_(True), autotune=True)
        y.backward(_randn(8, n, seed=6, device=device))
        assert_rel_close(y, softmax_ref(x))
        for op in ("softmax_fwd", "softmax_bwd"):
            cfg, source = TUNABLES[op].explain(key, flydsl.arch.name(device))
            assert source == "searched" and row_config_valid(cfg, n)
        assert any(tmp_path.rglob("*.json"))  # the winner is cached on this machine
    finally:
        clear_memo()  # the searched winners must not leak into other tests


# ------------------------------------------------------------ torch.compile


def test_custom_ops_opcheck(device):
    x = _randn(3, 33, device=device)
    y = softmax(x)
    torch.library.opcheck(torch.ops.fly_norm.softmax_fwd.default, (x, None))
    torch.library.opcheck(torch.ops.fly_norm.softmax_bwd.default, (_randn(3, 33, seed=7, device=device), y, None))


def test_compile_fullgraph(device):
    # One compiled function, forward and backward (about 10 s on the CPU).
    def f(x):
        return softmax(x * 2.0, dim=0) + 1.0

    x = _randn(5, 33, device=device).requires_grad_(True)
    y = torch.compile(f, fullgraph=True)(x)
    xr = x.detach().double().requires_grad_(True)
    yr = softmax_ref(xr * 2.0, dim=0) + 1.0
    assert_rel_close(y, yr)
    w = _randn(5, 33, seed=8, device=device)
    (y * w).sum().backward()
    (yr * w.double()).sum().backward()
    assert_rel_close(x.grad, xr.grad, tol=_grad_tol(torch.float32))


# ---------------------------------------------------------------------- GPU

GPU_WIDTHS = [1024, 4096, 32768, 131072, 1048576]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", GPU_WIDTHS + [4095, 4097, 65537])
def test_gpu_realistic_shapes(dtype, n):
    m = max(2, (1 << 22) // n)
    x = _randn(m, n, dtype=dtype, device="cuda")
    y = softmax(x)
    assert_rel_close(y, softmax_ref(x))
    dy = _randn(m, n, dtype=dtype, seed=1, device="cuda")
    dx = poison(torch.empty_like(y))
    softmax_bwd(dy, y, dx, sm.softmax_bwd_config(n, dtype, x.device))
    assert_rel_close(dx, softmax_bwd_ref(dy, y), tol=_grad_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 131072])
def test_gpu_compile_fullgraph(n):
    x = _randn(8, n, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    y = torch.compile(lambda t: softmax(t), fullgraph=True)(x)
    assert_rel_close(y, softmax_ref(x))
    g = _randn(8, n, dtype=torch.bfloat16, seed=2, device="cuda")
    y.backward(g)
    xr = x.detach().double().requires_grad_(True)
    softmax_ref(xr).backward(g.double())
    assert_rel_close(x.grad, xr.grad, tol=_grad_tol(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_int64_offsets():
    # More than 2**31 elements: row offsets past int32 must not wrap.
    n = 4097
    m = (1 << 31) // n + 4
    x = torch.empty(m, n, dtype=torch.bfloat16, device="cuda").normal_()
    y = softmax(x)
    assert_rel_close(y[-4:], softmax_ref(x[-4:]))
    dy = torch.randn_like(x)
    dx = softmax_bwd_ref(dy[-4:], y[-4:])
    del x
    out = torch.empty_like(y)
    out[-4:] = float("nan")
    softmax_bwd(dy, y, out, sm.softmax_bwd_config(n, torch.bfloat16, y.device))
    assert_rel_close(out[-4:], dx, tol=_grad_tol(torch.bfloat16))
