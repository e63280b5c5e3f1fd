"""The CPU stack's torch pin, and an early, plain check that pip can find it.

ci/constraints-cpu.txt pins a CPU-only torch ("torch==X+cpu"). PyPI carries no
such build (its Linux torch is the CUDA build, which also pins a triton other
than ours), so pip needs PyTorch's CPU wheel index as an extra index. Without
it pip fails deep inside an install with "No matching distribution found";
:func:`cpu_torch_problem` finds that first and says what to configure.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parent / "constraints-cpu.txt"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pin(name: str, constraints: Path = CONSTRAINTS) -> str:
    """The ``name==version`` line of the constraints file, e.g. ``triton==3.6.0``."""
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if re.match(rf"{re.escape(name)}\s*==", line):
            return line.replace(" ", "")
    raise ValueError(f"{constraints} pins no {name} version (expected a line '{name}==X')")


def torch_pin(constraints: Path = CONSTRAINTS) -> str:
    """The torch line of the constraints file, e.g. ``torch==2.13.0+cpu``."""
    return pin("torch", constraints)


def how_to_configure(pin: str) -> str:
    return (
        f"pip cannot find {pin}, the CPU-only torch that the CPU environments pin (ci/constraints-cpu.txt). "
        "PyPI has no CPU-only torch for Linux: point pip at PyTorch's CPU wheel index as an extra index, e.g.\n"
        f"    export PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX}\n"
        f"(or once: python3 -m pip config set global.extra-index-url {TORCH_CPU_INDEX}), then run nox again."
    )


def cpu_torch_problem(python: str, env: dict[str, str] | None = None, constraints: Path = CONSTRAINTS) -> str | None:
    """None when ``python``'s pip resolves the pinned CPU torch; otherwise what to configure, and pip's error.

    A dry run of torch alone (no dependencies, nothing installed): a few seconds where
    the index answers, before any environment is built with the pins.
    """
    pin = torch_pin(constraints)
    proc = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet", "--disable-pip-version-check", pin],
        capture_output=True, text=True, env=os.environ.copy() if env is None else env,
    )
    if proc.returncode == 0:
        return None
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.strip().splitlines()[-1:]
    return how_to_configure(pin) + ("\npip said: " + " | ".join(errors) if errors else "")
