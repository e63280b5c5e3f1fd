"""Kernel and launcher decorators: ``import flydsl.compiler as flyc``.

``@flyc.kernel`` marks a device function. It *is* a Triton JIT function (no
wrapper object sits between a launch and Triton), so launching costs exactly
what Triton costs and Triton's compile cache keys apply: the kernel's source,
the sources of every function it calls, constexpr values, argument dtypes and
divisibility specialization, the target and the compiler version.

``@flyc.jit`` marks a host launcher: a plain Python function that checks its
arguments, picks a launch configuration and launches kernels. The decorator
adds, in one pass over the arguments:

- device placement: every tensor argument must be on one device, and the
  launch runs under that device (a tensor on cuda:1 never launches on cuda:0);
- the stream: ``stream=None`` means torch's current stream of that device; a
  ``torch.cuda.Stream`` or a raw ``cudaStream_t`` integer makes the launch go
  there;
- empty inputs: when any tensor argument has no elements the launcher returns
  ``None`` without launching (``skip_empty=False`` turns this off for
  launchers that must still write something, e.g. a GEMM with K = 0);
- CPU tensors run through Triton's interpreter; on a process that compiles
  for the GPU they raise a clear error instead of crashing in the driver.

``launcher.__wrapped__`` is the undecorated function, for callers that manage
devices and streams themselves and want no checks at all.

``flyc.launch(kernel, grid, *args, **meta)`` launches a kernel like
``kernel[grid](*args, **meta)`` but, after the first launch of a
specialization, calls the compiled kernel directly: Triton's per-call
argument binding, option parsing and cache-key building (most of its ~10 us
of host time) are skipped. Launchers use it where host time matters.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import triton
import triton.language as tl

from . import _backend, _interp_gpu, _interp_numpy, cache, env
from .errors import ArgumentError, DeviceError

__all__ = [
    "kernel", "func", "gluon_kernel", "jit", "launch", "bind", "Bound", "hooks_idle", "programs_per_sm",
    "on_current_device", "cdiv", "next_power_of_2", "interpreting", "ensure_scratch_allocator",
]  # fmt: skip

F = TypeVar("F", bound=Callable[..., Any])

# Triton's cache manager: a damaged compiled-kernel entry is a miss, not a crash (flydsl.cache).
cache.install_checked_manager()

interpreting = _backend.interpreting


def kernel(
    fn: Callable | None = None,
    *,
    repr: Callable | None = None,  # noqa: A002 - Triton's own argument name
    launch_metadata: Callable | None = None,
    do_not_specialize: tuple | list | None = None,
    noinline: bool | None = None,
    debug: bool | None = None,
):
    """Mark a device function (a kernel, or a helper that kernels call).

    Arguments are Triton's: ``repr`` gives profilers a readable kernel name,
    ``launch_metadata`` reports bytes/flops to them, ``do_not_specialize``
    lists integer arguments that must not trigger a recompile when their value
    changes (row counts, for instance), ``noinline`` keeps a helper out of line.
    """

    def decorate(f):
        opts: dict[str, Any] = {}
        if repr is not None:
            opts["repr"] = repr
        if launch_metadata is not None:
            opts["launch_metadata"] = launch_metadata
        if do_not_specialize:
            opts["do_not_specialize"] = tuple(do_not_specialize)
        if noinline is not None:
            opts["noinline"] = noinline
        if debug is not None:
            opts["debug"] = debug
        if _backend.interpreting():
            # Triton's interpreter swaps triton.language's functions for
            # interpreted ones while a kernel runs, and finds the module to
            # patch among the kernel's globals. Kernels see the language only
            # through flydsl.expr, so make triton.language visible to it.
            f.__globals__.setdefault("__flydsl_triton_language__", tl)
            _interp_numpy.apply()  # the interpreter on numpy >= 2.4 (see the module)
            _interp_gpu.apply()  # bf16 conversions and descriptor checks as on the GPU (see the module)
            return _interpreter_compatible(triton.jit(f, **opts) if opts else triton.jit(f))
        return triton.jit(f, **opts) if opts else triton.jit(f)

    return decorate(fn) if fn is not None else decorate


def _interpreter_compatible(jf):
    """Let the interpreter recognise ``fx.constexpr`` parameters.

    The interpreter re-executes the kernel's source with postponed annotations
    and treats a parameter as constexpr only when its annotation string is
    ``constexpr`` or ``tl.constexpr``; ``fx.constexpr`` would silently become a
    runtime tensor. Normalise the annotations of the rewritten function.
    """
    rewrite = jf.rewrite

    def rewrite_normalized():
        fn = rewrite()
        ann = fn.__annotations__
        for name, value in ann.items():
            if isinstance(value, str) and value.rsplit(".", 1)[-1].strip() == "constexpr":
                ann[name] = "constexpr"
        return fn

    jf.rewrite = rewrite_normalized
    return jf


func = kernel  # device helpers are marked the same way; the alias reads better at call sites


def gluon_kernel(fn: Callable | None = None, *, do_not_specialize: tuple | list | None = None):
    """Mark a kernel (or a helper kernels call) written in the explicit-layout language,
    :mod:`flydsl.gexpr` (Triton's Gluon). It compiles for a GPU only: :func:`launch` refuses it while
    interpreting, and callers route CPU tensors elsewhere. ``do_not_specialize`` as :func:`kernel`."""
    from triton.experimental import gluon

    def decorate(f):
        jf = gluon.jit(f, do_not_specialize=tuple(do_not_specialize)) if do_not_specialize else gluon.jit(f)
        jf._flydsl_gluon = True
        return jf

    return decorate(fn) if fn is not None else decorate


def cdiv(a: int, b: int) -> int:
    """Ceiling division of two non-negative ints (host side)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


_Tensor = torch.Tensor


def _current_cuda_device() -> int:
    # torch.cuda.current_device() re-checks lazy initialisation on every call
    # (about a microsecond); the raw query is what the launch path can afford.
    return torch._C._cuda_getDevice()


def on_current_device(t: torch.Tensor) -> bool:
    """True for a CUDA tensor on the current device, where a launch without guards goes.

    Callers that have already checked their operands' devices use it to call
    a launcher's ``__wrapped__`` directly and skip the repeated checks.
    """
    return t.is_cuda and t.get_device() == _current_cuda_device()


def _as_stream(stream: Any, device: torch.device):
    if isinstance(stream, torch.cuda.Stream):
        return stream
    if isinstance(stream, int):
        return torch.cuda.ExternalStream(stream, device=device)
    raise ArgumentError(f"stream: expected None, a torch.cuda.Stream or a raw stream handle (int), got {stream!r}")


def _launch_context(device: torch.device, stream: Any) -> list:
    """Context managers that make ``device`` current and ``stream`` its current stream (none if already so)."""
    guards = []
    index = device.index if device.index is not None else _current_cuda_device()
    if index != _current_cuda_device():
        guards.append(torch.cuda.device(index))
    if stream is not None:
        s = _as_stream(stream, device)
        if s.device.index != index:
            raise DeviceError(f"stream: belongs to {s.device}, but the tensors are on cuda:{index}")
        if s != torch.cuda.current_stream(index):
            guards.append(torch.cuda.stream(s))
    return guards


class _SlowPath:
    """Everything a launch needs beyond the common case (kept out of the fast closure)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.name = getattr(fn, "__name__", "launcher")

    def call(self, index: int, stream, args, kwargs):
        if index >= 0:
            with contextlib.ExitStack() as stack:
                for guard in _launch_context(torch.device("cuda", index), stream):
                    stack.enter_context(guard)
                return self.fn(*args, **kwargs)
        if index == -1:
            self.check_host_tensors(args, kwargs)
        return self.fn(*args, **kwargs)

    @staticmethod
    def tensors(args, kwargs):
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]
        return [(name, a) for name, a in named if isinstance(a, _Tensor)]

    def raise_mixed(self, args, kwargs):
        tensors = self.tensors(args, kwargs)
        first_name, first = tensors[0]
        for name, t in tensors[1:]:
            if t.device != first.device:
                raise DeviceError(
                    f"{self.name}: tensor arguments are on different devices "
                    f"({first_name} on {first.device}, {name} on {t.device}); move them to one device"
                )

    def check_host_tensors(self, args, kwargs):
        tensors = self.tensors(args, kwargs)
        if any(t.device != tensors[0][1].device for _, t in tensors):
            self.raise_mixed(args, kwargs)
        if tensors[0][1].device.type == "cpu" and not _backend.interpreting():
            raise DeviceError(
                f"{self.name}: got CPU tensors, but this process compiles kernels for the GPU. "
                "Move the tensors to the GPU, or start Python with FLYDSL_INTERPRET=1 to run "
                "kernels on the CPU through Triton's interpreter."
            )


def _make_launcher(fn: Callable, skip_empty: bool) -> Callable:
    """Build the launcher closure. The common call (CUDA tensors on the current
    device, default stream) costs one isinstance + get_device (+ numel) per
    argument and one current-device query; everything else is in _SlowPath."""
    slow = _SlowPath(fn)
    takes_stream = "stream" in inspect.signature(fn).parameters
    tensor_type = _Tensor
    current = _current_cuda_device

    def launcher(*args, stream=None, **kwargs):
        index = -2  # -2: no tensor seen; -1: a non-CUDA tensor; else the CUDA device index
        for a in args if not kwargs else (*args, *kwargs.values()):
            if isinstance(a, tensor_type):
                d = a.get_device()
                if d != index:
                    if index != -2:
                        slow.raise_mixed(args, kwargs)
                    index = d
                if skip_empty and not a.numel():
                    return None
        if takes_stream:
            kwargs["stream"] = stream
        if index >= 0 and stream is None and index == current():
            return fn(*args, **kwargs)
        return slow.call(index, stream, args, kwargs)

    functools.update_wrapper(launcher, fn)
    launcher.__flydsl_launcher__ = True
    return launcher


def jit(fn: F | None = None, *, skip_empty: bool = True) -> Any:
    """Mark a host launcher (see the module docstring for what it adds)."""

    def decorate(f):
        return _make_launcher(f, skip_empty)

    return decorate(fn) if fn is not None else decorate


# ---------------------------------------------------------------- lean launch

_I32 = 1 << 31
_I64 = 1 << 63


def _spec(a: Any):
    """What Triton specializes a runtime argument on, or more (a finer key only costs a compile-cache hit).

    Tensors: dtype and 16-byte alignment. Ints: the value 1, divisibility by
    16 and the integer width (i32 / i64 / u64), whether or not the argument is
    specialized. Floats: nothing (they are never specialized). Anything else
    (bools, None, dtypes): its type and value.
    """
    t = type(a)
    if t is int:
        return (a == 1) | (a & 15 == 0) << 1 | (-_I32 <= a < _I32) << 2 | (-_I64 <= a < _I64) << 3
    if t is float:
        return 0.0
    if isinstance(a, _Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    return (t, a)


def _key(device: int, args: tuple, meta: dict) -> tuple:
    """The lean table's key: :func:`_spec` of each argument, inlined for plain tensors, ints and floats."""
    key = [device]
    add = key.append
    for a in args:
        t = type(a)
        if t is _Tensor:
            add(a.dtype)
            add(a.data_ptr() & 15 == 0)
        elif t is float:
            add(0.0)
        else:
            add(_spec(a))
    key.extend(meta.items())
    return tuple(key)


class _Lean:
    """Per-kernel table: specialization key -> launch entry (:func:`_entry`)."""

    __slots__ = ("kernel", "table", "occupancy")

    def __init__(self, kernel):
        self.kernel = kernel
        self.table: dict = {}
        self.occupancy: dict = {}

    def first(self, key, grid, args, meta):
        compiled = self.kernel[grid](*args, **meta)  # Triton's path: compiles (or loads) and launches
        tail = _constexpr_tail(self.kernel, len(args), meta)
        if compiled is None or tail is None:
            return  # not a plain launch (e.g. constexprs given positionally): stay on Triton's path
        self.table[key] = _entry(compiled, tail)


def hooks_idle() -> bool:
    """Whether no launch hook (a profiler's) is installed in Triton: launches may then skip Triton's path,
    which is the one that calls the hooks."""
    rt = _RUNTIME_KNOBS
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(exit_, "calls", exit_)


_RUNTIME_KNOBS = triton.knobs.runtime


def _lean(kernel) -> _Lean:
    lean = kernel.__dict__.get("_flydsl_lean")
    if lean is None:
        lean = kernel._flydsl_lean = _Lean(kernel)
    return lean


class _Recording(threading.local):
    """The launches :func:`launch` makes on this thread while :mod:`flydsl.direct` records a call (None when
    it does not)."""

    launches: list | None = None
    declined: bool = False  # the family's path did something a replay cannot redo (flydsl.direct.decline)


_RECORDING = _Recording()


def _refuse_meta(kernel, args) -> None:
    """Meta tensors hold no data to run a kernel on: a DeviceError naming the kernel (Triton would fail on them
    with torch's NotImplementedError). Checked where a launch takes Triton's own path (the interpreter, the
    first launch of a specialization), never on the compiled fast path; the public ops return meta results
    before launching. (Offline compile scripts stub ``launch`` itself and pass meta tensors through the
    launchers, so the launchers do not check.)"""
    for i, a in enumerate(args):
        if isinstance(a, _Tensor) and a.is_meta:
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
            raise DeviceError(f"{name}: argument {i} is a meta tensor, which holds no data to run a kernel on")


def launch(kernel, grid: tuple, *args, launch_pdl: bool = False, **meta) -> None:
    """``kernel[grid](*args, **meta)`` with Triton's per-call host work skipped once compiled.

    Runtime arguments go positionally, in the kernel's order; constexprs and
    options (``num_warps``...) by keyword. The launch goes to torch's current
    device and stream, as Triton's own launch does. The first launch of each
    specialization, launches while a profiler hook is installed, and the
    interpreter all take Triton's path.

    ``launch_pdl``: a programmatic dependent launch (the kernel may start before the one before it on the
    stream has finished, and must wait for it first: ``gdc_wait``). It is a launch attribute here, not part
    of the specialization (Triton 3.6 compiles the same code either way), so that one compiled kernel
    serves launches with and without it: a CUDA graph capture after PDL launches (whose launches the
    caller makes plain) compiles and loads nothing, which capture forbids. Taken on the direct C launch
    (Triton 3.6's CUDA launcher); the first launch of a specialization, launches under a profiler hook and
    other launchers are plain.
    """
    recorder = _RECORDING.launches
    if recorder is not None:  # flydsl.direct is recording a call's launches (to replay them)
        recorder.append((kernel, grid, args, meta, launch_pdl))
    if interpreting():
        _refuse_meta(kernel, args)
        if getattr(kernel, "_flydsl_gluon", False):
            raise RuntimeError(f"{kernel.__name__} is a gluon_kernel: it compiles for a GPU only, and this process "
                               "runs kernels through the CPU interpreter")  # fmt: skip
        kernel[grid](*args, **meta)
        return
    lean = _lean(kernel)
    device = _current_cuda_device()  # a compiled kernel's handle belongs to one device's context
    key = _key(device, args, meta)
    entry = lean.table.get(key)
    if entry is None or not hooks_idle():
        _refuse_meta(kernel, args)
        lean.first(key, grid, args, meta)
        return
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    _fire(entry, grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), args, launch_pdl)


_NO_DEFAULT = inspect.Parameter.empty


def _parameters(kernel) -> list[inspect.Parameter]:
    """The Python parameters of a Triton kernel (compiled or interpreted), in order."""
    return list(inspect.signature(kernel.fn).parameters.values())


def _constexpr_tail(kernel, nargs: int, meta: dict) -> tuple | None:
    """The values of ``kernel``'s parameters after its ``nargs`` runtime ones: each from ``meta``, else the
    parameter's default. None when one has neither (it was given positionally or is missing)."""
    tail = []
    for p in _parameters(kernel)[nargs:]:
        value = meta.get(p.name, p.default)
        if value is _NO_DEFAULT:
            return None
        tail.append(value)
    return tuple(tail)


def _compile(kernel, args: tuple, meta: dict):
    """The compiled kernel of this specialization (compiled or loaded now, not launched), handles loaded."""
    compiled = kernel.warmup(*args, grid=(1,), **meta)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    compiled._init_handles()
    return compiled


def _entry(compiled, tail: tuple) -> tuple:
    """A compiled specialization's launch entry: (launcher, function, packed metadata, constexpr tail,
    direct C launch or None, driver signature or None)."""
    run = compiled.run
    return run, compiled.function, compiled.packed_metadata, tail, _direct_launch(run), _driver_signature(compiled)


# Triton's scalar argument types -> the letters of Bound.driver_signature
_DRIVER_TYPES = {"i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
                 "i64": "l", "u64": "L", "fp32": "f", "f32": "f"}  # fmt: skip


def _driver_signature(compiled) -> str | None:
    """:meth:`Bound.driver_signature` of a compiled kernel (None: not one a plain driver launch can pass)."""
    sig = getattr(getattr(compiled, "src", None), "signature", None)
    md = compiled.metadata
    if not isinstance(sig, dict) or getattr(md, "num_ctas", 1) != 1:
        return None
    if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        return None  # launch attributes a plain cuLaunchKernel does not set
    letters = []
    for ty in sig.values():
        if ty == "constexpr":
            letters.append("c")
        elif isinstance(ty, str) and ty.startswith("*"):
            letters.append("p")
        elif ty in _DRIVER_TYPES:
            letters.append(_DRIVER_TYPES[ty])
        else:
            return None
    return "".join(letters)


def _fire(entry: tuple, g0: int, g1: int, g2: int, stream: int, args: tuple, pdl: bool = False) -> None:
    """Launch an entry's kernel: its C launch function directly when the launcher allows it (``pdl``: with
    the programmatic-dependent-launch attribute, see :func:`launch`)."""
    run, function, packed, tail, direct, _ = entry
    if direct is None:
        run(g0, g1, g2, stream, function, packed, None, None, None, *args, *tail)
        return
    launch_c, coop, compiled_pdl = direct
    launch_c(g0, g1, g2, stream, function, coop, pdl or compiled_pdl, None, None, packed, None, None, None, *args,
             *tail)  # fmt: skip


_DIRECT_LAUNCH_TRITON = "3.6."  # the Triton whose CUDA launcher's C arguments _fire passes


def _direct_launch(run, scratch: bool = False):
    """(C launch function, cooperative flag, PDL flag) of a compiled kernel's launcher when calling the C
    function directly is what its Python ``__call__`` would do (Triton 3.6's CUDA launcher, no scratch
    buffers to allocate per launch); None otherwise (other versions and backends: call ``run``). The
    launcher object's Python call costs ~2-4 us of host time a launch (measured on an H200 host: a
    norm launch through ``run`` against the C function, per-call host time over a loop of calls)."""
    if type(run).__name__ != "CudaLauncher" or not triton.__version__.startswith(_DIRECT_LAUNCH_TRITON):
        return None  # the C function's argument layout is that version's: others go through ``run``
    c = getattr(run, "launch", None)
    if not callable(c) or getattr(run, "profile_scratch_size", 1):
        return None
    if not scratch and getattr(run, "global_scratch_size", 1):  # the caller would have to allocate it
        return None
    return c, run.launch_cooperative_grid, run.launch_pdl


class Bound:
    """One compiled specialization of a kernel, launched with no per-call keying (see :func:`bind`)."""

    __slots__ = ("kernel", "device", "entry", "meta")

    def __init__(self, kernel, device: int, entry: tuple, meta: dict):
        self.kernel, self.device, self.entry, self.meta = kernel, device, entry, meta

    def __call__(self, grid0: int, *args) -> None:
        """Launch ``grid0`` programs (a 1-D grid) on the current stream of the bound device."""
        if not hooks_idle():  # a profiler hook is installed: Triton's own path reports the launch
            self.kernel[(grid0,)](*args, **self.meta)
            return
        _fire(self.entry, grid0, 1, 1, torch._C._cuda_getCurrentRawStream(self.device), args)

    def direct(self) -> tuple | None:
        """(C launch function, CUfunction, cooperative flag, PDL flag, packed metadata, constexpr tail,
        device) for callers that launch with no Python between them and the driver, or None where Triton's
        launcher must be called (another Triton version or backend). The C function is called as
        ``c(g0, g1, g2, stream, function, coop, pdl, None, None, packed, None, None, None, *args, *tail)``
        and takes each pointer as a tensor or as an integer (``data_ptr()``: no driver query); the caller
        keeps to :func:`hooks_idle` launches (a profiler's hooks are called on Triton's path only)."""
        _, function, packed, tail, direct, _ = self.entry
        if direct is None:
            return None
        c_launch, coop, pdl = direct
        return c_launch, function, coop, pdl, packed, tail, self.device

    def direct_scratch(self) -> tuple | None:
        """:meth:`direct`'s tuple and the global scratch memory a launch needs, in bytes a program (0: none),
        also for kernels that need it (device-side tensor descriptors), where :meth:`direct` gives None: the
        caller then passes a device pointer to ``programs x bytes`` of memory as the C function's global
        scratch argument (the 8th), as Triton's launcher does. None where Triton's launcher must be called."""
        run, function, packed, tail, _, _ = self.entry
        direct = _direct_launch(run, scratch=True)
        if direct is None:
            return None
        c_launch, coop, pdl = direct
        per_program = int(getattr(run, "global_scratch_size", 0) or 0) * int(getattr(run, "num_ctas", 1) or 1)
        return c_launch, function, coop, pdl, packed, tail, self.device, per_program

    def driver_signature(self) -> str | None:
        """The kernel's arguments in launch order (the runtime ones, then the constexpr tail), one letter
        each, for callers that launch through the CUDA driver themselves: ``p`` a device pointer;
        ``b``/``B``, ``h``/``H``, ``i``/``I``, ``l``/``L`` a signed/unsigned 8/16/32/64-bit integer; ``f``
        an fp32 scalar; ``c`` a constexpr, which is not a kernel parameter. The kernel's parameters are
        the non-``c`` values in that order, then Triton's two scratch pointers (both 0 where
        :meth:`direct` is not None), launched with a plain ``cuLaunchKernel``. None for kernels with
        other arguments (16-bit float scalars, tuples, tensor descriptors) and for cluster, cooperative and
        PDL launches (launch attributes a plain driver launch does not set)."""
        return self.entry[5]


def bind(kernel, *args, **meta) -> Bound:
    """Compile (or find) ``kernel``'s specialization for these arguments, as a :class:`Bound` launch.

    For host paths where :func:`launch`'s keying is the cost (small eager
    calls). The caller keeps the Bound under a key of its own, and that key
    must separate everything Triton specializes on (:func:`_spec`: each
    tensor's dtype and 16-byte alignment, each int's being 1, a multiple of
    16, its width) and the device: a Bound launched with arguments of another
    specialization runs code compiled for the wrong assumptions. Arguments as
    :func:`launch` (runtime ones positionally, constexprs and options by
    keyword). Compiled runs on the current CUDA device only.
    """
    if interpreting():
        raise RuntimeError("flyc.bind: the interpreter has no compiled kernel to bind; use flyc.launch")
    lean = _lean(kernel)
    device = _current_cuda_device()
    key = _key(device, args, meta)
    entry = lean.table.get(key)
    if entry is None:
        tail = _constexpr_tail(kernel, len(args), meta)
        if tail is None:
            params = _parameters(kernel)[len(args) :]
            missing = [p.name for p in params if p.name not in meta and p.default is _NO_DEFAULT]
            raise TypeError(f"flyc.bind: give {missing} by keyword (constexprs after the runtime arguments)")
        entry = _entry(_compile(kernel, args, meta), tail)
        lean.table[key] = entry
    return Bound(kernel, device, entry, meta)


def _sm_limits(device: int) -> tuple[int, int, int]:
    """(registers, threads, shared-memory bytes) of one SM of ``device`` (Hopper's where torch does not say)."""
    p = torch.cuda.get_device_properties(device)
    return (
        getattr(p, "regs_per_multiprocessor", 65536),
        getattr(p, "max_threads_per_multi_processor", 2048),
        getattr(p, "shared_memory_per_multiprocessor", 233472),
    )


def programs_per_sm(kernel, *args, launch_pdl: bool = False, **meta) -> int:
    """How many programs of this specialization one SM holds at once: the size of a resident wave per SM.

    Same arguments as :func:`launch` (``launch_pdl`` does not change it). Compiles the kernel if needed (no
    launch) and reads its real register and shared-memory use, so a
    persistent grid of ``programs_per_sm(...) * sm_count`` programs is one
    wave whatever the launch config. Registers are allocated per warp in
    blocks of 256; each program also reserves 1 KB of shared memory. The
    interpreter runs one program at a time: 1.
    """
    if interpreting():
        return 1
    lean = _lean(kernel)
    device = _current_cuda_device()
    key = _key(device, args, meta)
    count = lean.occupancy.get(key)
    if count is None:
        compiled = _compile(kernel, args, meta)
        warps = compiled.metadata.num_warps
        regs, threads, smem = _sm_limits(device)
        regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
        by_regs = regs // (regs_per_warp * warps)
        by_threads = threads // (32 * warps)
        by_smem = smem // (compiled.metadata.shared + 1024)
        count = lean.occupancy[key] = max(1, min(by_regs, by_threads, by_smem, 32))
    return count


# ------------------------------------------------------------ scratch memory


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's scratch allocator, from torch's caching allocator (on the current GPU, or the host when
    interpreting). torch's blocks are 512-byte aligned, past any alignment Triton asks for."""
    del alignment, stream
    device = "cpu" if interpreting() else "cuda"
    return torch.empty(size, dtype=torch.int8, device=device)


def _torch_zero_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """:func:`_torch_scratch` zero-filled (one memset a launch), installed under ``FLYDSL_ZERO_SCRATCH=1``: for
    compute-sanitizer's initcheck, which does not count the descriptors the kernels write through the
    tensormap proxy as writes (see :mod:`flydsl.env`)."""
    return _torch_scratch(size, alignment, stream).zero_()


def ensure_scratch_allocator() -> None:
    """Install :func:`_torch_scratch` (:func:`_torch_zero_scratch` under ``FLYDSL_ZERO_SCRATCH=1``) as Triton's
    scratch allocator in this thread's context if none is set.

    Kernels that build tensor descriptors on the device (``fx.make_tensor_descriptor``) need global
    scratch memory for them. Triton keeps its allocator in a context variable, so every thread starts
    without one (autograd runs the backward on threads of its own): launchers of such kernels call this
    before each launch (a context-variable read once ours is installed; the environment is read only while
    another allocator is current). An allocator the caller set is kept, except under
    ``FLYDSL_ZERO_SCRATCH=1``, where the zero-filling one replaces it: torch.compile's launchers install
    a plain ``torch.empty`` allocator on every run, which would otherwise leave our descriptors in unfilled
    memory for the rest of the thread (initcheck then reports every descriptor read).
    """
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    installed = None if current is None else current.get()
    if installed is _torch_scratch or installed is _torch_zero_scratch:
        return
    # "none set" is Triton's NullAllocator (one shared instance from 3.6, a fresh default before): by its type
    null_type = getattr(_allocation, "NullAllocator", None)
    zero = env.get("FLYDSL_ZERO_SCRATCH")
    if current is None or null_type is None or isinstance(installed, null_type) or zero:
        triton.set_allocator(_torch_zero_scratch if zero else _torch_scratch)
