"""The direct convolution kernel of depthwise layers (groups == C_in, each input channel feeding ``KG``
output channels) and of narrow groups (``CG`` input channels a group, a few: ``autotune.DIRECT_MAX_CG``).

Memory bound or close (a few flops a byte), where an implicit GEMM would waste most of a tensor-core tile on
a K of ``CG * taps``: a program computes a tile of ``BLOCK_M`` output positions x ``BLOCK_N`` output channels
and walks the filter window tap by tap; at each tap, each of the group's ``CG`` input channels is one masked
load of the input tile (channels contiguous in channels-last tensors: depthwise loads are whole vectors, and a
group's channels share their sectors, so the ``CG`` loads of a tap hit L1 after the first) and one weight
vector, multiplied and added in fp32. ``CG`` is a constexpr (the channel loop unrolled; one compile a width).
Sizes, strides, padding and dilation are runtime values (one compiled kernel serves every resolution and
window); bias and activation run in fp32 before the one downcast.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import activation, row_offset

__all__ = ["launch_direct"]

_RUNTIME_SIZES = ["M", "D", "H", "W", "OD", "OH", "OW", "KD", "KH", "KW", "sd", "sh", "sw", "pd", "ph", "pw",
                  "dd", "dh", "dw"]  # fmt: skip


# fmt: off
@flyc.kernel(do_not_specialize=_RUNTIME_SIZES)
def _conv_direct_kernel(
    x_ptr, w_ptr, y_ptr, bias_ptr,
    M, K_OUT, KG, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
    sx_n, sx_d, sx_h, sx_w, sx_c, s_wk, sy_n, sy_d, sy_h, sy_w, sy_c,
    CG: fx.constexpr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr, BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr,
):
    # fmt: on
    rm = fx.program_id(0) * BLOCK_M + fx.arange(0, BLOCK_M)
    rn = fx.program_id(1) * BLOCK_N + fx.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < K_OUT
    mm = fx.where(m_ok, rm, 0)
    ow = mm % OW
    t = mm // OW
    oh = t % OH
    t = t // OH
    od = t % OD
    nb = t // OD
    x_row = row_offset(nb, sx_n)
    c0 = (rn // KG) * CG  # output channel n reads its group's input channels c0 .. c0 + CG - 1
    w_rows = w_ptr + row_offset(rn, s_wk)
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
                x_pos = x_ptr + (row_dh + row_offset(iw, sx_w))[:, None]
                tap = (kd * KH + kh) * KW + kw
                for ci in fx.static_range(CG):
                    a = fx.load(x_pos + row_offset(c0 + ci, sx_c)[None, :], mask=ok[:, None] & n_ok[None, :],
                                other=0.0)  # fmt: skip
                    wv = fx.load(w_rows + ci * taps + tap, mask=n_ok, other=0.0)
                    acc += a.to(fx.float32) * wv.to(fx.float32)[None, :]
    out = acc
    if HAS_BIAS:
        out += fx.load(bias_ptr + rn, mask=n_ok, other=0.0).to(fx.float32)[None, :]
    out = activation(out, ACT)
    y_row = row_offset(nb, sy_n) + row_offset(od, sy_d) + row_offset(oh, sy_h) + row_offset(ow, sy_w)
    fx.store(y_ptr + y_row[:, None] + row_offset(rn, sy_c)[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


@flyc.jit
def launch_direct(x5, w2, y5, bias, geom, groups: int, act: int, cfg, stream=None):
    """Launch the direct kernel.

    ``x5``: ``[N, D, H, W, C_in]``; ``w2``: the weight as ``[K_out, CG * taps]`` (rows contiguous, each the
    group's channels in turn, their taps in (kd, kh, kw) order); ``y5``: ``[N, OD, OH, OW, K_out]`` (any
    strides), ``groups`` dividing ``C_in`` and ``K_out``; ``bias``: ``[K_out]`` or None. ``geom``: (kernel,
    stride, padding, dilation), three values each. ``cfg``: a :class:`fly_conv.autotune.ConvConfig` (block_m
    positions x block_n output channels).
    """
    nb, d, h, w, c = x5.shape
    _, od, oh, ow, k_out = y5.shape
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = geom
    m = nb * od * oh * ow
    grid = (flyc.cdiv(m, cfg.block_m), flyc.cdiv(k_out, cfg.block_n))
    # fmt: off
    flyc.launch(
        _conv_direct_kernel, grid,
        x5, w2, y5, bias,
        m, k_out, k_out // groups, d, h, w, od, oh, ow, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw,
        *x5.stride(), w2.stride(0), *y5.stride(),
        CG=c // groups, HAS_BIAS=bias is not None, ACT=act, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on
