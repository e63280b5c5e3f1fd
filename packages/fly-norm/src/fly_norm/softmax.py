"""Row-wise softmax, forward and backward, for any row width.

    y = softmax(x, dim=-1)                   # fp32 / fp16 / bf16, any leading shape
    dx = y * (dy - sum(dy * y, dim))         # the backward, reduction in fp32

Three strategies, chosen by the row width and the launch config (:class:`flydsl_common.rows.RowConfig`):

- single pass (``cfg.single_pass``): the whole row (``block_m`` rows per
  program) stays in registers between the reductions and the write, so each
  element is read once and written once; bf16 rows of 32K columns and more
  stay packed, two columns an int32 word (``PACKED``, :func:`_packed_softmax_rows`);
- split (compiled GPU runs only): each row over several programs of one
  resident wave, read once (:mod:`fly_norm._kernels.split`). The forward takes
  rows wider than 32K columns (``SPLIT_MIN_N``) in slices of 4096 columns (8192
  from 128K), at most 64 slices a row (so up to 512K); bf16 rows from 64K
  columns on NVIDIA sm_80+ take the resident kernel first, whose programs keep
  their 16K-column slice in shared memory (:mod:`fly_norm._kernels.resident`,
  up to 1M columns, 64K slices past it). The backward takes rows wider than
  16K (``SOFTMAX_SPLIT_MIN_N_BWD``) in slices of 4096 (8192 from 256K), at
  most 256 slices a row;
- chunked (otherwise: rows wider than ``flydsl_common.rows.MAX_SINGLE_PASS`` (16K) that
  no split path takes, every such row under the interpreter, and the
  backward wherever its tuned config says: on the H200 at 2K, 4K and 16K, where two
  reads of a row ran faster than one): the forward makes one *online* pass over
  the row's chunks that carries the running (max, sum) pair, then a second pass
  that normalizes and writes; the backward accumulates ``sum(dy * y)`` in a first
  pass and writes dx in a second. The extra read of each row comes mostly from L2.

Everything is computed in fp32 (16-bit inputs are upcast on load) and the
output is stored in the input's dtype. A row holding only ``-inf`` gives NaN,
as ``torch.softmax`` does; padding lanes and padding rows never produce NaN.

The kernels are in :mod:`fly_norm._kernels.softmax`. File order (DESIGN.md 11.1): config choice, host launch,
custom ops, autograd, public function, the seed's builder API.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import flydsl
import flydsl.arch
import flydsl.compiler as flyc
from flydsl import direct
from flydsl.autotune import SearchTask
from flydsl.checks import (
    check_last_dim_contiguous,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    describe,
    parse_dtype,
)
from flydsl.errors import ArgumentError, DeviceError, LayoutError, ShapeError
from flydsl.testing import poison, tolerance
from flydsl_common.rows import RowConfig, as_rows, row_config_valid

from . import _eager as eager
from ._kernels.softmax import softmax_bwd_kernel, softmax_fwd_kernel
from ._row_plans import packed_plan, row_meta, word_aligned
from ._split_host import launch_softmax_bwd_split, launch_softmax_fwd_resident, launch_softmax_fwd_split
from .autotune import row_config_for
from .reference import softmax_bwd_ref, softmax_ref
from .routing import ROW_KERNEL, Path, Route, route, row_kernels_below

__all__ = [
    "softmax",
    "softmax_fwd",
    "softmax_bwd",
    "softmax_config",
    "softmax_bwd_config",
    "build_softmax_module",
    "build_softmax_bwd_module",
    "SOFTMAX_DTYPES",
]

SOFTMAX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ------------------------------------------------------------ config choice


def _fwd_task(x2: torch.Tensor, y2: torch.Tensor) -> Callable[[], SearchTask]:
    """Search task of a forced tuning search: the real rows, written into ``y2`` (overwritten afterwards)."""

    def make() -> SearchTask:
        def run(cfg: RowConfig) -> torch.Tensor:
            _launch_fwd(x2, y2, cfg)
            return y2

        return SearchTask(
            run=run,
            reference=lambda: softmax_ref(x2),
            rtol=tolerance(x2.dtype),
            prepare=lambda: poison(y2),
        )

    return make


def _bwd_task(dy2: torch.Tensor, y2: torch.Tensor, dx2: torch.Tensor) -> Callable[[], SearchTask]:
    def make() -> SearchTask:
        def run(cfg: RowConfig) -> torch.Tensor:
            _launch_bwd(dy2, y2, dx2, cfg)
            return dx2

        return SearchTask(
            run=run,
            reference=lambda: softmax_bwd_ref(dy2, y2),
            rtol=tolerance(dx2.dtype),
            prepare=lambda: poison(dx2),
        )

    return make


def softmax_config(n: int, dtype: torch.dtype, device, *, autotune: bool | None = None, task=None) -> RowConfig:
    """The forward launch config for rows of ``n`` elements (searched winner, artifact or default ladder)."""
    return row_config_for("softmax_fwd", n, dtype, device, autotune=autotune, task=task)


def softmax_bwd_config(n: int, dtype: torch.dtype, device, *, autotune: bool | None = None, task=None) -> RowConfig:
    """The backward launch config for rows of ``n`` elements."""
    return row_config_for("softmax_bwd", n, dtype, device, autotune=autotune, task=task)


# --------------------------------------------------------------- host launch


def fwd_route(x2: torch.Tensor, y2: torch.Tensor) -> Route:
    """:func:`.routing.route` of a softmax forward's rows; narrower rows than :func:`.routing.row_kernels_below`
    need no arch or alignment looked up: the row kernel."""
    m, n = x2.shape
    if n < row_kernels_below():
        return ROW_KERNEL
    arch = flydsl.arch.current(x2.device)
    return route("softmax", x2.dtype, m, n, arch, row_dtypes=(y2.dtype,), aligned=word_aligned(x2, y2))


def bwd_route(dy2: torch.Tensor, y2: torch.Tensor, dx2: torch.Tensor) -> Route:
    """:func:`.routing.route` of a softmax backward's rows (as :func:`fwd_route`)."""
    m, n = y2.shape
    if n < row_kernels_below():
        return ROW_KERNEL
    arch = flydsl.arch.current(y2.device)
    return route("softmax", y2.dtype, m, n, arch, backward=True, row_dtypes=(dy2.dtype, dx2.dtype))


def _launch_fwd(x2: torch.Tensor, y2: torch.Tensor, cfg: RowConfig) -> None:
    """Launch the forward kernel on [M, N] rows; no checks (callers check).

    Rows wider than 32K columns on a GPU go through the split path (each row over
    several programs of one wave, read once: :mod:`fly_norm._kernels.split`), wide
    bf16 rows through the resident kernel (:mod:`fly_norm._kernels.resident`).
    """
    m, n = x2.shape
    path = fwd_route(x2, y2)
    for step in (path, *path.fallbacks):  # the resident kernel, the split slices: each until one launches
        if step.path is Path.RESIDENT and launch_softmax_fwd_resident(x2, y2, cfg=step.config):
            return
        if step.path is Path.SPLIT and launch_softmax_fwd_split(x2, y2, step.config):
            return
    cfg, packed = packed_plan(cfg, True, x2, y2)
    flyc.launch(
        softmax_fwd_kernel, (flyc.cdiv(m, cfg.block_m),),
        x2,
        y2,
        m,
        n,
        x2.stride(0),
        y2.stride(0),
        PACKED=packed,
        **row_meta(cfg, n),
    )


def _launch_bwd(dy2: torch.Tensor, y2: torch.Tensor, dx2: torch.Tensor, cfg: RowConfig) -> None:
    m, n = y2.shape
    path = bwd_route(dy2, y2, dx2)
    if path.path is Path.SPLIT and launch_softmax_bwd_split(dy2, y2, dx2, path.config):
        return
    flyc.launch(
        softmax_bwd_kernel, (flyc.cdiv(m, cfg.block_m),),
        dy2,
        y2,
        dx2,
        m,
        n,
        dy2.stride(0),
        y2.stride(0),
        dx2.stride(0),
        **row_meta(cfg, n),
    )


# Unchecked launchers for the public path (arguments already checked): the
# decorator still runs them under the tensors' device and current stream.
_run_fwd = flyc.jit(_launch_fwd)
_run_bwd = flyc.jit(_launch_bwd)


def _check_device(name: str, t: torch.Tensor, meta_ok: bool = False) -> None:
    """Kernels run on CUDA devices, and on the CPU only through the interpreter; the public function also
    takes meta tensors (``meta_ok``: the custom ops' fake implementations give shapes and dtypes)."""
    if t.device.type == "cuda" or (t.device.type == "cpu" and flydsl.interpreting()) or (meta_ok and t.is_meta):
        return
    where = "a CUDA device" + (" or the CPU (interpreter)" if flydsl.interpreting() else "")
    raise DeviceError(f"{name}: expected a tensor on {where}, got {describe(t)}")


def _check_layout(name: str, t: torch.Tensor) -> None:
    # An empty tensor is never read (autograd hands out stride-0 empty gradients).
    if t.numel():
        check_last_dim_contiguous(name, t)


def _check_rows(name: str, t: torch.Tensor, ndim: int | None = 2) -> None:
    check_tensor(name, t, dtypes=SOFTMAX_DTYPES, ndim=ndim)
    _check_device(name, t)
    _check_layout(name, t)


def _check_config(cfg: RowConfig, n: int) -> None:
    if not isinstance(cfg, RowConfig) or not row_config_valid(cfg, n):
        raise ArgumentError(f"cfg: expected a RowConfig valid for rows of {n} elements, got {cfg!r}")


@flyc.jit
def softmax_fwd(x2d: torch.Tensor, y2d: torch.Tensor, cfg: RowConfig, stream=None) -> None:
    """Low-level forward: ``y2d = softmax(x2d, dim=1)`` with launch config ``cfg``.

    ``x2d``, ``y2d``: [M, N] fp32/fp16/bf16 (each with its own dtype), last
    dim contiguous, rows may be strided. ``cfg`` must satisfy
    ``row_config_valid(cfg, N)``. ``stream`` as for every ``@flyc.jit`` launcher.
    """
    _check_rows("x2d", x2d)
    _check_rows("y2d", y2d)
    check_shape("y2d", y2d, x2d.shape, "the shape of x2d")
    _check_config(cfg, x2d.shape[1])
    _launch_fwd(x2d, y2d, cfg)


@flyc.jit
def softmax_bwd(dy2d: torch.Tensor, y2d: torch.Tensor, dx2d: torch.Tensor, cfg: RowConfig, stream=None) -> None:
    """Low-level backward: ``dx2d = y2d * (dy2d - sum(dy2d * y2d, dim=1))``, reduction in fp32.

    All three [M, N], one dtype (fp32/fp16/bf16), last dim contiguous, rows may
    be strided; ``cfg`` must satisfy ``row_config_valid(cfg, N)``.
    """
    _check_bwd(dy2d, y2d, "dy2d", "y2d", ndim=2)
    _check_rows("dx2d", dx2d)
    check_shape("dx2d", dx2d, y2d.shape, "the shape of y2d")
    check_same_dtype(y2d=y2d, dx2d=dx2d)
    _check_config(cfg, y2d.shape[1])
    _launch_bwd(dy2d, y2d, dx2d, cfg)


def _check_bwd(dy, y, dy_name="dy", y_name="y", ndim=None) -> None:
    _check_rows(y_name, y, ndim)
    check_tensor(dy_name, dy, dtypes=SOFTMAX_DTYPES)
    check_same_device(**{y_name: y, dy_name: dy})
    check_shape(dy_name, dy, y.shape, f"the shape of {y_name}")
    check_same_dtype(**{y_name: y, dy_name: dy})
    _check_layout(dy_name, dy)


_EAGER_PLANS: dict = {}  # cheap key of a plain call -> launch plan or None (see _eager.py)


def _eager_fwd_plan(x: torch.Tensor, m: int, n: int):
    """What :func:`._eager.make_plan` binds for :func:`_eager_fwd`'s key (what packed_plan reads: the
    dtype, the width, x's pointer's low bits), or None when no plan can serve it."""
    if x.dtype not in SOFTMAX_DTYPES or not route("softmax", x.dtype, m, n, flydsl.arch.current(x.device)).eager_plan:
        return None  # the split widths
    x2, y2 = x.view(m, n), torch.empty_like(x).view(m, n)
    cfg, packed = packed_plan(softmax_config(n, x.dtype, x.device), True, x2, y2)
    layout = (eager.ARG_X, eager.ARG_Y, eager.ARG_M, eager.ARG_N, eager.ARG_N, eager.ARG_N)
    return softmax_fwd_kernel, (x2, y2, m, n, n, n), dict(PACKED=packed, **row_meta(cfg, n)), cfg.block_m, layout


def _eager_fwd(x: torch.Tensor):
    """softmax over the last dim of a plain eager call through a cached launch plan; None when the call is
    not one (:func:`fly_norm._eager.rows_device`, rows narrower than the split path's, no gradient)."""
    dev = eager.rows_device(x)
    if dev is None or (x.requires_grad and eager.grad_enabled()):
        return None
    n = x.shape[-1]
    if not n:
        return None
    m = x.numel() // n
    xp = x.data_ptr()
    key = (None, x.dtype, n, dev, m >> 31, xp & 15, None, None)  # no prefix, weight or bias: eager's layout
    plan = _EAGER_PLANS.get(key, eager.MISSING)
    if plan is eager.MISSING:
        plan = eager.make_plan(_EAGER_PLANS, key, lambda: _eager_fwd_plan(x, m, n))
    if plan is None:
        return None
    y = torch.empty_like(x)
    eager.launch(plan, m, n, xp, None, None, y.data_ptr())
    return y


def _fwd_rows(x: torch.Tensor, autotune: bool | None) -> torch.Tensor:
    """Forward over the last dim of a checked ``x`` (last dim contiguous); returns a contiguous y."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    x2 = as_rows(x)
    y2 = y.view(x2.shape)
    cfg = softmax_config(x2.shape[1], x.dtype, x.device, autotune=autotune, task=_fwd_task(x2, y2))
    _run_fwd(x2, y2, cfg)
    return y


def _bwd_rows(dy: torch.Tensor, y: torch.Tensor, autotune: bool | None) -> torch.Tensor:
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if dx.numel() == 0:
        return dx
    y2 = as_rows(y)
    dy2 = as_rows(dy)
    dx2 = dx.view(y2.shape)
    cfg = softmax_bwd_config(y2.shape[1], y.dtype, y.device, autotune=autotune, task=_bwd_task(dy2, y2, dx2))
    _run_bwd(dy2, y2, dx2, cfg)
    return dx


# ----------------------------------------------------------- custom ops


@torch.library.custom_op("fly_norm::softmax_fwd", mutates_args=(), schema="(Tensor x, bool? autotune=None) -> Tensor")
def _softmax_fwd_op(x, autotune=None):
    _check_rows("x", x, ndim=None)
    return _fwd_rows(x, autotune)


@_softmax_fwd_op.register_fake
def _(x, autotune=None):
    return x.new_empty(x.shape)  # contiguous, like the real output


@torch.library.custom_op(
    "fly_norm::softmax_bwd", mutates_args=(), schema="(Tensor dy, Tensor y, bool? autotune=None) -> Tensor"
)
def _softmax_bwd_op(dy, y, autotune=None):
    _check_bwd(dy, y)
    return _bwd_rows(dy, y, autotune)


@_softmax_bwd_op.register_fake
def _(dy, y, autotune=None):
    return y.new_empty(y.shape)


# ----------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    ctx.autotune = inputs[1]
    ctx.save_for_backward(output)
    ctx.eager = False  # through the custom op (traced, meta): its backward op too


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    # Gradients arrive in any layout (expanded from a sum, transposed ...);
    # the kernel needs a contiguous last dim only.
    if grad.dim() and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        grad = grad.contiguous()
    grad = grad.to(y.dtype)
    if ctx.eager:
        _check_bwd(grad, y)
        if ctx.autotune:
            return _bwd_rows(grad, y, ctx.autotune), None
        return _BWD_REPLAYS.eager(_bwd_rows, grad, y, None), None  # replayed where it can be
    return torch.ops.fly_norm.softmax_bwd(grad, y, ctx.autotune), None


torch.library.register_autograd("fly_norm::softmax_fwd", _backward, setup_context=_setup_context)

# The eager autograd path's recorded calls (flydsl.direct), one table a direction.
_FWD_REPLAYS = direct.Replays("fly_norm.softmax forward")
_BWD_REPLAYS = direct.Replays("fly_norm.softmax backward")


class _EagerSoftmax(torch.autograd.Function):
    """The custom op's autograd outside tracing, without the dispatcher: the first call of a custom op's
    implementation imports torch._dynamo (1.4 s on a CPU host; see rmsnorm._EagerRMSNorm)."""

    @staticmethod
    def forward(ctx, x, autotune):  # ctx here: see rmsnorm._EagerRMSNorm
        out = _fwd_rows(x, autotune) if autotune else _FWD_REPLAYS.eager(_fwd_rows, x, None)
        _setup_context(ctx, (x, autotune), out)
        ctx.eager = True
        return out

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad)


# ---------------------------------------------------------- public function


def _normalize_dim(dim: int, ndim: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ArgumentError(f"dim: expected an int, got {dim!r}")
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise ArgumentError(f"dim: expected a dimension in [{-rank}, {rank - 1}], got {dim}")
    return dim % rank


def softmax(x: torch.Tensor, dim: int = -1, *, autotune: bool | None = None) -> torch.Tensor:
    """Softmax of ``x`` along ``dim``, computed in fp32 and returned in ``x.dtype``.

    Args:
        x: fp32/fp16/bf16 tensor of any shape on a CUDA device (the CPU through
           the interpreter). Rows may be strided; a ``dim`` other than the
           last, or a non-contiguous last dim, costs one transposing copy.
        dim: the dimension to normalize (negative counts from the end).
        autotune: ``True`` searches the launch config once per row-width
           bucket (``FLYDSL_AUTOTUNE`` when None); ``False`` never searches.

    Returns:
        A tensor of ``x``'s shape and dtype. Any row width works (on a GPU
        the forward splits rows of 32K-512K elements over several programs,
        bf16 rows of 64K-1M+ on NVIDIA through the resident kernel, and the
        backward rows wider than 16K; other rows wider than 16K take the
        two-pass chunked path); meta tensors give a meta result; zero rows give an
        empty result; a row of only ``-inf`` gives NaN, like ``torch.softmax``.
        Differentiable (``fly_norm::softmax_fwd`` / ``fly_norm::softmax_bwd``
        custom ops) and usable under ``torch.compile(fullgraph=True)``.

    Example::

        y = fly_norm.softmax(torch.randn(8, 32768, device="cuda", dtype=torch.bfloat16))
    """
    if not autotune and type(x) is torch.Tensor and (dim == -1 or dim == x.dim() - 1):  # small eager calls
        # through a cached launch plan, in C or in Python (None: not such a call)
        y = None if eager.compiling() else eager.fast(_EAGER_PLANS, None, x, None, None, None)
        if y is None:
            y = _eager_fwd(x)
        if y is not None:
            return y
    check_tensor("x", x, dtypes=SOFTMAX_DTYPES)
    _check_device("x", x, meta_ok=True)
    if x.dim() == 0:
        _normalize_dim(dim, 0)
        return softmax(x.reshape(1), 0, autotune=autotune).reshape(())
    d = _normalize_dim(dim, x.dim())
    moved = d != x.dim() - 1
    xt = x.movedim(d, -1) if moved else x
    if xt.shape[-1] > 1 and xt.stride(-1) != 1:
        xt = xt.contiguous()  # the kernel reads rows with unit stride
    if torch.compiler.is_compiling() or x.is_meta:  # traced, or meta tensors: the op (and its fake)
        y = torch.ops.fly_norm.softmax_fwd(xt, autotune)
    elif x.requires_grad and torch.is_grad_enabled():
        y = _EagerSoftmax.apply(xt, autotune)
    else:
        # Eager inference skips the dispatcher (microseconds per call at small shapes); what the cached plans
        # did not take (the split widths, strided rows) replays its first call's launches
        y = _fwd_rows(xt, autotune) if autotune else _FWD_REPLAYS.eager(_fwd_rows, xt, None)
    return y.movedim(-1, d) if moved else y


# ------------------------------------------------------ seed builder API


def _seed_rows(name: str, t: torch.Tensor, n: int, m_in: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``m_in`` rows of ``t`` seen as [*, n] without a copy (outputs must be written in place)."""
    check_tensor(name, t, dtypes=(dtype,))
    _check_rows(name, t, ndim=None)
    if t.dim() == 0 or t.shape[-1] != n:
        raise ShapeError(f"{name}: expected rows of N={n} elements (last dim), got {describe(t)}")
    try:
        rows = t.view(-1, n)
    except RuntimeError:
        raise LayoutError(f"{name}: the leading dims must collapse into one row stride, got {describe(t)}") from None
    if rows.shape[0] < m_in:
        raise ShapeError(f"{name}: expected at least m_in={m_in} rows, got {describe(t)}")
    return rows[:m_in]


def _seed_m(m_in) -> int:
    m = int(m_in)
    if m < 0:
        raise ArgumentError(f"m_in: expected a row count >= 0, got {m_in!r}")
    return m


def _seed_n(n) -> int:
    if int(n) < 1:
        raise ArgumentError(f"N: expected a row width >= 1, got {n!r}")
    return int(n)


def build_softmax_module(M: int, N: int, dtype_str: str = "f32", BLOCK_THREADS: int | None = None):  # noqa: N803
    """The seed's builder: a launcher ``launch(A, C, m_in, stream=None)`` computing softmax over rows of ``N``.

    ``M`` is vestigial (the row count is the runtime ``m_in``) and
    ``BLOCK_THREADS`` is accepted for source compatibility only: the launch
    config comes from the tuning adopter. ``A`` (input) and ``C`` (output)
    hold at least ``m_in`` rows of ``N`` elements of ``dtype_str``
    ("f32"/"f16"/"bf16"), last dim contiguous.

    Example::

        launch = build_softmax_module(M=32768, N=8192, dtype_str="bf16")
        launch(x, y, x.shape[0], stream=torch.cuda.current_stream())
    """
    del M, BLOCK_THREADS
    n = _seed_n(N)
    dtype = parse_dtype("dtype_str", dtype_str, SOFTMAX_DTYPES)

    @flyc.jit(skip_empty=False)
    def launch(A, C, m_in, stream=None):  # noqa: N803 - the seed's argument names
        m = _seed_m(m_in)
        a2, c2 = _seed_rows("A", A, n, m, dtype), _seed_rows("C", C, n, m, dtype)
        if m == 0:
            return
        _launch_fwd(a2, c2, softmax_config(n, dtype, A.device, task=_fwd_task(a2, c2)))

    return launch


def build_softmax_bwd_module(N: int, dtype_str: str = "f32"):  # noqa: N803
    """The seed's backward builder: ``launch(dy, y, dx, m_in, stream=None)`` computes
    ``dx = y * (dy - sum(dy * y))`` over the first ``m_in`` rows of ``N`` elements (fp32 reduction).

    Example::

        launch = build_softmax_bwd_module(N=8192, dtype_str="bf16")
        launch(dy, y, dx, y.shape[0], stream=torch.cuda.current_stream())
    """
    n = _seed_n(N)
    dtype = parse_dtype("dtype_str", dtype_str, SOFTMAX_DTYPES)

    @flyc.jit(skip_empty=False)
    def launch(dy, y, dx, m_in, stream=None):
        m = _seed_m(m_in)
        dy2, y2, dx2 = (_seed_rows(k, t, n, m, dtype) for k, t in (("dy", dy), ("y", y), ("dx", dx)))
        if m == 0:
            return
        _launch_bwd(dy2, y2, dx2, softmax_bwd_config(n, dtype, y.device, task=_bwd_task(dy2, y2, dx2)))

    return launch
