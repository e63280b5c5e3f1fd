"""What the attention kernels share on the device: which (batch, head, block) a program owns, its
sequence's bounds, a head's base pointer, the softcap's tanh (both directions recompute the same
scores, so they must share it), and the 16-bit forwards' online-softmax step.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

__all__ = ["block_program", "sequence_bounds", "head_base", "softcap_tanh", "online_update", "head_block"]


def head_block(head_dim: int, least: int = 16) -> int:
    """The tile width of a head dimension: its next power of two, at least ``least`` (a tensor-core dot's
    smallest K: 16, 32 for fp8; a head dim below it, down to 1, is padded and masked like 80 or 192). The one
    rule for every kernel and for the host buffers sized to a kernel's tile."""
    return max(least, flyc.next_power_of_2(head_dim))


@flyc.func
def block_program(pid, blocks, heads, LAST_FIRST: fx.constexpr):
    """(batch, head, block) of program ``pid`` on a one-axis grid of ``blocks`` blocks a (batch, head):
    the blocks of one (batch, head) are neighbours (they share its K and V, or Q and dO, through L2); with
    ``LAST_FIRST`` they run last block first (under causal, the query block with the most keys)."""
    bh = pid // blocks
    block = pid - bh * blocks
    if LAST_FIRST:
        block = blocks - 1 - block
    b = bh // heads
    return b, bh - b * heads, block


@flyc.func
def sequence_bounds(b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN: fx.constexpr):
    """(first query token, first key token, seqlen_q, seqlen_k) of sequence ``b``: the dense batch's
    (0, 0, as given), or, ``VARLEN``, read from ``cu_seqlens`` (the lengths given are then the maxima that
    sized the grid)."""
    q_start = 0
    k_start = 0
    if VARLEN:
        q_start = fx.load(cu_q_ptr + b)
        seqlen_q = fx.load(cu_q_ptr + b + 1) - q_start
        k_start = fx.load(cu_k_ptr + b)
        seqlen_k = fx.load(cu_k_ptr + b + 1) - k_start
    return q_start, k_start, seqlen_q, seqlen_k


@flyc.func
def head_base(ptr, b, start, h, stride_b, stride_s, stride_h):
    """The address of token ``start`` of head ``h`` in batch ``b`` (64-bit offsets)."""
    return ptr + row_offset(b, stride_b) + row_offset(start, stride_s) + row_offset(h, stride_h)


@flyc.func
def softcap_tanh(x):
    """tanh(x) in fp32 from one exp2: 1 - 2 / (e^(2x) + 1) (saturates to +-1 without NaN: e^(2x) = inf
    gives 1, 0 gives -1)."""
    return 1.0 - 2.0 / (fx.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@flyc.func
def online_update(
    acc, l_i, m_i, q, k, v, n0, seqlen_k, rows, lo_off, hi_off, qk_scale, cap_in, cap_out,
    BLOCK_N: fx.constexpr, MASKED: fx.constexpr, SOFTCAP: fx.constexpr,
):  # fmt: skip
    """The online-softmax update of (acc, l, m) by the key block at ``n0``, its K and V tiles loaded (by
    pointers or tensor descriptors): scores in log2 units, the edge mask (window edges, the diagonal, keys
    past ``seqlen_k``) where ``MASKED``, the running maximum and sum, ``acc`` rescaled and P @ V added."""
    s = fx.dot(q, fx.trans(k))  # fp32
    if SOFTCAP:  # cap * tanh(s * scale / cap), then into log2 units
        s = softcap_tanh(s * cap_in) * cap_out
    else:
        s = s * qk_scale
    if MASKED:
        rn = n0 + fx.arange(0, BLOCK_N)
        ok = (rn[None, :] >= (rows + lo_off)[:, None]) & (rn[None, :] <= (rows + hi_off)[:, None])
        ok = ok & (rn < seqlen_k)[None, :]
        s = fx.where(ok, s, float("-inf"))
    m_new = fx.maximum(m_i, fx.max(s, 1))
    # A row that has seen no key yet subtracts 0 instead of -inf: p and alpha are then exp2(-inf) = 0,
    # never exp2(-inf - -inf) = NaN.
    m_use = fx.where(m_new == float("-inf"), 0.0, m_new)
    p = fx.exp2(s - m_use[:, None])
    alpha = fx.exp2(m_i - m_use)
    l_i = l_i * alpha + fx.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = fx.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new
