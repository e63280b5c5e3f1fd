"""The flash attention forward: ``O = softmax(mask(softcap(Q K^T * scale))) V`` and its log-sum-exp.

One program computes a ``BLOCK_M`` block of query rows of one (batch, head)
and walks the keys in ``BLOCK_N`` steps with the online softmax: a running
row maximum ``m`` and sum ``l`` in fp32, the accumulator rescaled by
``exp2(m_old - m_new)`` when the maximum grows. The softmax scale and
``log2(e)`` are folded into one multiply so the exponentials are ``exp2``.

Masks: a query row ``i`` sees the keys ``j`` with
``i + off - left <= j <= i + off + right`` and ``j < seqlen_k``, where
``off = seqlen_k - seqlen_q`` aligns the diagonal to the bottom-right
corner (the host gives causal as ``right = 0`` and an unbounded side as a
large number). From those bounds each program derives, for its block of
rows, the key range it must visit at all (blocks fully masked for every row
are skipped) and the blocks inside it that every row sees whole: those run
without any mask; only the edge blocks (the window's left edge, the
diagonal, the ragged end of the keys) compute the mask. A row that sees no
key keeps ``m = -inf`` and ``l = 0``; the maximum is guarded so that
``-inf - -inf`` never happens, and such a row stores 0 and an lse of -inf.

Operands are read through pointers and their strides in place (any strides
with a unit last one: ``[B, S, H, D]`` or a ``[B, H, S, D]`` storage seen
through a transpose). Head dims that are not powers of two are padded to
the next one in registers and masked. GQA / MQA: query head ``h`` reads KV
head ``h // group``. Varlen (``VARLEN``): the batch index picks a sequence
of the packed tokens through ``cu_seqlens``; programs past its end return.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .programs import block_program, head_base, head_block, online_update, sequence_bounds

__all__ = ["launch_flash_fwd", "forward_arguments", "key_blocks", "UNBOUNDED"]

# The window side that bounds nothing: far past any sequence, and i + off +- UNBOUNDED stays in int32 for
# sequences up to 2^30 tokens.
UNBOUNDED = 1 << 30
_LOG2E = 1.4426950408889634
_LN2 = fx.constexpr(0.6931471805599453)  # a kernel reads module globals only as constexpr


@flyc.func
def _attend(
    acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows, lo_off, hi_off,
    qk_scale, cap_in, cap_out,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_N: fx.constexpr, MASKED: fx.constexpr, SOFTCAP: fx.constexpr,
):  # fmt: skip
    """One key block at ``n0``: scores, the (edge) mask, the online-softmax update of (acc, l, m)."""
    rn = n0 + fx.arange(0, BLOCK_N)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    k_ptrs = k_base + row_offset(rn, stride_ks)[:, None] + rd[None, :]
    v_ptrs = v_base + row_offset(rn, stride_vs)[:, None] + rdv[None, :]
    if MASKED:  # the ragged end of the keys may lie in this block
        n_ok = rn < seqlen_k
        k = fx.load(k_ptrs, mask=n_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)
        v = fx.load(v_ptrs, mask=n_ok[:, None] & (rdv < HEAD_DIM_V)[None, :], other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = fx.load(k_ptrs)
    else:
        k = fx.load(k_ptrs, mask=(rd < HEAD_DIM)[None, :], other=0.0)
    if not MASKED:
        if BLOCK_DV == HEAD_DIM_V:
            v = fx.load(v_ptrs)
        else:
            v = fx.load(v_ptrs, mask=(rdv < HEAD_DIM_V)[None, :], other=0.0)
    return online_update(acc, l_i, m_i, q, k, v, n0, seqlen_k, rows, lo_off, hi_off, qk_scale, cap_in, cap_out,
                         BLOCK_N, MASKED, SOFTCAP)  # fmt: skip


@flyc.func
def key_blocks(m0, seqlen_q, seqlen_k, win_left, win_right, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr):
    """The key walk of the query rows ``[m0, m0 + BLOCK_M)``: ``(lo_off, hi_off, kv_start, full_lo, full_hi,
    kv_end)``. Row i sees keys ``[i + lo_off, i + hi_off]`` (and ``< seqlen_k``); blocks outside ``[kv_start,
    kv_end)`` are skipped; ``[full_lo, full_hi)`` are the blocks every row sees whole (run unmasked); the rest
    are the masked edges. The fp8 forward walks the keys the same way."""
    off = seqlen_k - seqlen_q
    lo_off = off - win_left
    hi_off = off + win_right
    m_last = m0 + BLOCK_M - 1  # rows past seqlen_q widen the ranges only (they are never stored)
    # Keys any row of the block sees: [kv_start, kv_end); whole blocks outside are skipped. Clamped at 0
    # before dividing: integer division of negatives rounds differently compiled and interpreted.
    kv_start = fx.maximum(m0 + lo_off, 0) // BLOCK_N * BLOCK_N
    kv_end = fx.maximum(fx.minimum(seqlen_k, m_last + hi_off + 1), 0)
    # Blocks every row sees whole: [full_lo, full_hi), run unmasked.
    full_lo = fx.maximum(kv_start, fx.cdiv(fx.maximum(m_last + lo_off, 0), BLOCK_N) * BLOCK_N)
    full_lo = fx.minimum(full_lo, kv_end)
    full_hi = fx.maximum(fx.minimum(seqlen_k, m0 + hi_off + 1), 0) // BLOCK_N * BLOCK_N
    full_hi = fx.maximum(full_hi, full_lo)
    return lo_off, hi_off, kv_start, full_lo, full_hi, kv_end


# fmt: off
@flyc.kernel(do_not_specialize=["seqlen_q", "seqlen_k"])
def _flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
    seqlen_q, seqlen_k, heads, group, num_m, win_left, win_right, qk_scale, cap_in, cap_out,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, WINDOWED: fx.constexpr, SOFTCAP: fx.constexpr,
    VARLEN: fx.constexpr, STORE_LSE: fx.constexpr,
):
    # fmt: on
    # One grid axis (no 65535 cap on batch * heads): the query blocks of one (batch, head) are neighbours
    # (they share its K and V through L2), the last block first (under causal the longest).
    b, h, pid_m = block_program(fx.program_id(0), num_m, heads, True)
    h_kv = h // group
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    rows = m0 + fx.arange(0, BLOCK_M)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    q_base = head_base(q_ptr, b, q_start, h, stride_qb, stride_qs, stride_qh)
    k_base = head_base(k_ptr, b, k_start, h_kv, stride_kb, stride_ks, stride_kh)
    v_base = head_base(v_ptr, b, k_start, h_kv, stride_vb, stride_vs, stride_vh)
    m_ok = rows < seqlen_q
    q = fx.load(q_base + row_offset(rows, stride_qs)[:, None] + rd[None, :],
                mask=m_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)  # fmt: skip

    lo_off, hi_off, kv_start, full_lo, full_hi, kv_end = key_blocks(m0, seqlen_q, seqlen_k, win_left, win_right,
                                                                  BLOCK_M, BLOCK_N)

    acc = fx.zeros([BLOCK_M, BLOCK_DV], dtype=fx.float32)
    l_i = fx.zeros([BLOCK_M], dtype=fx.float32)
    m_i = fx.full([BLOCK_M], float("-inf"), dtype=fx.float32)
    if WINDOWED:  # the left edge of a window: masked
        for n0 in range(kv_start, full_lo, BLOCK_N):
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows,
                                    lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                                    BLOCK_DV, BLOCK_N, True, SOFTCAP)  # fmt: skip
    for n0 in range(full_lo, full_hi, BLOCK_N):  # the inner blocks: no mask at all
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows,
                                lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                                BLOCK_N, False, SOFTCAP)  # fmt: skip
    for n0 in range(full_hi, kv_end, BLOCK_N):  # the diagonal / right edge and the ragged end: masked
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows,
                                lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                                BLOCK_N, True, SOFTCAP)  # fmt: skip

    seen = l_i != 0.0  # rows that saw no key store 0 and lse -inf (a NaN score: NaN, as torch)
    out = acc / fx.where(seen, l_i, 1.0)[:, None]
    o_base = head_base(o_ptr, b, q_start, h, stride_ob, stride_os, stride_oh)
    fx.store(o_base + row_offset(rows, stride_os)[:, None] + rdv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (rdv < HEAD_DIM_V)[None, :])  # fmt: skip
    if STORE_LSE:  # natural log: (m + log2 l) * ln 2
        lse = fx.where(seen, (m_i + fx.log2(fx.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
        l_base = lse_ptr + row_offset(b, stride_lb) + row_offset(h, stride_lh) + q_start
        fx.store(l_base + rows, lse, mask=m_ok)


@flyc.jit(skip_empty=False)
def launch_flash_fwd(q, k, v, out, lse, cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int, batch: int,
                     win_left: int, win_right: int, softmax_scale: float, softcap: float, cfg,
                     stream=None):  # fmt: skip
    """Launch the forward over ``batch`` sequences.

    Dense (``cu_q`` None): ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``, ``out
    [B, Sq, Hq, Dv]``, ``lse [B, Hq, Sq]`` fp32 or None. Varlen: the same without the batch dimension
    (``[total, H, D]``), ``lse [Hq, total_q]``, ``cu_q`` / ``cu_k`` int32 ``[batch + 1]``. Every last
    stride is 1. ``win_left`` / ``win_right``: the window after the host's normalization (causal is
    ``win_right = 0``; -1 is unbounded). ``cfg``: a :class:`fly_attention.autotune.AttnConfig`.
    """
    if max_seqlen_q == 0 or batch == 0:
        return
    grid, args, meta = forward_arguments(q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, batch, win_left,
                                         win_right, softmax_scale, softcap, cfg)  # fmt: skip
    flyc.launch(_flash_fwd_kernel, grid, *args, **meta)


def forward_arguments(q, k, v, out, lse, cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int, batch: int,
                      win_left: int, win_right: int, softmax_scale: float, softcap: float, cfg):  # fmt: skip
    """(grid, runtime arguments, constexprs and launch options) of a 16-bit forward launch, arguments as
    :func:`launch_flash_fwd`'s: the pointer kernel's and the TMA kernel's parameters (the latter adds its
    own options)."""
    varlen = cu_q is not None
    heads, head_dim = q.shape[-2], q.shape[-1]
    group = heads // k.shape[-2]
    head_dim_v = v.shape[-1]
    left = win_left if win_left >= 0 else UNBOUNDED
    right = win_right if win_right >= 0 else UNBOUNDED
    if softcap > 0:
        cap_in, cap_out = softmax_scale / softcap, softcap * _LOG2E
    else:
        cap_in, cap_out = 1.0, 1.0
    if varlen:
        sqb = skb = svb = sob = slb = 0
        (sqs, sqh), (sks, skh), (svs, svh), (sos, soh) = (t.stride()[:2] for t in (q, k, v, out))
    else:
        sqb, sqs, sqh = q.stride()[:3]
        skb, sks, skh = k.stride()[:3]
        svb, svs, svh = v.stride()[:3]
        sob, sos, soh = out.stride()[:3]
        slb = lse.stride(0) if lse is not None else 0
    slh = (lse.stride(-2) if varlen else lse.stride(1)) if lse is not None else 0
    num_m = flyc.cdiv(max_seqlen_q, cfg.block_m)
    args = (q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, heads, group, num_m, left, right,
            softmax_scale * _LOG2E, cap_in, cap_out, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb,
            slh)  # fmt: skip
    meta = dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=head_block(head_dim),
        BLOCK_DV=head_block(head_dim_v), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        WINDOWED=win_left >= 0, SOFTCAP=softcap > 0, VARLEN=varlen, STORE_LSE=lse is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return (num_m * batch * heads,), args, meta
