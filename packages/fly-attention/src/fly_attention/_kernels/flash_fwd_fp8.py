"""The fp8 (e4m3) flash attention forward: both dots in fp8 with fp32 accumulation, per-tensor descales.

The walk is the 16-bit forward's (:func:`.flash_fwd.key_blocks`: skipped, unmasked and masked edge blocks,
the guarded online softmax); what differs:

- ``S = Q K^T`` is an e4m3 x e4m3 dot accumulated in fp32, then scaled by ``q_descale * k_descale *
  softmax_scale * log2(e)`` (one multiply; the descales are read from device memory in the kernel, so a
  call never synchronizes with the host and is CUDA-graph safe).
- ``P`` (fp32, in ``[0, 1]``) is rounded to e4m3 for ``P @ V``, a second e4m3 dot: both products on
  fp8 tensor cores is what makes fp8 faster than the 16-bit kernel. It is rounded as ``P * 2^8`` (out of
  e4m3's subnormal range down to 2^-14), a relative rounding of at most 2^-4 each; the row sums ``l`` are
  those of the fp32 ``P`` (with the same factor, which cancels in ``acc / l``).
- V is read K-major for that dot: from ``vt [B, Hkv, Dv, Sk_pad]``, the host's transposed copy, its keys
  padded with zeros to a whole number of key blocks (the edge blocks then load V^T unmasked, in 16-byte
  vectors). Hopper's fp8 wgmma takes both operands K-major from shared memory (there is no transposed fp8
  B operand as for 16-bit types). Compiled for sm_90 from an ``[Sk, Dv]`` tile instead, Triton loads V
  into registers and stores it transposed into shared memory byte by byte (128 ``st.shared.b8`` in the
  d 128 kernel against none), outside the ``cp.async`` pipeline.
- Hopper's fp8 wgmma accumulates with fewer mantissa bits than fp32 (Triton's default on sm_90 lets it
  run the whole dot so). The score dot is one reduction of head_dim terms, but ``P @ V`` runs over the
  whole key sequence: each block's product is taken from zero and added to the fp32 accumulator, so the
  reduced-precision sum spans one block, never the sequence.
- The output is ``acc / l * v_descale`` in the output's dtype (bf16 or fp16); the lse is that of the
  descaled, scaled scores (natural log), as the 16-bit kernel's.

Dense only (varlen is refused on the host).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .flash_fwd import _LN2, _LOG2E, UNBOUNDED, key_blocks
from .programs import block_program, head_base, head_block, softcap_tanh

__all__ = ["launch_flash_fwd_fp8"]

# P is taken as p * 2^P_SHIFT (at most 256, e4m3's largest is 448): e4m3 is subnormal below 2^-6 (one
# significant bit at 2^-9), so unscaled probabilities under 2^-6 would lose their precision and under 2^-10
# vanish; scaled, only those under 2^-14 do. The row sums carry the same factor, so out = acc / l is
# unchanged; the lse takes it off.
_P_SHIFT = fx.constexpr(8.0)


@flyc.func
def _attend_fp8(
    acc, l_i, m_i, q, k_base, vt_base, stride_ks, stride_vtd, n0, seqlen_k, rows, lo_off, hi_off,
    qk_scale, cap_in, cap_out,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_N: fx.constexpr, MASKED: fx.constexpr, SOFTCAP: fx.constexpr,
):  # fmt: skip
    """One key block at ``n0``: fp8 scores, the (edge) mask, the online-softmax update of (acc, l, m)."""
    # Every block the walk visits starts at a multiple of BLOCK_N (key_blocks' bounds are, but for an end
    # bound that then leaves its loop empty). Rounding n0 down to one says so to the compiler (a multiple_of
    # hint on a loop variable is dropped), and the V^T tile (keys contiguous) then loads in 16-byte vectors
    # instead of single bytes.
    rn = n0 // BLOCK_N * BLOCK_N + fx.arange(0, BLOCK_N)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    k_ptrs = k_base + row_offset(rn, stride_ks)[:, None] + rd[None, :]
    vt_ptrs = vt_base + row_offset(rdv, stride_vtd)[:, None] + rn[None, :]  # [Dv, N]: keys contiguous
    if MASKED:  # the ragged end of the keys may lie in this block
        k = fx.load(k_ptrs, mask=(rn < seqlen_k)[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = fx.load(k_ptrs)
    else:
        k = fx.load(k_ptrs, mask=(rd < HEAD_DIM)[None, :], other=0.0)
    # V^T needs no key mask: the host pads its keys with zeros to a whole number of blocks. A mask along
    # the contiguous (key) dimension would split the edge blocks' loads into single bytes.
    if BLOCK_DV == HEAD_DIM_V:
        vt = fx.load(vt_ptrs)
    else:
        vt = fx.load(vt_ptrs, mask=(rdv < HEAD_DIM_V)[:, None], other=0.0)
    s = fx.dot(q, fx.trans(k))  # e4m3 x e4m3 -> fp32
    if SOFTCAP:  # cap * tanh(s * scale / cap), then into log2 units
        s = softcap_tanh(s * cap_in) * cap_out
    else:
        s = s * qk_scale
    if MASKED:
        ok = (rn[None, :] >= (rows + lo_off)[:, None]) & (rn[None, :] <= (rows + hi_off)[:, None])
        ok = ok & (rn < seqlen_k)[None, :]
        s = fx.where(ok, s, float("-inf"))
    m_new = fx.maximum(m_i, fx.max(s, 1))
    # A row that has seen no key yet subtracts 0 instead of -inf (never exp2(-inf - -inf) = NaN).
    m_use = fx.where(m_new == float("-inf"), 0.0, m_new)
    # p in units of 2^-P_SHIFT (see the module's docstring): the shift rides in the row's subtrahend
    p = fx.exp2(s - (m_use - _P_SHIFT)[:, None])
    alpha = fx.exp2(m_i - m_use)
    l_i = l_i * alpha + fx.sum(p, 1)
    # The block's P @ V from zero, added in fp32 (see the module's docstring): not fused into the dot's
    # accumulator, whose fp8 sums are not fp32-exact on sm_90.
    pv = fx.dot(p.to(fx.float8e4nv), fx.trans(vt))
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


# fmt: off
@flyc.kernel(do_not_specialize=["seqlen_q", "seqlen_k"])
def _flash_fwd_fp8_kernel(
    q_ptr, k_ptr, vt_ptr, o_ptr, lse_ptr, q_ds_ptr, k_ds_ptr, v_ds_ptr,
    seqlen_q, seqlen_k, heads, group, num_m, win_left, win_right, qk_scale, cap_in, cap_out, out_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vtb, stride_vth, stride_vtd,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, WINDOWED: fx.constexpr, SOFTCAP: fx.constexpr,
    STORE_LSE: fx.constexpr, Q_DS: fx.constexpr, K_DS: fx.constexpr, V_DS: fx.constexpr,
):
    # fmt: on
    b, h, pid_m = block_program(fx.program_id(0), num_m, heads, True)
    h_kv = h // group
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    # Per-tensor descales from device memory (no host sync); a descale given as a number, or none, is in
    # the host's factors already.
    if Q_DS:
        qk_scale = qk_scale * fx.load(q_ds_ptr)
        cap_in = cap_in * fx.load(q_ds_ptr)
    if K_DS:
        qk_scale = qk_scale * fx.load(k_ds_ptr)
        cap_in = cap_in * fx.load(k_ds_ptr)
    if V_DS:
        out_scale = out_scale * fx.load(v_ds_ptr)
    rows = m0 + fx.arange(0, BLOCK_M)
    rd = fx.arange(0, BLOCK_D)
    rdv = fx.arange(0, BLOCK_DV)
    q_base = head_base(q_ptr, b, 0, h, stride_qb, stride_qs, stride_qh)
    k_base = head_base(k_ptr, b, 0, h_kv, stride_kb, stride_ks, stride_kh)
    vt_base = vt_ptr + row_offset(b, stride_vtb) + row_offset(h_kv, stride_vth)
    m_ok = rows < seqlen_q
    q = fx.load(q_base + row_offset(rows, stride_qs)[:, None] + rd[None, :],
                mask=m_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    lo_off, hi_off, kv_start, full_lo, full_hi, kv_end = key_blocks(m0, seqlen_q, seqlen_k, win_left, win_right,
                                                                      BLOCK_M, BLOCK_N)  # fmt: skip

    acc = fx.zeros([BLOCK_M, BLOCK_DV], dtype=fx.float32)
    l_i = fx.zeros([BLOCK_M], dtype=fx.float32)
    m_i = fx.full([BLOCK_M], float("-inf"), dtype=fx.float32)
    if WINDOWED:  # the left edge of a window: masked
        for n0 in range(kv_start, full_lo, BLOCK_N):
            acc, l_i, m_i = _attend_fp8(acc, l_i, m_i, q, k_base, vt_base, stride_ks, stride_vtd, n0, seqlen_k,
                                        rows, lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V,
                                        BLOCK_D, BLOCK_DV, BLOCK_N, True, SOFTCAP)  # fmt: skip
    for n0 in range(full_lo, full_hi, BLOCK_N):  # the inner blocks: no mask at all
        acc, l_i, m_i = _attend_fp8(acc, l_i, m_i, q, k_base, vt_base, stride_ks, stride_vtd, n0, seqlen_k, rows,
                                    lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                                    BLOCK_DV, BLOCK_N, False, SOFTCAP)  # fmt: skip
    for n0 in range(full_hi, kv_end, BLOCK_N):  # the diagonal / right edge and the ragged end: masked
        acc, l_i, m_i = _attend_fp8(acc, l_i, m_i, q, k_base, vt_base, stride_ks, stride_vtd, n0, seqlen_k, rows,
                                    lo_off, hi_off, qk_scale, cap_in, cap_out, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                                    BLOCK_DV, BLOCK_N, True, SOFTCAP)  # fmt: skip

    seen = l_i != 0.0  # rows that saw no key store 0 and lse -inf (a NaN score: NaN, as torch)
    out = acc * (out_scale / fx.where(seen, l_i, 1.0))[:, None]
    o_base = head_base(o_ptr, b, 0, h, stride_ob, stride_os, stride_oh)
    fx.store(o_base + row_offset(rows, stride_os)[:, None] + rdv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (rdv < HEAD_DIM_V)[None, :])  # fmt: skip
    if STORE_LSE:  # natural log: (m + log2 l) * ln 2
        lse = fx.where(seen, (m_i + fx.log2(fx.where(seen, l_i, 1.0)) - _P_SHIFT) * _LN2, float("-inf"))
        fx.store(lse_ptr + row_offset(b, stride_lb) + row_offset(h, stride_lh) + rows, lse, mask=m_ok)


# fp8 dots take at least 32 along their reduction (sm_90's fp8 wgmma steps K by 32): head dims below are
# padded to it.
MIN_BLOCK_D = 32


@flyc.jit(skip_empty=False)
def launch_flash_fwd_fp8(q, k, vt, out, lse, q_descale, k_descale, v_descale, seqlen_k: int, win_left: int,
                         win_right: int, softmax_scale: float, softcap: float, qk_factor: float, v_factor: float,
                         cfg, stream=None):  # fmt: skip
    """Launch the fp8 forward.

    ``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]`` e4m3 (unit last stride); ``vt [B, Hkv, Dv, Sk_pad]`` e4m3, V
    transposed (unit last stride), its keys zero-padded to ``Sk_pad``, a multiple of ``cfg.block_n``; ``out
    [B, Sq, Hq, Dv]`` bf16 / fp16; ``lse [B, Hq, Sq]`` fp32 or None. ``q_descale`` / ``k_descale`` /
    ``v_descale``: fp32 one-element tensors or None (read in the kernel); ``qk_factor`` / ``v_factor``: the
    descales given as numbers, multiplied in on the host (``qk_factor = q * k``). ``win_left`` /
    ``win_right`` as :func:`.flash_fwd.launch_flash_fwd`; ``cfg``: a :class:`fly_attention.autotune.AttnConfig`.
    """
    batch, seqlen_q, heads, head_dim = q.shape
    if seqlen_q == 0 or batch == 0:
        return
    group = heads // k.shape[2]
    head_dim_v = vt.shape[2]
    windowed = win_left >= 0
    left = win_left if win_left >= 0 else UNBOUNDED
    right = win_right if win_right >= 0 else UNBOUNDED
    if softcap > 0:
        cap_in, cap_out = softmax_scale * qk_factor / softcap, softcap * _LOG2E
    else:
        cap_in, cap_out = 1.0, 1.0
    sqb, sqs, sqh = q.stride()[:3]
    skb, sks, skh = k.stride()[:3]
    svb, svh, svd = vt.stride()[:3]
    sob, sos, soh = out.stride()[:3]
    slb, slh = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    num_m = flyc.cdiv(seqlen_q, cfg.block_m)
    grid = (num_m * batch * heads,)
    # fmt: off
    flyc.launch(
        _flash_fwd_fp8_kernel, grid,
        q, k, vt, out, lse, q_descale, k_descale, v_descale,
        seqlen_q, seqlen_k, heads, group, num_m, left, right, softmax_scale * qk_factor * _LOG2E, cap_in, cap_out,
        v_factor,
        sqb, sqs, sqh, skb, sks, skh, svb, svh, svd, sob, sos, soh, slb, slh,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=head_block(head_dim, MIN_BLOCK_D),
        BLOCK_DV=head_block(head_dim_v, MIN_BLOCK_D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        WINDOWED=windowed, SOFTCAP=softcap > 0, STORE_LSE=lse is not None, Q_DS=q_descale is not None,
        K_DS=k_descale is not None, V_DS=v_descale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on
