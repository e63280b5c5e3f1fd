"""The ci/ helpers (monorepo, changed_packages, cpu_stack, release, floors) are scripts, not an installed
package: the tests import them from the ci/ folder. Shared here: a recording load of noxfile.py, and a
temporary git monorepo shaped like this one."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "ci"
if str(CI) not in sys.path:
    sys.path.insert(0, str(CI))

import monorepo  # noqa: E402


def load_noxfile_sessions(monkeypatch) -> dict[str, dict]:
    """Load noxfile.py against a stand-in ``nox`` that records every session it defines."""
    found: dict[str, dict] = {}

    def session(func=None, /, **kw):
        def record(f):
            name = kw.get("name") or f.__name__
            assert name not in found, f"session {name} defined twice"
            found[name] = {"tags": list(kw.get("tags") or []), "python": kw.get("python", None), "doc": f.__doc__}
            return f

        return record(func) if func is not None else record

    stub = types.ModuleType("nox")
    stub.session = session
    stub.options = types.SimpleNamespace()
    stub.Session = object
    stub.command = types.SimpleNamespace(CommandFailed=RuntimeError)
    monkeypatch.setitem(sys.modules, "nox", stub)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found["__options__"] = vars(stub.options)
    return found


class GitRepo:
    """A temporary repository with every package's real pyproject.toml, a version file and a CHANGELOG."""

    def __init__(self, path: Path):
        self.path = path

    def git(self, *args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid", "-c", "tag.gpgSign=false",
             "-c", "commit.gpgSign=false", *args],
            cwd=self.path, check=True, capture_output=True, text=True,
        ).stdout

    def write(self, rel: str, text: str) -> Path:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def commit(self, subject: str, *paths: str) -> None:
        self.git("add", "--", *(paths or ["."]))
        self.git("commit", "-q", "-m", subject)

    def version_file(self, name: str) -> Path:
        pkg = monorepo.by_name(name)
        return self.path / pkg.path / "src" / pkg.module / "_version.py"

    def changelog(self, name: str) -> Path:
        return self.path / monorepo.by_name(name).path / "CHANGELOG.md"


@pytest.fixture
def repo(tmp_path) -> GitRepo:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    r = GitRepo(tmp_path / "repo")
    r.path.mkdir()
    r.git("init", "-q", "-b", "main")
    shutil.copy(ROOT / "LICENSE", r.path / "LICENSE")
    for pkg in monorepo.PACKAGES:
        (r.path / pkg.path).mkdir(parents=True)
        shutil.copy(ROOT / pkg.path / "pyproject.toml", r.path / pkg.path / "pyproject.toml")
        r.write(f"{pkg.path}/src/{pkg.module}/_version.py", '__version__ = "0.1.0"\n')
        r.write(f"{pkg.path}/src/{pkg.module}/__init__.py", "")
        r.write(f"{pkg.path}/CHANGELOG.md", "# Changelog\n\n## 0.1.0 (2026-01-01)\n\n- First release.\n")
    r.commit("initial layout")
    return r
