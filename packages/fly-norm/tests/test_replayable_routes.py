"""Every route of the autograd calls can be replayed (flydsl.direct), checked on the CPU: a fake H200 behind
flydsl.arch.current, kernel launches recorded but not run, and each forward-with-grad and backward body run as
flydsl.direct records it (under its ``_Watch`` dispatch mode, the launches collected). A body that makes a
torch op other than an allocation or a view, or declines, would take the general path on every call on a
GPU: 0.3-0.9 ms of host a backward call on the H200's sweep shapes (wide rows: the split kernels' zeroed or
pooled slots), against ~0.1-0.2 ms replayed. The recording must also give a plan (every launch's pointers
found among the call's inputs and allocations, the result rebuilt from them).

The shapes: the H200 sweep's (seed 20261202) backward rows of each route, and a tuned one for contrast.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import fly_norm
import flydsl.arch
import flydsl.compiler as flyc
from flydsl import direct
from flydsl.arch import SM90

H200 = dataclasses.replace(SM90, device_name="NVIDIA H200", sm_count=132)
_MODULES = {op: importlib.import_module(f"fly_norm.{name}") for op, name in
            (("rms_norm", "rmsnorm"), ("layer_norm", "layernorm"), ("softmax", "softmax"))}  # fmt: skip
_SPLIT_KERNELS = {"norm_fwd_split_kernel", "norm_fwd_staged_kernel", "norm_bwd_split_kernel", "norm_bwd_tiled_kernel",
                  "norm_bwd_staged_kernel", "softmax_fwd_split_kernel", "softmax_bwd_split_kernel",
                  "softmax_fwd_resident_kernel"}  # fmt: skip
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))


class _Recorder:
    """Stands in for a module's ``direct.Replays`` table: runs the body as :func:`flydsl.direct._record` does
    (its dispatch mode, the launches collected) and keeps what the recording saw and the plan it gives."""

    def __init__(self, direction: str, seen: list):
        self.direction, self.seen = direction, seen

    def eager(self, fn, *args):
        launches: list = []
        watch = direct._Watch(launches)
        flyc._RECORDING.launches, flyc._RECORDING.declined = launches, False
        try:
            with watch:
                result = fn(*args)
        finally:
            flyc._RECORDING.launches = None
        declined, flyc._RECORDING.declined = flyc._RECORDING.declined, False
        plan = direct._plan(args, result, watch.allocations, launches) if launches else None
        self.seen.append((self.direction, [str(f) for f in watch.foreign], declined,
                          [_name(k) for k, *_ in launches], plan))  # fmt: skip
        return result


@pytest.fixture
def recorded(monkeypatch):
    """The fake H200 (launches appended to a recording's list, not run; four programs an SM), each module's
    replay tables replaced by recorders; returns the list of what each recorded body did."""
    seen: list = []

    def launch(kernel, grid, *args, launch_pdl=False, **meta):
        if flyc._RECORDING.launches is not None:
            flyc._RECORDING.launches.append((kernel, grid, args, meta, launch_pdl))

    monkeypatch.setattr(flydsl.arch, "current", lambda device=None: H200)
    monkeypatch.setattr(flyc, "launch", launch)
    monkeypatch.setattr(flyc, "programs_per_sm", lambda kernel, *a, **meta: 4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # pdl_options on a CPU build
    # binding compiles for a GPU: any C launch serves the plan's bookkeeping here
    monkeypatch.setattr(direct, "_bind_direct", lambda kernel, args, meta: (None, None, False, False, None, (), 0, 0))
    for mod in _MODULES.values():
        monkeypatch.setattr(mod, "_FWD_REPLAYS", _Recorder("forward", seen))
        monkeypatch.setattr(mod, "_BWD_REPLAYS", _Recorder("backward", seen))
    return seen


# (op, M, N, dtype, the backward's first kernel on the H200: its route)
SHAPES = [
    ("rms_norm", 4096, 4096, "bf16", "norm_bwd_kernel"),  # tuned: the row kernel
    ("rms_norm", 1087, 510, "bf16", "norm_bwd_kernel"),
    ("rms_norm", 5, 256, "bf16", "norm_bwd_kernel"),
    ("rms_norm", 2, 277, "bf16", "norm_bwd_kernel"),
    ("rms_norm", 8, 16384, "bf16", "norm_bwd_kernel"),  # the pipelined row kernel
    ("rms_norm", 11, 87371, "bf16", "zero_slots_kernel"),  # odd width: the tiled split
    ("rms_norm", 49, 12660, "fp16", "zero_slots_kernel"),  # fp16: the tiled split
    ("rms_norm", 69, 91776, "bf16", "zero_slots_kernel"),  # bf16 word-aligned: the staged split (pooled slots)
    ("layer_norm", 21, 17045, "bf16", "zero_slots_kernel"),
    ("layer_norm", 36, 22576, "bf16", "zero_slots_kernel"),  # the staged split
    ("layer_norm", 69, 44057, "bf16", "zero_slots_kernel"),  # the split forward too
    ("layer_norm", 230, 1057, "bf16", "norm_bwd_kernel"),
    ("softmax", 57, 26979, "bf16", "zero_slots_kernel"),
    ("softmax", 7, 576, "bf16", "softmax_bwd_kernel"),
    ("softmax", 8, 65536, "bf16", "zero_slots_kernel"),  # the resident forward
]


def _call(op, x, params):
    if op == "rms_norm":
        return fly_norm.rms_norm(x, params[0], 1e-6)
    if op == "layer_norm":
        return fly_norm.layer_norm(x, params[0], params[1], 1e-5)
    return fly_norm.softmax(x, -1)


@pytest.mark.parametrize("op,m,n,dtype,first", SHAPES, ids=[f"{s[0]}-{s[1]}x{s[2]}-{s[3]}" for s in SHAPES])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_autograd_bodies_record_a_replayable_plan(recorded, op, m, n, dtype, first):
    dt = _DTYPES[dtype]
    x = torch.randn(m, n, dtype=dt).requires_grad_()
    params = [torch.randn(n, dtype=dt).requires_grad_() for _ in range({"rms_norm": 1, "layer_norm": 2}.get(op, 0))]
    y = _call(op, x, params)
    torch.autograd.grad(y, [x, *params], torch.randn(m, n, dtype=dt))
    assert [d for d, *_ in recorded] == ["forward", "backward"]
    for direction, foreign, declined, kernels, plan in recorded:
        assert not foreign and not declined, (direction, foreign, declined, kernels)
        assert kernels and plan is not None, (direction, kernels)
        assert len(plan.launches) == len(kernels)
        if kernels[0] == "zero_slots_kernel":  # the split kernel's fresh slots, zeroed just before it
            assert len(kernels) >= 2 and kernels[1] in _SPLIT_KERNELS, kernels
    backward = recorded[1][3]
    assert backward[0] == first, backward
