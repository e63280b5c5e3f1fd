"""Helpers shared by fly-attention's test modules: random inputs and the lse comparison."""

from __future__ import annotations

import torch

from flydsl.testing import assert_rel_close


def rand_qkv(b, sq, sk, hq, hkv, d, dv=None, *, dtype=torch.float16, device="cpu", seed=0):
    """Random ``[B, S, H, D]`` q, k, v (unit normal: scores of order sqrt(D) before the scale)."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, sq, hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def check_lse(lse, ref_lse, name="lse"):
    """Same rows at -inf (rows that see no key); the finite ones close in fp32 (both from the same inputs)."""
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert not torch.isnan(lse).any(), f"{name}: NaN"
    ref = ref_lse.to(lse.device)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), f"{name}: rows at -inf differ"
    fin = torch.isfinite(ref)
    if fin.any():
        assert_rel_close(lse[fin], ref[fin], tol=1e-5, name=name)
