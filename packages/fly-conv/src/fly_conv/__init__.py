"""fly-conv: FlyDSL convolution kernels.

Scope: implicit-GEMM convolution 1D/2D/3D.

This release is the package skeleton: it registers the ``conv`` family with
the ``flydsl`` command and exports no kernels yet. Kernels arrive in later
releases; ``__all__`` is the public contract and grows with them.
"""

from ._version import __version__

__all__ = ["__version__"]
