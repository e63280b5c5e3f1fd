"""Device code of the MoE routing: top-k of the router's scores, and the alignment of routed rows by expert.

Selection: a token's k experts are taken one at a time, each the largest remaining score, equal scores to
the lower expert id (the minimum id among the maxima), so ties give one answer on every device. A NaN score
ranks above every other, as in torch's sort (the references'), by ranking it as +inf: the max reductions
drop NaN on every target, so a NaN left in the ranking would never be picked (the row's weights finite,
from the other experts, where torch's are NaN), and as a NaN equals no maximum a row of NaN would pick no
column at all (ids past E, which fused_moe would read out of bounds). Ranked first, the NaN expert is taken
and its NaN weight reaches the row's renormalization.

Alignment (``moe_align``), in three launches and no host synchronization: the flat rows ``t * k + j`` are
cut into chunks; (1) each chunk counts its rows per expert, and fills its share of ``sorted_ids`` with the
padding value ``T * k`` (so the buffer needs no fill of its own: a host-side fill would be a fourth launch
and a torch op that a direct replay of the call cannot redo); (2) one program adds the counts up: the rows
of expert e before chunk p, each expert's run padded to a multiple of BLOCK_M and where it starts, the
expert of every block and the padded count; (3) each chunk writes its rows' flat indices at
``start[e] + before[p, e] + rank in the chunk``, so an expert's rows stay in ascending order (the result
does not depend on scheduling). Ids outside [0, E) are not placed.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx

__all__ = ["launch_topk_softmax", "launch_grouped_topk", "launch_align", "align_scratch_size"]

_NEG_INF = fx.constexpr(float("-inf"))
_POS_INF = fx.constexpr(float("inf"))


@flyc.func
def _nan_first(v):
    """``v`` with NaN as +inf: a ranking in which NaN comes first, as torch's sort puts it (see the module)."""
    return fx.where(v != v, _POS_INF, v)


@flyc.func
def _take_max(v, cols, BIG: fx.constexpr):
    """(max of each row of v, the lowest column holding it)."""
    best = fx.max(v, axis=1)
    idx = fx.min(fx.where(v == best[:, None], cols[None, :], BIG), axis=1)
    return best, idx


@flyc.func
def _select(
    v, vals, re, rt, t_ok, w_ptr, ids_ptr, stride_wt, stride_wk, stride_it, stride_ik, scale_num, RENORM: fx.constexpr,
    K: fx.constexpr, BLOCK_T: fx.constexpr, BLOCK_E: fx.constexpr, BLOCK_K: fx.constexpr,
):  # fmt: skip
    """Take the K largest of ``v`` a row (ties to the lower column) and store their columns as ids and their
    ``vals`` as weights, times ``scale_num`` over the chosen weights' sum (RENORM) or times ``scale_num``.
    The weights are kept in registers until scaled, so nothing is read back from memory. ``v`` holds no NaN
    (:func:`_nan_first`): every pick then finds a column below E, the lowest untaken one at worst.

    A taken column is set to -inf and also marked taken: once only -inf scores remain (a row with fewer
    than K finite logits), the next pick is the lowest column not yet taken, as the reference's stable sort
    gives; without the mark it was column 0 again and again (a repeated id carrying its weight again)."""
    rk = fx.arange(0, BLOCK_K)
    ids = fx.zeros([BLOCK_T, BLOCK_K], dtype=fx.int32)
    w = fx.zeros([BLOCK_T, BLOCK_K], dtype=fx.float32)
    taken = (rt[:, None] < 0) & (re[None, :] < 0)  # all False
    for j in fx.static_range(K):
        best = fx.max(v, axis=1)
        idx = fx.min(fx.where((v == best[:, None]) & ~taken, re[None, :], BLOCK_E), axis=1)
        hit = re[None, :] == idx[:, None]
        wj = fx.sum(fx.where(hit, vals, 0.0), axis=1)
        ids = fx.where(rk[None, :] == j, idx[:, None], ids)
        w = fx.where(rk[None, :] == j, wj[:, None], w)
        v = fx.where(hit, _NEG_INF, v)
        taken = taken | hit
    if RENORM:
        w = w * (scale_num / fx.sum(w, axis=1))[:, None]
    else:
        w = w * scale_num
    ok = t_ok[:, None] & (rk[None, :] < K)
    row = rt.to(fx.int64)[:, None]
    fx.store(ids_ptr + row * stride_it + rk[None, :] * stride_ik, ids, mask=ok)
    fx.store(w_ptr + row * stride_wt + rk[None, :] * stride_wk, w, mask=ok)


# fmt: off
@flyc.kernel(do_not_specialize=["T"])
def _topk_softmax_kernel(
    logits_ptr, w_ptr, ids_ptr, T, E, stride_lt, stride_le, stride_wt, stride_wk, stride_it, stride_ik,
    K: fx.constexpr, RENORM: fx.constexpr, BLOCK_T: fx.constexpr, BLOCK_E: fx.constexpr, BLOCK_K: fx.constexpr,
):
    # fmt: on
    rt = fx.program_id(0) * BLOCK_T + fx.arange(0, BLOCK_T)
    re = fx.arange(0, BLOCK_E)
    t_ok = rt < T
    e_ok = re < E
    ptrs = logits_ptr + rt.to(fx.int64)[:, None] * stride_lt + re[None, :] * stride_le
    x = fx.load(ptrs, mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(fx.float32)
    x = fx.where(e_ok[None, :], x, _NEG_INF)  # padding columns; rows past T stay finite (no inf - inf)
    row_max = fx.max(x, axis=1)
    p = fx.exp(x - row_max[:, None])
    p = fx.where(e_ok[None, :], p, 0.0)
    denom = fx.sum(p, axis=1)
    # selected on the logits (they rank as the probabilities do, and equal logits stay equal); a NaN logit's
    # p is NaN, so its row's renormalized weights are NaN as torch's (and its denom, so are the others')
    if RENORM:
        vals = p
    else:
        vals = p / denom[:, None]
    _select(_nan_first(x), vals, re, rt, t_ok, w_ptr, ids_ptr, stride_wt, stride_wk, stride_it, stride_ik, 1.0,
            RENORM, K, BLOCK_T, BLOCK_E, BLOCK_K)  # fmt: skip


# fmt: off
@flyc.kernel(do_not_specialize=["T"])
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, T, E, stride_lt, stride_le, stride_wt, stride_wk, stride_it, stride_ik,
    scaling,
    K: fx.constexpr, GROUPS: fx.constexpr, GROUP_SIZE: fx.constexpr, TOPK_GROUP: fx.constexpr,
    HAS_BIAS: fx.constexpr, SIGMOID: fx.constexpr, RENORM: fx.constexpr,
    BLOCK_T: fx.constexpr, BLOCK_E: fx.constexpr, BLOCK_G: fx.constexpr, BLOCK_K: fx.constexpr,
):
    # fmt: on
    rt = fx.program_id(0) * BLOCK_T + fx.arange(0, BLOCK_T)
    re = fx.arange(0, BLOCK_E)
    rg = fx.arange(0, BLOCK_G)
    t_ok = rt < T
    e_ok = re < E
    ptrs = logits_ptr + rt.to(fx.int64)[:, None] * stride_lt + re[None, :] * stride_le
    x = fx.load(ptrs, mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(fx.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + fx.exp(-x))
    else:
        xm = fx.where(e_ok[None, :], x, _NEG_INF)
        p = fx.exp(xm - fx.max(xm, axis=1)[:, None])
        scores = p / fx.sum(p, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = scores + fx.load(bias_ptr + re, mask=e_ok, other=0.0).to(fx.float32)[None, :]
    # a NaN score (or bias) ranks first in its group and its group first, as in the reference
    choice = fx.where(e_ok[None, :], _nan_first(choice), _NEG_INF)
    group_of = re // GROUP_SIZE
    # each group's score: the sum of its two largest choice scores (with a bias), else its largest
    gscore = fx.full([BLOCK_T, BLOCK_G], float("-inf"), dtype=fx.float32)
    for g in fx.static_range(GROUPS):
        inside = group_of[None, :] == g
        v = fx.where(inside, choice, _NEG_INF)
        first, idx = _take_max(v, re, BLOCK_E)
        s = first
        if HAS_BIAS and GROUP_SIZE > 1:
            second = fx.max(fx.where(re[None, :] == idx[:, None], _NEG_INF, v), axis=1)
            s = _nan_first(first + second)  # inf + -inf (NaN beside a -inf bias) is NaN: first, as the reference
        gscore = fx.where(rg[None, :] == g, s[:, None], gscore)
    # the TOPK_GROUP best groups; experts of the others are out of the running
    keep = (rt[:, None] < 0) & (re[None, :] < 0)  # all False
    for _ in fx.static_range(TOPK_GROUP):
        _, gi = _take_max(gscore, rg, BLOCK_G)
        keep = keep | (group_of[None, :] == gi[:, None])
        gscore = fx.where(rg[None, :] == gi[:, None], _NEG_INF, gscore)
    v = fx.where(keep & e_ok[None, :], choice, _NEG_INF)
    _select(v, scores, re, rt, t_ok, w_ptr, ids_ptr, stride_wt, stride_wk, stride_it, stride_ik, scaling, RENORM, K,
            BLOCK_T, BLOCK_E, BLOCK_K)  # fmt: skip


@flyc.func
def _chunk_rows(ids_ptr, i, NUMEL, TOPK, stride_it, stride_ik, E, re):
    """Flat rows i of topk_ids: (expert id, placed?, one-hot [rows, experts] as int32)."""
    ok = i < NUMEL
    t = i // TOPK
    eid = fx.load(ids_ptr + t.to(fx.int64) * stride_it + (i - t * TOPK) * stride_ik, mask=ok, other=-1).to(fx.int32)
    placed = ok & (eid >= 0) & (eid < E)
    onehot = ((eid[:, None] == re[None, :]) & placed[:, None]).to(fx.int32)
    return eid, placed, onehot


# fmt: off
@flyc.kernel(do_not_specialize=["NUMEL", "CHUNK", "CAP", "FILL"])
def _align_count_kernel(
    ids_ptr, counts_ptr, sorted_ptr, NUMEL, TOPK, E, CHUNK, CAP, FILL, stride_it, stride_ik,
    SUB: fx.constexpr, BLOCK_E: fx.constexpr, FILL_BLOCK: fx.constexpr,
):
    # fmt: on
    p = fx.program_id(0)
    # this program's share of sorted_ids, [p * FILL, (p + 1) * FILL), to the padding value; the scatter
    # (a later launch on the stream) overwrites the placed rows
    pad = fx.zeros([FILL_BLOCK], dtype=fx.int32) + NUMEL
    for f0 in range(0, FILL, FILL_BLOCK):
        j = p * FILL + f0 + fx.arange(0, FILL_BLOCK)
        fx.store(sorted_ptr + j, pad, mask=j < CAP)
    re = fx.arange(0, BLOCK_E)
    count = fx.zeros([BLOCK_E], dtype=fx.int32)
    for s0 in range(0, CHUNK, SUB):
        i = p * CHUNK + s0 + fx.arange(0, SUB)
        _, _, onehot = _chunk_rows(ids_ptr, i, NUMEL, TOPK, stride_it, stride_ik, E, re)
        count += fx.sum(onehot, axis=0)
    fx.store(counts_ptr + p * E + re, count, mask=re < E)


# fmt: off
@flyc.kernel(do_not_specialize=["CHUNKS", "BLOCKS"])
def _align_offsets_kernel(
    counts_ptr, expert_ids_ptr, npad_ptr, CHUNKS, E, BLOCKS,
    BLOCK_M: fx.constexpr, BLOCK_E: fx.constexpr, BLOCK_B: fx.constexpr,
):
    # fmt: on
    before_ptr = counts_ptr + CHUNKS * E  # the scratch: counts [CHUNKS, E], before [CHUNKS, E], start [E]
    start_ptr = before_ptr + CHUNKS * E
    re = fx.arange(0, BLOCK_E)
    e_ok = re < E
    run = fx.zeros([BLOCK_E], dtype=fx.int32)
    for p in range(0, CHUNKS):
        c = fx.load(counts_ptr + p * E + re, mask=e_ok, other=0)
        fx.store(before_ptr + p * E + re, run, mask=e_ok)
        run += c
    padded = (run + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = fx.cumsum(padded, axis=0)
    fx.store(start_ptr + re, ends - padded, mask=e_ok)
    total = fx.sum(padded, axis=0)
    fx.store(npad_ptr, total)
    for b0 in range(0, BLOCKS, BLOCK_B):
        b = b0 + fx.arange(0, BLOCK_B)
        first_row = b * BLOCK_M
        # the block's expert: how many experts' runs end at or before its first row
        eid = fx.sum(((ends[None, :] <= first_row[:, None]) & e_ok[None, :]).to(fx.int32), axis=1)
        fx.store(expert_ids_ptr + b, fx.where(first_row < total, eid, -1), mask=b < BLOCKS)


# fmt: off
@flyc.kernel(do_not_specialize=["NUMEL", "CHUNK", "CHUNKS"])
def _align_scatter_kernel(
    ids_ptr, scratch_ptr, sorted_ptr, NUMEL, TOPK, E, CHUNK, CHUNKS, stride_it, stride_ik,
    SUB: fx.constexpr, BLOCK_E: fx.constexpr,
):
    # fmt: on
    before_ptr = scratch_ptr + CHUNKS * E
    start_ptr = before_ptr + CHUNKS * E
    p = fx.program_id(0)
    re = fx.arange(0, BLOCK_E)
    seen = fx.zeros([BLOCK_E], dtype=fx.int32)  # rows of each expert earlier in this chunk
    for s0 in range(0, CHUNK, SUB):
        i = p * CHUNK + s0 + fx.arange(0, SUB)
        eid, placed, onehot = _chunk_rows(ids_ptr, i, NUMEL, TOPK, stride_it, stride_ik, E, re)
        upto = fx.cumsum(onehot, axis=0) - 1 + seen[None, :]
        rank = fx.sum(onehot * upto, axis=1)
        e = fx.where(placed, eid, 0)
        base = fx.load(start_ptr + e, mask=placed, other=0) + fx.load(before_ptr + p * E + e, mask=placed, other=0)
        fx.store(sorted_ptr + base + rank, i, mask=placed)
        seen += fx.sum(onehot, axis=0)


# ------------------------------------------------------------------ host launchers


def _rows_block(block_e: int) -> int:
    """Tokens a routing program takes: a [BLOCK_T, BLOCK_E] tile of about 4K scores (256 experts: 16 rows)."""
    return max(1, min(64, 4096 // block_e))


@flyc.jit(skip_empty=False)
def launch_topk_softmax(logits, weights, ids, k: int, renormalize: bool, stream=None):
    """weights [T, k] fp32, ids [T, k] int32 of logits [T, E]: the softmax's top k (see the module)."""
    t, e = logits.shape
    if t == 0:
        return
    block_e = flyc.next_power_of_2(e)
    block_t = _rows_block(block_e)
    # fmt: off
    flyc.launch(
        _topk_softmax_kernel, (flyc.cdiv(t, block_t),),
        logits, weights, ids, t, e, logits.stride(0), logits.stride(1), weights.stride(0), weights.stride(1),
        ids.stride(0), ids.stride(1), K=k, RENORM=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=flyc.next_power_of_2(k), num_warps=4,
    )
    # fmt: on


@flyc.jit(skip_empty=False)
def launch_grouped_topk(
    logits, bias, weights, ids, k: int, groups: int, topk_group: int, sigmoid: bool, renormalize: bool,
    scaling: float, stream=None,
):  # fmt: skip
    """weights [T, k] fp32, ids [T, k] int32 of logits [T, E] by DeepSeek-V3's grouped top-k (see the module)."""
    t, e = logits.shape
    if t == 0:
        return
    block_e = flyc.next_power_of_2(e)
    block_t = _rows_block(block_e)
    # fmt: off
    flyc.launch(
        _grouped_topk_kernel, (flyc.cdiv(t, block_t),),
        logits, bias if bias is not None else logits, weights, ids, t, e, logits.stride(0), logits.stride(1),
        weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1), float(scaling),
        K=k, GROUPS=groups, GROUP_SIZE=e // groups, TOPK_GROUP=topk_group, HAS_BIAS=bias is not None,
        SIGMOID=sigmoid, RENORM=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_G=flyc.next_power_of_2(groups), BLOCK_K=flyc.next_power_of_2(k), num_warps=4,
    )
    # fmt: on


# Chunks of the alignment: enough of them to spread the counting over the SMs, few enough that the one
# program adding them up (a loop over chunks) stays short: at most ~128 chunks, of 64-4096 rows.
_MAX_CHUNKS = 128
_CHUNK_MIN = 64
_CHUNK_MAX = 4096
_FILL_BLOCK = 1024  # sorted_ids elements a counting program fills a step


def _chunk(numel: int, sub: int) -> int:
    want = flyc.next_power_of_2(max(1, flyc.cdiv(numel, _MAX_CHUNKS)))
    return max(sub, _CHUNK_MIN, min(_CHUNK_MAX, want))


def _sub(num_experts: int) -> int:
    """Rows of a [SUB, BLOCK_E] one-hot tile of at most 8K ints."""
    return max(16, min(64, 8192 // flyc.next_power_of_2(num_experts)))


def align_scratch_size(numel: int, num_experts: int) -> int:
    """int32 elements of the scratch :func:`launch_align` takes for ``numel`` routed rows: each chunk's
    counts and rows before it, per expert, and each expert's start."""
    chunks = max(1, flyc.cdiv(numel, _chunk(numel, _sub(num_experts))))
    return (2 * chunks + 1) * num_experts


@flyc.jit(skip_empty=False)
def launch_align(
    topk_ids, num_experts: int, block_m: int, sorted_ids, expert_ids, num_padded, scratch, stream=None
):  # fmt: skip
    """Fill ``sorted_ids`` (its padding too), ``expert_ids`` and ``num_padded`` (see the module) from
    ``topk_ids`` [T, k] (int32 / int64, any strides); ``scratch``: int32, at least
    :func:`align_scratch_size` elements, its first ones used (the caller's, so that a call allocates once)."""
    t, k = topk_ids.shape
    numel = t * k
    block_e = flyc.next_power_of_2(num_experts)
    sub = _sub(num_experts)
    chunk = _chunk(numel, sub)
    chunks = max(1, flyc.cdiv(numel, chunk))
    cap = sorted_ids.shape[0]
    fill = flyc.cdiv(flyc.cdiv(cap, chunks), _FILL_BLOCK) * _FILL_BLOCK
    s0, s1 = topk_ids.stride(0), topk_ids.stride(1)
    # the scratch (one buffer, no views made on the host): counts [chunks, E], before [chunks, E], start [E]
    flyc.launch(_align_count_kernel, (chunks,), topk_ids, scratch, sorted_ids, numel, k, num_experts, chunk, cap,
                fill, s0, s1, SUB=sub, BLOCK_E=block_e, FILL_BLOCK=_FILL_BLOCK, num_warps=4)  # fmt: skip
    blocks = expert_ids.shape[0]
    flyc.launch(_align_offsets_kernel, (1,), scratch, expert_ids, num_padded, chunks, num_experts, blocks,
                BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=max(16, 4096 // block_e), num_warps=4)  # fmt: skip
    if numel:
        flyc.launch(_align_scatter_kernel, (chunks,), topk_ids, scratch, sorted_ids, numel, k, num_experts, chunk,
                    chunks, s0, s1, SUB=sub, BLOCK_E=block_e, num_warps=4)  # fmt: skip
