"""The one-shot and two-shot kernels in a single process: each simulated rank's shared buffer is a CPU tensor,
the kernels run through Triton's interpreter with every rank's address in ``ptrs``, and the stages of a call
run rank by rank (``SimGroup``). What this checks: the reduction math (fp32, rank order, one rounding), the
two-shot slice assignment, the grid-stride coverage of odd sizes, the epochs, the data halves, and the flag
protocol (a wait passes on a newer value, gives up on a stale one). What it cannot: real concurrency, the
memory ordering on a GPU, peer mappings (see the GPU tests)."""

from __future__ import annotations

import pytest
import torch
from comm_helpers import SimGroup, assert_within_ulp, inputs, ordered_sum

import flydsl.compiler as flyc

pytestmark = pytest.mark.skipif(not flyc.interpreting(), reason="the simulation runs the kernels on CPU buffers")


@pytest.mark.parametrize(
    "algorithm, world, dtype, n",
    [
        ("one_shot", 2, torch.bfloat16, 1),
        ("one_shot", 4, torch.float16, 333),
        ("one_shot", 8, torch.float32, 100),
        ("two_shot", 2, torch.float32, 37),
        ("two_shot", 4, torch.bfloat16, 300),
        ("two_shot", 8, torch.float16, 129),
    ],
)
def test_reduction_matches_the_fp32_sum_on_every_rank(algorithm, world, dtype, n):
    sim = SimGroup(world)
    xs = [inputs(r, n, dtype) for r in range(world)]
    keep = [x.clone() for x in xs]
    outs = sim.call(xs, algorithm)
    ref = ordered_sum(xs)
    for r in range(world):
        assert_within_ulp(outs[r], ref)
        assert torch.equal(outs[r].view(torch.uint8), outs[0].view(torch.uint8)), f"rank {r} differs from rank 0"
        assert torch.equal(xs[r], keep[r]), "the input must not change"
        assert sim.timeouts(r) == 0
    if dtype == torch.float32:  # the kernel's arithmetic is exactly the ordered fp32 sum
        assert torch.equal(outs[0], ref)


def test_one_shot_and_two_shot_give_the_same_bits():
    world, n = 4, 203
    xs = [inputs(r, n, torch.bfloat16, seed=3) for r in range(world)]
    a = SimGroup(world).call(xs, "one_shot")
    b = SimGroup(world).call(xs, "two_shot")
    for r in range(world):
        assert torch.equal(a[r].view(torch.int16), b[r].view(torch.int16))


@pytest.mark.parametrize("algorithm, op", [("one_shot", "min"), ("two_shot", "max")])
def test_max_and_min(algorithm, op):
    world, n = 4, 90
    xs = [inputs(r, n, torch.float16, seed=5) for r in range(world)]
    outs = SimGroup(world).call(xs, algorithm, op=op)
    ref = ordered_sum(xs, op)
    for o in outs:
        assert torch.equal(o.float(), ref)  # max / min pick an input: exact


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_in_place(algorithm):
    world, n = 2, 200
    xs = [inputs(r, n, torch.float32, seed=7) for r in range(world)]
    ref = ordered_sum(xs)
    SimGroup(world).call(xs, algorithm, outs=xs)
    for x in xs:
        assert torch.equal(x, ref)


def test_epochs_halves_and_flags_across_calls():
    """Every program counts every call; call e stages in half e % 2; flags hold 2e (and 2e + 1 for two-shot)."""
    world, n = 2, 300
    sim = SimGroup(world, programs=3, block=32)
    for epoch, algorithm in enumerate(["one_shot", "two_shot", "one_shot", "two_shot"], start=1):
        xs = [inputs(r, n, torch.float32, seed=epoch) for r in range(world)]
        outs = sim.call(xs, algorithm)
        ref = ordered_sum(xs)
        for r in range(world):
            assert torch.equal(outs[r], ref)
            assert sim.epochs(r) == [epoch] * 3
            want = 2 * epoch + (algorithm == "two_shot")
            assert [sim.flag(r, p, s) for p in range(3) for s in range(world)] == [want] * (3 * world)
            staged = sim.staged(r, epoch, n, torch.float32)
            if algorithm == "one_shot":
                assert torch.equal(staged, xs[r])  # the rank's input, in this call's half
        # the other half still holds the previous call's data: nothing overwrote it
        if epoch > 1:
            assert not torch.equal(sim.staged(0, epoch - 1, n, torch.float32), sim.staged(0, epoch, n, torch.float32))


def test_two_shot_reduces_each_rank_slice_in_place():
    """After stage 2, rank r's staged half holds the reduced values on its own slice and its input elsewhere."""
    from fly_comm import slice_range

    world, n = 4, 70  # slices of 32 elements: [0, 32), [32, 64), [64, 70), [70, 70)
    sim = SimGroup(world, programs=2, block=16)
    xs = [inputs(r, n, torch.float32, seed=11) for r in range(world)]
    outs = [torch.empty_like(x) for x in xs]
    for bit in (1, 2):
        for r in range(world):
            sim.stage(r, "two_shot", bit, xs[r], outs[r])
    ref = ordered_sum(xs)
    for r in range(world):
        start, stop = slice_range(n, world, r)
        staged = sim.staged(r, 1, n, torch.float32)
        assert torch.equal(staged[start:stop], ref[start:stop])
        mask = torch.ones(n, dtype=torch.bool)
        mask[start:stop] = False
        assert torch.equal(staged[mask], xs[r][mask])
    for r in range(world):
        sim.stage(r, "two_shot", 4, xs[r], outs[r])
        assert torch.equal(outs[r], ref)


def test_a_rank_one_call_ahead_does_not_block_a_late_one():
    """Rank 1 finishes call 1 and stages call 2 (overwriting its flag 2 -> 4 in rank 0's buffer) before rank 0
    waits in call 1: rank 0's wait for >= 2 passes on 4, and both calls are right (the halves keep them apart)."""
    world, n = 2, 100
    sim = SimGroup(world, programs=2, block=32, spin_limit=2)
    x1 = [inputs(r, n, torch.float32, seed=21) for r in range(world)]
    x2 = [inputs(r, n, torch.float32, seed=22) for r in range(world)]
    o1 = [torch.empty(n) for _ in range(world)]
    o2 = [torch.empty(n) for _ in range(world)]
    sim.stage(0, "one_shot", 1, x1[0], o1[0])
    sim.stage(1, "one_shot", 1, x1[1], o1[1])
    sim.stage(1, "one_shot", 2, x1[1], o1[1])  # rank 1 done with call 1
    sim.stage(1, "one_shot", 1, x2[1], o2[1])  # and staged call 2
    assert sim.flag(0, 0, 1) == 4
    sim.stage(0, "one_shot", 2, x1[0], o1[0])  # the late rank finishes call 1
    sim.stage(0, "one_shot", 1, x2[0], o2[0])
    for r in range(world):
        sim.stage(r, "one_shot", 2, x2[r], o2[r])
    for r in range(world):
        assert torch.equal(o1[r], ordered_sum(x1)) and torch.equal(o2[r], ordered_sum(x2))
        assert sim.timeouts(r) == 0


def test_a_wait_gives_up_only_under_a_spin_limit_and_says_so():
    """A peer that never staged (or whose flag is a previous call's) keeps the wait spinning: with a spin limit
    it gives up and counts one timeout a program and peer, instead of passing silently."""
    world, n, programs = 2, 64, 2
    sim = SimGroup(world, programs=programs, block=32, spin_limit=3)
    xs = [inputs(r, n, torch.float32) for r in range(world)]
    out = torch.empty(n)
    sim.stage(0, "one_shot", 1, xs[0], out)
    sim.stage(0, "one_shot", 2, xs[0], out)  # rank 1 never staged call 1
    assert sim.timeouts(0) == programs
    sim.stage(1, "one_shot", 1, xs[1], out)  # let rank 1 catch up with call 1: no wait of it times out
    sim.stage(1, "one_shot", 2, xs[1], out)
    assert sim.timeouts(1) == 0
    # call 2: rank 0 waits before rank 1 staged; rank 1's flag in rank 0's buffer is still call 1's (2 < 4)
    sim.stage(0, "one_shot", 1, xs[0], out)
    sim.stage(0, "one_shot", 2, xs[0], out)
    assert sim.timeouts(0) == 2 * programs
