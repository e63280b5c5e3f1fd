"""Property-based fuzzing of every fly-norm op against its fp64 reference (hypothesis).

Each draw picks a shape (0 and 1 rows and columns, odd widths, and each routing threshold of
:mod:`fly_norm.routing` / :mod:`fly_norm._row_plans` / :mod:`fly_norm.autotune` +-1), a layout (contiguous,
rows sliced out of wider storage, 3-D, transposed where the op takes it), dtypes, the optional arguments and
values that stress the numerics (large and tiny magnitudes, rows of one value, NaN, -inf in softmax).

Two profiles: ``cpu`` (the interpreter; small case counts, widths up to the CPU thresholds) and ``gpu`` (more
cases, the GPU's split / staged / resident thresholds too), chosen by the device; ``FLYDSL_FUZZ_EXAMPLES``
and ``FLYDSL_FUZZ_SEED`` override the count and the seed, which every test prints (``flydsl.testing.fuzz``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from norm_helpers import assert_quant_matches, reference_grads

import fly_norm
from fly_norm import _split_host
from fly_norm._row_plans import PACKED_MIN_N
from fly_norm.reference import (
    layer_norm_quant_ref,
    layer_norm_ref,
    rms_norm_quant_ref,
    rms_norm_ref,
    softmax_ref,
)
from flydsl.errors import FlyDSLError
from flydsl.testing import assert_rel_close, default_device, gpu_available, tolerance
from flydsl.testing.fuzz import banner, finding, fuzz
from flydsl_common.rows import MAX_SINGLE_PASS

GPU = gpu_available()

# Widths where a path or a config changes, +-1: the row kernels' buckets (powers of two), the single pass's
# limit, the backward's single pass (SPLIT_MIN_N_BWD - 1) and softmax's backward split, the packed single
# pass. The GPU adds the split, staged and resident thresholds.
_CPU_EDGES = {256, 1024, 4096, _split_host.SPLIT_MIN_N_BWD - 1, MAX_SINGLE_PASS, PACKED_MIN_N,
              _split_host.SOFTMAX_SPLIT_MIN_N_BWD - 1}  # fmt: skip
_GPU_EDGES = {_split_host.SPLIT_MIN_N, _split_host.FWD_STAGED_MIN_N, _split_host.RESIDENT_MIN_N}
_EDGES = sorted(_CPU_EDGES | (_GPU_EDGES if GPU else set()))
WIDE = sorted({e + d for e in _EDGES for d in (-1, 0, 1)})
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = default_device()


@pytest.fixture(autouse=True, scope="module")
def _print_seed():
    print(banner("fly-norm"))


@st.composite
def row_shapes(draw, max_rows=5):
    """(leading dims, N): N in 1..300 mostly, a threshold +-1 sometimes (then at most 2 rows)."""
    n = draw(st.one_of(*[st.integers(1, 300)] * 4, st.sampled_from(WIDE)))
    rows = draw(st.integers(0, 1 if n > 4096 else max_rows))
    lead = draw(st.sampled_from([(rows,), (1, rows), (rows, 1)] if rows else [(0,), (2, 0)]))
    return lead, n


def _values(shape, dtype, kind, gen_seed):
    g = torch.Generator().manual_seed(gen_seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    big = {torch.float16: 8e3, torch.bfloat16: 1e15, torch.float32: 1e15}[dtype]  # fp16: 8 sigma < 65504
    if kind == "large":
        x = x * big
    elif kind == "tiny":
        x = x * (1e-4 if dtype == torch.float16 else 1e-20)
    elif kind == "equal" and x.numel():
        # rows of one value each (small integers and halves: a row's fp32 sum is exact)
        vals = torch.randint(-8, 9, (*shape[:-1], 1), generator=g).double() / 2
        x = vals.expand(shape).clone()
    return x.to(dtype)


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another layout: rows sliced out of wider storage, or a transposed storage."""
    if how == "sliced":
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
        wide[..., 1 : 1 + x.shape[-1]] = x
        return wide[..., 1 : 1 + x.shape[-1]]
    if how == "transposed" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x


def _nan_rows(x: torch.Tensor, draw) -> torch.Tensor:
    """Put a NaN in some rows of x (in place); returns the rows' mask."""
    rows = x.reshape(-1, x.shape[-1])
    mask = torch.zeros(rows.shape[0], dtype=torch.bool)
    if rows.numel():
        for r in draw(st.lists(st.integers(0, rows.shape[0] - 1), min_size=1, max_size=2)):
            rows[r, draw(st.integers(0, rows.shape[1] - 1))] = float("nan")
            mask[r] = True
    return mask


def _check_rows(out, ref, nan_mask, tol, name):
    """Rows with a NaN input are all NaN (as torch gives); the other rows match the reference."""
    o, r = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    if nan_mask is not None and nan_mask.any():
        assert torch.isnan(o[nan_mask]).all(), f"{name}: a row with a NaN input has non-NaN outputs"
        o, r = o[~nan_mask], r[~nan_mask]
    assert_rel_close(o, r, tol=tol, name=name)


def _check_elementwise(out, ref, tol, name):
    """NaN exactly where the reference has it (an elementwise result); the rest matches."""
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{name}: NaN in other places than the reference's"
    keep = ~torch.isnan(ref)
    assert_rel_close(out[keep], ref[keep], tol=tol, name=name)


def _call_or_named_error(fn):
    """The op's result, or None when it refused the input with one of FlyDSL's own errors."""
    try:
        return fn()
    except FlyDSLError as exc:
        note(f"refused: {type(exc).__name__}: {exc}")
        return None


@st.composite
def norm_cases(draw, layer: bool):
    lead, n = draw(row_shapes())
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["normal", "normal", "large", "tiny", "equal", "nan"]))
    case = {
        "lead": lead, "n": n, "dtype": dtype, "kind": kind, "seed": draw(st.integers(0, 2**16)),
        "layout": draw(st.sampled_from(["contiguous", "sliced", "transposed"])),
        "weight": draw(st.sampled_from([None, "x", torch.float32])),
        "residual": draw(st.sampled_from([None, "x", torch.float32])),
        "eps": draw(st.sampled_from([1e-6, 1e-5, 0.1] + ([] if layer else [None]))),
        "offset": draw(st.sampled_from([0.0, 1.0])),
        "grad": draw(st.booleans()) and kind != "nan",
    }  # fmt: skip
    if layer:
        case["bias"] = draw(st.sampled_from([None, "x", torch.float32]))
    return case


def _operand(spec, dtype, shape, seed_):
    if spec is None:
        return None
    g = torch.Generator().manual_seed(seed_)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype if spec == "x" else spec)


def _run_norm(case, layer: bool, draw):
    if currently_in_test_context():  # (also run directly, by the fixed examples below)
        note(str(case))
    shape, dtype = (*case["lead"], case["n"]), case["dtype"]
    x = _layout(_values(shape, dtype, case["kind"], case["seed"]), case["layout"])
    nan_mask = _nan_rows(x, draw) if case["kind"] == "nan" else None
    w = _operand(case["weight"], dtype, (case["n"],), case["seed"] + 1)
    b = _operand(case.get("bias"), dtype, (case["n"],), case["seed"] + 2) if layer else None
    r = _operand(case["residual"], dtype, shape, case["seed"] + 3)
    leaves = [t.to(DEVICE).requires_grad_(case["grad"]) if t is not None else None for t in (x, w, b, r)]
    xd, wd, bd, rd = (t.detach().to(DEVICE) if t is not None else None for t in leaves)
    xg, wg, bg, rg = leaves
    h_dtype = None if r is None else r.dtype  # residual_out's: the reference rounds h to it as the kernels do,
    # also for the fp64 leaves of the reference gradients
    if layer:
        got = _call_or_named_error(lambda: fly_norm.layer_norm(xg, wg, bg, case["eps"], rg,
                                                               weight_offset=case["offset"]))  # fmt: skip
        ref_fn = lambda x_, w_, b_, r_: layer_norm_ref(x_, w_, b_, case["eps"], r_, case["offset"],  # noqa: E731
                                                       h_dtype=h_dtype)  # fmt: skip
    else:
        got = _call_or_named_error(lambda: fly_norm.rms_norm(xg, wg, case["eps"], rg, weight_offset=case["offset"]))
        eps = torch.finfo(dtype).eps if case["eps"] is None else case["eps"]
        ref_fn = lambda x_, w_, b_, r_: rms_norm_ref(x_, w_, eps, r_, case["offset"], h_dtype=h_dtype)  # noqa: E731
    if got is None:
        # Only layouts the docs exclude may be refused (a last dim that is not contiguous).
        assert case["layout"] == "transposed" and xd.stride(-1) != 1
        return
    y, h = (got, None) if r is None else got
    ref = ref_fn(xd, wd, bd, rd)
    ref_y, ref_h = (ref, None) if r is None else ref
    assert y.shape == xd.shape and y.dtype == dtype
    _check_rows(y, ref_y, nan_mask, tolerance(dtype), "y")
    if h is not None:
        assert h.dtype == r.dtype
        _check_elementwise(h, ref_h, tolerance(r.dtype), "residual_out")
    if not case["grad"] or y.numel() == 0:
        return
    g = torch.Generator().manual_seed(case["seed"] + 4)
    outs = (y,) if h is None else (y, h)
    ups = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(device=DEVICE, dtype=t.dtype) for t in outs]
    sum((t * u).sum() for t, u in zip(outs, ups, strict=True)).backward()
    refs = reference_grads(lambda *t: ref_fn(*t), (xd, wd, bd, rd), ups)
    eps = case["eps"] if case["eps"] is not None else torch.finfo(dtype).eps
    h64 = xd.double() if rd is None else (xd.double() + rd.double()).to(h_dtype).double()
    if layer:
        h64 = h64 - h64.mean(-1, keepdim=True)
    rstd = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    dy_w = ups[0].double() * (1.0 if wd is None else wd.double() + case["offset"])
    terms = torch.linalg.vector_norm(rstd * dy_w).item()  # the size of the terms dx sums
    if h is not None:
        terms += torch.linalg.vector_norm(ups[1].double()).item()
    for leaf, exp, name in zip(leaves, refs, ("dx", "dweight", "dbias", "dresidual"), strict=True):
        if leaf is not None:
            assert leaf.grad is not None, name
            scale = terms if name in ("dx", "dresidual") else 0.0
            tol = tolerance(leaf.dtype)
            if name == "dweight" and r is not None:
                # the backward reads h as saved (residual_out, in the residual's dtype), as torch's
                # `rms_norm(x + r)` saves x + r: the weight's gradient is as exact as that h
                tol = max(tol, tolerance(r.dtype))
            _assert_grad_close(leaf.grad, exp, scale, tol, name)


def _assert_grad_close(got, ref, terms: float, tol: float, name: str):
    """||got - ref|| <= tol * max(||ref||, terms): relative to the larger of the result and the terms it is
    the sum of. A gradient that cancels (a one-column row: dx = rstd * dy * eps / (x^2 + eps), 4e-7 of its
    terms) cannot keep digits that fp32 terms do not hold (torch's own fp32 backward loses 9-73% of it
    there); every other draw is held to the plain relative error, its terms being about its own size."""
    o, r = got.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(o).all(), f"{name}: non-finite gradient"
    if terms == 0.0 and not r.any():  # nothing to be relative to: exactly 0
        assert not o.any(), f"{name}: expected 0, got max {o.abs().max().item()}"
        return
    assert_rel_close(o, r, tol=tol, name=name, terms=terms)


@fuzz
@given(data=st.data())
def test_fuzz_rms_norm(data):
    _run_norm(data.draw(norm_cases(layer=False)), False, data.draw)


@fuzz
@given(data=st.data())
def test_fuzz_layer_norm(data):
    _run_norm(data.draw(norm_cases(layer=True)), True, data.draw)


@fuzz
@given(data=st.data())
def test_fuzz_norm_quant(data):
    """rms_norm_quant / layer_norm_quant: int8 and fp8 e4m3, with and without weight, bias, smooth scale and
    residual (operands in x's dtype; the smooth scale fp32 or x's). A row with a NaN input gets a NaN scale, as
    torch's amax, so it dequantizes to NaN (its codes are unspecified); the other rows match the reference."""
    lead, n = data.draw(row_shapes())
    dtype = data.draw(st.sampled_from(DTYPES))
    qdtype = data.draw(st.sampled_from([torch.int8, torch.float8_e4m3fn]))
    layer = data.draw(st.booleans())
    kind = data.draw(st.sampled_from(["normal", "large", "tiny", "equal", "nan"]))
    layout = data.draw(st.sampled_from(["contiguous", "sliced"]))
    s0 = data.draw(st.integers(0, 2**16))
    opts = {k: data.draw(st.booleans()) for k in ("weight", "bias", "smooth", "residual")}
    smooth_dtype = data.draw(st.sampled_from([torch.float32, dtype]))
    note(f"{lead} {n} {dtype} {qdtype} layer={layer} {kind} {layout} {opts} smooth {smooth_dtype}")
    shape = (*lead, n)
    x = _layout(_values(shape, dtype, kind, s0), layout).to(DEVICE)
    nan_mask = _nan_rows(x, data.draw) if kind == "nan" else None
    w = _operand("x" if opts["weight"] else None, dtype, (n,), s0 + 1)
    b = _operand("x" if opts["bias"] and layer else None, dtype, (n,), s0 + 2)
    sm = None
    if opts["smooth"]:
        sm = (torch.rand(n, generator=torch.Generator().manual_seed(s0 + 5), dtype=torch.float64) + 0.5).to(
            smooth_dtype
        )
    r = _operand("x" if opts["residual"] else None, dtype, shape, s0 + 3)
    w, b, sm, r = (None if t is None else t.to(DEVICE) for t in (w, b, sm, r))
    if layer:
        got = fly_norm.layer_norm_quant(x, w, b, dtype=qdtype, smooth_scale=sm, residual=r)
        ref = layer_norm_quant_ref(x, w, b, dtype=qdtype, smooth_scale=sm, residual=r)
    else:
        got = fly_norm.rms_norm_quant(x, w, dtype=qdtype, smooth_scale=sm, residual=r)
        ref = rms_norm_quant_ref(x, w, dtype=qdtype, smooth_scale=sm, residual=r)
    assert len(got) == len(ref)
    assert got[0].shape == x.shape and got[1].shape == x.shape[:-1]
    if x.numel():
        # the normalized (smoothed) rows in fp64: a code may differ from the reference's only at a rounding tie
        pre = layer_norm_ref(x, w, b, 1e-5, r) if layer else rms_norm_ref(x, w, 1e-6, r)
        pre = (pre if r is None else pre[0]).double() * (1.0 if sm is None else sm.double())
        q, s, pre = got[0].reshape(-1, n), got[1].reshape(-1), pre.reshape(-1, n)
        qr, sr = ref[0].reshape(-1, n), ref[1].reshape(-1)
        if nan_mask is not None:
            bad = nan_mask.to(q.device)
            assert torch.isnan(sr[bad]).all()
            assert torch.isnan(s[bad]).all(), "a row with a NaN input got a non-NaN scale"
            assert torch.isnan(q[bad].float() * s[bad, None]).all(), "a row with a NaN input dequantized to non-NaN"
            q, s, qr, sr, pre = (t[~bad] for t in (q, s, qr, sr, pre))
        assert_quant_matches(q, s, qr, sr, x=pre)
    if r is not None:
        _check_elementwise(got[2], ref[2], tolerance(dtype), "residual_out")


@fuzz
@given(data=st.data())
def test_fuzz_softmax(data):
    """softmax over any dim and layout, forward and backward; -inf entries, rows of only -inf (NaN, as
    torch), NaN rows, large magnitudes, rows of one value."""
    lead, n = data.draw(row_shapes())
    dtype = data.draw(st.sampled_from(DTYPES))
    kind = data.draw(st.sampled_from(["normal", "normal", "large", "equal", "neg-inf", "all-neg-inf", "nan"]))
    layout = data.draw(st.sampled_from(["contiguous", "sliced", "transposed"]))
    s0 = data.draw(st.integers(0, 2**16))
    shape = (*lead, n)
    x = _values(shape, dtype, "equal" if kind == "equal" else "normal", s0)
    if kind == "large":  # large logits: rows close to one-hot (fp16: 4 sigma stays under its 65504)
        x = (x.double() * (3e3 if dtype == torch.float16 else 1e30)).to(dtype)
    rows = x.reshape(-1, n)
    nan_mask = torch.zeros(rows.shape[0], dtype=torch.bool)
    if rows.numel() and kind in ("neg-inf", "all-neg-inf", "nan"):
        pick = data.draw(st.integers(0, rows.shape[0] - 1))
        if kind == "neg-inf":
            rows[pick, data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n))] = float("-inf")
            nan_mask[pick] = bool(torch.isneginf(rows[pick]).all())
        elif kind == "all-neg-inf":
            rows[pick] = float("-inf")
            nan_mask[pick] = True
        else:
            rows[pick, data.draw(st.integers(0, n - 1))] = float("nan")
            nan_mask[pick] = True
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1))
    x = _layout(x, layout).to(DEVICE)
    ref = softmax_ref(x, dim=dim)
    grad = data.draw(st.booleans()) and not torch.isnan(ref).any()
    note(f"{shape} {dtype} {kind} {layout} dim={dim} grad={grad}")
    xg = x.detach().clone().requires_grad_(grad)
    y = fly_norm.softmax(xg, dim=dim)
    assert y.shape == x.shape and y.dtype == dtype
    ref_torch = torch.softmax(x.double(), dim=dim)
    if dim in (-1, x.dim() - 1):
        _check_rows(y, ref, nan_mask, tolerance(dtype), "softmax")
    else:  # NaN rows run along another dim: torch's own result says where NaN goes
        assert torch.equal(torch.isnan(y), torch.isnan(ref_torch))
        finite = ~torch.isnan(ref)
        assert_rel_close(y[finite], ref[finite], tol=tolerance(dtype), name="softmax")
    if grad and y.numel():
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(s0 + 9), dtype=torch.float64).to(dtype)
        (y * dy.to(DEVICE)).sum().backward()
        (gx,) = reference_grads(lambda t: softmax_ref(t, dim=dim), (x,), (dy,))
        terms = torch.linalg.vector_norm(ref.cpu() * dy.double()).item()  # dx = y * dy - y * sum(y * dy)
        _assert_grad_close(xg.grad, gx, terms, tolerance(dtype), "dx")


@fuzz
@given(data=st.data())
def test_fuzz_modules(data):
    """FlyRMSNorm / FlyLayerNorm / FlySoftmax against the torch module they replace, same parameters, in fp64
    (normalized shapes of one and two dims, with and without affine parameters and bias)."""
    lead, n = data.draw(row_shapes(max_rows=3))
    dtype = data.draw(st.sampled_from(DTYPES))
    which = data.draw(st.sampled_from(["rms", "layer", "softmax"]))
    split = data.draw(st.sampled_from([None, 1] + ([n // 2] if n % 2 == 0 and n > 1 else [])))
    affine = data.draw(st.booleans())
    s0 = data.draw(st.integers(0, 2**16))
    shape = (*lead, n) if split is None else (*lead, split, n // split)
    norm_shape = shape[-1:] if split is None else shape[-2:]
    note(f"{which} {shape} {norm_shape} {dtype} affine={affine}")
    x = _values(shape, dtype, "normal", s0).to(DEVICE)
    if which == "softmax":
        dim = data.draw(st.integers(-x.dim(), x.dim() - 1))
        ours, theirs = fly_norm.FlySoftmax(dim), torch.nn.Softmax(dim)
    elif which == "rms":
        eps = data.draw(st.sampled_from([None, 1e-5]))
        ours = fly_norm.FlyRMSNorm(norm_shape, eps=eps, elementwise_affine=affine, device=DEVICE, dtype=dtype)
        # torch's eps=None is the input dtype's epsilon: the fp64 module is given that of the 16/32-bit input
        theirs = torch.nn.RMSNorm(norm_shape, eps=torch.finfo(dtype).eps if eps is None else eps,
                                  elementwise_affine=affine, dtype=torch.float64)  # fmt: skip
    else:
        bias = data.draw(st.booleans())
        ours = fly_norm.FlyLayerNorm(norm_shape, elementwise_affine=affine, bias=bias, device=DEVICE, dtype=dtype)
        theirs = torch.nn.LayerNorm(norm_shape, elementwise_affine=affine, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(s0 + 1), dtype=torch.float64))
            q.copy_(p.double().cpu())
    y = ours(x)
    ref = theirs(x.double().cpu())
    assert y.shape == x.shape
    assert_rel_close(y, ref, tol=tolerance(y.dtype), name=which)


# ---------------------------------------------------------------- failures the fuzzing found, as fixed examples


@finding
def test_norm_bwd_of_a_16_bit_residual_matches_its_forward():
    """layer_norm with a 16-bit residual on rows of one value (one column here). The forward normalized the
    fp32 sum h = x + r while the backward read h back from residual_out (fp16) against the forward's
    statistics, so (h - mean) * rstd, 0 in the forward, became fp16's rounding error times rstd =
    1 / sqrt(eps): dx was off by 7% of its terms. The forward now normalizes the stored (rounded) sum, as
    torch's ``layer_norm(x + r)`` does, and the two agree: one column gives y = bias, dx = dresidual = dh."""
    g = torch.Generator().manual_seed(604)
    x = torch.tensor([[1.5], [-2.0]], dtype=torch.float16, device=DEVICE).requires_grad_()
    r = (torch.randn(2, 1, generator=g) * 3).to(torch.float16).to(DEVICE).requires_grad_()
    w = torch.randn(1, generator=g).to(torch.float16).to(DEVICE).requires_grad_()
    b = torch.randn(1, generator=g).to(DEVICE).requires_grad_()
    y, h = fly_norm.layer_norm(x, w, b, 1e-5, r, weight_offset=1.0)
    dy, dh = torch.ones_like(y), torch.ones_like(h)
    ((y * dy).sum() + (h * dh).sum()).backward()
    assert torch.equal(y, b.detach().to(y.dtype).expand_as(y))
    assert torch.equal(x.grad, dh) and torch.equal(r.grad, dh)


@finding
def test_layer_norm_two_columns_through_a_16_bit_residual():
    """test_fuzz_layer_norm's GPU draw (seed 20261202): rows of two columns, fp16 x, weight, bias and
    residual, offset 1: dx was 1.03e-3 off its fp64 reference (1e-3 allowed), the forward's statistics being
    those of the unrounded sum beside the backward's rounded h (above)."""
    case = {"lead": (2,), "n": 2, "dtype": torch.float16, "kind": "normal", "seed": 2, "layout": "contiguous",
            "weight": "x", "residual": "x", "eps": 1e-05, "offset": 1.0, "grad": True, "bias": "x"}  # fmt: skip
    _run_norm(case, True, None)


@finding
def test_layer_norm_rows_of_one_value_against_an_exact_reference():
    """test_fuzz_layer_norm's GPU draw (seed 20261202): bf16 rows of one value, 107 columns, no weight or bias,
    offset 1, eps 0.1. The kernel's y is the exact 0; the fp64 reference's CUDA mean (a multiply by a rounded
    1 / 107) left each row an ulp from its value, y +-7e-16, so every output was "100% off". The reference
    now divides its sum by the width."""
    case = {"lead": (1, 3), "n": 107, "dtype": torch.bfloat16, "kind": "equal", "seed": 14683,
            "layout": "contiguous", "weight": None, "residual": None, "eps": 0.1, "offset": 1.0, "grad": False,
            "bias": None}  # fmt: skip
    _run_norm(case, True, None)
    x = _values((3, 107), torch.bfloat16, "equal", 14683).to(DEVICE)
    assert torch.equal(layer_norm_ref(x, None, None, 0.1), torch.zeros(3, 107, dtype=torch.float64, device=DEVICE))


@finding
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_fp32_bias_grad_not_rounded_to_weight_dtype(dtype):
    """x and weight 16-bit, bias fp32 (test_fuzz_layer_norm's draw x [1, 5, 110] fp16, fp32 bias): dbias is the
    fp32 column sum of dy and must come back as exact as fp32 holds it. It was computed in the weight's
    dtype (the backward op took one dtype for both parameters' gradients), then cast to fp32: rounded to 16
    bits: 1.7e-4 off here for fp16, 3.1e-3 for bf16 (1e-5 allowed)."""
    g = torch.Generator().manual_seed(13683)
    n = 110
    x = torch.randn(1, 5, n, generator=g).to(dtype).to(DEVICE).requires_grad_()
    w = torch.randn(n, generator=g).to(dtype).to(DEVICE).requires_grad_()
    b = torch.randn(n, generator=g).to(DEVICE).requires_grad_()
    dy = torch.randn(1, 5, n, generator=g).to(dtype)
    (fly_norm.layer_norm(x, w, b, 1e-6, weight_offset=1.0) * dy.to(DEVICE)).sum().backward()
    assert b.grad.dtype == torch.float32 and w.grad.dtype == dtype
    assert_rel_close(b.grad, dy.double().sum((0, 1)), tol=tolerance(torch.float32), name="dbias")


# Widths through each forward path: the row kernels, the packed single pass (bf16), the lane-stats loop and,
# on a GPU, the split and staged paths.
_ONE_VALUE_WIDTHS = [27, 300, 4097, 8192] + ([_split_host.SPLIT_MIN_N, _split_host.FWD_STAGED_MIN_N] if GPU else [])


@finding
@pytest.mark.parametrize("n", _ONE_VALUE_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_of_rows_of_one_value_is_exactly_zero(n, dtype):
    """Rows of one value each (test_fuzz_norm_quant's draw: [1, 1, 27] fp32 of 1.5s, fp8 with a smooth scale):
    the sum is exact, so a correctly rounded mean is exact and every h - mean is 0: LayerNorm's y is exactly
    the bias, and layer_norm_quant's codes and scale exactly 0, as torch's. With Triton's approximate `/` the
    mean missed by an ulp on the H200, and the quantizer scaled ulp * rstd of noise to full-range codes
    (scale 2e-8 against 0)."""
    vals = torch.tensor([1.5, -3.25, 0.5, 6.0], dtype=torch.float64)
    x = vals[:, None].expand(4, n).to(dtype).contiguous().to(DEVICE)
    w = _operand("x", dtype, (n,), 7).to(DEVICE)
    b = _operand("x", dtype, (n,), 8).to(DEVICE)
    y = fly_norm.layer_norm(x, w, b)
    assert torch.equal(y, b.expand_as(y)), "y is not exactly the bias"
    sm = torch.full((n,), 0.75, device=DEVICE)
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        q, s = fly_norm.layer_norm_quant(x, w, None, dtype=qdtype, smooth_scale=sm)
        assert torch.equal(s, torch.zeros_like(s)) and not q.float().any(), qdtype
