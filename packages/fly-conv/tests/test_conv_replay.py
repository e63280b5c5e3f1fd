"""Replayed eager calls (flydsl.direct): the routing into them (CPU) and, on a GPU, that calls replayed from
the first call's recording (the forward, the training step's forward and its backward kernels) match the
fp64 reference on fresh inputs of the same layouts.

The poisoning fill of the other suites is a torch op a replay would not redo (a recording that sees it
makes no plan), so these tests allocate plainly; every call is still checked against the reference.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from conv_helpers import rand, weight

from fly_conv import FlyConv2d, conv, conv_ref
from fly_conv.autotune import direct_kernel
from flydsl import direct
from flydsl.errors import ArgumentError
from flydsl.testing import assert_rel_close, host_work, tolerance

BF16, F16 = torch.bfloat16, torch.float16
conv_mod = importlib.import_module("fly_conv.conv")


def _channels_last(t):
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def test_geometry_keys():
    """Only exact ints, names and int sequences key a replay: a float or a bool would hash as the int it
    equals and skip the general path's checks."""
    key = conv_mod._geometry_key
    assert key(2) == 2 and key("same") == "same" and key((1, 2)) == (1, 2) and key([1, 2]) == (1, 2)
    assert key(1.0) is None and key((1, 2.0)) is None and key((True, 1)) is None and key(True) is None


def test_plain_call_routing_keeps_the_checks(device):
    """Calls that a replay could key (list geometry, Parameters) give the general path's results and errors."""
    x = rand(2, 4, 7, 6, dtype=F16, device=device)
    w = weight(6, 4, (3, 3), dtype=F16, device=device)
    b = rand(6, dtype=F16, device=device, seed=2)
    ref = conv_ref(x, w, b, padding=1)
    assert_rel_close(conv(x, w, b, [1, 1], [1, 1]), ref, tol=tolerance(F16))
    with torch.no_grad():
        assert_rel_close(conv(x, torch.nn.Parameter(w), b, padding=1), ref, tol=tolerance(F16))
    with pytest.raises(ArgumentError, match="stride"):
        conv(x, w, b, stride=1.0, padding=1)
    with pytest.raises(ArgumentError, match="groups"):
        conv(x, w, b, padding=1, groups=True)


# (name, x [N, C, *spatial], channels-last x, weight [K, C / groups, *kernel], kwargs): the layouts whose
# whole device work is allocations and flydsl launches (the copies to channels-last and the weight packs run
# as kernels), so that a replay serves them
_LAYERS = [
    ("3x3-cl", (4, 32, 14, 14), True, (48, 32, 3, 3), dict(padding=1)),
    ("3x3-nchw", (4, 32, 14, 14), False, (48, 32, 3, 3), dict(padding=1, activation="relu")),
    ("3x3-s2-cl", (4, 32, 15, 15), True, (32, 32, 3, 3), dict(stride=2, padding=1)),
    ("1x1-cl", (4, 64, 14, 14), True, (96, 64, 1, 1), dict()),
    ("1x1-nchw", (4, 64, 14, 14), False, (96, 64, 1, 1), dict()),
    ("dw3x3-cl", (4, 64, 14, 14), True, (64, 1, 3, 3), dict(padding=1, groups=64)),
    ("grouped-cl", (4, 64, 14, 14), True, (64, 8, 3, 3), dict(padding=1, groups=8)),
    ("1d-k7", (4, 32, 100), False, (32, 32, 7), dict(padding=3)),
    ("3d-cl", (2, 16, 4, 8, 8), True, (16, 16, 3, 3, 3), dict(padding=1)),
]


def _layer_inputs(shape, cl, w_shape, seed, device):
    x = rand(*shape, dtype=BF16, device=device, seed=seed)
    x = _channels_last(x) if cl else x
    fan_in = w_shape[1] * int(torch.tensor(w_shape[2:]).prod())
    w = rand(*w_shape, dtype=BF16, device=device, seed=seed + 100, scale=fan_in**-0.5)
    b = rand(w_shape[0], dtype=BF16, device=device, seed=seed + 200)
    return x, w, b


@pytest.mark.parametrize("layer", _LAYERS, ids=lambda c: c[0])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_common_layouts_are_replayable(layer):
    """The forward of every common layout, and the training step's forward body and backward kernels (the
    bias gradient's too), do nothing on the device but allocate, take views and launch flydsl kernels (the
    channels-last copies, the weight packs and the split sums are kernels): the calls flydsl.direct replays
    on a GPU."""
    _, shape, cl, w_shape, kw = layer
    x, w, b = _layer_inputs(shape, cl, w_shape, 0, "cpu")
    foreign, launches = host_work(conv, x, w, b, **kw)
    assert not foreign and launches, (foreign, launches)
    if not cl and math.prod(w_shape[2:]) > 1:  # NC* x: copied to channels-last by the shared copy kernel
        assert "_copy_padded_kernel" in launches
    # the training step's replayed bodies: the forward (no activation: torch applies it) and both gradients
    rank = len(w_shape) - 2
    stride = conv_mod._per_dim("stride", kw.get("stride", 1), rank, 1)
    pad = conv_mod._per_dim("padding", kw.get("padding", 0), rank, 0)
    dil, groups = (1,) * rank, kw.get("groups", 1)
    foreign, launches = host_work(conv_mod._conv_forward, x, w, b, stride, pad, pad, dil, groups, 0,
                                     cl)  # fmt: skip
    assert not foreign and launches, (foreign, launches)
    y_shape = (shape[0], w_shape[0], *conv_mod._out_size(shape[2:], w_shape[2:], stride, pad, pad, dil))
    for g in (
        rand(*y_shape, dtype=BF16, device="cpu", seed=9),
        _channels_last(rand(*y_shape, dtype=BF16, device="cpu")),
    ):
        foreign, launches = host_work(conv_mod._eager_grads, g, x, w, stride, pad, dil, groups, True,
                                         True, BF16, cl)  # fmt: skip
        assert not foreign, foreign
        assert "_channel_sum_kernel" in launches and "_sum_splits_kernel" in launches  # the bias gradient
        # the input gradient: the direct kernel's at stride 1 with narrow groups, else the implicit GEMM's
        direct = all(v == 1 for v in stride) and direct_kernel(w_shape[0], w_shape[1] * groups, groups, BF16)
        depthwise = groups > 1 and w_shape[1] == 1
        assert ("_conv_depthwise_wgrad_kernel" if depthwise else "_conv_wgrad_kernel") in launches
        assert ("_conv_direct_kernel" if direct else "_conv_implicit_kernel") in launches


def _count_replays(monkeypatch):
    replayed = []
    real = direct._Plan.replay
    monkeypatch.setattr(direct._Plan, "replay", lambda plan, args: replayed.append(1) or real(plan, args))
    return replayed


@pytest.mark.gpu
@pytest.mark.parametrize("layer", _LAYERS, ids=lambda c: c[0])
def test_gpu_replayed_calls_match_the_reference(layer, device, monkeypatch):
    """A plain eager call of each common layout is replayed after the first: every replay, on fresh inputs,
    matches the reference and returns a fresh output in the input's memory format."""
    _, shape, cl, w_shape, kw = layer
    replayed = _count_replays(monkeypatch)
    conv_mod._REPLAYS.clear()
    outs = []
    for seed in range(4):  # the first call records, the next ones replay
        x, w, b = _layer_inputs(shape, cl, w_shape, seed, device)
        y = conv(x, w, b, **kw)
        assert_rel_close(y, conv_ref(x, w, b, **kw), tol=tolerance(BF16))
        assert y.movedim(1, -1).is_contiguous() == cl
        outs.append(y)
    assert len({o.data_ptr() for o in outs}) == len(outs)
    assert len(replayed) == 3, "the calls after the first were not replayed"


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [_LAYERS[0], _LAYERS[1], _LAYERS[3], _LAYERS[6]], ids=lambda c: c[0])
def test_gpu_replayed_training_steps_match_the_reference(layer, device, monkeypatch):
    """Under autograd the forward's body and the backward's kernels (input and weight gradients, the split
    sum included) are replayed after the first step; every step's output and gradients match fp64 autograd."""
    _, shape, cl, w_shape, kw = layer
    replayed = _count_replays(monkeypatch)
    conv_mod._FWD_REPLAYS.clear()
    conv_mod._BWD_REPLAYS.clear()
    fn = (F.conv1d, F.conv2d, F.conv3d)[len(w_shape) - 3]
    ref_kw = {k: v for k, v in kw.items() if k != "activation"}
    for seed in range(3):
        leaves = [t.requires_grad_(True) for t in _layer_inputs(shape, cl, w_shape, seed, device)]
        y = conv(*leaves, **kw)
        dy = rand(*y.shape, dtype=BF16, device=device, seed=seed + 300)
        y.backward(dy)
        refs = [t.detach().double().requires_grad_(True) for t in leaves]
        y_ref = fn(*refs, **ref_kw)
        if kw.get("activation") == "relu":
            y_ref = y_ref.relu()
        y_ref.backward(dy.double())
        assert_rel_close(y, y_ref, tol=tolerance(BF16))
        for name, t, r in zip(("dx", "dweight", "dbias"), leaves, refs, strict=True):
            assert_rel_close(t.grad, r.grad, tol=2e-2, name=name)
    assert len(replayed) == 4, "the steps after the first were not replayed (forward and backward)"


@pytest.mark.gpu
def test_gpu_module_inference_is_replayed(device, monkeypatch):
    """A FlyConv2d under no_grad (Parameters, tuple geometry) takes the replay."""
    replayed = _count_replays(monkeypatch)
    conv_mod._REPLAYS.clear()
    m = FlyConv2d(32, 32, 3, padding=1, device=device, dtype=BF16)
    with torch.no_grad():
        for seed in range(3):
            x = _channels_last(rand(2, 32, 9, 9, dtype=BF16, device=device, seed=seed))
            assert_rel_close(m(x), conv_ref(x, m.weight, m.bias, padding=1), tol=tolerance(BF16))
    assert len(replayed) == 2


def test_traced_plain_call_takes_the_op(device):
    """A plain call under torch.compile (fullgraph) passes the replay routing and traces the custom op."""
    backend = "aot_eager" if device.type == "cpu" else "inductor"
    x = _channels_last(rand(2, 4, 7, 6, dtype=F16, device=device))
    w = weight(6, 4, (3, 3), dtype=F16, device=device)
    b = rand(6, dtype=F16, device=device, seed=2)

    @torch.compile(fullgraph=True, backend=backend)
    def f(x, w, b):
        return conv(x, w, b, stride=(1, 2), padding=[1, 1], activation="relu")

    assert_rel_close(f(x, w, b), conv_ref(x, w, b, stride=(1, 2), padding=1, activation="relu"), tol=tolerance(F16))
