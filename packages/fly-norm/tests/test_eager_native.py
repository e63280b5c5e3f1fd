"""The eager plans' C path (eager_native.c) on the CPU, with stand-in tensors.

The C function only ever launches for CUDA tensors, so here it is set up with a stand-in tensor class and
stand-in torch functions, and a Python function in place of Triton's C launch: each test checks what the
real path depends on, the key it looks plans up under (it must be the Python path's key), the arguments
it launches with (the plan's layout filled with the call's values), every case it must leave to Python,
and that no call leaks a reference. Skipped where no C compiler or Python headers are at hand.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from importlib.resources import files

import pytest
import torch

from fly_norm import _eager as eager
from flydsl import native

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def built():
    m = native.load("fly_norm_eager_native", (files("fly_norm") / "eager_native.c").read_text())
    if m is None:
        pytest.skip("no C compiler or Python headers here")
    return m


@pytest.fixture
def mod(built):
    """The C module (each test installs its own stand-ins through ``setup``). The module is the one the
    process's plain norm calls use once a GPU call has built it: the live objects go back afterwards."""
    yield built
    from fly_norm import _eager as eager

    if eager.fast is built.call:
        eager.install(built)


class FakeTensor:
    """What the C gate reads of a tensor."""

    def __init__(self, shape, dtype=torch.bfloat16, ptr=1 << 20, cuda=True, device=0, contiguous=True,
                 requires_grad=False):  # fmt: skip
        self.shape, self.dtype, self.ptr, self.is_cuda = torch.Size(shape), dtype, ptr, cuda
        self.device, self.contiguous, self.requires_grad = device, contiguous, requires_grad

    def is_contiguous(self):
        return self.contiguous

    def get_device(self):
        return self.device

    def numel(self):
        return self.shape.numel()

    def data_ptr(self):
        return self.ptr


class FakeParameter(FakeTensor):
    pass


class Hooks:
    """Triton's launch hook chain (``calls``: the installed hooks)."""

    def __init__(self):
        self.calls = []


class Knobs:
    """``triton.knobs.runtime``'s launch hooks."""

    def __init__(self):
        self.launch_enter_hook, self.launch_exit_hook = Hooks(), Hooks()


class Env:
    """The stand-ins ``setup`` takes, with the state the tests change."""

    def __init__(self):
        self.off, self.grad, self.device, self.knobs = [], True, 0, Knobs()
        self.launches, self.allocated = [], []

    def empty_like(self, x):
        y = FakeTensor(tuple(x.shape), x.dtype, ptr=(9 << 20) + 16 * len(self.allocated))
        self.allocated.append(y)
        return y

    def install(self, mod):
        mod.setup(FakeTensor, FakeParameter, self.off, lambda: self.grad, lambda: self.device,
                  lambda dev: 1000 + dev, self.knobs, self.empty_like)  # fmt: skip

    def plan(self, block_m=2, layout=None, sig=None, packed=("packed",), pdl=1, tail=("t1", "t2")):
        def c_launch(*args):
            self.launches.append(args)

        layout = layout or (eager.ARG_X, eager.ARG_NONE, eager.ARG_W, eager.ARG_B, eager.ARG_Y, eager.ARG_M,
                            eager.ARG_N, eager.ARG_ZERO, eager.ARG_EPS)  # fmt: skip
        return (c_launch, 77, 0, pdl, packed, tail, 0, block_m, layout, sig)


PREFIX = (True, None, True)


def key(x, w=None, b=None, prefix=PREFIX):
    """The Python path's key (norm.eager_forward / softmax._eager_fwd) for these operands."""
    n = x.shape[-1]
    m = x.numel() // n
    vec = [None if v is None else (v.dtype, v.shape, v.data_ptr() & 15) for v in (w, b)]
    return (prefix, x.dtype, n, x.get_device(), m >> 31, x.data_ptr() & 15, *vec)


def test_launches_the_plan_with_its_layout_filled(mod):
    env = Env()
    env.install(mod)
    x = FakeTensor((5, 3, 96), ptr=(1 << 20) + 4)
    w = FakeParameter((96,), ptr=(2 << 20) + 2)
    plans = {key(x, w): env.plan(block_m=4)}
    y = mod.call(plans, PREFIX, x, w, None, 1e-6)
    assert y is env.allocated[0] and y.shape == x.shape
    (args,) = env.launches
    assert args[:13] == (4, 1, 1, 1000, 77, 0, 1, None, None, ("packed",), None, None, None)  # 15 rows / 4
    assert args[13:] == (x.ptr, None, w.ptr, None, y.ptr, 15, 96, 0, 1e-6, "t1", "t2")


def _served(mod):
    """An installed Env and the baseline call it serves: (env, x, w, plans)."""
    env = Env()
    env.install(mod)
    x = FakeTensor((4, 64))
    w = FakeTensor((64,), ptr=3 << 20)
    return env, x, w, {key(x, w): env.plan()}


def test_leaves_to_python_what_it_does_not_serve(mod):
    env, x, w, plans = _served(mod)
    assert mod.call(plans, PREFIX, x, w, None, 1e-6) is not None  # the baseline is served
    cases = {
        "no plan for this key": lambda: mod.call({}, PREFIX, x, w, None, 1e-6),
        "a plan of None": lambda: mod.call({key(x, w): None}, PREFIX, x, w, None, 1e-6),
        "another prefix": lambda: mod.call(plans, (False, None, True), x, w, None, 1e-6),
        "not a tensor": lambda: mod.call(plans, PREFIX, [1.0], w, None, 1e-6),
        "not on a GPU": lambda: mod.call(plans, PREFIX, FakeTensor((4, 64), cuda=False), w, None, 1e-6),
        "not contiguous": lambda: mod.call(plans, PREFIX, FakeTensor((4, 64), contiguous=False), w, None, 1e-6),
        "no dimensions": lambda: mod.call(plans, PREFIX, FakeTensor(()), w, None, 1e-6),
        "zero columns": lambda: mod.call(plans, PREFIX, FakeTensor((4, 0)), w, None, 1e-6),
        "x needs a gradient": lambda: mod.call(plans, PREFIX, FakeTensor((4, 64), requires_grad=True), w, None, 1e-6),
        "w needs a gradient": lambda: mod.call(plans, PREFIX, x, FakeTensor((64,), ptr=3 << 20, requires_grad=True),
                                               None, 1e-6),
        "w on another device": lambda: mod.call(plans, PREFIX, x, FakeTensor((64,), ptr=3 << 20, device=1), None,
                                                1e-6),
        "w not contiguous": lambda: mod.call(plans, PREFIX, x, FakeTensor((64,), ptr=3 << 20, contiguous=False),
                                             None, 1e-6),
        "w not a tensor": lambda: mod.call(plans, PREFIX, x, 3.0, None, 1e-6),
        "eps not a number": lambda: mod.call(plans, PREFIX, x, w, None, "eps"),
        "a layout with a residual": lambda: mod.call({key(x, w): env.plan(layout=(eager.ARG_X, eager.ARG_R))},
                                                     PREFIX, x, w, None, 1e-6),
    }  # fmt: skip
    for name, run in cases.items():
        assert run() is None, name
    env.off.append(True)  # general_path_only
    assert mod.call(plans, PREFIX, x, w, None, 1e-6) is None
    env.off.clear()
    env.device = 1  # another current device
    assert mod.call(plans, PREFIX, x, w, None, 1e-6) is None
    env.device = 0
    for hooks in (env.knobs.launch_enter_hook, env.knobs.launch_exit_hook):  # a profiler's hook
        hooks.calls.append(print)
        assert mod.call(plans, PREFIX, x, w, None, 1e-6) is None
        hooks.calls.clear()
    env.knobs.launch_enter_hook = print  # an older Triton's plain function as the hook
    assert mod.call(plans, PREFIX, x, w, None, 1e-6) is None
    env.knobs.launch_enter_hook = None
    env.grad = False
    needs_grad = FakeTensor((4, 64), requires_grad=True)
    assert mod.call({key(needs_grad, w): env.plan()}, PREFIX, needs_grad, w, None, 1e-6) is not None  # no_grad
    assert len(env.launches) == 2  # only the two calls it served launched


def test_softmax_key_and_a_launch_error_propagates(mod):
    env = Env()
    env.install(mod)
    x = FakeTensor((3, 1000), dtype=torch.float32)
    layout = (eager.ARG_X, eager.ARG_Y, eager.ARG_M, eager.ARG_N, eager.ARG_N, eager.ARG_N)
    plans = {key(x, prefix=None): env.plan(block_m=1, layout=layout)}
    y = mod.call(plans, None, x, None, None, None)
    assert env.launches[-1][13:] == (x.ptr, y.ptr, 3, 1000, 1000, 1000, "t1", "t2")

    def failing(*args):
        raise RuntimeError("launch failed")

    plans[key(x, prefix=None)] = (failing, *env.plan(block_m=1, layout=layout)[1:])
    with pytest.raises(RuntimeError, match="launch failed"):
        mod.call(plans, None, x, None, None, None)


def test_no_reference_leaks(mod):
    env, x, w, plans = _served(mod)
    miss = FakeTensor((4, 65))
    for _ in range(10):  # warm up (interned ints, the first allocations)
        mod.call(plans, PREFIX, x, w, None, 1e-6)
        mod.call(plans, PREFIX, miss, w, None, 1e-6)
    env.launches.clear()
    env.allocated.clear()
    before = [sys.getrefcount(o) for o in (x, w, plans, PREFIX, torch.bfloat16, x.shape, w.shape)]
    for _ in range(1000):
        mod.call(plans, PREFIX, x, w, None, 1e-6)
        mod.call(plans, PREFIX, miss, w, None, 1e-6)
        mod.call(plans, PREFIX, x, 3.0, None, 1e-6)
    env.launches.clear()
    env.allocated.clear()
    after = [sys.getrefcount(o) for o in (x, w, plans, PREFIX, torch.bfloat16, x.shape, w.shape)]
    assert after == before


# ------------------------------------------------------------------ the driver path

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)  # fmt: skip
_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
_READ = {"p": ctypes.c_uint64, "l": ctypes.c_int64, "L": ctypes.c_uint64, "i": ctypes.c_int32, "I": ctypes.c_uint32,
         "h": ctypes.c_int16, "H": ctypes.c_uint16, "b": ctypes.c_int8, "B": ctypes.c_uint8, "f": ctypes.c_float}


class Driver:
    """Stand-ins for cuLaunchKernel and cuCtxGetCurrent: each launch's configuration and parameters, read
    back by the plan's driver signature (and Triton's two scratch pointers after them)."""

    def __init__(self, mod, sig):
        self.sig, self.launches, self.ctx, self.error = sig, [], 1, 0

        def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            values = [ctypes.cast(params[i], ctypes.POINTER(_READ[t])).contents.value
                      for i, t in enumerate(t for t in self.sig + "pp" if t != "c")]  # fmt: skip
            self.launches.append((f, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
            return self.error

        def ctx(out):
            out[0] = self.ctx
            return 0

        self._keep = (_LAUNCH(launch), _CTX(ctx))  # alive while the module holds their addresses
        addr = [ctypes.cast(f, ctypes.c_void_p).value for f in self._keep]
        assert mod.driver(*addr) is True


@pytest.fixture
def no_driver(mod):
    yield
    mod.driver(0, 0)


@pytest.fixture
def driver_call(mod, no_driver):
    """(Env, Driver, x, w) set up for a plain call through the driver path."""
    env = Env()
    env.install(mod)
    return env, Driver(mod, SIG), FakeTensor((4, 64)), FakeTensor((64,), ptr=3 << 20)


# x, (a None pointer: constexpr), w, b, y, M, N, (zero: constexpr), eps; then the tail's two constexprs
SIG = "pcppplicfcc"


def test_driver_launch_packs_the_parameters_by_signature(mod, no_driver):
    env = Env()
    env.install(mod)
    drv = Driver(mod, SIG)
    x = FakeTensor((5, 3, 96), ptr=(1 << 20) + 4)
    w = FakeParameter((96,), ptr=(2 << 20) + 2)
    b = FakeTensor((96,), ptr=(3 << 20) + 6)
    plans = {key(x, w, b): env.plan(block_m=4, sig=SIG, packed=(8, 1, 4096), pdl=0)}
    y = mod.call(plans, PREFIX, x, w, b, 1e-6)
    assert y is env.allocated[0] and not env.launches  # Triton's launch function not called
    ((f, grid, block, shared, stream, values, extra),) = drv.launches
    assert (f, grid, block, shared, stream, extra) == (77, (4, 1, 1), (256, 1, 1), 4096, 1000, None)
    # x, w, b, y, M as i64, N as i32, eps as fp32, the two scratch pointers
    assert values == [x.ptr, w.ptr, b.ptr, y.ptr, 15, 96, pytest.approx(1e-6, rel=1e-7), 0, 0]


def test_driver_path_leaves_to_triton_what_it_does_not_take(mod, driver_call):
    env, drv, x, w = driver_call
    k = key(x, w)
    cases = {  # (cluster, cooperative and PDL launches have no signature: flydsl's test_driver_signature_*)
        "no signature": env.plan(sig=None, packed=(8, 1, 0), pdl=1),
        "metadata not (warps, ctas, shared)": env.plan(sig=SIG, packed=("packed",), pdl=0),
        "a signature of another length": env.plan(sig=SIG + "c", packed=(8, 1, 0), pdl=0),
        "a type it does not pack": env.plan(sig=SIG.replace("f", "d"), packed=(8, 1, 0), pdl=0),
        "a tail value it cannot pass": env.plan(sig=SIG[:-1] + "l", packed=(8, 1, 0), pdl=0, tail=("t1", "t2")),
    }  # fmt: skip
    for name, plan in cases.items():
        env.launches.clear()
        assert mod.call({k: plan}, PREFIX, x, w, None, 1e-6) is not None, name
        assert len(env.launches) == 1 and not drv.launches, name  # served by Triton's launch function
    wide, w_wide = FakeTensor((4, 200)), FakeTensor((200,), ptr=3 << 20)  # N = 200 as an int8 parameter
    env.launches.clear()
    plan = env.plan(sig=SIG.replace("pli", "plb"), packed=(8, 1, 0), pdl=0)
    assert mod.call({key(wide, w_wide): plan}, PREFIX, wide, w_wide, None, 1e-6) is not None
    assert len(env.launches) == 1 and not drv.launches
    drv.ctx = 0  # no current context on this thread
    env.launches.clear()
    assert mod.call({k: env.plan(sig=SIG, packed=(8, 1, 0), pdl=0)}, PREFIX, x, w, None, 1e-6) is not None
    assert len(env.launches) == 1 and not drv.launches
    drv.ctx = 1
    drv.sig = SIG[:-1] + "l"
    plan = env.plan(sig=drv.sig, packed=(8, 1, 0), pdl=0, tail=("t1", 7))  # a runtime value in the tail
    assert mod.call({k: plan}, PREFIX, x, w, None, 1e-6) is not None
    assert drv.launches[-1][5][-3:] == [7, 0, 0]


def test_driver_launch_error_raises(mod, driver_call):
    env, drv, x, w = driver_call
    drv.error = 700
    plans = {key(x, w): env.plan(sig=SIG, packed=(8, 1, 0), pdl=0)}
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        mod.call(plans, PREFIX, x, w, None, 1e-6)
    assert not env.launches


def test_driver_path_keeps_no_references(mod, driver_call):
    env, drv, x, w = driver_call
    plans = {key(x, w): env.plan(sig=SIG, packed=(8, 1, 0), pdl=0)}
    for _ in range(10):
        mod.call(plans, PREFIX, x, w, None, 1e-6)
    env.allocated.clear()
    drv.launches.clear()
    gc.collect()  # earlier tests' plans (in cycles with their Env) hold SIG until collected
    before = [sys.getrefcount(o) for o in (x, w, plans, PREFIX, torch.bfloat16, x.shape, w.shape, SIG)]
    for _ in range(1000):
        mod.call(plans, PREFIX, x, w, None, 1e-6)
    assert len(drv.launches) == 1000 and not env.launches
    env.allocated.clear()
    after = [sys.getrefcount(o) for o in (x, w, plans, PREFIX, torch.bfloat16, x.shape, w.shape, SIG)]
    assert after == before
