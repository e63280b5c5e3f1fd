"""What the device is: backend, architecture, and the sizes kernels plan around.

``flydsl.arch.current(device)`` answers once per device and caches the
answer; heuristics take the resulting :class:`Arch` (or its ``name``) as an
explicit argument so they stay pure functions that CPU tests can call with
any architecture.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import _backend

__all__ = ["Arch", "current", "name", "from_name", "INTERPRETER", "SM90"]


@dataclass(frozen=True)
class Arch:
    backend: str  # "cuda", "hip" or "interpreter"
    name: str  # "sm_90", "gfx942", ... or "cpu" for the interpreter
    device_name: str  # marketing name, e.g. "NVIDIA H200"
    capability: tuple[int, int] | None  # CUDA compute capability
    sm_count: int  # streaming multiprocessors (compute units on AMD)
    warp_size: int
    smem_per_block: int  # bytes of shared memory a program may use (opt-in maximum)
    l2_bytes: int
    memory_bytes: int

    @property
    def is_hopper(self) -> bool:
        return self.backend == "cuda" and self.capability is not None and self.capability[0] == 9

    @property
    def is_interpreter(self) -> bool:
        return self.backend == "interpreter"

    @property
    def has_tma(self) -> bool:
        """Tensor-descriptor loads and stores run here: a CUDA GPU with the tensor memory accelerator (sm_90+),
        or the interpreter, which executes them."""
        return self.is_interpreter or (self.backend == "cuda" and (self.capability or (0,)) >= (9, 0))


# The interpreter executes kernels on the CPU. Its sizes are nominal (those of
# a Hopper SM, so configurations chosen for it are also valid GPU configs).
INTERPRETER = Arch(
    backend="interpreter",
    name="cpu",
    device_name="cpu (Triton interpreter)",
    capability=None,
    sm_count=os.cpu_count() or 1,
    warp_size=32,
    smem_per_block=227 * 1024,
    l2_bytes=50 * 1024 * 1024,
    memory_bytes=0,
)

# A named Hopper description, for CPU tests of heuristics and for tuning keys.
SM90 = Arch(
    backend="cuda",
    name="sm_90",
    device_name="NVIDIA H100/H200",
    capability=(9, 0),
    sm_count=132,
    warp_size=32,
    smem_per_block=227 * 1024,
    l2_bytes=50 * 1024 * 1024,
    memory_bytes=80 * 1024**3,
)


@functools.cache
def _query(index: int) -> Arch:
    props = torch.cuda.get_device_properties(index)
    hip = torch.version.hip is not None
    if hip:
        arch_name = getattr(props, "gcnArchName", "gfx").split(":")[0]
        capability = None
        warp = int(getattr(props, "warp_size", 64))
    else:
        capability = (props.major, props.minor)
        arch_name = f"sm_{props.major}{props.minor}"
        warp = int(getattr(props, "warp_size", 32))
    smem = int(
        getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 48 * 1024)
    )
    return Arch(
        backend="hip" if hip else "cuda",
        name=arch_name,
        device_name=props.name,
        capability=capability,
        sm_count=int(props.multi_processor_count),
        warp_size=warp,
        smem_per_block=smem,
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
        memory_bytes=int(props.total_memory),
    )


def current(device: torch.device | str | int | None = None) -> Arch:
    """The :class:`Arch` of ``device`` (default: the current GPU, or the interpreter)."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if device is not None and not isinstance(device, int):
        device = torch.device(device)
        if device.type == "cpu":
            return INTERPRETER
        device = device.index
    if _backend.interpreting() or not _cuda_available():
        return INTERPRETER
    return _query(torch._C._cuda_getDevice() if device is None else int(device))


_CUDA_SEEN: list = []  # non-empty once a GPU was found: a process's GPUs do not go away


def _cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked until it first says yes (it queries NVML or the driver on every
    call: ~5 us of a launch path's host time)."""
    if _CUDA_SEEN:
        return True
    if torch.cuda.is_available():
        _CUDA_SEEN.append(True)
        return True
    return False


def name(device=None) -> str:
    """Short architecture name ("sm_90", "gfx942", "cpu"), as used in tuning keys."""
    return current(device).name


def from_name(arch_name: str) -> Arch:
    """The :class:`Arch` a tuning key's arch name stands for: the interpreter for "cpu", this process's GPU
    when it has that name, and :data:`SM90` for "sm_90" elsewhere (CPU tests of heuristics, an artifact's
    sm_90 entries read on another machine). Another name on a machine without that GPU gets this
    process's arch, whose limits then decide validity."""
    if arch_name == "cpu":
        return INTERPRETER
    here = current()
    return SM90 if arch_name == "sm_90" and here.name != arch_name else here
