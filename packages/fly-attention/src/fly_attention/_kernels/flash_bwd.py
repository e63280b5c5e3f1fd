"""The flash attention backward: ``dQ``, ``dK``, ``dV`` from ``dO``, recomputing the probabilities.

Three launches, none with atomics, so the result is deterministic by construction:

1. ``delta = rowsum(dO * O)`` in fp32, one value per query row (:func:`_bwd_delta_kernel`);
2. ``dK`` / ``dV`` (:func:`_bwd_dkdv_kernel`): a program per (key block, batch * KV head) holds its K and V
   tiles and walks the query blocks that see them. Per block it recomputes ``P = exp(S - lse)`` from Q, K
   and the forward's lse (natural log, turned into log2 units here as the forward's exp2 does), then
   ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)`` (times softcap's ``1 - tanh^2``) and
   ``dK += dS^T Q``; ``dK`` takes the softmax scale once at the end. Under GQA / MQA the program loops over
   the group's query heads, so ``dK`` / ``dV`` are summed over the group in registers and stored once;
3. ``dQ`` (:func:`_bwd_dq_kernel`): a program per (query block, batch * query head) walks its key blocks
   exactly as the forward does: ``dQ += dS K``, times the scale at the end.

Masks are the forward's: query row ``i`` sees keys ``j`` with ``i + lo_off <= j <= i + hi_off`` and
``j < seqlen_k``. Seen from a key block, the rows that see any of its keys are ``[j0 - hi_off, j1 -
lo_off]``; blocks no row sees are skipped, blocks every (row, key) pair sees run without a mask, only the
edges compute it. Rows that saw no key carry lse ``-inf``; it is read as ``+inf`` so their P is
``exp2(-inf) = 0`` (never ``-inf - -inf``), and their dQ is 0. Rows past the sequence's end read Q, dO and
delta as 0 and lse as ``+inf``: they add nothing.

Operands are read through pointers and strides, head dims padded to powers of two and masked, varlen
through ``cu_seqlens``: all as in :mod:`.flash_fwd`.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .flash_fwd import UNBOUNDED
from .programs import block_program, head_base, head_block, sequence_bounds, softcap_tanh

__all__ = ["launch_flash_bwd"]

_LOG2E = 1.4426950408889634
_LOG2E_C = fx.constexpr(1.4426950408889634)  # a kernel reads module globals only as constexpr


# fmt: off
@flyc.kernel(do_not_specialize=["seqlen_q"])
def _bwd_delta_kernel(
    o_ptr, do_ptr, delta_ptr, cu_q_ptr, seqlen_q, heads, num_m,
    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh, stride_lb, stride_lh,
    HEAD_DIM_V: fx.constexpr, BLOCK_DV: fx.constexpr, BLOCK_M: fx.constexpr, VARLEN: fx.constexpr,
):
    # fmt: on
    b, h, pid_m = block_program(fx.program_id(0), num_m, heads, False)
    q_start, _, seqlen_q, _ = sequence_bounds(b, cu_q_ptr, cu_q_ptr, seqlen_q, seqlen_q, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    rows = m0 + fx.arange(0, BLOCK_M)
    rdv = fx.arange(0, BLOCK_DV)
    ok = (rows < seqlen_q)[:, None] & (rdv < HEAD_DIM_V)[None, :]
    o_base = head_base(o_ptr, b, q_start, h, stride_ob, stride_os, stride_oh)
    do_base = head_base(do_ptr, b, q_start, h, stride_db, stride_ds, stride_dh)
    o = fx.load(o_base + row_offset(rows, stride_os)[:, None] + rdv[None, :], mask=ok, other=0.0)
    do = fx.load(do_base + row_offset(rows, stride_ds)[:, None] + rdv[None, :], mask=ok, other=0.0)
    delta = fx.sum(o.to(fx.float32) * do.to(fx.float32), 1)
    l_base = delta_ptr + row_offset(b, stride_lb) + row_offset(h, stride_lh) + q_start
    fx.store(l_base + rows, delta, mask=rows < seqlen_q)


@flyc.func
def _dkdv_step(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, m0, seqlen_q, rn,
    lo_off, hi_off, qk_scale, cap_in, cap_out,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_M: fx.constexpr, MASKED: fx.constexpr, SOFTCAP: fx.constexpr,
):  # fmt: skip
    """One query block at ``m0`` against the program's key block, transposed (keys as rows): dK, dV
    updated."""
    rows = m0 + fx.arange(0, BLOCK_M)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    m_ok = rows < seqlen_q
    # Q read transposed ([BLOCK_D, BLOCK_M]): the score tile's dot takes it as its B operand as it lies
    qt = fx.load(q_base + rd[:, None] + row_offset(rows, stride_qs)[None, :],
                 mask=(rd < HEAD_DIM)[:, None] & m_ok[None, :], other=0.0)  # fmt: skip
    do = fx.load(do_base + row_offset(rows, stride_ds)[:, None] + rdv[None, :],
                 mask=m_ok[:, None] & (rdv < HEAD_DIM_V)[None, :], other=0.0)  # fmt: skip
    lse = fx.load(lse_base + rows, mask=m_ok, other=float("inf"))
    # log2 units; a row that saw no key (-inf) reads +inf: its P is exp2(s - inf) = 0
    lse2 = fx.where(lse == float("-inf"), float("inf"), lse * _LOG2E_C)
    delta = fx.load(delta_base + rows, mask=m_ok, other=0.0)
    st = fx.dot(k, qt)  # [BLOCK_N, BLOCK_M] fp32
    if SOFTCAP:
        t = softcap_tanh(st * cap_in)
        st = t * cap_out
    else:
        st = st * qk_scale
    if MASKED:
        ok = (rn[:, None] >= (rows + lo_off)[None, :]) & (rn[:, None] <= (rows + hi_off)[None, :])
        st = fx.where(ok, st, float("-inf"))
    pt = fx.exp2(st - lse2[None, :])
    dv = fx.dot(pt.to(do.dtype), do, dv)
    dpt = fx.dot(v, fx.trans(do))  # [BLOCK_N, BLOCK_M] fp32
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        dst = dst * (1.0 - t * t)
    dk = fx.dot(dst.to(qt.dtype), fx.trans(qt), dk)
    return dk, dv


# fmt: off
@flyc.kernel(do_not_specialize=["seqlen_q", "seqlen_k"])
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr,
    seqlen_q, seqlen_k, heads_kv, group, num_n, win_left, win_right, qk_scale, cap_in, cap_out, dk_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_lb, stride_lh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, SOFTCAP: fx.constexpr, VARLEN: fx.constexpr,
):
    # fmt: on
    b, h_kv, pid_n = block_program(fx.program_id(0), num_n, heads_kv, False)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    rn = n0 + fx.arange(0, BLOCK_N)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    n_ok = rn < seqlen_k
    k_base = head_base(k_ptr, b, k_start, h_kv, stride_kb, stride_ks, stride_kh)
    v_base = head_base(v_ptr, b, k_start, h_kv, stride_vb, stride_vs, stride_vh)
    k = fx.load(k_base + row_offset(rn, stride_ks)[:, None] + rd[None, :],
                mask=n_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    v = fx.load(v_base + row_offset(rn, stride_vs)[:, None] + rdv[None, :],
                mask=n_ok[:, None] & (rdv < HEAD_DIM_V)[None, :], other=0.0)  # fmt: skip

    off = seqlen_k - seqlen_q
    lo_off = off - win_left
    hi_off = off + win_right
    n_last = n0 + BLOCK_N - 1
    # Query rows that see any key of the block: [m_start, m_end) (whole query blocks from m_start).
    m_start = fx.maximum(n0 - hi_off, 0) // BLOCK_M * BLOCK_M
    m_end = fx.maximum(fx.minimum(seqlen_q, n_last - lo_off + 1), 0)
    # Query blocks whose every row sees every key of the block: [full_lo, full_hi), run unmasked (rows past
    # seqlen_q add nothing, so the row range may be padded up to a whole block).
    full_lo = fx.maximum(m_start, fx.cdiv(fx.maximum(n_last - hi_off, 0), BLOCK_M) * BLOCK_M)
    full_lo = fx.minimum(full_lo, fx.cdiv(m_end, BLOCK_M) * BLOCK_M)
    full_hi = fx.maximum(n0 - lo_off + 1, 0) // BLOCK_M * BLOCK_M
    full_hi = fx.minimum(full_hi, fx.cdiv(m_end, BLOCK_M) * BLOCK_M)
    full_hi = fx.maximum(full_hi, full_lo)
    # Keys past seqlen_k (the ragged end) need no mask here: they read K = V = 0 and only ever reach their
    # own rows of dK / dV (row j of dS^T Q is column j of dS), which are never stored.

    dk = fx.zeros([BLOCK_N, BLOCK_D], dtype=fx.float32)
    dv = fx.zeros([BLOCK_N, BLOCK_DV], dtype=fx.float32)
    for g in range(0, group):  # the group's query heads: dK / dV summed here, no atomics
        h = h_kv * group + g
        q_base = head_base(q_ptr, b, q_start, h, stride_qb, stride_qs, stride_qh)
        do_base = head_base(do_ptr, b, q_start, h, stride_db, stride_ds, stride_dh)
        lse_base = lse_ptr + row_offset(b, stride_lb) + row_offset(h, stride_lh) + q_start
        delta_base = delta_ptr + row_offset(b, stride_lb) + row_offset(h, stride_lh) + q_start
        for m0 in range(m_start, full_lo, BLOCK_M):  # the diagonal / right edge: masked
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, m0,
                                seqlen_q, rn, lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM,
                                HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, SOFTCAP)  # fmt: skip
        for m0 in range(full_lo, full_hi, BLOCK_M):  # the inner blocks: no mask
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, m0,
                                seqlen_q, rn, lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM,
                                HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, False, SOFTCAP)  # fmt: skip
        for m0 in range(full_hi, m_end, BLOCK_M):  # the window's left edge: masked
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, m0,
                                seqlen_q, rn, lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM,
                                HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, True, SOFTCAP)  # fmt: skip

    dk = dk * dk_scale
    dk_base = head_base(dk_ptr, b, k_start, h_kv, stride_dkb, stride_dks, stride_dkh)
    dv_base = head_base(dv_ptr, b, k_start, h_kv, stride_dvb, stride_dvs, stride_dvh)
    fx.store(dk_base + row_offset(rn, stride_dks)[:, None] + rd[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (rd < HEAD_DIM)[None, :])  # fmt: skip
    fx.store(dv_base + row_offset(rn, stride_dvs)[:, None] + rdv[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (rdv < HEAD_DIM_V)[None, :])  # fmt: skip


@flyc.func
def _dq_step(
    dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows, lo_off, hi_off,
    qk_scale, cap_in, cap_out,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_N: fx.constexpr, MASKED: fx.constexpr, SOFTCAP: fx.constexpr,
):  # fmt: skip
    """One key block at ``n0`` against the program's query block: dQ updated."""
    rn = n0 + fx.arange(0, BLOCK_N)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    n_ok = rn < seqlen_k
    k = fx.load(k_base + row_offset(rn, stride_ks)[:, None] + rd[None, :],
                mask=n_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    v = fx.load(v_base + row_offset(rn, stride_vs)[:, None] + rdv[None, :],
                mask=n_ok[:, None] & (rdv < HEAD_DIM_V)[None, :], other=0.0)  # fmt: skip
    s = fx.dot(q, fx.trans(k))  # [BLOCK_M, BLOCK_N] fp32
    if SOFTCAP:
        t = softcap_tanh(s * cap_in)
        s = t * cap_out
    else:
        s = s * qk_scale
    if MASKED:
        ok = (rn[None, :] >= (rows + lo_off)[:, None]) & (rn[None, :] <= (rows + hi_off)[:, None])
        ok = ok & n_ok[None, :]
        s = fx.where(ok, s, float("-inf"))
    p = fx.exp2(s - lse2[:, None])
    dp = fx.dot(do, fx.trans(v))
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = fx.dot(ds.to(k.dtype), k, dq)
    return dq


# fmt: off
@flyc.kernel(do_not_specialize=["seqlen_q", "seqlen_k"])
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
    seqlen_q, seqlen_k, heads, group, num_m, win_left, win_right, qk_scale, cap_in, cap_out, dq_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_lb, stride_lh, stride_dqb, stride_dqs, stride_dqh,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, WINDOWED: fx.constexpr, SOFTCAP: fx.constexpr,
    VARLEN: fx.constexpr,
):
    # fmt: on
    b, h, pid_m = block_program(fx.program_id(0), num_m, heads, True)
    h_kv = h // group
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    rows = m0 + fx.arange(0, BLOCK_M)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    m_ok = rows < seqlen_q
    q_base = head_base(q_ptr, b, q_start, h, stride_qb, stride_qs, stride_qh)
    do_base = head_base(do_ptr, b, q_start, h, stride_db, stride_ds, stride_dh)
    k_base = head_base(k_ptr, b, k_start, h_kv, stride_kb, stride_ks, stride_kh)
    v_base = head_base(v_ptr, b, k_start, h_kv, stride_vb, stride_vs, stride_vh)
    q = fx.load(q_base + row_offset(rows, stride_qs)[:, None] + rd[None, :],
                mask=m_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    do = fx.load(do_base + row_offset(rows, stride_ds)[:, None] + rdv[None, :],
                 mask=m_ok[:, None] & (rdv < HEAD_DIM_V)[None, :], other=0.0)  # fmt: skip
    l_off = row_offset(b, stride_lb) + row_offset(h, stride_lh) + q_start
    lse = fx.load(lse_ptr + l_off + rows, mask=m_ok, other=float("inf"))
    lse2 = fx.where(lse == float("-inf"), float("inf"), lse * _LOG2E_C)
    delta = fx.load(delta_ptr + l_off + rows, mask=m_ok, other=0.0)

    # The forward's walk: skipped, unmasked and edge key blocks.
    off = seqlen_k - seqlen_q
    lo_off = off - win_left
    hi_off = off + win_right
    m_last = m0 + BLOCK_M - 1
    kv_start = fx.maximum(m0 + lo_off, 0) // BLOCK_N * BLOCK_N
    kv_end = fx.maximum(fx.minimum(seqlen_k, m_last + hi_off + 1), 0)
    full_lo = fx.maximum(kv_start, fx.cdiv(fx.maximum(m_last + lo_off, 0), BLOCK_N) * BLOCK_N)
    full_lo = fx.minimum(full_lo, kv_end)
    full_hi = fx.maximum(fx.minimum(seqlen_k, m0 + hi_off + 1), 0) // BLOCK_N * BLOCK_N
    full_hi = fx.maximum(full_hi, full_lo)

    dq = fx.zeros([BLOCK_M, BLOCK_D], dtype=fx.float32)
    if WINDOWED:
        for n0 in range(kv_start, full_lo, BLOCK_N):
            dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows, lo_off,
                          hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True,
                          SOFTCAP)  # fmt: skip
    for n0 in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows, lo_off,
                      hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False,
                      SOFTCAP)  # fmt: skip
    for n0 in range(full_hi, kv_end, BLOCK_N):
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, n0, seqlen_k, rows, lo_off,
                      hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True,
                      SOFTCAP)  # fmt: skip

    dq = dq * dq_scale
    dq_base = head_base(dq_ptr, b, q_start, h, stride_dqb, stride_dqs, stride_dqh)
    fx.store(dq_base + row_offset(rows, stride_dqs)[:, None] + rd[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (rd < HEAD_DIM)[None, :])  # fmt: skip


def _strides3(t, varlen):
    """(batch, seq, head) strides: varlen tensors have no batch dimension (0)."""
    return (0, *t.stride()[:2]) if varlen else tuple(t.stride()[:3])


@flyc.jit(skip_empty=False)
def launch_flash_bwd(dout, q, k, v, out, lse, delta, dq, dk, dv, cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int,
                     batch: int, win_left: int, win_right: int, softmax_scale: float, softcap: float, cfg,
                     stream=None):  # fmt: skip
    """Launch the three backward kernels over ``batch`` sequences.

    Dense (``cu_q`` None): ``dout`` / ``out [B, Sq, Hq, Dv]``, q / k / v as the forward's, ``lse`` and
    ``delta`` fp32 ``[B, Hq, Sq]`` (delta written here, lse's strides), ``dq`` / ``dk`` / ``dv`` shaped as
    q / k / v. Varlen: no batch dimension, ``lse`` / ``delta [Hq, total_q]``, ``cu_q`` / ``cu_k`` int32
    ``[batch + 1]``. Every last stride is 1. Windows as :func:`.flash_fwd.launch_flash_fwd` takes them.
    ``delta`` must have lse's strides. ``cfg``: a :class:`fly_attention.autotune.AttnBwdConfig`. With no query
    rows nothing launches (the host gives zero dK / dV); with no keys only delta and dQ (zeros) run.
    """
    varlen = cu_q is not None
    if batch == 0 or max_seqlen_q == 0:
        return
    heads, head_dim = q.shape[-2], q.shape[-1]
    heads_kv = k.shape[-2]
    group = heads // heads_kv
    head_dim_v = v.shape[-1]
    left = win_left if win_left >= 0 else UNBOUNDED
    right = win_right if win_right >= 0 else UNBOUNDED
    if softcap > 0:
        cap_in, cap_out = softmax_scale / softcap, softcap * _LOG2E
    else:
        cap_in, cap_out = 1.0, 1.0
    qk_scale = softmax_scale * _LOG2E
    sq_ = _strides3(q, varlen)
    sk_ = _strides3(k, varlen)
    sv_ = _strides3(v, varlen)
    so_ = _strides3(out, varlen)
    sd_ = _strides3(dout, varlen)
    sdq, sdk, sdv = _strides3(dq, varlen), _strides3(dk, varlen), _strides3(dv, varlen)
    if varlen:
        slb, slh = 0, lse.stride(0)
    else:
        slb, slh = lse.stride(0), lse.stride(1)
    bd, bdv = head_block(head_dim), head_block(head_dim_v)
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=bd, BLOCK_DV=bdv, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)  # fmt: skip

    num_md = flyc.cdiv(max_seqlen_q, cfg.dq_block_m)
    flyc.launch(_bwd_delta_kernel, (num_md * batch * heads,), out, dout, delta, cu_q, max_seqlen_q, heads, num_md,
                *so_, *sd_, slb, slh, HEAD_DIM_V=head_dim_v, BLOCK_DV=bdv, BLOCK_M=cfg.dq_block_m, VARLEN=varlen,
                num_warps=cfg.num_warps)  # fmt: skip
    num_n = flyc.cdiv(max_seqlen_k, cfg.dkdv_block_n)
    # fmt: off
    if num_n:
        flyc.launch(
            _bwd_dkdv_kernel, (num_n * batch * heads_kv,),
            q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k,
            max_seqlen_q, max_seqlen_k, heads_kv, group, num_n, left, right, qk_scale, cap_in, cap_out,
            softmax_scale, *sq_, *sk_, *sv_, *sd_, slb, slh, *sdk, *sdv,
            BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n, SOFTCAP=softcap > 0, VARLEN=varlen, **common,
        )
    num_m = flyc.cdiv(max_seqlen_q, cfg.dq_block_m)
    flyc.launch(
        _bwd_dq_kernel, (num_m * batch * heads,),
        q, k, v, dout, lse, delta, dq, cu_q, cu_k,
        max_seqlen_q, max_seqlen_k, heads, group, num_m, left, right, qk_scale, cap_in, cap_out, softmax_scale,
        *sq_, *sk_, *sv_, *sd_, slb, slh, *sdq,
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, WINDOWED=win_left >= 0, SOFTCAP=softcap > 0,
        VARLEN=varlen, **common,
    )
    # fmt: on
