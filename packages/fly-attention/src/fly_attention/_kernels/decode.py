"""The decode attention: a few new query tokens a sequence against its KV cache, paged or dense.

One program serves one (sequence, KV head, block of query rows, split). Its rows are the query heads of
the KV head's GQA group times the new tokens (row ``r``: token ``r // group``, head ``r % group`` of the
group), so every key and value row read from the cache serves the whole group at once. It walks its keys
``BLOCK_N`` at a time with the online softmax (fp32 running maximum and sum, in log2 units: the softmax
scale and ``log2(e)`` are folded into one multiply). Key token ``t`` of sequence ``b`` lies, paged, in
cache block ``block_tables[b, t // PAGE]`` at slot ``t % PAGE``; dense, at ``[b, t]``. Every K / V row is
read whole (head_dim contiguous elements: 16-byte vectors) at the address its strides give.

Masks: the new tokens are the last ``q_len`` positions of the sequence, so token ``i`` sits at position
``p = seq_len - q_len + i`` and sees keys ``j <= p`` (bottom-right causal, speculative decoding's rule),
and with a window ``w`` only ``j >= p - w``. A row that sees no key keeps ``m = -inf`` and ``l = 0``; the
maximum is guarded so that ``-inf - -inf`` never happens, and the row stores 0.

Split-KV (``SPLIT``): the key range of a (sequence, KV head) is cut into ``num_splits`` runs of whole
``BLOCK_N`` steps; each program writes its normalized partial output (fp32) and its log-sum-exp (log2
units, -inf for a split with no key), and :func:`_decode_merge_kernel` combines the splits of each row by
their log-sum-exp. Sequence lengths are read on the device (no host sync); they are clamped to the
cache's capacity and block table entries to the cache's blocks, so no value makes a read out of bounds.

fp8 e4m3 caches are read as bytes and converted to the query's dtype before the dots (exact: every e4m3
value is a bf16 and an fp16); the per-tensor or per-KV-head scales multiply the scores (K's) and the
output (V's).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .programs import head_block, softcap_tanh

__all__ = ["launch_decode", "UNBOUNDED"]

UNBOUNDED = 1 << 30  # a window that bounds nothing (positions stay in int32)
_LOG2E = 1.4426950408889634


# fmt: off
@flyc.kernel(do_not_specialize=["max_keys", "num_blocks"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, o_ptr, po_ptr, plse_ptr, ks_ptr, vs_ptr,
    heads_kv, group, q_len, row_blocks, num_splits, max_keys, num_blocks, win_left,
    qk_scale, cap_in, cap_out, k_mul, v_mul, ks_stride, vs_stride,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_sl, stride_ob, stride_os, stride_oh,
    HEAD_DIM: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr,
    PAGE: fx.constexpr, HAS_SEQ_LENS: fx.constexpr, SPLIT: fx.constexpr, MULTI_Q: fx.constexpr,
    WINDOWED: fx.constexpr, SOFTCAP: fx.constexpr, K_SCALE: fx.constexpr, V_SCALE: fx.constexpr,
):
    # fmt: on
    pid = fx.program_id(0)
    split = pid % num_splits
    rest = pid // num_splits
    rb = rest % row_blocks
    rest = rest // row_blocks
    h = rest % heads_kv
    b = rest // heads_kv

    seq_len = max_keys
    if HAS_SEQ_LENS:
        seq_len = fx.minimum(fx.maximum(fx.load(sl_ptr + b * stride_sl), 0), max_keys)

    rows = rb * BLOCK_M + fx.arange(0, BLOCK_M)
    rows_ok = rows < group * q_len
    qi = rows // group
    hq = h * group + (rows - qi * group)
    rd = fx.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM
    q_rows = row_offset(b, stride_qb) + row_offset(qi, stride_qs) + row_offset(hq, stride_qh)
    q = fx.load(q_ptr + q_rows[:, None] + rd[None, :], mask=rows_ok[:, None] & d_ok[None, :], other=0.0)

    # Positions of the rows' tokens; the keys any row of the program sees: [lo, seq_len)
    pos = seq_len - q_len + qi
    lo = 0
    if WINDOWED:
        first_q = fx.minimum(rb * BLOCK_M // group, q_len - 1)
        lo = fx.maximum(seq_len - q_len + first_q - win_left, 0)
    lo = lo // BLOCK_N * BLOCK_N
    steps = fx.cdiv(fx.maximum(seq_len - lo, 0), BLOCK_N)
    per_split = fx.cdiv(steps, num_splits)
    n_lo = lo + split * per_split * BLOCK_N
    n_hi = fx.minimum(seq_len, n_lo + per_split * BLOCK_N)

    k_sc = k_mul
    if K_SCALE:
        k_sc = k_sc * fx.load(ks_ptr + h * ks_stride)
    k_head = k_ptr + row_offset(h, stride_kh)
    v_head = v_ptr + row_offset(h, stride_vh)

    acc = fx.zeros([BLOCK_M, BLOCK_D], dtype=fx.float32)
    l_i = fx.zeros([BLOCK_M], dtype=fx.float32)
    m_i = fx.full([BLOCK_M], float("-inf"), dtype=fx.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        t = n0 + fx.arange(0, BLOCK_N)
        t_ok = t < n_hi
        if PAGE > 0:
            blk = fx.load(bt_ptr + row_offset(b, stride_bt) + t // PAGE, mask=t_ok, other=0)
            blk = fx.minimum(fx.maximum(blk, 0), num_blocks - 1)  # a bad entry reads a wrong block, never out of bounds
            k_rows = row_offset(blk, stride_kb) + row_offset(t % PAGE, stride_ks)
            v_rows = row_offset(blk, stride_vb) + row_offset(t % PAGE, stride_vs)
        else:
            k_rows = row_offset(b, stride_kb) + row_offset(t, stride_ks)
            v_rows = row_offset(b, stride_vb) + row_offset(t, stride_vs)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = fx.load(k_head + k_rows[:, None] + rd[None, :], mask=kv_mask, other=0.0)
        v = fx.load(v_head + v_rows[:, None] + rd[None, :], mask=kv_mask, other=0.0)
        s = fx.dot(q, fx.trans(k.to(q.dtype))) * k_sc  # fp32 scores of the dequantized keys
        if SOFTCAP:  # cap * tanh(s * scale / cap), then into log2 units
            s = softcap_tanh(s * cap_in) * cap_out
        else:
            s = s * qk_scale
        ok = t_ok[None, :]
        if MULTI_Q:
            ok = ok & (t[None, :] <= pos[:, None])
        if WINDOWED:
            ok = ok & (t[None, :] >= (pos - win_left)[:, None])
        s = fx.where(ok, s, float("-inf"))
        m_new = fx.maximum(m_i, fx.max(s, 1))
        # A row that has seen no key yet subtracts 0 instead of -inf: p and alpha are then exp2(-inf) = 0.
        m_use = fx.where(m_new == float("-inf"), 0.0, m_new)
        p = fx.exp2(s - m_use[:, None])
        alpha = fx.exp2(m_i - m_use)
        l_i = l_i * alpha + fx.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = fx.dot(p.to(q.dtype), v.to(q.dtype), acc)
        m_i = m_new

    seen = l_i != 0.0  # no key: 0 (lse -inf); a NaN score: NaN, which the split merge keeps
    v_sc = v_mul
    if V_SCALE:
        v_sc = v_sc * fx.load(vs_ptr + h * vs_stride)
    out = acc * (v_sc / fx.where(seen, l_i, 1.0))[:, None]
    if SPLIT:
        # partials [batch, q_len, heads_q, num_splits, BLOCK_D] fp32, lse [batch, q_len, heads_q, num_splits]
        heads_q = heads_kv * group
        prow = ((b * q_len + qi).to(fx.int64) * heads_q + hq) * num_splits + split
        fx.store(po_ptr + (prow * BLOCK_D)[:, None] + rd[None, :], out, mask=rows_ok[:, None])
        lse = fx.where(seen, m_i + fx.log2(fx.where(seen, l_i, 1.0)), float("-inf"))
        fx.store(plse_ptr + prow, lse, mask=rows_ok)
    else:
        o_rows = row_offset(b, stride_ob) + row_offset(qi, stride_os) + row_offset(hq, stride_oh)
        fx.store(o_ptr + o_rows[:, None] + rd[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=rows_ok[:, None] & d_ok[None, :])  # fmt: skip


@flyc.kernel
def _decode_merge_kernel(
    po_ptr, plse_ptr, o_ptr, heads_q, q_len, num_splits, stride_ob, stride_os, stride_oh,
    HEAD_DIM: fx.constexpr, BLOCK_D: fx.constexpr, SPLITS: fx.constexpr,
):  # fmt: skip
    """One output row (sequence, token, query head): its splits weighted by ``exp2(lse_s - max lse)``.
    Splits with no key carry lse -inf and weigh 0; a row none of whose splits saw a key stores 0."""
    row = fx.program_id(0)  # (b * q_len + qi) * heads_q + hq
    hq = row % heads_q
    bq = row // heads_q
    qi = bq % q_len
    b = bq // q_len
    rs = fx.arange(0, SPLITS)
    rd = fx.arange(0, BLOCK_D)
    s_ok = rs < num_splits
    lse = fx.load(plse_ptr + row_offset(row, num_splits) + rs, mask=s_ok, other=float("-inf"))
    m = fx.max(lse, 0)
    m = fx.where(m == float("-inf"), 0.0, m)
    w = fx.exp2(lse - m)  # 0 for empty splits and the padding
    den = fx.sum(w, 0)
    part = fx.load(po_ptr + (row_offset(row, num_splits) + rs)[:, None] * BLOCK_D + rd[None, :],
                   mask=(s_ok & (w > 0.0))[:, None], other=0.0)  # fmt: skip
    out = fx.sum(part * w[:, None], 0) / fx.where(den > 0.0, den, 1.0)
    o_base = o_ptr + row_offset(b, stride_ob) + row_offset(qi, stride_os) + row_offset(hq, stride_oh)
    fx.store(o_base + rd, out.to(o_ptr.dtype.element_ty), mask=rd < HEAD_DIM)


@flyc.jit(skip_empty=False)
def launch_decode(q, k_cache, v_cache, block_tables, seq_lens, out, partial, partial_lse, k_scale, v_scale,
                  k_mul: float, v_mul: float, softmax_scale: float, window: int, softcap: float, num_splits: int,
                  block_m: int, cfg, stream=None):  # fmt: skip
    """Launch the decode (and, with ``num_splits > 1``, the merge).

    ``q [B, q_len, Hq, D]`` and ``out`` alike (unit last strides); caches paged ``[num_blocks, PAGE, Hkv,
    D]`` with ``block_tables [B, max_blocks]`` int32, or dense ``[B, S, Hkv, D]`` (``block_tables`` None);
    ``seq_lens`` int32 ``[B]`` or None (every sequence the cache's length). ``partial`` fp32
    ``[B, q_len, Hq, num_splits, BLOCK_D]`` and ``partial_lse`` fp32 ``[B, q_len, Hq, num_splits]`` (None
    without splits). ``k_scale`` / ``v_scale``: fp32 tensors of 1 or Hkv elements, or None; ``k_mul`` /
    ``v_mul`` multiply them (a scale given as a number). ``cfg``: a :class:`DecodeConfig`.
    """
    batch, q_len, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    if batch == 0 or q_len == 0 or heads_q == 0:
        return
    paged = block_tables is not None
    if paged:
        page = k_cache.shape[1]
        max_keys = block_tables.shape[1] * page
        num_blocks = k_cache.shape[0]
        stride_bt = block_tables.stride(0)
    else:
        page, max_keys, num_blocks, stride_bt = 0, k_cache.shape[1], 1, 0
    rows = group * q_len
    row_blocks = flyc.cdiv(rows, block_m)
    block_d = head_block(head_dim)
    split = num_splits > 1
    if softcap > 0:
        cap_in, cap_out = softmax_scale / softcap, softcap * _LOG2E
    else:
        cap_in, cap_out = 1.0, 1.0
    grid = (batch * heads_kv * row_blocks * num_splits,)
    sob, sos, soh = out.stride()[:3]
    # fmt: off
    flyc.launch(
        _decode_kernel, grid,
        q, k_cache, v_cache, block_tables, seq_lens, out, partial, partial_lse, k_scale, v_scale,
        heads_kv, group, q_len, row_blocks, num_splits, max_keys, num_blocks, window if window >= 0 else UNBOUNDED,
        softmax_scale * _LOG2E, cap_in, cap_out, k_mul, v_mul,
        k_scale.stride(0) if k_scale is not None and k_scale.numel() > 1 else 0,
        v_scale.stride(0) if v_scale is not None and v_scale.numel() > 1 else 0,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        stride_bt, seq_lens.stride(0) if seq_lens is not None else 0, sob, sos, soh,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg.block_n, PAGE=page,
        HAS_SEQ_LENS=seq_lens is not None, SPLIT=split, MULTI_Q=q_len > 1, WINDOWED=window >= 0,
        SOFTCAP=softcap > 0, K_SCALE=k_scale is not None, V_SCALE=v_scale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        flyc.launch(
            _decode_merge_kernel, (batch * q_len * heads_q,),
            partial, partial_lse, out, heads_q, q_len, num_splits, sob, sos, soh,
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=flyc.next_power_of_2(num_splits),
            num_warps=4 if block_d * num_splits <= 4096 else 8,
        )
    # fmt: on
