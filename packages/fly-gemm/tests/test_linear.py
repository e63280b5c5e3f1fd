"""Torch integration of fly-gemm: the custom op (opcheck, torch.compile fullgraph), autograd of gemm and
linear against torch autograd in fp64, FlyLinear as an nn.Linear drop-in, CUDA graph capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fly_gemm import FlyLinear, GemmConfig, PackedWeight, gemm, gemm_ref, linear, prepack
from flydsl.errors import ArgumentError, DTypeError, UnsupportedError
from flydsl.testing import assert_rel_close
from flydsl_common.reference import quantize_per_token_ref

ACTIVATIONS = [None, "relu", "silu", "gelu_tanh", "gelu"]
_TORCH_ACT = {None: lambda z: z, "relu": F.relu, "silu": F.silu, "gelu": F.gelu,
              "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}  # fmt: skip


def _rand(*shape, device, dtype=torch.float16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _grads_ref(fn, tensors, upstream):
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    fn(*leaves).backward(upstream.double())
    return [t.grad for t in leaves]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_gemm_autograd(device, activation, b_layout):
    m, n, k = 19, 40, 33
    a = _rand(m, k, device=device).requires_grad_()
    b = _rand(n, k, device=device, seed=1) if b_layout == "nk" else _rand(k, n, device=device, seed=1)
    b.requires_grad_()
    bias = _rand(n, device=device, seed=2, dtype=torch.float32).requires_grad_()
    dy = _rand(m, n, device=device, seed=3)
    y = gemm(a, b, bias=bias, activation=activation, b_layout=b_layout)
    assert_rel_close(y, gemm_ref(a, b, bias=bias, activation=activation, b_layout=b_layout))
    y.backward(dy)

    def ref(a_, b_, bias_):
        b_nk = b_ if b_layout == "nk" else b_.t()
        return _TORCH_ACT[activation](a_ @ b_nk.t() + bias_)

    for got, want, name in zip((a.grad, b.grad, bias.grad), _grads_ref(ref, (a, b, bias), dy), ("a", "b", "bias"),
                               strict=True):  # fmt: skip
        assert got.dtype == (torch.float32 if name == "bias" else torch.float16)
        assert_rel_close(got, want, tol=2e-3, name=name)  # g rounded to fp16 before the GEMMs


def test_autograd_and_tracing_refuse_what_the_op_cannot_take(device):
    a = _rand(4, 16, device=device).requires_grad_()
    b = _rand(8, 16, device=device, seed=1)
    with pytest.raises(ArgumentError, match="out: not supported when a gradient"):
        gemm(a, b, out=torch.empty(4, 8, dtype=torch.float16, device=device))
    with pytest.raises(ArgumentError, match="config: not taken"):
        gemm(a, b, config=GemmConfig(16, 16, 16))


def test_torch_compile_writes_out(device):
    torch._dynamo.reset()
    a, b = _rand(5, 32, device=device), _rand(8, 32, device=device, seed=1)
    out = torch.empty(5, 8, dtype=torch.float32, device=device)

    @torch.compile(fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    def f(x, w, o):
        return gemm(x, w, out=o, out_dtype=torch.float32)

    f(a, b, out)
    assert_rel_close(out, gemm_ref(a, b), tol=1e-5)


def test_gemm_backward_refuses_what_it_cannot_differentiate(device):
    a = _rand(4, 16, device=device, dtype=torch.float8_e4m3fn)
    sa = torch.ones(1, device=device, requires_grad=True)
    with pytest.raises(DTypeError, match="gemm backward"):
        gemm(a, a, scale_a=sa)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_linear_nd_and_module(device, activation):
    x = _rand(2, 3, 5, 48, device=device).requires_grad_()
    layer = FlyLinear(48, 24, activation=activation, device=device, dtype=torch.float16)
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    y = layer(x)
    assert y.shape == (2, 3, 5, 24) and y.dtype == torch.float16
    want = _TORCH_ACT[activation](F.linear(x.double(), layer.weight.double(), layer.bias.double()))
    assert_rel_close(y, want)
    dy = _rand(2, 3, 5, 24, device=device, seed=4)
    y.backward(dy)
    ref = _grads_ref(lambda a, w, b: _TORCH_ACT[activation](F.linear(a, w, b)), (x, layer.weight, layer.bias), dy)
    for got, want in zip((x.grad, layer.weight.grad, layer.bias.grad), ref, strict=True):
        assert_rel_close(got, want, tol=2e-3)
    # strided leading dims (no collapse to one stride): one copy, same result
    xt = _rand(5, 3, 48, device=device, seed=6).transpose(0, 1)
    want_t = _TORCH_ACT[activation](F.linear(xt.double(), layer.weight.double(), layer.bias.double()))
    assert_rel_close(linear(xt, layer.weight, layer.bias, activation), want_t)
    with pytest.raises(ArgumentError, match="activation"):
        FlyLinear(4, 4, activation="tanh")


def test_linear_fp32_runs_torch(device):
    x, w = _rand(3, 8, device=device, dtype=torch.float32), _rand(5, 8, device=device, seed=1, dtype=torch.float32)
    assert_rel_close(linear(x, w, None, "relu"), F.relu(x.double() @ w.double().t()), tol=1e-6)


def test_custom_op_passes_opcheck(device):
    a, b = _rand(7, 32, device=device), _rand(24, 32, device=device, seed=1)
    bias = _rand(24, device=device, seed=2)
    torch.library.opcheck(torch.ops.fly_gemm.gemm.default, (a, b, bias, "gelu", None, None, None, "nk"))
    torch.library.opcheck(torch.ops.fly_gemm.gemm.default, (a, b.t(), None, None, torch.float32, None, None, "kn"))


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    x = _rand(6, 32, device=device).requires_grad_()
    w = _rand(16, 32, device=device, seed=1).requires_grad_()

    @torch.compile(fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    def f(a, b):
        return linear(a, b, None, "relu") * 2.0

    y = f(x, w)
    assert_rel_close(y, 2.0 * F.relu(x.double() @ w.double().t()))
    y.sum().backward()
    gx, gw = _grads_ref(lambda a, b: 2.0 * F.relu(a @ b.t()), (x, w), torch.ones(6, 16, device=device))
    assert_rel_close(x.grad, gx, tol=2e-3)
    assert_rel_close(w.grad, gw, tol=2e-3)


@pytest.mark.gpu
@pytest.mark.graph
def test_cuda_graph_capture(device):
    a, b = _rand(256, 1024, device=device, dtype=torch.bfloat16), _rand(512, 1024, device=device, seed=1,
                                                                          dtype=torch.bfloat16)  # fmt: skip
    gemm(a, b)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = gemm(a, b)
    a.copy_(_rand(256, 1024, device=device, dtype=torch.bfloat16, seed=9))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(c, gemm_ref(a, b))


# ---------------------------------------------------------------- prepacked weights


@pytest.mark.parametrize("quant", [None, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_prepack(device, quant, b_layout):
    """A prepacked weight gives the GEMM of what it holds: the 16-bit weight, or its per-channel quantized
    codes with a 16-bit activation quantized per row on the fly (checked against the fp64 product of the
    same quantized operands, and against the unquantized product within the quantization's error)."""
    x = _rand(9, 64, device=device)
    w = _rand(48, 64, device=device, seed=1)
    packed = prepack(w if b_layout == "nk" else w.t().contiguous(), b_layout=b_layout, quant=quant)
    assert isinstance(packed, PackedWeight) and packed.shape == (48, 64) and packed.weight.is_contiguous()
    bias = _rand(48, device=device, seed=2)
    y = gemm(x, packed, bias=bias, activation="silu", out_dtype=torch.float32)
    if quant is None:
        assert_rel_close(y, gemm_ref(x, w, bias=bias, activation="silu"), tol=1e-5)
        return
    qx, sx = quantize_per_token_ref(x, quant)
    qw, sw = quantize_per_token_ref(w, quant)
    assert torch.equal(packed.weight.cpu().view(torch.uint8), qw.cpu().view(torch.uint8))
    assert_rel_close(y, gemm_ref(qx, qw, scale_a=sx, scale_b=sw, bias=bias, activation="silu"), tol=1e-5)
    # and near the unquantized product: fp8 e4m3 keeps 3 mantissa bits, int8 about 7 of a row's range
    tol = 0.08 if quant == torch.float8_e4m3fn else 0.02
    assert_rel_close(y, gemm_ref(x, w, bias=bias, activation="silu"), tol=tol)


def test_prepack_bad_input_is_named(device):
    w = _rand(8, 16, device=device)
    with pytest.raises(DTypeError, match="quant"):
        prepack(w, quant=torch.float16)
    with pytest.raises(ArgumentError, match="b_layout"):
        prepack(w, b_layout="mn")
    packed = prepack(w, quant=torch.int8)
    x = _rand(4, 16, device=device)
    with pytest.raises(ArgumentError, match="scale_b"):
        gemm(x, packed, scale_b=torch.ones(8, device=device))
    with pytest.raises(ArgumentError, match="scale_a"):
        gemm(x, packed, scale_a=torch.ones(4, device=device))
    with pytest.raises(ArgumentError, match="b_layout"):
        gemm(x, packed, b_layout="kn")
    with pytest.raises(DTypeError, match="x: a PackedWeight"):
        linear(x.float(), packed)


def test_fly_linear_prepack_serves_inference(device):
    """After prepack() the layer runs with grad mode on and trainable parameters (no no_grad, no frozen
    bias needed); gradients reach x and the bias; a backward needing the weight's gradient is refused."""
    layer = FlyLinear(64, 32, activation="relu", device=device, dtype=torch.float16)
    x = _rand(3, 7, 64, device=device)
    want = F.relu(F.linear(x.double(), layer.weight.double(), layer.bias.double()))
    layer.prepack(quant=torch.int8)
    assert layer.weight.requires_grad and layer.bias.requires_grad and torch.is_grad_enabled()
    y = layer(x)
    assert_rel_close(y, want, tol=0.02)
    with pytest.raises(UnsupportedError, match="weight: a prepacked FlyLinear has no weight gradient"):
        y.sum().backward()
    with torch.no_grad():
        assert_rel_close(layer(x), want, tol=0.02)
    layer.unpack()
    assert_rel_close(layer(x), want)


@pytest.mark.parametrize("quant", [None, torch.int8])
def test_fly_linear_prepacked_backward_to_input_and_bias(device, quant):
    """A frozen prepacked weight (a QLoRA-style base): dx and dbias against fp64 autograd of the layer's
    weight (quantized: of the dequantized weight the forward multiplies, within the quantization's error)."""
    layer = FlyLinear(48, 40, activation="silu", device=device, dtype=torch.float16)
    layer.weight.requires_grad_(False)
    layer.prepack(quant=quant)
    x = _rand(2, 5, 48, device=device).requires_grad_()
    dy = _rand(2, 5, 40, device=device, seed=4)
    y = layer(x)
    y.backward(dy)
    w = layer.weight if quant is None else layer.packed.weight.double() * layer.packed.scale.double()[:, None]
    ref = _grads_ref(lambda a, b: _TORCH_ACT["silu"](F.linear(a, w.double(), b)), (x, layer.bias), dy)
    tol = 2e-3 if quant is None else 2e-2  # quantized: the forward's x is quantized too (pre-activation)
    assert_rel_close(x.grad, ref[0], tol=tol, name="x")
    assert_rel_close(layer.bias.grad, ref[1], tol=tol, name="bias")
    assert layer.weight.grad is None
