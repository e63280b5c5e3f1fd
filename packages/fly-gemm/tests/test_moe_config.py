"""The fused MoE's launch config on the CPU: the default is valid by the one predicate on every arch and
shape of the models' range, picks row tiles near the rows an expert gets, is pure; the predicate refuses
what Triton or the shared memory cannot take."""

from __future__ import annotations

import itertools

import pytest
import torch

import flydsl.arch
from fly_gemm.moe_config import MoeConfig, default_moe_config, moe_config_valid, moe_smem_bytes

ARCHES = [flydsl.arch.INTERPRETER, flydsl.arch.SM90]
MODELS = [(8, 2, 14336, 4096), (128, 8, 768, 2048), (256, 8, 2048, 7168), (64, 6, 1408, 2048)]


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_is_valid_and_pure(arch, dtype):
    for (e, k, n, kk), tokens in itertools.product(MODELS, (0, 1, 3, 64, 1000, 16384)):
        cfg = default_moe_config(tokens, e, n, kk, k, dtype, arch)
        assert moe_config_valid(cfg, dtype, arch), (tokens, e, cfg)
        assert cfg == default_moe_config(tokens, e, n, kk, k, dtype, arch)


def test_row_tile_follows_the_rows_an_expert_gets():
    sm90 = flydsl.arch.SM90
    bf16 = torch.bfloat16
    assert default_moe_config(1, 8, 14336, 4096, 2, bf16, sm90).block_m == 16  # decode
    assert default_moe_config(128, 8, 14336, 4096, 2, bf16, sm90).block_m == 32  # 32 rows an expert
    assert default_moe_config(16384, 8, 14336, 4096, 2, bf16, sm90).block_m == 128  # prefill
    assert default_moe_config(64, 256, 2048, 7168, 8, bf16, sm90).block_m == 16  # 2 rows an expert
    assert default_moe_config(5, 4, 32, 32, 2, bf16, flydsl.arch.INTERPRETER).block_m == 16


def test_predicate_refuses_what_cannot_launch():
    sm90, bf16 = flydsl.arch.SM90, torch.bfloat16
    assert moe_config_valid(MoeConfig(64, 128, 64, num_warps=4, num_stages=4), bf16, sm90)
    assert not moe_config_valid(MoeConfig(48, 64, 64), bf16, sm90)  # not a power of two
    assert not moe_config_valid(MoeConfig(8, 64, 64), bf16, sm90)  # under the dot's 16
    assert not moe_config_valid(MoeConfig(64, 64, 64, num_warps=3), bf16, sm90)
    assert not moe_config_valid(MoeConfig(64, 64, 64, num_stages=0), bf16, sm90)
    assert not moe_config_valid(MoeConfig(64, 64, 64, group_m=0), bf16, sm90)
    big = MoeConfig(128, 256, 64, num_warps=8, num_stages=4)  # (128 + 512) x 64 x 2 x 4 = 320 KB
    assert moe_smem_bytes(big, bf16) == 327680
    assert not moe_config_valid(big, bf16, sm90)
