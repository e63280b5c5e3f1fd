"""Device helpers shared by both norm kernel files (:mod:`.norm`, :mod:`.split`)."""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx


@flyc.func
def load_weight(w_ptr, c, cmask, weight_offset, HAS_WEIGHT: fx.constexpr, EVICT: fx.constexpr):
    """(weight + weight_offset) at columns ``c`` in fp32; 1 where there is no weight (0 past the row).
    ``EVICT``: the load's cache hint ("", "evict_first", "evict_last")."""
    if HAS_WEIGHT:
        return fx.load(w_ptr + c, mask=cmask, other=0.0, eviction_policy=EVICT).to(fx.float32) + weight_offset
    else:
        return fx.where(cmask, 1.0, 0.0)
