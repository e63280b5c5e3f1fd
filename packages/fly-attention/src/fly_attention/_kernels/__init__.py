"""Device code of fly-attention: one kernel kind a file (``flash_fwd``: the forward, dense and varlen)."""
