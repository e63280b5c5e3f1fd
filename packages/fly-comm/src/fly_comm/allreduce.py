"""``CustomAllReduce``: an all-reduce across the GPUs of one host through buffers the ranks share.

Usage (every rank of the group, in the same order)::

    ar = CustomAllReduce(group)              # a collective: registers the buffers once
    y = ar.all_reduce(x)                     # sum over the group's ranks, x unchanged
    ar.all_reduce(x, out=x)                  # in place
    ar.close()                               # a collective too

CUDA graphs (the serving pattern): build the object and run one eager call of each dtype and algorithm you
will capture (kernels compile on their first call, which a capture cannot do) before capturing; then
capture ``ar.all_reduce(x, out=y)`` on every rank. A call allocates nothing and never waits on the host
(the staging buffers are registered once; the epoch that orders calls is a counter on the device, which a
replay advances), so replays are valid as long as every rank replays the same graphs in the same order.
With ``out=None`` the output is allocated by torch's caching allocator (the graph's pool under capture).

On the CPU (``device="cpu"``, or a group without a CUDA backend) ``all_reduce`` is
``torch.distributed.all_reduce`` with the same checks, so CPU jobs (gloo) run the API end to end.
"""

from __future__ import annotations

import socket
from contextlib import nullcontext

import torch
import torch.distributed as dist

from flydsl.errors import (
    ArgumentError,
    BackendError,
    DeviceError,
    DTypeError,
    LayoutError,
    ShapeError,
    UnsupportedError,
)

from . import _transport
from .algorithm import ALGORITHMS, WORLD_SIZES, choose_algorithm, default_cutoffs
from .layout import MAX_PROGRAMS, STATE_LEN, TIMEOUT_SLOT, BufferLayout, two_shot_slice

__all__ = ["CustomAllReduce", "DTYPES", "OPS", "DEFAULT_MAX_SIZE", "DEFAULT_PROGRAMS"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OPS = ("sum", "max", "min")
DEFAULT_MAX_SIZE = 8 * 2**20
# Programs a launch: every one must be resident (see fly_comm._kernels.allreduce), far below an H200's 132 SMs;
# 32 programs x 8 warps keep ~128 KiB of 16-byte loads in flight a rank. A first estimate, not yet measured.
DEFAULT_PROGRAMS = 32
NUM_WARPS = 8
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _hostname() -> str:
    return socket.gethostname()


def _resolve_device(device, group) -> torch.device:
    if device is None:
        backend = str(dist.get_backend(group)).lower()
        if torch.cuda.is_available() and "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device: {dev} requested, but torch sees no CUDA GPU")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type != "cpu":
        raise DeviceError(f"device: expected a CUDA device or 'cpu', got {dev}")
    return dev


class CustomAllReduce:
    """All-reduce over the ranks of ``group`` (default: the whole job) on one host.

    ``max_size``: the largest message in bytes (each rank registers two staging halves of it plus 4 KiB of
    flags). ``device``: this rank's device (default: the current CUDA device for a group with an NCCL
    backend, else the CPU). Keyword-only: ``transport`` (``"auto"``, ``"symm_mem"``, ``"ipc"``; see
    :mod:`fly_comm._transport`), ``cutoffs`` (``(one_shot_max, two_shot_max)`` in bytes, default
    :func:`~fly_comm.default_cutoffs` of the world size), ``programs`` (the kernels' fixed grid) and
    ``spin_limit`` (0: a wait for a peer never gives up; n: it gives up after n polls and counts it in
    :meth:`timeouts`, for debugging a hang, not for production: the call's result is then wrong).

    Construction and :meth:`close` are collectives of ``group``. The group must live on one host (checked
    once, from the ranks' host names); the kernels run where the world size is 2, 4 or 8 and every GPU can
    address every other (NVLink), else every call goes to ``torch.distributed.all_reduce``.
    """

    def __init__(self, group=None, max_size: int = DEFAULT_MAX_SIZE, device=None, *, transport: str = "auto",
                 cutoffs: tuple[int, int] | None = None, programs: int = DEFAULT_PROGRAMS,
                 spin_limit: int = 0):  # fmt: skip
        if not dist.is_available() or not dist.is_initialized():
            raise BackendError("CustomAllReduce: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first")  # fmt: skip
        if transport not in _transport.TRANSPORTS:
            raise ArgumentError(f"transport: expected one of {', '.join(_transport.TRANSPORTS)}, got {transport!r}")
        if isinstance(programs, bool) or not isinstance(programs, int) or not 1 <= programs <= MAX_PROGRAMS:
            raise ArgumentError(f"programs: expected an int in [1, {MAX_PROGRAMS}], got {programs!r}")
        if isinstance(spin_limit, bool) or not isinstance(spin_limit, int) or spin_limit < 0:
            raise ArgumentError(f"spin_limit: expected an int >= 0, got {spin_limit!r}")
        self.layout = BufferLayout.for_max_size(max_size)  # checks max_size
        self.max_size = max_size
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = _resolve_device(device, self.group)
        self.programs = programs
        self.spin_limit = spin_limit
        if cutoffs is None:
            cutoffs = default_cutoffs(self.world_size)
        if not isinstance(cutoffs, (tuple, list)) or len(cutoffs) != 2:
            raise ArgumentError(f"cutoffs: expected (one_shot_max, two_shot_max) in bytes, got {cutoffs!r}")
        self.one_shot_max, self.two_shot_max = cutoffs
        choose_algorithm(0, self.world_size, full_nvlink=False, one_shot_max=self.one_shot_max,
                         two_shot_max=self.two_shot_max)  # checks the cutoffs  # fmt: skip
        self._closed = False
        self._registration = None
        self.transport = "torch.distributed"

        # One exchange of what each rank is, before anything is allocated.
        cuda = self.device.type == "cuda"
        # The settings that shape the kernels' grid, flags and buffers must agree, or ranks would wait on
        # flags their peers never set.
        settings = (max_size, programs, self.one_shot_max, self.two_shot_max, transport)
        me = (_hostname(), self.device.type, _transport.gpu_identity(self.device.index) if cuda else None, settings)
        everyone: list = [None] * self.world_size
        with torch.cuda.device(self.device) if cuda else nullcontext():
            dist.all_gather_object(everyone, me, group=self.group)
        if len({e[3] for e in everyone}) > 1:
            raise ArgumentError("CustomAllReduce: the ranks passed different (max_size, programs, cutoffs, transport): "
                                f"{[e[3] for e in everyone]}; every rank must pass the same")  # fmt: skip
        everyone = [e[:3] for e in everyone]
        hosts = sorted({h for h, _, _ in everyone})
        if len(hosts) > 1:
            raise UnsupportedError(f"CustomAllReduce: the group spans {len(hosts)} hosts ({', '.join(hosts)}); "
                                   "it serves the GPUs of one host (use torch.distributed.all_reduce across hosts)")
        if len({t for _, t, _ in everyone}) > 1:
            raise DeviceError(f"device: the ranks use different device types: {[t for _, t, _ in everyone]}")
        gpus = [g for _, _, g in everyone]
        if cuda and len(set(gpus)) < len(gpus):
            raise DeviceError(f"device: two ranks of the group use the same GPU ({gpus}); one GPU a rank")

        self.full_nvlink = False
        if cuda and self.world_size in WORLD_SIZES:
            ok = _transport.peers_reachable(self.device.index, gpus)
            votes: list = [None] * self.world_size
            with torch.cuda.device(self.device):
                dist.all_gather_object(votes, ok, group=self.group)
            self.full_nvlink = all(votes)
        if self.full_nvlink:
            self._register(transport)

    # ------------------------------------------------------------------ setup

    def _register(self, transport: str) -> None:
        with torch.cuda.device(self.device):
            reg = _transport.register(self.layout.total_bytes, self.group, self.device, self.rank, self.world_size,
                                      transport)  # fmt: skip
            reg.local.zero_()  # flags start at 0; the first call signals 2
            self._ptrs = torch.tensor(reg.addresses, dtype=torch.int64, device=self.device)
            self._state = torch.zeros(STATE_LEN, dtype=torch.int64, device=self.device)
            self._registration = reg
            self.transport = reg.kind
            # No rank may signal into a buffer before its owner has zeroed it.
            self._barrier()

    def _barrier(self) -> None:
        """Every rank's work queued so far on its current stream has run (a collective)."""
        token = torch.zeros(1, device=self.device)
        dist.all_reduce(token, group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------- queries

    @property
    def kernels_enabled(self) -> bool:
        """Whether calls can take the one-shot / two-shot kernels (else all go to torch.distributed)."""
        return self._registration is not None

    def algorithm(self, nbytes: int) -> str:
        """The algorithm a call of ``nbytes`` bytes takes (:func:`~fly_comm.choose_algorithm` with this
        object's cutoffs; ``"nccl"`` means ``torch.distributed.all_reduce``, whatever the backend)."""
        return choose_algorithm(nbytes, self.world_size, full_nvlink=self.kernels_enabled,
                                one_shot_max=self.one_shot_max, two_shot_max=self.two_shot_max)  # fmt: skip

    def timeouts(self) -> int:
        """Waits that gave up under ``spin_limit`` so far (reads the device: a host synchronization)."""
        if not self.kernels_enabled:
            return 0
        return int(self._state[TIMEOUT_SLOT].item())

    # ------------------------------------------------------------------ calls

    def _check(self, t, op, out):
        if self._closed:
            raise BackendError("CustomAllReduce: all_reduce after close()")
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(f"t: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise DTypeError(f"t: dtype {t.dtype} is not supported; expected one of bfloat16, float16, float32")
        if op not in OPS:
            raise ArgumentError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
        if t.device != self.device:
            raise DeviceError(f"t: on {t.device}, but this CustomAllReduce serves {self.device}")
        if not t.is_contiguous():
            raise LayoutError(f"t: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
                              "call .contiguous() first")  # fmt: skip
        nbytes = t.numel() * t.element_size()
        if nbytes > self.max_size:
            raise ShapeError(f"t: {nbytes} bytes is more than max_size={self.max_size} bytes of this "
                             "CustomAllReduce; build it with a larger max_size")  # fmt: skip
        if out is None:
            return torch.empty_like(t, memory_format=torch.contiguous_format), nbytes
        if not isinstance(out, torch.Tensor):
            raise ArgumentError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if out.shape != t.shape:
            raise ShapeError(f"out: shape {tuple(out.shape)} differs from t's {tuple(t.shape)}")
        if out.dtype != t.dtype:
            raise DTypeError(f"out: dtype {out.dtype} differs from t's {t.dtype}")
        if out.device != t.device:
            raise DeviceError(f"out: on {out.device}, t on {t.device}")
        if not out.is_contiguous():
            raise LayoutError(f"out: must be contiguous (strides {out.stride()})")
        return out, nbytes

    def all_reduce(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None, *,
                   algorithm: str | None = None) -> torch.Tensor:  # fmt: skip
        """Reduce ``t`` over the group's ranks with ``op`` (``"sum"``, ``"max"``, ``"min"``) into ``out``
        (allocated when None; may be ``t`` itself) and return it. bf16, fp16 and fp32, contiguous, on this
        object's device, at most ``max_size`` bytes. The kernels reduce in fp32 in rank order, so every
        rank gets the same bits. ``algorithm`` forces one of ``"one_shot"``, ``"two_shot"``, ``"nccl"``
        (benchmarks, tests; every rank must pass the same); None chooses by size (:meth:`algorithm`)."""
        out, nbytes = self._check(t, op, out)
        if algorithm is None:
            algorithm = self.algorithm(nbytes)
        elif algorithm not in ALGORITHMS:
            raise ArgumentError(f"algorithm: expected None or one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        elif algorithm != "nccl" and not self.kernels_enabled:
            raise UnsupportedError(f"algorithm={algorithm!r}: this CustomAllReduce has no kernels "
                                   f"({self._why_no_kernels()})")  # fmt: skip
        if t.numel() == 0:
            return out
        if algorithm == "nccl":
            if out is not t:
                out.copy_(t)
            dist.all_reduce(out, op=_REDUCE_OPS[op], group=self.group)
            return out
        self._launch(t, out, op, algorithm)
        return out

    def _launch(self, t, out, op, algorithm) -> None:
        from ._kernels.allreduce import launch_one_shot, launch_two_shot

        # 16 bytes a thread a step: full-width vector loads for every dtype.
        block = (16 // t.element_size()) * 32 * NUM_WARPS
        common = dict(programs=self.programs, block=block, half_bytes=self.layout.half_bytes, op=op,
                      spin_limit=self.spin_limit, num_warps=NUM_WARPS)  # fmt: skip
        if algorithm == "one_shot":
            launch_one_shot(t, out, self._ptrs, self._state, self.rank, self.world_size, **common)
        else:
            launch_two_shot(t, out, self._ptrs, self._state, self.rank, self.world_size,
                            two_shot_slice(t.numel(), self.world_size), **common)  # fmt: skip

    def _why_no_kernels(self) -> str:
        if self._closed:
            return "closed"
        if self.device.type != "cuda":
            return f"device {self.device}"
        if self.world_size not in WORLD_SIZES:
            return f"world size {self.world_size}, not one of {WORLD_SIZES}"
        return "the GPUs are not all peer-to-peer reachable"

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Release the shared buffers (a collective: every rank calls it; idempotent). Waits until no rank
        can still be reading this rank's buffer."""
        if self._closed:
            return
        self._closed = True
        if self._registration is not None:
            with torch.cuda.device(self.device):
                self._barrier()
                self._registration.release()
                self._registration = None
                del self._ptrs, self._state

    def __enter__(self) -> CustomAllReduce:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.transport
        return (f"CustomAllReduce(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_size={self.max_size}, transport={state}, full_nvlink={self.full_nvlink})")

