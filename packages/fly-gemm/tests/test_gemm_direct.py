"""Eager gemm calls replayed from their first call's recording (flydsl.direct), on a GPU: every replay
against the fp64 reference with fresh operands, fresh outputs, and the paths that must stay general.

(The recording and replay machinery itself is tested on the CPU in flydsl-runtime's test_direct.py.)
"""

from __future__ import annotations

import importlib

import pytest
import torch

from fly_gemm import gemm, gemm_ref, linear
from flydsl import env
from flydsl.testing import assert_rel_close

pytestmark = pytest.mark.gpu

_gemm = importlib.import_module("fly_gemm.gemm")  # the module (the package's ``gemm`` is the function)


def _plans():
    return [p for p in _gemm._REPLAYS.plans.values() if type(p).__name__ == "_Plan"]


def _operands(m, n, k, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g)
    if dtype == torch.int8:
        a, b = (t.mul(40).round().clamp(-127, 127) for t in (a, b))
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


# decode sizes (split K reduced in the kernel or by a second one), a CUDA-core-sized M, 8-bit with scales
CASES = [
    (1, 4096, 4096, torch.bfloat16, {}),
    (16, 14336, 4096, torch.bfloat16, {"activation": "silu"}),
    (5, 3000, 1000, torch.float16, {"bias": True}),
    (32, 4096, 4096, torch.float8_e4m3fn, {"scales": True}),
    (16, 2048, 1024, torch.int8, {"out_dtype": torch.int32}),
    # the persistent TMA kernel (device-side descriptors: the replay allocates their scratch memory)
    (256, 4096, 4096, torch.bfloat16, {"bias": True, "activation": "gelu", "scratch": True}),
    (300, 1024, 1000, torch.float16, {"scratch": True}),
    # staged (misaligned K: aligned zero-padded copies made by a kernel, then the aligned kernels)
    (64, 1024, 1000, torch.int8, {"out_dtype": torch.int32}),
    (57, 4352, 6777, torch.bfloat16, {}),
]


@pytest.mark.parametrize("m,n,k,dtype,opts", CASES)
def test_replays_match_the_reference(device, m, n, k, dtype, opts):
    _gemm._REPLAYS.clear()
    outs = []
    for seed in range(4):  # the first call records, the next ones replay
        a, b = _operands(m, n, k, dtype, device, seed)
        kw = {}
        if opts.get("bias"):
            kw["bias"] = torch.randn(n, device=device, dtype=torch.float16)
        if opts.get("activation"):
            kw["activation"] = opts["activation"]
        if opts.get("scales"):
            kw["scale_a"] = torch.rand(m, device=device) + 0.5
            kw["scale_b"] = torch.rand(n, device=device) + 0.5
        if "out_dtype" in opts:
            kw["out_dtype"] = opts["out_dtype"]
        c = gemm(a, b, **kw)
        ref = gemm_ref(a, b, **{k: v for k, v in kw.items() if k != "out_dtype"})
        if c.dtype == torch.int32:
            assert torch.equal(c.cpu().long(), ref.cpu().long())
        else:
            assert_rel_close(c, ref)
        outs.append(c)
    assert len({id(o) for o in outs}) == len(outs)  # a fresh output every call
    if opts.get("scratch") and env.get("FLYDSL_ZERO_SCRATCH"):
        # the zero-filled scratch is a torch op the replay would not repeat: the general path every call
        assert not _plans(), "a call with zero-filled scratch was replayed"
    else:
        assert _plans(), "the calls were not replayed"


def test_calls_that_stay_general(device):
    """An output given (or a config): the general path every time."""
    _gemm._REPLAYS.clear()
    a, b = _operands(4, 512, 512, torch.bfloat16, device, 1)
    out = torch.empty(4, 512, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        assert gemm(a, b, out=out) is out
    assert not _plans()


@pytest.mark.tma_store  # dW comes from the persistent TMA kernel without split-K: written by TMA stores alone
def test_training_steps_replay_forward_and_backward(device):
    """linear's forward with grad and its backward's GEMMs, replayed: gradients against fp64 each step."""
    _gemm._REPLAYS.clear()
    w = torch.randn(512, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(512, device=device, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        x = torch.randn(8, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
        y = linear(x, w, bias, activation="gelu")
        g = torch.randn_like(y)
        dx, dw, db = torch.autograd.grad(y, (x, w, bias), g)
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, bias))
        y64 = torch.nn.functional.gelu(x64 @ w64.t() + b64)
        rx, rw, rb = torch.autograd.grad(y64, (x64, w64, b64), g.double())
        assert_rel_close(y, y64.detach())
        assert_rel_close(dx, rx)
        assert_rel_close(dw, rw)
        assert_rel_close(db, rb)
    assert _plans()
