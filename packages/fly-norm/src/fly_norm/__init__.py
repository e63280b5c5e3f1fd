"""fly-norm: FlyDSL normalization and softmax kernels.

    import fly_norm
    y = fly_norm.softmax(x, dim=-1)

``__all__`` is the public contract; see the package README for the API table.
"""

from ._version import __version__
from .softmax import build_softmax_bwd_module, build_softmax_module, softmax

__all__ = ["__version__", "softmax", "build_softmax_module", "build_softmax_bwd_module"]
