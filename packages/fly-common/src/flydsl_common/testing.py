"""Test helpers for quantized outputs, shared by every family's tests."""

from __future__ import annotations

import torch

from .reference import dequantize_ref

__all__ = ["assert_quant_close"]


def assert_quant_close(q, s, qr, sr, *, per_token: bool = True, scale_rtol: float = 1e-6, x=None) -> None:
    """Quantized tensor ``(q, s)`` against the reference ``(qr, sr)`` of the same scheme.

    Scales must agree to ``scale_rtol``. Elements may differ only on
    round-to-nearest near-ties (both sides round ``x * QMAX / amax`` once in
    fp32, but the product's last bit can differ, e.g. through the GPU's
    approximate division or another evaluation order), by one step of the
    format at most. With the quantized input ``x`` each differing element
    must be such a tie: ``x / scale`` in fp64 lies within 1e-5 (relative) of the
    midpoint between the two codes. Without ``x``, at most 1% of the elements
    (2 in a tiny tensor) may differ. (16-bit inputs whose row maximum is
    itself a 16-bit value hit exact ties often: bf16 rows quantized to e4m3
    can have several percent of their elements on a tie.)
    """
    assert q.shape == qr.shape and q.dtype == qr.dtype, (q.shape, qr.shape, q.dtype, qr.dtype)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, sr.float(), rtol=scale_rtol, atol=1e-12)
    dq, dqr = dequantize_ref(q, s, per_token), dequantize_ref(qr, sr, per_token)
    # One step of the format at the largest magnitude: 1 for int8, 32 (an ulp at 448) for e4m3.
    step = (s[..., None] if per_token else s).double() * (1.0 if q.dtype == torch.int8 else 32.0)
    assert ((dq - dqr).abs() <= step * 1.001 + 1e-12).all(), "quantized values differ by more than one step"
    differ = q.view(torch.uint8) != qr.view(torch.uint8)
    if x is None:
        count = differ.sum().item()
        assert count <= max(2, q.numel() // 100), f"{count} of {q.numel()} quantized values differ from the reference"
        return
    scale = (sr[..., None] if per_token else sr).double()
    exact = torch.where(scale > 0, x.double() / torch.where(scale > 0, scale, 1.0), 0.0)  # x in units of a step
    mid = (q.float().double() + qr.float().double()) / 2  # the tie between the two codes, in steps
    off_tie = differ & ((exact - mid).abs() > 1e-5 * exact.abs() + 1e-12)
    assert not off_tie.any(), f"{off_tie.sum().item()} quantized values differ from the reference away from a tie"
