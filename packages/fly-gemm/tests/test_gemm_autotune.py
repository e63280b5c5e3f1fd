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
