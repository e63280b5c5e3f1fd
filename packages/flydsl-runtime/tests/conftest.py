"""Shared fixtures of the runtime tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# FlyDSL's pytest plugin is opt-in (installing FlyDSL must not change other
# projects' test runs); this suite, like every package's, loads it here.
pytest_plugins = ["flydsl.testing.plugin"]


def run_python(code: str, env_extra: dict | None = None, env_drop: tuple = ()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (backend choice is per process) and capture its output."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture
def fresh_python():
    """``fresh_python(code, env_extra=None, env_drop=())``: run code in a new process."""
    return run_python
