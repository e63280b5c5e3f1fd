"""Host planning of the row kernels' launches (:mod:`fly_norm._kernels.norm`, :mod:`fly_norm._kernels.softmax`)
and of the split kernels' options: the chunked config, when a single pass runs packed, the launch constexprs a
config gives, PDL, word alignment. Host code only; the device
helpers are in :mod:`fly_norm._kernels.passes`.
"""

from __future__ import annotations

import torch

import flydsl.arch
from flydsl_common.rows import RowConfig

__all__ = ["CHUNKED", "FIXED_WIDTHS_MAX", "PACKED_MIN_N", "packed_plan", "pdl_options", "word_aligned",
           "row_meta"]  # fmt: skip


# The forwards' chunked rows (wider than one program keeps in registers) up to autotune.CHUNKED_MAX_N columns:
# chunks of 4096 columns over 16 warps, 8 elements a lane a chunk. Measured on the H200 (bf16, 2^27
# elements) the best of six configs for all three ops from 16K to 256K columns;
# the ladder's 16K-column chunks hold 32 accumulators a lane: rms_norm 70% of copy at 32K against 85%.
# Wider rows (softmax at 1M: 128 rows, one program an SM) need the ladder's wider chunks and 32 warps to
# keep enough loads in flight (39% of copy with CHUNKED, 55% with the ladder's).
CHUNKED = RowConfig(1, 4096, 16, False)

# The single passes that keep bf16 rows of this many columns and more packed, two columns an int32 word
# (PACKED: the quantized RMSNorm, the plain LayerNorm, softmax): at 32K two programs an SM instead of one.
# On the H200 against the chunked passes: quantized RMSNorm 78 -> 90% of the copy, LayerNorm 89 -> 94%
# (bf16, 2^27 elements); at 16K and below the unpacked single pass (already 95-100%) was faster.
PACKED_MIN_N = 32768


def packed_plan(cfg: RowConfig, eligible: bool, x2, y2, vectors=()) -> tuple[RowConfig, bool]:
    """(config, PACKED) of a row kernel's launch. A single-pass config of at least PACKED_MIN_N columns runs
    packed when the op can (``eligible``: its own conditions), ``x2`` and the per-column ``vectors`` are
    bf16, and every row of x2 and y2 ([M, N] views) and each vector start on a 4-byte boundary (an even
    width and row strides). A row that wide fits in registers only packed, so such a config's other calls
    run the chunked passes (``CHUNKED``). Other configs run as given."""
    if not (cfg.single_pass and cfg.block_n >= PACKED_MIN_N):
        return cfg, False
    packs = eligible and all(t.dtype == torch.bfloat16 for t in (x2, *vectors)) and word_aligned(x2, y2, *vectors)
    return (cfg, True) if packs else (CHUNKED, False)


def pdl_options(device) -> dict:
    """Launch options of a kernel that may start before the one before it on the stream has finished (it
    calls pdl_wait first): NVIDIA sm_90+, outside CUDA graph capture (a graph's edges: plain launches of the
    same compiled kernel, ``launch_pdl`` being a launch attribute in flyc.launch). Its launch then overlaps
    that kernel's tail (~1 us a launch on the H200)."""
    arch = flydsl.arch.current(device)
    if arch.backend != "cuda" or (arch.capability or (0,))[0] < 9 or torch.cuda.is_current_stream_capturing():
        return {}
    return {"launch_pdl": True}


def word_aligned(*tensors) -> bool:
    """Whether every row of each tensor ([M, N] row views, or [N] vectors) starts on a 4-byte boundary, with
    an even width: a 16-bit row read and written as int32 words (two columns each;
    :func:`fly_norm._kernels.pairs.as_words`)."""
    return all(
        t.shape[-1] % 2 == 0 and t.data_ptr() % 4 == 0 and (t.dim() == 1 or t.stride(0) % 2 == 0) for t in tensors
    )


# Each fixed width is a compilation of its own: past this many widths in a process (rows of many widths,
# e.g. softmax over varying sequence lengths), further widths run with N at run time (N_FIXED = 0).
FIXED_WIDTHS_MAX = 16
_FIXED_WIDTHS: set[int] = set()


def row_meta(cfg, n: int) -> dict:
    """The row kernels' launch constexprs for config ``cfg`` (a :class:`~flydsl_common.rows.RowConfig`) on
    rows of ``n`` columns: BLOCK_M, BLOCK_N, SINGLE_PASS, N_FIXED (``n`` for chunked rows while fewer than
    FIXED_WIDTHS_MAX widths are fixed, else 0) and the launch options (num_warps, maxnreg when capped)."""
    fixed = 0
    if not cfg.single_pass and (n in _FIXED_WIDTHS or len(_FIXED_WIDTHS) < FIXED_WIDTHS_MAX):
        _FIXED_WIDTHS.add(n)
        fixed = n
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_PASS=cfg.single_pass, N_FIXED=fixed,
                **cfg.launch_options())
