"""Tunable launch configs: cheap resolution on every call, bounded search on request.

A family describes one config space with a :class:`Tunable` (its config
dataclass, a pure default heuristic, a bounded candidate list and the one
validity predicate) and calls :meth:`Tunable.select` on every launch. A normal
call never benchmarks; it serves, in order:

1. a winner searched in this process (``FLYDSL_AUTOTUNE=1`` or ``autotune=True``);
2. the winner searched earlier on this machine (:class:`~.store.LocalCache`);
3. the family's shipped artifact (:class:`~.store.ArtifactFile`), unless
   ``FLYDSL_USE_ARTIFACTS=0``;
4. the default heuristic.

The answer is memoized per ``(key, arch)``, so after the first call a launch
pays one dict lookup. A search checks every candidate against the reference
before timing it (a wrong candidate is never timed) and keeps the default
unless something beats it by more than 2%.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import env
from ..errors import TuningError
from . import timer
from .store import ArtifactFile, LocalCache, _segment, _warn_once, identity, key_string, write_artifact

__all__ = ["TIE_TOLERANCE", "SearchResult", "SearchTask", "Tunable", "precompile", "tune_artifact"]

_log = logging.getLogger("flydsl.autotune")

# A candidate must beat the default by more than this to replace it: timing
# noise between windows is about 1-2%, and the default is the config every
# machine without a search runs, so it deserves the benefit of the doubt.
TIE_TOLERANCE = 0.02

SOURCES = ("memo", "searched", "cache", "artifact", "default")


@dataclass(frozen=True)
class SearchTask:
    """What a search needs to run, check and time one candidate.

    ``run(config)`` launches with that config and returns its output (a tensor
    or a tuple of tensors); ``reference()`` returns the expected output in the
    same structure. A candidate passes when every output tensor has the
    reference's shape, is finite and has ``||out - ref|| / ||ref|| <= rtol``
    (computed in float64). ``bench`` times a zero-argument callable and returns
    microseconds (default: :func:`flydsl.autotune.timer.bench`'s median);
    ``prepare`` runs before each candidate's checked run (e.g. to re-poison
    the output buffers so unwritten elements fail). ``view``, when given, maps
    both run's output and the reference to what is compared (e.g. quantized
    values times their scales); it runs outside the timed calls, so only
    ``run`` is timed.
    """

    run: Callable[[Any], Any]
    reference: Callable[[], Any]
    rtol: float
    bench: Callable[[Callable[[], Any]], float] | None = None
    prepare: Callable[[], None] | None = None
    view: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class SearchResult:
    """Outcome of :meth:`Tunable.search`.

    ``timings`` lists every timed (correct) candidate with its time in
    microseconds; ``rejected`` every candidate that failed or was wrong, with
    the reason (those are never timed).
    """

    config: Any
    time_us: float
    default_time_us: float | None
    timings: tuple[tuple[Any, float], ...]
    rejected: tuple[tuple[Any, str], ...]
    source: str = "searched"


# ---------------------------------------------------------------------------
# output check
# ---------------------------------------------------------------------------


def _flatten(out: Any) -> list[Any]:
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in _flatten(item)]
    return [out]


# Elements a check widens to float64 at once: a whole 7.5e9-element output (a DeepSeek-V3 grouped weight
# gradient, [256, 4096, 7168]) would take 56 GiB more at once; a chunk takes 512 MiB.
_CHECK_CHUNK = 1 << 26


def _mismatch(out: Any, ref: Any, rtol: float) -> str | None:
    """Why ``out`` does not match ``ref`` within ``rtol``, or None when it does."""
    import torch

    outs, refs = _flatten(out), _flatten(ref)
    if len(outs) != len(refs):
        return f"returned {len(outs)} outputs, the reference has {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o is None or r is None:
            if o is not r:
                return f"output {i} is {'None' if o is None else 'a value'}, the reference's is not"
            continue
        o = o if isinstance(o, torch.Tensor) else torch.as_tensor(o)
        r = r if isinstance(r, torch.Tensor) else torch.as_tensor(r)
        if o.shape != r.shape:
            return f"output {i} has shape {tuple(o.shape)}, the reference {tuple(r.shape)}"
        wide = torch.complex128 if (o.is_complex() or r.is_complex()) else torch.float64
        o_flat, r_flat = o.detach().reshape(-1), r.detach().reshape(-1)
        diff_sq = norm_sq = 0.0  # squared norms summed over the chunks, in Python's float64
        for start in range(0, o_flat.numel(), _CHECK_CHUNK):
            o64 = o_flat[start : start + _CHECK_CHUNK].to(dtype=wide)
            r64 = r_flat[start : start + _CHECK_CHUNK].to(device=o64.device, dtype=wide)
            if not bool(torch.isfinite(o64).all()):
                return f"output {i} has NaN or inf"
            diff_sq += float(torch.linalg.vector_norm(o64 - r64)) ** 2
            norm_sq += float(torch.linalg.vector_norm(r64)) ** 2
        diff, norm = math.sqrt(diff_sq), math.sqrt(norm_sq)
        # An all-zero reference leaves only the absolute error to judge.
        err = diff / norm if norm > 0 else diff
        if not err <= rtol:
            return f"output {i} has relative error {err:.3g} > rtol {rtol:g}"
    return None


# ---------------------------------------------------------------------------
# the tunable
# ---------------------------------------------------------------------------


def _freeze(value: Any) -> Any:
    # JSON turns tuples into lists; frozen configs want them back as tuples.
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True, eq=False)
class Tunable:
    """One tunable config space of a family (e.g. the softmax forward launch).

    ``config_type`` is a frozen dataclass; configs are stored as
    ``dataclasses.asdict`` and restored with ``config_type(**d)``.
    ``default(key, arch)`` is the pure fallback heuristic;
    ``candidates(key, arch)`` a bounded list searched with the default;
    ``is_valid(config, key, arch)`` the one validity predicate, which prunes
    candidates and rejects stored configs. ``artifact_dir`` is the family's
    ``artifacts/`` folder (``<name>.json`` inside). ``make_task(key, device)``
    and ``tune_keys(arch)`` serve offline tuning (``flydsl tune``).

    Keys are flat mappings of JSON scalars, bucketed by the family so that a
    new batch size does not mean a new search. Example::

        SOFTMAX = Tunable("softmax_fwd", SoftmaxConfig, default=softmax_default,
                          candidates=softmax_candidates, is_valid=softmax_valid,
                          artifact_dir=Path(__file__).parent / "artifacts")
        cfg = SOFTMAX.select({"n": bucket(n), "dtype": "bf16"}, arch.name(), task=make_task)
    """

    name: str
    config_type: type
    default: Callable[[Mapping, str], Any]
    candidates: Callable[[Mapping, str], Sequence[Any]]
    is_valid: Callable[[Any, Mapping, str], bool]
    artifact_dir: Path | None = None
    max_candidates: int = 64
    make_task: Callable[[Mapping, Any], SearchTask] | None = None
    tune_keys: Callable[[str], Sequence[Mapping]] = lambda arch: ()
    # Per-process state. The memo maps (sorted key items, arch) to (config, source).
    _memo: dict = field(default_factory=dict, init=False, repr=False)
    _state: dict = field(default_factory=dict, init=False, repr=False)
    _lock: Any = field(default_factory=threading.RLock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.config_type, type) and dataclasses.is_dataclass(self.config_type)):
            raise TypeError(f"Tunable {self.name!r}: config_type must be a dataclass type, got {self.config_type!r}")
        _segment("name", self.name)  # fails early on an empty or non-string name
        if self.max_candidates < 1:
            raise ValueError(f"Tunable {self.name!r}: max_candidates must be >= 1, got {self.max_candidates}")

    # -- resolution ---------------------------------------------------------

    def select(
        self,
        key: Mapping[str, Any],
        arch: str,
        *,
        autotune: bool | None = None,
        task: Callable[[], SearchTask] | None = None,
    ) -> Any:
        """The config to launch with for ``(key, arch)``; never benchmarks unless asked.

        ``autotune`` (default: ``FLYDSL_AUTOTUNE``) searches once per key and
        process, using ``task()`` to build the :class:`SearchTask`, and caches
        the winner on this machine. Otherwise the order is: memo, local cache,
        shipped artifact (unless ``FLYDSL_USE_ARTIFACTS=0``), default.
        """
        mkey = (tuple(sorted(key.items())), arch)
        hit = self._memo.get(mkey)
        if hit is not None:
            # A searched winner is final for the process; otherwise only an
            # explicit or environment request for a search overrides the memo.
            if hit[1] == "searched" or autotune is False:
                return hit[0]
            if autotune is None:
                autotune = env.get("FLYDSL_AUTOTUNE")
            if not autotune:
                return hit[0]
        elif autotune is None:
            autotune = env.get("FLYDSL_AUTOTUNE")
        if autotune:
            return self._search_once(mkey, key, arch, task)
        config, source = self._resolve(key, arch)
        self._memo[mkey] = (config, source)
        return config

    def explain(self, key: Mapping[str, Any], arch: str) -> tuple[Any, str]:
        """(config, source) that :meth:`select` would serve now, without searching or memoizing.

        ``source`` is ``"searched"`` for a winner searched in this process,
        ``"memo"`` for another memoized answer, else ``"cache"``,
        ``"artifact"`` or ``"default"``.
        """
        hit = self._memo.get((tuple(sorted(key.items())), arch))
        if hit is not None:
            return hit[0], "searched" if hit[1] == "searched" else "memo"
        return self._resolve(key, arch)

    def clear_memo(self) -> None:
        """Forget every memoized answer and searched key, and re-read the artifact on next use."""
        with self._lock:
            self._memo.clear()
            self._state.clear()

    def _search_once(
        self, mkey: tuple, key: Mapping[str, Any], arch: str, task: Callable[[], SearchTask] | None
    ) -> Any:
        with self._lock:
            hit = self._memo.get(mkey)
            if hit is not None and hit[1] == "searched":  # another thread finished it
                return hit[0]
            if task is None:
                raise TuningError(
                    f"autotuning {self.name} for {key_string(key)} on {arch} needs a search task, "
                    "but the call site gave no search task (task=None); unset FLYDSL_AUTOTUNE "
                    "or pass autotune=False to use the stored config"
                )
            return self.search(key, arch, task(), persist=True).config

    @property
    def artifact_path(self) -> Path | None:
        """The shipped artifact's file: ``artifact_dir / f"{name}.json"`` (None without an artifact_dir)."""
        return None if self.artifact_dir is None else Path(self.artifact_dir) / f"{self.name}.json"

    def _artifact(self) -> ArtifactFile | None:
        if self.artifact_path is None:
            return None
        art = self._state.get("artifact")
        if art is None:
            art = self._state.setdefault("artifact", ArtifactFile(self.artifact_path, self.name))
        return art

    def _restore(self, data: dict, key: Mapping[str, Any], arch: str, where: str) -> Any | None:
        """``config_type(**data)`` when constructible and valid, else None with one warning."""
        try:
            config = self.config_type(**{k: _freeze(v) for k, v in data.items()})
        except (TypeError, ValueError) as exc:
            problem = f"does not build a {self.config_type.__name__} ({exc})"
        else:
            try:
                if self.is_valid(config, key, arch):
                    return config
                problem = f"{config!r} fails {self.name}'s validity check"
            except Exception as exc:  # noqa: BLE001 - a predicate choking on odd values means invalid
                problem = f"{config!r} made the validity check raise {type(exc).__name__}: {exc}"
        _warn_once(
            f"{where}|{self.name}|{arch}|{key_string(key)}",
            f"ignoring the {self.name} config for {key_string(key)} on {arch} from {where}: {problem}",
        )
        return None

    def _resolve(self, key: Mapping[str, Any], arch: str) -> tuple[Any, str]:
        store = LocalCache()
        data = store.load(self.name, arch, key)
        if data is not None:
            config = self._restore(data, key, arch, str(store.path(self.name, arch, key)))
            if config is not None:
                return config, "cache"
        if env.get("FLYDSL_USE_ARTIFACTS"):
            art = self._artifact()
            data = art.lookup(arch, key) if art is not None else None
            if data is not None:
                config = self._restore(data, key, arch, str(art.path))
                if config is not None:
                    return config, "artifact"
        return self.default(key, arch), "default"

    # -- search -------------------------------------------------------------

    def _candidate_list(self, key: Mapping[str, Any], arch: str) -> list[Any]:
        """Default first, then the candidates: deduplicated, valid, at most ``max_candidates``."""
        default = self.default(key, arch)
        out: list[Any] = []
        seen: set = set()

        def add(config: Any) -> None:
            if not isinstance(config, self.config_type):
                raise TuningError(f"{self.name}: candidates() gave {config!r}, not a {self.config_type.__name__}")
            try:
                if config in seen:
                    return
                seen.add(config)
            except TypeError:  # unhashable field: fall back to a linear check
                if config in out:
                    return
            if not self.is_valid(config, key, arch):
                return
            out.append(config)

        add(default)
        if not out:
            _log.warning("%s: the default %r for %s on %s fails is_valid", self.name, default, key_string(key), arch)
        for config in self.candidates(key, arch):
            if len(out) >= self.max_candidates:
                _log.info("%s: candidate list truncated to %d", self.name, self.max_candidates)
                break
            add(config)
        return out

    def search(
        self,
        key: Mapping[str, Any],
        arch: str,
        task: SearchTask,
        *,
        persist: bool = True,
        progress: bool | None = None,
    ) -> SearchResult:
        """Check, time and rank the candidates of ``(key, arch)``; returns the winner.

        Every candidate is run once after ``task.prepare()`` and compared with
        the reference; a candidate that raises or is wrong is rejected and
        never timed. The fastest correct candidate wins, except that the
        default keeps its place within a 2% tie. With ``persist`` the winner
        is saved to the local cache and memoized for this process.
        ``progress`` (default ``FLYDSL_PROGRESS``) shows a bar on a terminal.
        Raises :class:`TuningError` when no candidate is correct.
        """
        from tqdm.auto import tqdm

        default = self.default(key, arch)
        configs = self._candidate_list(key, arch)
        reference = task.reference()
        view = task.view if task.view is not None else (lambda out: out)
        reference = view(reference)
        time_fn = task.bench if task.bench is not None else (lambda fn: timer.bench(fn).median_us)
        if progress is None:
            progress = env.get("FLYDSL_PROGRESS")
        timings: list[tuple[Any, float]] = []
        rejected: list[tuple[Any, str]] = []

        def reject(config: Any, reason: str) -> None:
            rejected.append((config, reason))
            _log.warning("%s %s on %s: rejected %r: %s", self.name, key_string(key), arch, config, reason)

        # disable=None lets tqdm hide itself when stderr is not a terminal.
        bar = tqdm(configs, desc=f"tuning {self.name}", unit="cfg", leave=False, disable=None if progress else True)
        for config in bar:
            if task.prepare is not None:
                task.prepare()
            try:
                out = view(task.run(config))
                reason = _mismatch(out, reference, task.rtol)
            except Exception as exc:  # noqa: BLE001 - any failure of a candidate only disqualifies it
                reason = f"raised {type(exc).__name__}: {exc}"
            if reason is not None:
                reject(config, reason)
                continue
            try:
                us = float(time_fn(lambda config=config: task.run(config)))
            except Exception as exc:  # noqa: BLE001 - same: a candidate failing under timing is dropped
                reject(config, f"timing raised {type(exc).__name__}: {exc}")
                continue
            if not (math.isfinite(us) and us > 0):
                reject(config, f"timing returned {us} us")
                continue
            timings.append((config, us))

        if not timings:
            lines = "\n".join(f"  {c!r}: {r}" for c, r in rejected) or "  (no valid candidates)"
            raise TuningError(f"{self.name}: no correct candidate for {key_string(key)} on {arch}:\n{lines}")
        best, best_us = min(timings, key=lambda t: t[1])
        default_us = next((us for c, us in timings if c == default), None)
        if default_us is not None and default_us <= (1.0 + TIE_TOLERANCE) * best_us:
            best, best_us = default, default_us
        result = SearchResult(best, best_us, default_us, tuple(timings), tuple(rejected))
        _log.info(
            "%s %s on %s: %r at %.2f us (default %s us)", self.name, key_string(key), arch, best, best_us, default_us
        )
        if persist:
            try:
                LocalCache().save(
                    self.name,
                    arch,
                    key,
                    dataclasses.asdict(best),
                    time_us=best_us,
                    default_time_us=default_us,
                    candidates=len(configs),
                )
            except OSError as exc:  # a read-only cache must not lose the searched answer
                _log.warning("%s: could not cache the tuning winner: %s", self.name, exc)
            self._memo[(tuple(sorted(key.items())), arch)] = (best, "searched")
        return result


def narrowed(tunable: Tunable, where: Mapping[str, Any], artifact: Path | None = None) -> Tunable:
    """``tunable`` whose search holds, for each key, only the candidates with every item of ``where`` (a
    config field -> value) beside the key's entry in ``artifact`` (default: the tunable's own), which an
    earlier search found over the rest of the space; a key without an entry keeps the whole space. The
    default is searched as always. What a change added to a space is then searched against what it must
    beat, in a fraction of a full search."""
    fields = {f.name for f in dataclasses.fields(tunable.config_type)}
    if not isinstance(where, Mapping) or not where:
        raise TuningError(f"candidates: expected a non-empty object of {tunable.config_type.__name__} fields, "
                          f"got {where!r}")  # fmt: skip
    unknown = sorted(set(where) - fields)
    if unknown:
        raise TuningError(f"candidates: {', '.join(unknown)} not a field of {tunable.config_type.__name__} "
                          f"(fields: {', '.join(sorted(fields))})")  # fmt: skip
    artifact = artifact if artifact is not None else tunable.artifact_path
    if artifact is None:
        raise TuningError(f"{tunable.name} has no artifact_dir; pass the artifact")
    shipped = ArtifactFile(Path(artifact), tunable.name)
    space = tunable.candidates

    def candidates(key: Mapping[str, Any], arch: str) -> list[Any]:
        entry = shipped.lookup(arch, key)
        if entry is None:
            return list(space(key, arch))
        held = tunable._restore(entry, key, arch, str(artifact))
        new = [c for c in space(key, arch) if c != held and all(getattr(c, f) == v for f, v in where.items())]
        return ([] if held is None else [held]) + new  # the entry once, though it may hold ``where`` too

    return dataclasses.replace(tunable, candidates=candidates)


def tune_artifact(
    tunable: Tunable,
    keys: Iterable[Mapping[str, Any]] | None,
    arch: str,
    device: Any,
    out_path: Path | None = None,
    progress: bool = True,
    jobs: int = 1,
) -> Path:
    """Search every key offline and merge the winners into the family's artifact.

    ``keys`` defaults to ``tunable.tune_keys(arch)`` when None. Each key gets
    ``tunable.make_task(key, device)`` and a search that does not touch the
    local cache; the artifact (``out_path``, default
    ``tunable.artifact_dir / f"{tunable.name}.json"``) is rewritten after each
    key so an interrupted run keeps what it found. Keys whose search fails
    are reported together in one :class:`TuningError` after the others are
    written. Returns the artifact path.

    ``jobs`` > 1 compiles every candidate first in that many worker processes (:func:`precompile`), so the
    search, which times one candidate at a time, finds each kernel in the compile cache: a search is mostly
    compiles, one after another, and the machine's other cores would sit idle.
    """
    from tqdm.auto import tqdm

    if tunable.make_task is None:
        raise TuningError(f"{tunable.name} has no make_task, so it cannot be tuned offline")
    out_path = out_path if out_path is not None else tunable.artifact_path
    if out_path is None:
        raise TuningError(f"{tunable.name} has no artifact_dir; pass out_path")
    keys = list(tunable.tune_keys(arch) if keys is None else keys)
    if not keys:
        raise TuningError(f"no keys to tune {tunable.name} for on {arch}")
    ident = identity(arch)
    precompile(tunable, keys, arch, device, jobs)
    failures: list[str] = []
    for key in tqdm(keys, desc=f"{tunable.name} keys", unit="key", disable=None if progress else True):
        try:
            result = tunable.search(key, arch, tunable.make_task(key, device), persist=False, progress=progress)
        except TuningError as exc:
            failures.append(str(exc))
            continue
        entry = {
            "arch": arch,
            "device_name": ident["device_name"],
            "triton": ident["triton"],
            "torch": ident["torch"],
            "key": dict(key),
            "config": dataclasses.asdict(result.config),
            "time_us": result.time_us,
            "default_time_us": result.default_time_us,
        }
        write_artifact(out_path, tunable.name, [entry])
    # The process should now serve the new artifact, not answers memoized before it.
    tunable.clear_memo()
    if failures:
        raise TuningError(f"{len(failures)} of {len(keys)} keys failed:\n" + "\n".join(failures))
    return Path(out_path)


def _find_tunable(name: str) -> tuple[str, Tunable] | None:
    """(family, tunable) of the installed family that registers a tunable called ``name``; None if none does."""
    from ..families import discover

    for fam_name, fam in discover().items():
        for t in fam.tunables():
            if t.name == name:
                return fam_name, t
    return None


def _compile_worker(family: str, name: str, arch: str, device: Any, items: list[tuple[dict, dict]]) -> int:
    """Run each (key, config) once, in a process of its own, so that its kernels land in the compile cache;
    returns how many raised (the search meets them again and rejects them with the reason)."""
    from ..families import discover

    tunable = next(t for t in discover()[family].tunables() if t.name == name)
    failed, task, task_key = 0, None, None
    for key, config in items:
        try:
            if key != task_key:
                task, task_key = None, None  # free the last key's operands before building the next
                task, task_key = tunable.make_task(key, device), key
            if task.prepare is not None:
                task.prepare()
            task.run(tunable.config_type(**config))
        except Exception:  # noqa: BLE001 - the search itself reports a failing candidate
            failed += 1
    return failed


def precompile(tunable: Tunable, keys: Sequence[Mapping[str, Any]], arch: str, device: Any, jobs: int) -> int:
    """Compile every candidate of ``keys`` in ``jobs`` spawned processes, each running a contiguous share of
    the (key, candidate) list, so that a process builds few keys' operands. Returns the number of candidates
    run; 0 when ``tunable`` belongs to no installed family (a worker finds the tunable by its family's entry
    point) or there is nothing to split.

    The kernels land in the shared compile cache; the search then loads them instead of compiling. Each
    worker holds one key's operands at a time: ``jobs`` bounds the device memory taken at once."""
    import concurrent.futures
    import multiprocessing

    if jobs < 2:
        return 0
    found = _find_tunable(tunable.name)
    if found is None or found[1].make_task is None:
        _log.info("%s: not an installed family's tunable; candidates compile during the search", tunable.name)
        return 0
    items = [(dict(k), dataclasses.asdict(c)) for k in keys for c in tunable._candidate_list(k, arch)]
    if len(items) < 2:
        return 0
    jobs = min(jobs, len(items))
    share = math.ceil(len(items) / jobs)
    chunks = [items[i : i + share] for i in range(0, len(items), share)]
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with concurrent.futures.ProcessPoolExecutor(max_workers=len(chunks), mp_context=ctx) as pool:
        futures = [pool.submit(_compile_worker, found[0], tunable.name, arch, device, c) for c in chunks]
        failed = sum(f.result() for f in futures)
    _log.info("%s: precompiled %d candidates of %d keys in %d processes (%d raised)", tunable.name, len(items),
              len(keys), len(chunks), failed)  # fmt: skip
    return len(items)
