"""The fly-norm tuning adopter: keys, candidate space, defaults (pure logic, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flydsl.arch
import flydsl.compiler as flyc
from fly_norm.autotune import (
    CHUNKED_MAX_N,
    OPS,
    TUNABLES,
    bwd_default_row_config,
    candidates,
    clear_memo,
    row_config_for,
    tuning_key,
)
from flydsl_common.rows import MAX_SINGLE_PASS, RowConfig, default_row_config, row_config_valid

BUCKETS = [1 << k for k in range(0, 21)]


def test_keys_bucket_row_widths():
    assert tuning_key(4095, torch.bfloat16) == tuning_key(4096, torch.bfloat16) == {"n_bucket": 4096, "dtype": "bf16"}
    assert tuning_key(4097, torch.float16) == {"n_bucket": 8192, "dtype": "fp16"}
    assert tuning_key(1, torch.float32) == {"n_bucket": 1, "dtype": "fp32"}


@pytest.mark.parametrize("n", BUCKETS)
def test_candidate_space_is_bounded_and_valid(n):
    key = {"n_bucket": n, "dtype": "bf16"}
    cands = candidates(key, "sm_90")
    assert len(cands) <= 24
    assert all(row_config_valid(c, n, "sm_90") for c in cands)
    assert len(set(cands)) == len(cands)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 7, 1000, 4097, 65537, 262144, 1048576])
def test_default_is_served_without_search(op, n, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLYDSL_AUTOTUNE", raising=False)
    clear_memo()
    cfg = row_config_for(op, n, torch.bfloat16, "cpu")
    # The backward keeps more values live per element: its own, leaner default.
    if op.endswith("_bwd"):
        assert cfg == bwd_default_row_config(flyc_next_pow2(n), "cpu", 8 if op == "layernorm_bwd" else 16)
    elif n <= MAX_SINGLE_PASS or n > CHUNKED_MAX_N:
        assert cfg == default_row_config(flyc_next_pow2(n), "cpu")
    else:  # the forwards' per-lane chunked passes: their own chunk (autotune.CHUNKED)
        assert cfg == RowConfig(1, 4096, 16, False)
    assert row_config_valid(cfg, n, "cpu")
    assert TUNABLES[op].explain(tuning_key(n, torch.bfloat16), "cpu")[1] in ("memo", "default")


def flyc_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@pytest.mark.parametrize("op", OPS)
def test_offline_task_is_the_ops_own_search_task(op, device, tmp_path, monkeypatch):
    """`flydsl tune norm` gets, per key, the search task the op itself builds; a search over it works."""
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("fly_norm.autotune._TUNE_ELEMENTS", 3 * 64)  # 3 rows: the interpreter is slow
    tunable = TUNABLES[op]
    key = {"n_bucket": 64, "dtype": "fp32"}
    task = tunable.make_task(key, device)
    space = [RowConfig(1, 64, 2, True), RowConfig(1, 32, 1, False)]
    small = dataclasses.replace(tunable, candidates=lambda k, a: space)
    arch = flydsl.arch.name(device)
    result = small.search(key, arch, task, persist=False)
    assert row_config_valid(result.config, 64, arch)
    assert not result.rejected  # every candidate computed the right answer
    if op in ("rmsnorm_bwd", "layernorm_bwd"):
        # the training case: the searched kernel also reduces dweight (and dbias), a costlier
        # specialization than dx alone, so it is searched as its own key
        _, dw, db = task.run(result.config)
        assert dw.shape == (64,) and (db.shape == (64,)) == (op == "layernorm_bwd")


def test_flydsl_tune_writes_an_artifact_that_is_then_served(tmp_path, monkeypatch):
    """The offline pipeline end to end: `flydsl tune norm` -> artifact JSON -> served by the next lookup."""
    import json

    from flydsl import cli
    from flydsl.autotune import ArtifactFile

    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("fly_norm.autotune._TUNE_ELEMENTS", 2 * 64)  # 2 rows: the interpreter is slow
    key = {"n_bucket": 64, "dtype": "fp32"}
    out = tmp_path / "artifacts"
    argv = ["tune", "norm", "--only", "softmax_fwd", "--key", json.dumps(key), "--out", str(out), "--allow-interpreter"]
    assert cli.main(argv) == 0
    data = json.loads((out / "softmax_fwd.json").read_text())
    assert data["name"] == "softmax_fwd" and len(data["entries"]) == 1
    arch = data["entries"][0]["arch"]  # where the CLI tuned: the GPU when there is one, else the interpreter
    assert arch == flydsl.arch.name("cuda" if torch.cuda.is_available() and not flyc.interpreting() else "cpu")
    served = ArtifactFile(out / "softmax_fwd.json", "softmax_fwd").lookup(arch, key)
    assert served is not None and row_config_valid(RowConfig(**served), 64, arch)


def test_gpu_tuning_skips_the_widths_of_the_split_paths():
    from fly_norm._split_host import SOFTMAX_SPLIT_MIN_N_BWD, SPLIT_MIN_N, SPLIT_MIN_N_BWD

    for op in OPS:
        limit = SPLIT_MIN_N_BWD if op.endswith("_bwd") else SPLIT_MIN_N
        limit = SOFTMAX_SPLIT_MIN_N_BWD if op == "softmax_bwd" else limit  # its chunked pass serves 16K
        gpu = [k["n_bucket"] for k in TUNABLES[op].tune_keys("sm_90")]
        assert gpu and max(gpu) < limit and max(gpu) * 2 >= limit and min(gpu) == 256
        assert max(k["n_bucket"] for k in TUNABLES[op].tune_keys("cpu")) == 262144


@pytest.mark.parametrize("n", [256, 1024, 2048, 4096, 8192, 16384])
def test_softmax_backward_candidates_add_its_chunked_pass_from_2k(n):
    from fly_norm.autotune import bwd_candidates, softmax_bwd_candidates

    key = {"n_bucket": n, "dtype": "bf16"}
    space = softmax_bwd_candidates(key, "sm_90")
    chunked = [c for c in space if not c.single_pass]
    assert space and all(row_config_valid(c, n, "sm_90") for c in space) and len(space) <= 24
    assert [c for c in space if c.single_pass] == (bwd_candidates(key, "sm_90") if n <= 8192 else [])
    assert bool(chunked) == (n >= 2048)
    assert all(c.block_n <= n <= 8 * c.block_n and c.block_n // (32 * c.num_warps) >= 4 for c in chunked)


@pytest.mark.parametrize("n", [256, 1024, 4096, 8192])
def test_backward_candidates_never_pack_more_than_the_backward_can_hold(n):
    from fly_norm.autotune import bwd_candidates

    space = bwd_candidates({"n_bucket": n, "dtype": "bf16"}, "sm_90")
    assert space and all(row_config_valid(c, n, "sm_90") and c.single_pass for c in space)
    assert all(c.block_m * c.block_n // (32 * c.num_warps) <= 16 and c.num_warps <= 32 for c in space)
    amd = bwd_candidates({"n_bucket": n, "dtype": "bf16"}, "gfx942")
    assert amd and all(c.num_warps <= 16 for c in amd)
    assert bwd_default_row_config(n, "sm_90", 16) in space and bwd_default_row_config(n, "sm_90", 8) in space
