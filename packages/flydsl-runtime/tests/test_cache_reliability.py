"""The compile cache and the tuning stores under real use: concurrency, damage, read-only folders, planted code.

Compiled-kernel scenarios run in child processes that choose compiled Triton
(``FLYDSL_INTERPRET=0``) and compile for sm_90 with Triton's bundled ptxas,
so they go through Triton's real cache on a machine without a GPU; the
children run ``cache_worker.py``. Tuning-store scenarios run in this process.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import random
import shutil
import stat
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flydsl import cache
from flydsl.autotune import (
    SCHEMA_VERSION,
    ArtifactFile,
    LocalCache,
    SearchTask,
    Tunable,
    TuningWarning,
    identity,
    write_artifact,
)
from flydsl.autotune import store as store_module

WORKER = Path(__file__).with_name("cache_worker.py")
ARCH = "sm_90"
KEY = {"n": 1024, "dtype": "fp32"}
CHECKED = "flydsl.cache:CheckedCacheManager"
TRITON_OWN = "triton.runtime.cache:FileCacheManager"  # Triton's own manager, named (flydsl installs its own)

# The child runs this through the builtin exec (spawn pickles builtins by name), so it never imports this
# test module; it sets its environment first, then runs one role of cache_worker.py.
_BOOT = """
import os, runpy
for k in DROP:
    os.environ.pop(k, None)
os.environ.update(ENV)
runpy.run_path(SCRIPT)[ROLE](**PARAMS)
"""


def _child_env(root: Path, tmp: Path, **extra: str) -> dict[str, str]:
    return {
        "FLYDSL_INTERPRET": "0", "TRITON_INTERPRET": "0", "FLYDSL_CACHE_DIR": str(root), "TMPDIR": str(tmp),
        "FLYDSL_PROGRESS": "0", **extra,
    }  # fmt: skip


def _spawn(role: str, params: dict, env: dict, drop=("TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER")):
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=exec, args=(_BOOT, {"ROLE": role, "PARAMS": params, "ENV": env, "DROP": drop, "SCRIPT": str(WORKER)})
    )
    proc.start()
    return proc


def _join_all(procs, deadline_s: float) -> list[int | None]:
    """Exit codes; a process still running at the deadline is killed and reported as None (a hang)."""
    end = time.monotonic() + deadline_s
    codes = []
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)
            codes.append(None)
        else:
            codes.append(proc.exitcode)
    return codes


def _run_one(role: str, params: dict, env: dict, deadline_s: float = 240, **kw) -> None:
    code = _join_all([_spawn(role, params, env, **kw)], deadline_s)[0]
    assert code == 0, f"{role} child ended with {code} (None: still running at the {deadline_s} s deadline)"


def _compiles_for_sm90() -> str | None:
    """None when this machine's Triton can compile for sm_90 (bundled ptxas), else why not."""
    probe = "from triton import knobs; print(knobs.nvidia.ptxas.path)"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    return None if res.returncode == 0 else (res.stderr.strip().splitlines() or ["?"])[-1]


needs_sm90_compiler = pytest.mark.skipif(
    _compiles_for_sm90() is not None, reason="Triton here cannot compile for sm_90 (no bundled ptxas)"
)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLYDSL_PROGRESS", "0")
    monkeypatch.delenv("FLYDSL_AUTOTUNE", raising=False)
    monkeypatch.delenv("FLYDSL_USE_ARTIFACTS", raising=False)
    # Warnings are once per file and process; each test starts with none given.
    monkeypatch.setattr(cache, "_warned", set())


def _triton_entries(folder: Path) -> dict[str, dict]:
    """{entry folder name: its group} for every compiled kernel under ``folder``; asserts each is whole."""
    groups = {}
    for entry in sorted(p for p in folder.iterdir() if p.is_dir()):
        names = sorted(p.name for p in entry.iterdir())
        assert not [n for n in names if n.startswith("tmp.")], f"{entry}: a write was left half done: {names}"
        grp = [n for n in names if n.startswith("__grp__")]
        assert len(grp) == 1, f"{entry}: {names}"
        group = json.loads((entry / grp[0]).read_text())["child_paths"]
        meta = grp[0][len("__grp__") :]
        problem = cache.check_kernel_group(entry, group, meta)
        assert problem is None, (entry, problem)
        groups[entry.name] = group
    return groups


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


# ---------------------------------------------------------------------------
# 8 processes on one cache root
# ---------------------------------------------------------------------------

WORKERS = 8
ROUNDS = 12
SHARED_VARIANTS = [["scale", 1.0, 64], ["axpy", 2.0, 128]]


def _own_variant(wid: int) -> list:
    return ["scale" if wid % 2 else "axpy", float(wid + 3), 256]


@needs_sm90_compiler
def test_eight_processes_share_one_cache_root(tmp_path):
    """8 spawned processes compile the same and their own kernels into one FLYDSL_CACHE_DIR (Triton's default
    manager, as FlyDSL configures it today), save and load the same and their own tuning entries, and merge
    their own entries into one artifact: every process finishes, nothing is torn, nothing is lost."""
    root, artifact = tmp_path / "cache", tmp_path / "artifacts" / "toy.json"
    env = _child_env(root, tmp_path)
    procs = [
        _spawn(
            "concurrent",
            {
                "wid": w,
                "variants": SHARED_VARIANTS + [_own_variant(w)],
                "rounds": ROUNDS,
                "artifact": str(artifact),
                "out": str(tmp_path / f"worker{w}.json"),
            },
            env,
        )  # fmt: skip
        for w in range(WORKERS)
    ]
    codes = _join_all(procs, deadline_s=300)
    assert codes == [0] * WORKERS, f"exit codes {codes} (None: still running at the deadline, a deadlock)"

    # compiled kernels: whole entries, one per distinct specialization, the same binary for the same kernel
    results = [json.loads((tmp_path / f"worker{w}.json").read_text())["compiled"] for w in range(WORKERS)]
    groups = _triton_entries(root / "triton")
    distinct = {json.dumps(v) for v in SHARED_VARIANTS} | {json.dumps(_own_variant(w)) for w in range(WORKERS)}
    assert len(groups) == len(distinct)
    for variant in distinct:
        prints = {json.dumps(r[variant]) for r in results if variant in r}
        assert len(prints) == 1, (variant, prints)

    # tuning: every worker's own entries, the shared entry whole, no temporary file left
    store = LocalCache(root / "tuning")
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)
        for w in range(WORKERS):
            for i in range(ROUNDS):
                key = {"op": "own", "worker": w, "round": i}
                assert store.load("toy", ARCH, key) == {"worker": w, "round": i}
        shared = store.load("toy", ARCH, {"op": "shared", "n": 4096})
        assert shared["worker"] in range(WORKERS) and shared["round"] == ROUNDS - 1
        art = json.loads(artifact.read_text())
        assert art["schema"] == SCHEMA_VERSION and len(art["entries"]) == WORKERS * ROUNDS
        reader = ArtifactFile(artifact, "toy")
        for w in range(WORKERS):
            for i in range(ROUNDS):
                assert reader.lookup(ARCH, {"op": "own", "worker": w, "round": i}) == {"worker": w, "round": i}
    leftovers = [p for p in tmp_path.rglob("*.tmp")]
    assert leftovers == []

    # A fresh process (the checked manager, which re-verifies every entry) finds every kernel in the cache:
    # nothing recompiled, nothing rewritten.
    before = _tree(root / "triton")
    out = tmp_path / "verify.json"
    _run_one("compile_all", {"variants": [json.loads(v) for v in sorted(distinct)], "out": str(out)},
             _child_env(root, tmp_path, TRITON_CACHE_MANAGER=CHECKED))  # fmt: skip
    verify = json.loads(out.read_text())
    assert verify["warnings"] == []
    assert _tree(root / "triton") == before
    for variant, fingerprint in verify["compiled"].items():
        assert any(r.get(variant) == fingerprint for r in results), variant


def test_concurrent_artifact_writers_lose_no_entry(tmp_path):
    """write_artifact is a read-merge-write: two processes merging at once used to drop each other's entries.
    Interpreter-mode children (no compile), many small merges each."""
    artifact = tmp_path / "artifacts" / "toy.json"
    code = """
import sys
from pathlib import Path
from flydsl.autotune import write_artifact
w, path = int(sys.argv[1]), Path(sys.argv[2])
for i in range(40):
    write_artifact(path, "toy", [{"arch": "sm_90", "key": {"w": w, "i": i}, "config": {"w": w}, "time_us": 1.0}])
"""
    env = {**os.environ, "FLYDSL_INTERPRET": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(w), str(artifact)], env=env) for w in range(WORKERS)]
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0] * WORKERS
    entries = json.loads(artifact.read_text())["entries"]
    want = [(w, i) for w in range(WORKERS) for i in range(40)]
    assert sorted((e["key"]["w"], e["key"]["i"]) for e in entries) == want
    assert [p.name for p in artifact.parent.iterdir()] == ["toy.json"]  # no lock or temporary file left


# ---------------------------------------------------------------------------
# damaged tuning files: detected, ignored with one warning, rebuilt by the next save
# ---------------------------------------------------------------------------


class _Planted:
    """Unpickling this runs code (touches a marker file): a store that unpickled would be caught by it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _damage(good: bytes, how: str, *, valid: dict, marker: Path) -> bytes:
    if how == "truncated":
        return good[: len(good) // 2]
    if how == "random":
        return random.Random(40).randbytes(len(good))
    if how == "wrong-schema":  # valid JSON, wrong shape
        return json.dumps({k: v for k, v in valid.items() if k not in ("config", "entries")}).encode()
    if how == "wrong-version":
        return json.dumps({**valid, "schema": SCHEMA_VERSION + 1}).encode()
    if how == "stale-triton":
        return json.dumps({**valid, "triton": "0.0.0"}).encode()
    if how == "pickle":
        return pickle.dumps(_Planted(marker))
    raise ValueError(how)


DAMAGES = ["truncated", "random", "wrong-schema", "wrong-version", "pickle"]


@dataclass(frozen=True)
class Cfg:
    block: int
    warps: int = 4


def _tunable(tmp_path, **kw) -> Tunable:
    return Tunable(
        "toy", Cfg, default=lambda key, arch: Cfg(128), candidates=lambda key, arch: [Cfg(64), Cfg(256)],
        is_valid=lambda cfg, key, arch: True, artifact_dir=tmp_path / "artifacts", **kw,
    )  # fmt: skip


def _ours(record, category=TuningWarning) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, category)]


@pytest.mark.parametrize("how", [*DAMAGES, "stale-triton"])
def test_damaged_local_cache_entry(tmp_path, recwarn, how):
    store = LocalCache()
    path = store.save("toy", ARCH, KEY, {"block": 64, "warps": 4}, time_us=1.0, default_time_us=2.0, candidates=2)
    marker = tmp_path / "unpickled"
    path.write_bytes(_damage(path.read_bytes(), how, valid=json.loads(path.read_text()), marker=marker))
    for _ in range(3):
        assert store.load("toy", ARCH, KEY) is None
    tun = _tunable(tmp_path)
    assert tun.explain(KEY, ARCH) == (Cfg(128), "default")
    assert len(_ours(recwarn)) == 1, _ours(recwarn)
    assert str(path) in _ours(recwarn)[0]
    assert not marker.exists()
    # The next save rebuilds the file; it serves at once, with no further warning.
    store.save("toy", ARCH, KEY, {"block": 256, "warps": 4}, time_us=1.0, default_time_us=2.0, candidates=2)
    assert json.loads(path.read_text())["config"] == {"block": 256, "warps": 4}
    assert store.load("toy", ARCH, KEY) == {"block": 256, "warps": 4}
    tun.clear_memo()
    assert tun.explain(KEY, ARCH) == (Cfg(256), "cache")
    assert len(_ours(recwarn)) == 1


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_artifact(tmp_path, recwarn, how):
    path = tmp_path / "artifacts" / "toy.json"
    entry = {"arch": ARCH, "key": KEY, "config": {"block": 64, "warps": 4}, "time_us": 1.0}
    write_artifact(path, "toy", [entry])
    marker = tmp_path / "unpickled"
    path.write_bytes(_damage(path.read_bytes(), how, valid=json.loads(path.read_text()), marker=marker))
    for _ in range(3):
        assert ArtifactFile(path, "toy").lookup(ARCH, KEY) is None
    assert _tunable(tmp_path).explain(KEY, ARCH) == (Cfg(128), "default")
    assert len(_ours(recwarn)) == 1, _ours(recwarn)
    assert not marker.exists()
    # Regenerating the artifact replaces the unusable file (saying so once) and it serves again.
    recwarn.clear()
    write_artifact(path, "toy", [{**entry, "config": {"block": 256, "warps": 4}}])
    assert len(_ours(recwarn)) == 1 and "replacing unusable" in _ours(recwarn)[0]
    assert json.loads(path.read_text())["entries"] == [{**entry, "config": {"block": 256, "warps": 4}}]
    assert ArtifactFile(path, "toy").lookup(ARCH, KEY) == {"block": 256, "warps": 4}


# ---------------------------------------------------------------------------
# damaged compiled kernels: a miss with one warning, recompiled and rewritten
# ---------------------------------------------------------------------------


@needs_sm90_compiler
def test_damaged_triton_cache_entries_are_recompiled(tmp_path):
    """Each file of a compiled entry (group index, metadata, cubin) truncated, overwritten with random bytes,
    replaced by valid JSON of the wrong shape (a group pointing outside its folder) or by a pickle payload:
    with the checked manager the next compile warns once, recompiles the same binary and rewrites the file;
    the payload never runs."""
    files = ["group", "metadata", "binary"]
    damages = ["truncated", "random", "schema", "pickle"]
    cases = [[["scale", float(1 + i), 64], which, how] for i, (which, how) in
             enumerate((w, d) for w in files for d in damages)]  # fmt: skip
    out, marker = tmp_path / "damage.json", tmp_path / "unpickled"
    _run_one("damage_and_recompile", {"cases": cases, "out": str(out), "marker": str(marker)},
             _child_env(tmp_path / "cache", tmp_path, TRITON_CACHE_MANAGER=CHECKED))  # fmt: skip
    results = json.loads(out.read_text())
    assert len(results) == len(cases)
    for r in results:
        assert r["before"] == r["after"] == r["again"], r["case"]
        assert len(r["warnings"]) == 1 and "recompiling" in r["warnings"][0], (r["case"], r["warnings"])
        assert r["rewritten"], r["case"]
    assert not marker.exists()
    _triton_entries(tmp_path / "cache" / "triton")


@needs_sm90_compiler
def test_triton_default_manager_crashes_on_a_damaged_entry(tmp_path):
    """Why the checked manager exists: Triton's own manager raises on a torn group file (and would hand a cut
    cubin to the driver). Kept as a record of Triton's behaviour; if it ever passes, Triton fixed it."""
    out = tmp_path / "damage.json"
    proc = _spawn("damage_and_recompile", {
        "cases": [[["scale", 1.0, 64], "group", "truncated"]], "out": str(out), "marker": str(tmp_path / "m"),
    }, _child_env(tmp_path / "cache", tmp_path, TRITON_CACHE_MANAGER=TRITON_OWN))  # fmt: skip
    assert _join_all([proc], 240) == [1]


def test_flydsl_installs_the_checked_manager(fresh_python):
    """In-process, through Triton's knob: the environment a child process inherits stays clean; a manager of
    the user's own (TRITON_CACHE_MANAGER) is left alone."""
    code = ("import os, flydsl, flydsl.compiler, triton; "
            "print(triton.knobs.cache.manager_class.__qualname__, os.environ.get('TRITON_CACHE_MANAGER'))")
    res = fresh_python(code, env_extra={"FLYDSL_INTERPRET": "1"}, env_drop=("TRITON_CACHE_MANAGER",))
    assert res.stdout.split() == ["CheckedCacheManager", "None"], res.stdout + res.stderr
    own = "triton.runtime.cache:FileCacheManager"
    res = fresh_python(code, env_extra={"FLYDSL_INTERPRET": "1", "TRITON_CACHE_MANAGER": own})
    assert res.stdout.split() == ["FileCacheManager", own], res.stdout + res.stderr


# ---------------------------------------------------------------------------
# read-only cache folders
# ---------------------------------------------------------------------------


def _read_only_roots(tmp_path) -> list[tuple[str, Path]]:
    """Cache roots that cannot be written: a file in place of the folder, and (unless chmod cannot stop
    this user, as for root) a folder with mode 0o555."""
    as_file = tmp_path / "cache-file"
    as_file.write_text("not a folder\n")
    roots = [("file", as_file)]
    locked = tmp_path / "cache-555"
    locked.mkdir()
    locked.chmod(0o555)
    if not os.access(locked, os.W_OK):
        roots.append(("chmod-555", locked))
    return roots


@pytest.fixture
def read_only_roots(tmp_path):
    roots = _read_only_roots(tmp_path)
    yield roots
    for _, path in roots:
        if path.is_dir():
            path.chmod(0o755)


def test_read_only_cache_serves_tuning(tmp_path, monkeypatch, recwarn, caplog, read_only_roots):
    """Loads find nothing and say nothing; a search returns its winner and serves it for the rest of the
    process; the failed save is one log line, no exception."""
    for name, root in read_only_roots:
        monkeypatch.setenv("FLYDSL_CACHE_DIR", str(root))
        assert LocalCache().load("toy", ARCH, KEY) is None, name
        times = {Cfg(64): 3.0, Cfg(256): 1.0, Cfg(128): 2.0}
        last: list[Cfg] = []

        def run(cfg, last=last):
            last.append(cfg)
            return torch.ones(4)

        def bench(fn, last=last, times=times):
            fn()
            return times[last[-1]]

        task = SearchTask(run=run, reference=lambda: torch.ones(4, dtype=torch.float64), rtol=1e-6, bench=bench)
        tun = _tunable(tmp_path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flydsl"):
            result = tun.search(KEY, ARCH, task)
        assert result.config == Cfg(256), name
        assert tun.explain(KEY, ARCH) == (Cfg(256), "searched")
        assert len([r for r in caplog.records if "could not cache" in r.getMessage()]) == 1, name
        assert _ours(recwarn) == [], name
        assert not (root.is_dir() and any(root.iterdir())), name


def _compile_with_root(tmp_path, root: Path, **env_extra: str) -> dict:
    out = tmp_path / f"compile-{len(list(tmp_path.glob('compile-*')))}.json"
    _run_one("compile_all", {"variants": SHARED_VARIANTS, "out": str(out)},
             _child_env(root, tmp_path, **env_extra))  # fmt: skip
    return json.loads(out.read_text())


@needs_sm90_compiler
def test_read_only_cache_root_compiles_to_a_private_temp_folder(tmp_path, read_only_roots):
    for name, root in read_only_roots:
        got = _compile_with_root(tmp_path, root)
        assert len(got["warnings"]) == 1 and "cannot be written" in got["warnings"][0], (name, got["warnings"])
        temp = tmp_path / f"flydsl-{os.getuid()}" / "triton"
        assert got["triton_dir"] == str(temp), name
        assert len(_triton_entries(temp)) == len(SHARED_VARIANTS), name
        assert stat.S_IMODE((tmp_path / f"flydsl-{os.getuid()}").stat().st_mode) == 0o700
        assert not (root.is_dir() and any(root.iterdir())), name


@needs_sm90_compiler
def test_read_only_user_triton_dir_with_the_checked_manager(tmp_path):
    """The user's own TRITON_CACHE_DIR is theirs to choose; when it cannot be written, the checked manager
    sends new entries to the private temp folder (one warning) instead of failing the compile."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    got = _compile_with_root(tmp_path, tmp_path / "cache", TRITON_CACHE_DIR=str(blocker / "triton"),
                             TRITON_CACHE_MANAGER=CHECKED)  # fmt: skip
    assert len(got["warnings"]) == 1 and "cannot be written" in got["warnings"][0], got["warnings"]
    assert len(_triton_entries(tmp_path / f"flydsl-{os.getuid()}" / "triton")) == len(SHARED_VARIANTS)


def test_foreign_temp_folder_is_not_trusted(tmp_path, monkeypatch):
    """A per-user temp folder open to others (it could hold planted binaries) is not used."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    planted = tmp_path / f"flydsl-{os.getuid()}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    got = cache._private_temp_dir()
    assert got.parent != planted and got.parent.parent == tmp_path
    shutil.rmtree(got.parent)
    planted.chmod(0o700)
    assert cache._private_temp_dir() == planted / "triton"


def _ro_bind_available() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    res = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return res.returncode == 0


@needs_sm90_compiler
@pytest.mark.skipif(not _ro_bind_available(), reason="needs a private mount namespace (unshare -m as root)")
def test_read_only_mount_as_root(tmp_path):
    """Root ignores chmod, not a read-only mount: the root folder bind-mounted read-only in a private mount
    namespace (nothing outside this child sees it)."""
    root = tmp_path / "ro-cache"
    root.mkdir()
    out = tmp_path / "ro.json"
    code = (
        f"import runpy; runpy.run_path({str(WORKER)!r})['compile_all'](variants={SHARED_VARIANTS!r}, out={str(out)!r})"
    )
    script = f'mount --bind "{root}" "{root}" && mount -o remount,bind,ro "{root}" && exec "{sys.executable}" -c "$0"'
    env = {**os.environ, **_child_env(root, tmp_path)}
    env.pop("TRITON_CACHE_DIR", None)
    res = subprocess.run(["unshare", "-m", "sh", "-c", script, code], env=env, capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert len(got["warnings"]) == 1 and "cannot be written" in got["warnings"][0], got["warnings"]
    assert len(_triton_entries(tmp_path / f"flydsl-{os.getuid()}" / "triton")) == len(SHARED_VARIANTS)
    assert list(root.iterdir()) == []


# ---------------------------------------------------------------------------
# nothing in a cache runs code when loaded
# ---------------------------------------------------------------------------


def test_stores_parse_json_only():
    """The modules that read cache files use no deserializer that can run code."""
    sources = [Path(cache.__file__), Path(store_module.__file__)]
    for source in sources:
        text = source.read_text()
        for word in ("pickle", "marshal", "shelve", "eval(", "exec(", "yaml", "torch.load", "np.load", "dill"):
            assert word not in text, (source.name, word)
        assert "json.loads" in text


def test_identity_needs_no_code_from_the_file():
    """Identity fields compared on load are plain strings from this process, never from the file."""
    ident = identity(ARCH)
    assert all(isinstance(v, str) for v in ident.values())
