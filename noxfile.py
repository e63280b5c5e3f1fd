"""Build, test, benchmark and release each FlyDSL package on its own.

    nox -l                          every session
    nox -s tests                    every package's CPU suite in one environment (CI: .ci/run)
    nox -s test-norm -- -n auto     one package; arguments after -- go to pytest
    nox -s lint                     ruff on packages/, ci/ and this file
    nox -s build-gemm               sdist + wheel, twine check, check-wheel-contents
    nox -s isolation-gemm           the wheels alone in a fresh environment, tests run outside packages/
    nox -s test-gemm-min            the CPU suite at the lowest declared torch, triton, numpy and siblings
    nox -s bump-gemm -- minor       set the version, open its CHANGELOG section (patch|minor|major|dev|X.Y.Z)
    nox -s release-gemm             release checks, build, install test; `-- --tag` then tags (the push publishes)
    nox -t gpu                      every GPU shard (gpu-common, gpu-norm, ...): needs a CUDA GPU
    nox -s gpu-gemm -- --bench      one shard, benchmarks too
    nox -s sanitize-gemm            the shard's tests under compute-sanitizer (-- --tool memcheck: one tool)
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

import floors  # noqa: E402
import release as rel  # noqa: E402
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
# The oldest Python we support (requires-python): where the dependency floors are tested,
# since the oldest torch / numpy releases have wheels for the older Pythons only.
OLDEST_PYTHON = "3.10"

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
    """Layout, version file, entry point, LICENSE and license metadata (ci/release.py: wheel_problems)."""
    problems = rel.wheel_problems(wheel, pkg, LICENSE.read_bytes())
    if problems:
        session.error("\n  ".join(["wheel check failed:", *problems]))
    with zipfile.ZipFile(wheel) as zf:
        top = sorted({n.split("/")[0] for n in zf.namelist()})
    session.log(f"{wheel.name}: top level {top}, no tests/, LICENSE present")


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
    if not pkg.gpu:  # the runtime: no family benchmarks; its launch-path probe is run by hand
        session.log(f"{pkg.distribution} registers no benchmarks (benchmarks/ holds probes run by hand)")
        return
    script = ROOT / pkg.path / "benchmarks" / "run.py"
    if script.is_file():
        session.run(sys.executable, str(script), *args, external=True)
    else:  # the family's registered benchmark, if any ("no benchmarks registered" otherwise)
        session.run(sys.executable, "-m", "flydsl.cli", "bench", pkg.name, *args, external=True)


def _gpu_tests(session: nox.Session, pkg: Package, pytest_args: list[str]) -> None:
    tests = str(_tests_dir(pkg).relative_to(ROOT))
    cmd = [sys.executable, "-m", "pytest", tests, "-m", "gpu", *PYTEST_FLAGS]
    collected = _probe([*cmd, "--collect-only", "-q"])
    if collected.returncode == 5:  # nothing marked gpu: a shard that runs nothing must not look green
        session.error(f"{tests} has no gpu-marked tests: a GPU shard with nothing to run fails")
    if collected.returncode:
        session.error(f"collecting {tests} failed:\n{collected.stdout[-3000:]}{collected.stderr[-3000:]}")
    session.run(*cmd, "--require-gpu", *pytest_args, external=True)


# ---------------------------------------------------------------- releases


def _release(session: nox.Session, pkg: Package) -> None:
    """Refuse what must not be released, then build and install-test the very wheel; tag with --tag.

    Flags (after --): --tag creates the annotated tag; --from-tag TAG is the release workflow
    (the pushed TAG must be this version's and point at HEAD); --offline compares with local
    tags only and skips the PyPI look-up. Other arguments go to pytest in the install test.
    Uploading is the workflow's (PyPI trusted publishing): no token on a developer's machine.
    """
    args = list(session.posargs)
    if "--publish" in args:
        session.error(f"publishing is the release workflow's: run with -- --tag, then push the tag "
                      f"({rel.tag_of(pkg, rel.read_version(ROOT, pkg))})")
    tag_it, offline = "--tag" in args, "--offline" in args
    tagged = None
    if "--from-tag" in args:
        i = args.index("--from-tag")
        if i + 1 >= len(args):
            session.error("--from-tag needs the tag")
        tagged = args[i + 1]
        del args[i:i + 2]
    pytest_args = [a for a in args if a not in ("--tag", "--offline")]
    if tag_it and tagged:
        session.error("--tag and --from-tag exclude each other: the workflow runs on a tag that exists")

    version = rel.read_version(ROOT, pkg)
    tag = rel.tag_of(pkg, version)
    session.log(f"{pkg.distribution} {version}: {'checks, then tag ' + tag if tag_it else 'checks (dry run)'}")
    if offline:
        session.warn("--offline: local tags only, sibling lower ends not looked up on PyPI")
    else:
        try:
            session.log(rel.fetch_tags(ROOT))
        except rel.ReleaseError as e:
            session.error(str(e))
    problems, notes = rel.release_problems(ROOT, pkg, tagged=tagged, published=None if offline else rel.pypi_published)
    for note in notes:
        session.warn(note)
    if tag_it or tagged:
        dirty = _git(session, "status", "--porcelain", "--untracked-files=no", "--", pkg.path).stdout.strip()
        if dirty:
            problems.append(f"{pkg.path} has uncommitted changes:\n{dirty}")
    if problems:
        session.error("release refused:\n  " + "\n  ".join(problems))

    session.install("-c", CONSTRAINTS, *BUILD_TOOLS)
    _sdist, wheel = _build(session, pkg, ROOT / "dist" / pkg.name)
    # The install test runs on the very wheel that is published.
    _isolation(session, pkg, Path(session.create_tmp()) / "wheelhouse", pytest_args, prebuilt={pkg.name: wheel})

    if tagged:
        session.log(f"{tagged}: checks, build and install test passed; dist/{pkg.name}/ is what gets published")
        return
    tag_cmd = ["git", "tag", "-a", tag, "-m", f"{pkg.distribution} {version}"]
    if not tag_it:
        session.log("dry run: all checks passed; `-- --tag` would run: " + " ".join(tag_cmd))
        return
    session.run(*tag_cmd, external=True)
    session.log(f"tagged {tag}. Publish: git push origin {tag} (the release workflow builds, tests and uploads); "
                f"then open the next version: nox -s bump-{pkg.name} -- dev")


def _test_at_floors(session: nox.Session, pkg: Package) -> None:
    """The package's CPU suite with every declared lower end installed; skips (saying why) where one is missing."""
    missing = [m for p in install_order(pkg.name) for m in floors.missing_lower_bounds(ROOT, p)]
    if missing:
        session.error("cannot test at the floors:\n  " + "\n  ".join(missing))
    py = str(Path(session.bin) / "python")

    # Our packages: the lower end of each sibling range, from PyPI; the in-repo copy where it is that version.
    editable, from_pypi = [], []
    for sib, low, req in floors.sibling_floors(ROOT, pkg):
        here = rel.Version(rel.read_version(ROOT, sib))
        found = rel.pypi_published(sib.distribution, low)
        if found:
            from_pypi.append(f"{sib.distribution}=={low}")
        elif here == low:
            why = "PyPI not reachable" if found is None else "not published"
            session.log(f"{sib.distribution} {low} ({req}): {why}; the in-repo copy is that version")
            editable.append(sib)
        elif found is None:
            session.skip(f"PyPI not reachable: cannot get {sib.distribution} {low}, the lower end of {req} "
                         f"(the in-repo copy is {here})")
        else:
            session.skip(f"{sib.distribution} {low}, the lower end of {req}, is not published and the in-repo "
                         f"copy is {here}: release it or raise the lower end")

    # Third-party floors: each must resolve to a wheel here (a CPU build for torch) before anything installs.
    third = floors.third_party_floors(ROOT, pkg)
    for floor in third:
        report = Path(session.create_tmp()) / f"floor-{floor.name}.json"
        proc = _probe([py, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
                       "--only-binary=:all:", "--report", str(report), floor.pin])
        if proc.returncode:
            why = " | ".join(ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")) or proc.stderr[-300:]
            session.skip(f"{floor.pin} ({'; '.join(floor.required_by)}) has no wheel for Python "
                         f"{session.python or sys.version.split()[0]} from pip's sources here: {why}")
        got = json.loads(report.read_text())["install"][0]["metadata"]["version"]
        if floor.name == "torch" and sys.platform.startswith("linux") and "+cpu" not in got:
            session.skip(f"{floor.pin}: pip finds only torch {got}, a CUDA build (several GB with its CUDA "
                         "libraries); the CPU suite needs the CPU build: put PyTorch's CPU wheel index in "
                         "PIP_EXTRA_INDEX_URL (ci/cpu_stack.py says how)")
        session.log(f"floor {floor.pin}: {got} ({'; '.join(floor.required_by)})")

    constraints = Path(session.create_tmp()) / "constraints-floors.txt"
    constraints.write_text(floors.merged_constraints(Path(CONSTRAINTS).read_text(), third))
    session.install("-c", str(constraints), *(f.name for f in third), *TEST_TOOLS)
    if from_pypi:
        session.install("-c", str(constraints), *from_pypi)
    session.install("--no-deps", *[a for p in [*editable, pkg] for a in ("-e", str(ROOT / p.path))])
    session.run("python", "-m", "pip", "check")  # the floors satisfy every declared requirement
    session.run("python", "-m", "pip", "list")
    _pytest(session, pkg, *session.posargs)


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

    @_session(f"test-{pkg.name}-min",
              f"{dist}: CPU tests at the lowest declared torch, triton, numpy and sibling versions "
              f"(Python {OLDEST_PYTHON}); skips, saying why, where a floor is not installable here.",
              python=OLDEST_PYTHON, tags=["min"], reuse_venv=False)
    def test_min(session: nox.Session) -> None:
        _test_at_floors(session, pkg)

    @_session(f"bump-{pkg.name}", f"{dist}: -- patch|minor|major|X.Y.Z sets the version and opens its CHANGELOG "
              "section; -- dev sets the next .devN.", python=False, tags=["release"])
    def bump(session: nox.Session) -> None:
        if len(session.posargs) != 1:
            session.error(f"usage: nox -s bump-{pkg.name} -- patch|minor|major|dev|X.Y.Z (got {session.posargs})")
        try:
            _, _, log = rel.bump(ROOT, pkg, session.posargs[0])
        except rel.ReleaseError as e:
            session.error(str(e))
        for line in log:
            session.log(line)

    @_session(f"release-{pkg.name}", f"{dist}: release checks, build, install test of the wheel; -- --tag tags "
              "<distribution>-v<version> (pushing the tag publishes through .github/workflows/release.yml).",
              tags=["release"], reuse_venv=False)
    def release(session: nox.Session) -> None:
        _release(session, pkg)

    if pkg.shard:
        _gpu_session(pkg)
        _sanitize_session(pkg)
    if pkg.gpu:
        _bench_session(pkg)


def _gpu_session(pkg: Package) -> None:
    @_session(f"gpu-{pkg.name}", f"GPU shard {pkg.name}: gpu-marked tests on CUDA (-- --bench adds benchmarks).",
              python=False, tags=["gpu"])
    def gpu(session: nox.Session) -> None:
        flags, pytest_args = _split_gpu_posargs(session.posargs)
        _require_gpu(session)
        _install_current(session, pkg, flags)
        _gpu_tests(session, pkg, pytest_args)
        if "--bench" in flags:
            _run_benchmarks(session, pkg, [])


# compute-sanitizer's tools, each a full pass over a GPU suite (memcheck: out-of-bounds and misaligned device
# accesses; racecheck: shared-memory hazards; initcheck: reads of device memory nothing wrote; synccheck:
# barriers in divergent code).
SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


def _sanitize_session(pkg: Package) -> None:
    @_session(f"sanitize-{pkg.name}",
              f"{pkg.distribution}: the gpu-marked tests under compute-sanitizer ({', '.join(SANITIZER_TOOLS)}); "
              "-- --tool NAME runs one tool; other args go to pytest.", python=False, tags=["sanitize"])
    def sanitize(session: nox.Session) -> None:
        flags, rest = _split_gpu_posargs(session.posargs)
        tools, pytest_args = _sanitizer_tools(session, rest)
        _require_gpu(session)
        tool = shutil.which("compute-sanitizer")
        if tool is None:
            session.error("compute-sanitizer is not on PATH (it ships with the CUDA toolkit)")
        _install_current(session, pkg, flags)
        tests = str(_tests_dir(pkg).relative_to(ROOT))
        # Two passes a tool. Without torch's caching allocator every tensor is its own allocation, so an access past
        # a tensor's end is an access past an allocation, which memcheck sees (inside a cached block it would not);
        # CUDA graph capture needs the allocator (a capture refuses cudaMalloc), so the "graph" tests run in a
        # second pass with it on, where an access outside every allocated segment is still caught. (The
        # cudaMallocAsync backend would serve both, but Triton's launcher cannot query the pointers a capture
        # allocates under it, and memcheck flags writes to a graph's memory before its first launch.)
        # (pytest's exit code 5: a family without graph tests selects none in the second pass)
        # FLYDSL_ZERO_SCRATCH: kernels that build tensor descriptors on the device write them into global scratch
        # through the tensormap proxy, which initcheck does not see as a write (every read of the descriptor
        # was reported: 97,664 in 8 tests of one kernel, none once the scratch was zero-filled)
        zero = {"FLYDSL_ZERO_SCRATCH": "1"}
        passes = ((["-m", "gpu and not overlap and not host_refs"], {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", **zero},
                   [0]),
                  (["-m", "gpu and graph and not overlap and not host_refs"], zero, [0, 5]))
        for name in tools:
            # racecheck, initcheck and synccheck cost time in proportion to the kernels' work (a 256 x 4096 x 4096
            # GEMM test: ~90 s under racecheck on an H200), so they run each test's smallest cases
            # (flydsl.testing.cases); memcheck runs every case
            sizes = [] if name == "memcheck" else ["--smallest-cases"]
            for marks, env, ok in passes:
                session.log(f"compute-sanitizer --tool {name}: {tests} {marks[1]!r}")
                # "overlap" tests need two streams' kernels to run at once, which the tools' serialized launches
                # prevent; "host_refs" tests count references, and under the tools each call's Python frames stay
                # alive (held from outside Python: +1 reference to each operand a call, no cycle gc collects)
                # --kernel-name-exclude: torch's own kernels (at::native::..., the tests' references and
                # copies) are not instrumented: their hazards are torch's (racecheck flagged its reduce kernel),
                # and instrumenting them costs more of a run than our kernels do. Not for initcheck: it tracks
                # writes only in the kernels it instruments, so every input torch filled would read as
                # uninitialized (thousands of reports a test, in our kernels and cuBLAS's alike)
                skip = [] if name == "initcheck" else ["--kernel-name-exclude", "kns=native"]
                # initcheck does not see TMA stores as writes: a tensor only they wrote reads as uninitialized
                # (the runtime's descriptor test, marked tma_store, shows it: every read of its output reported)
                if name == "initcheck":
                    marks = [marks[0], marks[1] + " and not tma_store"]
                session.run(tool, "--tool", name, "--error-exitcode", "97", "--target-processes", "all", *skip,
                            "--print-limit", "20", sys.executable, "-m", "pytest", tests, *marks,
                            *PYTEST_FLAGS, "--require-gpu", *sizes, *pytest_args, env=env, external=True,
                            success_codes=ok)  # fmt: skip


def _sanitizer_tools(session: nox.Session, args: list[str]) -> tuple[list[str], list[str]]:
    """(the compute-sanitizer tools to run, the remaining pytest arguments) from ``--tool NAME`` options."""
    tools, rest, it = [], [], iter(args)
    for a in it:
        if a == "--tool":
            name = next(it, None)
            if name not in SANITIZER_TOOLS:
                session.error(f"--tool: expected one of {', '.join(SANITIZER_TOOLS)}, got {name!r}")
            tools.append(name)
        else:
            rest.append(a)
    return tools or list(SANITIZER_TOOLS), rest


def _bench_session(pkg: Package) -> None:
    dist = pkg.distribution

    @_session(f"bench-{pkg.name}", f"{dist}: benchmarks on the GPU (current interpreter); -- args go to them.",
              python=False, tags=["bench"])
    def bench(session: nox.Session) -> None:
        flags, bench_args = _split_gpu_posargs(session.posargs)
        _require_gpu(session)
        _install_current(session, pkg, flags)
        _run_benchmarks(session, pkg, bench_args)


for _pkg in PACKAGES:
    _package_sessions(_pkg)
