"""Split-K of the forward implicit GEMM: the K steps (taps x channel blocks) cut into contiguous runs, each
run's fp32 partial sums in its own slice of a workspace, added in split order by a second pass that runs the
epilogue (bias, activation, fp8 dequantization, the cast, the store in the output's layout).

Forced split configs (``config=``) against the fp64 reference on the interpreter (ranks, groups, stride,
padding, dilation, the pointwise path, every activation, NC* and channels-last outputs, step counts the split
does not divide, fp8); bit-identical reruns; the default rule as a pure function on sm_90; the host path is
allocations, views and flydsl launches only (what flydsl.direct replays); the sm_90 compile of both kernels;
a ``gpu`` test at the 7x7 512 -> 512 layer that the default splits. Every output and workspace starts
poisoned (NaN).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from conv_helpers import rand, weight

import flydsl.compiler as flyc
from fly_conv import conv, conv_ref
from fly_conv._kernels.implicit_gemm import k_splits
from fly_conv.autotune import (
    ConvConfig,
    ConvProblem,
    candidates,
    config_valid,
    default_config,
    implicit_splits,
    tuning_key,
)
from flydsl.arch import INTERPRETER, SM90
from flydsl.testing import assert_rel_close, host_work, tolerance

F32, BF16, F8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
conv_mod = importlib.import_module("fly_conv.conv")

# (rank, N, C_in, K_out, spatial, kernel, stride, padding, dilation, groups, activation, K steps at block_k 16):
# each line says why it is here
CASES = [
    (2, 2, 20, 24, (7, 6), 3, 1, 1, 1, 1, "relu", 18),  # 3x3, a ragged channel block: 2 blocks x 9 taps
    (2, 2, 24, 20, (9, 8), 3, 2, 2, 2, 2, "silu", 9),  # groups 2 (12 channels a group), stride 2, dilation 2
    (2, 1, 16, 12, (6, 7), (5, 2), 1, 0, 1, 1, "gelu", 10),  # 10 taps: 10 steps, split 3 -> 4 + 4 + 2
    (2, 2, 64, 40, (5, 4), 1, 1, 0, 1, 1, "gelu_tanh", 4),  # 1x1 pointwise: the GEMM path's channel loop
    (1, 2, 16, 24, (21,), 5, 2, 2, 1, 1, None, 5),  # 1D strided, no activation
    (3, 1, 24, 12, (4, 5, 3), 3, 1, 1, 1, 2, "relu", 27),  # 3D 3x3x3, groups 2 (12 channels a group)
]
_BLOCK_K = 16


def _ids(c):
    ks = "x".join(map(str, c[5])) if isinstance(c[5], tuple) else c[5]
    return f"{c[0]}d-c{c[2]}-k{c[3]}-ks{ks}-s{c[6]}-g{c[9]}-{c[10]}"


def _cfg(split: int, block_k: int = _BLOCK_K) -> ConvConfig:
    return ConvConfig(32, 32, block_k, group_m=4, num_stages=1, split_k=split)


def _inputs(case, dtype, device, channels_last=False):
    rank, n, c, k, spatial, ks, stride, padding, dilation, groups, act, _ = case
    kernel = ks if isinstance(ks, tuple) else (ks,) * rank
    x = rand(n, c, *spatial, dtype=dtype, device=device)
    if channels_last:
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    w = weight(k, c // groups, kernel, dtype=dtype, device=device)
    b = rand(k, dtype=dtype, device=device, seed=2)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, activation=act)
    return x, w, b, kw


def _splits(case, split: int, block_k: int = _BLOCK_K) -> tuple[int, int]:
    """(splits, steps a split) the launch takes for ``case`` forced to ``split``."""
    rank, n, c, _, spatial, ks, *_ = case
    kernel = ks if isinstance(ks, tuple) else (ks,) * rank
    kernel = (1,) * (3 - rank) + kernel
    x5 = torch.empty((n, 1, 1, 1, c), device="meta")
    return k_splits(x5, (kernel, None, None, None), case[9], _cfg(split, block_k))


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_split_forward_matches_torch(case, split, device, poisoned):
    """fp32 (the full-precision dot), NC* output: every K step summed once, whatever split it fell in."""
    x, w, b, kw = _inputs(case, F32, device)
    splits, per = _splits(case, split)
    steps = case[-1]
    assert splits > 1 and splits == -(-steps // per) and per * (splits - 1) < steps  # no split is empty
    y = conv(x, w, b, **kw, config=_cfg(split))
    assert y.is_contiguous()
    assert_rel_close(y, conv_ref(x, w, b, **kw), tol=1e-5)


def test_split_of_steps_it_does_not_divide():
    assert _splits(CASES[2], 3) == (3, 4)  # 10 steps: 4 + 4 + 2
    assert _splits(CASES[1], 2) == (2, 5)  # 9 steps: 5 + 4
    assert _splits(CASES[3], 3) == (2, 2)  # 4 steps asked for 3 splits: 2 + 2 (no split left empty)
    assert _splits(CASES[3], 8) == (4, 1)  # more splits than steps: one step each


@pytest.mark.parametrize("layout", ["channels_last_memory", "nhwc", "nchw_from_channels_last"])
@pytest.mark.parametrize("split", [2, 3])
def test_split_output_layouts(layout, split, device, poisoned):
    """The reduce pass stores through the output's own strides: channels-last memory (NC* dims), N*C dims, and
    a contiguous NC* output of a channels-last input."""
    case = CASES[1]
    x, w, b, kw = _inputs(case, F32, device, channels_last=True)
    out_layout = {"channels_last_memory": None, "nhwc": "NHWC", "nchw_from_channels_last": "NCHW"}[layout]
    y = conv(x, w, b, **kw, output_layout=out_layout, config=_cfg(split))
    ref = conv_ref(x, w, b, **kw, output_layout=out_layout)
    if layout == "channels_last_memory":
        assert y.is_contiguous(memory_format=torch.channels_last)
    else:
        assert y.is_contiguous()
    assert_rel_close(y, ref, tol=1e-5)


def test_split_3d_channels_last_output(device, poisoned):
    case = CASES[5]
    x, w, b, kw = _inputs(case, F32, device)
    y = conv(x, w, b, **kw, output_layout="NDHWC", config=_cfg(3))
    assert_rel_close(y, conv_ref(x, w, b, **kw, output_layout="NDHWC"), tol=1e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["3x3", "pointwise"])
def test_split_fp16_no_bias(case, device, poisoned):
    """A 16-bit output: the fp32 sum is cast once, in the reduce pass."""
    x, w, _, kw = _inputs(case, torch.float16, device)
    y = conv(x, w, None, **kw, config=_cfg(2))
    assert y.dtype == torch.float16
    assert_rel_close(y, conv_ref(x, w, None, **kw), tol=tolerance(torch.float16))


@pytest.mark.parametrize("scale", ["tensor", "channel"])
@pytest.mark.parametrize("split", [2, 3])
def test_split_fp8_forward(scale, split, device, poisoned):
    """fp8 shares the path: the partial sums are raw fp8 x fp8 products, the reduce pass dequantizes them by
    x_scale * w_scale (per tensor or per output channel) before the bias and the activation."""
    x = rand(2, 64, 6, 7, dtype=F32, device=device).to(F8)  # 2 blocks of 32 channels x 9 taps: 18 steps
    w = weight(40, 64, (3, 3), dtype=F32, device=device).mul(4).to(F8)
    g = torch.Generator().manual_seed(7)
    xs = (torch.rand(1, generator=g) + 0.5).to(device)
    ws = (torch.rand(() if scale == "tensor" else (40,), generator=g) * 0.25 + 0.125).to(device)
    b = rand(40, dtype=F32, device=device, seed=2)
    kw = dict(padding=1, activation="silu", x_scale=xs, w_scale=ws)
    y = conv(x, w, b, **kw, config=_cfg(split, block_k=32))
    assert y.dtype == BF16
    assert_rel_close(y, conv_ref(x, w, b, **kw), tol=tolerance(BF16))


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["3x3", "pointwise"])
def test_split_is_deterministic(case, device, poisoned):
    """The splits are added in a fixed order: two runs are bit-identical (no atomics)."""
    x, w, b, kw = _inputs(case, F32, device)
    first = conv(x, w, b, **kw, config=_cfg(3))
    second = conv(x, w, b, **kw, config=_cfg(3))
    assert torch.equal(first, second)
    assert_rel_close(first, conv_ref(x, w, b, **kw), tol=1e-5)


# ------------------------------------------------------------------------------ the config


def test_split_validity():
    fwd = ConvProblem("implicit", 32 * 49, 512, 512, 9, 1, BF16)
    assert config_valid(ConvConfig(128, 128, 64, split_k=2), fwd, SM90)
    assert config_valid(_cfg(3), fwd, INTERPRETER)
    dgrad = dataclasses.replace(fwd, transposed=True)  # the input gradient stays unsplit
    assert not config_valid(ConvConfig(128, 128, 64, split_k=2), dgrad, SM90)
    dw = ConvProblem("direct", 1024, 64, 1, 9, 64, BF16)
    assert not config_valid(ConvConfig(64, 8, 1, split_k=2), dw, SM90)
    assert not config_valid(ConvConfig(128, 128, 64, split_k=0), fwd, SM90)


def test_default_splits_the_7x7_512_layer_on_sm90():
    """N = 32, 7x7 maps, 512 -> 512 3x3: 1568 x 512 is 52 tiles of 128 x 128 on 132 SMs, K = 4608 (72 steps of
    64): split so that tiles x splits fits one wave, each split >= 8 steps."""
    layer = ConvProblem("implicit", 32 * 7 * 7, 512, 512, 9, 1, BF16, (3, 3), (1, 1), (1, 1))
    cfg = default_config(layer, SM90)
    assert (cfg.block_m, cfg.block_n, cfg.block_k) == (128, 128, 64)
    tiles = 13 * 4
    assert cfg.split_k == 2 and tiles * cfg.split_k <= SM90.sm_count < tiles * (cfg.split_k + 1)
    assert 72 // cfg.split_k >= 8 and config_valid(cfg, layer, SM90)
    assert default_config(layer, SM90) == cfg  # pure
    fp8 = default_config(dataclasses.replace(layer, dtype=F8), SM90)  # 128 channels a step: 36 steps
    assert fp8.split_k == 2 and fp8.block_k == 128
    # its input gradient (the transposed GEMM) and the interpreter never split
    assert default_config(dataclasses.replace(layer, transposed=True), SM90).split_k == 1
    assert default_config(layer, INTERPRETER).split_k == 1


def test_default_does_not_split_a_full_grid_or_few_steps():
    resnet = ConvProblem("implicit", 32 * 56 * 56, 64, 64, 9, 1, BF16)  # 784 tiles: several waves
    cfg = default_config(resnet, SM90)
    assert cfg.split_k == 1 and cfg.block_m == 128
    small = ConvProblem("implicit", 2 * 7 * 7, 64, 64, 9, 1, BF16)  # 1 tile but 9 steps: not worth a split
    cfg = default_config(small, SM90)
    assert cfg.split_k == 1 and cfg.block_m == 64  # the 64-row tiles instead
    many = ConvProblem("implicit", 64, 2048, 2048, 9, 1, BF16)  # 16 tiles, 288 steps: capped at 8
    assert default_config(many, SM90).split_k == 8
    assert implicit_splits(ConvConfig(128, 128, 64), dataclasses.replace(many, kind="wgrad"), SM90) == 1


def test_candidates_split_an_underfilled_forward():
    layer = ConvProblem("implicit", 32 * 7 * 7, 512, 512, 9, 1, BF16, (3, 3), (1, 1), (1, 1))
    cands = candidates(tuning_key(layer), "sm_90")
    assert {c.split_k for c in cands} >= {1, 2, 4} and len([c for c in cands if not c.tma]) <= 30  # rows: on top
    big = dataclasses.replace(layer, m=32 * 56 * 56, n=64, cg=64)
    assert all(c.split_k == 1 for c in candidates(tuning_key(big), "sm_90"))
    dgrad = dataclasses.replace(layer, transposed=True)
    assert all(c.split_k == 1 for c in candidates(tuning_key(dgrad), "sm_90"))


# ------------------------------------------------------------------------------ the host path


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_split_host_path_is_replayable(channels_last, monkeypatch):
    """A split forward's device work is allocations, views and flydsl launches: the partial-sum GEMM and the
    reduce pass (the workspace an empty allocation that the GEMM fills), under a given config and under a
    default that splits (the plain call flydsl.direct replays)."""
    x, w, b, kw = _inputs(CASES[0], BF16, "cpu", channels_last=channels_last)
    kw["activation"] = None
    foreign, launches = host_work(conv, x, w, b, **kw, config=_cfg(2))
    assert not foreign, foreign
    assert launches[-2:] == ["_conv_implicit_kernel", "_conv_split_epilogue_kernel"], launches
    default = conv_mod.default_config

    def split_default(problem, arch):
        cfg = default(problem, arch)
        return dataclasses.replace(cfg, split_k=2) if problem.kind == "implicit" and not problem.transposed else cfg

    monkeypatch.setattr(conv_mod, "default_config", split_default)
    foreign, launches = host_work(conv_mod._conv_forward, x, w, b, (1, 1), (1, 1), (1, 1), (1, 1), 1, 1,
                                     channels_last)  # fmt: skip
    assert not foreign, foreign
    assert launches[-2:] == ["_conv_implicit_kernel", "_conv_split_epilogue_kernel"], launches


# ------------------------------------------------------------------------------ sm_90 and the H200


def _fields(line: str) -> dict:
    return dict(f.split(":", 1) for f in line.split() if ":" in f)


def test_split_kernels_compile_for_sm90_without_spill():
    """conv_compile_sm90.py --split: the partial-sum GEMM at the 7x7 512 -> 512 default (split 2), bf16 and fp8,
    compiles with wgmma and a pipelined K loop; the reduce pass too; no variant spills."""
    from pathlib import Path

    from flydsl.testing.sm90 import run_compile_script

    lines = run_compile_script(Path(__file__).with_name("conv_compile_sm90.py"), "--split")
    assert len(lines) == 4 and all(line.startswith("ok") for line in lines), "\n".join(lines)
    assert all(_fields(line)["STACK"] == "0" for line in lines), "\n".join(lines)
    for line in lines:
        f = _fields(line)
        if line.split()[1].startswith("implicit"):
            assert f["WGMMA"] == "1" and f["CP_ASYNC"] == "1" and int(line.split()[2]) >= int(f["PIPELINE"])
            assert f["WGMMA_E4M3"] == ("1" if "_fp8" in line else "0"), line


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [True, False])
def test_split_7x7_512_layer_gpu(channels_last, device, poisoned, monkeypatch):
    """The layer the default splits, bf16, bias + ReLU, against the reference; its launches are the split
    pair; a second call of the kind (the replay) is bit-identical."""
    x = rand(32, 512, 7, 7, dtype=BF16, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = weight(512, 512, (3, 3), dtype=BF16, device=device)
    b = rand(512, dtype=BF16, device=device, seed=2)
    kw = dict(padding=1, activation="relu")
    seen = []
    real = flyc.launch

    def spy(kernel, grid, *a, **k):
        seen.append((kernel.__name__, grid))
        return real(kernel, grid, *a, **k)

    monkeypatch.setattr(flyc, "launch", spy)
    y = conv(x, w, b, **kw)
    monkeypatch.setattr(flyc, "launch", real)
    names = [name for name, _ in seen]
    assert names[-2:] == ["_conv_implicit_kernel", "_conv_split_epilogue_kernel"], seen
    assert seen[-2][1][2] > 1  # the GEMM's split axis
    assert_rel_close(y, conv_ref(x, w, b, **kw), tol=tolerance(BF16))
    assert torch.equal(conv(x, w, b, **kw), y)
