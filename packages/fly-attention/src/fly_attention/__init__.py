"""fly-attention: FlyDSL attention kernels.

Scope: flash attention, decode, paged KV, RoPE + cache.

This release is the package skeleton: it registers the ``attention`` family with
the ``flydsl`` command and exports no kernels yet. Kernels arrive in later
releases; ``__all__`` is the public contract and grows with them.
"""

from ._version import __version__

__all__ = ["__version__"]
