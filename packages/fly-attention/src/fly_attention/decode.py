"""``paged_attention_decode``: attention of a few new tokens a sequence over a paged (or dense) KV cache.

In the order of the family's files: the kernels live in :mod:`._kernels.decode`, the config and the
split-KV count in :mod:`.decode_config`, then the host API below: argument checks (every bad input is
named before anything launches), the workspace and dispatch, the ``torch.library`` custom ops (with fake
implementations, so ``torch.compile(fullgraph=True)`` traces them), and the public function.

Serving runs this op inside CUDA graphs, so a call never synchronizes with the device and allocates only
what the shapes decide: the split count comes from the cache's capacity (a shape), never from the
sequence lengths' values, and ``out=`` takes a fixed output buffer.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

import flydsl.arch
from flydsl import direct
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError

from ._kernels.decode import launch_decode
from ._kernels.programs import head_block
from .decode_config import (
    MAX_SPLITS,
    DecodeConfig,
    decode_block_m,
    decode_config_valid,
    decode_splits,
    default_decode_config,
)

__all__ = ["paged_attention_decode", "Q_DTYPES", "FP8_KV", "MAX_Q_LEN", "MAX_HEAD_DIM"]

Q_DTYPES = (torch.float16, torch.bfloat16)
FP8_KV = torch.float8_e4m3fn
MAX_Q_LEN = 8  # new tokens a sequence (speculative decoding's drafts); the rows a program holds grow with it
MAX_HEAD_DIM = 256
MAX_PAGE = 256  # cache block sizes: powers of two up to this one (16-128 are the serving ones)


# ------------------------------------------------------------------ checks


def _number(name, x, *, lo=None, allow_none=False):
    if x is None and allow_none:
        return None
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or not math.isfinite(x) or (lo is not None and x < lo):
        what = "a finite number" + (f" >= {lo}" if lo is not None else "")
        raise ArgumentError(f"{name}: expected {'None or ' if allow_none else ''}{what}, got {x!r}")
    return float(x)


def _check_scale(name, scale, heads_kv, device):
    """None, a finite number, or an fp32 tensor of one element or ``[heads_kv]`` on the caches' device."""
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        check_tensor(name, scale, dtypes=(torch.float32,))
        if scale.device != device:
            raise DeviceError(f"{name}: expected a tensor on {device} (the caches' device), got {describe(scale)}")
        if scale.numel() == 1 or (scale.dim() == 1 and scale.shape[0] == heads_kv):
            return
        raise ShapeError(f"{name}: expected one element (per tensor) or [{heads_kv}] (per KV head), got "
                         f"{describe(scale)}")  # fmt: skip
    _number(name, scale)


def _check(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale, window, softcap, num_splits,
           softmax_scale):  # fmt: skip
    """Every argument, before anything launches. Returns q as ``[batch, q_len, heads_q, head_dim]``."""
    check_tensor("q", q, dtypes=Q_DTYPES)
    if q.dim() not in (3, 4):
        raise ShapeError(f"q: expected [batch, heads_q, head_dim] or [batch, q_len, heads_q, head_dim], got "
                         f"{describe(q)}")  # fmt: skip
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    batch, q_len, heads_q, d = q4.shape
    if q_len > MAX_Q_LEN:
        raise ShapeError(f"q: expected at most {MAX_Q_LEN} new tokens a sequence (dim 1), got {describe(q)}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ShapeError(f"q: expected a head_dim in 1..{MAX_HEAD_DIM}, got {describe(q)}")
    if q.stride(-1) != 1 and d > 1:
        raise LayoutError(f"q: expected a unit stride in the last (head_dim) dimension, got {describe(q)}")
    paged = block_tables is not None
    layout = "[num_blocks, block_size, heads_kv, head_dim]" if paged else "[batch, seqlen, heads_kv, head_dim]"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, dtypes=(q.dtype, FP8_KV))
        if t.dim() != 4:
            raise ShapeError(f"{name}: expected a 4-D tensor {layout}, got {describe(t)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise LayoutError(f"{name}: expected a unit stride in the last (head_dim) dimension, got {describe(t)}")
    if v_cache.dtype != k_cache.dtype:
        raise DTypeError(f"v_cache: expected dtype {dtype_name(k_cache.dtype)} (k_cache's), got {describe(v_cache)}")
    if v_cache.shape != k_cache.shape:
        raise ShapeError(f"v_cache: expected k_cache's shape {tuple(k_cache.shape)}, got {describe(v_cache)}")
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ShapeError(f"k_cache: expected head_dim {d} (q's), got {describe(k_cache)}")
    if heads_kv < 1 or heads_q % heads_kv:
        raise ShapeError(f"k_cache: expected a number of KV heads that divides q's {heads_q} heads (GQA / MQA), "
                         f"got {describe(k_cache)}")  # fmt: skip
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, out=out)
    if paged:
        check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2)
        if block_tables.shape[0] != batch:
            raise ShapeError(f"block_tables: expected [batch = {batch}, max_blocks] (q's batch), got "
                             f"{describe(block_tables)}")  # fmt: skip
        if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
            raise LayoutError(f"block_tables: expected a unit stride in the last dimension, got "
                              f"{describe(block_tables)}")  # fmt: skip
        page = k_cache.shape[1]
        if page < 1 or page > MAX_PAGE or page & (page - 1):
            raise ShapeError(f"k_cache: expected a block size (dim 1) that is a power of two up to {MAX_PAGE}, got "
                             f"{describe(k_cache)}")  # fmt: skip
        if k_cache.shape[0] < 1:
            raise ShapeError(f"k_cache: expected at least one cache block, got {describe(k_cache)}")
    elif k_cache.shape[0] != batch:
        raise ShapeError(f"k_cache: expected a dense cache [batch = {batch}, seqlen, heads_kv, head_dim] (no "
                         f"block_tables), got {describe(k_cache)}")  # fmt: skip
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
        if seq_lens.shape[0] != batch:
            raise ShapeError(f"seq_lens: expected [batch = {batch}] (q's batch), got {describe(seq_lens)}")
    elif paged:
        raise ArgumentError("seq_lens: expected an int32 tensor [batch] with a block table, got None")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_scale(name, s, heads_kv, k_cache.device)
    if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < -1:
        raise ArgumentError(f"window: expected an int >= -1 (-1: unbounded), got {window!r}")
    _number("softcap", softcap, lo=0.0)
    _number("softmax_scale", softmax_scale, allow_none=True)
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool)
                                   or not 1 <= num_splits <= MAX_SPLITS):  # fmt: skip
        raise ArgumentError(f"num_splits: expected None (chosen from the SM count) or an int in 1..{MAX_SPLITS}, "
                            f"got {num_splits!r}")  # fmt: skip
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,))
        if out.shape != q.shape:
            raise ShapeError(f"out: expected q's shape {tuple(q.shape)}, got {describe(out)}")
        if out.stride(-1) != 1 and d > 1:
            raise LayoutError(f"out: expected a unit stride in the last (head_dim) dimension, got {describe(out)}")
    return q4


# ------------------------------------------------------------------ config and launch


@functools.lru_cache(maxsize=1024)
def _config_for(d, rows, kv_dtype, arch, paged, programs) -> DecodeConfig:
    return default_decode_config(d, rows, kv_dtype, arch, paged=paged, programs=programs)


# The output's and the workspace's allocation, one name for tests to poison.
_empty = torch.empty


def _scale_args(scale):
    """(tensor or None, multiplier): a number becomes the kernel's multiplier, a tensor its pointer."""
    if scale is None:
        return None, 1.0
    if isinstance(scale, torch.Tensor):
        return scale.reshape(-1), 1.0
    return None, float(scale)


def _decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits, k_scale, v_scale, window,
            softcap, out, config=None):  # fmt: skip
    """Check, size the workspace, launch; returns ``out`` (given or new, q's shape)."""
    q4 = _check(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale, window, softcap, num_splits,
                softmax_scale)  # fmt: skip
    if out is None:
        out = _empty(*q.shape, dtype=q.dtype, device=q.device)
    if q.is_meta:
        return out
    out4 = out.unsqueeze(1) if q.dim() == 3 else out
    batch, q_len, heads_q, d = q4.shape
    heads_kv = k_cache.shape[2]
    rows = (heads_q // heads_kv) * q_len
    arch = flydsl.arch.current(q.device)
    block_m = decode_block_m(rows)
    row_blocks = -(-rows // block_m)
    if config is None:
        programs = min(batch * heads_kv * row_blocks, arch.sm_count)  # the default reads no more (few keys cached)
        cfg = _config_for(d, rows, k_cache.dtype, arch, block_tables is not None, programs)
    elif not decode_config_valid(config, d, rows, k_cache.dtype, arch):
        raise ArgumentError(f"config: expected a valid fly_attention.decode_config.DecodeConfig for head_dim {d}, "
                            f"{rows} rows a KV head, a {dtype_name(k_cache.dtype)} cache on {arch.name}, got "
                            f"{config!r}")  # fmt: skip
    else:
        cfg = config
    capacity = block_tables.shape[1] * k_cache.shape[1] if block_tables is not None else k_cache.shape[1]
    if num_splits is None:
        num_splits = decode_splits(batch, heads_kv, capacity, arch.sm_count, row_blocks=row_blocks,
                                   block_n=cfg.block_n)  # fmt: skip
    num_splits = int(num_splits)
    if batch == 0 or q_len == 0:
        return out
    if capacity == 0:  # no key at all: every row is 0
        out.zero_()
        return out
    partial = partial_lse = None
    if num_splits > 1:  # sized from shapes only (CUDA graph capture replays it with any lengths)
        block_d = head_block(d)  # the decode kernel's tile (its partials' row width)
        partial = _empty(batch, q_len, heads_q, num_splits, block_d, dtype=torch.float32, device=q.device)
        partial_lse = _empty(batch, q_len, heads_q, num_splits, dtype=torch.float32, device=q.device)
    ks, k_mul = _scale_args(k_scale)
    vs, v_mul = _scale_args(v_scale)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    launch_decode(q4, k_cache, v_cache, block_tables, seq_lens, out4, partial, partial_lse, ks, vs, k_mul, v_mul,
                  scale, int(window), float(softcap), num_splits, block_m, cfg)  # fmt: skip
    return out


# ------------------------------------------------------------------ custom ops

_LIB = torch.library.Library("fly_attention", "FRAGMENT")
_ARGS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor? block_tables, Tensor? seq_lens, float? softmax_scale, "
    "int? num_splits, Tensor? k_scale, Tensor? v_scale, float k_mul, float v_mul, int window, float softcap"
)
_LIB.define(f"paged_attention_decode({_ARGS}) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define(f"paged_attention_decode_out({_ARGS}, Tensor(a!) out) -> ()", tags=(torch.Tag.pt2_compliant_tag,))


def _op(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits, k_scale, v_scale, k_mul, v_mul,
        window, softcap, out=None):  # fmt: skip
    ks = k_scale if k_scale is not None else (k_mul if k_mul != 1.0 else None)
    vs = v_scale if v_scale is not None else (v_mul if v_mul != 1.0 else None)
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits, ks, vs, window, softcap,
                   out)  # fmt: skip


def _op_out(*args):
    _op(*args)


_LIB.impl("paged_attention_decode", _op, "CompositeExplicitAutograd")
_LIB.impl("paged_attention_decode_out", _op_out, "CompositeExplicitAutograd")


@torch.library.register_fake("fly_attention::paged_attention_decode", lib=_LIB)
def _(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits, k_scale, v_scale, k_mul, v_mul,
      window, softcap):  # fmt: skip
    return q.new_empty(q.shape)


@torch.library.register_fake("fly_attention::paged_attention_decode_out", lib=_LIB)
def _(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits, k_scale, v_scale, k_mul, v_mul,
      window, softcap, out):  # fmt: skip
    return None


# ------------------------------------------------------------------ public function


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    *,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    window: int = -1,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: the new tokens of each sequence against its KV cache, fp32 accumulation.

    Args:
        q: ``[batch, heads_q, head_dim]`` (one new token a sequence) or ``[batch, q_len, heads_q, head_dim]``
            with ``q_len <= 8`` (speculative decoding: the sequence's last ``q_len`` tokens), fp16 or bf16,
            any strides with a unit last one. Head dims 1..256.
        k_cache, v_cache: paged ``[num_blocks, block_size, heads_kv, head_dim]`` (block sizes: powers of two
            up to 256; 16, 32, 64, 128 the serving ones), or, with ``block_tables=None``, dense
            ``[batch, seqlen, heads_kv, head_dim]``; q's dtype or ``torch.float8_e4m3fn``. Read through
            their strides: vLLM's flash layout ``[num_blocks, block_size, heads, D]`` as it lies, and a
            ``[num_blocks, heads, block_size, D]`` storage through ``.transpose(1, 2)``. (vLLM's older
            paged-attention layout, with K split in 16-byte chunks ``[blocks, heads, D/x, block, x]``, is
            not read.) ``heads_q % heads_kv == 0``: query head h reads KV head ``h // (heads_q // heads_kv)``.
        block_tables: int32 ``[batch, max_blocks]``: token t of sequence b lies in cache block
            ``block_tables[b, t // block_size]`` at slot ``t % block_size``; None for dense caches.
        seq_lens: int32 ``[batch]``, the tokens of each sequence in the cache, the new ones included;
            values are clamped to ``[0, max_blocks * block_size]`` (dense: the cache's seqlen; None there means
            every sequence is that long). Block table entries past a sequence's length are never read; the
            ones it covers are clamped into ``[0, num_blocks)``: a bad value reads a wrong block, never
            out of bounds (values are not checked: that would synchronize with the device).
        softmax_scale: default ``1 / sqrt(head_dim)``.
        num_splits: split-KV count (1..64); default: :func:`fly_attention.decode_config.decode_splits` from
            the batch, KV heads, the cache's capacity a sequence and the SM count.
        k_scale, v_scale: dequantization scales of the cache (the key is ``k_cache * k_scale``): a number or
            an fp32 tensor of one element (per tensor) or ``[heads_kv]`` (per KV head); any cache dtype,
            intended for fp8 caches.
        window: -1 (unbounded) or ``w >= 0``: the token at position p sees keys ``p - w <= j <= p``
            (flash_attn's ``window=(w, 0)``).
        softcap: ``> 0`` caps the scores: ``softcap * tanh(s / softcap)``; 0 is off.
        out: a preallocated output (q's shape and dtype, unit last stride), written and returned (for
            CUDA graphs: the call then allocates only the split workspace, sized from shapes).

    Returns:
        q's shape and dtype. Token i of ``q_len`` sits at position ``seq_len - q_len + i`` and sees keys
        ``j <= seq_len - q_len + i`` (bottom-right causal); a token that sees no key (``seq_len = 0``, or
        ``seq_len < q_len``) gives 0. No host synchronization: CUDA graph capture records it as is.

    Raises:
        flydsl.errors.ArgumentError / ShapeError / DTypeError / LayoutError / DeviceError naming the
        argument.

    Example::

        out = paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens)
        # q [64, 32, 128] bf16, caches [4096, 16, 8, 128] bf16, block_tables [64, 256] int32, seq_lens [64]
    """
    if torch.compiler.is_compiling():
        ks, k_mul = (k_scale, 1.0) if not isinstance(k_scale, numbers.Real) else (None, float(k_scale))
        vs, v_mul = (v_scale, 1.0) if not isinstance(v_scale, numbers.Real) else (None, float(v_scale))
        scale = None if softmax_scale is None else float(softmax_scale)
        args = (q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, ks, vs, k_mul, v_mul, int(window),
                float(softcap))  # fmt: skip
        if out is None:
            return torch.ops.fly_attention.paged_attention_decode(*args)
        torch.ops.fly_attention.paged_attention_decode_out(*args, out)
        return out
    if out is not None:  # the caller's buffer: the general path (a replay allocates its own)
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits, k_scale, v_scale,
                       window, softcap, out)  # fmt: skip
    return _REPLAYS.eager(_decode, q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, num_splits, k_scale,
                          v_scale, window, softcap, None)  # fmt: skip


# Plain eager calls replay their first call's launches (flydsl.direct): the checks, the config and split
# choice and the launch keying of the general path cost a decode call 100-180 us of host time on the H200
# host against ~45 for SDPA's cuDNN backend.
_REPLAYS = direct.Replays("fly_attention.paged_attention_decode")
