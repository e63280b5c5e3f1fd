"""What a user gets from the wheels, with nothing of this repository's pins.

``test_family_from_wheels_runs_its_cpu_suite`` builds the wheels of
flydsl-runtime, flydsl-common and fly-gemm, installs them into a fresh virtual
environment the way a user would (third-party dependencies resolved by pip as
configured, NOT through ci/constraints-cpu.txt: torch and triton at the GPU
machine's versions, as a user's existing install; numpy and the test tools
whatever is newest), and runs fly-gemm's CPU suite there, outside the
repository. Such an install once got numpy 2.4, on which Triton 3.6's
interpreter failed 181 gemm tests. It takes a few minutes.

``test_installed_flydsl_leaves_other_projects_test_runs_alone``: FlyDSL's
pytest plugin is opt-in; a plain pytest run of an unrelated project in an
environment with FlyDSL installed sees no FlyDSL at all.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "ci") not in sys.path:
    sys.path.insert(0, str(ROOT / "ci"))

import cpu_stack  # noqa: E402

FAMILY = ("fly-gemm", "packages/fly-gemm", "fly_gemm")
STACK = [("flydsl-runtime", "packages/flydsl-runtime", "flydsl"), ("flydsl-common", "packages/fly-common",
                                                                   "flydsl_common"), FAMILY]
OURS = ("flydsl-runtime", "flydsl-common", "fly-norm", "fly-gemm", "fly-attention", "fly-conv", "fly-comm")


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would steer the child: no backend choice, no pytest
    options or plugin settings, no import path into the repository. pip's own configuration stays."""
    drop = ("TRITON_INTERPRET", "PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
            "PIP_CONSTRAINT", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("FLYDSL_")}
    env.update(extra)
    return env


def _run(cmd: list, cwd: Path, timeout: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env or _clean_env())
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n" \
                                 f"{proc.stderr[-4000:]}"
    return proc


def test_family_from_wheels_runs_its_cpu_suite(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path, 300)
    py = venv / "bin" / "python"
    wheelhouse = tmp_path / "wheelhouse"
    for _, path, _ in STACK:
        _run([py, "-m", "pip", "wheel", "--no-deps", "-q", "--wheel-dir", wheelhouse, ROOT / path], tmp_path, 600)
    wheels = {re.sub(r"_", "-", w.name.split("-")[0]): w for w in wheelhouse.glob("*.whl")}
    assert sorted(wheels) == sorted(d for d, _, _ in STACK), wheels
    for wheel in wheels.values():  # every wheel carries the repository's license
        with zipfile.ZipFile(wheel) as zf:
            (lic,) = [n for n in zf.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            assert zf.read(lic) == (ROOT / "LICENSE").read_bytes()

    # The user's torch and triton: the versions of the GPU machine (ci/constraints-cpu.txt), the
    # torch without its "+cpu" label (pip's CPU wheel source supplies that build; unpinned, pip would
    # take the newest CUDA torch from PyPI, gigabytes, with a newer triton). Our three from their
    # wheel files (no index copy of ours can be picked); everything else (numpy, tqdm, test tools)
    # as pip resolves it.
    torch_version = cpu_stack.torch_pin().split("+", 1)[0]
    triton_version = cpu_stack.pin("triton")
    family_wheel = wheels[FAMILY[0]]
    _run([py, "-m", "pip", "install", "-q", torch_version, triton_version,
          *[w for d, w in wheels.items() if d != FAMILY[0]], f"{family_wheel}[test]", "matplotlib"], tmp_path, 900)

    listed = _run([py, "-m", "pip", "list", "--format=freeze"], tmp_path, 120).stdout
    versions = dict(line.split("==", 1) for line in listed.splitlines() if "==" in line)
    ours = sorted(n for n in versions if n.lower() in OURS)
    assert ours == sorted(d for d, _, _ in STACK), f"distributions of ours: {ours}"
    print("resolved:", {k: versions.get(k) for k in ("torch", "triton", "numpy", "pytest")})
    assert versions["torch"].split("+")[0] == torch_version.split("==")[1], versions["torch"]

    tests = tmp_path / "run" / "tests"
    shutil.copytree(ROOT / FAMILY[1] / "tests", tests, ignore=shutil.ignore_patterns("__pycache__"))
    where = _run([py, "-c", f"import {FAMILY[2]}; print({FAMILY[2]}.__file__)"], tests.parent, 300).stdout
    assert Path(where.strip()).resolve().is_relative_to(venv.resolve()), where
    proc = _run([py, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-n", "2", "--rootdir", tests.parent],
                tests.parent, 1500)
    assert re.search(r"\d+ passed", proc.stdout) and " failed" not in proc.stdout, proc.stdout[-3000:]


# ------------------------------------------------- the pytest plugin is opt-in

PROJECT_TESTS = '''
import os

import pytest


def test_flydsl_left_triton_alone():
    assert "TRITON_INTERPRET" not in os.environ, os.environ.get("TRITON_INTERPRET")


@pytest.mark.gpu
def test_my_own_gpu_marker_is_mine():
    pass
'''


def _flydsl_installed() -> bool:
    try:
        metadata.distribution("flydsl-runtime")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _flydsl_installed(), reason="needs FlyDSL installed in this interpreter (nox -s tests)")
def test_installed_flydsl_leaves_other_projects_test_runs_alone(tmp_path):
    mine = [(ep.dist.name if ep.dist else "?", ep.value) for ep in metadata.entry_points(group="pytest11")
            if ep.dist and ep.dist.name.lower() in OURS]
    assert mine == [], f"our distributions register pytest plugins with every pytest run: {mine}"

    project = tmp_path / "unrelated"
    project.mkdir()
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: this project's own GPU tests\n")
    (project / "test_project.py").write_text(textwrap.dedent(PROJECT_TESTS))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist"]

    plain = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=600, env=_clean_env())
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "2 passed" in plain.stdout and "skipped" not in plain.stdout, plain.stdout

    # The same project opting in: the plugin imports flydsl (which fixes TRITON_INTERPRET for the
    # process) and on a machine without a GPU skips gpu-marked tests. Shows the check above can fail.
    opted = subprocess.run([*cmd, "-p", "flydsl.testing.plugin"], cwd=project, capture_output=True, text=True,
                           timeout=600, env=_clean_env())
    assert "FAILED test_project.py::test_flydsl_left_triton_alone" in opted.stdout, opted.stdout + opted.stderr
