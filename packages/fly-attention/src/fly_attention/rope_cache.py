"""``fused_rope_cache``: rotary embedding of q and k and the write of k and v into a paged KV cache, in one
kernel (:mod:`._kernels.rope_cache`): the step before :func:`fly_attention.paged_attention_decode` in a
serving loop.

In the order of the family's files: argument checks (every bad input named before anything launches), the
launch, the ``torch.library`` custom op (it mutates the caches, declared in its schema; a fake
implementation for ``torch.compile(fullgraph=True)``), and the public function, whose plain eager calls
replay their first call's launch (:mod:`flydsl.direct`). No host synchronization: CUDA graph capture records
it as is.
"""

from __future__ import annotations

import numbers

import torch

from flydsl import direct
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DTypeError, LayoutError, ShapeError

from ._kernels.rope_cache import launch_rope_cache
from .decode import FP8_KV, MAX_HEAD_DIM, _check_scale, _scale_args

__all__ = ["fused_rope_cache"]

_IN = (torch.float16, torch.bfloat16)
_INDEX = (torch.int32, torch.int64)

# The rotated q's allocation, one name for tests to poison.
_empty = torch.empty


def _check(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=_IN, ndim=3)
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise LayoutError(f"{name}: expected a unit stride in the last (head_dim) dimension, got {describe(t)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise DTypeError(f"{name}: expected dtype {dtype_name(q.dtype)} (q's), got {describe(t)}")
    tokens, _, d = q.shape
    if k.shape[0] != tokens or v.shape[0] != tokens:
        raise ShapeError(f"k, v: expected {tokens} tokens (q's dim 0), got k {describe(k)} and v {describe(v)}")
    if k.shape[2] != d:
        raise ShapeError(f"k: expected head_dim {d} (q's), got {describe(k)}")
    if v.shape[1] != k.shape[1]:
        raise ShapeError(f"v: expected {k.shape[1]} heads (k's), got {describe(v)}")
    if not 1 <= d <= MAX_HEAD_DIM or not 1 <= v.shape[2] <= MAX_HEAD_DIM:
        raise ShapeError(f"q, v: expected head dims in 1..{MAX_HEAD_DIM}, got q {describe(q)}, v {describe(v)}")
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32, *_IN), ndim=2)
    rot = cos_sin_cache.shape[1]
    if rot < 2 or rot % 2 or rot > d:
        raise ShapeError(f"cos_sin_cache: expected [max_position, rotary_dim] with an even rotary_dim in 2..{d} "
                         f"(q's head_dim), got {describe(cos_sin_cache)}")  # fmt: skip
    if cos_sin_cache.shape[0] < 1:
        raise ShapeError(f"cos_sin_cache: expected at least one position, got {describe(cos_sin_cache)}")
    if cos_sin_cache.stride(1) != 1:
        raise LayoutError(f"cos_sin_cache: expected a unit stride in the last dimension, got "
                          f"{describe(cos_sin_cache)}")  # fmt: skip
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, t, dtypes=_INDEX, ndim=1)
        if t.shape[0] != tokens:
            raise ShapeError(f"{name}: expected [{tokens}] (q's tokens), got {describe(t)}")
    for name, t, want in (("k_cache", k_cache, k), ("v_cache", v_cache, v)):
        check_tensor(name, t, dtypes=(q.dtype, FP8_KV), ndim=4)
        if t.shape[2] != want.shape[1] or t.shape[3] != want.shape[2]:
            raise ShapeError(f"{name}: expected [num_blocks, block_size, {want.shape[1]}, {want.shape[2]}] (the "
                             f"heads and head_dim of {name[0]}), got {describe(t)}")  # fmt: skip
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise LayoutError(f"{name}: expected a unit stride in the last (head_dim) dimension, got {describe(t)}")
    if v_cache.dtype != k_cache.dtype:
        raise DTypeError(f"v_cache: expected dtype {dtype_name(k_cache.dtype)} (k_cache's), got {describe(v_cache)}")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        raise ShapeError(f"v_cache: expected k_cache's blocks and block size {tuple(k_cache.shape[:2])}, got "
                         f"{describe(v_cache)}")  # fmt: skip
    check_same_device(q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, positions=positions, k_cache=k_cache,
                      v_cache=v_cache, slot_mapping=slot_mapping)  # fmt: skip
    if not isinstance(is_neox, bool):
        raise ArgumentError(f"is_neox: expected a bool, got {type(is_neox).__name__} {is_neox!r}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_scale(name, s, k.shape[1], k_cache.device)
        if s is not None and k_cache.dtype != FP8_KV:
            raise ArgumentError(f"{name}: a scale quantizes an fp8 cache; the caches are {dtype_name(k_cache.dtype)}")
        if isinstance(s, numbers.Real) and s == 0:
            raise ArgumentError(f"{name}: expected a nonzero scale (values are divided by it), got {s!r}")


def _rope_cache(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale):
    _check(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale)
    q_out = _empty(*q.shape, dtype=q.dtype, device=q.device)
    if q.is_meta or q.shape[0] == 0:
        return q_out
    ks, k_mul = _scale_args(k_scale)
    vs, v_mul = _scale_args(v_scale)
    launch_rope_cache(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, q_out, ks, vs, k_mul, v_mul,
                      is_neox)  # fmt: skip
    return q_out


# ------------------------------------------------------------------ custom op

_LIB = torch.library.Library("fly_attention", "FRAGMENT")
_LIB.define(
    "fused_rope_cache(Tensor q, Tensor k, Tensor v, Tensor cos_sin_cache, Tensor positions, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slot_mapping, bool is_neox, Tensor? k_scale, Tensor? v_scale, float k_mul, "
    "float v_mul) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _op(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale, k_mul, v_mul):
    ks = k_scale if k_scale is not None else (k_mul if k_mul != 1.0 else None)
    vs = v_scale if v_scale is not None else (v_mul if v_mul != 1.0 else None)
    return _rope_cache(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, is_neox, ks, vs)


_LIB.impl("fused_rope_cache", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("fly_attention::fused_rope_cache", lib=_LIB)
def _(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale, k_mul, v_mul):
    return q.new_empty(q.shape)


# ------------------------------------------------------------------ public function


def fused_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = True,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Rotary embedding of q and k and the write of k and v into a paged KV cache, in one kernel.

    Args:
        q: ``[tokens, heads_q, head_dim]``, fp16 or bf16; k ``[tokens, heads_kv, head_dim]`` and v
            ``[tokens, heads_kv, head_dim_v]`` of q's dtype. Any strides with a unit last one (slices of
            a fused QKV projection are read in place).
        cos_sin_cache: ``[max_position, rotary_dim]`` (fp32 or q's dtype): row p holds
            ``cos(p * f_i)`` for ``i < rotary_dim / 2``, then ``sin(p * f_i)`` (vLLM's layout). Only the first
            ``rotary_dim`` dims of each head rotate (partial rotary); the rest pass through.
        positions: int32 / int64 ``[tokens]``, each token's position (clamped into the table).
        k_cache, v_cache: ``[num_blocks, block_size, heads_kv, head_dim(_v)]``, q's dtype or
            ``torch.float8_e4m3fn``; written in place at ``slot_mapping``.
        slot_mapping: int32 / int64 ``[tokens]``: token t goes to block ``slot // block_size``, offset
            ``slot % block_size``; -1 (padding) and slots past the cache write nothing.
        is_neox: NeoX style (dim i pairs with ``i + rotary_dim / 2``) or GPT-J style (dims 2i and 2i + 1).
        k_scale, v_scale: fp8 caches only: the cache holds ``value / scale`` (saturated to +-448, rounded
            to nearest even); a number or an fp32 tensor of one element or ``[heads_kv]``; default 1.

    Returns:
        The rotated q (a new contiguous tensor of q's shape and dtype). k and v are not modified: the
        rotated k goes only into the cache. Meta tensors give a meta result.

    Raises:
        flydsl.errors.ArgumentError / ShapeError / DTypeError / LayoutError / DeviceError naming the
        argument.

    Example::

        q = fused_rope_cache(q, k, v, cos_sin, positions, k_cache, v_cache, slots)
        out = paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens)
    """
    if torch.compiler.is_compiling():
        ks, k_mul = (k_scale, 1.0) if not isinstance(k_scale, numbers.Real) else (None, float(k_scale))
        vs, v_mul = (v_scale, 1.0) if not isinstance(v_scale, numbers.Real) else (None, float(v_scale))
        return torch.ops.fly_attention.fused_rope_cache(q, k, v, cos_sin_cache, positions, k_cache, v_cache,
                                                        slot_mapping, is_neox, ks, vs, k_mul, v_mul)  # fmt: skip
    return _REPLAYS.eager(_rope_cache, q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, is_neox,
                          k_scale, v_scale)  # fmt: skip


# Plain eager calls replay their first call's launch (flydsl.direct): the checks and the launch keying of
# the general path cost a call 70-180 us of host time on the H200 host, for a kernel of 2.6-10 us up to 1K
# tokens.
_REPLAYS = direct.Replays("fly_attention.fused_rope_cache")
