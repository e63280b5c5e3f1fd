"""Device helpers shared by both norm kernel files (:mod:`.norm`, :mod:`.split`).

The weight (with its offset) and the backward's row loads.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl_common.device import row_offset


@flyc.func
def load_weight(w_ptr, c, cmask, weight_offset, HAS_WEIGHT: fx.constexpr, EVICT: fx.constexpr):
    """(weight + weight_offset) at columns ``c`` in fp32; 1 where there is no weight (0 past the row).
    ``weight_offset`` None: no offset (the forward's launchers pass None for 0, which saves an add an element
    in kernels bound by issue, e.g. the quantized forward). ``EVICT``: the load's cache hint ("",
    "evict_first", "evict_last")."""
    if HAS_WEIGHT:
        w = fx.load(w_ptr + c, mask=cmask, other=0.0, eviction_policy=EVICT).to(fx.float32)
        if weight_offset is not None:
            w = w + weight_offset
        return w
    else:
        return fx.where(cmask, 1.0, 0.0)


@flyc.func
def load_bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, M, c, cmask, stride_h, stride_dy,
                  IS_RMS: fx.constexpr, EVICT: fx.constexpr):  # fmt: skip
    """The backward's inputs for ``rows`` x columns ``c``: h and dy (storage dtype, zeros past the last row),
    each row's rstd and mean (0 for RMSNorm); ``EVICT`` is the h/dy loads' cache hint."""
    ok = rows < M
    mask = ok[:, None] & cmask[None, :]
    h = fx.load(h_ptr + row_offset(rows, stride_h)[:, None] + c[None, :], mask=mask, other=0.0, eviction_policy=EVICT)
    dy = fx.load(dy_ptr + row_offset(rows, stride_dy)[:, None] + c[None, :], mask=mask, other=0.0,
                 eviction_policy=EVICT)  # fmt: skip
    rstd = fx.load(rstd_ptr + rows, mask=ok, other=0.0)
    if IS_RMS:
        mean = fx.zeros_like(rstd)
    else:
        mean = fx.load(mean_ptr + rows, mask=ok, other=0.0)
    return h, dy, rstd, mean
