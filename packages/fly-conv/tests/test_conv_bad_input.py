"""Bad input classes of fly-conv's public API, one test a class (the table of issue 40 cites these names),
each parametrized over the entry points: ``conv``, ``conv1d`` / ``conv2d`` / ``conv3d`` and the ``FlyConv*d``
modules. test_conv_errors.py holds the long list of named errors, test_conv_fwd.py the layouts, zero sizes and
meta tensors; here each class gets one check an entry point. Outputs start as NaN (the ``poisoned`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from conv_helpers import rand, weight

from fly_conv import FlyConv1d, FlyConv2d, FlyConv3d, conv, conv1d, conv2d, conv3d, conv_ref
from flydsl.errors import DeviceError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, tolerance

F16 = torch.float16
FNS = {1: conv1d, 2: conv2d, 3: conv3d}
MODULES = {1: FlyConv1d, 2: FlyConv2d, 3: FlyConv3d}
# (entry point, rank): conv itself takes every rank from the weight
OPS = [("conv", 2), ("conv1d", 1), ("conv2d", 2), ("conv3d", 3), ("module", 2)]
IDS = [f"{op}-{rank}d" for op, rank in OPS]


def _call(op, rank, x, w, b=None, **kw):
    """``op`` on x with weight w (and bias b); the module gets w and b as its parameters."""
    if op == "conv":
        return conv(x, w, b, **kw)
    if op != "module":
        return FNS[rank](x, w, b, **kw)
    m = MODULES[rank](w.shape[1] * kw.get("groups", 1), w.shape[0], tuple(w.shape[2:]), bias=b is not None,
                      device=w.device, dtype=w.dtype, **kw)  # fmt: skip
    with torch.no_grad():
        m.weight.copy_(w)
        if b is not None:
            m.bias.copy_(b)
    return m(x)


def _xw(rank, n=2, c=4, k=6, size=5, ks=3, *, dtype=F16, device="cpu"):
    return rand(n, c, *([size] * rank), dtype=dtype, device=device), weight(k, c, (ks,) * rank, dtype=dtype,
                                                                            device=device)  # fmt: skip


# ---------------------------------------------------------------- dtype


@pytest.mark.parametrize("op,rank", OPS, ids=IDS)
def test_dtype(op, rank):
    """An int input and a weight of another dtype are named first (more: test_conv_errors)."""
    x, w = _xw(rank)
    with pytest.raises(DTypeError, match=r"^x: expected dtype fp16 or bf16 or fp32"):
        _call(op, rank, x.to(torch.int32), w)
    with pytest.raises(DTypeError, match=r"^weight: expected dtype fp16 \(x's\), got fp32"):
        _call(op, rank, x, w.float())


# ---------------------------------------------------------------- device


@pytest.mark.parametrize("op,rank", OPS, ids=IDS)
def test_device(op, rank, device):
    """A weight or bias on another device is named (DeviceError); meta inputs give a meta result of the right
    shape (test_conv_fwd.test_meta_tensors); on a second GPU, where there is one, the result is computed there."""
    meta = torch.device("meta")
    x, w = _xw(rank, device=device)
    b = rand(6, dtype=F16, device=device)
    if op != "module":  # a module's parameters follow the module; its input is what can differ
        with pytest.raises(DeviceError, match=r"^weight: expected a tensor on .* \(like x\)"):
            _call(op, rank, x, w.to(meta))
        with pytest.raises(DeviceError, match=r"^bias: expected a tensor on .* \(like x\)"):
            _call(op, rank, x, w, b.to(meta))
    else:
        with pytest.raises(DeviceError, match=r"^weight: expected a tensor on meta \(like x\)"):
            _call(op, rank, x.to(meta), w, b)
    y = _call(op, rank, x.to(meta), w.to(meta), b.to(meta), stride=2, padding=1)
    assert y.device == meta and y.shape == (2, 6, *([3] * rank))
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        x1, w1 = x.to("cuda:1"), w.to("cuda:1")
        y = _call(op, rank, x1, w1, padding=1)
        assert y.device == x1.device
        assert_rel_close(y, conv_ref(x1, w1, padding=1), tol=tolerance(F16))
        if op != "module":
            with pytest.raises(DeviceError, match="^weight: expected a tensor on cuda:1"):
                _call(op, rank, x1, w)


# ---------------------------------------------------------------- shape


@pytest.mark.parametrize("op,rank", OPS, ids=IDS)
def test_shape(op, rank):
    """Wrong ranks and channel counts that do not agree are named (more: test_conv_errors)."""
    x, w = _xw(rank)
    with pytest.raises(ShapeError, match=r"^x: expected \[N, C_in, \*spatial\] or \[C_in, \*spatial\]"):
        _call(op, rank, x[..., None], w)
    with pytest.raises(ShapeError, match=r"^weight: expected C_in / groups = 3 input channels"):
        _call(op, rank, x[:, :3], w)
    if op == "conv":
        with pytest.raises(ShapeError, match=r"^bias: expected \[6\]"):
            conv(x, w, torch.ones(5, dtype=F16))
    elif op != "module":
        with pytest.raises(ShapeError, match=rf"^weight: {op} expects a {rank + 2}-D weight"):
            _call(op, rank, x, w[..., 0])


# ---------------------------------------------------------------- stride


@pytest.mark.parametrize("op,rank", OPS, ids=IDS)
def test_stride(op, rank, device, poisoned):
    """Transposed spatial dims, a channel slice, spatial steps and a transposed weight: read through their
    strides, right against the fp64 reference (more: test_conv_fwd.test_strided_input_views)."""
    big = rand(2, 9, *([11] * rank), dtype=F16, device=device)
    if rank > 1:
        swapped = big[:, 1:6].transpose(-1, -2)  # spatial dims transposed
    else:
        swapped = rand(2, 11, 9, dtype=F16, device=device).transpose(1, 2)[:, 1:6]  # [N, W, C] memory, sliced
    views = [big[:, 2:7, ..., 1::2], swapped]
    w = weight(6, 5, (3,) * rank, dtype=F16, device=device).transpose(0, 1).contiguous().transpose(0, 1)
    for x in views:
        assert not x.is_contiguous()
        assert_rel_close(_call(op, rank, x, w, padding=1), conv_ref(x, w, padding=1), tol=tolerance(F16))


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize("op,rank", OPS, ids=IDS)
def test_alignment(op, rank, device, poisoned):
    """x, weight and bias one element past a 16-byte boundary, with odd channel and spatial sizes (odd strides),
    NC* and channels-last memory: right against the fp64 reference."""
    size = (7, 5, 3)[:rank]
    n, c, k = 2, 5, 3
    numel = n * c * int(torch.tensor(size).prod())
    x = rand(numel + 1, dtype=F16, device=device)[1:].view(n, c, *size)
    x_cl = rand(numel + 1, dtype=F16, device=device, seed=3)[1:].view(n, *size, c).movedim(-1, 1)
    w = rand(k * c * 3**rank + 1, dtype=F16, device=device, seed=1, scale=0.3)[1:].view(k, c, *([3] * rank))
    b = rand(k + 1, dtype=F16, device=device, seed=2)[1:]
    assert x.data_ptr() % 16 and w.data_ptr() % 16 and b.data_ptr() % 16
    for xi in (x, x_cl):
        y = _call(op, rank, xi, w, b, padding=1)
        assert_rel_close(y, conv_ref(xi, w, b, padding=1), tol=tolerance(F16))


# ---------------------------------------------------------------- empty


@pytest.mark.parametrize("op,rank", OPS, ids=IDS)
def test_empty(op, rank, device):
    """Zero batch and zero output channels give empty results; zero input channels give act(bias) (torch's
    result), nothing launched (test_conv_fwd.test_zero_sizes)."""
    x, w = _xw(rank, n=0, device=device)
    assert _call(op, rank, x, w, padding=1).shape == (0, 6, *([5] * rank))
    x, w = _xw(rank, k=0, device=device)
    assert _call(op, rank, x, w).shape == (2, 0, *([3] * rank))
    x, w = _xw(rank, c=0, device=device)
    b = rand(6, dtype=F16, device=device)
    y = _call(op, rank, x, w, b)  # (conv_ref's torch modules give no output channels here)
    assert torch.equal(y.double().cpu(), b.double().cpu().reshape(1, 6, *([1] * rank)).expand_as(y))


# ---------------------------------------------------------------- huge dimension


@pytest.mark.gpu
def test_huge_dimension():
    """conv2d over an input past 2^31 elements (int64 offsets, test_conv_addressing.test_int64_offsets_only_
    past_int32 for the choice): the last image, at the far end of x, against the reference on it alone."""
    n, c, h, w_ = 2**13 + 1, 64, 64, 64  # 2^31 + 2^18 elements
    need = 2 * n * c * h * w_ * 2 + (4 << 30)  # x in both layouts (NC* is copied to channels-last) and spare
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    x = torch.zeros(n, h, w_, c, dtype=torch.bfloat16, device="cuda").movedim(-1, 1)  # channels-last memory
    assert x.numel() > 2**31
    x[-1].normal_()
    wt = weight(8, c, (3, 3), dtype=torch.bfloat16, device="cuda")
    y = conv2d(x, wt, padding=1)
    assert_rel_close(y[-1:], conv_ref(x[-1:], wt, padding=1), tol=tolerance(torch.bfloat16))
    assert torch.equal(y[0], torch.zeros_like(y[0]))
    del x, y
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- NaN / Inf

NAN_CASES = [  # (rank, groups, kernel, stride, padding): the implicit GEMM, 1x1 (GEMM path), depthwise
    (1, 1, 3, 1, 1), (2, 1, 3, 2, 1), (3, 1, 3, 1, 1), (2, 1, 1, 1, 0), (2, 4, 3, 1, 1),
]  # fmt: skip


@pytest.mark.parametrize("case", NAN_CASES, ids=["1d", "2d-s2", "3d", "1x1", "depthwise"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaN arithmetic
def test_nan_inf(case, device, poisoned):
    """A NaN in one input pixel makes exactly the outputs whose window covers it NaN, an Inf another image's
    outputs +-Inf (or NaN), as torch's fp64 convolution: no output finite where torch's is not, none NaN where
    torch's is finite."""
    rank, groups, ks, stride, padding = case
    x = rand(2, 4, *([6] * rank), dtype=F16, device="cpu")
    w = weight(4, 4 // groups, (ks,) * rank, dtype=F16, device="cpu")
    x[(0, 1, *([3] * rank))] = float("nan")
    x[(1, 2, *([1] * rank))] = float("inf")
    ref = conv_ref(x, w, stride=stride, padding=padding, groups=groups)
    assert torch.isnan(ref).any() and torch.isinf(ref).any() and torch.isfinite(ref).any()
    y = conv(x.to(device), w.to(device), stride=stride, padding=padding, groups=groups).double().cpu()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN positions differ from torch's"
    assert torch.equal(torch.isposinf(y), torch.isposinf(ref)) and torch.equal(torch.isneginf(y), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert_rel_close(y[fin], ref[fin], tol=tolerance(F16))
