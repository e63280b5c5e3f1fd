"""Tuning adopter of fly-norm: one :class:`flydsl.autotune.Tunable` per row kernel.

Key: ``{"n_bucket": next power of two of N, "dtype": "bf16"|"fp16"|"fp32"}``
and the arch. A normal call serves the searched winner, the artifact shipped
in ``fly_norm/artifacts/<name>.json`` (generated on the H200 with ``flydsl
tune norm``) or the shared default ladder of :mod:`flydsl_common.rows`; it
never benchmarks unless ``FLYDSL_AUTOTUNE=1`` or ``autotune=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl.autotune import SearchTask, Tunable
from flydsl.checks import dtype_name
from flydsl_common.rows import RowConfig, default_row_config, row_config_valid

__all__ = ["OPS", "TUNABLES", "row_config_for", "tuning_key", "candidates"]

ARTIFACTS = Path(__file__).parent / "artifacts"
OPS = ("rmsnorm_fwd", "layernorm_fwd", "softmax_fwd", "rmsnorm_bwd", "layernorm_bwd", "softmax_bwd")

# Row widths the shipped artifacts cover (powers of two; a width is served by its bucket).
TUNE_BUCKETS = tuple(1 << k for k in range(8, 19))  # 256 .. 262144
TUNE_DTYPES = ("bf16", "fp16", "fp32")


def tuning_key(n: int, dtype: torch.dtype) -> dict:
    """Bucketed key: a new row width in the same power-of-two bucket reuses the search."""
    return {"n_bucket": flyc.next_power_of_2(max(n, 1)), "dtype": dtype_name(dtype)}


def _default(key, arch: str) -> RowConfig:
    return default_row_config(key["n_bucket"], arch)


def candidates(key, arch: str) -> list[RowConfig]:
    """A bounded, shape-aware space around the default (at most ~30 configs)."""
    n = key["n_bucket"]
    out = []
    if n <= 32768:  # one pass over the row, several rows per program on narrow rows
        for block_m in (1, 2, 4, 8, 16, 32):
            if block_m * n > 32768 or (block_m > 1 and n > 4096):
                continue
            for warps in (1, 2, 4, 8, 16, 32):
                per_thread = block_m * n // (32 * warps)
                if 2 <= per_thread <= 128:
                    out.append(RowConfig(block_m, n, warps, True))
    if n > 2048:  # chunked: the row is read twice, the second time mostly from L2
        for block_n in (2048, 4096, 8192, 16384, 32768):
            if block_n >= n:
                continue
            for warps in (4, 8, 16, 32):
                if 4 <= block_n // (32 * warps) <= 64:
                    out.append(RowConfig(1, block_n, warps, False))
    return out


def _valid(cfg: RowConfig, key, arch: str) -> bool:
    return row_config_valid(cfg, key["n_bucket"], arch)


def _tune_keys(arch: str) -> list[dict]:
    return [{"n_bucket": n, "dtype": d} for d in TUNE_DTYPES for n in TUNE_BUCKETS]


def _make(name: str) -> Tunable:
    return Tunable(
        name=name,
        config_type=RowConfig,
        default=_default,
        candidates=candidates,
        is_valid=_valid,
        artifact_dir=ARTIFACTS,
        max_candidates=48,
        tune_keys=_tune_keys,
    )


TUNABLES: dict[str, Tunable] = {name: _make(name) for name in OPS}


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
    return TUNABLES[op].select(tuning_key(n, dtype), flydsl.arch.name(device), autotune=autotune, task=task)
