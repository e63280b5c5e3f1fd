"""Where tuning winners live between processes: plain JSON, written atomically.

Two stores, both plain data to the resolver (JSON only: a cache file must
never be able to run code, so no object serialization format is used here):

- :class:`LocalCache`: winners searched on this machine, one small file per
  ``(tunable, arch, key)`` under ``FLYDSL_CACHE_DIR/tuning``. An entry is only
  served to a process with the same Triton version and device name as the
  one that searched it: a new compiler or another GPU model can change which
  config is fastest, so the entry is ignored rather than trusted.
- :class:`ArtifactFile`: the offline artifact a family package ships
  (``<pkg>/artifacts/<name>.json``), matched by arch and key only, since it is
  meant to serve every machine of that arch.

Anything missing is silent; anything corrupt or mismatched is ignored with one
:class:`TuningWarning` per file and process, so a bad file never breaks a
kernel call and never floods the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import cache
from ..errors import TuningError

__all__ = [
    "SCHEMA_VERSION",
    "ArtifactFile",
    "LocalCache",
    "TuningWarning",
    "atomic_write_json",
    "identity",
    "key_string",
    "write_artifact",
]

SCHEMA_VERSION = 1

# Names and arches become path components. Anything outside this set (a "/",
# AMD's "gfx942:sramecc+:xnack-") is replaced, so a caller's string is always
# one segment that cannot climb out of the cache root; the file's contents
# still carry the exact name and arch, so two strings that map to the same
# segment never serve each other's entries.
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.+-]")


class TuningWarning(UserWarning):
    """A tuning cache or artifact file was ignored (corrupt, stale or mismatched)."""


# ---------------------------------------------------------------------------
# warnings, identity, keys
# ---------------------------------------------------------------------------

# one token set for every cache warning (flydsl.cache.warn_once); a partial adds no frame, so the warning
# still points at the caller of the function that warns
_warn_once = functools.partial(cache.warn_once, category=TuningWarning)


def _dist_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=1)
def _process_identity() -> tuple[str, str, str, str]:
    """(device_name, triton, torch, flydsl) of this process; fixed for its lifetime."""
    try:
        import torch

        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a broken driver must not break config selection
        device_name = "unknown"
    flydsl_version = _dist_version("flydsl-runtime")
    if flydsl_version == "unknown":
        # Running from a source tree (PYTHONPATH) rather than an install.
        from .._version import __version__ as flydsl_version
    return device_name, _dist_version("triton"), _dist_version("torch"), flydsl_version


def identity(arch: str) -> dict[str, str]:
    """What produced a tuning result: arch, device name and the versions that matter.

    ``device_name`` is ``torch.cuda.get_device_name()`` of the current device,
    or ``"cpu"`` without CUDA; versions come from the installed distributions
    (``"unknown"`` when not installed). Triton is never imported.

    Example::

        >>> identity("sm_90")["device_name"]
        'NVIDIA H200'
    """
    device_name, triton_v, torch_v, flydsl_v = _process_identity()
    return {"arch": arch, "device_name": device_name, "triton": triton_v, "torch": torch_v, "flydsl": flydsl_v}


def key_string(key: Mapping[str, Any]) -> str:
    """Canonical text of a tuning key: compact JSON with sorted names.

    Values must be JSON scalars (int, float, str, bool, None); non-finite
    floats are refused because they have no JSON spelling.

    Example::

        >>> key_string({"n": 4096, "dtype": "bf16"})
        '{"dtype":"bf16","n":4096}'
    """
    return json.dumps(dict(key), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(key_string(key).encode("utf-8")).hexdigest()[:20]


def _segment(what: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"tuning {what} must be a non-empty string, got {value!r}")
    safe = _UNSAFE_CHARS.sub("_", value)
    return "_" + safe if safe.startswith(".") else safe


def _is_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (bool, int, str))


def _is_key(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(k, str) and _is_scalar(v) for k, v in obj.items())


def _is_config(obj: Any) -> bool:
    return isinstance(obj, dict) and all(isinstance(k, str) for k in obj)


def _is_time(value: Any, *, optional: bool) -> bool:
    if value is None:
        return optional
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------


def atomic_write_json(path: Path, obj: Any, *, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` so readers only ever see a whole file.

    The text goes to a temporary file in the same folder, is flushed and
    fsynced, then renamed over ``path`` (``os.replace`` is atomic on POSIX).
    Concurrent writers of the same path all succeed; the last rename wins.
    Parent folders are created. On any failure the temporary file is removed
    and an existing ``path`` is left untouched.
    """
    path = Path(path)
    # Serialize first: an unserializable object must fail before touching disk.
    text = json.dumps(obj, indent=indent, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # Keep the permissions of the file being replaced; mkstemp's 0600 would
        # make a shipped artifact unreadable to other users.
        mode = path.stat().st_mode & 0o777
    except OSError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_json(path: Path) -> tuple[Any, str | None]:
    """(object, None) or (None, why it could not be read); missing files raise FileNotFoundError.

    A path that runs through a file (a file where the cache folder should be)
    counts as missing: no entry can be there, and the cache root's own
    problem is reported once where the root is configured, not once a key.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except NotADirectoryError as exc:
        raise FileNotFoundError(exc.errno, exc.strerror, str(path)) from exc
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"unreadable ({exc})"
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"not valid JSON ({exc})"


# ---------------------------------------------------------------------------
# local cache
# ---------------------------------------------------------------------------


class LocalCache:
    """Winners searched on this machine: ``root/<name>/<arch>/<sha256(key)[:20]>.json``.

    ``root`` defaults to ``flydsl.cache.tuning_dir()``, read at each use so a
    changed ``FLYDSL_CACHE_DIR`` takes effect immediately.
    """

    def __init__(self, root: Path | None = None) -> None:
        self._root = Path(root) if root is not None else None

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else cache.tuning_dir()

    def path(self, name: str, arch: str, key: Mapping[str, Any]) -> Path:
        """The file that holds (or would hold) the winner for ``(name, arch, key)``."""
        return self.root / _segment("name", name) / _segment("arch", arch) / f"{_key_hash(key)}.json"

    def load(self, name: str, arch: str, key: Mapping[str, Any]) -> dict | None:
        """The cached winner's config dict, or None.

        A corrupt file, another schema, another name/arch/key (a hash
        collision), or an entry searched with another Triton version or on
        another device model is ignored with one :class:`TuningWarning` per
        path and process.
        """
        path = self.path(name, arch, key)
        try:
            obj, problem = _read_json(path)
        except FileNotFoundError:
            return None
        if problem is None:
            problem = self._mismatch(obj, name, arch, key)
        if problem is not None:
            _warn_once(str(path), f"ignoring tuning cache file {path}: {problem}")
            return None
        return dict(obj["config"])

    @staticmethod
    def _mismatch(obj: Any, name: str, arch: str, key: Mapping[str, Any]) -> str | None:
        if not isinstance(obj, dict):
            return "not a JSON object"
        if obj.get("schema") != SCHEMA_VERSION:
            return f"schema {obj.get('schema')!r}, expected {SCHEMA_VERSION}"
        if obj.get("name") != name or obj.get("arch") != arch:
            return f"holds {obj.get('name')!r}/{obj.get('arch')!r}, expected {name!r}/{arch!r}"
        if not _is_key(obj.get("key")) or key_string(obj["key"]) != key_string(key):
            return f"holds key {obj.get('key')!r}, expected {dict(key)!r}"
        if not _is_config(obj.get("config")):
            return "no config object"
        ident = identity(arch)
        for field in ("triton", "device_name"):
            if obj.get(field) != ident[field]:
                return f"searched with {field} {obj.get(field)!r}, this process has {ident[field]!r}"
        return None

    def save(
        self,
        name: str,
        arch: str,
        key: Mapping[str, Any],
        config: Mapping[str, Any],
        *,
        time_us: float,
        default_time_us: float | None,
        candidates: int,
    ) -> Path:
        """Store a searched winner atomically; returns the file written.

        ``config`` is the winner as a dict (a dataclass instance is converted).
        """
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            config = dataclasses.asdict(config)
        path = self.path(name, arch, key)
        entry = {
            "schema": SCHEMA_VERSION,
            "name": name,
            **identity(arch),
            "key": dict(key),
            "config": dict(config),
            "time_us": float(time_us),
            "default_time_us": None if default_time_us is None else float(default_time_us),
            "candidates": int(candidates),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        atomic_write_json(path, entry)
        return path


# ---------------------------------------------------------------------------
# shipped artifacts
# ---------------------------------------------------------------------------


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "not an object"
    if not isinstance(entry.get("arch"), str):
        return "no arch"
    if not _is_key(entry.get("key")):
        return "key is not an object of scalars"
    if not _is_config(entry.get("config")):
        return "config is not an object"
    if not _is_time(entry.get("time_us"), optional=True) or not _is_time(entry.get("default_time_us"), optional=True):
        return "times are not finite numbers"
    return None


def _parse_artifact(obj: Any, name: str) -> tuple[list[dict], int, str | None]:
    """(well-formed entries, count of malformed ones, reason the whole file is unusable)."""
    if not isinstance(obj, dict):
        return [], 0, "not a JSON object"
    if obj.get("schema") != SCHEMA_VERSION:
        return [], 0, f"schema {obj.get('schema')!r}, expected {SCHEMA_VERSION}"
    if obj.get("name") != name:
        return [], 0, f"artifact name {obj.get('name')!r}, expected {name!r}"
    raw = obj.get("entries")
    if not isinstance(raw, list):
        return [], 0, "no entries list"
    good = [e for e in raw if _entry_problem(e) is None]
    return good, len(raw) - len(good), None


class ArtifactFile:
    """A family's shipped tuning artifact, read lazily once per instance.

    Format::

        {"schema": 1, "name": "<name>", "entries": [
            {"arch", "device_name", "triton", "torch", "key": {...}, "config": {...},
             "time_us": float, "default_time_us": float | null}, ...]}

    Lookup is by ``(arch, key_string(key))``. A missing file is silently
    empty; a corrupt file, another schema or another name makes the whole
    file ignored, and malformed entries are skipped, each case with one
    :class:`TuningWarning` per process.
    """

    def __init__(self, path: Path, name: str) -> None:
        self.path = Path(path)
        self.name = name
        self._table: dict[tuple[str, str], dict] | None = None
        self._lock = threading.Lock()

    def lookup(self, arch: str, key: Mapping[str, Any]) -> dict | None:
        """The shipped config dict for ``(arch, key)``, or None."""
        table = self._table
        if table is None:
            table = self._load()
        config = table.get((arch, key_string(key)))
        return None if config is None else dict(config)

    def _load(self) -> dict[tuple[str, str], dict]:
        with self._lock:
            if self._table is not None:
                return self._table
            table: dict[tuple[str, str], dict] = {}
            try:
                obj, problem = _read_json(self.path)
            except FileNotFoundError:
                obj, problem = None, None
            else:
                entries, malformed, unusable = _parse_artifact(obj, self.name) if problem is None else ([], 0, problem)
                if unusable is not None:
                    _warn_once(str(self.path), f"ignoring tuning artifact {self.path}: {unusable}")
                elif malformed:
                    _warn_once(str(self.path), f"tuning artifact {self.path}: skipped {malformed} malformed entries")
                for entry in entries:
                    slot = (entry["arch"], key_string(entry["key"]))
                    # Duplicates only come from hand edits; prefer the entry
                    # tuned on this device model, else keep the first.
                    if slot not in table or entry.get("device_name") == identity(entry["arch"])["device_name"]:
                        table[slot] = entry["config"]
            self._table = table
            return table


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """Hold an exclusive advisory lock on ``folder`` (POSIX ``flock`` on the folder itself).

    Serializes read-merge-write updates between processes without leaving a
    lock file next to the artifacts. Where ``fcntl`` does not exist the
    update runs unlocked (any reader still sees a whole file).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def write_artifact(path: Path, name: str, entries: list[dict]) -> None:
    """Merge ``entries`` into the artifact at ``path`` and write it atomically.

    Existing well-formed entries are kept unless a new entry has the same
    ``(arch, key)``; the result is sorted by ``(arch, key string)`` and written
    with ``indent=1`` so diffs of regenerated artifacts stay small. A corrupt
    existing file is replaced (with a warning); a file that belongs to another
    artifact name raises :class:`TuningError`. Concurrent writers (processes
    tuning different keys into one artifact) are serialized by a lock on the
    artifact's folder, so none loses another's entries; any reader always
    sees a whole file.
    """
    path = Path(path)
    for entry in entries:
        bad = _entry_problem(entry)
        if bad is not None:
            raise ValueError(f"artifact entry {entry!r}: {bad}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(path.parent):
        _merge_artifact(path, name, entries)


def _merge_artifact(path: Path, name: str, entries: list[dict]) -> None:
    merged: dict[tuple[str, str], dict] = {}
    try:
        obj, problem = _read_json(path)
    except FileNotFoundError:
        obj, problem = None, "missing"
    if problem is None:
        old, malformed, unusable = _parse_artifact(obj, name)
        if isinstance(obj, dict) and obj.get("name") not in (None, name):
            raise TuningError(f"{path} holds the artifact {obj.get('name')!r}, not {name!r}; refusing to overwrite it")
        if unusable is not None:
            warnings.warn(f"replacing unusable tuning artifact {path}: {unusable}", TuningWarning, stacklevel=3)
        elif malformed:
            warnings.warn(f"dropping {malformed} malformed entries of {path}", TuningWarning, stacklevel=3)
        for entry in old:
            merged[(entry["arch"], key_string(entry["key"]))] = entry
    elif problem != "missing":
        warnings.warn(f"replacing unusable tuning artifact {path}: {problem}", TuningWarning, stacklevel=3)
    for entry in entries:
        merged[(entry["arch"], key_string(entry["key"]))] = dict(entry)
    ordered = [merged[slot] for slot in sorted(merged)]
    atomic_write_json(path, {"schema": SCHEMA_VERSION, "name": name, "entries": ordered}, indent=1)
