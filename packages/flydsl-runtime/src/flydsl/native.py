"""Host code in C: small CPython extension modules compiled at first use, as Triton compiles its launchers.

Some host paths are dominated by Python's own cost: an eager call on a few
rows spends more time in attribute reads, checks and calls than on the GPU.
:func:`load` compiles a module from C source with the C compiler and the
Python headers Triton uses for its launchers (so any machine that can launch
a Triton kernel can build it), caches the shared object in Triton's cache
(keyed by the source and the platform) and imports it. Where it cannot be
built it returns None once per name, with a warning, and callers keep their
Python path.

Example::

    mod = flydsl.native.load("my_fast", C_SOURCE)
    if mod is not None:
        mod.setup(...)

What such a module still calls of torch (a tensor's fields, ``torch.empty_like``) goes through torch's
argument parser, ~0.1-2 us a call. :func:`tensor_api` builds ``_native/tensor_api.cpp`` against the
installed torch's C++ headers (a C++ compiler and ~15-20 s, once per torch version: in the background, so
no call waits for it) and hands its capsule (``_native/tensor_api.h``, included as
``<flydsl/tensor_api.h>``) to the modules that asked, which then read tensors directly.
``FLYDSL_NATIVE_TORCH=0`` turns that build off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from importlib.resources import files

from flydsl import env

__all__ = ["load", "tensor_api"]

_MODULES: dict = {}  # name -> module or None (could not be built)
_HEADERS = {"flydsl/tensor_api.h": "tensor_api.h"}  # what C sources include of ours -> the file in _native/


def _source(name: str) -> str:
    return (files("flydsl") / "_native" / name).read_text()


def _expand(source: str) -> str:
    """``source`` with each ``#include <flydsl/...>`` line replaced by that header's text (so a module's cache
    key covers the headers it uses, and no include path is needed)."""
    for inc, fname in _HEADERS.items():
        source = source.replace(f"#include <{inc}>", _source(fname))
    return source


def load(name: str, source: str):
    """The extension module ``name`` compiled from C ``source`` (defining ``PyInit_<name>``), or None when it
    cannot be built here (no C compiler, no Python headers, a Triton without its build helper)."""
    if name in _MODULES:
        return _MODULES[name]
    try:
        from triton.runtime.build import compile_module_from_src

        mod = compile_module_from_src(src=_expand(source), name=name)
    except Exception as e:  # noqa: BLE001 - any build failure means: keep the Python path
        warnings.warn(f"flydsl.native: {name} could not be built ({e!r:.200}); the Python path serves instead",
                      RuntimeWarning, stacklevel=2)  # fmt: skip
        mod = None
    _MODULES[name] = mod
    return mod


# ------------------------------------------------------- the C++ tensor API

_API_NAME = "flydsl_tensor_api"
_api_lock = threading.Lock()
_api: dict = {"state": "idle", "capsule": None, "waiters": [], "error": None}


def _torch_build_flags():
    """(compiler, flags, cache key material) of a module built against the installed torch's headers."""
    import torch

    cxx = env.read_external("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX)")
    # torch's header and library folders as torch.utils.cpp_extension names them, without importing it: that
    # imports setuptools, whose distutils shim takes itself off sys.meta_path while another thread may be
    # walking it, so an import on the main thread finds nothing (seen on the H200: "No module named
    # 'torch._dynamo.distributed'" while this ran on its background thread)
    root = os.path.dirname(torch.__file__)
    torch_include = os.path.join(root, "include")
    includes = [sysconfig.get_paths()["include"], torch_include, os.path.join(torch_include, "torch", "csrc", "api",
                                                                              "include")]  # fmt: skip
    libs = [os.path.join(root, "lib")]
    abi = int(torch.compiled_with_cxx11_abi())
    flags = ["-O2", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{d}" for d in includes],
             *[f"-L{d}" for d in libs], *[f"-Wl,-rpath,{d}" for d in libs],
             "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10"]  # fmt: skip
    key = [torch.__version__, str(includes), str(libs), sys.version, platform.platform(), cxx]
    return cxx, flags, key


def _api_module():
    """tensor_api.cpp's module from Triton's cache, else compiled and cached."""
    from triton.runtime.build import _load_module_from_path
    from triton.runtime.cache import get_cache_manager

    source = _expand(_source("tensor_api.cpp"))
    cxx, flags, key = _torch_build_flags()
    cache = get_cache_manager(hashlib.sha256("\n".join([source, *key]).encode()).hexdigest())
    fname = _API_NAME + sysconfig.get_config_var("EXT_SUFFIX")
    path = cache.get_file(fname)
    if path is None:
        with tempfile.TemporaryDirectory() as d:
            src, so = os.path.join(d, "tensor_api.cpp"), os.path.join(d, fname)
            with open(src, "w") as f:
                f.write(source)
            err = None
            for std in ("-std=c++20", "-std=c++17"):  # torch's own standard: 20 from 2.12, 17 before
                r = subprocess.run([cxx, std, src, "-o", so, *flags], capture_output=True, text=True)
                if r.returncode == 0:
                    break
                err = r.stderr[-2000:]
            else:
                raise RuntimeError(f"{cxx} failed: {err}")
            with open(so, "rb") as f:
                path = cache.put(f.read(), fname, binary=True)
    return _load_module_from_path(_API_NAME, path)


def _finish(capsule, error) -> None:
    with _api_lock:
        _api["capsule"], _api["error"] = capsule, error
        _api["state"] = "ready" if capsule is not None else "failed"
        waiters, _api["waiters"] = _api["waiters"], []
    for w in waiters:
        w(capsule)
    if error is not None:
        warnings.warn(f"flydsl.native: the C++ tensor API could not be built ({error!r:.300}); C paths keep "
                      f"torch's Python methods", RuntimeWarning, stacklevel=2)  # fmt: skip


def _build() -> None:
    """Make the API available (from the cache or compiled) and tell the waiters."""
    try:
        capsule, error = _api_module().API, None
    except Exception as e:  # noqa: BLE001 - any failure: the C paths keep their Python-method reads
        capsule, error = None, e
    _finish(capsule, error)


def tensor_api(on_ready: Callable | None = None, wait: bool = False):
    """The capsule of flydsl's C++ tensor API (``_native/tensor_api.h``), or None while it is not available.

    The first call makes it available, from Triton's cache or by compiling it, on a background thread unless
    ``wait`` (even the cache's check imports torch's extension helpers, ~0.4 s: no caller waits for it; the
    caller keeps its Python-method path meanwhile). ``on_ready``, if given, is called with the capsule once it
    is available (at once when it is), or with None where it cannot be built (no C++ compiler, no torch
    headers, ``FLYDSL_NATIVE_TORCH=0``). Thread-safe.
    """
    with _api_lock:
        first = _api["state"] == "idle"
        if first:
            _api["state"] = "building" if env.get("FLYDSL_NATIVE_TORCH") else "failed"
        pending = _api["state"] == "building"
        if pending and on_ready is not None:
            _api["waiters"].append(on_ready)  # _finish calls it
    if first and pending:
        if wait:
            _build()
        else:
            threading.Thread(target=_build, name="flydsl-tensor-api", daemon=True).start()
    while wait and _api["state"] == "building":
        threading.Event().wait(0.05)
    if not pending and on_ready is not None:
        on_ready(_api["capsule"])
    return _api["capsule"]
