"""The weight gradient of a convolution: a reduction over batch x output positions, deterministic.

Per group ``g`` and filter tap ``t = (kd, kh, kw)``::

    dW[g, n, c, t] = sum_p dY[p, g, n] * X[p's input pixel for tap t, g, c]     p = (batch, od, oh, ow)

A program computes a ``BLOCK_M x BLOCK_N`` tile of (output channel, input channel) for ``TAPS`` taps and one
group (grid axis 1: tap block and group), walking its run of positions ``BLOCK_K`` at a time (the input pixels
gathered as in the forward, masked in the padding). Its output-gradient tile is loaded once a step for all its
taps, and its dot's N is ``TAPS x BLOCK_N`` (the input tile holds each tap's channels side by side): one tap
a program reads the output gradient once a tap. With more than one split (grid axis 2) the positions are cut into
equal runs, each storing fp32 partial sums to its own slice of a workspace; the host adds the slices in a
fixed order, so the result never depends on scheduling (no atomics).

Depthwise layers (one input channel a group) have their own kernel: there a tile of channel pairs would hold
one useful pair. A program takes a tap, a block of whole groups and a run of positions; each step multiplies
the output gradient's ``[positions, outputs]`` tile by the input channel broadcast over its group's outputs,
and the positions are summed once at the end (the same split and fixed-order sum).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .direct import group_columns
from .implicit_gemm import output_coords
from .rows_gemm import rows_layer, tma_row_matrix

__all__ = ["launch_wgrad", "launch_wgrad_rows", "launch_depthwise_wgrad", "rows_kernel_applies"]

_RUNTIME_SIZES = ["P", "D", "H", "W", "OD", "OH", "OW", "KD", "KH", "KW", "sd", "sh", "sw", "pd", "ph", "pw",
                  "dd", "dh", "dw", "split_steps"]  # fmt: skip


@flyc.func
def _positions(rp, BLOCK: fx.constexpr, OD, OH, OW):
    """The output coordinates of a program's first step of positions ``rp`` (``BLOCK`` of them) and the
    scalars that advance them one step: ``BLOCK`` as mixed-radix digits of (batch, OD, OH, OW). The loop then
    moves the coordinates by adds and compares (:func:`_advance`) instead of decoding each flat position
    again, three integer divisions a position and step (1.15-1.19x on the H200's weight gradients)."""
    nb, od, oh, ow = output_coords(rp, OD, OH, OW)
    q = BLOCK // OW
    r = q // OH
    return nb, od, oh, ow, r // OD, r % OD, q % OH, BLOCK % OW


@flyc.func
def _advance(nb, od, oh, ow, inc_n, inc_d, inc_h, inc_w, OD, OH, OW):
    """Coordinates one step on: each digit plus its increment and the carry from below (each sum is under
    twice its radix, so one compare makes the carry)."""
    ow = ow + inc_w
    cw = ow >= OW
    ow = fx.where(cw, ow - OW, ow)
    oh = oh + inc_h + fx.where(cw, 1, 0)
    ch = oh >= OH
    oh = fx.where(ch, oh - OH, oh)
    od = od + inc_d + fx.where(ch, 1, 0)
    cd = od >= OD
    od = fx.where(cd, od - OD, od)
    return nb + inc_n + fx.where(cd, 1, 0), od, oh, ow


@flyc.func
def _dy_rows(nb, od, oh, ow, sdy_n, sdy_d, sdy_h, sdy_w):
    return row_offset(nb, sdy_n) + row_offset(od, sdy_d) + row_offset(oh, sdy_h) + row_offset(ow, sdy_w)


@flyc.func
def _input_rows(p_ok, nb, od, oh, ow, kd, kh, kw, D, H, W, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                sx_n, sx_d, sx_h, sx_w):  # fmt: skip
    """The input rows of positions (``nb, od, oh, ow``) for taps (``kd, kh, kw``; scalars, or a tap axis that
    broadcasts against the positions'), and which of them fall inside the input (the padding is a mask)."""
    id_ = od * sd - pd + kd * dd
    ih = oh * sh - ph + kh * dh
    iw = ow * sw - pw + kw * dw
    x_ok = p_ok & (id_ >= 0) & (id_ < D) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    x_row = row_offset(nb, sx_n) + row_offset(id_, sx_d) + row_offset(ih, sx_h) + row_offset(iw, sx_w)
    return x_ok, x_row


# fmt: off
@flyc.kernel(do_not_specialize=_RUNTIME_SIZES)
def _conv_wgrad_kernel(
    dy_ptr, x_ptr, out_ptr,
    P, KG, CG, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw, split_steps,
    sdy_n, sdy_d, sdy_h, sdy_w, sdy_c, sx_n, sx_d, sx_h, sx_w, sx_c, so_s, so_k, so_c, so_t,
    IEEE: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, TAPS: fx.constexpr,
):
    # fmt: on
    n_tiles = fx.cdiv(CG, BLOCK_N)
    pid = fx.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    taps = KD * KH * KW
    tap_blocks = fx.cdiv(taps, TAPS)
    gt = fx.program_id(1)
    g = gt // tap_blocks
    split = fx.program_id(2)
    rk = pid_m * BLOCK_M + fx.arange(0, BLOCK_M)  # output channels of the group
    rc = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)  # input channels of the group
    k_ok = rk < KG
    c_ok = rc < CG
    dy_cols = row_offset(g * KG + rk, sdy_c)
    x_cols = row_offset(g * CG + rc, sx_c)
    if TAPS == 1:  # one tap: scalar coordinates, the B tile one tap's [positions, channels]
        rt = gt % tap_blocks
        t_ok = True
    else:  # TAPS taps: the B tile is [positions, TAPS x channels], tap-major, and the dot's N TAPS x BLOCK_N
        rt = (gt % tap_blocks) * TAPS + fx.arange(0, TAPS)
        t_ok = rt < taps
        rt = fx.where(t_ok, rt, 0)
    kd = rt // (KH * KW)
    kh = (rt // KW) % KH
    kw = rt % KW
    p_begin = split * split_steps * BLOCK_K
    p_end = fx.minimum(P, p_begin + split_steps * BLOCK_K)
    nb, od, oh, ow, inc_n, inc_d, inc_h, inc_w = _positions(p_begin + fx.arange(0, BLOCK_K), BLOCK_K, OD, OH, OW)
    acc = fx.zeros([BLOCK_M, TAPS * BLOCK_N], dtype=fx.float32)
    for p0 in range(p_begin, p_end, BLOCK_K):
        p_ok = p0 + fx.arange(0, BLOCK_K) < p_end
        dy_row = _dy_rows(nb, od, oh, ow, sdy_n, sdy_d, sdy_h, sdy_w)
        a = fx.load(dy_ptr + dy_cols[:, None] + dy_row[None, :], mask=k_ok[:, None] & p_ok[None, :], other=0.0)
        if TAPS == 1:
            x_ok, x_row = _input_rows(p_ok, nb, od, oh, ow, kd, kh, kw, D, H, W, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                                      sx_n, sx_d, sx_h, sx_w)  # fmt: skip
            b_off = x_row[:, None] + x_cols[None, :]
            b_ok = x_ok[:, None] & c_ok[None, :]
        else:
            x_ok, x_row = _input_rows(p_ok[:, None], nb[:, None], od[:, None], oh[:, None], ow[:, None], kd[None, :],
                                      kh[None, :], kw[None, :], D, H, W, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                                      sx_n, sx_d, sx_h, sx_w)  # fmt: skip
            b_off = x_row[:, :, None] + x_cols[None, None, :]
            b_ok = (x_ok & t_ok[None, :])[:, :, None] & c_ok[None, None, :]
        b = fx.load(x_ptr + b_off, mask=b_ok, other=0.0)
        if TAPS > 1:  # the loaded values, not the pointers: reshaped pointers lost the async-copy pipeline
            b = fx.reshape(b, [BLOCK_K, TAPS * BLOCK_N])  # (sm_90 compiles: plain loads into registers)
        if IEEE:
            acc = fx.dot(a, b, acc, input_precision="ieee")
        else:
            acc = fx.dot(a, b, acc)
        nb, od, oh, ow = _advance(nb, od, oh, ow, inc_n, inc_d, inc_h, inc_w, OD, OH, OW)

    o_base = out_ptr + row_offset(split, so_s) + row_offset(g * KG + rk, so_k)[:, None]
    if TAPS == 1:
        o_ptrs = o_base + row_offset(rc, so_c)[None, :] + row_offset(rt, so_t)
        fx.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & c_ok[None, :])
    else:
        o_ptrs = o_base[:, :, None] + row_offset(rt, so_t)[None, :, None] + row_offset(rc, so_c)[None, None, :]
        o_ok = k_ok[:, None, None] & t_ok[None, :, None] & c_ok[None, None, :]
        fx.store(o_ptrs, fx.reshape(acc, [BLOCK_M, TAPS, BLOCK_N]).to(out_ptr.dtype.element_ty), mask=o_ok)


@flyc.jit
def launch_wgrad(dy5, x5, out, geom, groups: int, splits: int, split_steps: int, cfg, stream=None):
    """Launch the weight-gradient kernel.

    ``dy5``: the output gradient as ``[N, OD, OH, OW, K_out]``; ``x5``: the input as ``[N, D, H, W, C_in]``
    (any strides); ``out``: ``[splits, K_out, C_in / groups, taps]`` (any strides; fp32 partial sums when
    ``splits > 1``, else the weight gradient itself in its dtype). ``geom``: (kernel, stride, padding,
    dilation), three values each. Split ``s`` reduces positions ``[s * split_steps * block_k, ...)``.
    """
    nb, od, oh, ow, k_out = dy5.shape
    _, d, h, w, c = x5.shape
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = geom
    kg, cg = k_out // groups, c // groups
    tiles = flyc.cdiv(kg, cfg.block_m) * flyc.cdiv(cg, cfg.block_n)
    # fmt: off
    flyc.launch(
        _conv_wgrad_kernel, (tiles, flyc.cdiv(kd * kh * kw, cfg.taps) * groups, splits),
        dy5, x5, out,
        nb * od * oh * ow, kg, cg, d, h, w, od, oh, ow, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw, split_steps,
        *dy5.stride(), *x5.stride(), *out.stride(),
        IEEE=x5.dtype.itemsize == 4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TAPS=cfg.taps,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on


# Stride 1 with the output the input's size (the 'same' layers): the input pixel of output position p for tap
# t is input row p + shift_t of the flattened [positions, C] matrix, one shift a tap, for every p whose tap
# lands inside the image; the rest (the padding) read a wrapped row, which the output-gradient tile's zeroed
# columns cancel. So both operands are plain row blocks that tensor descriptors load (TMA on sm_90: no
# per-element address or mask; rows before the first and past the last are zero-filled by the hardware), and
# only a mask a position is computed, from coordinates stepped by digits.
_ROWS_SIZES = ["P", "D", "H", "W", "KD", "KH", "KW", "pd", "ph", "pw", "dd", "dh", "dw", "split_steps"]


# fmt: off
@flyc.kernel(do_not_specialize=_ROWS_SIZES)
def _conv_wgrad_rows_kernel(
    dy_ptr, x_ptr, out_ptr,
    P, K_OUT, C, D, H, W, KD, KH, KW, pd, ph, pw, dd, dh, dw, split_steps, so_s, so_k, so_c, so_t,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr,
):
    # fmt: on
    n_tiles = fx.cdiv(C, BLOCK_N)
    pid = fx.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    tap = fx.program_id(1)
    split = fx.program_id(2)
    off_d = (tap // (KH * KW)) * dd - pd  # the tap's input offset a dim
    off_h = ((tap // KW) % KH) * dh - ph
    off_w = (tap % KW) * dw - pw
    shift = (off_d * H + off_h) * W + off_w
    dy_desc = fx.make_tensor_descriptor(dy_ptr, shape=[P, K_OUT], strides=[K_OUT, 1], block_shape=[BLOCK_K, BLOCK_M])
    x_desc = fx.make_tensor_descriptor(x_ptr, shape=[P, C], strides=[C, 1], block_shape=[BLOCK_K, BLOCK_N])
    p_begin = split * split_steps * BLOCK_K
    p_end = fx.minimum(P, p_begin + split_steps * BLOCK_K)
    nb, od, oh, ow, inc_n, inc_d, inc_h, inc_w = _positions(p_begin + fx.arange(0, BLOCK_K), BLOCK_K, D, H, W)
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    for p0 in range(p_begin, p_end, BLOCK_K):
        a = dy_desc.load([p0, pid_m * BLOCK_M])  # [positions, output channels]
        b = x_desc.load([p0 + shift, pid_n * BLOCK_N])  # [positions, input channels], the tap's rows
        ok = (p0 + fx.arange(0, BLOCK_K) < p_end) & (od + off_d >= 0) & (od + off_d < D) & (oh + off_h >= 0)
        ok = ok & (oh + off_h < H) & (ow + off_w >= 0) & (ow + off_w < W)
        a = fx.where(ok[:, None], a, fx.zeros_like(a))
        acc = fx.dot(fx.trans(a), b, acc)
        nb, od, oh, ow = _advance(nb, od, oh, ow, inc_n, inc_d, inc_h, inc_w, D, H, W)

    rk = pid_m * BLOCK_M + fx.arange(0, BLOCK_M)
    rc = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)
    o_ptrs = (out_ptr + row_offset(split, so_s) + row_offset(rk, so_k)[:, None] + row_offset(rc, so_c)[None, :]
              + row_offset(tap, so_t))  # fmt: skip
    fx.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rk < K_OUT)[:, None] & (rc < C)[None, :])


def rows_kernel_applies(dy5, x5, geom, groups: int) -> bool:
    """Whether :func:`launch_wgrad_rows` serves this weight gradient: a row-block layer whose output gradient
    and input are both 16-bit tensor-descriptor matrices of one dtype (:func:`.rows_gemm.rows_layer`,
    :func:`.rows_gemm.tma_row_matrix`)."""
    return (rows_layer(x5, dy5, geom, groups) and x5.dtype.itemsize == 2 and dy5.dtype == x5.dtype
            and tma_row_matrix(x5) and tma_row_matrix(dy5))  # fmt: skip


@flyc.jit
def launch_wgrad_rows(dy5, x5, out, geom, splits: int, split_steps: int, cfg, stream=None):
    """Launch the row-block weight-gradient kernel (where :func:`rows_kernel_applies`). ``dy5`` / ``x5``:
    ``[N, D, H, W, K_out]`` / ``[N, D, H, W, C_in]`` dense; ``out``: ``[splits, K_out, C_in, taps]`` (any
    strides; fp32 partial sums when ``splits > 1``, else the weight gradient in its dtype); ``geom``:
    (kernel, stride, padding, dilation). Split ``s`` reduces positions ``[s * split_steps * block_k, ...)``."""
    nb, d, h, w, k_out = dy5.shape
    c = x5.shape[4]
    (kd, kh, kw), _, (pd, ph, pw), (dd, dh, dw) = geom
    tiles = flyc.cdiv(k_out, cfg.block_m) * flyc.cdiv(c, cfg.block_n)
    flyc.ensure_scratch_allocator()  # the device-side descriptors live in Triton's scratch memory
    # fmt: off
    flyc.launch(
        _conv_wgrad_rows_kernel, (tiles, kd * kh * kw, splits),
        dy5, x5, out,
        nb * d * h * w, k_out, c, d, h, w, kd, kh, kw, pd, ph, pw, dd, dh, dw, split_steps, *out.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on


# fmt: off
@flyc.kernel(do_not_specialize=_RUNTIME_SIZES)
def _conv_depthwise_wgrad_kernel(
    dy_ptr, x_ptr, out_ptr,
    P, G, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw, split_steps,
    sdy_n, sdy_d, sdy_h, sdy_w, sdy_c, sx_n, sx_d, sx_h, sx_w, sx_c, so_s, so_k, so_t,
    KG: fx.constexpr, KG_P: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_G: fx.constexpr,
):
    # fmt: on
    BLOCK_N: fx.constexpr = BLOCK_G * KG_P
    tap = fx.program_id(0)  # fastest: the programs of one run of positions, every tap, run together (L2)
    g0 = fx.program_id(1) * BLOCK_G
    split = fx.program_id(2)
    kd = tap // (KH * KW)
    kh = (tap // KW) % KH
    kw = tap % KW
    rn, n_ok = group_columns(g0, G, KG, KG_P, BLOCK_G)  # output channels (KG a group)
    cx, cx_ok = group_columns(g0, G, 1, 1, BLOCK_G)  # their input channels, one a group
    dy_cols = row_offset(rn, sdy_c)
    x_cols = row_offset(cx, sx_c)
    p_begin = split * split_steps * BLOCK_M
    p_end = fx.minimum(p_begin + split_steps * BLOCK_M, P)
    nb, od, oh, ow, inc_n, inc_d, inc_h, inc_w = _positions(p_begin + fx.arange(0, BLOCK_M), BLOCK_M, OD, OH, OW)
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    for p0 in range(p_begin, p_end, BLOCK_M):
        p_ok = p0 + fx.arange(0, BLOCK_M) < p_end
        dy_row = _dy_rows(nb, od, oh, ow, sdy_n, sdy_d, sdy_h, sdy_w)
        x_ok, x_row = _input_rows(p_ok, nb, od, oh, ow, kd, kh, kw, D, H, W, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                                  sx_n, sx_d, sx_h, sx_w)  # fmt: skip
        a = fx.load(dy_ptr + dy_row[:, None] + dy_cols[None, :], mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        b = fx.load(x_ptr + x_row[:, None] + x_cols[None, :], mask=x_ok[:, None] & cx_ok[None, :], other=0.0)
        bb = fx.reshape(fx.broadcast_to(b.to(fx.float32)[:, :, None], [BLOCK_M, BLOCK_G, KG_P]), [BLOCK_M, BLOCK_N])
        acc += a.to(fx.float32) * bb
        nb, od, oh, ow = _advance(nb, od, oh, ow, inc_n, inc_d, inc_h, inc_w, OD, OH, OW)
    out = fx.sum(acc, axis=0)
    fx.store(out_ptr + row_offset(split, so_s) + row_offset(rn, so_k) + row_offset(tap, so_t),
             out.to(out_ptr.dtype.element_ty), mask=n_ok)  # fmt: skip


@flyc.jit
def launch_depthwise_wgrad(dy5, x5, out, geom, splits: int, split_steps: int, cfg, stream=None):
    """Launch the depthwise weight-gradient kernel (one input channel a group, ``K_out / C_in`` outputs each).

    ``dy5``: ``[N, OD, OH, OW, K_out]``; ``x5``: ``[N, D, H, W, C_in]`` (any strides); ``out``: ``[splits,
    K_out, taps]`` (fp32 partial sums when ``splits > 1``, else the weight gradient in its dtype). ``cfg``: a
    :class:`fly_conv.autotune.ConvConfig` from ``depthwise_wgrad_config``: ``block_m`` positions a step,
    ``block_n`` output channels (whole groups). Split ``s`` reduces positions ``[s * split_steps * block_m,
    ...)``.
    """
    nb, od, oh, ow, k_out = dy5.shape
    _, d, h, w, c = x5.shape
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = geom
    kg = k_out // c
    kg_p = flyc.next_power_of_2(kg)
    block_g = max(1, cfg.block_n // kg_p)
    # fmt: off
    flyc.launch(
        _conv_depthwise_wgrad_kernel, (kd * kh * kw, flyc.cdiv(c, block_g), splits),
        dy5, x5, out,
        nb * od * oh * ow, c, d, h, w, od, oh, ow, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw, split_steps,
        *dy5.stride(), *x5.stride(), *out.stride(),
        KG=kg, KG_P=kg_p, BLOCK_M=cfg.block_m, BLOCK_G=block_g, num_warps=cfg.num_warps, num_stages=1,
    )
    # fmt: on
