"""Property-based fuzzing of every fly-gemm op against its fp64 reference (hypothesis).

Each draw picks M, N, K (0, 1, odd sizes and each threshold of the config functions +-1: the interpreter's
row tiles of 16 / 32 and its 32-wide column and K tiles, K not a multiple of 16, the staging threshold of
:mod:`fly_gemm._staging`; on a GPU also the decode sizes, the tile widths and split-K of
:func:`fly_gemm.autotune.default_config`), operand layouts (contiguous, transposed storage, rows sliced out
of wider storage, ``b_layout="kn"``), dtypes, the optional arguments (bias and its dtype, activation,
scales as numbers / one-element / per-row / per-column tensors, ``out``, an explicit config) and values that
stress the numerics (large magnitudes, rows of one value, NaN).

Profiles: ``cpu`` (the interpreter, small shapes) and ``gpu`` (more cases, larger shapes); ``FLYDSL_FUZZ_EXAMPLES``
and ``FLYDSL_FUZZ_SEED`` override the count and the seed, which every test prints (``flydsl.testing.fuzz``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from fly_gemm import FlyLinear, GemmConfig, gemm, gemm_ref, linear, prepack
from fly_gemm._staging import _MIN_ELEMENTS, _TILED_SMALL_M
from flydsl.errors import FlyDSLError
from flydsl.testing import (
    assert_rel_close,
    default_device,
    empty_poisoned,
    fp8_fast_accum_tolerance,
    gpu_available,
    tolerance,
)
from flydsl.testing.fuzz import banner, finding, fuzz
from flydsl_common.reference import activation_ref, quantize_per_token_ref

GPU = gpu_available()
DEVICE = default_device()
IN_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
ACTIVATIONS = [None, "relu", "silu", "gelu_tanh", "gelu"]

# Sizes where a config changes, +-1. The interpreter's tiles: 16 rows up to M = 16, else 32; 32 columns;
# K steps of 32 (and 16, the vector width staging aligns to). The GPU's decode sizes (M <= 64) and tiles.
_CPU_EDGES = [1, 16, 32, 64]
_GPU_EDGES = [64, 128, 256, 4096]
EDGES = sorted({e + d for e in _CPU_EDGES + (_GPU_EDGES if GPU else []) for d in (-1, 0, 1)} - {-1})
SMALL = 70 if not GPU else 600


@pytest.fixture(autouse=True, scope="module")
def _print_seed():
    print(banner("fly-gemm"))


def _size(lo=0):
    return st.one_of(st.integers(max(lo, 0), SMALL), st.sampled_from([e for e in EDGES if e >= lo]))


@st.composite
def mnk(draw):
    """(M, N, K); now and then the staging threshold ((M + N) * K = 2^16, M past the decode rows of 32)."""
    if draw(st.integers(0, 9)) == 0:
        m, n = _TILED_SMALL_M + 1, draw(st.integers(1, 31))
        k = _MIN_ELEMENTS // (m + n) + draw(st.integers(-1, 1))
        return m, n, k
    return draw(_size()), draw(_size()), draw(_size())


def _rand(shape, dtype, kind, seed_):
    g = torch.Generator().manual_seed(seed_)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if dtype == torch.int8:
        return (x * 40).round().clamp(-127, 127).to(dtype)
    big = {torch.float16: 12.0, torch.bfloat16: 1e15, torch.float8_e4m3fn: 100.0}[dtype]
    if kind == "large":
        x = x * big
    elif kind == "equal" and x.numel():
        x = (torch.randint(-4, 5, (*shape[:-1], 1), generator=g).double() / 2).expand(shape).clone()
    return x.to(dtype)


def _layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as a view of transposed storage, or of rows sliced out of wider storage."""
    if how == "transposed":
        return t.t().contiguous().t()
    if how == "sliced":
        wide = torch.zeros(t.shape[0], t.shape[1] + 5, dtype=t.dtype)
        wide[:, 2 : 2 + t.shape[1]] = t
        return wide[:, 2 : 2 + t.shape[1]]
    return t


# fp8 operands on a GPU: how far (relative) from the output dtype's overflow threshold a result may fall on
# either side of it. Hopper's fast fp8 accumulation errs by ~2^-14 of the terms' magnitude, which, where large
# terms cancel, is more than that of the result: an fp16 C at K = 245 of values ~100 came out 65504 where the
# exact sum rounds to inf.
FP8_OVERFLOW_BAND = 2.0**-6


def _check(out, ref, tol, nan_rows=None, name="C", overflow_band=0.0):
    """NaN exactly where torch puts it (rows of a NaN in A, when K > 0); the rest against the reference.
    ``overflow_band``: results within that relative distance of the output dtype's overflow threshold may be
    the largest finite value or inf (of the reference's sign), and are left out of the error norm."""
    assert out.shape == ref.shape
    if out.dtype == torch.int32:
        assert torch.equal(out.cpu().long(), ref.round().long()), f"{name}: int32 product differs"
        return
    o = out.detach().double().cpu()
    assert torch.equal(torch.isnan(o), torch.isnan(ref)), f"{name}: NaN in other places than torch's"
    if overflow_band and out.dtype != torch.float32:
        fmax = torch.finfo(out.dtype).max
        edge = (o.abs() >= fmax * (1 - overflow_band)) & (o.sign() == ref.sign())
        edge &= torch.isinf(ref) | (ref.abs() >= fmax * (1 - overflow_band))
        ref = torch.where(edge, o, ref)
    inf = torch.isinf(ref)
    assert torch.equal(o[inf], ref[inf]), f"{name}: results past the output dtype's range are not inf as torch's"
    keep = torch.isfinite(ref)
    assert_rel_close(o[keep], ref[keep], tol=tol, name=name)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., C] as [rows, C] (also with no rows or no columns)."""
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


def _tol(out_dtype, in_dtype=None, k=0):
    """The output dtype's budget; fp8 operands on a GPU add into Hopper's fast fp8 accumulator (gemm's
    documented numerics, `fp8_fast_accum_tolerance`), which can exceed an fp32 or fp16 output's budget."""
    if out_dtype == torch.int32:
        return 0.0  # exact (checked by _check)
    tol = tolerance(out_dtype) if out_dtype != torch.float32 else 1e-5
    return max(tol, fp8_fast_accum_tolerance(k)) if GPU and in_dtype == torch.float8_e4m3fn else tol


CPU_CONFIGS = [None, GemmConfig(16, 32, 32, group_m=2, num_stages=1, tma=True),
               GemmConfig(16, 32, 32, group_m=1, num_stages=1, split_k=2)]  # fmt: skip


@fuzz
@given(data=st.data())
def test_fuzz_gemm(data):
    m, n, k = data.draw(mnk())
    dtype = data.draw(st.sampled_from(IN_DTYPES))
    # fp8 NaN is lost by the interpreter's dot (test_fp8_nan_propagates): NaN in fp8 only on a GPU
    nan_ok = dtype != torch.int8 and (GPU or dtype != torch.float8_e4m3fn)
    kind = data.draw(st.sampled_from(["normal", "normal", "large", "equal"] + (["nan"] if nan_ok else [])))
    lay_a = data.draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    lay_b = data.draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    b_layout = data.draw(st.sampled_from(["nk", "kn"]))
    raw_int = dtype == torch.int8 and data.draw(st.booleans())
    out_dtype = (
        torch.int32 if raw_int else data.draw(st.sampled_from([None, torch.float16, torch.bfloat16, torch.float32]))
    )
    bias = None if raw_int else data.draw(st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16]))
    act = None if raw_int else data.draw(st.sampled_from(ACTIVATIONS))
    scale_kinds = ["none", "number", "one", "vector"] if not raw_int else ["none"]
    sa_kind, sb_kind = data.draw(st.sampled_from(scale_kinds)), data.draw(st.sampled_from(scale_kinds))
    give_out = data.draw(st.sampled_from([None, "contiguous", "transposed"]))
    config = data.draw(st.sampled_from(CPU_CONFIGS)) if not GPU else None
    s0 = data.draw(st.integers(0, 2**16))
    note(f"M={m} N={n} K={k} {dtype} {kind} a:{lay_a} b:{lay_b}/{b_layout} out {out_dtype} bias {bias} act {act} "
         f"scales {sa_kind}/{sb_kind} out= {give_out} config {config}")  # fmt: skip

    a = _rand((m, k), dtype, kind, s0)
    b_nk = _rand((n, k), dtype, "normal" if kind == "nan" else kind, s0 + 1)
    nan_rows = None
    if kind == "nan" and m and k:
        nan_rows = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=2, unique=True))
        a[nan_rows, data.draw(st.integers(0, k - 1))] = float("nan")
    a_in = _layout(a, lay_a).to(DEVICE)
    b_in = _layout(b_nk if b_layout == "nk" else b_nk.t().contiguous(), lay_b).to(DEVICE)
    g = torch.Generator().manual_seed(s0 + 2)

    def scale(kind_, size):
        if kind_ == "none":
            return None
        v = torch.rand(size if kind_ == "vector" else 1, generator=g, dtype=torch.float64) + 0.5
        return float(v[0]) if kind_ == "number" else v.float().to(DEVICE)

    sa, sb = scale(sa_kind, m), scale(sb_kind, n)
    bias_t = None if bias is None else torch.randn(n, generator=g, dtype=torch.float64).to(bias).to(DEVICE)
    resolved_out = out_dtype or (dtype if dtype.itemsize == 2 else torch.bfloat16)
    out = None
    if give_out is not None:
        out = empty_poisoned(m, n, dtype=resolved_out, device=DEVICE)
        if give_out == "transposed":
            out = empty_poisoned(n, m, dtype=resolved_out, device=DEVICE).t()
    try:
        c = gemm(a_in, b_in, bias=bias_t, activation=act, out_dtype=out_dtype, scale_a=sa, scale_b=sb, out=out,
                 b_layout=b_layout, config=config)  # fmt: skip
    except FlyDSLError as exc:
        # Refusals allowed by the API: per-tensor numbers under a raw int32 product are excluded above, so only
        # a config that cannot serve this shape (an explicit config the caller chose) may be refused here.
        assert config is not None, f"refused: {type(exc).__name__}: {exc}"
        note(f"refused: {exc}")
        return
    assert c.dtype == resolved_out and c.shape == (m, n)
    if out is not None:
        assert c.data_ptr() == out.data_ptr()
    ref = gemm_ref(a, b_in.cpu(), bias=None if bias_t is None else bias_t.cpu(), activation=act,
                   scale_a=None if sa is None else torch.as_tensor(sa).cpu(),
                   scale_b=None if sb is None else torch.as_tensor(sb).cpu(), b_layout=b_layout)  # fmt: skip
    if resolved_out != torch.float32 and resolved_out != torch.int32:
        # a result past the output dtype's range is inf in torch's own matmul too
        ref = torch.where(torch.isinf(ref.to(resolved_out)), ref.sign() * float("inf"), ref)
    if resolved_out != torch.int32:
        # and one under its smallest value is 0 (silu(-707) = -1e-304 in fp64 is -0.0 in any output dtype)
        ref = torch.where(ref.to(resolved_out) == 0, torch.zeros_like(ref), ref)
    band = FP8_OVERFLOW_BAND if GPU and dtype == torch.float8_e4m3fn else 0.0
    _check(c, ref, _tol(resolved_out, dtype, k), nan_rows, overflow_band=band)


@fuzz
@given(data=st.data())
def test_fuzz_linear(data):
    """linear on N-D inputs (fp16 / bf16 through the kernel, fp32 through torch), bias, activation, weight as
    a tensor or a PackedWeight (quantized per channel or not), forward and backward."""
    m, n, k = data.draw(mnk())
    leads = [(m,), (1, m), (m, 1)] if m else [(0,), (2, 0)]
    lead = data.draw(st.sampled_from(leads))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    packs = [None, "plain", torch.float8_e4m3fn, torch.int8]
    packed = data.draw(st.sampled_from(packs)) if dtype != torch.float32 else None
    has_bias = data.draw(st.booleans())
    act = data.draw(st.sampled_from(ACTIVATIONS))
    grad = data.draw(st.booleans())
    quantized = packed in (torch.float8_e4m3fn, torch.int8)  # NaN through them: test_fp8_nan_propagates
    kind = data.draw(st.sampled_from(["normal", "equal"] + ([] if quantized and not GPU else ["nan"])))
    s0 = data.draw(st.integers(0, 2**16))
    note(f"x {(*lead, k)} w {(n, k)} {dtype} packed={packed} bias={has_bias} act={act} grad={grad} {kind}")
    x = _rand(
        (*lead, k), torch.float16 if dtype == torch.float16 else torch.bfloat16, kind if kind != "nan" else "normal", s0
    ).to(dtype)
    if kind == "nan" and x.numel():
        x.reshape(-1)[0] = float("nan")
    w = _rand((n, k), torch.bfloat16, "normal", s0 + 1).to(dtype)
    bias = (
        torch.randn(n, generator=torch.Generator().manual_seed(s0 + 2), dtype=torch.float64).to(dtype)
        if has_bias
        else None
    )
    weight = w if packed is None else prepack(w.to(DEVICE), quant=None if packed == "plain" else packed)
    xg = x.to(DEVICE).requires_grad_(grad and kind != "nan")
    bg = None if bias is None else bias.to(DEVICE).requires_grad_(grad and kind != "nan")
    wg = weight.to(DEVICE).requires_grad_(grad and kind != "nan") if packed is None else weight
    y = linear(xg, wg, bg, act)
    assert y.shape == (*lead, n) and y.dtype == dtype
    # The forward's pre-activation in fp64: with a quantized weight, of its stored codes and scales and of x
    # quantized per row as the call does; the gradients are those of the function computed (the backward
    # keeps this pre-activation and uses the dequantized weight).
    x2 = _rows(x.detach())
    if packed in (torch.float8_e4m3fn, torch.int8):
        qx, sx = quantize_per_token_ref(x2.float(), packed)
        pre = gemm_ref(qx, weight.weight.cpu(), scale_a=sx, scale_b=weight.scale.cpu())
        w_used = weight.weight.cpu().double() * weight.scale.cpu().double()[:, None]
    else:
        pre = x2.double() @ w.double().t()
        w_used = w.double()
    if bias is not None:
        pre = pre + bias.double()
    pre = pre.detach().requires_grad_()  # a leaf: x and w may require grad themselves
    ref = activation_ref(pre, act)
    _check(_rows(y), ref.detach(), _tol(dtype, packed if quantized else None, k))
    if not xg.requires_grad or y.numel() == 0:
        return
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(s0 + 3), dtype=torch.float64).to(dtype)
    (y * dy.to(DEVICE)).sum().backward()
    if quantized:
        # The activation's derivative at the pre-activation this call computed (gemm through the packed weight,
        # checked against fp64 above): x's codes may differ from the reference's by one step at a rounding tie
        # (assert_quant_close), which moves a row's pre-activation by ~1/16 of one term, and where N is small
        # (N = 1: dx = g[i] * w[j]) gelu' across that shift alone exceeded bf16's budget on the H200.
        with torch.no_grad():
            pre = gemm(_rows(x.detach().to(DEVICE)), weight, bias=None if bias is None else bias.detach().to(DEVICE))
        pre = pre.double().cpu().requires_grad_()
        ref = activation_ref(pre, act)
    (ref * _rows(dy).double()).sum().backward()
    dpre = pre.grad
    tol = tolerance(dtype) if dtype != torch.float32 else 1e-5
    assert_rel_close(xg.grad, (dpre @ w_used).reshape(x.shape), tol=tol, name="dx")
    if packed is None:
        assert_rel_close(wg.grad, dpre.t() @ x2.double(), tol=tol, name="dweight")
    if bias is not None:
        assert_rel_close(bg.grad, dpre.sum(0), tol=tol, name="dbias")


@fuzz
@given(data=st.data())
def test_fuzz_fly_linear(data):
    """FlyLinear against nn.Linear (fp64, the same parameters) then the activation; prepacked layers run
    inference in any grad mode."""
    _, n, k = data.draw(mnk())
    m = data.draw(_size())
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    has_bias, act = data.draw(st.booleans()), data.draw(st.sampled_from(ACTIVATIONS))
    pack = dtype != torch.float32 and data.draw(st.booleans())
    s0 = data.draw(st.integers(0, 2**16))
    note(f"M={m} N={n} K={k} {dtype} bias={has_bias} act={act} prepacked={pack}")
    layer = FlyLinear(k, n, bias=has_bias, device=DEVICE, dtype=dtype, activation=act)
    torch_layer = torch.nn.Linear(k, n, bias=has_bias, dtype=torch.float64)
    g = torch.Generator().manual_seed(s0)
    with torch.no_grad():
        for p, q in zip(layer.parameters(), torch_layer.parameters(), strict=True):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
            q.copy_(p.double().cpu())
    if pack:
        layer.prepack()
    x = torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype)
    y = layer(x.to(DEVICE))
    ref = activation_ref(torch_layer(x.double()), act)
    _check(y, ref.detach(), _tol(dtype))


# ---------------------------------------------------------------- failures the fuzzing found, as fixed examples


@finding
def test_linear_fp16_quantized_weight_dtype():
    """linear's contract: the result has x's dtype (and gemm's: out_dtype defaults to a's for 16-bit a), also
    against a weight prepacked with quant=fp8 / int8, where x is quantized on the fly (they returned bf16, the
    default of the quantized operands); the fp16 result is the product of the quantized operands, as for bf16.
    A quantized prepacked FlyLinear of fp16 gives the same fp16 result."""
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)).half().to(DEVICE)
    w = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    for quant in (torch.float8_e4m3fn, torch.int8):
        packed = prepack(w, quant=quant)
        y = linear(x, packed)
        assert y.dtype == torch.float16, quant
        assert gemm(x, packed).dtype == torch.float16, quant
        assert gemm(x, packed, out_dtype=torch.bfloat16).dtype == torch.bfloat16, quant  # an explicit one stays
        qx, sx = quantize_per_token_ref(x.float().cpu(), quant)
        ref = gemm_ref(qx, packed.weight.cpu(), scale_a=sx, scale_b=packed.scale.cpu())
        _check(y, ref, _tol(torch.float16, quant, 40))
        layer = FlyLinear(40, 5, bias=False, device=DEVICE, dtype=torch.float16)
        with torch.no_grad():
            layer.weight.copy_(w)
        y_layer = layer.prepack(quant=quant)(x)  # grad mode on, a trainable weight: the autograd path
        assert y_layer.dtype == torch.float16 and torch.equal(y_layer.detach(), y), quant


@finding
def test_linear_nd_with_k_zero():
    """F.linear on x [2, 3, 0] and weight [4, 0] gives zeros [2, 3, 4] (plus the bias); so does linear (its
    rows view once inferred the row count from -1, which N = 0 cannot give)."""
    x = torch.zeros(2, 3, 0, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(4, 0, dtype=torch.bfloat16, device=DEVICE)
    bias = torch.arange(4, dtype=torch.bfloat16, device=DEVICE)
    y = linear(x, w, bias)
    assert y.shape == (2, 3, 4) and torch.equal(y, bias.expand(2, 3, 4))


@finding
@pytest.mark.xfail(not GPU, strict=True, reason="the interpreter's fp8 dot drops NaN (the bf16 fix's fp8 case)")
def test_fp8_nan_propagates():
    """A NaN in a row of fp8 A makes that row of C NaN, as in torch (fp16 / bf16 already do): on the
    interpreter the fp8 row comes out finite."""
    a = torch.randn(17, 50, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    b = torch.randn(2, 50, generator=torch.Generator().manual_seed(1)).to(torch.float8_e4m3fn)
    a[3, 9] = float("nan")
    c = gemm(a.to(DEVICE), b.to(DEVICE), out_dtype=torch.float32)
    assert torch.isnan(c[3]).all() and torch.isfinite(c[torch.arange(17) != 3]).all()


@finding
@pytest.mark.parametrize("packed", [None, torch.float8_e4m3fn])
def test_relu_keeps_nan(packed):
    """relu(NaN) is NaN in torch. test_fuzz_linear's draw (x [1, 451, 4097] bf16, fp8 PackedWeight, bias,
    relu, a NaN in x) got a finite row on the H200: relu was the GPU's plain max, which returns the other
    operand (0) for a NaN. Now the epilogue's max propagates NaN, on every path."""
    g = torch.Generator().manual_seed(597)
    x = torch.randn(5, 300, generator=g).to(torch.bfloat16)
    x[2, 7] = float("nan")
    w = torch.randn(40, 300, generator=g).to(torch.bfloat16)
    bias = torch.randn(40, generator=g).to(torch.bfloat16).to(DEVICE)
    weight = w.to(DEVICE) if packed is None else prepack(w.to(DEVICE), quant=packed)
    y = linear(x.to(DEVICE), weight, bias, "relu").float().cpu()
    assert torch.isnan(y[2]).all(), "the NaN row lost its NaN"
    assert torch.isfinite(y[torch.arange(5) != 2]).all() and (y[torch.arange(5) != 2] >= 0).all()
    c = gemm(x.to(DEVICE), w.to(DEVICE), bias=bias, activation="relu").float().cpu()
    assert torch.isnan(c[2]).all() and torch.isfinite(c[torch.arange(5) != 2]).all()
