"""``FlyMoE`` against a plain torch layer computed in fp32 from the module's own parameters (router logits,
softmax or grouped sigmoid top-k, per-expert SiLU(gate) * up, down projection, weighted sum), by relative
error: 2-D and 3-D input, DeepSeek-V3-style grouped routing with a correction bias and a routed scaling
factor, a state-dict round trip, ``from_weights``, ``prepack`` (same result, frozen parameters, any grad
mode); inference only (a forward that would need a gradient raises); bad input named by argument. A GPU
case at a Mixtral-like size carries the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fly_gemm import FlyMoE
from flydsl.errors import ArgumentError, DeviceError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, default_device, tolerance

DEV = default_device()
H, INTER, E, K = 64, 32, 4, 2


def _ref(m: FlyMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer in fp32 from m's parameters, written out independently of fly_gemm's routing and kernels."""
    x2 = x.reshape(-1, m.hidden_size).float().cpu()
    logits = x2 @ m.router.weight.float().cpu().t()
    t, e = logits.shape
    if m.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    choice = scores
    if m.e_score_correction_bias is not None:
        choice = scores + m.e_score_correction_bias.float().cpu()
    if m.num_expert_group is not None:
        g = m.num_expert_group
        grouped = choice.view(t, g, e // g)
        best = grouped.topk(2, dim=-1).values.sum(-1) if m.e_score_correction_bias is not None else grouped.amax(-1)
        kept = torch.zeros(t, g, dtype=torch.bool).scatter_(1, best.topk(m.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // g, dim=1), float("-inf"))
    ids = choice.topk(m.top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if m.renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * m.routed_scaling_factor
    w1, w2 = m.w1.float().cpu(), m.w2.float().cpu()
    inter = m.intermediate_size
    out = torch.zeros_like(x2)
    for ti in range(t):
        for j in range(m.top_k):
            ex = int(ids[ti, j])
            gate_up = w1[ex] @ x2[ti]
            out[ti] += w[ti, j] * (w2[ex] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out.reshape(x.shape)


def _x(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def _module(seed=0, dtype=torch.bfloat16, **kw):
    torch.manual_seed(seed)
    opts = {"hidden_size": H, "intermediate_size": INTER, "num_experts": E, "top_k": K}
    opts.update(kw)
    h, i, e, k = (opts.pop(n) for n in ("hidden_size", "intermediate_size", "num_experts", "top_k"))
    return FlyMoE(h, i, e, k, device=DEV, dtype=dtype, **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_matches_fp32_reference(dtype):
    m = _module(seed=1, dtype=dtype)
    x = _x(13, H, dtype=dtype, seed=2)
    with torch.no_grad():
        y = m(x)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert_rel_close(y, _ref(m, x), tol=tolerance(torch.bfloat16))


def test_forward_3d_input_and_empty_batch():
    m = _module(seed=3)
    x = _x(2, 5, H, seed=4)
    with torch.inference_mode():
        y = m(x)
        assert m(x[:, :0]).shape == (2, 0, H)
    assert y.shape == (2, 5, H)
    assert_rel_close(y, _ref(m, x), tol=tolerance(torch.bfloat16))
    with torch.no_grad():  # the same tokens flattened give the same rows
        assert_rel_close(m(x.reshape(10, H)), y.reshape(10, H), tol=tolerance(torch.bfloat16))


def test_grouped_sigmoid_routing_with_correction_bias():
    m = _module(seed=5, num_experts=8, top_k=2, scoring="sigmoid", num_expert_group=4, topk_group=2,
                correction_bias=True, routed_scaling_factor=2.5)  # fmt: skip
    with torch.no_grad():
        # a bias large enough to move choices: a spread of +-0.5 over sigmoid scores in (0, 1)
        m.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 8))
    x = _x(17, H, seed=6)
    with torch.no_grad():
        y = m(x)
        ref = _ref(m, x)
        assert_rel_close(y, ref, tol=tolerance(torch.bfloat16))
        # the bias takes part in the choice: without it the reference differs from the module's output
        m.e_score_correction_bias.zero_()
        assert (_ref(m, x) - ref).norm() > 0.05 * ref.norm()
    assert "num_expert_group=4" in repr(m) and "correction_bias=True" in repr(m)


def test_sigmoid_scoring_without_groups():
    m = _module(seed=7, scoring="sigmoid", renormalize=False)
    x = _x(9, H, seed=8)
    with torch.no_grad():
        assert_rel_close(m(x), _ref(m, x), tol=tolerance(torch.bfloat16))


def test_state_dict_round_trip_and_from_weights():
    m = _module(seed=9, num_experts=8, scoring="sigmoid", num_expert_group=4, topk_group=2, correction_bias=True)
    with torch.no_grad():
        m.e_score_correction_bias.normal_(0.0, 0.1)
    sd = m.state_dict()
    assert set(sd) == {"router.weight", "w1", "w2", "e_score_correction_bias"}
    assert sd["router.weight"].dtype == torch.float32 and sd["w1"].shape == (8, 2 * INTER, H)
    assert sd["w2"].shape == (8, H, INTER) and sd["e_score_correction_bias"].dtype == torch.float32
    other = _module(seed=10, num_experts=8, scoring="sigmoid", num_expert_group=4, topk_group=2, correction_bias=True)
    other.load_state_dict(sd)
    x = _x(11, H, seed=11)
    with torch.no_grad():
        y = m(x)
        assert torch.equal(other(x), y)
        ported = FlyMoE.from_weights(sd["router.weight"].to(torch.bfloat16), sd["w1"], sd["w2"], top_k=K,
                                     e_score_correction_bias=sd["e_score_correction_bias"], scoring="sigmoid",
                                     num_expert_group=4, topk_group=2)  # fmt: skip
        assert ported.w1.data_ptr() == sd["w1"].data_ptr()  # taken without a copy
        assert ported.router.weight.dtype == torch.float32 and ported.w1.device == x.device
        assert_rel_close(ported(x), _ref(ported, x), tol=tolerance(torch.bfloat16))


def test_prepack_same_result_frozen_and_unpack():
    m = _module(seed=12)
    x = _x(7, H, seed=13)
    with torch.no_grad():
        before = m(x)
    with torch.no_grad():  # a strided (transposed-storage) w2 becomes contiguous, same values
        m.w2.data = m.w2.data.transpose(1, 2).contiguous().transpose(1, 2)
    assert not m.w2.is_contiguous()
    w2_param = m.w2
    assert m.prepack() is m
    assert m.w2 is w2_param and m.w2.is_contiguous() and m.w1.is_contiguous()
    assert not any(p.requires_grad for p in m.parameters()) and "prepacked=True" in repr(m)
    assert torch.equal(m(x), before)  # grad mode on: runs, since nothing requires grad
    m.unpack()
    assert all(p.requires_grad for p in m.parameters())
    with pytest.raises(UnsupportedError, match="inference-only"):
        m(x)


def test_forward_that_needs_a_gradient_raises():
    m = _module(seed=14)
    x = _x(3, H, seed=15)
    with pytest.raises(UnsupportedError, match=r"w1, w2, router\.weight: FlyMoE is inference-only"):
        m(x)
    m.prepack()
    with pytest.raises(UnsupportedError, match=r"^x: FlyMoE is inference-only"):
        m(x.clone().requires_grad_())


def test_bad_input_named():
    m = _module(seed=16).prepack()
    with pytest.raises(ShapeError, match="x: expected"):
        m(_x(3, H + 1))
    with pytest.raises(DTypeError, match="x: expected dtype bf16 or fp16"):
        m(_x(3, H, dtype=torch.float32))
    with pytest.raises(DTypeError, match=r"x: expected dtype bf16 \(the experts'\)"):
        m(_x(3, H, dtype=torch.float16))
    with pytest.raises(ArgumentError, match="x: expected a torch.Tensor"):
        m([0.0] * H)
    with pytest.raises(DeviceError, match="x: expected a tensor on"):
        m(torch.empty(3, H, dtype=torch.bfloat16, device="meta"))
    fp32 = FlyMoE(H, INTER, E, K, device=DEV)
    with torch.no_grad(), pytest.raises(DTypeError, match=r"w1: FlyMoE runs bf16 / fp16 experts"):
        fp32(_x(3, H))
    with pytest.raises(DTypeError, match="w1: FlyMoE.prepack needs bf16 / fp16"):
        fp32.prepack()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"top_k": 5}, "top_k: expected at most num_experts = 4"),
        ({"top_k": 0}, "top_k: expected an integer >= 1"),
        ({"hidden_size": 2.0}, "hidden_size: expected an integer"),
        ({"activation": "tanh"}, "activation: expected one of"),
        ({"scoring": "relu"}, "scoring: expected one of"),
        ({"num_expert_group": 2}, "num_expert_group, topk_group: give both"),
        ({"num_expert_group": 3, "topk_group": 1}, "num_expert_group: expected a divisor of num_experts = 4"),
        ({"num_expert_group": 2, "topk_group": 3}, "topk_group: expected at most num_expert_group = 2"),
        ({"num_expert_group": 4, "topk_group": 1}, "top_k: expected at most topk_group"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor: expected a finite number > 0"),
    ],
)
def test_bad_constructor_arguments(kw, match):
    with pytest.raises(ArgumentError, match=match):
        _module(**kw)


def test_bad_from_weights_arguments():
    m = _module(seed=17)
    r, w1, w2 = m.router.weight.detach(), m.w1.detach(), m.w2.detach()
    with pytest.raises(ShapeError, match=r"w2: expected \[4, 64, 32\]"):
        FlyMoE.from_weights(r, w1, w2.transpose(1, 2), top_k=K)
    with pytest.raises(ShapeError, match=r"router_weight: expected \[4, 64\]"):
        FlyMoE.from_weights(r.t(), w1, w2, top_k=K)
    with pytest.raises(ShapeError, match="w1: expected"):
        FlyMoE.from_weights(r, w1[:, :-1], w2, top_k=K)
    with pytest.raises(DTypeError, match="w2: expected dtype bf16"):
        FlyMoE.from_weights(r, w1, w2.half(), top_k=K)
    with pytest.raises(ShapeError, match=r"e_score_correction_bias: expected \[4\]"):
        FlyMoE.from_weights(r, w1, w2, top_k=K, e_score_correction_bias=torch.zeros(5, device=DEV))
    with pytest.raises(DeviceError, match="router_weight: expected a tensor on"):
        FlyMoE.from_weights(r.to("meta"), w1, w2, top_k=K)
    with pytest.raises(ArgumentError, match="dtype: taken from the weights"):
        FlyMoE.from_weights(r, w1, w2, top_k=K, dtype=torch.float16)


@pytest.mark.gpu
def test_gpu_mixtral_like():
    """Mixtral's structure (8 experts, top 2, SiLU, I = 3.5 H) at a quarter of its width, 96 tokens in 3-D."""
    torch.manual_seed(0)
    m = FlyMoE(1024, 3584, 8, 2, device="cuda", dtype=torch.bfloat16).prepack()
    x = torch.randn(3, 32, 1024, device="cuda", dtype=torch.bfloat16)
    y = m(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert_rel_close(y, _ref(m, x), tol=tolerance(torch.bfloat16))
