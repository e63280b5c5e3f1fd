"""choose_algorithm: the table of sizes x world sizes x reachability, the cutoffs' edges, bad arguments."""

from __future__ import annotations

import pytest

from fly_comm import DEFAULT_CUTOFFS, WORLD_SIZES, choose_algorithm, default_cutoffs
from flydsl.errors import ArgumentError

KiB, MiB = 1 << 10, 1 << 20


def _choose(nbytes, world, full_nvlink=True):
    one, two = default_cutoffs(world)
    return choose_algorithm(nbytes, world, full_nvlink=full_nvlink, one_shot_max=one, two_shot_max=two)


@pytest.mark.parametrize(
    "nbytes, world, expected",
    [
        (0, 2, "one_shot"),
        (2, 2, "one_shot"),
        (4 * KiB, 2, "one_shot"),
        (1 * MiB, 2, "one_shot"),
        (1 * MiB + 2, 2, "two_shot"),
        (8 * MiB, 2, "two_shot"),
        (8 * MiB + 2, 2, "nccl"),
        (64 * MiB, 2, "nccl"),
        (4 * KiB, 4, "one_shot"),
        (512 * KiB, 4, "one_shot"),
        (512 * KiB + 2, 4, "two_shot"),
        (4 * MiB, 4, "two_shot"),
        (16 * MiB, 4, "nccl"),
        (4 * KiB, 8, "one_shot"),
        (256 * KiB, 8, "one_shot"),
        (256 * KiB + 4, 8, "two_shot"),
        (8 * MiB, 8, "two_shot"),
        (8 * MiB + 4, 8, "nccl"),
    ],
)
def test_default_table(nbytes, world, expected):
    assert _choose(nbytes, world) == expected


@pytest.mark.parametrize("world", [1, 3, 5, 6, 7, 16])
def test_other_world_sizes_go_to_nccl(world):
    for nbytes in (0, 4 * KiB, 1 * MiB, 64 * MiB):
        assert choose_algorithm(nbytes, world, full_nvlink=True, one_shot_max=8 * MiB, two_shot_max=8 * MiB) == "nccl"
    assert default_cutoffs(world) == (0, 0)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_without_peer_access_everything_is_nccl(world):
    for nbytes in (0, 2, 4 * KiB, 1 * MiB, 8 * MiB):
        assert _choose(nbytes, world, full_nvlink=False) == "nccl"


def test_defaults_are_ordered_and_shrink_with_the_world():
    assert set(DEFAULT_CUTOFFS) == set(WORLD_SIZES)
    ones = [DEFAULT_CUTOFFS[w][0] for w in WORLD_SIZES]
    assert ones == sorted(ones, reverse=True), "one-shot reads world - 1 buffers: its window shrinks"
    for world, (one, two) in DEFAULT_CUTOFFS.items():
        assert 0 < one < two, world


def test_explicit_cutoffs():
    kw = dict(full_nvlink=True, one_shot_max=100, two_shot_max=1000)
    got = [choose_algorithm(n, 4, **kw) for n in (100, 101, 1000, 1001)]
    assert got == ["one_shot", "two_shot", "two_shot", "nccl"]
    # An empty two-shot window (one_shot_max >= two_shot_max) is allowed: one-shot, then NCCL.
    kw = dict(full_nvlink=True, one_shot_max=1000, two_shot_max=10)
    assert [choose_algorithm(n, 2, **kw) for n in (1000, 1001)] == ["one_shot", "nccl"]
    assert choose_algorithm(5, 2, full_nvlink=True, one_shot_max=0, two_shot_max=0) == "nccl"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(nbytes=-1), "nbytes"),
        (dict(nbytes=1.5), "nbytes"),
        (dict(world_size=0), "world_size"),
        (dict(world_size=True), "world_size"),
        (dict(one_shot_max=-2), "one_shot_max"),
        (dict(two_shot_max="8M"), "two_shot_max"),
        (dict(full_nvlink=1), "full_nvlink"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    args = dict(nbytes=16, world_size=2, full_nvlink=True, one_shot_max=1, two_shot_max=2)
    args.update(kwargs)
    with pytest.raises(ArgumentError, match=name):
        choose_algorithm(args.pop("nbytes"), args.pop("world_size"), **args)
