"""Fail a pull request that changes a package's code without a CHANGELOG entry.

    python ci/changelog_check.py --base origin/main [--labels "label1,label2"]

A package's code is what ships in its wheel or decides what it installs: ``src/`` and
``pyproject.toml``. Tests, benchmarks, README and PERF.md need no entry. An entry is a
line added to the package's ``CHANGELOG.md`` in the same change (the merge base of
``--base`` and HEAD to HEAD). The label ``no-changelog`` skips the check (internal
refactors, comments); the job prints what it skipped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

CI_DIR = Path(__file__).resolve().parent
if str(CI_DIR) not in sys.path:
    sys.path.insert(0, str(CI_DIR))

from monorepo import PACKAGES, Package, by_folder  # noqa: E402

SKIP_LABEL = "no-changelog"
CODE = ("src",)
CODE_FILES = ("pyproject.toml",)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def code_changed(paths: Sequence[str]) -> list[Package]:
    """Packages whose code (``src/``, ``pyproject.toml``) a change touches, lowest layer first."""
    hit = set()
    for path in paths:
        p = PurePosixPath(path)
        if len(p.parts) >= 3 and p.parts[0] == "packages":
            pkg = by_folder(p.parts[1])
            if pkg is None:
                continue
            if (p.parts[2] in CODE and len(p.parts) > 3) or (len(p.parts) == 3 and p.parts[2] in CODE_FILES):
                hit.add(pkg.name)
    return [p for p in PACKAGES if p.name in hit]


def added_entry(root: Path, base: str, pkg: Package) -> bool:
    """Whether the change adds a non-blank line to the package's CHANGELOG.md."""
    diff = _git(root, "diff", "--unified=0", f"{base}...HEAD", "--", f"{pkg.path}/CHANGELOG.md")
    return any(
        line.startswith("+") and not line.startswith("+++") and line[1:].strip() for line in diff.splitlines()
    )


def check(root: Path, base: str, labels: Sequence[str]) -> tuple[bool, list[str]]:
    """(passed, report lines)."""
    paths = _git(root, "diff", "--name-only", "--no-renames", f"{base}...HEAD").splitlines()
    changed = code_changed(paths)
    if not changed:
        return True, ["no package code changed: no CHANGELOG entry needed"]
    missing = [p for p in changed if not added_entry(root, base, p)]
    lines = [f"{p.path}: code changed, CHANGELOG.md {'has no new entry' if p in missing else 'updated'}"
             for p in changed]
    if not missing:
        return True, lines
    if SKIP_LABEL in labels:
        return True, [*lines, f"label {SKIP_LABEL!r}: the missing entries are accepted"]
    return False, [
        *lines,
        "add a line to the CHANGELOG.md of each package above, under its unreleased section (what a user of the "
        f"package notices), or, for a change no user notices, ask a maintainer for the {SKIP_LABEL!r} label",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="changelog_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the branch the pull request goes into, e.g. origin/main")
    ap.add_argument("--labels", default="", help="the pull request's labels, comma-separated")
    ap.add_argument("--root", default=str(CI_DIR.parent), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    labels = [label.strip() for label in args.labels.split(",") if label.strip()]
    try:
        ok, lines = check(Path(args.root), args.base, labels)
    except subprocess.CalledProcessError as e:
        print(f"changelog_check: git {' '.join(e.cmd[1:])} failed: {e.stderr.strip()}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
