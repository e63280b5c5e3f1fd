"""conv backward (input, weight and bias gradients) against fp64 autograd through torch's convolutions; the
custom ops (opcheck, torch.compile fullgraph, eager and traced backward); the FlyConv modules; the weight
gradient's split reduction and its determinism.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from conv_helpers import GRAD_TOL, rand, weight
from torch import nn

import flydsl.direct
from fly_conv import FlyConv1d, FlyConv2d, FlyConv3d, conv
from fly_conv._kernels.layout import launch_sum_splits
from fly_conv.autotune import ConvProblem, wgrad_over_taps, wgrad_splits
from flydsl.arch import SM90
from flydsl.testing import assert_rel_close, tolerance
from flydsl_common.reference import activation_ref

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
conv_mod = importlib.import_module("fly_conv.conv")

# (rank, N, C_in, K_out, spatial, kernel, stride, padding, dilation, groups, padding_mode)
CASES = [
    (2, 2, 5, 6, (7, 6), 3, 1, 1, 1, 1, "zeros"),  # the plain 3x3
    (2, 2, 6, 8, (9, 8), 3, 2, 1, 1, 2, "zeros"),  # stride 2 (dgrad's stride-aware gather), groups 2
    (2, 1, 4, 4, (9, 10), 5, 3, 2, 2, 1, "zeros"),  # stride 3, dilation 2, kernel 5
    (2, 1, 5, 6, (8, 9), 3, 1, 2, 2, 1, "zeros"),  # stride 1, dilation 2: dgrad's reversed taps step by 2
    (2, 2, 4, 6, (8, 7), 3, (1, 2), 1, 1, 1, "zeros"),  # stride 1 in one dim only: dgrad's division path
    (2, 2, 8, 5, (5, 5), 1, 1, 0, 1, 1, "zeros"),  # pointwise
    (2, 2, 6, 6, (7, 7), 3, 1, 1, 1, 6, "zeros"),  # depthwise: dgrad by the direct kernel, taps reversed
    (2, 2, 8, 12, (7, 6), 3, 1, 2, 2, 2, "zeros"),  # 4 channels a group into 6, dilation 2: direct dgrad
    (2, 1, 4, 8, (6, 7), 4, 1, "same", 1, 4, "zeros"),  # depthwise x2, even kernel "same": padding 1 / 2
    (2, 1, 4, 4, (5, 5), 3, 1, 3, 1, 4, "zeros"),  # padding past the window: the dgrad's padding is -1
    (1, 2, 16, 8, (19,), 5, 1, 2, 1, 4, "zeros"),  # 1D, 4 channels a group into 2
    (2, 1, 4, 6, (6, 7), 3, 1, 1, 1, 1, "reflect"),  # padding mode: torch's pad is differentiated by torch
    (1, 2, 17, 9, (23,), 7, 2, 3, 1, 1, "zeros"),  # 1D, 17 channels
    (3, 1, 3, 4, (3, 5, 4), 3, 1, 1, 1, 1, "zeros"),  # 3D
]


def _grads(case, dtype, device, activation=None, channels_last=False, fn=conv):
    rank, n, c, k, spatial, ks, stride, padding, dilation, groups, mode = case
    x = rand(n, c, *spatial, dtype=dtype, device=device)
    if channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    w = weight(k, c // groups, (ks,) * rank, dtype=dtype, device=device)
    b = rand(k, dtype=dtype, device=device, seed=2)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, padding_mode=mode,
              activation=activation)  # fmt: skip
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    y = fn(*leaves, **kw)
    dy = rand(*y.shape, dtype=dtype, device=device, seed=3)
    y.backward(dy)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    y_ref = _ref(*ref_leaves, **kw)
    y_ref.backward(dy.double())
    return y, y_ref, leaves, ref_leaves


def _check(y, y_ref, leaves, ref_leaves, dtype):
    assert_rel_close(y, y_ref, tol=tolerance(dtype))
    for name, t, r in zip(("dx", "dweight", "dbias"), leaves, ref_leaves, strict=True):
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        assert_rel_close(t.grad, r.grad, tol=GRAD_TOL[dtype], name=name)


def _ref(x, w, b, stride, padding, dilation, groups, padding_mode, activation):
    """The differentiable fp64 reference: torch's functional convolution (and F.pad for the padding modes)."""
    rank = w.dim() - 2
    if padding_mode != "zeros":
        p = (padding,) * rank if isinstance(padding, int) else padding
        x = F.pad(x, [v for q in reversed(p) for v in (q, q)], mode=padding_mode)
        padding = 0
    fn = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
    return activation_ref(fn(x, w, b, stride, padding, dilation, groups), activation)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}d-c{c[2]}-ks{c[5]}-s{c[6]}-d{c[8]}-g{c[9]}-{c[10]}")
def test_gradients(case, device, poisoned):
    _check(*_grads(case, F16, device), F16)


@pytest.mark.parametrize(("case", "direct_launches"), [(CASES[6], 2), (CASES[7], 2), (CASES[1], 1), (CASES[0], 0)],
                         ids=["depthwise", "narrow-groups", "narrow-groups-s2", "dense"])  # fmt: skip
def test_direct_kernel_runs_the_forward_and_stride_1_input_gradient(case, direct_launches, device, monkeypatch):
    """Narrow groups: the forward by the direct kernel, and at stride 1 the input gradient too (a stride-2
    input gradient stays on the implicit GEMM)."""
    calls = []
    real = conv_mod.launch_direct
    monkeypatch.setattr(conv_mod, "launch_direct", lambda *a, **k: calls.append(1) or real(*a, **k))
    with flydsl.direct.general_path_only():  # a replayed call would not pass through the host code
        _check(*_grads(case, F16, device), F16)
    assert len(calls) == direct_launches


@pytest.mark.parametrize("programs_per_sm", [None, 1 << 20], ids=["default", "split"])
@pytest.mark.parametrize("multiplier", [1, 3])
def test_depthwise_weight_gradient_kernel(multiplier, programs_per_sm, device, monkeypatch):
    """Depthwise layers' weight gradient runs its own kernel (one launch; the tiled kernel never), its positions
    split (partial sums added in order) where the grid is short of the SMs: forced here with a huge target."""
    autotune = importlib.import_module("fly_conv.autotune")
    if programs_per_sm:
        monkeypatch.setattr(autotune, "_DW_WGRAD_PROGRAMS_PER_SM", programs_per_sm)
    calls = []
    for name in ("launch_depthwise_wgrad", "launch_wgrad"):
        real = getattr(conv_mod, name)
        monkeypatch.setattr(conv_mod, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    case = (2, 2, 4, 4 * multiplier, (16, 17), 3, 1, 2, 2, 4, "zeros")  # dilation 2: taps past the border
    with flydsl.direct.general_path_only():
        _check(*_grads(case, F16, device), F16)
    assert calls == ["launch_depthwise_wgrad"]
    if not flydsl.arch.current().is_interpreter:
        return  # the GPU's position steps differ; the split itself is checked on the CPU
    p = ConvProblem("wgrad", 2 * 16 * 17, multiplier, 1, 9, 4, F16)
    split = autotune.depthwise_wgrad_config(p, flydsl.arch.current()).split_k
    # 34 steps of 16 positions, 9 programs: the interpreter's 2 "SMs" want 16 programs (2 runs); forced, the
    # most runs that keep >= 8 steps each (4)
    assert split == (4 if programs_per_sm else 2)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3], CASES[5]], ids=["s1", "s2", "s1-d2", "1x1"])
def test_gradients_int64_offsets(case, device, poisoned, monkeypatch):
    """Every launch forced onto the implicit GEMM's int64 offsets (chosen on the host where an offset could pass
    2^31; no CPU-sized tensor reaches that): forward, input gradient of stride 1 and strided, pointwise."""
    implicit = importlib.import_module("fly_conv._kernels.implicit_gemm")
    monkeypatch.setattr(implicit, "_I32_MAX", -1)
    _check(*_grads(case, F16, device), F16)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_gradients_with_activation(activation, device, poisoned):
    _check(*_grads(CASES[1], F16, device, activation=activation), F16)


def test_gradients_fp32_and_bf16(device, poisoned):
    _check(*_grads(CASES[1], F32, device), F32)
    _check(*_grads(CASES[0], BF16, device), BF16)


def test_gradients_channels_last(device, poisoned):
    y, y_ref, leaves, ref_leaves = _grads(CASES[1], F16, device, channels_last=True)
    _check(y, y_ref, leaves, ref_leaves, F16)
    assert leaves[0].grad.movedim(1, -1).is_contiguous()  # dx in x's memory format


def test_weight_gradient_split_and_deterministic(device, poisoned, monkeypatch):
    """The weight gradient with its positions split (partials summed in order) matches, bit for bit across runs."""
    default = conv_mod.default_config

    def split_default(problem, arch):
        cfg = default(problem, arch)
        return dataclasses.replace(cfg, split_k=3) if problem.kind == "wgrad" else cfg

    monkeypatch.setattr(conv_mod, "default_config", split_default)
    case = (2, 2, 4, 5, (11, 9), 3, 1, 1, 1, 1, "zeros")  # 198 positions: 7 steps of 32, splits of 3, 3 and 1
    y, y_ref, leaves, ref_leaves = _grads(case, F16, device)
    _check(y, y_ref, leaves, ref_leaves, F16)
    first = leaves[1].grad.clone()
    _, _, leaves2, _ = _grads(case, F16, device)
    assert torch.equal(first, leaves2[1].grad)


@pytest.mark.parametrize("taps", [2, 4, 16])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[12], CASES[13]],
                         ids=["3x3", "stride2-groups2", "k5-dilated", "1d-k7", "3d"])  # fmt: skip
def test_weight_gradient_several_taps_a_program(device, poisoned, monkeypatch, taps, case):
    """Programs over several taps (the output-gradient tile loaded once for all of them; the last tap block
    partly, or at 16 wholly but for 9, past the filter's taps), with the positions split: the same weight
    gradient."""
    default = conv_mod.default_config

    def several(problem, arch):
        cfg = default(problem, arch)
        if problem.kind != "wgrad":
            return cfg
        return dataclasses.replace(wgrad_over_taps(cfg, taps), split_k=2)

    monkeypatch.setattr(conv_mod, "default_config", several)
    _check(*_grads(case, F16, device), F16)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize(
    "case",
    [
        (3, 3, 3, 4, (2, 3, 2), 3, 1, 1, 1, 1, "zeros"),  # 12 positions an image: a step crosses images and frames
        (2, 2, 4, 4, (3, 37), 3, 1, 1, 1, 1, "zeros"),  # rows wider than a step: steps within a row and across
        (2, 3, 4, 8, (3, 5), 3, 1, 1, 1, 4, "zeros"),  # depthwise (its own kernel), 15 positions an image
        (3, 2, 2, 2, (3, 2, 3), 3, 2, 1, 1, 1, "zeros"),  # stride 2: 2 x 1 x 2 outputs an image, a step of several
    ],
    ids=["3d-across-images", "2d-wide-rows", "depthwise", "3d-stride2"],
)
def test_weight_gradient_positions_step_across_rows_images_and_frames(device, poisoned, monkeypatch, case, block):
    """The weight-gradient kernels decode a step's positions once and then advance their (batch, depth, row,
    column) by the step's digits with carries: steps that span columns, rows, frames and images, and runs of
    positions split so a run starts mid-image, give the reference's gradient."""
    default, depthwise = conv_mod.default_config, conv_mod.depthwise_wgrad_config

    def stepped(problem, arch):
        cfg = default(problem, arch)
        return dataclasses.replace(cfg, block_k=block, split_k=2) if problem.kind == "wgrad" else cfg

    monkeypatch.setattr(conv_mod, "default_config", stepped)
    monkeypatch.setattr(conv_mod, "depthwise_wgrad_config",
                        lambda p, a: dataclasses.replace(depthwise(p, a), block_m=block, split_k=2))  # fmt: skip
    _check(*_grads(case, F16, device), F16)


# layers the row-block kernels do not serve, and why
ROWS_FALLBACKS = [
    ((2, 1, 8, 8, (9, 8), 3, 2, 1, 1, 1, "zeros"), "stride 2"), ((2, 1, 8, 8, (9, 8), 3, 1, 0, 1, 1, "zeros"),
     "a smaller output"), ((2, 1, 8, 8, (9, 8), 3, 1, 1, 1, 2, "zeros"), "groups"),
    ((2, 1, 6, 8, (9, 8), 3, 1, 1, 1, 1, "zeros"), "6 channels"),
]  # fmt: skip
ROWS_CASES = [
    (2, 2, 8, 16, (7, 6), 3, 1, 1, 1, 1, "zeros"),  # 3x3 'same': shifts before the first row, wrapped rows
    (2, 2, 16, 8, (5, 9), 1, 1, 0, 1, 1, "zeros"),  # 1x1: no shift, no padding
    (3, 2, 8, 8, (3, 4, 5), 3, 1, 1, 1, 1, "zeros"),  # 3x3x3 'same': frames
    (2, 1, 8, 8, (9, 8), 3, 1, 2, 2, 1, "zeros"),  # dilation 2, padding 2
    (1, 2, 16, 8, (23,), 7, 1, 3, 1, 1, "zeros"),  # 1D, k 7
]


def _rows_patched(monkeypatch, kind: str, launcher: str, recorded: int, **changes) -> list:
    """Every ``kind`` launch on a row-block config (the default's tile with ``tma`` and ``changes``); returns
    the list that argument ``recorded`` of each call of fly_conv.conv's ``launcher`` is appended to."""
    default, real = conv_mod.default_config, getattr(conv_mod, launcher)
    launches = []

    def rows(problem, arch):
        cfg = default(problem, arch)
        return dataclasses.replace(cfg, tma=True, **changes) if problem.kind == kind else cfg

    def counted(*args, **kw):
        launches.append(args[recorded])
        return real(*args, **kw)

    monkeypatch.setattr(conv_mod, "default_config", rows)
    monkeypatch.setattr(conv_mod, launcher, counted)
    return launches


def _rows_configs(monkeypatch, split: int, block_k: int = 16) -> list:
    """Every weight gradient on the row-block kernel's config (``split`` runs, ``block_k`` positions a step)."""
    return _rows_patched(monkeypatch, "wgrad", "launch_wgrad_rows", 3, split_k=split, block_k=block_k)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("case", ROWS_CASES, ids=["3x3", "1x1", "3d", "dilated", "1d-k7"])
def test_weight_gradient_row_blocks(device, poisoned, monkeypatch, case, split):
    """The row-block kernel (operands as blocks of rows by tensor descriptors, a tap's input rows one shift
    away, the padding's wrapped rows cancelled by zeroed output-gradient columns): the reference's gradients,
    with the positions split so runs start mid-image."""
    launches = _rows_configs(monkeypatch, split)
    _check(*_grads(case, F16, device, channels_last=True), F16)
    assert launches, "the row-block kernel did not run"


def _rows_gemm_configs(monkeypatch) -> list:
    """Every implicit GEMM (forward and input gradient) on the row-block kernel's config, unsplit; the list
    holds each row-block launch's ``transposed`` flag."""
    return _rows_patched(monkeypatch, "implicit", "launch_rows_gemm", 6, split_k=1)


@pytest.mark.parametrize(
    "case, activation",
    [*((c, None) for c in ROWS_CASES), ((2, 2, 24, 40, (7, 6), 3, 1, 1, 1, 1, "zeros"), "silu"),
     ((2, 2, 40, 24, (5, 7), 1, 1, 0, 1, 1, "zeros"), "relu")],
    ids=["3x3", "1x1", "3d", "dilated", "1d-k7", "24-to-40-silu", "1x1-40-to-24-relu"],
)  # fmt: skip
def test_rows_gemm_forward_and_input_gradient(device, poisoned, monkeypatch, case, activation):
    """The row-block forward and input gradient (a tap's rows one shift away, loaded as blocks by tensor
    descriptors; the padding's wrapped rows zeroed): the reference's output and gradients, both launches on
    the row-block kernel. 24 channels into 40: channel steps past a tap's channels (A's zero-filled columns
    against the next tap's weights) and a partial column tile, with bias and activation in the epilogue; 1x1
    from 40 channels to 24: the pointwise loop's channel steps, a ragged last one, in both directions."""
    launches = _rows_gemm_configs(monkeypatch)
    _check(*_grads(case, F16, device, activation=activation, channels_last=True), F16)
    assert False in launches and True in launches, launches


@pytest.mark.parametrize("case, why", ROWS_FALLBACKS, ids=lambda v: v if isinstance(v, str) else "")
def test_rows_gemm_falls_back(device, poisoned, monkeypatch, case, why):
    """Layers the row-block forward does not serve keep the gathering kernel under a ``tma`` config."""
    launches = _rows_gemm_configs(monkeypatch)
    _check(*_grads(case, F16, device, channels_last=True), F16)
    assert False not in launches, why


@pytest.mark.parametrize("case, why", ROWS_FALLBACKS, ids=lambda v: v if isinstance(v, str) else "")
def test_weight_gradient_row_blocks_fall_back(device, poisoned, monkeypatch, case, why):
    """Layers the row-block kernel does not serve keep the gathering kernel under a ``tma`` config."""
    launches = _rows_configs(monkeypatch, 2)
    _check(*_grads(case, F16, device, channels_last=True), F16)
    assert not launches, why


@pytest.mark.parametrize("splits", [1, 15, 16, 17, 40])
def test_split_sums_cover_every_split_and_column(device, splits):
    """The weight gradient's split sum: blocks of splits a load (the last one partial) and column blocks past
    the end masked; close to the fp64 sum, bit-identical on a second run, nothing written past ``n``."""
    n = 300  # columns: two full blocks of 128 and a partial one
    parts = torch.randn(splits, n, generator=torch.Generator().manual_seed(splits)).to(device)
    out = torch.full((n + 7,), float("nan"), dtype=BF16, device=device)
    launch_sum_splits(parts, out[:n])
    assert_rel_close(out[:n], parts.double().sum(0), tol=tolerance(BF16))
    assert out[n:].isnan().all()
    again = torch.empty(n, dtype=BF16, device=device)
    launch_sum_splits(parts, again)
    assert torch.equal(out[:n], again)


@pytest.mark.parametrize(
    "shape, layout, channels",
    [((2, 7, 5), "nc", 3), ((3, 1000, 1), "nc", 65), ((1, 17, 37), "last", 1000), ((4, 9, 61), "last", 64),
     ((2, 5, 6, 7), "sliced", 17), ((1, 1, 1), "last", 1)],
    ids=["1d-nc-3", "1d-nc-65-splits", "2d-last-1000", "2d-last-64-splits", "3d-sliced-17", "one-row"],
)  # fmt: skip
def test_bias_gradient_channel_sum(device, poisoned, shape, layout, channels):
    """The bias gradient's channel sum: row runs that cross batch boundaries and split boundaries (the
    ``splits`` cases hold over 512 rows), channels-last, NC* and a channel slice of a wider tensor; close to
    the fp64 sum, bit-identical on a second run."""
    nb, *spatial = shape
    wide = channels + 3 if layout == "sliced" else channels
    full = rand(nb, wide, *spatial, dtype=BF16, device=device)
    if layout == "last":
        full = full.movedim(1, -1).contiguous().movedim(-1, 1)
    g = full[:, 1 : channels + 1] if layout == "sliced" else full
    db = conv_mod._conv_bias_grad(g, BF16)
    assert db.shape == (channels,) and db.dtype == BF16
    assert_rel_close(db, g.double().sum([0, *range(2, g.dim())]), tol=tolerance(BF16))
    assert torch.equal(db, conv_mod._conv_bias_grad(g, BF16))
    empty = conv_mod._conv_bias_grad(g[:0], F16)
    assert empty.shape == (channels,) and not empty.any()


def test_channel_sum_splits():
    """Row runs of whole row blocks, at least 512 rows, every split holding rows, at most 128 splits."""
    from fly_conv._kernels.layout import channel_sum_splits

    for rows, channels in [(1, 1), (511, 3), (513, 3), (100352, 64), (100352, 1000), (7 * 10**6, 64)]:
        splits, per = channel_sum_splits(rows, channels)
        assert per % 128 == 0 and per >= 512
        assert (splits - 1) * per < rows <= splits * per
        assert splits <= 128
    assert channel_sum_splits(100352, 64) == (112, 896)


def test_wgrad_splits_fill_the_sms():
    few = ConvProblem("wgrad", 8 * 56 * 56, 64, 64, 9, 1, BF16)  # 9 tiles of 64 x 64: split to fill 132 SMs
    cfg = conv_mod.default_config(few, SM90)
    assert cfg.split_k > 1 and 9 * cfg.split_k >= 132
    assert wgrad_splits(cfg, ConvProblem("wgrad", 64, 64, 64, 9, 1, BF16), SM90) == 1  # too few positions


# ------------------------------------------------------------------------------ custom ops and tracing


def test_opcheck(device):
    x = rand(2, 4, 6, 5, dtype=F16, device=device)
    w = weight(6, 2, (3, 3), dtype=F16, device=device)
    b = rand(6, dtype=F16, device=device)
    torch.library.opcheck(torch.ops.fly_conv.conv.default, (x, w, b, [2, 1], [1, 1], [1, 1], [1, 1], 2, "relu", False))
    torch.library.opcheck(torch.ops.fly_conv.conv.default, (x, w, None, [1, 1], [1, 0], [1, 2], [1, 1], 2, None, True))


def test_torch_compile_fullgraph_forward_and_backward(device):
    backend = "aot_eager" if device.type == "cpu" else "inductor"
    x = rand(2, 4, 7, 6, dtype=F16, device=device).requires_grad_(True)
    w = weight(6, 4, (3, 3), dtype=F16, device=device).requires_grad_(True)
    b = rand(6, dtype=F16, device=device).requires_grad_(True)

    @torch.compile(fullgraph=True, backend=backend)
    def f(x, w, b):
        return conv(x, w, b, stride=2, padding=1, activation="silu")

    y = f(x, w, b)
    dy = rand(*y.shape, dtype=F16, device=device, seed=5)
    y.backward(dy)
    refs = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    y_ref = _ref(*refs, 2, 1, 1, 1, "zeros", "silu")
    y_ref.backward(dy.double())
    assert_rel_close(y, y_ref, tol=tolerance(F16))
    for t, r in zip((x, w, b), refs, strict=True):
        assert_rel_close(t.grad, r.grad, tol=GRAD_TOL[F16])


# ------------------------------------------------------------------------------ modules


@pytest.mark.parametrize(
    "cls,torch_cls,rank,kw",
    [(FlyConv1d, nn.Conv1d, 1, dict(padding=3, padding_mode="circular")),
     (FlyConv2d, nn.Conv2d, 2, dict(stride=2, padding=1, groups=2)),
     (FlyConv2d, nn.Conv2d, 2, dict(padding="same", padding_mode="replicate", bias=False)),
     (FlyConv3d, nn.Conv3d, 3, dict(padding=1))],
    ids=["1d-circular", "2d-grouped", "2d-same-replicate", "3d"],
)  # fmt: skip
def test_modules_match_torch(cls, torch_cls, rank, kw, device):
    torch.manual_seed(0)
    ks = 7 if rank == 1 else 3
    ours = cls(4, 6, ks, device=device, dtype=F16, **kw)
    ref = torch_cls(4, 6, ks, device=device, dtype=torch.float64, **kw)
    assert isinstance(ours, torch_cls)
    ref.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    x = rand(2, 4, *([9] * rank if rank < 3 else [4, 5, 6]), dtype=F16, device=device)
    xo, xr = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    y, y_ref = ours(xo), ref(xr)
    assert_rel_close(y, y_ref, tol=tolerance(F16))
    dy = rand(*y.shape, dtype=F16, device=device, seed=4)
    y.backward(dy)
    y_ref.backward(dy.double())
    assert_rel_close(xo.grad, xr.grad, tol=GRAD_TOL[F16], name="dx")
    assert_rel_close(ours.weight.grad, ref.weight.grad, tol=GRAD_TOL[F16], name="dweight")


def test_module_activation(device):
    layer = FlyConv2d(3, 5, 3, padding=1, activation="relu", device=device, dtype=F16)
    x = rand(1, 3, 6, 6, dtype=F16, device=device)
    with torch.no_grad():
        y = layer(x)
    y_ref = _ref(x.double(), layer.weight.double(), layer.bias.double(), 1, 1, 1, 1, "zeros", "relu")
    assert_rel_close(y, y_ref, tol=tolerance(F16))
    assert "activation='relu'" in repr(layer)
    with pytest.raises(ValueError, match="activation"):
        FlyConv2d(3, 5, 3, activation="tanh")


# ------------------------------------------------------------------------------ GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [(2, 8, 64, 64, (56, 56), 3, 1, 1, 1, 1, "zeros"), (2, 8, 128, 128, (28, 28), 3, 2, 1, 1, 1, "zeros"),
     (2, 8, 256, 64, (28, 28), 1, 1, 0, 1, 1, "zeros"), (2, 8, 256, 256, (14, 14), 3, 1, 1, 1, 32, "zeros"),
     (3, 2, 32, 32, (8, 16, 16), 3, 1, 1, 1, 1, "zeros"), (1, 8, 128, 128, (1000,), 7, 1, 3, 1, 1, "zeros")],
)  # fmt: skip
def test_gradients_gpu(case, device, poisoned):
    _check(*_grads(case, BF16, device, channels_last=True), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [(2, 8, 64, 64, (56, 56), 3, 1, 1, 1, 1, "zeros"), (2, 8, 256, 64, (28, 28), 1, 1, 0, 1, 1, "zeros"),
     (2, 8, 256, 256, (14, 14), 3, 1, 1, 1, 1, "zeros"), (3, 2, 32, 32, (8, 16, 16), 3, 1, 1, 1, 1, "zeros")],
)  # fmt: skip
@pytest.mark.parametrize("block_k", [32, 64])
def test_weight_gradient_row_blocks_gpu(case, block_k, device, poisoned, monkeypatch):
    launches = _rows_configs(monkeypatch, 4, block_k)
    _check(*_grads(case, BF16, device, channels_last=True), BF16)
    assert launches


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case, activation",
    [((2, 8, 64, 64, (56, 56), 3, 1, 1, 1, 1, "zeros"), None), ((2, 8, 256, 64, (28, 28), 1, 1, 0, 1, 1, "zeros"),
      "relu"), ((2, 8, 256, 256, (14, 14), 3, 1, 1, 1, 1, "zeros"), "silu"),
     ((3, 2, 32, 32, (8, 16, 16), 3, 1, 1, 1, 1, "zeros"), None), ((1, 4, 96, 136, (257,), 7, 1, 3, 1, 1, "zeros"),
      None)],
    ids=["3x3-c64", "1x1-relu", "3x3-c256-silu", "3d", "1d-k7-c96-k136"],
)  # fmt: skip
def test_rows_gemm_gpu(case, activation, device, poisoned, monkeypatch):
    """The row-block forward and input gradient at the sizes of the tuned layers, on the defaults' tiles."""
    launches = _rows_gemm_configs(monkeypatch)
    _check(*_grads(case, BF16, device, activation=activation, channels_last=True), BF16)
    assert False in launches and True in launches, launches
