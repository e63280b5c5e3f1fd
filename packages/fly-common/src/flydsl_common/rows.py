"""Row-kernel plumbing shared by every memory-bound row kernel (quantization, norms, softmax).

- :func:`as_rows`: view ``[..., N]`` as ``[M, N]`` (strided rows kept, no copy
  when the leading dimensions collapse to one stride);
- :class:`RowConfig`: the launch configuration of a row kernel;
- :func:`default_row_config`: the measured default ladder, a pure function of
  (row width, arch), and :func:`row_config_valid`, the one validity predicate
  of the space (shared by heuristics, tuners and tests).

The ladder was measured on the H200 with a launch-config sweep of the
quantization kernel (numbers in fly-common's PERF.md, "The default launch
ladder"): a row of up to 16K elements stays in registers and is read once;
one 16K row over 8 warps streams at 98% of copy bandwidth, a 32K row in one
pass over 16 warps only at 73%. Wider rows are processed in chunks and read
twice, the second time mostly from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flydsl.compiler as flyc

__all__ = ["as_rows", "RowConfig", "default_row_config", "row_config_valid", "MAX_SINGLE_PASS"]

MAX_SINGLE_PASS = 16384  # widest row kept in registers (elements)
_ELEMS_PER_PROGRAM = 8192  # narrow rows: pack rows until a program moves 8K elements (97% at N = 1024)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` -> ``[M, N]``; a view whenever the leading dims collapse, else one copy."""
    if x.dim() == 2:  # already rows: skip the view (a view costs ~1 us on the launch path)
        return x
    n = x.shape[-1]
    if x.dim() == 1:
        return x.view(1, n)
    m = x.shape[:-1].numel()  # not -1: with N = 0 the row count cannot be inferred
    try:
        return x.view(m, n)
    except RuntimeError:  # leading dims not collapsible into one stride
        return x.reshape(m, n)


@dataclass(frozen=True)
class RowConfig:
    """Launch configuration of a row kernel."""

    block_m: int  # rows per program
    block_n: int  # columns per step (a power of two)
    num_warps: int
    single_pass: bool  # the whole row fits in one step and is kept in registers
    # Register cap a thread (NVIDIA, Triton's ``maxnreg``), or None: more programs fit an SM (Hopper's
    # row kernels are occupancy-bound) at the price of spills.
    maxnreg: int | None = None

    def launch_options(self) -> dict:
        """Triton's launch options of this config: ``num_warps`` and, when capped, ``maxnreg``."""
        if self.maxnreg is None:
            return {"num_warps": self.num_warps}
        return {"num_warps": self.num_warps, "maxnreg": self.maxnreg}


def _max_warps(arch: str) -> int:
    # 32 warps is 1024 threads on NVIDIA; AMD's 64-wide wavefronts cap a program at 16.
    return 16 if arch.startswith("gfx") else 32


def row_config_valid(cfg: RowConfig, n: int, arch: str = "sm_90") -> bool:
    """The one validity predicate of the row-kernel space."""
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.num_warps))
    if not pow2 or cfg.num_warps > _max_warps(arch):
        return False
    if cfg.block_m * cfg.block_n > 65536:  # Triton's per-block tensor limit is 2**20; keep registers sane
        return False
    if cfg.maxnreg is not None and (arch.startswith("gfx") or not 24 <= cfg.maxnreg <= 255 or cfg.maxnreg % 8):
        return False  # a cap: NVIDIA only, whole multiples of 8 as ptxas allocates them
    if cfg.single_pass:
        return cfg.block_n >= n
    return cfg.block_m == 1  # chunked rows are processed one row per program


def default_row_config(n: int, arch: str = "sm_90") -> RowConfig:
    """The default ladder (see the module docstring for the measurements behind it)."""
    block_n = flyc.next_power_of_2(max(n, 1))
    if block_n > MAX_SINGLE_PASS:
        if block_n <= 32768:
            return RowConfig(1, 16384, 16, False)  # 80% at N = 32K, best of the sweep
        return RowConfig(1, 32768, _max_warps(arch), False)  # 78% at N = 64K
    block_m = max(1, min(64, _ELEMS_PER_PROGRAM // block_n)) if block_n <= 2048 else 1
    # 4 warps up to 8K elements per program, 8 warps for 16K (16 warps lost 15% there).
    num_warps = 4 if block_m * block_n <= 8192 else 8
    return RowConfig(block_m, block_n, num_warps, True)
