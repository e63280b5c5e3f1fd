"""``flash_attn`` and ``flash_attn_varlen``: flash attention for fp16 / bf16, forward and backward, and the
fp8 (e4m3) forward of ``flash_attn`` with per-tensor descales.

In the order of the family's files: the kernels live in :mod:`._kernels.flash_fwd` and
:mod:`._kernels.flash_bwd`, the config choice in :mod:`.autotune`, then the host API below: argument checks
(every bad input is named before anything launches), allocation and dispatch; then the ``torch.library``
custom ops (with fake implementations, so ``torch.compile(fullgraph=True)`` traces them) with their
registered autograd, an eager ``autograd.Function`` for calls outside tracing, and the public functions.
The backward recomputes the probabilities from the forward's log-sum-exp, which a differentiable call
always writes; it uses no atomics, so its result is deterministic.
"""

from __future__ import annotations

import math
import numbers

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl.checks import check_same_device, check_tensor, describe, dtype_name
from flydsl.errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError, UnsupportedError

from ._kernels.flash_bwd import launch_flash_bwd
from ._kernels.flash_fwd import launch_flash_fwd
from ._kernels.flash_fwd_fp8 import launch_flash_fwd_fp8
from ._kernels.flash_fwd_tma import launch_flash_fwd_tma, tma_addressable
from ._seqlens import offsets_span
from .autotune import AttnBwdConfig, AttnConfig, bwd_config_for, bwd_config_valid, config_for, config_valid

__all__ = ["flash_attn", "flash_attn_varlen", "IN_DTYPES", "FP8_DTYPES", "FP8_OUT_DTYPES", "MAX_HEAD_DIM"]

IN_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn,)  # the fp8 forward's inputs (e5m2 is refused by name)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)  # its outputs; bf16 by default
MAX_HEAD_DIM = 256  # registers and shared memory of one program: the Q tile, the output tile and K / V tiles


# ------------------------------------------------------------------ checks


def _options(causal, softmax_scale, window, softcap) -> tuple[int, int]:
    """Check the options; the window as (left, right) with causal folded in (right = 0)."""
    if not isinstance(causal, bool):
        raise ArgumentError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    if softmax_scale is not None and (
        not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)
        or not math.isfinite(softmax_scale)
    ):  # fmt: skip
        raise ArgumentError(f"softmax_scale: expected None or a finite number, got {softmax_scale!r}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):  # fmt: skip
        raise ArgumentError(f"window: expected a pair of ints (left, right), -1 for unbounded, got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ArgumentError(f"window: each side must be >= -1 (-1: unbounded), got {tuple(window)!r}")
    if (not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not math.isfinite(softcap)
            or softcap < 0):  # fmt: skip
        raise ArgumentError(f"softcap: expected a finite number >= 0 (0: off), got {softcap!r}")
    if causal:  # flash-attention 2's rule: causal is the window with right = 0
        right = 0
    return left, right


def _check_deterministic(deterministic) -> None:
    if not isinstance(deterministic, bool):
        raise ArgumentError(f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}")


def _check_qkv(q, k, v, varlen: bool, dtypes=IN_DTYPES) -> None:
    """dtype, rank, device, strides, and the batch / sequence / head / head-dim agreement of q, k, v."""
    ndim = 3 if varlen else 4
    layout = "[total_tokens, heads, head_dim]" if varlen else "[batch, seqlen, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{name}: expected a torch.Tensor {layout}, got {type(t).__name__}")
        check_tensor(name, t, dtypes=dtypes)
        if t.dim() != ndim:
            raise ShapeError(f"{name}: expected a {ndim}-D tensor {layout}, got {describe(t)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise DTypeError(f"{name}: expected dtype {dtype_name(q.dtype)} (q's), got {describe(t)}")
    check_same_device(q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise LayoutError(f"{name}: expected a unit stride in the last (head_dim) dimension, got {describe(t)}")
    if not varlen and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ShapeError(f"k, v: expected batch {q.shape[0]} (q's), got k {describe(k)} and v {describe(v)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ShapeError(f"v: expected the sequence and heads of k {tuple(k.shape[:-1])}, got {describe(v)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or hq % hkv:
        raise ShapeError(f"k: expected a number of heads that divides q's {hq} (GQA / MQA), got {describe(k)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ShapeError(f"k: expected head_dim {d} (q's), got {describe(k)}")
    for name, t in (("q", q), ("v", v)):
        if not 1 <= t.shape[-1] <= MAX_HEAD_DIM:
            raise ShapeError(f"{name}: expected a head_dim in 1..{MAX_HEAD_DIM}, got {describe(t)}")


def _check_cu_seqlens(cu_q, cu_k, q, k, max_seqlen_q, max_seqlen_k) -> tuple[int, tuple[int, int] | None]:
    """cu_seqlens int32 ``[batch + 1]`` on q's device, non-decreasing, inside the packed tokens, and no
    sequence longer than its max_seqlen. Returns the batch and the query tokens the sequences cover
    (``(cu_q[0], cu_q[-1])``; None while tracing, capturing a CUDA graph or on meta tensors, where the values
    go unchecked). The values are checked once per offsets tensor (:func:`._seqlens.offsets_span`)."""
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        check_tensor(name, t, dtypes=(torch.int32,), ndim=1)
        if t.device != q.device:
            raise DeviceError(f"{name}: expected a tensor on {q.device} (q's device), got {describe(t)}")
        if t.numel() < 1:
            raise ShapeError(f"{name}: expected [batch + 1] offsets (at least one), got {describe(t)}")
    if cu_q.numel() != cu_k.numel():
        raise ShapeError(f"cu_seqlens_k: expected {cu_q.numel()} offsets (batch + 1, as cu_seqlens_q), got "
                         f"{describe(cu_k)}")  # fmt: skip
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 0:
            raise ArgumentError(f"{name}: expected an int >= 0, got {m!r}")
    batch = cu_q.numel() - 1
    if q.is_meta or torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return batch, None  # values unknown while tracing or on meta tensors; no host sync inside a CUDA graph
    # one host sync the first time these offsets tensors are seen, none after (_seqlens)
    span = offsets_span(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    return batch, span[:2]


# ------------------------------------------------------------------ config and launch


# The served configs (autotune.config_for / bwd_config_for): a searched winner, the shipped artifact's or the
# default, memoised there (one dict lookup a launch). Module names, so that tests can substitute them.
_config_for = config_for
_bwd_config_for = bwd_config_for


def _resolve(config, q, d, dv, sq, sk, causal, cls, lookup, valid, what: str):
    """A launch config: the given one, checked (its type, then ``valid``), or ``lookup``'s answer for the
    shape's buckets (sequence lengths to the next power of two), checked the same way."""
    arch = flydsl.arch.current(q.device)
    if config is None:
        config = lookup(d, dv, flyc.next_power_of_2(max(sq, 1)), flyc.next_power_of_2(max(sk, 1)), causal, q.dtype,
                        arch)  # fmt: skip
    elif not isinstance(config, cls):
        raise ArgumentError(f"config: expected None or a fly_attention.autotune.{cls.__name__}, got "
                            f"{type(config).__name__}")  # fmt: skip
    if not valid(config, d, dv, q.dtype, arch):
        raise ArgumentError(f"config: {config} is not a valid {what} config for head dims {d} / {dv}, "
                            f"{dtype_name(q.dtype)} on {arch.name}")  # fmt: skip
    return config


def _config(q, d, dv, sq, sk, causal, config) -> AttnConfig:
    return _resolve(config, q, d, dv, sq, sk, causal, AttnConfig, _config_for, config_valid, "launch")


# The outputs' allocation, one name for tests to poison (an element the kernel should write and did not
# then fails the comparison as NaN).
_empty = torch.empty


def _scale(softmax_scale, d) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)


def _launch_fwd(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, batch, left, right, scale, softcap, cfg):
    """The 16-bit forward's launch: the TMA kernel for ``cfg.tma`` where TMA can address every tensor, else
    the pointer kernel (with the same tiles: its result is the same to rounding)."""
    if cfg.tma and tma_addressable(q, k, v, out):  # (the lse is stored through pointers)
        launch = launch_flash_fwd_tma
    else:
        launch = launch_flash_fwd
    launch(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, batch, left, right, scale, softcap, cfg)


def _flash_attn(q, k, v, causal, softmax_scale, left, right, softcap, return_lse, config=None):
    """Check, allocate and launch the dense forward: (out ``[B, Sq, Hq, Dv]``, lse ``[B, Hq, Sq]`` fp32, or
    an empty ``[0]`` tensor without ``return_lse``)."""
    _check_qkv(q, k, v, varlen=False)
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    out = _empty(b, sq, hq, dv, dtype=q.dtype, device=q.device)
    lse = _empty(b, hq, sq if return_lse else 0, dtype=torch.float32, device=q.device)
    if q.is_meta:
        return out, (lse if return_lse else lse.new_empty(0))
    cfg = _config(q, d, dv, sq, sk, causal, config)
    _launch_fwd(q, k, v, out, lse if return_lse else None, None, None, sq, sk, b, left, right,
                _scale(softmax_scale, d), float(softcap), cfg)  # fmt: skip
    return out, (lse if return_lse else lse.new_empty(0))


def _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, left, right, softcap, return_lse,
                       config=None):  # fmt: skip
    """Check, allocate and launch the packed forward: (out ``[total_q, Hq, Dv]``, lse ``[Hq, total_q]`` fp32,
    or an empty ``[0]`` tensor without ``return_lse``)."""
    _check_qkv(q, k, v, varlen=True)
    batch, span = _check_cu_seqlens(cu_q, cu_k, q, k, max_q, max_k)
    total_q, hq, d = q.shape
    dv = v.shape[-1]
    out = _empty(total_q, hq, dv, dtype=q.dtype, device=q.device)
    lse = _empty(hq, total_q if return_lse else 0, dtype=torch.float32, device=q.device)
    # Tokens before the first sequence and after the last belong to none: they read 0 and lse -inf (the
    # sequences are consecutive, so nothing lies between them).
    first, last = span if span is not None else (0, 0)
    if span is None or first > 0 or last < total_q:
        for lo, hi in ((0, first), (last, total_q)) if span is not None else ((0, total_q),):
            out[lo:hi] = 0
            if return_lse:
                lse[:, lo:hi] = float("-inf")
    if q.is_meta:
        return out, (lse if return_lse else lse.new_empty(0))
    cfg = _config(q, d, dv, max_q, max_k, causal, config)
    _launch_fwd(q, k, v, out, lse if return_lse else None, cu_q, cu_k, max_q, max_k, batch, left, right,
                _scale(softmax_scale, d), float(softcap), cfg)  # fmt: skip
    return out, (lse if return_lse else lse.new_empty(0))


# ------------------------------------------------------------------ fp8 forward


def _is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_fp8_qkv(q, k, v) -> None:
    """All three e4m3 (e5m2 refused by name, no mix with 16-bit inputs), then as :func:`_check_qkv`."""
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e5m2:
            raise DTypeError(f"{name}: fp8 e5m2 is not supported; the fp8 forward takes float8_e4m3fn, got "
                             f"{describe(t)}")  # fmt: skip
    first = next(name for name, t in tensors if _is_fp8(t))
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype not in FP8_DTYPES:
            raise DTypeError(f"{name}: expected float8_e4m3fn like {first} (q, k and v are all fp8 or all 16-bit), "
                             f"got {describe(t)}")  # fmt: skip
    _check_qkv(q, k, v, varlen=False, dtypes=FP8_DTYPES)


def _descale(name: str, s, device) -> tuple[torch.Tensor | None, float]:
    """A per-tensor descale as (the tensor the kernel reads, or None; the factor the host folds in): None is
    1; a Python number is folded on the host (no tensor, no launch); a tensor is fp32 of one element (shape
    ``[1]``, the seed's ABI, or ``[]``) on q's device, read in the kernel (no host sync)."""
    if s is None:
        return None, 1.0
    if isinstance(s, numbers.Real) and not isinstance(s, bool):
        if not math.isfinite(s):
            raise ArgumentError(f"{name}: expected a finite number, got {s!r}")
        return None, float(s)
    if not isinstance(s, torch.Tensor):
        raise ArgumentError(f"{name}: expected None, a number or an fp32 tensor of shape [1], got "
                            f"{type(s).__name__} {s!r}")  # fmt: skip
    check_tensor(name, s, dtypes=(torch.float32,))
    if s.numel() != 1 or s.dim() > 1:
        raise ShapeError(f"{name}: expected one value (an fp32 tensor of shape [1]), got {describe(s)}")
    if s.device != device:
        raise DeviceError(f"{name}: expected a tensor on {device} (q's device), got {describe(s)}")
    return s, 1.0


def _fp8_out_dtype(out_dtype) -> torch.dtype:
    if out_dtype is None:
        return torch.bfloat16
    if out_dtype not in FP8_OUT_DTYPES:
        raise DTypeError(f"out_dtype: expected None (bf16), torch.bfloat16 or torch.float16 for fp8 inputs, got "
                         f"{out_dtype!r}")  # fmt: skip
    return out_dtype


def _v_transposed(v: torch.Tensor, block_n: int) -> torch.Tensor:
    """V as the fp8 kernel's P @ V dot reads it, K-major: ``[B, Hkv, Dv, Sk_pad]``, the keys zero-padded to a
    whole number of ``block_n`` key blocks (a multiple of 16 bytes, so every row is 16-byte aligned).

    A copy a call: one read and one write of V (at B 4, Hkv 32, Sk 4096, D 128: 64 MB each way, tens of
    microseconds at HBM speed, against about a millisecond of fp8 attention at that size; it shrinks
    against the kernel as the sequence grows, the kernel being quadratic in it)."""
    b, sk, hkv, dv = v.shape
    sk_pad = -(-sk // block_n) * block_n
    vt = torch.empty(b, hkv, dv, sk_pad, dtype=v.dtype, device=v.device)
    vt[..., :sk].copy_(v.permute(0, 2, 3, 1))
    if sk_pad > sk:  # the padded keys get p = 0, so they must be finite (garbage bytes may read as NaN)
        vt[..., sk:].view(torch.uint8).zero_()
    return vt


def _flash_attn_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, left, right, softcap,
                    return_lse, out_dtype=None, config=None):  # fmt: skip
    """Check, allocate and launch the fp8 forward: (out ``[B, Sq, Hq, Dv]`` in ``out_dtype``, lse ``[B, Hq,
    Sq]`` fp32 or an empty ``[0]`` tensor without ``return_lse``)."""
    _check_fp8_qkv(q, k, v)
    qd, qf = _descale("q_descale", q_descale, q.device)
    kd, kf = _descale("k_descale", k_descale, q.device)
    vd, vf = _descale("v_descale", v_descale, q.device)
    dtype = _fp8_out_dtype(out_dtype)
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    out = _empty(b, sq, hq, dv, dtype=dtype, device=q.device)
    lse = _empty(b, hq, sq if return_lse else 0, dtype=torch.float32, device=q.device)
    lse_out = lse if return_lse else lse.new_empty(0)
    if q.is_meta or b == 0 or sq == 0:
        return out, lse_out
    cfg = _config(q, d, dv, sq, sk, causal, config)
    launch_flash_fwd_fp8(q, k, _v_transposed(v, cfg.block_n), out, lse if return_lse else None, qd, kd, vd, sk,
                         left, right, _scale(softmax_scale, d), float(softcap), qf * kf, vf, cfg)  # fmt: skip
    return out, lse_out


def _bwd_config(q, d, dv, sq, sk, causal, config) -> AttnBwdConfig:
    return _resolve(config, q, d, dv, sq, sk, causal, AttnBwdConfig, _bwd_config_for, bwd_config_valid,
                    "backward launch")  # fmt: skip


def _grad_out(dout, out):
    """The output's gradient as the kernels read it: out's shape and dtype, a unit last stride (autograd may
    hand an expanded or strided one)."""
    if dout.shape != out.shape:
        raise ShapeError(f"dout: expected the output's shape {tuple(out.shape)}, got {describe(dout)}")
    if dout.dtype != out.dtype:
        dout = dout.to(out.dtype)
    if dout.stride(-1) != 1 and dout.shape[-1] > 1:
        dout = dout.contiguous()
    return dout


def _grads_like(q, k, v):
    """(dq, dk, dv): unwritten buffers of q's, k's and v's shapes and dtypes (through ``_empty``, which tests
    poison)."""
    return tuple(_empty(*t.shape, dtype=t.dtype, device=q.device) for t in (q, k, v))


def _flash_attn_bwd(dout, q, k, v, out, lse, causal, softmax_scale, left, right, softcap, config=None):
    """The dense backward: (dq, dk, dv) shaped as q, k, v (contiguous), from the forward's out and lse
    ``[B, Hq, Sq]``."""
    dout = _grad_out(dout, out)
    b, sq, hq, d = q.shape
    sk, dv_ = k.shape[1], v.shape[-1]
    dq, dk, dv = _grads_like(q, k, v)
    if q.is_meta:
        return dq, dk, dv
    if sq == 0 or b == 0:  # no query row: no gradient reaches the keys
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    delta = torch.empty_like(lse)
    cfg = _bwd_config(q, d, dv_, sq, sk, causal, config)
    launch_flash_bwd(dout, q, k, v, out, lse, delta, dq, dk, dv, None, None, sq, sk, b, left, right,
                     _scale(softmax_scale, d), float(softcap), cfg)  # fmt: skip
    return dq, dk, dv


def _flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale, left, right,
                           softcap, config=None):  # fmt: skip
    """The packed backward: (dq, dk, dv) shaped as q, k, v, from the forward's out and lse ``[Hq, total_q]``.
    Tokens outside every sequence get 0."""
    dout = _grad_out(dout, out)
    d, dv_ = q.shape[-1], v.shape[-1]
    batch = cu_q.numel() - 1
    dq, dk, dv = _grads_like(q, k, v)
    if q.is_meta:
        return dq, dk, dv
    # Tokens before the first sequence and after the last are zeroed here (the sequences are consecutive);
    # without the offsets' values (inside a CUDA graph capture: no host sync) everything is zeroed first.
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        spans = None
    else:  # checked and kept by the forward (the same offsets tensors): no host sync here
        spans = list(offsets_span(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k))
    for t, span in ((dq, spans[:2] if spans else None), (dk, spans[2:] if spans else None),
                    (dv, spans[2:] if spans else None)):  # fmt: skip
        if span is None:
            t.zero_()
        else:
            t[: span[0]] = 0
            t[span[1] :] = 0
    if batch == 0 or max_q == 0:  # no query row in any sequence: no gradient reaches the keys
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    delta = torch.empty_like(lse)
    cfg = _bwd_config(q, d, dv_, max_q, max_k, causal, config)
    launch_flash_bwd(dout, q, k, v, out, lse, delta, dq, dk, dv, cu_q, cu_k, max_q, max_k, batch, left, right,
                     _scale(softmax_scale, d), float(softcap), cfg)  # fmt: skip
    return dq, dk, dv


# ------------------------------------------------------------------ custom ops

# Defined through torch.library.Library (not custom_op), as fly-gemm does: custom_op's kernel imports
# torch._dynamo on its first eager call (seconds).
_LIB = torch.library.Library("fly_attention", "DEF")
_LIB.define(
    "flash_attn_fwd(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, int window_left, "
    "int window_right, float softcap, bool return_lse) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.define(
    "flash_attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, bool causal, float? softmax_scale, int window_left, int window_right, "
    "float softcap, bool return_lse) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _fwd_op(q, k, v, causal, softmax_scale, window_left, window_right, softcap, return_lse):
    return _flash_attn(q, k, v, causal, softmax_scale, window_left, window_right, softcap, return_lse)


def _varlen_op(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left, window_right, softcap,
               return_lse):  # fmt: skip
    return _flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left, window_right,
                              softcap, return_lse)  # fmt: skip


_LIB.define(
    "flash_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
    "float? softmax_scale, int window_left, int window_right, float softcap) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.define(
    "flash_attn_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, "
    "float? softmax_scale, int window_left, int window_right, float softcap) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)

_LIB.define(
    "flash_attn_fp8_fwd(Tensor q, Tensor k, Tensor v, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, "
    "bool causal, float? softmax_scale, int window_left, int window_right, float softcap, bool return_lse, "
    "ScalarType out_dtype) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _fp8_op(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, window_left, window_right, softcap,
            return_lse, out_dtype):  # fmt: skip
    return _flash_attn_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, window_left,
                           window_right, softcap, return_lse, out_dtype)  # fmt: skip


_LIB.impl("flash_attn_fp8_fwd", _fp8_op, "CompositeExplicitAutograd")
_LIB.impl("flash_attn_fwd", _fwd_op, "CompositeExplicitAutograd")
_LIB.impl("flash_attn_varlen_fwd", _varlen_op, "CompositeExplicitAutograd")
_LIB.impl("flash_attn_bwd", _flash_attn_bwd, "CompositeExplicitAutograd")
_LIB.impl("flash_attn_varlen_bwd", _flash_attn_varlen_bwd, "CompositeExplicitAutograd")


@torch.library.register_fake("fly_attention::flash_attn_fwd", lib=_LIB)
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, return_lse):
    b, sq, hq, _ = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1])
    lse = q.new_empty(b, hq, sq, dtype=torch.float32) if return_lse else q.new_empty(0, dtype=torch.float32)
    return out, lse


@torch.library.register_fake("fly_attention::flash_attn_fp8_fwd", lib=_LIB)
def _(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, window_left, window_right, softcap,
      return_lse, out_dtype):  # fmt: skip
    b, sq, hq, _ = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1], dtype=out_dtype)
    lse = q.new_empty(b, hq, sq, dtype=torch.float32) if return_lse else q.new_empty(0, dtype=torch.float32)
    return out, lse


@torch.library.register_fake("fly_attention::flash_attn_varlen_fwd", lib=_LIB)
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left, window_right, softcap, return_lse):
    total, hq, _ = q.shape
    out = q.new_empty(total, hq, v.shape[-1])
    lse = q.new_empty(hq, total, dtype=torch.float32) if return_lse else q.new_empty(0, dtype=torch.float32)
    return out, lse


@torch.library.register_fake("fly_attention::flash_attn_bwd", lib=_LIB)
def _(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("fly_attention::flash_attn_varlen_bwd", lib=_LIB)
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left, window_right, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ------------------------------------------------------------------ autograd


def _grad_needed(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _setup_context(ctx, inputs, output):
    """Save what the backward reads: q, k, v, the output and its lse (the probabilities are recomputed
    from them); the lse output is not differentiable."""
    out, lse = output
    return_lse = inputs[-1]
    if not return_lse:  # the public functions always ask for it when a gradient is needed
        raise UnsupportedError("flash attention backward: the forward must write its lse for the backward; "
                               "call the op with return_lse=True")  # fmt: skip
    ctx.mark_non_differentiable(lse)
    ctx.varlen = len(inputs) == 13
    if ctx.varlen:
        q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, _ = inputs
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.max_seqlens = (max_q, max_k)
    else:
        q, k, v, causal, scale, left, right, softcap, _ = inputs
        ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (causal, scale, left, right, softcap)
    ctx.eager = False  # through the op (traced, meta): its backward goes through the op too


def _backward(ctx, dout, dlse):
    """dq, dk, dv through the backward kernels (the lse's gradient, if any, is ignored: it is marked not
    differentiable); none for the options or cu_seqlens."""
    del dlse
    if ctx.varlen:
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        args = (dout, q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, *ctx.options)
        # traced: the op, not its body (the backward is traced too); eager: the body, no dispatcher
        fn = _flash_attn_varlen_bwd if ctx.eager else torch.ops.fly_attention.flash_attn_varlen_bwd
        dq, dk, dv = fn(*args)
        return dq, dk, dv, *(None,) * 10
    q, k, v, out, lse = ctx.saved_tensors
    fn = _flash_attn_bwd if ctx.eager else torch.ops.fly_attention.flash_attn_bwd
    dq, dk, dv = fn(dout, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, *(None,) * 6


torch.library.register_autograd("fly_attention::flash_attn_fwd", _backward, setup_context=_setup_context, lib=_LIB)
torch.library.register_autograd("fly_attention::flash_attn_varlen_fwd", _backward, setup_context=_setup_context,
                                lib=_LIB)  # fmt: skip


class _EagerFlashAttn(torch.autograd.Function):
    """The dense op's autograd outside tracing, without the dispatcher (the op's generated autograd
    redispatches and rebuilds its arguments on every call)."""

    # forward takes ctx itself (no separate setup_context): with one, Function.apply binds its arguments
    # through inspect.signature on every call.
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, left, right, softcap, return_lse):
        inputs = (q, k, v, causal, scale, left, right, softcap, return_lse)
        output = _flash_attn(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.eager = True
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


class _EagerFlashAttnVarlen(torch.autograd.Function):
    """The packed op's autograd outside tracing (as :class:`_EagerFlashAttn`)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, return_lse):
        inputs = (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, return_lse)
        output = _flash_attn_varlen(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.eager = True
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


# ------------------------------------------------------------------ public functions


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    deterministic: bool = False,
    q_descale: torch.Tensor | float | None = None,
    k_descale: torch.Tensor | float | None = None,
    v_descale: torch.Tensor | float | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Flash attention: ``softmax(mask(softcap(q k^T * softmax_scale))) v``, accumulated in fp32, and
    differentiable in q, k and v (fp16 / bf16); an fp8 e4m3 forward with per-tensor descales.

    Args:
        q: ``[batch, seqlen_q, heads_q, head_dim]``, fp16 or bf16; any strides with a unit last one (a
            ``[batch, heads, seqlen, head_dim]`` tensor's ``.transpose(1, 2)`` is read in place, no copy).
        k: ``[batch, seqlen_k, heads_kv, head_dim]``, q's dtype; ``heads_q % heads_kv == 0`` (GQA / MQA:
            query head h reads KV head ``h // (heads_q // heads_kv)``).
        v: ``[batch, seqlen_k, heads_kv, head_dim_v]``; head_dim_v may differ from head_dim (e.g. 192 / 128).
            Head dims 1..256 (64, 80, 96, 128, 192, 256 the intended ones; others padded to a power of two).
        causal: row i sees keys ``j <= i + seqlen_k - seqlen_q`` (aligned to the bottom-right corner).
        softmax_scale: default ``1 / sqrt(head_dim)``.
        window: ``(left, right)`` sliding window: row i sees ``i + off - left <= j <= i + off + right`` with
            ``off = seqlen_k - seqlen_q``; -1 leaves a side unbounded. With causal, right is 0.
        softcap: ``> 0`` caps the scores: ``softcap * tanh(s / softcap)`` before masking; 0 is off.
        return_lse: also return the log-sum-exp of the scaled scores, natural log, fp32 ``[batch, heads_q,
            seqlen_q]``. It is not differentiable (marked so: a gradient through it does not reach q, k, v).
        deterministic: accepted for flash-attention's API; the backward uses no atomics (dK / dV summed over
            a GQA group in registers, dQ by a program per query block), so both values give the same bits
            run to run.
        q_descale, k_descale, v_descale: fp8 only: the per-tensor dequantization factors of q, k, v (the
            attention is that of ``q * q_descale``, ...): fp32 tensors of shape ``[1]`` on q's device, read
            in the kernel (no host sync; CUDA-graph safe), or Python numbers; None is 1.
        out_dtype: fp8 only: the output's dtype, ``torch.bfloat16`` (default) or ``torch.float16``. For
            fp16 / bf16 inputs only None or q's dtype.

    fp8 (``torch.float8_e4m3fn`` q, k and v): both dots on fp8 tensor cores with fp32 accumulation: the
    scores times ``q_descale * k_descale * softmax_scale``, an fp32 online softmax, the probabilities
    rounded to e4m3 for ``P @ V`` (a relative rounding of up to 2^-4 each), the output times ``v_descale``.
    Forward only (a tensor that requires grad is refused), dense only (not :func:`flash_attn_varlen`); GQA,
    causal, windows, softcap and ``return_lse`` work as for 16-bit inputs. Each call makes a transposed
    copy of v (``[B, Hkv, Dv, Sk]``, the layout Hopper's fp8 tensor cores read for ``P @ V``): one extra read
    and write of v. e5m2 and mixes of fp8 with 16-bit inputs are refused.

    Returns:
        ``out [batch, seqlen_q, heads_q, head_dim_v]`` (contiguous, q's dtype), and ``lse`` with
        ``return_lse``. A row that sees no key (seqlen_q > seqlen_k under causal, or a window) gives 0
        and lse -inf. Meta tensors give meta outputs.

    Raises:
        flydsl.errors.ArgumentError / ShapeError / DTypeError / LayoutError / DeviceError naming the
        argument.

    Gradients (fp16 / bf16, fp32 accumulation): ``dq``, ``dk``, ``dv`` (GQA / MQA: summed over the group),
    through the ``fly_attention::flash_attn_fwd`` custom op's registered autograd, so
    ``torch.compile(fullgraph=True)`` traces forward and backward. A differentiable call always writes the
    lse (the backward recomputes the probabilities from it). Rows that see no key get dq 0.

    Example::

        out = flash_attn(q, k, v, causal=True)   # q [2, 1024, 32, 128], k / v [2, 1024, 8, 128] bf16
        out.backward(grad)                       # q.grad, k.grad, v.grad
    """
    left, right = _options(causal, softmax_scale, window, softcap)
    _check_deterministic(deterministic)
    if (_is_fp8(q) or _is_fp8(k) or _is_fp8(v) or q_descale is not None or k_descale is not None
            or v_descale is not None or out_dtype is not None):  # fmt: skip
        return _flash_attn_fp8_public(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, left, right,
                                      softcap, return_lse, out_dtype)  # fmt: skip
    grad = _grad_needed(q, k, v)
    want_lse = return_lse or grad  # the backward reads it
    if torch.compiler.is_compiling():
        scale = None if softmax_scale is None else float(softmax_scale)  # the schema's float?, not an int
        out, lse = torch.ops.fly_attention.flash_attn_fwd(q, k, v, causal, scale, left, right, float(softcap),
                                                          want_lse)  # fmt: skip
    elif grad:
        out, lse = _EagerFlashAttn.apply(q, k, v, causal, softmax_scale, left, right, float(softcap), True)
    else:  # the direct route: no dispatcher
        out, lse = _flash_attn(q, k, v, causal, softmax_scale, left, right, softcap, return_lse)
    return (out, lse) if return_lse else out


def _flash_attn_fp8_public(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, left, right, softcap,
                           return_lse, out_dtype):  # fmt: skip
    """flash_attn's fp8 route (and its refusals of descales or an out_dtype with 16-bit inputs)."""
    if not (_is_fp8(q) or _is_fp8(k) or _is_fp8(v)):
        if out_dtype is not None and (not isinstance(q, torch.Tensor) or out_dtype != q.dtype):
            raise ArgumentError(f"out_dtype: fp16 / bf16 inputs give q's dtype; out_dtype other than None or q's "
                                f"dtype is for fp8 inputs, got {out_dtype!r}")  # fmt: skip
        for name, s in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
            if s is not None:
                kind = dtype_name(q.dtype) if isinstance(q, torch.Tensor) else type(q).__name__
                raise ArgumentError(f"{name}: descales are for fp8 (float8_e4m3fn) inputs; q is {kind}")
        return flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale, window=(left, right),
                          softcap=softcap, return_lse=return_lse)  # fmt: skip
    for name, t in (("q", q), ("k", k), ("v", v)):
        if _grad_needed(t):
            raise UnsupportedError(f"{name}: the fp8 forward has no backward; got a tensor that requires grad "
                                   f"({describe(t)}); detach it or use fp16 / bf16 inputs")  # fmt: skip
    if torch.compiler.is_compiling():
        # the op's schema takes descales as tensors: numbers become one-element tensors in the graph
        ds = [torch.full((1,), float(s), dtype=torch.float32, device=q.device)
              if isinstance(s, numbers.Real) and not isinstance(s, bool) else s
              for s in (q_descale, k_descale, v_descale)]  # fmt: skip
        scale = None if softmax_scale is None else float(softmax_scale)
        out, lse = torch.ops.fly_attention.flash_attn_fp8_fwd(q, k, v, *ds, causal, scale, left, right,
                                                              float(softcap), return_lse,
                                                              _fp8_out_dtype(out_dtype))  # fmt: skip
    else:
        out, lse = _flash_attn_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, left, right,
                                   softcap, return_lse, out_dtype)  # fmt: skip
    return (out, lse) if return_lse else out


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Flash attention over packed sequences of different lengths, differentiable in q, k and v.

    Args:
        q: ``[total_q, heads_q, head_dim]``; k ``[total_k, heads_kv, head_dim]``; v ``[total_k, heads_kv,
            head_dim_v]`` (dtypes, strides and heads as :func:`flash_attn`).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on q's device, non-decreasing: sequence b is
            tokens ``cu[b]:cu[b + 1]`` (empty sequences allowed).
        max_seqlen_q, max_seqlen_k: at least the longest sequence of each (the grid's size).
        causal, softmax_scale, window, softcap: as :func:`flash_attn`, the causal / window alignment taken
            per sequence (its own seqlen_k - seqlen_q).
        return_lse: also return the fp32 lse ``[heads_q, total_q]`` (natural log; not differentiable).
        deterministic: as :func:`flash_attn`: the backward uses no atomics, both values give the same bits.

    Returns:
        ``out [total_q, heads_q, head_dim_v]`` (and ``lse``). Tokens outside every sequence read 0 (lse -inf).
        The value checks of cu_seqlens take one host synchronization (the backward takes one more, for the
        tokens outside every sequence, whose gradients are 0). Gradients as :func:`flash_attn`'s, none for
        cu_seqlens.

    Example::

        cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device=q.device)
        out = flash_attn_varlen(q, k, v, cu, cu, 12, 12, causal=True)
    """
    left, right = _options(causal, softmax_scale, window, softcap)
    _check_deterministic(deterministic)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if _is_fp8(t):
            raise UnsupportedError(f"{name}: fp8 attention is dense only (flash_attn); flash_attn_varlen takes "
                                   f"fp16 / bf16, got {describe(t)}")  # fmt: skip
    grad = _grad_needed(q, k, v)
    if torch.compiler.is_compiling():
        scale = None if softmax_scale is None else float(softmax_scale)
        out, lse = torch.ops.fly_attention.flash_attn_varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal, scale, left, right,
            float(softcap), return_lse or grad,
        )  # fmt: skip
    elif grad:
        out, lse = _EagerFlashAttnVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal, softmax_scale, left, right, float(softcap), True)  # fmt: skip
    else:
        out, lse = _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      softmax_scale, left, right, softcap, return_lse)  # fmt: skip
    return (out, lse) if return_lse else out
