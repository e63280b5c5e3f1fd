"""The pointer-based tiled GEMM: ``C = epilogue(A @ B^T)`` for every shape, stride and dtype.

One program computes a ``BLOCK_M x BLOCK_N`` tile of C and walks K in
``BLOCK_K`` steps with masked loads, so M, N and K may be anything (M = 1,
K not a multiple of the tile, K = 0) and the operands are read through their
strides in place (a transposed or sliced A or B costs no copy and needs no
alignment). Programs take tiles in grouped order (``fx.grouped_tile``): the
GROUP_M row-tiles of a group share their B tiles through L2.

Accumulators: fp32 for fp16/bf16/fp8 e4m3 inputs, int32 for int8; the
epilogue (:mod:`.epilogue`: scales, bias, activation) runs in fp32 before the
one downcast. A raw int8 product stores the int32 accumulator (``RAW``).

Split-K (decode-size M, too few C tiles to occupy the GPU): a second grid
axis splits K; each split stores its partial sums and :mod:`.splitk` adds
them in a fixed order and runs the epilogue (in a second kernel, or in the
tile's last split to finish: ``reduce_last``).
"""

from __future__ import annotations

import dataclasses

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import pdl_launch_dependents, pdl_wait, prefetch_l2, row_offset

from .epilogue import epilogue_meta, store_c
from .splitk import split_launch, store_split

__all__ = ["launch_tiled"]


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _gemm_tiled_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr, p_ptr, cnt_ptr,
    M, N, K, split_steps, stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr,
    INT_ACC: fx.constexpr, RAW: fx.constexpr, SPLIT: fx.constexpr, REDUCE_LAST: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, GROUP_M: fx.constexpr,
    PREFETCH_LINES: fx.constexpr, SPLITS_MAX: fx.constexpr = 1,
):
    # fmt: on
    # Program (tile, s): the C tile in grouped order, over split s of K (split_steps K steps each). The
    # split's start as a multiple of the constexpr BLOCK_K keeps the loads' alignment provable (without
    # it the compiler can neither vectorize nor pipeline them).
    pid_m, pid_n = fx.grouped_tile(fx.program_id(0), fx.cdiv(M, BLOCK_M), fx.cdiv(N, BLOCK_N), GROUP_M)
    split = fx.program_id(1)
    k_begin = split * split_steps * BLOCK_K
    k_end = fx.minimum(K, k_begin + split_steps * BLOCK_K)
    rm = pid_m * BLOCK_M + fx.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)
    rk = fx.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    # int64 offsets: M x K and N x K past 2^31 elements address correctly
    a_ptrs = a_ptr + row_offset(rm, stride_am)[:, None] + row_offset(k_begin + rk, stride_ak)[None, :]
    # B's tile as [N, K], transposed for the dot: K-major operands, which Hopper's 8-bit wgmma requires
    b_ptrs = b_ptr + row_offset(rn, stride_bn)[:, None] + row_offset(k_begin + rk, stride_bk)[None, :]
    a_step = row_offset(BLOCK_K, stride_ak)
    b_step = row_offset(BLOCK_K, stride_bk)
    if PREFETCH_LINES > 0:  # launched early (PDL): weights into L2 while the kernel before finishes
        line = 1024 // b_ptr.dtype.element_ty.primitive_bitwidth  # elements of B in a 128-byte line
        kl = k_begin + fx.arange(0, PREFETCH_LINES) * line
        prefetch_l2(b_ptr + row_offset(rn, stride_bn)[:, None] + row_offset(kl, stride_bk)[None, :],
                    n_ok[:, None] & (kl < k_end)[None, :], b_ptr)  # fmt: skip
        pdl_wait()  # A, C and the split workspace may belong to that kernel until it has finished
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.int32 if INT_ACC else fx.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = rk < k_end - k0
        a = fx.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = fx.trans(fx.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0))
        if INT_ACC:
            acc += fx.dot(a, b, out_dtype=fx.int32)
        else:
            acc = fx.dot(a, b, acc)
        a_ptrs += a_step
        b_ptrs += b_step

    if PREFETCH_LINES > 0:
        # The next kernel may launch once every program is past its weight stream: its programs prefetch
        # while this one's epilogue (and split reduction) runs. Signalled at the start instead, each kernel
        # of a chain launched the next at once, and their programs, resident early, slowed the weight
        # stream by a quarter (H200, 4096 x 14336 at M = 16: 33.4 -> 42.4 us).
        pdl_launch_dependents()
    if SPLIT:  # this split's partial sums, added up in order by .splitk
        store_split(acc, split, fx.program_id(0), p_ptr, cnt_ptr, M, N, fx.num_programs(1), rm, rn, c_ptr, stride_cm,
                    stride_cn, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS, ACT, RAW, REDUCE_LAST,
                    SPLITS_MAX)  # fmt: skip
    else:
        store_c(acc, rm, rn, m_ok, n_ok, c_ptr, stride_cm, stride_cn, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B,
                HAS_BIAS, ACT, RAW)  # fmt: skip


@flyc.jit(skip_empty=False)
def launch_tiled(a, b_nk, c, bias, scale_a, scale_b, act: int, cfg, stream=None):
    """Launch the tiled kernel: ``c[M, N] = epilogue(a[M, K] @ b_nk[N, K]^T)`` through the given strides.

    ``b_nk`` is B as an ``[N, K]`` view (a ``[K, N]`` B goes as its transpose: only the strides differ).
    ``scale_a`` / ``scale_b``: fp32, one element or one a row / column (flattened), or None. ``act``: an
    ``ACT_*`` code of :mod:`flydsl_common.device`. ``cfg``: a :class:`fly_gemm.autotune.GemmConfig`.
    With K = 0 the epilogue runs on zeros (bias and activation still apply).

    ``cfg.split_k > 1`` (decode-size M, where the C tiles are too few to occupy the GPU): each split of K
    writes its partial sums (fp32, int32 for int8) to a workspace; they are added in order before the
    epilogue by a second kernel or, with ``cfg.reduce_last``, by the tile's last split to finish.
    """
    m, k = a.shape
    n = b_nk.shape[0]
    if m == 0 or n == 0:
        return
    int_acc = not a.dtype.is_floating_point
    tiles = flyc.cdiv(m, cfg.block_m) * flyc.cdiv(n, cfg.block_n)
    if cfg.pdl and torch.cuda.is_current_stream_capturing():  # a graph's edges: plain launches
        cfg = dataclasses.replace(cfg, pdl=False)
    sp = split_launch(m, n, k, tiles, cfg, int_acc, c)
    # fmt: off
    flyc.launch(
        _gemm_tiled_kernel, (tiles, sp.splits),
        a, b_nk, c, bias, scale_a, scale_b, sp.workspace, sp.counters,
        m, n, k, sp.split_steps, a.stride(0), a.stride(1), b_nk.stride(0), b_nk.stride(1), c.stride(0), c.stride(1),
        **epilogue_meta(scale_a, scale_b, bias, act), INT_ACC=int_acc, RAW=not c.dtype.is_floating_point,
        SPLIT=sp.splits > 1, REDUCE_LAST=sp.reduce_last, SPLITS_MAX=sp.splits,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PREFETCH_LINES=_prefetch_lines(cfg, b_nk.element_size()), **cfg.launch_options(),
    )
    # fmt: on
    sp.finish(c, bias, scale_a, scale_b, act)


def _prefetch_lines(cfg, itemsize: int) -> int:
    """128-byte lines of each B row a PDL program prefetches: its pipeline's first ``num_stages`` K steps,
    rounded up to a power of two (0: no PDL)."""
    if not cfg.pdl:
        return 0
    return flyc.next_power_of_2(max(1, cfg.num_stages * cfg.block_k * itemsize // 128))
