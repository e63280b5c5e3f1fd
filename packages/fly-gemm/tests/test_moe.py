"""``fused_moe`` against the fp32 loop-over-experts reference by relative error (poisoned outputs, so an
unwritten row fails): fp16 and bf16, SiLU / GELU, the router weight on the output or the input, k = 1-4,
odd hidden and intermediate sizes, experts with no tokens, every token on one expert, int32 and int64 ids,
-1 slots (expert parallelism), strided operands, out= (and out=x), several tile configs, zero tokens, meta
tensors; bad input named by argument. GPU cases at the models' sizes (Mixtral 8x7B, DeepSeek-V3 routing on
64 and 256 experts, Qwen3-30B-A3B) carry the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch

from fly_gemm.moe import fused_moe
from fly_gemm.moe_config import MoeConfig
from fly_gemm.moe_reference import fused_moe_ref
from fly_gemm.moe_routing import grouped_topk, topk_softmax
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, default_device, empty_poisoned, tolerance

DEV = default_device()


def _layer(t, h, inter, e, k, dtype, seed, device=DEV, ids_dtype=torch.int32):
    """Unit-scale inputs and weights (as a trained layer's: outputs near 1) and softmax routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w1 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(t, e, generator=g)
    x, w1, w2, logits = (v.to(device) for v in (x, w1, w2, logits))
    w, ids = topk_softmax(logits, k)
    return x, w1, w2, w, ids.to(ids_dtype)


def _check(y, x, w1, w2, w, ids, **kw):
    ref = fused_moe_ref(x, w1, w2, w, ids, activation=kw.get("activation", "silu"),
                        apply_router_weight_on_input=kw.get("apply_router_weight_on_input", False))  # fmt: skip
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_rel_close(y, ref, tol=tolerance(x.dtype))


# (T, H, I, E, k): one token, k = 1; odd H and I (partial tiles in N and K); k = 4 over 8 experts at 50
# tokens; more experts than tokens (most empty); I wider than H
CASES = [(1, 32, 32, 4, 1), (23, 72, 40, 6, 2), (50, 64, 64, 8, 4), (5, 48, 24, 16, 3), (17, 32, 96, 8, 2)]


@pytest.mark.parametrize("t,h,inter,e,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_matches_reference(t, h, inter, e, k, dtype):
    x, w1, w2, w, ids = _layer(t, h, inter, e, k, dtype, seed=t * 31 + e)
    out = empty_poisoned(t, h, dtype=dtype, device=DEV)
    y = fused_moe(x, w1, w2, w, ids, out=out)
    assert y is out
    _check(y, x, w1, w2, w, ids)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_activation_and_router_weight_placement(activation, on_input):
    x, w1, w2, w, ids = _layer(19, 64, 48, 6, 2, torch.float16, seed=7)
    w = w * 3.0  # weights away from 1, so weighting the input and the output differ
    y = fused_moe(x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=on_input)
    _check(y, x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=on_input)
    other = fused_moe_ref(x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=not on_input)
    assert (y.double() - other.to(y.device).double()).norm() > 0.05 * other.double().norm()


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_fused_moe_empty_experts_and_one_expert(ids_dtype):
    x, w1, w2, w, ids = _layer(29, 32, 32, 8, 2, torch.float16, seed=3, ids_dtype=ids_dtype)
    ids = torch.where(ids % 2 == 0, 6, 1).to(ids_dtype)  # experts 0, 2-5 and 7 get no rows
    ids[:, 1] = torch.where(ids[:, 0] == 6, 1, 6)  # a token's two slots on distinct experts
    _check(fused_moe(x, w1, w2, w, ids), x, w1, w2, w, ids)
    one = torch.full_like(ids[:, :1], 5)  # every token on expert 5, k = 1
    _check(fused_moe(x, w1, w2, w[:, :1], one), x, w1, w2, w[:, :1], one)


def test_fused_moe_minus_one_slots_contribute_nothing():
    x, w1, w2, w, ids = _layer(21, 32, 48, 4, 3, torch.float16, seed=5)
    ids[::3, 1] = -1
    ids[4] = -1  # a token with no local expert: its output is zero
    y = fused_moe(x, w1, w2, w, ids, out=empty_poisoned(21, 32, dtype=torch.float16, device=DEV))
    _check(y, x, w1, w2, w, ids)
    assert torch.count_nonzero(y[4]) == 0


def test_fused_moe_strided_operands_and_out_is_x():
    x, w1, w2, w, ids = _layer(13, 48, 40, 4, 2, torch.bfloat16, seed=9)
    xs = torch.empty(13, 96, dtype=x.dtype, device=DEV)[:, ::2]
    xs.copy_(x)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] with H the strided-by-2I dimension
    w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    wt = w.t().contiguous().t()
    idst = ids.t().contiguous().t()
    _check(fused_moe(xs, w1t, w2t, wt, idst), x, w1, w2, w, ids)
    inplace = x.clone()
    y = fused_moe(inplace, w1, w2, w, ids, out=inplace)
    assert y is inplace
    _check(y, x, w1, w2, w, ids)


@pytest.mark.parametrize(
    "cfg",
    [MoeConfig(16, 16, 16, group_m=1), MoeConfig(32, 64, 16, group_m=8), MoeConfig(16, 32, 64, group_m=2)],
    ids=str,
)
def test_fused_moe_tile_configs(cfg):
    x, w1, w2, w, ids = _layer(37, 80, 56, 8, 2, torch.float16, seed=11)
    _check(fused_moe(x, w1, w2, w, ids, config=cfg), x, w1, w2, w, ids)


def test_fused_moe_zero_tokens_and_meta():
    x, w1, w2, w, ids = _layer(0, 32, 32, 4, 2, torch.float16, seed=1)
    assert fused_moe(x, w1, w2, w, ids).shape == (0, 32)
    m = torch.device("meta")
    y = fused_moe(torch.empty(5, 32, dtype=torch.bfloat16, device=m), torch.empty(4, 64, 32, dtype=torch.bfloat16,
                  device=m), torch.empty(4, 32, 32, dtype=torch.bfloat16, device=m),
                  torch.empty(5, 2, device=m), torch.empty(5, 2, dtype=torch.int32, device=m))  # fmt: skip
    assert y.shape == (5, 32) and y.dtype == torch.bfloat16 and y.is_meta


def test_fused_moe_bad_input_names_the_argument():
    x, w1, w2, w, ids = _layer(6, 32, 16, 4, 2, torch.float16, seed=2, device=torch.device("cpu"))
    bad = [
        (DTypeError, "x: expected dtype bf16 or fp16", dict(x=x.float())),
        (UnsupportedError, "x: fp8", dict(x=x.to(torch.float8_e4m3fn))),
        (DTypeError, "w1: expected dtype fp16", dict(w1=w1.bfloat16())),
        (ShapeError, "w1: expected \\[E, 2 \\* I, 32\\]", dict(w1=w1[:, :, :16])),
        (ShapeError, "w1: expected", dict(w1=w1[:, :31])),
        (ShapeError, "w2: expected \\[4, 32, 16\\]", dict(w2=w2[:3])),
        (ShapeError, "topk_ids: expected \\[6, k\\]", dict(ids=ids[:5])),
        (DTypeError, "topk_ids", dict(ids=ids.float())),
        (ShapeError, "topk_weights: expected \\[6, 2\\]", dict(w=w[:, :1])),
        (ArgumentError, "topk_ids: expected expert ids in \\[0, 4\\)", dict(ids=ids + 4)),
        (ArgumentError, "activation", dict(activation="relu")),
        (UnsupportedError, "w1_scale", dict(w1_scale=torch.ones(4))),
        (UnsupportedError, "block_shape", dict(block_shape=[128, 128])),
        (ShapeError, "out: expected \\[6, 32\\]", dict(out=torch.empty(6, 31, dtype=torch.float16))),
        (DTypeError, "out", dict(out=torch.empty(6, 32))),
        (ArgumentError, "config: .* not a valid", dict(config=MoeConfig(24, 32, 32))),
        (ArgumentError, "apply_router_weight_on_input", dict(apply_router_weight_on_input=1)),
    ]
    for err, match, change in bad:
        args = dict(x=x, w1=w1, w2=w2, w=w, ids=ids)
        kw = {k: v for k, v in change.items() if k not in args}
        args.update({k: v for k, v in change.items() if k in args})
        with pytest.raises(err, match=match):
            fused_moe(args["x"], args["w1"], args["w2"], args["w"], args["ids"], **kw)


# ------------------------------------------------------------------ GPU, the models' sizes


def _gpu_layer(t, h, inter, e, k, seed, grouped=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
    w1 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5).to(torch.bfloat16)
    logits = torch.randn(t, e, device="cuda", generator=g)
    if grouped is None:
        w, ids = topk_softmax(logits, k)
    else:
        groups, topk_group = grouped
        bias = torch.randn(e, device="cuda", generator=g) * 0.1
        w, ids = grouped_topk(logits, k, groups, topk_group, correction_bias=bias, routed_scaling_factor=2.5)
    return x, w1, w2, w, ids


# (T, H, I, E, k, grouped): Mixtral 8x7B at decode and prefill; DeepSeek-V3 routing on 64 and 256
# experts (8 groups, 4 kept); Qwen3-30B-A3B; odd token counts
GPU_CASES = [
    (1, 4096, 14336, 8, 2, None),
    (3, 4096, 14336, 8, 2, None),
    (1000, 4096, 14336, 8, 2, None),
    (64, 7168, 2048, 64, 6, (8, 4)),
    (513, 7168, 2048, 256, 8, (8, 4)),
    (1024, 2048, 768, 128, 8, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,inter,e,k,grouped", GPU_CASES)
def test_fused_moe_gpu_model_sizes(t, h, inter, e, k, grouped):
    x, w1, w2, w, ids = _gpu_layer(t, h, inter, e, k, seed=t + e, grouped=grouped)
    out = empty_poisoned(t, h, dtype=torch.bfloat16, device="cuda")
    y = fused_moe(x, w1, w2, w, ids, out=out)
    _check(y, x, w1, w2, w, ids)


@pytest.mark.gpu
def test_fused_moe_gpu_deterministic_and_all_on_one_expert():
    x, w1, w2, w, ids = _gpu_layer(777, 4096, 14336, 8, 2, seed=1)
    assert torch.equal(fused_moe(x, w1, w2, w, ids), fused_moe(x, w1, w2, w, ids))
    ids = torch.zeros_like(ids)
    ids[:, 1] = 3
    _check(fused_moe(x, w1, w2, w, ids), x, w1, w2, w, ids)
