"""GPU shard selection, the workflow's event rules (fork gate, the base of a push to main), the PR CHANGELOG
check (ci/changelog_check.py) on a temporary git repository, and the dependency floors (ci/floors.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

import changed_packages as cp
import changelog_check as cc
import floors
import monorepo

ALL = monorepo.names()
FAMILIES = ["norm", "gemm", "attention", "conv", "comm"]


# ------------------------------------------------------------ shard selection


@pytest.mark.parametrize(
    "paths, cpu, gpu",
    [
        (["packages/fly-gemm/README.md"], ["gemm"], []),
        (["packages/fly-gemm/CHANGELOG.md", "packages/fly-norm/PERF.md"], ["norm", "gemm"], []),
        (["packages/fly-attention/benchmarks/results/h200.json"], ["attention"], []),
        (["packages/fly-attention/benchmarks/run.py"], ["attention"], ["attention"]),  # a benchmark can change
        (["packages/fly-gemm/src/fly_gemm/README.md"], ["gemm"], ["gemm"]),  # only the package root's docs
        (["packages/flydsl-runtime/README.md"], ALL, []),
        (["packages/flydsl-runtime/src/flydsl/launch.py"], ALL, ALL),  # the runtime's own shard too
        (["tools/sm90_compile.py"], [], []),
        (["tools/README.md", "README.md"], [], []),
        (["noxfile.py"], ALL, ALL),
        (["packages/fly-conv/tests/test_conv.py", "packages/fly-conv/CHANGELOG.md"], ["conv"], ["conv"]),
    ],
)
def test_cpu_and_gpu_selection(paths, cpu, gpu):
    assert cp.packages_for_paths(paths) == cpu
    assert cp.shard_families(paths) == gpu


def test_tools_select_the_shards_that_use_them():
    matrix = cp.load_matrix()
    for fam in matrix["family"]:
        if fam["name"] == "gemm":
            fam["uses"] = ["tools/sm90_compile.py"]
        if fam["name"] == "conv":
            fam["uses"] = ["tools/"]
    assert cp.shard_families(["tools/sm90_compile.py"], matrix) == ["gemm", "conv"]
    assert cp.shard_families(["tools/sass_compare.py"], matrix) == ["conv"]
    assert cp.shard_families(["tools2/x.py"], matrix) == ALL  # not tools/: unknown, everything


def test_cli_families_and_shards(capsys):
    assert cp.main(["--families", "--json", "packages/fly-norm/README.md"]) == 0
    assert capsys.readouterr().out.strip() == "[]"
    assert cp.main(["--shards", "packages/fly-norm/PERF.md", "packages/fly-gemm/src/fly_gemm/gemm.py"]) == 0
    assert capsys.readouterr().out.split() == ["gemm-sm90", "gpu-gemm", "self-hosted,gpu,sm90"]
    assert cp.main(["--families", "--all"]) == 0
    assert capsys.readouterr().out.split() == ALL


# ------------------------------------------------------- the workflow's rules


@pytest.fixture(scope="module")
def ci_jobs():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())["jobs"]


def _step(job, step_id):
    return next(s for s in job["steps"] if s.get("id") == step_id)


@pytest.mark.parametrize(
    "event, head_repo, labels, gpu",
    [
        ("pull_request", "flydsl/flydsl", "", "true"),  # a branch of this repository
        ("pull_request", "someone/flydsl", "", "false"),  # a fork: waits for the label
        ("pull_request", "someone/flydsl", "bug,gpu-ci", "true"),
        ("pull_request", "someone/flydsl", "gpu-ci-later", "false"),  # the label exactly
        ("push", "", "", "true"),
        ("schedule", "", "", "true"),
    ],
)
def test_gpu_jobs_wait_for_a_label_on_forks(ci_jobs, tmp_path, event, head_repo, labels, gpu):
    out = tmp_path / "out"
    env = {"EVENT": event, "HEAD_REPO": head_repo, "LABELS": labels, "GITHUB_REPOSITORY": "flydsl/flydsl",
           "GITHUB_OUTPUT": str(out), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-ec", _step(ci_jobs["changes"], "gate")["run"]], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == f"gpu={gpu}\n"


def test_push_to_main_diffs_against_the_last_green_commit(ci_jobs):
    job = ci_jobs["changes"]
    run = _step(job, "touched")["run"]
    assert "gh run list --workflow ci.yml --branch main --event push --status success" in run
    assert 'args=(--base "$green")' in run and "args=(--all)" in run
    assert "github.event.before" not in str(job)  # a cancelled run's commits would be lost
    assert job["permissions"]["actions"] == "read"
    assert "--families --json" in run and job["outputs"]["families"]


# ----------------------------------------------------------- changelog check


def test_code_changed_is_src_and_pyproject_only():
    assert [p.name for p in cc.code_changed([
        "packages/fly-gemm/src/fly_gemm/gemm.py", "packages/fly-norm/tests/test_x.py",
        "packages/fly-conv/README.md", "packages/fly-conv/PERF.md", "packages/fly-attention/pyproject.toml",
        "packages/fly-attention/benchmarks/pyproject.toml", "ci/release.py", "packages/unknown/src/x.py",
    ])] == ["gemm", "attention"]


def test_changelog_check_on_a_git_repo(repo):
    repo.git("checkout", "-q", "-b", "pr")
    run = lambda labels=(): cc.check(repo.path, "main", list(labels))  # noqa: E731

    ok, lines = run()
    assert ok and lines == ["no package code changed: no CHANGELOG entry needed"]
    repo.write("packages/fly-gemm/tests/test_more.py", "x = 1\n")
    repo.commit("tests only")
    assert run()[0]

    repo.write("packages/fly-gemm/src/fly_gemm/gemm.py", "x = 2\n")
    repo.write("packages/fly-norm/src/fly_norm/norm.py", "y = 2\n")
    repo.commit("code in two packages")
    ok, lines = run()
    assert not ok
    assert "packages/fly-norm: code changed, CHANGELOG.md has no new entry" in lines
    assert "packages/fly-gemm: code changed, CHANGELOG.md has no new entry" in lines
    assert run(["no-changelog"])[0]  # the label skips it
    assert not run(["changelog"])[0]

    cl = repo.changelog("gemm")
    cl.write_text(cl.read_text().replace("# Changelog\n", "# Changelog\n\n## 0.1.1 (unreleased)\n\n- Faster.\n"))
    repo.commit("gemm entry")
    ok, lines = run()
    assert not ok and lines[:2] == ["packages/fly-norm: code changed, CHANGELOG.md has no new entry",
                                    "packages/fly-gemm: code changed, CHANGELOG.md updated"]
    cl = repo.changelog("norm")
    cl.write_text(cl.read_text() + "\n")  # a blank line is no entry
    repo.commit("blank")
    assert not run()[0]
    cl.write_text(cl.read_text() + "- Softmax of empty rows.\n")
    repo.commit("norm entry")
    assert run()[0]
    assert cc.main(["--base", "main", "--root", str(repo.path)]) == 0
    assert cc.main(["--base", "no-such-ref", "--root", str(repo.path)]) == 2


# ------------------------------------------------------------------- floors


@pytest.mark.parametrize("pkg", monorepo.PACKAGES, ids=lambda p: p.name)
def test_every_direct_dependency_has_a_lower_bound(pkg):
    assert floors.missing_lower_bounds(ROOT, pkg) == []


def test_floors_of_a_family(tmp_path):
    gemm = monorepo.by_name("gemm")
    got = {f.name: str(f.version) for f in floors.third_party_floors(ROOT, gemm)}
    assert got["torch"] == "2.9" and got["triton"] == "3.5" and "numpy" in got and "tqdm" in got
    assert [(p.name, str(v)) for p, v, _ in floors.sibling_floors(ROOT, gemm)] == [("runtime", "0.1"),
                                                                                  ("common", "0.1")]
    merged = floors.merged_constraints("torch==2.13.0+cpu  # cpu\npytest==9.2.0\nnumpy==2.0\n",
                                       floors.third_party_floors(ROOT, gemm))
    pins = [ln.split("#")[0].strip() for ln in merged.splitlines() if ln.split("#")[0].strip()]
    assert "torch==2.13.0+cpu" not in pins and "torch==2.9" in pins and "pytest==9.2.0" in pins
    assert len([p for p in pins if p.startswith("numpy")]) == 1


def test_missing_lower_bound_is_named(repo):
    py = repo.path / "packages/flydsl-runtime/pyproject.toml"
    text = py.read_text()
    assert '"tqdm>=4.60"' in text
    py.write_text(text.replace('"tqdm>=4.60"', '"tqdm"'))
    (problem,) = floors.missing_lower_bounds(repo.path, monorepo.by_name("runtime"))
    assert "tqdm has no lower bound" in problem


def test_the_min_sessions_say_why_they_skip():
    text = (ROOT / "noxfile.py").read_text()
    body = text[text.index("def _test_at_floors"):text.index("# ---", text.index("def _test_at_floors"))]
    assert body.count("session.skip(") >= 4 and "pip\", \"check\"" in body
    assert Path(ROOT / "noxfile.py").is_file()
