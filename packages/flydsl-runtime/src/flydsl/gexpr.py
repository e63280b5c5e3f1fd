"""The explicit-layout device language: ``import flydsl.gexpr as gx``.

:mod:`flydsl.expr` (Triton's language) leaves shared memory and the layout of
every block to the compiler. A kernel that must own its shared memory (a ring
of buffers filled by asynchronous copies, read as often as it likes) is
written in this second face instead: Triton's Gluon language, where each
block carries an explicit layout (``gx.BlockedLayout``...), shared memory is
allocated by the kernel (``gx.allocate_shared_memory``) and copies into it
are issued and awaited by hand (``gx.async_copy``: ``cp.async`` on NVIDIA
sm_80 and newer). Such kernels are marked ``@flyc.gluon_kernel`` and compile
for a GPU only: the CPU interpreter cannot run them, so their callers take
another route there.

Helpers written in :mod:`flydsl.expr` may be called from these kernels when
every block they make comes from their arguments (a ``full`` or ``arange``
there would have no layout).
"""

from __future__ import annotations

from triton.experimental.gluon import language as _gl
from triton.experimental.gluon.language import *  # noqa: F403 - the language's names, as Gluon defines them
from triton.experimental.gluon.language.nvidia.ampere import async_copy

__all__ = [name for name in dir(_gl) if not name.startswith("_")] + ["async_copy"]
