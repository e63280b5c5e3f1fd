"""The persistent TMA GEMM (Hopper): ``C = epilogue(A @ B^T)`` with tensor descriptors.

A grid of at most one program an SM (two with ``occupancy``: one program's
epilogue overlaps the other's main loop) walks the output tiles in grouped
order (``fx.grouped_tile``: GROUP_M row-tiles share their B tiles through
L2), a grid's width apart. Each tile's K loop loads A and B blocks through tensor
descriptors (the copy engine moves them into shared memory; out-of-bounds
rows and columns read as zeros, so ragged M, N and K need no masks) and feeds
the tensor cores; the epilogue (:mod:`.epilogue`) runs in fp32 and the tile is
stored through a descriptor (clipped at the edges).

TMA needs every stride but the last to be a multiple of 16 bytes and the last
to be 1: the host (:func:`tma_operand_a`) sends anything else to the tiled
kernel, since a descriptor over a misaligned row reads wrong data without an
error. B may be ``[N, K]`` (K-major: what Hopper's 8-bit tensor cores take
directly) or ``[K, N]`` (``B_KN``); A ``[M, K]`` or, read through a
transposed view, ``[K, M]`` (``A_KM``: the gradient G^T of a backward).

Options of the tile loop (``GemmConfig``): ``flatten`` fuses it with the K
loop so the next tile's loads start during this tile's last steps;
``warp_specialize`` lets Triton split loads and math across warp groups;
``epilogue_subtile`` stores the tile in two column halves through a buffer
of half the size, which leaves shared memory for another pipeline stage
(128 x 256 tiles at 4 stages). ``split_k`` (few tiles against a long K, e.g.
256 rows x 4096 columns x K 14336) makes the work units (split, tile): each
writes its partial sums and :mod:`.splitk` adds them and runs the epilogue.
"""

from __future__ import annotations

import torch

import flydsl.arch
import flydsl.compiler as flyc
import flydsl.expr as fx

from .epilogue import epilogue, epilogue_meta
from .splitk import split_launch, store_split

__all__ = ["tma_rows", "tma_operand_a", "launch_persistent"]


# fmt: off
@flyc.kernel(do_not_specialize=["M"])
def _gemm_tma_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, sa_ptr, sb_ptr, p_ptr, cnt_ptr,
    M, N, K, split_steps, stride_am, stride_b, stride_cm,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr,
    INT_ACC: fx.constexpr, RAW_INT: fx.constexpr, A_KM: fx.constexpr, B_KN: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, GROUP_M: fx.constexpr,
    FLATTEN: fx.constexpr, WARP_SPECIALIZE: fx.constexpr, SUBTILE: fx.constexpr, SPLIT_K: fx.constexpr,
    REDUCE_LAST: fx.constexpr, SPLITS_MAX: fx.constexpr = 1,
):
    # fmt: on
    if A_KM:  # A stored as [K, M] (a transposed view, e.g. the gradient in dB = G^T A)
        a_desc = fx.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_am, 1], block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = fx.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_KN:
        b_desc = fx.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N])
    else:
        b_desc = fx.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K])
    C_N: fx.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N  # the columns of one store
    if not SPLIT_K:
        c_desc = fx.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, C_N])
    num_pid_m = fx.cdiv(M, BLOCK_M)
    num_pid_n = fx.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    k_steps = fx.cdiv(K, BLOCK_K)
    splits = 1
    if SPLIT_K:
        splits = fx.cdiv(k_steps, split_steps)
    for work in fx.range(fx.program_id(0), tiles * splits, fx.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        if SPLIT_K:  # work unit (split, tile), split-major: the programs running together share a split's A, B
            split = work // tiles
            tile = work - split * tiles
            k_lo = split * split_steps
            k_hi = fx.minimum(k_steps, k_lo + split_steps)
        else:
            tile = work
            k_lo = 0
            k_hi = k_steps
        pid_m, pid_n = fx.grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.int32 if INT_ACC else fx.float32)
        for ki in range(k_lo, k_hi):
            if A_KM:
                a = fx.trans(a_desc.load([ki * BLOCK_K, m0]))
            else:
                a = a_desc.load([m0, ki * BLOCK_K])
            if B_KN:
                b = b_desc.load([ki * BLOCK_K, n0])
            else:
                b = fx.trans(b_desc.load([n0, ki * BLOCK_K]))
            if INT_ACC:
                acc += fx.dot(a, b, out_dtype=fx.int32)
            else:
                acc = fx.dot(a, b, acc)
        if SPLIT_K:  # this split's partial sums, added up in order by .splitk
            store_split(acc, split, tile, p_ptr, cnt_ptr, M, N, splits, m0 + fx.arange(0, BLOCK_M),
                        n0 + fx.arange(0, BLOCK_N), c_ptr, stride_cm, 1, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B,
                        HAS_BIAS, ACT, RAW_INT, REDUCE_LAST, SPLITS_MAX)  # fmt: skip
        elif SUBTILE:  # the tile's two column halves, stored one after the other through a half-size buffer
            halves = fx.split(fx.permute(fx.reshape(acc, (BLOCK_M, 2, C_N)), (0, 2, 1)))
            _store_tile(c_desc, halves[0], m0, n0, M, N, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS, ACT,
                        RAW_INT, BLOCK_M, C_N)  # fmt: skip
            _store_tile(c_desc, halves[1], m0, n0 + C_N, M, N, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS,
                        ACT, RAW_INT, BLOCK_M, C_N)  # fmt: skip
        else:
            _store_tile(c_desc, acc, m0, n0, M, N, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS, ACT, RAW_INT,
                        BLOCK_M, BLOCK_N)  # fmt: skip


@flyc.func
def _store_tile(
    c_desc, acc, m0, n0, M, N, sa_ptr, sb_ptr, bias_ptr,
    SCALE_A: fx.constexpr, SCALE_B: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr, RAW_INT: fx.constexpr,
    TILE_M: fx.constexpr, TILE_N: fx.constexpr,
):  # fmt: skip
    """The epilogue of a [TILE_M, TILE_N] accumulator at (m0, n0), stored through the descriptor (clipped)."""
    if RAW_INT:
        c_desc.store([m0, n0], acc)
    else:
        rm = m0 + fx.arange(0, TILE_M)
        rn = n0 + fx.arange(0, TILE_N)
        out = epilogue(acc, rm, rn, rm < M, rn < N, sa_ptr, sb_ptr, bias_ptr, SCALE_A, SCALE_B, HAS_BIAS, ACT)
        c_desc.store([m0, n0], out.to(c_desc.dtype))


def tma_rows(t: torch.Tensor, whole_rows: bool = True) -> bool:
    """A 2-D operand TMA can address: unit last stride, 16-byte aligned base and row stride, and (unless
    ``whole_rows`` is False: a scratch buffer of ours, whose bytes between rows are free) row bytes a multiple
    of 16, so that no descriptor store can touch a user's bytes past a row's end."""
    size = t.element_size()
    return (
        t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
        and (not whole_rows or (t.shape[1] * size) % 16 == 0)
    )  # fmt: skip


def tma_operand_a(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, c_scratch: bool = False):
    """``(a's storage, a_km)`` when the persistent TMA kernel may take these operands, else None: a CUDA GPU
    with tensor-memory access (sm_90+) or the interpreter; K > 0; ``b`` (as given, ``[N, K]`` or
    ``[K, N]``) and ``c`` :func:`tma_rows` (``c_scratch``: c is a buffer of ours, see ``whole_rows``);
    ``a`` too, or its transpose (a ``[K, M]`` row-major storage: ``a_km``)."""
    if not flydsl.arch.current(a.device).has_tma:
        return None
    if a.shape[1] == 0 or not (tma_rows(b) and tma_rows(c, whole_rows=not c_scratch)):
        return None
    if tma_rows(a):
        return a, False
    return (a.t(), True) if tma_rows(a.t()) else None


@flyc.jit(skip_empty=False)
def launch_persistent(a, a_km: bool, b, c, bias, scale_a, scale_b, act: int, b_kn: bool, cfg, stream=None):
    """Launch the persistent TMA kernel: ``c[M, N] = epilogue(A[M, K] @ B^T)`` with ``a`` the storage of A
    (``[M, K]``, or ``[K, M]`` with ``a_km``) and ``b`` as ``[N, K]`` or, with ``b_kn``, ``[K, N]``, as
    :func:`tma_operand_a` gives them. Other arguments as :func:`fly_gemm._kernels.tiled.launch_tiled`."""
    k, m = a.shape if a_km else a.shape[::-1]
    n = c.shape[1]
    if m == 0 or n == 0:
        return
    tiles = flyc.cdiv(m, cfg.block_m) * flyc.cdiv(n, cfg.block_n)
    sp = split_launch(m, n, k, tiles, cfg, not a.dtype.is_floating_point, c)
    programs = max(1, min(tiles * sp.splits, cfg.occupancy * flydsl.arch.current(a.device).sm_count))
    flyc.ensure_scratch_allocator()  # the device-side descriptors live in Triton's scratch memory
    # fmt: off
    flyc.launch(
        _gemm_tma_kernel, (programs,),
        a, b, c, bias, scale_a, scale_b, sp.workspace, sp.counters,
        m, n, k, sp.split_steps, a.stride(0), b.stride(0), c.stride(0),
        **epilogue_meta(scale_a, scale_b, bias, act),
        INT_ACC=not a.dtype.is_floating_point, RAW_INT=not c.dtype.is_floating_point, A_KM=bool(a_km),
        B_KN=bool(b_kn),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize, SUBTILE=cfg.epilogue_subtile,
        SPLIT_K=sp.splits > 1, REDUCE_LAST=sp.reduce_last, SPLITS_MAX=sp.splits,
        **cfg.launch_options(),
    )
    # fmt: on
    sp.finish(c, bias, scale_a, scale_b, act)
