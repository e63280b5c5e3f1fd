"""fly_norm.routing.route: which kernel path serves a call, at every threshold +-1, per dtype, operands and
arch (the interpreter, a Hopper GPU, older and AMD GPUs); and the host code's actual launches following it
(the GPU stubbed out: a fake H200, launches recorded, not run)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import flydsl.arch
import flydsl.compiler as flyc
from fly_norm import _split_host as S
from fly_norm import layer_norm, layer_norm_quant, rms_norm, rms_norm_quant, routing
from fly_norm._norm_host import backward_into
from fly_norm.routing import PIPELINED_BWD, ROW_KERNEL, Path, Route, resident_config, route, row_kernels_below
from flydsl.arch import INTERPRETER, SM90
from flydsl.errors import ArgumentError

softmax_mod = importlib.import_module("fly_norm.softmax")  # the module (the package exports the function)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
H200 = dataclasses.replace(SM90, device_name="NVIDIA H200", sm_count=132)
AMPERE = dataclasses.replace(SM90, name="sm_86", capability=(8, 6), smem_per_block=99 * 1024)
TURING = dataclasses.replace(SM90, name="sm_75", capability=(7, 5), smem_per_block=64 * 1024)
MI300 = dataclasses.replace(SM90, name="gfx942", backend="hip", capability=None, warp_size=64, smem_per_block=64 * 1024)
NORMS = ("rms_norm", "layer_norm")


def path(*args, **kw) -> Path:
    return route(*args, **kw).path


# ------------------------------------------------------------------ the pure function


def test_route_is_frozen_and_rejects_an_unknown_op():
    r = route("softmax", F32, 4, 1024, H200)
    assert r == Route(Path.ROWS, None, (), eager_plan=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.path = Path.SPLIT
    with pytest.raises(ArgumentError, match="op: expected one of rms_norm, layer_norm, softmax, got 'gelu'"):
        route("gelu", F32, 4, 1024, H200)


@pytest.mark.parametrize("op", [*NORMS, "softmax"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_the_interpreter_runs_every_width_on_the_row_kernels(op, backward, dtype):
    """Only the pipelined backward (RMSNorm's bf16 rows of 8K-16K) leaves the row kernels under the interpreter."""
    for n in (1, 256, S.SPLIT_MIN_N_BWD, S.SPLIT_MIN_N, S.RESIDENT_MIN_N, S.WIDE_MIN_N, 1 << 20, 1 << 22):
        got = path(op, dtype, 3, n, INTERPRETER, backward=backward, row_dtypes=(dtype,) * 2)
        pipelined = op == "rms_norm" and backward and dtype == BF16 and n <= PIPELINED_BWD.block_n
        assert got is (Path.PIPELINED if pipelined and n >= S.SPLIT_MIN_N_BWD else Path.ROWS), (n, got)


@pytest.mark.parametrize("op", NORMS)
@pytest.mark.parametrize("dtype", [F32, F16])
def test_norm_forward_splits_from_split_min_n_on_a_gpu(op, dtype):
    slices = S.FWD_SLICE if op == "rms_norm" else S.LN_FWD_SLICE
    below = route(op, dtype, 8, S.SPLIT_MIN_N - 1, H200)
    assert below == Route(Path.ROWS, eager_plan=True)
    assert route(op, dtype, 8, S.SPLIT_MIN_N, H200) == Route(Path.SPLIT, slices, (Route(Path.ROWS),))
    # no staged forward but for bf16 rows; RMSNorm's wide slices from WIDE_MIN_N
    assert route(op, dtype, 8, S.FWD_STAGED_MIN_N, H200).path is Path.SPLIT
    wide = S.FWD_SLICE_WIDE if op == "rms_norm" else S.LN_FWD_SLICE
    assert route(op, dtype, 8, S.WIDE_MIN_N - 1, H200).config == slices
    assert route(op, dtype, 8, S.WIDE_MIN_N, H200).config == wide


@pytest.mark.parametrize("op", NORMS)
def test_norm_forward_staged_takes_plain_word_aligned_bf16_rows_from_its_width(op):
    vec = (BF16, BF16) if op == "layer_norm" else ()

    def fwd(n, **kw):
        return route(op, BF16, 8, n, H200, **{"row_dtypes": (BF16,), "vector_dtypes": vec, **kw})

    assert fwd(S.FWD_STAGED_MIN_N - 1).path is Path.SPLIT
    assert fwd(S.FWD_STAGED_MIN_N) == Route(Path.STAGED, S.FWD_STAGED, (Route(Path.ROWS),))
    assert fwd(1 << 20).path is Path.STAGED
    n = S.FWD_STAGED_MIN_N
    for kw in ({"residual": True}, {"smooth": True}, {"quant": torch.int8}, {"quant": torch.float8_e4m3fn},
               {"aligned": False}, {"row_dtypes": (F32,)}):  # fmt: skip
        assert fwd(n, **kw).path is Path.SPLIT, kw
    # LayerNorm's weight and bias are held as words: bf16 (or absent); RMSNorm's weight is not
    assert fwd(n, vector_dtypes=(F32,)).path is (Path.SPLIT if op == "layer_norm" else Path.STAGED)
    assert fwd(n, vector_dtypes=()).path is Path.STAGED
    # AMD: no stages for a program (its pipeliner stages otherwise)
    assert route(op, BF16, 8, n, MI300, row_dtypes=(BF16,), vector_dtypes=vec).path is Path.SPLIT


@pytest.mark.parametrize("op", NORMS)
@pytest.mark.parametrize("quant", [torch.int8, torch.float8_e4m3fn])
def test_quantized_forward_takes_no_eager_plan_and_the_slices_past_split_min_n(op, quant):
    assert route(op, BF16, 8, S.SPLIT_MIN_N - 1, H200, quant=quant) == Route(Path.ROWS, eager_plan=False)
    assert route(op, BF16, 8, S.SPLIT_MIN_N, H200, quant=quant, residual=True).path is Path.SPLIT
    assert route(op, BF16, 8, 1 << 18, H200, quant=quant, row_dtypes=(quant,)).path is Path.SPLIT
    assert route(op, BF16, 8, S.SPLIT_MIN_N - 1, H200, residual=True).eager_plan


@pytest.mark.parametrize("arch", [H200, INTERPRETER])
def test_rms_backward_pipelined_from_split_min_n_bwd_to_its_width(arch):
    rows = (BF16, BF16)  # dy, dx

    def bwd(n, **kw):
        return route("rms_norm", BF16, 8, n, arch, **{"backward": True, "row_dtypes": rows, **kw})

    assert bwd(S.SPLIT_MIN_N_BWD - 1) == Route(Path.ROWS)
    assert bwd(S.SPLIT_MIN_N_BWD) == bwd(PIPELINED_BWD.block_n) == Route(Path.PIPELINED, PIPELINED_BWD)
    gpu = arch is H200
    assert bwd(PIPELINED_BWD.block_n + 1).path is (Path.STAGED if gpu else Path.ROWS)
    for kw in ({"residual": True, "row_dtypes": (BF16, BF16, BF16)}, {"aligned": False}, {"row_dtypes": (F32, BF16)}):
        assert bwd(12288, **kw).path is not Path.PIPELINED, kw
    assert route("layer_norm", BF16, 8, 12288, arch, backward=True, row_dtypes=rows).path is not Path.PIPELINED


@pytest.mark.parametrize("op", NORMS)
def test_norm_backward_split_paths_on_a_gpu(op):
    tiled = S.BWD_TILED if op == "rms_norm" else S.LN_BWD_TILED
    n = PIPELINED_BWD.block_n + 1 if op == "rms_norm" else S.SPLIT_MIN_N_BWD  # past the pipelined rows

    def bwd(dtype, n=n, arch=H200, **kw):
        return route(op, dtype, 8, n, arch, **{"backward": True, "row_dtypes": (dtype, dtype), **kw})

    assert bwd(F32, n=S.SPLIT_MIN_N_BWD - 1) == Route(Path.ROWS)
    assert bwd(BF16) == Route(Path.STAGED, S.BWD_STAGED, (Route(Path.ROWS),))
    assert bwd(BF16, residual=True, row_dtypes=(BF16,) * 3).path is Path.STAGED  # three rows fit too
    for dtype in (F32, F16):
        assert bwd(dtype) == Route(Path.TILED, tiled, (Route(Path.ROWS),))
    assert bwd(BF16, aligned=False).path is Path.TILED
    assert bwd(BF16, residual=True, row_dtypes=(BF16, BF16, F32)).path is Path.TILED  # a residual gradient in fp32
    assert bwd(BF16, arch=MI300).path is Path.TILED
    most = S.SPLIT_MAX_PARTS * S.BWD_STAGED.slice_cols  # the widest rows of at most SPLIT_MAX_PARTS slices
    assert bwd(BF16, n=most).path is Path.STAGED and bwd(BF16, n=most + 1) == Route(Path.ROWS)
    assert bwd(F32, n=S.SPLIT_MAX_PARTS * tiled.slice_cols + 1) == Route(Path.ROWS)


def test_norm_backward_register_slices_without_a_tiled_config(monkeypatch):
    monkeypatch.setattr(S, "BWD_TILED", None)
    monkeypatch.setattr(S, "BWD_STAGED", None)
    assert route("rms_norm", BF16, 8, 1 << 16, H200, backward=True, row_dtypes=(BF16, BF16)) == Route(
        Path.SPLIT, S.BWD_SLICE, (Route(Path.ROWS),)
    )


def test_softmax_forward_resident_then_split_then_rows():
    def fwd(n, dtype=BF16, arch=H200, **kw):
        return route("softmax", dtype, 8, n, arch, **{"row_dtypes": (dtype,), **kw})

    assert fwd(S.SPLIT_MIN_N - 1) == Route(Path.ROWS, eager_plan=True)
    assert fwd(S.SPLIT_MIN_N) == Route(Path.SPLIT, S.FWD_SLICE, (Route(Path.ROWS),))
    assert fwd(S.RESIDENT_MIN_N - 1).path is Path.SPLIT
    then = (Route(Path.SPLIT, S.FWD_SLICE, (Route(Path.ROWS),)), Route(Path.ROWS))
    assert fwd(S.RESIDENT_MIN_N) == Route(Path.RESIDENT, S.RESIDENT, then)
    assert fwd(1 << 21).config == resident_config(H200, 1 << 21) == dataclasses.replace(S.RESIDENT_WIDE)
    for kw in ({"dtype": F16}, {"dtype": F32}, {"aligned": False}, {"row_dtypes": (F32,)}, {"arch": TURING},
               {"arch": MI300}):  # fmt: skip
        assert fwd(S.RESIDENT_MIN_N, **kw).path is Path.SPLIT, kw
    assert fwd(S.WIDE_MIN_N - 1, dtype=F32).config == S.FWD_SLICE
    assert fwd(S.WIDE_MIN_N, dtype=F32).config == S.FWD_SLICE_WIDE
    # Ampere: the ring shrinks to its shared memory
    assert fwd(S.RESIDENT_MIN_N, arch=AMPERE).config == resident_config(AMPERE, S.RESIDENT_MIN_N)
    # past RESIDENT_WIDE's slices: the split slices (and past theirs, at launch, the chunked passes)
    wide = S.RESIDENT_WIDE
    too_wide = S.SPLIT_MAX_PARTS * 2 * wide.chunk * (wide.ring - wide.left) + 2
    assert resident_config(H200, too_wide) is None and fwd(too_wide).path is Path.ROWS  # past the slices' too
    assert fwd(S.SPLIT_MAX_PARTS * S.FWD_SLICE_WIDE.slice_cols, arch=TURING).path is Path.SPLIT
    assert fwd(S.SPLIT_MAX_PARTS * S.FWD_SLICE_WIDE.slice_cols + 1, arch=TURING) == Route(Path.ROWS)


def test_softmax_backward_splits_past_16k():
    def bwd(n, arch=H200):
        return route("softmax", BF16, 8, n, arch, backward=True, row_dtypes=(BF16, BF16))

    assert bwd(S.SOFTMAX_SPLIT_MIN_N_BWD - 1) == Route(Path.ROWS)
    assert bwd(S.SOFTMAX_SPLIT_MIN_N_BWD) == Route(Path.SPLIT, S.SOFTMAX_BWD_SLICE, (Route(Path.ROWS),))
    assert bwd(S.SOFTMAX_BWD_WIDE_MIN_N - 1).config == S.SOFTMAX_BWD_SLICE
    assert bwd(S.SOFTMAX_BWD_WIDE_MIN_N).config == S.SOFTMAX_BWD_SLICE_WIDE
    assert bwd(S.SOFTMAX_BWD_WIDE_MIN_N, arch=INTERPRETER) == Route(Path.ROWS)


@pytest.mark.parametrize("op", [*NORMS, "softmax"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("arch", [H200, AMPERE, MI300, INTERPRETER])
def test_every_call_narrower_than_row_kernels_below_takes_the_row_kernels(op, backward, arch):
    """The host returns ROW_KERNEL below row_kernels_below() without asking route (nor looking the arch and the
    alignment up): route must agree, whatever the operands."""
    below = row_kernels_below()
    assert below == S.SPLIT_MIN_N_BWD  # with today's thresholds: the pipelined and split backward's 8K + 1
    if op != "softmax":  # the bound is tight: the norms' backward leaves the row kernels right at it
        assert route(op, BF16, 4, below, H200, backward=True, row_dtypes=(BF16, BF16)).path is not Path.ROWS
    for n in (1, 1000, 4096, below - 2, below - 1):
        for dtype in (BF16, F16, F32):
            for kw in ({}, {"residual": True}, {"aligned": False}, {"quant": torch.int8}, {"smooth": True},
                       {"row_dtypes": (dtype, dtype), "vector_dtypes": (dtype, dtype)}):  # fmt: skip
                assert route(op, dtype, 4, n, arch, backward=backward, **kw).path is Path.ROWS, (n, dtype, kw)
    assert ROW_KERNEL == Route(Path.ROWS)


def test_tuning_skips_the_buckets_the_row_kernels_do_not_serve():
    from fly_norm.autotune import TUNABLES, TUNE_BUCKETS

    routed = {"rmsnorm_bwd": ("rms_norm", True), "layernorm_fwd": ("layer_norm", False),
              "softmax_bwd": ("softmax", True)}  # fmt: skip
    for name, (op, backward) in routed.items():
        keys = [k["n_bucket"] for k in TUNABLES[name].tune_keys("sm_90")]
        kw = dict(backward=backward, row_dtypes=(BF16, BF16), vector_dtypes=(BF16, BF16))
        want = [n for n in TUNE_BUCKETS if route(op, BF16, 1, n, H200, **kw).path is Path.ROWS]
        assert keys == want and keys[0] == 256, name
        assert [k["n_bucket"] for k in TUNABLES[name].tune_keys("cpu")] == list(TUNE_BUCKETS)


# ---------------------------------------------------------- the host code follows it

_KERNELS = {  # (op, backward, path) -> the kernel the host launches
    **{(op, False, Path.ROWS): "norm_fwd_kernel" for op in NORMS},
    **{(op, False, Path.SPLIT): "norm_fwd_split_kernel" for op in NORMS},
    **{(op, False, Path.STAGED): "norm_fwd_staged_kernel" for op in NORMS},
    **{(op, True, p): "norm_bwd_kernel" for op in NORMS for p in (Path.ROWS, Path.PIPELINED)},
    **{(op, True, Path.SPLIT): "norm_bwd_split_kernel" for op in NORMS},
    **{(op, True, Path.TILED): "norm_bwd_tiled_kernel" for op in NORMS},
    **{(op, True, Path.STAGED): "norm_bwd_staged_kernel" for op in NORMS},
    ("softmax", False, Path.ROWS): "softmax_fwd_kernel",
    ("softmax", False, Path.SPLIT): "softmax_fwd_split_kernel",
    ("softmax", False, Path.RESIDENT): "softmax_fwd_resident_kernel",
    ("softmax", True, Path.ROWS): "softmax_bwd_kernel",
    ("softmax", True, Path.SPLIT): "softmax_bwd_split_kernel",
}


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))


@pytest.fixture
def fake_h200(monkeypatch):
    """A fake H200 behind flydsl.arch.current; launches recorded (kernel name, constexprs and options), not run;
    ``waves[0]`` programs an SM for every split kernel (0: no wave fits, so each falls back)."""
    launched: list = []
    waves = [2]
    monkeypatch.setattr(flydsl.arch, "current", lambda device=None: H200)
    monkeypatch.setattr(flyc, "launch", lambda kernel, grid, *a, **meta: launched.append((_name(kernel), meta)))
    monkeypatch.setattr(flyc, "programs_per_sm", lambda kernel, *a, **meta: waves[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # pdl_options on a CPU build
    monkeypatch.setattr(S, "_POOLS", {})
    monkeypatch.setattr(S, "_FWD_POOLS", {})
    return launched, waves


def _rows(m, n, dtype, aligned=True):
    """[m, n] rows of a row stride of n + 2: word aligned (for even n), or starting an element later."""
    base = torch.zeros(m, n + 2, dtype=dtype)
    return base[:, :n] if aligned else base[:, 1 : n + 1]


def _expect(r: Route, op: str, backward: bool, fits: bool) -> tuple[str, Route]:
    """The kernel the host must launch for route ``r`` and the route it comes from: ``r``'s own, or, when no
    wave fits, its last fallback's (the row kernel)."""
    taken = r if fits or not r.fallbacks else r.fallbacks[-1]
    return _KERNELS[op, backward, taken.path], taken


def _check_config(meta: dict, taken: Route) -> None:
    cfg = taken.config
    if taken.path in (Path.SPLIT, Path.TILED, Path.STAGED):
        assert meta["SLICE"] == cfg.slice_cols and meta["num_warps"] == cfg.warps
    if taken.path is Path.RESIDENT:
        assert meta["CHUNK"] == cfg.chunk and meta["RING"] == cfg.ring and meta["num_warps"] == cfg.warps
    if taken.path is Path.PIPELINED:
        assert meta["PIPELINED"] == routing.PIPELINED_BWD_STAGES and meta["BLOCK_N"] == cfg.block_n
    if taken.path is Path.ROWS and "PIPELINED" in meta:
        assert meta["PIPELINED"] == 0


WIDTHS = [1000, 8192, 8193, 16384, 16385, 32768, 32769, 65535, 65536, 131072, 1 << 20]


@pytest.mark.parametrize("fits", [True, False], ids=["wave_fits", "no_wave"])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_forward_launches_follow_the_route(fake_h200, fits, dtype, aligned):
    launched, waves = fake_h200
    waves[0] = 2 if fits else 0
    for n in WIDTHS:
        x = _rows(2, n, dtype, aligned)
        w, b, r = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype), torch.zeros(2, n, dtype=dtype)
        calls = {
            ("rms_norm", ()): (rms_norm, (x, w)),
            ("rms_norm", ("residual",)): (lambda *a: rms_norm(*a[:2], residual=a[2]), (x, w, r)),
            ("layer_norm", ()): (layer_norm, (x, w, b)),
            ("layer_norm", ("quant",)): (layer_norm_quant, (x, w, b)),
            ("rms_norm", ("quant",)): (rms_norm_quant, (x, w)),
            ("softmax", ()): (softmax_mod.softmax, (x,)),
        }
        for (op, extra), (fn, args) in calls.items():
            launched.clear()
            fn(*args)
            y_dtype = torch.int8 if "quant" in extra else dtype
            word = aligned and n % 2 == 0  # the output is contiguous; x's rows start off by an element
            r_ = route(op, dtype, 2, n, H200, residual="residual" in extra, row_dtypes=(y_dtype,),
                       quant=torch.int8 if "quant" in extra else None, vector_dtypes=(dtype,) * 2,
                       aligned=word)  # fmt: skip
            kernel, taken = _expect(r_, op, False, fits)
            assert [k for k, _ in launched] == [kernel], (op, extra, n, r_)
            _check_config(launched[0][1], taken)


@pytest.mark.parametrize("fits", [True, False], ids=["wave_fits", "no_wave"])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_backward_launches_follow_the_route(fake_h200, fits, dtype, aligned):
    from flydsl_common.rows import RowConfig

    launched, waves = fake_h200
    waves[0] = 2 if fits else 0
    for n in WIDTHS:
        for op, dres in (("rms_norm", False), ("rms_norm", True), ("layer_norm", False), ("softmax", False)):
            h = _rows(3, n, dtype, aligned)
            dy, dx = torch.zeros(3, n, dtype=dtype), torch.zeros(3, n, dtype=dtype)
            dr = torch.zeros(3, n, dtype=dtype) if dres else None
            stats = torch.zeros(3, dtype=torch.float32)
            cfg = RowConfig(1, 4096, 16, False)  # the tuner's, as far as the route is concerned
            launched.clear()
            if op == "softmax":
                softmax_mod._launch_bwd(dy, h, dx, cfg)
            else:
                dw = torch.zeros(n, dtype=torch.float32)
                backward_into(h, dw, dy, dr, None if op == "rms_norm" else stats, stats, dx, dw, None, 0.0,
                              op == "rms_norm", cfg)  # fmt: skip
            word = aligned and n % 2 == 0
            rows = (dtype, dtype) if dr is None else (dtype, dtype, dtype)
            r_ = route(op, dtype, 3, n, H200, backward=True, residual=dres, row_dtypes=rows, aligned=word)
            kernel, taken = _expect(r_, op, True, fits)
            assert launched and launched[0][0] == kernel, (op, dres, n, r_, launched)
            _check_config(launched[0][1], taken)


# ---------------------------------------------------------------- the split configs' validity predicate

SHIPPED = ("FWD_SLICE", "FWD_SLICE_WIDE", "LN_FWD_SLICE", "BWD_SLICE", "BWD_TILED", "LN_BWD_TILED", "SOFTMAX_BWD_SLICE",
           "SOFTMAX_BWD_SLICE_WIDE", "FWD_STAGED", "BWD_STAGED", "RESIDENT", "RESIDENT_WIDE")  # fmt: skip


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_split_configs_are_valid(name):
    assert S.split_config_valid(getattr(S, name), H200)


def test_every_route_names_a_valid_config():
    """Over the widths, dtypes and directions of every op, on each arch: a split, tiled, staged or resident
    route's config passes the predicate (the row kernels' is the tuner's: RowConfig or None)."""
    for arch in (H200, AMPERE, MI300):
        for op in routing.OPS:
            for dtype in (BF16, F16, F32):
                for n in (S.SPLIT_MIN_N, 65536, 131072, 262144, 1 << 20, 3 << 19):
                    for backward in (False, True):
                        for r in (route(op, dtype, 64, n, arch, backward=backward),):
                            for step in (r, *r.fallbacks):
                                if step.path in (Path.ROWS, Path.PIPELINED):
                                    continue
                                assert S.split_config_valid(step.config, arch), (arch.name, op, dtype, n, step)


@pytest.mark.parametrize(
    "cfg",
    [
        S.SliceConfig(slice_cols=3000, warps=4),  # not a power of two
        S.SliceConfig(slice_cols=4096, warps=3),  # a warp count Triton does not take
        S.SliceConfig(slice_cols=64, warps=4),  # fewer columns than lanes
        S.SliceConfig(slice_cols=4096, warps=4, maxnreg=100),  # not a multiple of 8
        S.SliceConfig(slice_cols=4096, warps=4, maxnreg=264),  # past ptxas's 255
        S.TiledConfig(slice_cols=2048, warps=4, maxnreg=168, tile_rows=3),
        S.TiledConfig(slice_cols=2048, warps=4, maxnreg=168, tile_rows=4, lead=3),
        S.StagedConfig(slice_cols=16384, warps=16, stages=0),
        S.StagedConfig(slice_cols=512, warps=16, stages=3),  # fewer words than lanes
        S.ResidentConfig(chunk=1000, ring=10, warps=4, left=2),
        S.ResidentConfig(chunk=1024, ring=2, warps=4, left=2),  # nothing left for a slice
        S.ResidentConfig(chunk=8192, ring=12, warps=16, left=4),  # a 384 KB ring
        S.ResidentConfig(chunk=64, ring=10, warps=4, left=2),  # fewer words than lanes
        routing.PIPELINED_BWD,  # not a split config
    ],
    ids=lambda c: repr(c)[:60],
)
def test_invalid_split_configs_are_refused(cfg):
    assert not S.split_config_valid(cfg, H200)


def test_a_ring_that_fits_sm90_may_not_fit_an_older_gpu():
    assert S.split_config_valid(S.RESIDENT_WIDE, H200) and not S.split_config_valid(S.RESIDENT_WIDE, AMPERE)
