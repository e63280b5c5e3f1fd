"""Registration of one buffer a rank that every rank of the group can address, and the peer check.

Two transports, chosen the same way on every rank (the choice depends only on the installed torch, which
the ranks of a job share, so no rank can take one path while another takes the other and hang):

- ``symm_mem``: torch's symmetric memory (``torch.distributed._symmetric_memory``: ``empty`` +
  ``rendezvous``, torch >= 2.6; on torch 2.5 the module lacks ``empty``). The handle maps every peer's
  allocation into this process and gives their addresses (``buffer_ptrs``).
- ``ipc``: CUDA IPC. The buffer comes from torch's caching allocator; ``torch.multiprocessing.reductions.
  reduce_tensor`` gives the picklable handle torch itself sends between processes (a ``cudaIpcMemHandle_t``
  of the allocation plus the buffer's offset in it), the handles are exchanged with ``all_gather_object``
  and each peer's is opened with the rebuild function that came with it (``cudaIpcOpenMemHandle``, peer
  access enabled lazily). Needs every rank to see every GPU of the host (``CUDA_VISIBLE_DEVICES`` the same
  in all ranks, torchrun's default) and not ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` (IPC of
  such memory needs a file-descriptor exchange torch does not do here).

Neither path runs on this repository's CPU-only CI; see the package README.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flydsl.errors import ArgumentError, UnsupportedError

__all__ = ["TRANSPORTS", "Registration", "default_transport", "register", "peers_reachable", "gpu_identity"]

TRANSPORTS = ("auto", "symm_mem", "ipc")


def _symm_mem_module():
    try:
        from torch.distributed import _symmetric_memory as symm
    except ImportError:
        return None
    if not all(hasattr(symm, name) for name in ("empty", "rendezvous")):
        return None
    return symm


def default_transport() -> str:
    """``"symm_mem"`` where the installed torch has symmetric memory's ``empty`` and ``rendezvous``, else
    ``"ipc"``."""
    return "symm_mem" if _symm_mem_module() is not None else "ipc"


@dataclass
class Registration:
    """One rank's view of the shared buffers: its own, and every rank's address in this process."""

    kind: str
    local: torch.Tensor  # this rank's buffer (uint8)
    addresses: list[int]  # rank -> address of that rank's buffer, usable from this process's device
    keep: list[Any] = field(default_factory=list)  # handles / mapped tensors that keep the mappings alive

    def release(self) -> None:
        # Peers' mappings first, then the handle, then our own allocation.
        self.keep.clear()
        self.addresses = []


def register(nbytes: int, group, device: torch.device, rank: int, world: int, transport: str) -> Registration:
    """Allocate ``nbytes`` on ``device`` and map every rank's allocation here (a collective of ``group``)."""
    if transport not in TRANSPORTS:
        raise ArgumentError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    kind = default_transport() if transport == "auto" else transport
    if kind == "symm_mem":
        symm = _symm_mem_module()
        if symm is None:
            raise UnsupportedError(f"transport='symm_mem': torch {torch.__version__} has no "
                                   "torch.distributed._symmetric_memory.empty/rendezvous; use transport='ipc'")
        return _register_symm_mem(symm, nbytes, group, device, rank, world)
    return _register_ipc(nbytes, group, device, rank, world)


def _register_symm_mem(symm, nbytes, group, device, rank, world) -> Registration:
    name = group.group_name
    enabled = getattr(symm, "is_symm_mem_enabled_for_group", None)
    enable = getattr(symm, "enable_symm_mem_for_group", None)
    if enable is not None and (enabled is None or not enabled(name)):
        with warnings.catch_warnings():  # deprecated (a no-op) in the newest torch, required before 2.7
            warnings.simplefilter("ignore")
            enable(name)
    local = symm.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm.rendezvous(local, name)
    bases = [int(p) for p in handle.buffer_ptrs]
    if len(bases) != world:
        raise UnsupportedError(f"symmetric memory mapped {len(bases)} buffers for a group of {world} ranks")
    # The tensor may sit at an offset in its symmetric allocation; the same offset on every rank.
    delta = local.data_ptr() - bases[rank]
    return Registration("symm_mem", local, [b + delta for b in bases], [handle])


def _register_ipc(nbytes, group, device, rank, world) -> Registration:
    from torch.multiprocessing.reductions import reduce_tensor

    local = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rebuild, args = reduce_tensor(local)
    handles: list[Any] = [None] * world
    dist.all_gather_object(handles, (rebuild, args), group=group)
    mapped = []
    for r, (fn, a) in enumerate(handles):
        mapped.append(local if r == rank else fn(*a))
    return Registration("ipc", local, [t.data_ptr() for t in mapped], [t for t in mapped if t is not local])


def gpu_identity(index: int) -> str:
    """A string naming the physical GPU ``index`` of this process (its UUID where torch reports it)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{props.name}@{getattr(props, 'pci_bus_id', index)}"


def _nvml_nvlink(a: str, b: str) -> bool | None:
    """Whether NVML reports an NVLink path between the GPUs of identities ``a`` and ``b`` (None: unknown)."""
    try:
        import pynvml  # nvidia-ml-py, which torch itself uses where installed; optional here
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        # By UUID, not index: CUDA's device order (fastest first by default) need not be NVML's (PCI bus order).
        ha, hb = (pynvml.nvmlDeviceGetHandleByUUID(u if u.startswith("GPU-") else f"GPU-{u}") for u in (a, b))
        status = pynvml.nvmlDeviceGetP2PStatus(ha, hb, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
        return status == pynvml.NVML_P2P_STATUS_OK
    except Exception:  # no UUID from torch, an NVML without the query: unknown
        return None


def peers_reachable(own: int, peer_ids: list[str]) -> bool:
    """Whether this process's GPU ``own`` can read and write every GPU in ``peer_ids`` (by
    :func:`gpu_identity`) directly: NVLink where NVML can tell, else CUDA's peer-access report."""
    local = {gpu_identity(i): i for i in range(torch.cuda.device_count())}
    me = gpu_identity(own)
    for pid in peer_ids:
        if pid == me:
            continue
        idx = local.get(pid)
        if idx is None:  # a GPU this process cannot see: no peer mapping possible
            return False
        nvlink = _nvml_nvlink(me, pid)
        if nvlink is False:
            return False
        if nvlink is None and not torch.cuda.can_device_access_peer(own, idx):
            return False
    return True
