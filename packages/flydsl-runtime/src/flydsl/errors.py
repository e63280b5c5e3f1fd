"""FlyDSL's exception types.

Each one subclasses the builtin a caller would catch anyway (ValueError,
TypeError, RuntimeError), so ``except ValueError`` keeps working, and
``except FlyDSLError`` catches everything FlyDSL raises on purpose.
"""

from __future__ import annotations

__all__ = [
    "FlyDSLError",
    "ArgumentError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "LayoutError",
    "UnsupportedError",
    "BackendError",
    "TuningError",
]


class FlyDSLError(Exception):
    """Base of every error FlyDSL raises deliberately."""


class ArgumentError(FlyDSLError, ValueError):
    """An argument has a value the operation cannot accept."""


class ShapeError(ArgumentError):
    """A tensor's shape does not fit the operation or the other arguments."""


class DTypeError(FlyDSLError, TypeError):
    """A tensor's dtype is not supported, or does not match another argument's."""


class DeviceError(ArgumentError):
    """Tensors live on the wrong device, or on different devices."""


class LayoutError(ArgumentError):
    """Strides or alignment that the kernel cannot serve."""


class UnsupportedError(FlyDSLError, NotImplementedError):
    """A valid request that this backend or version does not implement."""


class BackendError(FlyDSLError, RuntimeError):
    """The compiler/runtime backend is in a state FlyDSL cannot work with."""


class TuningError(FlyDSLError, RuntimeError):
    """A tuning search could not produce a valid configuration."""
