"""The grouped GEMM's tuning adopter: keys (rows a group bucketed, the rest exact; the launch's kind from b's
layout), the bounded candidate space, the tuning set (the MoE models' routed rows, the three launches of a
training step), the served config (default without a search or an artifact, one dict lookup once resolved),
the offline search task of each kind against its reference, and a search at the call site under
FLYDSL_AUTOTUNE=1 whose winner the call launches."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import flydsl.arch
from fly_gemm import grouped_gemm, grouped_gemm_ref
from fly_gemm.grouped_gemm import (
    GROUPED_TUNABLE,
    GroupedGemmConfig,
    grouped_candidates,
    grouped_config_for,
    grouped_tuning_key,
)
from fly_gemm.moe_config import MOE_TUNE_MODELS
from flydsl.errors import ArgumentError
from flydsl.testing import assert_rel_close, default_device, tolerance

DEV = default_device()
BF16 = torch.bfloat16
_mod = importlib.import_module("fly_gemm.grouped_gemm")


def test_key_buckets_rows_a_group_and_keeps_the_shape_exact():
    key = grouped_tuning_key("fwd", 8 * 2 * 4096 - 5, 8, 28672, 4096, BF16)
    assert key == {"kind": "fwd", "rows": 8192, "groups": 8, "n": 28672, "k": 4096, "dtype": "bf16"}
    assert grouped_tuning_key("wgrad", 1 << 30, 8, 64, 64, BF16)["rows"] == 16384  # capped
    assert grouped_tuning_key("dgrad", 0, 4, 64, 64, BF16)["rows"] == 1
    with pytest.raises(ArgumentError, match="kind"):
        grouped_tuning_key("bwd", 64, 4, 64, 64, BF16)


@pytest.mark.parametrize("arch", ["sm_90", "cpu"])
def test_every_candidate_is_valid_and_the_space_bounded(arch):
    keys = list(GROUPED_TUNABLE.tune_keys("sm_90"))
    keys.append(grouped_tuning_key("fwd", 64 * 24, 64, 1536, 2048, BF16))  # 24 rows a group: 32-row tiles
    for key in keys:
        cands = grouped_candidates(key, arch)
        assert cands and len(cands) == len(set(cands)) <= 30, key
        assert all(GROUPED_TUNABLE.is_valid(c, key, arch) for c in cands), key
        assert GROUPED_TUNABLE._candidate_list(key, arch)[0] == GROUPED_TUNABLE.default(key, arch)
        if arch == "sm_90":
            assert {c.block_n for c in cands} >= {64, 128, 256} and {c.num_stages for c in cands} == {3, 4}
    small = grouped_candidates(keys[-1], "sm_90")
    assert 32 in {c.block_m for c in small}


def test_tuning_set_is_the_models_training_launches():
    keys = GROUPED_TUNABLE.tune_keys("sm_90")
    assert len(keys) == len({json.dumps(k, sort_keys=True) for k in keys}) == 3 * 2 * 2 * 3
    assert {k["kind"] for k in keys} == {"fwd", "dgrad", "wgrad"} and {k["dtype"] for k in keys} == {"bf16"}
    assert {k["groups"] for k in keys} == {spec[0] for spec in MOE_TUNE_MODELS.values()}


def test_default_is_served_without_a_search_or_an_artifact(fresh, monkeypatch):
    monkeypatch.setenv("FLYDSL_USE_ARTIFACTS", "0")
    arch = flydsl.arch.name(DEV)
    for kind in ("fwd", "dgrad", "wgrad"):
        key = grouped_tuning_key(kind, 300, 4, 64, 32, BF16)
        assert GROUPED_TUNABLE.explain(key, arch) == (GROUPED_TUNABLE.default(key, arch), "default")
        cfg = grouped_config_for(kind, 300, 4, 64, 32, BF16, DEV)
        assert cfg == GROUPED_TUNABLE.default(key, arch)
        assert grouped_config_for(kind, 290, 4, 64, 32, BF16, DEV) is cfg  # same bucket: the memo

        def refuse(*a, **kw):
            raise AssertionError("the memoized answer should have been served")

        with monkeypatch.context() as m:
            m.setattr(type(GROUPED_TUNABLE), "select", refuse)
            assert grouped_config_for(kind, 260, 4, 64, 32, BF16, DEV) is cfg


def _recorded(monkeypatch) -> list:
    """The (kind, config) of each served launch of the module: the kind from the key it was served for."""
    seen = []
    real = _mod.grouped_config_for

    def served(kind, *args):
        cfg = real(kind, *args)
        seen.append((kind, cfg))
        return cfg

    monkeypatch.setattr(_mod, "grouped_config_for", served)
    return seen


def test_each_launch_of_a_training_step_asks_its_kind(fresh, monkeypatch):
    """The forward serves the "fwd" key, dA (the product over b's transposed view) "dgrad", dB "wgrad"."""
    seen = _recorded(monkeypatch)
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32, device=DEV)
    a = torch.randn(14, 32, device=DEV, dtype=BF16, requires_grad=True)
    b = torch.randn(3, 48, 32, device=DEV, dtype=BF16, requires_grad=True)
    grouped_gemm(a, b, offsets).backward(torch.randn(14, 48, device=DEV, dtype=BF16))
    assert [k for k, _ in seen] == ["fwd", "dgrad", "wgrad"]


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
def test_search_task_runs_each_kind_against_its_reference(kind):
    """The offline search's task of a key: the launch of its kind on random operands is within the dtype's
    tolerance of the task's own reference under the default and a second candidate."""
    key = grouped_tuning_key(kind, 3 * 20, 3, 48, 32, BF16)
    task = GROUPED_TUNABLE.make_task(key, DEV)
    ref = task.reference()
    for cfg in grouped_candidates(key, flydsl.arch.name(DEV))[:2]:
        assert_rel_close(task.run(cfg), ref, tol=task.rtol)


def test_autotune_searches_at_the_call_site(fresh, monkeypatch):
    """FLYDSL_AUTOTUNE=1: the forward's key is searched once (on the key's random operands), the call launches
    the winner, and a later call of the bucket is served it without a second search."""
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "1")
    offsets = torch.tensor([9, 20], dtype=torch.int32, device=DEV)
    a = torch.randn(20, 32, device=DEV, dtype=BF16)
    b = torch.randn(2, 48, 32, device=DEV, dtype=BF16)
    assert_rel_close(grouped_gemm(a, b, offsets), grouped_gemm_ref(a, b, offsets), tol=tolerance(BF16))
    key = grouped_tuning_key("fwd", 20, 2, 48, 32, BF16)
    cfg, source = GROUPED_TUNABLE.explain(key, flydsl.arch.name(DEV))
    assert source == "searched" and isinstance(cfg, GroupedGemmConfig)
    monkeypatch.setattr(type(GROUPED_TUNABLE), "search", lambda *a, **kw: pytest.fail("searched twice"))
    seen = _recorded(monkeypatch)
    assert_rel_close(grouped_gemm(a[:18], b, offsets.clamp(max=18)), grouped_gemm_ref(a[:18], b, offsets.clamp(max=18)),
                     tol=tolerance(BF16))  # fmt: skip
    assert seen == [("fwd", cfg)]


def test_the_shipped_sm90_artifact_covers_the_tuning_set(fresh):
    """Every key of the tuning set (the three models' training launches at 4096 and 16384 tokens) has an sm_90
    entry in the shipped artifact, a config of the key's candidate space (a search on the H200 timed it
    fastest), which is what an sm_90 launch is served."""
    keys = list(GROUPED_TUNABLE.tune_keys("sm_90"))
    assert keys
    for key in keys:
        cfg, source = GROUPED_TUNABLE.explain(key, "sm_90")
        assert source == "artifact", key
        assert GROUPED_TUNABLE.is_valid(cfg, key, "sm_90"), key
        assert cfg in GROUPED_TUNABLE._candidate_list(key, "sm_90"), key
