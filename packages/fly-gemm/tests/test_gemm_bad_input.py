"""The bad-input classes of issue 40, one test a class, over the family's public ops: gemm, linear, prepack
(a PackedWeight through gemm), fused_moe, grouped_gemm and topk_softmax.

Each class is answered by an error of FlyDSL's own types naming the argument, or by a correct result against
the fp64/fp32 reference. Checks that other files already make in depth are referenced in comments rather
than repeated; each class still has its one test here so the family's table can cite it. A check that shows
a bug is an xfail of its own (strict), named test_<class>_<what>.
"""

from __future__ import annotations

import pytest
import torch

from fly_gemm import (
    fused_moe,
    gemm,
    gemm_ref,
    grouped_gemm,
    grouped_gemm_ref,
    grouped_topk,
    linear,
    prepack,
    topk_softmax,
)
from fly_gemm.moe_reference import fused_moe_ref, grouped_topk_ref, topk_softmax_ref
from flydsl.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, tolerance

OPS = ["gemm", "linear", "prepack", "fused_moe", "grouped_gemm", "topk_softmax"]
F16 = torch.float16
BF16 = torch.bfloat16


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _misaligned(t):
    """A copy of ``t`` whose storage starts one element past an aligned base (contiguous otherwise)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    buf.copy_(t)
    assert buf.data_ptr() % 16 != 0
    return buf


def _layer(t, h, inter, e, k, device, dtype=F16, seed=0):
    """A unit-scale MoE layer (outputs near 1) with softmax routing from fp32 logits."""
    x = _randn(t, h, dtype=dtype, device=device, seed=seed)
    w1 = _randn(e, 2 * inter, h, dtype=dtype, device=device, seed=seed + 1, scale=h**-0.5)
    w2 = _randn(e, h, inter, dtype=dtype, device=device, seed=seed + 2, scale=inter**-0.5)
    w, ids = topk_softmax(_randn(t, e, device=device, seed=seed + 3), k)
    return x, w1, w2, w, ids


def _grouped(m, k, n, sizes, device, seed=0):
    a = _randn(m, k, dtype=BF16, device=device, seed=seed)
    b = _randn(len(sizes), n, k, dtype=BF16, device=device, seed=seed + 1, scale=k**-0.5)
    offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return a, b, offsets


def _check_gemm(c, a, b, **kw):
    ref = gemm_ref(a, b, **kw)
    assert c.shape == ref.shape
    assert_rel_close(c, ref, tol=tolerance(c.dtype if c.dtype in (F16, BF16) else a.dtype))


def _check_moe(y, x, w1, w2, w, ids):
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_rel_close(y, fused_moe_ref(x, w1, w2, w, ids), tol=tolerance(x.dtype))


def _check_grouped(c, a, b, offsets):
    assert c.shape == (a.shape[0], b.shape[1]) and c.dtype == a.dtype
    assert_rel_close(c, grouped_gemm_ref(a, b, offsets), tol=tolerance(a.dtype))


def _check_topk(out, logits, k):
    w, ids = out
    wr, idr = topk_softmax_ref(logits, k)
    assert torch.equal(ids.cpu(), idr.cpu())
    assert_rel_close(w, wr, tol=1e-5)


# ---------------------------------------------------------------- dtype


@pytest.mark.parametrize("op", OPS)
def test_dtype(device, op):
    """A dtype outside an op's table, or operands of two dtypes, is named. (Deeper:
    test_gemm.py::test_bad_inputs*, test_gemm_api.py, test_moe.py::test_fused_moe_bad_input_names_the_argument,
    test_grouped_gemm.py::test_bad_input_is_named, test_moe_routing.py::test_routing_bad_input_names_the_argument.)"""
    a, b = _randn(4, 16, dtype=F16, device=device), _randn(8, 16, dtype=F16, device=device, seed=1)
    if op == "gemm":
        with pytest.raises(DTypeError, match="^a: expected dtype fp16 or bf16 or fp8_e4m3 or int8, got fp32"):
            gemm(a.float(), b.float())
        with pytest.raises(DTypeError, match="^b: expected dtype fp16"):
            gemm(a, b.bfloat16())
        with pytest.raises(DTypeError, match="^out_dtype"):
            gemm(a, b, out_dtype=torch.int32)
        with pytest.raises(DTypeError, match="^bias: expected dtype"):
            gemm(a, b, bias=torch.zeros(8, dtype=torch.float64, device=device))
    elif op == "linear":
        with pytest.raises(DTypeError, match=r"^weight: expected dtype fp16 \(x's\), got bf16"):
            linear(a, b.bfloat16())
        with pytest.raises(DTypeError, match="^weight: expected a PackedWeight of dtype fp16"):
            linear(a, prepack(b.bfloat16()))
        with pytest.raises(DTypeError, match="^x: a PackedWeight runs the fp16 / bf16 kernels"):
            linear(a.float(), prepack(b))
    elif op == "prepack":
        with pytest.raises(DTypeError, match="^b: expected dtype fp16 / bf16 / fp8_e4m3 / int8"):
            prepack(b.to(torch.int32))
        with pytest.raises(DTypeError, match="^quant: expected None, torch.float8_e4m3fn or torch.int8"):
            prepack(b, quant=torch.float16)
        with pytest.raises(DTypeError, match=r"^b: expected dtype bf16 \(a's\), got fp16"):
            gemm(a.bfloat16(), prepack(b))
    elif op == "fused_moe":
        x, w1, w2, w, ids = _layer(6, 32, 16, 4, 2, device)
        with pytest.raises(DTypeError, match="^x: expected dtype bf16 or fp16"):
            fused_moe(x.float(), w1, w2, w, ids)
        with pytest.raises(DTypeError, match="^w1: expected dtype fp16"):
            fused_moe(x, w1.bfloat16(), w2, w, ids)
        with pytest.raises(DTypeError, match="^topk_ids"):
            fused_moe(x, w1, w2, w, ids.float())
    elif op == "grouped_gemm":
        a, b, offs = _grouped(10, 32, 16, [4, 6], device)
        with pytest.raises(DTypeError, match="^a: expected dtype bf16 or fp16"):
            grouped_gemm(a.float(), b, offs)
        with pytest.raises(DTypeError, match="^b: expected dtype bf16"):
            grouped_gemm(a, b.half(), offs)
        with pytest.raises(DTypeError, match="^offsets: expected dtype int32"):
            grouped_gemm(a, b, offs.long())
    else:
        logits = _randn(4, 8, device=device)
        with pytest.raises(DTypeError, match="^router_logits: expected dtype fp32 or bf16 or fp16, got int32"):
            topk_softmax(logits.to(torch.int32), 2)
        with pytest.raises(DTypeError, match="^router_logits: .*got fp64"):
            topk_softmax(logits.double(), 2)


# ---------------------------------------------------------------- device


def _other_device(device):
    """A device other than ``device`` that a test can always allocate on: the CPU beside a GPU, meta beside
    the CPU."""
    return torch.device("cpu") if torch.device(device).type == "cuda" else torch.device("meta")


def _meta_result(op):
    m = torch.device("meta")
    if op == "gemm":
        return gemm(torch.empty(5, 16, dtype=BF16, device=m), torch.empty(8, 16, dtype=BF16, device=m)), (5, 8)
    if op == "linear":
        return linear(torch.empty(2, 5, 16, dtype=BF16, device=m), torch.empty(8, 16, dtype=BF16, device=m)), (2, 5, 8)
    if op == "prepack":
        packed = prepack(torch.empty(8, 16, dtype=BF16, device=m))
        assert packed.weight.is_meta
        return gemm(torch.empty(5, 16, dtype=BF16, device=m), packed), (5, 8)
    if op == "fused_moe":
        x, w1, w2 = (torch.empty(s, dtype=BF16, device=m) for s in [(5, 32), (4, 64, 32), (4, 32, 32)])
        return fused_moe(x, w1, w2, torch.empty(5, 2, device=m), torch.empty(5, 2, dtype=torch.int32, device=m)), (
            5,
            32,
        )
    if op == "grouped_gemm":
        a, b = torch.empty(10, 32, dtype=BF16, device=m), torch.empty(2, 16, 32, dtype=BF16, device=m)
        return grouped_gemm(a, b, torch.empty(2, dtype=torch.int32, device=m)), (10, 16)
    w, ids = topk_softmax(torch.empty(5, 8, device=m), 2)
    assert ids.is_meta and ids.dtype == torch.int32 and ids.shape == (5, 2)
    return w, (5, 2)


@pytest.mark.parametrize("where", ["mixed", "meta", pytest.param("other_gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op", OPS)
def test_device(device, op, where):
    """mixed: a tensor on another device than the first operand is named (topk_softmax takes one tensor:
    nothing to mix); meta: meta inputs give a meta result of the right shape (README: custom ops with fake
    implementations); other_gpu: everything on a second GPU gives the right result there, and a mix of the two
    GPUs is named. (Also: test_gemm.py::test_bad_inputs*, test_grouped_gemm.py::test_bad_input_is_named.)"""
    if where == "meta":
        out, shape = _meta_result(op)
        assert out.is_meta and tuple(out.shape) == shape
        return
    if where == "other_gpu":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two GPUs")
        _check_on_second_gpu(op)
        return
    other = _other_device(device)
    a, b = _randn(4, 16, dtype=F16, device=device), _randn(8, 16, dtype=F16, device=device, seed=1)
    if op == "gemm":
        with pytest.raises(DeviceError, match="^b: expected a tensor on"):
            gemm(a, b.to(other))
        with pytest.raises(DeviceError, match="^b: expected a tensor on"):
            gemm(a.to(other), b)
        elsewhere = {
            "bias": torch.zeros(8, dtype=F16, device=other),
            "scale_a": torch.ones(4, device=other),
            "scale_b": torch.ones(8, device=other),
            "out": torch.empty(4, 8, dtype=F16, device=other),
        }
        for name, t in elsewhere.items():
            with pytest.raises(DeviceError, match=f"^{name}: expected a tensor on"):
                gemm(a, b, **{name: t})
    elif op == "linear":
        with pytest.raises(DeviceError, match="^bias: expected a tensor on"):
            linear(a, b, torch.zeros(8, dtype=F16, device=other))
        with pytest.raises(DeviceError):  # named as gemm's b: test_device_linear_names_weight
            linear(a, b.to(other))
    elif op == "prepack":
        with pytest.raises(DeviceError, match="^b: expected a tensor on"):
            gemm(a, prepack(b.to(other)))
        with pytest.raises(DeviceError, match="^b: expected a tensor on"):
            gemm(a.to(other), prepack(b))
    elif op == "fused_moe":
        x, w1, w2, w, ids = _layer(6, 32, 16, 4, 2, device)
        with pytest.raises(DeviceError, match="^w1: expected a tensor on"):
            fused_moe(x, w1.to(other), w2, w, ids)
        with pytest.raises(DeviceError, match="^w2: expected a tensor on"):
            fused_moe(x, w1, w2.to(other), w, ids)
        with pytest.raises(DeviceError, match="^topk_weights: expected a tensor on"):
            fused_moe(x, w1, w2, w.to(other), ids)
        with pytest.raises(DeviceError, match="^topk_ids: expected a tensor on"):
            fused_moe(x, w1, w2, w, ids.to(other))
    elif op == "grouped_gemm":
        a, b, offs = _grouped(10, 32, 16, [4, 6], device)
        with pytest.raises(DeviceError, match="^b: expected a tensor on"):
            grouped_gemm(a, b.to(other), offs)
        with pytest.raises(DeviceError, match="^offsets: expected a tensor on"):
            grouped_gemm(a, b, offs.to(other))
    else:
        pytest.skip("one tensor argument: no mix to make")


def _check_on_second_gpu(op):
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with torch.cuda.device(0):  # the current device is not the tensors': the op must follow its inputs
        a, b = _randn(9, 40, dtype=BF16, device=gpu1), _randn(24, 40, dtype=BF16, device=gpu1, seed=1)
        if op in ("gemm", "linear", "prepack"):
            c = {"gemm": gemm, "linear": linear, "prepack": lambda a, b: gemm(a, prepack(b))}[op](a, b)
            assert c.device == gpu1
            _check_gemm(c, a, b)
            with pytest.raises(DeviceError, match="^b: expected a tensor on cuda:0"):
                gemm(a.to(gpu0), b)
        elif op == "fused_moe":
            x, w1, w2, w, ids = _layer(7, 32, 24, 4, 2, gpu1)
            y = fused_moe(x, w1, w2, w, ids)
            assert y.device == gpu1
            _check_moe(y, x, w1, w2, w, ids)
            with pytest.raises(DeviceError, match="^w1: expected a tensor on cuda:0"):
                fused_moe(x.to(gpu0), w1, w2, w.to(gpu0), ids.to(gpu0))
        elif op == "grouped_gemm":
            a, b, offs = _grouped(10, 32, 16, [4, 6], gpu1)
            c = grouped_gemm(a, b, offs)
            assert c.device == gpu1
            _check_grouped(c, a, b, offs)
            with pytest.raises(DeviceError, match="^b: expected a tensor on cuda:0"):
                grouped_gemm(a.to(gpu0), b, offs.to(gpu0))
        else:
            logits = _randn(6, 8, device=gpu1)
            out = topk_softmax(logits, 2)
            assert out[0].device == gpu1
            _check_topk(out, logits, 2)


def test_device_linear_names_weight(device):
    a, b = _randn(4, 16, dtype=F16, device=device), _randn(8, 16, dtype=F16, device=device, seed=1)
    with pytest.raises(DeviceError, match="^weight: expected a tensor on"):
        linear(a, b.to(_other_device(device)))


# ---------------------------------------------------------------- shape


@pytest.mark.parametrize("op", OPS)
def test_shape(device, op):
    """Wrong ranks and mismatched sizes are named. (Deeper: test_gemm.py, test_gemm_api.py,
    test_moe.py::test_fused_moe_bad_input_names_the_argument, test_grouped_gemm.py::test_bad_input_is_named.)"""
    a, b = _randn(4, 16, dtype=F16, device=device), _randn(8, 16, dtype=F16, device=device, seed=1)
    if op == "gemm":
        with pytest.raises(ShapeError, match="^a: expected a 2-D tensor"):
            gemm(a[0], b)
        with pytest.raises(ShapeError, match="^b: expected a 2-D tensor"):
            gemm(a, b[None])
        with pytest.raises(ShapeError, match=r"^b: expected \[N, 16\]"):
            gemm(a, b[:, :15])
        with pytest.raises(ShapeError, match=r"^b: expected \[16, N\]"):
            gemm(a, b, b_layout="kn")
        with pytest.raises(ShapeError, match="^bias: expected"):
            gemm(a, b, bias=torch.zeros(7, dtype=F16, device=device))
        with pytest.raises(ShapeError, match="^scale_a: expected one value"):
            gemm(a, b, scale_a=torch.ones(3, device=device))
        with pytest.raises(ShapeError, match=r"^out: expected \[4, 8\]"):
            gemm(a, b, out=torch.empty(4, 7, dtype=F16, device=device))
    elif op == "linear":
        with pytest.raises(ShapeError, match="^x: expected at least 1 dimension"):
            linear(torch.tensor(1.0, dtype=F16, device=device), b)
        with pytest.raises(ShapeError, match="^weight: expected a 2-D tensor"):
            linear(a, b[0])
        with pytest.raises(ShapeError, match=r"^weight: expected \[N, 16\] \(K = x's last dimension\)"):
            linear(a, b[:, :12])
        with pytest.raises(ShapeError, match=r"^bias: expected \[8\]"):
            linear(a, b, torch.zeros(7, dtype=F16, device=device))
    elif op == "prepack":
        with pytest.raises(ShapeError, match="^b: expected a 2-D tensor"):
            prepack(b[0])
        with pytest.raises(ShapeError, match=r"^b: expected \[N, 16\]"):
            gemm(a, prepack(b[:, :8]))
        with pytest.raises(ShapeError, match=r"^weight: expected \[N, 16\]"):
            linear(a, prepack(b[:, :8]))
    elif op == "fused_moe":
        x, w1, w2, w, ids = _layer(6, 32, 16, 4, 2, device)
        with pytest.raises(ShapeError, match="^x: expected a 2-D tensor"):
            fused_moe(x[None], w1, w2, w, ids)
        with pytest.raises(ShapeError, match="^w1: expected a 3-D tensor"):
            fused_moe(x, w1[0], w2, w, ids)
        with pytest.raises(ShapeError, match=r"^w1: expected \[E, 2 \* I, 32\]"):
            fused_moe(x, w1[:, :, :16], w2, w, ids)
        with pytest.raises(ShapeError, match=r"^w2: expected \[4, 32, 16\]"):
            fused_moe(x, w1, w2[:3], w, ids)
        with pytest.raises(ShapeError, match=r"^topk_ids: expected \[6, k\]"):
            fused_moe(x, w1, w2, w, ids[:5])
        with pytest.raises(ShapeError, match=r"^topk_weights: expected \[6, 2\]"):
            fused_moe(x, w1, w2, w[:, :1], ids)
    elif op == "grouped_gemm":
        a, b, offs = _grouped(10, 32, 16, [4, 6], device)
        with pytest.raises(ShapeError, match="^a: expected a 2-D"):
            grouped_gemm(a[0], b, offs)
        with pytest.raises(ShapeError, match="^b: expected a 3-D"):
            grouped_gemm(a, b[0], offs)
        with pytest.raises(ShapeError, match=r"^b: expected \[G, N, 32\]"):
            grouped_gemm(a, b[:, :, :16], offs)
        with pytest.raises(ShapeError, match=r"^offsets: expected \[2\]"):
            grouped_gemm(a, b, offs[:1])
    else:
        with pytest.raises(ShapeError, match="^router_logits: expected a 2-D tensor"):
            topk_softmax(_randn(2, 4, 8, device=device), 2)
        with pytest.raises(ArgumentError, match="^k: expected at most E = 8"):
            topk_softmax(_randn(4, 8, device=device), 9)


# ---------------------------------------------------------------- stride


@pytest.mark.parametrize("op", OPS)
def test_stride(device, op):
    """Sliced rows (row stride, column offset), transposed operands and non-unit last strides give the
    reference: every op here documents any strides (gemm: "any strides"; the others read through strides or
    take contiguous copies)."""
    base = _randn(12, 50, dtype=BF16, device=device)
    a = base[::2, 3:36]  # [6, 33], row stride 100, offset 3
    b = _randn(20, 50, dtype=BF16, device=device, seed=1)[::2, 5:38]  # [10, 33]
    at = _randn(33, 6, dtype=BF16, device=device, seed=2).t()
    bt = _randn(33, 10, dtype=BF16, device=device, seed=3).t()
    if op == "gemm":
        _check_gemm(gemm(a, b), a, b)
        _check_gemm(gemm(at, bt), at, bt)
        _check_gemm(gemm(a, b.t(), b_layout="kn"), a, b)
        _check_gemm(gemm(at, bt.t(), b_layout="kn"), at, bt)
        out = torch.empty(10, 6, dtype=BF16, device=device).t()  # a transposed out
        assert gemm(a, b, out=out) is out
        _check_gemm(out, a, b)
    elif op == "linear":
        x3 = _randn(3, 4, 50, dtype=BF16, device=device, seed=4)[:, ::2, 3:36]  # leading dims that do not collapse
        y = linear(x3, b)
        assert y.shape == (3, 2, 10)
        _check_gemm(y.reshape(6, 10), x3.reshape(6, 33), b)
        _check_gemm(linear(at, bt), at, bt)
    elif op == "prepack":
        _check_gemm(gemm(a, prepack(b)), a, b)
        _check_gemm(gemm(at, prepack(bt)), at, bt)
        _check_gemm(gemm(a, prepack(b.t(), b_layout="kn")), a, b)
    elif op == "fused_moe":
        x, w1, w2, w, ids = _layer(7, 32, 24, 4, 2, device)
        xs = torch.empty(7, 50, dtype=F16, device=device)[:, 5:37]
        xs.copy_(x)
        _check_moe(fused_moe(xs, w1, w2, w, ids), x, w1, w2, w, ids)
        t = lambda v: v.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731 - same values, strides swapped
        _check_moe(fused_moe(t(x), t(w1), t(w2), t(w), t(ids)), x, w1, w2, w, ids)
    elif op == "grouped_gemm":
        ga, gb, offs = _grouped(10, 32, 16, [4, 6], device)
        gas = torch.empty(10, 50, dtype=BF16, device=device)[:, 3:35]
        gas.copy_(ga)
        _check_grouped(grouped_gemm(gas, gb, offs), ga, gb, offs)
        t = lambda v: v.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731
        _check_grouped(grouped_gemm(t(ga), t(gb), offs), ga, gb, offs)
        offs2 = torch.stack([offs, torch.zeros_like(offs)], 1).reshape(-1)[::2]  # strided offsets
        _check_grouped(grouped_gemm(ga, gb, offs2), ga, gb, offs)
    else:
        logits = _randn(8, 20, device=device)
        _check_topk(topk_softmax(logits[::2, 3:15], 3), logits[::2, 3:15], 3)
        lt = _randn(12, 5, device=device, seed=1).t()
        _check_topk(topk_softmax(lt, 3), lt, 3)


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize("op", OPS)
def test_alignment(device, op):
    """Operands (and outputs, bias, scales) starting one element past an aligned base, with odd K and row
    strides: the reference, nothing misread (the TMA kernel must not take such operands; README, Kernels)."""
    m, n, k = 6, 10, 33
    a = _misaligned(_randn(m, k, dtype=F16, device=device))
    b = _misaligned(_randn(n, k, dtype=F16, device=device, seed=1))
    if op == "gemm":
        _check_gemm(gemm(a, b), a, b)
        bias = _misaligned(_randn(n, dtype=F16, device=device, seed=2))
        out = _misaligned(torch.zeros(m, n, dtype=F16, device=device))
        assert gemm(a, b, bias=bias, out=out) is out
        _check_gemm(out, a, b, bias=bias)
        ai = _misaligned(_randn(m, k, device=device, seed=3).mul(40).round().to(torch.int8))
        bi = _misaligned(_randn(n, k, device=device, seed=4).mul(40).round().to(torch.int8))
        sa = _misaligned(_randn(m, device=device, seed=5).abs() + 0.5)
        assert torch.equal(gemm(ai, bi, out_dtype=torch.int32).double(), gemm_ref(ai, bi))
        assert_rel_close(gemm(ai, bi, scale_a=sa, out_dtype=torch.float32), gemm_ref(ai, bi, scale_a=sa), tol=1e-5)
        # an odd row stride: rows of 33 elements inside rows of 35
        a35 = _randn(m, 35, dtype=F16, device=device, seed=6)[:, 1:34]
        _check_gemm(gemm(a35, b), a35, b)
    elif op == "linear":
        x = _misaligned(_randn(2, 3, k, dtype=F16, device=device))
        y = linear(x, b, _misaligned(_randn(n, dtype=F16, device=device, seed=2)))
        assert y.shape == (2, 3, n)
    elif op == "prepack":
        _check_gemm(gemm(a, prepack(b)), a, b)
        _check_gemm(linear(a, prepack(b)), a, b)
    elif op == "fused_moe":
        x, w1, w2, w, ids = _layer(7, 33, 23, 4, 2, device)  # odd H and I: odd row strides everywhere
        y = fused_moe(_misaligned(x), _misaligned(w1), _misaligned(w2), _misaligned(w), _misaligned(ids))
        _check_moe(y, x, w1, w2, w, ids)
    elif op == "grouped_gemm":
        ga, gb, offs = _grouped(10, 33, 17, [4, 6], device)
        _check_grouped(grouped_gemm(_misaligned(ga), _misaligned(gb), _misaligned(offs)), ga, gb, offs)
    else:
        logits = _misaligned(_randn(9, 7, device=device))
        _check_topk(topk_softmax(logits, 3), logits, 3)
        lb = _misaligned(_randn(9, 7, dtype=BF16, device=device))
        _check_topk(topk_softmax(lb, 3), lb, 3)
    if op == "linear":
        _check_gemm(y.reshape(6, n), x.reshape(6, k), b, bias=_randn(n, dtype=F16, device=device, seed=2))


# ---------------------------------------------------------------- empty


@pytest.mark.parametrize("op", OPS)
def test_empty(device, op):
    """Zero rows, columns, depth, tokens or groups give the right empty (or zero / act(bias)) result, no launch
    error. (Also: test_moe.py::test_fused_moe_zero_tokens_and_meta.)"""
    k16 = _randn(8, 16, dtype=F16, device=device, seed=1)
    if op in ("gemm", "prepack"):
        w = (lambda t: prepack(t)) if op == "prepack" else (lambda t: t)
        assert gemm(torch.empty(0, 16, dtype=F16, device=device), w(k16)).shape == (0, 8)
        assert gemm(_randn(4, 16, dtype=F16, device=device), w(k16[:0])).shape == (4, 0)
        z = gemm(torch.empty(4, 0, dtype=F16, device=device), w(torch.empty(8, 0, dtype=F16, device=device)))
        assert z.shape == (4, 8) and (z == 0).all()
        bias = _randn(8, dtype=F16, device=device, seed=2)
        k0 = torch.empty(8, 0, dtype=F16, device=device)
        z = gemm(torch.empty(4, 0, dtype=F16, device=device), w(k0), bias=bias, activation="relu")
        assert torch.equal(z, bias.relu().expand(4, 8))  # K = 0: act(bias) (README)
    elif op == "linear":
        assert linear(torch.empty(2, 0, 16, dtype=F16, device=device), k16).shape == (2, 0, 8)
        assert linear(torch.empty(0, 16, dtype=F16, device=device), prepack(k16)).shape == (0, 8)
    elif op == "fused_moe":
        x, w1, w2, w, ids = _layer(0, 32, 16, 4, 2, device)
        assert fused_moe(x, w1, w2, w, ids).shape == (0, 32)
        # tokens routed to no expert of this rank (ids outside [0, E), README: moe_align): a zero row
        x, w1, w2, w, ids = _layer(5, 32, 16, 4, 2, device)
        ids = ids.clone()
        ids[2] = -1
        y = fused_moe(x, w1, w2, w, ids)
        assert (y[2] == 0).all()
        _check_moe(y, x, w1, w2, w, ids)
    elif op == "grouped_gemm":
        ga, gb, _ = _grouped(0, 32, 16, [0, 0], device)
        offs = torch.zeros(2, dtype=torch.int32, device=device)
        assert grouped_gemm(ga, gb, offs).shape == (0, 16)
        ga, gb, offs = _grouped(6, 32, 16, [0, 6, 0], device)  # empty first and last groups
        _check_grouped(grouped_gemm(ga, gb, offs), ga, gb, offs)
        c = grouped_gemm(ga, gb[:0], offs[:0])  # no groups: every row past the last offset, zero
        assert c.shape == (6, 16) and (c == 0).all()
    else:
        w, ids = topk_softmax(torch.empty(0, 8, device=device), 2)
        assert w.shape == (0, 2) and ids.shape == (0, 2) and ids.dtype == torch.int32


# ---------------------------------------------------------------- huge dimension


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["MK", "MN"])
def test_huge_dimension(case):
    """gemm past int32 element offsets: A of M x K > 2^31 elements (bf16 [2^31 / 4096 + 64, 4096] x [256,
    4096]), or C of M x N > 2^31 ([2^31 / 4096 + 64, 64] x [4096, 64]); the last rows, and those around
    element 2^31, match the fp64 reference computed on them alone."""
    big = 4096
    m = 2**31 // big + 64
    k, n = (big, 256) if case == "MK" else (64, big)
    need = 2 * (m * k + m * n) + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free on the GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    a = torch.empty(m, k, dtype=BF16, device="cuda").normal_(generator=gen)
    b = torch.empty(n, k, dtype=BF16, device="cuda").normal_(generator=gen).mul_(k**-0.5)
    c = gemm(a, b)
    boundary = 2**31 // (k if case == "MK" else n)
    rows = [0, boundary - 1, boundary, boundary + 1, m - 2, m - 1]
    assert_rel_close(c[rows], gemm_ref(a[rows], b), tol=tolerance(BF16))
    del a, b, c
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- NaN / Inf


def _assert_same_non_finite(out, ref):
    """NaN and +-Inf exactly where the reference has them; the finite elements within tolerance."""
    out = out.float()
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref).cpu())
    assert torch.equal(torch.isposinf(out).cpu(), torch.isposinf(ref).cpu())
    assert torch.equal(torch.isneginf(out).cpu(), torch.isneginf(ref).cpu())
    fin = torch.isfinite(ref)
    assert fin.any() and not fin.all()
    return fin


@pytest.mark.parametrize("op", OPS)
def test_nan_inf(device, op):
    """NaN / Inf propagate as in torch's reference: into their own rows (and columns) only, never into other
    tokens or tiles; a routing row of -inf logits but one gives that expert weight 1; a row of only -inf, or
    with +inf, gives NaN weights as torch.softmax. A NaN logit: test_nan_inf_topk_softmax_nan_logit."""
    if op in ("gemm", "linear", "prepack"):
        a = _randn(5, 16, dtype=F16, device=device)
        b = _randn(6, 16, dtype=F16, device=device, seed=1)
        a[0, 2] = float("nan")
        a[1, 3] = float("inf")
        b[4, 0] = float("-inf")
        c = {"gemm": gemm, "linear": linear, "prepack": lambda a, b: gemm(a, prepack(b))}[op](a, b)
        ref = gemm_ref(a, b)
        fin = _assert_same_non_finite(c, ref)
        assert_rel_close(c.float()[fin], ref[fin], tol=tolerance(F16))
    elif op == "fused_moe":
        x, w1, w2, w, ids = _layer(9, 32, 16, 4, 2, device)
        x[2, 3] = float("nan")
        x[5, 0] = float("inf")
        y = fused_moe(x, w1, w2, w, ids)
        ref = fused_moe_ref(x, w1, w2, w, ids)
        bad = ~torch.isfinite(ref).all(-1)
        assert bad.tolist() == [i in (2, 5) for i in range(9)]
        assert not torch.isfinite(y[bad]).all(-1).any()  # each bad token's row holds NaN / Inf
        assert_rel_close(y[~bad], ref[~bad], tol=tolerance(F16))  # the other tokens are untouched
    elif op == "grouped_gemm":
        ga, gb, offs = _grouped(10, 32, 16, [4, 6], device)
        ga[1, 2] = float("nan")
        ga[6, 0] = float("-inf")
        c, ref = grouped_gemm(ga, gb, offs), grouped_gemm_ref(ga, gb, offs)
        fin = _assert_same_non_finite(c, ref)
        assert_rel_close(c.float()[fin], ref[fin], tol=tolerance(BF16))
    else:
        logits = _randn(4, 8, device=device)
        logits[1, :] = float("-inf")
        logits[2, 3] = float("inf")
        logits[3, :] = float("-inf")
        logits[3, 6] = 0.5
        w, ids = topk_softmax(logits, 2)
        wr, idr = topk_softmax_ref(logits, 2)
        assert torch.equal(torch.isnan(w).cpu(), torch.isnan(wr).cpu()) and torch.isnan(w[1:3]).all()
        assert ids[2, 0].item() == 3 and ids[3, 0].item() == 6 and w[3].tolist() == [1.0, 0.0]
        assert_rel_close(w[0], wr[0], tol=1e-5)
        assert torch.equal(ids[0].cpu(), idr[0].cpu())


@pytest.mark.parametrize("renormalize", [True, False])
def test_nan_inf_topk_softmax_nan_logit(device, renormalize):
    """A NaN logit among finite ones makes its row's weights NaN, as torch.softmax (and topk_softmax_ref) do,
    renormalized or not (the max reductions drop NaN: with renormalization the row came out finite, from the
    other experts); a row of only NaN too. The ids of such a row are unspecified but are k distinct expert ids
    in [0, E) (a NaN matches no maximum: a row of NaN got ids past E, which fused_moe would read out of
    bounds); the other rows are untouched. grouped_topk likewise against grouped_topk_ref: sigmoid scores are
    per expert, so without renormalization only the NaN expert's weight is NaN."""
    e = 6  # not a power of two: the kernels' padding columns past E are there to be (wrongly) picked
    logits = _randn(4, e, device=device)
    logits[1, 4] = float("nan")
    logits[2, :] = float("nan")
    logits[3, [0, 2]] = float("nan")
    nan_rows = torch.tensor([False, True, True, True])
    for k in (2, e):
        w, ids = topk_softmax(logits, k, renormalize)
        wr, idr = topk_softmax_ref(logits, k, renormalize)
        w, ids, wr, idr = w.cpu(), ids.cpu(), wr.cpu(), idr.cpu()
        assert torch.isnan(wr[nan_rows]).all() and torch.isnan(w[nan_rows]).all(), w
        _assert_valid_ids(ids, e)
        assert torch.equal(ids[0], idr[0])
        assert_rel_close(w[0], wr[0], tol=1e-5)
    for scoring, bias in (("sigmoid", None), ("sigmoid", torch.zeros(e, device=device)), ("softmax", None)):
        w, ids = grouped_topk(logits, 3, 3, 2, correction_bias=bias, scoring=scoring, renormalize=renormalize)
        wr, idr = grouped_topk_ref(logits, 3, 3, 2, correction_bias=bias, scoring=scoring, renormalize=renormalize)
        w, ids, wr, idr = w.cpu(), ids.cpu(), wr.cpu(), idr.cpu()
        assert torch.isnan(wr[nan_rows]).any(-1).all()
        assert torch.equal(torch.isnan(w), torch.isnan(wr)), (scoring, bias, w, wr)
        _assert_valid_ids(ids, e)
        assert torch.equal(ids[0], idr[0])
        assert_rel_close(w[0], wr[0], tol=1e-5)


def _assert_valid_ids(ids, e):
    """Each row: distinct expert ids in [0, e)."""
    assert ((ids >= 0) & (ids < e)).all(), ids
    assert all(len(set(row)) == len(row) for row in ids.tolist()), ids
