"""Host code of the split paths (:mod:`fly_norm._kernels.split`) and of softmax's resident forward
(:mod:`fly_norm._kernels.resident`): their launch configurations, which rows take them, the pooled slots
and the launchers. The kernels' module docstrings say how the paths work; the measurements behind each
configuration are beside it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl_common.rows import MAX_SINGLE_PASS

from ._exchange_host import slot_lanes
from ._kernels.split import (
    norm_bwd_split_kernel,
    norm_bwd_staged_kernel,
    norm_bwd_tiled_kernel,
    norm_fwd_split_kernel,
    norm_fwd_staged_kernel,
    softmax_bwd_split_kernel,
    softmax_fwd_split_kernel,
    zero_slots_kernel,
)
from ._row_plans import pdl_options, word_aligned
from .routing import Path, Route, resident_config, split_route

try:
    from ._kernels.resident import softmax_fwd_resident_kernel
except ImportError:  # a Triton whose Gluon lacks what the resident kernel uses: the split paths take its rows
    softmax_fwd_resident_kernel = None

__all__ = [
    "SPLIT_MIN_N", "SPLIT_MIN_N_BWD", "SOFTMAX_SPLIT_MIN_N_BWD", "SPLIT_MAX_PARTS", "SPIN_LIMIT", "SliceConfig",
    "TiledConfig", "StagedConfig", "EvictHints", "ResidentConfig", "split_config_valid", "launch_split",
    "launch_fwd_split", "launch_bwd_split", "launch_softmax_fwd_split", "launch_softmax_bwd_split",
    "take_slots", "give_back_slots", "take_fwd_slots", "give_back_fwd_slots", "launch_softmax_fwd_resident",
]  # fmt: skip

# Which rows take which of these paths: fly_norm.routing (route, split_route), from the thresholds and
# configurations below.

# On a GPU, the rows the default configs would send down a chunked (two-read) path take a split path:
# Forward: rows up to 32K columns take the chunked paths, their width fixed at compile time (_row_plans.row_meta;
# H200, bf16, 2^27 elements: at 32K rms_norm 97%, softmax 92%, layer_norm 86% of copy chunked, against
# 85/81/75% split); wider rows' second read no longer finds them in L2 (64K: chunked 68-76%, split 69-83%).
SPLIT_MIN_N = 2 * MAX_SINGLE_PASS + 1
# Rows of more slices than this take the chunked paths: the wave then holds only a few rows and every
# program polls as many slots (softmax at 1M columns, 256 slices: 40% of copy against 55% chunked)
SPLIT_MAX_PARTS = 64
SPLIT_MIN_N_BWD = 8192 + 1  # backward: wider than its single-pass default (16 warps x 32 x 16 elements)
# Softmax's backward splits only past 16K: its chunked pass (8192 x 16 warps, the row's second read from L2)
# measured 187.3 us at 16K against the split's 202.9 (H200, bf16, 2^27 elements: 103% / 95% of a copy of
# the same bytes); at 32K the split stays ahead (205.7 against 211.4 us)
SOFTMAX_SPLIT_MIN_N_BWD = 16384 + 1


@dataclass(frozen=True)
class SliceConfig:
    """A register-resident split kernel's launch: each program holds ``slice_cols`` columns of a row (its
    slice) in registers, across ``warps`` warps, its registers capped at ``maxnreg`` (None: uncapped)."""

    slice_cols: int
    warps: int
    maxnreg: int | None = None


@dataclass(frozen=True)
class TiledConfig:
    """The tiled split backward's launch (:func:`_norm_bwd_tiled_kernel`): a program owns ``slice_cols``
    columns, across ``warps`` warps, registers capped at ``maxnreg`` (None: uncapped), and walks tiles of
    ``tile_rows`` rows; ``lead`` (0-2) runs pass 1 that many tiles ahead of the wait (see the kernel)."""

    slice_cols: int
    warps: int
    maxnreg: int | None
    tile_rows: int
    lead: int = 0


@dataclass(frozen=True)
class StagedConfig:
    """A staged split kernel's launch (bf16 rows held as int32 words): a program owns ``slice_cols`` columns,
    across ``warps`` warps, its row loop software-pipelined ``stages`` deep, registers capped at ``maxnreg``
    (None: uncapped)."""

    slice_cols: int
    warps: int
    stages: int
    maxnreg: int | None = None


@dataclass(frozen=True)
class EvictHints:
    """Cache hints of the split kernels' loads: of the rows, and of the per-column operands (weight, bias,
    smooth scale); each "" (none), "evict_first" or "evict_last"."""

    rows: str = ""
    cols: str = ""


# The slice configs: the fastest of the slice widths, warps and caps timed on the H200 (bf16, 2^27 elements,
# 16K-256K columns); several programs share an SM so that one's wait overlaps the others' loads. 32 elements
# a thread (the backward holds two rows: h and dy, or y and dy).
FWD_SLICE = SliceConfig(slice_cols=4096, warps=4)  # RMSNorm and softmax (80 registers: 6 programs an SM)
# From WIDE_MIN_N columns, RMSNorm and softmax slices of 8192 (168 registers, 2 programs an SM): fewer
# slices a row to wait for; H200, bf16: rms 77/73% of copy at 128K/256K against 76/57% with 4096-column
# slices, softmax 64/67 against 64/61
FWD_SLICE_WIDE = SliceConfig(slice_cols=8192, warps=4)
WIDE_MIN_N = 131072
# LayerNorm: 128 registers uncapped (4 programs an SM), 96 capped (5), spill-free
LN_FWD_SLICE = SliceConfig(slice_cols=4096, warps=4, maxnreg=96)
BWD_SLICE = SliceConfig(slice_cols=4096, warps=4)  # the norms' (which also hold per-column weight-gradient sums)
# Rows a norm-backward program takes at a time (a [BWD_ROWS, slice] tile). RMSNorm only: layer_norm with
# tiles of 4 rows waited out the spin limit on the H200 (every row poisoned, 16K-64K columns), cause not
# found; its tiles stay one row until that is understood.
BWD_ROWS = 1
# The tiled split backward (_norm_bwd_tiled_kernel: the tile re-read from L2 after the wait, nothing held
# across it): a TiledConfig, or None for the register-resident kernel above. Measured on the H200 (bf16,
# the whole backward through autograd, 16K/32K/64K columns), 2048
# columns x 4 warps, 4-row tiles, lead 1, capped at 168 registers: RMSNorm 69/69/67% of copy against the
# register-resident kernel's 54/54/52%, LayerNorm 58/60/60% against 58/55/53%. Lead 2 and the uncapped
# lead 1 (184 registers) lost to it everywhere.
BWD_TILED = TiledConfig(slice_cols=2048, warps=4, maxnreg=168, tile_rows=4, lead=1)  # RMSNorm
LN_BWD_TILED = TiledConfig(slice_cols=2048, warps=4, maxnreg=168, tile_rows=4, lead=1)
SOFTMAX_BWD_SLICE = SliceConfig(slice_cols=4096, warps=4)
# Rows of SOFTMAX_BWD_WIDE_MIN_N+ columns take slices of 8192 columns x 8 warps, up to SOFTMAX_BWD_MAX_PARTS
# of them (collect_sum's poll is one reduction whatever the count). H200 (bf16, 2^27 elements, % of copy):
# 256K 93 against 90 for 4096 x 4, 512K 85 and 1M 78 against the chunked pass's 59 and 55 (it reads the rows
# twice; 256 slices of 4096 at 1M: 64); 16384 x 16 and 8192 x 4 no better
SOFTMAX_BWD_SLICE_WIDE = SliceConfig(slice_cols=8192, warps=8)
SOFTMAX_BWD_WIDE_MIN_N = 262144
SOFTMAX_BWD_MAX_PARTS = 256
# The staged norm forward (_norm_fwd_staged_kernel, bf16 rows of FWD_STAGED_MIN_N+ columns, no residual,
# smooth scale or quantized output, LayerNorm's weight and bias bf16 or absent), a StagedConfig. H200 (bf16,
# 2^27 elements): RMSNorm 91 / 90 / 88% of copy at 64K / 128K / 256K against the register-resident split's
# 83 / 77 / 72%; 8192 x 16 and 4096 x 8 slower; at 32K the single passes stay ahead (99% against 91%).
# LayerNorm 86 / 84 / 83% against 68 / 61 / 55%. Softmax's staged forward (81 / 78 / 76%) lost to the
# resident kernel (fly_norm._kernels.resident, 88-91%). 16384 x 8 warps (one uncapped program an SM): -1 to
# +0.5 points; LayerNorm's weight and bias held widened there: -20 to -30.
FWD_STAGED = StagedConfig(slice_cols=16384, warps=16, stages=3)
FWD_STAGED_MIN_N = 65536
# The staged norm backward (_norm_bwd_staged_kernel, bf16 rows), a StagedConfig. H200 (bf16, 2^27
# elements): RMSNorm 32K 85.5% of copy, LayerNorm 16K / 32K 80 / 79%, against the tiled kernel's 69 / 58 /
# 60%; 4096 x 8 warps 81-85 / 53-60%, 2048 x 4 warps 76-81 / 59-66%, 4 stages no better (0 to -20 points);
# 8192 x 8 warps (one uncapped program an SM): LayerNorm the same, RMSNorm 32K -1.3.
BWD_STAGED = StagedConfig(slice_cols=8192, warps=16, stages=3)
# Cache hints of the split kernels' loads (EvictHints). H200, none against rows "evict_first" and per-column
# operands "evict_last": no gain, within 1-3% and worse on the softmax backward; the per-column operands'
# evict_last in the chunked quant and layer_norm forward gained nothing either. None shipped.
SPLIT_EVICT = EvictHints(rows="", cols="")
SPIN_LIMIT = 1 << 20  # polls of a slot (~1 us each: about a second) before a row is given up, poisoned



# ---------------------------------------------------------------- validity

_WARPS = (1, 2, 4, 8, 16)


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


def _maxnreg_ok(maxnreg) -> bool:
    """A register cap ptxas takes and the launches use: None, or a multiple of 8 in 24..255."""
    return maxnreg is None or (isinstance(maxnreg, int) and 24 <= maxnreg <= 255 and maxnreg % 8 == 0)


def split_config_valid(cfg, arch: flydsl.arch.Arch | None = None) -> bool:
    """The one validity predicate of the split paths' configs (the shipped ones and every route's pass it):

    - :class:`SliceConfig` / :class:`TiledConfig` / :class:`StagedConfig`: a power-of-two slice (the kernels'
      ``arange``; staged rows are int32 words, two columns each) of at least one column a lane, a warp
      count Triton takes, a register cap ptxas takes; tiles of a power of two rows (at most 16) and a lead
      of 0-2 tiles (the tiled kernel's pass 1 runs at most two ahead); 1-8 pipeline stages;
    - :class:`ResidentConfig`: a power-of-two chunk of at least one word a lane, a ring of more slots than
      it leaves beyond a slice, and the ring's int32 words within the arch's shared memory (sm_90's 227 KB
      when ``arch`` is None).
    """
    if isinstance(cfg, ResidentConfig):
        smem = arch.smem_per_block if arch is not None else 227 * 1024
        return (_pow2(cfg.chunk) and cfg.warps in _WARPS and cfg.chunk >= 32 * cfg.warps
                and 0 <= cfg.left < cfg.ring and cfg.ring * cfg.chunk * 4 <= smem)  # fmt: skip
    if not isinstance(cfg, (SliceConfig, TiledConfig, StagedConfig)):
        return False
    if not (_pow2(cfg.slice_cols) and cfg.warps in _WARPS and cfg.slice_cols >= 32 * cfg.warps):
        return False
    if not _maxnreg_ok(cfg.maxnreg):
        return False
    if isinstance(cfg, TiledConfig):
        return _pow2(cfg.tile_rows) and cfg.tile_rows <= 16 and cfg.lead in (0, 1, 2)
    if isinstance(cfg, StagedConfig):
        return 1 <= cfg.stages <= 8 and cfg.slice_cols >= 2 * 32 * cfg.warps  # two columns a word
    return True


# ---------------------------------------------------------------- resident softmax

@dataclass(frozen=True)
class ResidentConfig:
    """The resident kernel's launch: chunks of ``chunk`` int32 words (two columns each), a ring of ``ring``
    chunk slots in shared memory (at most: the device's shared memory), ``warps`` warps, and ``left`` slots
    left beyond a slice (chunks of later rows in flight while a slice is held): a slice is ``ring - left``
    chunks."""

    chunk: int
    ring: int
    warps: int
    left: int


# RESIDENT: 40 KB rings, five programs an SM, 16K-column
# slices (H200, bf16: 88-91% of the copy from 64K to 1M, where one program an SM with 64K slices ran 75-86%).
# RESIDENT_WIDE: rows of more than SPLIT_MAX_PARTS of RESIDENT's slices (past 1M columns), 64K slices.
RESIDENT = ResidentConfig(chunk=1024, ring=10, warps=4, left=2)
RESIDENT_WIDE = ResidentConfig(chunk=4096, ring=12, warps=16, left=4)
RESIDENT_MIN_N = 65536



def _launch_opts(cfg: SliceConfig | TiledConfig, cols: bool = False) -> dict:
    """Triton launch options of a slice or tiled config (warps, register cap), and the cache hints if any."""
    opts = {"num_warps": cfg.warps} if cfg.maxnreg is None else {"num_warps": cfg.warps, "maxnreg": cfg.maxnreg}
    if SPLIT_EVICT.rows:
        opts["ROW_EVICT"] = SPLIT_EVICT.rows
    if cols and SPLIT_EVICT.cols:
        opts["COL_EVICT"] = SPLIT_EVICT.cols
    return opts


def _staged_opts(cfg: StagedConfig) -> dict:
    """Launch options of a staged kernel's config."""
    opts = {"STAGES": cfg.stages, "num_warps": cfg.warps}
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return opts


def launch_split(kernel, rows, stat_cols, build, slice_cols, device, tile_rows: int = 1,
                  programs: int | None = None, max_parts: int = SPLIT_MAX_PARTS, slots_of=None) -> int:
    """Allocate the rows' slots (zeroed), size one wave and launch. Returns the row groups
    launched, or 0 (nothing launched) when a row has more than ``max_parts`` slices or one wave cannot
    hold them all: the caller then takes its chunked path. A program takes ``tile_rows`` rows at a time.

    ``build(slots, parts, parts_pow2, groups)`` returns the kernel's (args, meta); it is called once
    with ``groups=None`` to size the wave (buffers that depend on the group count may then be any fresh
    fp32 tensor: only dtypes and alignment decide the compiled specialization), then with the count.
    ``programs`` (tests of a wait's give-up path): launch only the wave's first programs. ``slots_of(words)``:
    all-zero slots lent by a pool, or None; by default, and where it gives None, fresh slots: a
    ``torch.zeros``, or, in a call that :mod:`flydsl.direct` records, an allocation that :func:`zero_slots`
    zeroes just before the kernel's launch (a torch op other than an allocation would keep the call from
    being replayed).
    """
    m, n = rows.shape
    parts = flyc.cdiv(n, slice_cols)
    if parts > max_parts:
        return 0
    pp = flyc.next_power_of_2(parts)
    words = m * stat_cols * pp
    lent = None if slots_of is None else slots_of(words)
    fresh = lent is None and _recording()  # zeroed by a launch of this call's own
    if lent is not None:
        zeros = lent
    elif fresh:
        zeros = torch.empty(words, dtype=torch.int64, device=device)
    else:
        zeros = torch.zeros(words, dtype=torch.int64, device=device)
    slots = zeros.view(m, stat_cols * pp)
    args, meta = build(slots, parts, pp, None)
    wave = flyc.programs_per_sm(kernel, *args, **meta) * flydsl.arch.current(device).sm_count
    if wave < parts:
        return 0
    groups = min(flyc.cdiv(m, tile_rows), wave // parts)
    args, meta = build(slots, parts, pp, groups)
    if fresh:
        zero_slots(zeros)
    flyc.launch(kernel, (programs or groups * parts,), *args, **meta)
    return groups


_ZERO_BLOCK = 1024  # int64 words a program of zero_slots_kernel


def zero_slots(slots: torch.Tensor) -> None:
    """Zero a fresh contiguous int64 slot buffer on the current stream: one small launch, where a
    ``torch.zeros`` has its fill kernel; recorded with the call's other launches, so its replays zero their
    own slots. A plain launch, not PDL: the buffer may reuse memory that the kernel before it on the stream
    still reads. Only recorded calls take this path (outside a recording, torch.zeros: under CUDA graph
    capture, say, nothing must compile)."""
    words = slots.numel()
    if words:
        flyc.launch(zero_slots_kernel, (flyc.cdiv(words, _ZERO_BLOCK),), slots, words, BLOCK=_ZERO_BLOCK,
                    num_warps=4)  # fmt: skip


def norm_split_route(x2, y2, w, b, r2, s, is_rms, quantized: bool) -> Route:
    """:func:`fly_norm.routing.split_route` of a norm forward's operands ([M, N] row views; None when absent;
    ``quantized``: y2 holds the quantized codes)."""
    vectors = () if is_rms else tuple(v for v in (w, b) if v is not None)  # LayerNorm's, held as words staged
    op = "rms_norm" if is_rms else "layer_norm"
    return split_route(
        op, x2.dtype, x2.shape[1], flydsl.arch.current(x2.device), residual=r2 is not None,
        quant=y2.dtype if quantized else None, smooth=s is not None, row_dtypes=(y2.dtype,),
        vector_dtypes=tuple(v.dtype for v in vectors), aligned=word_aligned(x2, y2, *vectors),
    )  # fmt: skip


@flyc.jit(skip_empty=False)
def launch_fwd_split(
    x2, r2, w, b, s, y2, h2, mean, rstd, qscale, eps, weight_offset, is_rms, quant: int, qmax: float, stream=None,
    route: Route | None = None,
) -> bool:  # fmt: skip
    """Forward of either norm on [M, N] row views through the split path (False: not launched, see
    :func:`launch_split`). Operands as :func:`fly_norm._norm_host.launch_fwd` (None when absent);
    ``quant`` is its quantization code (0: float y), ``qmax`` the format's largest value. ``route``: the
    call's :func:`fly_norm.routing.route` (staged or slices; by default :func:`norm_split_route`'s).
    """
    route = route or norm_split_route(x2, y2, w, b, r2, s, is_rms, quant != 0)
    if route.path is Path.STAGED:
        staged = route.config
        return x2.shape[0] == 0 or _launch_fwd_staged(x2, w, b, y2, mean, rstd, eps, weight_offset, is_rms, staged)
    cfg = route.config

    def build(slots, parts, pp, groups):
        m, n = x2.shape
        # fmt: off
        args = (
            x2, r2, w, b, s, y2, h2, mean, rstd, qscale, slots,
            m, n, parts, x2.stride(0), 0 if r2 is None else r2.stride(0), y2.stride(0),
            0 if h2 is None else h2.stride(0), float(eps), float(weight_offset),
        )
        meta = dict(
            IS_RMS=bool(is_rms), HAS_RESIDUAL=r2 is not None, HAS_WEIGHT=w is not None, HAS_BIAS=b is not None,
            HAS_SMOOTH=s is not None, STORE_STATS=rstd is not None, QUANT=quant, QMAX=qmax, SLICE=cfg.slice_cols,
            PARTS_POW2=pp, SPIN_LIMIT=SPIN_LIMIT, **_launch_opts(cfg, cols=True),
        )
        # fmt: on
        return args, meta

    return x2.shape[0] == 0 or launch_split(norm_fwd_split_kernel, x2, 3, build, cfg.slice_cols, x2.device) > 0


# ------------------------------------------------------- pooled slots
#
# A split launch's slots must read 0 (unpublished) when it starts: a fresh torch.zeros buffer is a memset
# launch before the kernel (~0.8 us, and a launch gap of 1-2 us, on the H200). The staged
# kernels take pooled buffers instead, one pool a (device, stream), zeroed again in stream order by a kernel:
#
# - the staged backward, whose launch is always followed by the column sums of its weight gradients: one
#   buffer, which the column-sum kernel zeroes after it (_norm_host.launch_sum_partials' ``clear``). (Zeroing it
#   inside the staged backward itself, before its loop, slowed LayerNorm's by a third: 220 -> 293 us at
#   16K on the H200.)
# - the staged forward, followed by nothing of ours: two buffers taken in turn; each launch zeroes, after
#   its row loop, the words the launch before it dirtied in the other one (``clear_share``), so the next
#   launch finds that one all zeros.
#
# A buffer taken and not yet handed back (another thread on the stream, or an exception between) is not
# lent again: such a launch takes fresh zeros. Under CUDA graph capture (a replay would find the buffers as
# the capture left them) and past the pools' bound: fresh zeros. A call that flydsl.direct records takes
# fresh slots too, zeroed by a launch of the call's own (launch_split, zero_slots): its replays then take and
# give back nothing, where a lent buffer would keep the call on the general path every time (0.3-0.9 ms a
# backward call on the H200's sweep shapes, against ~0.1-0.2 ms replayed); the zeroing launch costs what
# torch.zeros' fill kernel does (~1-2 us with its gap), the pool's saving, given up for those calls.

_POOL_LOCK = threading.Lock()
_POOLS: dict = {}  # backward: (device, stream) -> _Slots
_FWD_POOLS: dict = {}  # forward: (device, stream) -> _SlotPair
_POOL_STREAMS = 16


class _Slots:
    """The staged backward's buffer on one stream (all zeros when not lent, in stream order)."""

    def __init__(self):
        self.buf = None
        self.lent = False


class _SlotPair:
    """The staged forward's two buffers on one stream: ``bufs[turn]`` is all zeros (in stream order), the
    first ``dirty[1 - turn]`` words of the other were dirtied by the last launch."""

    def __init__(self):
        self.bufs = [None, None]
        self.dirty = [0, 0]
        self.turn = 0
        self.lent = False


def _recording() -> bool:
    """Whether :mod:`flydsl.direct` is recording the call running on this thread (its launches are being
    collected, :data:`flydsl.compiler._RECORDING`)."""
    return flyc._RECORDING.launches is not None


def _lendable(pools: dict, device, new):
    """The current stream's entry in ``pools`` (a ``new()`` one where it has none), or None: under CUDA graph
    capture, past the pools' bound, or lent. Called under ``_POOL_LOCK``."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    entry = pools.get(key)
    if entry is None:
        if len(pools) >= _POOL_STREAMS:
            return None
        entry = pools[key] = new()
    return None if entry.lent else entry


def _grown(buf, words: int, device):
    """``buf`` when it holds ``words`` words, else a new all-zero buffer (at least twice as large)."""
    if buf is not None and buf.numel() >= words:
        return buf
    return torch.zeros(max(words, 0 if buf is None else 2 * buf.numel()), dtype=torch.int64, device=device)


def take_slots(words: int, device):
    """An all-zero int64 buffer of ``words`` words from the current stream's backward pool, or None (not
    lent: see above). The caller launches a kernel that zeroes the words it dirtied, then
    :func:`give_back_slots`."""
    if _recording():  # lent for this call only: a replay would not take and give back (see above)
        return None
    device = torch.device(device)
    with _POOL_LOCK:
        entry = _lendable(_POOLS, device, _Slots)
        if entry is None:
            return None
        entry.buf = _grown(entry.buf, words, device)
        entry.lent = True
        return entry.buf[:words]


def give_back_slots(slots) -> None:
    """Hand a :func:`take_slots` buffer back once the kernel that zeroes it is launched."""
    with _POOL_LOCK:
        for entry in _POOLS.values():
            if entry.lent and entry.buf.data_ptr() == slots.data_ptr():
                entry.lent = False


def take_fwd_slots(words: int, device):
    """(slots, clear) from the current stream's forward pool: ``slots`` an all-zero int64 buffer of ``words``
    words, ``clear`` the other buffer's dirtied words, which the launch must zero; or None (not lent: see
    above). Then :func:`give_back_fwd_slots`."""
    if _recording():  # lent for this call only, the pair's turn kept on the host: not replayable
        return None
    device = torch.device(device)
    with _POOL_LOCK:
        pair = _lendable(_FWD_POOLS, device, _SlotPair)
        if pair is None:
            return None
        i = pair.turn
        pair.bufs[i] = _grown(pair.bufs[i], words, device)
        other = pair.bufs[1 - i]
        pair.lent = True
        return pair.bufs[i][:words], pair.bufs[i][:0] if other is None else other[: pair.dirty[1 - i]]


def give_back_fwd_slots(slots, launched: bool) -> None:
    """Hand a :func:`take_fwd_slots` buffer back; ``launched``: the kernel was launched (it dirtied the
    buffer's ``slots.numel()`` words and zeroed the other's), so the next launch takes the other buffer."""
    with _POOL_LOCK:
        for pair in _FWD_POOLS.values():
            i = pair.turn
            if pair.lent and pair.bufs[i].data_ptr() == slots.data_ptr():
                pair.lent = False
                if launched:
                    pair.dirty[i], pair.dirty[1 - i], pair.turn = slots.numel(), 0, 1 - i


def _launch_fwd_staged(x2, w, b, y2, mean, rstd, eps, weight_offset, is_rms, cfg: StagedConfig) -> bool:
    """The staged norm forward at ``cfg`` through :func:`launch_split` (False: not launched)."""
    # RMSNorm adds its offset always (as measured on the H200); LayerNorm only a nonzero one (an add an element less)
    offset = float(weight_offset) if is_rms or weight_offset else None

    taken: dict = {}  # "pooled": the slots lent by the pool; "clear": the words this launch zeroes
    pdl = pdl_options(x2.device)  # once a call: build runs twice

    def slots_of(words):
        got = take_fwd_slots(words, x2.device)
        if got is None:  # fresh slots (launch_split zeroes them), nothing of the pool's to zero
            return None
        taken["pooled"], taken["clear"] = got
        return got[0]

    def build(slots, parts, pp, groups):
        m, n = x2.shape
        clear = taken.get("clear")
        if clear is None:
            clear = slots.view(-1)[:0]
        args = (x2, w, b, y2, mean, rstd, slots, clear, m, n, parts, x2.stride(0), y2.stride(0), float(eps), offset,
                clear.numel())  # fmt: skip
        meta = dict(IS_RMS=bool(is_rms), HAS_WEIGHT=w is not None, HAS_BIAS=b is not None,
                    STORE_STATS=rstd is not None, SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=SPIN_LIMIT,
                    STAGES=cfg.stages, num_warps=cfg.warps, **pdl)  # fmt: skip
        return args, meta

    launched = False
    try:
        launched = launch_split(norm_fwd_staged_kernel, x2, 1, build, cfg.slice_cols, x2.device,
                                 slots_of=slots_of) > 0
    finally:
        if "pooled" in taken:
            give_back_fwd_slots(taken["pooled"], launched)
    return launched


def _softmax_slices(x2, backward: bool) -> SliceConfig:
    """The softmax split path's slice config for these rows (:func:`fly_norm.routing.split_route`)."""
    return split_route("softmax", x2.dtype, x2.shape[1], flydsl.arch.current(x2.device), backward=backward).config


def launch_softmax_fwd_split(x2, y2, cfg: SliceConfig | None = None) -> bool:
    """Softmax forward on [M, N] row views through the split path (False: not launched). No checks. (Wide bf16
    rows on NVIDIA take :mod:`fly_norm._kernels.resident` first.) ``cfg``: the route's slices (by default
    :func:`fly_norm.routing.split_route`'s)."""
    cfg = cfg or _softmax_slices(x2, False)

    def build(slots, parts, pp, groups):
        m, n = x2.shape
        args = (x2, y2, slots, m, n, parts, x2.stride(0), y2.stride(0))
        return args, dict(SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=SPIN_LIMIT, **_launch_opts(cfg))

    return x2.shape[0] == 0 or launch_split(softmax_fwd_split_kernel, x2, 2, build, cfg.slice_cols, x2.device) > 0


def launch_softmax_bwd_split(dy2, y2, dx2, cfg: SliceConfig | None = None) -> bool:
    """Softmax backward on [M, N] row views through the split path (False: not launched). No checks. ``cfg``:
    the route's slices (by default :func:`fly_norm.routing.split_route`'s)."""
    cfg = cfg or _softmax_slices(y2, True)

    def build(slots, parts, pp, groups):
        m, n = y2.shape
        args = (dy2, y2, dx2, slots, m, n, parts, dy2.stride(0), y2.stride(0), dx2.stride(0))
        lanes = slot_lanes(pp, cfg.warps, flydsl.arch.current(y2.device).warp_size)
        return args, dict(SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=SPIN_LIMIT, LANES=lanes, **_launch_opts(cfg))

    return y2.shape[0] == 0 or launch_split(softmax_bwd_split_kernel, y2, 1, build, cfg.slice_cols, y2.device,
                                             max_parts=SOFTMAX_BWD_MAX_PARTS) > 0  # fmt: skip


def norm_bwd_rows(h2, dy2, dres2, dx2) -> tuple:
    """The row operands of a norm backward (h2, dy2, the residual gradient when given, dx2)."""
    return (h2, dy2, dx2) if dres2 is None else (h2, dy2, dres2, dx2)


def norm_bwd_split_route(h2, dy2, dres2, dx2, is_rms) -> Route:
    """:func:`fly_norm.routing.split_route` of a norm backward's rows ([M, N] views; ``dres2`` None when absent)."""
    rows = norm_bwd_rows(h2, dy2, dres2, dx2)
    return split_route(
        "rms_norm" if is_rms else "layer_norm", h2.dtype, h2.shape[1], flydsl.arch.current(h2.device),
        backward=True, residual=dres2 is not None, row_dtypes=tuple(t.dtype for t in rows[1:]),
        aligned=word_aligned(*rows),
    )  # fmt: skip


@flyc.jit(skip_empty=False)
def launch_bwd_split(
    h2, w, dy2, dres2, mean, rstd, dx2, need_dw, need_db, weight_offset, is_rms, stream=None, pooled=False,
    route: Route | None = None,
):  # fmt: skip
    """Backward of either norm on [M, N] row views through the split path: writes dx2 and returns the
    [groups, N] fp32 weight-gradient partials (dw, db; None where not needed) for the caller's column sum,
    or None when nothing was launched (see :func:`launch_split`). ``M > 0``. ``pooled`` (the caller's
    column sum zeroes the slots): the staged kernel's slots from :func:`take_slots`, and a third value
    returned, that buffer (None: fresh slots), which the caller's column-sum launch zeroes before it calls
    :func:`give_back_slots`. ``route``: the call's :func:`fly_norm.routing.route` (staged, tiled or slices;
    by default :func:`norm_bwd_split_route`'s).
    """
    partials: dict = {}
    lent: list = []

    def slots_of(words):
        buf = take_slots(words, h2.device) if pooled and staged and (need_dw or need_db) else None
        if buf is not None:
            lent.append(buf)
        return buf  # None: fresh slots, zeroed by launch_split

    def build(slots, parts, pp, groups):
        m, n = h2.shape
        if groups is None:
            # sizing the wave: any fp32 buffer keys the same specialization (rstd: no torch op, which a
            # dtype view of the slots would be, keeping the call from being replayed)
            dwp = dbp = rstd
        else:
            dev = h2.device
            dwp = partials["dw"] = torch.empty(groups, n, dtype=torch.float32, device=dev) if need_dw else None
            dbp = partials["db"] = torch.empty(groups, n, dtype=torch.float32, device=dev) if need_db else None
        # fmt: off
        args = (
            h2, w, dy2, dres2, mean, rstd, dx2, dwp if need_dw else None, dbp if need_db else None, slots,
            m, n, parts, h2.stride(0), dy2.stride(0), 0 if dres2 is None else dres2.stride(0), dx2.stride(0),
            float(weight_offset),
        )
        meta = dict(
            IS_RMS=bool(is_rms), HAS_WEIGHT=w is not None, HAS_DRES=dres2 is not None, COMPUTE_DW=need_dw,
            COMPUTE_DB=need_db, SLICE=cfg.slice_cols, PARTS_POW2=pp, SPIN_LIMIT=SPIN_LIMIT,
            **(_staged_opts(cfg) if staged else _launch_opts(cfg)),
            **({"PAIR": pair} if staged else {}),
            **({"ROWS": tile_rows} if tiled or tile_rows > 1 else {}),
            **({"LEAD": cfg.lead} if tiled else {}),
        )
        # fmt: on
        return args, meta

    route = route or norm_bwd_split_route(h2, dy2, dres2, dx2, is_rms)
    staged, tiled, cfg = route.path is Path.STAGED, route.path is Path.TILED, route.config
    tile_rows = cfg.tile_rows if tiled else (BWD_ROWS if is_rms and not staged else 1)
    kernel = norm_bwd_staged_kernel if staged else norm_bwd_tiled_kernel if tiled else norm_bwd_split_kernel
    # the staged kernel's LayerNorm PAIR form only without a residual gradient (with one it spills: 69% of copy
    # against 92%); it and RMSNorm's staged kernel take one slot a slice, the rest two
    pair = dres2 is None
    one_slot = staged and (is_rms or pair)
    if not launch_split(kernel, h2, 1 if one_slot else 2, build, cfg.slice_cols, h2.device, tile_rows,
                         slots_of=slots_of):
        for buf in lent:  # nothing launched: the buffer is still all zeros
            give_back_slots(buf)
        return None
    out = partials.get("dw"), partials.get("db")
    return (*out, lent[0] if lent else None) if pooled else out


def launch_softmax_fwd_resident(
    x2, y2, spin_limit: int = SPIN_LIMIT, programs: int | None = None, cfg: ResidentConfig | None = None
) -> bool:
    """Softmax forward on [M, N] bf16 row views (routed to :attr:`fly_norm.routing.Path.RESIDENT`) through
    the resident kernel, one wave (False: not launched; :func:`launch_split`). ``programs`` (tests): launch
    only the first programs of the wave (a row whose other slices never publish: its wait gives up). ``cfg``:
    the route's (by default :func:`fly_norm.routing.resident_config`'s for the device)."""
    cfg = cfg or resident_config(flydsl.arch.current(x2.device), x2.shape[1])
    chunk, ring, warps, left = cfg.chunk, cfg.ring, cfg.warps, cfg.left
    per_slice = 2 * chunk * (ring - left)  # columns
    slot_cols = 1 if x2.shape[1] > per_slice else 0  # one slice a row: no exchange, no slots to zero

    def build(slots, parts, pp, groups):
        m, n = x2.shape
        chunks = flyc.cdiv(flyc.cdiv(n // 2, parts), chunk)  # the slices as even as whole chunks allow
        args = (x2, y2, slots, m, n, parts, groups or 1, x2.stride(0), y2.stride(0))
        meta = dict(CHUNK=chunk, CHUNKS=chunks, RING=ring, WARPS=warps, EVEN=n // 2 == parts * chunks * chunk,
                    PP=pp, SPIN_LIMIT=spin_limit, num_warps=warps)  # fmt: skip
        return args, meta

    return x2.shape[0] == 0 or launch_split(softmax_fwd_resident_kernel, x2, slot_cols, build, per_slice,
                                             x2.device, programs=programs) > 0  # fmt: skip
