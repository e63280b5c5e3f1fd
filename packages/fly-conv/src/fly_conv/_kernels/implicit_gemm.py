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

Split-K (``SPLIT_K`` > 1, the forward only): a grid of output tiles short of the SMs (small maps, many channels)
also cuts the flat K loop into contiguous runs of ``split_steps`` steps (grid axis 2). Each run stores its raw
fp32 partial sums to its own slice of a contiguous workspace ``[splits, M, K_out]``, and
:func:`launch_split_epilogue` adds the slices in split order (fixed: the result never depends on scheduling,
no atomics) and runs the epilogue once on the sum (scales, bias, activation, the downcast, the store through the
output's strides).

fp8 (e4m3) operands take the same code: A and B tiles load as fp8 and the dot multiplies them as they are (B
as ``[BLOCK_N, BLOCK_K]`` with K contiguous, transposed for the dot: K-major operands, which Hopper's 8-bit
wgmma requires). The epilogue then multiplies the fp32 accumulator by the dequantization scales
(``X_SCALE``: x's per-tensor scale; ``W_SCALE``: the weight's, per tensor or per output channel) before the
bias. With both off (16-bit and fp32 inputs) the kernel compiles exactly as without them. The fp8 dot takes
Triton's sm_90 default (no ``max_num_imprecise_acc``: the wgmma accumulator is never split for promotion, as in
fly-gemm's fp8 kernels and torch's fast-accumulation scaled matmul); the GPU tests hold it to the bf16 budget.
"""

from __future__ import annotations

import math

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import activation, row_offset

__all__ = ["launch_implicit_gemm", "launch_split_epilogue", "k_splits"]

# Sizes that change with the resolution or batch: not specialized, so a new size never compiles again.
_RUNTIME_SIZES = ["M", "D", "H", "W", "OD", "OH", "OW", "KD", "KH", "KW", "sd", "sh", "sw", "pd", "ph", "pw",
                  "dd", "dh", "dw", "split_steps", "s_split"]  # fmt: skip


@flyc.func
def output_coords(rm, OD, OH, OW):
    """A flat output position's (batch, od, oh, ow), int32 (the direct and weight-gradient kernels' decode
    too; positions past the end are masked by the caller)."""
    ow = rm % OW
    t = rm // OW
    oh = t % OH
    t = t // OH
    return t // OD, t % OD, oh, ow


@flyc.func
def k_step(kk, c_blocks, khw, KW, BLOCK_K: fx.constexpr):
    """(tap, first channel, kd, kh, kw) of step ``kk`` of a flat K loop over (tap, channel block): scalar work,
    ``c_blocks`` channel blocks a tap, ``khw`` = KH * KW."""
    tap = kk // c_blocks
    kd = tap // khw
    r = tap - kd * khw
    kh = r // KW
    return tap, (kk - tap * c_blocks) * BLOCK_K, kd, kh, r - kh * KW


@flyc.func
def _hint(v, VEC: fx.constexpr, idx: fx.constexpr):
    """``v`` in the offset type, declared a multiple of ``VEC`` (the host checked that it is): what lets the
    compiler prove a gather's 16-byte alignment (vector loads, async copies) where Triton's own
    specialization (multiples of 16) says nothing, e.g. 8 channels a group."""
    v = fx.cast(v, idx)
    if VEC > 1:
        v = v // VEC * VEC
    return v


# fmt: off
@flyc.kernel(do_not_specialize=_RUNTIME_SIZES)
def _conv_implicit_kernel(
    x_ptr, w_ptr, y_ptr, bias_ptr, xs_ptr, ws_ptr,
    M, N_OUT, CG, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
    sx_n, sx_d, sx_h, sx_w, sx_c, s_wn, sy_n, sy_d, sy_h, sy_w, sy_c, split_steps, s_split,
    HAS_BIAS: fx.constexpr, ACT: fx.constexpr, TRANSPOSED: fx.constexpr, POINTWISE: fx.constexpr,
    UNIT_STRIDE: fx.constexpr, IDX64: fx.constexpr, C_VEC: fx.constexpr, IEEE: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr, BLOCK_K: fx.constexpr, GROUP_M: fx.constexpr,
    X_SCALE: fx.constexpr = False, W_SCALE: fx.constexpr = 0, SPLIT_K: fx.constexpr = 1,
):
    # fmt: on
    # Offsets in int32 where the host proved every one of them fits (IDX64 otherwise): half the registers
    # of int64 for every per-row value the K loop keeps live.
    idx: fx.constexpr = fx.int64 if IDX64 else fx.int32
    pid_m, pid_n = fx.grouped_tile(fx.program_id(0), fx.cdiv(M, BLOCK_M), fx.cdiv(N_OUT, BLOCK_N), GROUP_M)
    g = fx.program_id(1)
    rm = pid_m * BLOCK_M + fx.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + fx.arange(0, BLOCK_N)
    rk = fx.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N_OUT
    cg = CG // C_VEC * C_VEC  # C_VEC divides CG and x's strides (host): aligned gathers
    sxn = _hint(sx_n, C_VEC, idx)
    sxd = _hint(sx_d, C_VEC, idx)
    sxh = _hint(sx_h, C_VEC, idx)
    sxw = _hint(sx_w, C_VEC, idx)
    swn = _hint(s_wn, C_VEC, idx)
    nb, od, oh, ow = output_coords(fx.where(m_ok, rm, 0), OD, OH, OW)  # rows past M read position 0, masked
    c_ptrs = x_ptr + fx.cast(g * cg + rk, idx) * sx_c  # this group's first BLOCK_K channels of x
    w_ptrs = w_ptr + (fx.cast(g * N_OUT + rn, idx) * swn)[:, None] + rk[None, :]  # [BLOCK_N, BLOCK_K]
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    # The K steps this program reduces: all of them, or split-K's contiguous run of ``split_steps`` (grid axis 2)
    if POINTWISE:
        k_steps = fx.cdiv(cg, BLOCK_K)
    else:
        k_steps = KD * KH * KW * fx.cdiv(cg, BLOCK_K)
    if SPLIT_K > 1:
        k_lo = fx.program_id(2) * split_steps
        k_hi = fx.minimum(k_steps, k_lo + split_steps)
        c_lo = k_lo * BLOCK_K  # the pointwise loop's channels
        c_hi = k_hi * BLOCK_K
    else:
        k_lo = 0
        k_hi = k_steps
        c_lo = 0
        c_hi = cg
    if POINTWISE:  # 1x1, stride 1, no padding: a plain GEMM on x's rows, read in place
        a_ptrs = c_ptrs[None, :] + (fx.cast(nb, idx) * sxn + fx.cast(od, idx) * sxd + fx.cast(oh, idx) * sxh
                                    + fx.cast(ow, idx) * sxw)[:, None]  # fmt: skip
        for c0 in range(c_lo, c_hi, BLOCK_K):
            c_ok = rk < cg - c0
            a = fx.load(a_ptrs + fx.cast(c0, idx) * sx_c, mask=m_ok[:, None] & c_ok[None, :], other=0.0)
            b = fx.load(w_ptrs + c0, mask=n_ok[:, None] & c_ok[None, :], other=0.0)
            if IEEE:
                acc = fx.dot(a, fx.trans(b), acc, input_precision="ieee")
            else:
                acc = fx.dot(a, fx.trans(b), acc)
    else:
        # A row's input position of tap 0 and the step a tap index moves it: the forward reads
        # o * stride - pad + k * dil, the stride-1 input gradient reads i + pad - k * dil. Its address is then
        # a per-row base computed once plus a per-tap scalar, and its bounds check six int32 compares.
        if TRANSPOSED:
            pos_d = od + pd
            pos_h = oh + ph
            pos_w = ow + pw
            step_d = -dd
            step_h = -dh
            step_w = -dw
        else:
            pos_d = od * sd - pd
            pos_h = oh * sh - ph
            pos_w = ow * sw - pw
            step_d = dd
            step_h = dh
            step_w = dw
        x_nb = fx.cast(nb, idx) * sxn
        a_base = x_nb + fx.cast(pos_d, idx) * sxd + fx.cast(pos_h, idx) * sxh + fx.cast(pos_w, idx) * sxw
        khw = KH * KW
        c_blocks = fx.cdiv(cg, BLOCK_K)
        # One flat loop over (tap, channel block): the software pipeline runs across taps (a layer of 64
        # channels has one block a tap); the tap's decomposition is scalar work.
        for kk in range(k_lo, k_hi):
            tap, c0, kd, kh, kw = k_step(kk, c_blocks, khw, KW, BLOCK_K)
            if TRANSPOSED and not UNIT_STRIDE:
                # the input gradient of a strided convolution: tap k reaches the forward output
                # (i + pad - k * dil) / stride where that is a non-negative whole number
                nd = pos_d - kd * dd
                nh = pos_h - kh * dh
                nw = pos_w - kw * dw
                qd = fx.where(nd >= 0, nd, 0) // sd
                qh = fx.where(nh >= 0, nh, 0) // sh
                qw = fx.where(nw >= 0, nw, 0) // sw
                ok = ((nd >= 0) & (qd * sd == nd) & (qd < D) & (nh >= 0) & (qh * sh == nh) & (qh < H)
                      & (nw >= 0) & (qw * sw == nw) & (qw < W))  # fmt: skip
                a_row = x_nb + fx.cast(qd, idx) * sxd + fx.cast(qh, idx) * sxh + fx.cast(qw, idx) * sxw
            else:
                td = kd * step_d
                th = kh * step_h
                tw = kw * step_w
                id_ = pos_d + td
                ih = pos_h + th
                iw = pos_w + tw
                ok = (id_ >= 0) & (id_ < D) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                a_row = a_base + (fx.cast(td, idx) * sxd + fx.cast(th, idx) * sxh + fx.cast(tw, idx) * sxw)
            c_ok = rk < cg - c0
            a = fx.load(c_ptrs[None, :] + (a_row + fx.cast(c0, idx) * sx_c)[:, None],
                        mask=(ok & m_ok)[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
            b = fx.load(w_ptrs + (tap * cg + c0), mask=n_ok[:, None] & c_ok[None, :], other=0.0)
            if IEEE:  # fp32 inputs: full-precision products (tf32 would round them to 10 bits)
                acc = fx.dot(a, fx.trans(b), acc, input_precision="ieee")
            else:
                acc = fx.dot(a, fx.trans(b), acc)

    co = g * N_OUT + rn  # output channels
    out = acc
    if SPLIT_K > 1:
        # split-K: the raw fp32 partial sums into this split's slice of the workspace (y: [splits, M, K_out],
        # contiguous, so a row's offset is m * K_out = m * sy_w; addressing it through the decoded rows, as
        # below, spills 128 x 128 fp32 tiles on sm_90), the epilogue run once on their sum by
        # _conv_split_epilogue_kernel
        y_row = fx.cast(rm, idx) * sy_w + fx.cast(fx.program_id(2), idx) * s_split
        fx.store(y_ptr + y_row[:, None] + (fx.cast(co, idx) * sy_c)[None, :], out,
                 mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip
    else:
        # the epilogue decodes its rows again rather than keep them live through the K loop
        nb, od, oh, ow = output_coords(fx.where(m_ok, rm, 0), OD, OH, OW)
        out = conv_epilogue(out, co, n_ok, bias_ptr, xs_ptr, ws_ptr, HAS_BIAS, ACT, X_SCALE, W_SCALE)
        y_row = (fx.cast(nb, idx) * sy_n + fx.cast(od, idx) * sy_d + fx.cast(oh, idx) * sy_h
                 + fx.cast(ow, idx) * sy_w)  # fmt: skip
        y_ptrs = y_ptr + y_row[:, None] + (fx.cast(co, idx) * sy_c)[None, :]
        fx.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@flyc.func
def conv_epilogue(out, co, n_ok, bias_ptr, xs_ptr, ws_ptr, HAS_BIAS: fx.constexpr, ACT: fx.constexpr,
              X_SCALE: fx.constexpr, W_SCALE: fx.constexpr):  # fmt: skip
    """The fp32 tile ``out`` (columns: output channels ``co``) dequantized, biased and activated."""
    if X_SCALE:  # fp8: x's per-tensor dequantization scale
        out = out * fx.load(xs_ptr).to(fx.float32)
    if W_SCALE == 1:  # fp8: the weight's per-tensor scale
        out = out * fx.load(ws_ptr).to(fx.float32)
    elif W_SCALE == 2:  # fp8: the weight's scale of each output channel
        out = out * fx.load(ws_ptr + co, mask=n_ok, other=0.0).to(fx.float32)[None, :]
    if HAS_BIAS:
        out += fx.load(bias_ptr + co, mask=n_ok, other=0.0).to(fx.float32)[None, :]
    return activation(out, ACT)


_RED_SIZES = ["M", "OD", "OH", "OW", "splits", "s_split"]


# fmt: off
@flyc.kernel(do_not_specialize=_RED_SIZES)
def _conv_split_epilogue_kernel(
    parts_ptr, y_ptr, bias_ptr, xs_ptr, ws_ptr,
    M, K_OUT, OD, OH, OW, splits, s_split, sy_n, sy_d, sy_h, sy_w, sy_c,
    HAS_BIAS: fx.constexpr, ACT: fx.constexpr, X_SCALE: fx.constexpr, W_SCALE: fx.constexpr,
    BLOCK_M: fx.constexpr, BLOCK_N: fx.constexpr,
):
    # fmt: on
    # split-K's second pass: the splits' fp32 partial sums (``parts`` [splits, M, K_OUT], rows contiguous)
    # added in split order (fixed: the result never depends on scheduling), then the forward's epilogue
    # and the store into y's own strides
    rm = fx.program_id(0) * BLOCK_M + fx.arange(0, BLOCK_M)
    co = fx.program_id(1) * BLOCK_N + fx.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = co < K_OUT
    mask = m_ok[:, None] & n_ok[None, :]
    p_ptrs = parts_ptr + (rm.to(fx.int64) * K_OUT)[:, None] + co[None, :]
    acc = fx.zeros([BLOCK_M, BLOCK_N], dtype=fx.float32)
    for s in range(0, splits):
        acc += fx.load(p_ptrs + row_offset(s, s_split), mask=mask, other=0.0)
    out = conv_epilogue(acc, co, n_ok, bias_ptr, xs_ptr, ws_ptr, HAS_BIAS, ACT, X_SCALE, W_SCALE)
    nb, od, oh, ow = output_coords(fx.where(m_ok, rm, 0), OD, OH, OW)
    y_row = row_offset(nb, sy_n) + row_offset(od, sy_d) + row_offset(oh, sy_h) + row_offset(ow, sy_w)
    fx.store(y_ptr + y_row[:, None] + row_offset(co, sy_c)[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def geom_pointwise(geom) -> bool:
    """A 1x1 convolution with stride 1 and no padding: every output position reads its own input pixel."""
    return all(v == 1 for v in geom[0] + geom[1]) and not any(geom[2])


_I32_MAX = 2**31 - 1


def _index_meta(x5, w2, y5, geom, transposed: bool, cg: int) -> dict:
    """The kernel's host-chosen addressing constexprs.

    ``IDX64``: int64 offsets unless every offset the kernel forms provably fits int32 (x's through the most a
    tap position reaches on either side: padding, dilation, the input gradient's unstrided positions; the
    weight's and y's through their extents; each with a tile of channels of slack). ``C_VEC``: the largest power of
    two up to 16 bytes that divides the channels a group, x's strides and the weight's row stride (x's
    channels contiguous), which the kernel declares so that its gathers are provably aligned.
    ``UNIT_STRIDE``: the input gradient of a stride-1 convolution, whose taps are the forward's reversed (no
    divisions in its K loop).
    """
    nb, c = x5.shape[0], x5.shape[4]
    kernel, stride, pad, dil = geom
    slack = 256  # a tile's channels past the end, masked but addressed
    # Every int32 value the gather forms is a partial sum of row terms (batch, then a tap-0 position and a
    # tap's step a dim) and a channel term: bounded by the sum of their largest magnitudes. A tap-0 position
    # is o * stride - pad (forward) or i + pad (input gradient), its step at most (k - 1) * dil.
    x_bound = (nb - 1) * abs(x5.stride(0)) + (c + slack) * abs(x5.stride(4))
    for osz, k, s, p, dl, st in zip(y5.shape[1:4], kernel, stride, pad, dil, x5.stride()[1:4], strict=True):
        x_bound += ((osz - 1) * (1 if transposed else s) + p + (k - 1) * dl) * abs(st)
    w_bound = max((w2.shape[0] + slack) * abs(w2.stride(0)), w2.shape[1] + slack)
    y_bound = sum((sz - 1) * abs(st) for sz, st in zip(y5.shape[:4], y5.stride()[:4], strict=True))
    y_bound += (y5.shape[4] + slack) * abs(y5.stride(4))
    bounds = (x_bound, w_bound, y_bound)
    vec = 16 // x5.element_size()
    if x5.stride(4) != 1 or w2.stride(1) != 1:
        vec = 1
    common = math.gcd(cg, w2.stride(0), *x5.stride()[:4])
    while vec > 1 and common % vec:
        vec //= 2
    return {"IDX64": max(bounds) > _I32_MAX, "C_VEC": vec, "UNIT_STRIDE": transposed and all(s == 1 for s in stride)}


def k_splits(x5, geom, groups: int, cfg) -> tuple[int, int]:
    """(splits, K steps a split) of a forward launched with ``cfg``: ``cfg.split_k`` runs of whole K steps
    (taps x channel blocks), as even as they come, fewer where the steps are fewer (no split is empty)."""
    steps = geom[0][0] * geom[0][1] * geom[0][2] * flyc.cdiv(x5.shape[4] // groups, cfg.block_k)
    per = flyc.cdiv(steps, max(1, min(cfg.split_k, steps)))
    return flyc.cdiv(steps, per), per


@flyc.jit
def launch_implicit_gemm(x5, w2, y5, bias, geom, act: int, transposed: bool, groups: int, cfg, x_scale=None,
                         w_scale=None, parts=None, stream=None):  # fmt: skip
    """Launch the implicit-GEMM kernel.

    ``x5``: the gathered operand as a ``[N, D, H, W, C]`` view (any strides; channels contiguous is the fast
    case); ``w2``: the packed weight ``[groups * N_OUT, taps * CG]`` (rows contiguous); ``y5``: the output
    as a ``[N, OD, OH, OW, groups * N_OUT]`` view (any strides); ``bias``: ``[groups * N_OUT]`` or None.
    ``geom``: (kernel, stride, padding, dilation), three values each, of the forward convolution;
    ``transposed``: run as the forward's input gradient (x5 is then the output gradient, y5 the input's).
    ``cfg``: a :class:`fly_conv.autotune.ConvConfig`. ``x_scale`` / ``w_scale`` (fp8 forward only): fp32
    dequantization scales, x's of one element, the weight's of one element or one an output channel
    (``[groups * N_OUT]``, contiguous), or None.

    ``parts`` (split-K, the forward only): an fp32 workspace ``[splits, N, OD, OH, OW, groups * N_OUT]``
    (contiguous), ``splits`` from :func:`k_splits`: each split's partial sums go to its slice, with no
    epilogue (``bias``, ``act`` and the scales are then :func:`launch_split_epilogue`'s) and ``y5`` unwritten.
    """
    nb, d, h, w, c = x5.shape
    _, od, oh, ow, k_out = y5.shape
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = geom
    m = nb * od * oh * ow
    n_out = k_out // groups
    cg = c // groups
    tiles = flyc.cdiv(m, cfg.block_m) * flyc.cdiv(n_out, cfg.block_n)
    splits, per, s_split, out, y_all = 1, 0, 0, y5, y5
    if parts is not None:
        splits, per = k_splits(x5, geom, groups, cfg)
        if transposed or tuple(parts.shape) != (splits, *y5.shape) or not parts.is_contiguous():
            raise ValueError(f"parts: expected a contiguous fp32 [{splits}, *y5's shape] for a forward, got "
                             f"{tuple(parts.shape)} (transposed={transposed})")  # fmt: skip
        s_split, out = parts.stride(0), parts[0]
        y_all = parts.view(-1, *parts.shape[2:])  # every split's rows: the int32 bound covers the workspace
        bias = x_scale = w_scale = None
        act = 0
    # fmt: off
    flyc.launch(
        _conv_implicit_kernel, (tiles, groups, splits),
        x5, w2, parts if parts is not None else y5, bias, x_scale, w_scale,
        m, n_out, cg, d, h, w, od, oh, ow, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw,
        *x5.stride(), w2.stride(0), *out.stride(), per, s_split,
        HAS_BIAS=bias is not None, ACT=act, TRANSPOSED=transposed, POINTWISE=geom_pointwise(geom),
        **_index_meta(x5, w2, y_all, geom, transposed, cg), IEEE=x5.dtype.itemsize == 4,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        X_SCALE=x_scale is not None, W_SCALE=0 if w_scale is None else 1 if w_scale.numel() == 1 else 2,
        SPLIT_K=splits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    # fmt: on


_RED_BLOCK_M = 32  # rows x channels of a reduce program: 4096 fp32 partials a split, 32 a thread at 4 warps
_RED_BLOCK_N = 128


@flyc.jit
def launch_split_epilogue(parts, y5, bias, act: int, x_scale=None, w_scale=None, stream=None):
    """Split-K's second pass: ``y5 = act(sum(parts) * x_scale * w_scale + bias)`` in ``y5``'s dtype and
    strides, the splits added in order. ``parts``: :func:`launch_implicit_gemm`'s contiguous fp32 workspace
    ``[splits, *y5's shape]``; the rest as :func:`launch_implicit_gemm` takes them."""
    splits = parts.shape[0]
    _, od, oh, ow, k_out = y5.shape
    m = y5.numel() // k_out
    blk_n = min(_RED_BLOCK_N, flyc.next_power_of_2(k_out))
    blk_m = max(_RED_BLOCK_M, 4096 // blk_n)
    grid = (flyc.cdiv(m, blk_m), flyc.cdiv(k_out, blk_n))
    # fmt: off
    flyc.launch(
        _conv_split_epilogue_kernel, grid,
        parts, y5, bias, x_scale, w_scale, m, k_out, od, oh, ow, splits, parts.stride(0), *y5.stride(),
        HAS_BIAS=bias is not None, ACT=act, X_SCALE=x_scale is not None,
        W_SCALE=0 if w_scale is None else 1 if w_scale.numel() == 1 else 2, BLOCK_M=blk_m, BLOCK_N=blk_n,
        num_warps=4,
    )
    # fmt: on
