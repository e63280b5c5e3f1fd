"""Shared pieces of fly-conv's tests: seeded inputs and weights, the gradients' tolerances."""

from __future__ import annotations

import torch

# Gradients through 16-bit kernels: dy and the products are rounded to the input dtype (fp16: 2^-11 a value),
# so a gradient is held to a few roundings of its terms; fp32 to the fp32 budget.
GRAD_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def rand(*shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def weight(k_out, cg, kernel, *, dtype, device, seed=1):
    """A weight scaled by 1 / sqrt(fan-in): outputs of unit scale, as a trained layer's."""
    fan_in = cg
    for k in kernel:
        fan_in *= k
    return rand(k_out, cg, *kernel, dtype=dtype, device=device, seed=seed, scale=max(fan_in, 1) ** -0.5)
