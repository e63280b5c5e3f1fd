"""LayerNorm forward, backward, fused residual and quantized forward against the fp64 reference.

The comparison helpers are test_rmsnorm's (both norms share one kernel family).
"""

from __future__ import annotations

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

import fly_norm.layernorm as layernorm_mod
from fly_norm.layernorm import build_layernorm_module, layer_norm, layer_norm_quant, layernorm_bwd, layernorm_fwd
from fly_norm.reference import layer_norm_quant_ref, layer_norm_ref
from flydsl.errors import DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance
from flydsl_common.rows import RowConfig


def affine(n, dtype, device, has_w=True, has_b=True):
    w = randn(n, dtype=dtype, device=device, seed=1) if has_w else None
    b = randn(n, dtype=dtype, device=device, seed=7) if has_b else None
    return w, b


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,n", SHAPES)
def test_forward(device, dtype, lead, n):
    x = randn(*lead, n, dtype=dtype, device=device, scale=2.0) + 0.5
    w, b = affine(n, dtype, device)
    y = layer_norm(x, w, b)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert_rel_close(y, layer_norm_ref(x, w, b, 1e-5))


# Optional affine parts, fp32 parameters with 16-bit activations, and the (1 + w) convention.
@pytest.mark.parametrize(
    "dtype,pdtype,has_w,has_b,offset",
    [
        (torch.bfloat16, torch.float32, True, True, 0.0),
        (torch.float16, torch.float16, False, True, 0.0),
        (torch.float32, torch.float32, True, False, 1.0),
        (torch.float32, torch.float32, False, False, 0.0),
    ],
)
def test_affine_variants(device, dtype, pdtype, has_w, has_b, offset):
    x = randn(3, 100, dtype=dtype, device=device)
    w, b = affine(100, pdtype, device, has_w, has_b)
    y = layer_norm(x, w, b, 1e-6, weight_offset=offset)
    assert y.dtype == dtype
    assert_rel_close(y, layer_norm_ref(x, w, b, 1e-6, weight_offset=offset))


# Rows of the 32K bucket under the packed config: (width, row stride, first column of x's view, weight,
# bias, packs). Packed: an even width and stride from a 4-byte boundary; else the chunked passes serve it.
PACKED_CASES = [(32768, 32768, 0, True, True, True), (20000, 20004, 0, True, False, True),
                (20000, 20000, 0, False, False, True), (20001, 20001, 0, True, True, False),
                (20000, 20001, 0, True, True, False), (20000, 20002, 1, True, True, False)]  # fmt: skip


@pytest.mark.parametrize("n,stride,first,has_w,has_b,packs", PACKED_CASES)
def test_packed_rows(device, monkeypatch, n, stride, first, has_w, has_b, packs):
    """The plain LayerNorm's single pass with bf16 rows held packed (two columns an int32 through both
    reductions), and the calls that config cannot serve packed, against the reference; a large mean."""
    from fly_norm import _norm_host as norm

    force_config(monkeypatch, layernorm_mod, RowConfig(1, 32768, 8, True, maxnreg=128))
    monkeypatch.setattr(norm, "_EAGER_PLANS", {})  # plans made under other configs must not serve these calls
    seen = []
    real = norm._row_plan
    monkeypatch.setattr(norm, "_row_plan", lambda *a: seen.append(real(*a)[1]) or real(*a))
    base = randn(3, stride + first, dtype=torch.bfloat16, device=device, scale=2.0) + 100.0
    x = base[:, first : first + n]
    x[1, n - 1] = -300.0  # an outlier in the last column (even widths: the high half of a word)
    w, b = affine(n, torch.bfloat16, device, has_w, has_b)
    y = layer_norm(x, w, b, 1e-5)
    assert seen == [packs]
    assert_rel_close(y, layer_norm_ref(x, w, b, 1e-5))


@pytest.mark.parametrize("config", [None, CHUNKED], ids=["single_pass", "chunked"])
def test_large_mean_is_not_cancelled(device, monkeypatch, config):
    """|mean| >> std: E[x^2] - E[x]^2 in fp32 would lose the variance; the chunked path merges (mean, M2) pairs."""
    if config is not None:
        force_config(monkeypatch, layernorm_mod, config)
    x = randn(3, 257, device=device) + 1000.0
    y = layer_norm(x, None, None)
    # The input itself is exact; fp32 rounding of x - mean leaves ~1e-4 / 1 relative error at most.
    assert_rel_close(y, layer_norm_ref(x, None, None), tol=1e-4)
    # The chunked pass sums each lane's deviations from the lane's first element (the row's first chunk)
    # and merges the lanes about the row's first element: a first chunk far from the rest of the row
    # (row 0), a first chunk holding the row's only large values (row 1), an outlier first element (row 2)
    x = randn(3, 257, device=device)
    x[0, :64] += 1000.0
    x[1, :64] += 300.0
    x[1, 64:] = 0.001 * x[1, 64:] + 2.0
    x[2] += 500.0
    x[2, 0] = -3000.0
    assert_rel_close(layer_norm(x, None, None), layer_norm_ref(x, None, None), tol=1e-4)


def test_fused_residual_and_strided_rows(device):
    base = randn(4, 300, dtype=torch.bfloat16, device=device)
    x = base[:, 5:262]  # row stride 300
    r = randn(4, 257, device=device, seed=2)  # fp32 residual stream with bf16 activations
    w, b = affine(257, torch.bfloat16, device)
    y, h = layer_norm(x, w, b, residual=r)
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    y_ref, h_ref = layer_norm_ref(x, w, b, 1e-5, r)
    assert_rel_close(y, y_ref)
    assert_rel_close(h, h_ref)


def test_empty_input(device):
    x = torch.empty(3, 0, 16, device=device)
    w, b = affine(16, torch.float32, device)
    assert layer_norm(x, w, b).shape == x.shape
    q, s = layer_norm_quant(x, w, b)
    assert q.shape == x.shape and s.shape == (3, 0)


def test_low_level_launch_writes_every_element(device):
    x = randn(3, 257, device=device) * 3
    w, b = affine(257, torch.float32, device)
    dy = randn(3, 257, device=device, seed=4)
    for cfg in (RowConfig(4, 512, 4, True), CHUNKED):
        y = empty_poisoned(3, 257, dtype=torch.float32, device=device)
        mean, rstd = (empty_poisoned(3, dtype=torch.float32, device=device) for _ in range(2))
        layernorm_fwd(x, w, b, y, mean=mean, rstd=rstd, config=cfg)
        assert_rel_close(y, layer_norm_ref(x, w, b))
        dx = empty_poisoned(3, 257, dtype=torch.float32, device=device)
        dw, db = (empty_poisoned(257, dtype=torch.float32, device=device) for _ in range(2))
        layernorm_bwd(x, w, dy, mean, rstd, dx, dw, db, config=cfg)
        gx, gw, gb = reference_grads(lambda a, c, d: layer_norm_ref(a, c, d), (x, w, b), (dy,))
        for out, ref, name in ((dx, gx, "dx"), (dw, gw, "dweight"), (db, gb, "dbias")):
            assert_rel_close(out, ref, name=name)


def test_low_level_backward_with_dweight_and_dbias_in_different_dtypes(device):
    """dweight in fp32 and dbias in bf16 (the seed builders' outputs may differ): their column sums then
    take a launch each (one launch serves both only in one dtype)."""
    x = randn(6, 300, device=device) * 2
    w, b = affine(300, torch.float32, device)
    dy = randn(6, 300, device=device, seed=4)
    mean, rstd = x.double().mean(-1).float(), torch.rsqrt(x.double().var(-1, unbiased=False) + 1e-5).float()
    dx = empty_poisoned(6, 300, dtype=torch.float32, device=device)
    dw = empty_poisoned(300, dtype=torch.float32, device=device)
    db = empty_poisoned(300, dtype=torch.bfloat16, device=device)
    layernorm_bwd(x, w, dy, mean, rstd, dx, dw, db)
    gx, gw, gb = reference_grads(lambda a, c, d: layer_norm_ref(a, c, d), (x, w, b), (dy,))
    assert_rel_close(dx, gx, name="dx")
    assert_rel_close(dw, gw, name="dweight")
    assert_rel_close(db, gb, tol=tolerance(torch.bfloat16), name="dbias")


# ---------------------------------------------------------------- backward

# (N, residual, weight_offset, weight, bias, chunked): odd widths, fused residual, (1 + w),
# missing affine parts, and the chunked backward (scratch + column-outer partials).
GRAD_CASES = [
    (7, False, 0.0, True, True, False),
    (257, True, 0.0, True, True, False),
    (33, True, 1.0, True, False, False),
    (100, False, 0.0, False, True, False),
    (257, True, 0.5, True, True, True),
]


@pytest.mark.parametrize("n,fused,offset,has_w,has_b,chunked", GRAD_CASES)
def test_gradients(device, monkeypatch, n, fused, offset, has_w, has_b, chunked):
    if chunked:
        force_config(monkeypatch, layernorm_mod, CHUNKED)
    x = randn(5, n, device=device).requires_grad_()
    w, b = (None if t is None else t.requires_grad_() for t in affine(n, torch.float32, device, has_w, has_b))
    r = randn(5, n, device=device, seed=2).requires_grad_() if fused else None
    out = layer_norm(x, w, b, 1e-5, r, weight_offset=offset)
    outs = out if fused else (out,)
    ups = [randn(5, n, device=device, seed=10 + i) for i in range(len(outs))]
    sum((o * u).sum() for o, u in zip(outs, ups, strict=True)).backward()
    ref = reference_grads(lambda a, c, d, e: layer_norm_ref(a, c, d, 1e-5, e, offset), (x, w, b, r), ups)
    assert_grads_close((x, w, b, r), ref, ("x", "weight", "bias", "residual"))


@pytest.mark.parametrize("n,fused,offset,has_w,has_b,chunked", [c for c in GRAD_CASES if not c[5]])
def test_gradients_lean_single_pass(device, monkeypatch, n, fused, offset, has_w, has_b, chunked):
    """The single-pass backward's lean form (no select past the row: dy reads 0 there), which layer_norm takes
    from norm.BWD_LEAN_MIN_N columns, forced at every width: masked columns and rows past the last."""
    from fly_norm import _norm_host as norm

    monkeypatch.setattr(norm, "BWD_LEAN_MIN_N", 0)
    test_gradients(device, monkeypatch, n, fused, offset, has_w, has_b, chunked)


@pytest.mark.parametrize("used", [0, 1])
def test_gradients_through_one_output(device, used):
    """With a residual, only y or only residual_out reaching the loss: the other output's gradient arrives as
    None (grads are not materialized) and counts as zero."""
    x = randn(4, 33, device=device).requires_grad_()
    w, b = (t.requires_grad_() for t in affine(33, torch.float32, device))
    r = randn(4, 33, device=device, seed=2).requires_grad_()
    up = randn(4, 33, device=device, seed=11)
    (layer_norm(x, w, b, 1e-5, r)[used] * up).sum().backward()
    ups = [up if i == used else torch.zeros_like(up) for i in range(2)]
    ref = reference_grads(lambda a, c, d, e: layer_norm_ref(a, c, d, 1e-5, e), (x, w, b, r), ups)
    assert_grads_close((x, w, b, r), ref, ("x", "weight", "bias", "residual"))


def test_parameter_gradients_in_their_dtype(device):
    x = randn(4, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    w = randn(64, device=device, seed=1).requires_grad_()
    b = randn(64, dtype=torch.bfloat16, device=device, seed=7).requires_grad_()
    layer_norm(x, w, b).float().sum().backward()
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
    gx, gw, gb = reference_grads(lambda a, c, d: layer_norm_ref(a, c, d), (x, w, b), (torch.ones(4, 64),))
    for out, ref in ((x.grad, gx), (w.grad, gw), (b.grad, gb)):
        assert_rel_close(out, ref, tol=tolerance(torch.bfloat16))


def test_stats_only_when_grad_is_needed(device):
    x = randn(3, 16, device=device)
    _, _, mean, rstd = torch.ops.fly_norm.layer_norm_fwd(x, None, None, None, 1e-5, 0.0, False)
    assert mean.numel() == rstd.numel() == 0
    _, _, mean, rstd = torch.ops.fly_norm.layer_norm_fwd(x, None, None, None, 1e-5, 0.0, True)
    assert_rel_close(mean, x.double().mean(-1))
    assert_rel_close(rstd, torch.rsqrt(x.double().var(-1, unbiased=False) + 1e-5))


# ---------------------------------------------------------------- quantized forward


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,fused,smooth", [(1, False, False), (33, True, False), (257, True, True)])
def test_quant(device, qdtype, dtype, n, fused, smooth):
    x = randn(3, n, dtype=dtype, device=device, scale=3.0)
    w, b = affine(n, dtype, device)
    r = randn(3, n, dtype=dtype, device=device, seed=2) if fused else None
    s_col = (randn(n, device=device, seed=3).abs() + 0.5) if smooth else None
    out = layer_norm_quant(x, w, b, dtype=qdtype, smooth_scale=s_col, residual=r)
    ref = layer_norm_quant_ref(x, w, b, dtype=qdtype, smooth_scale=s_col, residual=r)
    assert_quant_matches(out[0], out[1], ref[0], ref[1])
    if fused:
        assert_rel_close(out[2], ref[2])


def test_quant_chunked(device, monkeypatch):
    force_config(monkeypatch, layernorm_mod, CHUNKED)
    x = randn(2, 257, dtype=torch.float16, device=device)
    w, b = affine(257, torch.float16, device)
    q, s = layer_norm_quant(x, w, b, dtype=torch.float8_e4m3fn)
    assert_quant_matches(q, s, *layer_norm_quant_ref(x, w, b, dtype=torch.float8_e4m3fn))


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_are_named(device):
    x = randn(4, 8, dtype=torch.float16, device=device)
    w, b = affine(8, torch.float16, device)
    with pytest.raises(DTypeError, match="bias: expected dtype"):
        layer_norm(x, w, b.bfloat16())
    with pytest.raises(ShapeError, match="bias: expected a 1-D tensor"):
        layer_norm(x, w, b[None])
    with pytest.raises(LayoutError, match="weight: expected a contiguous vector"):
        layer_norm(x, randn(16, dtype=torch.float16, device=device)[::2], b)
    with pytest.raises(LayoutError, match="residual: the last dimension must be contiguous"):
        layer_norm(x, w, b, residual=randn(8, 4, dtype=torch.float16, device=device).t())
    with pytest.raises(DTypeError, match="bias: expected dtype fp16"):
        layer_norm_quant(x, w, b.float())
    with pytest.raises(ShapeError, match="smooth_scale: expected shape"):
        layer_norm_quant(x, w, b, smooth_scale=torch.ones(9, device=device))


# ---------------------------------------------------------------- seed builder and torch integration


def test_builder(device):
    n, m_in = 70, 2
    x = randn(4, n, dtype=torch.float16, device=device)
    w, b = affine(n, torch.float16, device)
    y = empty_poisoned(4, n, dtype=torch.float16, device=device)
    build_layernorm_module(n, "f16")(x, w, b, y, m_in)
    assert_rel_close(y[:m_in], layer_norm_ref(x[:m_in], w, b, 1e-5))
    assert torch.isnan(y[m_in:]).all()
    with pytest.raises(DTypeError, match="Beta: expected dtype fp16"):
        build_layernorm_module(n, "f16")(x, w, b.float(), y, m_in)


def test_custom_ops_pass_opcheck(device):
    x = randn(3, 33, device=device)
    w, b = affine(33, torch.float32, device)
    torch.library.opcheck(torch.ops.fly_norm.layer_norm_fwd.default, (x, w, b, x * 0.5, 1e-5, 0.0, True))
    _, _, mean, rstd = torch.ops.fly_norm.layer_norm_fwd(x, w, b, None, 1e-5, 0.0, True)
    args = (x * 2, None, x, w, mean, rstd, 0.0, True, True, torch.float32, torch.float32, torch.float32)
    torch.library.opcheck(torch.ops.fly_norm.layer_norm_bwd.default, args)
    args = (x, w, b, None, torch.ones(33, device=device), 1e-5, torch.float8_e4m3fn)
    torch.library.opcheck(torch.ops.fly_norm.layer_norm_quant.default, args)


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    x = randn(3, 40, device=device).requires_grad_()
    w, b = (t.requires_grad_() for t in affine(40, torch.float32, device))

    @torch.compile(fullgraph=True)
    def f(a, c, d):
        return torch.relu(layer_norm(a, c, d))

    y = f(x, w, b)
    y.sum().backward()
    assert_rel_close(y, torch.relu(layer_norm_ref(x, w, b)))
    ref = reference_grads(lambda a, c, d: torch.relu(layer_norm_ref(a, c, d)), (x, w, b), (torch.ones(3, 40),))
    assert_grads_close((x, w, b), ref, ("x", "weight", "bias"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,n",
    # 20001 and 32768: the chunked forward (layer_norm splits only past 32K columns), quant included
    [(1, 1024), (4096, 1024), (2048, 4096), (1000, 8192), (8, 20001), (32, 32768), (64, 65536), (16, 262144),
     (3, 65537), (5, 4095)],
)  # fmt: skip
def test_gpu_shapes(dtype, m, n):
    x = randn(m, n, dtype=dtype, device="cuda") + 3.0
    w, b = affine(n, dtype, "cuda")
    r = randn(m, n, dtype=dtype, device="cuda", seed=2)
    y, h = layer_norm(x, w, b, residual=r)
    y_ref, h_ref = layer_norm_ref(x, w, b, 1e-5, r)
    assert_rel_close(y, y_ref)
    assert_rel_close(h, h_ref)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    dy = randn(m, n, dtype=dtype, device="cuda", seed=3)
    layer_norm(xs, ws, bs).backward(dy)
    gx, gw, gb = reference_grads(lambda a, c, d: layer_norm_ref(a, c, d), (x, w, b), (dy,))
    assert_rel_close(xs.grad, gx)
    assert_rel_close(ws.grad, gw, tol=tolerance(dtype))
    assert_rel_close(bs.grad, gb, tol=tolerance(dtype))
    q, s = layer_norm_quant(x, w, b, dtype=torch.int8)
    assert_quant_matches(q, s, *layer_norm_quant_ref(x, w, b, dtype=torch.int8))


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_compile_and_cuda_graph():
    torch._dynamo.reset()
    x = randn(128, 8192, dtype=torch.bfloat16, device="cuda")
    w, b = affine(8192, torch.bfloat16, "cuda")
    f = torch.compile(lambda a, c, d: layer_norm(a, c, d) + 1, fullgraph=True)
    assert_rel_close(f(x, w, b), layer_norm_ref(x, w, b) + 1)
    layer_norm(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer_norm(x, w, b)
    x.copy_(randn(128, 8192, dtype=torch.bfloat16, device="cuda", seed=9))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(y, layer_norm_ref(x, w, b))
