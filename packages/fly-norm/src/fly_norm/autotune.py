"""Tuning adopter of fly-norm: one :class:`flydsl.autotune.Tunable` per row kernel.

Key: ``{"n_bucket": next power of two of N, "dtype": "bf16"|"fp16"|"fp32"}``
and the arch. A normal call serves the searched winner, the artifact shipped
in ``fly_norm/artifacts/<name>.json`` (generated on the H200 with ``flydsl
tune norm``) or the shared default ladder of :mod:`flydsl_common.rows`; it
never benchmarks unless ``FLYDSL_AUTOTUNE=1`` or ``autotune=True``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl import env
from flydsl.autotune import SearchTask, Tunable
from flydsl.checks import dtype_name, parse_dtype
from flydsl.errors import TuningError
from flydsl_common.rows import RowConfig, default_row_config, row_config_valid

from ._eager import general_path_only
from ._row_plans import CHUNKED, PACKED_MIN_N
from .routing import Path as RoutePath
from .routing import route

__all__ = [
    "OPS", "TUNABLES", "row_config_for", "clear_memo", "tuning_key", "candidates", "bwd_candidates",
    "softmax_bwd_candidates", "bwd_default_row_config",
]  # fmt: skip

ARTIFACTS = Path(__file__).parent / "artifacts"
OPS = (
    "rmsnorm_fwd", "layernorm_fwd", "softmax_fwd", "rmsnorm_bwd", "layernorm_bwd", "softmax_bwd",
    "rmsnorm_quant", "layernorm_quant",  # the quantized forwards: same kernel and space, their own winners
)  # fmt: skip

# Row widths the shipped artifacts cover (powers of two; a width is served by its bucket).
TUNE_BUCKETS = tuple(1 << k for k in range(8, 19))  # 256 .. 262144
# On a GPU, the buckets whose rows fly_norm.routing.route sends elsewhere than the row kernel (the split,
# staged, resident and pipelined paths: the row config does not steer them) are not tuned: `flydsl tune norm`
# skips them there. (Softmax's backward splits only past 16K: its space holds chunked configs, and its 16K
# bucket is searched.) The tuner's rows: contiguous, of the key's dtype, with weight and bias (_run_op).
_ROUTED = {  # tunable -> (routing op, backward, quantized output)
    "rmsnorm_fwd": ("rms_norm", False, None), "layernorm_fwd": ("layer_norm", False, None),
    "softmax_fwd": ("softmax", False, None), "rmsnorm_bwd": ("rms_norm", True, None),
    "layernorm_bwd": ("layer_norm", True, None), "softmax_bwd": ("softmax", True, None),
    "rmsnorm_quant": ("rms_norm", False, torch.int8), "layernorm_quant": ("layer_norm", False, torch.int8),
}  # fmt: skip


def _gpu_arch(name: str) -> flydsl.arch.Arch:
    """A nominal description of the GPU named ``name`` (sm_90, gfx942, ...): Hopper's sizes, its backend."""
    hip = name.startswith("gfx")
    return dataclasses.replace(flydsl.arch.SM90, name=name, backend="hip" if hip else "cuda",
                               capability=None if hip else flydsl.arch.SM90.capability)  # fmt: skip


def _row_kernel_serves(name: str, n: int, dtype: torch.dtype, arch: flydsl.arch.Arch) -> bool:
    """Whether the tuned row config serves rows of ``n`` columns of tunable ``name`` (routing.route)."""
    op, backward, quant = _ROUTED[name]
    rows = (dtype,) if not backward else (dtype, dtype)  # y; dy and dx
    vectors = () if op != "layer_norm" else (dtype, dtype)
    path = route(op, dtype, 1, n, arch, backward=backward, quant=quant, row_dtypes=rows, vector_dtypes=vectors)
    return path.path is RoutePath.ROWS
# Shipped artifacts cover bf16 (what the benchmarks and most models run); fp16
# and fp32 keys are served by the default ladder unless searched on the machine
# or tuned with `flydsl tune norm --key '{"n_bucket": 4096, "dtype": "fp16"}'`.
TUNE_DTYPES = ("bf16",)


def tuning_key(n: int, dtype: torch.dtype) -> dict:
    """Bucketed key: a new row width in the same power-of-two bucket reuses the search."""
    return {"n_bucket": flyc.next_power_of_2(max(n, 1)), "dtype": dtype_name(dtype)}


CHUNKED_MAX_N = 262144


def _default(key, arch: str) -> RowConfig:
    n = key["n_bucket"]
    cfg = default_row_config(n, arch)
    if cfg.single_pass or n > CHUNKED_MAX_N or not row_config_valid(CHUNKED, n, arch):
        return cfg
    return CHUNKED


# Backward launch default (the "*_bwd" tunables). The backward keeps h, dy,
# the next block's prefetch, their products and the per-element weight-gradient
# accumulators live at once. Compiled for sm_90 (`python tools/sm90_compile.py
# norm_bwd`: ptxas, bf16, widths and strides multiples of 16 as Triton
# specializes them), 16 elements a thread take 118-127 registers for rms_norm
# (four 4-warp programs an SM) and 144-150 for layer_norm (a second
# accumulator, dbias, and the mean: three); 8 elements a thread take 88-94 for
# layer_norm (five). Measured on the H200 (bf16, 2^27 elements): rms_norm at 16 elements
# reached 91-92% of copy up to 8K columns; layer_norm 62-66% at 16 elements
# and 69-74% at 8, so layer_norm uses 8 elements a thread wherever 16
# warps suffice (up to 4K columns), 16 above. The grid is the resident count
# (_norm_host.bwd_resident). 32 warps cap a thread at 64 registers and spill, so
# rows wider than 16 warps x 32 threads x 16 elements go through the chunked
# path with 8K-element chunks (on a GPU, the split path takes them first).
_BWD_ELEMS_PER_THREAD = 16
_BWD_ELEMS = {"layernorm_bwd": 8}  # ops whose default packs fewer elements per thread
_BWD_MAX_WARPS = 16
_BWD_CHUNK = RowConfig(1, 8192, 16, False)


def bwd_default_row_config(n: int, arch: str = "sm_90", elems_per_thread: int = _BWD_ELEMS_PER_THREAD) -> RowConfig:
    """Pure default of the norm backward's launch config for rows of ``n`` elements (see above).

    More warps first (up to 16), then more elements a thread (up to 16).
    """
    del arch  # one table serves NVIDIA and AMD: at most 16 warps (1024 threads with 64-wide waves)
    block_n = flyc.next_power_of_2(max(n, 1))
    if block_n > 32 * _BWD_MAX_WARPS * _BWD_ELEMS_PER_THREAD:
        return _BWD_CHUNK
    elems = max(elems_per_thread, block_n // (32 * _BWD_MAX_WARPS))
    warps = max(4, min(_BWD_MAX_WARPS, block_n // (32 * elems)))
    block_m = max(1, min(64, 32 * warps * elems // block_n))
    return RowConfig(block_m, block_n, warps, True)


def _bwd_default_for(name: str):
    elems = _BWD_ELEMS.get(name, _BWD_ELEMS_PER_THREAD)

    def default(key, arch: str) -> RowConfig:
        return bwd_default_row_config(key["n_bucket"], arch, elems)

    return default


def candidates(key, arch: str) -> list[RowConfig]:
    """A bounded, shape-aware space (at most ~20 configs per key, each a compile and a timing).

    Single pass (rows up to 32K): rows per program so that a program moves
    2K-16K elements, and warps giving 8-64 elements per thread (the range
    where the quantization sweep found every winner). Chunked (rows above
    4K): 1K-16K chunks at 4-16 elements a thread, the width fixed at compile
    time (the best configs measured from 8K to 32K columns on the H200: 2048
    columns over 8 warps up to 4096 over 32).
    """
    n = key["n_bucket"]
    out = []
    if n <= 32768:
        for block_m in (1, 2, 4, 8, 16, 32, 64):
            elems = block_m * n
            if not (min(2048, n) <= elems <= max(16384, n)) or (block_m > 1 and n > 2048):
                continue
            for warps in (1, 2, 4, 8, 16, 32):
                if 8 <= elems // (32 * warps) <= 64:
                    out.append(RowConfig(block_m, n, warps, True))
    if n > 4096:
        for block_n in (1024, 2048, 4096, 8192, 16384):
            if block_n >= n:
                continue
            for warps in (4, 8, 16, 32):
                if 4 <= block_n // (32 * warps) <= 16:
                    out.append(RowConfig(1, block_n, warps, False))
                    if warps == 32:  # 29-46 registers uncapped (sm_90): one program an SM above 32
                        out.append(RowConfig(1, block_n, warps, False, maxnreg=32))
    return out


def packed_candidates(key, arch: str) -> list[RowConfig]:
    """The space of the forwards whose single pass holds bf16 rows packed from 32K columns (the quantized
    RMSNorm, the plain LayerNorm, softmax; _row_plans.PACKED_MIN_N): the forwards' and, at 32K, that single
    pass over 8 warps under a 128-register cap (two programs an SM; sm_90: 128 registers, no spill). Calls
    it cannot serve packed run the chunked passes (_row_plans.packed_plan)."""
    out = candidates(key, arch)
    n = key["n_bucket"]
    if n == PACKED_MIN_N and key["dtype"] == "bf16" and not arch.startswith("gfx") and arch != "cpu":
        out.append(RowConfig(1, n, 8, True, maxnreg=128))
    return out


# Register caps the backward's search tries beside each uncapped config (sm_90, `tools/sm90_compile.py`:
# layer_norm's 16-element configs take 143-147 registers, one 8-warp program an SM or three of 4 warps;
# at 128 two and four fit without spilling, at 96 five of 4 warps with a small spill; 16 warps at 64: two).
_BWD_CAPS = {4: (128, 96), 8: (128,), 16: (64,), 32: ()}


def bwd_candidates(key, arch: str) -> list[RowConfig]:
    """The backward's space: single pass at 8 or 16 elements a thread and 4-16 warps (more spill; see above),
    and on NVIDIA 32 warps at 8 elements (64 registers: one program an SM, more warps to cover its
    reductions).

    Rows wider than the single-pass limit take the split paths on a GPU (not steered by a row config), so
    only single-pass configs are searched: about six per key, each also with the register caps of
    ``_BWD_CAPS`` (about fourteen in all).
    """
    n = key["n_bucket"]
    out = []
    for warps in (4, 8, 16) if arch.startswith("gfx") else (4, 8, 16, 32):  # gfx: 16 warps of 64 at most
        for elems in (8, 16) if warps < 32 else (8,):
            per_program = 32 * warps * elems
            if per_program < n or per_program // n > 64:
                continue
            cfg = RowConfig(per_program // n, n, warps, True)
            out.append(cfg)
            out += [dataclasses.replace(cfg, maxnreg=cap) for cap in _BWD_CAPS[warps]]
    return out


def softmax_bwd_candidates(key, arch: str) -> list[RowConfig]:
    """The softmax backward's space: the backward's single pass (:func:`bwd_candidates`) and, from 2K
    columns, its chunked pass (one read for sum(dy * y), a second, from L2, for dx) at chunks of 1K-16K and
    8 or 16 warps, at most 8 chunks a row. On the H200 two reads of a row ran 1-2% faster than one at 2K-4K
    and the chunk decides at 16K (4 warps lost 5-30%)."""
    n = key["n_bucket"]
    out = bwd_candidates(key, arch)  # none past the single pass's reach (16K)
    if n >= 2048:
        for block_n in (1024, 2048, 4096, 8192, 16384):
            for warps in (8, 16):
                if block_n <= n <= 8 * block_n and block_n // (32 * warps) >= 4:
                    out.append(RowConfig(1, block_n, warps, False))
    return out


def _valid(cfg: RowConfig, key, arch: str) -> bool:
    return row_config_valid(cfg, key["n_bucket"], arch)


def _tune_keys_for(name: str):
    def tune_keys(arch: str) -> list[dict]:
        if arch == "cpu":  # the interpreter: every bucket runs the row kernels
            return [{"n_bucket": n, "dtype": d} for d in TUNE_DTYPES for n in TUNE_BUCKETS]
        gpu = _gpu_arch(arch)
        return [
            {"n_bucket": n, "dtype": d} for d in TUNE_DTYPES for n in TUNE_BUCKETS
            if _row_kernel_serves(name, n, parse_dtype("dtype", d), gpu)
        ]  # fmt: skip

    return tune_keys


# ------------------------------------------------------------ offline tuning

# While a capture is active for an op, row_config_for hands the search task
# it was given to the capture (and serves the default): `flydsl tune norm`
# runs the public op once on generated inputs and gets exactly the task a
# forced search in a user's process would run.
# A module global, not a context variable: on CUDA, autograd runs the backward
# on its own device thread, where a context variable set here is not visible.
_CAPTURE: list[tuple[str, list]] = []

# Rows of the bucket's width, 2^27 elements as the benchmark runs (PERF.md, "Why 2^27"): at 2^25 a kernel's
# ramp and tail are ~6% of its time on the H200 and weigh differently per config.
_TUNE_ELEMENTS = 1 << 27


def _run_op(op: str, m: int, n: int, dtype: torch.dtype, device) -> None:
    from . import layer_norm, layer_norm_quant, rms_norm, rms_norm_quant, softmax

    x = torch.randn(m, n, device=device, dtype=dtype)
    w = torch.randn(n, device=device, dtype=dtype)
    b = torch.randn(n, device=device, dtype=dtype)
    if op == "rmsnorm_quant":
        rms_norm_quant(x, w, 1e-6)
        return
    if op == "layernorm_quant":
        layer_norm_quant(x, w, b, 1e-5)
        return
    fwd = {
        "rmsnorm": lambda t: rms_norm(t, w, 1e-6, autotune=False),
        "layernorm": lambda t: layer_norm(t, w, b, 1e-5, autotune=False),
        "softmax": lambda t: softmax(t, -1, autotune=False),
    }[op.rsplit("_", 1)[0]]
    if op.endswith("_fwd"):
        fwd(x)
        return
    # The weight and bias need gradients too, as in training: a backward without dweight/dbias is another
    # kernel specialization (no per-column accumulators: ~40 fewer registers a thread), and configs
    # searched on it misfire on the real one (H200: a 64-register cap timed 207 us without
    # dweight, 688 us with it).
    for t in (x, w, b):
        t.requires_grad_(True)
    fwd(x).backward(torch.randn(m, n, device=device, dtype=dtype))


def _make_task(name: str):
    def make_task(key, device) -> SearchTask:
        n = key["n_bucket"]
        dtype = parse_dtype("dtype", key["dtype"])
        captured: list = []
        _CAPTURE.append((name, captured))
        try:
            with general_path_only():  # the path that builds the search task
                _run_op(name, max(1, _TUNE_ELEMENTS // n), n, dtype, device)
        finally:
            _CAPTURE.pop()
        if not captured or captured[0] is None:
            raise TuningError(f"{name}: the op built no search task for key {key}")
        return captured[0]()

    return make_task


_CANDIDATES = {name: packed_candidates for name in ("rmsnorm_quant", "layernorm_fwd", "softmax_fwd")}
_CANDIDATES["softmax_bwd"] = softmax_bwd_candidates


def _make(name: str) -> Tunable:
    return Tunable(
        name=name,
        config_type=RowConfig,
        default=_bwd_default_for(name) if name.endswith("_bwd") else _default,
        candidates=_CANDIDATES.get(name, bwd_candidates if name.endswith("_bwd") else candidates),
        is_valid=_valid,
        artifact_dir=ARTIFACTS,
        max_candidates=24,
        tune_keys=_tune_keys_for(name),
        make_task=_make_task(name),
    )


TUNABLES: dict[str, Tunable] = {name: _make(name) for name in OPS}


# Per-process memo in front of Tunable.select, keyed by what a call site has at
# hand (op, n, dtype, device): a hit costs one dict lookup and the env check,
# instead of building the bucketed key and querying the arch (~4 us).
_FAST: dict[tuple, RowConfig] = {}


def clear_memo() -> None:
    """Forget every resolved config of this process (tests; after tuning)."""
    _FAST.clear()
    for t in TUNABLES.values():
        t.clear_memo()


def row_config_for(
    op: str,
    n: int,
    dtype: torch.dtype,
    device,
    *,
    autotune: bool | None = None,
    task: Callable[[], SearchTask] | None = None,
) -> RowConfig:
    """The launch config of row kernel ``op`` for rows of ``n`` elements of ``dtype`` on ``device``.

    The config must also fit this exact ``n`` (a bucket's winner is chosen for
    the bucket's upper end): a single-pass config always covers the bucket.
    """
    capture = _CAPTURE[-1] if _CAPTURE else None
    fast_key = (op, n, dtype, device)
    plain = capture is None and not autotune and not env.get("FLYDSL_AUTOTUNE")
    if plain:
        cfg = _FAST.get(fast_key)
        if cfg is not None:
            return cfg
    if capture is not None and capture[0] == op:
        capture[1].append(task)
        autotune = False
    cfg = TUNABLES[op].select(tuning_key(n, dtype), flydsl.arch.name(device), autotune=autotune, task=task)
    if plain:
        _FAST[fast_key] = cfg
    else:
        _FAST.pop(fast_key, None)  # a search may have changed the answer
    return cfg
