"""The all-reduce kernels on one GPU: every rank a stream of this process, its shared buffer a device
allocation (``StreamGroup``), all ranks' kernels running at once. What this runs that the CPU simulation
cannot: real concurrency between the ranks' programs, the system-scope release / acquire flags and the
L2 reads of peer data on the hardware, the vector widths of every dtype, a rank whose kernel starts late, a
rank one call ahead reusing its data half, and CUDA graph capture of the ranks' launches; and, with each
rank a process on the same GPU, the CUDA IPC transport's handles and mappings. What it cannot: symmetric
memory, mappings between GPUs and NVLink, which need two GPUs (test_comm_gpu.py).

``overlap``: the ranks' kernels must run at once, which compute-sanitizer's serialized launches prevent."""

from __future__ import annotations

import comm_gpu_workers as w
import pytest
import torch
from comm_helpers import StreamGroup, inputs, ordered_sum, run_group

pytestmark = [pytest.mark.gpu, pytest.mark.overlap]


def _programs(world: int) -> int:
    """Programs a rank, all ranks' programs resident at once (one a streaming multiprocessor at most)."""
    return min(32, torch.cuda.get_device_properties(0).multi_processor_count // world)


def _inputs(world, n, dtype, seed):
    cpu = [inputs(r, n, dtype, seed=seed) for r in range(world)]
    return cpu, [x.cuda() for x in cpu]


def _check_call(group, cpu, outs, op="sum"):
    want = ordered_sum(cpu, op).to(outs[0].dtype)  # fp32 in rank order, rounded once: the kernels' bits
    for r, out in enumerate(outs):
        got = out.cpu()
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            bad = int((got != want).sum())
            raise AssertionError(f"rank {r}: {bad} of {got.numel()} elements differ from the ordered fp32 sum")
    assert group.timeouts() == [0] * group.world, "a wait gave up: the ranks' kernels did not run at once"


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_rank_gets_the_ordered_sum(world, algorithm, dtype):
    group = StreamGroup(world, programs=_programs(world))
    es = torch.empty((), dtype=dtype).element_size()
    for n in (1, 7, 16, 17, 1000, 4097, 65537, 1_000_003, (8 << 20) // es):
        cpu, xs = _inputs(world, n, dtype, seed=n % 89)
        outs = group.call(xs, algorithm)
        torch.cuda.synchronize()
        _check_call(group, cpu, outs)
        for r in range(world):
            assert torch.equal(xs[r].cpu(), cpu[r]), f"rank {r}: the input changed"


@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_and_in_place(op):
    world, n = 4, 30_001
    group = StreamGroup(world, programs=_programs(world))
    for algorithm in ("one_shot", "two_shot"):
        cpu, xs = _inputs(world, n, torch.float16, seed=11)
        group.call(xs, algorithm, op=op, outs=xs)  # out is the input
        torch.cuda.synchronize()
        _check_call(group, cpu, xs, op)


def test_many_calls_alternate_algorithms_sizes_and_halves():
    """Back-to-back calls with no host synchronisation between them: each rank's next call stages into the
    other data half while a slower peer may still read this one, and both algorithms share the epochs."""
    world = 4
    group = StreamGroup(world, programs=_programs(world))
    plan = [(3, "one_shot"), (4096, "two_shot"), (100_000, "one_shot"), (1 << 20, "two_shot"), (17, "two_shot")]
    data = {n: _inputs(world, n, torch.bfloat16, seed=n % 31) for n, _ in plan}
    results = []
    for i in range(200):
        n, algorithm = plan[i % len(plan)]
        results.append((n, group.call(data[n][1], algorithm)))
    torch.cuda.synchronize()
    for n, outs in results:
        _check_call(group, data[n][0], outs)
    assert [int(s[0]) for s in group.states] == [200] * world, "every program counts every call"


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_a_late_rank_is_waited_for(algorithm):
    world = 4
    group = StreamGroup(world, programs=_programs(world))
    for late in range(world):
        cpu, xs = _inputs(world, 50_000, torch.float32, seed=late)
        outs = group.call(xs, algorithm, late=late)  # ~50 ms of GPU sleep before that rank's kernel
        torch.cuda.synchronize()
        _check_call(group, cpu, outs)


def test_cuda_graph_capture_and_replay():
    """Every rank's launch captured in one graph (forked onto the ranks' streams and joined back), replayed
    with new inputs copied into the captured ones; eager calls between replays share the epoch counters."""
    world, n = 4, 300_001
    group = StreamGroup(world, programs=_programs(world))
    for algorithm in ("one_shot", "two_shot"):
        xs = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for _ in range(world)]
        outs = [torch.empty_like(x) for x in xs]
        group.call(xs, algorithm, outs=outs)  # compiles outside the capture
        torch.cuda.synchronize()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=stream):
            group.call(xs, algorithm, outs=outs)
        torch.cuda.current_stream().wait_stream(stream)
        for k in range(8):
            cpu = [inputs(r, n, torch.bfloat16, seed=300 + k) for r in range(world)]
            for x, c in zip(xs, cpu, strict=True):
                x.copy_(c)
            graph.replay()
            if k % 3 == 2:
                small_cpu, small = _inputs(world, 64, torch.bfloat16, seed=k)
                eager = group.call(small, "one_shot")
                torch.cuda.synchronize()
                _check_call(group, small_cpu, eager)
            torch.cuda.synchronize()
            _check_call(group, cpu, outs)
        del graph


@pytest.mark.parametrize("world", [2, 4])
def test_ipc_mappings_between_processes_on_one_gpu(world):
    """The CUDA IPC transport for real: each rank a process on GPU 0, its peers' buffers opened from their
    handles, both kernels reading through those mappings (comm_gpu_workers.ipc_on_one_gpu)."""
    failures = [f"rank {r}: {m}" for r, msgs in enumerate(run_group(w.ipc_on_one_gpu, world, spawn=True,
                                                                     timeout=300.0)) for m in msgs]  # fmt: skip
    assert not failures, "\n".join(failures)
