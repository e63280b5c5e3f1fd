"""What a new user hits first: every public argument checked with FlyDSL's error types (naming the
argument, the expectation and what was given), one-number scales, meta tensors, and a module's first call
costing no more than the functional call's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fly_gemm import FlyLinear, PackedWeight, gemm, gemm_ref, linear, prepack
from flydsl.errors import ArgumentError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close


def _rand(*shape, device, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


# ---------------------------------------------------------------- one-number scales (README: "one value")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.float16])
@pytest.mark.parametrize("sa,sb", [(2.0, None), (None, 3), (0.5, 1.25)])
def test_scale_may_be_a_python_number(device, dtype, sa, sb):
    m, n, k = 9, 24, 40
    a, b = _rand(m, k, device=device), _rand(n, k, device=device, seed=1)
    if dtype == torch.int8:
        a, b = (t.mul(30).round().clamp(-127, 127) for t in (a, b))
    a, b = a.to(dtype), b.to(dtype)
    c = gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert_rel_close(c, gemm_ref(a, b, scale_a=sa, scale_b=sb), tol=1e-5)
    # the same as the one-element tensor form
    as_tensor = [None if s is None else torch.tensor([float(s)], device=device) for s in (sa, sb)]
    assert torch.equal(c, gemm(a, b, scale_a=as_tensor[0], scale_b=as_tensor[1], out_dtype=torch.float32))


# ---------------------------------------------------------------- bad arguments are named


def test_gemm_bad_arguments_are_named(device):
    a, b = _rand(4, 16, device=device), _rand(8, 16, device=device, seed=1)
    cases = [
        (dict(a=[[1.0]]), ArgumentError, r"a: expected a torch.Tensor, got list"),
        (dict(a=a.cpu().numpy()), ArgumentError, r"a: expected a torch.Tensor, got ndarray"),
        (dict(b="w"), ArgumentError, r"b: expected a torch.Tensor or a fly_gemm.PackedWeight, got str"),
        (dict(bias=[0.0] * 8), ArgumentError, r"bias: expected None or a torch.Tensor \[N\], got list"),
        (dict(out=3), ArgumentError, r"out: expected None or a torch.Tensor \[M, N\], got int"),
        (dict(scale_a="2"), ArgumentError, r"scale_a: expected None, a number or an fp32 tensor .*got str '2'"),
        (dict(scale_b=True), ArgumentError, r"scale_b: expected None, a number .*got bool True"),
        (dict(config="fast"), ArgumentError, r"config: expected None or a fly_gemm.GemmConfig, got str 'fast'"),
        (dict(config={"block_m": 16}), ArgumentError, r"config: expected None or a fly_gemm.GemmConfig, got dict"),
        (dict(out_dtype="bf16"), DTypeError, r"out_dtype: expected one of .* got bf16"),
        (dict(activation=3), ArgumentError, r"activation: expected None or one of .* got 3"),
        (dict(b_layout=None), ArgumentError, r"b_layout: expected one of \['nk', 'kn'\], got None"),
    ]
    for kwargs, err, msg in cases:
        args = {"a": a, "b": b, **kwargs}
        with pytest.raises(err, match=msg):
            gemm(args.pop("a"), args.pop("b"), **args)


def test_scale_number_under_autograd_is_refused_like_a_tensor_scale(device):
    a = _rand(4, 16, device=device).requires_grad_()
    with pytest.raises(DTypeError, match="gemm backward: .* without scales, got fp16 with scales"):
        gemm(a, _rand(8, 16, device=device, seed=1), scale_a=2.0)


def test_linear_bad_arguments_are_named(device):
    x, w = _rand(3, 16, device=device), _rand(8, 16, device=device, seed=1)
    with pytest.raises(ArgumentError, match="x: expected a torch.Tensor, got list"):
        linear([1.0], w)
    with pytest.raises(ArgumentError, match=r"weight: expected a torch.Tensor \[N, K\] or a fly_gemm.PackedWeight"):
        linear(x, "w")
    with pytest.raises(ShapeError, match=r"weight: expected \[N, 16\] \(K = x's last dimension\)"):
        linear(x, w[:, :12])
    with pytest.raises(ShapeError, match=r"weight: expected \[N, 16\]"):
        linear(x.float(), w[:, :12].float())  # the torch path too
    with pytest.raises(DTypeError, match="weight: expected dtype fp16 \\(x's\\), got bf16"):
        linear(x, w.bfloat16())
    with pytest.raises(ShapeError, match=r"bias: expected \[8\]"):
        linear(x, w, torch.zeros(7, dtype=torch.float16, device=device))
    with pytest.raises(ArgumentError, match="bias: expected a torch.Tensor, got float"):
        linear(x, w, 0.5)
    with pytest.raises(ArgumentError, match="activation"):
        linear(x.float(), w.float(), None, "tanh")  # the torch path names it too
    with pytest.raises(DTypeError, match="weight: expected a PackedWeight of dtype fp16"):
        linear(x, prepack(w.bfloat16()))


def test_prepack_bad_weights_are_refused_up_front(device):
    with pytest.raises(DTypeError, match=r"b: expected dtype fp16 / bf16 / fp8_e4m3 / int8 \(gemm takes these\), "
                                         r"got fp64"):  # fmt: skip
        prepack(_rand(8, 16, device=device, dtype=torch.float64))
    with pytest.raises(DTypeError, match=r"b: expected dtype .* got fp32"):
        prepack(_rand(8, 16, device=device, dtype=torch.float32))
    with pytest.raises(DTypeError, match=r"b: expected dtype fp16 / bf16 / fp32 \(quantizing to int8 reads"):
        prepack(_rand(8, 16, device=device, dtype=torch.float64), quant=torch.int8)
    with pytest.raises(DTypeError, match="quant: expected None, torch.float8_e4m3fn or torch.int8, got 'int8'"):
        prepack(_rand(8, 16, device=device), quant="int8")
    with pytest.raises(ArgumentError, match="b: expected a torch.Tensor, got list"):
        prepack([[1.0]])
    with pytest.raises(ShapeError, match="b: expected a 2-D tensor"):
        prepack(_rand(16, device=device))
    # an fp32 weight quantized is fine: the packed codes serve a 16-bit activation
    packed = prepack(_rand(8, 16, device=device, dtype=torch.float32), quant=torch.int8)
    assert packed.dtype == torch.int8 and packed.scale.shape == (8,)


def test_fly_linear_bad_arguments_are_named(device):
    with pytest.raises(ArgumentError, match="in_features: expected an integer >= 0, got float 4.5"):
        FlyLinear(4.5, 8)
    with pytest.raises(ArgumentError, match="out_features: expected an integer >= 0, got int -1"):
        FlyLinear(4, -1)
    with pytest.raises(ArgumentError, match="activation"):
        FlyLinear(4, 4, activation="tanh")
    layer = FlyLinear(16, 8, device=device, dtype=torch.float32)
    with pytest.raises(DTypeError, match="weight: FlyLinear.prepack packs fp16 / bf16 layers .* got fp32"):
        layer.prepack()
    layer16 = FlyLinear(16, 8, device=device, dtype=torch.float16).prepack()
    with pytest.raises(ShapeError, match=r"weight: expected \[N, 12\]"):
        layer16(_rand(2, 12, device=device))
    with pytest.raises(DTypeError, match="x: expected dtype fp16 \\(the prepacked layer's\\), got bf16"):
        layer16(_rand(2, 16, device=device, dtype=torch.bfloat16))
    with pytest.raises(ArgumentError, match="x: expected a torch.Tensor"):
        layer16("x")


# ---------------------------------------------------------------- meta tensors, as torch's own ops


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, None), (torch.float8_e4m3fn, torch.float16),
                                             (torch.int8, torch.int32)])  # fmt: skip
def test_meta_tensors_give_meta_outputs(dtype, out_dtype):
    a = torch.empty(5, 48, dtype=dtype, device="meta")
    b = torch.empty(48, 24, dtype=dtype, device="meta")
    c = gemm(a, b, b_layout="kn", out_dtype=out_dtype)
    want = out_dtype or (dtype if dtype.itemsize == 2 else torch.bfloat16)
    assert c.device.type == "meta" and c.shape == (5, 24) and c.dtype == want


def test_meta_linear_module_and_autograd():
    meta = torch.device("meta")
    x = torch.empty(2, 3, 32, dtype=torch.bfloat16, device=meta, requires_grad=True)
    w = torch.empty(16, 32, dtype=torch.bfloat16, device=meta, requires_grad=True)
    y = linear(x, w, None, "gelu")
    assert y.device == meta and y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.device == meta and x.grad.shape == x.shape and w.grad.shape == w.shape
    layer = FlyLinear(32, 16, activation="silu", device=meta, dtype=torch.bfloat16)
    out = layer(x.detach())
    assert out.device == meta and out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
    for quant in (None, torch.int8):
        layer.prepack(quant=quant)
        assert isinstance(layer.packed, PackedWeight) and layer.packed.weight.device == meta
        out = layer(x)
        assert out.device == meta and out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
    out = gemm(x.detach()[0], prepack(w.detach(), quant=torch.float8_e4m3fn))
    assert out.device == meta and out.shape == (3, 16)
    assert F.linear(x.detach().float(), w.detach().float()).device == meta  # torch's own, for comparison


# ---------------------------------------------------------------- the first call with autograd


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_first_call_with_autograd_does_not_import_dynamo():
    """torch.library.custom_op imports torch._dynamo on an op's first eager call (1.3-3.9 s of a
    FlyLinear's first forward); fly-gemm's op must not. Checked in a fresh process, where nothing has
    imported it yet."""
    code = textwrap.dedent("""
        import sys
        import torch
        import fly_gemm
        assert "torch._dynamo" not in sys.modules, "imported by fly_gemm itself"
        layer = fly_gemm.FlyLinear(32, 16, activation="relu", dtype=torch.float16)
        layer(torch.randn(3, 32, dtype=torch.float16)).sum().backward()
        print("torch._dynamo" in sys.modules)
    """)
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
