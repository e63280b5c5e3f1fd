"""fly-attention: FlyDSL attention kernels.

``flash_attn(q, k, v, ...)``: the flash attention forward on ``[batch, seqlen, heads, head_dim]`` fp16 /
bf16 tensors (MHA / GQA / MQA, bottom-right causal, sliding window, softcap, lse);
``flash_attn_varlen(...)``: the same over packed sequences. :class:`AttnConfig` is the launch
configuration; ``flash_attn_ref`` / ``flash_attn_varlen_ref`` the fp32 / fp64 references. Forward only:
no backward yet. See the package README for the API table and status.
"""

from ._version import __version__
from .attention import flash_attn, flash_attn_varlen
from .autotune import AttnConfig
from .reference import flash_attn_ref, flash_attn_varlen_ref

__all__ = ["__version__", "flash_attn", "flash_attn_varlen", "AttnConfig", "flash_attn_ref", "flash_attn_varlen_ref"]
