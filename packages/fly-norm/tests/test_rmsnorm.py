"""RMSNorm forward, backward, fused residual and quantized forward against the fp64 reference.

CPU runs go through Triton's interpreter, so shapes stay small; ``gpu`` cases
cover realistic widths. Helpers shared with test_layernorm live in norm_helpers.
"""

from __future__ import annotations

import time

import pytest
import torch
from norm_helpers import (
    CHUNKED,
    DTYPES,
    QDTYPES,
    SHAPES,
    assert_grads_close,
    assert_quant_matches,
    force_config,
    randn,
    reference_grads,
)

import fly_norm._norm_host as norm_mod
import fly_norm.rmsnorm as rmsnorm_mod
from fly_norm.autotune import bwd_default_row_config
from fly_norm.reference import rms_norm_quant_ref, rms_norm_ref
from fly_norm.rmsnorm import (
    build_rmsnorm_bwd_module,
    build_rmsnorm_module,
    rms_norm,
    rms_norm_quant,
    rmsnorm_bwd,
    rmsnorm_fwd,
)
from fly_norm.routing import Path
from flydsl.errors import DeviceError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance
from flydsl_common.rows import RowConfig, row_config_valid

# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,n", SHAPES)
def test_forward(device, dtype, lead, n):
    x = randn(*lead, n, dtype=dtype, device=device)
    w = randn(n, dtype=dtype, device=device, seed=1)
    y = rms_norm(x, w)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert_rel_close(y, rms_norm_ref(x, w, 1e-6))


# fp32 weights with 16-bit activations, no weight at all, and the (1 + w) convention.
@pytest.mark.parametrize(
    "dtype,wdtype,offset",
    [(torch.bfloat16, torch.float32, 0.0), (torch.float16, None, 0.0), (torch.float32, torch.float32, 1.0)],
)
def test_weight_variants(device, dtype, wdtype, offset):
    x = randn(3, 100, dtype=dtype, device=device)
    w = None if wdtype is None else randn(100, dtype=wdtype, device=device, seed=1) * 0.1
    y = rms_norm(x, w, 1e-5, weight_offset=offset)
    assert y.dtype == dtype
    assert_rel_close(y, rms_norm_ref(x, w, 1e-5, weight_offset=offset))


@pytest.mark.parametrize("dtype,rdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float16, torch.float32)])  # fmt: skip
def test_fused_residual(device, dtype, rdtype):
    x = randn(2, 3, 130, dtype=dtype, device=device)
    r = randn(2, 3, 130, dtype=rdtype, device=device, seed=2)
    w = randn(130, dtype=dtype, device=device, seed=1)
    y, h = rms_norm(x, w, residual=r)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert h.dtype == rdtype and y.dtype == dtype
    assert_rel_close(y, y_ref)
    assert_rel_close(h, h_ref)


def test_strided_rows_are_served(device):
    base = randn(5, 300, dtype=torch.float16, device=device)
    x = base[:, 7:264]  # row stride 300, last dim contiguous
    r = randn(5, 400, dtype=torch.float16, device=device, seed=3)[:, :257]
    w = randn(257, dtype=torch.float16, device=device, seed=1)
    y, h = rms_norm(x, w, residual=r)
    assert y.is_contiguous() and h.is_contiguous()
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert_rel_close(y, y_ref)
    assert_rel_close(h, h_ref)


def test_empty_input(device):
    x = torch.empty(0, 64, device=device)
    w = torch.ones(64, device=device)
    assert rms_norm(x, w).shape == (0, 64)
    y, h = rms_norm(x, w, residual=torch.empty(0, 64, device=device))
    assert y.shape == h.shape == (0, 64)
    q, s = rms_norm_quant(x, w)
    assert q.shape == (0, 64) and s.shape == (0,)
    xg = torch.empty(2, 0, 64, device=device, requires_grad=True)
    wg = torch.ones(64, device=device, requires_grad=True)
    rms_norm(xg, wg).sum().backward()
    assert xg.grad.shape == xg.shape and (wg.grad == 0).all()


def test_low_level_launch_writes_every_element(device):
    """Poisoned outputs: rmsnorm_fwd / rmsnorm_bwd must write every element they own (both paths)."""
    x = randn(3, 257, device=device)
    w = randn(257, device=device, seed=1)
    dy = randn(3, 257, device=device, seed=4)
    for cfg in (RowConfig(2, 512, 4, True), CHUNKED, RowConfig(2, 512, 4, True, maxnreg=128)):
        y = empty_poisoned(3, 257, dtype=torch.float32, device=device)
        rstd = empty_poisoned(3, dtype=torch.float32, device=device)
        rmsnorm_fwd(x, w, y, eps=1e-6, rstd=rstd, config=cfg)
        assert_rel_close(y, rms_norm_ref(x, w, 1e-6))
        dx = empty_poisoned(3, 257, dtype=torch.float32, device=device)
        dw = empty_poisoned(257, dtype=torch.float32, device=device)
        rmsnorm_bwd(x, w, dy, rstd, dx, dw, config=cfg)
        gx, gw = reference_grads(lambda a, b: rms_norm_ref(a, b, 1e-6), (x, w), (dy,))
        assert_rel_close(dx, gx, name="dx")
        assert_rel_close(dw, gw, name="dweight")


@pytest.mark.parametrize("fixed", [16, 0], ids=["width_fixed", "width_at_run_time"])
def test_chunked_rows_with_the_width_fixed_or_at_run_time(device, monkeypatch, fixed):
    """Chunked rows compile with N fixed (_row_plans.row_meta) until FIXED_WIDTHS_MAX widths are; then N is read
    at run time. Both must write every element of odd rows right (rms_norm, layer_norm, softmax)."""
    from fly_norm import _norm_host as norm
    from fly_norm import _row_plans as passes
    from fly_norm.reference import layer_norm_ref, softmax_ref
    from fly_norm.softmax import softmax_fwd

    monkeypatch.setattr(passes, "FIXED_WIDTHS_MAX", fixed)
    monkeypatch.setattr(passes, "_FIXED_WIDTHS", set())
    assert passes.row_meta(CHUNKED, 257)["N_FIXED"] == (257 if fixed else 0)
    assert passes.row_meta(RowConfig(4, 512, 4, True), 300)["N_FIXED"] == 0  # single pass: never
    for n in (257, 1000):
        x, w, b = randn(3, n, device=device), randn(n, device=device, seed=1), randn(n, device=device, seed=2)
        for is_rms, ref in ((True, rms_norm_ref(x, w, 1e-6)), (False, layer_norm_ref(x, w, b, 1e-6))):
            y = empty_poisoned(3, n, dtype=torch.float32, device=device)
            norm.launch_fwd(x, None, w, None if is_rms else b, None, y, None, None, None, None, 1e-6, 0.0, is_rms,
                            None, CHUNKED)  # fmt: skip
            assert_rel_close(y, ref)
        y = empty_poisoned(3, n, dtype=torch.float32, device=device)
        softmax_fwd(x, y, CHUNKED)
        assert_rel_close(y, softmax_ref(x))


def test_chunked_path(device, monkeypatch):
    """Rows wider than one step are reduced chunk by chunk: forward, residual, backward and quant."""
    force_config(monkeypatch, rmsnorm_mod, CHUNKED)
    x = randn(3, 257, device=device)
    r = randn(3, 257, device=device, seed=2)
    w = randn(257, device=device, seed=1)
    assert_rel_close(rms_norm(x, w), rms_norm_ref(x, w))
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, h = rms_norm(xs, ws, residual=rs, weight_offset=0.5)
    dy, dh = randn(3, 257, device=device, seed=5), randn(3, 257, device=device, seed=6)
    ((y * dy).sum() + (h * dh).sum()).backward()
    ref = reference_grads(lambda a, b, c: rms_norm_ref(a, b, 1e-6, c, 0.5), (x, w, r), (dy, dh))
    assert_grads_close((xs, ws, rs), ref, ("x", "weight", "residual"))
    q, s = rms_norm_quant(x, w, dtype=torch.int8)
    assert_quant_matches(q, s, *rms_norm_quant_ref(x, w, dtype=torch.int8))


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quant_chunked_matches_single_pass(device, monkeypatch, qdtype):
    """The quantized RMSNorm takes its row max from the statistics pass (max |y| = rstd * max |h * w|),
    single pass and chunked: both match the reference, with residual and smooth scale, and each other's
    scales to the last bits (the sums of squares are added in different orders)."""
    x = randn(3, 257, device=device, scale=3.0)
    x[1, 200] = 40.0  # an outlier far from the first chunk sets the row's max
    r = randn(3, 257, device=device, seed=2)
    w, sm = randn(257, device=device, seed=1), randn(257, device=device, seed=3).abs() + 0.5
    qr, sr, hr = rms_norm_quant_ref(x, w, dtype=qdtype, smooth_scale=sm, residual=r)
    got = []
    for cfg in (RowConfig(4, 512, 4, True), CHUNKED):
        force_config(monkeypatch, rmsnorm_mod, cfg)
        q, s, h = rms_norm_quant(x, w, dtype=qdtype, smooth_scale=sm, residual=r)
        assert_quant_matches(q, s, qr, sr)
        assert_rel_close(h, hr)
        got.append((s, h))
    assert_rel_close(got[0][0], got[1][0], tol=1e-6)
    assert torch.equal(got[0][1], got[1][1])


# Rows of the 32K bucket under the packed config: (width, row stride, first column of x's view). Packed:
# an even width and stride from a 4-byte boundary; else (odd width, odd stride, a view starting at column
# 1) the chunked passes serve the same config.
PACKED_CASES = [(32768, 32768, 0, True), (20000, 20004, 0, True), (20001, 20001, 0, False),
                (20000, 20001, 0, False), (20000, 20002, 1, False)]  # fmt: skip


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("n,stride,first,packs", PACKED_CASES)
def test_quant_packed_rows(device, monkeypatch, qdtype, n, stride, first, packs):
    """The quantized RMSNorm's single pass with bf16 rows held packed (two columns an int32 through the
    reduction), and the calls that config cannot serve packed, against the reference."""
    from fly_norm import _norm_host as norm

    force_config(monkeypatch, rmsnorm_mod, RowConfig(1, 32768, 8, True, maxnreg=128))
    seen = []
    real = norm._row_plan
    monkeypatch.setattr(norm, "_row_plan", lambda *a: seen.append(real(*a)[1]) or real(*a))
    base = randn(3, stride + first, dtype=torch.bfloat16, device=device, scale=3.0)
    x = base[:, first : first + n]
    x[1, n - 1] = 40.0  # an outlier in the last column (even widths: the high half of a word) sets the max
    w = randn(n, dtype=torch.bfloat16, device=device, seed=1)
    q, s = rms_norm_quant(x, w, dtype=qdtype)
    assert seen == [packs]
    assert_quant_matches(q, s, *rms_norm_quant_ref(x, w, dtype=qdtype))


# ---------------------------------------------------------------- backward


# (N, residual, weight_offset, weight present): odd widths, the fused path and the (1 + w) convention.
GRAD_CASES = [(7, False, 0.0, True), (257, True, 0.0, True), (33, True, 1.0, True), (100, False, 0.0, False)]


@pytest.mark.parametrize("n,fused,offset,has_w", GRAD_CASES)
def test_gradients(device, n, fused, offset, has_w):
    x = randn(2, 3, n, device=device).requires_grad_()
    w = randn(n, device=device, seed=1).requires_grad_() if has_w else None
    r = randn(2, 3, n, device=device, seed=2).requires_grad_() if fused else None
    out = rms_norm(x, w, 1e-6, r, weight_offset=offset)
    outs = out if fused else (out,)
    ups = [randn(*x.shape, device=device, seed=10 + i) for i in range(len(outs))]
    sum((o * u).sum() for o, u in zip(outs, ups, strict=True)).backward()
    ref = reference_grads(lambda a, b, c: rms_norm_ref(a, b, 1e-6, c, offset), (x, w, r), ups)
    assert_grads_close((x, w, r), ref, ("x", "weight", "residual"))


@pytest.mark.parametrize("used", [0, 1])
def test_gradients_through_one_output(device, used):
    """With a residual, only y or only residual_out reaching the loss (the other's gradient: None, zero)."""
    x = randn(4, 33, device=device).requires_grad_()
    w = randn(33, device=device, seed=1).requires_grad_()
    r = randn(4, 33, device=device, seed=2).requires_grad_()
    up = randn(4, 33, device=device, seed=11)
    (rms_norm(x, w, 1e-6, r)[used] * up).sum().backward()
    ups = [up if i == used else torch.zeros_like(up) for i in range(2)]
    ref = reference_grads(lambda a, b, c: rms_norm_ref(a, b, 1e-6, c), (x, w, r), ups)
    assert_grads_close((x, w, r), ref, ("x", "weight", "residual"))


def test_weight_gradient_in_weight_dtype(device):
    x = randn(4, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    w = randn(64, device=device, seed=1).requires_grad_()  # fp32 master weight, bf16 activations
    rms_norm(x, w).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    gx, gw = reference_grads(lambda a, b: rms_norm_ref(a, b), (x, w), (torch.ones(4, 64),))
    assert_rel_close(x.grad, gx)
    assert_rel_close(w.grad, gw, tol=tolerance(torch.bfloat16))


def test_mixed_dtype_residual_gradients(device):
    """bf16 activations on an fp32 residual stream: each gradient comes back in its input's dtype."""
    x = randn(3, 50, dtype=torch.bfloat16, device=device).requires_grad_()
    r = randn(3, 50, device=device, seed=2).requires_grad_()
    y, h = rms_norm(x, None, residual=r)
    dy, dh = randn(3, 50, device=device, seed=5), randn(3, 50, device=device, seed=6)
    ((y.float() * dy).sum() + (h * dh).sum()).backward()
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32
    gx, gr = reference_grads(lambda a, c: rms_norm_ref(a, None, 1e-6, c), (x, r), (dy, dh))
    assert_rel_close(x.grad, gx)
    assert_rel_close(r.grad, gr, tol=tolerance(torch.bfloat16))  # y is rounded to bf16 before dy meets it


def test_stats_only_when_grad_is_needed(device):
    x = randn(3, 16, device=device)
    w = randn(16, device=device)
    _, _, rstd = torch.ops.fly_norm.rms_norm_fwd(x, w, None, 1e-6, 0.0, False)
    assert rstd.numel() == 0
    _, _, rstd = torch.ops.fly_norm.rms_norm_fwd(x, w, None, 1e-6, 0.0, True)
    expected = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6)
    assert_rel_close(rstd, expected)


# (N, weight: "bf16" / "fp32" / None, weight_offset, rows strided, dweight asked for): the pipelined backward's
# widths (past the single pass's 8K, to 16K) with each weight form; one below a power of two, one odd pair.
PIPELINED_CASES = [
    (8194, "bf16", 0.0, False, True),
    (12286, "fp32", 1.0, True, True),
    (16384, None, 0.0, False, False),
]


@pytest.mark.parametrize("n,wdtype,offset,strided,need_dw", PIPELINED_CASES)
def test_pipelined_backward(device, n, wdtype, offset, strided, need_dw):
    """RMSNorm's bf16 backward at 8K-16K columns runs the pipelined kernel (packed words through the software
    pipeliner): dx and dweight against the fp64 reference, dx's every element written (poisoned first)."""
    m = 3
    base = randn(m, n + 6 if strided else n, dtype=torch.bfloat16, device=device)
    x = base[:, :n]  # strided rows when the base is wider
    w = None if wdtype is None else randn(n, dtype=getattr(torch, {"bf16": "bfloat16"}.get(wdtype, "float32")),
                                          device=device, seed=1)  # fmt: skip
    dy = randn(m, n, dtype=torch.bfloat16, device=device, seed=2)
    rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6).float()
    dx = empty_poisoned(m, n, dtype=torch.bfloat16, device=device)
    dw = empty_poisoned(n, dtype=w.dtype, device=device) if need_dw and w is not None else None
    x2, dy2 = x.detach(), dy
    path = norm_mod.bwd_route(x2, dy2, None, dx, True)
    assert path.path is Path.PIPELINED and path.config.block_n == 16384  # the path under test
    norm_mod.backward_into(x2, w, dy2, None, None, rstd, dx, dw, None, offset, True, bwd_default_row_config(n))
    xs = x.detach().clone().requires_grad_()
    ws = None if w is None else w.detach().clone().requires_grad_()
    gx, gw = reference_grads(lambda a, b: rms_norm_ref(a, b, 1e-6, None, offset), (xs, ws), (dy,))
    assert_rel_close(dx, gx, name="dx")
    if dw is not None:
        assert_rel_close(dw, gw, tol=tolerance(w.dtype), name="dweight")


def test_pipelined_backward_plan():
    """Only RMSNorm's bf16 rows of 8K-16K columns, even widths and strides, 4-byte aligned, with no residual
    gradient take the pipelined backward (fly_norm.routing.route); everything else keeps its config."""

    def plan(n=12288, dtype=torch.bfloat16, is_rms=True, dres=False, offset=0, stride=None):
        x = torch.zeros(2, (stride or n) + offset, dtype=dtype)[:, offset : offset + n]
        return norm_mod.bwd_route(x, x, x if dres else None, x, is_rms).path is Path.PIPELINED

    assert plan() and plan(8194) and plan(16384) and plan(stride=12300)
    assert not plan(8192) and not plan(16386) and not plan(12287)  # the single pass's widths; too wide; odd
    assert not plan(dtype=torch.float16) and not plan(dtype=torch.float32)
    assert not plan(is_rms=False) and not plan(dres=True)
    assert not plan(offset=1) and not plan(stride=12289)  # rows off 4-byte boundaries


@pytest.mark.parametrize("n", [1, 7, 256, 1000, 1024, 4096, 8192, 8193, 16384, 65537, 262144])
def test_backward_default_config(n):
    """The backward's default keeps <= 16 elements per thread (no register spills) and is valid."""
    for arch in ("sm_90", "gfx942"):
        for elems in (8, 16):  # layer_norm's default, rms_norm's
            cfg = bwd_default_row_config(n, arch, elems)
            assert row_config_valid(cfg, n, arch)
            per_thread = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
            assert per_thread <= 16 and cfg.num_warps <= 16
            # the asked-for density wherever 16 warps allow it (tiny rows pack more rows instead)
            assert per_thread == elems or cfg.num_warps == 16 or cfg.block_m == 64 or n <= 32
            assert cfg.single_pass == (n <= 8192)


# ---------------------------------------------------------------- quantized forward


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 257])
def test_quant(device, qdtype, dtype, n):
    x = randn(3, n, dtype=dtype, device=device, scale=3.0)
    w = randn(n, dtype=dtype, device=device, seed=1)
    q, s = rms_norm_quant(x, w, dtype=qdtype)
    assert s.shape == (3,)
    assert_quant_matches(q, s, *rms_norm_quant_ref(x, w, dtype=qdtype))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("smooth_dtype", [torch.float32, torch.bfloat16])
def test_quant_smooth_and_residual(device, qdtype, smooth_dtype):
    x = randn(2, 2, 100, dtype=torch.bfloat16, device=device)
    r = randn(2, 2, 100, dtype=torch.bfloat16, device=device, seed=2)
    w = randn(100, dtype=torch.bfloat16, device=device, seed=1)
    smooth = (randn(100, device=device, seed=3).abs() + 0.5).to(smooth_dtype)
    q, s, h = rms_norm_quant(x, w, dtype=qdtype, smooth_scale=smooth, residual=r)
    qr, sr, hr = rms_norm_quant_ref(x, w, dtype=qdtype, smooth_scale=smooth, residual=r)
    assert_quant_matches(q, s, qr, sr)
    assert_rel_close(h, hr)


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_are_named(device):
    x = randn(4, 8, device=device)
    w = randn(8, device=device)
    with pytest.raises(DTypeError, match="x: expected dtype"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(DTypeError, match="weight: expected dtype"):
        rms_norm(x.half(), w.double())  # any fp32/fp16/bf16 weight is taken (test_norm_api), fp64 is not
    with pytest.raises(ShapeError, match=r"weight: expected shape \(8,\)"):
        rms_norm(x, randn(9, device=device))
    with pytest.raises(ShapeError, match="residual: expected shape"):
        rms_norm(x, w, residual=randn(4, 9, device=device))
    with pytest.raises(LayoutError, match="x: the last dimension must be contiguous"):
        rms_norm(randn(8, 4, device=device).t(), w)
    with pytest.raises(DeviceError, match="weight: expected a tensor on"):
        rms_norm(x, torch.ones(8, device="meta"))


def test_quant_operand_dtypes_must_match(device):
    x = randn(4, 8, dtype=torch.bfloat16, device=device)
    w = randn(8, dtype=torch.bfloat16, device=device)
    with pytest.raises(DTypeError, match="weight: expected dtype bf16"):
        rms_norm_quant(x, w.float())
    with pytest.raises(DTypeError, match="residual: expected dtype bf16"):
        rms_norm_quant(x, w, residual=x.float())
    with pytest.raises(DTypeError, match="smooth_scale: expected dtype"):
        rms_norm_quant(x, w, smooth_scale=torch.ones(8, dtype=torch.float16, device=device))
    with pytest.raises(DTypeError, match="dtype: expected torch.int8 or torch.float8_e4m3fn"):
        rms_norm_quant(x, w, dtype=torch.float16)


# ---------------------------------------------------------------- seed builders


def test_builders(device):
    n, rows, m_in = 100, 5, 3  # buffers hold more rows than m_in: the rest must stay untouched
    x = randn(rows, n, dtype=torch.bfloat16, device=device)
    w = randn(n, device=device, seed=1)  # fp32 weight with bf16 activations (weight_dtype_str="f32")
    y = empty_poisoned(rows, n, dtype=torch.bfloat16, device=device)
    rstd = empty_poisoned(rows, dtype=torch.float32, device=device)
    build_rmsnorm_module(n, "bf16", store_rstd=True, eps=1e-5, weight_dtype_str="f32")(x, w, y, rstd, m_in)
    assert_rel_close(y[:m_in], rms_norm_ref(x[:m_in], w, 1e-5))
    assert torch.isnan(y[m_in:].float()).all() and torch.isnan(rstd[m_in:]).all()
    y2 = empty_poisoned(rows, n, dtype=torch.bfloat16, device=device)
    build_rmsnorm_module(n, "bf16", weight_dtype_str="f32")(x, w, y2, m_in)
    assert torch.equal(y2[:m_in], y[:m_in])

    dy = randn(rows, n, dtype=torch.bfloat16, device=device, seed=4)
    dx = empty_poisoned(rows, n, dtype=torch.bfloat16, device=device)
    dw = empty_poisoned(n, dtype=torch.float32, device=device)
    build_rmsnorm_bwd_module(n, "bf16", weight_dtype_str="f32")(x, w, dy, rstd, dx, dw, m_in)
    gx, gw = reference_grads(lambda a, b: rms_norm_ref(a, b, 1e-5), (x[:m_in], w), (dy[:m_in],))
    assert_rel_close(dx[:m_in], gx)
    assert_rel_close(dw, gw, tol=tolerance(torch.bfloat16))
    with pytest.raises(DTypeError, match="Input: expected dtype bf16"):
        build_rmsnorm_module(n, "bf16")(x.half(), w.bfloat16(), y, m_in)
    with pytest.raises(DTypeError, match="weight_dtype_str"):
        build_rmsnorm_module(n, "f32", weight_dtype_str="bf16")


# ---------------------------------------------------------------- torch integration


def test_forced_search_checks_candidates_against_the_reference(device, monkeypatch, tmp_path):
    """autotune=True searches with the call's own inputs; the winner must still give the right answer."""
    from fly_norm.autotune import clear_memo

    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    try:
        x = randn(2, 600, device=device)
        w = randn(600, device=device, seed=1)
        r = randn(2, 600, device=device, seed=2)
        y, h = rms_norm(x, w, residual=r, autotune=True)
        y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
        assert_rel_close(y, y_ref)
        assert_rel_close(h, h_ref)
    finally:
        clear_memo()  # the searched winner must not leak into other tests


def test_custom_ops_pass_opcheck(device):
    x = randn(3, 33, device=device)
    w = randn(33, device=device, seed=1)
    r = randn(3, 33, device=device, seed=2)
    torch.library.opcheck(torch.ops.fly_norm.rms_norm_fwd.default, (x, w, r, 1e-6, 0.0, True))
    torch.library.opcheck(torch.ops.fly_norm.rms_norm_quant.default, (x, w, None, None, 1e-6, torch.int8))
    rstd = torch.ops.fly_norm.rms_norm_fwd(x, w, None, 1e-6, 0.0, True)[2]
    torch.library.opcheck(torch.ops.fly_norm.rms_norm_bwd.default, (r, None, x, w, rstd, 0.0, True, torch.float32))


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    x = randn(3, 40, device=device).requires_grad_()
    w = randn(40, device=device, seed=1).requires_grad_()
    r = randn(3, 40, device=device, seed=2)

    @torch.compile(fullgraph=True)
    def f(a, b, c):
        y, h = rms_norm(a, b, 1e-6, c)
        q, s = rms_norm_quant(h, None, dtype=torch.int8)
        return y * 2.0, q, s

    start = time.perf_counter()
    y, q, s = f(x, w, r)
    y.sum().backward()
    assert time.perf_counter() - start < 120
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert_rel_close(y, 2.0 * y_ref)
    assert_quant_matches(q, s, *rms_norm_quant_ref(h_ref.float(), None, dtype=torch.int8))
    gx, gw = reference_grads(lambda a, b: 2.0 * rms_norm_ref(a, b, 1e-6, r)[0], (x, w), (torch.ones(3, 40),))
    assert_grads_close((x, w), (gx, gw), ("x", "weight"))


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n",
    [(1, 1024), (4096, 1024), (2048, 4096), (1000, 8192), (300, 16384), (64, 65536), (16, 262144), (3, 65537),
     (7, 4097)],
)  # fmt: skip
def test_gpu_shapes(dtype, m, n):
    x = randn(m, n, dtype=dtype, device="cuda")
    w = randn(n, device="cuda", seed=1)
    r = randn(m, n, dtype=dtype, device="cuda", seed=2)
    assert_rel_close(rms_norm(x, w.to(dtype)), rms_norm_ref(x, w.to(dtype)))
    y, h = rms_norm(x, w, residual=r)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert_rel_close(y, y_ref)
    assert_rel_close(h, h_ref)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = randn(m, n, dtype=dtype, device="cuda", seed=3)
    rms_norm(xs, ws).backward(dy)
    gx, gw = reference_grads(lambda a, b: rms_norm_ref(a, b), (x, w), (dy,))
    assert_rel_close(xs.grad, gx)
    assert_rel_close(ws.grad, gw, tol=tolerance(dtype))
    q, s = rms_norm_quant(x, w.to(dtype), dtype=torch.float8_e4m3fn)
    assert_quant_matches(q, s, *rms_norm_quant_ref(x, w.to(dtype), dtype=torch.float8_e4m3fn))


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_compile_and_cuda_graph():
    torch._dynamo.reset()
    x = randn(256, 4096, dtype=torch.bfloat16, device="cuda")
    w = randn(4096, dtype=torch.bfloat16, device="cuda", seed=1)
    f = torch.compile(lambda a, b: rms_norm(a, b) * 2, fullgraph=True)
    assert_rel_close(f(x, w), 2 * rms_norm_ref(x, w))
    rms_norm(x, w)  # compile the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rms_norm(x, w)
    x.copy_(randn(256, 4096, dtype=torch.bfloat16, device="cuda", seed=9))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(y, rms_norm_ref(x, w))
