"""fp64 references of fly-gemm's ops, imported by tests and benchmarks alike."""

from __future__ import annotations

import torch

from flydsl_common.reference import activation_ref

__all__ = ["gemm_ref", "grouped_gemm_ref"]


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


def grouped_gemm_ref(a, b, offsets) -> torch.Tensor:
    """The grouped GEMM in float32, a loop over groups: row block g is ``a[start_g:end_g] @ b[g]^T`` with
    ``end_g = offsets[g]`` (``b`` ``[G, N, K]``); rows past the last offset are zeros. Offsets are read as
    :func:`fly_gemm.grouped_gemm`'s kernels read them (running maxima clamped to ``[0, M]``). Differentiable:
    fp32 leaves ``a`` and ``b`` get the reference gradients."""
    m = a.shape[0]
    ends = offsets.detach().to("cpu", torch.int64).clamp(0, m)
    ends = ends.cummax(0).values.tolist() if ends.numel() else []
    a32, b32 = a.float(), b.float()
    parts, start = [], 0
    for g, end in enumerate(ends):
        parts.append(a32[start:end] @ b32[g].t())
        start = end
    parts.append(a32.new_zeros(m - start, b.shape[1]))
    return torch.cat(parts)
