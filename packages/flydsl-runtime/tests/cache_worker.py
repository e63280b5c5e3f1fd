"""The child processes of test_cache_reliability.py (not a test module).

A parent starts each child with ``multiprocessing`` (spawn) and has it run
``runpy.run_path(this file)[<role>](**params)``, after setting the child's
environment, so the child chooses compiled Triton (``FLYDSL_INTERPRET=0``)
before anything imports triton: kernels compile for sm_90 with Triton's own
compiler and bundled ptxas, no GPU needed, through the real compile cache.
Results go to a JSON file the parent reads.
"""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from pathlib import Path

# Importing flydsl chooses the backend (before triton is imported) and configures the cache root, which may
# warn; those warnings are recorded so a role can report them.
with warnings.catch_warnings(record=True) as _import_warnings:
    warnings.simplefilter("always")
    import flydsl  # noqa: F401

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl import cache
from flydsl.autotune import ArtifactFile, LocalCache, TuningWarning, write_artifact


@flyc.kernel
def scale_kernel(x_ptr, y_ptr, n, SCALE: fx.constexpr, BLOCK: fx.constexpr):
    offs = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    fx.store(y_ptr + offs, fx.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)


@flyc.kernel
def axpy_kernel(x_ptr, y_ptr, n, SCALE: fx.constexpr, BLOCK: fx.constexpr):
    offs = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    y = fx.load(y_ptr + offs, mask=mask)
    fx.store(y_ptr + offs, fx.load(x_ptr + offs, mask=mask) * SCALE + y, mask=mask)


KERNELS = {"scale": scale_kernel, "axpy": axpy_kernel}


def compile_variant(kernel: str, scale: float, block: int):
    """Compile one specialization for sm_90 through Triton's cache; returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "SCALE": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(KERNELS[kernel], sig, {(3,): scale, (4,): block})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _fingerprint(compiled) -> dict:
    return {"hash": compiled.hash, "cubin": hashlib.sha256(compiled.asm["cubin"]).hexdigest()}


def _strict_warnings() -> None:
    # Any ignored (torn, foreign) tuning file or unusable cache in a healthy run is a failure.
    warnings.simplefilter("error", TuningWarning)
    warnings.simplefilter("error", cache.CacheWarning)


def concurrent(wid: int, variants: list, rounds: int, artifact: str, out: str) -> None:
    """Compile shared and own kernels, save and load shared and own tuning entries, extend one artifact."""
    assert not _import_warnings, [str(w.message) for w in _import_warnings]
    _strict_warnings()
    compiled = {json.dumps(v): _fingerprint(compile_variant(*v)) for v in variants}
    store = LocalCache()
    shared_key = {"op": "shared", "n": 4096}
    for i in range(rounds):
        own_key = {"op": "own", "worker": wid, "round": i}
        store.save("toy", "sm_90", own_key, {"worker": wid, "round": i}, time_us=1.0, default_time_us=2.0, candidates=3)
        store.save(
            "toy", "sm_90", shared_key, {"worker": wid, "round": i}, time_us=1.0, default_time_us=None, candidates=3
        )
        got = store.load("toy", "sm_90", own_key)
        assert got == {"worker": wid, "round": i}, got
        shared = store.load("toy", "sm_90", shared_key)
        assert shared is not None and set(shared) == {"worker", "round"}, shared
        entry = {"arch": "sm_90", "key": own_key, "config": {"worker": wid, "round": i}, "time_us": float(i)}
        write_artifact(Path(artifact), "toy", [entry])
        # A fresh reader sees a whole file holding at least this writer's entry.
        assert ArtifactFile(Path(artifact), "toy").lookup("sm_90", own_key) == {"worker": wid, "round": i}
    Path(out).write_text(json.dumps({"compiled": compiled}))


def compile_all(variants: list, out: str) -> None:
    """Compile each variant; record fingerprints and the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = {json.dumps(v): _fingerprint(compile_variant(*v)) for v in variants}
    found = [str(w.message) for w in [*_import_warnings, *caught] if issubclass(w.category, cache.CacheWarning)]
    Path(out).write_text(json.dumps({"compiled": compiled, "warnings": found, "triton_dir": str(cache.triton_dir())}))


def _entry_files(variant) -> tuple[Path, str]:
    """(folder, kernel name) of a compiled variant's cache entry."""
    compiled = compile_variant(*variant)
    folder = Path(compiled.metadata_group[f"{compiled.name}.json"]).parent
    return folder, compiled.name


def damage_and_recompile(cases: list, out: str, marker: str) -> None:
    """For each (variant, file, damage): compile, damage that cache file, compile again.

    Reports per case: the fingerprint before and after, the warnings of the
    second compile, and whether the damaged file was rewritten whole.
    """
    import pickle

    class Payload:
        def __reduce__(self):
            return (Path.touch, (Path(marker),))

    rng = random.Random(40)
    results = []
    for variant, which, damage in cases:
        folder, name = _entry_files(variant)
        before = _fingerprint(compile_variant(*variant))
        target = folder / {"group": f"__grp__{name}.json", "metadata": f"{name}.json", "binary": f"{name}.cubin"}[which]
        good = target.read_bytes()
        if damage == "truncated":
            bad = good[: len(good) // 2]
        elif damage == "random":
            bad = rng.randbytes(len(good))
        elif damage == "schema":  # valid JSON of the wrong shape (a group pointing outside its folder)
            bad = json.dumps(
                {"child_paths": {f"{name}.json": "/etc/hostname"}} if which == "group" else [1, 2]
            ).encode()
        elif damage == "pickle":
            bad = pickle.dumps(Payload())
        else:
            raise ValueError(damage)
        target.write_bytes(bad)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            after = _fingerprint(compile_variant(*variant))
            again = _fingerprint(compile_variant(*variant))  # the rebuilt entry serves, silently
        found = [str(w.message) for w in caught if issubclass(w.category, cache.CacheWarning)]
        results.append({
            "case": [variant, which, damage], "before": before, "after": after, "again": again,
            "warnings": found, "rewritten": target.read_bytes() == good,
        })  # fmt: skip
    Path(out).write_text(json.dumps(results))
