"""Which packages a change touches, and which GPU CI shards should run for it.

    python ci/changed_packages.py                      # diff against origin/main (or HEAD~1)
    python ci/changed_packages.py --base v1.2          # diff against a ref (merge base .. working tree)
    python ci/changed_packages.py packages/fly-norm/src/fly_norm/__init__.py README.md
    git diff --name-only main | python ci/changed_packages.py -
    python ci/changed_packages.py --json               # ["runtime", "common", ...]
    python ci/changed_packages.py --shards [--json]    # enabled GPU shards of the touched families

Rules (:func:`touched_by`):

- a file of a package touches that package and every package that depends on
  it, so a runtime change touches everything and a common change touches
  common and every family (imports only go down, so the runtime is not);
- ``noxfile.py``, ``ci/``, ``.ci/``, ``.github/``, ``ruff.toml``,
  ``.gitignore`` (hatchling builds honour it) and any file not named below
  touch everything: unknown means test it all;
- documentation at the root (``*.md``, ``*.rst``, ``LICENSE*``, ``docs/``)
  touches nothing; nor does ``tools/`` (scripts run by hand; no test runs them).

GPU shards (:func:`shard_families`) follow the same rules, less what cannot change
what a GPU runs: a package's ``README.md``, ``CHANGELOG.md``, ``PERF.md`` and
``benchmarks/results/`` select no shard (they still touch the package for the CPU
jobs: the README is the wheel's description); a ``tools/`` path selects the
families whose ``[[family]] uses`` in ci/matrix.toml lists it (a file or a folder).

Importable: :func:`touched_by`, :func:`packages_for_paths`,
:func:`changed_paths`, :func:`load_matrix`, :func:`shards`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

CI_DIR = Path(__file__).resolve().parent
REPO_ROOT = CI_DIR.parent
if str(CI_DIR) not in sys.path:
    sys.path.insert(0, str(CI_DIR))

from monorepo import PACKAGES, by_folder, dependents, names  # noqa: E402

__all__ = ["touched_by", "packages_for_paths", "shard_families", "changed_paths", "load_matrix", "shards", "main"]

MATRIX_PATH = CI_DIR / "matrix.toml"
ALL = frozenset(names())
DOC_SUFFIXES = (".md", ".rst")
DOC_DIRS = ("docs",)


def _normalize(path: str) -> PurePosixPath:
    path = path.strip().replace("\\", "/")
    while path.startswith("./"):
        path = path[2:]
    return PurePosixPath(path)


def _is_root_doc(p: PurePosixPath) -> bool:
    if p.parts and p.parts[0] in DOC_DIRS:
        return True
    return len(p.parts) == 1 and (p.suffix.lower() in DOC_SUFFIXES or p.name.upper().startswith("LICENSE"))


def touched_by(path: str) -> frozenset[str]:
    """The packages (short names) that a change to ``path`` (relative to the repo root) touches."""
    p = _normalize(path)
    if not p.parts or str(p) == ".":
        return frozenset()
    if p.parts[0] == "packages" and len(p.parts) >= 3:
        pkg = by_folder(p.parts[1])
        if pkg is None:  # a package folder this list does not know yet: test everything
            return ALL
        return frozenset(d.name for d in dependents(pkg.name))
    if _is_root_doc(p) or p.parts[0] == "tools":
        return frozenset()
    if p.parts[0] == "packages" and p.suffix.lower() in DOC_SUFFIXES:  # packages/README.md and the like
        return frozenset()
    # noxfile.py, ci/, .ci/, .github/, ruff.toml, .gitignore and anything unknown.
    return ALL


def packages_for_paths(paths: Iterable[str]) -> list[str]:
    """Touched packages in the canonical order (lowest layer first)."""
    touched: set[str] = set()
    for path in paths:
        if path.strip():
            touched |= touched_by(path)
    return [n for n in names() if n in touched]


GPU_IRRELEVANT_FILES = ("README.md", "CHANGELOG.md", "PERF.md")  # at a package's root
GPU_IRRELEVANT_DIRS = (("benchmarks", "results"),)  # under a package's root


def _uses(fam: dict[str, Any], p: PurePosixPath) -> bool:
    for used in fam.get("uses", []):
        u = PurePosixPath(used.rstrip("/"))
        if p == u or u in p.parents:
            return True
    return False


def shard_families(paths: Iterable[str], matrix: dict[str, Any] | None = None) -> list[str]:
    """The families (and runtime) whose GPU shards a change to ``paths`` must run, lowest layer first."""
    matrix = matrix if matrix is not None else load_matrix()
    selected: set[str] = set()
    for path in paths:
        if not path.strip():
            continue
        p = _normalize(path)
        if p.parts and p.parts[0] == "tools":
            selected |= {f["name"] for f in matrix["family"] if _uses(f, p)}
            continue
        if p.parts and p.parts[0] == "packages" and len(p.parts) >= 3 and by_folder(p.parts[1]) is not None:
            inner = p.parts[2:]
            if len(inner) == 1 and inner[0] in GPU_IRRELEVANT_FILES:
                continue
            if any(inner[: len(d)] == d and len(inner) > len(d) for d in GPU_IRRELEVANT_DIRS):
                continue
        selected |= touched_by(path)
    families = {f["name"] for f in matrix["family"]}
    return [n for n in names() if n in selected and n in families]


# ---------------------------------------------------------------------- git


def _git(*args: str, cwd: Path = REPO_ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def _ref_exists(ref: str, cwd: Path) -> bool:
    try:
        _git("rev-parse", "--verify", "-q", f"{ref}^{{commit}}", cwd=cwd)
    except subprocess.CalledProcessError:
        return False
    return True


def default_base(cwd: Path = REPO_ROOT) -> str | None:
    for ref in ("origin/main", "HEAD~1"):
        if _ref_exists(ref, cwd):
            return ref
    return None


def changed_paths(base: str | None = None, cwd: Path = REPO_ROOT) -> list[str] | None:
    """Files changed since the merge base of ``base`` and HEAD, including uncommitted and untracked ones.

    Returns None when the base cannot be resolved (no such ref, a shallow clone, a
    first commit): the caller should then treat everything as touched.
    """
    base = base or default_base(cwd)
    if base is None or not _ref_exists(base, cwd):
        return None
    try:
        merge_base = _git("merge-base", base, "HEAD", cwd=cwd).strip()
        # --no-renames lists both ends of a move, so a file moved out of a package touches it.
        diff = _git("diff", "--name-only", "--no-renames", merge_base, cwd=cwd)
        untracked = _git("ls-files", "--others", "--exclude-standard", cwd=cwd)
    except subprocess.CalledProcessError:
        return None
    return sorted({line for line in (diff + untracked).splitlines() if line.strip()})


# ------------------------------------------------------------------- matrix


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def load_matrix(path: Path | str = MATRIX_PATH) -> dict[str, Any]:
    """Read and validate ci/matrix.toml; raises ValueError naming the first problem."""
    data = _load_toml(Path(path))
    if data.get("schema") != 1:
        raise ValueError(f"{path}: expected schema = 1, got {data.get('schema')!r}")
    gpu_packages = {p.name for p in PACKAGES if p.shard}
    families = data.get("family")
    archs = data.get("arch")
    if not families or not archs:
        raise ValueError(f"{path}: needs [[family]] and [[arch]] tables")
    seen: set[str] = set()
    for fam in families:
        name = fam.get("name")
        if name not in gpu_packages:
            raise ValueError(f"{path}: family {name!r} is not a GPU package ({', '.join(sorted(gpu_packages))})")
        if name in seen:
            raise ValueError(f"{path}: family {name!r} listed twice")
        seen.add(name)
        if fam.get("session") != f"gpu-{name}":
            raise ValueError(f"{path}: family {name!r} must run session 'gpu-{name}', got {fam.get('session')!r}")
        uses = fam.get("uses", [])
        if not isinstance(uses, list) or not all(isinstance(u, str) and u.startswith("tools/") for u in uses):
            raise ValueError(f"{path}: family {name!r}: uses must be a list of tools/ paths, got {uses!r}")
        labels = fam.get("labels", [])
        if not isinstance(labels, list) or not all(isinstance(label, str) and label for label in labels):
            raise ValueError(f"{path}: family {name!r}: labels must be a list of runner labels, got {labels!r}")
        if not isinstance(fam.get("enabled", True), bool):
            raise ValueError(f"{path}: family {name!r}: enabled must be true or false")
        if not fam.get("enabled", True) and not fam.get("reason"):
            raise ValueError(f"{path}: disabled family {name!r} needs a reason")
    ids: set[str] = set()
    for arch in archs:
        aid = arch.get("id")
        if not isinstance(aid, str) or not aid or aid in ids:
            raise ValueError(f"{path}: arch id {aid!r} missing or repeated")
        ids.add(aid)
        if not isinstance(arch.get("enabled"), bool):
            raise ValueError(f"{path}: arch {aid!r} needs enabled = true|false")
        if not arch["enabled"] and not arch.get("reason"):
            raise ValueError(f"{path}: disabled arch {aid!r} needs a reason")
        runner = arch.get("runner")
        if not runner or not all(isinstance(label, str) and label for label in runner):
            raise ValueError(f"{path}: arch {aid!r} needs runner = [labels]")
        if aid not in runner:
            raise ValueError(f"{path}: arch {aid!r} runner labels must include the arch id")
    return data


def shards(
    matrix: dict[str, Any] | None = None,
    families: Iterable[str] | None = None,
    *,
    include_disabled: bool = False,
) -> list[dict[str, Any]]:
    """GPU shards (family x arch) for ``families`` (default: all), enabled ones unless asked otherwise.

    A shard is enabled when its arch and its family both are (a family's ``enabled = false`` needs a
    ``reason``, as an arch's does); its runner labels are the arch's plus the family's ``labels``.
    """
    matrix = matrix if matrix is not None else load_matrix()
    wanted = None if families is None else set(families)
    out = []
    for fam in matrix["family"]:
        if wanted is not None and fam["name"] not in wanted:
            continue
        for arch in matrix["arch"]:
            enabled = arch["enabled"] and fam.get("enabled", True)
            if not enabled and not include_disabled:
                continue
            out.append(
                {
                    "id": f"{fam['name']}-{arch['id']}",
                    "family": fam["name"],
                    "arch": arch["id"],
                    "session": fam["session"],
                    # the arch's labels, then the family's own (a multi-GPU runner for comm)
                    "runner": list(arch["runner"]) + [x for x in fam.get("labels", []) if x not in arch["runner"]],
                    "enabled": enabled,
                    "timeout_minutes": arch.get("timeout_minutes", 60),
                }
            )
    return out


# ---------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="changed_packages.py",
        description="Print the packages a change touches (lowest layer first), or their GPU CI shards.",
    )
    ap.add_argument("paths", nargs="*", help="changed paths relative to the repo root; '-' reads them from stdin")
    ap.add_argument("--base", help="git ref to diff against (default: origin/main, else HEAD~1)")
    ap.add_argument("--all", action="store_true", help="every package (scheduled runs, manual runs)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--shards", action="store_true", help="print the enabled GPU shards the change selects")
    ap.add_argument("--families", action="store_true",
                    help="print the families (and runtime) whose GPU shards the change selects")
    ap.add_argument("--matrix", default=str(MATRIX_PATH), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    paths: list[str] | None = None
    if args.all:
        touched = names()
    elif args.paths:
        paths = []
        for p in args.paths:
            paths.extend(sys.stdin.read().splitlines() if p == "-" else [p])
        touched = packages_for_paths(paths)
    else:
        paths = changed_paths(args.base)
        if paths is None:
            print(
                f"changed_packages: cannot diff against {args.base or 'origin/main or HEAD~1'}; "
                "treating every package as touched",
                file=sys.stderr,
            )
            touched = names()
        else:
            touched = packages_for_paths(paths)

    if args.shards or args.families:
        matrix = load_matrix(args.matrix)
        families = [f["name"] for f in matrix["family"]] if paths is None else shard_families(paths, matrix)
        if args.families:
            print(json.dumps(families) if args.json else " ".join(families))
            return 0
        rows = shards(matrix, families)
        if args.json:
            print(json.dumps(rows))
        else:
            for r in rows:
                print(f"{r['id']:<18} {r['session']:<16} {','.join(r['runner'])}")
        return 0
    print(json.dumps(touched) if args.json else " ".join(touched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
