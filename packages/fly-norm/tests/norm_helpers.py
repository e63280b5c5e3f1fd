"""Helpers shared by the norm test modules (a plain module: pytest collects nothing here)."""

from __future__ import annotations

import torch

from flydsl.testing import assert_rel_close
from flydsl_common.rows import RowConfig
from flydsl_common.testing import assert_quant_close

__all__ = [
    "DTYPES",
    "QDTYPES",
    "SHAPES",
    "CHUNKED",
    "randn",
    "force_config",
    "reference_grads",
    "assert_grads_close",
    "assert_quant_matches",
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QDTYPES = [torch.int8, torch.float8_e4m3fn]

# (leading shape, N): N = 1 (the degenerate row), odd and non-multiple-of-8
# widths, one below / one above a power of two, a 3-D input, a lone row.
SHAPES = [((1,), 1), ((3,), 7), ((2, 1), 33), ((3,), 255), ((1,), 257), ((2,), 1000)]

# Forces the chunked (two-pass) path on a small row: 257 = 4 chunks of 64 + 1.
CHUNKED = RowConfig(block_m=1, block_n=64, num_warps=2, single_pass=False)


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def force_config(monkeypatch, module, cfg):
    """Make every launch of ``module`` (forward, backward and the quantized forward) use ``cfg``."""
    monkeypatch.setattr(module, "_fwd_config", lambda *a, **k: cfg)
    monkeypatch.setattr(module, "_bwd_config", lambda *a, **k: cfg)
    monkeypatch.setattr(module, "_quant_config", lambda *a, **k: cfg)


def reference_grads(ref_fn, tensors, upstream):
    """Gradients of sum(out_i * upstream_i) through the fp64 reference, for each tensor (None stays None)."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    outs = ref_fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(((o * u.to(o.device).double()).sum() for o, u in zip(outs, upstream, strict=True))).backward()
    return [None if t is None else t.grad for t in leaves]


def assert_grads_close(tensors, expected, names):
    for t, ref, name in zip(tensors, expected, names, strict=True):
        if t is not None:
            assert_rel_close(t.grad, ref, tol=1e-5, name=f"d{name}")


def assert_quant_matches(q, s, qr, sr, x=None):
    """``x``: the quantized values before rounding (fp64), so that every differing code must sit at a rounding
    tie (else at most 1% may differ: bf16 rows put several percent of their elements on a tie)."""
    assert_quant_close(q, s, qr, sr, per_token=True, scale_rtol=1e-4, x=x)
