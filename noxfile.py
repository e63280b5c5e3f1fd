"""Build, test, benchmark and release each FlyDSL package on its own.

    nox -l                          every session
    nox -s tests                    every package's CPU suite in one environment (CI: .ci/run)
    nox -s test-norm -- -n auto     one package; arguments after -- go to pytest
    nox -s lint                     ruff on packages/, ci/ and this file
    nox -s build-gemm               sdist + wheel, twine check, check-wheel-contents
    nox -s isolation-gemm           the wheels alone in a fresh environment, tests run outside packages/
    nox -s release-gemm             dry run; `-- --publish` tags <distribution>-v<version> and uploads
    nox -t gpu                      every GPU shard (gpu-common, gpu-norm, ...): needs a CUDA GPU
    nox -s gpu-gemm -- --bench      one shard, benchmarks too
    nox -s bench-gemm               benchmarks only
    nox -s demo                     every installed family's kernels on small problems against torch

Every session comes from the one package list in ci/monorepo.py. CPU
environments pin a CPU build of torch and the triton of the GPU machine
(ci/constraints-cpu.txt); GPU sessions use the interpreter that runs nox, with
its preinstalled CUDA torch and triton, and never install third-party packages.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "ci"))

from cpu_stack import cpu_torch_problem  # noqa: E402
from monorepo import PACKAGES, Package, install_order  # noqa: E402

CONSTRAINTS = str(ROOT / "ci" / "constraints-cpu.txt")
LICENSE = ROOT / "LICENSE"  # each package carries a copy (hatch packs license files from the package folder)

# The CPU stack, pinned in ci/constraints-cpu.txt: a CPU-only torch ("+cpu") and the triton
# of the GPU machine; numpy as it comes (the runtime adapts Triton's interpreter to numpy
# >= 2.4). PyPI carries only CUDA builds of torch for Linux, so pip must know a CPU wheel
# source to resolve torch==X+cpu: PyTorch's CPU wheel index as an extra index
# (PIP_EXTRA_INDEX_URL, or `pip config set global.extra-index-url ...`; a CI variable in
# .github/workflows/ci.yml), or a local wheel folder in pip's configuration.
# _install_cpu_stack checks that first and says what to configure (ci/cpu_stack.py).
CPU_STACK = ("torch", "triton", "numpy")
TEST_TOOLS = ("pytest", "pytest-xdist", "hypothesis", "tqdm", "matplotlib")
CI_TEST_TOOLS = ("pytest", "pyyaml", "nox", "tomli; python_version < '3.11'")  # nox: checks the noxfile
BUILD_TOOLS = ("build", "twine", "check-wheel-contents")
PYTEST_FLAGS = ("-p", "no:cacheprovider")

nox.options.sessions = ["lint", "tests"]  # a bare `nox`
nox.options.error_on_external_run = True


# ------------------------------------------------------------------ helpers


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _tests_dir(pkg: Package) -> Path:
    return ROOT / pkg.path / "tests"


_CPU_TORCH_FOUND = False  # checked once per nox run


def _require_cpu_torch_source(session: nox.Session) -> None:
    """Stop with what to configure when pip cannot find the pinned CPU torch (before a long install fails)."""
    global _CPU_TORCH_FOUND
    if _CPU_TORCH_FOUND:
        return
    problem = cpu_torch_problem(str(Path(session.bin) / "python"))
    if problem:
        session.error(problem)
    _CPU_TORCH_FOUND = True


def _install_cpu_stack(session: nox.Session, *extra: str) -> None:
    _require_cpu_torch_source(session)
    session.install("-c", CONSTRAINTS, *CPU_STACK, *TEST_TOOLS, *extra)


def _installed_ours(session: nox.Session, python: str = "python") -> dict[str, dict]:
    """Our distributions (names starting with "fly") that pip sees in the session's environment."""
    out = session.run(
        python, "-m", "pip", "list", "--format=json", silent=True, stderr=subprocess.DEVNULL, external=True
    )
    rows = json.loads(str(out).strip().splitlines()[-1])
    return {_canon(r["name"]): r for r in rows if _canon(r["name"]).startswith("fly")}


def _guard_editable(session: nox.Session, pkgs: list[Package], *, exact: bool, python: str = "python") -> None:
    """Each of ``pkgs`` is an editable install of this checkout: no PyPI copy of ours sneaked in."""
    ours = _installed_ours(session, python)
    problems = []
    for pkg in pkgs:
        row = ours.get(_canon(pkg.distribution))
        where = row and row.get("editable_project_location")
        if row is None:
            problems.append(f"{pkg.distribution} is not installed")
        elif not where or Path(where).resolve() != (ROOT / pkg.path).resolve():
            problems.append(f"{pkg.distribution} {row['version']} is not an editable install of {ROOT / pkg.path}"
                            f" (editable location: {where or 'none'})")
    if exact:
        extra = sorted(set(ours) - {_canon(p.distribution) for p in pkgs})
        if extra:
            problems.append(f"unexpected distributions of ours (or a stranger's fly-*): {', '.join(extra)}")
    if problems:
        session.error("pip list guard failed:\n  " + "\n  ".join(problems))
    session.log("pip list guard: " + ", ".join(f"{p.distribution} (editable)" for p in pkgs))


def _install_editable(session: nox.Session, pkgs: list[Package]) -> None:
    args = [a for p in pkgs for a in ("-e", str(ROOT / p.path))]
    session.install("-c", CONSTRAINTS, *args)
    _guard_editable(session, pkgs, exact=True)


def _pytest(session: nox.Session, pkg: Package, *args: str) -> None:
    tests = _tests_dir(pkg)
    if not tests.is_dir():
        session.error(f"{pkg.path} has no tests/ folder: every package ships its CPU tests")
    session.run("pytest", str(tests.relative_to(ROOT)), *PYTEST_FLAGS, *args)


def _read_version(pkg: Package) -> str:
    text = (ROOT / pkg.path / "src" / pkg.module / "_version.py").read_text()
    m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
    if not m:
        raise RuntimeError(f"no __version__ in {pkg.path}/src/{pkg.module}/_version.py")
    return m.group(1)


def _dist_stem(pkg: Package) -> str:
    """The distribution name as wheel and sdist file names spell it."""
    return re.sub(r"[-_.]+", "_", pkg.distribution).lower()


def _build(session: nox.Session, pkg: Package, outdir: Path) -> tuple[Path, Path]:
    """Build the sdist, then the wheel from the sdist (which proves the sdist is complete), and check both."""
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    session.run("python", "-m", "build", "--outdir", str(outdir), str(ROOT / pkg.path))
    stem = _dist_stem(pkg)
    sdists = sorted(outdir.glob(f"{stem}-*.tar.gz"))
    wheels = sorted(outdir.glob(f"{stem}-*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        session.error(f"expected one sdist and one wheel of {pkg.distribution} in {outdir}, got {sdists + wheels}")
    sdist, wheel = sdists[0], wheels[0]
    session.run("twine", "check", "--strict", str(sdist), str(wheel))
    session.run("check-wheel-contents", str(wheel))
    _check_wheel(session, pkg, wheel)
    _check_sdist(session, pkg, sdist)
    return sdist, wheel


def _check_wheel(session: nox.Session, pkg: Package, wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        if len(dist_info) != 1:
            session.error(f"{wheel.name}: expected one .dist-info folder, got {sorted(dist_info)}")
        info = dist_info.pop()
        entry_points = zf.read(f"{info}/entry_points.txt").decode() if pkg.gpu else ""
        metadata = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        license_text = zf.read(f"{info}/licenses/LICENSE") if f"{info}/licenses/LICENSE" in names else None
    top = {n.split("/")[0] for n in names}
    if "tests" in top:
        session.error(f"{wheel.name} has a top-level tests/ folder")
    stray = sorted(t for t in top if t != pkg.module and not t.endswith(".dist-info"))
    if stray:
        session.error(f"{wheel.name}: unexpected top-level entries {stray}; only {pkg.module}/ belongs there")
    if f"{pkg.module}/_version.py" not in names:
        session.error(f"{wheel.name}: {pkg.module}/_version.py missing")
    if pkg.gpu and not re.search(rf"^\[flydsl\.families\]\s*\n{pkg.name}\s*=", entry_points, re.M):
        session.error(f"{wheel.name}: no flydsl.families entry point named {pkg.name!r}")
    if license_text != LICENSE.read_bytes():
        session.error(f"{wheel.name}: .dist-info/licenses/LICENSE is {'missing' if license_text is None else 'not'}"
                      f"{'' if license_text is None else ' the repository LICENSE'}")
    if metadata.get("License-Expression") != "Apache-2.0" or "LICENSE" not in (metadata.get_all("License-File") or []):
        session.error(f"{wheel.name}: METADATA lacks License-Expression: Apache-2.0 or License-File: LICENSE")
    session.log(f"{wheel.name}: top level {sorted(top)}, no tests/")


def _check_sdist(session: nox.Session, pkg: Package, sdist: Path) -> None:
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    needed = ["pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", f"src/{pkg.module}/__init__.py"]
    if _tests_dir(pkg).is_dir():
        needed.append("tests")
    missing = [n for n in needed if n not in members and not any(m.startswith(n + "/") for m in members)]
    if missing:
        session.error(f"{sdist.name} lacks {missing}")


def _third_party_requirements(wheels: list[Path]) -> list[str]:
    """Requires-Dist of the wheels, without our own packages and without extras."""
    reqs = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(zf.read(meta_name).decode())
        for req in meta.get_all("Requires-Dist") or []:
            name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]
            if "extra ==" in req or _canon(name).startswith("fly"):
                continue
            reqs.append(req)
    return sorted(set(reqs))


def _isolation(
    session: nox.Session,
    pkg: Package,
    wheelhouse: Path,
    pytest_args: list[str],
    prebuilt: dict[str, Path] | None = None,
) -> None:
    """Install ``pkg`` from wheels alone (ours from ``wheelhouse`` only) and run its tests outside the repo."""
    prebuilt = prebuilt or {}
    session.install("-c", CONSTRAINTS, "build")
    shutil.rmtree(wheelhouse, ignore_errors=True)
    wheelhouse.mkdir(parents=True)
    wheels = []
    for dep in install_order(pkg.name):
        if dep.name in prebuilt:
            wheel = Path(shutil.copy2(prebuilt[dep.name], wheelhouse))
        else:
            session.run("python", "-m", "build", "--wheel", "--outdir", str(wheelhouse), str(ROOT / dep.path))
            (wheel,) = sorted(wheelhouse.glob(f"{_dist_stem(dep)}-*.whl"))
        wheels.append(wheel)

    # Third-party dependencies from the normal index (CPU pins), then ours from the folder only:
    # --no-index means no PyPI copy of ours can be picked, whatever versions exist there.
    _install_cpu_stack(session, *_third_party_requirements(wheels))
    session.install("--no-index", "--find-links", str(wheelhouse), pkg.distribution)

    want = {_canon(p.distribution) for p in install_order(pkg.name)}
    ours = _installed_ours(session)
    if set(ours) != want:
        session.error(f"pip list: distributions of ours are {sorted(ours)}, expected exactly {sorted(want)}")
    editable = [n for n, r in ours.items() if r.get("editable_project_location")]
    if editable:
        session.error(f"pip list: {editable} are editable installs; isolation needs the wheels")
    where = session.run(
        "python", "-c", f"import {pkg.module}; print({pkg.module}.__file__)", silent=True, stderr=subprocess.DEVNULL
    )
    where = Path(str(where).strip().splitlines()[-1]).resolve()
    if Path(session.virtualenv.location).resolve() not in where.parents:
        session.error(f"{pkg.module} imports from {where}, not from the session's environment")
    session.log(f"installed from wheels only: {', '.join(sorted(ours))}; {pkg.module} from {where}")

    with tempfile.TemporaryDirectory(prefix=f"flydsl-isolation-{pkg.name}-") as tmp:
        shutil.copytree(_tests_dir(pkg), Path(tmp) / "tests")
        with session.chdir(tmp):
            session.run(
                "pytest", "tests", "--rootdir", tmp, *PYTEST_FLAGS, *pytest_args,
                env={"PYTHONPATH": None},
            )


def _git(session: nox.Session, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if check and proc.returncode:
        session.error(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _probe(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kw)


# ------------------------------------------------------------- GPU helpers
#
# GPU sessions run in the interpreter that runs nox (`python -m nox ...`): GPU runners come
# with CUDA torch and triton preinstalled and may have no network, so nothing third-party is
# installed and our packages go in editable, without dependencies or build isolation.

GPU_FLAGS = ("--bench", "--no-install")


def _split_gpu_posargs(posargs: list[str]) -> tuple[set[str], list[str]]:
    ours = {a for a in posargs if a in GPU_FLAGS}
    return ours, [a for a in posargs if a not in GPU_FLAGS]


def _require_gpu(session: nox.Session) -> None:
    if os.environ.get("FLYDSL_INTERPRET", "") not in ("", "0"):
        session.error("FLYDSL_INTERPRET is set: GPU sessions must run compiled kernels; unset it")
    check = "import torch; assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'"
    proc = _probe([sys.executable, "-c", check])
    if proc.returncode:
        why = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        session.error(
            f"no GPU visible to {sys.executable}: {why}\n"
            "GPU sessions fail instead of skipping. Run `python -m nox` with the interpreter that has CUDA torch."
        )
    session.log(f"GPU visible to {sys.executable}")


def _install_current(session: nox.Session, pkg: Package, flags: set[str]) -> None:
    pkgs = install_order(pkg.name)
    if "--no-install" not in flags:
        # Without build isolation pip builds with what is installed: hatchling, and editables
        # for hatchling's editable wheels.
        if _probe([sys.executable, "-c", "import hatchling, editables"]).returncode:
            session.error(
                f"{sys.executable} lacks hatchling or editables, needed to install our packages without network: "
                "pip install hatchling editables (or pass --no-install if they are installed already)"
            )
        args = [a for p in pkgs for a in ("-e", str(ROOT / p.path))]
        session.run(
            sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args, external=True
        )
    _guard_editable(session, pkgs, exact=False, python=sys.executable)


def _run_benchmarks(session: nox.Session, pkg: Package, args: list[str]) -> None:
    script = ROOT / pkg.path / "benchmarks" / "run.py"
    if script.is_file():
        session.run(sys.executable, str(script), *args, external=True)
    else:  # the family's registered benchmark, if any ("no benchmarks registered" otherwise)
        session.run(sys.executable, "-m", "flydsl.cli", "bench", pkg.name, *args, external=True)


def _gpu_tests(session: nox.Session, pkg: Package, pytest_args: list[str]) -> None:
    tests = str(_tests_dir(pkg).relative_to(ROOT))
    cmd = [sys.executable, "-m", "pytest", tests, "-m", "gpu", *PYTEST_FLAGS]
    collected = _probe([*cmd, "--collect-only", "-q"])
    if collected.returncode == 5:  # nothing marked gpu: a skeleton family
        session.warn(f"{tests} has no gpu-marked tests; the shard has nothing to run")
        return
    session.run(*cmd, "--require-gpu", *pytest_args, external=True)


# ------------------------------------------------------------ the sessions


@nox.session(tags=["cpu"])
def tests(session: nox.Session) -> None:
    """Every package's CPU suite (and ci/tests) in one environment: what CI runs."""
    _install_cpu_stack(session, *CI_TEST_TOOLS)
    _install_editable(session, list(PACKAGES))
    reports = Path(session.create_tmp()) / "junit"
    shutil.rmtree(reports, ignore_errors=True)
    reports.mkdir(parents=True)
    suites = [(pkg.name, str(_tests_dir(pkg).relative_to(ROOT))) for pkg in PACKAGES] + [("ci", "ci/tests")]
    failed = []
    # pytest once per package: test modules of different packages may share names.
    for name, path in suites:
        if not (ROOT / path).is_dir():
            session.error(f"{path} is missing: every package ships its CPU tests")
        try:
            session.run("pytest", path, *PYTEST_FLAGS, f"--junitxml={reports / name}.xml", *session.posargs)
        except nox.command.CommandFailed:
            failed.append(name)
    totals = _junit_summary(session, [(name, reports / f"{name}.xml") for name, _ in suites])
    if failed:
        session.error(f"test suites failed: {', '.join(failed)}")
    # One closing line for the whole run, after the per-suite lines of pytest.
    print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped", flush=True)


def _junit_summary(session: nox.Session, reports: list[tuple[str, Path]]) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for name, path in reports:
        row = {"passed": 0, "failed": 0, "skipped": 0}
        if path.is_file():
            for suite in ET.parse(path).getroot().iter("testsuite"):
                tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
                bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
                row["passed"] += tests - skipped - bad
                row["failed"] += bad
                row["skipped"] += skipped
        session.log(f"{name:<10} {row['passed']:>5} passed {row['failed']:>4} failed {row['skipped']:>4} skipped")
        for k in totals:
            totals[k] += row[k]
    return totals


@nox.session(name="test-ci", tags=["test"])
def test_ci(session: nox.Session) -> None:
    """The CI helpers' own tests (matrix, changed packages, workflow consistency)."""
    session.install("-c", CONSTRAINTS, *CI_TEST_TOOLS)
    session.run("pytest", "ci/tests", *PYTEST_FLAGS, *session.posargs)


@nox.session(tags=["cpu", "lint"])
def lint(session: nox.Session) -> None:
    """ruff check on packages/, ci/ and noxfile.py."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "check", "packages", "ci", "noxfile.py", *session.posargs)


@nox.session(tags=["demo"], venv_params=["--system-site-packages"])
def demo(session: nox.Session) -> None:
    """`flydsl demo`: every family's kernels on small problems against torch (timed on a GPU)."""
    probe = (
        "import importlib.util as u, json\n"
        "r = {m: u.find_spec(m) is not None for m in ('triton', 'tqdm', 'matplotlib', 'hatchling', 'editables')}\n"
        "try:\n    import torch\n    r['torch'], r['cuda'] = True, torch.cuda.is_available()\n"
        "except Exception:\n    r['torch'], r['cuda'] = False, False\n"
        "print(json.dumps(r))\n"
    )
    have = json.loads(_probe([str(Path(session.bin) / "python"), "-c", probe]).stdout.strip().splitlines()[-1])
    if not have["torch"]:
        session.log("no torch in this interpreter: installing the CPU pins")
        _require_cpu_torch_source(session)
        session.install("-c", CONSTRAINTS, *CPU_STACK, "tqdm", "matplotlib")
    else:
        session.log(f"using the preinstalled torch (CUDA available: {have['cuda']})")
        missing = [m for m in ("triton", "tqdm", "matplotlib") if not have[m]]
        if missing:
            session.install(*missing)
    args = [a for p in PACKAGES for a in ("-e", str(ROOT / p.path))]
    # With the build backend at hand (GPU machines may have no network) build without isolation.
    offline = ("--no-build-isolation",) if have["hatchling"] and have["editables"] else ()
    session.install("--no-deps", *offline, *args)
    _guard_editable(session, list(PACKAGES), exact=True)
    session.run("flydsl", "info")
    session.run("flydsl", "demo", *session.posargs)


def _session(name: str, doc: str, **kwargs):
    """``nox.session`` for generated sessions: the docstring is what `nox -l` shows."""

    def decorate(func):
        func.__doc__ = doc
        return nox.session(name=name, **kwargs)(func)

    return decorate


def _package_sessions(pkg: Package) -> None:
    """Define every per-package session of ``pkg`` (a function, so each closure binds its own pkg)."""
    dist = pkg.distribution

    @_session(f"test-{pkg.name}", f"{dist}: CPU tests (Triton interpreter); -- args go to pytest.", tags=["test"])
    def test(session: nox.Session) -> None:
        _install_cpu_stack(session)
        _install_editable(session, install_order(pkg.name))
        _pytest(session, pkg, *session.posargs)

    @_session(f"build-{pkg.name}", f"{dist}: sdist + wheel into dist/{pkg.name}/, twine check, check-wheel-contents.",
              tags=["build"])
    def build(session: nox.Session) -> None:
        session.install("-c", CONSTRAINTS, *BUILD_TOOLS)
        _build(session, pkg, ROOT / "dist" / pkg.name)

    @_session(f"isolation-{pkg.name}", f"{dist}: its wheels alone in a fresh env; tests run outside packages/.",
              tags=["isolation"])
    def isolation(session: nox.Session) -> None:
        _isolation(session, pkg, Path(session.create_tmp()) / "wheelhouse", session.posargs)

    @_session(f"release-{pkg.name}", f"{dist}: release checks, build, install test; tag + upload with -- --publish.",
              tags=["release"], reuse_venv=False)
    def release(session: nox.Session) -> None:
        publish = "--publish" in session.posargs
        version = _read_version(pkg)
        tag = f"{pkg.distribution}-v{version}"
        session.log(f"{pkg.distribution} {version}: {'PUBLISH' if publish else 'dry run (-- --publish to release)'}")
        if _git(session, "tag", "--list", tag).stdout.strip():
            session.error(f"tag {tag} exists: bump src/{pkg.module}/_version.py first")
        changelog = (ROOT / pkg.path / "CHANGELOG.md").read_text()
        if not re.search(rf"^##\s+\[?{re.escape(version)}\]?(\s|$)", changelog, re.M):
            session.error(f"{pkg.path}/CHANGELOG.md has no '## {version}' entry")
        if publish:
            if _git(session, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode:
                session.error("no commit to tag")
            dirty = _git(session, "status", "--porcelain", "--", pkg.path).stdout.strip()
            if dirty:
                session.error(f"{pkg.path} has uncommitted changes:\n{dirty}")

        session.install("-c", CONSTRAINTS, *BUILD_TOOLS)
        sdist, wheel = _build(session, pkg, ROOT / "dist" / pkg.name)
        # The install test runs on the very wheel that would be uploaded.
        pytest_args = [a for a in session.posargs if a != "--publish"]
        _isolation(session, pkg, Path(session.create_tmp()) / "wheelhouse", pytest_args, prebuilt={pkg.name: wheel})

        tag_cmd = ["git", "tag", "-a", tag, "-m", f"{pkg.distribution} {version}"]
        upload_cmd = ["twine", "upload", str(sdist), str(wheel)]
        if not publish:
            session.log("dry run: all checks passed; with -- --publish this would run:")
            session.log("  " + " ".join(tag_cmd))
            session.log("  " + " ".join(upload_cmd))
            session.log(f"  then push the tag: git push origin {tag}")
            return
        session.run(*tag_cmd, external=True)
        try:
            session.run(*upload_cmd)
        except nox.command.CommandFailed:
            _git(session, "tag", "-d", tag, check=False)
            session.error(f"upload failed; tag {tag} removed again")
        session.log(f"released {pkg.distribution} {version}; push the tag: git push origin {tag}")

    if not pkg.gpu:
        return

    @_session(f"gpu-{pkg.name}", f"GPU shard {pkg.name}: gpu-marked tests on CUDA (-- --bench adds benchmarks).",
              python=False, tags=["gpu"])
    def gpu(session: nox.Session) -> None:
        flags, pytest_args = _split_gpu_posargs(session.posargs)
        _require_gpu(session)
        _install_current(session, pkg, flags)
        _gpu_tests(session, pkg, pytest_args)
        if "--bench" in flags:
            _run_benchmarks(session, pkg, [])

    @_session(f"bench-{pkg.name}", f"{dist}: benchmarks on the GPU (current interpreter); -- args go to them.",
              python=False, tags=["bench"])
    def bench(session: nox.Session) -> None:
        flags, bench_args = _split_gpu_posargs(session.posargs)
        _require_gpu(session)
        _install_current(session, pkg, flags)
        _run_benchmarks(session, pkg, bench_args)


for _pkg in PACKAGES:
    _package_sessions(_pkg)
