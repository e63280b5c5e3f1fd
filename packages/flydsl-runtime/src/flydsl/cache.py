"""One cache root for everything FlyDSL keeps between processes.

``FLYDSL_CACHE_DIR`` (default ``~/.cache/flydsl``) holds:

- ``triton/``: Triton's compiled kernels (Triton keys them by kernel source,
  the sources of every function it calls, constexpr values, argument dtypes
  and specialization, target and compiler version, so a changed helper or a
  new dtype never reuses a stale binary);
- ``tuning/``: searched tuning winners, one small JSON file per
  (tunable, arch, key).

Triton's own ``TRITON_CACHE_DIR`` is honoured when the user set it; otherwise
FlyDSL points it under the root before Triton is imported. When the root
cannot be written (a read-only mount, a file where the folder should be),
compiled kernels go to a private folder under the system's temporary
directory instead, with one :class:`CacheWarning`: calls keep working, they
only recompile in each new session.

Nothing in either cache can run code when read: tuning files are JSON only,
and :class:`CheckedCacheManager`, Triton's cache manager in every process that
compiles through :mod:`flydsl.compiler` (:func:`install_checked_manager`;
a ``TRITON_CACHE_MANAGER`` of the user's own is left alone), makes Triton treat
a truncated, corrupt or foreign compiled-kernel entry as a miss (one warning,
then recompiled and rewritten) instead of crashing on it or handing a cut
binary to the driver.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import struct
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import env

# CheckedCacheManager is importable too, but built on first access (it subclasses Triton's manager).
__all__ = [
    "root", "triton_dir", "tuning_dir", "Entry", "entries", "size", "clear", "configure_triton",
    "install_checked_manager", "CacheWarning", "warn_once", "writable", "check_kernel_group",
]  # fmt: skip

KINDS = ("triton", "tuning")


def root() -> Path:
    """The cache root (not created until something is written)."""
    return env.get("FLYDSL_CACHE_DIR")


_exported: str | None = None  # the TRITON_CACHE_DIR value FlyDSL set itself, if it did
_fallback: tuple[str, Path] | None = None  # (unusable root, the temporary folder used instead)


class CacheWarning(UserWarning):
    """A cache folder or file could not be used; FlyDSL went on without it."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(token: str, message: str, category: type[Warning] = CacheWarning) -> None:
    """Warn about ``token`` (a path, usually) at most once per process: the caches' one warning channel
    (compiled kernels here, tuning files in :mod:`flydsl.autotune.store`)."""
    with _warned_lock:
        if token in _warned:
            return
        _warned.add(token)
    warnings.warn(message, category, stacklevel=3)


def writable(path: Path) -> bool:
    """Whether ``path`` is, or could be created as, a folder this process can write.

    Walks up to the nearest existing ancestor: it must be a folder with write
    and search permission (``os.access`` also reports a read-only mount).
    Nothing is created.
    """
    p = Path(path)
    while not os.path.lexists(p):
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def _private_temp_dir() -> Path:
    """A folder under the system temp dir that only this user can write.

    A fixed per-user name lets later processes reuse what earlier ones
    compiled; it is used only if it is a real folder owned by this user and
    closed to others (a folder planted by someone else could hold binaries
    that Triton would load), else a fresh ``mkdtemp`` folder is.
    """
    getuid = getattr(os, "getuid", None)
    if getuid is not None:
        base = Path(tempfile.gettempdir()) / f"flydsl-{getuid()}"
        try:
            base.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(base)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == getuid() and not st.st_mode & 0o077:
                return base / "triton"
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="flydsl-")) / "triton"


def triton_dir() -> Path:
    """Where Triton's compiled kernels live: the user's TRITON_CACHE_DIR, else ``<root>/triton``.

    A TRITON_CACHE_DIR that FlyDSL exported itself does not count as the
    user's: the folder follows the root, so pointing FLYDSL_CACHE_DIR
    elsewhere (as tests do) never lists or clears the real cache.
    """
    external = env.read_external("TRITON_CACHE_DIR")
    if external and external != _exported:
        return Path(external).expanduser()
    if _fallback is not None and _fallback[0] == str(root()):
        return _fallback[1]
    return root() / "triton"


def tuning_dir() -> Path:
    return root() / "tuning"


def configure_triton() -> None:
    """Point Triton's cache under the root, unless the user chose a folder.

    A root that cannot be written sends compiled kernels to a private
    temporary folder instead (one :class:`CacheWarning`).
    """
    global _exported, _fallback
    ours = str(root() / "triton")
    current = env.read_external("TRITON_CACHE_DIR")
    if not current:
        if not writable(root() / "triton"):
            temp = _private_temp_dir()
            _fallback = (str(root()), temp)
            warn_once(
                f"root|{root()}",
                f"the FlyDSL cache folder {root()} cannot be written (read-only, or not a folder); compiled "
                f"kernels go to {temp} for now. Point FLYDSL_CACHE_DIR at a writable folder to keep them.",
            )
            ours = str(temp)
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


# ---------------------------------------------------------------------------
# Triton's compiled-kernel cache, read defensively
# ---------------------------------------------------------------------------

_BINARY_SUFFIXES = (".cubin", ".hsaco")


def _whole_elf(path: Path) -> str | None:
    """None when ``path`` is an ELF file at least as long as its headers say, else what is wrong."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        return f"unreadable ({exc})"
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] not in (1, 2):
        return "not a 64-bit ELF binary"
    order = "<" if head[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
    end = max(64, phoff + phentsize * phnum, shoff + shentsize * shnum)
    if size < end:
        return f"truncated ({size} bytes, its headers reach {end})"
    return None


def check_kernel_group(folder: Path, group: object, metadata_name: str) -> str | None:
    """Why a Triton cache group (the ``child_paths`` of its ``__grp__`` file) must not be served, or None.

    Every child must be a file inside ``folder`` (a planted group could point
    anywhere), the metadata must be a JSON object naming its target, and a
    device binary must be a whole ELF file. Only JSON is parsed.
    """
    if not isinstance(group, dict) or not group.get(metadata_name):
        return "no metadata entry"
    base = os.path.realpath(folder)
    for child, where in group.items():
        if not isinstance(child, str) or not isinstance(where, str):
            return "names that are not strings"
        real = os.path.realpath(where)
        if os.path.dirname(real) != base:
            return f"{child} points outside its folder ({where})"
        if not os.path.isfile(real):
            return f"{child} is missing"
        if child.endswith(_BINARY_SUFFIXES):
            problem = _whole_elf(Path(real))
            if problem is not None:
                return f"{child} is {problem}"
    try:
        meta = json.loads(Path(group[metadata_name]).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{metadata_name} is not valid JSON ({exc})"
    target = meta.get("target") if isinstance(meta, dict) else None
    if not isinstance(target, dict) or not {"backend", "arch", "warp_size"} <= target.keys():
        return f"{metadata_name} names no target"
    return None


def _checked_manager_class():
    """Build :class:`CheckedCacheManager` on first use: Triton is imported only when Triton asks for it."""
    from triton.runtime.cache import FileCacheManager

    class CheckedCacheManager(FileCacheManager):
        """Triton's file cache, except that a damaged entry is a miss and a read-only folder is survived.

        - ``get_group``: an ``__grp__`` file that is not valid JSON, or a
          group whose files are missing, outside the entry's folder, a cut
          device binary or unreadable metadata, is reported once
          (:class:`CacheWarning`) and treated as absent, so Triton compiles
          again and overwrites it (its writes are atomic renames).
        - a cache folder that cannot be created or written sends this entry
          to a private temporary folder (one warning).
        """

        def __init__(self, key, override=False, dump=False):
            try:
                super().__init__(key, override=override, dump=dump)
            except OSError as exc:
                if override or dump:
                    raise
                self._to_temp(key, exc)

        def _to_temp(self, key, exc) -> None:
            temp = _private_temp_dir()
            warn_once(
                f"triton|{os.path.dirname(self.cache_dir or '')}",
                f"Triton's cache folder cannot be written ({exc}); compiled kernels go to {temp} for now",
            )
            self.cache_dir = str(temp / key)
            self.lock_path = os.path.join(self.cache_dir, "lock")
            os.makedirs(self.cache_dir, exist_ok=True)

        def get_group(self, filename):
            grp = self._make_path(f"__grp__{filename}")
            try:
                group = super().get_group(filename)
            except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
                problem = f"unreadable group file ({type(exc).__name__}: {exc})"
            else:
                if group is None:
                    return None
                problem = check_kernel_group(Path(self.cache_dir), group, filename)
                if problem is None:
                    return group
            warn_once(grp, f"ignoring Triton cache entry {grp}: {problem}; recompiling it")
            return None

        def put(self, data, filename, binary=True):
            try:
                return super().put(data, filename, binary=binary)
            except OSError as exc:
                self._to_temp(self.key, exc)
                return super().put(data, filename, binary=binary)

    CheckedCacheManager.__module__ = __name__
    CheckedCacheManager.__qualname__ = "CheckedCacheManager"
    return CheckedCacheManager


def install_checked_manager() -> None:
    """Make :class:`CheckedCacheManager` Triton's cache manager in this process, unless the user set
    ``TRITON_CACHE_MANAGER``. Set through Triton's knob, not the environment: a child process inherits no
    setting that would make a Triton without FlyDSL import ``flydsl.cache``. Called once Triton is imported
    (by :mod:`flydsl.compiler`)."""
    if env.read_external("TRITON_CACHE_MANAGER"):
        return
    import triton

    triton.knobs.cache.manager_class = _checked_manager_class_cached()


@functools.cache
def _checked_manager_class_cached():
    return _checked_manager_class()


def __getattr__(name: str):
    # Triton resolves TRITON_CACHE_MANAGER="flydsl.cache:CheckedCacheManager" with getattr; the class
    # subclasses Triton's, so it is built lazily to keep `import flydsl` from importing Triton.
    if name == "CheckedCacheManager":
        cls = _checked_manager_class_cached()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
