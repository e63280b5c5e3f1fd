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

Such a module reaches torch only through its Python objects (a tensor's attributes and methods,
``torch.empty_like``): nothing is built against torch's headers, so a torch upgrade cannot break it.
"""

from __future__ import annotations

import warnings

__all__ = ["load"]

_MODULES: dict = {}  # name -> module or None (could not be built)


def load(name: str, source: str):
    """The extension module ``name`` compiled from C ``source`` (defining ``PyInit_<name>``), or None when it
    cannot be built here (no C compiler, no Python headers, a Triton without its build helper)."""
    if name in _MODULES:
        return _MODULES[name]
    try:
        from triton.runtime.build import compile_module_from_src

        mod = compile_module_from_src(src=source, name=name)
    except Exception as e:  # noqa: BLE001 - any build failure means: keep the Python path
        warnings.warn(f"flydsl.native: {name} could not be built ({e!r:.200}); the Python path serves instead",
                      RuntimeWarning, stacklevel=2)  # fmt: skip
        mod = None
    _MODULES[name] = mod
    return mod
