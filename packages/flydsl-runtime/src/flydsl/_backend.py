"""Choose between compiled Triton and Triton's CPU interpreter, once per process.

Triton decides at import time whether ``triton.jit`` produces compiled or
interpreted functions (it decorates its own library functions such as
``tl.sum`` then), and flipping the choice later breaks every kernel that calls
such a helper. So the choice is made here, when ``flydsl`` is imported, before
``triton`` is: ``FLYDSL_INTERPRET`` forces it either way; unset, the
interpreter is used exactly when torch sees no GPU.
"""

from __future__ import annotations

import sys

from . import env
from .errors import BackendError

_INTERPRET: bool | None = None


def _gpu_visible() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


def _triton_interpret_flag() -> bool:
    raw = env.read_external("TRITON_INTERPRET")
    return raw is not None and raw.strip().lower() in {"1", "true", "yes", "on"}


def select() -> bool:
    """Decide the backend for this process (idempotent); True means interpreter."""
    global _INTERPRET
    if _INTERPRET is not None:
        return _INTERPRET
    forced = env.get("FLYDSL_INTERPRET")
    interpret = (not _gpu_visible()) if forced is None else bool(forced)
    if "triton" in sys.modules:
        # Too late to choose: Triton has already fixed its mode. Accept it only
        # when it agrees with ours; otherwise say exactly how to fix it.
        if _triton_interpret_flag() != interpret:
            want = "the CPU interpreter" if interpret else "compiled kernels"
            raise BackendError(
                f"triton was imported before flydsl and is not set up for {want}. "
                "Import flydsl before triton, or set TRITON_INTERPRET="
                f"{'1' if interpret else '0'} (or FLYDSL_INTERPRET) before starting Python."
            )
    else:
        env.export("TRITON_INTERPRET", "1" if interpret else "0")
    _INTERPRET = interpret
    return interpret


def interpreting() -> bool:
    """True when kernels run through Triton's CPU interpreter in this process."""
    return select()
