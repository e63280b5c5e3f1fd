"""The shared buffer's layout (flags, two data halves) and the two-shot slicing."""

from __future__ import annotations

import pytest

from fly_comm import BufferLayout, slice_range, two_shot_slice
from fly_comm.layout import (
    ALIGN,
    DATA_OFFSET,
    FLAG_BYTES,
    FLAGS_BYTES,
    MAX_PROGRAMS,
    MAX_WORLD,
    SLICE_ALIGN,
    STATE_LEN,
    TIMEOUT_SLOT,
    flag_value,
)  # fmt: skip
from flydsl.errors import ArgumentError


def test_layout_regions_do_not_overlap_and_are_aligned():
    lay = BufferLayout.for_max_size(8 << 20)
    assert FLAGS_BYTES == MAX_PROGRAMS * MAX_WORLD * FLAG_BYTES <= DATA_OFFSET
    assert lay.data_offset == DATA_OFFSET and DATA_OFFSET % ALIGN == 0
    assert lay.half_bytes >= lay.max_size and lay.half_bytes % ALIGN == 0
    assert lay.half_offset(2) == DATA_OFFSET and lay.half_offset(1) == DATA_OFFSET + lay.half_bytes
    assert lay.half_offset(3) == lay.half_offset(1) and lay.half_offset(4) == lay.half_offset(2)
    assert lay.total_bytes == DATA_OFFSET + 2 * lay.half_bytes
    # an odd max_size still gets whole aligned halves that hold it
    odd = BufferLayout.for_max_size(1000)
    assert odd.half_bytes == ALIGN and odd.total_bytes == DATA_OFFSET + 2 * ALIGN


def test_flag_offsets_are_distinct_and_inside_the_flags():
    lay = BufferLayout.for_max_size(4096)
    offsets = {lay.flag_offset(p, r) for p in range(MAX_PROGRAMS) for r in range(MAX_WORLD)}
    assert len(offsets) == MAX_PROGRAMS * MAX_WORLD
    assert min(offsets) == 0 and max(offsets) + FLAG_BYTES == FLAGS_BYTES
    assert all(o % FLAG_BYTES == 0 for o in offsets)
    with pytest.raises(ArgumentError, match="program"):
        lay.flag_offset(MAX_PROGRAMS, 0)
    with pytest.raises(ArgumentError, match="src_rank"):
        lay.flag_offset(0, MAX_WORLD)


def test_state_holds_one_epoch_a_program_and_the_timeouts():
    assert STATE_LEN == MAX_PROGRAMS + 1 and TIMEOUT_SLOT == MAX_PROGRAMS


def test_flag_values_grow_across_calls_and_phases():
    values = [flag_value(e, ph) for e in range(1, 6) for ph in (0, 1)]
    assert values == sorted(values) and len(set(values)) == len(values) and min(values) > 0  # flags start at 0
    with pytest.raises(ArgumentError):
        flag_value(0, 0)
    with pytest.raises(ArgumentError):
        flag_value(1, 2)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 7, 15, 16, 17, 100, 1000, 4099, 1 << 20, (1 << 20) + 3])
def test_two_shot_slices_cover_the_message_once(world, numel):
    s = two_shot_slice(numel, world)
    assert s % SLICE_ALIGN == 0 and s * world >= numel
    assert s - SLICE_ALIGN < -(-numel // world) or numel == 0  # no more padding than the alignment needs
    covered = []
    for r in range(world):
        start, stop = slice_range(numel, world, r)
        assert start % SLICE_ALIGN == 0 or start == numel
        covered.extend(range(start, stop))
    assert covered == list(range(numel))


def test_slicing_rejects_bad_arguments():
    with pytest.raises(ArgumentError, match="rank"):
        slice_range(10, 2, 2)
    with pytest.raises(ArgumentError):
        two_shot_slice(-1, 2)
    with pytest.raises(ArgumentError):
        two_shot_slice(10, 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8M", None])
def test_max_size_must_be_a_positive_int(bad):
    with pytest.raises(ArgumentError, match="max_size"):
        BufferLayout.for_max_size(bad)
