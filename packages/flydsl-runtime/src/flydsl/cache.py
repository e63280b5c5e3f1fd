"""One cache root for everything FlyDSL keeps between processes.

``FLYDSL_CACHE_DIR`` (default ``~/.cache/flydsl``) holds:

- ``triton/``: Triton's compiled kernels (Triton keys them by kernel source,
  the sources of every function it calls, constexpr values, argument dtypes
  and specialization, target and compiler version, so a changed helper or a
  new dtype never reuses a stale binary);
- ``tuning/``: searched tuning winners, one small JSON file per
  (tunable, arch, key).

Triton's own ``TRITON_CACHE_DIR`` is honoured when the user set it; otherwise
FlyDSL points it under the root before Triton is imported.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import env

__all__ = ["root", "triton_dir", "tuning_dir", "Entry", "entries", "size", "clear", "configure_triton"]

KINDS = ("triton", "tuning")


def root() -> Path:
    """The cache root (not created until something is written)."""
    return env.get("FLYDSL_CACHE_DIR")


_exported: str | None = None  # the TRITON_CACHE_DIR value FlyDSL set itself, if it did


def triton_dir() -> Path:
    """Where Triton's compiled kernels live: the user's TRITON_CACHE_DIR, else ``<root>/triton``.

    A TRITON_CACHE_DIR that FlyDSL exported itself does not count as the
    user's: the folder follows the root, so pointing FLYDSL_CACHE_DIR
    elsewhere (as tests do) never lists or clears the real cache.
    """
    external = env.read_external("TRITON_CACHE_DIR")
    if external and external != _exported:
        return Path(external).expanduser()
    return root() / "triton"


def tuning_dir() -> Path:
    return root() / "tuning"


def configure_triton() -> None:
    """Point Triton's cache under the root, unless the user chose a folder."""
    global _exported
    ours = str(root() / "triton")
    current = env.read_external("TRITON_CACHE_DIR")
    if not current:
        env.export("TRITON_CACHE_DIR", ours)
    # A child process inherits the value its FlyDSL parent exported: still ours.
    if not current or current == ours:
        _exported = ours


@dataclass(frozen=True)
class Entry:
    kind: str  # "triton" or "tuning"
    path: Path
    files: int
    bytes: int


def _dir_usage(path: Path) -> tuple[int, int]:
    files = total = 0
    if not path.is_dir():
        return 0, 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:  # removed by a concurrent process
                pass
    return files, total


def _kind_dir(kind: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"cache kind must be one of {KINDS}, got {kind!r}")
    return triton_dir() if kind == "triton" else tuning_dir()


def entries() -> list[Entry]:
    """One entry per top-level item of each cache kind (a kernel hash, a tunable)."""
    out = []
    for kind in KINDS:
        base = _kind_dir(kind)
        if not base.is_dir():
            continue
        for child in sorted(base.iterdir()):
            if child.is_dir():
                files, total = _dir_usage(child)
            else:
                files, total = 1, child.stat().st_size
            out.append(Entry(kind, child, files, total))
    return out


def size(kind: str | None = None) -> int:
    """Bytes used by one kind of cache, or by all of them."""
    kinds = KINDS if kind is None else (kind,)
    return sum(_dir_usage(_kind_dir(k))[1] for k in kinds)


def clear(kind: str | None = None) -> int:
    """Delete one kind of cache (or all); returns the bytes freed."""
    kinds = KINDS if kind is None else (kind,)
    freed = 0
    for k in kinds:
        path = _kind_dir(k)
        freed += _dir_usage(path)[1]
        shutil.rmtree(path, ignore_errors=True)
    return freed
