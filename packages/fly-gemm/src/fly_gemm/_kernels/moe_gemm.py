"""Device code of the fused MoE: the grouped GEMM over aligned row blocks, and the reduce of each token's
top-k rows.

Grouped GEMM: the aligned rows (``moe_align``) come in blocks of BLOCK_M, each block one expert's. A
program computes a ``BLOCK_M x BLOCK_N`` tile of the block's output rows: it reads the block's expert from
``expert_ids``, its rows from ``sorted_ids`` (padding rows, ``>= T * k``, are masked off), gathers the A
rows (stage 1: token ``row // k`` of x; stage 2: row ``row`` of the intermediate) and multiplies them by
that expert's weight ``[N, K]`` (read through its strides, in place). Blocks past the padded count (the
buffers are sized for the worst case) exit at once. Programs take tiles in grouped order, so consecutive
blocks, usually one expert's, share its weight tiles through L2.

- Stage 1 (``GATED``): two accumulators, the gate rows ``[0, I)`` and the up rows ``[I, 2I)`` of w1, and
  the epilogue ``act(gate) * up`` in fp32.
- ``MUL_WEIGHT``: the row's router weight multiplies the accumulators before the epilogue (stage 2: the
  router weight on the expert's output; stage 1 with ``apply_router_weight_on_input``: on its input).

- ``QUANT``: 8-bit operands (fp8 e4m3, or int8 into an int32 accumulator) with fp32 scales: per channel,
  ``acc * a_scale[row] * w_scale[e, col]`` after the K loop; block-scaled, each K step's product times the
  row's group scale and the column's weight-block scale (BLOCK_K divides the scale block, so a step lies in
  one block; the gate and up columns look up their blocks apart, so I need not be a block multiple).
  ``_moe_quant_kernel`` makes the 8-bit activations and their scales (per row, or per row group).

Each routed row's output is written to its own row ``t * k + j``; the reduce kernel adds a token's k rows
in a fixed order (deterministic, no atomics) in fp32, skipping slots whose expert is not in [0, E).
"""

from __future__ import annotations

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import (
    INTERPRET,
    PTX,
    absmax_f32,
    activation,
    cast_sat_fp8e4m3,
    cast_sat_int8,
    inverse_scale,
    maximum_nan,
    quant_scale,
    row_offset,
)

__all__ = [
    "launch_moe_gemm",
    "launch_moe_sum",
    "launch_moe_quant",
    "QUANT_NONE",
    "QUANT_CHANNEL",
    "QUANT_BLOCK",
    "QUANT_W4",
    "QUANT_W4A8",
]

QUANT_NONE = 0  # 16-bit weights and activations
QUANT_CHANNEL = 1  # a scale per weight row (output channel) and per activation row, applied after the K loop
QUANT_BLOCK = 2  # a scale per weight block and per activation row group, applied to each K step's product
QUANT_W4 = 3  # packed int4 / fp4 weights with block (group) scales, dequantized to A's dtype before the dot
QUANT_W4A8 = 4  # packed int4 / fp4 weights, fp8 activations: the 4-bit codes (exact in e4m3) in an fp8 dot




@flyc.func
def _to_16bit(x, dtype: fx.constexpr):
    """fp32 -> ``dtype`` (bf16 / fp16) rounded to nearest even, on the hardware and in the interpreter."""
    if INTERPRET and dtype == fx.bfloat16:
        bits = x.to(fx.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # finite values: round the low 16 bits away
        return bits.to(fx.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


# The 4-bit decode is on the critical path of every K step, and at decode sizes it bounds the kernel (the dot
# is small): each code becomes fp32 through bit patterns, a mask, a shift and one fp32 operation, with no
# integer -> float conversion, no compare and no select.
_INT4_MAGIC = fx.constexpr(0x4B000008)  # fp32 2**23 + 8 with the code in the low bits: 2**23 + (code ^ 8)
_INT4_BIAS = fx.constexpr(8388616.0)  # 2**23 + 8
_FP4_UNBIAS = fx.constexpr(2.0**126)  # e2m1 placed in an fp32's top exponent bits reads as 2**-126 x its value


@flyc.func
def _w4_values(v, HIGH: fx.constexpr, FP4: fx.constexpr):
    """fp32 values of the 4-bit codes in int32 ``v`` (bytes 0..255): the low nibble, or the high one (``HIGH``).
    int4: the code (two's complement) as 2**23 + (code ^ 8), minus 2**23 + 8: exact. fp4 e2m1: magnitude bits
    (exponent, mantissa) moved to fp32 bits 24..22 and the sign to bit 31 read as 2**-126 x the value (the
    code 0.5 as an fp32 subnormal), times 2**126: exact, as the multiply keeps subnormal inputs."""
    if FP4:
        if HIGH:
            bits = ((v << 18) & 0x01C00000) | ((v << 24) & -2147483648)
        else:
            bits = ((v << 22) & 0x01C00000) | ((v << 28) & -2147483648)
        return bits.to(fx.float32, bitcast=True) * _FP4_UNBIAS
    else:
        if HIGH:
            bits = ((v >> 4) & 15) ^ _INT4_MAGIC
        else:
            bits = (v & 15) ^ _INT4_MAGIC
        return bits.to(fx.float32, bitcast=True) - _INT4_BIAS


@flyc.func
def _w4_scale(s, FP4: fx.constexpr):
    """fp32 scale of a column: as stored (int4: fp32), or 2**(s - 127) of an e8m0 byte (MXFP4; s = 0 reads as
    0, not 2**-127)."""
    if FP4:
        return (s.to(fx.int32) << 23).to(fx.float32, bitcast=True)
    else:
        return s


@flyc.func
def _e8m0_bf16(s):
    """bf16 2**(s - 127) of e8m0 bytes ``s`` (0 reads as 0, 255 as inf), the bits ``s << 7``."""
    return (s.to(fx.int32) << 7).to(fx.int16).to(fx.bfloat16, bitcast=True)


@flyc.func
def _dequant_w4(packed, scale, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, FP4: fx.constexpr):
    """[BLOCK_N, BLOCK_K / 2] bytes of 4-bit pairs (element 2j in the low nibble, 2j + 1 in the high) ->
    [BLOCK_N, BLOCK_K] fp32 values times ``scale`` (from :func:`_w4_scale`): [BLOCK_N, 1], a column's, or
    [BLOCK_N, BLOCK_K], an element's."""
    v = packed.to(fx.int32)
    w = fx.reshape(fx.join(_w4_values(v, False, FP4), _w4_values(v, True, FP4)), [BLOCK_N, BLOCK_K])
    return w * scale


# bf16 bit patterns of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as two 8-byte tables (low bytes, high
# bytes) a ``prmt`` indexes by the code's three magnitude bits
_FP4_ASM = fx.constexpr("""{
.reg .b32 x, y, sl, sh, lb, hb, s, tl0, tl1, th0, th1, nz;
mov.b32 tl0, 0xC0800000; mov.b32 tl1, 0xC0804000; mov.b32 th0, 0x3F3F3F00; mov.b32 th1, 0x40404040;
mov.b32 nz, 0x80008000;
and.b32 x, $4, 0x07070707; shr.b32 y, x, 4; or.b32 x, x, y; prmt.b32 sl, x, x, 0x0020;
shr.b32 x, $4, 4; and.b32 x, x, 0x07070707; shr.b32 y, x, 4; or.b32 x, x, y; prmt.b32 sh, x, x, 0x0020;
prmt.b32 lb, tl0, tl1, sl; prmt.b32 hb, th0, th1, sl;
shl.b32 s, $4, 4; and.b32 s, s, 0x80808080; or.b32 hb, hb, s;
prmt.b32 $0, lb, hb, 0x5140; prmt.b32 $1, lb, hb, 0x7362;
fma.rn.bf16x2 $0, $0, $5, nz; fma.rn.bf16x2 $1, $1, $6, nz;
prmt.b32 lb, tl0, tl1, sh; prmt.b32 hb, th0, th1, sh;
and.b32 s, $4, 0x80808080; or.b32 hb, hb, s;
prmt.b32 $2, lb, hb, 0x5140; prmt.b32 $3, lb, hb, 0x7362;
fma.rn.bf16x2 $2, $2, $5, nz; fma.rn.bf16x2 $3, $3, $6, nz;
}""")


@flyc.func
def _fp4_bf16(packed, scale):
    """MXFP4 bytes (uint8 [R, C]: an e2m1 code in each nibble) -> the (low, high) nibbles' values in bf16 ([R, C]
    each) times ``scale`` (bf16, broadcastable; a power of two, so the product is exact). NVIDIA inline PTX,
    four bytes at a time: the magnitudes index two ``prmt`` byte tables, the sign bits are or-ed in, one bf16
    fma (times the scale, plus -0) a pair: about 3 instructions an element, where the fp32 decode takes ~10
    (the gated stage's K loop at decode sizes is bound by them)."""
    return fx.inline_asm_elementwise(
        _FP4_ASM, "=r,=r,=r,=r,r,r,r", [packed, fx.broadcast_to(scale, packed.shape)],
        dtype=(fx.bfloat16, fx.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip


@flyc.func
def _w4_step_scale(row, k0, rk, n_ok, K, stride_bsk, SCALE_BK: fx.constexpr, BLOCK_K: fx.constexpr,
                   FP4: fx.constexpr):  # fmt: skip
    """The scales of a 4-bit K step at ``k0`` for the weight rows at ``row`` ([BLOCK_N] pointers): [BLOCK_N, 1]
    where the step lies in one group (BLOCK_K divides it), else each element's group ([BLOCK_N, BLOCK_K]:
    groups smaller than a step; 0 past ``K``, where there is no group to read)."""
    if SCALE_BK % BLOCK_K == 0:
        s = fx.load(row + row_offset(k0 // SCALE_BK, stride_bsk), mask=n_ok, other=0)
        return _w4_scale(s, FP4)[:, None]
    else:
        kb = row_offset((k0 + rk) // SCALE_BK, stride_bsk)
        s = fx.load(row[:, None] + kb[None, :], mask=n_ok[:, None] & (rk < K - k0)[None, :], other=0)
        return _w4_scale(s, FP4)


# fmt: off
@flyc.kernel(do_not_specialize=["NUMEL", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ptr, expert_ids_ptr, npad_ptr, w_ptr, as_ptr, bs_ptr,
    N, K, KP, NUMEL, num_blocks, TOPK, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_wt, stride_wk,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    GATHER_A: fx.constexpr, GATED: fx.constexpr, ACT: fx.constexpr, MUL_WEIGHT: fx.constexpr,
    QUANT: fx.constexpr, INT_ACC: fx.constexpr, SCALE_BN: fx.constexpr, SCALE_BK: fx.constexpr, FP4: fx.constexpr,
    FP4_ASM: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, GROUP_M: fx.constexpr,
):
    # fmt: on
    pid_m, pid_n = fx.grouped_tile(fx.program_id(0), num_blocks, fx.cdiv(N, BLOCK_N), GROUP_M)
    npad = fx.load(npad_ptr)
    expert = fx.load(expert_ids_ptr + pid_m)
    if (pid_m * BLOCK_M < npad) & (expert >= 0):
        rows = fx.load(sorted_ptr + pid_m * BLOCK_M + fx.arange(0, BLOCK_M))
        m_ok = rows < NUMEL
        if GATHER_A:
            a_rows = rows // TOPK  # the token of routed row t * k + j
        else:
            a_rows = rows
        rn = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)
        rk = fx.arange(0, BLOCK_K)
        n_ok = rn < N
        a_ptrs = a_ptr + row_offset(a_rows, stride_am)[:, None] + row_offset(rk, stride_ak)[None, :]
        a_step = row_offset(BLOCK_K, stride_ak)
        if QUANT >= 3:
            # two int4 a byte along K (low nibble first): a step reads BLOCK_K / 2 bytes of each weight row
            rk2 = fx.arange(0, BLOCK_K // 2)
            b_ptrs = (b_ptr + row_offset(expert, stride_be) + row_offset(rn, stride_bn)[:, None]
                      + row_offset(rk2, stride_bk)[None, :])  # fmt: skip
            b_step = row_offset(BLOCK_K // 2, stride_bk)
        else:
            b_ptrs = (b_ptr + row_offset(expert, stride_be) + row_offset(rn, stride_bn)[:, None]
                      + row_offset(rk, stride_bk)[None, :])  # fmt: skip
            b_step = row_offset(BLOCK_K, stride_bk)
        if QUANT >= 2:
            # block scales: the weight row block of each column (gate and up rows apart: I need not be a
            # multiple of the block) and the routed row's activation scales, one of each a K block
            bs_row = bs_ptr + row_offset(expert, stride_bse) + row_offset(rn // SCALE_BN, stride_bsn)
            bs_row_up = bs_ptr + row_offset(expert, stride_bse) + row_offset((rn + N) // SCALE_BN, stride_bsn)
            as_row = as_ptr + row_offset(a_rows, stride_asm)
        if INT_ACC:
            acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.int32)
            acc_up = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.int32)
        else:
            acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
            acc_up = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            if QUANT >= 3:
                # the step's bytes inside the row's KP = cdiv(K, 2): a bound the compiler sees is a multiple
                # of 16 where KP is (Triton specializes it), so the loads stay vector-wide and pipelined (a
                # per-column form such as ``2 * rk2 < K - k0`` keeps them one byte wide, in series)
                k2_left = KP - k0 // 2
            a = fx.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b_ok = n_ok[:, None] & k_ok[None, :]
            if QUANT == 3 and FP4_ASM and PTX:
                # MXFP4 into a bf16 dot (one scale a column a step): the codes times the scale straight to bf16
                b4_ok = n_ok[:, None] & (rk2 < k2_left)[None, :]
                kb = row_offset(k0 // SCALE_BK, stride_bsk)
                sb = _e8m0_bf16(fx.load(bs_row + kb, mask=n_ok, other=0))[:, None]
                lo, hi = _fp4_bf16(fx.load(b_ptrs, mask=b4_ok, other=0), sb)
                acc = fx.dot(a, fx.trans(fx.reshape(fx.join(lo, hi), [BLOCK_N, BLOCK_K])), acc)
                if GATED:
                    sb_up = _e8m0_bf16(fx.load(bs_row_up + kb, mask=n_ok, other=0))[:, None]
                    lo, hi = _fp4_bf16(fx.load(b_ptrs + up_offset, mask=b4_ok, other=0), sb_up)
                    acc_up = fx.dot(a, fx.trans(fx.reshape(fx.join(lo, hi), [BLOCK_N, BLOCK_K])), acc_up)
            elif QUANT == 3:
                # weight-only: the tile dequantized to A's dtype (int4 x its group scale, rounded once), then
                # the 16-bit dot
                b4_ok = n_ok[:, None] & (rk2 < k2_left)[None, :]
                sb = _w4_step_scale(bs_row, k0, rk, n_ok, K, stride_bsk, SCALE_BK, BLOCK_K, FP4)
                b = _dequant_w4(fx.load(b_ptrs, mask=b4_ok, other=0), sb, BLOCK_N, BLOCK_K, FP4)
                acc = fx.dot(a, fx.trans(_to_16bit(b, a.dtype)), acc)
                if GATED:
                    sb_up = _w4_step_scale(bs_row_up, k0, rk, n_ok, K, stride_bsk, SCALE_BK, BLOCK_K, FP4)
                    b_up = _dequant_w4(fx.load(b_ptrs + up_offset, mask=b4_ok, other=0), sb_up, BLOCK_N, BLOCK_K,
                                       FP4)  # fmt: skip
                    acc_up = fx.dot(a, fx.trans(_to_16bit(b_up, a.dtype)), acc_up)
            elif QUANT == 4:
                # w4a8: the 4-bit values are exact in e4m3 (int4 -8..7; fp4 e2m1 +-0.5..6), so the fp8 dot
                # takes them as they are; BLOCK_K divides the group, so this step's partial product is scaled
                # by (the row's group scale) x (the column's group scale), as for block scales
                b4_ok = n_ok[:, None] & (rk2 < k2_left)[None, :]
                sa = fx.load(as_row + row_offset(k0 // SCALE_BK, stride_ask), mask=m_ok, other=0.0)
                kb = row_offset(k0 // SCALE_BK, stride_bsk)
                sb = _w4_scale(fx.load(bs_row + kb, mask=n_ok, other=0), FP4)
                codes = _dequant_w4(fx.load(b_ptrs, mask=b4_ok, other=0), 1.0, BLOCK_N, BLOCK_K, FP4).to(a.dtype)
                acc += fx.dot(a, fx.trans(codes)) * sa[:, None] * sb[None, :]
                if GATED:
                    sb_up = _w4_scale(fx.load(bs_row_up + kb, mask=n_ok, other=0), FP4)
                    codes_up = _dequant_w4(fx.load(b_ptrs + up_offset, mask=b4_ok, other=0), 1.0, BLOCK_N, BLOCK_K,
                                           FP4).to(a.dtype)  # fmt: skip
                    acc_up += fx.dot(a, fx.trans(codes_up)) * sa[:, None] * sb_up[None, :]
            elif QUANT == 2:
                # BLOCK_K divides the scale block, so this step lies in one K block: its partial product
                # is dequantized by (row group scale) x (weight block scale) before it is added
                kb = row_offset(k0 // SCALE_BK, stride_bsk)
                sa = fx.load(as_row + row_offset(k0 // SCALE_BK, stride_ask), mask=m_ok, other=0.0)
                sb = fx.load(bs_row + kb, mask=n_ok, other=0.0)
                part = fx.dot(a, fx.trans(fx.load(b_ptrs, mask=b_ok, other=0.0)))
                acc += part * sa[:, None] * sb[None, :]
                if GATED:
                    sb_up = fx.load(bs_row_up + kb, mask=n_ok, other=0.0)
                    part_up = fx.dot(a, fx.trans(fx.load(b_ptrs + up_offset, mask=b_ok, other=0.0)))
                    acc_up += part_up * sa[:, None] * sb_up[None, :]
            elif INT_ACC:
                acc += fx.dot(a, fx.trans(fx.load(b_ptrs, mask=b_ok, other=0)), out_dtype=fx.int32)
                if GATED:
                    acc_up += fx.dot(a, fx.trans(fx.load(b_ptrs + up_offset, mask=b_ok, other=0)),
                                     out_dtype=fx.int32)  # fmt: skip
            elif QUANT == 1:
                # fp8 per channel: Hopper's fp8 MMA adds into a narrower accumulator than fp32 (Triton's sm_90
                # default keeps it for the whole K loop); promoted to fp32 once a K step, as the block-scaled
                # path is by its scales. Over the whole loop, its error at K = 14336 (Mixtral's down
                # projection) flipped enough fp8 codes of the intermediate to move the layer 1.5%.
                acc = fx.dot(a, fx.trans(fx.load(b_ptrs, mask=b_ok, other=0.0)), acc, max_num_imprecise_acc=BLOCK_K)
                if GATED:
                    acc_up = fx.dot(a, fx.trans(fx.load(b_ptrs + up_offset, mask=b_ok, other=0.0)), acc_up,
                                    max_num_imprecise_acc=BLOCK_K)  # fmt: skip
            else:
                acc = fx.dot(a, fx.trans(fx.load(b_ptrs, mask=b_ok, other=0.0)), acc)
                if GATED:
                    acc_up = fx.dot(a, fx.trans(fx.load(b_ptrs + up_offset, mask=b_ok, other=0.0)), acc_up)
            a_ptrs += a_step
            b_ptrs += b_step
        if QUANT == 1:
            # per-channel weights, per-row activations: the whole dot is dequantized once, here
            sa = fx.load(as_ptr + row_offset(a_rows, stride_asm), mask=m_ok, other=0.0)
            bs_e = bs_ptr + row_offset(expert, stride_bse)
            sb = fx.load(bs_e + row_offset(rn, stride_bsn), mask=n_ok, other=0.0)
            acc = acc.to(fx.float32) * sa[:, None] * sb[None, :]
            if GATED:
                sb_up = fx.load(bs_e + row_offset(rn + N, stride_bsn), mask=n_ok, other=0.0)
                acc_up = acc_up.to(fx.float32) * sa[:, None] * sb_up[None, :]
        if MUL_WEIGHT:
            # the router weight [t, j] of row t * k + j, read in place (any dtype and strides): no converted
            # copy is made on the host
            w_t = rows // TOPK
            w_ptrs = w_ptr + row_offset(w_t, stride_wt) + row_offset(rows - w_t * TOPK, stride_wk)
            w = fx.load(w_ptrs, mask=m_ok, other=0.0).to(fx.float32)
            acc = acc * w[:, None]
            if GATED:
                acc_up = acc_up * w[:, None]
        if GATED:
            acc = activation(acc, ACT) * acc_up
        c_ptrs = c_ptr + row_offset(rows, stride_cm)[:, None] + row_offset(rn, stride_cn)[None, :]
        fx.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# fmt: off
@flyc.kernel(do_not_specialize=["T"])
def _moe_sum_kernel(
    c_ptr, ids_ptr, out_ptr, T, H, E, stride_cm, stride_it, stride_ik, stride_ot, stride_oh,
    TOPK: fx.constexpr, BLOCK_H: fx.constexpr,
):
    # fmt: on
    t = fx.program_id(0)
    rh = fx.program_id(1) * BLOCK_H + fx.arange(0, BLOCK_H)
    h_ok = rh < H
    acc = fx.zeros([BLOCK_H], dtype=fx.float32)
    for j in fx.static_range(TOPK):
        e = fx.load(ids_ptr + row_offset(t, stride_it) + j * stride_ik)
        used = (e >= 0) & (e < E)
        row = row_offset(t * TOPK + j, stride_cm)
        acc += fx.load(c_ptr + row + rh, mask=h_ok & used, other=0.0).to(fx.float32)
    fx.store(out_ptr + row_offset(t, stride_ot) + row_offset(rh, stride_oh), acc.to(out_ptr.dtype.element_ty),
             mask=h_ok)  # fmt: skip


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _moe_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, GROUP, stride_xm, stride_xk, stride_qm, stride_sm,
    QMAX: fx.constexpr, OUT_INT8: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_K: fx.constexpr,
):
    # fmt: on
    # program (row block, group): scale = amax / QMAX of the group's elements of each row, q = saturate(
    # round(x * (QMAX / amax))) (0 for an all-zero group); the same arithmetic as the reference's
    rows = fx.program_id(0) * BLOCK_M + fx.arange(0, BLOCK_M)
    g = fx.program_id(1)
    row_ok = rows < M
    rk = fx.arange(0, BLOCK_K)
    x_rows = x_ptr + row_offset(rows, stride_xm)[:, None]
    q_rows = q_ptr + row_offset(rows, stride_qm)[:, None]
    k_lo = g * GROUP
    amax = fx.zeros([BLOCK_M], dtype=fx.float32)
    for c0 in range(0, GROUP, BLOCK_K):
        c = k_lo + c0 + rk
        ok = row_ok[:, None] & ((c < K) & (c0 + rk < GROUP))[None, :]
        xc = fx.load(x_rows + row_offset(c, stride_xk)[None, :], mask=ok, other=0.0)
        amax = maximum_nan(amax, absmax_f32(xc, 1))
    inv = inverse_scale(amax, QMAX)
    fx.store(s_ptr + row_offset(rows, stride_sm) + g, quant_scale(amax, QMAX), mask=row_ok)
    for c0 in range(0, GROUP, BLOCK_K):
        c = k_lo + c0 + rk
        ok = row_ok[:, None] & ((c < K) & (c0 + rk < GROUP))[None, :]
        xc = fx.load(x_rows + row_offset(c, stride_xk)[None, :], mask=ok, other=0.0).to(fx.float32)
        v = xc * inv[:, None]
        if OUT_INT8:
            qv = cast_sat_int8(v)
        else:
            qv = cast_sat_fp8e4m3(v)
        fx.store(q_rows + c[None, :], qv, mask=ok)


# ------------------------------------------------------------------ host launchers


def _fp4_asm(bf16_mxfp4: bool, group: int, cfg) -> bool:
    """Whether an MXFP4 launch decodes through :func:`_fp4_bf16`: bf16 activations, one scale a column a K step,
    whole 4-byte packs a thread, and tiles of fewer than 64 rows (the warp-level MMA of decode sizes, where the
    decode bounds the step; sm_90's compiler rejects the shared layout it picks for some warpgroup-MMA tiles,
    64 x 128 x 32 at 4 warps among them, which keep the fp32 decode)."""
    return (bf16_mxfp4 and group % cfg.block_k == 0 and cfg.block_m < 64
            and (cfg.block_n * cfg.block_k // 2) % (4 * 32 * cfg.num_warps) == 0)  # fmt: skip


@flyc.jit(skip_empty=False)
def launch_moe_gemm(
    a, w, c, sorted_ids, expert_ids, num_padded, weights, topk: int, numel: int, *, gather_a: bool, gated: bool,
    act: int, mul_weight: bool, cfg, a_scale=None, w_scale=None, quant: int = QUANT_NONE,
    scale_block: tuple = (1, 1), fp4: bool = False, stream=None,
):  # fmt: skip
    """One grouped GEMM (see the module): ``c[row] = epilogue(A[row or row // topk] @ w[e]^T)`` over the
    aligned blocks. ``w`` [E, N', K] (stage 1: N' = 2N, gate rows then up rows); ``c`` [T * k, N];
    ``weights``: the router weights [T, k], fp32 / bf16 / fp16, any strides (read with ``mul_weight``).
    Quantized (``quant``): ``a`` fp8 / int8 with fp32 ``a_scale`` [rows of a, groups] (one group a row for
    QUANT_CHANNEL, one a ``scale_block[1]`` columns for QUANT_BLOCK); ``w_scale`` fp32 [E, N'] (channel) or
    [E, cdiv(N', scale_block[0]), cdiv(K, scale_block[1])] (block), any strides. QUANT_W4: ``a`` 16-bit,
    ``w`` uint8 [E, N', K / 2] (int4 pairs; ``fp4``: fp4 e2m1 pairs with e8m0 scales read as uint8),
    ``w_scale`` as for block scales, no ``a_scale``. QUANT_W4A8: ``w`` and ``w_scale`` as QUANT_W4, ``a`` fp8
    e4m3 with ``a_scale`` as QUANT_BLOCK's (groups of ``scale_block[1]`` columns)."""
    n = c.shape[1]
    k = a.shape[1]
    blocks = expert_ids.shape[0]
    if blocks == 0 or n == 0:
        return
    if quant == QUANT_NONE:
        a_scale, w_scale = a, w  # not read
        as_strides, ws_strides = (0, 0), (0, 0, 0)
    else:
        if a_scale is None:  # weight-only (QUANT_W4): no activation scales
            a_scale, as_strides = a, (0, 0)
        else:
            as_strides = (a_scale.stride(0), a_scale.stride(1))
        ws_strides = (w_scale.stride(0), w_scale.stride(1), w_scale.stride(2) if w_scale.dim() == 3 else 0)
    # fmt: off
    flyc.launch(
        _moe_gemm_kernel, (blocks * flyc.cdiv(n, cfg.block_n),),
        a, w, c, sorted_ids, expert_ids, num_padded, weights, a_scale, w_scale,
        n, k, w.shape[2] if quant >= QUANT_W4 else k, numel, blocks, topk, n * w.stride(1),
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        weights.stride(0), weights.stride(1), *as_strides, *ws_strides,
        GATHER_A=gather_a, GATED=gated, ACT=act, MUL_WEIGHT=mul_weight,
        QUANT=quant, INT_ACC=not a.dtype.is_floating_point,
        SCALE_BN=scale_block[0], SCALE_BK=scale_block[1], FP4=fp4,
        FP4_ASM=_fp4_asm(fp4 and quant == QUANT_W4 and a.dtype == torch.bfloat16, scale_block[1], cfg),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **cfg.launch_options(),
    )
    # fmt: on


@flyc.jit(skip_empty=False)
def launch_moe_quant(x, q, scale, group: int, stream=None):
    """Dynamic symmetric quantization of ``x`` [M, K] (16-bit, any strides) into ``q`` [M, K] (fp8 e4m3 or
    int8, contiguous rows) with fp32 ``scale`` [M, cdiv(K, group)]: one scale a row's ``group`` columns
    (``group = K``: per token)."""
    m, k = x.shape
    if m == 0 or k == 0:
        return
    is_int8 = not q.dtype.is_floating_point
    block_k = min(512, flyc.next_power_of_2(group))
    block_m = max(1, min(16, 2048 // block_k))
    # fmt: off
    flyc.launch(
        _moe_quant_kernel, (flyc.cdiv(m, block_m), flyc.cdiv(k, group)),
        x, q, scale, m, k, group, x.stride(0), x.stride(1), q.stride(0), scale.stride(0),
        QMAX=127.0 if is_int8 else 448.0, OUT_INT8=is_int8, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
    )
    # fmt: on


@flyc.jit(skip_empty=False)
def launch_moe_sum(c, topk_ids, out, num_experts: int, stream=None):
    """``out[t] = sum_j c[t * k + j]`` over the slots j whose expert is in [0, E), in fp32, in order of j."""
    t, h = out.shape
    topk = topk_ids.shape[1]
    if t == 0 or h == 0:
        return
    block_h = min(1024, flyc.next_power_of_2(h))
    # fmt: off
    flyc.launch(
        _moe_sum_kernel, (t, flyc.cdiv(h, block_h)),
        c, topk_ids, out, t, h, num_experts, c.stride(0), topk_ids.stride(0), topk_ids.stride(1),
        out.stride(0), out.stride(1), TOPK=topk, BLOCK_H=block_h, num_warps=4,
    )
    # fmt: on
