"""``fused_moe``: a mixture-of-experts layer (gate/up projection, activation, down projection, weighted sum
over a token's experts) in two grouped GEMMs and a reduce, for bf16 / fp16.

In the order of the family's files: the kernels live in :mod:`._kernels.moe_gemm` (the grouped GEMM and
the reduce) and :mod:`._kernels.moe_routing` (the alignment), the config in :mod:`.moe_config`, the
routing in :mod:`.moe_routing`, the reference in :mod:`.moe_reference`; the host API below checks the
arguments (every bad input named before anything launches), aligns the routed rows by expert and launches:

1. stage 1: ``inter[t * k + j] = act(x[t] @ W1g[e]^T) * (x[t] @ W1u[e]^T)`` (e = ids[t, j]), one grouped
   GEMM with the activation and the product in its epilogue, in x's dtype;
2. stage 2: ``down[t * k + j] = w[t, j] * (inter[t * k + j] @ W2[e]^T)``, the grouped GEMM whose epilogue
   applies the router weight, in fp32;
3. ``out[t] = sum_j down[t * k + j]`` in fp32 in order of j (deterministic; no atomics).

Layouts are vLLM's, so models port without repacking: ``w1`` [E, 2I, H] with the gate rows first, ``w2``
[E, H, I]. Nothing synchronizes with the host (buffers are sized for the alignment's worst case), so a
call can be captured in a CUDA graph; the host path is allocations and flyc launches only (six kernels:
three of the alignment, two GEMMs, the reduce), so a plain eager call of a kind seen before is replayed
from the first one's recording (:mod:`flydsl.direct`).
"""

from __future__ import annotations

import torch

import flydsl.arch
from flydsl import direct
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl_common.device import activation_code

from ._kernels.moe_gemm import launch_moe_gemm, launch_moe_sum
from .moe_config import MoeConfig, default_moe_config, moe_config_valid
from .moe_routing import align, check_id_values, check_topk_ids

__all__ = ["fused_moe", "MOE_DTYPES", "MOE_ACTIVATIONS"]

MOE_DTYPES = (torch.bfloat16, torch.float16)
# the activations of act(gate) * up that models use: SiLU (Mixtral, Qwen, DeepSeek), GELU (erf; tanh form)
MOE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale, block_shape, out):
    """Every argument checked, naming it; returns (E, I, H, T, k)."""
    check_tensor("x", x, ndim=2)
    if x.dtype not in MOE_DTYPES:
        if x.dtype == torch.float8_e4m3fn:
            raise UnsupportedError(f"x: fp8 activations are not supported yet (bf16 / fp16 for now), got {describe(x)}")
        raise DTypeError(f"x: expected dtype bf16 or fp16, got {describe(x)}")
    for name, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("block_shape", block_shape)):
        if s is not None:
            raise UnsupportedError(f"{name}: quantized (fp8 / int8 / block-scaled) weights are not supported yet; "
                                   f"pass None with bf16 / fp16 weights, got {type(s).__name__}")  # fmt: skip
    t, h = x.shape
    check_tensor("w1", w1, ndim=3)
    check_tensor("w2", w2, ndim=3)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise DTypeError(f"{name}: expected dtype {dtype_name(x.dtype)} (x's), got {describe(w)}")
    e, two_i, h1 = w1.shape
    if e == 0 or two_i == 0 or two_i % 2 or h1 != h:
        raise ShapeError(f"w1: expected [E, 2 * I, {h}] (E >= 1 experts, gate rows then up rows, H = x's "
                         f"{h} columns), got {describe(w1)}")  # fmt: skip
    inter = two_i // 2
    if tuple(w2.shape) != (e, h, inter):
        raise ShapeError(f"w2: expected [{e}, {h}, {inter}] ([E, H, I] with w1's E and I), got {describe(w2)}")
    check_topk_ids(topk_ids)
    if topk_ids.shape[0] != t or topk_ids.shape[1] == 0:
        raise ShapeError(f"topk_ids: expected [{t}, k] (one row a token of x, k >= 1), got {describe(topk_ids)}")
    check_tensor("topk_weights", topk_weights, dtypes=_WEIGHT_DTYPES, ndim=2)
    if topk_weights.shape != topk_ids.shape:
        raise ShapeError(f"topk_weights: expected {list(topk_ids.shape)} (topk_ids' shape), got "
                         f"{describe(topk_weights)}")  # fmt: skip
    if str(activation).lower() not in MOE_ACTIVATIONS:
        raise ArgumentError(f"activation: expected one of {list(MOE_ACTIVATIONS)}, got {activation!r}")
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), ndim=2)
        if tuple(out.shape) != (t, h):
            raise ShapeError(f"out: expected [{t}, {h}] (x's shape), got {describe(out)}")
    check_same_device(x=x, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, out=out)
    check_id_values(topk_ids, e)  # on the CPU only, where reading them costs no device synchronization
    return e, inter, h, t, topk_ids.shape[1]


def fused_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None,
    apply_router_weight_on_input: bool = False,
    out: torch.Tensor | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """A mixture-of-experts layer: ``out[t] = sum_j w[t, j] * W2[e] @ (act(W1g[e] @ x[t]) * (W1u[e] @ x[t]))``
    with ``e = topk_ids[t, j]``, accumulated in fp32.

    Args:
        x: ``[T, H]`` bf16 / fp16, any strides.
        w1: ``[E, 2 * I, H]``, x's dtype: each expert's gate rows ``[0, I)`` then up rows ``[I, 2I)`` (vLLM's
            layout); any strides.
        w2: ``[E, H, I]``, x's dtype (the down projection); any strides.
        topk_weights: ``[T, k]`` fp32 / bf16 / fp16, the router weights (e.g. from :func:`topk_softmax`).
        topk_ids: ``[T, k]`` int32 / int64, the experts. An id outside ``[0, E)`` contributes nothing (-1:
            an expert of another rank, under expert parallelism); on the CPU, ids other than -1 outside
            ``[0, E)`` raise (there reading them costs no synchronization).
        activation: ``"silu"`` (default), ``"gelu"`` (erf form) or ``"gelu_tanh"``, applied to the gate.
        w1_scale, w2_scale, block_shape: quantized weights, not supported yet (must be None).
        apply_router_weight_on_input: the router weight scales the expert's input instead of its output
            (Llama-4 style): ``W2[e] @ (act(W1g[e] @ (w x)) * (W1u[e] @ (w x)))``.
        out: optional ``[T, H]`` output in x's dtype; may be ``x`` itself (x is read by stage 1 only).
        config: a :class:`~fly_gemm.moe_config.MoeConfig` for both grouped GEMMs (default: chosen for the shape).

    Returns:
        ``[T, H]`` in x's dtype (``out`` when given). T = 0 gives an empty result.

    Raises:
        flydsl.errors.ArgumentError / DTypeError / ShapeError / DeviceError / UnsupportedError naming the
        argument, before anything launches.

    Example::

        w, ids = topk_softmax(router_logits, 2)
        y = fused_moe(x, w1, w2, w, ids)   # Mixtral: x [T, 4096], w1 [8, 28672, 4096], w2 [8, 4096, 14336]
    """
    if (type(apply_router_weight_on_input) is bool and type(activation) is str and w1_scale is None
            and w2_scale is None and block_shape is None and (config is None or type(config) is MoeConfig)
            and all(type(a) in _PLAIN for a in (x, w1, w2, topk_weights, topk_ids))
            and (out is None or type(out) in _PLAIN)):  # fmt: skip
        # every argument hashable and of a type the key tells apart (a bool, not an int equal to it)
        return _REPLAYS.eager(_fused_moe, x, w1, w2, topk_weights, topk_ids, activation,
                              apply_router_weight_on_input, out, config)  # fmt: skip
    return _fused_moe(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config,
                      w1_scale, w2_scale, block_shape)  # fmt: skip


# Plain eager calls of a kind seen before (every operand's layout, the options, the stream) replay the first
# call's launches (flydsl.direct): no argument checks, config choice, alignment sizing or launch keying,
# which are most of a decode call's host time. Calls under CUDA graph capture, torch.compile or a dispatch
# mode, and calls on the CPU, take the general path below.
_REPLAYS = direct.Replays("fly_gemm.fused_moe")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _fused_moe(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config,
               w1_scale=None, w2_scale=None, block_shape=None):  # fmt: skip
    """The general path: checks, config, alignment and the launches (allocations and flyc launches only)."""
    e, inter, h, t, k = _check(x, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale, block_shape, out)
    if not isinstance(apply_router_weight_on_input, bool):
        raise ArgumentError(f"apply_router_weight_on_input: expected a bool, got {apply_router_weight_on_input!r}")
    if out is None:
        out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0 or h == 0 or x.device.type == "meta":
        return out
    arch = flydsl.arch.current(x.device)
    if config is None:
        config = default_moe_config(t, e, inter, h, k, x.dtype, arch)
    elif not isinstance(config, MoeConfig):
        raise ArgumentError(f"config: expected None or a fly_gemm.moe_config.MoeConfig, got {type(config).__name__}")
    if not moe_config_valid(config, x.dtype, arch):
        raise ArgumentError(f"config: {config} is not a valid launch config for {dtype_name(x.dtype)} on {arch.name}")
    numel = t * k
    sorted_ids, expert_ids, num_padded = align(topk_ids, e, config.block_m)
    act = activation_code(activation)
    inter_rows = torch.empty(numel, inter, dtype=x.dtype, device=x.device)
    launch_moe_gemm(x, w1, inter_rows, sorted_ids, expert_ids, num_padded, topk_weights, k, numel, gather_a=True,
                    gated=True, act=act, mul_weight=apply_router_weight_on_input, cfg=config)  # fmt: skip
    # fp32 rows for the reduce: one rounding fewer on the way out, for bytes small beside stage 2's flops
    # (2 * I flops an element written: 1536 for Qwen3-30B's I = 768)
    down = torch.empty(numel, h, dtype=torch.float32, device=x.device)
    launch_moe_gemm(inter_rows, w2, down, sorted_ids, expert_ids, num_padded, topk_weights, k, numel,
                    gather_a=False, gated=False, act=0, mul_weight=not apply_router_weight_on_input,
                    cfg=config)  # fmt: skip
    launch_moe_sum(down, topk_ids, out, e)
    return out
