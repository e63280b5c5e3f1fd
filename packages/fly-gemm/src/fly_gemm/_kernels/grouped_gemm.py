"""Device code of the grouped GEMM (tokens already grouped by expert): the group table, the grouped
product ``C[rows of g] = A[rows of g] @ B[g]^T`` and the per-group weight gradient ``dB[g] = dC_g^T @ A_g``.

Rows: group g owns rows ``[end(g-1), end(g))`` with ``end(g) = max(offsets[0..g])`` clamped to ``[0, M]``
(so decreasing or out-of-range offsets, which the host does not read on a GPU, give empty groups instead of
reads out of bounds), and the rows ``[end(G-1), M)`` past the last offset form a tail group that has no
weight and whose output rows are written as zeros.

Nothing is read back to the host: the grid is sized by the bound on the row tiles,
``sum_g cdiv(rows_g, BLOCK_M) <= cdiv(M, BLOCK_M) + G`` (G groups and the tail), and a one-program kernel
writes the table the GEMM programs read:

- ``row_start[g]``, g in [0, G + 1]: the first row of group g (``row_start[G]`` the tail's, ``row_start[G + 1]
  = M``);
- ``tile_start[g]``, g in [0, G + 1]: the first row tile of group g in a running count (``tile_start[G + 1]``
  the number of tiles).

A GEMM program maps its row-tile index to its group by a binary search of ``tile_start`` (log2(G + 2)
scalar loads, in L2 after the first program); programs past the real count exit at once.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

__all__ = ["launch_group_table", "launch_grouped_gemm", "launch_grouped_wgrad", "max_row_tiles", "search_steps"]


@flyc.func
def _max_combine(x, y):
    return fx.maximum(x, y)


@flyc.kernel(do_not_specialize=["G", "M"])
def _group_table_kernel(
    offs_ptr, table_ptr, G, M, stride_o, BLOCK_M: fx.constexpr, BLOCK_G: fx.constexpr
):  # fmt: skip
    # One program, BLOCK_G groups a step; the running maximum of the ends and the running tile count carry
    # from one step to the next. table: row_start [G + 2] then tile_start [G + 2].
    tile_ptr = table_ptr + G + 2
    end_carry = M * 0
    tile_carry = M * 0
    for g0 in range(0, G + 1, BLOCK_G):
        g = g0 + fx.arange(0, BLOCK_G)
        # end of g (the tail's: M) and end of g - 1 (before group 0: 0), clamped to [0, M]
        cur = fx.load(offs_ptr + g * stride_o, mask=g < G, other=M)
        prev = fx.load(offs_ptr + (g - 1) * stride_o, mask=(g >= 1) & (g <= G), other=0)
        prev = fx.where(g == 0, 0, fx.where(g > G, M, prev))
        cur = fx.minimum(fx.maximum(cur, 0), M)
        prev = fx.minimum(fx.maximum(prev, 0), M)
        end = fx.maximum(fx.associative_scan(cur, 0, _max_combine), end_carry)
        start = fx.maximum(fx.associative_scan(prev, 0, _max_combine), end_carry)
        tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        inclusive = fx.cumsum(tiles, 0) + tile_carry
        ok = g <= G
        fx.store(table_ptr + g, start, mask=ok)
        fx.store(tile_ptr + g, inclusive - tiles, mask=ok)
        end_carry = fx.max(end, 0)
        tile_carry = fx.max(inclusive, 0)
    fx.store(table_ptr + G + 1, M)
    fx.store(tile_ptr + G + 1, tile_carry)


# fmt: off
@flyc.kernel(do_not_specialize=["max_tiles"])
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, table_ptr,
    G, N, K, max_tiles, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, GROUP_M: fx.constexpr,
    SEARCH: fx.constexpr,
):
    # fmt: on
    t, pid_n = fx.grouped_tile(fx.program_id(0), max_tiles, fx.cdiv(N, BLOCK_N), GROUP_M)
    tile_ptr = table_ptr + G + 2
    if t < fx.load(tile_ptr + G + 1):
        # the group of tile t: the largest g with tile_start[g] <= t (an empty group shares its start with
        # the next one, so the last of equal starts is the one that owns the tile)
        lo = t * 0
        hi = lo + G + 1
        for _ in fx.static_range(SEARCH):
            mid = (lo + hi) // 2
            right = fx.load(tile_ptr + mid) <= t
            lo = fx.where(right, mid, lo)
            hi = fx.where(right, hi, mid)
        grp = lo
        first = fx.load(table_ptr + grp) + (t - fx.load(tile_ptr + grp)) * BLOCK_M
        rm = first + fx.arange(0, BLOCK_M)
        m_ok = rm < fx.load(table_ptr + grp + 1)
        rn = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)
        rk = fx.arange(0, BLOCK_K)
        n_ok = rn < N
        a_ptrs = a_ptr + row_offset(rm, stride_am)[:, None] + row_offset(rk, stride_ak)[None, :]
        # B[g]'s tile as [N, K], transposed for the dot; the tail group reads no weight (no K steps)
        b_ptrs = (b_ptr + row_offset(fx.minimum(grp, G - 1), stride_be) + row_offset(rn, stride_bn)[:, None]
                  + row_offset(rk, stride_bk)[None, :])  # fmt: skip
        a_step = row_offset(BLOCK_K, stride_ak)
        b_step = row_offset(BLOCK_K, stride_bk)
        k_end = fx.where(grp < G, K, 0)
        acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
        for k0 in range(0, k_end, BLOCK_K):
            k_ok = rk < K - k0
            a = fx.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = fx.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = fx.dot(a, fx.trans(b), acc)
            a_ptrs += a_step
            b_ptrs += b_step
        c_ptrs = c_ptr + row_offset(rm, stride_cm)[:, None] + row_offset(rn, stride_cn)[None, :]
        fx.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# fmt: off
@flyc.kernel
def _grouped_wgrad_kernel(
    g_ptr, a_ptr, d_ptr, table_ptr,
    N, K, stride_gm, stride_gn, stride_am, stride_ak, stride_de, stride_dn, stride_dk,
    BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, BLOCK_R: fx.constexpr, GROUP_N: fx.constexpr,
):
    # fmt: on
    # Program: one [BLOCK_N, BLOCK_K] tile of dB[e], reducing over the group's rows in order (one program a
    # tile: deterministic, no atomics); a group without rows stores zeros.
    tiles_n = fx.cdiv(N, BLOCK_N)
    tiles_k = fx.cdiv(K, BLOCK_K)
    pid = fx.program_id(0)
    e = pid // (tiles_n * tiles_k)
    pid_n, pid_k = fx.grouped_tile(pid % (tiles_n * tiles_k), tiles_n, tiles_k, GROUP_N)
    r_begin = fx.load(table_ptr + e)
    r_end = fx.load(table_ptr + e + 1)
    rr = fx.arange(0, BLOCK_R)
    rn = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + fx.arange(0, BLOCK_K)
    n_ok = rn < N
    k_ok = rk < K
    g_ptrs = g_ptr + row_offset(r_begin + rr, stride_gm)[:, None] + row_offset(rn, stride_gn)[None, :]
    a_ptrs = a_ptr + row_offset(r_begin + rr, stride_am)[:, None] + row_offset(rk, stride_ak)[None, :]
    g_step = row_offset(BLOCK_R, stride_gm)
    a_step = row_offset(BLOCK_R, stride_am)
    acc = fx.zeros([BLOCK_N, BLOCK_K], dtype=fx.float32)
    for r0 in range(r_begin, r_end, BLOCK_R):
        r_ok = rr < r_end - r0
        gt = fx.load(g_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        at = fx.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc = fx.dot(fx.trans(gt), at, acc)
        g_ptrs += g_step
        a_ptrs += a_step
    d_ptrs = (d_ptr + row_offset(e, stride_de) + row_offset(rn, stride_dn)[:, None]
              + row_offset(rk, stride_dk)[None, :])  # fmt: skip
    fx.store(d_ptrs, acc.to(d_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


# ------------------------------------------------------------------ host launchers


def max_row_tiles(m: int, groups: int, block_m: int) -> int:
    """The bound on the row tiles of all groups and the tail: ``cdiv(M, BLOCK_M) + G`` (each nonempty group
    adds at most one partial tile to the tiles of M rows)."""
    return flyc.cdiv(m, block_m) + groups


def search_steps(groups: int) -> int:
    """Binary-search steps that narrow ``[0, G + 1)`` to one group."""
    return max(1, (groups + 1).bit_length())


@flyc.jit(skip_empty=False)
def launch_group_table(offsets, table, m: int, block_m: int, stream=None):
    """Write ``table`` (int32 ``[2 * (G + 2)]``: ``row_start`` then ``tile_start``) from ``offsets`` (int32
    ``[G]``, cumulative row ends) for ``m`` rows in tiles of ``block_m``."""
    groups = offsets.shape[0]
    block_g = min(1024, flyc.next_power_of_2(groups + 1))
    flyc.launch(_group_table_kernel, (1,), offsets, table, groups, m, offsets.stride(0) if groups else 1,
                BLOCK_M=block_m, BLOCK_G=block_g, num_warps=4)  # fmt: skip


@flyc.jit(skip_empty=False)
def launch_grouped_gemm(a, b, c, table, cfg, stream=None):
    """``c[rows of g] = a[rows of g] @ b[g]^T`` (tail rows: zeros) through every operand's strides: ``a``
    ``[M, K]``, ``b`` ``[G, N, K]`` (any view, e.g. a transposed one for the input gradient), ``c``
    ``[M, N]``; ``table`` from :func:`launch_group_table` with ``cfg.block_m``."""
    m, k = a.shape
    groups, n = b.shape[0], b.shape[1]
    if m == 0 or n == 0:
        return
    tiles = max_row_tiles(m, groups, cfg.block_m)
    # fmt: off
    flyc.launch(
        _grouped_gemm_kernel, (tiles * flyc.cdiv(n, cfg.block_n),),
        a, b, c, table, groups, n, k, tiles, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SEARCH=search_steps(groups), **cfg.launch_options(),
    )
    # fmt: on


@flyc.jit(skip_empty=False)
def launch_grouped_wgrad(g, a, d, table, cfg, stream=None):
    """``d[e] = g[rows of e]^T @ a[rows of e]`` for every group e (zeros for a group without rows): ``g``
    ``[M, N]``, ``a`` ``[M, K]``, ``d`` ``[G, N, K]``; output tiles ``cfg.block_m x cfg.block_n`` over
    (N, K), rows reduced in ``cfg.block_k`` steps."""
    groups, n, k = d.shape
    if groups == 0 or n == 0 or k == 0:
        return
    tiles = flyc.cdiv(n, cfg.block_m) * flyc.cdiv(k, cfg.block_n)
    # fmt: off
    flyc.launch(
        _grouped_wgrad_kernel, (groups * tiles,),
        g, a, d, table, n, k, g.stride(0), g.stride(1), a.stride(0), a.stride(1), d.stride(0), d.stride(1),
        d.stride(2), BLOCK_N=cfg.block_m, BLOCK_K=cfg.block_n, BLOCK_R=cfg.block_k, GROUP_N=cfg.group_m,
        **cfg.launch_options(),
    )
    # fmt: on
