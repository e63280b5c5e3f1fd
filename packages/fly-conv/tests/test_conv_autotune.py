"""ConvConfig's default and validity predicate (pure: CPU-tested for the interpreter and sm_90)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fly_conv.autotune import (
    DIRECT_MAX_CG,
    KINDS,
    ConvConfig,
    ConvProblem,
    candidates,
    config_valid,
    default_config,
    direct_kernel,
    smem_bytes,
    tuning_key,
)
from flydsl.arch import INTERPRETER, SM90

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (m, n, cg, taps, groups): ResNet / UNet 3x3, 1x1, grouped 4-64 channels a group, depthwise, tiny, 3D, 1D
SHAPES = [(8 * 56 * 56, 64, 64, 9, 1), (64 * 7 * 7, 512, 512, 9, 1), (8 * 56 * 56, 256, 64, 1, 1),
          (8 * 28 * 28, 8, 8, 9, 32), (8 * 28 * 28, 64, 64, 9, 4), (1, 1, 1, 1, 1), (2 * 8 * 28 * 28, 64, 64, 27, 1),
          (8 * 1000, 256, 256, 7, 1), (16 * 112 * 112, 96, 1, 9, 96)]  # fmt: skip


@pytest.mark.parametrize("arch", [INTERPRETER, SM90], ids=["interpreter", "sm_90"])
def test_defaults_are_valid(arch):
    for kind, dtype, (m, n, cg, taps, groups) in itertools.product(KINDS, DTYPES, SHAPES):
        problem = ConvProblem(kind, m, n, cg, taps, groups, dtype)
        cfg = default_config(problem, arch)
        assert config_valid(cfg, problem, arch), (problem, cfg)
        assert default_config(problem, arch) == cfg  # pure


def test_default_tiles_follow_the_layer():
    big = default_config(ConvProblem("implicit", 64 * 56 * 56, 256, 256, 9, 1, torch.bfloat16), SM90)
    assert (big.block_m, big.block_n, big.block_k) == (128, 128, 64)
    grouped = default_config(ConvProblem("implicit", 8 * 28 * 28, 8, 8, 9, 32, torch.bfloat16), SM90)
    assert grouped.block_n == 16 and grouped.block_k == 16  # 8 channels a group: the dot's minimum, not 128
    small = default_config(ConvProblem("implicit", 2 * 7 * 7, 64, 64, 9, 1, torch.bfloat16), SM90)
    assert small.block_m == 64  # under a wave: smaller row tiles


@pytest.mark.parametrize("arch", [INTERPRETER, SM90], ids=["interpreter", "sm_90"])
def test_fp8_defaults_are_valid(arch):
    for m, n, cg, taps, groups in SHAPES:
        problem = ConvProblem("implicit", m, n, cg, taps, groups, torch.float8_e4m3fn)
        cfg = default_config(problem, arch)
        assert config_valid(cfg, problem, arch) and cfg.block_k >= 32, (problem, cfg)


def test_fp8_tiles_and_validity():
    """fp8 takes 128 channels a step where the layer has them (the 16-bit tile's bytes), 32 at least (the 8-bit
    dot's K), one byte an element of shared memory; the forward implicit GEMM only."""
    f8 = torch.float8_e4m3fn
    big = ConvProblem("implicit", 64 * 56 * 56, 256, 256, 9, 1, f8)
    cfg = default_config(big, SM90)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages) == (128, 128, 128, 4)
    assert smem_bytes(cfg, big) == 4 * 256 * 128 * 1  # 128 KB, as the 16-bit 128 x 128 x 64 at 4 stages
    assert default_config(ConvProblem("implicit", 8 * 28 * 28, 8, 8, 9, 32, f8), SM90).block_k == 32
    assert not config_valid(ConvConfig(64, 64, 16), big, SM90)  # under the 8-bit dot's K of 32
    assert config_valid(ConvConfig(64, 64, 32), big, SM90)
    assert not config_valid(ConvConfig(64, 64, 32), ConvProblem("wgrad", 1024, 64, 64, 9, 1, f8), SM90)
    assert not config_valid(ConvConfig(64, 8, 1), ConvProblem("direct", 1024, 64, 1, 9, 64, f8), SM90)


def test_direct_kernel_takes_depthwise_and_narrow_groups():
    bf16, f8 = torch.bfloat16, torch.float8_e4m3fn
    assert direct_kernel(96, 96, 96, bf16) and direct_kernel(96, 192, 96, torch.float32)  # depthwise, multiplier 2
    assert direct_kernel(128, 128, 32, bf16) and direct_kernel(64, 64, 32, torch.float16)  # 4 and 2 a group
    assert direct_kernel(32 * DIRECT_MAX_CG, 96, 32, bf16)  # the widest group it takes, 3 outputs a group
    assert not direct_kernel(32 * (DIRECT_MAX_CG + 1), 64, 32, bf16)  # one channel wider: the implicit GEMM
    assert not direct_kernel(64, 64, 1, bf16) and not direct_kernel(1, 8, 1, bf16)  # dense, even of one channel
    assert not direct_kernel(128, 128, 32, f8) and not direct_kernel(64, 64, 64, f8)  # fp8: the scaled GEMM only
    dw = default_config(ConvProblem("direct", 1 << 20, 384, 1, 9, 384, bf16), SM90)
    cg4 = default_config(ConvProblem("direct", 1 << 20, 128, 4, 9, 32, bf16), SM90)
    cg8 = default_config(ConvProblem("direct", 1 << 20, 256, 8, 9, 32, bf16), SM90)
    # the input tile grows with the group: 8 channels a group take twice the threads for the same outputs
    assert cg4.block_m * cg4.block_n == dw.block_m * dw.block_n == cg8.block_m * cg8.block_n
    assert cg4.num_warps == dw.num_warps == cg8.num_warps // 2


def test_validity_predicate_refuses():
    p = ConvProblem("implicit", 1024, 64, 64, 9, 1, torch.bfloat16)
    assert config_valid(ConvConfig(64, 64, 32), p, SM90)
    assert not config_valid(ConvConfig(64, 64, 8), p, SM90)  # under the dot's 16
    assert not config_valid(ConvConfig(48, 64, 32), p, SM90)  # not a power of two
    assert not config_valid(ConvConfig(64, 64, 32, num_warps=3), p, SM90)
    assert config_valid(ConvConfig(64, 64, 32, split_k=2), p, SM90)  # split-K: the forward and the weight gradient
    dgrad = dataclasses.replace(p, transposed=True)
    assert not config_valid(ConvConfig(64, 64, 32, split_k=2), dgrad, SM90)  # not the input gradient
    assert not config_valid(ConvConfig(256, 256, 256, num_stages=4), p, SM90)  # shared memory
    assert smem_bytes(ConvConfig(128, 128, 64, num_stages=4), p) == 4 * 256 * 64 * 2
    dw = ConvProblem("direct", 1024, 64, 1, 9, 64, torch.bfloat16)
    assert config_valid(ConvConfig(64, 8, 1), dw, SM90)  # no dot: no minimum
    wg = ConvProblem("wgrad", 8 * 56 * 56, 64, 64, 9, 1, torch.bfloat16)
    assert config_valid(ConvConfig(64, 64, 64, taps=4), wg, SM90)  # several taps: the weight gradient only
    assert smem_bytes(ConvConfig(64, 64, 64, taps=4), wg) == 3 * (64 + 4 * 64) * 64 * 2
    assert not config_valid(ConvConfig(64, 64, 64, taps=3), wg, SM90)  # a power of two
    assert not config_valid(ConvConfig(64, 128, 64, taps=4), wg, SM90)  # the dot's N past 256
    assert not config_valid(ConvConfig(64, 64, 64, taps=2), p, SM90)
    rows = ConvConfig(64, 64, 64, tma=True)  # the row-block kernels: 16-bit, TMA, one tap, the forward unsplit
    assert config_valid(rows, wg, SM90) and config_valid(rows, wg, INTERPRETER)
    assert config_valid(rows, p, SM90) and config_valid(rows, dataclasses.replace(p, transposed=True), SM90)
    assert not config_valid(dataclasses.replace(rows, split_k=2), p, SM90)
    assert not config_valid(rows, ConvProblem("direct", 1024, 64, 1, 9, 64, torch.bfloat16), SM90)
    assert not config_valid(rows, dataclasses.replace(wg, dtype=torch.float32), SM90)
    assert not config_valid(dataclasses.replace(rows, taps=2), wg, SM90)
    assert not config_valid(rows, wg, dataclasses.replace(SM90, capability=(8, 0)))  # no TMA before sm_90
    layer = dataclasses.replace(wg, kernel=(3, 3), stride=(1, 1), dilation=(1, 1))
    assert any(c.tma for c in candidates(tuning_key(layer), "sm_90"))  # in the weight gradient's tuning space
    assert not any(c.tma for c in candidates(tuning_key(dataclasses.replace(layer, groups=2)), "sm_90"))
    fwd = ConvProblem("implicit", 32 * 56 * 56, 64, 64, 9, 1, torch.bfloat16, (3, 3), (1, 1), (1, 1))
    for prob in (fwd, dataclasses.replace(fwd, transposed=True)):  # the row-block forward and input gradient
        cands = candidates(tuning_key(prob), "sm_90")
        n_rows = sum(c.tma for c in cands)  # first in line, unsplit
        assert n_rows >= 2 and all(c.tma and c.split_k == 1 for c in cands[:n_rows]), cands
    strided = dataclasses.replace(fwd, stride=(2, 2))
    assert not any(c.tma for c in candidates(tuning_key(strided), "sm_90"))
    assert not config_valid(ConvConfig(64, 64, 32), ConvProblem("bad", 1, 1, 1, 1, 1, torch.bfloat16), SM90)
    with pytest.raises(ValueError, match="kind"):
        default_config(ConvProblem("bad", 1, 1, 1, 1, 1, torch.bfloat16), SM90)


# ------------------------------------------------------------------------------ the kernels compile for the H200


def _compile_sm90() -> list[str]:
    """Lines of conv_compile_sm90.py, run in a process of its own (the interpreter is chosen once a process)."""
    from pathlib import Path

    from flydsl.testing.sm90 import run_compile_script

    return run_compile_script(Path(__file__).with_name("conv_compile_sm90.py"))


@pytest.fixture(scope="module")
def sm90_lines():
    return _compile_sm90()


def _tensor_core(lines: list[str]) -> list[str]:
    """The tensor-core dot kernels' lines, 16-bit and fp8 (not the direct kernel's, not fp32's full-precision
    dot)."""
    return [line for line in lines if " depthwise " not in line and " direct_" not in line and "_fp32 " not in line
            and " wgrad_depthwise" not in line]


def _fields(line: str) -> dict:
    """``KEY:value`` fields of one compile line."""
    return dict(f.split(":", 1) for f in line.split() if ":" in f)


def test_kernels_compile_for_sm90_with_wgmma(sm90_lines):
    """Triton's compiler takes every kernel variant at its sm_90 default; the dot kernels' tl.dot is wgmma."""
    assert len(sm90_lines) == 26 and all(line.startswith("ok") for line in sm90_lines), "\n".join(sm90_lines)
    assert all(_fields(line)["WGMMA"] == "1" for line in _tensor_core(sm90_lines)), "\n".join(sm90_lines)


def test_fp8_forward_is_e4m3_wgmma_on_sm90(sm90_lines):
    """The fp8 forward's dot is Hopper's 8-bit wgmma on e4m3 operands (B K-major), and only the fp8 variants use it
    (the 16-bit kernels compile as before)."""
    fp8 = [line for line in sm90_lines if "_fp8 " in line]
    assert len(fp8) == 5, "\n".join(sm90_lines)
    for line in sm90_lines:
        assert _fields(line)["WGMMA_E4M3"] == ("1" if line in fp8 else "0"), "\n".join(sm90_lines)


def test_kernels_do_not_spill_on_sm90(sm90_lines):
    """No variant takes stack (a register spill) at its default."""
    assert all(_fields(line)["STACK"] == "0" for line in sm90_lines), "\n".join(sm90_lines)


def test_dot_kernels_k_loop_is_pipelined_on_sm90(sm90_lines):
    """The 16-bit and fp8 dot kernels' K loops are software-pipelined: their loads are asynchronous copies and
    shared memory holds num_stages A + B tiles (one stage's worth would mean the loop is not multi-buffered)."""
    for line in _tensor_core(sm90_lines):
        f = _fields(line)
        shared = int(line.split()[2])
        if " wgrad_rows " in line or " rows_" in line:  # tensor descriptors: both tiles a step, steps ahead
            assert int(f["TMA"]) >= 6, "\n".join(sm90_lines)
            continue
        assert f["CP_ASYNC"] == "1" and shared >= int(f["PIPELINE"]) > 0, "\n".join(sm90_lines)
