"""Plain torch references of fly-gemm's mixture-of-experts ops, imported by tests and benchmarks alike.

Selection rules shared with the kernels: experts are ranked by score, equal scores by the lower expert id
(a stable sort), so ties give one answer on every device. Expert ids outside ``[0, E)`` (expert
parallelism's -1: an expert of another rank) contribute nothing.
"""

from __future__ import annotations

import torch

from flydsl_common.reference import inverse_scale_ref, torch_activation

__all__ = [
    "topk_softmax_ref",
    "grouped_topk_ref",
    "moe_align_ref",
    "fused_moe_ref",
    "quantize_groups_ref",
    "dequantize_weight_ref",
    "unpack_int4_ref",
    "unpack_fp4_ref",
]


def _topk_stable(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k largest scores a row, ties to the lower id."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def topk_softmax_ref(router_logits: torch.Tensor, k: int, renormalize: bool = True):
    """(weights fp32 [T, k], ids int32 [T, k]): the softmax over all experts, its k largest (selected on the
    logits, which rank as the probabilities do), renormalized to sum to 1 a token when asked."""
    logits = router_logits.double()
    ids = _topk_stable(logits, k)
    w = torch.softmax(logits, dim=-1).gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.float(), ids.to(torch.int32)


def grouped_topk_ref(
    router_logits: torch.Tensor,
    k: int,
    num_expert_group: int,
    topk_group: int,
    *,
    correction_bias: torch.Tensor | None = None,
    scoring: str = "sigmoid",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
):
    """DeepSeek-V3's routing, in float64: scores ``sigmoid(logits)`` (or the softmax); choice scores = scores
    + ``correction_bias``; a group's score is the sum of its two largest choice scores (with a bias) or its
    largest (without, DeepSeek-V2); the ``topk_group`` best groups are kept and the k best experts of those
    chosen by choice score; the weights are the plain scores of the chosen experts, renormalized when asked,
    times ``routed_scaling_factor``. Returns (weights fp32 [T, k], ids int32 [T, k])."""
    logits = router_logits.double()
    t, e = logits.shape
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.double()[None, :]
    grouped = choice.view(t, num_expert_group, e // num_expert_group)
    if correction_bias is not None:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    else:
        group_scores = grouped.max(-1).values
    groups = _topk_stable(group_scores, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep[:, :, None].expand_as(grouped).reshape(t, e)
    ids = _topk_stable(choice.masked_fill(~keep, float("-inf")), k)
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return (w * routed_scaling_factor).float(), ids.to(torch.int32)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_ids, expert_ids, num_padded) as :func:`fly_gemm.moe_routing.moe_align` defines them, in
    plain torch: the flat indices ``t * k + j`` grouped by expert (ascending within an expert), each
    expert's run padded to a multiple of ``block_m`` with ``T * k``; the expert of each block (-1 past the
    padded count); the padded count. Buffers sized as the kernel sizes them."""
    flat = topk_ids.reshape(-1).long().cpu()
    numel = flat.numel()
    size = moe_align_capacity(numel, num_experts, block_m)
    sorted_ids = torch.full((size,), numel, dtype=torch.int32)
    expert_ids = torch.full((size // block_m,), -1, dtype=torch.int32)
    pos = 0
    for e in range(num_experts):
        rows = torch.nonzero(flat == e).flatten()
        if rows.numel() == 0:
            continue
        sorted_ids[pos : pos + rows.numel()] = rows.to(torch.int32)
        padded = -(-rows.numel() // block_m) * block_m
        expert_ids[pos // block_m : (pos + padded) // block_m] = e
        pos += padded
    return sorted_ids, expert_ids, torch.tensor([pos], dtype=torch.int32)


def moe_align_capacity(numel: int, num_experts: int, block_m: int) -> int:
    """The padded worst case of ``numel`` routed rows over ``num_experts`` experts: every non-empty expert
    (at most min(E, numel) of them) pads at most ``block_m - 1`` rows; a multiple of ``block_m``."""
    worst = numel + min(num_experts, numel) * (block_m - 1)
    return -(-worst // block_m) * block_m


def quantize_groups_ref(a: torch.Tensor, qdtype: torch.dtype, group: int) -> torch.Tensor:
    """The kernels' dynamic activation quantization, in fp32, returned dequantized: each row's ``group``
    columns (the last group may be partial) get ``scale = amax / QMAX`` (QMAX 448 for fp8 e4m3, 127 for
    int8) and ``q = saturate(round_half_even(a * (QMAX / amax)))`` (0 for an all-zero group, and for one whose
    QMAX / amax overflows fp32); returns
    ``q * scale`` [M, K] fp32."""
    a = a.float()
    m, k = a.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=a.device)
    padded[:, :k] = a
    g = padded.view(m, groups, group)
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    amax = g.abs().amax(-1, keepdim=True)
    # a correctly rounded fp32 division, as the kernel's: bf16 inputs land on fp8 rounding ties often, where
    # one ulp of ``inv`` decides
    v = (g * inverse_scale_ref(amax, qmax)).clamp(-qmax, qmax)
    q = torch.round(v) if qdtype == torch.int8 else v.to(torch.float8_e4m3fn).float()
    return (q * (amax / qmax)).view(m, groups * group)[:, :k]


def unpack_int4_ref(packed: torch.Tensor) -> torch.Tensor:
    """int8 values [..., 2 K] of uint8 int4 pairs [..., K]: two's complement, element 2j in the low nibble,
    2j + 1 in the high."""
    v = packed.to(torch.int16)
    lo, hi = v & 15, v >> 4
    lo, hi = lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(torch.int8)


_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_fp4_ref(packed: torch.Tensor) -> torch.Tensor:
    """fp32 values [..., 2 K] of uint8 fp4 e2m1 pairs [..., K] (MXFP4's elements), low nibble first."""
    v = packed.long()
    codes = torch.stack((v & 15, v >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return torch.tensor(_FP4_VALUES, device=packed.device)[codes]


def dequantize_weight_ref(w: torch.Tensor, scale: torch.Tensor, block_shape=None) -> torch.Tensor:
    """fp32 ``w * scale`` of quantized expert weights ``w`` [E, N, K]: ``scale`` [E, N] / [E, N, 1] (per
    output channel) or, with ``block_shape`` [bn, bk], [E, cdiv(N, bn), cdiv(K, bk)] (one a block). uint8
    ``w`` holds int4 pairs ([E, N, K / 2], :func:`unpack_int4_ref`) with fp32 scales, or fp4 e2m1 pairs
    (:func:`unpack_fp4_ref`) with e8m0 scales (MXFP4)."""
    if w.dtype == torch.uint8:  # int4 with fp32 scales, fp4 e2m1 with e8m0 scales (MXFP4)
        w = unpack_int4_ref(w) if scale.dtype == torch.float32 else unpack_fp4_ref(w)
    e, n, k = w.shape
    wf = w.float()
    s = scale.float()
    if block_shape is None:
        return wf * s.reshape(e, n, 1)
    bn, bk = block_shape
    s = s.repeat_interleave(bn, dim=1).repeat_interleave(bk, dim=2)[:, :n, :k]
    return wf * s


def fused_moe_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape=None,
    dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The MoE layer in ``dtype`` (fp32 by default), a loop over experts::

        out[t] = sum_j w[t, j] * W2[e] @ (act(W1g[e] @ x[t]) * (W1u[e] @ x[t])),   e = ids[t, j]

    ``w1`` [E, 2I, H] (gate rows first, then up), ``w2`` [E, H, I]. With ``apply_router_weight_on_input``
    the weight scales the input instead: ``W2[e] @ (act(W1g[e] @ (w x[t])) * (W1u[e] @ (w x[t])))``.
    Ids outside [0, E) contribute nothing. Returns [T, H] in ``dtype``, on x's device.

    Quantized weights (fp8 e4m3 / int8 ``w1``, ``w2`` with ``w1_scale``, ``w2_scale``, and ``block_shape``
    for block scales) are dequantized, and the activations quantized as :func:`fused_moe` does it: x per
    token (or in 1 x block_k groups) before the router weight, the intermediate (kept in fp32) quantized
    likewise, so the result is the kernel's up to summation order. uint8 weights (packed int4, weight-only):
    dequantized and rounded to x's dtype as the kernel does; x and the intermediate (in x's dtype) as they
    are. With ``compute_dtype`` fp8 e4m3 (w4a8) the 4-bit weights are dequantized in fp32 and the activations
    quantized to fp8 in 1 x group groups, as for fp8 block scales."""
    t, h = x.shape
    e_count, two_i, _ = w1.shape
    inter = two_i // 2
    quant = w1_scale is not None
    out = torch.zeros(t, h, dtype=dtype, device=x.device)
    ids = topk_ids.long()
    w4 = quant and w1.dtype == torch.uint8 and compute_dtype is None  # weight-only
    if quant and not w4:
        qdtype = compute_dtype if w1.dtype == torch.uint8 else w1.dtype
        xs = quantize_groups_ref(x, qdtype, h if block_shape is None else block_shape[1]).to(dtype)
    else:
        xs = x.to(dtype)

    def expert_weight(w, scale, e):
        # one expert at a time: a whole layer's dequantized fp32 copy would not fit beside the layer at the
        # models' sizes. Weight-only int4 is rounded to x's dtype, as the kernel rounds it.
        if not quant:
            return w[e].to(dtype)
        wd = dequantize_weight_ref(w[e : e + 1], scale[e : e + 1], block_shape)[0]
        return (wd.to(x.dtype) if w4 else wd).to(dtype)

    ws = topk_weights.to(dtype)
    for e in range(e_count):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w1d, w2d = expert_weight(w1, w1_scale, e), expert_weight(w2, w2_scale, e)
        a = xs[tok]
        w = ws[tok, slot][:, None]
        if apply_router_weight_on_input:
            a = a * w
        gate_up = a @ w1d.t()
        y = torch_activation(gate_up[:, :inter], activation) * gate_up[:, inter:]
        if w4:  # the kernel stores the intermediate in x's dtype
            y = y.to(x.dtype).to(dtype)
        elif quant:  # the kernel keeps the intermediate in fp32 and quantizes it per row (group)
            y = quantize_groups_ref(y.float(), qdtype, inter if block_shape is None else block_shape[1]).to(dtype)
        y = y @ w2d.t()
        if not apply_router_weight_on_input:
            y = y * w
        out.index_add_(0, tok, y)
    return out
