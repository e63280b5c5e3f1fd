"""FlyDSL runtime: a small Python DSL for GPU kernels on top of Triton.

Importing ``flydsl`` fixes, once per process and before Triton is imported,
whether kernels run compiled on the GPU or through Triton's CPU interpreter
(see :mod:`flydsl._backend`), and points Triton's compiled-kernel cache under
FlyDSL's cache root (see :mod:`flydsl.cache`).

Modules::

    import flydsl.compiler as flyc   # @flyc.kernel, @flyc.jit, cdiv, next_power_of_2
    import flydsl.expr as fx         # the device language (Triton's) + index helpers
    import flydsl.gexpr as gx        # the explicit-layout language (Gluon), for @flyc.gluon_kernel
    flydsl.arch                      # what the device is
    flydsl.cache                     # the cache root: ls / size / clear
    flydsl.autotune                  # tuning framework and timer
    flydsl.env                       # every FLYDSL_* variable
    flydsl.errors, flydsl.checks     # exception types, argument validation
    flydsl.testing                   # pytest helpers (also a pytest plugin)
"""

from . import env, errors
from ._backend import interpreting, select
from ._version import __version__
from .cache import configure_triton as _configure_triton

_configure_triton()
INTERPRET: bool = select()

__all__ = ["__version__", "INTERPRET", "interpreting", "env", "errors"]
