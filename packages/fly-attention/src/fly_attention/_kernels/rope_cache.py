"""Rotary embedding of q and k fused with the write of k and v into a paged KV cache: one kernel.

Program ``(t, c)`` serves token ``t`` and chunk ``c`` of ``BLOCK_H`` heads: the first ``q_chunks`` chunks are
query heads (rotated, written to the new q), the rest KV heads (k rotated, then k and v written into the
cache at ``slot_mapping[t]``: block ``slot // PAGE``, offset ``slot % PAGE``). The rotation pairs dim ``i``
of the first half of the rotary dims with ``i + ROT / 2`` (NeoX) or dims ``2i`` and ``2i + 1`` (GPT-J),
with ``cos_sin_cache[pos] = [cos(pos * f_i) for i < ROT / 2, sin(...)]``, in fp32; dims past ``ROT`` pass
through. A slot of -1 (padding) or outside the cache writes nothing; positions are clamped into the cos /
sin table, so no value makes an access out of bounds. fp8 caches get ``value / scale`` saturated to
+-448 and rounded to nearest even.
"""

from __future__ import annotations

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import cast_sat_fp8e4m3, row_offset

__all__ = ["launch_rope_cache"]

_FP8 = torch.float8_e4m3fn


@flyc.func
def _rotate_store(src, dst, heads_ok, cos, sin, scale, HALF: fx.constexpr, ROT: fx.constexpr,
                  HEAD_DIM: fx.constexpr, BLOCK_HALF: fx.constexpr, BLOCK_D: fx.constexpr, NEOX: fx.constexpr,
                  QUANT: fx.constexpr):  # fmt: skip
    """Head rows at ``src`` (a pointer a head: ``[BLOCK_H]``) rotated into the rows at ``dst``; ``dst``
    stores ``value / scale`` in fp8 when ``QUANT``."""
    ri = fx.arange(0, BLOCK_HALF)
    i_ok = heads_ok[:, None] & (ri < HALF)[None, :]
    if NEOX:
        i1 = ri
        i2 = ri + HALF
    else:
        i1 = 2 * ri
        i2 = 2 * ri + 1
    x1 = fx.load(src[:, None] + i1[None, :], mask=i_ok, other=0.0).to(fx.float32)
    x2 = fx.load(src[:, None] + i2[None, :], mask=i_ok, other=0.0).to(fx.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    ty = dst.dtype.element_ty
    if QUANT:
        o1 = cast_sat_fp8e4m3(o1 / scale[:, None])
        o2 = cast_sat_fp8e4m3(o2 / scale[:, None])
    fx.store(dst[:, None] + i1[None, :], o1.to(ty), mask=i_ok)
    fx.store(dst[:, None] + i2[None, :], o2.to(ty), mask=i_ok)
    if ROT < HEAD_DIM:  # partial rotary: the other dims pass through
        rd = fx.arange(0, BLOCK_D)
        p_ok = heads_ok[:, None] & ((rd >= ROT) & (rd < HEAD_DIM))[None, :]
        x = fx.load(src[:, None] + rd[None, :], mask=p_ok, other=0.0)
        if QUANT:
            x = cast_sat_fp8e4m3(x.to(fx.float32) / scale[:, None])
        fx.store(dst[:, None] + rd[None, :], x.to(ty), mask=p_ok)


# fmt: off
@flyc.kernel(do_not_specialize=["max_pos", "num_slots"])
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cs_ptr, pos_ptr, kc_ptr, vc_ptr, slot_ptr, qo_ptr, ks_ptr, vs_ptr,
    heads_q, heads_kv, q_chunks, max_pos, num_slots, k_mul, v_mul, ks_stride, vs_stride,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_qot, stride_qoh,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, ROT: fx.constexpr, BLOCK_D: fx.constexpr,
    BLOCK_DV: fx.constexpr, BLOCK_HALF: fx.constexpr, BLOCK_H: fx.constexpr, PAGE: fx.constexpr,
    NEOX: fx.constexpr, QUANT: fx.constexpr, K_SCALE: fx.constexpr, V_SCALE: fx.constexpr,
):
    # fmt: on
    t = fx.program_id(0)
    c = fx.program_id(1)
    HALF = ROT // 2
    pos = fx.load(pos_ptr + t).to(fx.int32)
    pos = fx.minimum(fx.maximum(pos, 0), max_pos - 1)
    ri = fx.arange(0, BLOCK_HALF)
    cs_row = cs_ptr + row_offset(pos, stride_cs)
    cos = fx.load(cs_row + ri, mask=ri < HALF, other=0.0).to(fx.float32)
    sin = fx.load(cs_row + HALF + ri, mask=ri < HALF, other=0.0).to(fx.float32)
    ones = fx.full([BLOCK_H], 1.0, dtype=fx.float32)
    if c < q_chunks:  # query heads: rotated into the new q
        h = c * BLOCK_H + fx.arange(0, BLOCK_H)
        src = q_ptr + row_offset(t, stride_qt) + row_offset(h, stride_qh)
        dst = qo_ptr + row_offset(t, stride_qot) + row_offset(h, stride_qoh)
        _rotate_store(src, dst, h < heads_q, cos, sin, ones, HALF, ROT, HEAD_DIM, BLOCK_HALF, BLOCK_D, NEOX, False)
    else:  # KV heads: k rotated, k and v into the cache
        slot = fx.load(slot_ptr + t).to(fx.int64)
        if (slot >= 0) & (slot < num_slots):
            blk = slot // PAGE
            off = slot - blk * PAGE
            h = (c - q_chunks) * BLOCK_H + fx.arange(0, BLOCK_H)
            h_ok = h < heads_kv
            k_sc = ones * k_mul
            v_sc = ones * v_mul
            if K_SCALE:
                k_sc = k_sc * fx.load(ks_ptr + h * ks_stride, mask=h_ok, other=1.0)
            if V_SCALE:
                v_sc = v_sc * fx.load(vs_ptr + h * vs_stride, mask=h_ok, other=1.0)
            src = k_ptr + row_offset(t, stride_kt) + row_offset(h, stride_kh)
            dst = kc_ptr + blk * stride_kcb + off * stride_kcs + row_offset(h, stride_kch)
            _rotate_store(src, dst, h_ok, cos, sin, k_sc, HALF, ROT, HEAD_DIM, BLOCK_HALF, BLOCK_D, NEOX, QUANT)
            rd = fx.arange(0, BLOCK_DV)
            v_ok = h_ok[:, None] & (rd < HEAD_DIM_V)[None, :]
            x = fx.load(v_ptr + row_offset(t, stride_vt) + row_offset(h, stride_vh)[:, None] + rd[None, :],
                        mask=v_ok, other=0.0)  # fmt: skip
            if QUANT:
                x = cast_sat_fp8e4m3(x.to(fx.float32) / v_sc[:, None])
            v_dst = vc_ptr + blk * stride_vcb + off * stride_vcs + row_offset(h, stride_vch)
            fx.store(v_dst[:, None] + rd[None, :], x.to(vc_ptr.dtype.element_ty), mask=v_ok)


@flyc.jit(skip_empty=False)
def launch_rope_cache(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, q_out, k_scale, v_scale,
                      k_mul: float, v_mul: float, is_neox: bool, stream=None):  # fmt: skip
    """Launch over ``T`` tokens: ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` (unit last strides),
    ``cos_sin_cache [max_pos, ROT]``, ``positions`` / ``slot_mapping`` ``[T]`` int32 or int64, caches
    ``[num_blocks, PAGE, Hkv, D or Dv]``, ``q_out`` like q. Scales as the decode's (tensors of 1 or Hkv
    fp32 elements or None, times ``k_mul`` / ``v_mul``)."""
    tokens, heads_q, head_dim = q.shape
    heads_kv, head_dim_v = k.shape[1], v.shape[-1]
    if tokens == 0:
        return
    rot = cos_sin_cache.shape[1]
    block_d = flyc.next_power_of_2(head_dim)
    # heads a program: about 4K elements of the widest row (one program's loads in flight)
    block_h = max(1, min(flyc.next_power_of_2(max(heads_q, heads_kv)), 4096 // max(block_d, 1)))
    q_chunks = flyc.cdiv(heads_q, block_h)
    kv_chunks = flyc.cdiv(heads_kv, block_h)
    page = k_cache.shape[1]
    # fmt: off
    flyc.launch(
        _rope_cache_kernel, (tokens, q_chunks + kv_chunks),
        q, k, v, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, q_out, k_scale, v_scale,
        heads_q, heads_kv, q_chunks, cos_sin_cache.shape[0], k_cache.shape[0] * page, k_mul, v_mul,
        k_scale.stride(0) if k_scale is not None and k_scale.numel() > 1 else 0,
        v_scale.stride(0) if v_scale is not None and v_scale.numel() > 1 else 0,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], cos_sin_cache.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *q_out.stride()[:2],
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, ROT=rot, BLOCK_D=block_d,
        BLOCK_DV=flyc.next_power_of_2(head_dim_v), BLOCK_HALF=max(1, flyc.next_power_of_2(rot // 2)),
        BLOCK_H=block_h, PAGE=page, NEOX=is_neox, QUANT=k_cache.dtype == _FP8,
        K_SCALE=k_scale is not None, V_SCALE=v_scale is not None, num_warps=4,
    )
    # fmt: on
