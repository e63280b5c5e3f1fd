"""fp64 references of fly-gemm's ops, imported by tests and benchmarks alike."""

from __future__ import annotations

import torch

from flydsl_common.reference import activation_ref

__all__ = ["gemm_ref"]


def gemm_ref(a, b, *, bias=None, activation=None, scale_a=None, scale_b=None, b_layout="nk") -> torch.Tensor:
    """``act((a @ B^T) * scale_a[m] * scale_b[n] + bias)`` in float64 (B = b, or b^T for ``b_layout="kn"``).

    Scales: one value (a number or a one-element tensor), or one a row of A (``[M]``) / a column of C
    (``[N]``); None is 1.
    """
    b_nk = b if b_layout == "nk" else b.t()
    c = a.double() @ b_nk.double().t()
    if scale_a is not None:
        sa = torch.as_tensor(scale_a, dtype=torch.float64, device=c.device).reshape(-1)
        c = c * (sa if sa.numel() == 1 else sa[:, None])
    if scale_b is not None:
        c = c * torch.as_tensor(scale_b, dtype=torch.float64, device=c.device).reshape(-1)[None, :]
    if bias is not None:
        c = c + bias.double()[None, :]
    return activation_ref(c, activation)
