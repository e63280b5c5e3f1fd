"""The direct convolution kernel of depthwise layers (groups == C_in) and of narrow groups (``CG`` input channels
a group, a few: ``autotune.DIRECT_MAX_CG``), each group feeding ``KG`` output channels.

Memory bound or close (a few flops a byte), where an implicit GEMM would waste most of a tensor-core step on a
K of ``CG * taps``: a program computes ``BLOCK_M`` output positions x the outputs of ``BLOCK_G`` whole groups
and walks the filter window tap by tap. At each tap it loads the groups' input channels once, a
``[BLOCK_M, BLOCK_G * CG]`` tile (channels contiguous in channels-last tensors: whole-vector loads), then for
each of the ``CG`` channels picks that channel of every group out of the registers (a select-sum over the
in-thread channel axis, which folds to moves) and broadcasts it over the group's ``KG`` outputs, multiplied
by the tap's weight vector and added in fp32. No shuffles, no shared memory: the tile stays in the threads
that loaded it. ``CG`` / ``KG`` that are not powers of two are padded (``CG_P`` / ``KG_P``) and masked, their
gathers no longer whole vectors.

Sizes, strides, padding and dilation are runtime values (one compiled kernel serves every resolution and
window); ``CG`` and ``KG`` are constexprs. Bias and activation run in fp32 before the one downcast.

The input gradient of a stride-1 layer is the same convolution of the output gradient with the taps
reversed (``FLIP``), so it runs this kernel too; the weight is read through three strides (output channel,
group channel, tap), which cover both packs.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import activation, row_offset

from .implicit_gemm import output_coords

__all__ = ["launch_direct"]

_RUNTIME_SIZES = ["M", "D", "H", "W", "OD", "OH", "OW", "KD", "KH", "KW", "sd", "sh", "sw", "pd", "ph", "pw",
                  "dd", "dh", "dw"]  # fmt: skip


@flyc.func
def group_columns(g0, G, WIDTH: fx.constexpr, WIDTH_P: fx.constexpr, BLOCK_G: fx.constexpr):
    """(channel index, in-bounds mask) of ``BLOCK_G`` groups of ``WIDTH`` channels from group ``g0``, laid out
    ``WIDTH_P`` a group: contiguous (provably, so loads vectorize) when ``WIDTH`` is a power of two."""
    i = fx.arange(0, BLOCK_G * WIDTH_P)
    if WIDTH == WIDTH_P:
        ch = g0 * WIDTH + i
        return ch, ch < G * WIDTH
    g = g0 + i // WIDTH_P
    j = i % WIDTH_P
    return g * WIDTH + j, (g < G) & (j < WIDTH)


# fmt: off
@flyc.kernel(do_not_specialize=_RUNTIME_SIZES)
def _conv_direct_kernel(
    x_ptr, w_ptr, y_ptr, bias_ptr,
    M, G, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
    sx_n, sx_d, sx_h, sx_w, sx_c, s_wn, s_wc, s_wt, sy_n, sy_d, sy_h, sy_w, sy_c,
    CG: fx.constexpr, KG: fx.constexpr, CG_P: fx.constexpr, KG_P: fx.constexpr, FLIP: fx.constexpr,
    HAS_BIAS: fx.constexpr, ACT: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_G: fx.constexpr,
):
    # fmt: on
    BLOCK_N: fx.constexpr = BLOCK_G * KG_P
    rm = fx.program_id(0) * BLOCK_M + fx.arange(0, BLOCK_M)
    g0 = fx.program_id(1) * BLOCK_G
    cx, cx_ok = group_columns(g0, G, CG, CG_P, BLOCK_G)  # the groups' input channels
    rn, n_ok = group_columns(g0, G, KG, KG_P, BLOCK_G)  # their output channels
    rc = fx.arange(0, CG_P)
    m_ok = rm < M
    nb, od, oh, ow = output_coords(fx.where(m_ok, rm, 0), OD, OH, OW)
    x_row = row_offset(nb, sx_n)
    x_cols = row_offset(cx, sx_c)
    w_cols = w_ptr + row_offset(rn, s_wn)
    taps = KD * KH * KW
    bd = od * sd - pd
    bh = oh * sh - ph
    bw = ow * sw - pw
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    for kd in range(0, KD):
        id_ = bd + kd * dd
        d_ok = m_ok & (id_ >= 0) & (id_ < D)
        for kh in range(0, KH):
            ih = bh + kh * dh
            h_ok = d_ok & (ih >= 0) & (ih < H)
            row_dh = x_row + row_offset(id_, sx_d) + row_offset(ih, sx_h)
            for kw in range(0, KW):
                iw = bw + kw * dw
                ok = h_ok & (iw >= 0) & (iw < W)
                xt = fx.load(x_ptr + (row_dh + row_offset(iw, sx_w))[:, None] + x_cols[None, :],
                             mask=ok[:, None] & cx_ok[None, :], other=0.0)  # fmt: skip
                x3 = fx.reshape(xt.to(fx.float32), [BLOCK_M, BLOCK_G, CG_P])
                tap = (kd * KH + kh) * KW + kw
                w_tap = w_cols + row_offset(taps - 1 - tap if FLIP else tap, s_wt)
                for ci in fx.static_range(CG):
                    # channel ci of each group (-0.0 is the sum's identity: the select-sum folds to a move),
                    # repeated over the group's outputs
                    xc = fx.sum(fx.where((rc == ci)[None, None, :], x3, -0.0), axis=2)
                    xb = fx.reshape(fx.broadcast_to(xc[:, :, None], [BLOCK_M, BLOCK_G, KG_P]), [BLOCK_M, BLOCK_N])
                    wv = fx.load(w_tap + ci * s_wc, mask=n_ok, other=0.0)
                    acc += xb * wv.to(fx.float32)[None, :]
    out = acc
    if HAS_BIAS:
        out += fx.load(bias_ptr + rn, mask=n_ok, other=0.0).to(fx.float32)[None, :]
    out = activation(out, ACT)
    y_row = row_offset(nb, sy_n) + row_offset(od, sy_d) + row_offset(oh, sy_h) + row_offset(ow, sy_w)
    fx.store(y_ptr + y_row[:, None] + row_offset(rn, sy_c)[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


@flyc.jit
def launch_direct(x5, w, y5, bias, geom, groups: int, act: int, cfg, input_grad: bool = False, stream=None):
    """Launch the direct kernel.

    ``x5``: ``[N, D, H, W, C_in]``; ``y5``: ``[N, OD, OH, OW, K_out]`` (any strides), ``groups`` dividing
    ``C_in`` and ``K_out``; ``bias``: ``[K_out]`` or None. ``geom``: (kernel, stride, padding, dilation), three
    values each. ``w``: the forward's weight transposed, ``[CG * taps, K_out]`` (row ``ci * taps + tap``: a tap's
    weights of every output channel one vector). ``input_grad``: the launch is a stride-1 layer's input
    gradient (x5 the output gradient, y5 the input's, geom's padding ``dilation * (kernel - 1) - padding``) and
    ``w`` the layer's weight packed for it, ``[K_out, taps * CG]`` in this launch's terms (row: an output
    channel, that is a channel of the layer's input; column ``tap * CG + ci``, ci a channel of the output
    gradient's group), read with its taps reversed. ``cfg``: a :class:`fly_conv.autotune.ConvConfig`:
    ``block_m`` positions x ``block_n`` output channels, rounded to whole groups (at least one, its outputs
    padded to a power of two, the positions cut to keep the tile's size).
    """
    nb, d, h, wd, c = x5.shape
    _, od, oh, ow, k_out = y5.shape
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = geom
    m = nb * od * oh * ow
    cg, kg = c // groups, k_out // groups
    if input_grad:  # [K_out, (tap, ci)]
        s_wn, s_wc, s_wt = w.stride(0), w.stride(1), cg * w.stride(1)
    else:  # [(ci, tap), K_out]
        s_wn, s_wc, s_wt = w.stride(1), kd * kh * kw * w.stride(0), w.stride(0)
    kg_p = flyc.next_power_of_2(kg)
    block_g = max(1, cfg.block_n // kg_p)
    block_m = max(1, cfg.block_m * cfg.block_n // (block_g * kg_p))
    grid = (flyc.cdiv(m, block_m), flyc.cdiv(groups, block_g))
    # fmt: off
    flyc.launch(
        _conv_direct_kernel, grid,
        x5, w, y5, bias,
        m, groups, d, h, wd, od, oh, ow, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw,
        *x5.stride(), s_wn, s_wc, s_wt, *y5.stride(),
        CG=cg, KG=kg, CG_P=flyc.next_power_of_2(cg), KG_P=kg_p, FLIP=input_grad, HAS_BIAS=bias is not None,
        ACT=act, BLOCK_M=block_m, BLOCK_G=block_g, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on
