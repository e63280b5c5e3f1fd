"""The varlen offsets' checks made once per offsets tensor (fly_attention._seqlens): a second call with the same
tensors reads nothing back from the device; an in-place write, other lengths or another tensor are checked
again; bad values are refused by name."""

from __future__ import annotations

import pytest
import torch

from fly_attention import _seqlens
from flydsl.errors import ArgumentError


@pytest.fixture
def host_reads(monkeypatch):
    """Counts the device-to-host reads the check makes (its one ``tolist``)."""
    count = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: count.append(1) or real(self))
    _seqlens.clear()
    return count


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


def test_checked_once_per_tensor_pair(host_reads):
    cu_q, cu_k = _cu(0, 3, 10), _cu(0, 5, 12)
    assert _seqlens.offsets_span(cu_q, cu_k, 10, 12, 7, 7) == (0, 10, 0, 12)
    assert _seqlens.offsets_span(cu_q, cu_k, 10, 12, 7, 7) == (0, 10, 0, 12)
    assert len(host_reads) == 1


@pytest.mark.parametrize("change", ["in_place_q", "in_place_k", "other_k", "totals", "maxima"])
def test_checked_again_when_anything_it_read_changes(host_reads, change):
    cu_q, cu_k = _cu(0, 3, 10), _cu(0, 5, 12)
    _seqlens.offsets_span(cu_q, cu_k, 10, 12, 7, 7)
    args = [cu_q, cu_k, 10, 12, 7, 7]
    if change == "in_place_q":
        cu_q[1] = 4
    elif change == "in_place_k":
        cu_k[1] = 6
    elif change == "other_k":
        args[1] = _cu(0, 5, 12)
    elif change == "totals":
        args[2] = 11
    else:
        args[4] = 8
    _seqlens.offsets_span(*args)
    assert len(host_reads) == 2


def test_a_bad_value_written_in_place_is_caught(host_reads):
    cu_q, cu_k = _cu(0, 3, 10), _cu(0, 5, 12)
    _seqlens.offsets_span(cu_q, cu_k, 10, 12, 7, 7)
    cu_q[1] = 11  # decreasing now
    with pytest.raises(ArgumentError, match="cu_seqlens_q: expected non-decreasing"):
        _seqlens.offsets_span(cu_q, cu_k, 10, 12, 7, 7)


@pytest.mark.parametrize("cu_q, cu_k, msg", [
    ((0, 5, 3), (0, 2, 4), "cu_seqlens_q: expected non-decreasing"),
    ((0, 3, 11), (0, 2, 4), "cu_seqlens_q: expected offsets within the 10"),
    ((0, 3, 10), (-1, 2, 4), "cu_seqlens_k: expected offsets within"),
    ((0, 2, 10), (0, 2, 4), "max_seqlen_q: a sequence of cu_seqlens_q has 8 tokens"),
])  # fmt: skip
def test_bad_values_are_named(host_reads, cu_q, cu_k, msg):
    with pytest.raises(ArgumentError, match=msg):
        _seqlens.offsets_span(_cu(*cu_q), _cu(*cu_k), 10, 12, 7, 7)


def test_entries_go_with_their_tensors(host_reads):
    import gc

    cu_q, cu_k = _cu(0, 3, 10), _cu(0, 5, 12)
    _seqlens.offsets_span(cu_q, cu_k, 10, 12, 7, 7)
    assert len(_seqlens._CHECKED) == 1
    del cu_q
    gc.collect()
    assert not _seqlens._CHECKED
