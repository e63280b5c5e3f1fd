"""The implicit-GEMM convolution kernel, 1D / 2D / 3D (1D and 2D are 3D with size-1 dims).

The forward as a GEMM, per group ``g``::

    Y[m, n] = sum_k A[m, k] * B[n, k]     m = (batch, od, oh, ow)       M = N * OD * OH * OW
                                          n = output channel of g        N = K_out / groups
                                          k = (kd, kh, kw, c), c innermost  K = KD * KH * KW * C_in / groups

A is never built: a program's rows gather their input pixels for one filter tap at a time straight from
``x`` (masked where a tap falls in the zero padding), ``C_BLOCK`` channels per step. B is the weight packed as
``[K_out, KD, KH, KW, C_in / groups]`` (one row of K a output channel). The K loop is one flat loop over (tap,
channel block), so Triton's software pipeline spans taps. Every size, stride, padding and dilation is a
runtime value: one compiled kernel serves every resolution and kernel size (only the dtype, the tile and the
epilogue's flags are compiled in).

``POINTWISE`` (1x1, stride 1, no padding) makes it a plain GEMM over ``x``'s pixels read in place: no tap
loop, row addresses computed once; an NC* ``x`` needs no channels-last copy then (its rows are contiguous
along M, which the dot reads as well).

``TRANSPOSED`` turns the same kernel into the input gradient (dgrad) of a forward convolution: rows are the
forward's input positions, the gathered operand is the output gradient, and a row takes a tap's term only
where ``(i + pad - k * dil)`` is a non-negative multiple of the stride (the forward's output position it came
from); B is then the weight packed as ``[C_in, KD, KH, KW, K_out / groups]``.

Tensors are read and written through their strides, so channels-last tensors (the fast case: channels
contiguous, the gathers vectorize) and any other layout are served by the same code. Accumulation in fp32;
the epilogue adds the bias and applies the activation in fp32 before the one downcast.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import activation, row_offset

__all__ = ["launch_implicit_gemm"]

# Sizes that change with the resolution or batch: not specialized, so a new size never compiles again.
_RUNTIME_SIZES = ["M", "D", "H", "W", "OD", "OH", "OW", "KD", "KH", "KW", "sd", "sh", "sw", "pd", "ph", "pw",
                  "dd", "dh", "dw"]  # fmt: skip


# fmt: off
@flyc.kernel(do_not_specialize=_RUNTIME_SIZES)
def _conv_implicit_kernel(
    x_ptr, w_ptr, y_ptr, bias_ptr,
    M, N_OUT, CG, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
    sx_n, sx_d, sx_h, sx_w, sx_c, s_wn, sy_n, sy_d, sy_h, sy_w, sy_c,
    HAS_BIAS: fx.constexpr, ACT: fx.constexpr, TRANSPOSED: fx.constexpr, POINTWISE: fx.constexpr, IEEE: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, GROUP_M: fx.constexpr,
):
    # fmt: on
    pid_m, pid_n = fx.grouped_tile(fx.program_id(0), fx.cdiv(M, BLOCK_M), fx.cdiv(N_OUT, BLOCK_N), GROUP_M)
    g = fx.program_id(1)
    rm = pid_m * BLOCK_M + fx.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)
    rk = fx.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N_OUT
    # a row's (batch, od, oh, ow); rows past M take position 0 and are masked
    mm = fx.where(m_ok, rm, 0)
    ow = mm % OW
    t = mm // OW
    oh = t % OH
    t = t // OH
    od = t % OD
    nb = t // OD
    x_row = row_offset(nb, sx_n)  # int64: a batch past 2^31 elements addresses correctly
    if TRANSPOSED:  # i + pad: a tap k reaches the forward output (i + pad - k * dil) / stride
        bd = od + pd
        bh = oh + ph
        bw = ow + pw
    else:  # o * stride - pad: the tap k reads input o * stride - pad + k * dil
        bd = od * sd - pd
        bh = oh * sh - ph
        bw = ow * sw - pw
    c_base = g * CG  # this group's first channel of x
    w_rows = w_ptr + row_offset(g * N_OUT + rn, s_wn)  # this group's weight rows, [BLOCK_N]
    khw = KH * KW
    c_blocks = fx.cdiv(CG, BLOCK_K)
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    if POINTWISE:  # 1x1, stride 1, no padding: a plain GEMM on x's rows, read in place
        a_rows = x_ptr + x_row + row_offset(od, sx_d) + row_offset(oh, sx_h) + row_offset(ow, sx_w)
        for c0 in range(0, CG, BLOCK_K):
            c = c0 + rk
            c_ok = c < CG
            a = fx.load(a_rows[:, None] + row_offset(c_base + c, sx_c)[None, :], mask=m_ok[:, None] & c_ok[None, :],
                        other=0.0)  # fmt: skip
            b = fx.load(w_rows[:, None] + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
            if IEEE:
                acc = fx.dot(a, fx.trans(b), acc, input_precision="ieee")
            else:
                acc = fx.dot(a, fx.trans(b), acc)
    else:
        for kk in range(0, KD * khw * c_blocks):
            tap = kk // c_blocks
            c0 = (kk - tap * c_blocks) * BLOCK_K
            kd = tap // khw
            kh = (tap // KW) % KH
            kw = tap % KW
            if TRANSPOSED:
                nd = bd - kd * dd
                nh = bh - kh * dh
                nw = bw - kw * dw
                qd = fx.where(nd >= 0, nd, 0) // sd
                qh = fx.where(nh >= 0, nh, 0) // sh
                qw = fx.where(nw >= 0, nw, 0) // sw
                ok = ((nd >= 0) & (qd * sd == nd) & (qd < D) & (nh >= 0) & (qh * sh == nh) & (qh < H)
                      & (nw >= 0) & (qw * sw == nw) & (qw < W))  # fmt: skip
                id_ = qd
                ih = qh
                iw = qw
            else:
                id_ = bd + kd * dd
                ih = bh + kh * dh
                iw = bw + kw * dw
                ok = (id_ >= 0) & (id_ < D) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            ok = ok & m_ok
            a_row = x_row + row_offset(id_, sx_d) + row_offset(ih, sx_h) + row_offset(iw, sx_w)
            c = c0 + rk
            c_ok = c < CG
            a = fx.load(x_ptr + a_row[:, None] + row_offset(c_base + c, sx_c)[None, :],
                        mask=ok[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
            b = fx.load(w_rows[:, None] + (tap * CG + c)[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
            if IEEE:  # fp32 inputs: full-precision products (tf32 would round them to 10 bits)
                acc = fx.dot(a, fx.trans(b), acc, input_precision="ieee")
            else:
                acc = fx.dot(a, fx.trans(b), acc)

    co = g * N_OUT + rn  # output channels
    out = acc
    if HAS_BIAS:
        out += fx.load(bias_ptr + co, mask=n_ok, other=0.0).to(fx.float32)[None, :]
    out = activation(out, ACT)
    y_row = row_offset(nb, sy_n) + row_offset(od, sy_d) + row_offset(oh, sy_h) + row_offset(ow, sy_w)
    y_ptrs = y_ptr + y_row[:, None] + row_offset(co, sy_c)[None, :]
    fx.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def geom_pointwise(geom) -> bool:
    """A 1x1 convolution with stride 1 and no padding: every output position reads its own input pixel."""
    return all(v == 1 for v in geom[0] + geom[1]) and not any(geom[2])


@flyc.jit
def launch_implicit_gemm(x5, w2, y5, bias, geom, act: int, transposed: bool, groups: int, cfg, stream=None):
    """Launch the implicit-GEMM kernel.

    ``x5``: the gathered operand as a ``[N, D, H, W, C]`` view (any strides; channels contiguous is the fast
    case); ``w2``: the packed weight ``[groups * N_OUT, taps * CG]`` (rows contiguous); ``y5``: the output
    as a ``[N, OD, OH, OW, groups * N_OUT]`` view (any strides); ``bias``: ``[groups * N_OUT]`` or None.
    ``geom``: (kernel, stride, padding, dilation), three values each, of the forward convolution;
    ``transposed``: run as the forward's input gradient (x5 is then the output gradient, y5 the input's).
    ``cfg``: a :class:`fly_conv.autotune.ConvConfig`.
    """
    nb, d, h, w, c = x5.shape
    _, od, oh, ow, k_out = y5.shape
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = geom
    m = nb * od * oh * ow
    n_out = k_out // groups
    cg = c // groups
    tiles = flyc.cdiv(m, cfg.block_m) * flyc.cdiv(n_out, cfg.block_n)
    # fmt: off
    flyc.launch(
        _conv_implicit_kernel, (tiles, groups),
        x5, w2, y5, bias,
        m, n_out, cg, d, h, w, od, oh, ow, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw,
        *x5.stride(), w2.stride(0), *y5.stride(),
        HAS_BIAS=bias is not None, ACT=act, TRANSPOSED=transposed, POINTWISE=geom_pointwise(geom),
        IEEE=x5.dtype.itemsize == 4,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on
