"""``grouped_gemm`` against the fp32 loop-over-groups reference (``grouped_gemm_ref``) by relative error,
forward and gradients (dA, dB against fp32 autograd of the reference), with every output and workspace
poisoned (NaN / int minimum) so an unwritten element fails: fp16 and bf16, empty groups, every row in one
group, rows past the last offset, M_total = 0, K = 0, no groups, odd K and N, strided operands, out_dtype;
the group table against a host computation and its tile bound; meta tensors, torch.compile(fullgraph=True)
forward and backward, ``torch.library.opcheck``; the config's default and validity; bad input named by
argument. GPU cases at training sizes (G = 8-128, K / N 512-4096, M_total up to 16K) carry the ``gpu``
marker."""

from __future__ import annotations

import importlib

import pytest
import torch

import flydsl.arch
from fly_gemm import GroupedGemmConfig, grouped_gemm, grouped_gemm_ref
from fly_gemm._kernels.grouped_gemm import launch_group_table, max_row_tiles
from flydsl.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, default_device, empty_poisoned, tolerance

DEV = default_device()
_mod = importlib.import_module("fly_gemm.grouped_gemm")  # the module: the package's name is the function


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every output and workspace the host allocates starts poisoned."""

    def empty(*shape, dtype, device=None):
        return empty_poisoned(*shape, dtype=dtype, device=device)

    monkeypatch.setattr(_mod, "_empty", empty)


def _sizes_to_offsets(sizes, device=DEV):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _operands(m, k, n, groups, dtype, seed, device=DEV):
    """Unit-scale operands (outputs near 1, as a trained layer's)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = (torch.randn(groups, n, k, generator=gen) / max(1, k) ** 0.5).to(dtype)
    return a.to(device), b.to(device)


def _check_forward_backward(a, b, offsets, out_dtype=None, seed=0):
    """Forward against the reference; then dA and dB against fp32 autograd of the reference."""
    a = a.detach().requires_grad_(True)
    b = b.detach().requires_grad_(True)
    out = grouped_gemm(a, b, offsets, out_dtype=out_dtype)
    want = out_dtype or a.dtype
    assert out.dtype == want and out.shape == (a.shape[0], b.shape[1])
    a32 = a.detach().float().requires_grad_(True)
    b32 = b.detach().float().requires_grad_(True)
    ref = grouped_gemm_ref(a32, b32, offsets)
    assert_rel_close(out, ref, tol=tolerance(a.dtype if want == torch.float32 else want), name="out")
    gen = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(out.shape, generator=gen).to(want).to(out.device)
    out.backward(grad)
    ref.backward(grad.float())
    assert a.grad.dtype == a.dtype and b.grad.dtype == b.dtype
    assert_rel_close(a.grad, a32.grad, tol=tolerance(a.dtype), name="dA")
    assert_rel_close(b.grad, b32.grad, tol=tolerance(a.dtype), name="dB")
    return out, a.grad, b.grad


# (M_total, K, N, group sizes): partial tiles in M, N and K (K not a multiple of 16); empty groups (first,
# middle, last, runs of them); every row in one group (first, middle, last); one group; more groups than
# rows; rows past the last offset (sizes summing to less than M_total)
CASES = [
    (50, 40, 24, [10, 0, 23, 12, 5]),
    (37, 33, 45, [0, 0, 37]),
    (64, 48, 32, [64, 0, 0, 0]),
    (29, 17, 19, [0, 29, 0]),
    (45, 64, 64, [45]),
    (7, 24, 40, [1, 0, 2, 0, 1, 1, 0, 2, 0]),
    (40, 32, 24, [12, 0, 9]),  # rows 21..39 belong to no group: zeros out and zero dA
]


@pytest.mark.parametrize("m,k,n,sizes", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_and_gradients_match_reference(m, k, n, sizes, dtype):
    a, b = _operands(m, k, n, len(sizes), dtype, seed=m * 7 + k)
    offsets = _sizes_to_offsets(sizes)
    out, da, db = _check_forward_backward(a, b, offsets, seed=m)
    end = sum(sizes)
    assert (out[end:] == 0).all() and (da[end:] == 0).all()
    for g, size in enumerate(sizes):
        if size == 0:  # a group without rows: exactly zero weight gradient
            assert (db[g] == 0).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_out_dtype(out_dtype):
    a, b = _operands(33, 40, 24, 3, torch.bfloat16, seed=3)
    _check_forward_backward(a, b, _sizes_to_offsets([10, 0, 23]), out_dtype=out_dtype)


def test_strided_operands_are_read_in_place():
    """a transposed, b sliced and permuted, a gradient with stride 0 (``out.sum()``)."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(40, 30, generator=gen).to(torch.float16).to(DEV).t()  # [30, 40], column-major
    b = (torch.randn(3, 40, 2 * 24, generator=gen) / 6).to(torch.float16).to(DEV)[:, :, ::2].transpose(1, 2)
    offsets = _sizes_to_offsets([11, 0, 19])
    _check_forward_backward(a, b, offsets)
    a1, b1 = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    grouped_gemm(a1, b1, offsets).float().sum().backward()
    a32, b32 = a.detach().float().requires_grad_(True), b.detach().float().requires_grad_(True)
    grouped_gemm_ref(a32, b32, offsets).sum().backward()
    assert_rel_close(a1.grad, a32.grad, tol=tolerance(torch.float16), name="dA")
    assert_rel_close(b1.grad, b32.grad, tol=tolerance(torch.float16), name="dB")


def test_no_rows():
    a, b = _operands(0, 40, 24, 4, torch.bfloat16, seed=1)
    offsets = torch.zeros(4, dtype=torch.int32, device=DEV)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = grouped_gemm(a, b, offsets)
    assert out.shape == (0, 24) and out.dtype == torch.bfloat16
    out.backward(torch.ones_like(out))
    assert a.grad.shape == (0, 40)
    assert b.grad.shape == b.shape and (b.grad == 0).all()  # every group empty: written, zeros


def test_k_zero_and_no_groups_give_zeros():
    a, b = _operands(9, 0, 16, 2, torch.float16, seed=2)
    out = grouped_gemm(a, b, _sizes_to_offsets([4, 5]))
    assert out.shape == (9, 16) and (out == 0).all()
    a, b = _operands(9, 32, 16, 0, torch.float16, seed=2)
    out = grouped_gemm(a, b, torch.zeros(0, dtype=torch.int32, device=DEV))
    assert out.shape == (9, 16) and (out == 0).all()


def test_weight_gradient_is_deterministic():
    a, b = _operands(70, 48, 40, 3, torch.bfloat16, seed=9)
    offsets = _sizes_to_offsets([30, 0, 40])
    grads = []
    for _ in range(2):
        bb = b.detach().clone().requires_grad_(True)
        grouped_gemm(a, bb, offsets).float().square().sum().backward()
        grads.append(bb.grad)
    assert torch.equal(grads[0], grads[1])


# ---------------------------------------------------------------- the group table


def _table_ref(offsets, m, block_m):
    ends = [min(max(x, 0), m) for x in offsets]
    run, starts, tiles = 0, [], []
    for end in ends + [m]:
        start = run
        run = max(run, end)
        starts.append(start)
        tiles.append(-(-(run - start) // block_m))
    tile_start = [sum(tiles[:g]) for g in range(len(tiles) + 1)]
    return starts + [m] + tile_start


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    "offsets,m",
    [([], 5), ([0], 0), ([3, 3, 9], 9), ([10, 20, 30], 40), ([17, 5, 40, 2], 33), ([-4, 7, 100], 50)]
    + [
        (torch.randint(0, 90, (g,), generator=torch.Generator().manual_seed(g)).sort().values.tolist(), 90)
        for g in (1, 7, 64, 1500)
    ],
)
def test_group_table_and_tile_bound(offsets, m, block_m):
    """The table kernel (on decreasing and out-of-range offsets too, which a GPU call does not check) against
    a host computation; the tiles stay within the grid's bound."""
    offs = torch.tensor(offsets, dtype=torch.int32, device=DEV)
    table = empty_poisoned(2 * (len(offsets) + 2), dtype=torch.int32, device=DEV)
    launch_group_table(offs, table, m, block_m)
    want = _table_ref(offsets, m, block_m)
    assert table.tolist() == want
    assert want[-1] <= max_row_tiles(m, len(offsets), block_m)


# ---------------------------------------------------------------- meta tensors, torch.compile, opcheck


def test_meta_tensors_give_meta_outputs():
    meta = torch.device("meta")
    a = torch.empty(100, 64, dtype=torch.bfloat16, device=meta)
    b = torch.empty(4, 32, 64, dtype=torch.bfloat16, device=meta)
    offs = torch.empty(4, dtype=torch.int32, device=meta)
    out = grouped_gemm(a, b, offs, out_dtype=torch.float32)
    assert out.device == meta and out.shape == (100, 32) and out.dtype == torch.float32


def test_forward_and_backward_under_torch_compile_fullgraph():
    torch._dynamo.reset()
    a, b = _operands(30, 40, 24, 3, torch.bfloat16, seed=4)
    offsets = _sizes_to_offsets([12, 0, 18])

    def loss(a, b, offsets):
        return (grouped_gemm(a, b, offsets).float() ** 2).sum()

    ac, bc = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    torch.compile(loss, fullgraph=True, backend="aot_eager")(ac, bc, offsets).backward()
    a32, b32 = a.float().requires_grad_(True), b.float().requires_grad_(True)
    (grouped_gemm_ref(a32, b32, offsets) ** 2).sum().backward()
    assert_rel_close(ac.grad, a32.grad, tol=tolerance(torch.bfloat16), name="dA")
    assert_rel_close(bc.grad, b32.grad, tol=tolerance(torch.bfloat16), name="dB")


def test_opcheck():
    a, b = _operands(21, 24, 16, 3, torch.float16, seed=6)
    offsets = _sizes_to_offsets([5, 0, 16])
    a.requires_grad_(True)
    b.requires_grad_(True)
    torch.library.opcheck(torch.ops.fly_gemm.grouped_gemm.default, (a, b, offsets, None))
    grad = torch.randn(21, 16).to(torch.float16).to(DEV)
    torch.library.opcheck(torch.ops.fly_gemm.grouped_gemm_wgrad.default, (grad, a.detach(), offsets, torch.float16))


# ---------------------------------------------------------------- the kernels compile for the H200

_SM90_SCRIPT = """
import flydsl
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage, signature
from fly_gemm._kernels import grouped_gemm as kg

def report(name, fn, types, consts, aligned, warps, stages):
    k = compile_sm90(fn, signature(fn, types, pointer="*bf16"), consts, divisible_by_16(aligned), num_warps=warps,
                     num_stages=stages)
    print("ok", name, "wgmma" if "wgmma.mma_async" in k.asm["ptx"] else "no-wgmma", resource_usage(k))

tiles = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "SEARCH": 4}
gemm = ["a_ptr", "b_ptr", "c_ptr", "table_ptr", "K", "N", "stride_am", "stride_be", "stride_cm"]
report("fwd", kg._grouped_gemm_kernel, {"table_ptr": "*i32"}, {**tiles, "stride_ak": 1, "stride_bk": 1, "stride_cn": 1},
       gemm + ["stride_bn"], 8, 4)
report("dA", kg._grouped_gemm_kernel, {"table_ptr": "*i32"}, {**tiles, "stride_ak": 1, "stride_bn": 1, "stride_cn": 1},
       gemm + ["stride_bk"], 8, 4)
report("dB", kg._grouped_wgrad_kernel, {"table_ptr": "*i32"},
       {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_R": 64, "GROUP_N": 8, "stride_gn": 1, "stride_ak": 1, "stride_dk": 1},
       ["g_ptr", "a_ptr", "d_ptr", "table_ptr", "K", "N", "stride_gm", "stride_am", "stride_de", "stride_dn"], 8, 4)
report("table", kg._group_table_kernel, {"offs_ptr": "*i32", "table_ptr": "*i32"}, {"BLOCK_M": 128, "BLOCK_G": 256},
       ["offs_ptr", "table_ptr"], 4, 1)
"""


def test_kernels_compile_for_sm90_on_tensor_cores_without_spills():
    """Triton's compiler (not the interpreter) takes the default training-size variants for sm_90, in a
    process of its own: the GEMMs become wgmma, and nothing spills."""
    from flydsl.testing.sm90 import run_compile_script

    lines = run_compile_script(_SM90_SCRIPT)
    got = {line.split()[1]: (line.split()[2], " ".join(line.split()[3:])) for line in lines if line.startswith("ok")}
    assert set(got) == {"fwd", "dA", "dB", "table"}, "\n".join(lines)
    for name, (mma, usage) in got.items():
        assert usage.endswith("STACK:0"), (name, usage)
        if name != "table":
            assert mma == "wgmma", (name, mma)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("m,groups,n,k", [(16384, 8, 4096, 4096), (1000, 128, 512, 2048), (40, 64, 768, 512),
                                          (0, 1, 16, 16), (5, 0, 8, 8)])  # fmt: skip
@pytest.mark.parametrize("wgrad", [False, True])
def test_default_config_is_valid(m, groups, n, k, wgrad):
    for arch in (flydsl.arch.SM90, flydsl.arch.INTERPRETER):
        for dtype in (torch.bfloat16, torch.float16):
            cfg = _mod.default_grouped_gemm_config(m, groups, n, k, dtype, arch, wgrad)
            assert _mod.grouped_gemm_config_valid(cfg, dtype, arch), cfg


def test_training_size_default_is_128_tiles():
    cfg = _mod.default_grouped_gemm_config(16384, 8, 4096, 4096, torch.bfloat16, flydsl.arch.SM90)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps) == (128, 128, 64, 8)
    assert cfg.num_stages in (3, 4)


BAD_CONFIGS = [
    GroupedGemmConfig(8, 32, 32),  # below the dot's 16
    GroupedGemmConfig(16, 48, 32),  # not a power of two
    GroupedGemmConfig(16, 32, 32, num_warps=3),
    GroupedGemmConfig(16, 32, 32, num_stages=0),
    GroupedGemmConfig(256, 256, 128, num_stages=4),  # past the shared memory
    GroupedGemmConfig(16, 32, 32, group_m=0),
]


@pytest.mark.parametrize("cfg", BAD_CONFIGS)
def test_invalid_configs_are_refused(cfg):
    assert not _mod.grouped_gemm_config_valid(cfg, torch.bfloat16, flydsl.arch.SM90)
    a, b = _operands(8, 32, 16, 1, torch.bfloat16, seed=0)
    with pytest.raises(ArgumentError, match="config"):
        _mod._grouped_gemm(a, b, _sizes_to_offsets([8]), None, cfg)


# ---------------------------------------------------------------- bad input


def _bad_inputs():
    a, b = _operands(10, 32, 16, 2, torch.bfloat16, seed=0, device="cpu")
    offs = torch.tensor([4, 10], dtype=torch.int32)
    meta = torch.device("meta")
    return [
        (lambda: grouped_gemm(a.tolist(), b, offs), ArgumentError, "a: expected a torch.Tensor"),
        (lambda: grouped_gemm(a.float(), b, offs), DTypeError, "a: expected dtype bf16 or fp16"),
        (lambda: grouped_gemm(a[0], b, offs), ShapeError, "a: expected a 2-D"),
        (lambda: grouped_gemm(a, b.half(), offs), DTypeError, "b: expected dtype bf16"),
        (lambda: grouped_gemm(a, b[0], offs), ShapeError, "b: expected a 3-D"),
        (lambda: grouped_gemm(a, b[:, :, :16], offs), ShapeError, r"b: expected \[G, N, 32\]"),
        (lambda: grouped_gemm(a, b, offs.long()), DTypeError, "offsets: expected dtype int32"),
        (lambda: grouped_gemm(a, b, offs[:1]), ShapeError, r"offsets: expected \[2\]"),
        (lambda: grouped_gemm(a, b, offs[None]), ShapeError, "offsets: expected a 1-D"),
        (lambda: grouped_gemm(a, b, offs, out_dtype=torch.int8), DTypeError, "out_dtype"),
        (lambda: grouped_gemm(a, b.to(meta), offs), DeviceError, "b: expected a tensor on cpu"),
        (lambda: grouped_gemm(a, b, offs.to(meta)), DeviceError, "offsets: expected a tensor on cpu"),
        # on the CPU the offsets are read: decreasing, negative and past M_total are named
        (lambda: grouped_gemm(a, b, torch.tensor([6, 4], dtype=torch.int32)), ArgumentError, "offsets: .*non-decr"),
        (lambda: grouped_gemm(a, b, torch.tensor([-1, 4], dtype=torch.int32)), ArgumentError, "offsets"),
        (lambda: grouped_gemm(a, b, torch.tensor([4, 11], dtype=torch.int32)), ArgumentError, r"\[0, 10\]"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_bad_input_is_named(case):
    call, error, words = _bad_inputs()[case]
    with pytest.raises(error, match=words):
        call()


def test_bad_input_is_named_under_autograd():
    a, b = _operands(10, 32, 16, 2, torch.bfloat16, seed=0, device="cpu")
    a.requires_grad_(True)
    with pytest.raises(ShapeError, match=r"offsets: expected \[2\]"):
        grouped_gemm(a, b, torch.tensor([10], dtype=torch.int32))


# ---------------------------------------------------------------- GPU: training sizes


def _skewed_sizes(m, groups, seed, empty_every=0):
    """Group sizes summing to m, skewed as a router's (a few hot experts), some groups empty."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=gen) ** 3
    if empty_every:
        weights[::empty_every] = 0
    sizes = (weights / weights.sum() * m).floor().long()
    sizes[int(weights.argmax())] += m - int(sizes.sum())
    return sizes.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,k,n,groups,empty_every",
    [
        (16384, 4096, 4096, 8, 0),
        (16384, 2048, 1408, 64, 5),
        (8192, 512, 4096, 128, 3),
        (4096, 4096, 512, 32, 0),
        (12000, 1000, 1544, 16, 4),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_training_sizes(device, m, k, n, groups, empty_every, dtype):
    a, b = _operands(m, k, n, groups, dtype, seed=m + groups, device=device)
    sizes = _skewed_sizes(m, groups, seed=groups, empty_every=empty_every)
    _check_forward_backward(a, b, _sizes_to_offsets(sizes, device), seed=groups)


@pytest.mark.gpu
def test_gpu_all_rows_in_one_group_and_tail(device):
    a, b = _operands(16384, 1024, 2048, 16, torch.bfloat16, seed=1, device=device)
    sizes = [0] * 16
    sizes[9] = 16000  # 384 rows past the last offset
    out, da, _ = _check_forward_backward(a, b, _sizes_to_offsets(sizes, device))
    assert (out[16000:] == 0).all() and (da[16000:] == 0).all()


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_cuda_graph_capture_and_inductor(device):
    a, b = _operands(4096, 1024, 1024, 8, torch.bfloat16, seed=2, device=device)
    offsets = _sizes_to_offsets(_skewed_sizes(4096, 8, seed=2), device)
    grouped_gemm(a, b, offsets)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm(a, b, offsets)
    out.fill_(float("nan"))
    graph.replay()
    assert_rel_close(out, grouped_gemm_ref(a, b, offsets), tol=tolerance(torch.bfloat16))
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, o: grouped_gemm(a, b, o) * 2, fullgraph=True)
    assert_rel_close(fn(a, b, offsets) / 2, grouped_gemm_ref(a, b, offsets), tol=tolerance(torch.bfloat16))
