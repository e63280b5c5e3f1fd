"""flydsl-common: what the FlyDSL kernel families share.

- ``flydsl_common.device``: device building blocks (row addressing, vector
  loads/stores, fp32 reductions, saturating int8/fp8 casts, epilogue activations);
- ``quantize_per_token`` / ``quantize_per_tensor``: dynamic int8 / fp8 quantization;
- ``vec_add``: the smallest end-to-end kernel;
- ``flydsl_common.reference``: fp32/fp64 references;
- ``flydsl_common.bench``: the benchmark harness (cases, providers, bytes/flops
  model, ceilings measured in the same run; table, JSON, markdown, PNG).
"""

from ._version import __version__
from .quant import quantize_per_tensor, quantize_per_token
from .vec_add import build_vec_add_module, vec_add

__all__ = ["__version__", "quantize_per_token", "quantize_per_tensor", "vec_add", "build_vec_add_module"]
