"""Keep Triton's CPU interpreter working with current numpy.

Triton's interpreter holds every value as a numpy array, scalars as arrays of
one element, and turns such a tensor into a Python int (``tensor.__index__``,
used by ``range()``, slicing, shapes) with ``int(array)``. numpy deprecated
converting an array with ``ndim > 0`` to a scalar in 1.25 (a DeprecationWarning
on every kernel that indexes with a scalar: about ten thousand in our test
suites) and made it an error in 2.4 ("only 0-dimensional arrays can be
converted to Python scalars"), so with numpy 2.4 and triton up to 3.7 nearly
every interpreted kernel fails. Triton 3.8's interpreter takes the one element
first; for older Triton, :func:`apply` makes the interpreter do the same.

It only touches the interpreter (``triton.runtime.interpreter``), only while
kernels run interpreted (compiled kernels never reach it), and only on Triton
older than 3.8. numpy therefore needs no upper bound for FlyDSL's CPU path.
"""

from __future__ import annotations

import re

_APPLIED = False
# First Triton whose interpreter converts one-element arrays itself.
_FIXED_IN = (3, 8)


def _triton_version(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _index(self) -> int:
    # ``.item()`` takes the single element of an array of any ndim (and raises
    # ValueError naming the size when there is more than one), the conversion
    # numpy asks for instead of ``int(array)``.
    return int(self.handle.data.item())


def apply() -> bool:
    """Patch the interpreter's tensor ``__index__`` (idempotent); True when the patch is in place."""
    global _APPLIED
    if _APPLIED:
        return True
    import triton

    if _triton_version(triton.__version__) >= _FIXED_IN:
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - an interpreter-less Triton build
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # pragma: no cover - a Triton laid out differently: leave it alone
        return False

    def patch_lang_tensor(tensor, *rest):
        # The interpreter sets its own attributes on triton.language's tensor
        # class for the duration of a launch (and, where it passes a scope
        # object, restores them through it afterwards); override __index__
        # the same way, after it, so that restore undoes ours too.
        original(tensor, *rest)
        scope = rest[0] if rest else None
        if scope is not None and hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", _index)
        else:
            tensor.__index__ = _index

    patch_lang_tensor.__wrapped__ = original
    interpreter._patch_lang_tensor = patch_lang_tensor
    _APPLIED = True
    return True
