"""fly-gemm: FlyDSL GEMM kernels.

Scope: dense / scaled GEMM with fused epilogues, MoE.

This release is the package skeleton: it registers the ``gemm`` family with
the ``flydsl`` command and exports no kernels yet. Kernels arrive in later
releases; ``__all__`` is the public contract and grows with them.
"""

from ._version import __version__

__all__ = ["__version__"]
