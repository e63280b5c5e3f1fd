"""The decode GEMM on CUDA cores: ``C = epilogue(A @ B^T)`` for a few rows of A (M up to ``BLOCK_M``).

At decode sizes the time is the read of B (the weights); tensor-core tiles of 16+ rows compute mostly
padding there, and what matters is the bytes in flight. One program owns ``BLOCK_N`` rows of B (columns
of C) and ``BLOCK_M`` rows of A, walks K in ``BLOCK_K`` steps (the next step of B loaded before this
step's products) and keeps a per-lane accumulator
``[BLOCK_M, BLOCK_N, BLOCK_K]`` (each lane multiplies its own elements: no reduction inside the loop),
reduced over K once at the end; then the shared epilogue (:mod:`.epilogue`). Products accumulate in fp32
(int32 for int8: exact). A second grid axis covers M past ``BLOCK_M``.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .epilogue import epilogue_meta, store_c

__all__ = ["launch_gemv"]


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _gemv_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr,
    M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr,
    INT_ACC: fx.constexpr, RAW: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr,
):
    # fmt: on
    rn = fx.program_id(0) * BLOCK_N + fx.arange(0, BLOCK_N)
    rm = fx.program_id(1) * BLOCK_M + fx.arange(0, BLOCK_M)
    rk = fx.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + row_offset(rm, stride_am)[:, None] + row_offset(rk, stride_ak)[None, :]  # [BM, BK]
    b_ptrs = b_ptr + row_offset(rn, stride_bn)[:, None] + row_offset(rk, stride_bk)[None, :]  # [BN, BK]
    a_step = row_offset(BLOCK_K, stride_ak)
    b_step = row_offset(BLOCK_K, stride_bk)
    acc = fx.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=fx.int32 if INT_ACC else fx.float32)
    # B's next step is loaded before this step's products (by hand: the compiler pipelines loads that feed
    # a dot, not these), so two steps of the weights are in flight a program.
    b_nx = fx.load(b_ptrs, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        b = b_nx
        b_ptrs += b_step
        b_nx = fx.load(b_ptrs, mask=n_ok[:, None] & (rk < K - k0 - BLOCK_K)[None, :], other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
        a = fx.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_last")
        if INT_ACC:
            acc += a.to(fx.int32)[:, None, :] * b.to(fx.int32)[None, :, :]
        else:
            acc += a.to(fx.float32)[:, None, :] * b.to(fx.float32)[None, :, :]
        a_ptrs += a_step
    store_c(fx.sum(acc, axis=2), rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr, SCALE_A,
            SCALE_B, HAS_BIAS, ACT, RAW)  # fmt: skip


@flyc.jit(skip_empty=False)
def launch_gemv(a, b_nk, c, bias, scale_a, scale_b, act: int, cfg, stream=None):
    """Launch the CUDA-core decode kernel (arguments as :func:`fly_gemm._kernels.tiled.launch_tiled`)."""
    m, k = a.shape
    n = b_nk.shape[0]
    if m == 0 or n == 0:
        return
    # fmt: off
    flyc.launch(
        _gemv_kernel, (flyc.cdiv(n, cfg.block_n), flyc.cdiv(m, cfg.block_m)),
        a, b_nk, c, bias, scale_a, scale_b,
        m, n, k, a.stride(0), a.stride(1), b_nk.stride(0), b_nk.stride(1), c.stride(0), c.stride(1),
        **epilogue_meta(scale_a, scale_b, bias, act),
        INT_ACC=not a.dtype.is_floating_point, RAW=not c.dtype.is_floating_point,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **cfg.launch_options(),
    )
    # fmt: on
