"""``fused_moe`` against the fp32 loop-over-experts reference by relative error (poisoned outputs, so an
unwritten row fails): fp16 and bf16, SiLU / GELU, the router weight on the output or the input, k = 1-4,
odd hidden and intermediate sizes, experts with no tokens, every token on one expert, int32 and int64 ids,
-1 slots (expert parallelism), strided operands, out= (and out=x), 16-bit and strided router weights, several
tile configs, zero tokens, meta tensors, fresh routing call after call (the alignment's padded bound above
the real row count); bad input named by argument; a host path of allocations, views and flyc launches only
(no host synchronization: what CUDA graph capture and flydsl.direct's replays need). GPU cases at the
models' sizes (Mixtral 8x7B, DeepSeek-V3 routing on 64 and 256 experts, Qwen3-30B-A3B), CUDA graph capture
and replayed eager calls carry the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flydsl.compiler as flyc
from fly_gemm import moe as moe_mod
from fly_gemm.moe import fused_moe
from fly_gemm.moe_config import MoeConfig
from fly_gemm.moe_reference import fused_moe_ref, topk_softmax_ref
from fly_gemm.moe_routing import grouped_topk, topk_softmax
from flydsl import direct
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, default_device, empty_poisoned, tolerance

DEV = default_device()


def _layer(t, h, inter, e, k, dtype, seed, device=DEV, ids_dtype=torch.int32):
    """Unit-scale inputs and weights (as a trained layer's: outputs near 1) and softmax routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w1 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(t, e, generator=g)
    x, w1, w2 = (v.to(device) for v in (x, w1, w2))
    # routed where kernels run (a CPU tensor on a GPU machine is refused), then moved to ``device``
    w, ids = (v.to(device) for v in topk_softmax(logits.to(DEV), k))
    return x, w1, w2, w, ids.to(ids_dtype)


def _check(y, x, w1, w2, w, ids, **kw):
    ref = fused_moe_ref(x, w1, w2, w, ids, activation=kw.get("activation", "silu"),
                        apply_router_weight_on_input=kw.get("apply_router_weight_on_input", False))  # fmt: skip
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_rel_close(y, ref, tol=tolerance(x.dtype))


# (T, H, I, E, k): one token, k = 1; odd H and I (partial tiles in N and K); k = 4 over 8 experts at 50
# tokens; more experts than tokens (most empty); I wider than H
CASES = [(1, 32, 32, 4, 1), (23, 72, 40, 6, 2), (50, 64, 64, 8, 4), (5, 48, 24, 16, 3), (17, 32, 96, 8, 2)]


@pytest.mark.parametrize("t,h,inter,e,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_matches_reference(t, h, inter, e, k, dtype):
    x, w1, w2, w, ids = _layer(t, h, inter, e, k, dtype, seed=t * 31 + e)
    out = empty_poisoned(t, h, dtype=dtype, device=DEV)
    y = fused_moe(x, w1, w2, w, ids, out=out)
    assert y is out
    _check(y, x, w1, w2, w, ids)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_activation_and_router_weight_placement(activation, on_input):
    x, w1, w2, w, ids = _layer(19, 64, 48, 6, 2, torch.float16, seed=7)
    w = w * 3.0  # weights away from 1, so weighting the input and the output differ
    y = fused_moe(x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=on_input)
    _check(y, x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=on_input)
    other = fused_moe_ref(x, w1, w2, w, ids, activation=activation, apply_router_weight_on_input=not on_input)
    assert (y.double() - other.to(y.device).double()).norm() > 0.05 * other.double().norm()


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_fused_moe_empty_experts_and_one_expert(ids_dtype):
    x, w1, w2, w, ids = _layer(29, 32, 32, 8, 2, torch.float16, seed=3, ids_dtype=ids_dtype)
    ids = torch.where(ids % 2 == 0, 6, 1).to(ids_dtype)  # experts 0, 2-5 and 7 get no rows
    ids[:, 1] = torch.where(ids[:, 0] == 6, 1, 6)  # a token's two slots on distinct experts
    _check(fused_moe(x, w1, w2, w, ids), x, w1, w2, w, ids)
    one = torch.full_like(ids[:, :1], 5)  # every token on expert 5, k = 1
    _check(fused_moe(x, w1, w2, w[:, :1], one), x, w1, w2, w[:, :1], one)


def test_fused_moe_minus_one_slots_contribute_nothing():
    x, w1, w2, w, ids = _layer(21, 32, 48, 4, 3, torch.float16, seed=5)
    ids[::3, 1] = -1
    ids[4] = -1  # a token with no local expert: its output is zero
    y = fused_moe(x, w1, w2, w, ids, out=empty_poisoned(21, 32, dtype=torch.float16, device=DEV))
    _check(y, x, w1, w2, w, ids)
    assert torch.count_nonzero(y[4]) == 0


def test_fused_moe_strided_operands_and_out_is_x():
    x, w1, w2, w, ids = _layer(13, 48, 40, 4, 2, torch.bfloat16, seed=9)
    xs = torch.empty(13, 96, dtype=x.dtype, device=DEV)[:, ::2]
    xs.copy_(x)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] with H the strided-by-2I dimension
    w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    wt = w.t().contiguous().t()
    idst = ids.t().contiguous().t()
    _check(fused_moe(xs, w1t, w2t, wt, idst), x, w1, w2, w, ids)
    inplace = x.clone()
    y = fused_moe(inplace, w1, w2, w, ids, out=inplace)
    assert y is inplace
    _check(y, x, w1, w2, w, ids)


def test_fused_moe_router_weights_16bit_and_strided():
    """The GEMM reads the router weights in place (no converted copy): bf16 / fp16, transposed storage."""
    x, w1, w2, w, ids = _layer(11, 48, 32, 6, 3, torch.float16, seed=13)
    for wd in (w.to(torch.bfloat16), w.to(torch.float16).t().contiguous().t()):
        for on_input in (False, True):
            y = fused_moe(x, w1, w2, wd, ids, apply_router_weight_on_input=on_input,
                          out=empty_poisoned(11, 48, dtype=torch.float16, device=DEV))  # fmt: skip
            _check(y, x, w1, w2, wd, ids, apply_router_weight_on_input=on_input)


def test_fused_moe_fresh_routing_each_call():
    """Calls of one shape with fresh inputs and routing (as a decode loop makes them): the buffers are sized for
    the alignment's bound (T * k + E * (block_m - 1)), far above the rows in use at small T, and each call's
    result matches the reference; the routing of one call leaves nothing behind for the next."""
    cfg = MoeConfig(16, 32, 32, group_m=1)
    for t in (1, 9):
        for seed in range(2):
            x, w1, w2, w, ids = _layer(t, 40, 24, 32, 4, torch.bfloat16, seed=100 * t + seed)
            if seed == 1:
                ids[:, 0] = 31  # every token on the last expert too
            y = fused_moe(x, w1, w2, w, ids, config=cfg, out=empty_poisoned(t, 40, dtype=torch.bfloat16,
                          device=DEV))  # fmt: skip
            _check(y, x, w1, w2, w, ids)


_SYNCS = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique2", "equal", "is_nonzero", "masked_select",
          "_to_copy", "copy_"}  # fmt: skip


class _HostOps(TorchDispatchMode):
    """Every torch op of the host path; a read of a tensor's value on the host fails at once."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _SYNCS:
            raise AssertionError(f"fused_moe's host path ran {func}: a device synchronization / copy")
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("t,ids_dtype,on_input", [(1, torch.int32, False), (16, torch.int64, True),
                                                  (300, torch.int32, False)])  # fmt: skip
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_fused_moe_host_path_has_no_sync_and_only_allocates(monkeypatch, t, ids_dtype, on_input):
    """What CUDA graph capture and flydsl.direct's replay of an eager call need: no op reads a tensor's value on
    the host (``.item()``, ``int(t)``, ``nonzero``...: ``aten._local_scalar_dense`` and kin, a sync on a GPU),
    no fill or copy; every torch op an allocation or a view; the six kernels launched through flyc.launch. The
    kernels are recorded, not run (their values are the other tests'); the CPU-only read of the ids'
    values (an error check that a GPU call never makes: ``check_id_values`` reads device ids never) is
    left out, as it is on a GPU."""
    launches = []
    monkeypatch.setattr(flyc, "launch", lambda kernel, grid, *a, **kw: launches.append(kernel))
    monkeypatch.setattr(moe_mod, "check_id_values", lambda ids, e: None)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
    w1 = torch.randn(32, 96, 64, generator=g).to(torch.bfloat16)
    w2 = torch.randn(32, 64, 48, generator=g).to(torch.bfloat16)
    w, ids = topk_softmax_ref(torch.randn(t, 32, generator=g), 8)
    ids = ids.to(ids_dtype)
    with _HostOps() as mode:
        fused_moe(x, w1, w2, w, ids, apply_router_weight_on_input=on_input)
    foreign = [op for op in mode.ops if op not in direct._ALLOCATIONS and op not in direct._VIEWS]
    assert not foreign, f"torch ops other than allocations and views: {foreign}"
    assert sum(op in direct._ALLOCATIONS for op in mode.ops) <= 4  # out, the alignment's buffer, 2 row buffers
    assert len(launches) == 6, launches


@pytest.mark.parametrize(
    "cfg",
    [MoeConfig(16, 16, 16, group_m=1), MoeConfig(32, 64, 16, group_m=8), MoeConfig(16, 32, 64, group_m=2)],
    ids=str,
)
def test_fused_moe_tile_configs(cfg):
    x, w1, w2, w, ids = _layer(37, 80, 56, 8, 2, torch.float16, seed=11)
    _check(fused_moe(x, w1, w2, w, ids, config=cfg), x, w1, w2, w, ids)


def test_fused_moe_zero_tokens_and_meta():
    x, w1, w2, w, ids = _layer(0, 32, 32, 4, 2, torch.float16, seed=1)
    assert fused_moe(x, w1, w2, w, ids).shape == (0, 32)
    m = torch.device("meta")
    y = fused_moe(torch.empty(5, 32, dtype=torch.bfloat16, device=m), torch.empty(4, 64, 32, dtype=torch.bfloat16,
                  device=m), torch.empty(4, 32, 32, dtype=torch.bfloat16, device=m),
                  torch.empty(5, 2, device=m), torch.empty(5, 2, dtype=torch.int32, device=m))  # fmt: skip
    assert y.shape == (5, 32) and y.dtype == torch.bfloat16 and y.is_meta


def test_fused_moe_bad_input_names_the_argument():
    x, w1, w2, w, ids = _layer(6, 32, 16, 4, 2, torch.float16, seed=2, device=torch.device("cpu"))
    bad = [
        (DTypeError, "x: expected dtype bf16 or fp16", dict(x=x.float())),
        (UnsupportedError, "x: fp8", dict(x=x.to(torch.float8_e4m3fn))),
        (DTypeError, "w1: expected dtype fp16", dict(w1=w1.bfloat16())),
        (ShapeError, "w1: expected \\[E, 2 \\* I, 32\\]", dict(w1=w1[:, :, :16])),
        (ShapeError, "w1: expected", dict(w1=w1[:, :31])),
        (ShapeError, "w2: expected \\[4, 32, 16\\]", dict(w2=w2[:3])),
        (ShapeError, "topk_ids: expected \\[6, k\\]", dict(ids=ids[:5])),
        (DTypeError, "topk_ids", dict(ids=ids.float())),
        (ShapeError, "topk_weights: expected \\[6, 2\\]", dict(w=w[:, :1])),
        (ArgumentError, "topk_ids: expected expert ids in \\[0, 4\\)", dict(ids=ids + 4)),
        (ArgumentError, "activation", dict(activation="relu")),
        (ArgumentError, "w1_scale: given with fp16 weights", dict(w1_scale=torch.ones(4))),
        (ArgumentError, "block_shape: given with fp16 weights", dict(block_shape=[128, 128])),
        (ShapeError, "out: expected \\[6, 32\\]", dict(out=torch.empty(6, 31, dtype=torch.float16))),
        (DTypeError, "out", dict(out=torch.empty(6, 32))),
        (ArgumentError, "config: .* not a valid", dict(config=MoeConfig(24, 32, 32))),
        (ArgumentError, "apply_router_weight_on_input", dict(apply_router_weight_on_input=1)),
    ]
    for err, match, change in bad:
        args = dict(x=x, w1=w1, w2=w2, w=w, ids=ids)
        kw = {k: v for k, v in change.items() if k not in args}
        args.update({k: v for k, v in change.items() if k in args})
        with pytest.raises(err, match=match):
            fused_moe(args["x"], args["w1"], args["w2"], args["w"], args["ids"], **kw)


# ------------------------------------------------------------------ GPU, the models' sizes


def _gpu_layer(t, h, inter, e, k, seed, grouped=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
    w1 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5).to(torch.bfloat16)
    logits = torch.randn(t, e, device="cuda", generator=g)
    if grouped is None:
        w, ids = topk_softmax(logits, k)
    else:
        groups, topk_group = grouped
        bias = torch.randn(e, device="cuda", generator=g) * 0.1
        w, ids = grouped_topk(logits, k, groups, topk_group, correction_bias=bias, routed_scaling_factor=2.5)
    return x, w1, w2, w, ids


# (T, H, I, E, k, grouped): Mixtral 8x7B at decode and prefill; DeepSeek-V3 routing on 64 and 256
# experts (8 groups, 4 kept); Qwen3-30B-A3B; odd token counts
GPU_CASES = [
    (1, 4096, 14336, 8, 2, None),
    (3, 4096, 14336, 8, 2, None),
    (1000, 4096, 14336, 8, 2, None),
    (64, 7168, 2048, 64, 6, (8, 4)),
    (513, 7168, 2048, 256, 8, (8, 4)),
    (1024, 2048, 768, 128, 8, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,inter,e,k,grouped", GPU_CASES)
def test_fused_moe_gpu_model_sizes(t, h, inter, e, k, grouped):
    x, w1, w2, w, ids = _gpu_layer(t, h, inter, e, k, seed=t + e, grouped=grouped)
    out = empty_poisoned(t, h, dtype=torch.bfloat16, device="cuda")
    y = fused_moe(x, w1, w2, w, ids, out=out)
    _check(y, x, w1, w2, w, ids)


@pytest.mark.gpu
def test_fused_moe_gpu_deterministic_and_all_on_one_expert():
    x, w1, w2, w, ids = _gpu_layer(777, 4096, 14336, 8, 2, seed=1)
    assert torch.equal(fused_moe(x, w1, w2, w, ids), fused_moe(x, w1, w2, w, ids))
    ids = torch.zeros_like(ids)
    ids[:, 1] = 3
    _check(fused_moe(x, w1, w2, w, ids), x, w1, w2, w, ids)


def _gpu_routing(t, e, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    w, ids = topk_softmax(torch.randn(t, e, device="cuda", generator=g), k)
    return x, w, ids


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.graph
def test_fused_moe_gpu_cuda_graph_capture(t):
    """Captured once at Qwen3-30B-A3B's decode shapes, replayed with new tokens and new routing of the same
    shapes (one replay with every token on the same 8 experts): nothing of the call depends on the routing on
    the host or synchronizes, so each replay matches the reference (the output poisoned before each)."""
    x, w1, w2, w, ids = _gpu_layer(t, 2048, 768, 128, 8, seed=21)
    out = torch.empty_like(x)
    fused_moe(x, w1, w2, w, ids, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w1, w2, w, ids, out=out)
    for seed in range(3):
        nx, nw, nids = _gpu_routing(t, 128, 8, seed)
        if seed == 2:
            nids = torch.arange(120, 128, device="cuda", dtype=torch.int32).expand(t, 8).contiguous()
        x.copy_(nx)
        w.copy_(nw)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, w1, w2, w, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t,with_out", [(1, False), (16, False), (16, True)])
def test_fused_moe_gpu_replayed_calls_match_the_reference(monkeypatch, t, with_out):
    """Plain eager calls replay the first call's launches (flydsl.direct): every later call, on fresh tokens and
    routing of the same layouts, is a replay, matches the reference and returns a fresh output (or the
    ``out`` given). Plain allocations only: a poisoning fill inside a recorded call would make it decline."""
    replayed = []
    real = direct._Plan.replay
    monkeypatch.setattr(direct._Plan, "replay", lambda plan, args: replayed.append(1) or real(plan, args))
    moe_mod._REPLAYS.clear()
    _, w1, w2, _, _ = _gpu_layer(1, 2048, 768, 128, 8, seed=5)
    outs = []
    for seed in range(4):  # the first call records, the next ones replay
        x, w, ids = _gpu_routing(t, 128, 8, 10 + seed)
        out = torch.empty_like(x) if with_out else None
        y = fused_moe(x, w1, w2, w, ids, out=out)
        assert out is None or y is out
        _check(y, x, w1, w2, w, ids)
        outs.append(y)
    assert len({o.data_ptr() for o in outs}) == len(outs)
    assert len(replayed) == 3, "the calls after the first were not replayed"
