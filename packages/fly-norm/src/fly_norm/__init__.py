"""fly-norm: FlyDSL normalization and softmax kernels.

Scope: LayerNorm, RMSNorm, softmax (fwd + bwd, fused residual, quantized).

This release is the package skeleton: it registers the ``norm`` family with
the ``flydsl`` command and exports no kernels yet. Kernels arrive in later
releases; ``__all__`` is the public contract and grows with them.
"""

from ._version import __version__

__all__ = ["__version__"]
