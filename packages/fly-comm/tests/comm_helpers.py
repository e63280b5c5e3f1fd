"""Helpers of the fly-comm suite: process groups of several ranks, and a single-process simulation of the
kernels' shared memory (every "rank" a CPU buffer of this process, its kernels run by the interpreter)."""

from __future__ import annotations

import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch

from fly_comm.layout import STATE_LEN, TIMEOUT_SLOT, BufferLayout, two_shot_slice

# Units in the last place, relative: one rounding to the dtype (round to nearest) is at most half of it;
# Triton's interpreter truncates fp32 -> bf16 (its RTNE path is taken only for non-default modes), a full one.
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input of a test (the same on the rank and in the checking process)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank * 7 + n)
    return torch.randn(n, generator=g, dtype=torch.float32).to(dtype)


def ordered_sum(xs: list[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """The kernels' reduction: fp32, ranks in order 0..world-1."""
    acc = xs[0].float()
    for x in xs[1:]:
        x = x.float()
        acc = acc + x if op == "sum" else torch.maximum(acc, x) if op == "max" else torch.minimum(acc, x)
    return acc


def assert_within_ulp(out: torch.Tensor, ref32: torch.Tensor, ulps: float = 1.0) -> None:
    """``out`` is ``ref32`` (fp32) rounded to out's dtype: within ``ulps`` units of its last place, relatively."""
    tol = ulps * ULP[out.dtype] * ref32.abs() + torch.finfo(out.dtype).tiny
    err = (out.float() - ref32).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {out.numel()} elements off by more than {ulps} ulp; first at "
                           f"{int(bad.nonzero()[0])}: {out.flatten()[bad.flatten()][0].item()} vs "
                           f"{ref32.flatten()[bad.flatten()][0].item()}")  # fmt: skip


# ------------------------------------------------------------------ process groups


def _entry(rank: int, world: int, port: int, backend: str, fn, args, outdir: str) -> None:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # reported to the test, which names the rank
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        dist.destroy_process_group()
    finally:
        Path(outdir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_group(fn, world: int, *args, backend: str = "gloo", timeout: float = 120.0, spawn: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` processes of one process group; return each rank's result.

    gloo groups fork (CPU only: a spawned child re-imports torch, seconds each) unless ``spawn``; NCCL
    groups, and gloo groups whose ranks use CUDA, spawn (CUDA cannot be used in a forked child), so ``fn``
    must be importable (a module-level function here). A rank that raises fails the test with its
    traceback; a group still running after ``timeout`` seconds (a hang) is killed and fails it too.
    """
    import torch.multiprocessing as mp

    method = "spawn" if backend == "nccl" or spawn else "fork"
    with tempfile.TemporaryDirectory(prefix="fly-comm-test-") as outdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), backend, fn, args, outdir), nprocs=world,
                                 join=False, start_method=method)  # fmt: skip
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"process group of {world} ranks still running after {timeout} s (a hang)")
        results = []
        for rank in range(world):
            status, value = pickle.loads(Path(outdir, f"rank{rank}.pkl").read_bytes())
            if status != "ok":
                raise AssertionError(f"rank {rank} failed: {value}")
            results.append(value)
        return results


# ------------------------------------------------------------------ simulation


class SimGroup:
    """``world`` ranks' shared buffers as CPU tensors of this process, for the interpreter.

    ``call`` runs one all-reduce: each stage of the kernel for every rank, ranks in order, then the next
    stage (a spin inside one launch could never see a flag a later launch sets). ``stage`` runs one stage
    of one rank, for tests that interleave ranks differently.
    """

    def __init__(self, world: int, max_size: int = 1 << 16, programs: int = 2, block: int = 64,
                 spin_limit: int = 4):  # fmt: skip
        self.world, self.programs, self.block, self.spin_limit = world, programs, block, spin_limit
        self.layout = BufferLayout.for_max_size(max_size)
        self.buffers = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8) for _ in range(world)]
        self.ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        self.states = [torch.zeros(STATE_LEN, dtype=torch.int64) for _ in range(world)]

    def stage(self, rank, algorithm, stages, x, out, op="sum"):
        from fly_comm._kernels.allreduce import launch_one_shot, launch_two_shot

        kw = dict(programs=self.programs, block=self.block, half_bytes=self.layout.half_bytes, op=op,
                  stages=stages, spin_limit=self.spin_limit)  # fmt: skip
        if algorithm == "one_shot":
            launch_one_shot(x, out, self.ptrs, self.states[rank], rank, self.world, **kw)
        else:
            launch_two_shot(x, out, self.ptrs, self.states[rank], rank, self.world,
                            two_shot_slice(x.numel(), self.world), **kw)  # fmt: skip

    def call(self, xs, algorithm, op="sum", outs=None):
        outs = outs if outs is not None else [torch.full_like(x, float("nan")) for x in xs]
        for bit in (1, 2) if algorithm == "one_shot" else (1, 2, 4):
            for r in range(self.world):
                self.stage(r, algorithm, bit, xs[r], outs[r], op)
        return outs

    def epochs(self, rank) -> list[int]:
        return self.states[rank][: self.programs].tolist()

    def timeouts(self, rank) -> int:
        return int(self.states[rank][TIMEOUT_SLOT])

    def staged(self, rank, epoch, n, dtype) -> torch.Tensor:
        """The first ``n`` elements of rank ``rank``'s data half for call ``epoch``."""
        off = self.layout.half_offset(epoch)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.buffers[rank][off : off + nbytes].view(dtype)

    def flag(self, rank, program, src) -> int:
        off = self.layout.flag_offset(program, src)
        return int(self.buffers[rank][off : off + 8].view(torch.int64))



class StreamGroup:
    """``world`` ranks on one GPU: each rank's shared buffer a device allocation of this process and each
    rank's launches on a stream of its own, so the ranks' kernels run at once and synchronise through the
    flags as they do across GPUs (system-scope release / acquire, L2 reads of peer data), with no peer
    mapping. ``programs * world`` must fit the GPU at once (a program waits for its peers' program of the
    same number); ``spin_limit`` turns a wait that would hang (kernels not running at once, as under
    compute-sanitizer) into a counted timeout."""

    def __init__(self, world: int, max_size: int = 8 << 20, programs: int = 16, spin_limit: int = 1 << 22):
        self.world, self.programs, self.spin_limit = world, programs, spin_limit
        self.layout = BufferLayout.for_max_size(max_size)
        self.buffers = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device="cuda") for _ in range(world)]
        self.ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device="cuda")
        self.states = [torch.zeros(STATE_LEN, dtype=torch.int64, device="cuda") for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]

    def launch(self, rank, algorithm, x, out, op="sum"):
        """Rank ``rank``'s whole call (every stage, one kernel) on the current stream, with the parameters
        :class:`~fly_comm.CustomAllReduce` launches with."""
        from fly_comm._kernels.allreduce import launch_one_shot, launch_two_shot
        from fly_comm.allreduce import NUM_WARPS

        block = (16 // x.element_size()) * 32 * NUM_WARPS
        kw = dict(programs=self.programs, block=block, half_bytes=self.layout.half_bytes, op=op,
                  spin_limit=self.spin_limit, num_warps=NUM_WARPS)  # fmt: skip
        if algorithm == "one_shot":
            launch_one_shot(x, out, self.ptrs, self.states[rank], rank, self.world, **kw)
        else:
            launch_two_shot(x, out, self.ptrs, self.states[rank], rank, self.world,
                            two_shot_slice(x.numel(), self.world), **kw)  # fmt: skip

    def call(self, xs, algorithm, op="sum", outs=None, late=None, late_cycles=100_000_000):
        """One all-reduce: every rank's kernel on its stream, forked from and joined back into the current
        stream (so it also captures into a CUDA graph). ``late``: a rank whose stream first sleeps
        ``late_cycles`` GPU clock cycles."""
        outs = outs if outs is not None else [torch.full_like(x, float("nan")) for x in xs]
        here = torch.cuda.current_stream()
        for r, s in enumerate(self.streams):
            s.wait_stream(here)
            with torch.cuda.stream(s):
                if r == late:
                    torch.cuda._sleep(late_cycles)
                self.launch(r, algorithm, xs[r], outs[r], op)
        for s in self.streams:
            here.wait_stream(s)
        return outs

    def timeouts(self) -> list[int]:
        return [int(s[TIMEOUT_SLOT]) for s in self.states]
