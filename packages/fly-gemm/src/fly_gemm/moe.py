"""``fused_moe``: a mixture-of-experts layer (gate/up projection, activation, down projection, weighted sum
over a token's experts) in two grouped GEMMs and a reduce, for bf16 / fp16 activations with bf16 / fp16,
fp8 e4m3 (per output channel or block-scaled), int8 (per output channel), int4 (packed, group scales) or
MXFP4 (packed fp4 e2m1, e8m0 group scales) expert weights.

In the order of the family's files: the kernels live in :mod:`._kernels.moe_gemm` (the grouped GEMM and
the reduce) and :mod:`._kernels.moe_routing` (the alignment), the config in :mod:`.moe_config`, the
routing in :mod:`.moe_routing`, the reference in :mod:`.moe_reference`; the host API below checks the
arguments (every bad input named before anything launches), aligns the routed rows by expert and launches:

1. stage 1: ``inter[t * k + j] = act(x[t] @ W1g[e]^T) * (x[t] @ W1u[e]^T)`` (e = ids[t, j]), one grouped
   GEMM with the activation and the product in its epilogue, in x's dtype;
2. stage 2: ``down[t * k + j] = w[t, j] * (inter[t * k + j] @ W2[e]^T)``, the grouped GEMM whose epilogue
   applies the router weight, in fp32;
3. ``out[t] = sum_j down[t * k + j]`` in fp32 in order of j (deterministic; no atomics).

Quantized weights run as w8a8: each stage's input is quantized on the fly to the weights' dtype (a
kernel of its own: per token, or in 1 x block_k groups for block scales), the dot takes 8-bit operands
with fp32 (int32 for int8) accumulation, and the scales dequantize it: once after the K loop (per channel:
row scale x column scale) or each K step (block scales: the step lies in one scale block). Why w8a8 and
not weight-only dequantization to bf16 in the kernel: at prefill, where these formats are used for speed,
the fp8 / int8 dot runs at twice the bf16 tensor-core rate on Hopper and the tiles move half the bytes;
at decode both read the same 8-bit weights (the bytes that count), and the activations' quantization is
a small extra pass over T rows. The intermediate stays fp32 between the stages when quantized (stage 2
rounds it once, to 8 bits, instead of to bf16 first). 4-bit weights (uint8, two a byte: int4 with fp32
scales, or MXFP4's fp4 e2m1 with e8m0 scales) are weight-only: each tile is dequantized in the kernel (the
value x its group scale, rounded to x's dtype) before a 16-bit dot, so they save bytes (decode), not flops;
with ``compute_dtype=torch.float8_e4m3fn`` (w4a8) the activations are quantized as for fp8 block scales and
the 4-bit codes (exact in e4m3) go into an fp8 dot, for the fp8 rate at prefill.

Layouts are vLLM's, so models port without repacking: ``w1`` [E, 2I, H] with the gate rows first, ``w2``
[E, H, I]. Nothing synchronizes with the host (buffers are sized for the alignment's worst case), so a
call can be captured in a CUDA graph; the host path is allocations and flyc launches only (six kernels:
three of the alignment, two GEMMs, the reduce), so a plain eager call of a kind seen before is replayed
from the first one's recording (:mod:`flydsl.direct`).
"""

from __future__ import annotations

import dataclasses

import torch

import flydsl.arch
from flydsl import direct
from flydsl.autotune import SearchTask
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import tolerance
from flydsl_common.device import activation_code

from ._kernels.moe_gemm import (
    QUANT_BLOCK,
    QUANT_CHANNEL,
    QUANT_NONE,
    QUANT_W4,
    QUANT_W4A8,
    launch_moe_gemm,
    launch_moe_quant,
    launch_moe_sum,
)
from .moe_config import (
    DOT_MIN_K_8BIT,
    W4_MIN_BLOCK_K,
    MoeConfig,
    block_k_ok,
    fit_block_k,
    moe_config_for,
    moe_config_valid,
)
from .moe_reference import fused_moe_ref
from .moe_routing import align, check_id_values, check_topk_ids

__all__ = ["fused_moe", "MOE_DTYPES", "MOE_QUANT_DTYPES", "MOE_ACTIVATIONS"]

MOE_DTYPES = (torch.bfloat16, torch.float16)
# quantized expert weights: fp8 e4m3 (per output channel or block-scaled), int8 (per output channel) and
# int4 packed in uint8, two along K (group scales)
MOE_QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # MXFP4's power-of-two block scales
# the activations of act(gate) * up that models use: SiLU (Mixtral, Qwen, DeepSeek), GELU (erf; tanh form)
MOE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_quant(w1, w2, x, e, inter, h, w1_scale, w2_scale, block_shape, compute_dtype=None):
    """The weights' dtype against x's and the quantization arguments; returns (quant mode, (block n, block k))."""
    wdt = w1.dtype
    if compute_dtype is not None and compute_dtype != torch.float8_e4m3fn:
        raise DTypeError(f"compute_dtype: expected None or torch.float8_e4m3fn, got {compute_dtype!r}")
    if compute_dtype is not None and wdt != torch.uint8:
        raise ArgumentError(f"compute_dtype: fp8 activations go with 4-bit (uint8) weights; 8-bit weights "
                            f"quantize the activations to their own dtype, 16-bit ones take x's, got "
                            f"{describe(w1)}")  # fmt: skip
    if wdt == x.dtype:
        if w2.dtype != wdt:
            raise DTypeError(f"w2: expected dtype {dtype_name(wdt)} (w1's), got {describe(w2)}")
        for name, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("block_shape", block_shape)):
            if s is not None:
                raise ArgumentError(f"{name}: given with {dtype_name(wdt)} weights; scales and block_shape go "
                                    f"with fp8 e4m3 / int8 weights only, got {type(s).__name__}")  # fmt: skip
        return QUANT_NONE, (1, 1)
    if wdt not in MOE_QUANT_DTYPES:
        raise DTypeError(f"w1: expected dtype {dtype_name(x.dtype)} (x's), fp8 e4m3, int8 or uint8 (packed int4), "
                         f"got {describe(w1)}")  # fmt: skip
    if w2.dtype != wdt:
        raise DTypeError(f"w2: expected dtype {dtype_name(wdt)} (w1's), got {describe(w2)}")
    # uint8 weights: int4 with fp32 scales, or MXFP4 (fp4 e2m1) with e8m0 scales
    scale_dtypes = (torch.float32, _E8M0) if wdt == torch.uint8 and _E8M0 is not None else (torch.float32,)
    for name, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        if s is None:
            raise ArgumentError(f"{name}: required with {dtype_name(wdt)} weights (fp32 dequantization scales)")
        check_tensor(name, s, dtypes=scale_dtypes)
    if w2_scale.dtype != w1_scale.dtype:
        raise DTypeError(f"w2_scale: expected dtype {dtype_name(w1_scale.dtype)} (w1_scale's), got "
                         f"{describe(w2_scale)}")  # fmt: skip
    if block_shape is None and wdt == torch.uint8:
        raise ArgumentError("block_shape: required with uint8 (packed int4 / fp4) weights: [block_n, group] of "
                            "the scales")  # fmt: skip
    if block_shape is None:
        for name, s, rows in (("w1_scale", w1_scale, 2 * inter), ("w2_scale", w2_scale, h)):
            if tuple(s.shape) not in ((e, rows), (e, rows, 1)):
                raise ShapeError(f"{name}: expected [{e}, {rows}] or [{e}, {rows}, 1] (one scale an output "
                                 f"channel of each expert), got {describe(s)}")  # fmt: skip
        return QUANT_CHANNEL, (1, 1)
    bn, bk = _block_pair(block_shape)
    # the kernel's K step must lie in one scale block: a power-of-two block of at least the dot's 16
    if bn < 1 or bk < 16 or bk & (bk - 1):
        raise ArgumentError(f"block_shape: expected block_n >= 1 and block_k a power of two >= 16, got "
                            f"{list(block_shape)}")  # fmt: skip
    if wdt == torch.int8:
        raise UnsupportedError(f"block_shape: block-scaled weights are fp8 e4m3 or packed int4 (int8 is "
                               f"per-channel), got {describe(w1)}")  # fmt: skip
    if wdt != torch.uint8 and bk < DOT_MIN_K_8BIT:
        raise UnsupportedError(f"block_shape: fp8 block-scaled weights need block_k >= {DOT_MIN_K_8BIT} (a K step "
                               f"lies in one scale block, and an 8-bit tensor-core dot's K is at least "
                               f"{DOT_MIN_K_8BIT}), got {list(block_shape)}")  # fmt: skip
    for name, s, n, k in (("w1_scale", w1_scale, 2 * inter, h), ("w2_scale", w2_scale, h, inter)):
        want = (e, _cdiv(n, bn), _cdiv(k, bk))
        if tuple(s.shape) != want:
            raise ShapeError(f"{name}: expected {list(want)} (one scale a {bn} x {bk} block of each expert's "
                             f"[{n}, {k}] weight), got {describe(s)}")  # fmt: skip
    if wdt != torch.uint8:
        return QUANT_BLOCK, (bn, bk)
    if compute_dtype is None:
        return QUANT_W4, (bn, bk)
    if bk < DOT_MIN_K_8BIT:
        raise UnsupportedError(f"block_shape: 4-bit weights with fp8 activations need groups of at least "
                               f"{DOT_MIN_K_8BIT} columns (a K step lies in one group, and an 8-bit dot's K is at "
                               f"least {DOT_MIN_K_8BIT}), got {list(block_shape)}")  # fmt: skip
    return QUANT_W4A8, (bn, bk)


def _block_pair(block_shape) -> tuple[int, int]:
    """``block_shape`` as (block_n, block_k): a list or tuple of two ints (values checked by the caller)."""
    if (not isinstance(block_shape, (list, tuple)) or len(block_shape) != 2
            or any(type(b) is not int for b in block_shape)):  # fmt: skip
        raise ArgumentError(f"block_shape: expected [block_n, block_k] (two ints, e.g. [128, 128]), got "
                            f"{block_shape!r}")  # fmt: skip
    return block_shape[0], block_shape[1]


def _check(x, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale, block_shape, out, id_values=True,
           compute_dtype=None):  # fmt: skip
    """Every argument checked, naming it; returns (E, I, H, T, k, quant mode, scale block). Shapes, dtypes
    and devices only, except topk_ids' values on the CPU (``id_values=False``: not them either, for the op's
    fake implementation, whose tensors have no values to read)."""
    check_tensor("x", x, ndim=2)
    if x.dtype not in MOE_DTYPES:
        if x.dtype == torch.float8_e4m3fn:
            raise UnsupportedError(f"x: fp8 activations are not supported yet (bf16 / fp16 for now; fp8 "
                                   f"weights quantize them on the fly), got {describe(x)}")  # fmt: skip
        raise DTypeError(f"x: expected dtype bf16 or fp16, got {describe(x)}")
    t, h = x.shape
    check_tensor("w1", w1, ndim=3)
    check_tensor("w2", w2, ndim=3)
    e, two_i, h1 = w1.shape
    if w1.dtype == torch.uint8:  # int4 pairs along K: the stored K is half the logical one
        if e == 0 or two_i == 0 or two_i % 2 or h % 2 or 2 * h1 != h:
            raise ShapeError(f"w1: expected [E, 2 * I, {h // 2}] (uint8: packed int4 pairs of x's {h} columns, "
                             f"H even), got {describe(w1)}")  # fmt: skip
        inter = two_i // 2
        if inter % 2 or tuple(w2.shape) != (e, h, inter // 2):
            raise ShapeError(f"w2: expected [{e}, {h}, {inter // 2}] ([E, H, I / 2] packed int4 pairs, I even), "
                             f"got {describe(w2)}")  # fmt: skip
    else:
        if e == 0 or two_i == 0 or two_i % 2 or h1 != h:
            raise ShapeError(f"w1: expected [E, 2 * I, {h}] (E >= 1 experts, gate rows then up rows, H = x's "
                             f"{h} columns), got {describe(w1)}")  # fmt: skip
        inter = two_i // 2
        if tuple(w2.shape) != (e, h, inter):
            raise ShapeError(f"w2: expected [{e}, {h}, {inter}] ([E, H, I] with w1's E and I), got {describe(w2)}")
    quant, scale_block = _check_quant(w1, w2, x, e, inter, h, w1_scale, w2_scale, block_shape, compute_dtype)
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
    check_same_device(x=x, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, out=out,
                      w1_scale=w1_scale, w2_scale=w2_scale)  # fmt: skip
    if id_values:
        check_id_values(topk_ids, e)  # on the CPU only, where reading them costs no device synchronization
    return e, inter, h, t, topk_ids.shape[1], quant, scale_block


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
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A mixture-of-experts layer: ``out[t] = sum_j w[t, j] * W2[e] @ (act(W1g[e] @ x[t]) * (W1u[e] @ x[t]))``
    with ``e = topk_ids[t, j]``, accumulated in fp32.

    Args:
        x: ``[T, H]`` bf16 / fp16, any strides.
        w1: ``[E, 2 * I, H]``, x's dtype, fp8 e4m3 or int8: each expert's gate rows ``[0, I)`` then up
            rows ``[I, 2I)`` (vLLM's layout); any strides. uint8: 4-bit pairs ``[E, 2 * I, H / 2]``, element
            2j in the low nibble (H and I even): two's-complement int4 with fp32 scales, or fp4 e2m1 with
            ``torch.float8_e8m0fnu`` scales (MXFP4, as gpt-oss ships it).
        w2: ``[E, H, I]`` (uint8: ``[E, H, I / 2]``), w1's dtype (the down projection); any strides.
        topk_weights: ``[T, k]`` fp32 / bf16 / fp16, the router weights (e.g. from :func:`topk_softmax`).
        topk_ids: ``[T, k]`` int32 / int64, the experts. An id outside ``[0, E)`` contributes nothing (-1:
            an expert of another rank, under expert parallelism); on the CPU, ids other than -1 outside
            ``[0, E)`` raise (there reading them costs no synchronization).
        activation: ``"silu"`` (default), ``"gelu"`` (erf form) or ``"gelu_tanh"``, applied to the gate.
        w1_scale, w2_scale: fp32 dequantization scales of quantized ``w1`` / ``w2`` (both fp8 e4m3, int8 or
            uint8; None for 16-bit weights), any strides: per output channel ``[E, 2I]`` (or ``[E, 2I, 1]``) /
            ``[E, H]`` (or ``[E, H, 1]``), or with ``block_shape`` one a weight block,
            ``[E, cdiv(2I, bn), cdiv(H, bk)]`` / ``[E, cdiv(H, bn), cdiv(I, bk)]``. ``W = q * scale``. The
            activations (x, then the intermediate) are quantized to the weights' dtype on the fly,
            symmetric: ``scale = amax / 448`` (fp8) or ``/ 127`` (int8) per token, or per 1 x bk group with
            ``block_shape``. MXFP4: e8m0 scales (an exponent byte 0 reads as 0, not 2**-127).
        block_shape: ``[bn, bk]`` block scales (fp8 e4m3, DeepSeek-V3's ``[128, 128]``; required for 4-bit
            weights, ``[1, group]``: ``[1, 32]`` for MXFP4): bk a power of two, >= 32 for fp8 (the K step
            divides it, and an 8-bit dot's K is at least 32), >= 16 for 4-bit weights (K steps of at least
            32: a smaller group reads a scale an element), any bn >= 1; shapes need not be multiples of the
            blocks. With 4-bit weights the activations are not quantized.
        apply_router_weight_on_input: the router weight scales the expert's input instead of its output
            (Llama-4 style): ``W2[e] @ (act(W1g[e] @ (w x)) * (W1u[e] @ (w x)))``.
        out: optional ``[T, H]`` output in x's dtype; may be ``x`` itself (x is read by stage 1 only).
        config: a :class:`~fly_gemm.moe_config.MoeConfig` for both grouped GEMMs (default: chosen for the shape).
        compute_dtype: the dot's operands with 4-bit weights: None (x's dtype: the weights dequantized,
            weight-only) or ``torch.float8_e4m3fn`` (w4a8: the activations quantized on the fly in 1 x group
            groups, as for fp8 block scales; the 4-bit codes, exact in e4m3, go into an fp8 dot, both group
            scales applied each K step; groups of at least 32). Other weights take None.

    Returns:
        ``[T, H]`` in x's dtype (``out`` when given). T = 0 gives an empty result.

    Raises:
        flydsl.errors.ArgumentError / DTypeError / ShapeError / DeviceError / UnsupportedError naming the
        argument, before anything launches.

    Example::

        w, ids = topk_softmax(router_logits, 2)
        y = fused_moe(x, w1, w2, w, ids)   # Mixtral: x [T, 4096], w1 [8, 28672, 4096], w2 [8, 4096, 14336]
        # DeepSeek-V3's fp8 experts: w1 [256, 4096, 7168] e4m3, w1_scale [256, 32, 56] fp32, ...
        y = fused_moe(x, w1, w2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[128, 128])

    Quantized calls take the general path (checks, config, launches) each time; 16-bit calls replay.

    Under ``torch.compile`` (``fullgraph=True`` included) the call is traced as the custom op
    ``torch.ops.fly_gemm.fused_moe`` (a fake implementation gives the result's shape and checks what shapes
    and dtypes tell); ``out`` is then filled by a copy of the op's result, and ``config`` is refused (the op
    takes the tuned config). No gradient: as in eager calls, the result does not require grad.
    """
    if (type(apply_router_weight_on_input) is bool and type(activation) is str and w1_scale is None
            and w2_scale is None and block_shape is None and compute_dtype is None
            and (config is None or type(config) is MoeConfig)
            and all(type(a) in _PLAIN for a in (x, w1, w2, topk_weights, topk_ids))
            and (out is None or type(out) in _PLAIN)):  # fmt: skip
        # every argument hashable and of a type the key tells apart (a bool, not an int equal to it)
        # (under torch.compile Replays.eager takes the general path, _general, which routes to the op: no
        # check of tracing of its own on the replayed route)
        return _REPLAYS.eager(_general, x, w1, w2, topk_weights, topk_ids, activation,
                              apply_router_weight_on_input, out, config)  # fmt: skip
    return _general(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config,
                    w1_scale, w2_scale, block_shape, compute_dtype)  # fmt: skip


# Plain eager calls of a kind seen before (every operand's layout, the options, the stream) replay the first
# call's launches (flydsl.direct): no argument checks, config choice, alignment sizing or launch keying,
# which are most of a decode call's host time. Calls under CUDA graph capture, torch.compile or a dispatch
# mode, and calls on the CPU, take the general path below.
_REPLAYS = direct.Replays("fly_gemm.fused_moe")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _general(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config,
             w1_scale=None, w2_scale=None, block_shape=None, compute_dtype=None):  # fmt: skip
    """Every call that is not replayed: traced ones through the custom op, eager ones the general path."""
    if _compiling():
        return _traced(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config,
                       w1_scale, w2_scale, block_shape, compute_dtype)  # fmt: skip
    return _fused_moe(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config,
                      w1_scale, w2_scale, block_shape, compute_dtype)  # fmt: skip


_compiling = torch.compiler.is_compiling


def _fused_moe(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config,
               w1_scale=None, w2_scale=None, block_shape=None, compute_dtype=None):  # fmt: skip
    """The general path: checks, config, alignment and the launches (allocations and flyc launches only)."""
    e, inter, h, t, k, quant, scale_block = _check(x, w1, w2, topk_weights, topk_ids, activation, w1_scale,
                                                   w2_scale, block_shape, out, compute_dtype=compute_dtype)  # fmt: skip
    if not isinstance(apply_router_weight_on_input, bool):
        raise ArgumentError(f"apply_router_weight_on_input: expected a bool, got {apply_router_weight_on_input!r}")
    if out is None:
        out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0 or h == 0 or x.device.type == "meta":
        return out
    arch = flydsl.arch.current(x.device)
    fp4 = w1_scale is not None and w1_scale.dtype == _E8M0
    # the dot's operands: x's dtype, or the 8-bit weights' (the activations quantized to it); 4-bit weights
    # are dequantized to x's dtype, or (w4a8) their codes taken as fp8
    in_dtype = x.dtype if quant == QUANT_W4 else torch.float8_e4m3fn if quant == QUANT_W4A8 else w1.dtype
    kind = _K_KIND.get(quant, "block")  # moe_config.fit_block_k's name of the mode
    if config is None:
        s1_in, s2_in = w1_scale, w2_scale

        def task():  # the search task of this call (FLYDSL_AUTOTUNE=1): its own operands, the fp32 reference
            def run(cfg):  # a fresh output: ``out`` may be x itself
                return _fused_moe(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
                                  None, cfg, s1_in, s2_in, block_shape, compute_dtype)  # fmt: skip

            def reference():
                return fused_moe_ref(x, w1, w2, topk_weights, topk_ids, activation=activation,
                                     apply_router_weight_on_input=apply_router_weight_on_input, w1_scale=s1_in,
                                     w2_scale=s2_in, block_shape=block_shape, compute_dtype=compute_dtype)  # fmt: skip

            return SearchTask(run=run, reference=reference, rtol=tolerance(x.dtype))

        config = moe_config_for(t, e, inter, h, k, in_dtype, _quant_mode(quant, scale_block, fp4), x.device,
                                task=task)  # fmt: skip
        if quant in _SCALE_BLOCKED:  # the shipped configs fit it
            config = dataclasses.replace(config, block_k=fit_block_k(config.block_k, scale_block[1], kind))
    elif not isinstance(config, MoeConfig):
        raise ArgumentError(f"config: expected None or a fly_gemm.moe_config.MoeConfig, got {type(config).__name__}")
    if not moe_config_valid(config, in_dtype, arch):
        raise ArgumentError(f"config: {config} is not a valid launch config for {dtype_name(in_dtype)} on {arch.name}")
    if quant in _SCALE_BLOCKED and not block_k_ok(config.block_k, scale_block[1], kind):
        if kind == "w4":
            raise ArgumentError(f"config: block_k {config.block_k} is below {W4_MIN_BLOCK_K}, the smallest K step "
                                f"for 4-bit weights")  # fmt: skip
        raise ArgumentError(f"config: block_k {config.block_k} must divide block_shape's block_k "
                            f"{scale_block[1]} (each K step lies in one scale block)")  # fmt: skip
    if fp4:  # the kernel reads the e8m0 exponents as bytes
        w1_scale, w2_scale = w1_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    numel = t * k
    sorted_ids, expert_ids, num_padded = align(topk_ids, e, config.block_m)
    act = activation_code(activation)
    # quantized: the intermediate stays fp32 until stage 2 quantizes it (one rounding, not bf16 then fp8)
    inter_rows = torch.empty(numel, inter, dtype=x.dtype if quant in (QUANT_NONE, QUANT_W4) else torch.float32,
                             device=x.device)  # fmt: skip
    a1, s1 = x, None
    if quant in (QUANT_CHANNEL, QUANT_BLOCK, QUANT_W4A8):
        a1, s1 = _quantize(x, in_dtype, h if quant == QUANT_CHANNEL else scale_block[1])
    launch_moe_gemm(a1, w1, inter_rows, sorted_ids, expert_ids, num_padded, topk_weights, k, numel, gather_a=True,
                    gated=True, act=act, mul_weight=apply_router_weight_on_input, cfg=config, a_scale=s1,
                    w_scale=w1_scale, quant=quant, scale_block=scale_block, fp4=fp4)  # fmt: skip
    # fp32 rows for the reduce: one rounding fewer on the way out, for bytes small beside stage 2's flops
    # (2 * I flops an element written: 1536 for Qwen3-30B's I = 768)
    down = torch.empty(numel, h, dtype=torch.float32, device=x.device)
    a2, s2 = inter_rows, None
    if quant in (QUANT_CHANNEL, QUANT_BLOCK, QUANT_W4A8):
        # rows of slots outside [0, E) are never written nor read by stage 2: their quantization is unused
        a2, s2 = _quantize(inter_rows, in_dtype, inter if quant == QUANT_CHANNEL else scale_block[1])
    launch_moe_gemm(a2, w2, down, sorted_ids, expert_ids, num_padded, topk_weights, k, numel,
                    gather_a=False, gated=False, act=0, mul_weight=not apply_router_weight_on_input,
                    cfg=config, a_scale=s2, w_scale=w2_scale, quant=quant, scale_block=scale_block,
                    fp4=fp4)  # fmt: skip
    launch_moe_sum(down, topk_ids, out, e)
    return out


# the quant modes whose K step a scale group bounds, and their moe_config.fit_block_k kind
_SCALE_BLOCKED = (QUANT_BLOCK, QUANT_W4, QUANT_W4A8)
_K_KIND = {QUANT_W4: "w4", QUANT_W4A8: "w4a8"}


def _quant_mode(quant: int, scale_block: tuple[int, int], fp4: bool) -> str:
    """The tuning key's name of a call's quantization (:func:`~fly_gemm.moe_config.moe_tuning_key`)."""
    if quant == QUANT_NONE:
        return "none"
    if quant == QUANT_CHANNEL:
        return "channel"
    bn, bk = scale_block
    if quant == QUANT_BLOCK:
        return f"block{bn}x{bk}"
    a8 = "a8" if quant == QUANT_W4A8 else ""
    if fp4:
        return f"mxfp4{a8}" if bk == 32 else f"mxfp4{a8}g{bk}"  # the MX format's block of 32 goes unnamed
    return f"w4{a8}g{bk}"


def _quantize(a, qdtype, group):
    """Dynamic activation quantization (allocations and one flyc launch): ``a`` [M, K] -> q [M, K] in
    ``qdtype`` and fp32 scales [M, cdiv(K, group)], one a row's ``group`` columns."""
    m, kk = a.shape
    q = torch.empty(m, kk, dtype=qdtype, device=a.device)
    scale = torch.empty(m, _cdiv(kk, group), dtype=torch.float32, device=a.device)
    launch_moe_quant(a, q, scale, group)
    return q, scale


# ------------------------------------------------------------------ custom op (torch.compile)


def _traced(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, out, config, w1_scale,
            w2_scale, block_shape, compute_dtype=None):  # fmt: skip
    """A call under torch.compile: the op on the arguments its schema takes (checked here first where the
    schema would refuse them without naming the argument), ``out`` filled by a copy of its result."""
    if config is not None:
        raise ArgumentError("config: not taken under torch.compile (the op serves its tuned config)")
    for name, a in (("x", x), ("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(a, torch.Tensor):
            raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(a).__name__}")
    for name, a in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("out", out)):
        if a is not None and not isinstance(a, torch.Tensor):
            raise ArgumentError(f"{name}: expected None or a torch.Tensor, got {type(a).__name__}")
    if not isinstance(activation, str):
        raise ArgumentError(f"activation: expected one of {list(MOE_ACTIVATIONS)}, got {activation!r}")
    if not isinstance(apply_router_weight_on_input, bool):
        raise ArgumentError(f"apply_router_weight_on_input: expected a bool, got {apply_router_weight_on_input!r}")
    if block_shape is not None:
        block_shape = list(_block_pair(block_shape))
    if compute_dtype is not None and not isinstance(compute_dtype, torch.dtype):
        raise DTypeError(f"compute_dtype: expected None or torch.float8_e4m3fn, got {compute_dtype!r}")
    # No gradient, as an eager call's result (written by the kernels) has none: the op has no backward, and
    # without this a traced call on inputs that require grad would return a result that claims one.
    with torch.no_grad():
        y = torch.ops.fly_gemm.fused_moe(x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, activation,
                                         apply_router_weight_on_input, block_shape, compute_dtype)  # fmt: skip
    if out is None:
        return y
    check_tensor("out", out, dtypes=(x.dtype,), ndim=2)
    if tuple(out.shape) != tuple(y.shape):
        raise ShapeError(f"out: expected {list(y.shape)} (x's shape), got {describe(out)}")
    return out.copy_(y)


# Through torch.library.Library, as fly_gemm::gemm (see gemm.py: custom_op's kernel imports torch._dynamo on
# its first eager call); a fragment, since gemm.py defines the namespace. No ``out`` (the op returns a new
# tensor; traced code copies into one) and no config (not a schema type).
_LIB = torch.library.Library("fly_gemm", "FRAGMENT")
_LIB.define(
    "fused_moe(Tensor x, Tensor w1, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor? w1_scale, "
    "Tensor? w2_scale, str activation, bool apply_router_weight_on_input, int[]? block_shape, "
    "ScalarType? compute_dtype=None) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _fused_moe_op(x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, activation, apply_router_weight_on_input,
                  block_shape, compute_dtype=None):  # fmt: skip
    return _fused_moe(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, None, None,
                      w1_scale, w2_scale, block_shape, compute_dtype)  # fmt: skip


_LIB.impl("fused_moe", _fused_moe_op, "CompositeExplicitAutograd")


@torch.library.register_fake("fly_gemm::fused_moe", lib=_LIB)
def _(x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, activation, apply_router_weight_on_input,
      block_shape, compute_dtype=None):  # fmt: skip
    # shapes, dtypes and devices as the real call checks them; topk_ids' values are not there to read
    _check(x, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale, block_shape, None, id_values=False,
           compute_dtype=compute_dtype)  # fmt: skip
    return x.new_empty(x.shape)
