"""The one typed registry of every ``FLYDSL_*`` environment variable.

Nothing else in FlyDSL reads ``os.environ``: code asks this module
(``flydsl.env.get("FLYDSL_AUTOTUNE")``), so every variable has one name, one
type, one default and one line of help, and ``flydsl info`` can list them all.
The few variables FlyDSL *sets* for Triton (interpreter choice, cache folder)
are written here too, through :func:`export`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Var", "VARS", "get", "is_set", "describe", "export", "read_external", "child_environment"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected one of 1/0/true/false/yes/no/on/off")


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from None


def _parse_path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _parse_level(name: str, raw: str) -> str:
    level = raw.strip().upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError(f"environment variable {name}={raw!r}: expected DEBUG, INFO, WARNING or ERROR")
    return level


@dataclass(frozen=True)
class Var:
    """One documented environment variable."""

    name: str
    parse: Callable[[str, str], Any]
    default: Callable[[], Any]
    help: str

    @property
    def type_name(self) -> str:
        return {_parse_bool: "bool", _parse_int: "int", _parse_path: "path", _parse_level: "level"}.get(
            self.parse, "str"
        )


VARS: dict[str, Var] = {
    v.name: v
    for v in [
        Var(
            "FLYDSL_INTERPRET",
            _parse_bool,
            lambda: None,
            "1 forces Triton's CPU interpreter, 0 forces compiled kernels; unset: the interpreter is "
            "chosen exactly when no GPU is visible. Read once, when flydsl is imported.",
        ),
        Var(
            "FLYDSL_CACHE_DIR",
            _parse_path,
            lambda: Path("~/.cache/flydsl").expanduser(),
            "Root of every FlyDSL cache: Triton's compiled kernels (triton/) and searched tuning "
            "winners (tuning/).",
        ),
        Var(
            "FLYDSL_AUTOTUNE",
            _parse_bool,
            lambda: False,
            "1 makes tunable kernels search their candidate space (once per key and process) instead "
            "of serving the cached winner, the shipped artifact or the default.",
        ),
        Var(
            "FLYDSL_USE_ARTIFACTS",
            _parse_bool,
            lambda: True,
            "0 ignores the tuning artifacts shipped inside family packages (debugging: serve the "
            "local winner or the default only).",
        ),
        Var(
            "FLYDSL_PROGRESS",
            _parse_bool,
            lambda: True,
            "0 hides the progress bar of tuning searches.",
        ),
        Var(
            "FLYDSL_FUZZ_SEED",
            _parse_int,
            lambda: 40,
            "The seed of the families' property-based fuzz tests (flydsl.testing.fuzz).",
        ),
        Var(
            "FLYDSL_FUZZ_EXAMPLES",
            _parse_int,
            lambda: None,
            "Cases a fuzz test draws; unset: 80 where kernels run in the interpreter, 500 on a GPU.",
        ),
        Var(
            "FLYDSL_FUZZ_SHRINK",
            _parse_bool,
            lambda: False,
            "1 lets Hypothesis shrink a failing fuzz case (minutes through the interpreter).",
        ),
        Var(
            "FLYDSL_ZERO_SCRATCH",
            _parse_bool,
            lambda: False,
            "1 zero-fills the global scratch memory of kernels that build tensor descriptors on the device "
            "(one memset a launch; read when a thread's allocator is installed, and replacing one another "
            "library set). For compute-sanitizer's initcheck, which does not count the descriptor the kernel "
            "writes through the tensormap proxy as a write; the sanitize sessions set it.",
        ),
        Var(
            "FLYDSL_LOG_LEVEL",
            _parse_level,
            lambda: "WARNING",
            "Level of the 'flydsl' logger: DEBUG, INFO, WARNING or ERROR.",
        ),
    ]
}


def get(name: str) -> Any:
    """Typed value of a registered variable (its default when unset)."""
    var = VARS.get(name)
    if var is None:
        raise KeyError(f"{name} is not a FlyDSL environment variable; known: {', '.join(sorted(VARS))}")
    raw = os.environ.get(name)
    if raw is None:
        return var.default()
    return var.parse(name, raw)


def is_set(name: str) -> bool:
    """True when a registered variable is present in the environment."""
    if name not in VARS:
        raise KeyError(f"{name} is not a FlyDSL environment variable")
    return name in os.environ


def describe() -> list[tuple[str, str, str, str]]:
    """(name, type, current value, help) for every variable, for ``flydsl info``."""
    rows = []
    for var in VARS.values():
        try:
            value = repr(get(var.name))
        except ValueError as exc:
            value = f"<invalid: {exc}>"
        rows.append((var.name, var.type_name, value, var.help))
    return rows


# Variables of other tools that FlyDSL reads or writes. Listed so the one place
# touching the environment is this module.
# (PYTORCH_NO_CUDA_MEMORY_CACHING: the test plugin skips CUDA graph captures without torch's caching allocator.)
_EXTERNAL = {"TRITON_INTERPRET", "TRITON_CACHE_DIR", "TRITON_CACHE_MANAGER", "PYTORCH_NO_CUDA_MEMORY_CACHING"}


def read_external(name: str) -> str | None:
    """Read one of the non-FlyDSL variables FlyDSL coordinates with (Triton's, torch's)."""
    if name not in _EXTERNAL:
        raise KeyError(f"{name} is not a variable FlyDSL coordinates with")
    return os.environ.get(name)


def export(name: str, value: str) -> None:
    """Set one of Triton's variables before Triton is imported."""
    if name not in _EXTERNAL:
        raise KeyError(f"{name} is not a variable FlyDSL sets")
    os.environ[name] = value


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides``: what a child process FlyDSL starts (a compile check, a
    benchmark worker) runs with."""
    return {**os.environ, **overrides}
