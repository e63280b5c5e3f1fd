"""Packaging metadata every package shares: license, URLs, classifiers, the opt-in pytest plugin,
the pytest configuration, and the CPU stack's torch check (ci/cpu_stack.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cpu_stack
import monorepo

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "ci"  # on sys.path through conftest.py

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PACKAGES = monorepo.PACKAGES


def _project(pkg) -> dict:
    with open(ROOT / pkg.path / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_repository_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_license_shipped_in_wheel_and_sdist(pkg):
    project = _project(pkg)
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    # hatch takes license files from the package folder: a byte-identical copy of the repository's.
    assert (ROOT / pkg.path / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert "LICENSE" in project["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_urls_and_classifiers(pkg):
    project = _project(pkg)["project"]
    urls = project["urls"]
    assert set(urls) == {"Homepage", "Source", "Issues", "Changelog"}
    assert urls["Changelog"].endswith(f"/{pkg.path}/CHANGELOG.md") and urls["Source"].endswith(f"/{pkg.path}")
    classifiers = project["classifiers"]
    python = re.compile(r"Programming Language :: Python :: (3\.\d+)")
    versions = [m.group(1) for m in map(python.fullmatch, classifiers) if m]
    assert versions == ["3.10", "3.11", "3.12", "3.13"]
    assert project["requires-python"] == ">=3.10"
    assert sum(c.startswith("Development Status :: ") for c in classifiers) == 1
    # PEP 639: the license expression replaces License classifiers.
    assert not [c for c in classifiers if c.startswith("License ::")]


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_pytest_plugin_is_opt_in_and_each_suite_opts_in(pkg):
    project = _project(pkg)["project"]
    assert "pytest11" not in project.get("entry-points", {}), "a pytest11 entry point loads into every pytest run"
    conftest = (ROOT / pkg.path / "tests" / "conftest.py").read_text()
    assert re.search(r'^pytest_plugins = \["flydsl\.testing\.plugin"\]', conftest, re.M)


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_interpreter_warnings_filtered_narrowly(pkg):
    filters = _project(pkg)["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert filters, "the interpreter's numpy warnings flood the test summary"
    for f in filters:
        action, message, category, module = f.split(":")[:4]
        assert action == "ignore" and message and category and module == "triton.runtime.interpreter", f


def test_constraints_leave_numpy_free():
    pins = [ln.split("#", 1)[0].strip() for ln in (CI / "constraints-cpu.txt").read_text().splitlines()]
    assert not [p for p in pins if re.match(r"numpy\b", p)], "numpy needs no bound: the runtime adapts the interpreter"
    assert re.fullmatch(r"torch==[\d.]+\+cpu", cpu_stack.torch_pin())


def test_missing_cpu_torch_source_is_reported_with_the_fix(tmp_path):
    """pip pointed at an index without the CPU torch (as PyPI alone is): the message says what to set."""
    empty = tmp_path / "index"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty))
    venv = tmp_path / "venv"  # no torch installed: pip must find it in its sources
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    problem = cpu_stack.cpu_torch_problem(str(venv / "bin" / "python"), env=env)
    assert problem is not None
    assert f"PIP_EXTRA_INDEX_URL={cpu_stack.TORCH_CPU_INDEX}" in problem and cpu_stack.torch_pin() in problem
    assert "pip said:" in problem


def test_torch_pin_missing_is_an_error(tmp_path):
    bad = tmp_path / "c.txt"
    bad.write_text("triton==3.6.0\n# torch==1.0\n")
    with pytest.raises(ValueError, match="pins no torch"):
        cpu_stack.torch_pin(bad)
