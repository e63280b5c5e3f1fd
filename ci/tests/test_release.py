"""Versions, bumps, CHANGELOG sections and the release refusals (ci/release.py), on temporary git repositories,
and the release workflow checked against the packages and the noxfile (CI has no GitHub runner)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, load_noxfile_sessions

import monorepo
import release as rel

PACKAGES = monorepo.PACKAGES
GEMM = monorepo.by_name("gemm")
RUNTIME = monorepo.by_name("runtime")


def _all_published(name, version):
    return True


# ------------------------------------------------------------------ versions


@pytest.mark.parametrize(
    "current, part, expected",
    [
        ("0.1.0", "patch", "0.1.1"),
        ("0.1.0", "minor", "0.2.0"),
        ("0.1.0", "major", "1.0.0"),
        ("0.1.0", "dev", "0.1.1.dev0"),
        ("0.1.1.dev0", "dev", "0.1.1.dev1"),
        ("0.1.1.dev3", "patch", "0.1.1"),
        ("0.1.1.dev3", "minor", "0.2.0"),
        ("0.2.0.dev1", "minor", "0.2.0"),
        ("0.2.0.dev1", "major", "1.0.0"),
        ("1.0.0.dev0", "major", "1.0.0"),
        ("0.1.0", "0.3.0", "0.3.0"),
    ],
)
def test_next_version(current, part, expected):
    assert rel.next_version(current, part) == expected


@pytest.mark.parametrize("current, part, problem", [
    ("0.1.0", "0.1.0", "not above"),
    ("0.1.0", "0.0.9", "not above"),
    ("0.1.0", "1.0", "X.Y.Z"),
    ("0.1.0", "1.0.0rc1", "X.Y.Z"),
    ("0.1", "patch", "X.Y.Z"),
    ("0.1.0", "bogus", "X.Y.Z"),
])
def test_next_version_refuses(current, part, problem):
    with pytest.raises(rel.ReleaseError, match=problem):
        rel.next_version(current, part)


def test_tag_info_names_every_package():
    for pkg in PACKAGES:
        assert rel.tag_info(f"{pkg.distribution}-v1.2.3") == (pkg, "1.2.3")
    for bad, problem in [("fly-gemm-v1.2", "X.Y.Z"), ("fly-gemm-v0.2.0.dev1", "never released"),
                         ("gemm-v0.1.0", "names no package"), ("fly-gemm-0.1.0", "names no package")]:
        with pytest.raises(rel.ReleaseError, match=problem):
            rel.tag_info(bad)


# ---------------------------------------------------------------- changelog


def test_open_section_renames_an_unreleased_top_and_replaces_its_commit_list():
    text = "# Changelog\n\nIntro.\n\n## 0.2.0 (unreleased)\n\n### Added\n\n- thing\n\n## 0.1.0 (2026-01-01)\n\n- a\n"
    once = rel.open_section(text, "0.3.0", ["fix x", "add y"], "fly-gemm-v0.1.0")
    twice = rel.open_section(once, "0.3.0", ["fix x", "add y", "add z"], "fly-gemm-v0.1.0")
    assert [s.version for s in rel.sections(twice)] == ["0.3.0", "0.1.0"]
    assert "### Added\n\n- thing" in twice and "Intro." in twice
    assert twice.count("### Commits since fly-gemm-v0.1.0") == 1 and "- add z\n" in twice
    assert twice.endswith("## 0.1.0 (2026-01-01)\n\n- a\n")


def test_open_section_refuses_an_existing_released_version():
    with pytest.raises(rel.ReleaseError, match="already has"):
        rel.open_section("# Changelog\n\n## 0.1.0 (2026-01-01)\n\n- a\n", "0.1.0", [], None)


@pytest.mark.parametrize("heading, problem", [
    ("## 0.2.0 (unreleased)", "still marked unreleased"),
    ("## Unreleased", "no '## 0.2.0' section"),
    ("## 0.1.9 (2026-01-02)", "no '## 0.2.0' section"),
])
def test_changelog_problems(heading, problem):
    (found,) = rel.changelog_problems(f"# Changelog\n\n{heading}\n\n- x\n", "0.2.0")
    assert problem in found
    assert rel.changelog_problems("# Changelog\n\n## 0.2.0 (2026-02-01)\n\n- x\n", "0.2.0") == []
    assert rel.section_notes("# Changelog\n\n## [0.2.0] - 2026-02-01\n\n- x\n\n## 0.1.0\n- y\n", "0.2.0") == "- x\n"


# --------------------------------------------------------------------- bump


def test_bump_sets_the_version_and_lists_the_package_commits_since_its_tag(repo):
    repo.git("tag", "-a", "fly-gemm-v0.1.0", "-m", "fly-gemm 0.1.0")
    repo.write("packages/fly-gemm/src/fly_gemm/gemm.py", "x = 1\n")
    repo.commit("fly-gemm: a faster decode path")
    repo.write("packages/fly-norm/src/fly_norm/norm.py", "y = 1\n")
    repo.commit("fly-norm: unrelated")
    repo.write("packages/fly-gemm/tests/test_x.py", "z = 1\n")
    repo.commit("fly-gemm tests: odd shapes")

    old, new, log = rel.bump(repo.path, GEMM, "minor")
    assert (old, new) == ("0.1.0", "0.2.0")
    assert repo.version_file("gemm").read_text() == '__version__ = "0.2.0"\n'
    text = repo.changelog("gemm").read_text()
    top = rel.sections(text)[0]
    assert top.version == "0.2.0" and top.unreleased
    body = text[top.start:top.end]
    commits = "- fly-gemm: a faster decode path\n- fly-gemm tests: odd shapes\n"
    assert "### Commits since fly-gemm-v0.1.0\n\n" + commits in body
    assert "unrelated" not in text and "initial layout" not in body
    assert repo.version_file("norm").read_text() == '__version__ = "0.1.0"\n'  # siblings untouched

    assert rel.bump(repo.path, GEMM, "dev")[1] == "0.2.1.dev0"
    assert rel.sections(repo.changelog("gemm").read_text())[0].version == "0.2.0"  # dev opens no section


def test_bump_without_a_tag_lists_every_commit_of_the_package(repo):
    rel.bump(repo.path, GEMM, "patch")
    text = repo.changelog("gemm").read_text()
    assert "### Commits since the first commit\n\n- initial layout\n" in text


def test_bump_refuses_a_version_that_sibling_ranges_exclude(repo):
    before = {p.name: repo.version_file(p.name).read_text() for p in PACKAGES}
    changelog = repo.changelog("runtime").read_text()
    with pytest.raises(rel.ReleaseError, match=r"fly-gemm/pyproject.toml requires flydsl-runtime<0.2,>=0.1"):
        rel.bump(repo.path, RUNTIME, "minor")  # every family requires flydsl-runtime>=0.1,<0.2
    assert {p.name: repo.version_file(p.name).read_text() for p in PACKAGES} == before  # nothing written
    assert repo.changelog("runtime").read_text() == changelog
    assert rel.bump(repo.path, RUNTIME, "patch")[1] == "0.1.1"  # inside the ranges


def test_bump_cli_reports_a_refusal(repo):
    proc = subprocess.run([sys.executable, str(ROOT / "ci" / "release.py"), "--root", str(repo.path),
                           "bump", "runtime", "1.0.0"], capture_output=True, text=True)
    assert proc.returncode == 1 and "excludes flydsl-runtime 1.0.0" in proc.stderr


# ----------------------------------------------------------- release checks


def _release_ready(repo, version="0.2.0"):
    repo.version_file("gemm").write_text(f'__version__ = "{version}"\n')
    repo.changelog("gemm").write_text(f"# Changelog\n\n## {version} (2026-03-01)\n\n- faster\n\n## 0.1.0\n\n- a\n")
    repo.commit(f"fly-gemm {version}")


def test_release_checks_pass_for_a_ready_package(repo):
    repo.git("tag", "-a", "fly-gemm-v0.1.0", "-m", "0.1.0")
    _release_ready(repo)
    assert rel.release_problems(repo.path, GEMM, published=_all_published) == ([], [])


def test_release_refuses_an_unreleased_heading(repo):
    _release_ready(repo)
    repo.changelog("gemm").write_text("# Changelog\n\n## 0.2.0 (unreleased)\n\n- faster\n")
    problems, _ = rel.release_problems(repo.path, GEMM, published=_all_published)
    assert len(problems) == 1 and "still marked unreleased" in problems[0]


def test_release_refuses_a_version_not_above_the_last_tag(repo):
    repo.git("tag", "-a", "fly-gemm-v0.3.0", "-m", "0.3.0")
    repo.git("tag", "-a", "fly-gemm-v0.1.0", "-m", "0.1.0")  # made later, lower: the highest version counts
    _release_ready(repo, "0.2.0")
    problems, _ = rel.release_problems(repo.path, GEMM, published=_all_published)
    assert problems == ["fly-gemm 0.2.0 is not above its last release tag fly-gemm-v0.3.0"]


def test_release_refuses_an_existing_tag_and_a_dev_version(repo):
    _release_ready(repo)
    repo.git("tag", "-a", "fly-gemm-v0.2.0", "-m", "0.2.0")
    problems, _ = rel.release_problems(repo.path, GEMM, published=_all_published)
    assert any("tag fly-gemm-v0.2.0 exists" in p for p in problems)
    repo.version_file("gemm").write_text('__version__ = "0.2.1.dev0"\n')
    problems, _ = rel.release_problems(repo.path, GEMM, published=_all_published)
    assert any("is a .dev version" in p for p in problems)


def test_release_from_a_tag_needs_that_tag_at_head(repo):
    _release_ready(repo)
    repo.git("tag", "-a", "fly-gemm-v0.2.0", "-m", "0.2.0")
    assert rel.release_problems(repo.path, GEMM, tagged="fly-gemm-v0.2.0", published=_all_published)[0] == []
    assert "does not match" in rel.release_problems(repo.path, GEMM, tagged="fly-gemm-v0.2.1",
                                                    published=_all_published)[0][0]
    repo.write("packages/fly-gemm/src/fly_gemm/later.py", "")
    repo.commit("later")
    (problem,) = rel.release_problems(repo.path, GEMM, tagged="fly-gemm-v0.2.0", published=_all_published)[0]
    assert "not at the checked-out" in problem


def test_release_refuses_an_unpublished_sibling_floor_and_says_when_offline(repo):
    _release_ready(repo)
    asked = []

    def only_runtime(name, version):
        asked.append((name, str(version)))
        return name == "flydsl-runtime"

    problems, notes = rel.release_problems(repo.path, GEMM, published=only_runtime)
    assert sorted(asked) == [("flydsl-common", "0.1"), ("flydsl-runtime", "0.1")]
    assert problems == ["flydsl-common 0.1, the lower end of flydsl-common<0.2,>=0.1, is not published: release "
                        "flydsl-common first, or raise the lower end to a published version"]
    problems, notes = rel.release_problems(repo.path, GEMM, published=lambda n, v: None)
    assert problems == [] and len(notes) == 2 and all(n.startswith("PyPI not reachable") for n in notes)
    assert rel.release_problems(repo.path, GEMM, published=None)[1] == [
        "PyPI look-up of sibling lower ends skipped (offline)"]


def test_fetch_tags_from_the_remote(repo, tmp_path):
    assert rel.fetch_tags(repo.path) == "no git remote: compared with local tags only"
    remote = tmp_path / "remote.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(repo.path), str(remote)], check=True)
    subprocess.run(["git", "-C", str(remote), "tag", "fly-gemm-v0.5.0"], check=True)  # released elsewhere
    repo.git("remote", "add", "origin", str(remote))
    assert rel.last_tag(repo.path, GEMM) is None
    assert rel.fetch_tags(repo.path) == "fetched tags from origin"
    assert rel.last_tag(repo.path, GEMM)[1] == "fly-gemm-v0.5.0"
    _release_ready(repo, "0.2.0")
    assert "not above its last release tag fly-gemm-v0.5.0" in rel.release_problems(
        repo.path, GEMM, published=_all_published)[0][0]
    repo.git("remote", "set-url", "origin", str(tmp_path / "gone.git"))
    with pytest.raises(rel.ReleaseError, match="could not fetch tags from origin"):
        rel.fetch_tags(repo.path)


def _wheel(path: Path, license_bytes: bytes | None, module="fly_gemm") -> Path:
    info = "fly_gemm-0.2.0.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(f"{module}/_version.py", '__version__ = "0.2.0"\n')
        meta = "Metadata-Version: 2.4\nName: fly-gemm\nVersion: 0.2.0\nLicense-Expression: Apache-2.0\n"
        zf.writestr(f"{info}/METADATA", meta + ("License-File: LICENSE\n" if license_bytes else ""))
        zf.writestr(f"{info}/entry_points.txt", "[flydsl.families]\ngemm = fly_gemm._family:FAMILY\n")
        if license_bytes is not None:
            zf.writestr(f"{info}/licenses/LICENSE", license_bytes)
    return path


def test_wheel_without_license_is_refused(tmp_path):
    lic = (ROOT / "LICENSE").read_bytes()
    assert rel.wheel_problems(_wheel(tmp_path / "ok.whl", lic), GEMM, lic) == []
    problems = rel.wheel_problems(_wheel(tmp_path / "none.whl", None), GEMM, lic)
    assert any("no LICENSE" in p for p in problems) and any("License-File" in p for p in problems)
    assert rel.wheel_problems(_wheel(tmp_path / "other.whl", b"MIT"), GEMM, lic) == [
        "other.whl: fly_gemm-0.2.0.dist-info/licenses/LICENSE is not the repository LICENSE"]


# ------------------------------------------------------------ the workflow


@pytest.fixture(scope="module")
def workflow():
    yaml = pytest.importorskip("yaml")
    text = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    return text, yaml.safe_load(text)


def _on(wf):  # PyYAML reads the key `on` as True
    return wf.get("on", wf.get(True))


def test_workflow_has_one_tag_pattern_per_package(workflow):
    _, wf = workflow
    assert sorted(_on(wf)["push"]["tags"]) == sorted(f"{p.distribution}-v*" for p in PACKAGES)
    assert set(_on(wf)) == {"push"} and "branches" not in _on(wf)["push"]


def test_workflow_steps(workflow, monkeypatch):
    text, wf = workflow
    jobs = wf["jobs"]
    assert list(jobs) == ["resolve", "build", "publish", "github-release"]
    assert jobs["build"]["needs"] == "resolve"
    assert jobs["publish"]["needs"] == ["resolve", "build"]
    assert jobs["github-release"]["needs"] == ["resolve", "publish"]
    runs = {name: "\n".join(s.get("run", "") for s in job["steps"]) for name, job in jobs.items()}
    # The build runs the release session on the pushed tag: the same checks as a laptop, the install test.
    assert 'nox -s "release-$NAME" -- --from-tag "$TAG"' in runs["build"]
    assert "--from-tag" in (ROOT / "noxfile.py").read_text()
    sessions = load_noxfile_sessions(monkeypatch)
    for pkg in PACKAGES:
        assert f"release-{pkg.name}" in sessions
    assert any(s.get("with", {}).get("fetch-depth") == 0 for s in jobs["build"]["steps"])
    (upload,) = [s for s in jobs["build"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert upload["with"]["path"] == "dist/${{ needs.resolve.outputs.name }}/"  # where build-<name> writes
    # Trusted publishing: an OIDC token for the publish job alone, no password anywhere.
    (pub,) = [s for s in jobs["publish"]["steps"] if "gh-action-pypi-publish" in s.get("uses", "")]
    assert "password" not in pub.get("with", {}) and "secrets." not in text
    assert jobs["publish"]["permissions"] == {"id-token": "write"}
    assert jobs["publish"]["environment"]["name"] == "pypi"
    assert wf["permissions"] == {"contents": "read"}
    assert jobs["github-release"]["permissions"] == {"contents": "write"}
    assert "ci/release.py notes" in runs["github-release"] and "--notes-file notes.md" in runs["github-release"]
    assert "ci/release.py tag-info" in runs["resolve"]


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_workflow_resolve_and_notes_steps_run(workflow, pkg, tmp_path):
    """The resolve step's and the notes step's shell, run here as the runner would (pip install left out)."""
    _, wf = workflow
    version = rel.read_version(ROOT, pkg)
    step = next(s for s in wf["jobs"]["resolve"]["steps"] if s.get("id") == "tag")
    script = "\n".join(ln for ln in step["run"].splitlines() if "pip install" not in ln)
    out = tmp_path / "github_output"
    env = {"TAG": f"{pkg.distribution}-v{version}", "GITHUB_OUTPUT": str(out), "PATH": str(Path(sys.executable).parent)
           + ":/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-ec", script.replace("python ", f"{sys.executable} ")], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == f"name={pkg.name}\ndistribution={pkg.distribution}\nversion={version}\n"
    env["TAG"] = f"{pkg.distribution}-v9.9.9"  # a tag that is not the in-repo version fails the job
    assert subprocess.run(["bash", "-ec", script.replace("python ", f"{sys.executable} ")], cwd=ROOT, env=env,
                          capture_output=True).returncode == 1
    notes_step = next(s for s in wf["jobs"]["github-release"]["steps"] if "notes" in s.get("run", ""))
    script = "\n".join(ln for ln in notes_step["run"].splitlines() if "pip install" not in ln)
    env.update(NAME=pkg.name, VERSION=version)
    proc = subprocess.run(["bash", "-ec", script.replace("python ", f"{sys.executable} ")], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert proc.returncode != 0  # outside the checkout ci/release.py is not there: the step needs actions/checkout
    proc = subprocess.run(["bash", "-ec", script.replace("python ", f"{sys.executable} ").replace(
        "> notes.md", f"> {tmp_path / 'notes.md'}")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "notes.md").read_text().strip()
