"""Training steps whose forward-with-grad and backward are replayed from their first call's recording
(flydsl.direct), on a GPU: every step against fp64 autograd with fresh inputs, at widths the row kernels
serve and at widths the split paths serve (their slots zeroed by a launch of the recorded call's own).

(The recording and replay machinery itself is tested on the CPU in flydsl-runtime's test_direct.py.)
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import fly_norm
from flydsl.testing import assert_rel_close

pytestmark = pytest.mark.gpu

# the modules (fly_norm.softmax is the function)
_MODULES = {op: importlib.import_module(f"fly_norm.{name}") for op, name in
            (("rms_norm", "rmsnorm"), ("layer_norm", "layernorm"), ("softmax", "softmax"))}  # fmt: skip


def _step(op, m, n, device, seed, residual=False):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()

    x, w, b = rand(m, n), rand(n), rand(n)
    r = rand(m, n) if residual else None
    dy = torch.randn(m, n, generator=g).to(device=device, dtype=torch.bfloat16)
    leaves = {"x": x, "w": w, "b": b, "r": r}
    if op == "rms_norm":
        out = fly_norm.rms_norm(x, w, 1e-6, residual=r)
        y = out[0] if residual else out
        used = ["x", "w"] + (["r"] if residual else [])
    elif op == "layer_norm":
        y = fly_norm.layer_norm(x, w, b, 1e-5)
        used = ["x", "w", "b"]
    else:
        y = fly_norm.softmax(x)
        used = ["x"]
    grads = torch.autograd.grad(y, [leaves[k] for k in used], dy)

    d = {k: v.detach().double().requires_grad_() for k, v in leaves.items() if v is not None}
    if op == "rms_norm":
        h = d["x"] + d["r"] if residual else d["x"]
        ref = F.rms_norm(h, (n,), d["w"], 1e-6)
    elif op == "layer_norm":
        ref = F.layer_norm(d["x"], (n,), d["w"], d["b"], 1e-5)
    else:
        ref = torch.softmax(d["x"], -1)
    ref_grads = torch.autograd.grad(ref, [d[k] for k in used], dy.double())
    assert_rel_close(y, ref.detach())
    for got, want in zip(grads, ref_grads, strict=True):
        assert_rel_close(got, want)


def _replayed(op) -> int:
    mod = _MODULES[op]
    return sum(type(p).__name__ == "_Plan" for t in (mod._FWD_REPLAYS, mod._BWD_REPLAYS) for p in t.plans.values())


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
@pytest.mark.parametrize("m,n", [(4, 4096), (300, 1000), (1, 128), (64, 8192)])
def test_replayed_steps_match_fp64(device, op, m, n):
    for seed in range(4):  # the first step records, the next ones replay
        _step(op, m, n, device, seed)
    assert _replayed(op) >= 2, "neither direction was replayed"


def test_fused_residual_steps(device):
    for seed in range(3):
        _step("rms_norm", 8, 2048, device, seed, residual=True)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
@pytest.mark.parametrize("m,n", [(2, 131072), (11, 87371), (69, 91776), (21, 17045)])
def test_wide_rows_replay_and_stay_right(device, op, m, n):
    """Rows wide enough for the split paths (staged, tiled, slices, resident) are replayed too: a recorded call
    takes fresh slots zeroed by a launch of its own, not the pools' (lent for one call), and every step's
    answers stay right."""
    mod = _MODULES[op]
    mod._FWD_REPLAYS.clear()
    mod._BWD_REPLAYS.clear()
    for seed in range(4):
        _step(op, m, n, device, seed)
    for table in (mod._FWD_REPLAYS, mod._BWD_REPLAYS):
        assert any(type(p).__name__ == "_Plan" for p in table.plans.values()), f"{table.name}: not replayed"


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
@pytest.mark.parametrize("m,n", [(2, 131072), (55, 68374), (7, 40000)])
def test_wide_inference_calls_replay_and_stay_right(device, op, m, n):
    """Inference calls the cached launch plans do not take (rows for the split paths) replay their first
    call's launches too, each answer against fp64 on fresh inputs."""
    mod = _MODULES[op]
    mod._FWD_REPLAYS.clear()
    for seed in range(4):  # the first call records, the next ones replay
        g = torch.Generator(device="cpu").manual_seed(seed)
        x, w, b = (torch.randn(*s, generator=g).to(device=device, dtype=torch.bfloat16) for s in ((m, n), (n,), (n,)))
        xd, wd, bd = x.double(), w.double(), b.double()
        if op == "rms_norm":
            y, ref = fly_norm.rms_norm(x, w, 1e-6), F.rms_norm(xd, (n,), wd, 1e-6)
        elif op == "layer_norm":
            y, ref = fly_norm.layer_norm(x, w, b, 1e-5), F.layer_norm(xd, (n,), wd, bd, 1e-5)
        else:
            y, ref = fly_norm.softmax(x), torch.softmax(xd, -1)
        assert_rel_close(y, ref)
    assert any(type(p).__name__ == "_Plan" for p in mod._FWD_REPLAYS.plans.values()), "not replayed"
