"""fly-attention's tuning adopter: the key, the bounded candidate spaces of both directions, the configs
config_for / bwd_config_for serve (default, shipped artifact, local cache, a search), flash_attn launching
them, and `flydsl tune attention` (CPU-tested: sm_90 and the interpreter as arches, tiny shapes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from attn_helpers import rand_qkv

import flydsl.arch
from fly_attention import attention as attn_mod
from fly_attention import autotune, flash_attn, flash_attn_ref
from fly_attention.autotune import (
    BWD_TUNABLE,
    FWD_TUNABLE,
    SEQLEN_CAP,
    AttnBwdConfig,
    AttnConfig,
    bwd_candidates,
    bwd_config_for,
    bwd_config_valid,
    candidates,
    clear_memo,
    config_for,
    config_valid,
    default_bwd_config,
    default_config,
    key_args,
    tuning_key,
)
from fly_attention.bench import attn_grads_ref
from flydsl.arch import INTERPRETER, SM90
from flydsl.autotune import ArtifactFile, LocalCache, TuningWarning, write_artifact
from flydsl.testing import assert_rel_close, tolerance

F16, BF16, FP8 = torch.float16, torch.bfloat16, torch.float8_e4m3fn


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty tuning cache, no search asked, nothing memoised before or after."""
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLYDSL_AUTOTUNE", raising=False)
    monkeypatch.delenv("FLYDSL_USE_ARTIFACTS", raising=False)
    clear_memo()
    yield tmp_path
    clear_memo()


def _ship(monkeypatch, folder, name, entries):
    """Write ``entries`` ((arch, key, config) triples) as the artifact of tunable ``name`` in ``folder`` and make
    the tunable read it there."""
    write_artifact(folder / f"{name}.json", name, [
        {"arch": arch, "device_name": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11", "key": key,
         "config": dataclasses.asdict(cfg), "time_us": 10.0, "default_time_us": 12.0}
        for arch, key, cfg in entries
    ])  # fmt: skip
    attr = "FWD_TUNABLE" if name == "flash_fwd" else "BWD_TUNABLE"
    monkeypatch.setattr(autotune, attr, dataclasses.replace(getattr(autotune, attr), artifact_dir=folder))
    clear_memo()


def _spy(monkeypatch, name):
    """Record the config (the last argument) of every launch through ``attention.<name>``."""
    seen, launch = [], getattr(attn_mod, name)
    monkeypatch.setattr(attn_mod, name, lambda *args: (seen.append(args[-1]), launch(*args))[1])
    return seen


# ------------------------------------------------------------------------------ the key


def test_key_buckets_the_lengths_and_keeps_the_rest():
    key = tuning_key(128, 64, 1000, 3000, True, BF16)
    assert key == {"head_dim": 128, "head_dim_v": 64, "causal": True, "dtype": "bf16", "seqlen_q": 1024,
                   "seqlen_k": 4096}  # fmt: skip
    assert tuning_key(128, 64, 1024, 2049, True, BF16) == key  # the same buckets: the same key
    assert tuning_key(80, 80, 1, 0, False, FP8) == {"head_dim": 80, "head_dim_v": 80, "causal": False,
                                                    "dtype": "fp8_e4m3", "seqlen_q": 1, "seqlen_k": 1}  # fmt: skip
    assert tuning_key(64, 64, 17, 33, False, F16)["dtype"] == "fp16"
    # past the tuned range's top, one key
    long = tuning_key(128, 128, 100_000, SEQLEN_CAP + 1, False, BF16)
    assert (long["seqlen_q"], long["seqlen_k"]) == (SEQLEN_CAP, SEQLEN_CAP) == (16384, 16384)
    assert not {"batch", "heads", "heads_kv"} & set(key)
    assert key_args(key) == (128, 64, 1024, 4096, True, BF16)
    assert json.loads(json.dumps(key)) == key  # JSON scalars only
    for bad in ({**key, "dtype": "fp32"}, {**key, "seqlen_q": 0}, {**key, "causal": 1}, {"head_dim": 64}):
        with pytest.raises(ValueError, match="key"):
            key_args(bad)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        BWD_TUNABLE.default(tuning_key(128, 128, 64, 64, False, FP8), "sm_90")


# ------------------------------------------------------------------------------ the candidate spaces


def test_tuning_sets_are_the_benchs_cases():
    fwd, bwd = FWD_TUNABLE.tune_keys("sm_90"), BWD_TUNABLE.tune_keys("sm_90")
    for keys in (fwd, bwd):
        assert len(keys) == len({json.dumps(k, sort_keys=True) for k in keys})
        assert all(k["seqlen_q"] == k["seqlen_k"] and k["head_dim"] == k["head_dim_v"] for k in keys)
    # bf16 at d 64 / 128 / 256 and fp8 at d 128, causal and not, 1K-16K (varlen's pack lengths fall among them)
    assert len(fwd) == 40
    assert {(k["dtype"], k["head_dim"]) for k in fwd} == {("bf16", 64), ("bf16", 128), ("bf16", 256),
                                                           ("fp8_e4m3", 128)}  # fmt: skip
    assert {k["seqlen_q"] for k in fwd} == {1024, 2048, 4096, 8192, 16384}
    assert {k["causal"] for k in fwd} == {False, True}
    # d 128 at 1K-16K, d 64 and 256 at 4K, causal and not
    assert len(bwd) == 14 and {k["dtype"] for k in bwd} == {"bf16"}
    assert {(k["head_dim"], k["seqlen_q"]) for k in bwd if k["head_dim"] != 128} == {(64, 4096), (256, 4096)}


@pytest.mark.parametrize("arch", ["sm_90", "cpu"])
def test_every_candidate_is_valid_and_the_spaces_bounded(arch):
    """Every key of the tuning sets, on sm_90 and the interpreter: a valid default among its candidates, every
    candidate valid, none twice, at most 16."""
    a = SM90 if arch == "sm_90" else INTERPRETER
    for tunable, space in ((FWD_TUNABLE, candidates), (BWD_TUNABLE, bwd_candidates)):
        for key in tunable.tune_keys("sm_90"):
            d, dv, sq, sk, causal, dtype = key_args(key)
            cands = space(key, arch)
            assert cands == space(key, arch)  # pure
            assert len(cands) == len(set(cands)) <= tunable.max_candidates == 16, key
            assert all(isinstance(c, tunable.config_type) and tunable.is_valid(c, key, arch) for c in cands), key
            default = tunable.default(key, arch)
            if tunable is FWD_TUNABLE:
                assert default == default_config(d, dv, sq, sk, causal, dtype, a)
                assert all(config_valid(c, d, dv, dtype, a) for c in cands)
            else:
                assert default == default_bwd_config(d, dv, sq, sk, causal, dtype, a)
                assert all(bwd_config_valid(c, d, dv, dtype, a) for c in cands)
            assert default in cands and tunable.is_valid(default, key, arch), key
            searched = tunable._candidate_list(key, arch)  # what a search times: the default first
            assert searched[0] == default and set(searched) == set(cands)
            assert len(cands) >= (7 if arch == "sm_90" else 1), (key, cands)


def test_candidates_follow_the_key():
    def fwd(d, sq=4096, dtype=BF16, dv=None):
        return candidates(tuning_key(d, dv or d, sq, sq, True, dtype), "sm_90")

    d128 = fwd(128)
    assert {c.block_m for c in d128} == {64, 128} and {c.block_n for c in d128} == {64, 128}
    assert {c.num_warps for c in d128} == {4, 8} and {c.num_stages for c in d128} == {2, 3, 4}
    assert {c.tma for c in d128} == {False, True} and any(c.tma_store for c in d128)
    assert all(c.block_m == 128 and c.num_warps == 8 for c in d128 if c.tma)  # tma_candidates' tiles
    d256 = fwd(256)  # shared memory: no 128-key steps, short 32-key ones instead
    assert 32 in {c.block_n for c in d256} and 128 not in {c.block_n for c in d256}
    fp8 = fwd(128, dtype=FP8)  # no TMA kernel for fp8; its P @ V dot needs 32 keys a step
    assert not any(c.tma for c in fp8) and min(c.block_n for c in fp8) >= 32 and len(fp8) >= 10
    assert fwd(256, dtype=FP8)  # 64-row tiles take 8 warps where 4 cannot hold them
    assert not any(c.tma for c in fwd(100))  # rows of 200 bytes: not whole 16-byte units
    decode = fwd(128, sq=20)  # 20 queries: one 32-row tile, no 128-row TMA tiles
    assert {c.block_m for c in decode} == {32} and not any(c.tma for c in decode)
    assert fwd(192, dv=128) and all(config_valid(c, 192, 128, BF16, SM90) for c in fwd(192, dv=128))
    bwd = bwd_candidates(tuning_key(128, 128, 4096, 4096, False, BF16), "sm_90")
    assert {(c.dkdv_block_m, c.dkdv_block_n) for c in bwd} >= {(32, 64), (64, 128), (64, 64)}
    assert all((c.dq_block_m, c.dq_block_n) == (c.dkdv_block_n, c.dkdv_block_m) for c in bwd)  # mirrored
    assert {c.num_warps for c in bwd} == {4, 8} and {c.num_stages for c in bwd} == {2, 3}


# ------------------------------------------------------------------------------ what config_for serves


def test_the_default_when_nothing_is_searched_or_shipped(fresh, monkeypatch):
    monkeypatch.setenv("FLYDSL_USE_ARTIFACTS", "0")  # the shipped sm_90 artifacts cover some of these keys
    assert attn_mod._config_for is config_for and attn_mod._bwd_config_for is bwd_config_for
    for a in (SM90, INTERPRETER):
        for d, dv, sq, sk, causal, dtype in [(128, 128, 4096, 4096, True, BF16), (64, 64, 32, 1024, False, F16),
                                             (256, 256, 1 << 17, 1 << 17, False, BF16), (128, 128, 8, 8, True, FP8),
                                             (192, 128, 2048, 512, True, F16)]:  # fmt: skip
            cfg = config_for(d, dv, sq, sk, causal, dtype, a)
            assert cfg == default_config(d, dv, sq, sk, causal, dtype, a)
            assert config_for(d, dv, sq, sk, causal, dtype, a) is cfg  # memoised
            if dtype != FP8:
                assert bwd_config_for(d, dv, sq, sk, causal, dtype, a) == default_bwd_config(d, dv, sq, sk, causal,
                                                                                             dtype, a)  # fmt: skip
        assert FWD_TUNABLE.explain(tuning_key(128, 128, 4096, 4096, True, BF16), a.name)[1] in ("memo", "default")


def test_a_shipped_config_is_served_and_checked_against_the_launch(fresh, monkeypatch):
    key = tuning_key(128, 128, 4096, 4096, False, BF16)
    shipped = AttnConfig(128, 128, num_warps=8, num_stages=3, tma=True)  # 225 KB of shared memory
    assert shipped != default_config(128, 128, 4096, 4096, False, BF16, SM90)
    _ship(monkeypatch, fresh / "artifacts", "flash_fwd", [("sm_90", key, shipped)])
    assert config_for(128, 128, 4096, 4096, False, BF16, SM90) == shipped
    assert config_for(128, 128, 2048 + 1, 4096, False, BF16, SM90) == shipped  # the same buckets
    assert config_for(128, 128, 4096, 4096, True, BF16, SM90) != shipped  # another key: causal
    # a GPU of the same arch name that cannot hold it gets its own default (answers are memoised by arch name,
    # which fixes the shared memory a program may take: a fresh process)
    clear_memo()
    small = dataclasses.replace(SM90, smem_per_block=200 * 1024)
    served = config_for(128, 128, 4096, 4096, False, BF16, small)
    assert served == default_config(128, 128, 4096, 4096, False, BF16, small)
    assert config_valid(served, 128, 128, BF16, small) and not config_valid(shipped, 128, 128, BF16, small)
    monkeypatch.setenv("FLYDSL_USE_ARTIFACTS", "0")
    clear_memo()
    assert config_for(128, 128, 4096, 4096, False, BF16, SM90) == default_config(128, 128, 4096, 4096, False, BF16,
                                                                                   SM90)  # fmt: skip


def test_flash_attn_launches_the_shipped_config(fresh, monkeypatch, device):
    """An artifact entry for the call's key and arch is what flash_attn launches (right, against the fp32
    reference); a call of another key gets its default; an entry the key cannot take is ignored (one warning)
    and the default served."""
    a = flydsl.arch.current(device)
    shipped = AttnConfig(16, 16, num_warps=4, num_stages=1)
    key = tuning_key(16, 16, 20, 20, True, F16)
    bad_key = tuning_key(16, 16, 40, 40, True, F16)
    assert shipped != default_config(16, 16, 32, 32, True, F16, a)
    _ship(monkeypatch, fresh / "artifacts", "flash_fwd", [
        (a.name, key, shipped),
        (a.name, bad_key, AttnConfig(16, 16, num_warps=4, num_stages=1, tma_store=True)),  # a store without TMA
    ])  # fmt: skip
    seen = _spy(monkeypatch, "_launch_fwd")
    q, k, v = rand_qkv(1, 20, 20, 2, 1, 16, device=device)
    out = flash_attn(q, k, v, causal=True)
    assert seen == [shipped]
    assert_rel_close(out, flash_attn_ref(q, k, v, causal=True).to(out.device), tol=tolerance(F16))
    q, k, v = rand_qkv(1, 40, 40, 2, 2, 16, device=device, seed=1)
    with pytest.warns(TuningWarning, match="validity"):
        out = flash_attn(q, k, v, causal=True)
    assert seen[-1] == default_config(16, 16, 64, 64, True, F16, a)
    assert_rel_close(out, flash_attn_ref(q, k, v, causal=True).to(out.device), tol=tolerance(F16))


def test_fp8_and_the_tma_kernel_take_served_configs(fresh, monkeypatch, device):
    """A served fp8 config launches the fp8 kernel with it; a served TMA config runs the TMA kernel where TMA
    can address the tensors and the pointer kernel with its tiles where it cannot."""
    a = flydsl.arch.current(device)
    fp8_cfg = AttnConfig(16, 32, num_warps=4, num_stages=1)
    tma_cfg = AttnConfig(32, 16, num_warps=4, num_stages=1, tma=True)
    entries = [(a.name, tuning_key(16, 16, 32, 32, False, FP8), fp8_cfg),
               (a.name, tuning_key(16, 16, 32, 32, False, F16), tma_cfg)]  # fmt: skip
    _ship(monkeypatch, fresh / "artifacts", "flash_fwd", entries)
    seen = _spy(monkeypatch, "launch_flash_fwd_fp8")
    g = torch.Generator().manual_seed(0)
    # integer scores with scale ln 2: probabilities exact in e4m3 (the interpreter's e4m3 rounding is not the GPU's)
    q8, k8 = (torch.randint(-1, 2, (1, 32, 2, 16), generator=g).float().to(device=device, dtype=FP8) for _ in "qk")
    v8 = (torch.randn(1, 32, 2, 16, generator=g) * 3).to(device=device, dtype=FP8)
    out = flash_attn(q8, k8, v8, softmax_scale=0.6931471805599453)
    assert seen == [fp8_cfg]
    ref = flash_attn_ref(q8.float(), k8.float(), v8.float(), softmax_scale=0.6931471805599453)
    assert_rel_close(out, ref.to(out.device), tol=tolerance(BF16))
    tma, pointer = _spy(monkeypatch, "launch_flash_fwd_tma"), _spy(monkeypatch, "launch_flash_fwd")
    q, k, v = rand_qkv(1, 32, 32, 2, 2, 16, device=device)
    assert_rel_close(flash_attn(q, k, v), flash_attn_ref(q, k, v).to(device), tol=tolerance(F16))
    assert (tma, pointer) == ([tma_cfg], [])
    wide = torch.zeros(1, 32, 2, 17, dtype=F16, device=device)
    wide[..., :16] = q
    q_odd = wide[..., :16]  # rows of 17 elements: strides TMA cannot take
    assert_rel_close(flash_attn(q_odd, k, v), flash_attn_ref(q, k, v).to(device), tol=tolerance(F16))
    assert (tma, pointer) == ([tma_cfg], [tma_cfg])


def test_the_backward_launches_a_cached_winner(fresh, monkeypatch, device):
    """A winner searched earlier on this machine (the local cache) is what the backward launches."""
    a = flydsl.arch.current(device)
    key = tuning_key(16, 16, 32, 32, False, F16)
    cached = AttnBwdConfig(16, 16, 16, 16, num_warps=4, num_stages=1)
    assert cached != default_bwd_config(16, 16, 32, 32, False, F16, a)
    LocalCache().save("flash_bwd", a.name, key, dataclasses.asdict(cached), time_us=1.0, default_time_us=2.0,
                      candidates=2)  # fmt: skip
    seen = _spy(monkeypatch, "launch_flash_bwd")
    q, k, v = (t.requires_grad_(True) for t in rand_qkv(1, 32, 32, 2, 2, 16, device=device))
    dout = torch.randn(1, 32, 2, 16, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=F16)
    flash_attn(q, k, v).backward(dout)
    assert seen == [cached]
    for got, ref in zip((q.grad, k.grad, v.grad), attn_grads_ref(q.detach(), k.detach(), v.detach(), dout),
                        strict=True):  # fmt: skip
        assert_rel_close(got, ref.to(got.device), tol=2 * tolerance(F16))


def test_a_search_picks_a_correct_config_and_caches_it(fresh, monkeypatch, device):
    """FLYDSL_AUTOTUNE=1: the first call of a key searches it (the key's representative problem, every candidate
    checked against the fp32 reference, then timed); the winner is a candidate, the call is right, and the next
    process-fresh lookup serves it from the local cache."""
    a = flydsl.arch.current(device)
    key = tuning_key(16, 16, 20, 20, True, F16)
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "1")
    q, k, v = rand_qkv(1, 20, 20, 2, 2, 16, device=device)
    out = flash_attn(q, k, v, causal=True)
    monkeypatch.delenv("FLYDSL_AUTOTUNE")
    assert_rel_close(out, flash_attn_ref(q, k, v, causal=True).to(out.device), tol=tolerance(F16))
    cfg, source = FWD_TUNABLE.explain(key, a.name)
    assert source == "searched" and cfg in candidates(key, a.name)
    clear_memo()
    assert FWD_TUNABLE.explain(key, a.name) == (cfg, "cache")
    assert config_for(16, 16, 32, 32, True, F16, a) == cfg


def test_family_lists_both_tunables():
    from flydsl.families import discover

    tunables = list(discover()["attention"].tunables())
    assert [t.name for t in tunables] == ["flash_fwd", "flash_bwd"]
    assert tunables[0] is autotune.FWD_TUNABLE and tunables[1] is autotune.BWD_TUNABLE
    assert all(t.make_task is not None and t.artifact_dir.name == "artifacts" for t in tunables)
    assert tunables[0].artifact_dir.parent.name == "fly_attention"


def test_flydsl_tune_attention_writes_artifacts_that_are_then_served(fresh, device):
    """`flydsl tune attention --key ...` on a tiny 16-bit key searches both directions (the key is theirs alike)
    and writes each artifact; an fp8 key tunes the forward (--only)."""
    from flydsl import cli

    key = tuning_key(16, 16, 32, 32, False, F16)
    out = fresh / "artifacts"
    assert cli.main(["tune", "attention", "--key", json.dumps(key), "--out", str(out), "--allow-interpreter"]) == 0
    fp8_key = tuning_key(16, 16, 32, 32, True, FP8)
    argv = ["tune", "attention", "--only", "flash_fwd", "--key", json.dumps(fp8_key), "--out", str(out),
            "--allow-interpreter"]  # fmt: skip
    assert cli.main(argv) == 0
    for name, cls, keys in (("flash_fwd", AttnConfig, (key, fp8_key)), ("flash_bwd", AttnBwdConfig, (key,))):
        data = json.loads((out / f"{name}.json").read_text())
        assert data["name"] == name and len(data["entries"]) == len(keys)
        for k in keys:
            arch = data["entries"][0]["arch"]
            served = ArtifactFile(out / f"{name}.json", name).lookup(arch, k)
            tunable = FWD_TUNABLE if name == "flash_fwd" else BWD_TUNABLE
            assert served is not None and tunable.is_valid(cls(**served), k, arch)


@pytest.mark.parametrize("tunable", [FWD_TUNABLE, BWD_TUNABLE], ids=lambda t: t.name)
def test_the_shipped_sm90_artifact_covers_the_tuning_set(fresh, tunable):
    """Every key of the tuning set has an sm_90 entry in the shipped artifact, a config valid for its key
    (the default, or one a search on the H200 timed faster), which is what an sm_90 launch is served."""
    keys = list(tunable.tune_keys("sm_90"))
    for key in keys:
        cfg, source = tunable.explain(key, "sm_90")
        assert source == "artifact", key
        assert tunable.is_valid(cfg, key, "sm_90") and cfg in tunable._candidate_list(key, "sm_90"), key
