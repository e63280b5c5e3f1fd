"""Direct launches: a family's plain eager call replayed from a recording of its first run.

A small eager call spends most of its host time on work whose outcome is the same for every call of the
same kind: argument checks, the config lookup, routing, the outputs' sizes, and :func:`flydsl.compiler.launch`
keying every argument of every kernel. :meth:`Replays.call` runs the family's general path once per key
and records what it does on the device:

- every kernel it launches through :func:`flydsl.compiler.launch` (grid, arguments, options), bound to its
  compiled specialization for a direct C launch (:func:`flydsl.compiler.bind`);
- every tensor it allocates (``torch.empty`` and its kin, seen through a ``TorchDispatchMode``);
- where each tensor argument of each launch points: into an input (an offset from its data pointer), into
  one of the call's allocations, or into a buffer that existed before the call (a family's cache: kept
  and reused as it is).

Later calls of the key allocate the same tensors, fill the launches' pointers from their own inputs and
allocations, and go straight to Triton's C launch functions: no Python of the family's runs.

A call is replayed only when its path did nothing else on the device: a torch op other than an
allocation or a view (a fill, a copy, a reduction), or a kernel launched other than through
:func:`flydsl.compiler.launch` (Triton's launch hook counts every launch while recording), leaves its key
to the general path (after a few tries, so that a first call that fills a family's cache is recorded
again). Kernels whose launch needs Triton's own launcher (profiling scratch, another Triton version) are
not replayed either; a kernel's global scratch memory (device-side tensor descriptors) is allocated by the
replay, as Triton's launcher does (under ``FLYDSL_ZERO_SCRATCH=1`` the scratch's zero-fill is such a torch op,
so calls of those kernels keep the general path, which zero-fills every launch's).

The key is the family's and must determine everything its path reads on the host: every tensor's dtype,
shape, strides, device and 16-byte alignment (:func:`tensor_key`), every other argument, and the stream
when the path keeps per-stream buffers. Families replay only where :func:`usable` allows it: a GPU, no
tracing, no CUDA graph capture, no profiler hook in Triton, no tuning search, not inside
:func:`general_path_only`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from . import compiler as _compiler
from . import env

__all__ = ["Replays", "usable", "tensor_key", "general_path_only", "decline"]

_MISSING = object()
_DECLINED = object()  # a recording the family declined (decline()): the key keeps the general path at once
_TRIES = 3  # recordings of one key before it stays on the general path
_OFF: list = []  # non-empty inside general_path_only()


def _ops(*names: str) -> frozenset:
    """The aten overloads named (``"empty.memory_format"``) that this torch has."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return frozenset(found)


# What a replayable path may do with torch besides launching kernels: allocate, and take views.
_ALLOCATIONS = _ops("empty.memory_format", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
_VIEWS = _ops(
    "view", "_unsafe_view", "t", "transpose.int", "permute", "expand", "as_strided", "select.int", "slice.Tensor",
    "alias", "unsqueeze", "squeeze", "squeeze.dim", "squeeze.dims", "detach", "_reshape_alias", "unflatten.int",
    "flatten.using_ints", "view_as_real", "view_as_complex", "diagonal",
)


@contextmanager
def general_path_only():
    """Calls made inside take their family's general path, never a replay (a tuning harness running an op to
    capture the search task that only the general path builds)."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def decline() -> None:
    """Called by a family's path when it does what a replay would not redo (it takes a pooled buffer lent
    for this call only, say): the call being recorded, if any, gets no plan, and its key keeps the general
    path. A no-op when nothing is being recorded."""
    if _compiler._RECORDING.launches is not None:
        _compiler._RECORDING.declined = True


_compiling = torch.compiler.is_compiling
_capturing = torch.cuda.is_current_stream_capturing
_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def usable() -> bool:
    """Whether a direct launch may serve a call now (see the module docstring; also: no torch dispatch mode
    of the caller's is active, which a replay would bypass); the caller checks that its tensors are CUDA
    tensors on the current device."""
    return not (
        _OFF or _compiling() or _compiler.interpreting() or not _compiler.hooks_idle() or _capturing() or _modes()
        or env.get("FLYDSL_AUTOTUNE")
    )  # fmt: skip


def tensor_key(t) -> tuple | None:
    """A tensor's part of a replay key: dtype, shape, strides, device and its address modulo 16 (what
    Triton specializes a pointer on); None for None."""
    if t is None:
        return None
    return t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _current_device() -> int:
    return torch._C._cuda_getDevice()


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a Parameter's torch-function handling is the tensor's


def _bind_direct(kernel, args: tuple, meta: dict):
    """(C launch, function, cooperative, PDL, packed metadata, constexpr tail, device, global scratch bytes a
    program) of the compiled specialization these arguments launch, or None where it cannot be launched
    directly."""
    return _compiler.bind(kernel, *args, **meta).direct_scratch()


class Replays:
    """The recorded plans of one public function: ``key -> plan``, None (the key takes the general path) or
    the count of failed recordings so far. At most ``limit`` keys are kept (the table is cleared past it)."""

    def __init__(self, name: str, limit: int = 4096):
        self.name = name
        self.limit = limit
        self.plans: dict = {}

    def call(self, key, fn: Callable, *args):
        """``fn(*args)``: replayed when ``key`` has a plan, else run (and recorded, the first times)."""
        plan = self.plans.get(key, _MISSING)
        if type(plan) is _Plan:
            return plan.replay(args)
        if plan is None or _compiler._RECORDING.launches is not None:  # no plan, or inside another recording
            return fn(*args)
        result, made = _record(fn, args)
        if made is _DECLINED:  # never replayable
            made = None
        elif made is None:
            tries = 1 if plan is _MISSING else plan + 1
            made = None if tries >= _TRIES else tries
        elif len(self.plans) >= self.limit:
            self.plans.clear()
        self.plans[key] = made
        return result

    def eager(self, fn: Callable, *args):
        """``fn(*args)`` for a family's plain eager call, keyed on every argument (a tensor by
        :func:`tensor_key`, anything else as it is) and the stream: replayed where :func:`usable` allows it and
        every tensor argument is a plain CUDA tensor (not a subclass), the first one on the current device;
        else ``fn(*args)`` on the general path. Every argument must be hashable; the arguments must determine
        everything ``fn`` reads on the host (a family whose path also reads state of its own keys the call
        itself with :meth:`call`)."""
        if not usable():
            return fn(*args)
        key = []
        dev = None
        for a in args:
            if isinstance(a, torch.Tensor):
                if type(a) not in _PLAIN or not a.is_cuda:
                    return fn(*args)
                if dev is None:
                    dev = a.get_device()
                key.append(tensor_key(a))
            else:
                key.append(a)
        if dev is None or dev != _current_device():
            return fn(*args)
        key.append(_stream(dev))
        return self.call(tuple(key), fn, *args)

    def clear(self) -> None:
        self.plans.clear()


# ------------------------------------------------------------------ recording


class _Watch(TorchDispatchMode):
    """The torch ops a recorded call makes: its allocations in order (with the launches' positions among
    them), and whether anything else ran."""

    def __init__(self, launches: list):
        super().__init__()
        self.launches = launches
        self.allocations: list[tuple[int, torch.Tensor]] = []  # (launches recorded before it, tensor)
        self.foreign: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocations.append((len(self.launches), out))
        elif func not in _VIEWS:
            self.foreign.append(func)
        return out


class _Count:
    def __init__(self):
        self.n = 0

    def __call__(self, *args, **kwargs):
        self.n += 1


def _record(fn: Callable, args: tuple):
    """(fn(*args), its plan or None)."""
    hooks = triton.knobs.runtime.launch_enter_hook
    if not (hasattr(hooks, "add") and hasattr(hooks, "remove")):
        return fn(*args), None
    launches: list = []
    watch, count = _Watch(launches), _Count()
    _compiler._RECORDING.launches = launches
    _compiler._RECORDING.declined = False
    hooks.add(count)  # also keeps every launch on Triton's path while recording (hooks_idle() is False)
    try:
        with watch:
            result = fn(*args)
    finally:
        hooks.remove(count)
        _compiler._RECORDING.launches = None
    if _compiler._RECORDING.declined:
        _compiler._RECORDING.declined = False
        return result, _DECLINED
    if watch.foreign or count.n != len(launches) or not launches:
        return result, None
    return result, _plan(args, result, watch.allocations, launches)


class _Sources:
    """Where a pointer of the recorded call points: into an input (its storage), or into the latest
    allocation made before a given launch that holds it."""

    def __init__(self, args: tuple, allocations: list):
        self.inputs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                # the bytes the input itself spans (not its whole storage: a replay's input of the same layout
                # may sit in a storage of its own, so nothing before or past its own elements may be used)
                span = (sum((d - 1) * st for d, st in zip(a.shape, a.stride(), strict=True)) + 1) * a.element_size()
                start, storage = a.data_ptr(), a.untyped_storage()
                self.inputs.append((i, start, start + (span if a.numel() else 0), storage.data_ptr(),
                                    storage.data_ptr() + storage.nbytes()))
        self.allocations = [(when, t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for when, t in
                            allocations]  # fmt: skip
        self.layouts = [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for _, t in allocations]

    def find(self, t: torch.Tensor, before: int):
        """(1, input index, offset) or (2, allocation index, offset); (0, t) for a buffer older than the call;
        None when the pointer is ambiguous (two inputs span it) or lies in an input's storage outside the
        input's own elements."""
        p = t.data_ptr()
        for j in range(len(self.allocations) - 1, -1, -1):
            when, start, end = self.allocations[j]
            if when <= before and (start <= p < end or p == start):
                return 2, j, p - start
        hits = [(i, p - start) for i, start, end, _, _ in self.inputs if start <= p < end or p == start]
        if len(hits) > 1:
            return None
        if hits:
            return 1, hits[0][0], hits[0][1]
        if any(lo <= p < hi for _, _, _, lo, hi in self.inputs):
            return None  # in an input's storage but outside its elements: nothing a replay could point at
        return 0, t


class _Plan:
    """A recorded call: the allocations to make, the launches with their argument recipes, the result's
    recipe, and the buffers older than the call that the launches use (kept alive here)."""

    __slots__ = ("allocations", "launches", "result", "keep")

    def __init__(self, allocations, launches, result, keep):
        self.allocations, self.launches, self.result, self.keep = allocations, launches, result, keep

    def replay(self, args: tuple):
        made = [torch.empty_strided(size, stride, dtype=dtype, device=device)
                for size, stride, dtype, device in self.allocations]  # fmt: skip
        for c_launch, grid, stream_device, head, recipe, tail, scratch in self.launches:
            if scratch:  # device-side descriptors' memory, a launch's own (as Triton's launcher allocates it)
                buf = torch.empty(scratch, dtype=torch.int8, device=torch.device("cuda", stream_device))
                made.append(buf)  # alive until the replay returns; the allocator orders its reuse on the stream
                head = (*head[:3], buf.data_ptr(), *head[4:])
            values = []
            for code, what, offset in recipe:
                if code == 0:
                    values.append(what)
                elif code == 1:
                    values.append(args[what].data_ptr() + offset)
                else:
                    values.append(made[what].data_ptr() + offset)
            c_launch(*grid, _stream(stream_device), *head, *values, *tail)
        return _build(self.result, args, made)


def _plan(args: tuple, result, allocations: list, launches: list) -> _Plan | None:
    sources = _Sources(args, allocations)
    keep: list = []
    planned = []
    for index, (kernel, grid, kargs, meta, launch_pdl) in enumerate(launches):
        direct = _bind_direct(kernel, kargs, meta)
        if direct is None:
            return None
        c_launch, function, coop, pdl, packed, tail, device, per_program = direct
        recipe = []
        for a in kargs:
            if isinstance(a, torch.Tensor):
                found = sources.find(a, index)
                if found is None:
                    return None
                if found[0] == 0:  # a buffer older than the call: its pointer is a constant
                    keep.append(found[1])
                    found = (0, found[1].data_ptr(), 0)
                recipe.append(found)
            else:
                recipe.append((0, a, 0))
        g = tuple(grid) + (1,) * (3 - len(grid))
        head = (function, coop, bool(pdl or launch_pdl), None, None, packed, None, None, None)
        planned.append((c_launch, g, device, head, tuple(recipe), tail, per_program * g[0] * g[1] * g[2]))
    shapes = [(t.shape, t.stride(), t.dtype, t.device) for _, t in allocations]
    recipe = _recipe(result, args, sources, len(launches))
    if recipe is None:
        return None
    return _Plan(shapes, planned, recipe, keep)


_CONSTANTS = (type(None), bool, int, float, str, torch.dtype)


def _recipe(value, args: tuple, sources: _Sources, end: int):
    """How to rebuild the call's result: ("t", code, index, view) for a tensor (an input as it is, or an
    allocation, through ``view`` = (offset, size, stride) when it is not the allocation itself), ("z",
    size, stride, dtype, device) for an empty tensor, ("seq", type, items), ("c", value) for constants;
    None when the result cannot be rebuilt."""
    if isinstance(value, torch.Tensor):
        for i, a in enumerate(args):
            if a is value:
                return ("t", 1, i, None)
        if not value.numel():  # no memory to point into (placeholders): made afresh
            return ("z", tuple(value.shape), value.stride(), value.dtype, value.device)
        found = sources.find(value, end)
        if found is None or found[0] != 2:
            return None  # a view of an input, or a buffer older than the call: not made again by a replay
        _, j, offset = found
        itemsize = value.element_size()
        if offset % itemsize or sources.layouts[j][3] != value.dtype:  # as_strided keeps the allocation's dtype
            return None
        if sources.layouts[j] == (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype):
            return ("t", 2, j, None)  # the allocation itself
        return ("t", 2, j, (offset // itemsize, tuple(value.shape), value.stride()))
    if type(value) in (tuple, list):
        items = [_recipe(v, args, sources, end) for v in value]
        return None if any(r is None for r in items) else ("seq", type(value), items)
    if isinstance(value, _CONSTANTS):
        return ("c", value)
    return None


def _build(recipe, args: tuple, made: list):
    kind = recipe[0]
    if kind == "t":
        _, code, index, view = recipe
        t = args[index] if code == 1 else made[index]
        return t if view is None else t.as_strided(view[1], view[2], view[0])
    if kind == "seq":
        return recipe[1](_build(r, args, made) for r in recipe[2])
    if kind == "z":
        return torch.empty_strided(recipe[1], recipe[2], dtype=recipe[3], device=recipe[4])
    return recipe[1]
