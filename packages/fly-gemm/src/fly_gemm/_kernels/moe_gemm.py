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

Each routed row's output is written to its own row ``t * k + j``; the reduce kernel adds a token's k rows
in a fixed order (deterministic, no atomics) in fp32, skipping slots whose expert is not in [0, E).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import activation, row_offset

__all__ = ["launch_moe_gemm", "launch_moe_sum"]


# fmt: off
@flyc.kernel(do_not_specialize=["NUMEL", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ptr, expert_ids_ptr, npad_ptr, w_ptr,
    N, K, NUMEL, num_blocks, TOPK, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_wt, stride_wk,
    GATHER_A: fx.constexpr, GATED: fx.constexpr, ACT: fx.constexpr, MUL_WEIGHT: fx.constexpr,
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
        b_ptrs = (b_ptr + row_offset(expert, stride_be) + row_offset(rn, stride_bn)[:, None]
                  + row_offset(rk, stride_bk)[None, :])  # fmt: skip
        a_step = row_offset(BLOCK_K, stride_ak)
        b_step = row_offset(BLOCK_K, stride_bk)
        acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
        acc_up = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            a = fx.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b_ok = n_ok[:, None] & k_ok[None, :]
            acc = fx.dot(a, fx.trans(fx.load(b_ptrs, mask=b_ok, other=0.0)), acc)
            if GATED:
                acc_up = fx.dot(a, fx.trans(fx.load(b_ptrs + up_offset, mask=b_ok, other=0.0)), acc_up)
            a_ptrs += a_step
            b_ptrs += b_step
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


# ------------------------------------------------------------------ host launchers


@flyc.jit(skip_empty=False)
def launch_moe_gemm(
    a, w, c, sorted_ids, expert_ids, num_padded, weights, topk: int, numel: int, *, gather_a: bool, gated: bool,
    act: int, mul_weight: bool, cfg, stream=None,
):  # fmt: skip
    """One grouped GEMM (see the module): ``c[row] = epilogue(A[row or row // topk] @ w[e]^T)`` over the
    aligned blocks. ``w`` [E, N', K] (stage 1: N' = 2N, gate rows then up rows); ``c`` [T * k, N];
    ``weights``: the router weights [T, k], fp32 / bf16 / fp16, any strides (read with ``mul_weight``)."""
    n = c.shape[1]
    k = a.shape[1]
    blocks = expert_ids.shape[0]
    if blocks == 0 or n == 0:
        return
    # fmt: off
    flyc.launch(
        _moe_gemm_kernel, (blocks * flyc.cdiv(n, cfg.block_n),),
        a, w, c, sorted_ids, expert_ids, num_padded, weights,
        n, k, numel, blocks, topk, n * w.stride(1),
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        weights.stride(0), weights.stride(1), GATHER_A=gather_a, GATED=gated, ACT=act, MUL_WEIGHT=mul_weight,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, **cfg.launch_options(),
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
