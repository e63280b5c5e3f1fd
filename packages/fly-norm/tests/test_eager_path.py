"""The eager fast path of rms_norm / layer_norm (cached launch plans for small inference calls; GPU only)."""

from __future__ import annotations

import pytest
import torch
from norm_helpers import randn

from fly_norm import _norm_host as shared
from fly_norm import layer_norm, rms_norm
from fly_norm.reference import layer_norm_ref, rms_norm_ref
from fly_norm.rmsnorm import _fwd_config
from flydsl.testing import assert_rel_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("wdtype", ["same", "fp32", None])
def test_plans_serve_every_batch_size_and_operand_mix(dtype, wdtype):
    n = 4096
    w = None if wdtype is None else randn(n, dtype=dtype if wdtype == "same" else torch.float32, device="cuda", seed=1)
    b = None if wdtype is None else randn(n, dtype=w.dtype, device="cuda", seed=2)
    for m in (1, 3, 64, 1000):  # one plan a key: M is a runtime value
        x = randn(m, n, dtype=dtype, device="cuda", seed=m) + 0.25
        assert_rel_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
        assert_rel_close(layer_norm(x, w, b, 1e-5), layer_norm_ref(x, w, b, 1e-5))
    keys = [k for k in shared._EAGER_PLANS if k[1] is dtype and k[2] == n]
    assert len({k[0] for k in keys}) == 2  # both norms planned


def test_plans_keep_residual_offsets_and_odd_widths_apart():
    for n in (1, 7, 255, 4097, 16383):
        x = randn(2, 3, n, dtype=torch.bfloat16, device="cuda", scale=2.0)
        r = randn(2, 3, n, dtype=torch.float32, device="cuda", seed=1)
        w = randn(n, dtype=torch.bfloat16, device="cuda", seed=2)
        y, h = rms_norm(x, w, 1e-6, residual=r, weight_offset=1.0)
        ry, rh = rms_norm_ref(x, w, 1e-6, r, 1.0)
        assert_rel_close(y, ry)
        assert_rel_close(h, rh)
        assert h.dtype == torch.float32 and y.shape == x.shape
    # a weight view at an odd offset is not 16-byte aligned: its own plan, still right
    n = 4096
    wbase = randn(n + 1, dtype=torch.bfloat16, device="cuda", seed=3)
    x = randn(5, n, dtype=torch.bfloat16, device="cuda")
    for w in (wbase[:n], wbase[1:]):
        assert_rel_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    xbase = randn(5 * n + 1, dtype=torch.bfloat16, device="cuda")
    xo = xbase[1:].view(5, n)  # misaligned rows
    assert_rel_close(layer_norm(xo, None, None, 1e-5), layer_norm_ref(xo, None, None, 1e-5))


def test_plans_keep_zero_and_nonzero_weight_offsets_apart():
    # A zero offset goes to the kernel as None (no add compiled in): its plan must not serve other offsets.
    x = randn(3, 4096, dtype=torch.bfloat16, device="cuda")
    w = randn(4096, dtype=torch.bfloat16, device="cuda", seed=1)
    b = randn(4096, dtype=torch.bfloat16, device="cuda", seed=2)
    for offset in (0.0, 1.0, 0.0, 0.5, 1.0):
        assert_rel_close(rms_norm(x, w, 1e-6, weight_offset=offset), rms_norm_ref(x, w, 1e-6, None, offset))
        assert_rel_close(layer_norm(x, w, b, 1e-5, weight_offset=offset),
                         layer_norm_ref(x, w, b, 1e-5, None, offset))  # fmt: skip


def test_calls_the_plan_does_not_cover_take_the_general_path():
    n = 4096
    x = randn(4, n, dtype=torch.bfloat16, device="cuda")
    w = randn(n, dtype=torch.bfloat16, device="cuda", seed=1)

    def fast(x, w):
        return shared.eager_forward(x, w, None, None, 1e-6, 0.0, True, _fwd_config)

    assert fast(x, w) is not None
    xg = x.clone().requires_grad_()
    assert fast(xg, w) is None  # autograd records it
    assert fast(x[:, : n // 2], w[: n // 2]) is None  # strided rows
    assert fast(x, w[:100]) is None  # a bad weight: the general path ...
    with pytest.raises(Exception, match="weight"):
        rms_norm(x, w[:100])  # ... which names it
    wide = randn(2, 40000, dtype=torch.bfloat16, device="cuda")
    assert fast(wide, None) is None  # split path widths
    y = rms_norm(xg, w)
    assert y.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_softmax_plans(dtype):
    from fly_norm import softmax
    from fly_norm.reference import softmax_ref
    from fly_norm.softmax import _EAGER_PLANS, _eager_fwd

    for n in (1, 7, 1000, 4096, 16383):
        for m in (1, 5, 64):
            x = randn(m, 2, n, dtype=dtype, device="cuda", scale=3.0, seed=m)
            assert_rel_close(softmax(x), softmax_ref(x))
            assert_rel_close(softmax(x, dim=2), softmax_ref(x))
    assert any(k[1] is dtype and k[2] == 4096 for k in _EAGER_PLANS)
    x = randn(8, 4096, dtype=dtype, device="cuda")
    assert _eager_fwd(x[:, :100]) is None  # strided rows: the general path
    assert_rel_close(softmax(x, dim=0), softmax_ref(x, dim=0))  # not the last dim: the general path


def test_module_weights_take_the_plan_under_no_grad():
    """nn.Parameter weights (FlyRMSNorm's, FlyLayerNorm's) are plain tensors to a plan when nothing records a
    gradient; with autograd recording, the call goes through the op."""
    from fly_norm import FlyLayerNorm, FlyRMSNorm

    x = randn(4, 4096, dtype=torch.bfloat16, device="cuda")
    rms = FlyRMSNorm(4096, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    ln = FlyLayerNorm(4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        rms.weight.copy_(randn(4096, dtype=torch.bfloat16, device="cuda", seed=5))
        assert shared.eager_forward(x, rms.weight, None, None, 1e-6, 0.0, True, _fwd_config) is not None
        assert_rel_close(rms(x), rms_norm_ref(x, rms.weight, 1e-6))
        assert_rel_close(ln(x), layer_norm_ref(x, ln.weight, ln.bias, 1e-5))
    assert shared.eager_forward(x, rms.weight, None, None, 1e-6, 0.0, True, _fwd_config) is None
    assert rms(x).requires_grad


def test_a_launch_hook_sees_every_launch():
    """A profiler's launch hook is called on Triton's path only: with one installed, plans are not used."""
    import triton

    from fly_norm import softmax

    x = randn(4, 4096, dtype=torch.bfloat16, device="cuda")
    w = randn(4096, dtype=torch.bfloat16, device="cuda", seed=1)
    rms_norm(x, w)
    softmax(x)  # plans exist
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(seen.append)
    try:
        assert shared.eager_forward(x, w, None, None, 1e-6, 0.0, True, _fwd_config) is None
        assert_rel_close(rms_norm(x, w), rms_norm_ref(x, w, 1e-6))
        softmax(x)
    finally:
        hooks.remove(seen.append)
    assert len(seen) == 2


@pytest.fixture
def c_path():
    """eager_native.c, built by the first call on a GPU."""
    from fly_norm import _eager as eager
    from fly_norm import softmax

    softmax(torch.zeros(1, 64, device="cuda"))  # the first call builds the C path
    if eager.fast is eager._no_fast:
        pytest.skip("eager_native.c could not be built here")
    return eager.fast.__self__


@pytest.mark.host_refs
def test_plain_calls_take_the_c_path_and_keep_no_references(c_path):
    """With a C compiler at hand (as Triton needs one), plain calls go through eager_native.c: right results,
    the same plans as the Python path, no reference or memory kept per call."""
    import sys

    from fly_norm import _eager as eager
    from fly_norm import softmax

    x = randn(3, 4096, dtype=torch.bfloat16, device="cuda")
    w = randn(4096, dtype=torch.bfloat16, device="cuda", seed=1)
    b = randn(4096, dtype=torch.bfloat16, device="cuda", seed=2)
    rms_norm(x, w)
    softmax(x)
    assert eager.fast is not eager._first_fast
    if eager.fast is eager._no_fast:
        pytest.skip("eager_native.c could not be built here")
    assert eager.fast(shared._EAGER_PLANS, shared._PLAIN_PREFIX[True], x, w, None, 1e-6) is not None
    for _ in range(3):
        assert_rel_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
        assert_rel_close(layer_norm(x, w, b, 1e-5), layer_norm_ref(x, w, b, 1e-5))
    torch.cuda.synchronize()
    before = ([sys.getrefcount(t) for t in (x, w, b)], torch.cuda.memory_allocated())
    for _ in range(500):
        rms_norm(x, w, 1e-6)
        layer_norm(x, w, b, 1e-5)
        softmax(x)
    torch.cuda.synchronize()
    assert ([sys.getrefcount(t) for t in (x, w, b)], torch.cuda.memory_allocated()) == before


@pytest.mark.graph
def test_driver_path_launches_on_the_current_stream(c_path):
    """The C path launches through the driver on torch's current stream: calls captured in a CUDA graph on a
    side stream replay with the graph (a launch on any other stream would fail the capture or miss the
    replay), and their results follow the input's new values."""
    from fly_norm import _eager as eager
    from fly_norm import softmax
    from fly_norm.reference import softmax_ref

    x = randn(5, 4096, dtype=torch.bfloat16, device="cuda")
    w = randn(4096, dtype=torch.bfloat16, device="cuda", seed=1)
    b = randn(4096, dtype=torch.bfloat16, device="cuda", seed=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_norm(x, w, 1e-6), layer_norm(x, w, b, 1e-5), softmax(x)  # the plans, made on this stream
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if eager.fast is eager._no_fast:
        pytest.skip("eager_native.c could not be built here")
    assert eager.fast.__self__.driver() is True  # libcuda's launch found
    assert all(p is None or p[9] for p in shared._EAGER_PLANS.values())  # plans carry their driver signature
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1, y2, y3 = rms_norm(x, w, 1e-6), layer_norm(x, w, b, 1e-5), softmax(x)
    for seed in (7, 8):
        x.copy_(randn(5, 4096, dtype=torch.bfloat16, device="cuda", seed=seed, scale=2.0))
        for y in (y1, y2, y3):
            y.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(y1, rms_norm_ref(x, w, 1e-6))
        assert_rel_close(y2, layer_norm_ref(x, w, b, 1e-5))
        assert_rel_close(y3, softmax_ref(x))
