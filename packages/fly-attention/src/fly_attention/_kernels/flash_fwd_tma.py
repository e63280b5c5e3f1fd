"""The 16-bit flash attention forward with Q, K, V (and optionally O) moved by tensor descriptors (Hopper's TMA).

The same computation as :mod:`.flash_fwd` (online softmax in fp32, exp2 with the scale folded in, the key
walk of :func:`.flash_fwd.key_blocks`: skipped blocks, an unmasked inner run and masked edges), with the
tiles loaded by the copy engine instead of by every thread's pointer arithmetic: the compiler pipelines
descriptor loads with ``num_stages`` shared-memory buffers and mbarriers, and the registers the pointer
tiles took are free.

Each program builds, on the device, one 2-D descriptor a tensor over the rows of its own (batch, head):
base = token 0 of the head (of the sequence, under varlen), shape ``[seqlen, head_dim]``, row stride the
tensor's token stride. The copy engine fills everything outside that shape with zeros: the ragged end of
the keys reads finite zeros (the score mask still sets those keys to -inf), rows past seqlen_q read 0, and
the padded columns of a head dim that is not a power of two read 0 in both Q and K, so they add nothing
to the scores. No load is masked. This reads any strides the pointer kernel reads (``[B, S, H, D]``, a
``[B, H, S, D]`` storage through a transpose, heads sliced out of a wider tensor) as long as every stride
but the last and the base addresses are multiples of 16 bytes (:func:`tma_addressable`; the host sends
anything else to the pointer kernel: a misaligned device-side descriptor reads wrong data without an
error).

``TMA_STORE``: the output tile is stored through a descriptor too (clipped to ``[seqlen_q, head_dim_v]``;
the head dims are multiples of 8 elements, so no store reaches past a row into the next head), at the cost
of an output tile of shared memory (sm_90 compiles place it in the key loop's freed buffers).
"""

from __future__ import annotations

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .flash_fwd import forward_arguments, key_blocks
from .programs import block_program, head_base, online_update, sequence_bounds

__all__ = ["launch_flash_fwd_tma", "tma_addressable"]

_LN2 = fx.constexpr(0.6931471805599453)  # a kernel reads module globals only as constexpr
_TMA_ALIGN = 16  # bytes: TMA's alignment of a descriptor's base and of every stride but the last


# fmt: off
@flyc.kernel(do_not_specialize=["seqlen_q", "seqlen_k"])
def _flash_fwd_tma_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
    seqlen_q, seqlen_k, heads, group, num_m, win_left, win_right, qk_scale, cap_in, cap_out,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    HEAD_DIM: fx.constexpr, HEAD_DIM_V: fx.constexpr, BLOCK_D: fx.constexpr, BLOCK_DV: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, WINDOWED: fx.constexpr, SOFTCAP: fx.constexpr,
    VARLEN: fx.constexpr, STORE_LSE: fx.constexpr, TMA_STORE: fx.constexpr,
):
    # fmt: on
    b, h, pid_m = block_program(fx.program_id(0), num_m, heads, True)
    h_kv = h // group
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:  # varlen: a sequence shorter than the grid's
        return
    rows = m0 + fx.arange(0, BLOCK_M)
    # One (batch, head)'s rows as a 2-D tensor each: out-of-shape rows and columns read as zeros.
    q_desc = fx.make_tensor_descriptor(head_base(q_ptr, b, q_start, h, stride_qb, stride_qs, stride_qh),
                                       shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])  # fmt: skip
    k_desc = fx.make_tensor_descriptor(head_base(k_ptr, b, k_start, h_kv, stride_kb, stride_ks, stride_kh),
                                       shape=[seqlen_k, HEAD_DIM], strides=[stride_ks, 1],
                                       block_shape=[BLOCK_N, BLOCK_D])  # fmt: skip
    v_desc = fx.make_tensor_descriptor(head_base(v_ptr, b, k_start, h_kv, stride_vb, stride_vs, stride_vh),
                                       shape=[seqlen_k, HEAD_DIM_V], strides=[stride_vs, 1],
                                       block_shape=[BLOCK_N, BLOCK_DV])  # fmt: skip
    q = q_desc.load([m0, 0])

    lo_off, hi_off, kv_start, full_lo, full_hi, kv_end = key_blocks(m0, seqlen_q, seqlen_k, win_left, win_right,
                                                                  BLOCK_M, BLOCK_N)

    acc = fx.zeros([BLOCK_M, BLOCK_DV], dtype=fx.float32)
    l_i = fx.zeros([BLOCK_M], dtype=fx.float32)
    m_i = fx.full([BLOCK_M], float("-inf"), dtype=fx.float32)
    if WINDOWED:  # the left edge of a window: masked
        for n0 in range(kv_start, full_lo, BLOCK_N):
            acc, l_i, m_i = online_update(acc, l_i, m_i, q, k_desc.load([n0, 0]), v_desc.load([n0, 0]), n0,
                                          seqlen_k, rows, lo_off, hi_off, qk_scale, cap_in, cap_out, BLOCK_N,
                                          True, SOFTCAP)  # fmt: skip
    for n0 in range(full_lo, full_hi, BLOCK_N):  # the inner blocks: no mask at all
        acc, l_i, m_i = online_update(acc, l_i, m_i, q, k_desc.load([n0, 0]), v_desc.load([n0, 0]), n0,
                                      seqlen_k, rows, lo_off, hi_off, qk_scale, cap_in, cap_out, BLOCK_N,
                                      False, SOFTCAP)  # fmt: skip
    for n0 in range(full_hi, kv_end, BLOCK_N):  # the diagonal / right edge and the ragged end: masked
        acc, l_i, m_i = online_update(acc, l_i, m_i, q, k_desc.load([n0, 0]), v_desc.load([n0, 0]), n0,
                                      seqlen_k, rows, lo_off, hi_off, qk_scale, cap_in, cap_out, BLOCK_N,
                                      True, SOFTCAP)  # fmt: skip

    seen = l_i != 0.0  # rows that saw no key store 0 and lse -inf (a NaN score: NaN, as torch)
    out = (acc / fx.where(seen, l_i, 1.0)[:, None]).to(o_ptr.dtype.element_ty)
    o_base = head_base(o_ptr, b, q_start, h, stride_ob, stride_os, stride_oh)
    if TMA_STORE:  # clipped to [seqlen_q, HEAD_DIM_V]: rows past the sequence and padded columns stay unwritten
        o_desc = fx.make_tensor_descriptor(o_base, shape=[seqlen_q, HEAD_DIM_V], strides=[stride_os, 1],
                                           block_shape=[BLOCK_M, BLOCK_DV])  # fmt: skip
        o_desc.store([m0, 0], out)
    else:
        rdv = fx.arange(0, BLOCK_DV)
        fx.store(o_base + row_offset(rows, stride_os)[:, None] + rdv[None, :], out,
                 mask=(rows < seqlen_q)[:, None] & (rdv < HEAD_DIM_V)[None, :])  # fmt: skip
    if STORE_LSE:  # natural log: (m + log2 l) * ln 2
        lse = fx.where(seen, (m_i + fx.log2(fx.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
        l_base = lse_ptr + row_offset(b, stride_lb) + row_offset(h, stride_lh) + q_start
        fx.store(l_base + rows, lse, mask=rows < seqlen_q)


def tma_addressable(*tensors: torch.Tensor | None) -> bool:
    """Whether the TMA kernel may read / write these tensors: 16-byte aligned base addresses and every stride
    but the last (1) a multiple of 16 bytes. A device-side descriptor over anything else reads wrong data
    without an error, so the host sends such layouts to the pointer kernel."""
    for t in tensors:
        if t is None:
            continue
        size = t.element_size()
        if t.data_ptr() % _TMA_ALIGN or t.stride(-1) != 1:
            return False
        if any((s * size) % _TMA_ALIGN for s in t.stride()[:-1]):
            return False
    return True


@flyc.jit(skip_empty=False)
def launch_flash_fwd_tma(q, k, v, out, lse, cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int, batch: int,
                         win_left: int, win_right: int, softmax_scale: float, softcap: float, cfg,
                         stream=None):  # fmt: skip
    """Launch the TMA forward; arguments as :func:`.flash_fwd.launch_flash_fwd` (dense or varlen), for
    16-bit tensors that :func:`tma_addressable` takes and a ``cfg`` with ``tma=True`` (``tma_store`` as the
    kernel's ``TMA_STORE``)."""
    if max_seqlen_q == 0 or batch == 0:
        return
    grid, args, meta = forward_arguments(q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, batch, win_left,
                                         win_right, softmax_scale, softcap, cfg)  # fmt: skip
    flyc.ensure_scratch_allocator()  # the device-side descriptors live in Triton's scratch memory
    flyc.launch(_flash_fwd_tma_kernel, grid, *args, TMA_STORE=cfg.tma_store, **meta)
