"""fused_moe's tuning adopter on the CPU: the key (token buckets, quant-mode names), the bounded candidate space
(valid on sm_90 and the interpreter for every tuning key, K steps inside the scale block), what a call is
served (default, a stored winner, a memoized answer), searches in the interpreter (`flydsl tune gemm --only
moe`, and ``FLYDSL_AUTOTUNE=1`` at the call site) whose winners match ``fused_moe_ref``, the registration."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_moe import _layer
from test_moe_quant import E8M0, INT4, quantize_mxfp4, quantize_weight

import flydsl.arch
from fly_gemm import moe as moe_mod
from fly_gemm import moe_config as moe_config_mod
from fly_gemm.moe import fused_moe
from fly_gemm.moe_bench import MODELS
from fly_gemm.moe_config import (
    MOE_TUNABLE,
    MOE_TUNE_TOKENS,
    MoeConfig,
    default_moe_config,
    moe_candidates,
    moe_config_for,
    moe_config_valid,
    moe_tuning_key,
)
from fly_gemm.moe_reference import fused_moe_ref
from flydsl.autotune import ArtifactFile, LocalCache
from flydsl.checks import parse_dtype
from flydsl.errors import ArgumentError
from flydsl.testing import assert_rel_close, default_device, tolerance

DEV = default_device()
FP8 = torch.float8_e4m3fn
ARCHES = {"sm_90": flydsl.arch.SM90, "cpu": flydsl.arch.INTERPRETER}
# keys off the tuning set whose scale block bounds the K step (and a per-channel one that does not)
SCALED = [(FP8, "block128x128", 128), (FP8, "block64x64", 64), (FP8, "block1x32", 32), (torch.bfloat16, "w4g32", 32),
          (torch.float16, "w4g128", 128), (torch.bfloat16, "mxfp4", 32), (torch.bfloat16, "mxfp4g16", 16),
          (torch.int8, "channel", None), (FP8, "w4a8g64", 64), (FP8, "mxfp4a8", 32)]  # fmt: skip


def test_key_buckets_tokens_and_keeps_the_shape_exact():
    key = moe_tuning_key(300, 8, 14336, 4096, 2, torch.bfloat16, "none")
    assert key == {"tokens_bucket": 512, "experts": 8, "inter": 14336, "hidden": 4096, "topk": 2, "dtype": "bf16",
                   "quant": "none"}  # fmt: skip
    buckets = {t: moe_tuning_key(t, 256, 2048, 7168, 8, FP8, "block128x128")["tokens_bucket"]
               for t in (0, 1, 2, 3, 16, 17, 1000, 1024, 16384, 16385, 10**6)}  # fmt: skip
    assert buckets == {0: 1, 1: 1, 2: 2, 3: 4, 16: 16, 17: 32, 1000: 1024, 1024: 1024, 16384: 16384, 16385: 16384,
                       10**6: 16384}  # fmt: skip
    assert moe_tuning_key(5, 4, 32, 64, 2, FP8, "block128x128")["dtype"] == "fp8_e4m3"
    for bad in ("block128", "w4", "blockx", "fp8", "mxfp4g0", "", None):
        with pytest.raises(ArgumentError, match="quant"):
            moe_tuning_key(5, 4, 32, 64, 2, torch.bfloat16, bad)


def _spy_keys(monkeypatch):
    """The quant names (and in_dtypes) fused_moe's calls hand to moe_config_for."""
    seen = []
    real = moe_mod.moe_config_for

    def spy(tokens, e, inter, h, k, in_dtype, quant, device, *, task=None):
        seen.append((in_dtype, quant))
        return real(tokens, e, inter, h, k, in_dtype, quant, device, task=task)

    monkeypatch.setattr(moe_mod, "moe_config_for", spy)
    return seen


def test_calls_name_their_quant_mode(fresh, monkeypatch):
    seen = _spy_keys(monkeypatch)
    t, h, inter, e, k = 5, 64, 32, 4, 2
    x, w1, w2, w, ids = _layer(t, h, inter, e, k, torch.bfloat16, seed=3)
    fused_moe(x, w1, w2, w, ids)
    w1f, w2f = w1.float(), w2.float()
    for qdtype, block_shape in ((FP8, None), (torch.int8, None), (FP8, [128, 64]), (INT4, [1, 32])):
        (q1, s1), (q2, s2) = quantize_weight(w1f, qdtype, block_shape), quantize_weight(w2f, qdtype, block_shape)
        fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape)
    if E8M0 is not None:
        for group in (32, 16):
            (q1, s1), (q2, s2) = quantize_mxfp4(w1f, group), quantize_mxfp4(w2f, group)
            fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[1, group])
    want = [(torch.bfloat16, "none"), (FP8, "channel"), (torch.int8, "channel"), (FP8, "block128x64"),
            (torch.bfloat16, "w4g32")]  # fmt: skip
    if E8M0 is not None:
        want += [(torch.bfloat16, "mxfp4"), (torch.bfloat16, "mxfp4g16")]
    assert seen == want


def test_tuning_set_is_the_models_at_decode_and_prefill():
    keys = MOE_TUNABLE.tune_keys("sm_90")
    assert len(keys) == len({json.dumps(k, sort_keys=True) for k in keys}) == 3 * 6 * 2
    assert {(k["experts"], k["topk"], k["hidden"], k["inter"]) for k in keys} == {m[:4] for m in MODELS.values()}
    assert {k["tokens_bucket"] for k in keys} == set(MOE_TUNE_TOKENS)
    assert {(k["dtype"], k["quant"]) for k in keys} == {("bf16", "none"), ("fp8_e4m3", "block128x128")}


def _keys():
    keys = list(MOE_TUNABLE.tune_keys("sm_90"))
    for dtype, quant, _ in SCALED:
        keys += [moe_tuning_key(t, e, inter, h, k, dtype, quant) for e, k, h, inter, _g in MODELS.values()
                 for t in (1, 64, 4096)]  # fmt: skip
    return keys


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_every_candidate_is_valid_and_the_space_bounded(arch):
    a = ARCHES[arch]
    for key in _keys():
        dtype = parse_dtype("dtype", key["dtype"])
        cands = moe_candidates(key, arch)
        if arch == "cpu":
            assert 1 <= len(cands) <= 2, (key, cands)
        else:
            assert 8 <= len(cands) <= 30, (key, len(cands))
            assert {c.block_n for c in cands} >= {64, 128}
            assert {c.num_stages for c in cands} == {3, 4}
        assert len(set(cands)) == len(cands)
        assert all(moe_config_valid(c, dtype, a) for c in cands), key
        assert all(MOE_TUNABLE.is_valid(c, key, arch) for c in cands), key
        default = MOE_TUNABLE.default(key, arch)
        assert MOE_TUNABLE.is_valid(default, key, arch) and default in cands, (key, default)
        # the default is the heuristic's at the bucket's token count (K step cut to the scale block)
        plain = default_moe_config(key["tokens_bucket"], key["experts"], key["inter"], key["hidden"], key["topk"],
                                   dtype, a)  # fmt: skip
        assert dataclasses.replace(default, block_k=plain.block_k) == plain
        if arch == "sm_90":  # row tiles around the rows an expert gets (the default's and its neighbours)
            assert {c.block_m for c in cands} <= {16, 32, 64, 128}
            assert all(abs(c.block_m.bit_length() - default.block_m.bit_length()) <= 1 for c in cands)
            assert {c.block_k for c in cands} <= {16, 32, 64, 128}
            if key["quant"] in ("none", "channel"):  # K steps of 64-128 (16-bit), 128 (8-bit)
                assert {c.block_k for c in cands} == ({128} if dtype.itemsize == 1 else {64, 128})


@pytest.mark.parametrize("arch", sorted(ARCHES))
@pytest.mark.parametrize("dtype,quant,block_k", SCALED, ids=[q for _, q, _ in SCALED])
def test_scale_blocks_bound_the_k_step(arch, dtype, quant, block_k):
    w4 = quant.startswith(("w4g", "mxfp4")) and "a8" not in quant  # weight-only 4-bit (w4a8: as block scales)
    for e, k, h, inter, _g in MODELS.values():
        for t in (1, 16, 1024, 16384):
            key = moe_tuning_key(t, e, inter, h, k, dtype, quant)
            cands = moe_candidates(key, arch)
            assert cands
            for cfg in [*cands, MOE_TUNABLE.default(key, arch)]:
                if w4:  # K steps of 32 and up: a group's columns, or 32 (scales read an element) below that
                    assert cfg.block_k >= 32 and (block_k % cfg.block_k == 0 or cfg.block_k == 32), (key, cfg)
                else:
                    assert block_k is None or block_k % cfg.block_k == 0, (key, cfg)
                if "a8" in quant:  # w4a8: K steps of 32 (64 and up spill on sm_90)
                    assert cfg.block_k == 32, (key, cfg)
    key = moe_tuning_key(16, 8, 256, 256, 2, dtype, quant)
    if w4:  # a stored 4-bit config with a 16-column K step is refused (wrong on sm_90), 2 groups a step taken
        assert not MOE_TUNABLE.is_valid(MoeConfig(16, 64, 16, num_stages=1), key, arch)
        assert MOE_TUNABLE.is_valid(MoeConfig(16, 64, 2 * block_k, num_stages=1), key, arch)
    elif block_k is not None:  # a stored config whose K step crosses a scale block is refused
        assert not MOE_TUNABLE.is_valid(MoeConfig(16, 64, 2 * block_k, num_stages=1), key, arch)


def test_default_is_served_when_nothing_is_searched_or_shipped(fresh, monkeypatch):
    monkeypatch.setenv("FLYDSL_USE_ARTIFACTS", "0")
    for dtype, quant, _ in [(torch.bfloat16, "none", None), *SCALED]:
        key = moe_tuning_key(300, 8, 64, 32, 2, dtype, quant)
        arch = flydsl.arch.name(DEV)
        assert MOE_TUNABLE.explain(key, arch) == (MOE_TUNABLE.default(key, arch), "default")
        cfg = moe_config_for(300, 8, 64, 32, 2, dtype, quant, DEV)
        assert cfg == MOE_TUNABLE.default(key, arch)
        assert moe_config_for(257, 8, 64, 32, 2, dtype, quant, DEV) is cfg  # same bucket


def test_a_resolved_config_is_one_dict_lookup(fresh, monkeypatch):
    cfg = moe_config_for(7, 4, 32, 64, 2, torch.bfloat16, "none", DEV)

    def refuse(*a, **kw):
        raise AssertionError("the memoized answer should have been served")

    monkeypatch.setattr(type(MOE_TUNABLE), "select", refuse)  # the Tunable is frozen: its class
    assert moe_config_for(5, 4, 32, 64, 2, torch.bfloat16, "none", DEV) is cfg


def _tiny_key():
    return moe_tuning_key(9, 4, 32, 64, 2, torch.bfloat16, "none")


def _recording_launches(monkeypatch):
    cfgs = []
    real = moe_mod.launch_moe_gemm

    def spy(*a, cfg, **kw):
        cfgs.append(cfg)
        return real(*a, cfg=cfg, **kw)

    monkeypatch.setattr(moe_mod, "launch_moe_gemm", spy)
    return cfgs


def test_a_stored_winner_is_launched(fresh, monkeypatch):
    """A winner in the local cache is served to fused_moe's calls of its bucket (config=None), and computes the
    reference's result."""
    arch = flydsl.arch.name(DEV)
    key = _tiny_key()
    stored = MoeConfig(32, 16, 16, group_m=2, num_warps=4, num_stages=1)
    assert stored != MOE_TUNABLE.default(key, arch) and MOE_TUNABLE.is_valid(stored, key, arch)
    LocalCache().save("moe", arch, key, dataclasses.asdict(stored), time_us=1.0, default_time_us=2.0, candidates=2)
    cfgs = _recording_launches(monkeypatch)
    x, w1, w2, w, ids = _layer(9, 64, 32, 4, 2, torch.bfloat16, seed=5)
    y = moe_mod._fused_moe(x, w1, w2, w, ids, "silu", False, None, None)  # the general path, as a first call
    assert cfgs == [stored, stored]
    assert_rel_close(y, fused_moe_ref(x, w1, w2, w, ids), tol=tolerance(torch.bfloat16))


def test_flydsl_tune_moe_writes_an_artifact_whose_winner_matches_the_reference(fresh, monkeypatch):
    """`flydsl tune gemm --only moe` on one tiny key in the interpreter: the search checks each candidate against
    fused_moe_ref, the winner is valid, served from the artifact, and fused_moe with it matches the reference."""
    from flydsl import cli

    key = _tiny_key()
    out = fresh / "artifacts"
    argv = ["tune", "gemm", "--only", "moe", "--key", json.dumps(key), "--out", str(out), "--allow-interpreter"]
    assert cli.main(argv) == 0
    data = json.loads((out / "moe.json").read_text())
    assert data["name"] == "moe" and len(data["entries"]) == 1
    arch = data["entries"][0]["arch"]
    served = ArtifactFile(out / "moe.json", "moe").lookup(arch, key)
    assert served is not None
    cfg = MoeConfig(**served)
    assert cfg in moe_candidates(key, arch) and MOE_TUNABLE.is_valid(cfg, key, arch)
    x, w1, w2, w, ids = _layer(9, 64, 32, 4, 2, torch.bfloat16, seed=7)
    assert_rel_close(fused_moe(x, w1, w2, w, ids, config=cfg), fused_moe_ref(x, w1, w2, w, ids),
                     tol=tolerance(torch.bfloat16))  # fmt: skip


def test_autotune_searches_at_the_call_site_and_leaves_x_intact(fresh, monkeypatch):
    """FLYDSL_AUTOTUNE=1: a call searches its key once on its own operands (candidates write their own output,
    so out=x is safe), launches the winner, and later calls of the bucket are served it without a search."""
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "1")
    x, w1, w2, w, ids = _layer(9, 64, 32, 4, 2, torch.bfloat16, seed=11)
    ref = fused_moe_ref(x, w1, w2, w, ids)
    y = fused_moe(x, w1, w2, w, ids, out=x)
    assert y is x
    assert_rel_close(y, ref, tol=tolerance(torch.bfloat16))
    arch = flydsl.arch.name(DEV)
    cfg, source = MOE_TUNABLE.explain(_tiny_key(), arch)
    assert source == "searched" and cfg in moe_candidates(_tiny_key(), arch)
    cfgs = _recording_launches(monkeypatch)
    x2, w1, w2, w, ids = _layer(12, 64, 32, 4, 2, torch.bfloat16, seed=12)  # same bucket (16)
    monkeypatch.setattr(type(MOE_TUNABLE), "search", lambda *a, **kw: pytest.fail("searched twice"))
    assert_rel_close(fused_moe(x2, w1, w2, w, ids), fused_moe_ref(x2, w1, w2, w, ids), tol=tolerance(torch.bfloat16))
    assert cfgs == [cfg, cfg]


def test_the_family_registers_the_moe_tunable():
    from fly_gemm._family import FAMILY
    from flydsl.families import discover

    assert [t.name for t in FAMILY.tunables()] == ["gemm", "moe", "grouped_gemm"]
    assert "moe" in [t.name for t in discover()["gemm"].tunables()]
    assert MOE_TUNABLE.make_task is not None and MOE_TUNABLE.config_type is MoeConfig


@pytest.mark.parametrize("dtype,quant", [(torch.bfloat16, "none"), (FP8, "block32x32"), (torch.bfloat16, "w4g32"),
                                         (FP8, "w4a8g32"), (torch.bfloat16, "mxfp4"), (FP8, "mxfp4a8")])  # fmt: skip
def test_search_task_layer_runs_every_mode(dtype, quant):
    """The offline search's random layer of a key (its weights, scales, block shape and, for w4a8 keys, the
    fp8 compute dtype) is a call fused_moe takes, against the reference given the same arguments."""
    if quant.startswith("mxfp4") and E8M0 is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    key = moe_tuning_key(5, 3, 32, 64, 2, dtype, quant)
    args, kw = moe_config_mod._random_layer(key, DEV)
    y = fused_moe(*args, **kw)
    ref = fused_moe_ref(*args, **kw)
    assert_rel_close(y, ref, tol=tolerance(torch.bfloat16))


def test_the_shipped_sm90_artifact_covers_the_tuning_set(fresh):
    """Every key of the tuning set (the three models at decode and prefill, bf16 and fp8 block-scaled) has an
    sm_90 entry in the shipped artifact, a config valid for its key (the default, or one a search on the H200
    timed faster), which is what an sm_90 launch is served."""
    keys = list(MOE_TUNABLE.tune_keys("sm_90"))
    assert keys
    for key in keys:
        cfg, source = MOE_TUNABLE.explain(key, "sm_90")
        assert source == "artifact", key
        assert MOE_TUNABLE.is_valid(cfg, key, "sm_90") and cfg in MOE_TUNABLE._candidate_list(key, "sm_90"), key
