"""What a new user meets first: meta tensors, mixed operand dtypes in the drop-in modules, the first call's
cost, and the errors that bad arguments raise."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from norm_helpers import DTYPES, randn
from torch import nn

import fly_norm
from fly_norm import FlyLayerNorm, FlyRMSNorm, FlySoftmax
from flydsl.errors import ArgumentError, DTypeError, FlyDSLError, ShapeError
from flydsl.testing import assert_rel_close, tolerance

# ---------------------------------------------------------------- meta tensors


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def _assert_meta(t, shape, dtype):
    assert t.device.type == "meta", t.device
    assert tuple(t.shape) == tuple(shape), t.shape
    assert t.dtype == dtype, t.dtype


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norms_on_meta_tensors_give_meta_outputs(op, residual, grad):
    x = _meta(3, 5, 96, grad=grad)
    w = _meta(96, dtype=torch.float32, grad=grad)
    r = _meta(3, 5, 96, dtype=torch.float32, grad=grad) if residual else None
    if op == "rms_norm":
        out = fly_norm.rms_norm(x, w, 1e-6, r)
    else:
        out = fly_norm.layer_norm(x, w, _meta(96, dtype=torch.float32, grad=grad), 1e-5, r)
    y, h = out if residual else (out, None)
    _assert_meta(y, x.shape, torch.bfloat16)
    if residual:
        _assert_meta(h, x.shape, torch.float32)
    assert y.requires_grad == grad
    if grad:  # the backward runs on meta too: gradients of the operands' shapes and dtypes
        (y.sum() + (h.sum() if residual else 0)).backward()
        _assert_meta(x.grad, x.shape, x.dtype)
        _assert_meta(w.grad, w.shape, w.dtype)
        if residual:
            _assert_meta(r.grad, r.shape, r.dtype)


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("op", ["rms_norm_quant", "layer_norm_quant"])
def test_quantized_norms_on_meta_tensors(op, qdtype):
    x, w = _meta(4, 7, 64), _meta(64)
    r = _meta(4, 7, 64)
    if op == "rms_norm_quant":
        q, scale, h = fly_norm.rms_norm_quant(x, w, dtype=qdtype, residual=r)
    else:
        q, scale, h = fly_norm.layer_norm_quant(x, w, _meta(64), dtype=qdtype, residual=r)
    _assert_meta(q, x.shape, qdtype)
    _assert_meta(scale, (4, 7), torch.float32)
    _assert_meta(h, x.shape, torch.bfloat16)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("dim", [-1, 0])
def test_softmax_on_meta_tensors(dim, grad):
    x = _meta(6, 33, dtype=torch.float16, grad=grad)
    y = fly_norm.softmax(x, dim)
    _assert_meta(y, x.shape, torch.float16)
    if grad:
        y.sum().backward()
        _assert_meta(x.grad, x.shape, torch.float16)


@pytest.mark.parametrize("grad", [False, True])
def test_modules_on_meta_tensors(grad):
    x = _meta(2, 3, 40, dtype=torch.float32, grad=grad)
    for mod in (FlyRMSNorm(40, device="meta"), FlyLayerNorm(40, device="meta"), FlySoftmax(-1)):
        y = mod(x)
        _assert_meta(y, x.shape, torch.float32)
        if grad:
            y.sum().backward()
            for p in mod.parameters():
                _assert_meta(p.grad, p.shape, p.dtype)


def test_meta_x_with_a_real_weight_is_a_device_error():
    with pytest.raises(FlyDSLError, match="weight"):
        fly_norm.rms_norm(_meta(2, 8), torch.ones(8, dtype=torch.bfloat16))


# ---------------------------------------------------------------- mixed dtypes in the modules


def _torch_result(ref_mod, x):
    try:
        return ref_mod(x)
    except RuntimeError:  # torch refuses the dtype pair (LayerNorm: parameters of neither x's dtype nor fp32)
        return None


@pytest.mark.filterwarnings("ignore:Mismatch dtype")
@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_modules_follow_torch_dtype_rules(device, kind, x_dtype, w_dtype):
    """Every fp32/fp16/bf16 (input, parameter) pair: where torch's module returns a result, ours returns one
    of the same dtype and shape, within the output dtype's tolerance of an fp64 reference (forward, and the
    gradients in their operands' dtypes); where torch raises, ours raises DTypeError."""
    n = 72
    if kind == "rms":
        ref_mod, mod = nn.RMSNorm(n, eps=1e-6, dtype=w_dtype), FlyRMSNorm(n, eps=1e-6, dtype=w_dtype, device=device)
    else:
        ref_mod, mod = nn.LayerNorm(n, dtype=w_dtype), FlyLayerNorm(n, dtype=w_dtype, device=device)
    with torch.no_grad():
        for p in ref_mod.parameters():
            p.copy_(randn(*p.shape, seed=3, scale=0.5) + 1.0)
    mod.load_state_dict(ref_mod.state_dict())
    x = randn(3, 5, n, dtype=x_dtype, seed=1)
    y_torch = _torch_result(ref_mod, x)  # torch on the CPU: the dtype rule is the module's, not the device's
    xd = x.to(device).clone().requires_grad_()
    if y_torch is None:
        with pytest.raises(DTypeError, match="weight"):
            mod(xd)
        return
    y = mod(xd)
    assert y.dtype == y_torch.dtype and y.shape == y_torch.shape and y.device == xd.device

    # fp64 reference from the same (rounded) values
    x64 = x.detach().double().requires_grad_()
    params64 = [p.detach().double().requires_grad_() for p in ref_mod.parameters()]
    if kind == "rms":
        ref = torch.nn.functional.rms_norm(x64, (n,), params64[0], 1e-6)
    else:
        ref = torch.nn.functional.layer_norm(x64, (n,), *params64, 1e-5)
    assert_rel_close(y, ref, tol=tolerance(y.dtype), name=f"{kind} y")

    dy = randn(*y.shape, seed=5)
    (y.float() * dy.to(device)).sum().backward()
    (ref * dy.double()).sum().backward()
    assert xd.grad.dtype == x_dtype
    assert_rel_close(xd.grad, x64.grad, tol=tolerance(x_dtype), name="dx")
    for p, p64 in zip(mod.parameters(), params64, strict=True):
        assert p.grad.dtype == p.dtype == w_dtype
        # the gradient sums rows of the output-dtype products: the coarser of the two dtypes bounds it
        tol = max(tolerance(w_dtype), tolerance(x_dtype))
        assert_rel_close(p.grad, p64.grad, tol=tol, name="dweight")


@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
def test_rms_norm_takes_any_float_weight_dtype(device, x_dtype, w_dtype):
    """The functional rms_norm: y in x's dtype, computed in fp32 from the weight's values (the eager path and
    the autograd path)."""
    x = randn(4, 130, dtype=x_dtype, seed=2, device=device)
    w = (randn(130, seed=4, scale=0.5) + 1.0).to(device=device, dtype=w_dtype)
    ref = torch.nn.functional.rms_norm(x.double(), (130,), w.double(), 1e-6)
    y = fly_norm.rms_norm(x, w, 1e-6)
    assert y.dtype == x_dtype
    assert_rel_close(y, ref, tol=tolerance(x_dtype))
    wg = w.clone().requires_grad_()
    y2 = fly_norm.rms_norm(x, wg, 1e-6)
    assert y2.dtype == x_dtype
    assert_rel_close(y2, ref, tol=tolerance(x_dtype))
    y2.float().sum().backward()
    assert wg.grad.dtype == w_dtype


def test_rms_norm_eps_none_is_the_dtype_epsilon(device):
    x = randn(3, 40, dtype=torch.float16, seed=6, device=device)
    assert torch.equal(fly_norm.rms_norm(x, None, None), fly_norm.rms_norm(x, None, torch.finfo(torch.float16).eps))


# ---------------------------------------------------------------- the first call


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_first_differentiable_call_does_not_import_dynamo():
    """torch wraps a custom op's implementation so that its first call imports torch._dynamo (1.3-2.3 s);
    eager autograd calls must not go through it (a fresh interpreter: nothing imported it before)."""
    code = textwrap.dedent(
        """
        import os, sys
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, fly_norm
        x = torch.randn(4, 64, requires_grad=True)
        for mod in (fly_norm.FlyRMSNorm(64), fly_norm.FlyLayerNorm(64), fly_norm.FlySoftmax(-1)):
            mod(x).sum().backward()
        fly_norm.rms_norm(x, torch.ones(64), residual=torch.zeros(4, 64, requires_grad=True))[1].sum().backward()
        print("dynamo imported" if "torch._dynamo" in sys.modules else "clean")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "clean", out.stdout + out.stderr


# ---------------------------------------------------------------- argument checks

_X = randn(4, 64)
_W = torch.ones(64)


@pytest.mark.parametrize(
    "call,error,name",
    [
        (lambda: fly_norm.rms_norm(_X, [1.0] * 64), ArgumentError, "weight"),
        (lambda: fly_norm.rms_norm(_X, _W, residual=[0.0]), ArgumentError, "residual"),
        (lambda: fly_norm.layer_norm(_X, _W, "bias"), ArgumentError, "bias"),
        (lambda: fly_norm.rms_norm_quant(_X, _W, smooth_scale=2.0), ArgumentError, "smooth_scale"),
        (lambda: fly_norm.rms_norm(_X, _W, "1e-6"), ArgumentError, "eps"),
        (lambda: fly_norm.rms_norm(_X, _W, -1e-6), ArgumentError, "eps"),
        (lambda: fly_norm.rms_norm(_X, _W, float("nan")), ArgumentError, "eps"),
        (lambda: fly_norm.rms_norm(_X, _W, torch.tensor(1e-6)), ArgumentError, "eps"),
        (lambda: fly_norm.layer_norm(_X, _W, _W, float("inf")), ArgumentError, "eps"),
        (lambda: fly_norm.rms_norm_quant(_X, _W, -1.0), ArgumentError, "eps"),
        (lambda: fly_norm.layer_norm_quant(_X, _W, _W, "x"), ArgumentError, "eps"),
        (lambda: fly_norm.rms_norm(_X, _W, weight_offset="1"), ArgumentError, "weight_offset"),
        (lambda: fly_norm.layer_norm(_X, _W, _W, weight_offset=float("nan")), ArgumentError, "weight_offset"),
        (lambda: fly_norm.rms_norm(_X, _W.double()), DTypeError, "weight"),
        (lambda: fly_norm.layer_norm(_X, _W.bfloat16(), None), DTypeError, "weight"),
        (lambda: fly_norm.rms_norm_quant(_X, _W, dtype="int8"), DTypeError, "dtype"),
        (lambda: FlyRMSNorm(64)([1.0] * 64), ArgumentError, "input"),
        (lambda: FlyLayerNorm(64)("x"), ArgumentError, "input"),
        (lambda: FlyRMSNorm(64)(_X[:, :3]), ShapeError, "input"),
        (lambda: FlyLayerNorm((2, 64))(_X), ShapeError, "input"),
        (lambda: FlyRMSNorm(64, eps=-1.0)(_X), ArgumentError, "eps"),
    ],
)
def test_bad_arguments_raise_flydsl_errors_naming_them(call, error, name):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(f"{name}:"), str(info.value)


def test_dtype_error_names_each_accepted_dtype_once():
    with pytest.raises(DTypeError) as info:
        fly_norm.layer_norm(_X, _W.half(), None)
    assert "fp32 or fp32" not in str(info.value) and "expected dtype fp32," in str(info.value), str(info.value)
