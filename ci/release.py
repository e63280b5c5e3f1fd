"""Versions, CHANGELOG sections, tags and the release checks of each package: the logic behind
``nox -s bump-<name>``, ``nox -s release-<name>`` and ``.github/workflows/release.yml``.

    python ci/release.py tag-info fly-gemm-v0.2.0 [--github-output FILE]   # tag -> package, version
    python ci/release.py notes gemm 0.2.0                                  # the CHANGELOG section, for the release
    python ci/release.py bump gemm minor|patch|major|dev|X.Y.Z             # what the nox session runs

Versions: ``X.Y.Z`` for releases, ``X.Y.Z.devN`` between them (the version of main after a
release, so a wheel built from main never carries a released version). A release is the
annotated tag ``<distribution>-v<version>`` on the commit that has that version; pushing it
runs the release workflow, which builds, tests and publishes (PyPI trusted publishing).

Functions take the repository root so the tests run them on a temporary git repository.
Standard library plus ``packaging`` (a dependency of pip, pytest and nox, so wherever nox runs).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

CI_DIR = Path(__file__).resolve().parent
if str(CI_DIR) not in sys.path:
    sys.path.insert(0, str(CI_DIR))

from monorepo import PACKAGES, Package, by_name  # noqa: E402

REPO_ROOT = CI_DIR.parent
PYPI_JSON = "https://pypi.org/pypi/{name}/json"
VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.dev(\d+))?$")
_VERSION_LINE = re.compile(r"""^(__version__\s*=\s*)(["'])([^"']+)\2""", re.M)
_HEADING = re.compile(r"^##\s+\[?(?P<version>[^\s\]]+)\]?(?P<rest>[^\n]*)$", re.M)
_COMMITS_TITLE = "### Commits since "


class ReleaseError(Exception):
    """A release or bump refused; the message says what is wrong and what to do."""


# ------------------------------------------------------------------ versions


def parse_version(text: str, what: str = "version") -> Version:
    """A version of ours: X.Y.Z or X.Y.Z.devN (nothing else, so ordering and bumps stay obvious)."""
    if not VERSION_RE.match(text):
        raise ReleaseError(f"{what} must be X.Y.Z or X.Y.Z.devN, got {text!r}")
    return Version(text)


def version_file(root: Path, pkg: Package) -> Path:
    """The one version source of a package (hatch's [tool.hatch.version] path)."""
    return root / pkg.path / "src" / pkg.module / "_version.py"


def read_version(root: Path, pkg: Package) -> str:
    path = version_file(root, pkg)
    m = _VERSION_LINE.search(path.read_text())
    if not m:
        raise ReleaseError(f"no __version__ = '...' line in {path}")
    return m.group(3)


def write_version(root: Path, pkg: Package, version: str) -> None:
    path = version_file(root, pkg)
    text = path.read_text()
    new, n = _VERSION_LINE.subn(lambda m: f"{m.group(1)}{m.group(2)}{version}{m.group(2)}", text, count=1)
    if n != 1:
        raise ReleaseError(f"no __version__ = '...' line in {path}")
    path.write_text(new)


def next_version(current: str, part: str) -> str:
    """The version ``bump`` sets: ``major``/``minor``/``patch`` (a release), ``dev`` (between releases), or X.Y.Z.

    From a release X.Y.Z: patch -> X.Y.(Z+1), minor -> X.(Y+1).0, major -> (X+1).0.0,
    dev -> X.Y.(Z+1).dev0. From X.Y.Z.devN (main after a release): patch -> X.Y.Z (the
    release it led to), minor/major as from X.Y.Z unless already there, dev -> X.Y.Z.dev(N+1).
    """
    cur = parse_version(current, "current version")
    major, minor, patch = cur.release
    dev = cur.dev
    if part == "dev":
        return f"{major}.{minor}.{patch}.dev{dev + 1}" if dev is not None else f"{major}.{minor}.{patch + 1}.dev0"
    if part == "patch":
        return f"{major}.{minor}.{patch}" if dev is not None else f"{major}.{minor}.{patch + 1}"
    if part == "minor":
        return f"{major}.{minor}.0" if dev is not None and patch == 0 else f"{major}.{minor + 1}.0"
    if part == "major":
        return f"{major}.0.0" if dev is not None and (minor, patch) == (0, 0) else f"{major + 1}.0.0"
    explicit = parse_version(part, "the requested version")
    if explicit <= cur:
        raise ReleaseError(f"requested version {part} is not above the current {current}")
    return part


# ---------------------------------------------------------------------- git


def git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if check and proc.returncode:
        raise ReleaseError(f"git {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def fetch_tags(root: Path) -> str:
    """Fetch the remote's tags (origin, else the only remote) so "above the last tag" sees every release.

    Returns what was done, for the log; raises when a remote exists but cannot be reached.
    """
    remotes = git(root, "remote").stdout.split()
    if not remotes:
        return "no git remote: compared with local tags only"
    remote = "origin" if "origin" in remotes else remotes[0]
    proc = git(root, "fetch", "--quiet", "--tags", remote, check=False)
    if proc.returncode:
        raise ReleaseError(
            f"could not fetch tags from {remote}: {proc.stderr.strip()}\n"
            "a release compares with every published tag; retry online (or pass --offline to compare with "
            "local tags only, at your own risk)"
        )
    return f"fetched tags from {remote}"


def package_tags(root: Path, pkg: Package) -> list[tuple[Version, str]]:
    """The package's release tags ``<distribution>-v<version>``, lowest version first."""
    prefix = f"{pkg.distribution}-v"
    out = []
    for tag in git(root, "tag", "--list", f"{prefix}*").stdout.split():
        try:
            out.append((Version(tag[len(prefix):]), tag))
        except InvalidVersion:
            continue
    return sorted(out)


def last_tag(root: Path, pkg: Package, exclude: str | None = None) -> tuple[Version, str] | None:
    tags = [t for t in package_tags(root, pkg) if t[1] != exclude]
    return tags[-1] if tags else None


def commit_subjects(root: Path, pkg: Package, since: str | None) -> list[str]:
    """Subjects of the commits that touched the package folder since ``since`` (a tag), oldest first."""
    rng = [f"{since}..HEAD"] if since else ["HEAD"]
    if git(root, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode:
        return []
    out = git(root, "log", "--reverse", "--format=%s", *rng, "--", pkg.path).stdout
    return [s for s in out.splitlines() if s.strip()]


# ---------------------------------------------------------------- changelog


@dataclass(frozen=True)
class Section:
    version: str
    heading: str  # the whole heading line
    start: int  # offset of the heading in the text
    end: int  # offset of the next heading of level 2 (or the end)

    @property
    def unreleased(self) -> bool:
        return self.version.lower() == "unreleased" or "unreleased" in self.heading.lower()


def sections(text: str) -> list[Section]:
    found = list(_HEADING.finditer(text))
    return [
        Section(m.group("version"), m.group(0), m.start(), found[i + 1].start() if i + 1 < len(found) else len(text))
        for i, m in enumerate(found)
    ]


def find_section(text: str, version: str) -> Section | None:
    for s in sections(text):
        try:
            if Version(s.version) == Version(version):
                return s
        except InvalidVersion:
            continue
    return None


def section_notes(text: str, version: str) -> str:
    """The body of ``version``'s section (what the GitHub release shows)."""
    s = find_section(text, version)
    if s is None:
        raise ReleaseError(f"the CHANGELOG has no '## {version}' section")
    return text[s.start + len(s.heading):s.end].strip() + "\n"


def open_section(text: str, version: str, subjects: Sequence[str], since: str | None) -> str:
    """Put ``## <version> (unreleased)`` on top with the commit subjects under it.

    An unreleased section already on top (written by hand or by an earlier bump) is renamed
    to ``version`` and keeps its text; its commit list is replaced.
    """
    since_text = since or "the first commit"
    commits = f"{_COMMITS_TITLE}{since_text}\n\n" + (
        "".join(f"- {s}\n" for s in subjects) if subjects else "- (none touched this package)\n"
    )
    heading = f"## {version} (unreleased)"
    secs = sections(text)
    if secs and secs[0].unreleased:
        top = secs[0]
        body = text[top.start + len(top.heading):top.end]
        body = re.sub(rf"\n{re.escape(_COMMITS_TITLE)}.*?(?=\n### |\Z)", "", body, flags=re.S).rstrip("\n")
        new = f"{heading}{body}\n\n{commits}\n"
        return text[:top.start] + new + text[top.end:].lstrip("\n")
    if find_section(text, version) is not None:
        raise ReleaseError(f"the CHANGELOG already has a '## {version}' section")
    insert_at = secs[0].start if secs else len(text)
    head = text[:insert_at].rstrip("\n") + "\n\n" if text[:insert_at].strip() else "# Changelog\n\n"
    rest = text[insert_at:]
    return head + f"{heading}\n\n{commits}\n" + rest


def changelog_problems(text: str, version: str) -> list[str]:
    s = find_section(text, version)
    if s is None:
        return [f"CHANGELOG.md has no '## {version}' section"]
    if s.unreleased:
        return [
            f"CHANGELOG.md's heading {s.heading.strip()!r} is still marked unreleased: "
            f"write '## {version} ({_dt.date.today().isoformat()})' when the section is final"
        ]
    if not section_notes(text, version).strip():
        return [f"CHANGELOG.md's '## {version}' section is empty"]
    return []


# ----------------------------------------------------------- sibling ranges


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def requirements(root: Path, pkg: Package) -> list[Requirement]:
    return [Requirement(r) for r in _load_toml(root / pkg.path / "pyproject.toml")["project"]["dependencies"]]


def sibling_requirements(root: Path, pkg: Package) -> dict[str, Requirement]:
    """The package's requirements on our other packages, by short name."""
    dists = {p.distribution: p.name for p in PACKAGES}
    return {dists[r.name]: r for r in requirements(root, pkg) if r.name in dists}


def lower_end(spec: SpecifierSet) -> Version | None:
    lows = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    return max(lows) if lows else None


def range_problems(root: Path, changed: Package | None = None, version: str | None = None) -> list[str]:
    """Sibling ranges that exclude the in-repo version of the sibling (with ``changed`` at ``version``)."""
    problems = []
    for pkg in PACKAGES:
        for sib, req in sibling_requirements(root, pkg).items():
            sib_pkg = by_name(sib)
            have = version if changed is not None and sib == changed.name else read_version(root, sib_pkg)
            if not req.specifier.contains(have, prereleases=True):
                problems.append(
                    f"{pkg.path}/pyproject.toml requires {req}, which excludes {sib_pkg.distribution} {have}"
                )
    return problems


def pypi_published(name: str, version: Version, timeout: float = 10.0) -> bool | None:
    """Whether PyPI has ``name`` at ``version``; None when PyPI cannot be reached."""
    try:
        with urllib.request.urlopen(PYPI_JSON.format(name=name), timeout=timeout) as r:
            releases = json.load(r).get("releases", {})
    except urllib.error.HTTPError as e:
        return False if e.code == 404 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None
    for v, files in releases.items():
        try:
            if Version(v) == version and any(not f.get("yanked") for f in files):
                return True
        except InvalidVersion:
            continue
    return False


def unpublished_floors(
    root: Path, pkg: Package, published: Callable[[str, Version], bool | None] = pypi_published
) -> tuple[list[str], list[str]]:
    """(problems, notes): sibling ranges whose lower end is not on PyPI; notes say what could not be checked."""
    problems, notes = [], []
    for sib, req in sibling_requirements(root, pkg).items():
        low = lower_end(req.specifier)
        if low is None:
            problems.append(f"{req}: a sibling range needs a lower end (>=)")
            continue
        found = published(req.name, low)
        if found is None:
            notes.append(f"PyPI not reachable: not checked that {req.name} {low} (the lower end of {req}) is published")
        elif not found:
            problems.append(
                f"{req.name} {low}, the lower end of {req}, is not published: release {by_name(sib).distribution} "
                "first, or raise the lower end to a published version"
            )
    return problems, notes


# -------------------------------------------------------------------- wheel


def wheel_problems(wheel: Path, pkg: Package, license_bytes: bytes) -> list[str]:
    """What is wrong with a built wheel of ``pkg``: layout, version file, entry point, LICENSE and its metadata."""
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        infos = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        if len(infos) != 1:
            return [f"{wheel.name}: expected one .dist-info folder, got {sorted(infos)}"]
        info = infos.pop()
        metadata = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        lic_path = f"{info}/licenses/LICENSE"
        license_text = zf.read(lic_path) if lic_path in names else None
        entry_points = zf.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
    top = {n.split("/")[0] for n in names}
    if "tests" in top:
        problems.append(f"{wheel.name} has a top-level tests/ folder")
    stray = sorted(t for t in top if t != pkg.module and not t.endswith(".dist-info"))
    if stray:
        problems.append(f"{wheel.name}: unexpected top-level entries {stray}; only {pkg.module}/ belongs there")
    if f"{pkg.module}/_version.py" not in names:
        problems.append(f"{wheel.name}: {pkg.module}/_version.py missing")
    if pkg.gpu and not re.search(rf"^\[flydsl\.families\]\s*\n{pkg.name}\s*=", entry_points, re.M):
        problems.append(f"{wheel.name}: no flydsl.families entry point named {pkg.name!r}")
    if license_text is None:
        problems.append(f"{wheel.name}: no LICENSE ({lic_path} missing)")
    elif license_text != license_bytes:
        problems.append(f"{wheel.name}: {lic_path} is not the repository LICENSE")
    if metadata.get("License-Expression") != "Apache-2.0" or "LICENSE" not in (metadata.get_all("License-File") or []):
        problems.append(f"{wheel.name}: METADATA lacks License-Expression: Apache-2.0 or License-File: LICENSE")
    return problems


# ----------------------------------------------------------- release checks


def tag_of(pkg: Package, version: str) -> str:
    return f"{pkg.distribution}-v{version}"


def tag_info(tag: str) -> tuple[Package, str]:
    """The package and version a release tag names; ReleaseError for anything else."""
    # Longest distribution first: no distribution of ours is a prefix of another today, but stay exact.
    for pkg in sorted(PACKAGES, key=lambda p: -len(p.distribution)):
        prefix = f"{pkg.distribution}-v"
        if tag.startswith(prefix):
            version = tag[len(prefix):]
            parse_version(version, f"the version in tag {tag!r}")
            if Version(version).is_prerelease:
                raise ReleaseError(f"tag {tag!r}: .devN versions are never released")
            return pkg, version
    raise ReleaseError(
        f"tag {tag!r} names no package: expected <distribution>-v<X.Y.Z> with one of "
        + ", ".join(p.distribution for p in PACKAGES)
    )


def release_problems(
    root: Path,
    pkg: Package,
    *,
    tagged: str | None = None,
    published: Callable[[str, Version], bool | None] | None = pypi_published,
) -> tuple[list[str], list[str]]:
    """(problems, notes) of releasing ``pkg`` at its in-repo version.

    Before tagging (``tagged`` None) the tag must not exist yet; in the release workflow
    (``tagged`` the pushed tag) it must be the tag of the in-repo version and point at HEAD.
    Either way the version must be above every other tag of the package. ``published`` None
    skips the PyPI look-up of sibling floors (with a note). Tags are compared as they are:
    call :func:`fetch_tags` first.
    """
    problems, notes = [], []
    version = read_version(root, pkg)
    try:
        v = parse_version(version, f"{version_file(root, pkg).relative_to(root)} version")
    except ReleaseError as e:
        return [str(e)], notes
    if v.is_prerelease:
        problems.append(
            f"{pkg.distribution} {version} is a .dev version: set the release version with "
            f"`nox -s bump-{pkg.name} -- patch|minor|major|X.Y.Z`"
        )
    tag = tag_of(pkg, version)
    existing = {t for _, t in package_tags(root, pkg)}
    if tagged is None:
        if tag in existing:
            problems.append(f"tag {tag} exists: {pkg.distribution} {version} is released; bump the version")
    else:
        if tagged != tag:
            problems.append(f"tag {tagged} does not match the in-repo version {version} ({tag})")
        elif tag not in existing:
            problems.append(f"tag {tag} does not exist")
        else:
            at = git(root, "rev-list", "-n", "1", tag).stdout.strip()
            head = git(root, "rev-parse", "HEAD").stdout.strip()
            if at != head:
                problems.append(f"tag {tag} points at {at[:12]}, not at the checked-out {head[:12]}")
    last = last_tag(root, pkg, exclude=tag)
    if last is not None and v <= last[0]:
        problems.append(f"{pkg.distribution} {version} is not above its last release tag {last[1]}")
    changelog = root / pkg.path / "CHANGELOG.md"
    problems += changelog_problems(changelog.read_text() if changelog.is_file() else "", version)
    problems += [p for p in range_problems(root) if p.startswith(f"{pkg.path}/")]
    if published is None:
        notes.append("PyPI look-up of sibling lower ends skipped (offline)")
    else:
        more, more_notes = unpublished_floors(root, pkg, published)
        problems += more
        notes += more_notes
    return problems, notes


# ---------------------------------------------------------------------- bump


def bump(root: Path, pkg: Package, part: str) -> tuple[str, str, list[str]]:
    """Set the new version and open its CHANGELOG section; returns (old, new, log lines).

    Refuses (before writing anything) when a sibling range in the repository would exclude
    the new version: widen those ranges first.
    """
    old = read_version(root, pkg)
    new = next_version(old, part)
    breaks = range_problems(root, pkg, new)
    if breaks:
        raise ReleaseError(
            f"{pkg.distribution} {new} would leave sibling ranges that exclude it:\n  " + "\n  ".join(breaks)
            + "\nwiden them (the upper end) where the dependent works with it, then bump again"
        )
    log = [f"{pkg.distribution}: {old} -> {new} ({version_file(root, pkg).relative_to(root)})"]
    write_version(root, pkg, new)
    if Version(new).is_prerelease:
        log.append("a .dev version: no CHANGELOG section (the next release bump opens one)")
        return old, new, log
    last = last_tag(root, pkg)
    since = last[1] if last else None
    subjects = commit_subjects(root, pkg, since)
    changelog = root / pkg.path / "CHANGELOG.md"
    text = changelog.read_text() if changelog.is_file() else "# Changelog\n"
    changelog.write_text(open_section(text, new, subjects, since))
    log.append(
        f"{changelog.relative_to(root)}: '## {new} (unreleased)' with {len(subjects)} commit subject(s) since "
        f"{since or 'the first commit'}; turn them into user-facing entries, then date the heading"
    )
    return old, new, log


# ---------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="release.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tag-info", help="the package and version of a release tag")
    t.add_argument("tag")
    t.add_argument("--github-output", help="append name=, distribution=, version= to this file")
    n = sub.add_parser("notes", help="a version's CHANGELOG section")
    n.add_argument("name")
    n.add_argument("version")
    b = sub.add_parser("bump", help="set a package's version and open its CHANGELOG section")
    b.add_argument("name")
    b.add_argument("part")
    ap.add_argument("--root", default=str(REPO_ROOT), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = Path(args.root)
    try:
        if args.cmd == "tag-info":
            pkg, version = tag_info(args.tag)
            if read_version(root, pkg) != version:
                raise ReleaseError(
                    f"tag {args.tag} names {version}, but {version_file(root, pkg).relative_to(root)} says "
                    f"{read_version(root, pkg)}"
                )
            lines = [f"name={pkg.name}", f"distribution={pkg.distribution}", f"version={version}"]
            if args.github_output:
                with open(args.github_output, "a") as f:
                    f.write("".join(line + "\n" for line in lines))
            print("\n".join(lines))
        elif args.cmd == "notes":
            pkg = by_name(args.name)
            print(section_notes((root / pkg.path / "CHANGELOG.md").read_text(), args.version), end="")
        elif args.cmd == "bump":
            _, _, log = bump(root, by_name(args.name), args.part)
            print("\n".join(log))
    except (ReleaseError, KeyError) as e:
        print(f"release.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
