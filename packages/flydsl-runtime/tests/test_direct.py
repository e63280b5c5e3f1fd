"""flydsl.direct: a call recorded once, then replayed from its plan, on the CPU with stand-in kernels.

A stand-in kernel computes through raw pointers (as compiled code reads memory) and calls Triton's launch
hook as Triton's launcher does; a stand-in for the compiled specialization's C launch function runs the same
body on the integer pointers a replay passes. So each test checks what a replay depends on: the right
pointers (inputs at their offsets, fresh allocations, buffers older than the call), fresh outputs every
call, and every case that must stay on the general path.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import triton

import flydsl.compiler as flyc
from flydsl import direct

# stand-in kernels and CPU tensors through the launch path: what Triton's interpreter runs
pytestmark = pytest.mark.interpreter


def _floats(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr)) if n else np.zeros(0, np.float32)


def _ptr(x) -> int:
    return x.data_ptr() if isinstance(x, torch.Tensor) else int(x)


class AxpyKernel:
    """c[i] = alpha * a[i] + b[i] for i < n (fp32), a kernel stand-in: ``kernel[grid](a, b, c, n, alpha,
    BLOCK=...)``."""

    def __init__(self):
        self.launched = 0

    def body(self, a, b, c, n, alpha):
        self.launched += 1
        _floats(_ptr(c), n)[:] = alpha * _floats(_ptr(a), n) + _floats(_ptr(b), n)

    def __getitem__(self, grid):
        def run(a, b, c, n, alpha, BLOCK=64):  # noqa: N803 - a constexpr's name
            triton.knobs.runtime.launch_enter_hook(None)  # as Triton's launcher calls its hook
            self.body(a, b, c, n, alpha)

        return run


AXPY = AxpyKernel()


SCRATCH = {"bytes a program": 0}  # what the stand-in specializations say they need of global scratch


@pytest.fixture
def stand_ins(monkeypatch):
    """Bind stand-in kernels to stand-in C launch functions; a stream of 0. Records every replayed launch
    (grid, global scratch pointer, values)."""
    replayed = []
    SCRATCH["bytes a program"] = 0

    def bind_direct(kernel, args, meta):
        def c_launch(g0, g1, g2, stream, function, coop, pdl, scratch, _b, packed, _c, _d, _e, *values):
            replayed.append((g0, g1, g2, scratch, values))
            kernel.body(*values[: len(values) - 1])  # the tail (BLOCK) last

        return c_launch, "function", 0, False, "packed", (meta.get("BLOCK", 64),), 0, SCRATCH["bytes a program"]

    monkeypatch.setattr(direct, "_bind_direct", bind_direct)
    monkeypatch.setattr(direct, "_stream", lambda device: 0)
    return replayed


def axpy(a, b, alpha):
    """A family's general path: checks, an allocation, a temporary, two launches."""
    n = a.numel()
    tmp = torch.empty(n, dtype=torch.float32)
    flyc.launch(AXPY, (1,), a.view(-1), b.view(-1), tmp, n, alpha, BLOCK=64)
    out = torch.empty_like(a)
    flyc.launch(AXPY, (1,), tmp, b.view(-1), out.view(-1), n, 1.0, BLOCK=64)
    return out  # alpha * a + 2 b


def test_a_recorded_call_replays_on_new_inputs(stand_ins):
    replays = direct.Replays("axpy")
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    key = ("axpy", direct.tensor_key(a), direct.tensor_key(b), 3.0)
    first = replays.call(key, axpy, a, b, 3.0)
    torch.testing.assert_close(first, 3 * a + 2 * b)
    assert not stand_ins  # the first call ran the general path
    for _ in range(3):
        a2, b2 = torch.randn(4, 8), torch.randn(4, 8)
        out = replays.call(key, axpy, a2, b2, 3.0)
        torch.testing.assert_close(out, 3 * a2 + 2 * b2)
        assert out.shape == a2.shape and out.data_ptr() != first.data_ptr()
    assert len(stand_ins) == 6  # two launches a replay
    assert stand_ins[0][:4] == (1, 1, 1, None)  # no global scratch


def test_offsets_into_inputs_and_allocations(stand_ins):
    """Launch arguments that are views at an offset: of an input, and of the call's own allocation."""

    def tail_axpy(a, b):
        out = torch.empty(a.numel() + 5, dtype=torch.float32)
        flyc.launch(AXPY, (1,), a.view(-1)[3:], b.view(-1)[3:], out[5:], a.numel() - 3, 2.0, BLOCK=64)
        return out[5:][: a.numel() - 3]

    replays = direct.Replays("tail")
    for _ in range(3):
        a, b = torch.randn(3, 7), torch.randn(3, 7)
        out = replays.call(("k",), tail_axpy, a, b)
        torch.testing.assert_close(out, 2 * a.view(-1)[3:] + b.view(-1)[3:])
    assert len(stand_ins) == 2


def test_a_buffer_older_than_the_call_is_reused_and_kept(stand_ins):
    cache = {"ones": torch.ones(16)}

    def add_ones(a):
        out = torch.empty_like(a)
        flyc.launch(AXPY, (1,), a, cache["ones"], out, a.numel(), 1.0, BLOCK=64)
        return out

    replays = direct.Replays("ones")
    replays.call(("k",), add_ones, torch.zeros(16))
    kept = cache.pop("ones")
    plan = replays.plans[("k",)]
    assert plan.keep == [kept]  # held by the plan while the family's cache lets go
    del kept
    a = torch.randn(16)
    torch.testing.assert_close(replays.call(("k",), add_ones, a), a + 1)


def test_results_with_structure(stand_ins):
    def two(a, b):
        out = torch.empty_like(a)
        flyc.launch(AXPY, (1,), a, b, out, a.numel(), -1.0, BLOCK=64)
        return out, None, a, 7

    replays = direct.Replays("two")
    replays.call(("k",), two, torch.randn(5), torch.randn(5))
    a, b = torch.randn(5), torch.randn(5)
    out, none, same, seven = replays.call(("k",), two, a, b)
    torch.testing.assert_close(out, b - a)
    assert none is None and same is a and seven == 7


@pytest.mark.parametrize("what", ["torch op", "launch outside flyc.launch", "aliased inputs", "no launch"])
def test_what_stays_on_the_general_path(stand_ins, what):
    def fill(a, b):
        out = torch.empty_like(a)
        if what == "torch op":
            out.zero_()  # work on the device that a replay would not redo
        if what == "launch outside flyc.launch":
            AXPY[(1,)](a, b, out, a.numel(), 1.0)
        elif what != "no launch":
            flyc.launch(AXPY, (1,), a, b, out, a.numel(), 1.0, BLOCK=64)
        return out

    replays = direct.Replays("fill")
    for i in range(5):
        a = torch.randn(8)
        b = a if what == "aliased inputs" else torch.randn(8)
        out = replays.call(("k",), fill, a, b)
        if what != "no launch":
            torch.testing.assert_close(out, a + b)
        # recorded at most three times, then the key stays on the general path
        assert replays.plans[("k",)] == (min(i + 1, 2) if i < 2 else None)
    assert not stand_ins


def test_a_first_call_that_fills_a_cache_is_recorded_again(stand_ins):
    cache = {}

    def cached_ones(a):
        if "ones" not in cache:
            cache["ones"] = torch.ones(a.numel())  # a fill: the first call is not replayable
        out = torch.empty_like(a)
        flyc.launch(AXPY, (1,), a, cache["ones"], out, a.numel(), 2.0, BLOCK=64)
        return out

    replays = direct.Replays("cached")
    replays.call(("k",), cached_ones, torch.randn(6))
    assert replays.plans[("k",)] == 1
    replays.call(("k",), cached_ones, torch.randn(6))
    a = torch.randn(6)
    torch.testing.assert_close(replays.call(("k",), cached_ones, a), 2 * a + 1)
    assert len(stand_ins) == 1


def test_kernels_without_a_direct_launch_are_not_replayed(stand_ins, monkeypatch):
    monkeypatch.setattr(direct, "_bind_direct", lambda kernel, args, meta: None)
    replays = direct.Replays("axpy")
    for _ in range(4):
        a, b = torch.randn(4), torch.randn(4)
        torch.testing.assert_close(replays.call(("k",), axpy, a, b, 1.0), a + 2 * b)
    assert replays.plans[("k",)] is None


def test_the_table_is_bounded_and_nested_calls_are_not_recorded(stand_ins):
    replays = direct.Replays("axpy", limit=2)
    for n in (3, 4, 5):
        replays.call(("k", n), axpy, torch.randn(n), torch.randn(n), 1.0)
    assert len(replays.plans) == 1  # cleared when full
    inner = direct.Replays("inner")

    def outer(a, b):
        return inner.call(("i",), axpy, a, b, 1.0)

    replays.call(("outer",), outer, torch.randn(3), torch.randn(3))
    assert ("i",) not in inner.plans  # ran inside the outer recording: not recorded on its own


def test_usable_here_and_general_path_only():
    assert not direct.usable()  # the interpreter: nothing is compiled to launch directly
    with direct.general_path_only():
        assert direct._OFF
    assert not direct._OFF


def test_tensor_key():
    t = torch.randn(4, 6)[:, 1:]
    assert direct.tensor_key(t) == (t.dtype, t.shape, (6, 1), t.device, t.data_ptr() & 15)
    assert direct.tensor_key(None) is None


def test_a_declined_call_keeps_the_general_path_at_once(stand_ins):
    def pooled(a, b):
        direct.decline()  # e.g. a pooled buffer lent for this call only
        return axpy(a, b, 1.0)

    replays = direct.Replays("pooled")
    a, b = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(replays.call(("k",), pooled, a, b), a + 2 * b)
    assert replays.plans[("k",)] is None and not stand_ins
    direct.decline()  # outside a recording: nothing happens
    replays.call(("j",), axpy, a, b, 1.0)
    assert type(replays.plans[("j",)]).__name__ == "_Plan"


def test_usable_gates(monkeypatch):
    """Each condition alone turns direct launches off: a dispatch mode of the caller's, general_path_only,
    a tuning search, graph capture, a profiler hook, tracing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(direct._compiler, "interpreting", lambda: False)
    monkeypatch.setattr(direct, "_capturing", lambda: False)
    monkeypatch.delenv("FLYDSL_AUTOTUNE", raising=False)
    assert direct.usable()

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert not direct.usable()
    with direct.general_path_only():
        assert not direct.usable()
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "1")
    assert not direct.usable()
    monkeypatch.delenv("FLYDSL_AUTOTUNE")
    monkeypatch.setattr(direct, "_capturing", lambda: True)
    assert not direct.usable()
    monkeypatch.setattr(direct, "_capturing", lambda: False)
    monkeypatch.setattr(direct._compiler, "hooks_idle", lambda: False)
    assert not direct.usable()
    monkeypatch.setattr(direct._compiler, "hooks_idle", lambda: True)
    monkeypatch.setattr(direct, "_compiling", lambda: True)
    assert not direct.usable()


def test_global_scratch_is_allocated_for_each_launch(stand_ins, monkeypatch):
    """A kernel needing global scratch (device-side descriptors) gets grid x bytes of its own at each replay."""
    SCRATCH["bytes a program"] = 128
    sizes = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **{**kw, "device": "cpu"})  # a stand-in device: the host
        if kw.get("dtype") is torch.int8:
            sizes.append(t.numel())
        return t

    replays = direct.Replays("scratch")
    a, b = torch.randn(8), torch.randn(8)
    replays.call(("k",), axpy, a, b, 1.0)
    monkeypatch.setattr(direct.torch, "empty", empty)
    torch.testing.assert_close(replays.call(("k",), axpy, a, b, 1.0), a + 2 * b)
    assert sizes == [128, 128]  # one program a launch, two launches
    assert all(isinstance(r[3], int) and r[3] for r in stand_ins)


def test_empty_placeholders_and_views_in_results(stand_ins):
    """Empty placeholder outputs (a custom op's unused results) are made afresh with their dtype; a result
    that views its allocation is rebuilt as the same view."""

    def with_placeholders(a, b):
        buf = torch.empty(2 * a.numel(), dtype=torch.float32)
        flyc.launch(AXPY, (1,), a, b, buf[a.numel() :], a.numel(), 1.0, BLOCK=64)
        return buf[a.numel() :].view(a.shape), torch.empty(0, dtype=torch.int8), torch.empty(0)

    replays = direct.Replays("placeholders")
    replays.call(("k",), with_placeholders, torch.randn(2, 3), torch.randn(2, 3))
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    y, p8, p32 = replays.call(("k",), with_placeholders, a, b)
    torch.testing.assert_close(y, a + b)
    assert (p8.dtype, p8.numel(), p32.dtype, p32.numel()) == (torch.int8, 0, torch.float32, 0)
    assert len(stand_ins) == 1


def test_pointers_outside_an_inputs_elements_are_not_replayed(stand_ins):
    """A launch reading an input's storage past the input's own elements (a replay's input of the same layout
    may have no such bytes): the key keeps the general path."""

    def beyond(a, b):
        out = torch.empty_like(b)
        past = a.as_strided((3,), (1,), a.storage_offset() + a.numel() + 1)  # after a's last element
        flyc.launch(AXPY, (1,), past, b, out, 3, 1.0, BLOCK=64)
        return out

    replays = direct.Replays("beyond")
    big = torch.randn(12)
    for _ in range(3):
        replays.call(("k",), beyond, big[:8], torch.randn(3))
    assert replays.plans[("k",)] is None and not stand_ins


def test_eager_keys_every_argument_and_replays(stand_ins, monkeypatch):
    """Replays.eager: the first call of a kind records, the next ones (fresh tensors, same layouts and
    options) replay; another option or layout is another key; a CPU tensor keeps the general path."""
    monkeypatch.setattr(direct, "usable", lambda: True)
    monkeypatch.setattr(direct, "_current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    replays = direct.Replays("test.eager")
    for alpha in (2.0, 2.0, 3.0):
        a, b = torch.randn(100), torch.randn(100)
        out = replays.eager(axpy, a, b, alpha)
        torch.testing.assert_close(out, alpha * a + 2 * b)
    plans = [p for p in replays.plans.values() if type(p) is direct._Plan]
    assert len(plans) == 2  # alpha 2.0 (recorded once, replayed once) and alpha 3.0
    keys = list(replays.plans)
    assert keys[0][-2] == 2.0 and keys[1][-2] == 3.0 and keys[0][-1] == 0  # the options, then the stream
    assert len(stand_ins) == 2  # the one replay's two launches
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: False))
    out = replays.eager(axpy, torch.randn(100), torch.randn(100), 2.0)
    assert len(stand_ins) == 2  # a CPU tensor: the general path


def test_host_work_names_foreign_ops_and_launches():
    """flydsl.testing.host_work: allocations and views pass, any other torch op is named, launches are
    recorded by kernel name and not run, and flyc.launch is restored afterwards."""
    import flydsl.compiler as flyc
    from flydsl.testing import host_work

    def kernel_stub():
        pass

    real = flyc.launch

    def replayable(x):
        y = torch.empty_like(x)
        flyc.launch(kernel_stub, (1,), x, y)
        return y.view(-1)

    assert host_work(replayable, torch.ones(4)) == ([], ["kernel_stub"])
    foreign, launches = host_work(lambda x: x.add(1), torch.ones(4))
    assert launches == [] and any("add" in op for op in foreign)
    assert flyc.launch is real
