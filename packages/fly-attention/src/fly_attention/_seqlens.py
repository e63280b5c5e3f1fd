"""The varlen offsets' value checks, made once per offsets tensor.

``flash_attn_varlen`` must refuse offsets that are not non-decreasing, that leave the packed tokens, or
whose sequences are longer than ``max_seqlen``, and it must know which tokens lie outside every sequence (they
read 0). Both need the offsets' values on the host: a device-to-host copy, which waits for the GPU to drain,
so a call can no longer be queued behind the work before it (on the H200 that doubled a 16 x 1024-token
forward's time). A model passes the same offsets tensors to every layer, forward and backward, so the check
is made once per tensor and kept: keyed by the tensor itself (weakly: a tensor freed and another allocated
at its address is a new key), valid while its version counter (bumped by every in-place write through torch)
and everything else the check read (the other offsets tensor, the packed lengths, the maxima) are unchanged.
"""

from __future__ import annotations

import weakref

import torch

from flydsl.errors import ArgumentError

__all__ = ["offsets_span", "clear"]

# id(cu_seqlens_q) -> (weakref to it, its version, weakref to cu_seqlens_k, cu_k's version, total_q, total_k,
# max_q, max_k, span). By id, not by the tensor (a tensor's == compares elements); the weak reference says
# whether the id still names the same tensor, and its callback drops the entry when the tensor goes.
_CHECKED: dict[int, tuple] = {}


def clear() -> None:
    _CHECKED.clear()


def offsets_span(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int,
                 max_k: int) -> tuple[int, int, int, int]:  # fmt: skip
    """Check the offsets' values (one host sync the first time a pair is seen, none after) and return the
    tokens the sequences cover: ``(cu_q[0], cu_q[-1], cu_k[0], cu_k[-1])``. The caller has checked dtype
    (int32), rank, device and the pair's lengths."""
    seen = _CHECKED.get(id(cu_q))
    if seen is not None:
        q_ref, version, k_ref, k_version, *sizes, span = seen
        if (q_ref() is cu_q and version == cu_q._version and k_ref() is cu_k and k_version == cu_k._version
                and sizes == [total_q, total_k, max_q, max_k]):  # fmt: skip
            return span
    batch = cu_q.numel() - 1
    rows = []
    for cu in (cu_q, cu_k):
        steps = cu.diff() if batch else cu.new_zeros(1)
        rows.append(torch.stack([cu[0], cu[-1], steps.min(), steps.max()]))
    (q_first, q_last, q_min, q_max), (k_first, k_last, k_min, k_max) = torch.stack(rows).tolist()
    for name, cu, first, last, lo, hi, total, mx, mname in (
        ("cu_seqlens_q", cu_q, q_first, q_last, q_min, q_max, total_q, max_q, "max_seqlen_q"),
        ("cu_seqlens_k", cu_k, k_first, k_last, k_min, k_max, total_k, max_k, "max_seqlen_k"),
    ):
        if lo < 0:
            raise ArgumentError(f"{name}: expected non-decreasing offsets, got {cu.tolist()}")
        if first < 0 or last > total:
            raise ArgumentError(f"{name}: expected offsets within the {total} packed tokens, got first {first}, "
                                f"last {last}")  # fmt: skip
        if hi > mx:
            raise ArgumentError(f"{mname}: a sequence of {name} has {hi} tokens, more than {mname} = {mx}")
    span = (int(q_first), int(q_last), int(k_first), int(k_last))
    key = id(cu_q)
    q_ref = weakref.ref(cu_q, lambda ref, key=key: _CHECKED.get(key, (None,))[0] is ref and _CHECKED.pop(key))
    _CHECKED[key] = (q_ref, cu_q._version, weakref.ref(cu_k), cu_k._version, total_q, total_k, max_q, max_k, span)
    return span
