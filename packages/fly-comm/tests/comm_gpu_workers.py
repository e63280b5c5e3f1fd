"""What each rank of the GPU tests runs (spawned processes import this module, so it stays importable and
cheap). Each worker returns a list of failure messages (empty: passed), which the test asserts on, so a
failing rank reports what failed instead of dying in the middle of a collective and hanging its peers."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from comm_helpers import inputs, ordered_sum

from fly_comm import CustomAllReduce

_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}

# 1 element to 64 MiB: small and odd element counts (masked tails, slices shorter than a block, empty slices
# at 8 ranks), then powers of two and just past them in bytes.
ODD_ELEMENTS = [1, 2, 3, 7, 15, 16, 17, 127, 1000, 1023, 4097, 65537, 1_000_003]
BYTE_SIZES = [4 << 10, 64 << 10, 256 << 10, (256 << 10) + 16, 1 << 20, (1 << 20) + 2, 4 << 20, 8 << 20, 16 << 20,
              64 << 20]  # fmt: skip


def _same_on_every_rank(t: torch.Tensor) -> bool:
    """Whether every rank holds the same bits in ``t`` (a checksum of its raw bytes, gathered)."""
    raw = t.contiguous().view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, raw.numel() + 1, device=t.device, dtype=torch.int64) % 65521
    digest = torch.stack([raw.sum(), (raw * weights).sum()])
    every = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(every, digest)
    return all(torch.equal(d, every[0]) for d in every)


def _check(name, y, xs_cpu, nccl, scale, world, failures, exact_bits=True):
    """``y`` (this rank's result) against the kernels' contract and against NCCL's result."""
    dtype = y.dtype
    want = ordered_sum(xs_cpu).to(dtype)  # fp32 in rank order, rounded once to nearest even: the kernels' bits
    if exact_bits and not torch.equal(y.cpu().view(torch.uint8), want.view(torch.uint8)):
        bad = int((y.cpu() != want).sum())
        failures.append(f"{name}: {bad} of {y.numel()} elements differ from the ordered fp32 sum rounded once")
    # NCCL adds in the dtype in its own order: both within a few roundings of the exact sum (relative to sum |x|)
    err = ((y.float() - nccl.float()).abs() / scale).max().item() if y.numel() else 0.0
    tol = 2 * world * _UNIT[dtype]
    if not err <= tol:
        failures.append(f"{name}: differs from NCCL by {err:.3g} of sum |x| (tolerance {tol:.3g})")
    if not _same_on_every_rank(y):
        failures.append(f"{name}: the ranks' results differ")


def sizes_against_nccl(rank: int, world: int, dtypes: list, transport: str = "auto") -> list[str]:
    failures: list[str] = []
    device = torch.device("cuda", rank)
    with CustomAllReduce(max_size=64 << 20, transport=transport) as ar:
        if not ar.kernels_enabled:
            return [f"rank {rank}: no kernels ({ar!r}); the GPUs are not all peer-to-peer reachable"]
        for dtype in dtypes:
            es = torch.empty((), dtype=dtype).element_size()
            counts = ODD_ELEMENTS + [b // es for b in BYTE_SIZES]
            for n in counts:
                if n * es > (8 << 20) and dtype != dtypes[0]:
                    continue  # the largest sizes in the first dtype only: each rank builds every rank's input
                xs_cpu = [inputs(r, n, dtype, seed=n % 97) for r in range(world)]
                x = xs_cpu[rank].to(device)
                nccl = x.clone()
                dist.all_reduce(nccl)
                scale = x.float().abs()
                dist.all_reduce(scale)
                scale.clamp_min_(torch.finfo(torch.float32).tiny)
                for algorithm in (None, "one_shot", "two_shot"):
                    y = ar.all_reduce(x, algorithm=algorithm)
                    took = algorithm or ar.algorithm(n * es)
                    _check(f"{dtype} n={n} {took}", y, xs_cpu, nccl, scale, world, failures, exact_bits=took != "nccl")
                if not torch.equal(x.cpu(), xs_cpu[rank]):
                    failures.append(f"{dtype} n={n}: the input changed")
        # in place, both kernels
        for algorithm in ("one_shot", "two_shot"):
            xs_cpu = [inputs(r, 4099, torch.bfloat16, seed=1) for r in range(world)]
            x = xs_cpu[rank].to(device)
            if ar.all_reduce(x, out=x, algorithm=algorithm) is not x or not torch.equal(
                    x.cpu(), ordered_sum(xs_cpu).to(torch.bfloat16)):
                failures.append(f"in place {algorithm}: wrong result")
    torch.cuda.synchronize()
    return failures


def graph_capture_and_replay(rank: int, world: int) -> list[str]:
    """Capture one call of each kernel in a CUDA graph after an eager warm-up, then replay it with new inputs
    copied into the captured input: the epoch on the device orders the replays."""
    failures: list[str] = []
    device = torch.device("cuda", rank)
    with CustomAllReduce(max_size=4 << 20) as ar:
        for algorithm, n in (("one_shot", 1000), ("two_shot", 300_001), (None, 2048)):
            x = torch.empty(n, dtype=torch.bfloat16, device=device)
            y = torch.empty_like(x)
            x.copy_(inputs(rank, n, torch.bfloat16, seed=100))
            ar.all_reduce(x, out=y, algorithm=algorithm)  # compiles outside the capture
            torch.cuda.synchronize()
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=stream):
                ar.all_reduce(x, out=y, algorithm=algorithm)
            torch.cuda.current_stream().wait_stream(stream)
            for k in range(12):
                xs_cpu = [inputs(r, n, torch.bfloat16, seed=200 + k) for r in range(world)]
                x.copy_(xs_cpu[rank])
                graph.replay()
                if k % 4 == 3:  # an eager call between replays shares the epoch counter
                    ar.all_reduce(torch.ones(64, dtype=torch.bfloat16, device=device))
                if not torch.equal(y.cpu(), ordered_sum(xs_cpu).to(torch.bfloat16)):
                    failures.append(f"graph {algorithm} n={n} replay {k}: wrong result")
            del graph
    torch.cuda.synchronize()
    return failures


def many_calls(rank: int, world: int, calls: int) -> list[str]:
    """``calls`` calls back to back, cycling sizes and algorithms (NCCL among them), checked every 97th."""
    failures: list[str] = []
    device = torch.device("cuda", rank)
    plan = [(3, "one_shot"), (4096, "two_shot"), (100_000, None), (17, None), (1 << 20, "two_shot"), (511, "nccl")]
    with CustomAllReduce(max_size=4 << 20) as ar:
        xs = {n: [inputs(r, n, torch.float16, seed=3) for r in range(world)] for n, _ in plan}
        want = {n: ordered_sum(v).to(torch.float16) for n, v in xs.items()}
        local = {n: v[rank].to(device) for n, v in xs.items()}
        out = {n: torch.empty_like(t) for n, t in local.items()}
        for i in range(calls):
            n, algorithm = plan[i % len(plan)]
            ar.all_reduce(local[n], out=out[n], algorithm=algorithm)
            if i % 97 == 0 and algorithm != "nccl" and not torch.equal(out[n].cpu(), want[n]):
                failures.append(f"call {i} n={n} {algorithm}: wrong result")
    torch.cuda.synchronize()
    return failures


def late_rank(rank: int, world: int) -> list[str]:
    """The last rank arrives late (a GPU sleep before its call, or a host sleep): the others wait for it, no
    deadlock, right results."""
    failures: list[str] = []
    device = torch.device("cuda", rank)
    with CustomAllReduce(max_size=1 << 20) as ar:
        for k, algorithm in enumerate(("one_shot", "two_shot") * 3):
            xs_cpu = [inputs(r, 10_000, torch.float32, seed=k) for r in range(world)]
            x = xs_cpu[rank].to(device)
            if rank == world - 1:
                if k % 2:
                    time.sleep(0.2)
                else:
                    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles queued before the call
            y = ar.all_reduce(x, algorithm=algorithm)
            if not torch.equal(y.cpu(), ordered_sum(xs_cpu)):
                failures.append(f"late rank, call {k} {algorithm}: wrong result")
    torch.cuda.synchronize()
    return failures


def wrong_device(rank: int, world: int) -> list[str]:
    from flydsl.errors import DeviceError

    with CustomAllReduce() as ar:
        try:
            ar.all_reduce(torch.zeros(4))
        except DeviceError as e:
            return [] if "cuda" in str(e) else [f"unexpected message: {e}"]
    return ["a CPU tensor was accepted by a CUDA CustomAllReduce"]


def ipc_on_one_gpu(rank: int, world: int) -> list[str]:
    """Every rank a process on GPU 0 of a gloo group: the buffers registered through CUDA IPC (the handles
    exchanged, each peer's allocation opened in this process), then calls of both kernels through those
    mappings. The ranks' kernels share the GPU by time slices, so the waits are bounded (``spin_limit``)
    and a wait that gave up is reported instead of hanging. (CustomAllReduce itself refuses two ranks on
    one GPU; this drives its transport and kernels directly.)"""
    from fly_comm import _transport
    from fly_comm._kernels.allreduce import launch_one_shot, launch_two_shot
    from fly_comm.allreduce import NUM_WARPS
    from fly_comm.layout import STATE_LEN, TIMEOUT_SLOT, BufferLayout, two_shot_slice

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    layout = BufferLayout.for_max_size(1 << 20)
    reg = _transport.register(layout.total_bytes, dist.group.WORLD, device, rank, world, "ipc")
    failures: list[str] = []
    if reg.kind != "ipc" or len(reg.addresses) != world:
        return [f"registration: kind {reg.kind}, {len(reg.addresses)} addresses"]
    reg.local.zero_()
    torch.cuda.synchronize()
    dist.barrier()  # no rank signals into a buffer before its owner has zeroed it
    ptrs = torch.tensor(reg.addresses, dtype=torch.int64, device=device)
    state = torch.zeros(STATE_LEN, dtype=torch.int64, device=device)
    for k, (algorithm, n) in enumerate([("one_shot", 1000), ("two_shot", 100_003), ("one_shot", 17),
                                        ("two_shot", 4096), ("one_shot", 65_536)]):  # fmt: skip
        xs = [inputs(r, n, torch.bfloat16, seed=k) for r in range(world)]
        x = xs[rank].to(device)
        out = torch.full_like(x, float("nan"))
        kw = dict(programs=8, block=8 * 32 * NUM_WARPS, half_bytes=layout.half_bytes, spin_limit=1 << 24,
                  num_warps=NUM_WARPS)  # fmt: skip
        if algorithm == "one_shot":
            launch_one_shot(x, out, ptrs, state, rank, world, **kw)
        else:
            launch_two_shot(x, out, ptrs, state, rank, world, two_shot_slice(n, world), **kw)
        torch.cuda.synchronize()
        want = ordered_sum(xs).to(torch.bfloat16)
        if not torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)):
            failures.append(f"call {k} {algorithm} n={n}: {int((out.cpu() != want).sum())} elements wrong")
    if int(state[TIMEOUT_SLOT]):
        failures.append(f"{int(state[TIMEOUT_SLOT])} waits gave up")
    dist.barrier()  # no peer still reads this rank's buffer when the mappings go
    reg.release()
    return failures
