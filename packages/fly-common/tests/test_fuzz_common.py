"""Property-based fuzzing of fly-common's public ops against their references (hypothesis).

``quantize_per_token`` / ``quantize_per_tensor`` (int8 and fp8 e4m3, dynamic and static scales) against
:mod:`flydsl_common.reference`, and ``vec_add`` against torch's own sum. Each draw picks a shape (no rows,
no columns, one of each, odd widths, and each width where :func:`flydsl_common.rows.default_row_config`
changes its config +-1: the packed-row buckets up to 2048, the single pass's limit ``MAX_SINGLE_PASS``, the
chunk of 16K / 32K past it; for vec_add its 4096-element block), a layout (contiguous, rows sliced out of
wider storage, 3-D leading dims that do not collapse, a transposed last dim, which the quantizers refuse
as documented), dtypes, an explicit launch config now and then (the two-pass chunked path on small rows),
and values that stress the numerics: large and tiny magnitudes, rows of zeros, rows of one value, NaN and
+-inf rows.

Codes may differ from the reference only at a rounding tie (``assert_quant_close`` given the input); the
scales agree to fp32 rounding. NaN rows get a NaN scale (torch's amax, documented in
``flydsl_common.device.absmax_f32``), rows holding +-inf an infinite scale; their codes are not specified
(``x * inv`` is NaN there), every other row must match.

Profiles: ``cpu`` (the interpreter, 80 cases a test) and ``gpu`` (500, gpu-marked), chosen by the device;
``FLYDSL_FUZZ_EXAMPLES`` and ``FLYDSL_FUZZ_SEED`` override the count and the seed (``flydsl.testing.fuzz``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from flydsl.errors import LayoutError
from flydsl.testing import assert_rel_close, cpu_select, default_device, empty_poisoned, gpu_available
from flydsl.testing.fuzz import banner, finding, fuzz
from flydsl_common import quantize_per_tensor, quantize_per_token, vec_add
from flydsl_common.reference import quantize_per_tensor_ref, quantize_per_token_ref, vec_add_ref
from flydsl_common.rows import MAX_SINGLE_PASS, RowConfig, row_config_valid
from flydsl_common.testing import assert_quant_close

GPU = gpu_available()
DEVICE = default_device()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QDTYPES = [torch.int8, torch.float8_e4m3fn]

# Widths where the default row config changes, +-1: block_n is the next power of two (block_m packs rows up
# to 8K elements a program while block_n <= 2048, one row a program past it), the single pass ends at
# MAX_SINGLE_PASS, and wider rows stream in 16K chunks up to 32K, 32K chunks past it.
_EDGES = [256, 1024, 2048, 4096, MAX_SINGLE_PASS, 2 * MAX_SINGLE_PASS]
WIDE = sorted({e + d for e in _EDGES for d in (-1, 0, 1)})
# vec_add's program covers 4096 elements; 16-element multiples are its vector width
VEC_EDGES = sorted({e + d for e in (16, 4096, 8192) for d in (-1, 0, 1)})


@pytest.fixture(autouse=True, scope="module")
def _print_seed():
    print(banner("fly-common"))


@st.composite
def row_shapes(draw):
    """(leading dims, N): N in 0..300 mostly, a threshold +-1 sometimes (then at most 2 rows)."""
    n = draw(st.one_of(*[st.integers(0, 300)] * 4, st.sampled_from(WIDE)))
    rows = draw(st.integers(0, 2 if n > 2048 else 6))
    lead = draw(st.sampled_from([(rows,), (1, rows), (rows, 1), (2, rows)] if rows else [(0,), (2, 0)]))
    return lead, n


@st.composite
def row_configs(draw, n):
    """None (the default ladder) or an explicit valid RowConfig: small chunks force the two-pass path (on
    rows up to 4096 wide: past that the default streams in chunks itself, and 16-wide chunks of a 32K row
    cost the interpreter seconds)."""
    if n > 4096 or draw(st.integers(0, 3)):
        return None
    single = draw(st.booleans()) and n <= 1024
    block_n = draw(st.sampled_from([16, 32, 64])) if not single else max(16, 1 << max(n - 1, 0).bit_length())
    cfg = RowConfig(1 if not single else draw(st.sampled_from([1, 2, 4])), block_n,
                    draw(st.sampled_from([1, 2, 4])), single)  # fmt: skip
    assert row_config_valid(cfg, n), cfg
    return cfg


def _values(shape, dtype, kind, seed_, draw):
    """fp64 values of ``kind`` in ``dtype``; the mask of rows whose scale is NaN / inf by construction."""
    g = torch.Generator().manual_seed(seed_)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if kind == "large":  # fp16: 8 sigma stays under 65504
        x = x * {torch.float16: 8e3, torch.bfloat16: 1e36, torch.float32: 1e36}[dtype]
    elif kind == "tiny":  # normal numbers of the input dtype, a scale of ~1e-30 / 1e-6
        x = x * (1e-5 if dtype == torch.float16 else 1e-30)
    elif kind == "flush":  # fp32 / bf16 rows whose QMAX / amax overflows (amax ~1e-37; subnormals too): codes 0
        x = x * (1e-5 if dtype == torch.float16 else 2.0**-125)
    x = x.to(dtype)
    rows = x.reshape(-1, shape[-1]) if x.numel() else x.reshape(0, max(shape[-1], 0))
    special = torch.zeros(rows.shape[0], dtype=torch.bool)
    if rows.numel() and kind in ("zeros", "equal", "nan", "inf"):
        picks = draw(st.lists(st.integers(0, rows.shape[0] - 1), min_size=1, max_size=3, unique=True))
        for r in picks:
            if kind == "zeros":
                rows[r] = 0
            elif kind == "equal":  # one value a row, any sign (an exact tie of every element with amax)
                rows[r] = draw(st.sampled_from([-3.0, -0.5, 1.0, 2.5, 448.0, 1e-3]))
            else:
                col = draw(st.integers(0, rows.shape[1] - 1))
                rows[r, col] = float("nan") if kind == "nan" else draw(st.sampled_from([float("inf"), -float("inf")]))
                special[r] = True
    return x, special


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as rows sliced out of wider storage, a 3-D view whose leading dims do not collapse
    into one stride (3-D: a padding row after each block; 2-D: every other row), or a transposed last dim."""
    if how == "sliced":
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
        wide[..., 1 : 1 + x.shape[-1]] = x
        return wide[..., 1 : 1 + x.shape[-1]]
    if how == "gapped" and x.dim() == 3:
        big = torch.zeros(x.shape[0], x.shape[1] + 1, x.shape[2], dtype=x.dtype)
        big[:, : x.shape[1]] = x
        return big[:, : x.shape[1]]
    if how == "gapped" and x.dim() == 2:
        big = torch.zeros(2 * x.shape[0], x.shape[1], dtype=x.dtype)
        big[::2] = x
        return big[::2]
    if how == "transposed" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x


def _refused_as_documented(x: torch.Tensor, exc: Exception) -> None:
    """The quantizers' one documented refusal of a float input: a last dim that is not contiguous."""
    assert isinstance(exc, LayoutError) and x.shape[-1] > 1 and x.stride(-1) != 1, f"refused: {exc!r}"
    note(f"refused: {exc}")


def _check_special_scales(s, sr, special):
    """NaN / inf scales exactly where the reference has them (torch's amax); only there."""
    s, sr = s.reshape(-1).cpu(), sr.reshape(-1).cpu()
    assert torch.equal(torch.isnan(s), torch.isnan(sr)), f"NaN scales at other rows than torch's amax: {s}"
    assert torch.equal(torch.isinf(s), torch.isinf(sr)), f"inf scales at other rows than the reference's: {s}"
    assert torch.equal(~torch.isfinite(sr), special), "the draw's NaN / inf rows are not the non-finite ones"


@fuzz
@given(data=st.data())
def test_fuzz_quantize_per_token(data):
    lead, n = data.draw(row_shapes())
    dtype, qdtype = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(QDTYPES))
    kind = data.draw(st.sampled_from(["normal", "normal", "large", "tiny", "flush", "zeros", "equal", "nan", "inf"]))
    layout = data.draw(st.sampled_from(["contiguous", "sliced", "gapped", "transposed"]))
    cfg = data.draw(row_configs(n))
    s0 = data.draw(st.integers(0, 2**16))
    note(f"{lead} N={n} {dtype} -> {qdtype} {kind} {layout} config {cfg}")
    x, special = _values((*lead, n), dtype, kind, s0, data.draw)
    x = _layout(x, layout).to(DEVICE)
    try:
        q, s = quantize_per_token(x, qdtype, config=cfg)
    except LayoutError as exc:
        _refused_as_documented(x, exc)
        return
    assert q.shape == x.shape and q.dtype == qdtype and q.is_contiguous()
    assert s.shape == x.shape[:-1] and s.dtype == torch.float32
    qr, sr = quantize_per_token_ref(x.cpu(), qdtype)
    if n == 0:  # rows of no columns: an all-zero row's scale
        assert torch.equal(s.cpu(), sr)
        return
    _check_special_scales(s, sr, special)
    ok = ~special
    q2, s2, x2 = cpu_select(q.reshape(-1, n), ok), s.reshape(-1).cpu()[ok], x.reshape(-1, n).cpu()[ok]
    assert_quant_close(q2, s2, cpu_select(qr.reshape(-1, n), ok), sr.reshape(-1)[ok], per_token=True, x=x2)
    zero = (x2 == 0).all(-1)
    assert (s2[zero] == 0).all() and (cpu_select(q2, zero).float() == 0).all(), "a row of zeros: scale 0 and codes 0"


@fuzz
@given(data=st.data())
def test_fuzz_quantize_per_tensor(data):
    """Dynamic (scale = amax / QMAX over the whole tensor) and static (a given fp32 scale of one element,
    0-d or [1]; a scale of 0 gives codes 0, a small one saturates)."""
    lead, n = data.draw(row_shapes())
    dtype, qdtype = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(QDTYPES))
    static = data.draw(st.sampled_from([None, "0-d", "[1]"]))
    kinds = ["normal", "normal", "large", "tiny", "flush", "zeros", "equal"] + ([] if static else ["nan", "inf"])
    kind = data.draw(st.sampled_from(kinds))
    layout = data.draw(st.sampled_from(["contiguous", "sliced", "gapped", "transposed"]))
    cfg = data.draw(row_configs(n))
    s0 = data.draw(st.integers(0, 2**16))
    x, special = _values((*lead, n), dtype, kind, s0, data.draw)
    scale = None
    if static:
        v = data.draw(st.sampled_from([0.0, 1e-3, 0.01, 0.5, 3.0]))
        scale = torch.tensor(v if static == "0-d" else [v], dtype=torch.float32)
    note(f"{lead} N={n} {dtype} -> {qdtype} {kind} {layout} scale {scale} config {cfg}")
    x = _layout(x, layout).to(DEVICE)
    try:
        q, s = quantize_per_tensor(x, qdtype, scale=None if scale is None else scale.to(DEVICE), config=cfg)
    except LayoutError as exc:
        _refused_as_documented(x, exc)
        return
    assert q.shape == x.shape and q.dtype == qdtype and s.shape == () and s.dtype == torch.float32
    qr, sr = quantize_per_tensor_ref(x.cpu(), qdtype, scale=scale)
    if x.numel() == 0:
        assert s.item() == sr.item()
        return
    if special.any():  # a NaN / inf anywhere: the whole tensor's scale is NaN / inf, as the reference's
        assert torch.equal(torch.isnan(s.cpu()), torch.isnan(sr)) and torch.equal(torch.isinf(s.cpu()), torch.isinf(sr))
        assert not torch.isfinite(sr)
        return
    assert_quant_close(q.cpu(), s.cpu(), qr, sr, per_token=False, x=x.cpu())
    if scale is not None and scale.item() == 0:
        assert (q.float() == 0).all(), "a scale of 0: codes 0"


@fuzz
@given(data=st.data())
def test_fuzz_vec_add(data):
    """a + b for fp32 / fp16 / bf16 / int32 of any shape and layout (the op copies non-contiguous inputs),
    ``out`` given or not; NaN and +-inf where torch's sum has them. 16-bit sums are added in fp32 and
    rounded once, as torch's CPU add: equal to it bit for bit; int32 wraps around as torch's."""
    dtype = data.draw(st.sampled_from(DTYPES + [torch.int32]))
    numel = data.draw(st.one_of(st.integers(0, 300), st.sampled_from(VEC_EDGES)))
    shapes = [(numel,), (1, numel), (numel, 1)] + ([(2, numel // 2)] if numel % 2 == 0 else [])
    shape = data.draw(st.sampled_from(shapes))
    lay_a, lay_b = (data.draw(st.sampled_from(["contiguous", "sliced", "transposed"])) for _ in range(2))
    kind = data.draw(st.sampled_from(["normal", "large", "nan-inf"] if dtype != torch.int32 else ["normal", "wrap"]))
    give_out = data.draw(st.booleans())
    s0 = data.draw(st.integers(0, 2**16))
    note(f"{shape} {dtype} {kind} a:{lay_a} b:{lay_b} out={give_out}")
    g = torch.Generator().manual_seed(s0)
    if dtype == torch.int32:
        hi = 2**31 if kind == "wrap" else 1000
        a, b = (torch.randint(-hi, hi, shape, generator=g, dtype=torch.int64).to(torch.int32) for _ in range(2))
    else:
        big = {torch.float16: 3e4, torch.bfloat16: 1e38, torch.float32: 1e38}[dtype] if kind == "large" else 1.0
        a, b = ((torch.randn(shape, generator=g, dtype=torch.float64) * big).to(dtype) for _ in range(2))
        if kind == "nan-inf" and a.numel():
            specials = [float("nan"), float("inf"), -float("inf")]
            for t in (a, b):
                for i in data.draw(st.lists(st.integers(0, t.numel() - 1), max_size=3)):
                    t.view(-1)[i] = data.draw(st.sampled_from(specials))
    a_in, b_in = _layout(a, lay_a).to(DEVICE), _layout(b, lay_b).to(DEVICE)
    out = empty_poisoned(*shape, dtype=dtype, device=DEVICE) if give_out else None
    c = vec_add(a_in, b_in, out=out)
    assert c.shape == a.shape and c.dtype == dtype
    if out is not None:
        assert c.data_ptr() == out.data_ptr()
    want = a + b  # torch's own sum (16-bit: in fp32, rounded once; int32: wrapping)
    got = c.cpu()
    if dtype == torch.int32:
        assert torch.equal(got, want), "int32 sums differ from torch's"
        return
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN in other places than torch's"
    keep = ~torch.isnan(want)
    assert torch.equal(got[keep], want[keep]), "sums differ from torch's correctly rounded ones"
    fin = torch.isfinite(want)
    assert_rel_close(got[fin], vec_add_ref(a, b)[fin], dtype=dtype, name="vec_add")


# ---------------------------------------------------------------- failures the fuzzing found, as fixed examples


@finding
@pytest.mark.parametrize("qdtype", QDTYPES, ids=str)
@pytest.mark.parametrize("op", ["per_token", "per_tensor"])
def test_quantize_row_of_tiny_values_flushes_to_zero(op, qdtype):
    """A row whose amax is tiny (2^-124 ~ 4.7e-38, a normal fp32 and bf16 number) has the inverse scale
    QMAX / amax = 127 * 2^124 past fp32's range. It was inf: every nonzero element saturated to +-QMAX (x =
    q * scale off by up to 4x: -2^-126 dequantized as -2^-124) and a zero became 0 * inf = NaN (fp8: a NaN
    code), kernels and references alike. Now the inverse is 0 there: codes 0, the row dequantizes to 0 (off
    by less than its values' size; its scale, amax / QMAX, is subnormal). A row at 2^-110, whose inverse is
    finite, keeps its codes."""
    a = 2.0**-124
    x = torch.tensor([[a, 0.75 * a, -0.25 * a, 0.0], [2.0**-110, 0.5 * 2.0**-110, -(2.0**-112), 0.0]])
    rows = [0, 1] if op == "per_token" else [0]  # per tensor: the tiny row alone (one amax for the tensor)
    op_fn, ref_fn = {"per_token": (quantize_per_token, quantize_per_token_ref),
                     "per_tensor": (quantize_per_tensor, quantize_per_tensor_ref)}[op]  # fmt: skip
    x = x[rows]
    q, s = op_fn(x.to(DEVICE), qdtype)
    q = q.float().cpu()
    ref_q, ref_s = ref_fn(x, qdtype)
    assert torch.equal(q, ref_q.float()) and torch.equal(s.cpu(), ref_s), (q, ref_q)
    assert torch.equal(q[0], torch.zeros(4)), "the tiny row: codes 0 (not saturated, no NaN)"
    if 1 in rows:  # 448 or 127 times (1, 1/2, -1/4, 0), exact
        qmax = 127.0 if qdtype == torch.int8 else 448.0
        want = torch.tensor([qmax, qmax / 2, -qmax / 4, 0.0])
        assert torch.equal(q[1], want.round() if qdtype == torch.int8 else want), q[1]
