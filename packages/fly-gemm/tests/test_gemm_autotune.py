"""fly-gemm's tuning adopter: keys, candidate space, offline task and `flydsl tune gemm` end to end."""

from __future__ import annotations

import dataclasses
import json

import torch

import flydsl.arch
import flydsl.compiler as flyc
from fly_gemm.autotune import (
    TUNABLE,
    GemmConfig,
    candidates,
    clear_memo,
    config_for,
    config_valid,
    default_config,
    tuning_key,
)
from flydsl.autotune import ArtifactFile, LocalCache
from flydsl.checks import parse_dtype


def test_keys_bucket_m_and_name_the_epilogue():
    key = tuning_key(300, 4096, 14336, torch.bfloat16, torch.bfloat16, "bias_gelu")
    assert key == {"m_bucket": 512, "n": 4096, "k": 14336, "dtype": "bf16", "out": "bf16", "epilogue": "bias_gelu"}
    assert tuning_key(100000, 8, 8, torch.int8, torch.int32, "none")["m_bucket"] == 8192  # capped


def test_epilogue_names_round_trip():
    from fly_gemm.autotune import parse_epilogue

    cases = {"none": (False, None), "bias": (True, None), "bias_gelu": (True, "gelu"), "silu": (False, "silu"),
             "bias_gelu_tanh": (True, "gelu_tanh"), "gelu_tanh": (False, "gelu_tanh")}  # fmt: skip
    for name, want in cases.items():
        assert parse_epilogue(name) == want


def test_candidate_space_is_valid_bounded_and_holds_the_default():
    keys = TUNABLE.tune_keys("sm_90")
    assert len(keys) == len({json.dumps(k, sort_keys=True) for k in keys}) == 96 + 18 + 24
    assert {(k["dtype"], k["out"], k["epilogue"]) for k in keys} == {
        ("bf16", "bf16", "none"), ("fp8_e4m3", "bf16", "none"), ("bf16", "bf16", "bias_gelu"),
        ("int8", "int32", "none")}  # fmt: skip
    for key in keys:
        cands = candidates(key, "sm_90")
        dtype = parse_dtype("dtype", key["dtype"])
        out_size = parse_dtype("out", key["out"]).itemsize
        assert 1 <= len(cands) <= TUNABLE.max_candidates
        assert all(config_valid(c, dtype, flydsl.arch.SM90, out_size) for c in cands)
        if key["epilogue"] == "none":
            default = default_config(key["m_bucket"], key["n"], key["k"], dtype, flydsl.arch.SM90)
        else:  # a fused epilogue's default is the plain GEMM's config of the shape
            default = TUNABLE.explain({**key, "epilogue": "none"}, "sm_90")[0]
        assert default == TUNABLE.default(key, "sm_90")
        if key["m_bucket"] > 64:
            assert any(c.tma for c in cands) and any(c.flatten for c in cands)
            assert any(c.epilogue_subtile and c.block_n == 256 and c.num_stages == 4 for c in cands)
            assert any(c.occupancy == 2 for c in cands) == (key["out"] != "int32")  # 4-byte C: too big twice
        else:  # split-K is tried where the widest column tiles leave SMs idle (1.5 programs an SM wanted)
            assert any(c.gemv for c in cands) == (key["m_bucket"] <= 8)
            assert any(c.split_k > 1 for c in cands) == (key["n"] // 128 < 1.5 * flydsl.arch.SM90.sm_count)


def test_calls_are_served_a_config_once_resolved(device):
    clear_memo()
    cfg = config_for(7, 32, 48, torch.float16, torch.float16, "none", device)
    assert isinstance(cfg, GemmConfig)
    assert config_for(5, 32, 48, torch.float16, torch.float16, "none", device) is cfg  # same bucket: memo


def test_a_fused_epilogue_takes_the_plain_gemms_config(tmp_path, monkeypatch, device):
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    clear_memo()
    plain = tuning_key(16, 32, 48, torch.float16, torch.float16, "none")
    cfg = GemmConfig(16, 16, 32, num_stages=1)
    LocalCache().save("gemm", flydsl.arch.name(device), plain, dataclasses.asdict(cfg), time_us=1.0,
                      default_time_us=None, candidates=1)  # fmt: skip
    try:
        assert config_for(16, 32, 48, torch.float16, torch.float16, "bias_gelu_erf", device) == cfg
        assert config_for(16, 32, 48, torch.float16, torch.float32, "bias_gelu_erf", device) != cfg  # fp32 out
    finally:
        clear_memo()


def test_flydsl_tune_writes_an_artifact_that_is_then_served(tmp_path, monkeypatch):
    """`flydsl tune gemm` -> artifact JSON -> served by the next lookup (a small key in the interpreter)."""
    from flydsl import cli

    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "cache"))
    key = tuning_key(16, 32, 48, torch.float16, torch.float16, "bias_relu")
    out = tmp_path / "artifacts"
    argv = ["tune", "gemm", "--only", "gemm", "--key", json.dumps(key), "--out", str(out), "--allow-interpreter"]
    assert cli.main(argv) == 0
    data = json.loads((out / "gemm.json").read_text())
    assert data["name"] == "gemm" and len(data["entries"]) == 1
    arch = data["entries"][0]["arch"]
    assert arch == flydsl.arch.name("cuda" if torch.cuda.is_available() and not flyc.interpreting() else "cpu")
    served = ArtifactFile(out / "gemm.json", "gemm").lookup(arch, key)
    assert served is not None and config_valid(GemmConfig(**served), torch.float16, flydsl.arch.current())

    # --missing skips the key already written, --match keeps the keys holding its items
    other = tuning_key(16, 32, 48, torch.float16, torch.float16, "none")
    keys = ["--key", json.dumps(key), "--key", json.dumps(other)]
    argv = ["tune", "gemm", "--only", "gemm", *keys, "--out", str(out), "--allow-interpreter", "--missing"]
    assert cli.main([*argv, "--match", '{"epilogue": "gelu_erf"}']) == 0  # matches nothing: nothing tuned
    assert len(json.loads((out / "gemm.json").read_text())["entries"]) == 1
    assert cli.main([*argv, "--match", '{"epilogue": "none"}', "--match", '{"epilogue": "bias_relu"}']) == 0
    entries = json.loads((out / "gemm.json").read_text())["entries"]
    assert sorted(e["key"]["epilogue"] for e in entries) == ["bias_relu", "none"]


# (M bucket, N, K, dtype) -> the default's splits of K on sm_90 (132 SMs). Small grids split so that the
# (split, tile) units fill at most one wave, each split >= 8 K steps; the H200 sweep's rows (seed 20261202)
# are given at their M bucket (135 -> 256, 201 -> 256, 11 / 13 -> 16, 27 -> 32).
SPLIT_TABLE = [
    (256, 2448, 2224, torch.bfloat16, 3),  # sweep 135 x 2448 x 2224: 40 tiles, 35 K steps -> 120 units
    (256, 1400, 4160, torch.bfloat16, 6),  # sweep 201 x 1400 x 4160 (+ bias + gelu): 22 tiles -> 132 units
    (256, 4096, 4096, torch.bfloat16, 2),  # the searched winner: 64 tiles split in 2
    (256, 4096, 14336, torch.int8, 2),  # the int8 winner (K steps of 128)
    (16, 2560, 2536, torch.bfloat16, 2),  # decode rule (its own target: 1.5 programs an SM)
    (16, 5432, 5576, torch.bfloat16, 2),
    (32, 5760, 4632, torch.int8, 2),  # sweep int8 27 x 5760 x 4632
    (16, 9120, 3512, torch.bfloat16, 1),  # sweep 13 x 9120 x 3512: 285 tiles of 16 x 32, over the target
    (1024, 4792, 6104, torch.bfloat16, 1),  # sweep 950 x 4792 x 6104: 304 tiles, 2.3 waves
    (256, 8192, 8192, torch.bfloat16, 1),  # 128 tiles: a wave already
    (4096, 4096, 4096, torch.bfloat16, 1),
    (8192, 8192, 8192, torch.bfloat16, 1),
    (8192, 8192, 8192, torch.int8, 1),
    (256, 2448, 256, torch.bfloat16, 1),  # short K: 4 K steps
    (256, 1400, 960, torch.bfloat16, 1),  # 22 tiles would take 6 splits, but 15 K steps make no 2 of 8
]


def test_default_splits_k_by_the_waves_a_grid_fills():
    arch = flydsl.arch.SM90
    for m, n, k, dtype, want in SPLIT_TABLE:
        cfg = default_config(m, n, k, dtype, arch)
        assert config_valid(cfg, dtype, arch), (m, n, k, cfg)
        assert cfg.split_k == want, (m, n, k, dtype, cfg)
        assert cfg.reduce_last == (want > 1)
        if m > 64 and want > 1:  # one wave of (split, tile) units, every split >= 8 K steps
            tiles = flyc.cdiv(m, cfg.block_m) * flyc.cdiv(n, cfg.block_n)
            k_steps = flyc.cdiv(k, cfg.block_k)
            assert tiles * cfg.split_k <= arch.sm_count and k_steps // cfg.split_k >= 8
            # and no more splits could have been taken
            assert tiles * (cfg.split_k + 1) > arch.sm_count or k_steps // (cfg.split_k + 1) < 8


def test_default_split_k_runs_correctly_end_to_end(tmp_path, monkeypatch, device):
    """A GPU of 3 SMs (the arch the default is derived for, patched): the default splits K for these small
    shapes, and gemm, served that default through config_for, matches the fp64 reference (bias + GELU
    applied once on the summed splits; the raw int8 product exact)."""
    from fly_gemm import gemm, gemm_ref
    from flydsl.testing import assert_rel_close, tolerance

    small = dataclasses.replace(flydsl.arch.SM90, sm_count=3)
    monkeypatch.setattr(flydsl.arch, "from_name", lambda name: small)
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    clear_memo()
    try:
        gen = torch.Generator().manual_seed(0)
        # (m, n, k, dtype, splits): 128 x 128 tiles past the decode sizes (25 K steps in 3 splits: 9, 9, 7);
        # the decode path's 16 x 32 tiles (16 K steps of 128 in 2)
        for m, n, k, dtype, splits in ((100, 96, 1600, torch.bfloat16, 3), (5, 64, 2048, torch.float16, 2)):
            a = torch.randn(m, k, generator=gen).to(dtype).to(device)
            b = torch.randn(n, k, generator=gen).to(dtype).to(device)
            bias = torch.randn(n, generator=gen).to(dtype).to(device)
            cfg = config_for(m, n, k, dtype, dtype, "bias_gelu", device)
            assert cfg.split_k == splits and cfg.reduce_last, cfg
            c = gemm(a, b, bias=bias, activation="gelu")
            assert_rel_close(c, gemm_ref(a, b, bias=bias, activation="gelu"), tol=tolerance(dtype))
        m, n, k = 100, 96, 3200  # int8, K steps of 128: 25 in 3 splits
        a = torch.randint(-8, 8, (m, k), generator=gen, dtype=torch.int8).to(device)
        b = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8).to(device)
        assert config_for(m, n, k, torch.int8, torch.int32, "none", device).split_k == 3
        raw = gemm(a, b, out_dtype=torch.int32)
        assert torch.equal(raw.cpu().long(), gemm_ref(a, b).cpu().long())
    finally:
        clear_memo()
