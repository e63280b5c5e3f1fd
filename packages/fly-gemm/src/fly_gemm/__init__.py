"""fly-gemm: FlyDSL GEMM kernels.

``gemm(a, b, ...)``: C = A @ B^T for fp16, bf16, fp8 e4m3 and int8, with
per-tensor / per-row / per-column scales, bias and activation fused into the
kernel's epilogue; ``linear(x, weight, bias, activation)`` on N-D inputs and
the ``FlyLinear`` module (autograd for fp16 / bf16). :class:`GemmConfig` is the
launch configuration. Mixture of experts: ``topk_softmax`` / ``grouped_topk`` routing, ``moe_align`` and
``fused_moe`` (bf16 / fp16), the ``FlyMoE`` module (router + experts, inference); ``grouped_gemm`` for
tokens already grouped by expert (training: autograd).
See the package README for the API table and status.
"""

from ._version import __version__
from .autotune import GemmConfig
from .builders import compile_preshuffle_gemm
from .gemm import gemm
from .grouped_gemm import GroupedGemmConfig, grouped_gemm
from .linear import linear
from .modules import FlyLinear
from .moe import fused_moe
from .moe_config import MoeConfig
from .moe_module import FlyMoE
from .moe_reference import fused_moe_ref
from .moe_routing import MoeAlignment, grouped_topk, moe_align, topk_softmax
from .prepack import PackedWeight, prepack
from .reference import gemm_ref, grouped_gemm_ref

__all__ = [
    "__version__", "gemm", "linear", "FlyLinear", "prepack", "PackedWeight", "compile_preshuffle_gemm", "gemm_ref",
    "GemmConfig", "fused_moe", "topk_softmax", "grouped_topk", "moe_align", "MoeAlignment", "MoeConfig",
    "fused_moe_ref", "FlyMoE", "grouped_gemm", "GroupedGemmConfig", "grouped_gemm_ref",
]  # fmt: skip
