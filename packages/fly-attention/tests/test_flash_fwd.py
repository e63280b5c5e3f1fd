"""flash_attn against the fp32 reference: every option and their combinations, GQA ratios, odd sequence
lengths both ways, padded head dims, the transposed layout, lse, rows that see no key.

CPU runs go through Triton's interpreter at small shapes (fp16, and bf16: the interpreter's dot is exact
for it); every output is allocated poisoned (NaN), so an element the kernel should write and did not fails.
``gpu`` tests take the sizes the issue names.
"""

from __future__ import annotations

import pytest
import torch
from attn_helpers import check_lse, rand_qkv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fly_attention import AttnConfig, flash_attn, flash_attn_ref
from fly_attention import attention as attn_mod
from flydsl.testing import assert_rel_close, tolerance


def run_and_check(q, k, v, dtype=None, **opts):
    out, lse = flash_attn(q, k, v, return_lse=True, **opts)
    ref, ref_lse = flash_attn_ref(q, k, v, return_lse=True, **opts)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in the output"
    assert_rel_close(out, ref.to(out.device), tol=tolerance(dtype or q.dtype))
    check_lse(lse, ref_lse)
    return out, lse


# Cases as data: (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, options).
CASES = [
    # plain MHA at the boundary lengths: one token, a ragged tile (17), several whole tiles (128)
    (1, 1, 1, 2, 2, 64, 64, {}),
    (2, 17, 17, 2, 2, 64, 64, {}),
    (1, 128, 128, 2, 2, 64, 64, {}),
    # causal, square and both ways off-square (bottom-right alignment; sq > sk has rows that see nothing)
    (1, 128, 128, 2, 2, 64, 64, {"causal": True}),
    (2, 17, 128, 2, 2, 64, 64, {"causal": True}),
    (2, 128, 17, 2, 2, 64, 64, {"causal": True}),
    (1, 1, 128, 2, 2, 64, 64, {"causal": True}),
    (1, 33, 1, 2, 2, 64, 64, {"causal": True}),
    # GQA 4:1 and MQA (all query heads on one KV head), with and without causal
    (1, 40, 40, 8, 2, 64, 64, {}),
    (1, 40, 57, 8, 2, 64, 64, {"causal": True}),
    (2, 23, 23, 4, 1, 64, 64, {"causal": True}),
    # head dims not powers of two (padded and masked), and a value head dim different from q/k's
    (1, 33, 45, 2, 1, 80, 80, {}),
    (1, 45, 33, 2, 2, 96, 96, {"causal": True}),
    (1, 29, 29, 2, 2, 96, 64, {}),
    (1, 29, 41, 2, 1, 80, 48, {"causal": True}),
    # sliding windows: each side alone, both, composed with causal (right = 0), and a window so small some
    # rows see nothing when seqlen_q > seqlen_k
    (1, 70, 70, 2, 2, 64, 64, {"window": (16, -1)}),
    (1, 70, 70, 2, 2, 64, 64, {"window": (-1, 5)}),
    (1, 50, 77, 2, 1, 64, 64, {"window": (9, 20)}),
    (1, 77, 50, 2, 2, 64, 64, {"window": (7, 40), "causal": True}),
    (1, 60, 20, 2, 2, 64, 64, {"window": (0, 0)}),
    (1, 64, 64, 2, 2, 64, 64, {"window": (0, 0)}),
    # softcap, alone and with causal + window + GQA; an explicit scale
    (1, 45, 45, 2, 2, 64, 64, {"softcap": 2.0}),
    (2, 31, 50, 4, 2, 80, 80, {"softcap": 10.0, "causal": True, "window": (12, -1)}),
    (1, 36, 36, 2, 2, 64, 64, {"softmax_scale": 0.37, "causal": True}),
]


def _case_id(case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    tag = "-".join(f"{k}={v}" for k, v in opts.items())
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}/{dv}" + (f"-{tag}" if tag else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp16_against_reference(device, case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    run_and_check(*rand_qkv(b, sq, sk, hq, hkv, d, dv, device=device), **opts)


# bf16 (exact dots in the interpreter) on a subset that touches every path
BF16_CASES = [CASES[i] for i in (1, 5, 9, 13, 18, 22)]


@pytest.mark.parametrize("case", BF16_CASES, ids=_case_id)
def test_bf16_against_reference(device, case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    run_and_check(*rand_qkv(b, sq, sk, hq, hkv, d, dv, dtype=torch.bfloat16, device=device), **opts)


def test_rows_that_see_no_key_give_zero_and_minus_inf(device):
    """seqlen_q > seqlen_k under causal: the first seqlen_q - seqlen_k rows see nothing: 0 and lse -inf,
    never NaN (the guarded running maximum)."""
    q, k, v = rand_qkv(1, 50, 10, 2, 2, 64, device=device)
    out, lse = run_and_check(q, k, v, causal=True)
    assert torch.equal(out[:, :40].float().cpu(), torch.zeros(1, 40, 2, 64))
    assert torch.isneginf(lse[:, :, :40]).all() and torch.isfinite(lse[:, :, 40:]).all()
    # an empty key sequence: every row
    q, k, v = rand_qkv(1, 5, 0, 2, 2, 64, device=device)
    out, lse = flash_attn(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_transposed_and_strided_layouts_are_read_in_place(device):
    """``[B, H, S, D]`` storage through ``.transpose(1, 2)``, heads sliced out of a wider tensor, and a
    batch-strided k: the same result as the contiguous tensors."""
    b, s, hq, hkv, d = 2, 37, 4, 2, 64
    g = torch.Generator().manual_seed(3)
    q_bhsd = torch.randn(b, hq, s, d, generator=g).half().to(device)
    k_wide = torch.randn(b, s, 2 * hkv, d, generator=g).half().to(device)
    v_bhsd = torch.randn(b, hkv, s, d, generator=g).half().to(device)
    q, k, v = q_bhsd.transpose(1, 2), k_wide[:, :, 1::2], v_bhsd.transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = run_and_check(q, k, v, causal=True)[0]
    assert_rel_close(out, flash_attn(q.contiguous(), k.contiguous(), v.contiguous(), causal=True), tol=1e-6)


@pytest.mark.parametrize("cfg", [AttnConfig(16, 16, num_stages=1), AttnConfig(16, 64), AttnConfig(64, 16)])
def test_configs_agree(device, cfg):
    """Tile sizes change the block walk (skipped, unmasked and edge blocks) but not the result."""
    q, k, v = rand_qkv(1, 75, 90, 4, 2, 80, device=device, seed=4)
    for opts in ({"causal": True}, {"window": (20, 3)}):
        left, right = attn_mod._options(opts.get("causal", False), None, opts.get("window", (-1, -1)), 0.0)
        out, lse = attn_mod._flash_attn(q, k, v, opts.get("causal", False), None, left, right, 0.0, True, cfg)
        ref, ref_lse = flash_attn_ref(q, k, v, return_lse=True, **opts)
        assert_rel_close(out, ref, tol=tolerance(q.dtype))
        check_lse(lse, ref_lse)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sq=st.integers(1, 70),
    sk=st.integers(1, 70),
    group=st.sampled_from([(2, 2), (4, 1), (4, 2)]),
    d=st.sampled_from([64, 80, 96]),
    causal=st.booleans(),
    left=st.integers(-1, 40),
    right=st.integers(-1, 40),
    softcap=st.sampled_from([0.0, 3.0]),
)
def test_random_shapes_and_options(device, sq, sk, group, d, causal, left, right, softcap):
    hq, hkv = group
    q, k, v = rand_qkv(1, sq, sk, hq, hkv, d, device=device, seed=sq * 131 + sk)
    run_and_check(q, k, v, causal=causal, window=(left, right), softcap=softcap)


def test_without_lse_returns_only_the_output(device):
    q, k, v = rand_qkv(1, 20, 20, 2, 2, 64, device=device)
    out = flash_attn(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert_rel_close(out, flash_attn_ref(q, k, v), tol=tolerance(q.dtype))


# ---------------------------------------------------------------- GPU: the sizes the issue names


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(device, d, dv, causal):
    q, k, v = rand_qkv(2, 1000, 1000, 8, 2, d, dv, dtype=torch.bfloat16, device=device)
    run_and_check(q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(4097, 4097), (1000, 4097), (4097, 1000), (1, 4097)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 1)])
def test_gpu_long_sequences(device, sq, sk, dtype, heads):
    for opts in ({}, {"causal": True}):
        q, k, v = rand_qkv(2, sq, sk, heads[0], heads[1], 128, dtype=dtype, device=device)
        run_and_check(q, k, v, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "opts", [{"window": (256, 0)}, {"window": (100, 300)}, {"softcap": 30.0, "causal": True}, {"softcap": 5.0}]
)
def test_gpu_window_and_softcap(device, opts):
    q, k, v = rand_qkv(4, 1000, 1500, 8, 2, 128, dtype=torch.bfloat16, device=device)
    run_and_check(q, k, v, **opts)


@pytest.mark.gpu
def test_gpu_transposed_layout(device):
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in rand_qkv(2, 1000, 1000, 8, 8, 128,
                                                                                  dtype=torch.bfloat16,
                                                                                  device=device))  # fmt: skip
    run_and_check(q, k, v, causal=True)
