"""MoE routing on the CPU interpreter against the plain torch references: the softmax top-k and DeepSeek-V3's
grouped top-k (ties to the lower id, k = 1 and k = E, renormalized or not, strided and 16-bit logits, zero
tokens), the alignment by expert (exact against the reference for int32 and int64 ids, experts with no
rows, every row to one expert, -1 slots left out, empty input, the padded worst case; every element of
poisoned buffers written, the padding included), and bad input named by argument."""

from __future__ import annotations

import pytest
import torch

from fly_gemm._kernels.moe_routing import align_scratch_size, launch_align
from fly_gemm.moe_reference import grouped_topk_ref, moe_align_ref, topk_softmax_ref
from fly_gemm.moe_routing import grouped_topk, moe_align, moe_align_capacity, topk_softmax
from flydsl.errors import ArgumentError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, default_device, empty_poisoned

DEV = default_device()


def _logits(t, e, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=g).to(dtype).to(DEV)


def _check_routing(got, ref):
    (w, ids), (w_ref, ids_ref) = got, ref
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ids_ref), f"ids differ:\n{ids.cpu()}\n{ids_ref}"
    assert_rel_close(w.cpu(), w_ref, tol=1e-5, name="weights")


# (T, E, k): one token; k = 1; k = E (every expert); odd T and E (padding rows and columns); 256 experts
TOPK_CASES = [(1, 8, 2), (37, 8, 1), (5, 8, 8), (19, 7, 3), (33, 60, 4), (3, 256, 8)]


@pytest.mark.parametrize("t,e,k", TOPK_CASES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_reference(t, e, k, renormalize):
    x = _logits(t, e, t * 1000 + e)
    _check_routing(topk_softmax(x, k, renormalize), topk_softmax_ref(x.cpu(), k, renormalize))


def test_topk_softmax_ties_go_to_the_lower_id():
    x = torch.zeros(4, 8, device=DEV)
    x[1, [2, 5, 6]] = 1.0  # three-way tie for the top
    x[2, [7, 0]] = 3.0
    x[3] = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0, 0.0, 1.0, 1.0])
    w, ids = topk_softmax(x, 3, renormalize=False)
    assert ids.cpu().tolist() == [[0, 1, 2], [2, 5, 6], [0, 7, 1], [1, 2, 4]]
    _check_routing((w, ids), topk_softmax_ref(x.cpu(), 3, False))


def test_topk_softmax_16bit_and_strided_logits():
    x = _logits(40, 24, 3, torch.bfloat16)
    wide = torch.empty(40, 48, dtype=torch.bfloat16, device=DEV)
    wide[:, ::2] = x
    strided = wide[:, ::2]  # column stride 2
    _check_routing(topk_softmax(strided, 4), topk_softmax_ref(x.cpu(), 4))
    xt = _logits(24, 40, 4, torch.float16).t()  # row stride 1
    _check_routing(topk_softmax(xt, 2), topk_softmax_ref(xt.cpu(), 2))


def test_topk_softmax_no_tokens():
    w, ids = topk_softmax(torch.empty(0, 8, device=DEV), 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)


# (T, E, groups, topk_group, k): DeepSeek-V3's 256 / 8 / 4 / 8 at few tokens; groups of one expert;
# every group kept; k = every expert of the kept groups; odd T
GROUPED_CASES = [(3, 256, 8, 4, 8), (9, 16, 16, 3, 2), (13, 16, 4, 4, 16), (21, 24, 6, 2, 8), (1, 64, 8, 2, 1)]


@pytest.mark.parametrize("t,e,groups,topk_group,k", GROUPED_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_topk_matches_reference(t, e, groups, topk_group, k, bias):
    x = _logits(t, e, t + e + k)
    b = (torch.randn(e, generator=torch.Generator().manual_seed(e)) * 0.2).to(DEV) if bias else None
    got = grouped_topk(x, k, groups, topk_group, correction_bias=b, routed_scaling_factor=2.5)
    ref = grouped_topk_ref(x.cpu(), k, groups, topk_group, correction_bias=None if b is None else b.cpu(),
                           routed_scaling_factor=2.5)  # fmt: skip
    _check_routing(got, ref)


@pytest.mark.parametrize("scoring,renormalize", [("softmax", False), ("sigmoid", False), ("softmax", True)])
def test_grouped_topk_scoring_and_renormalize(scoring, renormalize):
    x = _logits(11, 32, 5, torch.bfloat16)
    got = grouped_topk(x, 6, 4, 2, scoring=scoring, renormalize=renormalize)
    _check_routing(got, grouped_topk_ref(x.cpu(), 6, 4, 2, scoring=scoring, renormalize=renormalize))


def test_grouped_topk_ties_go_to_the_lower_group_and_id():
    x = torch.zeros(2, 16, device=DEV)  # 4 groups of 4; every score equal in row 0
    x[1, [9, 10, 13, 14]] = 2.0  # groups 2 and 3 tie at the top, experts tie inside them
    got = grouped_topk(x, 3, 4, 2, correction_bias=torch.zeros(16, device=DEV))
    assert got[1].cpu().tolist() == [[0, 1, 2], [9, 10, 13]]
    _check_routing(got, grouped_topk_ref(x.cpu(), 3, 4, 2, correction_bias=torch.zeros(16)))


# (T, k, E, block_m, id dtype, routing): random; every row to one expert; most experts empty; -1 slots;
# a single row; block_m of 1 and larger than the rows
ALIGN_CASES = [
    (50, 4, 8, 16, torch.int32, "random"),
    (33, 2, 8, 16, torch.int64, "one"),
    (7, 1, 64, 16, torch.int32, "random"),
    (29, 3, 5, 4, torch.int64, "minus"),
    (1, 1, 4, 16, torch.int32, "random"),
    (20, 2, 6, 1, torch.int32, "random"),
    (9, 2, 3, 128, torch.int64, "random"),
]


@pytest.mark.parametrize("t,k,e,block_m,dtype,routing", ALIGN_CASES)
def test_moe_align_matches_reference(t, k, e, block_m, dtype, routing):
    g = torch.Generator().manual_seed(t * k + e)
    ids = torch.randint(0, e, (t, k), generator=g)
    if routing == "one":
        ids.fill_(e - 1)
    elif routing == "minus":
        ids[torch.rand(t, k, generator=g) < 0.3] = -1
    ids = ids.to(dtype).to(DEV)
    got = moe_align(ids, e, block_m)
    ref = moe_align_ref(ids, e, block_m)
    assert got.sorted_ids.shape[0] == moe_align_capacity(t * k, e, block_m)
    for name, a, b in zip(("sorted_ids", "expert_ids", "num_padded"), got, ref, strict=True):
        assert a.dtype == torch.int32, name
        assert torch.equal(a.cpu(), b), f"{name}:\n{a.cpu()}\n{b}"


def test_moe_align_large_chunked():
    # enough rows for several chunks of the counting kernels: ranks carried across chunks
    ids = torch.randint(0, 16, (700, 2), generator=torch.Generator().manual_seed(1)).to(torch.int32).to(DEV)
    got = moe_align(ids, 16, 32)
    for a, b in zip(got, moe_align_ref(ids, 16, 32), strict=True):
        assert torch.equal(a.cpu(), b)


def test_moe_align_strided_ids():
    base = torch.randint(0, 6, (12, 6), generator=torch.Generator().manual_seed(2)).to(DEV)
    ids = base[:, ::2]  # non-contiguous int64
    got = moe_align(ids, 6, 8)
    for a, b in zip(got, moe_align_ref(ids.contiguous(), 6, 8), strict=True):
        assert torch.equal(a.cpu(), b)


def test_moe_align_empty():
    got = moe_align(torch.empty(0, 2, dtype=torch.int32, device=DEV), 8, 16)
    assert got.sorted_ids.numel() == 0 and got.expert_ids.numel() == 0
    assert got.num_padded.cpu().tolist() == [0]


# (T, k, E, block_m): one chunk; many chunks, each filling its share of the padding; every row on one expert
@pytest.mark.parametrize("t,k,e,block_m", [(3, 2, 8, 16), (700, 2, 16, 32), (300, 4, 4, 64)])
def test_launch_align_writes_every_element(t, k, e, block_m):
    """The kernels fill sorted_ids' padding themselves (no host-side fill to redo in a replay or a graph):
    poisoned buffers, every element against the reference."""
    g = torch.Generator().manual_seed(t + e)
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32)
    if e == 4:
        ids.fill_(2)
    ids = ids.to(DEV)
    ref = moe_align_ref(ids, e, block_m)
    size = moe_align_capacity(t * k, e, block_m)
    got = (empty_poisoned(size, dtype=torch.int32, device=DEV), empty_poisoned(size // block_m, dtype=torch.int32,
           device=DEV), empty_poisoned(1, dtype=torch.int32, device=DEV))  # fmt: skip
    scratch = empty_poisoned(align_scratch_size(t * k, e), dtype=torch.int32, device=DEV)
    launch_align(ids, e, block_m, *got, scratch)
    for name, a, b in zip(("sorted_ids", "expert_ids", "num_padded"), got, ref, strict=True):
        assert torch.equal(a.cpu(), b), f"{name}:\n{a.cpu()}\n{b}"


def test_moe_align_capacity_is_the_padded_worst_case():
    assert moe_align_capacity(8, 256, 16) == 128  # 8 rows can touch 8 experts at most
    assert moe_align_capacity(4096, 8, 64) == 4608  # 4096 + 8 * 63, rounded up to a block
    assert moe_align_capacity(5, 3, 1) == 5
    assert moe_align_capacity(0, 8, 16) == 0


def test_routing_bad_input_names_the_argument():
    x = torch.randn(4, 8, device=DEV)
    with pytest.raises(ArgumentError, match="k: expected at most E = 8"):
        topk_softmax(x, 9)
    with pytest.raises(ArgumentError, match="k: expected a positive int"):
        topk_softmax(x, 0)
    with pytest.raises(DTypeError, match="router_logits"):
        topk_softmax(x.to(torch.int32), 2)
    with pytest.raises(ShapeError, match="router_logits"):
        topk_softmax(x[0], 2)
    with pytest.raises(ArgumentError, match="num_expert_group: expected a divisor"):
        grouped_topk(x, 2, 3, 1)
    with pytest.raises(ArgumentError, match="topk_group: expected at most"):
        grouped_topk(x, 2, 4, 5)
    with pytest.raises(ArgumentError, match="k: expected at most topk_group"):
        grouped_topk(x, 3, 4, 1)
    with pytest.raises(ShapeError, match="correction_bias: expected \\[8\\]"):
        grouped_topk(x, 2, 4, 2, correction_bias=torch.zeros(7, device=DEV))
    with pytest.raises(ArgumentError, match="scoring"):
        grouped_topk(x, 2, 4, 2, scoring="tanh")
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(DTypeError, match="topk_ids"):
        moe_align(ids.float(), 8, 16)
    with pytest.raises(ArgumentError, match="block_m"):
        moe_align(ids, 8, 0)
    with pytest.raises(ArgumentError, match="topk_ids: expected expert ids in \\[0, 8\\).*got 8"):
        moe_align(ids + 8, 8, 16)
