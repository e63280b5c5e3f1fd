"""Test helpers for quantized outputs, shared by every family's tests."""

from __future__ import annotations

import torch

from .reference import dequantize_ref

__all__ = ["assert_quant_close"]


def assert_quant_close(q, s, qr, sr, *, per_token: bool = True, scale_rtol: float = 1e-6) -> None:
    """Quantized tensor ``(q, s)`` against the reference ``(qr, sr)`` of the same scheme.

    Scales must agree to ``scale_rtol``. Elements may differ only on
    round-to-nearest near-ties (both sides round ``x * QMAX / amax`` once in
    fp32, but the product's last bit can differ, e.g. through the GPU's
    approximate division): by one step of the format at most, and on at most
    1% of the elements (2 in a tiny tensor).
    """
    assert q.shape == qr.shape and q.dtype == qr.dtype, (q.shape, qr.shape, q.dtype, qr.dtype)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, sr.float(), rtol=scale_rtol, atol=1e-12)
    dq, dqr = dequantize_ref(q, s, per_token), dequantize_ref(qr, sr, per_token)
    # One step of the format at the largest magnitude: 1 for int8, 32 (an ulp at 448) for e4m3.
    step = (s[..., None] if per_token else s).double() * (1.0 if q.dtype == torch.int8 else 32.0)
    assert ((dq - dqr).abs() <= step * 1.001 + 1e-12).all(), "quantized values differ by more than one step"
    differ = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
    assert differ <= max(2, q.numel() // 100), f"{differ} of {q.numel()} quantized values differ from the reference"
