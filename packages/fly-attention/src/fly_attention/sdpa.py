"""``scaled_dot_product_attention``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

It takes torch's arguments and torch's ``[..., heads, seqlen, head_dim]`` layout and serves the call with
:func:`fly_attention.flash_attn` through ``.transpose(1, 2)`` views (no copy of q, k or v in the common
4-D case). Two conventions differ between the two and are translated here:

- torch's ``is_causal`` is the lower-triangular mask aligned at the top-left corner (query row i sees keys
  ``j <= i``), flash_attn's causal is aligned at the bottom-right (``j <= i + seqlen_k - seqlen_q``). For
  seqlen_q < seqlen_k no row sees a key past ``seqlen_q - 1``, so k and v are sliced (views) to the first
  seqlen_q keys, where both conventions agree; for seqlen_q > seqlen_k the mask is flash_attn's window
  ``(-1, seqlen_q - seqlen_k)`` without causal (row i sees ``j <= i + off + right = i``).
- torch broadcasts the batch dimensions of q, k and v (its math backend) and a single KV head over all
  query heads; heads_kv < heads_q otherwise needs ``enable_gqa=True`` (a multiple), as in torch.

What flash_attn does not serve goes to torch's own SDPA, with a warning once per process and reason: an
``attn_mask`` (boolean or additive), dtypes other than fp16 / bf16 (fp32, fp64: torch's exact math is what
those callers expect), head dims over 256. Such a call is torch's in full, dropout included. A call that
flash_attn serves with ``dropout_p > 0`` raises :class:`flydsl.errors.UnsupportedError`: the kernel has no
dropout, and silently skipping it would change training.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from flydsl.checks import describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError

from .attention import IN_DTYPES, MAX_HEAD_DIM, flash_attn

__all__ = ["scaled_dot_product_attention"]

# Reasons already warned about in this process (one warning per reason; tests clear it).
_warned: set[str] = set()


def _fall_back(reason: str, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"fly_attention.scaled_dot_product_attention: {reason}; served by "
            "torch.nn.functional.scaled_dot_product_attention (warned once per process)",
            UserWarning,
            stacklevel=3,
        )
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip


def _split(name: str, t: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(batch dims, heads) of a ``[..., heads, seqlen, head_dim]`` tensor (heads 1 for a 2-D one)."""
    if t.dim() < 2:
        raise ShapeError(f"{name}: expected at least 2 dimensions [..., seqlen, head_dim], got {describe(t)}")
    return tuple(t.shape[:-3]), (t.shape[-3] if t.dim() >= 3 else 1)


def _as_bhsd(t: torch.Tensor, batch: tuple[int, ...], heads: int) -> torch.Tensor:
    """``t`` as ``[prod(batch), heads, seqlen, head_dim]``: a view unless broadcasting or folding several
    batch dims of a strided tensor forces reshape to copy."""
    s, d = t.shape[-2:]
    t = t.reshape(*([1] * (len(batch) + 3 - t.dim())), *t.shape) if t.dim() < len(batch) + 3 else t
    t = t.expand(*batch, heads, s, d)
    return t.reshape(math.prod(batch), heads, s, d) if len(batch) != 1 else t


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` (same arguments and semantics), served by :func:`flash_attn`.

    Args:
        query: ``[..., heads_q, seqlen_q, head_dim]`` (2-D ``[seqlen_q, head_dim]`` and 3-D allowed, as torch),
            fp16 or bf16 for the flash kernel; other float dtypes fall back to torch.
        key: ``[..., heads_kv, seqlen_k, head_dim]``; value: ``[..., heads_kv, seqlen_k, head_dim_v]``. The
            batch dimensions broadcast as in torch; heads_kv equals heads_q, is 1, or (with ``enable_gqa``)
            divides heads_q.
        attn_mask: a boolean or additive mask: served by torch's SDPA (warned once).
        dropout_p: must be 0 on the flash path (UnsupportedError otherwise).
        is_causal: torch's top-left aligned lower-triangular mask (row i sees keys ``j <= i``), for any
            seqlen_q / seqlen_k.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        enable_gqa: allow heads_kv < heads_q (a divisor of it), query head h reading KV head
            ``h // (heads_q // heads_kv)`` as torch's ``repeat_interleave``.

    Returns:
        ``[..., heads_q, seqlen_q, head_dim_v]`` in query's dtype: on the flash path a ``.transpose(1, 2)``
        view of flash_attn's contiguous ``[batch, seqlen_q, heads_q, head_dim_v]`` output.

    Raises:
        flydsl.errors.UnsupportedError (dropout_p > 0 on the flash path), ArgumentError / ShapeError /
        DTypeError naming the argument for bad input (heads that do not match without enable_gqa, ...).

    Example::

        out = scaled_dot_product_attention(q, k, v, is_causal=True)   # q, k, v [2, 16, 1024, 128] bf16
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{name}: expected a torch.Tensor [..., heads, seqlen, head_dim], got "
                                f"{type(t).__name__}")  # fmt: skip
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise ArgumentError(f"attn_mask: expected None or a torch.Tensor, got {type(attn_mask).__name__}")
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
        raise ArgumentError(f"dropout_p: expected a probability in [0, 1], got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise ArgumentError(f"is_causal: expected a bool, got {type(is_causal).__name__} {is_causal!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
                              or not math.isfinite(scale)):  # fmt: skip
        raise ArgumentError(f"scale: expected None or a finite number, got {scale!r}")
    if not isinstance(enable_gqa, bool):
        raise ArgumentError(f"enable_gqa: expected a bool, got {type(enable_gqa).__name__} {enable_gqa!r}")

    (bq, hq), (bk, hk), (bv, hv) = _split("query", query), _split("key", key), _split("value", value)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None:
        return _fall_back("attn_mask is not supported by the flash kernel", *args)
    if query.dtype not in IN_DTYPES:
        return _fall_back(f"dtype {query.dtype} is not fp16 / bf16", *args)
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return _fall_back(f"head dims over {MAX_HEAD_DIM}", *args)
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise DTypeError(f"{name}: expected query's dtype {dtype_name(query.dtype)}, got {describe(t)}")
    if dropout_p > 0:
        raise UnsupportedError(f"dropout_p: fly_attention's flash kernel has no dropout; got dropout_p={dropout_p} "
                               "(pass 0.0, e.g. in eval, or call torch's SDPA for training with dropout)")  # fmt: skip

    try:
        batch = torch.broadcast_shapes(bq, bk, bv)
    except RuntimeError:
        raise ShapeError(f"key, value: batch dimensions {bk} and {bv} do not broadcast with query's {bq} "
                         f"(query {describe(query)})") from None  # fmt: skip
    if hk != hv:
        raise ShapeError(f"value: expected key's {hk} heads, got {describe(value)}")
    if key.shape[-2] != value.shape[-2]:
        raise ShapeError(f"value: expected key's seqlen {key.shape[-2]}, got {describe(value)}")
    if query.shape[-1] != key.shape[-1]:
        raise ShapeError(f"key: expected query's head_dim {query.shape[-1]}, got {describe(key)}")
    if hk < 1:
        raise ShapeError(f"key: expected at least one head, got {describe(key)}")
    if enable_gqa:
        if hq % hk:
            raise ShapeError(f"key: with enable_gqa, heads_kv must divide query's {hq} heads, got {describe(key)}")
    elif hk not in (hq, 1):
        raise ShapeError(f"key: expected query's {hq} heads (or 1, broadcast; fewer that divide it need "
                         f"enable_gqa=True), got {describe(key)}")  # fmt: skip

    sq, sk = query.shape[-2], key.shape[-2]
    q4, k4, v4 = _as_bhsd(query, batch, hq), _as_bhsd(key, batch, hk), _as_bhsd(value, batch, hk)
    causal, window = False, (-1, -1)
    if is_causal:  # torch's top-left alignment in flash_attn's bottom-right terms (module docstring)
        if sq <= sk:
            k4, v4, causal = k4[:, :, :sq], v4[:, :, :sq], True
        else:
            window = (-1, sq - sk)
    out = flash_attn(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), causal=causal,
                     softmax_scale=scale, window=window).transpose(1, 2)  # fmt: skip
    rank = max(query.dim(), key.dim(), value.dim())
    return out.reshape((*batch, hq, sq, value.shape[-1])[-rank:] if rank > 2 else (sq, value.shape[-1]))
