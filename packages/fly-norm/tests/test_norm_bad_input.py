"""The bad-input classes of issue 40, one test a class, over the family's public ops (functions and modules).

Each class is answered by an error of FlyDSL's own types naming the argument, or by a correct result against
the fp64 reference. Checks that other files already make in depth are referenced in comments rather than
repeated; each class still has its one test here so the family's table can cite it.
"""

from __future__ import annotations

import pytest
import torch
from norm_helpers import CHUNKED, assert_quant_matches, force_config, randn

import fly_norm.layernorm as layernorm_mod
from fly_norm import (
    FlyLayerNorm,
    FlyRMSNorm,
    FlySoftmax,
    layer_norm,
    layer_norm_quant,
    rms_norm,
    rms_norm_quant,
    softmax,
)
from fly_norm._split_host import SPLIT_MIN_N, launch_fwd_split
from fly_norm.reference import layer_norm_quant_ref, layer_norm_ref, rms_norm_quant_ref, rms_norm_ref, softmax_ref
from flydsl.errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance
from flydsl_common.rows import RowConfig

FUNCTIONS = ["rms_norm", "layer_norm", "softmax", "rms_norm_quant", "layer_norm_quant"]
MODULES = ["FlyRMSNorm", "FlyLayerNorm", "FlySoftmax"]
OPS = FUNCTIONS + MODULES
QUANT = ("rms_norm_quant", "layer_norm_quant")


def _params(n, dtype, device):
    """The weight and bias of an op over rows of ``n`` (in x's dtype, as the quantized ops require)."""
    return randn(n, dtype=dtype, device=device, seed=1) + 1.0, randn(n, dtype=dtype, device=device, seed=2)


def _module(op, n, dtype, device):
    if op == "FlySoftmax":
        return FlySoftmax(-1)
    if op == "FlyRMSNorm":  # eps as the reference's (the module's default is the dtype's machine epsilon)
        mod = FlyRMSNorm(n, eps=1e-6, dtype=dtype, device=device)
    else:
        mod = FlyLayerNorm(n, dtype=dtype, device=device)
    if torch.device(device).type != "meta":
        w, b = _params(n, dtype, device)
        with torch.no_grad():
            mod.weight.copy_(w)
            if getattr(mod, "bias", None) is not None:
                mod.bias.copy_(b)
    return mod


def _run(op, x, w=None, b=None):
    """Our op on ``x`` (parameters from ``_params`` unless given); a tuple for the quantized ops."""
    if w is None and op not in MODULES:
        w, b = _params(x.shape[-1], x.dtype, x.device)
    if op == "rms_norm":
        return rms_norm(x, w)
    if op == "layer_norm":
        return layer_norm(x, w, b)
    if op == "softmax":
        return softmax(x)
    if op == "rms_norm_quant":
        return rms_norm_quant(x, w)
    if op == "layer_norm_quant":
        return layer_norm_quant(x, w, b)
    with torch.no_grad():
        return _module(op, x.shape[-1], x.dtype, x.device)(x)


def _ref(op, x):
    w, b = _params(x.shape[-1], x.dtype, x.device)
    if op in ("rms_norm", "FlyRMSNorm"):
        return rms_norm_ref(x, w)
    if op in ("layer_norm", "FlyLayerNorm"):
        return layer_norm_ref(x, w, b)
    if op in ("softmax", "FlySoftmax"):
        return softmax_ref(x)
    if op == "rms_norm_quant":
        return rms_norm_quant_ref(x, w)
    return layer_norm_quant_ref(x, w, b)


def _assert_matches_ref(op, x):
    out, ref = _run(op, x), _ref(op, x)
    if op in QUANT:
        q, s = out
        assert q.shape == x.shape and s.shape == x.shape[:-1]
        assert_quant_matches(q, s, *ref)
    else:
        assert out.shape == x.shape and out.dtype == x.dtype
        assert_rel_close(out, ref, tol=tolerance(x.dtype))


# ---------------------------------------------------------------- dtype


@pytest.mark.parametrize("op", OPS)
def test_dtype(device, op):
    """An integer or fp64 input is named as ``x``; a weight / bias / quantized dtype outside the table as
    themselves. (Deeper: test_rmsnorm.py::test_bad_inputs_are_named, test_quant_operand_dtypes_must_match,
    test_layernorm.py::test_bad_inputs_are_named, test_norm_api.py::test_modules_follow_torch_dtype_rules.)"""
    x = randn(4, 8, device=device)
    if op in MODULES:
        mod = _module(op, 8, torch.float32, device)
        with pytest.raises(DTypeError, match="^x: expected dtype fp32 or fp16 or bf16, got int32"):
            mod(x.to(torch.int32))
        with pytest.raises(DTypeError, match="^x: .*got fp64"):
            mod(x.double())
        return
    w, b = _params(8, torch.float32, device)
    with pytest.raises(DTypeError, match="^x: expected dtype fp32 or fp16 or bf16, got int32"):
        _run(op, x.to(torch.int32), w, b)
    with pytest.raises(DTypeError, match="^x: .*got fp64"):
        _run(op, x.double(), w, b)
    if op in ("rms_norm", "layer_norm", "rms_norm_quant", "layer_norm_quant"):
        w, b = _params(8, torch.float32, device)
        with pytest.raises(DTypeError, match="^weight: expected dtype"):
            _run(op, x, w.double(), b)
    if op in ("layer_norm", "layer_norm_quant"):
        w, b = _params(8, torch.float16, device)
        with pytest.raises(DTypeError, match="^bias: expected dtype fp16"):
            _run(op, x.half(), w, b.bfloat16())
    if op in QUANT:
        fn = rms_norm_quant if op == "rms_norm_quant" else lambda x, w, **kw: layer_norm_quant(x, w, None, **kw)
        with pytest.raises(DTypeError, match="^dtype: expected torch.int8 or torch.float8_e4m3fn"):
            fn(x, _params(8, torch.float32, device)[0], dtype=torch.float16)


# ---------------------------------------------------------------- device


def _other_device(device):
    """A device other than ``device`` that a test can always allocate on: the CPU beside a GPU, meta beside
    the CPU."""
    return torch.device("cpu") if torch.device(device).type == "cuda" else torch.device("meta")


@pytest.mark.parametrize("where", ["mixed", "meta", pytest.param("other_gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op", OPS)
def test_device(device, op, where):
    """mixed: x on one device and a parameter on another raise DeviceError naming the parameter (for softmax,
    with one tensor, there is nothing to mix); meta: meta inputs give a meta result of the right shape and
    dtype, nothing launched (README: custom ops with fake implementations); other_gpu: everything on a
    second GPU gives the right result there, and x on one GPU with a weight on another is named."""
    n = 8
    if where == "mixed":
        if op in ("softmax", "FlySoftmax"):
            pytest.skip("one tensor argument: no mix to make")
        x = randn(4, n, device=device)
        other = _other_device(device)
        if op in MODULES:
            with pytest.raises(DeviceError, match="^weight: expected a tensor on"):
                _module(op, n, x.dtype, other)(x)
            return
        w, b = _params(n, x.dtype, device)
        with pytest.raises(DeviceError, match="^weight: expected a tensor on"):
            _run(op, x, w.to(other), b)
        if op in ("layer_norm", "layer_norm_quant"):
            with pytest.raises(DeviceError, match="^bias: expected a tensor on"):
                _run(op, x, w, b.to(other))
        with pytest.raises(DeviceError, match="^weight: expected a tensor on"):
            _run(op, x.to(other), w, b)  # x moved: its weight, still on the first device, is the odd one
        return
    if where == "meta":
        meta = torch.device("meta")
        x = torch.empty(2, 3, n, dtype=torch.bfloat16, device=meta)
        out = _module(op, n, x.dtype, meta)(x) if op in MODULES else _run(op, x)
        if op in QUANT:
            q, s = out
            assert q.is_meta and q.shape == x.shape and q.dtype == torch.int8
            assert s.is_meta and s.shape == x.shape[:-1] and s.dtype == torch.float32
        else:
            assert out.is_meta and out.shape == x.shape and out.dtype == x.dtype
        return
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    gpu1 = torch.device("cuda", 1)
    x = randn(5, 33, dtype=torch.bfloat16, device=gpu1)
    with torch.cuda.device(0):  # the current device is not the tensors': the op must follow its inputs
        out, ref = _run(op, x), _ref(op, x)
    first = out[0] if op in QUANT else out
    assert first.device == gpu1
    if op in QUANT:
        assert_quant_matches(*out, *ref)
    else:
        assert_rel_close(out, ref, tol=tolerance(x.dtype))
    if op in ("rms_norm", "layer_norm", "rms_norm_quant", "layer_norm_quant"):
        w, b = _params(33, x.dtype, torch.device("cuda", 0))
        with pytest.raises(DeviceError, match="^weight: expected a tensor on cuda:1"):
            _run(op, x, w, b)


# ---------------------------------------------------------------- shape


@pytest.mark.parametrize("op", OPS)
def test_shape(device, op):
    """Parameters of the wrong length or rank are named; a 0-d x is named (softmax of a 0-d tensor is 1, as
    torch's); softmax's dim out of range is named (an ArgumentError: a dim is not a tensor shape). (Deeper:
    test_rmsnorm.py / test_layernorm.py ::test_bad_inputs_are_named, test_norm_api.py's table.)"""
    x = randn(4, 8, device=device)
    if op in ("softmax", "FlySoftmax"):
        fn = softmax if op == "softmax" else lambda x, dim: FlySoftmax(dim)(x)
        with pytest.raises(ArgumentError, match=r"^dim: expected a dimension in \[-2, 1\], got 2"):
            fn(x, dim=2)
        one = fn(torch.tensor(0.5, device=device), dim=0)
        assert one.shape == () and one.item() == 1.0
        return
    if op in MODULES:
        with pytest.raises(ShapeError, match=r"^input: expected trailing shape \(9,\)"):
            _module(op, 9, x.dtype, device)(x)
        return
    w, b = _params(8, x.dtype, device)
    w9, b9 = _params(9, x.dtype, device)
    with pytest.raises(ShapeError, match=r"^weight: expected shape \(8,\)"):
        _run(op, x, w9, b)
    with pytest.raises(ShapeError, match="^weight: expected a 1-D tensor"):
        _run(op, x, w[None], b)
    with pytest.raises(ShapeError, match="^x: expected at least 1 dimension"):
        _run(op, torch.tensor(1.0, device=device), w[:1], b[:1])
    if op in ("layer_norm", "layer_norm_quant"):
        with pytest.raises(ShapeError, match=r"^bias: expected shape \(8,\)"):
            _run(op, x, w, b9)
    if op == "rms_norm":
        with pytest.raises(ShapeError, match="^residual: expected shape"):
            rms_norm(x, w, residual=randn(4, 9, device=device))
    if op in QUANT:
        fn = rms_norm_quant if op == "rms_norm_quant" else lambda x, w, **kw: layer_norm_quant(x, w, None, **kw)
        with pytest.raises(ShapeError, match=r"^smooth_scale: expected shape \(8,\)"):
            fn(x, w, smooth_scale=torch.ones(9, device=device))


# ---------------------------------------------------------------- stride


@pytest.mark.parametrize("op", OPS)
def test_stride(device, op):
    """Strided rows (row stride, column offset, a strided leading dim) are read in place and give the
    reference; a non-unit last stride is a LayoutError naming x for the norms (README: "a non-contiguous last
    dim where a kernel needs one"), and a correct result for softmax, which reduces along any dim."""
    base = randn(3, 6, 40, dtype=torch.bfloat16, device=device)
    _assert_matches_ref(op, base[:, ::2, 3:36])  # [3, 3, 33]: strides (240, 80, 1), offset 3
    _assert_matches_ref(op, base[1, ::2, 3:36])  # 2-D, row stride 80
    xt = randn(33, 5, dtype=torch.bfloat16, device=device, seed=3).t()
    if op in ("softmax", "FlySoftmax"):
        _assert_matches_ref(op, xt)
        assert_rel_close(softmax(xt, dim=0), softmax_ref(xt, dim=0), tol=tolerance(torch.bfloat16))
        return
    with pytest.raises(LayoutError, match="^x: the last dimension must be contiguous"):
        _run(op, xt)
    if op in MODULES:
        return
    w, b = _params(33, torch.bfloat16, device)
    with pytest.raises(LayoutError, match="^weight: expected a contiguous vector"):
        _run(op, base[0, :, 3:36], randn(66, dtype=torch.bfloat16, device=device)[::2], b)


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_alignment(device, op, dtype):
    """x (and the weight, the bias, the residual) starting one element past an aligned base, with an odd row
    width and row stride: the reference, nothing misread by vector loads."""
    m, n = 5, 33
    x = randn(m * n + 1, dtype=dtype, device=device, seed=7)[1:].view(m, n)
    assert x.data_ptr() % 16 != 0
    _assert_matches_ref(op, x)
    xs = randn(m * 35 + 1, dtype=dtype, device=device, seed=8)[1:].view(m, 35)[:, :n]  # row stride 35
    _assert_matches_ref(op, xs)
    if op in MODULES or op == "softmax":
        return
    w0, b0 = _params(n, dtype, device)
    w = torch.empty(n + 1, dtype=dtype, device=device)[1:]
    b = torch.empty(n + 1, dtype=dtype, device=device)[1:]
    w.copy_(w0), b.copy_(b0)
    out, ref = _run(op, x, w, b), _ref(op, x)
    if op in QUANT:
        assert_quant_matches(*out, *ref)
    else:
        assert_rel_close(out, ref, tol=tolerance(dtype))
    if op == "rms_norm":
        r = randn(m * n + 1, dtype=dtype, device=device, seed=9)[1:].view(m, n)
        y, h = rms_norm(x, w, residual=r)
        yr, hr = rms_norm_ref(x, w0, residual=r)
        assert_rel_close(y, yr, tol=tolerance(dtype))
        assert_rel_close(h, hr, tol=tolerance(dtype))


# ---------------------------------------------------------------- empty


@pytest.mark.parametrize("op", OPS)
def test_empty(device, op):
    """Zero rows (2-D and 3-D) give an empty result of the right shape and dtype, no launch. Zero columns:
    softmax gives the empty result, as torch does; the norms raise ArgumentError naming x (README: "any row
    width N >= 1"; torch's own norms return an empty tensor there)."""
    for shape in [(0, 8), (2, 0, 8)]:
        x = torch.empty(shape, device=device)
        out = _run(op, x)
        if op in QUANT:
            q, s = out
            assert q.shape == shape and q.dtype == torch.int8 and s.shape == shape[:-1]
        else:
            assert out.shape == shape and out.dtype == x.dtype
    x = torch.empty(4, 0, device=device)
    if op in ("softmax", "FlySoftmax"):
        out = _run(op, x)
        assert out.shape == (4, 0) and out.shape == torch.softmax(x, -1).shape
        return
    if op in MODULES:
        with pytest.raises(ArgumentError, match="^x: the normalized"):
            _module(op, 0, x.dtype, device)(x)
        return
    with pytest.raises(ArgumentError, match=r"^x: the normalized \(last\) dimension must have at least one"):
        _run(op, x)


# ---------------------------------------------------------------- huge dimension


@pytest.mark.gpu
def test_huge_dimension():
    """rms_norm over bf16 [2^31 / N + 3, N]: 2^31 + 3 N elements, so the last rows start past int32 offsets;
    those rows (and the rows around element 2^31) match the reference computed on them alone."""
    n = 4096
    m = 2**31 // n + 3
    need = 2 * (2 * m * n) + (1 << 30)  # x, y and headroom
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free on the GPU")
    x = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    x.normal_(generator=torch.Generator("cuda").manual_seed(0))
    w = randn(n, dtype=torch.bfloat16, device="cuda", seed=1) + 1.0
    y = rms_norm(x, w)
    boundary = 2**31 // n
    rows = [0, boundary - 1, boundary, boundary + 1, m - 2, m - 1]
    assert_rel_close(y[rows], rms_norm_ref(x[rows], w), tol=tolerance(torch.bfloat16))
    del x, y
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- NaN / Inf


def _nan_inf_rows(n, device, dtype=torch.float32):
    x = randn(5, n, dtype=dtype, device=device)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, :] = float("-inf")
    x[3, 0] = 1.0
    x[4, 2] = float("-inf")  # softmax: a zero there, the rest of the row finite
    return x


# A width that is no power of two: the row blocks hold padding lanes, as most real widths do.
NAN_N = 100


@pytest.mark.parametrize("op", OPS)
def test_nan_inf(device, op):
    """NaN / Inf where torch's (fp64) reference has them, the finite values finite and right. softmax: -inf
    entries give exact zeros, a row holding only -inf gives NaN, as torch.softmax. The quantized ops: a row
    whose normalized values hold a NaN gets a NaN scale, so it dequantizes to NaN, never to a finite wrong
    row (its codes are unspecified); the finite rows are unaffected. (layer_norm_quant on each of its paths:
    test_nan_inf_layer_norm_quant_scale.)"""
    x = _nan_inf_rows(NAN_N, device)
    out, ref = _run(op, x), _ref(op, x)
    if op in QUANT:
        q, s = out
        qr, sr = ref
        bad = torch.tensor([False, True, True, True, True], device=device)  # rows 1-4 normalize to NaN / Inf
        assert torch.isnan(sr[bad]).all()
        assert torch.isnan(s[bad]).all(), s
        assert torch.isnan(q[bad].float() * s[bad, None]).all()  # dequantized: NaN
        assert_quant_matches(q[~bad], s[~bad], qr[~bad], sr[~bad])
        return
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (out, ref)
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref))
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert fin.any() and not fin.all()
    assert_rel_close(out[fin], ref[fin], tol=tolerance(x.dtype))
    if op in ("softmax", "FlySoftmax"):
        assert out[3].tolist() == [1.0] + [0.0] * (NAN_N - 1) and out[4, 2].item() == 0.0
        assert torch.isnan(_run(op, torch.full((2, NAN_N), float("-inf"), device=device))).all()


def _quant_on(path, x, w, b, r, sm, qdtype, monkeypatch):
    """(q, scale, residual_out or None) of layer_norm_quant (rms_norm_quant where ``b`` is None, eps 1e-6)
    through ``path`` (see the test below)."""
    is_rms = b is None
    eps = 1e-6 if is_rms else 1e-5
    if path == "split":
        q = torch.empty(x.shape, dtype=qdtype, device=x.device)
        s = empty_poisoned(x.shape[0], dtype=torch.float32, device=x.device)
        h = None if r is None else torch.empty_like(r)
        code, qmax = (1, 127.0) if qdtype == torch.int8 else (2, 448.0)
        assert launch_fwd_split(x, r, w, b, sm, q, h, None, None, s, eps, 0.0, is_rms, code, qmax)
        return q, s, h
    if path == "chunked":
        force_config(monkeypatch, layernorm_mod, CHUNKED)
    if path == "chunk":
        force_config(monkeypatch, layernorm_mod, RowConfig(1, 128, 4, False))
    if is_rms:
        out = rms_norm_quant(x, w, eps, dtype=qdtype, smooth_scale=sm, residual=r)
    else:
        out = layer_norm_quant(x, w, b, eps, dtype=qdtype, smooth_scale=sm, residual=r)
    return out if r is not None else (*out, None)


# layer_norm_quant's abs-max paths: "rows", the row kernel's single pass (rows of NAN_N columns in blocks of
# 128); "chunked", the chunked passes over a row wider than its block (CHUNKED: two chunks of 64, the last
# short: the lanes' running max); "chunk", the chunked passes with one chunk of 128 (lanes past the row: the
# lanes' merge); "split", the split kernel launched directly (one slice of 4096 columns a row, so it runs in
# the interpreter too); "wide", the public op on rows past SPLIT_MIN_N, which a GPU splits over many slices.
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("path", ["rows", "chunked", "chunk", "split", pytest.param("wide", marks=pytest.mark.gpu)])
def test_nan_inf_layer_norm_quant_scale(device, path, fused, monkeypatch):
    """layer_norm_quant on each of its paths: a row whose normalized values hold a NaN (a NaN or an Inf in x)
    gets a NaN scale, as torch's amax gives it, so it dequantizes to NaN; the finite row matches the
    reference. The rows are narrower than their block (slice), whose padding lanes hold 0, and the last chunk
    of a chunked row is short: a max that drops NaN let those zeros win (scale 0, codes 0: a row of silent
    zeros). ``fused``: with a residual, a smooth scale and fp8 codes (int8 otherwise)."""
    n = SPLIT_MIN_N + 7231 if path == "wide" else NAN_N
    x = _nan_inf_rows(n, device)
    w, b = _params(n, x.dtype, device)
    r = randn(5, n, device=device, seed=3) if fused else None
    sm = torch.rand(n, device=device) + 0.5 if fused else None
    qdtype = torch.float8_e4m3fn if fused else torch.int8
    q, s, h = _quant_on(path, x, w, b, r, sm, qdtype, monkeypatch)
    qr, sr, *_ = layer_norm_quant_ref(x, w, b, 1e-5, dtype=qdtype, smooth_scale=sm, residual=r)
    assert torch.isnan(sr[1:]).all()
    assert torch.isnan(s[1:]).all(), s
    assert torch.isnan(q[1:].float() * s[1:, None]).all()  # dequantized: NaN
    assert_quant_matches(q[:1], s[:1], qr[:1], sr[:1])
    if fused:  # residual_out: x + r as fp32 adds it (the reference's rounding step turns its inf into NaN)
        torch.testing.assert_close(h, x + r, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("path", ["split", pytest.param("wide", marks=pytest.mark.gpu)])
def test_nan_inf_rms_norm_quant_split_scale(device, path, monkeypatch):
    """rms_norm_quant's split path (its row paths: test_nan_inf) takes the row's scale from the same exchange
    of the slices' |y| maxima as layer_norm_quant's: a row whose normalized values hold a NaN gets a NaN scale
    there too, not the zeros past N in a short slice."""
    n = SPLIT_MIN_N + 7231 if path == "wide" else NAN_N
    x = _nan_inf_rows(n, device)
    w = _params(n, x.dtype, device)[0]
    q, s, _ = _quant_on(path, x, w, None, None, None, torch.int8, monkeypatch)
    qr, sr = rms_norm_quant_ref(x, w, 1e-6)
    assert torch.isnan(sr[1:]).all()
    assert torch.isnan(s[1:]).all(), s
    assert torch.isnan(q[1:].float() * s[1:, None]).all()  # dequantized: NaN
    assert_quant_matches(q[:1], s[:1], qr[:1], sr[:1])
