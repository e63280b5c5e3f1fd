"""The split paths (rows of 16K-32K+ columns over several programs of one wave; GPU only): norm forward, softmax."""

from __future__ import annotations

import sys

import pytest
import torch
from norm_helpers import assert_quant_matches, randn, reference_grads

import flydsl.arch
import flydsl.compiler as flyc
from fly_norm import layer_norm, layer_norm_quant, rms_norm, rms_norm_quant
from fly_norm._split_host import SPLIT_MIN_N, SPLIT_MIN_N_BWD, launch_fwd_split
from fly_norm.reference import (
    layer_norm_quant_ref,
    layer_norm_ref,
    rms_norm_quant_ref,
    rms_norm_ref,
    softmax_bwd_ref,
    softmax_ref,
)
from fly_norm.routing import Path, resident_config, route
from fly_norm.softmax import softmax, softmax_bwd, softmax_bwd_config, softmax_config, softmax_fwd
from flydsl import direct
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance


def test_split_path_is_never_taken_by_the_interpreter_or_for_narrow_rows():
    arch = flydsl.arch.current()
    for op in ("rms_norm", "layer_norm", "softmax"):
        assert route(op, torch.float32, 4, SPLIT_MIN_N - 1, arch).path is Path.ROWS
        assert (route(op, torch.float32, 4, SPLIT_MIN_N, arch).path is Path.SPLIT) == (not flyc.interpreting())
    bwd = route("layer_norm", torch.float32, 4, SPLIT_MIN_N_BWD, arch, backward=True)
    assert (bwd.path is Path.ROWS) == flyc.interpreting()


def _resident(x2, y2) -> bool:
    """Whether softmax's forward routes these rows to the resident kernel."""
    return sys.modules["fly_norm.softmax"].fwd_route(x2, y2).path is Path.RESIDENT


def _staged_bwd(h2, dy2, dres2, dx2) -> bool:
    """Whether a norm backward's split path over these rows is the staged kernel."""
    from fly_norm import _split_host as split

    return split.norm_bwd_split_route(h2, dy2, dres2, dx2, True).path is Path.STAGED


def _staged_fwd(x2, y2, packed=None) -> bool:
    """Whether a plain norm forward's split path is the staged kernel; ``packed``: LayerNorm's (weight, bias)
    (None: RMSNorm's, whose weight the kernel does not hold as words)."""
    from fly_norm import _split_host as split

    w, b = packed or (None, None)
    return split.norm_split_route(x2, y2, w, b, None, None, packed is None, False).path is Path.STAGED


# (M, N): one slice short (40000 = 16384 + 16384 + 7232: 3 slices, padded to 4), an odd width
# (65537: a 1-column last slice), more rows than the wave has row groups, the widest rows.
SPLIT_SHAPES = [(5, 40000), (3, 65537), (300, 65536), (40, 262144), (2, 1048576)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", SPLIT_SHAPES)
def test_split_forward_matches_reference(dtype, m, n):
    x = randn(m, n, dtype=dtype, device="cuda", scale=2.0) + 0.5
    w = randn(n, dtype=dtype, device="cuda", seed=1)
    b = randn(n, dtype=dtype, device="cuda", seed=2)
    assert_rel_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert_rel_close(layer_norm(x, w, b, 1e-5), layer_norm_ref(x, w, b, 1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [*SPLIT_SHAPES, (5, 524288 + 6), (3, 1048576 + 2050)])
def test_split_softmax_backward_waits(m, n):
    """The split softmax backward's wait (collect_sum), five times over the same rows (a stale slot read as 0
    would leave a slice out of a row now and then): dx right every time. Rows of 256K+ columns take
    slices of 8192 (split.SOFTMAX_BWD_SLICE_WIDE): 65 of them at 512K + 6 columns, 129 at 1M + 2050 (the last
    slice short)."""
    from fly_norm import _split_host as split

    x = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2.0)
    dy = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=3)
    y = torch.softmax(x.float(), -1).to(torch.bfloat16)
    ref = softmax_bwd_ref(dy, y)
    for _ in range(5):
        dx = empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
        assert split.launch_softmax_bwd_split(dy, y, dx)
        assert_rel_close(dx, ref, tol=2 * tolerance(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("m,n", SPLIT_SHAPES[:4])
def test_wide_slices_match_reference(monkeypatch, is_rms, m, n):
    """The split kernels with the wide rows' 8192-column slices (split.FWD_SLICE_WIDE) at every width, on
    real wide rows, twice (the exchange): the norms with a residual, stats and the quantized output;
    softmax forward and backward."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "WIDE_MIN_N", 0)
    x = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2.0) + 0.5
    r = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=3)
    w = randn(n, dtype=torch.bfloat16, device="cuda", seed=1)
    b = None if is_rms else randn(n, dtype=torch.bfloat16, device="cuda", seed=2)
    for _ in range(2):
        y, h = (empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        rstd = empty_poisoned(m, dtype=torch.float32, device="cuda")
        mean = None if is_rms else empty_poisoned(m, dtype=torch.float32, device="cuda")
        assert split.launch_fwd_split(x, r, w, b, None, y, h, mean, rstd, None, 1e-5, 0.0, is_rms, 0, 127.0)
        ref = rms_norm_ref(x, w, 1e-5, r) if is_rms else layer_norm_ref(x, w, b, 1e-5, r)
        assert_rel_close(y, ref[0])
        assert_rel_close(h, ref[1])
    y = empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    assert split.launch_softmax_fwd_split(x, y)
    assert_rel_close(y, softmax_ref(x))
    dx = empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    assert split.launch_softmax_bwd_split(r, y, dx)
    assert_rel_close(dx, softmax_bwd_ref(r, y), tol=2 * tolerance(torch.bfloat16))
    if is_rms:
        q = torch.empty(m, n, dtype=torch.int8, device="cuda")
        scale = empty_poisoned(m, dtype=torch.float32, device="cuda")
        assert split.launch_fwd_split(x, None, w, None, None, q, None, None, None, scale, 1e-6, 0.0, True, 1, 127.0)
        assert_quant_matches(q, scale, *rms_norm_quant_ref(x, w, 1e-6, dtype=torch.int8))


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [True, False])
def test_split_low_level_writes_every_element_and_the_stats(is_rms):
    """Strided rows, fused residual, fp32 weight with bf16 rows, (1 + w), a large mean; poisoned outputs."""
    m, n = 67, 50000
    base = randn(m, n + 64, dtype=torch.bfloat16, device="cuda", scale=3.0) + 100.0  # |mean| >> std
    x2 = base[:, 32 : 32 + n]
    r2 = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=3)
    w = randn(n, dtype=torch.float32, device="cuda", seed=4)
    b = None if is_rms else randn(n, dtype=torch.float32, device="cuda", seed=5)
    y_buf = empty_poisoned(m, n + 16, dtype=torch.bfloat16, device="cuda")
    y2 = y_buf[:, :n]
    h2 = empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    rstd = empty_poisoned(m, dtype=torch.float32, device="cuda")
    mean = None if is_rms else empty_poisoned(m, dtype=torch.float32, device="cuda")
    assert launch_fwd_split(x2, r2, w, b, None, y2, h2, mean, rstd, None, 1e-5, 1.0, is_rms, 0, 127.0)
    h = (x2.double() + r2.double()).to(torch.bfloat16).double()  # normalized as residual_out stores it
    assert_rel_close(h2, h)
    if is_rms:
        ref = rms_norm_ref(x2, w, 1e-5, r2, 1.0)[0]
        ref_rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-5)
    else:
        ref = layer_norm_ref(x2, w, b, 1e-5, r2, 1.0)[0]
        ref_rstd = torch.rsqrt(h.var(-1, unbiased=False) + 1e-5)
        assert_rel_close(mean, h.mean(-1), tol=1e-5)
    assert_rel_close(y2, ref)
    assert torch.isnan(y_buf[:, n:].float()).all()  # columns past the view untouched
    assert_rel_close(rstd, ref_rstd, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiled",
    ["staged", None, (1024, 4, None, 4), (1024, 4, None, 4, 1), (1024, 4, None, 2, 2)],
    ids=["staged", "resident", "tiled", "lead", "lead2"],
)
@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("m,n", [(300, 16384), (5, 40000), (2, 262144)])
def test_split_backward_with_fused_residual(is_rms, m, n, tiled, monkeypatch):
    """dx, the residual's gradient, dweight (fp32 weight, (1 + w)) and dbias through the split backward (the
    staged kernel, bf16's default; the register-resident kernel and the tiled one, with and without its
    lead). RMSNorm at 16K with a residual gradient: not the single pipelined pass (routing.route)."""
    from fly_norm import _split_host as split

    if tiled != "staged":
        monkeypatch.setattr(split, "BWD_STAGED", None)
        tiled = None if tiled is None else split.TiledConfig(*tiled)
        monkeypatch.setattr(split, "BWD_TILED", tiled)
        monkeypatch.setattr(split, "LN_BWD_TILED", tiled)
    x = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2.0)
    r = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=1)
    w = randn(n, device="cuda", seed=2) * 0.1
    b = None if is_rms else randn(n, device="cuda", seed=3)
    dy = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=4)
    dh = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=5)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)] + ([] if is_rms else [b.clone().requires_grad_()])
    if is_rms:
        y, h = rms_norm(leaves[0], leaves[2], 1e-6, residual=leaves[1], weight_offset=1.0)

        def ref(a, rr, ww):
            return rms_norm_ref(a, ww, 1e-6, rr, 1.0)
    else:
        y, h = layer_norm(leaves[0], leaves[2], leaves[3], 1e-5, residual=leaves[1], weight_offset=1.0)

        def ref(a, rr, ww, bb):
            return layer_norm_ref(a, ww, bb, 1e-5, rr, 1.0)
    ((y.float() * dy.float()).sum() + (h.float() * dh.float()).sum()).backward()
    expected = reference_grads(ref, (x, r, w) if is_rms else (x, r, w, b), (dy, dh))
    for leaf, exp, name in zip(leaves, expected, ["x", "residual", "weight", "bias"], strict=False):
        assert_rel_close(leaf.grad, exp, name=f"d{name}", tol=tolerance(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("m,n", [(5, 40000), (70, 65536)])
def test_split_quantized_forward(qdtype, m, n):
    """Quantized output through the split path: a second exchange of the slices' |y| maxima; SmoothQuant, residual."""
    x = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2.0)
    r = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=1)
    w = randn(n, dtype=torch.bfloat16, device="cuda", seed=2)
    b = randn(n, dtype=torch.bfloat16, device="cuda", seed=3)
    smooth = torch.rand(n, device="cuda") + 0.5
    q, s, h = rms_norm_quant(x, w, 1e-6, dtype=qdtype, smooth_scale=smooth, residual=r)
    qr, sr, hr = rms_norm_quant_ref(x, w, 1e-6, dtype=qdtype, smooth_scale=smooth, residual=r)
    assert_quant_matches(q, s, qr, sr)
    assert_rel_close(h, hr)
    q, s = layer_norm_quant(x, w, b, 1e-5, dtype=qdtype)
    assert_quant_matches(q, s, *layer_norm_quant_ref(x, w, b, 1e-5, dtype=qdtype))


# ---------------------------------------------------------------- softmax


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n", [*SPLIT_SHAPES, (9, 20000), (32, 131072)])
def test_split_softmax_forward_and_backward(dtype, m, n):
    x = randn(m, n, dtype=dtype, device="cuda", scale=3.0)
    # Several runs: a slot read before it was published (a stale copy in one thread) showed up only in
    # some runs, as a slice left out of one row's sum.
    for _ in range(3):
        y = empty_poisoned(m, n, dtype=dtype, device="cuda")
        softmax_fwd(x, y, softmax_config(n, dtype, x.device))
        assert_rel_close(y, softmax_ref(x))
    dy = randn(m, n, dtype=dtype, device="cuda", seed=3)
    dx = empty_poisoned(m, n, dtype=dtype, device="cuda")
    softmax_bwd(dy, y, dx, softmax_bwd_config(n, dtype, x.device))
    # dx = y * (dy - dot) cancels where dy is close to dot: twice the dtype's tolerance, as the softmax tests
    assert_rel_close(dx, softmax_bwd_ref(dy, y), tol=2 * tolerance(dtype))


@pytest.mark.gpu
def test_split_softmax_extremes():
    """A row of -inf (NaN, as torch), a slice of -inf inside a finite row, huge and tiny magnitudes."""
    n = 50000
    x = randn(4, n, device="cuda", scale=3.0)
    x[0] = float("-inf")
    x[1, :20000] = float("-inf")  # the first slice and part of the second: max and sum come from the rest
    x[2] = x[2] * 1e4
    x[3] = x[3] - 1e4  # every exp(x) underflows unless the max is subtracted first
    y = softmax(x)
    ref = torch.softmax(x.double(), -1)
    assert torch.isnan(y[0]).all() and torch.isnan(ref[0]).all()
    assert (y[1, :20000] == 0).all()
    assert_rel_close(y[1:], ref[1:])
    torch.testing.assert_close(y[1:].double().sum(-1), torch.ones(3, dtype=torch.float64, device="cuda"))


def _fake_split_launches(monkeypatch, per_sm: int) -> list:
    """launch_split's launches recorded, not run (grids; a zeroing launch as ("zero", words)), on a fake device
    of 10 SMs holding ``per_sm`` programs each."""
    import types

    from fly_norm import _split_host as split

    launched = []

    def launch(kernel, grid, *a, **k):
        if kernel is split.zero_slots_kernel:
            slots, words = a
            assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == words
            assert grid == (-(-words // k["BLOCK"]),) and "launch_pdl" not in k
            launched.append(("zero", words))
        else:
            launched.append(grid)

    monkeypatch.setattr(split.flyc, "programs_per_sm", lambda kernel, *a, **k: per_sm)
    monkeypatch.setattr(split.flyc, "launch", launch)
    monkeypatch.setattr(split.flydsl.arch, "current", lambda device: types.SimpleNamespace(sm_count=10))
    return launched


def test_split_grid_is_one_wave_and_falls_back_when_a_row_does_not_fit(monkeypatch):
    """The host side on any machine: the grid never exceeds one wave; rows wider than a wave's slices decline."""
    from fly_norm import _split_host as split

    launched = _fake_split_launches(monkeypatch, 2)
    seen_groups = []

    def build(slots, parts, pp, groups):
        seen_groups.append(groups)
        assert slots.shape[1] == 2 * pp and slots.dtype == torch.int64 and (slots == 0).all()
        return (), {}

    rows = torch.empty(50, 5 * 1024)  # 5 parts of 1024 columns; a wave of 20 programs holds 4 rows
    assert split.launch_split(None, rows, 2, build, 1024, "cpu") == 4
    assert launched == [(20,)] and seen_groups == [None, 4]
    few = torch.empty(3, 5 * 1024)  # fewer rows than the wave could take: one group per row
    assert split.launch_split(None, few, 2, build, 1024, "cpu") == 3 and launched[-1] == (15,)
    wide = torch.empty(2, 21 * 1024)  # 21 parts > a wave of 20: declined, nothing launched
    assert split.launch_split(None, wide, 2, build, 1024, "cpu") == 0 and len(launched) == 2
    monkeypatch.setattr(split.flyc, "programs_per_sm", lambda kernel, *a, **k: 32)  # a wave of 320
    too_many = torch.empty(2, (split.SPLIT_MAX_PARTS + 1) * 1024)  # fits the wave, but too many slices
    assert split.launch_split(None, too_many, 2, build, 1024, "cpu") == 0 and len(launched) == 2


def test_recorded_split_launch_zeroes_its_own_slots(monkeypatch):
    """In a call flydsl.direct records, fresh slots are an allocation zeroed by a launch of their own just
    before the kernel's (a torch.zeros would keep the call from being replayed); none when nothing launches,
    none for slots a pool lends (all zeros already)."""
    from fly_norm import _split_host as split

    launched = _fake_split_launches(monkeypatch, 2)
    monkeypatch.setattr(split, "_recording", lambda: True)
    build = lambda slots, parts, pp, groups: ((), {})  # noqa: E731
    few = torch.empty(3, 5 * 1024)  # 5 slices of 1024 columns (8 slots a row and stat), a group a row
    assert split.launch_split(None, few, 2, build, 1024, "cpu") == 3
    assert launched == [("zero", 3 * 2 * 8), (15,)]
    wide = torch.empty(2, 21 * 1024)  # more slices than a wave of 20: nothing launched, nothing zeroed
    assert split.launch_split(None, wide, 2, build, 1024, "cpu") == 0 and len(launched) == 2
    pooled = torch.zeros(3 * 2 * 8, dtype=torch.int64)
    assert split.launch_split(None, few, 2, build, 1024, "cpu", slots_of=lambda words: pooled[:words]) == 3
    assert launched[2:] == [(15,)]
    assert split.take_slots(10, "cpu") is None and split.take_fwd_slots(10, "cpu") is None  # nothing lent


# ------------------------------------------- the split kernels' arithmetic on any machine
#
# With one slice per row (N <= the slice width) a row's only program never waits for
# another, so the interpreter, which runs programs one after another, runs these kernels
# too: every exchange, merge and prefetch path except the cross-program wait itself.


@pytest.fixture(params=["slice", "wide"])
def fwd_launcher(request, monkeypatch):
    """The split forward with its default slices, or with the wide rows' (split.FWD_SLICE_WIDE) at every
    width (RMSNorm)."""
    from fly_norm import _split_host as split

    if request.param == "wide":
        monkeypatch.setattr(split, "WIDE_MIN_N", 0)
    return launch_fwd_split


@pytest.mark.parametrize("is_rms", [True, False])
def test_one_slice_forward_with_residual_and_stats(device, is_rms, fwd_launcher):
    m, n = 7, 300  # more rows than the wave's row groups on a 2-core interpreter: the row loop runs
    x, r = randn(m, n, device=device, scale=2.0) + 3.0, randn(m, n, device=device, seed=1)
    w, b = randn(n, device=device, seed=2), None if is_rms else randn(n, device=device, seed=3)
    y = empty_poisoned(m, n, dtype=torch.float32, device=device)
    h = empty_poisoned(m, n, dtype=torch.float32, device=device)
    rstd = empty_poisoned(m, dtype=torch.float32, device=device)
    mean = None if is_rms else empty_poisoned(m, dtype=torch.float32, device=device)
    assert fwd_launcher(x, r, w, b, None, y, h, mean, rstd, None, 1e-5, 0.5, is_rms, 0, 127.0)
    hh = x.double() + r.double()
    if is_rms:
        ref = rms_norm_ref(x, w, 1e-5, r, 0.5)[0]
        assert_rel_close(rstd, torch.rsqrt(hh.pow(2).mean(-1) + 1e-5), tol=1e-5)
    else:
        ref = layer_norm_ref(x, w, b, 1e-5, r, 0.5)[0]
        assert_rel_close(mean, hh.mean(-1), tol=1e-5)
        assert_rel_close(rstd, torch.rsqrt(hh.var(-1, unbiased=False) + 1e-5), tol=1e-5)
    assert_rel_close(y, ref)
    assert_rel_close(h, hh)


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_one_slice_quantized_forward(device, qdtype, fwd_launcher):
    m, n = 5, 200
    x, w = randn(m, n, device=device), randn(n, device=device, seed=1)
    smooth = torch.rand(n, device=device) + 0.5
    q = torch.empty(m, n, dtype=qdtype, device=device)
    scale = empty_poisoned(m, dtype=torch.float32, device=device)
    code, qmax = (1, 127.0) if qdtype == torch.int8 else (2, 448.0)
    assert fwd_launcher(x, None, w, None, smooth, q, None, None, None, scale, 1e-6, 0.0, True, code, qmax)
    assert_quant_matches(q, scale, *rms_norm_quant_ref(x, w, 1e-6, dtype=qdtype, smooth_scale=smooth))


@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("tile_rows", [1, 4])
@pytest.mark.parametrize("tiled", [None, 0, 1, 2], ids=["resident", "tiled", "lead", "lead2"])
def test_one_slice_backward(device, is_rms, tile_rows, tiled, monkeypatch):
    from fly_norm import _split_host as split
    from fly_norm._split_host import launch_bwd_split

    monkeypatch.setattr(split, "BWD_ROWS", tile_rows)  # 4: a last tile of 2 rows past M
    cfg = None if tiled is None else split.TiledConfig(512, 4, None, tile_rows, tiled)
    monkeypatch.setattr(split, "BWD_TILED", cfg)
    monkeypatch.setattr(split, "LN_BWD_TILED", cfg)
    m, n = 6, 257
    h = randn(m, n, device=device, scale=2.0) + 1.0
    w = randn(n, device=device, seed=1)
    dy, dres = randn(m, n, device=device, seed=2), randn(m, n, device=device, seed=3)
    mu = torch.zeros(m, device=device) if is_rms else h.mean(-1)
    var = h.pow(2).mean(-1) if is_rms else h.var(-1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-5)
    dx = empty_poisoned(m, n, dtype=torch.float32, device=device)
    dwp, dbp = launch_bwd_split(h, w, dy, dres, None if is_rms else mu, rstd, dx, True, not is_rms, 1.0, is_rms)
    xhat = (h.double() - mu.double()[:, None]) * rstd.double()[:, None]
    g = dy.double() * (w.double() + 1.0)
    ref = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not is_rms:
        ref = ref - g.mean(-1, keepdim=True)
    assert_rel_close(dx, ref * rstd.double()[:, None] + dres.double())
    assert_rel_close(dwp.sum(0), (dy.double() * xhat).sum(0), tol=1e-5)
    if not is_rms:
        assert_rel_close(dbp.sum(0), dy.double().sum(0), tol=1e-5)


@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("dres", [False, True])
def test_one_slice_staged_backward(device, is_rms, dres, monkeypatch):
    """The staged backward (bf16 rows read as words, pass 1 a row ahead, the row loop pipelined) with one slice
    a row: dx (+ the residual's gradient), dweight of an fp32 weight with (1 + w), dbias."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "BWD_STAGED", split.StagedConfig(512, 4, 3))
    m, n = 7, 300
    h = randn(m, n, dtype=torch.bfloat16, device=device, scale=2.0) + 1.0
    w = randn(n, device=device, seed=1)
    dy = randn(m, n, dtype=torch.bfloat16, device=device, seed=2)
    dr = randn(m, n, dtype=torch.bfloat16, device=device, seed=3) if dres else None
    hd = h.double()
    mu = torch.zeros(m, dtype=torch.float64, device=device) if is_rms else hd.mean(-1)
    var = hd.pow(2).mean(-1) if is_rms else hd.var(-1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-5).float()
    dx = empty_poisoned(m, n, dtype=torch.bfloat16, device=device)
    assert _staged_bwd(h, dy, dr, dx)
    dwp, dbp = split.launch_bwd_split(h, w, dy, dr, None if is_rms else mu.float(), rstd, dx, True, not is_rms, 1.0,
                                      is_rms)  # fmt: skip
    xhat = (hd - mu[:, None]) * rstd.double()[:, None]
    g = dy.double() * (w.double() + 1.0)
    ref = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not is_rms:
        ref = ref - g.mean(-1, keepdim=True)
    ref = ref * rstd.double()[:, None] + (0.0 if dr is None else dr.double())
    assert_rel_close(dx, ref)
    assert_rel_close(dwp.sum(0), (dy.double() * xhat).sum(0), tol=1e-5)
    if not is_rms:
        assert_rel_close(dbp.sum(0), dy.double().sum(0), tol=1e-5)


@pytest.mark.parametrize("pair", [True, False])
@pytest.mark.parametrize("offset", [0.0, 40.0, 500.0, "spikes"])
def test_staged_layer_backward_rows_far_from_zero(device, pair, offset, monkeypatch):
    """LayerNorm's staged backward on rows whose mean is 0, 40, 500 and (a constant row of 4096 with a few
    entries of 4128: bf16 rows can be no denser) ~3000 standard deviations from zero. Its sums are taken as
    sum(g * h) - mean * sum(g) (past 64 standard deviations again about the mean) and xhat as h * rstd - mean
    * rstd, the slices' two sums published as one signed pair (``pair``; without: the form taken with a
    residual gradient, sum(g * (h - mean)) and two slots a slice): dx and the weight gradients stay within
    bf16's tolerance of the fp64 reference of the same (bf16) rows. One slice a row in the interpreter, three
    on a GPU."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "BWD_STAGED", split.StagedConfig(512, 4, 3))
    m, n = 6, 400 if flyc.interpreting() else 1200
    if offset == "spikes":
        h = torch.full((m, n), 4096.0, device=device)
        h[:, 7::97] = 4128.0
        h = h.to(torch.bfloat16)
    else:
        h = (randn(m, n, device=device) + offset).to(torch.bfloat16)
    w = randn(n, device=device, seed=1)
    dy = randn(m, n, dtype=torch.bfloat16, device=device, seed=2)
    hd = h.double()
    mu, var = hd.mean(-1), hd.var(-1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-5).float()
    dx = empty_poisoned(m, n, dtype=torch.bfloat16, device=device)
    dr = None if pair else randn(m, n, dtype=torch.bfloat16, device=device, seed=3)
    assert _staged_bwd(h, dy, dr, dx)
    dwp, dbp = split.launch_bwd_split(h, w, dy, dr, mu.float(), rstd, dx, True, True, 0.0, False)
    xhat = (hd - mu[:, None]) * rstd.double()[:, None]
    g = dy.double() * w.double()
    ref = (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd.double()[:, None]
    assert_rel_close(dx, ref + (0.0 if dr is None else dr.double()))
    assert_rel_close(dwp.sum(0), (dy.double() * xhat).sum(0), tol=1e-4)
    assert_rel_close(dbp.sum(0), dy.double().sum(0), tol=1e-5)


def test_staged_backward_takes_only_word_aligned_bf16_rows():

    rows = torch.zeros(4, 1000, dtype=torch.bfloat16)
    assert _staged_bwd(rows, rows, None, rows) and _staged_bwd(rows, rows, rows, rows)
    assert not _staged_bwd(rows.float(), rows.float(), None, rows.float())
    assert not _staged_bwd(rows.half(), rows.half(), None, rows.half())
    assert not _staged_bwd(rows, rows, rows.float(), rows)  # a residual gradient in another dtype
    assert not _staged_bwd(rows[:, :999], rows[:, :999], None, rows[:, :999])  # an odd width
    assert not _staged_bwd(rows[:, 1:], rows, None, rows)  # rows off 4-byte boundaries


@pytest.mark.parametrize("is_rms, dres", [(True, False), (False, False), (False, True)])
def test_staged_wait_that_never_ends_poisons_instead_of_hanging(monkeypatch, is_rms, dres):
    """Two slices a row in the interpreter: the staged kernel's asm-free wait (collect_from's or, for
    LayerNorm's pair of sums, collect_pairs_from's fallback; with a residual gradient two slots a slice)
    gives up after SPIN_LIMIT reads on the row's first slice (NaN), and the row's last program, which sees
    both slices' sums, writes its slice right."""
    if not flyc.interpreting():
        pytest.skip("on a GPU both programs of a row run at once")
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "BWD_STAGED", split.StagedConfig(64, 4, 3))
    monkeypatch.setattr(split, "SPIN_LIMIT", 3)
    m, n = 3, 100  # slices of 64 and 36 columns
    x = randn(m, n, dtype=torch.bfloat16, scale=2.0) + 1.5
    dy = randn(m, n, dtype=torch.bfloat16, seed=2)
    xd = x.double()
    mean = torch.zeros(m, dtype=torch.float64) if is_rms else xd.mean(-1)
    var = xd.pow(2).mean(-1) if is_rms else xd.var(-1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-6).float()
    dx = empty_poisoned(m, n, dtype=torch.bfloat16)
    dr = randn(m, n, dtype=torch.bfloat16, seed=3) if dres else None
    split.launch_bwd_split(x, None, dy, dr, None if is_rms else mean.float(), rstd, dx, False, False, 0.0, is_rms)
    xhat = (xd - mean[:, None]) * rstd.double()[:, None]
    g = dy.double()
    c0 = 0.0 if is_rms else g.mean(-1, keepdim=True)
    ref = (g - c0 - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd.double()[:, None]
    ref = ref + (0.0 if dr is None else dr.double())
    assert torch.isnan(dx[:, :64]).all()
    assert_rel_close(dx[:, 64:], ref[:, 64:])


@pytest.mark.parametrize("slices", [1, 2])
def test_staged_rms_forward(device, slices, monkeypatch):
    """The staged RMSNorm forward (bf16 rows as words, pass 1 a row ahead, the row loop pipelined): y and the
    saved rstd with an fp32 weight and (1 + w). One slice a row anywhere; two on a GPU, and in the interpreter
    (programs one after another) the row's first slice gives up its wait (NaN) while its last is right."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "FWD_STAGED", split.StagedConfig(256, 4, 3))
    monkeypatch.setattr(split, "FWD_STAGED_MIN_N", 0)
    monkeypatch.setattr(split, "SPIN_LIMIT", 3 if flyc.interpreting() else split.SPIN_LIMIT)
    m, n = 5, 200 if slices == 1 else 400
    x = randn(m, n, dtype=torch.bfloat16, device=device, scale=2.0) + 0.5
    w = randn(n, device=device, seed=1)
    y = empty_poisoned(m, n, dtype=torch.bfloat16, device=device)
    rstd = empty_poisoned(m, dtype=torch.float32, device=device)
    assert _staged_fwd(x, y)
    assert split.launch_fwd_split(x, None, w, None, None, y, None, None, rstd, None, 1e-6, 1.0, True, 0, 127.0)
    ref = rms_norm_ref(x, w, 1e-6, None, 1.0)
    if slices == 2 and flyc.interpreting():
        assert torch.isnan(y[:, :256]).all()
        assert_rel_close(y[:, 256:], ref[:, 256:])
    else:
        assert_rel_close(y, ref)
        assert_rel_close(rstd, torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6))


@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("affine", ["both", "offset", "weight", "none"])
def test_staged_layer_forward(device, slices, affine, monkeypatch):
    """The staged LayerNorm forward: y and the saved mean and rstd against fp64, with and without a bf16
    weight (and offset) and bias held as words, over rows whose means range from
    ordinary to ~100 standard deviations (there M2 from the sums cancels more than 6 bits: the exact M2 is
    taken instead), a constant row (M2 = 0) and rows whose slices' means differ by ~1000 and ~16 standard
    deviations of their own (Chan's merge of the slices' M2s about the row's mean). Three slices a row on a
    GPU (the last short); one in the interpreter."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "FWD_STAGED", split.StagedConfig(256, 4, 3))
    monkeypatch.setattr(split, "FWD_STAGED_MIN_N", 0)
    if slices > 1 and flyc.interpreting():
        pytest.skip("the interpreter runs one program at a time: a row's slices would wait on each other")
    m, n = 9, 200 if slices == 1 else 700
    x = randn(m, n, dtype=torch.float32, device=device, seed=slices)
    x = x * torch.tensor([2.0, 0.5, 1.0, 0.5, 0.25, 0.0, 0.0, 0.5, 1.0], device=device)[:, None]
    x = (x + torch.tensor([0.5, -3.0, 40.0, 50.0, -24.0, 7.0, 64.0, 0.0, 0.0], device=device)[:, None])
    x[7, 512:] += 1000.0  # the last slice ~2000 standard deviations above the others
    x[8, :256] -= 16.0  # the first slice ~16 below
    x = x.bfloat16()
    x[6, n // 3] = 64.5  # one element an ulp off a constant row: mean / std ~ 2000, M2 from the sums is noise
    w = None if affine == "none" else randn(n, dtype=torch.bfloat16, device=device, seed=1)
    b = randn(n, dtype=torch.bfloat16, device=device, seed=2) if affine in ("both", "offset") else None
    offset = 1.0 if affine == "offset" else 0.0
    y = empty_poisoned(m, n, dtype=torch.bfloat16, device=device)
    mean = empty_poisoned(m, dtype=torch.float32, device=device)
    rstd = empty_poisoned(m, dtype=torch.float32, device=device)
    assert _staged_fwd(x, y, (w, b))
    assert split.launch_fwd_split(x, None, w, b, None, y, None, mean, rstd, None, 1e-5, offset, False, 0, 127.0)
    xd = x.double()
    assert_rel_close(y, layer_norm_ref(x, w, b, 1e-5, None, offset))
    assert_rel_close(mean, xd.mean(-1))
    assert_rel_close(rstd, torch.rsqrt(xd.var(-1, unbiased=False) + 1e-5))


def test_pooled_slots_are_lent_once_and_zeroed_by_the_column_sums(device, monkeypatch):
    """The staged backward's pooled slots (split.take_slots): all zeros when lent, not lent again before they
    are given back (that launch takes fresh zeros), a larger request gets a larger buffer; the column-sum
    kernel zeroes the buffer it is given while it sums (the partials' sums right)."""
    from fly_norm import _norm_host as norm
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "_POOLS", {})
    a = split.take_slots(100, device)
    assert a.numel() == 100 and (a == 0).all()
    assert split.take_slots(10, device) is None  # lent
    a.fill_(7)
    partials = randn(5, 300, device=device)
    out = empty_poisoned(300, dtype=torch.float32, device=device)
    norm.launch_sum_partials(partials, out, clear=a)
    assert (a == 0).all()
    assert_rel_close(out, partials.double().sum(0))
    split.give_back_slots(a)
    b = split.take_slots(60, device)
    assert b.data_ptr() == a.data_ptr() and (b == 0).all()
    split.give_back_slots(b)
    c = split.take_slots(1000, device)  # outgrown: a new buffer
    assert c.numel() == 1000 and (c == 0).all()
    c[:5] = 1
    q = randn(5, 300, device=device, seed=3)
    norm.launch_sum_partials(partials, out, q, out2 := empty_poisoned(300, dtype=torch.float32, device=device),
                             clear=c)  # fmt: skip
    assert (c == 0).all()
    assert_rel_close(out2, q.double().sum(0))


def test_forward_slot_pairs_are_taken_in_turn(device, monkeypatch):
    """The staged forward's pooled slots (split.take_fwd_slots), host logic: an all-zero buffer and nothing to
    zero at first; not lent twice; after a launch the other buffer, with the first one's dirtied words to
    zero; a launch that did not happen changes nothing; a larger request grows the buffer in turn."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "_FWD_POOLS", {})
    a, clear = split.take_fwd_slots(100, device)
    assert a.numel() == 100 and (a == 0).all() and clear.numel() == 0
    assert split.take_fwd_slots(10, device) is None  # lent
    split.give_back_fwd_slots(a, launched=True)  # a launch dirtied a's 100 words
    b, clear = split.take_fwd_slots(60, device)
    assert b.data_ptr() != a.data_ptr() and (b == 0).all()
    assert clear.data_ptr() == a.data_ptr() and clear.numel() == 100
    split.give_back_fwd_slots(b, launched=False)  # not launched: b still next, a's words still to zero
    b2, clear = split.take_fwd_slots(50, device)
    assert b2.data_ptr() == b.data_ptr() and clear.numel() == 100
    split.give_back_fwd_slots(b2, launched=True)
    a2, clear = split.take_fwd_slots(1000, device)  # a outgrown: a new buffer, b's 50 words to zero
    assert a2.numel() == 1000 and (a2 == 0).all() and clear.data_ptr() == b.data_ptr() and clear.numel() == 50
    split.give_back_fwd_slots(a2, launched=True)
    (pair,) = split._FWD_POOLS.values()
    assert not pair.lent and pair.turn == 1 and pair.dirty == [1000, 0]


@pytest.mark.parametrize("is_rms", [True, False])
def test_staged_forward_pooled_slots_over_many_calls(device, monkeypatch, is_rms):
    """The staged forward through its pooled slots, call after call with row counts that grow (a buffer
    outgrown) and shrink: y, mean and rstd right every time; after each call the buffer the next call takes
    is all zeros, and the launch zeroed what the one before it had dirtied. Three slices a row on a GPU (the
    last short), one in the interpreter."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "FWD_STAGED", split.StagedConfig(256, 4, 3))
    monkeypatch.setattr(split, "FWD_STAGED_MIN_N", 0)
    monkeypatch.setattr(split, "_FWD_POOLS", {})
    n = 200 if flyc.interpreting() else 700
    for i, m in enumerate([9, 9, 40, 3, 17]):
        x = (randn(m, n, device=device, scale=2.0, seed=i) + 0.5).bfloat16()
        w = randn(n, dtype=torch.bfloat16, device=device, seed=1)
        b = None if is_rms else randn(n, dtype=torch.bfloat16, device=device, seed=2)
        y = empty_poisoned(m, n, dtype=torch.bfloat16, device=device)
        mean = None if is_rms else empty_poisoned(m, dtype=torch.float32, device=device)
        rstd = empty_poisoned(m, dtype=torch.float32, device=device)
        assert split.launch_fwd_split(x, None, w, b, None, y, None, mean, rstd, None, 1e-5, 0.0, is_rms, 0, 127.0)
        (pair,) = split._FWD_POOLS.values()
        nxt = pair.bufs[pair.turn]  # None until a second call
        assert not pair.lent and pair.dirty[pair.turn] == 0 and (nxt is None or (nxt == 0).all()), f"call {i}"
        parts = flyc.cdiv(n, 256)
        used = pair.bufs[1 - pair.turn][: pair.dirty[1 - pair.turn]].view(m, -1)
        assert used.shape[1] == flyc.next_power_of_2(parts) and (used[:, :parts] != 0).all(), f"call {i}"
        ref = rms_norm_ref(x, w, 1e-5) if is_rms else layer_norm_ref(x, w, b, 1e-5)
        assert_rel_close(y, ref, name=f"y {i}")
        xd = x.double()
        if is_rms:
            assert_rel_close(rstd, torch.rsqrt(xd.square().mean(-1) + 1e-5), name=f"rstd {i}")
        else:
            assert_rel_close(mean, xd.mean(-1), name=f"mean {i}")
            assert_rel_close(rstd, torch.rsqrt(xd.var(-1, unbiased=False) + 1e-5), name=f"rstd {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [True, False])
def test_public_staged_forward_over_many_calls(monkeypatch, is_rms):
    """The public forward at 64K-128K columns (the staged kernel, its slots pooled), call after call with row
    counts and widths that grow and shrink: y right every time, and the buffer the next call takes all zeros.
    On the general path: an eager call the replays take would record its launches with fresh slots instead
    (test_direct_replays covers those)."""
    from fly_norm import _split_host as split
    from fly_norm._eager import general_path_only

    monkeypatch.setattr(split, "_FWD_POOLS", {})
    for i, (m, n) in enumerate([(8, 65536), (8, 65536), (40, 131072), (3, 65538), (21, 131072)]):
        x = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2.0, seed=i) + 0.5
        w = randn(n, dtype=torch.bfloat16, device="cuda", seed=1)
        b = None if is_rms else randn(n, dtype=torch.bfloat16, device="cuda", seed=2)
        with general_path_only():
            y = rms_norm(x, w) if is_rms else layer_norm(x, w, b)
        torch.cuda.synchronize()
        (pair,) = split._FWD_POOLS.values()
        nxt = pair.bufs[pair.turn]  # None until a second call
        assert not pair.lent and (nxt is None or (nxt == 0).all()), f"call {i}"
        assert_rel_close(y, rms_norm_ref(x, w) if is_rms else layer_norm_ref(x, w, b), name=f"y {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.graph
def test_staged_paths_replay_in_a_cuda_graph(is_rms):
    """The staged forward (64K columns) and the staged backward with its column sums (16K + 2) captured in
    one CUDA graph and replayed with new inputs: under capture they take fresh slots zeroed inside the graph
    and plain launches (no PDL, no pool), so every replay is right; the pools are not lent by the capture."""
    from fly_norm import _split_host as split

    def make(m, n, seed):
        x = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2.0, seed=seed) + 0.5
        w = randn(n, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
        b = None if is_rms else randn(n, dtype=torch.bfloat16, device="cuda", seed=seed + 2)
        return x, w, b

    def op(x, w, b):
        return rms_norm(x, w) if is_rms else layer_norm(x, w, b)

    def ref(x, w, b=None):
        return rms_norm_ref(x, w) if is_rms else layer_norm_ref(x, w, b)

    xf, wf, bf = make(8, 65536, 0)
    xb, wb, bb = make(64, 16386, 10)
    leaves = [t.requires_grad_() for t in (xb, wb, bb) if t is not None]
    dy = randn(64, 16386, dtype=torch.bfloat16, device="cuda", seed=20)

    def step():
        return op(xf, wf, bf), torch.autograd.grad(op(xb, wb, bb), leaves, dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, grads = step()
    assert not any(e.lent for e in split._POOLS.values()) and not any(p.lent for p in split._FWD_POOLS.values())
    for seed in (5, 6):
        for t, (new, _, _) in ((xf, make(8, 65536, seed)), (xb, make(64, 16386, seed + 1))):
            with torch.no_grad():
                t.copy_(new)
        with torch.no_grad():
            dy.copy_(randn(64, 16386, dtype=torch.bfloat16, device="cuda", seed=seed + 2))
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(y, ref(xf, wf, bf), name=f"y {seed}")
        for g, r, name in zip(grads, reference_grads(ref, leaves, (dy,)), ("dx", "dweight", "dbias"), strict=False):
            assert_rel_close(g, r, tol=2 * tolerance(torch.bfloat16), name=f"{name} {seed}")


@pytest.mark.parametrize("words", [1, 1023, 1024, 2500])
def test_zero_slots_zeroes_every_word_and_nothing_past(device, words):
    """The recorded split calls' slot zeroing (split.zero_slots): every word of the buffer 0, the words past it
    (the rest of a larger allocation) untouched."""
    from fly_norm import _split_host as split

    buf = torch.full((words + 64,), -7, dtype=torch.int64, device=device)
    split.zero_slots(buf[:words])
    assert (buf[:words] == 0).all() and (buf[words:] == -7).all()


@pytest.mark.parametrize("p", [1, 7, 66, 256, 257, 600])
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_column_sums_of_any_shape(device, p, n):
    """launch_sum_partials over one step (P <= 256: a [next_pow2(P), band] tile) and several (P > 256), with a
    band wider or narrower than N: each column's fp32 sum right, in bf16 and fp32 outputs, and the same bits
    on a second launch (a fixed order)."""
    from fly_norm import _norm_host as norm

    partials = randn(p, n, device=device, seed=p + n)
    q = randn(p, n, device=device, seed=p * n + 1)
    out = empty_poisoned(n, dtype=torch.float32, device=device)
    out2 = empty_poisoned(n, dtype=torch.bfloat16, device=device)
    norm.launch_sum_partials(partials, out)
    assert_rel_close(out, partials.double().sum(0))
    again = empty_poisoned(n, dtype=torch.float32, device=device)
    norm.launch_sum_partials(partials, again)
    assert torch.equal(out, again)
    norm.launch_sum_partials(partials, empty_poisoned(n, dtype=torch.bfloat16, device=device), q, out2)
    assert_rel_close(out2, q.double().sum(0))


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [True, False])
def test_staged_backward_pooled_slots_over_many_calls(monkeypatch, is_rms):
    """The public backward through the staged kernel (16K + 2 and 32K columns), call after call with row
    counts that grow (the pool outgrown) and shrink: dx, dweight (and dbias) right every time, and after each
    call the stream's pooled slots all zeros again and free to lend."""
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "_POOLS", {})
    # on the general path: a recorded (and so a replayed) call takes fresh slots, never the pool's
    with direct.general_path_only():
        for i, (m, n) in enumerate([(64, 16386), (64, 16386), (300, 32768), (5, 16386), (130, 32768)]):
            x = randn(m, n, dtype=torch.bfloat16, device="cuda", scale=2.0, seed=i) + 0.5
            w = randn(n, dtype=torch.bfloat16, device="cuda", seed=1).requires_grad_()
            b = None if is_rms else randn(n, dtype=torch.bfloat16, device="cuda", seed=2).requires_grad_()
            dy = randn(m, n, dtype=torch.bfloat16, device="cuda", seed=10 + i)
            xs = x.clone().requires_grad_()
            out = rms_norm(xs, w) if is_rms else layer_norm(xs, w, b)
            out.backward(dy)
            torch.cuda.synchronize()
            (entry,) = split._POOLS.values()
            assert not entry.lent and (entry.buf == 0).all(), f"call {i}"
            leaves = (x, w) if is_rms else (x, w, b)
            fn = (lambda a, c: rms_norm_ref(a, c)) if is_rms else (lambda a, c, d: layer_norm_ref(a, c, d))
            ref = reference_grads(fn, leaves, (dy,))
            got = (xs.grad, w.grad) if is_rms else (xs.grad, w.grad, b.grad)
            for g, r, name in zip(got, ref, ("dx", "dweight", "dbias"), strict=False):
                assert_rel_close(g, r, tol=2 * tolerance(torch.bfloat16), name=f"{name} {i}")


def _softmax_extremes(m, n, seed):
    """bf16 rows for the wide softmax: ordinary rows, a row with -inf entries, a row whose halves' maxima differ
    by ~80, an all -inf row (NaN, as torch.softmax), a row whose first half is -inf and the rest near -200 (a
    -inf slice's sum rescaled to the others' would underflow to 0 / 0), rows near the bf16 extremes (+-3e38),
    one of ties near 1e5 (past the kernels' fast exponent range: the exact branch), one near 100, one whose
    first quarter is near -1e5 (one thread's max past that range, the row's not), and one with a NaN (NaN
    throughout, as torch.softmax, though the words' max passes over NaN on NVIDIA), and one whose NaN sits
    among columns all -inf (with 512-word chunks over 4 warps, every column of one thread). Rows 3, 9 and 11:
    all NaN."""
    x = randn(m, n, dtype=torch.float32, device="cuda", seed=seed, scale=3.0)
    x[1, ::3] = float("-inf")
    x[2, n // 2 :] += 80.0
    x[3] = float("-inf")
    x[4, : n // 2] = float("-inf")
    x[4, n // 2 :] -= 200.0
    x[5] = x[5] * 1e36 + 3.0e38
    x[6] = x[6] * 1e36 - 3.0e38
    x[7, ::2] = 1e5  # 99840 in bf16, ties; the others 90112
    x[7, 1::2] = 9e4
    x[8] += 100.0
    x[9, n - 3] = float("nan")
    x[10, : n // 4] -= 1e5
    x[11, (torch.arange(n) % 1024) < 8] = float("-inf")  # a thread's every column -inf (512-word chunks, 4 warps)
    x[11, 3] = float("nan")  # ... but one NaN: the row NaN, as torch.softmax
    return x.bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n"), [(12, 2000), (2001, 5000), (300, 6144), (12, 65536), (12, 1048576),
                                      (12, 1048576 + 2050)])
def test_resident_softmax_forward(m, n, monkeypatch):
    """The resident softmax forward (each slice in a shared-memory ring) against fp64 on the extreme rows of
    _softmax_extremes. Small chunks (512 words) and a ring of 6 (slices of two chunks): one slice a row, with
    a masked tail (2000); three slices, the last short, more rows than a wave holds (5000); three whole slices
    (6144, no column masks). The shipped configs: RESIDENT at 64K (four slices) and 1M (64, the most a row
    may have), RESIDENT_WIDE past 1M (17 slices of 64K, the last short)."""
    from fly_norm import _split_host as resident

    if n < 65536:
        monkeypatch.setattr(resident, "RESIDENT", resident.ResidentConfig(512, 6, 4, 4))
        monkeypatch.setattr(resident, "RESIDENT_MIN_N", 0)
    else:
        shipped = resident.RESIDENT_WIDE if n > 1048576 else resident.RESIDENT
        assert resident_config(flydsl.arch.current(), n) == shipped
    x = _softmax_extremes(m, n, seed=n)
    y = empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    assert _resident(x, y)
    assert resident.launch_softmax_fwd_resident(x, y)
    assert torch.isnan(y[3]).all() and torch.isnan(y[9]).all() and torch.isnan(y[11]).all()
    rows = [r for r in range(m) if r not in (3, 9, 11)]
    assert_rel_close(y[rows], softmax_ref(x[rows]))
    for r in (1, 2, 4, 5, 6, 7, 8, 10):
        assert_rel_close(y[r], softmax_ref(x[r]), name=f"row {r}")


@pytest.mark.gpu
def test_resident_softmax_on_strided_rows_through_the_public_op():
    """Rows of a wider tensor (row stride past N) through fly_norm.softmax at 128K columns (two slices)."""

    wide = randn(3, 131072 + 64, dtype=torch.bfloat16, device="cuda", seed=3, scale=4.0)
    x = wide[:, :131072]
    assert _resident(x, x)
    y = softmax(x)
    assert_rel_close(y, softmax_ref(x))


@pytest.mark.gpu
def test_resident_softmax_wait_that_never_ends_poisons_instead_of_hanging(monkeypatch):
    """Only the first program of the wave launched: its row's other slice never publishes, so its wait gives up
    after the spin limit and its slice is NaN; nothing else is written."""
    from fly_norm import _split_host as resident

    monkeypatch.setattr(resident, "RESIDENT", resident.ResidentConfig(512, 6, 4, 4))
    monkeypatch.setattr(resident, "RESIDENT_MIN_N", 0)
    x = randn(1, 4000, dtype=torch.bfloat16, device="cuda", seed=4)  # two slices: two chunks (2048 columns), 1952
    y = torch.zeros_like(x)
    assert resident.launch_softmax_fwd_resident(x, y, spin_limit=64, programs=1)
    assert torch.isnan(y[0, :2048]).all() and (y[0, 2048:] == 0).all()


def test_resident_softmax_takes_only_wide_word_aligned_bf16_rows_on_nvidia(monkeypatch):
    from fly_norm import _split_host as resident
    from flydsl.arch import SM90, Arch

    monkeypatch.setattr(resident.flyc, "interpreting", lambda: False)
    monkeypatch.setattr(resident.flydsl.arch, "current", lambda device=None: SM90)
    cfg = resident.RESIDENT
    most = resident.SPLIT_MAX_PARTS * 2 * cfg.chunk * (cfg.ring - cfg.left)  # the widest row of RESIDENT's slices
    assert resident_config(SM90, 65536) == resident_config(SM90, most) == resident.RESIDENT
    assert resident_config(SM90, most + 2) == resident.RESIDENT_WIDE
    wide = resident.RESIDENT_WIDE
    assert resident_config(SM90, resident.SPLIT_MAX_PARTS * 2 * wide.chunk * (wide.ring - wide.left) + 2) is None
    rows = torch.zeros(2, resident.RESIDENT_MIN_N + 2, dtype=torch.bfloat16)
    assert _resident(rows, rows)
    assert not _resident(rows[:, :-4], rows[:, :-4])  # narrower than RESIDENT_MIN_N
    assert not _resident(rows.half(), rows.half()) and not _resident(rows, rows.float())
    assert not _resident(rows[:, :-1], rows[:, :-1])  # an odd width
    assert not _resident(rows[:, 1:], rows[:, 1:])  # rows off 4-byte boundaries
    # the ring shrinks with the shared memory; too small a ring, AMD or pre-sm_80: no
    monkeypatch.setattr(resident, "RESIDENT", resident.ResidentConfig(4096, 12, 16, 4))
    ampere = Arch(**{**SM90.__dict__, "capability": (8, 6), "smem_per_block": 99 * 1024})
    monkeypatch.setattr(resident.flydsl.arch, "current", lambda device=None: ampere)
    assert resident_config(flydsl.arch.current(), 65536) == resident.ResidentConfig(4096, 6, 16, 4)
    for arch in (Arch(**{**SM90.__dict__, "smem_per_block": 64 * 1024}), Arch(**{**SM90.__dict__, "backend": "hip"}),
                 Arch(**{**SM90.__dict__, "capability": (7, 5)})):  # fmt: skip
        monkeypatch.setattr(resident.flydsl.arch, "current", lambda device=None, a=arch: a)
        assert resident_config(flydsl.arch.current(), 65536) is None and not _resident(rows, rows)


def test_staged_forward_takes_only_wide_word_aligned_bf16_rows(monkeypatch):
    from fly_norm import _split_host as split

    rows = torch.zeros(2, split.FWD_STAGED_MIN_N + 2, dtype=torch.bfloat16)
    assert _staged_fwd(rows, rows)
    assert not _staged_fwd(rows[:, :-4], rows[:, :-4])  # narrower than FWD_STAGED_MIN_N
    assert not _staged_fwd(rows.half(), rows.half()) and not _staged_fwd(rows, rows.float())
    assert not _staged_fwd(rows[:, :-1], rows[:, :-1]) and not _staged_fwd(rows[:, 1:], rows[:, 1:])
    # LayerNorm's weight and bias, held as words: bf16 and word aligned, or absent
    vec = torch.zeros(split.FWD_STAGED_MIN_N + 4, dtype=torch.bfloat16)
    w = vec[: rows.shape[1]]
    assert _staged_fwd(rows, rows, (w, w)) and _staged_fwd(rows, rows, (None, None))
    assert not _staged_fwd(rows, rows, (w.float(), None))
    assert not _staged_fwd(rows, rows, (None, vec[1 : rows.shape[1] + 1]))


def test_one_slice_softmax(device):
    from fly_norm._split_host import launch_softmax_bwd_split, launch_softmax_fwd_split

    m, n = 6, 333
    x = randn(m, n, device=device, scale=5.0)
    x[1] = float("-inf")  # a row of -inf: NaN, as torch.softmax
    ref = torch.softmax(x.double(), -1)
    keep = torch.tensor([0, 2, 3, 4, 5], device=device)
    y = empty_poisoned(m, n, dtype=torch.float32, device=device)
    assert launch_softmax_fwd_split(x, y)
    assert torch.isnan(y[1]).all() and torch.isnan(ref[1]).all()
    assert_rel_close(y[keep], ref[keep])
    dy = randn(m, n, device=device, seed=1)
    dx = empty_poisoned(m, n, dtype=torch.float32, device=device)
    assert launch_softmax_bwd_split(dy, y[keep].contiguous(), dx[: len(keep)])
    assert_rel_close(dx[: len(keep)], softmax_bwd_ref(dy[: len(keep)], y[keep]), tol=2 * tolerance(torch.float32))


@pytest.mark.parametrize(
    "kernel",
    ["rms", "layer", "softmax", "softmax_bwd", "norm_bwd", "norm_bwd_tiles", "norm_bwd_tiled",
     "norm_bwd_lead", "norm_bwd_lead2"],
)  # fmt: skip
def test_a_wait_that_never_ends_poisons_instead_of_hanging(monkeypatch, kernel):
    """Two slices a row in the interpreter (programs one after another): the first program of a row gives up
    after SPIN_LIMIT polls and writes NaN; the row's last program sees every partial result, so its slice
    checks the cross-slice merge (sums of squares, Chan's mean/M2, max/sum rescaling, dot products)."""
    if not flyc.interpreting():
        pytest.skip("on a GPU both programs of a row run at once")
    from fly_norm import _split_host as split

    monkeypatch.setattr(split, "FWD_SLICE", split.SliceConfig(64, 4))
    monkeypatch.setattr(split, "LN_FWD_SLICE", split.SliceConfig(64, 4))
    monkeypatch.setattr(split, "BWD_SLICE", split.SliceConfig(64, 4))
    monkeypatch.setattr(split, "SOFTMAX_BWD_SLICE", split.SliceConfig(64, 4))
    monkeypatch.setattr(split, "BWD_ROWS", 2 if kernel == "norm_bwd_tiles" else 1)
    tiled = {"norm_bwd_tiled": split.TiledConfig(64, 4, None, 2), "norm_bwd_lead": split.TiledConfig(64, 4, None, 2, 1),
             "norm_bwd_lead2": split.TiledConfig(64, 4, None, 2, 2)}.get(kernel)  # fmt: skip
    monkeypatch.setattr(split, "BWD_TILED", tiled)
    monkeypatch.setattr(split, "LN_BWD_TILED", None)
    monkeypatch.setattr(split, "SPIN_LIMIT", 3)
    m, n = 3, 100  # slices of 64 and 36 columns
    x, w, b = randn(m, n, scale=2.0) + 1.5, randn(n, seed=1), randn(n, seed=2)
    out = empty_poisoned(m, n, dtype=torch.float32)
    norm_fwd = split.launch_fwd_split
    if kernel == "rms":
        assert norm_fwd(x, None, w, None, None, out, None, None, None, None, 1e-6, 0.0, True, 0, 127.0)
        ref = rms_norm_ref(x, w, 1e-6)
    elif kernel == "layer":
        assert norm_fwd(x, None, w, b, None, out, None, None, None, None, 1e-5, 0.0, False, 0, 127.0)
        ref = layer_norm_ref(x, w, b, 1e-5)
    elif kernel == "softmax":
        assert split.launch_softmax_fwd_split(x, out)
        ref = softmax_ref(x)
    elif kernel == "softmax_bwd":
        y = torch.softmax(x, -1)
        assert split.launch_softmax_bwd_split(w.expand(m, n).contiguous(), y, out)
        ref = softmax_bwd_ref(w.expand(m, n), y)
    else:
        rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
        dwp, _ = split.launch_bwd_split(x, None, b.expand(m, n).contiguous(), None, None, rstd, out, True, False, 0.0,
                                        True)  # fmt: skip
        xhat = x.double() * rstd.double()[:, None]
        g = b.double().expand(m, n)
        ref = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd.double()[:, None]
        assert_rel_close(dwp.sum(0), (g * xhat).sum(0), tol=1e-5)  # accumulated before the waits
    assert torch.isnan(out[:, :64]).all()  # the first slices' programs gave up waiting
    assert_rel_close(out[:, 64:], ref[:, 64:])  # the last ones merged both slices
