"""The CI helpers and their consistency: matrix, package list, noxfile sessions, workflow, .ci/run.

Needs only pytest, PyYAML and (on Python 3.10) tomli; nox is optional: the
noxfile is loaded against a recording stand-in for ``nox`` and, where nox is
installed, cross-checked with ``nox --list --json``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import load_noxfile_sessions

import changed_packages as cp
import monorepo

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "ci"  # on sys.path through conftest.py

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ALL = ["runtime", "common", "norm", "gemm", "attention", "conv", "comm"]
FAMILIES = ["norm", "gemm", "attention", "conv", "comm"]
GPU_PACKAGES = ["common", *FAMILIES]  # kernel families: entry point, bench- session
SHARDS = ALL  # every package has gpu-marked tests and a gpu-<name> shard, the runtime included
# comm's shards need a multi-GPU runner (the family's `labels`) and stay disabled until one exists
ENABLED = [n for n in SHARDS if n != "comm"]


# ------------------------------------------------------------- package list


def test_package_list_order_and_names():
    assert monorepo.names() == ALL
    assert [p.name for p in monorepo.PACKAGES if p.gpu] == GPU_PACKAGES
    assert [p.name for p in monorepo.PACKAGES if p.shard] == SHARDS


@pytest.mark.parametrize("pkg", monorepo.PACKAGES, ids=lambda p: p.name)
def test_package_list_matches_pyproject(pkg):
    folder = ROOT / pkg.path
    with open(folder / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    assert project["project"]["name"] == pkg.distribution
    assert project["tool"]["hatch"]["version"]["path"] == f"src/{pkg.module}/_version.py"
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == [f"src/{pkg.module}"]
    assert (folder / "src" / pkg.module / "_version.py").is_file()
    assert (folder / "CHANGELOG.md").is_file() and (folder / "README.md").is_file()
    deps = project["project"]["dependencies"]
    for dep in pkg.depends:
        sibling = monorepo.by_name(dep).distribution
        (req,) = [d for d in deps if re.match(rf"{re.escape(sibling)}\s*[<>=!~]", d)]
        assert ">=" in req and "<" in req.replace("<=", "") and "==" not in req, f"{req}: use a range, not a pin"
    ours = {p.distribution for p in monorepo.PACKAGES}
    declared = {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0] for d in deps}
    assert declared & ours == {monorepo.by_name(d).distribution for d in pkg.depends}
    entry_points = project["project"].get("entry-points", {}).get("flydsl.families", {})
    if pkg.gpu:
        assert entry_points == {pkg.name: f"{pkg.module}._family:FAMILY"}
    else:
        assert entry_points == {}


def test_test_module_names_are_unique_across_packages():
    seen: dict[str, str] = {}
    for pkg in monorepo.PACKAGES:
        for test in sorted((ROOT / pkg.path / "tests").glob("**/test_*.py")):
            assert test.name not in seen, f"{test.name} is in both {seen[test.name]} and {pkg.name}"
            seen[test.name] = pkg.name


def test_install_order_and_dependents():
    assert [p.name for p in monorepo.install_order("runtime")] == ["runtime"]
    assert [p.name for p in monorepo.install_order("common")] == ["runtime", "common"]
    assert [p.name for p in monorepo.install_order("gemm")] == ["runtime", "common", "gemm"]
    assert [p.name for p in monorepo.dependents("runtime")] == ALL
    assert [p.name for p in monorepo.dependents("common")] == ["common", *FAMILIES]
    assert [p.name for p in monorepo.dependents("conv")] == ["conv"]


# ------------------------------------------------------------------- matrix


def test_matrix_parses():
    matrix = cp.load_matrix()
    assert [f["name"] for f in matrix["family"]] == SHARDS
    archs = {a["id"]: a for a in matrix["arch"]}
    assert archs["sm90"]["enabled"] is True
    for off in ("sm80", "sm100", "gfx942"):
        assert archs[off]["enabled"] is False and archs[off]["reason"]
    enabled = cp.shards(matrix)
    assert {s["id"] for s in enabled} == {f"{f}-sm90" for f in ENABLED}
    assert all(s["runner"] == ["self-hosted", "gpu", "sm90"] for s in enabled)
    every = cp.shards(matrix, include_disabled=True)
    assert len(every) == len(SHARDS) * len(archs)
    (comm,) = [f for f in matrix["family"] if f["name"] == "comm"]
    assert comm["enabled"] is False and comm["reason"] and comm["labels"] == ["multi-gpu"]
    comm_sm90 = next(s for s in every if s["id"] == "comm-sm90")
    assert comm_sm90["runner"] == ["self-hosted", "gpu", "sm90", "multi-gpu"] and comm_sm90["enabled"] is False


@pytest.mark.parametrize(
    "text, problem",
    [
        ("schema = 2", "schema"),
        ('schema = 1\n[[family]]\nname = "nope"\nsession = "gpu-nope"\n'
         '[[arch]]\nid = "sm90"\nenabled = true\nrunner = ["sm90"]\n', "not a GPU package"),
        ('schema = 1\n[[family]]\nname = "norm"\nsession = "gpu-norm"\nuses = ["packages/x"]\n'
         '[[arch]]\nid = "sm90"\nenabled = true\nrunner = ["sm90"]\n', "tools/ paths"),
        ('schema = 1\n[[family]]\nname = "norm"\nsession = "gpu-gemm"\n'
         '[[arch]]\nid = "sm90"\nenabled = true\nrunner = ["sm90"]\n', "must run session"),
        ('schema = 1\n[[family]]\nname = "norm"\nsession = "gpu-norm"\n'
         '[[arch]]\nid = "sm80"\nenabled = false\nrunner = ["sm80"]\n', "needs a reason"),
        ('schema = 1\n[[family]]\nname = "norm"\nsession = "gpu-norm"\n'
         '[[arch]]\nid = "sm90"\nenabled = true\nrunner = ["self-hosted"]\n', "include the arch id"),
        ('schema = 1\n[[family]]\nname = "comm"\nsession = "gpu-comm"\nenabled = false\n'
         '[[arch]]\nid = "sm90"\nenabled = true\nrunner = ["sm90"]\n', "disabled family 'comm' needs a reason"),
        ('schema = 1\n[[family]]\nname = "comm"\nsession = "gpu-comm"\nlabels = "multi-gpu"\n'
         '[[arch]]\nid = "sm90"\nenabled = true\nrunner = ["sm90"]\n', "labels must be a list"),
    ],
)
def test_matrix_validation(tmp_path, text, problem):
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        cp.load_matrix(path)


# --------------------------------------------------------- changed packages


@pytest.mark.parametrize(
    "paths, expected",
    [
        (["packages/flydsl-runtime/src/flydsl/cli.py"], ALL),
        (["packages/fly-common/src/flydsl_common/quant.py"], ["common", *FAMILIES]),
        (["packages/fly-norm/src/fly_norm/__init__.py"], ["norm"]),
        (["./packages/fly-gemm/tests/test_gemm_package.py", "packages/fly-conv/README.md"], ["gemm", "conv"]),
        (["packages/fly-attention/benchmarks/results/h200.json"], ["attention"]),
        (["noxfile.py"], ALL),
        (["ci/matrix.toml"], ALL),
        ([".github/workflows/ci.yml"], ALL),
        ([".ci/run"], ALL),
        (["ruff.toml"], ALL),
        ([".gitignore"], ALL),
        (["packages/fly-newfamily/src/x.py"], ALL),  # a folder the list does not know: everything
        (["some-new-root-file.cfg"], ALL),  # unknown: everything
        (["README.md"], []),
        (["CONTRIBUTING.md", "docs/guide.md", "LICENSE"], []),
        (["packages/README.md"], []),
        ([], []),
        (["README.md", "packages/fly-conv/src/fly_conv/_family.py"], ["conv"]),
    ],
)
def test_touched_packages(paths, expected):
    assert cp.packages_for_paths(paths) == expected


def _run_cli(capsys, *argv):
    assert cp.main(list(argv)) == 0
    return capsys.readouterr().out


def test_cli_names_and_json(capsys):
    assert _run_cli(capsys, "packages/fly-norm/src/fly_norm/_version.py", "README.md").strip() == "norm"
    assert json.loads(_run_cli(capsys, "--json", "packages/fly-common/x.py")) == ["common", *FAMILIES]
    assert _run_cli(capsys, "--all").split() == ALL


def test_cli_reads_paths_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(read=lambda: "packages/fly-gemm/a.py\nREADME.md\n"))
    assert _run_cli(capsys, "-").split() == ["gemm"]


def test_cli_shards(capsys):
    rows = json.loads(_run_cli(capsys, "--shards", "--json", "packages/fly-gemm/src/fly_gemm/__init__.py"))
    assert rows == [
        {
            "id": "gemm-sm90",
            "family": "gemm",
            "arch": "sm90",
            "session": "gpu-gemm",
            "runner": ["self-hosted", "gpu", "sm90"],
            "enabled": True,
            "timeout_minutes": 60,
        }
    ]
    every = json.loads(_run_cli(capsys, "--shards", "--json", "packages/flydsl-runtime/src/flydsl/env.py"))
    assert [r["family"] for r in every] == ENABLED
    assert json.loads(_run_cli(capsys, "--shards", "--json", "packages/fly-comm/src/fly_comm/allreduce.py")) == []
    assert json.loads(_run_cli(capsys, "--shards", "--json", "README.md")) == []
    text = _run_cli(capsys, "--shards", "packages/fly-conv/x.py")
    assert text.split() == ["conv-sm90", "gpu-conv", "self-hosted,gpu,sm90"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_changed_paths_from_git(tmp_path):
    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid", *args],
            cwd=tmp_path, check=True, capture_output=True,
        )

    git("init", "-q")
    (tmp_path / "README.md").write_text("x\n")
    (tmp_path / "packages" / "fly-gemm").mkdir(parents=True)
    (tmp_path / "packages" / "fly-gemm" / "a.py").write_text("a = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "base")
    git("tag", "base")
    (tmp_path / "packages" / "fly-norm").mkdir(parents=True)
    (tmp_path / "packages" / "fly-norm" / "b.py").write_text("b = 1\n")  # untracked
    git("mv", "packages/fly-gemm/a.py", "packages/fly-gemm-old.py")  # a move out of a package
    git("commit", "-q", "-m", "change")
    (tmp_path / "README.md").write_text("y\n")  # uncommitted

    paths = cp.changed_paths("base", cwd=tmp_path)
    assert paths == ["README.md", "packages/fly-gemm-old.py", "packages/fly-gemm/a.py", "packages/fly-norm/b.py"]
    assert cp.packages_for_paths(paths) == ALL  # packages/fly-gemm-old.py is an unknown path
    assert cp.changed_paths("no-such-ref", cwd=tmp_path) is None


# ------------------------------------------------------------- the noxfile


def _noxfile_sessions(monkeypatch) -> dict[str, dict]:
    return load_noxfile_sessions(monkeypatch)


def test_noxfile_sessions(monkeypatch):
    sessions = _noxfile_sessions(monkeypatch)
    options = sessions.pop("__options__")
    expected = {"tests", "lint", "demo", "test-ci"}
    for name in ALL:
        expected |= {f"test-{name}", f"test-{name}-min", f"build-{name}", f"isolation-{name}", f"release-{name}",
                     f"bump-{name}"}
    for name in SHARDS:
        expected |= {f"gpu-{name}", f"sanitize-{name}"}
    for name in GPU_PACKAGES:
        expected.add(f"bench-{name}")
    assert set(sessions) == expected
    assert options["sessions"] == ["lint", "tests"]
    for name, s in sessions.items():
        assert s["doc"], f"{name} has no description for `nox -l`"
        if name.startswith(("gpu-", "sanitize-", "bench-", "bump-")):
            assert s["python"] is False, f"{name} must run in the current interpreter"
        elif name.endswith("-min"):
            assert s["python"] == "3.10", f"{name}: the floors are tested on the oldest supported Python"
        else:
            assert s["python"] is None
    assert "gpu" in sessions["gpu-norm"]["tags"]
    assert "cpu" in sessions["tests"]["tags"]
    gpu_tagged = {n for n, s in sessions.items() if "gpu" in s["tags"]}
    assert gpu_tagged == {f"gpu-{n}" for n in SHARDS}


def test_every_shard_has_its_session(monkeypatch):
    sessions = _noxfile_sessions(monkeypatch)
    for shard in cp.shards(include_disabled=True):
        assert shard["session"] in sessions
        assert sessions[shard["session"]]["python"] is False


def test_noxfile_agrees_with_real_nox(monkeypatch):
    pytest.importorskip("nox")
    expected = sorted(n for n in _noxfile_sessions(monkeypatch) if n != "__options__")
    # Naming every session: real nox fails on any name it does not define.
    proc = subprocess.run(
        [sys.executable, "-m", "nox", "--list", "--json", "-f", str(ROOT / "noxfile.py"), "-s", *expected],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    listed = {s["session"]: s for s in json.loads(proc.stdout)}
    assert sorted(listed) == expected
    assert {n for n, s in listed.items() if "gpu" in s["tags"]} == {f"gpu-{n}" for n in SHARDS}


# ----------------------------------------------------------- the workflow


@pytest.fixture(scope="module")
def workflow():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())


def _runs(job) -> str:
    return "\n".join(step.get("run", "") for step in job.get("steps", []))


def test_workflow_gpu_jobs_match_the_matrix(workflow):
    jobs = workflow["jobs"]
    gpu_jobs = {name: job for name, job in jobs.items() if re.search(r"nox -s gpu-", _runs(job))}
    enabled = cp.shards()
    assert set(gpu_jobs) == {s["session"] + "-" + s["arch"] for s in enabled}, (
        "GPU jobs in ci.yml must be exactly the enabled shards of ci/matrix.toml"
    )
    for shard in enabled:
        job = gpu_jobs[f"{shard['session']}-{shard['arch']}"]
        assert job["runs-on"] == shard["runner"]
        assert re.search(rf"nox -s {re.escape(shard['session'])}(\s|$)", _runs(job))
        assert job["needs"] == "changes"
        # the fork gate first, then the families the change selects for GPU shards
        assert job["if"] == (f"needs.changes.outputs.gpu == 'true' && "
                             f"contains(fromJSON(needs.changes.outputs.families), '{shard['family']}')")
        assert job["timeout-minutes"] == shard["timeout_minutes"]


def test_workflow_cpu_build_and_lint_jobs(workflow):
    jobs = workflow["jobs"]
    cpu = [j for j in jobs.values() if "nox -s test-${{ matrix.package }} " in _runs(j)]
    assert len(cpu) == 1 and cpu[0]["strategy"]["matrix"]["package"] == ALL, "one CPU job per package"
    assert cpu[0]["strategy"]["matrix"]["python"] == ["3.10", "3.13"], "the oldest and newest supported Python"
    assert "--force-python ${{ matrix.python }}" in _runs(cpu[0])
    (floor,) = [j for j in jobs.values() if "nox -s test-${{ matrix.package }}-min" in _runs(j)]
    assert floor["strategy"]["matrix"]["package"] == ALL
    (setup,) = [s for s in floor["steps"] if s.get("uses", "").startswith("actions/setup-python")]
    assert setup["with"]["python-version"] == "3.10"
    assert jobs["changelog"]["if"] == "github.event_name == 'pull_request'"
    assert "ci/changelog_check.py --base" in _runs(jobs["changelog"]) and "--labels" in _runs(jobs["changelog"])
    build = [j for j in jobs.values() if "nox -s build-${{ matrix.package }}" in _runs(j)]
    assert len(build) == 1 and build[0]["strategy"]["matrix"]["package"] == ALL
    assert "isolation-${{ matrix.package }}" in _runs(build[0])
    assert any(re.search(r"nox -s lint(\s|$)", _runs(j)) for j in jobs.values())
    assert any(re.search(r"nox -s test-ci(\s|$)", _runs(j)) for j in jobs.values())
    assert "ci/changed_packages.py" in _runs(jobs["changes"])
    for job in jobs.values():  # hosted jobs never land on GPU runners and vice versa
        labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
        assert ("gpu" in labels) == bool(re.search(r"nox -s gpu-", _runs(job)))


# ---------------------------------------------------------- pins and entry


def test_cpu_constraints():
    pins = {}
    for line in (CI / "constraints-cpu.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.split(r"[<>=!~]", line, maxsplit=1)[0]
            pins[name] = line
    assert pins["torch"] == "torch==2.13.0+cpu"
    assert pins["triton"] == "triton==3.6.0"
    assert "numpy" not in pins  # any numpy: the runtime adapts Triton's interpreter (flydsl/_interp_numpy.py)
    for tool in ("pytest", "pytest-xdist", "hypothesis", "tqdm", "matplotlib"):
        assert pins[tool].startswith(f"{tool}=="), f"{tool} must be pinned"
    assert "://" not in (CI / "constraints-cpu.txt").read_text()


def test_ci_run_is_the_readme_test_command():
    command = "python3 -m pip install nox && python3 -m nox -s tests"
    run = (ROOT / ".ci" / "run").read_text()
    assert run.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in run
    assert command in run
    assert command in (ROOT / "README.md").read_text()
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111, ".ci/run must be executable"


def test_sanitize_workflow_covers_every_shard(monkeypatch):
    """.github/workflows/sanitize.yml runs `nox -s sanitize-<family>` for exactly the families with an enabled
    GPU shard (its runner is the one-GPU sm90 runner), each a session of the noxfile; every shard family has
    the session, so enabling a shard only adds it to the list."""
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "sanitize.yml").read_text())
    job = flow["jobs"]["sanitize"]
    assert set(job["strategy"]["matrix"]["family"]) == {s["family"] for s in cp.shards()} == set(ENABLED)
    assert "nox -s sanitize-${{ matrix.family }}" in _runs(job)
    sessions = _noxfile_sessions(monkeypatch)
    assert {f"sanitize-{n}" for n in SHARDS} <= set(sessions)
