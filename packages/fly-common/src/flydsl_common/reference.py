"""fp32/fp64 torch references for the kernels in flydsl-common.

Tests and benchmarks import these; family packages keep their own references
beside their kernels and may build on the ones here.
"""

from __future__ import annotations

import torch

from .device import FP8_E4M3_MAX, INT8_MAX

__all__ = [
    "vec_add_ref", "torch_activation", "activation_ref", "quantize_per_token_ref", "quantize_per_tensor_ref",
    "dequantize_ref", "inverse_scale_ref",
]  # fmt: skip


def vec_add_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() + b.double()


_TORCH_ACTIVATIONS = {
    None: lambda x: x,
    "none": lambda x: x,
    "relu": torch.relu,
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,  # the exact (erf) form
    "gelu_erf": torch.nn.functional.gelu,
}


def torch_activation(x: torch.Tensor, name: str | None) -> torch.Tensor:
    """Activation ``name`` (as in flydsl_common.device.ACTIVATIONS, any case) in torch, in x's dtype and
    differentiable: the form kernels' backward passes and torch fallbacks use."""
    try:
        fn = _TORCH_ACTIVATIONS[name if name is None else str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}") from None
    return fn(x)


def activation_ref(x: torch.Tensor, name: str | None) -> torch.Tensor:
    """Activation in float64 (names as in flydsl_common.device.ACTIVATIONS)."""
    return torch_activation(x.double(), name)


def _qmax(dtype: torch.dtype) -> float:
    return INT8_MAX if dtype == torch.int8 else FP8_E4M3_MAX


def _quantize(x32: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    qmax = _qmax(dtype)
    v = (x32 * inv).clamp(-qmax, qmax)
    if dtype == torch.int8:
        return torch.round(v).to(torch.int8)  # torch.round: half to even, like the kernel
    return v.to(dtype)


def quantize_per_token_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in fp32: scale = amax/QMAX, q = sat(round(x * (QMAX/amax))); the inverse is 0
    for amax = 0 and where it overflows (amax below ~1e-36: codes 0, as flydsl_common.device.inverse_scale)."""
    qmax = _qmax(dtype)
    x32 = x.float()
    amax = x32.abs().amax(dim=-1) if x.shape[-1] else torch.zeros(x.shape[:-1], device=x.device)
    return _quantize(x32, inverse_scale_ref(amax, qmax)[..., None], dtype), amax / qmax


def inverse_scale_ref(d: torch.Tensor, num: float) -> torch.Tensor:
    """The kernels' inverse scale ``num / d`` in d's dtype, correctly rounded (a tensor divided by a tensor:
    torch's ``number / tensor`` multiplies by a rounded reciprocal), where d > 0 and the quotient is finite;
    0 elsewhere (d = 0, NaN, or so small that the quotient overflows: codes 0, as
    flydsl_common.device.inverse_scale)."""
    inv = torch.full_like(d, num) / torch.where(d > 0, d, torch.ones_like(d))
    return torch.where((d > 0) & torch.isfinite(inv), inv, torch.zeros_like(inv))


def quantize_per_tensor_ref(x: torch.Tensor, dtype: torch.dtype, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = _qmax(dtype)
    x32 = x.float()
    if scale is None:
        amax = x32.abs().amax() if x.numel() else torch.zeros((), device=x.device)
        scale = amax / qmax
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    return _quantize(x32, inverse_scale_ref(scale, 1.0), dtype), scale


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, per_token: bool) -> torch.Tensor:
    s = scale.double()
    return q.double() * (s[..., None] if per_token else s)
