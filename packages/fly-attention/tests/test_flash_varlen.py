"""flash_attn_varlen against the per-sequence fp32 reference: empty and length-1 sequences, the causal /
window alignment of each sequence's own lengths, GQA, lse, tokens outside every sequence; the dense
forward and the packed one agree."""

from __future__ import annotations

import pytest
import torch
from attn_helpers import check_lse

from fly_attention import flash_attn, flash_attn_varlen, flash_attn_varlen_ref
from flydsl.testing import assert_rel_close, tolerance


def _cu(lengths, device):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return torch.tensor(offs, dtype=torch.int32, device=device)


def _packed(lens_q, lens_k, hq, hkv, d, dv=None, *, dtype=torch.float16, device="cpu", seed=0, extra_q=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    tq, tk = sum(lens_q) + extra_q, sum(lens_k)
    q = torch.randn(tq, hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(tk, hkv, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(tk, hkv, dv, generator=g).to(device=device, dtype=dtype)
    return q, k, v, _cu(lens_q, device), _cu(lens_k, device)


def _run(q, k, v, cu_q, cu_k, dtype=None, **opts):
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **opts)
    ref, ref_lse = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    assert not torch.isnan(out).any()
    assert_rel_close(out, ref, tol=tolerance(dtype or q.dtype))
    check_lse(lse, ref_lse)
    return out, lse


# (query lengths, key lengths, heads_q, heads_kv, head_dim, options): empty sequences (query side, key
# side, both), length 1, lengths past one tile, seqlen_q > seqlen_k and < per sequence.
CASES = [
    ([5, 0, 17, 1, 40], [5, 0, 17, 1, 40], 2, 2, 64, {}),
    ([5, 0, 17, 1, 40], [5, 0, 17, 1, 40], 2, 2, 64, {"causal": True}),
    ([3, 30, 1, 0, 12], [20, 7, 1, 9, 0], 4, 1, 64, {"causal": True}),
    ([33, 2, 19], [11, 40, 19], 4, 2, 80, {"window": (6, 2)}),
    ([33, 2, 19], [11, 40, 19], 2, 2, 96, {"window": (6, -1), "causal": True, "softcap": 4.0}),
    ([1], [1], 2, 2, 64, {"causal": True}),
    ([0, 0], [4, 0], 2, 2, 64, {}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-{c[5]}")
def test_varlen_against_reference(device, case):
    lens_q, lens_k, hq, hkv, d, opts = case
    _run(*_packed(lens_q, lens_k, hq, hkv, d, device=device), **opts)


def test_varlen_bf16_and_value_head_dim(device):
    q, k, v, cu_q, cu_k = _packed([9, 1, 26], [30, 1, 26], 4, 2, 96, 64, dtype=torch.bfloat16, device=device)
    _run(q, k, v, cu_q, cu_k, causal=True)


def test_tokens_outside_every_sequence_read_zero(device):
    """cu_seqlens_q that starts past 0 and ends before the packed tokens: the tokens before and after get
    0 and lse -inf (not the poison of the allocation)."""
    q, k, v, _, cu_k = _packed([6, 4], [6, 4], 2, 2, 64, device=device, extra_q=5)
    cu_q = torch.tensor([2, 8, 12], dtype=torch.int32, device=device)
    out, lse = _run(q, k, v, cu_q, cu_k)
    assert (out[:2] == 0).all() and (out[12:] == 0).all()
    assert torch.isneginf(lse[:, :2]).all() and torch.isneginf(lse[:, 12:]).all()


def test_varlen_matches_dense(device):
    """Equal-length sequences packed give the dense forward's output and lse."""
    b, s, hq, hkv, d = 3, 21, 4, 2, 64
    q, k, v, cu_q, cu_k = _packed([s] * b, [s] * b, hq, hkv, d, device=device, seed=5)
    out, lse = flash_attn_varlen(q, k, v, cu_q, cu_k, s, s, causal=True, return_lse=True)
    dense, dense_lse = flash_attn(q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d), causal=True,
                                  return_lse=True)  # fmt: skip
    assert_rel_close(out.view(b, s, hq, d), dense, tol=1e-6)
    assert_rel_close(lse.view(hq, b, s).transpose(0, 1), dense_lse, tol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen(device, causal):
    lens_q = [1000, 0, 1, 4097, 333, 2048]
    lens_k = [1000, 7, 1, 4097, 1200, 100]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 8, 2, 128, dtype=torch.bfloat16, device=device)
    _run(q, k, v, cu_q, cu_k, causal=causal)
