"""``fused_moe`` under torch.compile: the custom op ``fly_gemm::fused_moe`` and its fake implementation
(``torch.library.opcheck`` with bf16 and fp8 block-scaled weights), ``torch.compile(fullgraph=True)`` of a
function calling ``fused_moe`` (bf16, fp8 per channel, fp8 block-scaled) against the eager call (bit for bit:
the same kernels) and ``fused_moe_ref``, meta tensors through the op, ``out`` and ``config`` under tracing,
bad input named under tracing, and no gradient (as in eager calls). Small shapes, so the CPU interpreter runs
them; on the CPU the compiled functions use the ``aot_eager`` backend (tracing, fake tensors and AOT
dispatch as inductor sees them, without generating C++ for the surrounding torch ops)."""

from __future__ import annotations

import pytest
import torch
from test_moe_quant import quantize_weight  # the fp8 weight quantizer of the quantized MoE tests

from fly_gemm.moe import fused_moe
from fly_gemm.moe_config import MoeConfig
from fly_gemm.moe_reference import fused_moe_ref
from fly_gemm.moe_routing import topk_softmax
from flydsl.errors import ArgumentError, ShapeError
from flydsl.testing import assert_rel_close, default_device, tolerance

DEV = default_device()
FP8 = torch.float8_e4m3fn
BACKEND = "aot_eager" if DEV.type == "cpu" else "inductor"
T, H, INTER, E, K = 5, 64, 32, 4, 2


def _layer(dtype=torch.bfloat16, seed=0):
    """Unit-scale bf16 activations, fp32 weights (quantized by the caller) and softmax routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w1 = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    w, ids = topk_softmax(torch.randn(T, E, generator=g), K)
    return x.to(DEV), w1.to(DEV), w2.to(DEV), w.to(DEV), ids.to(DEV)


def _operands(mode: str, seed=0):
    """(x, w1, w2, topk_weights, topk_ids, keyword arguments) of one weight format."""
    x, w1, w2, w, ids = _layer(seed=seed)
    if mode == "bf16":
        return x, w1.to(x.dtype), w2.to(x.dtype), w, ids, {}
    block = None if mode == "fp8-channel" else [32, 32]
    q1, s1 = quantize_weight(w1, FP8, block)
    q2, s2 = quantize_weight(w2, FP8, block)
    return x, q1, q2, w, ids, {"w1_scale": s1, "w2_scale": s2, "block_shape": block}


def _op_args(x, w1, w2, w, ids, w1_scale=None, w2_scale=None, block_shape=None, activation="silu", on_input=False):
    return (x, w1, w2, w, ids, w1_scale, w2_scale, activation, on_input, block_shape)


@pytest.mark.parametrize("mode", ["bf16", "fp8-block"])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_opcheck(mode):
    x, w1, w2, w, ids, kw = _operands(mode, seed=1)
    # opcheck's sub-tests: the schema (no input mutated, no output aliasing an input), the fake against the
    # real result's shape, dtype and strides, the autograd registration (none needed: no input requires
    # grad), AOT dispatch with static and dynamic shapes. test_schema runs for bf16 only: its mutation check
    # compares every input before and after the call with arithmetic torch does not implement for fp8 e4m3
    # ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); the bf16 case checks the same schema.
    tests = ("test_schema",) * (mode == "bf16") + (
        "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fly_gemm.fused_moe.default, _op_args(x, w1, w2, w, ids, **kw), test_utils=tests)
    torch.library.opcheck(torch.ops.fly_gemm.fused_moe.default,
                          _op_args(x, w1, w2, w, ids, **kw, activation="gelu_tanh", on_input=True),
                          test_utils=tests)  # fmt: skip


@pytest.mark.parametrize("mode", ["bf16", "fp8-channel", "fp8-block"])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_torch_compile_fullgraph_matches_eager_and_reference(mode):
    torch._dynamo.reset()
    x, w1, w2, w, ids, kw = _operands(mode, seed=2)

    @torch.compile(fullgraph=True, backend=BACKEND)
    def layer(x, w1, w2, w, ids):
        # torch ops around the call, so the op sits inside a traced graph
        return fused_moe(x * 2, w1, w2, w.float(), ids, activation="gelu", **kw) + x

    y = layer(x, w1, w2, w, ids)
    eager = fused_moe(x * 2, w1, w2, w.float(), ids, activation="gelu", **kw) + x
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, eager)  # the same kernels on the same operands
    ref = fused_moe_ref(x * 2, w1, w2, w.float(), ids, activation="gelu", **kw).to(x.device)
    assert_rel_close(y - x, ref, tol=tolerance(x.dtype))


def test_meta_tensors_through_the_op():
    m = torch.device("meta")
    x = torch.empty(T, H, dtype=torch.bfloat16, device=m)
    w1 = torch.empty(E, 2 * INTER, H, dtype=FP8, device=m)
    w2 = torch.empty(E, H, INTER, dtype=FP8, device=m)
    s1 = torch.empty(E, 2, 2, device=m)
    s2 = torch.empty(E, 2, 1, device=m)
    w, ids = torch.empty(T, K, device=m), torch.empty(T, K, dtype=torch.int32, device=m)
    y = torch.ops.fly_gemm.fused_moe(x, w1, w2, w, ids, s1, s2, "silu", False, [32, 32])
    assert y.is_meta and y.shape == (T, H) and y.dtype == torch.bfloat16
    with pytest.raises(ShapeError, match="w2_scale"):
        torch.ops.fly_gemm.fused_moe(x, w1, w2, w, ids, s1, s1, "silu", False, [32, 32])


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_out_under_torch_compile_is_filled_by_a_copy():
    torch._dynamo.reset()
    x, w1, w2, w, ids, _ = _operands("bf16", seed=3)
    want = fused_moe(x, w1, w2, w, ids)

    @torch.compile(fullgraph=True, backend=BACKEND)
    def into(x, w1, w2, w, ids, out):
        return fused_moe(x, w1, w2, w, ids, out=out)

    out = torch.full_like(x, float("nan"))
    y = into(x, w1, w2, w, ids, out)
    assert torch.equal(out, want) and torch.equal(y, want)
    xc = x.clone()  # out=x: stage 1 reads x before the copy writes it
    into(xc, w1, w2, w, ids, xc)
    assert torch.equal(xc, want)


def _raises(match: str):
    """The error as a fullgraph compile reports it: Dynamo wraps an exception raised while tracing (in the
    traced Python code, or in the op's fake implementation) in one of its own, whose message carries ours."""
    return pytest.raises((ArgumentError, torch._dynamo.exc.TorchDynamoException), match=match)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_config_and_bad_input_under_torch_compile_name_the_argument():
    x, w1, w2, w, ids, kw = _operands("fp8-channel", seed=4)

    def call(*operands, **kw):
        torch._dynamo.reset()
        return torch.compile(lambda *a: fused_moe(*a, **kw), fullgraph=True, backend=BACKEND)(*operands)

    bf16 = (x, w1.float().to(x.dtype), w2.float().to(x.dtype), w, ids)
    with _raises("config: not taken under torch.compile"):
        call(*bf16, config=MoeConfig(16, 32, 32))
    with _raises(r"out: expected \[5, 64\]"):
        call(*bf16, out=torch.empty(T + 1, H, dtype=x.dtype, device=x.device))
    with _raises("activation: expected one of"):
        call(*bf16, activation="relu")
    with _raises("block_shape: expected"):
        call(x, w1, w2, w, ids, w1_scale=kw["w1_scale"], w2_scale=kw["w2_scale"], block_shape=[32])
    # from the fake implementation: shapes and dtypes checked as the real call checks them
    with _raises("w2_scale: expected"):
        call(x, w1, w2, w, ids, w1_scale=kw["w1_scale"], w2_scale=kw["w2_scale"][:, 1:])
    with _raises("topk_weights: expected"):
        call(x, bf16[1], bf16[2], w[:, :1], ids)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_no_gradient_under_torch_compile_as_in_eager():
    torch._dynamo.reset()
    x, w1, w2, w, ids, _ = _operands("bf16", seed=5)
    xg, w1g = x.clone().requires_grad_(), w1.clone().requires_grad_()
    eager = fused_moe(xg, w1g, w2, w, ids)
    compiled = torch.compile(fused_moe, fullgraph=True, backend=BACKEND)(xg, w1g, w2, w, ids)
    assert not eager.requires_grad and not compiled.requires_grad
    assert torch.equal(compiled, eager)
