"""CPU tests of the tuning framework: resolution order, search rules, stores.

The "kernel" is a plain torch op and timing is a fake ``bench`` that reads a
per-config time from a dict, so every ranking is deterministic and nothing is
launched on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flydsl.autotune import (
    SCHEMA_VERSION,
    ArtifactFile,
    LocalCache,
    SearchTask,
    Tunable,
    TuningError,
    TuningWarning,
    atomic_write_json,
    identity,
    key_string,
    narrowed,
    precompile,
    tune_artifact,
    write_artifact,
)

ARCH = "sm_90"
KEY = {"n": 1024, "dtype": "fp32"}


@dataclass(frozen=True)
class Cfg:
    block: int
    warps: int = 4


DEFAULT = Cfg(128)


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """Each test gets its own cache root and the documented env defaults."""
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLYDSL_PROGRESS", "0")
    monkeypatch.delenv("FLYDSL_AUTOTUNE", raising=False)
    monkeypatch.delenv("FLYDSL_USE_ARTIFACTS", raising=False)


def make_tunable(tmp_path, *, candidates=(Cfg(64), Cfg(256), Cfg(512)), is_valid=None, make_task=None, **kw):
    return Tunable(
        "toy_fwd",
        Cfg,
        default=lambda key, arch: DEFAULT,
        candidates=lambda key, arch: list(candidates),
        is_valid=is_valid or (lambda cfg, key, arch: cfg.block <= 1024),
        artifact_dir=tmp_path / "artifacts",
        make_task=make_task,
        **kw,
    )


class FakeKernel:
    """A torch "kernel" whose correctness and speed per config are set by the test."""

    def __init__(self, times, wrong=(), raising=(), bad_output=None):
        self.times = dict(times)
        self.wrong = set(wrong)
        self.raising = set(raising)
        self.bad_output = bad_output
        self.ran: list[Cfg] = []
        self.timed: list[Cfg] = []
        self.x = torch.linspace(-1.0, 1.0, 64)

    def run(self, cfg):
        self.ran.append(cfg)
        if cfg in self.raising:
            raise RuntimeError("out of shared memory")
        if cfg in self.wrong:
            return self.bad_output(self.x) if self.bad_output else (self.x * 2.5, self.x.sum())
        return (self.x * 2, self.x.sum())

    def reference(self):
        return (self.x.double() * 2, self.x.double().sum())

    def bench(self, fn):
        before = len(self.ran)
        fn()
        cfg = self.ran[before]
        self.timed.append(cfg)
        return self.times[cfg]

    def task(self, **kw):
        return SearchTask(run=self.run, reference=self.reference, rtol=1e-6, bench=self.bench, **kw)


def write_toy_artifact(tmp_path, config, *, key=KEY, arch=ARCH):
    path = tmp_path / "artifacts" / "toy_fwd.json"
    write_artifact(path, "toy_fwd", [{"arch": arch, "key": dict(key), "config": config, "time_us": 1.0}])
    return path


def save_toy_cache(config, *, key=KEY, arch=ARCH):
    return LocalCache().save("toy_fwd", arch, key, config, time_us=1.0, default_time_us=2.0, candidates=3)


def one_tuning_warning(record):
    ours = [w for w in record if issubclass(w.category, TuningWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    return str(ours[0].message)


# ---------------------------------------------------------------------------
# resolution order
# ---------------------------------------------------------------------------


def test_default_when_nothing_is_stored(tmp_path):
    tun = make_tunable(tmp_path)
    assert tun.explain(KEY, ARCH) == (DEFAULT, "default")
    assert tun.select(KEY, ARCH) == DEFAULT
    assert tun.explain(KEY, ARCH) == (DEFAULT, "memo")


def test_resolution_order_searched_cache_artifact_default(tmp_path, monkeypatch):
    write_toy_artifact(tmp_path, {"block": 256, "warps": 4})
    # Artifact beats default.
    assert make_tunable(tmp_path).explain(KEY, ARCH) == (Cfg(256), "artifact")
    # FLYDSL_USE_ARTIFACTS=0 skips it.
    monkeypatch.setenv("FLYDSL_USE_ARTIFACTS", "0")
    assert make_tunable(tmp_path).explain(KEY, ARCH) == (DEFAULT, "default")
    monkeypatch.delenv("FLYDSL_USE_ARTIFACTS")
    # The local cache beats the artifact.
    save_toy_cache({"block": 512, "warps": 8})
    tun = make_tunable(tmp_path)
    assert tun.explain(KEY, ARCH) == (Cfg(512, 8), "cache")
    assert tun.select(KEY, ARCH) == Cfg(512, 8)
    # A search beats the cache, even though the memo already holds the cache's answer.
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 5.0, Cfg(256): 9.0, Cfg(512): 11.0})
    assert tun.select(KEY, ARCH, autotune=True, task=kernel.task) == Cfg(64)
    assert tun.explain(KEY, ARCH) == (Cfg(64), "searched")
    assert tun.select(KEY, ARCH) == Cfg(64)
    # The winner was persisted: a fresh process (fresh tunable) serves it from the cache.
    assert make_tunable(tmp_path).explain(KEY, ARCH) == (Cfg(64), "cache")


def test_memo_is_per_key_and_arch(tmp_path):
    write_toy_artifact(tmp_path, {"block": 256, "warps": 4})
    tun = make_tunable(tmp_path)
    assert tun.select(KEY, ARCH) == Cfg(256)
    assert tun.select({**KEY, "n": 2048}, ARCH) == DEFAULT
    assert tun.select(KEY, "sm_80") == DEFAULT
    # Key order does not matter.
    assert tun.select({"dtype": "fp32", "n": 1024}, ARCH) == Cfg(256)


def test_clear_memo_rereads_stores(tmp_path):
    tun = make_tunable(tmp_path)
    assert tun.select(KEY, ARCH) == DEFAULT
    save_toy_cache({"block": 64, "warps": 4})
    assert tun.select(KEY, ARCH) == DEFAULT  # memoized
    tun.clear_memo()
    assert tun.select(KEY, ARCH) == Cfg(64)


def test_env_autotune_forces_search(tmp_path, monkeypatch):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 9.0, Cfg(256): 5.0, Cfg(512): 11.0})
    assert tun.select(KEY, ARCH, task=kernel.task) == DEFAULT  # no search without the request
    assert kernel.ran == []
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "1")
    assert tun.select(KEY, ARCH, task=kernel.task) == Cfg(256)
    assert set(kernel.timed) == {DEFAULT, Cfg(64), Cfg(256), Cfg(512)}


def test_autotune_false_overrides_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYDSL_AUTOTUNE", "1")
    tun = make_tunable(tmp_path)
    assert tun.select(KEY, ARCH, autotune=False) == DEFAULT


def test_search_runs_once_per_key_per_process(tmp_path):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 5.0, Cfg(256): 9.0, Cfg(512): 11.0})
    calls = []

    def task():
        calls.append(1)
        return kernel.task()

    for _ in range(3):
        assert tun.select(KEY, ARCH, autotune=True, task=task) == Cfg(64)
    assert len(calls) == 1
    tun.select({**KEY, "n": 2048}, ARCH, autotune=True, task=task)
    assert len(calls) == 2


def test_autotune_without_task_raises(tmp_path):
    tun = make_tunable(tmp_path)
    with pytest.raises(TuningError, match="no search task"):
        tun.select(KEY, ARCH, autotune=True)


# ---------------------------------------------------------------------------
# search rules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidate_us", "winner"),
    [
        (98.5, DEFAULT),  # 1.5% faster: inside the tie, the default stays
        (95.0, Cfg(64)),  # 5% faster: a real win
    ],
)
def test_tie_rule_favours_default(tmp_path, candidate_us, winner):
    tun = make_tunable(tmp_path, candidates=[Cfg(64)])
    kernel = FakeKernel({DEFAULT: 100.0, Cfg(64): candidate_us})
    result = tun.search(KEY, ARCH, kernel.task(), persist=False)
    assert result.config == winner
    assert result.default_time_us == 100.0
    assert result.time_us == (100.0 if winner == DEFAULT else candidate_us)
    assert dict(result.timings) == {DEFAULT: 100.0, Cfg(64): candidate_us}


@pytest.mark.parametrize(
    "bad_output",
    [
        lambda x: (x * 2.5, x.sum()),  # wrong values
        lambda x: (x * 2, x.sum() + float("nan")),  # NaN
        lambda x: (torch.full_like(x, float("inf")), x.sum()),  # inf
        lambda x: (x[:-1] * 2, x.sum()),  # shape mismatch
        lambda x: x * 2,  # wrong structure
    ],
    ids=["values", "nan", "inf", "shape", "structure"],
)
def test_wrong_candidate_is_dropped_and_never_timed(tmp_path, bad_output):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(256): 9.0, Cfg(512): 9.5}, wrong={Cfg(64)}, bad_output=bad_output)
    result = tun.search(KEY, ARCH, kernel.task(), persist=False)
    assert result.config == Cfg(256)
    assert Cfg(64) in kernel.ran
    assert Cfg(64) not in kernel.timed
    assert [c for c, _ in result.rejected] == [Cfg(64)]
    assert Cfg(64) not in dict(result.timings)


def test_view_maps_outputs_and_reference_outside_the_timed_calls(tmp_path):
    """With ``view`` the comparison is on view(output) vs view(reference); the timed callable is run alone."""
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(256): 9.0, Cfg(512): 9.5}, wrong={Cfg(64)})
    viewed, timed_outputs = [], []

    def view(out):  # the second element's sum drops out: only x * 2 is compared
        viewed.append(out)
        return out[0] + 1.0

    def bench(fn):
        timed_outputs.append(fn())
        return kernel.times[kernel.ran[-1]]

    task = SearchTask(run=kernel.run, reference=kernel.reference, rtol=1e-6, bench=bench, view=view)
    result = tun.search(KEY, ARCH, task, persist=False)
    assert result.config == Cfg(256)
    assert [c for c, _ in result.rejected] == [Cfg(64)]  # wrong after the view too
    assert len(viewed) == 1 + len(kernel.ran) - len(timed_outputs)  # the reference + each checked run
    assert all(isinstance(o, tuple) for o in timed_outputs)  # timing saw run's raw output, never the view


def test_wrong_candidate_would_have_been_fastest(tmp_path, caplog):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 0.1, Cfg(256): 9.0, Cfg(512): 9.5}, wrong={Cfg(64)})
    with caplog.at_level("WARNING", logger="flydsl"):
        result = tun.search(KEY, ARCH, kernel.task(), persist=False)
    assert result.config == Cfg(256)
    assert "relative error" in dict(result.rejected)[Cfg(64)]
    assert any("rejected" in r.getMessage() and "block=64" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 26])
def test_check_in_chunks_matches_the_whole_output(monkeypatch, chunk):
    """The candidate check widens to float64 a chunk at a time (a huge output would not fit the GPU twice
    over): the relative error is the whole output's, and a NaN in any chunk, the last one too, rejects."""
    from flydsl.autotune import tuner

    monkeypatch.setattr(tuner, "_CHECK_CHUNK", chunk)
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    ref = torch.randn(5, 31, generator=gen, dtype=torch.float64)
    out = (ref + 1e-3 * torch.randn(5, 31, generator=gen, dtype=torch.float64)).t()  # strided, not contiguous
    ref = ref.t()
    err = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
    assert tuner._mismatch(out, ref, err * 1.0001) is None
    reason = tuner._mismatch(out, ref, err * 0.999)
    assert reason is not None and f"{err:.3g}" in reason
    out = out.clone()
    out[-1, -1] = float("nan")
    assert tuner._mismatch(out, ref, 1.0) == "output 0 has NaN or inf"


def test_raising_candidate_is_dropped(tmp_path):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 9.0, Cfg(256): 9.5}, raising={Cfg(512)})
    result = tun.search(KEY, ARCH, kernel.task(), persist=False)
    assert result.config == Cfg(64)
    assert "RuntimeError: out of shared memory" in dict(result.rejected)[Cfg(512)]
    assert Cfg(512) not in kernel.timed


def test_all_wrong_raises_with_reasons(tmp_path):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({}, wrong={DEFAULT, Cfg(64), Cfg(256)}, raising={Cfg(512)})
    with pytest.raises(TuningError) as info:
        tun.search(KEY, ARCH, kernel.task(), persist=False)
    message = str(info.value)
    assert "block=64" in message and "relative error" in message and "out of shared memory" in message
    assert kernel.timed == []
    # Nothing was cached by the failed search.
    assert not LocalCache().path("toy_fwd", ARCH, KEY).exists()


def test_invalid_candidates_are_pruned_and_never_run(tmp_path):
    candidates = [Cfg(64), Cfg(2048), Cfg(64), DEFAULT, Cfg(4096), Cfg(256)]
    tun = make_tunable(tmp_path, candidates=candidates)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 9.0, Cfg(256): 8.0})
    result = tun.search(KEY, ARCH, kernel.task(), persist=False)
    # Default first, duplicates dropped, invalid ones (block > 1024) never run.
    assert list(dict.fromkeys(kernel.ran)) == [DEFAULT, Cfg(64), Cfg(256)]
    assert result.config == Cfg(256)


def test_max_candidates_keeps_default(tmp_path):
    candidates = [Cfg(b) for b in (16, 32, 64, 256, 512)]
    tun = make_tunable(tmp_path, candidates=candidates, max_candidates=3)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(16): 9.0, Cfg(32): 8.0})
    tun.search(KEY, ARCH, kernel.task(), persist=False)
    assert list(dict.fromkeys(kernel.ran)) == [DEFAULT, Cfg(16), Cfg(32)]


def test_prepare_runs_before_each_candidate(tmp_path):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 9.0, Cfg(256): 8.0, Cfg(512): 7.0})
    events = []
    original_run = kernel.run
    kernel.run = lambda cfg: (events.append(("run", cfg)), original_run(cfg))[1]
    tun.search(KEY, ARCH, kernel.task(prepare=lambda: events.append(("prepare", None))), persist=False)
    # Each checked run is directly preceded by a prepare (timed runs follow the checked run).
    checked = [i for i, e in enumerate(events) if e[0] == "run" and (i == 0 or events[i - 1][0] == "prepare")]
    assert len(checked) == 4
    assert sum(e[0] == "prepare" for e in events) == 4


def test_search_persists_winner_with_identity(tmp_path):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 5.0, Cfg(256): 9.0, Cfg(512): 11.0})
    tun.search(KEY, ARCH, kernel.task())
    path = LocalCache().path("toy_fwd", ARCH, KEY)
    assert path.parent == tmp_path / "cache" / "tuning" / "toy_fwd" / ARCH
    entry = json.loads(path.read_text())
    assert entry["schema"] == SCHEMA_VERSION
    assert entry["config"] == {"block": 64, "warps": 4}
    assert entry["time_us"] == 5.0 and entry["default_time_us"] == 10.0 and entry["candidates"] == 4
    for field in ("device_name", "triton", "torch", "flydsl"):
        assert entry[field] == identity(ARCH)[field]


def test_search_without_persist_leaves_no_trace(tmp_path):
    tun = make_tunable(tmp_path)
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 5.0, Cfg(256): 9.0, Cfg(512): 11.0})
    tun.search(KEY, ARCH, kernel.task(), persist=False)
    assert not (tmp_path / "cache").exists()
    assert tun.explain(KEY, ARCH) == (DEFAULT, "default")


# ---------------------------------------------------------------------------
# stored configs that must be ignored
# ---------------------------------------------------------------------------


def test_artifact_config_failing_is_valid_is_ignored(tmp_path):
    write_toy_artifact(tmp_path, {"block": 4096, "warps": 4})
    tun = make_tunable(tmp_path)
    with pytest.warns(TuningWarning, match="validity"):
        assert tun.explain(KEY, ARCH) == (DEFAULT, "default")


def test_artifact_config_of_another_shape_is_ignored(tmp_path, recwarn):
    write_toy_artifact(tmp_path, {"block": 64, "stages": 3})  # a field Cfg does not have
    tun = make_tunable(tmp_path)
    for _ in range(3):
        tun.clear_memo()
        assert tun.select(KEY, ARCH) == DEFAULT
    assert "does not build a Cfg" in one_tuning_warning(recwarn)


def test_cached_config_failing_is_valid_falls_through_to_artifact(tmp_path):
    write_toy_artifact(tmp_path, {"block": 256, "warps": 4})
    save_toy_cache({"block": 8192, "warps": 4})
    with pytest.warns(TuningWarning):
        assert make_tunable(tmp_path).explain(KEY, ARCH) == (Cfg(256), "artifact")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"schema": 1, "name": "toy_fwd", "entries": [', "not valid JSON"),
        (json.dumps({"schema": 99, "name": "toy_fwd", "entries": []}), "schema"),
        (json.dumps({"schema": 1, "name": "other_op", "entries": []}), "artifact name"),
        (json.dumps([1, 2, 3]), "not a JSON object"),
    ],
    ids=["corrupt", "schema", "name", "not-object"],
)
def test_bad_artifact_file_ignored_with_one_warning(tmp_path, recwarn, text, reason):
    path = tmp_path / "artifacts" / "toy_fwd.json"
    path.parent.mkdir()
    path.write_text(text)
    art = ArtifactFile(path, "toy_fwd")
    for _ in range(5):
        assert art.lookup(ARCH, KEY) is None
    # Another reader of the same file (another tunable) does not warn again.
    assert ArtifactFile(path, "toy_fwd").lookup(ARCH, KEY) is None
    tun = make_tunable(tmp_path)
    for _ in range(3):
        tun.clear_memo()
        assert tun.select(KEY, ARCH) == DEFAULT
    assert reason in one_tuning_warning(recwarn)


def test_malformed_entry_skipped_others_served(tmp_path, recwarn):
    path = tmp_path / "artifacts" / "toy_fwd.json"
    good = {"arch": ARCH, "key": KEY, "config": {"block": 256, "warps": 4}, "time_us": 3.0}
    bad = [{"arch": ARCH, "key": "n=1024", "config": {}}, {"arch": ARCH, "key": KEY}, "junk"]
    atomic_write_json(path, {"schema": 1, "name": "toy_fwd", "entries": [*bad, good]})
    art = ArtifactFile(path, "toy_fwd")
    for _ in range(3):
        assert art.lookup(ARCH, KEY) == {"block": 256, "warps": 4}
    assert "3 malformed" in one_tuning_warning(recwarn)


def test_missing_artifact_is_silent(tmp_path, recwarn):
    assert ArtifactFile(tmp_path / "nope.json", "toy_fwd").lookup(ARCH, KEY) is None
    assert make_tunable(tmp_path).select(KEY, ARCH) == DEFAULT
    assert not [w for w in recwarn if issubclass(w.category, TuningWarning)]


def test_corrupt_cache_file_ignored_with_one_warning(tmp_path, recwarn):
    path = LocalCache().path("toy_fwd", ARCH, KEY)
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": 1, "config": {"blo')
    for _ in range(5):
        assert LocalCache().load("toy_fwd", ARCH, KEY) is None
    tun = make_tunable(tmp_path)
    assert tun.select(KEY, ARCH) == DEFAULT
    assert "not valid JSON" in one_tuning_warning(recwarn)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("triton", "2.0.0", "triton"),
        ("device_name", "NVIDIA Other GPU", "device_name"),
        ("key", {"n": 1, "dtype": "fp32"}, "key"),  # a hash collision
        ("name", "other_op", "expected"),
        ("schema", 0, "schema"),
    ],
)
def test_mismatched_cache_entry_ignored(tmp_path, recwarn, field, value, reason):
    path = save_toy_cache({"block": 64, "warps": 4})
    entry = json.loads(path.read_text())
    entry[field] = value
    path.write_text(json.dumps(entry))
    for _ in range(3):
        assert LocalCache().load("toy_fwd", ARCH, KEY) is None
    assert make_tunable(tmp_path).explain(KEY, ARCH) == (DEFAULT, "default")
    assert reason in one_tuning_warning(recwarn)


def test_cache_round_trip_restores_tuples(tmp_path):
    @dataclass(frozen=True)
    class TileCfg:
        tile: tuple[int, int]
        split: bool = False

    tun = Tunable(
        "tile_op",
        TileCfg,
        default=lambda key, arch: TileCfg((64, 64)),
        candidates=lambda key, arch: [],
        is_valid=lambda cfg, key, arch: isinstance(cfg.tile, tuple),
    )
    LocalCache().save("tile_op", ARCH, KEY, TileCfg((128, 32), True), time_us=1.0, default_time_us=None, candidates=1)
    assert tun.explain(KEY, ARCH) == (TileCfg((128, 32), True), "cache")


# ---------------------------------------------------------------------------
# stores
# ---------------------------------------------------------------------------


def test_key_string_is_canonical():
    assert key_string({"n": 4096, "dtype": "bf16", "flag": True, "eps": None}) == (
        '{"dtype":"bf16","eps":null,"flag":true,"n":4096}'
    )
    assert key_string({"b": 1, "a": 2}) == key_string({"a": 2, "b": 1})
    with pytest.raises(ValueError):
        key_string({"x": float("nan")})


def test_local_cache_paths_stay_under_root(tmp_path):
    cache = LocalCache(tmp_path / "root")
    for name, arch in [("../evil", ARCH), ("toy_fwd", "sm_90/.."), ("..", "."), ("toy_fwd", "gfx942:sramecc+:xnack-")]:
        path = cache.path(name, arch, KEY)
        assert path.parent.parent.parent == tmp_path / "root", path
        assert path.resolve().is_relative_to((tmp_path / "root").resolve())
    with pytest.raises(ValueError):
        cache.path("", ARCH, KEY)
    # Two arches sharing a folder name do not serve each other's entries.
    cache.save("toy_fwd", "gfx942:xnack-", KEY, {"block": 64}, time_us=1.0, default_time_us=None, candidates=1)
    with pytest.warns(TuningWarning, match="expected"):
        assert cache.load("toy_fwd", "gfx942_xnack-", KEY) is None
    assert cache.load("toy_fwd", "gfx942:xnack-", KEY) == {"block": 64}


def test_local_cache_root_follows_env(tmp_path, monkeypatch):
    cache = LocalCache()
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache.path("toy_fwd", ARCH, KEY).is_relative_to(tmp_path / "elsewhere" / "tuning")
    assert LocalCache(tmp_path / "fixed").path("toy_fwd", ARCH, KEY).is_relative_to(tmp_path / "fixed")


def test_atomic_write_failure_keeps_old_file(tmp_path):
    path = tmp_path / "sub" / "f.json"
    atomic_write_json(path, {"ok": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"ok": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_write_artifact_merges_and_sorts(tmp_path):
    path = tmp_path / "a.json"

    def entry(arch, n, block):
        return {"arch": arch, "key": {"n": n}, "config": {"block": block}, "time_us": 1.0, "default_time_us": None}

    write_artifact(path, "toy_fwd", [entry("sm_90", 4096, 1), entry("sm_80", 64, 2)])
    write_artifact(path, "toy_fwd", [entry("sm_90", 1024, 3), entry("sm_90", 4096, 4)])
    text = path.read_text()
    data = json.loads(text)
    assert data["schema"] == SCHEMA_VERSION and data["name"] == "toy_fwd"
    got = [(e["arch"], e["key"]["n"], e["config"]["block"]) for e in data["entries"]]
    # Sorted by (arch, key string): "1024" < "4096"; the sm_90/4096 entry was replaced.
    assert got == [("sm_80", 64, 2), ("sm_90", 1024, 3), ("sm_90", 4096, 4)]
    assert text.startswith('{\n "schema": 1')  # indent=1
    assert ArtifactFile(path, "toy_fwd").lookup("sm_90", {"n": 4096}) == {"block": 4}
    with pytest.raises(TuningError, match="refusing"):
        write_artifact(path, "other_op", [entry("sm_90", 1, 1)])
    with pytest.raises(ValueError):
        write_artifact(path, "toy_fwd", [{"arch": "sm_90", "config": {}}])


def test_write_artifact_replaces_corrupt_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("{not json")
    with pytest.warns(TuningWarning, match="replacing"):
        write_artifact(path, "toy_fwd", [{"arch": ARCH, "key": KEY, "config": {"block": 8}}])
    assert ArtifactFile(path, "toy_fwd").lookup(ARCH, KEY) == {"block": 8}


def test_tune_artifact_writes_what_select_serves(tmp_path):
    kernels = {}

    def make_task(key, device):
        kernels[key["n"]] = kernel = FakeKernel(
            {DEFAULT: 10.0, Cfg(64): 5.0 if key["n"] == 1024 else 12.0, Cfg(256): 9.9, Cfg(512): 11.0}
        )
        return kernel.task()

    tun = make_tunable(tmp_path, make_task=make_task, tune_keys=lambda arch: [KEY, {**KEY, "n": 2048}])
    path = tune_artifact(tun, None, ARCH, "cpu", progress=False)
    assert path == tmp_path / "artifacts" / "toy_fwd.json"
    assert set(kernels) == {1024, 2048}
    entries = json.loads(path.read_text())["entries"]
    assert [e["config"] for e in entries] == [{"block": 64, "warps": 4}, {"block": 128, "warps": 4}]
    for e in entries:
        assert {"arch", "device_name", "triton", "torch", "key", "config", "time_us", "default_time_us"} <= set(e)
    assert tun.explain(KEY, ARCH) == (Cfg(64), "artifact")
    assert not (tmp_path / "cache").exists()  # offline tuning does not touch the local cache


def test_narrowed_searches_the_new_candidates_against_the_shipped_entry(tmp_path):
    """``narrowed(t, {"warps": 8})``: a key with an artifact entry searches the default, that entry and the
    candidates with 8 warps (a new part of the space), and keeps the entry when none beats it; a key without
    an entry searches the whole space; the winner is merged into the artifact."""
    space = [Cfg(64), Cfg(256), Cfg(512), Cfg(64, 8), Cfg(256, 8)]
    timed = {}

    def make_task(key, device):
        times = {DEFAULT: 10.0, Cfg(64): 8.0, Cfg(256): 7.0, Cfg(512): 9.0, Cfg(64, 8): 7.5,
                 Cfg(256, 8): 6.0 if key["n"] == 2048 else 7.2}
        timed[key["n"]] = kernel = FakeKernel(times)
        return kernel.task()

    other = {**KEY, "n": 2048}
    tun = make_tunable(tmp_path, candidates=space, make_task=make_task)
    write_toy_artifact(tmp_path, {"block": 256, "warps": 4})
    write_artifact(tmp_path / "artifacts" / "toy_fwd.json", "toy_fwd",
                   [{"arch": ARCH, "key": other, "config": {"block": 256, "warps": 4}, "time_us": 7.0}])
    third = {**KEY, "n": 4096}  # no entry: the whole space
    tune_artifact(narrowed(tun, {"warps": 8}), [KEY, other, third], ARCH, "cpu", progress=False)
    assert set(timed[1024].timed) == {DEFAULT, Cfg(256), Cfg(64, 8), Cfg(256, 8)}
    assert set(timed[4096].timed) == {DEFAULT, *space}
    fresh = make_tunable(tmp_path, candidates=space)
    assert fresh.explain(KEY, ARCH) == (Cfg(256), "artifact")  # 7.0 held against 7.2 and 7.5
    assert fresh.explain(other, ARCH) == (Cfg(256, 8), "artifact")  # the new candidate won: 6.0
    assert fresh.explain(third, ARCH) == (Cfg(256), "artifact")  # the whole space's fastest


def test_narrowed_lists_an_entry_that_holds_the_filter_once(tmp_path):
    """The key's entry is searched once, also when it is one of the filtered candidates."""
    write_toy_artifact(tmp_path, {"block": 256, "warps": 8})
    tun = narrowed(make_tunable(tmp_path, candidates=[Cfg(64, 8), Cfg(256, 8), Cfg(512)]), {"warps": 8})
    assert tun.candidates(KEY, ARCH) == [Cfg(256, 8), Cfg(64, 8)]


@pytest.mark.parametrize("where, match", [({}, "non-empty"), ({"tiles": 2}, "tiles not a field of Cfg"),
                                           ([1], "non-empty object")])
def test_narrowed_names_a_bad_filter(tmp_path, where, match):
    with pytest.raises(TuningError, match=match):
        narrowed(make_tunable(tmp_path), where)


def test_tune_artifact_needs_make_task(tmp_path):
    with pytest.raises(TuningError, match="make_task"):
        tune_artifact(make_tunable(tmp_path), [KEY], ARCH, "cpu")


def test_no_pickle_in_autotune_sources():
    import flydsl.autotune

    package = Path(flydsl.autotune.__file__).parent
    sources = sorted(package.glob("*.py"))
    assert sources
    for source in sources:
        text = source.read_text()
        for word in ("pickle", "marshal", "shelve", "eval("):
            assert word not in text, (source, word)


def test_import_pulls_in_neither_triton_nor_torch(tmp_path):
    code = "import sys, flydsl.autotune; assert 'triton' not in sys.modules and 'torch' not in sys.modules"
    src = Path(__import__("flydsl").__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(src), "FLYDSL_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)


# ---------------------------------------------------------------------------
# concurrent writers
# ---------------------------------------------------------------------------

# The worker runs as source through the builtin exec, so a spawned child never
# imports this test module (which would pull in torch, and depends on pytest's
# import mode). LocalCache.save probes the device name, which imports torch:
# seconds per child on a 2-core CI machine, so the children reuse the parent's
# identity instead. Odd writers go through save(), even ones write the same
# entry with atomic_write_json directly.
_WRITER = """
from flydsl.autotune import LocalCache, atomic_write_json, store
store._process_identity = lambda: IDENT
cache = LocalCache(ROOT)
path = cache.path("toy_fwd", "sm_90", {"n": 1})
for i in range(ROUNDS):
    config = {"writer": WID, "round": i, "pad": "x" * (97 * ((WID * 31 + i) % 40))}
    if WID % 2:
        cache.save("toy_fwd", "sm_90", {"n": 1}, config, time_us=1.0, default_time_us=None, candidates=1)
    else:
        atomic_write_json(path, {**ENTRY, "config": config})
"""
ROUNDS = 100


def test_concurrent_writers_never_expose_half_files(tmp_path, monkeypatch):
    # Children skip the GPU probe (a torch import) when the backend is forced.
    monkeypatch.setenv("FLYDSL_INTERPRET", "1")
    root = tmp_path / "tuning"
    cache = LocalCache(root)
    path = cache.save("toy_fwd", "sm_90", {"n": 1}, {"writer": -1}, time_us=1.0, default_time_us=None, candidates=1)
    entry = json.loads(path.read_text())
    ident = tuple(identity("sm_90")[k] for k in ("device_name", "triton", "torch", "flydsl"))
    ctx = multiprocessing.get_context("spawn")
    shared = {"ROOT": str(root), "ENTRY": entry, "IDENT": ident, "ROUNDS": ROUNDS}
    workers = [ctx.Process(target=exec, args=(_WRITER, {**shared, "WID": w})) for w in range(4)]
    for w in workers:
        w.start()
    reads = 0
    deadline = time.monotonic() + 60
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)  # a torn or foreign file would warn in load()
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            json.loads(path.read_text())  # raises on a torn file
            assert cache.load("toy_fwd", "sm_90", {"n": 1}) is not None
            reads += 1
            time.sleep(0.0002)  # leave the writers some CPU on small machines
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0
    assert reads > 0
    final = cache.load("toy_fwd", "sm_90", {"n": 1})
    assert final["writer"] in range(4) and final["round"] == ROUNDS - 1
    # No temporary files left behind.
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_precompile_skips_a_tunable_no_family_registers(tmp_path):
    """Workers find the tunable through its family's entry point: one that none registers compiles during the
    search, and tune_artifact's result is the same with jobs as without."""
    kernel = FakeKernel({DEFAULT: 10.0, Cfg(64): 5.0, Cfg(256): 9.9, Cfg(512): 11.0})
    tun = make_tunable(tmp_path, make_task=lambda key, device: kernel.task(), tune_keys=lambda arch: [KEY])
    assert precompile(tun, [KEY], ARCH, "cpu", jobs=4) == 0
    path = tune_artifact(tun, None, ARCH, "cpu", progress=False, jobs=4)
    assert [e["config"] for e in json.loads(path.read_text())["entries"]] == [{"block": 64, "warps": 4}]


def test_compile_worker_runs_each_candidate_once_building_a_task_a_key(tmp_path, monkeypatch):
    """A worker's share: every (key, candidate) run once, one task built per key (its operands freed before
    the next), a candidate that raises counted, not fatal."""
    import flydsl.families
    from flydsl.autotune import tuner

    built, ran = [], []

    def make_task(key, device):
        built.append(key["n"])

        def run(cfg):
            ran.append((key["n"], cfg.block))
            if cfg.block == 256:
                raise RuntimeError("out of shared memory")
            return torch.zeros(1)

        return SearchTask(run=run, reference=lambda: torch.zeros(1), rtol=0.0)

    tun = make_tunable(tmp_path, make_task=make_task)
    fam = flydsl.families.Family("toy", "toy", "toy", "0", tunables=lambda: [tun])
    monkeypatch.setattr(flydsl.families, "discover", lambda: {"toy": fam})
    assert tuner._find_tunable("toy_fwd") == ("toy", tun)
    keys = [KEY, {**KEY, "n": 2048}]
    items = [(k, dataclasses.asdict(c)) for k in keys for c in tun._candidate_list(k, ARCH)]
    assert tuner._compile_worker("toy", "toy_fwd", ARCH, "cpu", items) == 2  # Cfg(256) of each key
    assert built == [1024, 2048]
    assert ran == [(n, b) for n in (1024, 2048) for b in (128, 64, 256, 512)]
