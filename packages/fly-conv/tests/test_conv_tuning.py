"""fly-conv's tuning adopter: the key, the bounded candidate space, config_for's sources, a search on the
interpreter, the wiring into conv and `flydsl tune conv` (CPU-tested: SM90 and the interpreter as arches)."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
import torch.nn.functional as F
from conv_helpers import rand, weight

import flydsl.arch
from fly_conv import autotune, conv, conv2d
from fly_conv.autotune import (
    TUNABLE,
    ConvConfig,
    ConvProblem,
    candidates,
    clear_memo,
    config_for,
    config_valid,
    default_config,
    key_problem,
    tuning_key,
)
from flydsl.arch import INTERPRETER, SM90
from flydsl.autotune import ArtifactFile, LocalCache, write_artifact
from flydsl.testing import assert_rel_close

BF16, F32 = torch.bfloat16, torch.float32
conv_mod = importlib.import_module("fly_conv.conv")  # the module: the package's ``conv`` is the function


def _layer(kind, m, n, cg, taps, groups, dtype=BF16, kernel=(3, 3), stride=(1, 1), dilation=(1, 1), **kw):
    return ConvProblem(kind, m, n, cg, taps, groups, dtype, kernel, stride, dilation, **kw)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty tuning cache, no search asked, nothing memoised before or after."""
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLYDSL_AUTOTUNE", raising=False)
    clear_memo()
    yield tmp_path
    clear_memo()


# ------------------------------------------------------------------------------ the key


def test_key_names_the_layer_not_its_resolution():
    p = _layer("implicit", 8 * 56 * 56, 64, 64, 9, 1)
    assert tuning_key(p) == {"kind": "implicit", "rank": 2, "kernel": "3x3", "stride": "1x1", "dilation": "1x1",
                             "groups": "dense", "cin": 64, "cout": 64, "m_bucket": 32768, "dtype": "bf16"}  # fmt: skip
    # another resolution of the same layer in the same bucket of positions: the same key (D/H/W are not in it)
    assert tuning_key(dataclasses.replace(p, m=8 * 60 * 50)) == tuning_key(p)
    assert tuning_key(dataclasses.replace(p, m=4 * 112 * 112)) == {**tuning_key(p), "m_bucket": 65536}
    assert not {"d", "h", "w", "spatial", "n"} & set(tuning_key(p))
    # the 3D layer's kernel and stride spelled out a dim each
    k3 = tuning_key(_layer("implicit", 1000, 64, 64, 27, 1, kernel=(3, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1)))
    assert (k3["rank"], k3["kernel"], k3["stride"], k3["dilation"]) == (3, "3x3x3", "1x2x2", "1x1x1")


def test_key_buckets_channels_positions_and_groups():
    key = tuning_key(_layer("implicit", 300, 96, 24, 9, 4))  # 96 in (24 a group) -> 384 out
    assert (key["cin"], key["cout"], key["groups"], key["m_bucket"]) == (128, 512, "cg32", 512)
    big = tuning_key(_layer("implicit", 10**8, 5000, 5000, 9, 1))
    assert (big["cin"], big["cout"], big["m_bucket"]) == (2048, 2048, 1 << 20)  # capped
    dw = tuning_key(_layer("direct", 1000, 192, 1, 9, 96))  # 96 channels, 2 outputs each
    assert (dw["groups"], dw["cin"], dw["cout"], dw["kind"]) == ("depthwise", 128, 256, "direct")
    # the input gradient names the layer's channels as the forward does, its kind "dgrad"
    dgrad = tuning_key(_layer("implicit", 5000, 32, 256, 9, 1, transposed=True))
    assert (dgrad["kind"], dgrad["cin"], dgrad["cout"]) == ("dgrad", 32, 256)
    wgrad = tuning_key(_layer("wgrad", 5000, 256, 32, 9, 1))
    assert (wgrad["kind"], wgrad["cin"], wgrad["cout"]) == ("wgrad", 32, 256)
    # kind and dtype given override the problem's
    fwd = _layer("implicit", 5000, 256, 32, 9, 1)
    assert tuning_key(fwd, "implicit", torch.float8_e4m3fn)["dtype"] == "fp8_e4m3"
    assert tuning_key(_layer("implicit", 5000, 32, 256, 9, 1), "dgrad") == dgrad
    with pytest.raises(ValueError, match="geometry|kernel"):
        tuning_key(ConvProblem("implicit", 5000, 32, 256, 9, 1, BF16))  # no geometry, no key
    with pytest.raises(ValueError, match="kind"):
        key_problem({**dgrad, "kind": "transposed"})
    with pytest.raises(ValueError, match="kernel"):
        key_problem({**dgrad, "kernel": "3by3"})


# ------------------------------------------------------------------------------ the candidate space


def _tune_keys():
    return TUNABLE.tune_keys("sm_90")


def test_tuning_set_is_the_benchs_layers():
    keys = _tune_keys()
    assert len(keys) == len({json.dumps(k, sort_keys=True) for k in keys}) == 44
    assert {k["kind"] for k in keys} == {"implicit", "dgrad", "direct", "wgrad"}
    assert {k["rank"] for k in keys} == {1, 2, 3}
    assert {k["dtype"] for k in keys} == {"bf16", "fp8_e4m3"}
    assert {k["groups"] for k in keys} >= {"dense", "depthwise", "cg4", "cg64"}
    assert {k["kernel"] for k in keys} == {"1x1", "3x3", "7x7", "3x3x3", "7"}
    assert all(tuning_key(key_problem(k)) == k for k in keys)  # the representative problem's key is the key


@pytest.mark.parametrize("arch", ["sm_90", "cpu"])
def test_every_candidate_is_valid_and_the_space_bounded(arch):
    a = SM90 if arch == "sm_90" else INTERPRETER
    for key in _tune_keys():
        p = key_problem(key)
        cands = candidates(key, arch)
        assert all(isinstance(c, ConvConfig) and config_valid(c, p, a) for c in cands), key
        rows = [c for c in cands if c.tma and p.kind == "implicit"]  # the row-block forward's, on top
        assert len(cands) == len(set(cands)) <= 30 + len(rows) and len(rows) <= 5
        assert (8 if arch == "sm_90" else 2) <= len(cands), (key, cands)
        default = TUNABLE.default(key, arch)
        assert default == default_config(p, a) and config_valid(default, p, a)
        searched = TUNABLE._candidate_list(key, arch)  # what a search times: the default first
        assert searched[0] == default and len(searched) <= TUNABLE.max_candidates


def test_candidates_follow_the_layer():
    def space(problem):
        return candidates(tuning_key(problem), "sm_90")

    wide = space(_layer("implicit", 1 << 17, 256, 256, 9, 1))
    assert {c.block_m for c in wide} == {64, 128} and {c.block_n for c in wide} == {64, 128, 256}
    assert {c.block_k for c in wide} == {32, 64} and {c.num_warps for c in wide} == {4, 8}
    assert {c.num_stages for c in wide} == {3, 4} and all(c.split_k == 1 for c in wide)  # no split-K kernel
    narrow = space(_layer("implicit", 1 << 17, 4, 4, 9, 32))  # 4 channels a group: the dot's 16 at most
    assert {(c.block_n, c.block_k) for c in narrow} == {(16, 16)} and 256 in {c.block_m for c in narrow}
    fp8 = space(_layer("implicit", 1 << 17, 256, 256, 9, 1, torch.float8_e4m3fn))
    assert {c.block_k for c in fp8} == {64, 128}
    fp32 = space(_layer("implicit", 1 << 17, 256, 256, 9, 1, F32))
    assert max(c.block_m * c.block_n for c in fp32) <= 128 * 64  # registers: small tiles only
    dw = space(_layer("direct", 1 << 17, 384, 1, 9, 384))
    assert {c.block_n for c in dw} == {8, 16, 32, 64, 128} and len({c.block_m for c in dw}) > 2
    # the weight gradient's few tiles: the positions split to fill the SMs, half and twice that (none only
    # where filling takes fewer than 4 splits), the default tile on the row-block kernel, then over 2 taps a
    # program (4 taps past the space's 30 here: several taps never won a search on the H200)
    wg = space(_layer("wgrad", 8 * 56 * 56, 64, 64, 9, 1))
    splits = {c.split_k for c in wg}
    assert 1 not in splits and max(splits) >= 4 and len(splits) >= 3
    assert {c.taps for c in wg} == {1, 2} and all(c.taps * c.block_n <= 256 for c in wg)
    assert {c.block_k for c in wg if c.tma} == {32, 64} and all(c.taps == 1 for c in wg if c.tma)
    few = space(_layer("wgrad", 2 * 8 * 8, 256, 256, 9, 1))  # 128 positions: nothing to split
    assert 1 in {c.split_k for c in few}
    assert {c.taps for c in space(_layer("wgrad", 8 * 56 * 56, 64, 256, 1, 1, kernel=(1, 1)))} == {1}  # one tap


# ------------------------------------------------------------------------------ config_for's sources


def test_default_when_nothing_is_searched_or_shipped(fresh):
    problems = [
        _layer("implicit", 8 * 56 * 56, 96, 24, 9, 1),
        _layer("wgrad", 8 * 28 * 28, 64, 64, 9, 1),
        _layer("direct", 5000, 96, 1, 9, 96),
        _layer("implicit", 999, 64, 48, 9, 1, transposed=True),
    ]
    for problem in problems:
        for a in (SM90, INTERPRETER):
            cfg = config_for(problem, arch=a)
            assert cfg == default_config(problem, a)  # the problem's own default, not its bucket's
            assert TUNABLE.explain(tuning_key(problem), a.name)[1] in ("memo", "default")
            assert config_for(problem, arch=a) is cfg  # memoised
    # a problem without geometry has no key: its default
    plain = ConvProblem("implicit", 999, 64, 48, 9, 1, BF16)
    assert config_for(plain, arch=SM90) == default_config(plain, SM90)


def test_a_cached_or_shipped_winner_is_served(fresh, monkeypatch):
    problem = _layer("implicit", 8 * 56 * 56, 64, 64, 9, 1)
    key = tuning_key(problem)
    shipped = ConvConfig(64, 128, 32, num_warps=8, num_stages=3)
    assert shipped != default_config(problem, SM90)
    art = fresh / "artifacts"
    write_artifact(art / "conv.json", "conv", [{"arch": "sm_90", "device_name": "NVIDIA H200", "triton": "3.6.0",
                                                "torch": "2.13", "key": key, "config": dataclasses.asdict(shipped),
                                                "time_us": 10.0, "default_time_us": 12.0}])  # fmt: skip
    monkeypatch.setattr(autotune, "TUNABLE", dataclasses.replace(TUNABLE, artifact_dir=art))
    assert config_for(problem, arch=SM90) == shipped
    assert config_for(dataclasses.replace(problem, m=8 * 50 * 60), arch=SM90) == shipped  # another resolution
    monkeypatch.setenv("FLYDSL_USE_ARTIFACTS", "0")
    clear_memo()
    assert config_for(problem, arch=SM90) == default_config(problem, SM90)
    # a winner searched earlier on this machine (the local cache) comes before the artifact
    cached = ConvConfig(128, 64, 32, num_warps=8, num_stages=4)
    LocalCache().save("conv", "sm_90", key, dataclasses.asdict(cached), time_us=1.0, default_time_us=2.0,
                      candidates=3)  # fmt: skip
    monkeypatch.setenv("FLYDSL_USE_ARTIFACTS", "1")
    clear_memo()
    assert config_for(problem, arch=SM90) == cached


def test_a_search_on_the_interpreter_picks_a_config_that_matches_torch(fresh, monkeypatch, device):
    """FLYDSL_AUTOTUNE=1: the first conv of a key searches it (the key's representative layer, each candidate
    checked against the fp64 reference, then timed); the winner is valid, and conv launched with it matches
    torch's F.conv2d in fp32."""
    a = flydsl.arch.current(device)
    x = rand(2, 8, 7, 6, dtype=F32, device=device)
    w = weight(16, 8, (3, 3), dtype=F32, device=device)
    problem = _layer("implicit", 2 * 7 * 6, 16, 8, 9, 1, F32)
    key = tuning_key(problem)
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "1")
    y = conv2d(x, w, padding=1)  # searches through config_for
    monkeypatch.delenv("FLYDSL_AUTOTUNE")
    cfg, source = TUNABLE.explain(key, a.name)
    assert source == "searched" and config_valid(cfg, problem, a)
    assert cfg in TUNABLE._candidate_list(key, a.name)
    served = config_for(problem, arch=a)
    assert served == (default_config(problem, a) if cfg == TUNABLE.default(key, a.name) else cfg)
    ref = F.conv2d(x.cpu(), w.cpu(), padding=1)
    assert_rel_close(y.cpu(), ref, tol=1e-5)
    assert_rel_close(conv(x, w, padding=1, config=served).cpu(), ref, tol=1e-5)


def test_conv_launches_the_served_config(fresh, monkeypatch, device):
    """The forward and both gradients are launched with config_for's answer (a winner cached for their keys)."""
    a = flydsl.arch.current(device)
    x = rand(2, 8, 7, 6, dtype=F32, device=device).requires_grad_(True)
    w = weight(16, 8, (3, 3), dtype=F32, device=device).requires_grad_(True)
    fwd = _layer("implicit", 2 * 7 * 6, 16, 8, 9, 1, F32)
    dgrad = _layer("implicit", 2 * 7 * 6, 8, 16, 9, 1, F32, transposed=True)
    wgrad = _layer("wgrad", 2 * 7 * 6, 16, 8, 9, 1, F32)
    winners = {"implicit": ConvConfig(16, 16, 16, group_m=2, num_stages=1),
               "dgrad": ConvConfig(16, 16, 16, group_m=3, num_stages=1),
               "wgrad": ConvConfig(16, 16, 16, num_stages=1, split_k=2)}  # fmt: skip
    for problem in (fwd, dgrad, wgrad):
        key = tuning_key(problem)
        LocalCache().save("conv", a.name, key, dataclasses.asdict(winners[key["kind"]]), time_us=1.0,
                          default_time_us=2.0, candidates=2)  # fmt: skip
    seen = []
    implicit, wgrad_launch = conv_mod.launch_implicit_gemm, conv_mod.launch_wgrad
    monkeypatch.setattr(conv_mod, "launch_implicit_gemm", lambda *args: (seen.append(args[8]), implicit(*args))[1])
    monkeypatch.setattr(conv_mod, "launch_wgrad", lambda *args: (seen.append(args[7]), wgrad_launch(*args))[1])
    y = conv2d(x, w, padding=1)
    y.backward(torch.ones_like(y))
    assert seen == [winners["implicit"], winners["dgrad"], winners["wgrad"]]
    x_ref, w_ref = x.detach().cpu().requires_grad_(True), w.detach().cpu().requires_grad_(True)
    y_ref = F.conv2d(x_ref, w_ref, padding=1)
    y_ref.backward(torch.ones_like(y_ref))
    assert_rel_close(y.detach().cpu(), y_ref.detach(), tol=1e-5)
    assert_rel_close(x.grad.cpu(), x_ref.grad, tol=1e-5)
    assert_rel_close(w.grad.cpu(), w_ref.grad, tol=1e-5)


# ------------------------------------------------------------------------------ registration and the CLI


def test_family_lists_conv():
    from flydsl.families import discover

    fam = discover()["conv"]
    tunables = list(fam.tunables())
    assert [t.name for t in tunables] == ["conv"] and tunables[0] is autotune.TUNABLE
    assert tunables[0].config_type is ConvConfig and tunables[0].make_task is not None


def test_flydsl_tune_conv_writes_an_artifact_that_is_then_served(fresh, device):
    """`flydsl tune conv --key ...` on a tiny depthwise key -> artifact JSON -> served by the next lookup."""
    from flydsl import cli

    key = tuning_key(_layer("direct", 40, 8, 1, 9, 8))
    out = fresh / "artifacts"
    argv = ["tune", "conv", "--only", "conv", "--key", json.dumps(key), "--out", str(out), "--allow-interpreter"]
    assert cli.main(argv) == 0
    data = json.loads((out / "conv.json").read_text())
    assert data["name"] == "conv" and len(data["entries"]) == 1
    arch = data["entries"][0]["arch"]
    served = ArtifactFile(out / "conv.json", "conv").lookup(arch, key)
    assert served is not None and config_valid(ConvConfig(**served), key_problem(key), flydsl.arch.current())


def test_the_shipped_sm90_artifact_serves_valid_configs_for_tuned_keys(fresh):
    """Each sm_90 entry of the shipped artifact is a key of the tuning set whose config is valid for it and
    among its candidates (the default, or one a search on the H200 timed faster), and is what an sm_90 launch
    of that key is served; keys with no entry get their default."""
    keys = list(TUNABLE.tune_keys("sm_90"))
    shipped = ArtifactFile(TUNABLE.artifact_dir / "conv.json", "conv")
    covered = [k for k in keys if shipped.lookup("sm_90", k) is not None]
    assert covered
    for key in keys:
        cfg, source = TUNABLE.explain(key, "sm_90")
        assert source == ("artifact" if key in covered else "default"), key
        assert TUNABLE.is_valid(cfg, key, "sm_90") and cfg in TUNABLE._candidate_list(key, "sm_90"), key
