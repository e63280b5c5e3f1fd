"""Staging of misaligned operands (fly_gemm._staging): which operands a call copies, and that a staged call
gives the reference's result (ragged K padded with zeros, a scratch output copied back, nothing written
outside the output's elements).

The decision is checked as a function of shapes, strides and alignment; the staged calls run with the
size threshold lowered to zero, so that the interpreter's small shapes take the staged route.
"""

from __future__ import annotations

import pytest
import torch

from fly_gemm import GemmConfig, _staging, gemm, gemm_ref
from fly_gemm._staging import Staging, plan
from flydsl.testing import assert_rel_close, empty_poisoned, host_work

TMA = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=True)
TILED = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1)


def _rand(*shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if dtype == torch.int8:
        return x.mul(40).round().clamp(-127, 127).to(device=device, dtype=dtype)
    return x.to(device=device, dtype=dtype)


@pytest.fixture
def stage_small(monkeypatch):
    """Stage calls of any size (the interpreter's shapes are below the production threshold); the list it
    gives records the staging of each staged call."""
    monkeypatch.setattr(_staging, "_MIN_ELEMENTS", 0)
    staged = []
    real = _staging.stage_operands

    def recording(s, *args):
        staged.append(s)
        return real(s, *args)

    monkeypatch.setattr(_staging, "stage_operands", recording)
    return staged


# ---------------------------------------------------------------- the decision


def _t(rows, k, dtype=torch.bfloat16, pad=0):
    """A [rows, k] K-major view whose rows are ``k + pad`` elements apart."""
    return torch.empty(rows, k + pad, dtype=dtype)[:, :k]


def test_aligned_operands_are_never_copied(stage_small):
    a, b, c = _t(64, 64), _t(48, 64), _t(64, 48)
    assert plan(a, b, c, tma=True) is None
    assert plan(a, b, c, tma=False) is None


def test_a_ragged_k_pads_both_operands(stage_small):
    a, b, c = _t(64, 47), _t(48, 47), _t(64, 48)
    assert plan(a, b, c, tma=False) == Staging(48, True, True, False)
    assert plan(a, b, c, tma=True) == Staging(48, True, True, False)


def test_16_byte_rows_suffice_for_tma_but_not_for_the_tiled_kernel(stage_small):
    """bf16 K = 40: 80-byte rows TMA addresses; the tiled kernel's K masks would vary within a vector."""
    a, b, c = _t(64, 40), _t(48, 40), _t(64, 48)
    assert plan(a, b, c, tma=True) is None
    assert plan(a, b, c, tma=False) == Staging(48, True, True, False)


def test_an_output_tma_cannot_store_is_staged_for_tma_only(stage_small):
    a, b = _t(64, 64), _t(47, 64)
    c = _t(64, 47)  # 94-byte rows
    assert plan(a, b, c, tma=True) == Staging(64, False, False, True)
    assert plan(a, b, c, tma=False) is None
    strided = torch.empty(64, 96, dtype=torch.bfloat16)[:, ::2]  # last stride 2
    assert plan(a, _t(48, 64), strided, tma=True) == Staging(64, False, False, True)


def test_only_the_misaligned_operand_is_copied(stage_small):
    a = _t(64, 64, pad=1)  # rows 65 elements apart
    b, c = _t(48, 64), _t(64, 48)
    assert plan(a, b, c, tma=False) == Staging(64, True, False, False)
    assert plan(a, b, c, tma=True) == Staging(64, True, False, False)
    assert plan(_t(64, 64), _t(48, 64, pad=8), c, tma=False) == Staging(64, False, True, False)
    assert plan(_t(64, 64), _t(48, 64, pad=8), c, tma=True) is None  # 16-byte rows: TMA reads it


def test_transposed_operands_are_read_in_place(stage_small):
    """A as a [K, M] storage's transpose (the backward's G^T), B as [K, N]: read along their unit stride."""
    a = torch.empty(64, 32, dtype=torch.bfloat16).t()  # [32, 64] view, M-major
    b = torch.empty(64, 48, dtype=torch.bfloat16).t()  # [48, 64] view of [K, N]
    c = _t(32, 48)
    assert plan(a, b, c, tma=False) is None
    assert plan(a, b, c, tma=True) is None
    # a ragged K along their strided dimension needs no mask inside a vector, no 16-byte K row: in place
    # (the backward's dB = G^T A over an odd number of rows)
    a = torch.empty(47, 32, dtype=torch.bfloat16).t()
    b = torch.empty(47, 48, dtype=torch.bfloat16).t()
    assert plan(a, b, c, tma=False) is None
    assert plan(a, b, c, tma=True) is None
    # one K-major operand with a ragged K: both copied, padded (the other would be read past its K rows)
    assert plan(_t(32, 47), b, c, tma=True) == Staging(48, True, True, False)


def test_16_bit_decode_sizes_stay_on_the_tiled_kernel_unstaged(stage_small):
    """M up to 32 in 16 bits: the weight's copy costs more than the unvectorized read; 8 bits are staged."""
    c = _t(32, 48)
    assert plan(_t(32, 47), _t(48, 47), c, tma=False) is None
    assert plan(_t(32, 47, torch.int8), _t(48, 47, torch.int8), c, tma=False) == Staging(48, True, True, False)
    assert plan(_t(33, 47), _t(48, 47), _t(33, 48), tma=False) == Staging(48, True, True, False)
    assert plan(_t(32, 47), _t(48, 47), c, tma=True) == Staging(48, True, True, False)  # TMA: rows must align


def test_small_calls_and_the_switch(monkeypatch):
    a, b, c = _t(4, 47), _t(8, 47), _t(4, 8)
    assert plan(a, b, c, tma=False) is None  # (4 + 8) x 47 elements: copies would cost more than they save
    big_a, big_b = _t(1024, 47), _t(1024, 47)
    assert plan(big_a, big_b, _t(1024, 1024), tma=False) == Staging(48, True, True, False)
    monkeypatch.setattr(_staging, "ENABLED", [False])
    assert plan(big_a, big_b, _t(1024, 1024), tma=False) is None


def test_empty_calls_are_not_staged(stage_small):
    assert plan(_t(0, 47), _t(8, 47), _t(0, 8), tma=False) is None
    assert plan(_t(4, 0), _t(8, 0), _t(4, 8), tma=False) is None


# ---------------------------------------------------------------- staged calls against the reference


@pytest.mark.parametrize("cfg", [TMA, TILED], ids=["tma", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("m,n,k", [(40, 17, 47), (33, 33, 40), (36, 8, 23)])
def test_staged_calls_match_the_reference(device, stage_small, cfg, dtype, m, n, k):
    a = _rand(m, k, dtype=dtype, device=device)
    b = _rand(n, k, dtype=dtype, device=device, seed=1)
    sa = torch.rand(m, device=device) + 0.5
    sb = torch.rand(n, device=device) + 0.5
    bias = _rand(n, dtype=torch.float32, device=device, seed=2)
    kw = dict(scale_a=sa, scale_b=sb) if dtype.itemsize == 1 else {}
    out = empty_poisoned(m, n, dtype=torch.float32, device=device)
    c = gemm(a, b, bias=bias, activation="silu", out=out, config=cfg, **kw)
    assert c is out and stage_small, "the call was not staged"
    assert_rel_close(c, gemm_ref(a, b, bias=bias, activation="silu", **kw), tol=1e-5)
    if dtype == torch.int8:
        raw = gemm(a, b, out_dtype=torch.int32, config=cfg)
        assert torch.equal(raw.cpu().long(), gemm_ref(a, b).cpu().long())


@pytest.mark.parametrize("cfg", [TMA, TILED], ids=["tma", "tiled"])
def test_staged_layouts_and_outputs(device, stage_small, cfg):
    """A sliced A, B as [K, N] with a ragged K, a strided output: the result lands in the output's elements
    only."""
    m, n, k = 40, 24, 37
    a = _rand(m, k + 3, dtype=torch.float16, device=device)[:, 1 : k + 1]  # rows k + 3 apart, offset base
    b_kn = _rand(k, n, dtype=torch.float16, device=device, seed=1)
    out_big = empty_poisoned(m, 2 * n, dtype=torch.float32, device=device)
    c = gemm(a, b_kn, b_layout="kn", out=out_big[:, 1::2], config=cfg)
    assert stage_small[-1].copy_a and stage_small[-1].copy_b and stage_small[-1].k == 48
    assert_rel_close(c, gemm_ref(a, b_kn, b_layout="kn"), tol=1e-5)
    assert torch.isnan(out_big[:, 0::2]).all()  # nothing written outside the output's elements
    odd = empty_poisoned(m, n + 1, dtype=torch.float16, device=device)[:, :n]  # rows of 50 bytes
    assert_rel_close(gemm(a, b_kn, b_layout="kn", out=odd, config=cfg), gemm_ref(a, b_kn, b_layout="kn"))


def test_staged_backward(device, stage_small):
    """Gradients through a staged call (ragged K in the forward, ragged M in dB = G^T A)."""
    m, n, k = 40, 16, 23
    a = _rand(m, k, dtype=torch.float16, device=device).requires_grad_()
    b = _rand(n, k, dtype=torch.float16, device=device, seed=1).requires_grad_()
    g = _rand(m, n, dtype=torch.float16, device=device, seed=2)
    da, db = torch.autograd.grad(gemm(a, b), (a, b), g)
    assert [s.k for s in stage_small[:1]] == [32]  # the forward's K padded
    a64, b64 = a.detach().double(), b.detach().double()
    assert_rel_close(da, g.double() @ b64)
    assert_rel_close(db, g.double().t() @ a64)


# ---------------------------------------------------------------- the GPU, at the sizes that are staged

GPU_MISALIGNED = [(300, 1000, 1001), (64, 2048, 1000), (1000, 1001, 1024), (8, 4096, 2056)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_MISALIGNED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_gpu_misaligned_shapes(device, m, n, k, dtype):
    a = _rand(m, k, dtype=dtype, device=device)
    b = _rand(n, k, dtype=dtype, device=device, seed=1)
    kw = {}
    if dtype.itemsize == 1:
        kw = dict(scale_a=torch.rand(m, device=device) + 0.5, scale_b=torch.rand(n, device=device) + 0.5)
    bias = _rand(n, dtype=torch.bfloat16, device=device, seed=2)
    out = empty_poisoned(m, n, dtype=torch.bfloat16, device=device)
    c = gemm(a, b, bias=bias, activation="gelu", out=out, **kw)
    assert_rel_close(c, gemm_ref(a, b, bias=bias, activation="gelu", **kw))


@pytest.mark.parametrize("cfg", [TMA, TILED], ids=["tma", "tiled"])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_staged_host_path_only_allocates_and_launches(stage_small, cfg):
    """The copies (operands in, a scratch output back) are launches of flydsl-common's copy kernel, so a
    staged call is allocations, views and launches only: what flydsl.direct replays on a GPU. Kernels are
    recorded, not run (the interpreter's own tensor work is not the call's)."""
    a = _rand(40, 47, dtype=torch.float16, device="cpu")  # K = 47: both operands padded to 48
    b = _rand(17, 47, dtype=torch.float16, device="cpu", seed=1)
    out = torch.empty(40, 17 + 3, dtype=torch.float16)[:, :17]  # rows TMA cannot store: a scratch output
    foreign, launches = host_work(gemm, a, b, out=out, config=cfg)
    assert stage_small and not foreign, (stage_small, foreign)
    copies = 3 if stage_small[0].copy_c else 2
    assert launches.count("_copy_padded_kernel") == copies, launches
