"""MoE routing: the router's top-k (softmax, and DeepSeek-V3's grouped top-k) and the alignment of the
routed rows by expert that the grouped GEMMs of :mod:`fly_gemm.moe` walk.

Kernels in :mod:`._kernels.moe_routing`; references in :mod:`.moe_reference`. Ties between equal scores
go to the lower expert id, on every device. Nothing here synchronizes with the host: output sizes come
from shapes alone (the alignment's from its padded worst case).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flydsl.checks import check_same_device, check_tensor, describe
from flydsl.errors import ArgumentError, ShapeError

from ._kernels.moe_routing import align_scratch_size, launch_align, launch_grouped_topk, launch_topk_softmax
from .moe_reference import moe_align_capacity

__all__ = ["topk_softmax", "grouped_topk", "moe_align", "MoeAlignment", "moe_align_capacity"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)


def _positive_int(name: str, v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ArgumentError(f"{name}: expected a positive int ({what}), got {v!r}")
    return v


def _check_logits(router_logits, k):
    check_tensor("router_logits", router_logits, dtypes=_LOGIT_DTYPES, ndim=2)
    e = router_logits.shape[1]
    if e == 0:
        raise ShapeError(f"router_logits: expected [T, E] with E >= 1 experts, got {describe(router_logits)}")
    _positive_int("k", k, "experts a token")
    if k > e:
        raise ArgumentError(f"k: expected at most E = {e} (router_logits' experts), got {k}")
    return router_logits.shape


def _outputs(t: int, k: int, device):
    return (torch.empty(t, k, dtype=torch.float32, device=device), torch.empty(t, k, dtype=torch.int32, device=device))


def topk_softmax(router_logits: torch.Tensor, k: int, renormalize: bool = True):
    """The k experts of each token by the softmax of its router logits.

    Args:
        router_logits: ``[T, E]`` fp32 / bf16 / fp16, any strides (the softmax runs in fp32).
        k: experts a token, 1 <= k <= E.
        renormalize: scale the k weights to sum to 1 (Mixtral, Qwen3); else they are the softmax
            probabilities themselves.

    Returns:
        ``(weights, ids)``: fp32 ``[T, k]`` and int32 ``[T, k]``, best first; equal logits go to the lower id.
        A row holding NaN (or +inf, or only -inf) gets NaN weights, as ``torch.softmax``; its ids are distinct
        experts in [0, E) (a NaN ranks first, as in torch's sort).

    Example::

        w, ids = topk_softmax(router(x), 2)
        y = fused_moe(x, w1, w2, w, ids)
    """
    t, _ = _check_logits(router_logits, k)
    weights, ids = _outputs(t, k, router_logits.device)
    if router_logits.device.type != "meta":
        launch_topk_softmax(router_logits, weights, ids, k, bool(renormalize))
    return weights, ids


def grouped_topk(
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
    """DeepSeek-V3's routing: the best ``topk_group`` of ``num_expert_group`` expert groups, then the best k
    experts inside them.

    Scores are ``sigmoid(logits)`` (``scoring="softmax"``: the softmax, DeepSeek-V2); the choice adds
    ``correction_bias`` (fp32 ``[E]``, V3's load-balancing bias) to the scores; a group ranks by the sum of its
    two best choice scores (with a bias) or by its best one (without). The weights are the plain scores of
    the chosen experts, renormalized to sum to 1 when asked, times ``routed_scaling_factor`` (V3: 2.5).

    Args:
        router_logits: ``[T, E]`` fp32 / bf16 / fp16; E a multiple of ``num_expert_group``.
        k: experts a token, at most ``topk_group * E / num_expert_group``.

    Returns:
        ``(weights, ids)``: fp32 ``[T, k]`` and int32 ``[T, k]``; ties go to the lower group / expert id. A NaN
        score ranks first (in its group, and its group first), as in torch's sort: its weight is NaN, and so is
        its row's when renormalized; the ids stay distinct experts in [0, E).

    Example::

        w, ids = grouped_topk(logits, 8, 8, 4, correction_bias=bias, routed_scaling_factor=2.5)  # DeepSeek-V3
    """
    t, e = _check_logits(router_logits, k)
    groups = _positive_int("num_expert_group", num_expert_group, "expert groups")
    if e % groups:
        raise ArgumentError(f"num_expert_group: expected a divisor of E = {e} (router_logits' experts), got {groups}")
    _positive_int("topk_group", topk_group, "groups kept a token")
    if topk_group > groups:
        raise ArgumentError(f"topk_group: expected at most num_expert_group = {groups}, got {topk_group}")
    if k > topk_group * (e // groups):
        raise ArgumentError(f"k: expected at most topk_group * E / num_expert_group = {topk_group * (e // groups)} "
                            f"(the experts of the kept groups), got {k}")  # fmt: skip
    if scoring not in ("sigmoid", "softmax"):
        raise ArgumentError(f"scoring: expected 'sigmoid' or 'softmax', got {scoring!r}")
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, dtypes=_LOGIT_DTYPES, ndim=1)
        if correction_bias.shape[0] != e:
            raise ShapeError(f"correction_bias: expected [{e}] (one per expert), got {describe(correction_bias)}")
        check_same_device(router_logits=router_logits, correction_bias=correction_bias)
        correction_bias = correction_bias.contiguous()
    weights, ids = _outputs(t, k, router_logits.device)
    if router_logits.device.type != "meta":
        launch_grouped_topk(router_logits, correction_bias, weights, ids, k, groups, topk_group,
                            scoring == "sigmoid", bool(renormalize), float(routed_scaling_factor))  # fmt: skip
    return weights, ids


class MoeAlignment(NamedTuple):
    """The routed rows grouped by expert (see :func:`moe_align`)."""

    sorted_ids: torch.Tensor  # int32 [capacity]: flat rows t * k + j by expert, padding = T * k
    expert_ids: torch.Tensor  # int32 [capacity / block_m]: each block's expert, -1 past num_padded
    num_padded: torch.Tensor  # int32 [1]: rows in use (a multiple of block_m)


def check_topk_ids(topk_ids, num_experts: int | None = None) -> None:
    """``topk_ids``: int32 / int64 ``[T, k]``. With ``num_experts``, on the CPU (where reading the values
    costs no device synchronization), every id in [0, E) or -1 (an expert of another rank)."""
    check_tensor("topk_ids", topk_ids, dtypes=_ID_DTYPES, ndim=2)
    if num_experts is not None:
        check_id_values(topk_ids, num_experts)


def check_id_values(topk_ids, num_experts: int) -> None:
    """On the CPU only, every id in [0, E) or -1: there the values are read on the host, a read that on a GPU
    would be a synchronization (and would break CUDA graph capture), so device ids are never read here."""
    if topk_ids.device.type == "cpu" and topk_ids.numel():
        bad = (topk_ids >= num_experts) | (topk_ids < -1)
        if bool(bad.any()):
            v = int(topk_ids[bad][0])
            raise ArgumentError(f"topk_ids: expected expert ids in [0, {num_experts}) (or -1: not on this rank), "
                                f"got {v}")  # fmt: skip


def _aligned(n: int) -> int:
    """n int32 elements rounded up to 16 bytes, so that every part of the alignment's one buffer starts
    16-byte aligned (what Triton specializes a pointer on)."""
    return -(-n // 4) * 4


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """:func:`moe_align` with no argument checks (the caller checked them), for ``fused_moe``'s path: one
    int32 allocation holds the results and the kernels' scratch, and nothing else runs on the host."""
    t, k = topk_ids.shape
    size = moe_align_capacity(t * k, num_experts, block_m)
    blocks = size // block_m
    # [scratch | sorted_ids | expert_ids | num_padded]: the scratch first, so the kernels take the buffer
    # itself for it (one view fewer to make on the host)
    at_sorted = _aligned(align_scratch_size(t * k, num_experts))
    at_experts = at_sorted + _aligned(size)
    at_npad = at_experts + _aligned(blocks)
    buf = torch.empty(at_npad + 1, dtype=torch.int32, device=topk_ids.device)
    sorted_ids = buf[at_sorted : at_sorted + size]
    expert_ids = buf[at_experts : at_experts + blocks]
    num_padded = buf[at_npad:]
    if buf.device.type != "meta":
        launch_align(topk_ids, num_experts, block_m, sorted_ids, expert_ids, num_padded, buf)
    return MoeAlignment(sorted_ids, expert_ids, num_padded)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the routed rows by expert, each expert's run padded to a multiple of ``block_m``.

    Row ``t * k + j`` stands for token t's j-th expert. ``sorted_ids`` lists the rows expert by expert
    (ascending inside an expert), each expert's run padded with ``T * k`` to a multiple of ``block_m``;
    ``expert_ids[b]`` is the expert of rows ``b * block_m`` to ``(b + 1) * block_m - 1``; ``num_padded``
    the rows in use. Sized from shapes, with no host synchronization: ``sorted_ids`` holds
    :func:`moe_align_capacity` rows (the padded worst case), past ``num_padded`` padding and -1 blocks.
    Ids outside [0, E) (-1: an expert of another rank) are left out; on the CPU other values raise.
    The three results are views of one buffer.

    Args:
        topk_ids: int32 / int64 ``[T, k]``, any strides.
        num_experts: E. block_m: the grouped GEMM's row tile.

    Example::

        sorted_ids, expert_ids, num_padded = moe_align(ids, 8, 64)
    """
    check_topk_ids(topk_ids)
    _positive_int("num_experts", num_experts, "E")
    _positive_int("block_m", block_m, "rows a block")
    check_id_values(topk_ids, num_experts)
    return align(topk_ids, num_experts, block_m)
