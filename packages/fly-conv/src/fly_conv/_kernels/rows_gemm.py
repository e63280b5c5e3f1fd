"""The row-block convolution: the forward, and the input gradient, of stride-1 layers whose output is the
input's size ('same' 3x3 / 3x3x3 / 1D layers, 1x1 ones), with both operands loaded by tensor descriptors.

With stride 1 and the output the input's size, output position ``p`` (flat over batch, D, H, W) reads, for
tap ``t``, the input pixel ``p + shift(t)`` of the flattened ``[positions, C]`` matrix, where ``shift(t) =
(off_d * H + off_h) * W + off_w`` and ``off = k * dilation - padding`` a dim (the input gradient: ``padding -
k * dilation``, the forward's taps reversed). A tap's A tile is then a plain block of rows, ``[m0 + shift,
m0 + shift + BLOCK_M)``, that a tensor descriptor (Hopper's TMA) loads with no per-element address or mask:
rows before the first and past the last read as zeros. Rows whose tap pixel falls in the padding of one of
the dims read another row's pixel (the row above wraps into the previous image row, for example): a mask from
each row's coordinates zeroes them in registers before the dot, as the gathering kernel's load mask would.
The weight, packed ``[N_OUT, (kd, kh, kw, c)]``, is a row block too; a K step past a tap's channels reads the
next tap's weights against A's zero-filled columns (the descriptor's shape ends at C), so it adds nothing.

The same K loop as the implicit GEMM (one flat loop over taps x channel blocks, software-pipelined by
``num_stages`` descriptor loads) and the same epilogue (the fp8 forward's dequantization scales, bias and
activation in fp32, one downcast, the store through the output's strides). The host routes here only where
:func:`rows_gemm_applies` holds and the config asks for it (``ConvConfig.tma``); everything else runs
:mod:`.implicit_gemm`.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset

from .implicit_gemm import conv_epilogue, geom_pointwise, k_step, output_coords

__all__ = ["launch_rows_gemm", "rows_gemm_applies", "rows_layer", "tma_row_matrix"]

_RUNTIME_SIZES = ["M", "D", "H", "W", "KD", "KH", "KW", "pd", "ph", "pw", "dd", "dh", "dw"]


# fmt: off
@flyc.kernel(do_not_specialize=_RUNTIME_SIZES)
def _conv_rows_kernel(
    x_ptr, w_ptr, y_ptr, bias_ptr, xs_ptr, ws_ptr,
    M, N_OUT, C, D, H, W, KD, KH, KW, pd, ph, pw, dd, dh, dw, s_wn, sy_n, sy_d, sy_h, sy_w, sy_c,
    HAS_BIAS: fx.constexpr, ACT: fx.constexpr, TRANSPOSED: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, GROUP_M: fx.constexpr,
    X_SCALE: fx.constexpr = False, W_SCALE: fx.constexpr = 0, POINTWISE: fx.constexpr = False,
):
    # fmt: on
    pid_m, pid_n = fx.grouped_tile(fx.program_id(0), fx.cdiv(M, BLOCK_M), fx.cdiv(N_OUT, BLOCK_N), GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    taps = KD * KH * KW
    x_desc = fx.make_tensor_descriptor(x_ptr, shape=[M, C], strides=[C, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = fx.make_tensor_descriptor(w_ptr, shape=[N_OUT, taps * C], strides=[s_wn, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])  # fmt: skip
    rm = m0 + fx.arange(0, BLOCK_M)
    m_ok = rm < M
    nb, od, oh, ow = output_coords(fx.where(m_ok, rm, 0), D, H, W)
    khw = KH * KW
    c_blocks = fx.cdiv(C, BLOCK_K)
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    for kk in range(0, taps * c_blocks):
        if POINTWISE:  # 1x1 with no padding: a plain GEMM over the rows, no shift and no mask
            a = x_desc.load([m0, kk * BLOCK_K])
            b = w_desc.load([n0, kk * BLOCK_K])
        else:
            tap, c0, kd, kh, kw = k_step(kk, c_blocks, khw, KW, BLOCK_K)
            if TRANSPOSED:  # the input gradient reads position i + padding - k * dilation
                off_d = pd - kd * dd
                off_h = ph - kh * dh
                off_w = pw - kw * dw
            else:
                off_d = kd * dd - pd
                off_h = kh * dh - ph
                off_w = kw * dw - pw
            a = x_desc.load([m0 + (off_d * H + off_h) * W + off_w, c0])  # [positions, channels]: the tap's rows
            id_ = od + off_d
            ih = oh + off_h
            iw = ow + off_w
            ok = (id_ >= 0) & (id_ < D) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = fx.where(ok[:, None], a, fx.zeros_like(a))  # rows whose tap pixel is padding: another row's
            b = w_desc.load([n0, tap * C + c0])  # [output channels, channels]
        acc = fx.dot(a, fx.trans(b), acc)

    co = n0 + fx.arange(0, BLOCK_N)
    n_ok = co < N_OUT
    out = conv_epilogue(acc, co, n_ok, bias_ptr, xs_ptr, ws_ptr, HAS_BIAS, ACT, X_SCALE, W_SCALE)
    y_row = row_offset(nb, sy_n) + row_offset(od, sy_d) + row_offset(oh, sy_h) + row_offset(ow, sy_w)
    fx.store(y_ptr + y_row[:, None] + row_offset(co, sy_c)[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


_TMA_ALIGN = 16  # bytes: a descriptor's base address and every stride but the last
_MAX_ROWS = 2**31 - 2**20  # a descriptor's dims and the kernels' row index are int32 (less a tap's shift)


def rows_layer(x5, y5, geom, groups: int) -> bool:
    """The layers the row-block kernels serve (this module's and the weight gradient's): stride 1, one group,
    the output the input's size, so that a tap's input pixel of every position is one row shift away."""
    return all(s == 1 for s in geom[1]) and groups == 1 and tuple(y5.shape[1:4]) == tuple(x5.shape[1:4])


def tma_row_matrix(t5) -> bool:
    """``t5`` ``[N, D, H, W, C]`` readable as the ``[positions, C]`` matrix of a tensor descriptor: dense
    (rows of C, then positions), 16-byte rows and base (a misaligned descriptor reads wrong data without an
    error), fewer than :data:`_MAX_ROWS` positions."""
    return (t5.is_contiguous() and (t5.shape[4] * t5.element_size()) % _TMA_ALIGN == 0
            and t5.data_ptr() % _TMA_ALIGN == 0 and t5.numel() // max(1, t5.shape[4]) < _MAX_ROWS)  # fmt: skip


def rows_gemm_applies(x5, w2, y5, geom, groups: int, transposed: bool = False) -> bool:
    """Whether :func:`launch_rows_gemm` serves this launch: a :func:`rows_layer`, ``x5`` a
    :func:`tma_row_matrix` of 16-bit values (or the fp8 forward's e4m3), the packed weight of its dtype with
    contiguous 16-byte rows and a 16-byte aligned base."""
    size = x5.element_size()
    return (rows_layer(x5, y5, geom, groups) and tma_row_matrix(x5)
            and (size == 2 or (size == 1 and not transposed)) and w2.dtype == x5.dtype and w2.stride(1) == 1
            and (w2.stride(0) * size) % _TMA_ALIGN == 0 and w2.data_ptr() % _TMA_ALIGN == 0)  # fmt: skip


@flyc.jit
def launch_rows_gemm(x5, w2, y5, bias, geom, act: int, transposed: bool, cfg, x_scale=None, w_scale=None,
                     stream=None):  # fmt: skip
    """Launch the row-block kernel (where :func:`rows_gemm_applies`): ``x5`` ``[N, D, H, W, C]`` dense (the
    forward's input, or the input gradient's output gradient), ``w2`` the packed weight ``[N_OUT, taps * C]``
    (rows contiguous), ``y5`` ``[N, D, H, W, N_OUT]`` (any strides), ``bias`` ``[N_OUT]`` or None; ``geom`` the
    forward's (kernel, stride, padding, dilation); ``cfg`` a ``ConvConfig`` (its tile; ``split_k`` 1). fp8:
    ``x_scale`` / ``w_scale`` as :func:`.implicit_gemm.launch_implicit_gemm` takes them."""
    nb, d, h, w, c = x5.shape
    n_out = y5.shape[4]
    (kd, kh, kw), _, (pd, ph, pw), (dd, dh, dw) = geom
    m = nb * d * h * w
    tiles = flyc.cdiv(m, cfg.block_m) * flyc.cdiv(n_out, cfg.block_n)
    flyc.ensure_scratch_allocator()  # the device-side descriptors live in Triton's scratch memory
    # fmt: off
    flyc.launch(
        _conv_rows_kernel, (tiles,),
        x5, w2, y5, bias, x_scale, w_scale,
        m, n_out, c, d, h, w, kd, kh, kw, pd, ph, pw, dd, dh, dw, w2.stride(0), *y5.stride(),
        HAS_BIAS=bias is not None, ACT=act, TRANSPOSED=transposed, X_SCALE=x_scale is not None,
        W_SCALE=0 if w_scale is None else 1 if w_scale.numel() == 1 else 2, POINTWISE=geom_pointwise(geom),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on
