"""Host code that RMSNorm and LayerNorm share (:mod:`fly_norm.rmsnorm`, :mod:`fly_norm.layernorm`): argument
checks, the forward's and backward's plans and launches of the kernels in :mod:`fly_norm._kernels.norm` (and
of the split paths, :mod:`fly_norm._split_host`), the eager small-call plans, and the fake (meta)
implementations. How the kernels work: :mod:`fly_norm._kernels.norm`'s docstring.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl.autotune import SearchTask
from flydsl.checks import check_last_dim_contiguous, check_same_device, check_shape, check_tensor, describe, parse_dtype
from flydsl.errors import ArgumentError, DTypeError, LayoutError
from flydsl.testing import tolerance
from flydsl_common.device import FP8_E4M3_MAX, INT8_MAX
from flydsl_common.rows import RowConfig, as_rows

from . import _eager as eager
from ._kernels.norm import norm_bwd_kernel, norm_fwd_kernel, sum_partials_kernel
from ._row_plans import packed_plan, pdl_options, row_meta, word_aligned
from ._split_host import give_back_slots, launch_bwd_split, launch_fwd_split, norm_bwd_rows
from .routing import PIPELINED_BWD_STAGES, ROW_KERNEL, Path, Route, route, row_kernels_below

__all__ = [  # private to fly-norm: the host plumbing that rmsnorm.py and layernorm.py share
    "FLOAT_DTYPES", "QUANT_DTYPES", "QUANT_NONE", "check_norm_args", "check_eps", "check_weight_offset", "on_meta",
    "needs_grad", "detach_all",
    "norm_forward", "norm_quant_forward", "norm_backward", "backward_into", "backward_reference",
    "launch_fwd", "fwd_route", "bwd_route", "fake_forward", "fake_quant_forward", "fake_backward",
    "builder_dtypes", "builder_rows",
]  # fmt: skip


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)

QUANT_NONE = 0  # write y in the output's float dtype
_QUANT_INT8 = 1
_QUANT_FP8 = 2


# ---------------------------------------------------------------- host launch


def _qmax(qdtype: torch.dtype | None) -> float:
    return FP8_E4M3_MAX if qdtype == torch.float8_e4m3fn else INT8_MAX


def _quant_code(qdtype: torch.dtype | None) -> int:
    if qdtype is None:
        return QUANT_NONE
    return _QUANT_INT8 if qdtype == torch.int8 else _QUANT_FP8


@flyc.jit(skip_empty=False)
def launch_fwd(
    x2, r2, w, b, s, y2, h2, mean, rstd, qscale, eps, weight_offset, is_rms, qdtype, cfg: RowConfig, stream=None
):
    """Launch the forward kernel on [M, N] row views. ``None`` operands are not read or written.

    ``x2``/``r2`` may have any row stride (last dim contiguous); ``y2``/``h2``
    likewise. ``mean``/``rstd`` (fp32 [M]) are written when given;
    ``qscale`` (fp32 [M]) when ``qdtype`` is int8/fp8 (``y2`` then holds q).
    """
    m, n = x2.shape
    if m == 0:
        return
    path = fwd_route(x2, r2, w, b, s, y2, is_rms, qdtype)
    if path.path is not Path.ROWS:  # wide rows on a GPU: the split paths (_split_host)
        code, qmax = _quant_code(qdtype), _qmax(qdtype)
        ops = (x2, r2, w, b, s, y2, h2, mean, rstd, qscale, eps, weight_offset, is_rms, code, qmax)
        if launch_fwd_split.__wrapped__(*ops, route=path):
            return  # split over the programs of one wave (else its fallback: the row kernel)
    store_stats = rstd is not None and (mean is not None or is_rms)
    cfg, packed = _row_plan(x2, r2, w, b, s, y2, weight_offset, is_rms, qdtype, cfg)
    # Absent operands go as None: a constexpr for Triton, so nothing to parse or key at launch.
    # fmt: off
    flyc.launch(
        norm_fwd_kernel, (flyc.cdiv(m, cfg.block_m),),
        x2, r2, w, b, s, y2, h2, mean, rstd, qscale,
        m, n, x2.stride(0), 0 if r2 is None else r2.stride(0), y2.stride(0), 0 if h2 is None else h2.stride(0),
        float(eps), _offset_arg(weight_offset),
        **_fwd_meta(is_rms, r2, w, b, s, store_stats, qdtype, cfg, n, packed),
    )
    # fmt: on


_OPS = {True: "rms_norm", False: "layer_norm"}


def fwd_route(x2, r2, w, b, s, y2, is_rms, qdtype) -> Route:
    """:func:`.routing.route` of a norm forward's operands ([M, N] views; None when absent); narrower rows
    than :func:`.routing.row_kernels_below` need no arch or alignment looked up: the row kernel."""
    m, n = x2.shape
    if n < row_kernels_below():
        return ROW_KERNEL
    vectors = () if is_rms else tuple(v for v in (w, b) if v is not None)  # LayerNorm's, held as words staged
    return route(
        _OPS[is_rms], x2.dtype, m, n, flydsl.arch.current(x2.device), residual=r2 is not None, quant=qdtype,
        smooth=s is not None, row_dtypes=(y2.dtype,), vector_dtypes=tuple(v.dtype for v in vectors),
        aligned=word_aligned(x2, y2, *vectors),
    )  # fmt: skip


def bwd_route(h2, dy2, dres2, dx2, is_rms) -> Route:
    """:func:`.routing.route` of a norm backward's rows ([M, N] views; ``dres2`` None when absent); as
    :func:`fwd_route`, the row kernel for rows narrower than :func:`.routing.row_kernels_below`."""
    m, n = h2.shape
    if n < row_kernels_below():
        return ROW_KERNEL
    rows = norm_bwd_rows(h2, dy2, dres2, dx2)
    return route(
        _OPS[is_rms], h2.dtype, m, n, flydsl.arch.current(h2.device), backward=True, residual=dres2 is not None,
        row_dtypes=tuple(t.dtype for t in rows[1:]), aligned=word_aligned(*rows),
    )  # fmt: skip


def _row_plan(x2, r2, w, b, s, y2, weight_offset, is_rms, qdtype, cfg: RowConfig) -> tuple[RowConfig, bool]:
    """(config, PACKED) of a forward launch (:func:`._row_plans.packed_plan`): the quantized RMSNorm
    (:func:`_packed_quant_rows`, which needs its weight) and the plain LayerNorm (:func:`_packed_norm_rows`)
    run packed when there is no residual, smooth scale or weight offset."""
    vectors = [v for v in (w, b) if v is not None]
    eligible = (
        is_rms == (qdtype is not None) and r2 is None and s is None and weight_offset == 0
        and (w is not None or not is_rms)
    )  # fmt: skip
    return packed_plan(cfg, eligible, x2, y2, vectors)


def _offset_arg(weight_offset: float) -> float | None:
    """The forward kernel's ``weight_offset`` argument: None for 0, a constexpr, so no add is compiled in
    (:func:`.affine.load_weight`); a launch plan made for one must not serve the other (eager key)."""
    return None if weight_offset == 0 else float(weight_offset)


def _fwd_meta(is_rms, r2, w, b, s, store_stats: bool, qdtype, cfg: RowConfig, n: int, packed=False) -> dict:
    """The forward kernel's constexprs and launch options."""
    return dict(
        IS_RMS=bool(is_rms), HAS_RESIDUAL=r2 is not None, HAS_WEIGHT=w is not None, HAS_BIAS=b is not None,
        HAS_SMOOTH=s is not None, STORE_STATS=store_stats, QUANT=_quant_code(qdtype), QMAX=_qmax(qdtype),
        PACKED=packed, **row_meta(cfg, n),
    )


def _bwd_call(
    h2, w, dy2, dres2, mean, rstd, dx2, dwp, dbp, scratch, weight_offset, is_rms, cfg: RowConfig, pipelined: int = 0
):
    """(args, meta) of the backward kernel; absent operands are replaced by ``rstd``, which they never touch."""
    m, n = h2.shape
    # fmt: off
    args = (
        h2, h2 if w is None else w, dy2, h2 if dres2 is None else dres2, rstd if mean is None else mean, rstd,
        dx2, rstd if dwp is None else dwp, rstd if dbp is None else dbp, rstd if scratch is None else scratch,
        m, n, h2.stride(0), dy2.stride(0), 0 if dres2 is None else dres2.stride(0), dx2.stride(0),
        float(weight_offset),
    )
    meta = dict(
        IS_RMS=bool(is_rms), HAS_WEIGHT=w is not None, HAS_DRES=dres2 is not None, COMPUTE_DW=dwp is not None,
        COMPUTE_DB=dbp is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_PASS=cfg.single_pass,
        PIPELINED=pipelined, LEAN=not is_rms and n >= BWD_LEAN_MIN_N, **cfg.launch_options(),
    )
    # fmt: on
    return args, meta


# The single pass's xhat without a select past the row (LEAN) for LayerNorm rows this wide and wider. H200
# (bf16, 2^27 elements, A/B in one process, tuned configs): layer_norm 4K 86.9 -> 88.6% of copy, 8K 83.0 -> 87.1%,
# but 1K 86.9 -> 82.4% (2K not measured); rms_norm 1K-8K 0 to -0.7.
BWD_LEAN_MIN_N = 4096


# The pipelined backward (routing.PIPELINED_BWD, its measurements there): which rows take it, routing.route.


def bwd_programs(m: int, cfg: RowConfig, device: torch.device, per_sm: int | None = None) -> int:
    """Programs of the backward grid, each looping over row blocks: ``per_sm`` an SM, by default
    ``16 // num_warps`` (see :func:`bwd_resident` for what GPU launches use)."""
    sms = flydsl.arch.current(device).sm_count
    per_sm = per_sm or max(1, 16 // cfg.num_warps)
    return max(1, min(flyc.cdiv(m, cfg.block_m), per_sm * sms))


def bwd_resident(
    h2, w, dy2, dres2, mean, rstd, dx2, need_dw, need_db, weight_offset, is_rms, cfg, pipelined: int = 0
) -> int | None:
    """Programs of this backward specialization an SM holds at once (None in the interpreter).

    The backward grid is exactly one resident wave: throughput follows the row bytes an SM keeps in
    flight, so every program that fits should run. 1, 2 and 4 programs an SM were timed on the H200, and
    ``16 // num_warps`` won: for those configs (~120 registers) exactly the resident count; layer_norm's
    8-element configs (~90 registers) hold 5 programs of 4 warps, not 4.
    """
    if flyc.interpreting():
        return None
    part = rstd  # sizing: any fp32 buffer keys the same specialization as the partials
    args, meta = _bwd_call(h2, w, dy2, dres2, mean, rstd, dx2, part if need_dw else None, part if need_db else None,
                           None if cfg.single_pass else rstd, weight_offset, is_rms, cfg, pipelined)  # fmt: skip
    return flyc.programs_per_sm(norm_bwd_kernel, *args, **meta)


@flyc.jit(skip_empty=False)
def launch_bwd(
    h2, w, dy2, dres2, mean, rstd, dx2, dwp, dbp, scratch, weight_offset, is_rms, programs, cfg: RowConfig,
    pipelined: int = 0, stream=None,
):
    """Launch the backward kernel: dx2 and the [programs, N] fp32 partials dwp/dbp (when given).

    ``scratch`` (fp32 [2, M]) is needed by the chunked path only; ``pipelined``: the row loop's stages on
    the pipelined path (:attr:`.routing.Path.PIPELINED`), else 0.
    """
    if h2.shape[0] == 0:
        return
    args, meta = _bwd_call(
        h2, w, dy2, dres2, mean, rstd, dx2, dwp, dbp, scratch, weight_offset, is_rms, cfg, pipelined
    )  # fmt: skip
    flyc.launch(norm_bwd_kernel, (programs,), *args, **meta)


@flyc.jit(skip_empty=False)
def launch_sum_partials(partials, out, partials2=None, out2=None, clear=None, stream=None):
    """out[N] (any float dtype) = partials[P, N].sum(0) in fp32, deterministic; with ``partials2`` (the same
    shape) and ``out2`` (out's dtype), out2 = partials2.sum(0) in the same launch (a launch and its gap fewer
    a LayerNorm backward). ``clear``: an int64 buffer the launch also zeroes (the split
    backward's pooled slots).

    Each program sums a band of columns over every row in [block_p, band] tiles: block_p = next_pow2(P) up
    to 256 (one step for up to 256 partials, no dependent loads), the band narrowed to keep ~4096 partials a
    step (32 fp32 a thread at 4 warps) and at least 16 columns. At 16K / 32K columns (66 / 33 partials) one
    step measured 4.0 / 4.5 us against 5.0 / 6.5 for three dependent [32, 64] steps (H200).
    The tile depends on P only, so a given shape always sums in one order.
    """
    p, n = partials.shape
    if n == 0:
        return
    block_p = min(256, flyc.next_power_of_2(p))
    band = max(16, 4096 // block_p)
    two = partials2 is not None
    flyc.launch(
        sum_partials_kernel, (flyc.cdiv(n, band), 2 if two else 1), partials, out, partials2 if two else partials,
        out2 if two else out, partials if clear is None else clear, p, n, 0 if clear is None else clear.numel(),
        BLOCK_P=block_p, BLOCK_N=band, num_warps=4, **pdl_options(partials.device),
    )  # fmt: skip


# ---------------------------------------------------------------- validation


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[M, N] view for a kernel (row strides kept); a gradient with a broadcast last dim is copied."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return as_rows(t)


def _check_vector(name, t, n, device, dtypes):
    if t is None:
        return
    check_tensor(name, t, dtypes=tuple(dict.fromkeys(dtypes)), ndim=1, device=device)  # each dtype named once
    check_shape(name, t, (n,), "the normalized (last) dimension of x")
    if n > 1 and t.stride(0) != 1:
        raise LayoutError(f"{name}: expected a contiguous vector, got {describe(t)}")


def _plain_call(x, weight, bias, any_weight_dtype: bool = False) -> bool:
    """True for x with a dense last dim and contiguous weight/bias vectors of x's dtype or fp32 (any float
    dtype of FLOAT_DTYPES with ``any_weight_dtype``) on x's device.

    A sufficient condition only: False sends the call through the full checks
    of :func:`check_norm_args`, which accept it or name what is wrong.
    """
    if type(x) is not torch.Tensor or x.dtype not in FLOAT_DTYPES or not x.dim() or x.stride(-1) != 1:
        return False
    n, dtype, device = x.shape[-1], x.dtype, x.device
    for v in (weight, bias):
        if v is not None and (
            type(v) not in _TENSOR_TYPES or v.dim() != 1 or v.shape[0] != n or v.stride(0) != 1
            or (v.dtype is not dtype and v.dtype is not torch.float32
                and not (any_weight_dtype and v.dtype in FLOAT_DTYPES))
            or v.device != device
        ):  # fmt: skip
            return False
    return n > 0


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # a module's weight is a Parameter


def check_norm_args(
    x, weight=None, bias=None, residual=None, smooth_scale=None, *, quant_dtype=None, any_weight_dtype=False
):
    """Validate the operands of a norm before anything is launched; errors name the argument.

    Plain forward: weight/bias in x's dtype or fp32 (``any_weight_dtype``: any of
    fp32/fp16/bf16, RMSNorm's rule), residual any float dtype (residual_out takes
    it). Quantized forward (the seed's rule): weight, bias and residual must have
    x's dtype; smooth_scale x's dtype or fp32.
    """
    if residual is None and smooth_scale is None and quant_dtype is None and _plain_call(
        x, weight, bias, any_weight_dtype
    ):
        return  # the common call, proven valid in a few attribute reads
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    check_last_dim_contiguous("x", x)
    n = x.shape[-1]
    if n == 0:
        raise ArgumentError(f"x: the normalized (last) dimension must have at least one element, got {describe(x)}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual), ("smooth_scale", smooth_scale)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ArgumentError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    check_same_device(x=x, weight=weight, bias=bias, residual=residual, smooth_scale=smooth_scale)
    if quant_dtype is not None:
        if not isinstance(quant_dtype, torch.dtype) or quant_dtype not in QUANT_DTYPES:
            raise DTypeError(f"dtype: expected torch.int8 or torch.float8_e4m3fn, got {quant_dtype!r}")
        affine_dtypes = (x.dtype,)
    else:
        affine_dtypes = FLOAT_DTYPES if any_weight_dtype else (x.dtype, torch.float32)
    _check_vector("weight", weight, n, x.device, affine_dtypes)
    _check_vector("bias", bias, n, x.device, (x.dtype,) if quant_dtype is not None else (x.dtype, torch.float32))
    _check_vector("smooth_scale", smooth_scale, n, x.device, (x.dtype, torch.float32))
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,) if quant_dtype is not None else FLOAT_DTYPES)
        check_shape("residual", residual, tuple(x.shape), "the shape of x")
        check_last_dim_contiguous("residual", residual)


_INF = float("inf")


def _real(name: str, v, nonnegative: bool) -> float:
    """``v`` as a float: a finite real number (and >= 0 where ``nonnegative``), else ArgumentError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ArgumentError(f"{name}: expected a real number, got {v!r} ({type(v).__name__})")
    f = float(v)
    if not math.isfinite(f) or (nonnegative and f < 0):
        raise ArgumentError(f"{name}: expected a finite number{' >= 0' if nonnegative else ''}, got {v!r}")
    return f


def check_eps(eps) -> float:
    """eps as a float, checked: finite and >= 0 (a negative eps can make mean + eps negative: NaN rows)."""
    if type(eps) is float and 0.0 <= eps < _INF:  # the common call (NaN fails the comparison)
        return eps
    return _real("eps", eps, True)


def check_weight_offset(weight_offset) -> float:
    """weight_offset as a float, checked: finite."""
    if type(weight_offset) is float and -_INF < weight_offset < _INF:
        return weight_offset
    return _real("weight_offset", weight_offset, False)


def on_meta(x) -> bool:
    """x is a meta tensor: the call gives outputs of the right shape and dtype, as torch's ops do, through the
    custom op's fake implementation (nothing to launch)."""
    return x.device.type == "meta"


def needs_grad(*tensors) -> bool:
    """True when autograd must record this call (grad mode on and some operand requires grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def detach_all(*tensors):
    return tuple(None if t is None else t.detach() for t in tensors)


def _empty(device) -> torch.Tensor:
    # Custom ops cannot return None: unused outputs are empty fp32 tensors.
    return torch.empty(0, dtype=torch.float32, device=device)


# ---------------------------------------------------------------- host ops


ConfigFor = Callable[..., RowConfig]


def _fwd_outputs(x, residual, store_stats, is_rms, qdtype, placeholders=True):
    """Output buffers; unused ones are empty placeholders (custom ops cannot return None) or, for the
    eager fast path, None (three fewer allocations per call)."""
    dev = x.device
    unused = _empty(dev) if placeholders else None
    y = torch.empty_like(x, dtype=qdtype or x.dtype, memory_format=torch.contiguous_format)
    h = torch.empty(x.shape, dtype=residual.dtype, device=dev) if residual is not None else unused
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=dev) if store_stats else unused
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=dev) if store_stats and not is_rms else unused
    if placeholders:  # a custom op's outputs must not alias each other
        h = _empty(dev) if h is unused else h
        rstd = _empty(dev) if rstd is unused else rstd
    return y, h, mean, rstd


def _search_task(run: Callable[[RowConfig], object], reference: Callable[[], object], dtype) -> SearchTask:
    return SearchTask(run=run, reference=reference, rtol=tolerance(dtype))


def norm_forward(
    x,
    weight,
    bias,
    residual,
    eps: float,
    weight_offset: float,
    *,
    is_rms: bool,
    store_stats: bool,
    config_for: ConfigFor,
    reference: Callable,
    autotune=None,
    config: RowConfig | None = None,
    placeholders: bool = True,
):
    """(y, residual_out, mean, rstd): the forward of either norm on validated operands.

    Unused outputs are empty tensors (residual_out without residual, mean for
    RMSNorm, both stats unless ``store_stats``), or None without ``placeholders``. ``config_for(n, dtype,
    device, autotune=, task=)`` picks the launch config; ``reference()``
    gives the search task's expected y (or (y, residual_out)).
    """
    y, h, mean, rstd = _fwd_outputs(x, residual, store_stats, is_rms, None, placeholders)
    if x.numel() == 0:
        return y, h, mean, rstd
    x2 = as_rows(x)
    r2 = None if residual is None else as_rows(residual)
    y2, h2 = as_rows(y), (None if residual is None else as_rows(h))  # contiguous: plain [M, N] views
    m_stats = rstd.view(-1) if store_stats else None
    mean_stats = mean.view(-1) if store_stats and not is_rms else None

    # Eager calls on the current device skip the launcher's device checks: check_norm_args made them.
    launch = launch_fwd.__wrapped__ if not placeholders and flyc.on_current_device(x) else launch_fwd

    def run(cfg):
        launch(x2, r2, weight, bias, None, y2, h2, mean_stats, m_stats, None, eps, weight_offset, is_rms, None, cfg)
        return y if residual is None else (y, h)

    cfg = config or config_for(
        x2.shape[1], x.dtype, x.device, autotune=autotune, task=lambda: _search_task(run, reference, x.dtype)
    )
    run(cfg)
    return y, h, mean, rstd


# ---------------------------------------------------------------- eager small calls

_EAGER_PLANS: dict = {}  # cheap key of a plain call -> launch plan or None (see .eager)
_PLAIN_PREFIX = {True: (True, None, True), False: (False, None, True)}  # key prefix: (is_rms, residual, no offset)


def _eager_fwd_plan(x, weight, bias, residual, eps, weight_offset, is_rms, config_for, key):
    """What :func:`.eager.make_plan` binds for :func:`eager_forward`'s ``key``, or None when no plan can serve
    it: the key's parts are validated here, once (_row_plan reads dtypes, the width, pointers' low bits)."""
    (_, rkey, _), dtype, n, _, _, _, wkey, bkey = key
    vector_dtypes = FLOAT_DTYPES if is_rms else (dtype, torch.float32)  # RMSNorm: any float weight
    vectors_ok = all(k is None or (k is not False and k[1] == (n,) and k[0] in vector_dtypes)
                     for k in (wkey, bkey))  # fmt: skip
    if dtype not in FLOAT_DTYPES or not vectors_ok or (rkey and rkey[0] not in FLOAT_DTYPES):
        return None
    m = x.numel() // n
    arch = flydsl.arch.current(x.device)
    if not route(_OPS[is_rms], dtype, m, n, arch, residual=residual is not None).eager_plan:  # the split widths
        return None
    x2, y2 = x.view(m, n), torch.empty_like(x).view(m, n)
    cfg, packed = _row_plan(x2, residual, weight, bias, None, y2, weight_offset, is_rms, None,
                            config_for(n, dtype, x.device, autotune=None, task=None))  # fmt: skip
    meta = _fwd_meta(is_rms, residual, weight, bias, None, False, None, cfg, n, packed)
    h, rn = (None, 0) if residual is None else (torch.empty_like(residual), n)
    offset = _offset_arg(weight_offset)
    args = (x, residual, weight, bias, None, y2, h, None, None, None, m, n, n, rn, n, rn, eps, offset)
    return norm_fwd_kernel, args, meta, cfg.block_m, _eager_layout(residual is not None, weight_offset)


def _eager_layout(residual: bool, weight_offset: float) -> tuple:
    """Where each of norm_fwd_kernel's runtime arguments comes from in a plan (.eager.ARG_*): x, residual,
    weight, bias, smooth scale, y, residual out, mean, rstd, row scales, M, N, the four row strides, eps and
    the weight offset (a runtime value only when not 0)."""
    e = eager
    rn = e.ARG_N if residual else e.ARG_ZERO
    return (e.ARG_X, e.ARG_R if residual else e.ARG_NONE, e.ARG_W, e.ARG_B, e.ARG_NONE, e.ARG_Y,
            e.ARG_H if residual else e.ARG_NONE, e.ARG_NONE, e.ARG_NONE, e.ARG_NONE, e.ARG_M, e.ARG_N, e.ARG_N, rn,
            e.ARG_N, rn, e.ARG_EPS, e.ARG_NONE if weight_offset == 0 else e.ARG_OFFSET)  # fmt: skip


def eager_forward(x, weight, bias, residual, eps, weight_offset, is_rms: bool, config_for: ConfigFor):
    """y (or (y, residual_out)) of a plain eager norm call through a cached launch plan (:mod:`.eager`); None
    when the call is not one, and the caller takes the general path (which also validates and names bad
    arguments).

    Plain: :func:`.eager.rows_device`, rows narrower than the split paths', weight and bias of the row's
    width in x's dtype or fp32, an optional dense residual of x's shape on the same device, nothing that
    needs a gradient. The config is chosen when the plan is made. With no residual and no weight offset the
    plan is looked up and launched in C first (:data:`.eager.fast`).
    """
    if residual is None and weight_offset == 0 and not eager.compiling():
        y = eager.fast(_EAGER_PLANS, _PLAIN_PREFIX[is_rms], x, weight, bias, eps)
        if y is not None:
            return y
    dev = eager.rows_device(x)
    if dev is None:
        return None
    if eager.grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
        or (residual is not None and residual.requires_grad)
    ):  # fmt: skip
        return None
    shape = x.shape
    n = shape[-1]
    if not n:
        return None
    m = x.numel() // n
    xp = x.data_ptr()
    rkey = None
    if residual is not None:
        if type(residual) is not torch.Tensor or residual.shape != shape or not residual.is_contiguous() or (
            not residual.is_cuda or residual.get_device() != dev
        ):  # fmt: skip
            return None
        rkey = residual.dtype, residual.data_ptr() & 15
    dtype = x.dtype
    wkey, bkey = eager.vector_key(weight, dev), eager.vector_key(bias, dev)
    key = ((is_rms, rkey, weight_offset == 0), dtype, n, dev, m >> 31, xp & 15, wkey, bkey)
    plan = _EAGER_PLANS.get(key, eager.MISSING)
    if plan is eager.MISSING:
        plan = eager.make_plan(_EAGER_PLANS, key, lambda: _eager_fwd_plan(x, weight, bias, residual, eps,
                                                                         weight_offset, is_rms, config_for, key))
    if plan is None:
        return None
    y = torch.empty_like(x)
    wp = None if weight is None else weight.data_ptr()
    bp = None if bias is None else bias.data_ptr()
    if residual is None:
        eager.launch(plan, m, n, xp, wp, bp, y.data_ptr(), eps, offset=weight_offset)
        return y
    h = torch.empty_like(residual)
    eager.launch(plan, m, n, xp, wp, bp, y.data_ptr(), eps, residual.data_ptr(), h.data_ptr(), weight_offset)
    return y, h


def norm_quant_forward(
    x,
    weight,
    bias,
    residual,
    smooth_scale,
    eps: float,
    qdtype: torch.dtype,
    *,
    is_rms: bool,
    config_for: ConfigFor,
    reference: Callable,
    config: RowConfig | None = None,
):
    """(q, scale, residual_out) of either norm, quantized per row to int8 / fp8 e4m3.

    ``reference()`` returns the reference (q, scale, ...) of the search task;
    candidates are compared on the dequantized rows q * scale.
    """
    q, h, _, _ = _fwd_outputs(x, residual, False, is_rms, qdtype)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, scale, h
    x2 = as_rows(x)
    r2 = None if residual is None else as_rows(residual)
    h2 = None if residual is None else h.view(x2.shape)

    def launch(cfg):
        launch_fwd(
            x2, r2, weight, bias, smooth_scale, q.view(x2.shape), h2, None, None, scale.view(-1), eps, 0.0,
            is_rms, qdtype, cfg,
        )  # fmt: skip

    def run(cfg):
        launch(cfg)
        return q, scale

    def dequantize(out):  # candidates are judged on q * scale, outside the timed launches
        return out[0].double() * out[1].double()[..., None]

    def task():
        return SearchTask(run=run, reference=reference, rtol=tolerance(qdtype), view=dequantize)

    launch(config or config_for(x2.shape[1], x.dtype, x.device, task=task))
    return q, scale, h


def backward_into(h2, weight, dy2, dres2, mean, rstd, dx2, dweight, dbias, weight_offset, is_rms, cfg: RowConfig):
    """Backward on [M, N] row views into given outputs: dx2, and dweight/dbias ([N], any float dtype) when given.

    The weight gradients go through a [programs, N] fp32 partial buffer and a
    fixed-order column sum (deterministic, no float atomics).
    """
    m, n = h2.shape
    if m == 0:
        for t in (dweight, dbias):
            if t is not None:
                t.zero_()
        return
    dev = h2.device
    split = None
    lent = None
    path, pipelined = bwd_route(h2, dy2, dres2, dx2, is_rms), 0
    if path.path is Path.PIPELINED:
        cfg, pipelined = path.config, PIPELINED_BWD_STAGES
    elif path.path is not Path.ROWS:  # wide rows on a GPU: split over one wave (else the row kernel)
        split = launch_bwd_split(
            h2, weight, dy2, dres2, mean, rstd, dx2, dweight is not None, dbias is not None, weight_offset, is_rms,
            pooled=True, route=path,
        )  # fmt: skip
    if split is not None:
        dwp, dbp, lent = split
    else:
        scratch = None if cfg.single_pass else torch.empty(2, m, dtype=torch.float32, device=dev)
        per_sm = bwd_resident(
            h2, weight, dy2, dres2, mean, rstd, dx2, dweight is not None, dbias is not None, weight_offset, is_rms, cfg,
            pipelined,
        )  # fmt: skip
        programs = bwd_programs(m, cfg, dev, per_sm)
        dwp = torch.empty(programs, n, dtype=torch.float32, device=dev) if dweight is not None else None
        dbp = torch.empty(programs, n, dtype=torch.float32, device=dev) if dbias is not None else None
        launch_bwd(
            h2, weight, dy2, dres2, mean, rstd, dx2, dwp, dbp, scratch, weight_offset, is_rms, programs, cfg, pipelined
        )  # fmt: skip
    sums = [(part, out) for part, out in ((dwp, dweight), (dbp, dbias)) if part is not None]
    if len(sums) == 2 and dweight.dtype == dbias.dtype:
        launch_sum_partials(dwp, dweight, dbp, dbias, clear=lent)
    else:  # the first launch zeroes the pooled slots
        for i, (part, out) in enumerate(sums):
            launch_sum_partials(part, out, clear=lent if i == 0 else None)
    if lent is not None:
        give_back_slots(lent)


def norm_backward(
    dy,
    dres,
    h,
    weight,
    mean,
    rstd,
    weight_offset: float,
    *,
    is_rms: bool,
    need_dw: bool,
    need_db: bool,
    dx_dtype: torch.dtype,
    dweight_dtype: torch.dtype,
    config_for: ConfigFor,
    config: RowConfig | None = None,
    dbias_dtype: torch.dtype | None = None,
):
    """(dx, dweight, dbias) from the saved normalized input ``h`` and its row statistics.

    ``dres`` is the gradient flowing into residual_out (or None); it is added
    to dx, which is then also the residual's gradient. dweight comes back in
    ``dweight_dtype``, dbias in ``dbias_dtype`` (default: ``dweight_dtype``);
    each empty when not needed.
    """
    dx, dw, db = fake_backward(h, need_dw, need_db, dweight_dtype, dx_dtype, dbias_dtype)
    if h.numel() == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    h2, dy2 = _rows(h), _rows(dy)
    dres2 = None if dres is None else _rows(dres)
    mean2 = None if is_rms else mean.reshape(-1)
    rstd2 = rstd.reshape(-1)

    def run(cfg):
        backward_into(
            h2, weight, dy2, dres2, mean2, rstd2, dx.view(h2.shape), dw if need_dw else None,
            db if need_db else None, weight_offset, is_rms, cfg,
        )  # fmt: skip
        return dx, dw, db

    def reference():
        return backward_reference(h, weight, dy, dres, mean, rstd, weight_offset, need_dw, need_db)

    run(config or config_for(h2.shape[1], h.dtype, h.device, task=lambda: _search_task(run, reference, h.dtype)))
    return dx, dw, db


def backward_reference(h, weight, dy, dres, mean, rstd, weight_offset, need_dw, need_db):
    """(dx, dweight, dbias) in float64 from the saved statistics (the search tasks' expected output)."""
    h64, dy64 = h.double(), dy.double()
    mu = 0.0 if mean is None or mean.numel() == 0 else mean.double()[..., None]
    r = rstd.double()[..., None]
    xhat = (h64 - mu) * r
    g = dy64 if weight is None else dy64 * (weight.double() + weight_offset)
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if mean is not None and mean.numel():
        dx = dx - g.mean(-1, keepdim=True)
    dx = dx * r
    if dres is not None:
        dx = dx + dres.double()
    rows = dy64.reshape(-1, dy64.shape[-1])
    dw = (rows * xhat.reshape(rows.shape)).sum(0) if need_dw else h.new_empty(0, dtype=torch.float32)
    db = rows.sum(0) if need_db else h.new_empty(0, dtype=torch.float32)
    return dx, dw, db


def builder_dtypes(dtype_str, weight_dtype_str):
    """Seed builders: (activation dtype, weight dtype) from the builder's dtype strings."""
    dtype = parse_dtype("dtype_str", dtype_str, FLOAT_DTYPES)
    wdtype = dtype if weight_dtype_str is None else parse_dtype("weight_dtype_str", weight_dtype_str, FLOAT_DTYPES)
    parse_dtype("weight_dtype_str", wdtype, (dtype, torch.float32))  # fp32 weights, or the activations' dtype
    return dtype, wdtype


def builder_rows(name, t, n, m_in, dtype):
    """Seed builders: the first ``m_in`` rows of a contiguous row buffer, as [m_in, N], checked against the builder."""
    check_tensor(name, t, dtypes=(dtype,))
    return t.view(-1, n)[:m_in]


# ---------------------------------------------------------------- fake (meta) implementations


def fake_forward(x, residual, store_stats: bool, is_rms: bool):
    """Shapes and dtypes of :func:`norm_forward`'s outputs, for torch.compile's tracing."""
    return _fwd_outputs(x, residual, store_stats, is_rms, None)


def fake_quant_forward(x, residual, qdtype):
    q, h, _, _ = _fwd_outputs(x, residual, False, True, qdtype)
    return q, x.new_empty(x.shape[:-1], dtype=torch.float32), h


def fake_backward(h, need_dw: bool, need_db: bool, dweight_dtype, dx_dtype, dbias_dtype=None):
    """(dx, dweight, dbias) allocated: dbias in ``dbias_dtype`` (default: ``dweight_dtype``), never rounded
    through the weight's dtype when the bias has a wider one."""
    n = h.shape[-1]
    dx = h.new_empty(h.shape, dtype=dx_dtype)
    dw = h.new_empty(n, dtype=dweight_dtype) if need_dw else h.new_empty(0, dtype=torch.float32)
    db_dtype = dweight_dtype if dbias_dtype is None else dbias_dtype
    db = h.new_empty(n, dtype=db_dtype) if need_db else h.new_empty(0, dtype=torch.float32)
    return dx, dw, db
