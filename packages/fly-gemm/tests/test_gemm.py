"""gemm against the fp64 reference: dtypes, epilogues, scales, layouts, odd and boundary shapes, bad input.

CPU runs go through Triton's interpreter (small shapes; fp16, fp8 and int8 here, bf16 in
``test_gemm_bf16.py``); ``gpu`` tests add bf16 at the sizes the issue names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fly_gemm
import flydsl.arch
from fly_gemm import GemmConfig, gemm, gemm_ref
from fly_gemm._kernels.persistent import tma_operand_a
from fly_gemm._kernels.splitk import tile_counters
from fly_gemm.autotune import config_valid, default_config
from flydsl.checks import parse_dtype
from flydsl.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance

# (M, N, K): one row and one column, K below one step and not a multiple of it, a ragged last tile in each
# dimension, a tile boundary exactly (32).
SHAPES = [(1, 1, 1), (1, 7, 16), (7, 33, 47), (33, 40, 5), (32, 32, 64), (50, 17, 33)]
ACTIVATIONS = [None, "relu", "silu", "gelu_tanh", "gelu"]


def _rand(*shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * scale
    if dtype == torch.int8:
        return x.mul(40).round().clamp(-127, 127).to(device=device, dtype=dtype)
    return x.to(device=device, dtype=dtype)


def _out(m, n, dtype, device):
    return empty_poisoned(m, n, dtype=dtype, device=device)  # unwritten elements fail as NaN


def _tol(in_dtype, out_dtype):
    # the inputs are exact in the reference (it reads the same quantized values): only the accumulation
    # order and the output's rounding differ
    return tolerance(out_dtype) if out_dtype != torch.float32 else 1e-5


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_fp16(device, m, n, k, out_dtype):
    a, b = _rand(m, k, dtype=torch.float16, device=device), _rand(n, k, dtype=torch.float16, device=device, seed=1)
    c = gemm(a, b, out_dtype=out_dtype, out=_out(m, n, out_dtype, device))
    assert c.dtype == out_dtype
    assert_rel_close(c, gemm_ref(a, b), tol=_tol(a.dtype, out_dtype))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_and_activation_epilogues(device, activation):
    m, n, k = 37, 50, 40
    a, b = _rand(m, k, dtype=torch.float16, device=device), _rand(n, k, dtype=torch.float16, device=device, seed=1)
    bias = _rand(n, dtype=torch.float32, device=device, seed=2)
    c = gemm(a, b, bias=bias, activation=activation, out=_out(m, n, torch.float32, device))
    assert_rel_close(c, gemm_ref(a, b, bias=bias, activation=activation), tol=1e-5)
    # no bias, 16-bit output, 16-bit bias
    c16 = gemm(a, b, bias=bias.half(), activation=activation)
    assert_rel_close(c16, gemm_ref(a, b, bias=bias.half(), activation=activation))


def test_layouts_and_strides_are_read_in_place(device):
    """B as [K, N], transposed and sliced operands, a strided output: no copies, same result."""
    m, n, k = 20, 24, 36
    a_big = _rand(m, 2 * k, dtype=torch.float16, device=device)
    a = a_big[:, ::2]  # column stride 2
    b_kn = _rand(k, n, dtype=torch.float16, device=device, seed=1)
    ref = gemm_ref(a, b_kn, b_layout="kn")
    assert_rel_close(gemm(a, b_kn, b_layout="kn", out_dtype=torch.float32), ref, tol=1e-5)
    assert_rel_close(gemm(a, b_kn.t(), out_dtype=torch.float32), ref, tol=1e-5)  # [N, K] view, column-major
    at = _rand(k, m, dtype=torch.float16, device=device, seed=3).t()  # a transposed view
    out_big = empty_poisoned(m, 2 * n, dtype=torch.float32, device=device)
    c = gemm(at, b_kn, b_layout="kn", out=out_big[:, 1::2])
    assert_rel_close(c, gemm_ref(at, b_kn, b_layout="kn"), tol=1e-5)
    assert torch.isnan(out_big[:, 0::2]).all()  # nothing written outside the output's elements


@pytest.mark.parametrize("sa_kind", ["none", "tensor", "row"])
@pytest.mark.parametrize("sb_kind", ["none", "tensor", "col"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_scaled(device, dtype, sa_kind, sb_kind):
    m, n, k = 19, 33, 50
    a, b = _rand(m, k, dtype=dtype, device=device), _rand(n, k, dtype=dtype, device=device, seed=1)
    g = torch.Generator().manual_seed(5)
    sa = {"none": None, "tensor": torch.rand(1, generator=g) + 0.5, "row": torch.rand(m, generator=g) + 0.5}[sa_kind]
    sb = {"none": None, "tensor": torch.rand((), generator=g) + 0.5, "col": torch.rand(n, generator=g) + 0.5}[sb_kind]
    sa, sb = (None if s is None else s.to(device) for s in (sa, sb))
    bias = _rand(n, dtype=torch.bfloat16, device=device, seed=2)
    c = gemm(a, b, scale_a=sa, scale_b=sb, bias=bias, activation="silu", out=_out(m, n, torch.bfloat16, device))
    assert c.dtype == torch.bfloat16
    assert_rel_close(c, gemm_ref(a, b, scale_a=sa, scale_b=sb, bias=bias, activation="silu"))
    c32 = gemm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert_rel_close(c32, gemm_ref(a, b, scale_a=sa, scale_b=sb), tol=1e-5)


def test_int8_raw_product_is_exact(device):
    m, n, k = 9, 21, 70
    a, b = _rand(m, k, dtype=torch.int8, device=device), _rand(n, k, dtype=torch.int8, device=device, seed=1)
    c = gemm(a, b, out_dtype=torch.int32, out=_out(m, n, torch.int32, device))
    assert c.dtype == torch.int32
    assert torch.equal(c.cpu().long(), a.cpu().long() @ b.cpu().long().t())


def test_default_output_dtypes(device):
    a16 = _rand(3, 16, dtype=torch.float16, device=device)
    assert gemm(a16, a16).dtype == torch.float16
    a8 = _rand(3, 16, dtype=torch.float8_e4m3fn, device=device)
    assert gemm(a8, a8).dtype == torch.bfloat16
    i8 = _rand(3, 16, dtype=torch.int8, device=device)
    assert gemm(i8, i8).dtype == torch.bfloat16


def test_empty_and_zero_k(device):
    a = torch.empty(0, 16, dtype=torch.float16, device=device)
    b = _rand(5, 16, dtype=torch.float16, device=device)
    assert gemm(a, b).shape == (0, 5)
    assert gemm(b, a).shape == (5, 0)
    # K = 0: the product is zero, the epilogue still applies
    a0 = torch.empty(4, 0, dtype=torch.float16, device=device)
    b0 = torch.empty(6, 0, dtype=torch.float16, device=device)
    bias = _rand(6, dtype=torch.float32, device=device)
    c = gemm(a0, b0, bias=bias, activation="relu", out=_out(4, 6, torch.float32, device))
    assert torch.equal(c.cpu(), torch.relu(bias.cpu()).expand(4, 6))
    assert torch.equal(gemm(a0, b0, out_dtype=torch.float32).cpu(), torch.zeros(4, 6))


def test_bad_input_is_named(device):
    a = _rand(4, 16, dtype=torch.float16, device=device)
    b = _rand(8, 16, dtype=torch.float16, device=device)
    with pytest.raises(DTypeError, match="b: expected dtype fp16"):
        gemm(a, b.float())
    with pytest.raises(DTypeError, match="a: expected dtype"):
        gemm(a.float(), b.float())
    with pytest.raises(ShapeError, match=r"b: expected \[N, 16\]"):
        gemm(a, b[:, :15])
    with pytest.raises(ShapeError, match=r"b: expected \[16, N\]"):
        gemm(a, b, b_layout="kn")
    with pytest.raises(ArgumentError, match="b_layout"):
        gemm(a, b, b_layout="tn")
    with pytest.raises(ShapeError, match="bias: expected"):
        gemm(a, b, bias=torch.zeros(7, device=device))
    with pytest.raises(ShapeError, match="scale_a: expected one value"):
        gemm(a, b, scale_a=torch.ones(3, device=device))
    with pytest.raises(DTypeError, match="scale_b: expected dtype fp32"):
        gemm(a, b, scale_b=torch.ones(8, dtype=torch.float16, device=device))
    with pytest.raises(ShapeError, match=r"out: expected \[4, 8\]"):
        gemm(a, b, out=torch.empty(4, 7, dtype=torch.float16, device=device))
    with pytest.raises(DTypeError, match="out: expected dtype"):
        gemm(a, b, out_dtype=torch.float32, out=torch.empty(4, 8, dtype=torch.float16, device=device))
    with pytest.raises(DTypeError, match="out_dtype"):
        gemm(a, b, out_dtype=torch.int32)
    i8 = _rand(4, 16, dtype=torch.int8, device=device)
    with pytest.raises(ArgumentError, match="raw int8 product"):
        gemm(i8, i8, out_dtype=torch.int32, scale_a=torch.ones(1, device=device))
    with pytest.raises(ArgumentError, match="activation"):
        gemm(a, b, activation="tanh")
    with pytest.raises(DeviceError, match="b:"):
        gemm(a, b.to("meta"))
    with pytest.raises(ArgumentError, match="config"):
        gemm(a, b, config=GemmConfig(8, 16, 16))


# The persistent TMA kernel in the interpreter: small tiles, ragged edges in M, N and K (descriptor loads
# read zeros there, stores clip; K = 16 and 48 leave a K tile part empty), both B layouts, every dtype, the
# full epilogue.
TMA = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=True)
TMA_SHAPES = [(7, 32, 48), (40, 48, 32), (33, 16, 16)]  # rows of 16-byte multiples for every dtype (TMA)


TMA_SUBTILE = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=True, epilogue_subtile=True)
TMA_TWO = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=True, occupancy=2)  # 2 programs an SM


# Split-K in the TMA kernel: K = 48 in 2 splits of 1 step; K = 160 (5 steps of 32) in splits of 2, 2, 1.
TMA_SPLIT = GemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=True, split_k=3)
TMA_SPLIT_LAST = dataclasses.replace(TMA_SPLIT, reduce_last=True)  # reduced by the tile's last split


@pytest.mark.parametrize("m,n,k", TMA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("cfg", [TMA, TMA_SUBTILE, TMA_TWO], ids=["tile", "subtile", "two-an-sm"])
def test_tma_kernel(device, m, n, k, dtype, b_layout, cfg):
    _check_tma(device, m, n, k, dtype, b_layout, cfg)


@pytest.mark.parametrize("m,n,k", [(7, 32, 48), (9, 48, 160)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("cfg", [TMA_SPLIT, TMA_SPLIT_LAST], ids=["second-kernel", "last-split"])
def test_tma_split_k(device, m, n, k, dtype, b_layout, cfg):
    _check_tma(device, m, n, k, dtype, b_layout, cfg)


def _check_tma(device, m, n, k, dtype, b_layout, cfg):
    a = _rand(m, k, dtype=dtype, device=device)
    b = _rand(n, k, dtype=dtype, device=device, seed=1)
    b = b if b_layout == "nk" else b.t().contiguous()
    sa = torch.rand(m, device=device) + 0.5
    bias = _rand(n, dtype=torch.float32, device=device, seed=2)
    out = _out(m, n, torch.float32, device)
    tma_here = device.type == "cpu" or torch.cuda.get_device_capability()[0] >= 9
    assert (tma_operand_a(a, b, out) is not None) == tma_here
    c = gemm(a, b, b_layout=b_layout, scale_a=sa, bias=bias, activation="gelu_tanh", out=out, config=cfg)
    assert_rel_close(c, gemm_ref(a, b, b_layout=b_layout, scale_a=sa, bias=bias, activation="gelu_tanh"), tol=1e-5)
    if dtype == torch.int8:
        raw = gemm(a, b, b_layout=b_layout, out_dtype=torch.int32, config=cfg, out=_out(m, n, torch.int32, device))
        assert torch.equal(raw.cpu().long(), gemm_ref(a, b, b_layout=b_layout).cpu().long())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_tma_reads_a_transposed_a(device, dtype):
    """A given as a transposed view of a row-major [K, M] tensor (the backward's G^T): the TMA kernel reads
    its storage (A_KM), no copy."""
    m, n, k = 48, 32, 64
    a_store = _rand(k, m, dtype=dtype, device=device)
    b = _rand(n, k, dtype=dtype, device=device, seed=1)
    out = _out(m, n, torch.float32, device)
    a_t, a_km = tma_operand_a(a_store.t(), b, out)
    assert a_km and a_t.data_ptr() == a_store.data_ptr()
    c = gemm(a_store.t(), b, config=TMA, out=out)
    assert_rel_close(c, gemm_ref(a_store.t(), b), tol=1e-5)


def test_tma_falls_back_where_tma_cannot_address(device):
    """Rows not a multiple of 16 bytes, a strided last dim, K = 0: the tiled kernel serves them."""

    a = _rand(9, 20, dtype=torch.float16, device=device)  # 40-byte rows
    b = _rand(16, 20, dtype=torch.float16, device=device, seed=1)
    out = _out(9, 16, torch.float16, device)
    assert tma_operand_a(a, b, out) is None
    assert_rel_close(gemm(a, b, config=TMA, out=out), gemm_ref(a, b))
    a2 = _rand(9, 32, dtype=torch.float16, device=device)[:, ::2]  # 16 columns, stride 2
    assert tma_operand_a(a2, b[:, :16], out) is None
    assert_rel_close(gemm(a2, b[:, :16].contiguous(), config=TMA), gemm_ref(a2, b[:, :16]))
    a0 = torch.empty(4, 0, dtype=torch.float16, device=device)
    b0 = torch.empty(8, 0, dtype=torch.float16, device=device)
    assert torch.equal(gemm(a0, b0, config=TMA, out_dtype=torch.float32).cpu(), torch.zeros(4, 8))


@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8])
def test_split_k(device, dtype, split_k):
    """K split over a second grid axis, partials added in order by a second kernel: same results, every
    epilogue, and the int8 product exact; more splits than K steps, and a ragged last split."""
    m, n, k = 5, 40, 150  # 5 steps of 32: splits of 2, 2, 1 steps (split_k 3), at most 5 splits
    a, b = _rand(m, k, dtype=dtype, device=device), _rand(n, k, dtype=dtype, device=device, seed=1)
    cfg = GemmConfig(16, 32, 32, group_m=1, num_stages=1, split_k=split_k)
    sb = torch.rand(n, device=device) + 0.5
    bias = _rand(n, dtype=torch.float32, device=device, seed=2)
    c = gemm(a, b, scale_b=sb, bias=bias, activation="relu", config=cfg, out=_out(m, n, torch.float32, device))
    assert_rel_close(c, gemm_ref(a, b, scale_b=sb, bias=bias, activation="relu"), tol=1e-5)
    if dtype == torch.int8:
        raw = gemm(a, b, out_dtype=torch.int32, config=cfg, out=_out(m, n, torch.int32, device))
        assert torch.equal(raw.cpu().long(), a.cpu().long() @ b.cpu().long().t())


@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_split_k_reduced_by_the_last_split(device, dtype, split_k):
    """reduce_last: the tile's last split adds the partials in the same order as the second kernel does, so
    the results are bitwise those of the two-kernel path, every call (the tile counters are left zeroed)."""
    m, n, k = 37, 72, 150  # 3 x 3 tiles of 16 x 32
    a, b = _rand(m, k, dtype=dtype, device=device), _rand(n, k, dtype=dtype, device=device, seed=1)
    two_kernels = GemmConfig(16, 32, 32, group_m=1, num_stages=1, split_k=split_k)
    one_kernel = dataclasses.replace(two_kernels, reduce_last=True)
    bias = _rand(n, dtype=torch.float32, device=device, seed=2)
    want = gemm(a, b, bias=bias, activation="gelu", config=two_kernels, out=_out(m, n, torch.float32, device))
    for _ in range(3):
        got = gemm(a, b, bias=bias, activation="gelu", config=one_kernel, out=_out(m, n, torch.float32, device))
        assert torch.equal(got, want)
        assert not tile_counters(9, device).any()
    assert_rel_close(want, gemm_ref(a, b, bias=bias, activation="gelu"), tol=1e-5)
    if dtype == torch.int8:
        raw = gemm(a, b, out_dtype=torch.int32, config=one_kernel, out=_out(m, n, torch.int32, device))
        assert torch.equal(raw.cpu().long(), a.cpu().long() @ b.cpu().long().t())


@pytest.mark.gpu
@pytest.mark.parametrize("split_k,reduce_last", [(1, False), (3, False), (3, True)])
@pytest.mark.graph
def test_pdl_launches_wait_for_the_kernel_before(device, split_k, reduce_last):
    """PDL (sm_90+): a GEMM that may start while the kernel before it finishes reads its A only after that
    kernel's writes are visible. In a chain where each GEMM's A is the previous one's poisoned-then-written
    output, a read too early would see NaN; every step matches its reference, and the chain captured in a
    CUDA graph (where it launches plainly) replays to the same bits."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("griddepcontrol needs sm_90")
    cfg = GemmConfig(16, 32, 64, group_m=1, num_stages=3, split_k=split_k, reduce_last=reduce_last, pdl=True)
    assert config_valid(cfg, torch.bfloat16, flydsl.arch.current(device))
    m, n = 5, 1024
    ws = [_rand(n, n, dtype=torch.bfloat16, device=device, seed=s, scale=n**-0.5) for s in range(1, 7)]
    x = _rand(m, n, dtype=torch.bfloat16, device=device)

    def chain(outs):  # GEMM i reads GEMM i-1's output: launched back to back, no sync between
        for i, w in enumerate(ws):
            gemm(x if i == 0 else outs[i - 1], w, config=cfg, out=outs[i])
        return outs

    outs = chain([_out(m, n, torch.bfloat16, device) for _ in ws])
    for i, w in enumerate(ws):
        assert_rel_close(outs[i], gemm_ref(x if i == 0 else outs[i - 1], w))
    graph_outs = [_out(m, n, torch.bfloat16, device) for _ in ws]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        chain(graph_outs)
    graph.replay()
    torch.cuda.synchronize(device)
    assert all(torch.equal(got, want) for got, want in zip(graph_outs, outs, strict=True))


@pytest.mark.parametrize("m", [1, 3, 8, 11])  # 11 > block_m: a second grid axis over M
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8])
def test_gemv_kernel(device, m, dtype):
    """The CUDA-core decode kernel: per-lane products reduced once, every epilogue, strided A, raw int8."""
    n, k = 40, 150
    a = _rand(m, 2 * k, dtype=dtype, device=device)[:, ::2]  # column stride 2
    b = _rand(n, k, dtype=dtype, device=device, seed=1)
    cfg = GemmConfig(8, 16, 32, group_m=1, num_stages=1, gemv=True)
    sa, sb = torch.rand(m, device=device) + 0.5, torch.rand(1, device=device) + 0.5
    bias = _rand(n, dtype=torch.float32, device=device, seed=2)
    c = gemm(a, b, scale_a=sa, scale_b=sb, bias=bias, activation="gelu_tanh", config=cfg,
             out=_out(m, n, torch.float32, device))  # fmt: skip
    assert_rel_close(c, gemm_ref(a, b, scale_a=sa, scale_b=sb, bias=bias, activation="gelu_tanh"), tol=1e-5)
    if dtype == torch.int8:
        raw = gemm(a, b, out_dtype=torch.int32, config=cfg, out=_out(m, n, torch.int32, device))
        assert torch.equal(raw.cpu().long(), a.cpu().long() @ b.cpu().long().t())


def test_default_takes_the_searched_winners_tiles():
    """On the keys of the shipped sm_90 artifact (searched on the H200), the pure default picks the winner's
    tile (rows x columns) on every bf16 key but one and on most 8-bit ones: the default was fitted to them
    (fly_gemm.autotune), so a change that loses them is a change to measure first."""
    entries = json.loads((Path(fly_gemm.__file__).parent / "artifacts" / "gemm.json").read_text())["entries"]
    hits: dict = {}
    for e in entries:
        key, won = e["key"], e["config"]
        if key["epilogue"] != "none":
            continue
        dtype = parse_dtype("dtype", key["dtype"])
        cfg = default_config(key["m_bucket"], key["n"], key["k"], dtype, flydsl.arch.SM90)
        same = (cfg.block_m, cfg.block_n) == (won["block_m"], won["block_n"])
        hits.setdefault(key["dtype"], []).append(same)
    assert len(hits["bf16"]) == 48 and sum(hits["bf16"]) >= 47
    eight = hits["fp8_e4m3"] + hits["int8"]
    assert sum(eight) >= 0.8 * len(eight)


def test_default_configs_are_valid():
    """The heuristic's configs pass the validity predicate for every regime and dtype (sm_90 and CPU)."""
    for arch in (flydsl.arch.SM90, flydsl.arch.INTERPRETER):
        for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8):
            for m in (1, 7, 16, 17, 64, 65, 1024, 8192):
                for n, k in ((16, 16), (4096, 4096), (1000, 4097)):
                    cfg = default_config(m, n, k, dtype, arch)
                    assert config_valid(cfg, dtype, arch), (arch.name, dtype, m, n, k, cfg)
    big = default_config(8192, 8192, 8192, torch.bfloat16, flydsl.arch.SM90)
    assert (big.block_m, big.block_n, big.block_k, big.group_m) == (128, 256, 64, 8)  # many tiles: 128 x 256
    assert big.tma and big.epilogue_subtile  # Hopper: the persistent TMA kernel for every M past the decode sizes
    mid = default_config(1024, 4096, 4096, torch.bfloat16, flydsl.arch.SM90)  # one wave of 128 x 256, not two
    assert (mid.block_m, mid.block_n, mid.tma) == (128, 256, True)
    few = default_config(256, 4096, 4096, torch.bfloat16, flydsl.arch.SM90)  # 64 tiles of 128 x 128: K split
    assert (few.block_n, few.split_k, few.reduce_last, few.tma) == (128, 2, True, True)
    fp8 = default_config(8192, 8192, 8192, torch.float8_e4m3fn, flydsl.arch.SM90)
    assert (fp8.block_m, fp8.block_n, fp8.block_k, fp8.tma) == (128, 256, 128, True)  # the artifact's winner
    int8 = default_config(8192, 8192, 8192, torch.int8, flydsl.arch.SM90)  # int32 tiles: 128 x 128
    assert (int8.block_m, int8.block_n, int8.block_k) == (128, 128, 128)
    small = default_config(1, 4096, 4096, torch.bfloat16, flydsl.arch.SM90)
    assert small.block_m == 16 and not small.tma
    # decode sizes: the searched winners' shapes (fly_gemm/artifacts, H200): 16 x 32 x 128 tiles split in 2,
    # reduced by the last split, at M <= 16 and N = 4096
    assert (small.block_n, small.block_k, small.split_k, small.reduce_last) == (32, 128, 2, True)
    wide = default_config(1, 14336, 4096, torch.bfloat16, flydsl.arch.SM90)
    assert (wide.block_n, wide.split_k) == (64, 1)  # 224 tiles: the winner's 16 x 64
    assert default_config(16, 8192, 8192, torch.bfloat16, flydsl.arch.SM90).block_n == 32  # 256 tiles, no split
    assert default_config(16, 28672, 8192, torch.bfloat16, flydsl.arch.SM90).block_n == 128
    m64 = default_config(64, 4096, 4096, torch.bfloat16, flydsl.arch.SM90)  # the winner: 64 x 64, K split in 2
    assert (m64.block_m, m64.block_n, m64.block_k, m64.split_k) == (64, 64, 128, 2)
    assert (default_config(64, 14336, 4096, torch.bfloat16, flydsl.arch.SM90).block_n,
            default_config(64, 8192, 8192, torch.bfloat16, flydsl.arch.SM90).split_k) == (128, 1)  # fmt: skip
    fp8_small = default_config(16, 4096, 4096, torch.float8_e4m3fn, flydsl.arch.SM90)  # the winner: 16 x 32 x 512
    assert (fp8_small.block_n, fp8_small.block_k, fp8_small.split_k) == (32, 512, 1)
    narrow = default_config(1, 1024, 4096, torch.bfloat16, flydsl.arch.SM90)
    assert narrow.block_n == 32 and narrow.split_k == 4  # 32 tiles: K split in 4 (8 K steps a split)
    assert default_config(1, 1024, 256, torch.bfloat16, flydsl.arch.SM90).split_k == 1  # too few K steps
    assert default_config(2048, 4096, 4096, torch.bfloat16, flydsl.arch.SM90).split_k == 1
    # the CUDA-core decode kernel: rows of A up to 8, per-lane accumulators within 64 registers a thread
    assert config_valid(GemmConfig(1, 16, 256, gemv=True), torch.bfloat16, flydsl.arch.SM90)
    assert not config_valid(GemmConfig(16, 16, 256, gemv=True), torch.bfloat16, flydsl.arch.SM90)
    assert not config_valid(GemmConfig(8, 32, 256, gemv=True), torch.bfloat16, flydsl.arch.SM90)
    assert not config_valid(GemmConfig(8, 16, 16), torch.bfloat16, flydsl.arch.SM90)  # a dot needs 16
    assert config_valid(GemmConfig(16, 16, 16), torch.bfloat16, flydsl.arch.SM90)
    # two programs an SM: the TMA kernel only, both within the SM's shared memory (bf16 out: 112 KB each)
    two = GemmConfig(128, 128, 64, num_warps=8, num_stages=3, tma=True, epilogue_subtile=True, occupancy=2)
    assert config_valid(two, torch.bfloat16, flydsl.arch.SM90, 2)
    assert two.launch_options()["maxnreg"] == 128  # 65536 registers over 2 x 256 threads
    assert not config_valid(two, torch.bfloat16, flydsl.arch.SM90, 4)  # an fp32 C half: 128 KB each
    assert not config_valid(dataclasses.replace(two, num_stages=4), torch.bfloat16, flydsl.arch.SM90, 2)
    assert not config_valid(dataclasses.replace(two, tma=False, epilogue_subtile=False), torch.bfloat16,
                            flydsl.arch.SM90, 2)  # fmt: skip
    assert not config_valid(dataclasses.replace(two, occupancy=3), torch.bfloat16, flydsl.arch.SM90, 2)
    # the last split's reduction: the tiled kernel with split-K only
    assert config_valid(GemmConfig(16, 64, 128, split_k=4, reduce_last=True), torch.bfloat16, flydsl.arch.SM90)
    assert not config_valid(GemmConfig(16, 64, 128, reduce_last=True), torch.bfloat16, flydsl.arch.SM90)
    assert config_valid(GemmConfig(64, 64, 64, tma=True, split_k=2, reduce_last=True), torch.bfloat16,
                        flydsl.arch.SM90)  # fmt: skip
    # programmatic dependent launch: the tiled kernel on sm_90+ (griddepcontrol), a launch option
    pdl = GemmConfig(16, 64, 128, split_k=4, reduce_last=True, pdl=True)
    assert config_valid(pdl, torch.bfloat16, flydsl.arch.SM90) and pdl.launch_options()["launch_pdl"]
    assert not config_valid(pdl, torch.bfloat16, flydsl.arch.INTERPRETER)
    assert not config_valid(dataclasses.replace(pdl, tma=True), torch.bfloat16, flydsl.arch.SM90)
    assert not config_valid(GemmConfig(1, 16, 256, gemv=True, pdl=True), torch.bfloat16, flydsl.arch.SM90)
    assert "launch_pdl" not in dataclasses.replace(pdl, pdl=False).launch_options()
    assert not config_valid(GemmConfig(16, 16, 16), torch.float8_e4m3fn, flydsl.arch.SM90)  # 8-bit K >= 32
    assert config_valid(GemmConfig(16, 16, 32), torch.int8, flydsl.arch.SM90)


# ---------------------------------------------------------------- GPU: bf16 and the shapes

GPU_SHAPES = [(1, 1000, 1023), (7, 4097, 1000), (127, 1023, 4097), (1024, 1000, 1023), (256, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_shapes(device, m, n, k, dtype):
    a, b = _rand(m, k, dtype=dtype, device=device), _rand(n, k, dtype=dtype, device=device, seed=1)
    bias = _rand(n, dtype=dtype, device=device, seed=2)
    c = gemm(a, b, bias=bias, activation="gelu", out=_out(m, n, dtype, device))
    assert_rel_close(c, gemm_ref(a, b, bias=bias, activation="gelu"))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_gpu_scaled_shapes(device, m, n, k, dtype):
    a, b = _rand(m, k, dtype=dtype, device=device), _rand(n, k, dtype=dtype, device=device, seed=1)
    sa = torch.rand(m, device=device) + 0.5
    sb = torch.rand(n, device=device) + 0.5
    c = gemm(a, b, scale_a=sa, scale_b=sb, out=_out(m, n, torch.bfloat16, device))
    assert_rel_close(c, gemm_ref(a, b, scale_a=sa, scale_b=sb))


# ---------------------------------------------------------------- property-based shapes


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(0, 100),
    layout=st.sampled_from(["nk", "kn"]), dtype=st.sampled_from([torch.float16, torch.float8_e4m3fn, torch.int8]),
    tma=st.booleans(), split_k=st.sampled_from([1, 3]),
)  # fmt: skip
def test_any_shape(device, m, n, k, layout, dtype, tma, split_k):
    """Random M, N, K (K = 0 included), both layouts, every input dtype; the TMA kernel where it can address
    the operands (else the tiled kernel), with or without split-K: always the reference's result."""
    a = _rand(m, k, dtype=dtype, device=device)
    b = _rand(n, k, dtype=dtype, device=device, seed=1)
    b = b if layout == "nk" else b.t().contiguous()
    cfg = GemmConfig(16, 32, 32, group_m=2, num_stages=1, tma=tma, split_k=split_k)
    bias = _rand(n, dtype=torch.float32, device=device, seed=2)
    c = gemm(a, b, b_layout=layout, bias=bias, activation="silu", config=cfg, out=_out(m, n, torch.float32, device))
    # Elementwise, as an fp32 dot product is accurate: the products are exact in fp32 for these inputs, so
    # the pre-activation is off by at most (K + 1) fp32 roundings of sum |a b| + |bias|, which silu (slope
    # below 1.1) passes on, plus silu's own fp32 evaluation (exp and a division: 2^-20 of its value). A
    # norm-relative bound would be ill-conditioned for the outputs that cancel to near 0.
    ref = gemm_ref(a, b, b_layout=layout, bias=bias, activation="silu")
    size = gemm_ref(a.double().abs(), b.double().abs(), b_layout=layout, bias=bias.double().abs())
    bound = 1.1 * (k + 1) * 2.0**-24 * size + 2.0**-20 * ref.abs() + 1e-30
    err = (c.double().cpu() - ref.cpu()).abs()
    assert torch.isfinite(c).all() and (err <= bound.cpu()).all(), f"max error / bound {(err / bound.cpu()).max()}"
