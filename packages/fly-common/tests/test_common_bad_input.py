"""The bad-input classes of issue 40, one test a class, over this package's public ops: quantize_per_token,
quantize_per_tensor and vec_add.

Each class is answered by an error of FlyDSL's own types naming the argument, or by a correct result against
the reference. Checks that other files already make are referenced in comments rather than repeated; each
class still has its one test here so the family's table can cite it. A check that shows a bug is an xfail
of its own (strict), named test_<class>_<what>.
"""

from __future__ import annotations

import pytest
import torch

from flydsl.errors import DeviceError, DTypeError, FlyDSLError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close
from flydsl_common.quant import quantize_per_tensor, quantize_per_token
from flydsl_common.reference import quantize_per_tensor_ref, quantize_per_token_ref, vec_add_ref
from flydsl_common.testing import assert_quant_close
from flydsl_common.vec_add import vec_add

OPS = ["quantize_per_token", "quantize_per_tensor", "vec_add"]
QUANT = ("quantize_per_token", "quantize_per_tensor")


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _run(op, x, qdtype=torch.int8):
    if op == "quantize_per_token":
        return quantize_per_token(x, qdtype)
    if op == "quantize_per_tensor":
        return quantize_per_tensor(x, qdtype)
    return vec_add(x, x * 0.5)


def _assert_matches_ref(op, x, qdtype=torch.int8):
    out = _run(op, x, qdtype)
    if op == "vec_add":
        assert out.shape == x.shape and out.dtype == x.dtype
        assert_rel_close(out, vec_add_ref(x, x * 0.5))
        return
    q, s = out
    per_token = op == "quantize_per_token"
    ref = (quantize_per_token_ref if per_token else quantize_per_tensor_ref)(x, qdtype)
    assert q.shape == x.shape and s.shape == (x.shape[:-1] if per_token else ())
    assert_quant_close(q, s, *ref, per_token=per_token, x=x)


# ---------------------------------------------------------------- dtype


@pytest.mark.parametrize("op", OPS)
def test_dtype(device, op):
    """Inputs outside fp32/fp16/bf16 (vec_add: and int32) are named; so are a quantized dtype outside int8 /
    fp8 e4m3, a static scale not in fp32, and vec_add's operands of two dtypes or an out of a third.
    (Also: test_common_quant.py / test_common_vec_add.py ::test_bad_inputs*.)"""
    x = _randn(4, 8, device=device)
    if op == "vec_add":
        with pytest.raises(DTypeError, match="^a: expected dtype fp32 or fp16 or bf16 or int32, got fp64"):
            vec_add(x.double(), x.double())
        with pytest.raises(DTypeError, match="^b: expected dtype fp32"):
            vec_add(x, x.half())
        with pytest.raises(DTypeError, match="^out: expected dtype fp32"):
            vec_add(x, x, out=torch.empty(4, 8, dtype=torch.float16, device=device))
        return
    with pytest.raises(DTypeError, match="^x: expected dtype fp32 or fp16 or bf16, got int32"):
        _run(op, x.to(torch.int32))
    with pytest.raises(DTypeError, match="^x: .*got fp64"):
        _run(op, x.double())
    with pytest.raises(DTypeError, match="^dtype: expected torch.int8 or torch.float8_e4m3fn, got torch.uint8"):
        _run(op, x, torch.uint8)
    if op == "quantize_per_tensor":
        with pytest.raises(DTypeError, match="^scale: expected dtype fp32"):
            quantize_per_tensor(x, scale=torch.ones((), dtype=torch.float16, device=device))


# ---------------------------------------------------------------- device


def _other_device(device):
    """A device other than ``device`` that a test can always allocate on: the CPU beside a GPU, meta beside
    the CPU."""
    return torch.device("cpu") if torch.device(device).type == "cuda" else torch.device("meta")


@pytest.mark.parametrize("where", ["mixed", pytest.param("other_gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op", OPS)
def test_device(device, op, where):
    """mixed: a second tensor on another device than the first is named (quantize_per_token takes one tensor:
    nothing to mix). other_gpu: everything on a second GPU gives the right result there, and a mix of the
    two GPUs is named. Meta inputs: test_device_meta_inputs."""
    if where == "mixed":
        x = _randn(4, 8, device=device)
        other = _other_device(device)
        if op == "quantize_per_token":
            pytest.skip("one tensor argument: no mix to make")
        if op == "quantize_per_tensor":
            with pytest.raises(DeviceError, match="^scale: expected a tensor on"):
                quantize_per_tensor(x, scale=torch.ones((), device=other))
            with pytest.raises(DeviceError, match="^scale: expected a tensor on"):
                quantize_per_tensor(torch.empty(4, 8, device=other), scale=torch.ones((), device=device))
            return
        with pytest.raises(DeviceError, match="^b: expected a tensor on"):
            vec_add(x, x.to(other))
        with pytest.raises(DeviceError, match="^b: expected a tensor on"):
            vec_add(x.to(other), x)
        with pytest.raises(DeviceError, match="^out: expected a tensor on"):
            vec_add(x, x, out=torch.empty(4, 8, device=other))
        return
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    gpu1 = torch.device("cuda", 1)
    x = _randn(5, 33, dtype=torch.bfloat16, device=gpu1)
    with torch.cuda.device(0):  # the current device is not the tensors': the op must follow its inputs
        _assert_matches_ref(op, x)
        out = _run(op, x)
    assert (out if op == "vec_add" else out[0]).device == gpu1
    x0 = x.to("cuda:0")
    if op == "vec_add":
        with pytest.raises(DeviceError, match="^b: expected a tensor on cuda:0"):
            vec_add(x0, x)
    elif op == "quantize_per_tensor":
        with pytest.raises(DeviceError, match="^scale: expected a tensor on cuda:0"):
            quantize_per_tensor(x0, scale=torch.ones((), device=gpu1))


@pytest.mark.parametrize("op", OPS)
def test_device_meta_inputs(op):
    """The ops are not documented to take meta tensors (they are no custom ops with fake implementations);
    either a meta result of the right shape or a FlyDSL error naming the input is acceptable."""
    x = torch.empty(4, 8, device="meta")
    try:
        out = _run(op, x)
    except FlyDSLError as e:
        assert str(e).startswith(("x:", "a:")), str(e)
        return
    first = out if op == "vec_add" else out[0]
    assert first.is_meta and first.shape == x.shape


# ---------------------------------------------------------------- shape


@pytest.mark.parametrize("op", OPS)
def test_shape(device, op):
    """A 0-d x (the quantizers need a last dim), a static scale of more than one element, and vec_add's
    operands or out of another shape are named. (Also: test_common_quant.py::test_bad_inputs_are_named.)"""
    x = _randn(4, 8, device=device)
    if op == "vec_add":
        with pytest.raises(ShapeError, match=r"^b: expected shape \(4, 8\) \(the shape of a\)"):
            vec_add(x, x[:, :7])
        with pytest.raises(ShapeError, match=r"^b: expected shape"):
            vec_add(x, x[None])
        with pytest.raises(ShapeError, match=r"^out: expected shape \(4, 8\)"):
            vec_add(x, x, out=torch.empty(4, 9, device=device))
        return
    with pytest.raises(ShapeError, match="^x: expected at least 1 dimension"):
        _run(op, torch.tensor(1.0, device=device))
    if op == "quantize_per_tensor":
        with pytest.raises(ShapeError, match="^scale: expected a single element"):
            quantize_per_tensor(x, scale=torch.ones(2, 2, device=device))


# ---------------------------------------------------------------- stride


@pytest.mark.parametrize("op", OPS)
def test_stride(device, op):
    """Strided rows (a row stride, a column offset, a strided leading dim) give the reference; a non-unit last
    stride is a LayoutError naming x for the quantizers (their docstrings: "the last dim must be
    contiguous"), and the right sum for vec_add (its docstring: non-contiguous inputs are copied), whose out
    must be contiguous (named)."""
    base = _randn(3, 6, 40, dtype=torch.bfloat16, device=device)
    _assert_matches_ref(op, base[:, ::2, 3:36])
    _assert_matches_ref(op, base[1, ::2, 3:36])
    xt = _randn(33, 5, dtype=torch.bfloat16, device=device, seed=3).t()
    if op == "vec_add":
        _assert_matches_ref(op, xt)
        c = vec_add(xt, base[0, :5, :33])
        assert_rel_close(c, vec_add_ref(xt, base[0, :5, :33]))
        with pytest.raises(LayoutError, match="^out: must be contiguous"):
            vec_add(xt, xt, out=torch.empty(33, 5, dtype=torch.bfloat16, device=device).t())
        return
    with pytest.raises(LayoutError, match="^x: the last dimension must be contiguous"):
        _run(op, xt)


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_alignment(device, op, dtype):
    """Inputs (and vec_add's out) starting one element past an aligned base, odd row widths and strides: the
    reference, nothing misread by vector loads."""
    m, n = 5, 33
    x = _randn(m * n + 1, dtype=dtype, device=device, seed=7)[1:].view(m, n)
    assert x.data_ptr() % 16 != 0
    _assert_matches_ref(op, x)
    _assert_matches_ref(op, _randn(m * 35 + 1, dtype=dtype, device=device, seed=8)[1:].view(m, 35)[:, :n])
    if op in QUANT:
        _assert_matches_ref(op, x, torch.float8_e4m3fn)
        return
    out = torch.empty(m * n + 1, dtype=dtype, device=device)[1:].view(m, n)
    b = _randn(m * n + 3, dtype=dtype, device=device, seed=9)[3:].view(m, n)
    assert vec_add(x, b, out=out) is out
    assert_rel_close(out, vec_add_ref(x, b))


# ---------------------------------------------------------------- empty


@pytest.mark.parametrize("op", OPS)
def test_empty(device, op):
    """Zero rows, zero columns, and an empty 3-D input give empty results of the right shapes (per tensor: a
    zero scale, as an all-zero tensor's), no launch. (Also: test_common_vec_add.py::test_empty.)"""
    for shape in [(0, 8), (4, 0), (2, 0, 8)]:
        x = torch.empty(shape, device=device)
        out = _run(op, x)
        if op == "vec_add":
            assert out.shape == shape and out.dtype == x.dtype
            continue
        q, s = out
        assert q.shape == shape and q.dtype == torch.int8 and s.dtype == torch.float32
        if op == "quantize_per_token":
            assert s.shape == shape[:-1]  # its values, with zero columns: test_empty_quantize_per_token_zero_columns
        else:
            assert s.shape == () and s.item() == 0.0


def test_empty_quantize_per_token_zero_columns(device):
    x = torch.empty(64, 0, device=device)
    # torch's deterministic mode fills uninitialized memory with NaN: the result cannot be zero by chance
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _, s = quantize_per_token(x, torch.int8)
    finally:
        torch.use_deterministic_algorithms(was)
    _, sr = quantize_per_token_ref(x, torch.int8)
    assert torch.equal(s, sr), s


# ---------------------------------------------------------------- huge dimension


@pytest.mark.gpu
def test_huge_dimension():
    """quantize_per_token over bf16 [2^31 / N + 3, N]: 2^31 + 3 N elements, so the last rows start past
    int32 offsets; those rows and the rows around element 2^31 match the reference computed on them."""
    n = 4096
    m = 2**31 // n + 3
    need = 2 * m * n + m * n + (1 << 30)  # x (bf16), q (int8) and headroom
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free on the GPU")
    x = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    x.normal_(generator=torch.Generator("cuda").manual_seed(0))
    q, s = quantize_per_token(x, torch.int8)
    boundary = 2**31 // n
    rows = [0, boundary - 1, boundary, boundary + 1, m - 2, m - 1]
    qr, sr = quantize_per_token_ref(x[rows], torch.int8)
    assert_quant_close(q[rows], s[rows], qr, sr, x=x[rows])
    del x, q, s
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- NaN / Inf


# A width that is no power of two: the row blocks hold padding lanes, as most real widths do.
NAN_N = 13


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_nan_inf(device, op, qdtype):
    """vec_add: NaN and Inf as torch's sum (inf + -inf = NaN). The quantizers: a row (tensor) holding +-inf
    gets an infinite scale, as the reference, so its dequantization is not finite; the finite rows are
    unaffected (per token). NaN inputs: test_nan_inf_quantize_nan."""
    if op == "vec_add":
        if qdtype != torch.int8:
            pytest.skip("vec_add has no quantized dtype")
        a = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), float("inf"), 2.0], device=device)
        b = torch.tensor([1.0, 2.0, 1.0, 1.0, float("-inf"), float("nan")], device=device)
        c, ref = vec_add(a, b), a + b
        assert torch.equal(torch.isnan(c), torch.isnan(ref)) and torch.isnan(c).sum() == 3
        assert torch.equal(c[~torch.isnan(ref)], ref[~torch.isnan(ref)])
        return
    x = _randn(3, NAN_N, device=device)
    x[1, 5] = float("-inf")
    x[2, 0] = float("inf")
    q, s = _run(op, x, qdtype)
    if op == "quantize_per_token":
        _, sr = quantize_per_token_ref(x, qdtype)
        assert s[1:].tolist() == [float("inf")] * 2 == sr[1:].tolist()
        assert not torch.isfinite(q[1:].float() * s[1:, None]).all(-1).any()  # rows 1, 2 dequantize non-finite
        assert_quant_close(q[:1], s[:1], *quantize_per_token_ref(x[:1], qdtype), x=x[:1])
    else:
        assert s.item() == float("inf") == quantize_per_tensor_ref(x, qdtype)[1].item()
        assert not torch.isfinite(q.float() * s).any()


@pytest.mark.parametrize("case", ["nan_among_finite", "all_nan"])
@pytest.mark.parametrize("op", QUANT)
def test_nan_inf_quantize_nan(device, op, case):
    """A row (tensor) holding a NaN gets a NaN scale, as torch's amax gives it (the abs-max dropped NaN: a
    finite scale with the NaN coded as finite values)."""
    x = _randn(2, NAN_N, device=device)
    if case == "all_nan":
        x[1, :] = float("nan")
    else:
        x[1, 3] = float("nan")
    per_token = op == "quantize_per_token"
    q, s = _run(op, x) if per_token else _run(op, x[1:])
    sr = quantize_per_token_ref(x, torch.int8)[1][1:] if per_token else quantize_per_tensor_ref(x[1:], torch.int8)[1]
    assert torch.isnan(sr).all()
    s = s[1:] if per_token else s
    assert torch.isnan(s).all(), f"scale of a row / tensor holding a NaN: {s}"
