"""The seed library's builder, for users porting from it: :func:`build_flash_attn_func_module`.

It returns a launcher with the seed's calling convention, ``launch(q, k, v, o, batch, seqlen, *, q_descale=None,
k_descale=None, v_descale=None, stream=None)`` over ``[batch, seqlen, heads, head_dim]`` buffers (flat,
as the seed's ``q.view(-1)``, or 4-D), checks the buffers against the builder's parameters and serves the
call with :func:`fly_attention.flash_attn` (fp8 e4m3 with the launch's descales included). The seed's
dense self-attention has one seqlen for q and k, so its causal mask is the square lower triangle (no
corner-alignment question). Its kernel-choice knobs
(``num_kv_splits``: split-K of the KV loop on AMD) are accepted and have no effect on the result here.
"""

from __future__ import annotations

import numbers

import torch

import flydsl.compiler as flyc
from flydsl.checks import describe, dtype_name, parse_dtype
from flydsl.errors import ArgumentError, DTypeError, ShapeError

from .attention import IN_DTYPES, MAX_HEAD_DIM, flash_attn

__all__ = ["build_flash_attn_func_module"]


def _positive_int(name: str, v) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise ArgumentError(f"{name}: expected a positive int, got {v!r}")
    return int(v)


def _buffer(name: str, t, shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """``t`` as ``[batch, seqlen, heads, head_dim]``: a 4-D tensor of that shape (unit last stride), or a flat
    contiguous buffer of at least that many elements (the seed's ``.view(-1)``)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise DTypeError(f"{name}: expected dtype {dtype_name(dtype)} (the builder's), got {describe(t)}")
    n = shape[0] * shape[1] * shape[2] * shape[3]
    if t.dim() == 4 and tuple(t.shape) == shape:
        return t
    if t.dim() == 1 and t.is_contiguous() and t.numel() >= n:
        return t[:n].view(shape)
    raise ShapeError(f"{name}: expected [batch, seqlen, heads, head_dim] = {list(shape)} or a flat contiguous "
                     f"buffer of >= {n} elements, got {describe(t)}")  # fmt: skip


def build_flash_attn_func_module(
    num_heads: int,
    head_dim: int,
    causal: bool = False,
    dtype_str: str = "bf16",
    num_kv_heads: int | None = None,
    num_kv_splits: int = 1,
):
    """A launcher of dense flash attention forward for ``num_heads`` query heads of ``head_dim``.

    Args:
        num_heads: query heads. head_dim: 1..256 (q, k and v share it, as in the seed).
        causal: the lower-triangular mask (q and k have the same seqlen in this convention).
        dtype_str: "bf16" or "f16" / "fp16"; or "fp8": e4m3 q, k and v with per-tensor descales (the
            launch's ``q_descale`` etc.), o bf16 or fp16 (the attention of ``q * q_descale``, ... in fp32,
            written in o's dtype), served by :func:`fly_attention.flash_attn`'s fp8 forward.
        num_kv_heads: KV heads (default num_heads); must divide num_heads (GQA / MQA).
        num_kv_splits: the seed's split-K knob: accepted (>= 1), no effect here.

    Returns:
        ``launch(q, k, v, o, batch, seqlen, *, q_descale=None, k_descale=None, v_descale=None, stream=None)``:
        q, o ``[batch, seqlen, num_heads, head_dim]`` and k, v ``[batch, seqlen, num_kv_heads, head_dim]`` of
        dtype_str, each a 4-D tensor of exactly that shape or a flat contiguous buffer of at least that many
        elements (fp8: o bf16 or fp16); o is written in place. The descales (fp8 only; None elsewhere) are
        fp32 tensors of one element on q's device (read in the kernel: no host sync) or numbers; None is 1.
        ``stream``: a torch.cuda.Stream or None (the current stream).

    Raises:
        flydsl.errors.ArgumentError / DTypeError at build time for bad parameters; ShapeError / DTypeError
        naming the buffer at launch time when a buffer does not fit them.

    Example::

        exe = build_flash_attn_func_module(32, 128, causal=True, dtype_str="bf16", num_kv_heads=8)
        exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), batch, seqlen)
    """
    num_heads = _positive_int("num_heads", num_heads)
    head_dim = _positive_int("head_dim", head_dim)
    if head_dim > MAX_HEAD_DIM:
        raise ArgumentError(f"head_dim: expected 1..{MAX_HEAD_DIM}, got {head_dim}")
    num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ArgumentError(f"num_kv_heads: expected a divisor of num_heads = {num_heads} (GQA / MQA), "
                            f"got {num_kv_heads}")  # fmt: skip
    if not isinstance(causal, bool):
        raise ArgumentError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    _positive_int("num_kv_splits", num_kv_splits)
    dtype = parse_dtype("dtype_str", dtype_str)
    fp8 = dtype == torch.float8_e4m3fn
    if not fp8 and dtype not in IN_DTYPES:
        raise DTypeError(f"dtype_str: expected 'bf16', 'f16' or 'fp8', got {dtype_str!r}")

    @flyc.jit(skip_empty=False)  # the buffers are checked even when a launch has nothing to compute
    def launch_flash_attn(q, k, v, o, batch, seqlen, *, q_descale=None, k_descale=None, v_descale=None,
                          stream=None):  # fmt: skip
        for name, n in (("batch", batch), ("seqlen", seqlen)):
            if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
                raise ArgumentError(f"{name}: expected an int >= 0, got {n!r}")
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        if not fp8:
            for name, d in descales.items():
                if d is not None:
                    raise ArgumentError(f"{name}: descales belong to the fp8 path; this launcher was built for "
                                        f"{dtype_name(dtype)}, pass None")  # fmt: skip
        q_shape, kv_shape = (batch, seqlen, num_heads, head_dim), (batch, seqlen, num_kv_heads, head_dim)
        q4, k4, v4 = _buffer("q", q, q_shape, dtype), _buffer("k", k, kv_shape, dtype), _buffer("v", v, kv_shape, dtype)
        if not fp8:
            o4 = _buffer("o", o, q_shape, dtype)
            o4.copy_(flash_attn(q4, k4, v4, causal=causal))  # one extra pass over O: flash_attn allocates its output
            return
        if isinstance(o, torch.Tensor) and o.dtype not in IN_DTYPES:
            raise DTypeError(f"o: expected dtype bf16 or fp16 (the fp8 launcher's output), got {describe(o)}")
        o4 = _buffer("o", o, q_shape, o.dtype if isinstance(o, torch.Tensor) else torch.bfloat16)
        out_dtype = o4.dtype
        o4.copy_(flash_attn(q4, k4, v4, causal=causal, out_dtype=out_dtype, **descales))

    return launch_flash_attn
