"""fly-attention: FlyDSL attention kernels.

``flash_attn(q, k, v, ...)``: flash attention (forward and backward) on ``[batch, seqlen, heads, head_dim]``
fp16 / bf16 tensors (MHA / GQA / MQA, bottom-right causal, sliding window, softcap, lse);
``flash_attn_varlen(...)``: the same over packed sequences. :class:`AttnConfig` is the launch
configuration; ``flash_attn_ref`` / ``flash_attn_varlen_ref`` the fp32 / fp64 references.
``scaled_dot_product_attention(...)``: a drop-in for torch's SDPA on ``[B, H, S, D]`` served by flash_attn
(masks and other dtypes fall back to torch); ``build_flash_attn_func_module(...)``: the seed's builder.
``paged_attention_decode(...)``: decode attention over a paged (or dense) KV cache, split-KV, fp8 caches;
``fused_rope_cache(...)``: rotary embedding and the KV-cache write in one kernel.
See the package README for the API table and status.
"""

from ._version import __version__
from .attention import flash_attn, flash_attn_varlen
from .autotune import AttnConfig
from .builders import build_flash_attn_func_module
from .decode import paged_attention_decode
from .decode_config import DecodeConfig
from .decode_reference import fused_rope_cache_ref, paged_attention_decode_ref
from .reference import flash_attn_fp8_ref, flash_attn_ref, flash_attn_varlen_ref
from .rope_cache import fused_rope_cache
from .sdpa import scaled_dot_product_attention

__all__ = [
    "__version__", "flash_attn", "flash_attn_varlen", "AttnConfig", "flash_attn_ref", "flash_attn_varlen_ref",
    "scaled_dot_product_attention", "build_flash_attn_func_module", "paged_attention_decode", "fused_rope_cache",
    "DecodeConfig", "paged_attention_decode_ref", "fused_rope_cache_ref", "flash_attn_fp8_ref",
]  # fmt: skip
