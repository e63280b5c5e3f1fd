"""fly-norm: FlyDSL normalization and softmax kernels.

    import fly_norm
    y = fly_norm.rms_norm(x, weight, eps=1e-6)
    y, h = fly_norm.rms_norm(x, weight, residual=r)       # fused pre-norm residual add
    q, scale = fly_norm.rms_norm_quant(x, weight)          # int8 (or fp8) with per-row scales
    p = fly_norm.softmax(x, dim=-1)

``__all__`` is the public contract; see the package README for the API table.
"""

from ._version import __version__
from .layernorm import build_layernorm_module, layer_norm, layer_norm_quant
from .modules import FlyLayerNorm, FlyRMSNorm, FlySoftmax
from .rmsnorm import build_rmsnorm_bwd_module, build_rmsnorm_module, rms_norm, rms_norm_quant
from .softmax import build_softmax_bwd_module, build_softmax_module, softmax

__all__ = [
    "__version__",
    "rms_norm",
    "layer_norm",
    "rms_norm_quant",
    "layer_norm_quant",
    "softmax",
    "FlyLayerNorm",
    "FlyRMSNorm",
    "FlySoftmax",
    "build_rmsnorm_module",
    "build_rmsnorm_bwd_module",
    "build_layernorm_module",
    "build_softmax_module",
    "build_softmax_bwd_module",
]
