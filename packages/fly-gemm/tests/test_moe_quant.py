"""``fused_moe`` with quantized expert weights: fp8 e4m3 per output channel, fp8 block-scaled (DeepSeek-V3's
128 x 128 blocks, and smaller blocks on shapes that are not multiples of them), int8 w8a8 per channel.

Each result is compared twice: against ``fused_moe_ref`` given the same quantized weights (it dequantizes them
and quantizes the activations with the kernels' arithmetic, so only summation order and the output's rounding
differ: x's dtype's tolerance), and against the unquantized fp32 layer with a bound from the quantization
itself (see ``_QUANT_BOUND``). Bad quantization arguments are named; the quantized host path is allocations,
views and flyc launches only. GPU cases at the models' sizes carry the ``gpu`` marker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fly_gemm import moe as moe_mod
from fly_gemm.moe import fused_moe
from fly_gemm.moe_config import MoeConfig
from fly_gemm.moe_reference import (
    dequantize_weight_ref,
    fused_moe_ref,
    quantize_groups_ref,
    unpack_fp4_ref,
    unpack_int4_ref,
)
from fly_gemm.moe_routing import grouped_topk, topk_softmax
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, default_device, empty_poisoned, host_work, rel_error, tolerance
from flydsl.testing.sm90 import run_compile_script

DEV = default_device()
FP8 = torch.float8_e4m3fn

# Relative error of the quantized layer against the unquantized one: four quantizations (x, W1, the
# intermediate, W2), each with a relative rms error of at most 2**-4 / sqrt(3) ~ 3.6% for fp8 e4m3 (3
# mantissa bits, round to nearest), ~7% if independent, bounded at twice that; int8 with a scale a row of a
# Gaussian (amax ~ 3.5 rms): ~ 3.5 / (127 sqrt(12)) ~ 0.8% each, ~1.6% together, bounded at three times that.
# Int4 weights (uint8: packed pairs; x and the intermediate not quantized) in groups of 32 Gaussian values
# (amax ~ 2.2 rms): ~ 2.2 / (7 sqrt(12)) ~ 9.1% each; gate, up and W2 noisy: ~ sqrt(3) x 9.1% ~ 16%, bounded
# at twice that.
# MXFP4 (e2m1: 1 mantissa bit, values 0.5-6 a power-of-two scale): ~ 11.5% rms a value across the grid,
# more for the small values of a group; ~13% each, sqrt(3) x 13% ~ 23% for the three noisy factors,
# bounded at twice that.
_QUANT_BOUND = {FP8: 0.15, torch.int8: 0.05, torch.uint8: 0.32, "mxfp4": 0.45}
INT4 = torch.uint8

# (weight dtype, block_shape): the four formats
MODES = [(FP8, None), (torch.int8, None), (FP8, [128, 128]), (INT4, [1, 32])]
MODE_IDS = ["fp8-channel", "int8-channel", "fp8-block128", "int4-g32"]


def quantize_weight(w: torch.Tensor, qdtype: torch.dtype, block_shape=None):
    """(q, fp32 scale) of fp32 weights [E, N, K]: symmetric, one scale an output channel ([E, N]) or a
    ``block_shape`` block ([E, cdiv(N, bn), cdiv(K, bk)]), as checkpoints ship them. ``torch.uint8``: int4
    values in [-7, 7], two a byte along K (low nibble first), [E, N, K / 2]."""
    qmax = {torch.int8: 127.0, INT4: 7.0}.get(qdtype, 448.0)
    e, n, k = w.shape
    if block_shape is None:
        scale = w.abs().amax(-1) / qmax
        full = scale[:, :, None]
    else:
        bn, bk = block_shape
        gn, gk = -(-n // bn), -(-k // bk)
        padded = torch.zeros(e, gn * bn, gk * bk, dtype=w.dtype, device=w.device)
        padded[:, :n, :k] = w
        scale = padded.view(e, gn, bn, gk, bk).abs().amax((2, 4)) / qmax
        full = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
    v = (w / torch.where(full > 0, full, torch.ones_like(full))).clamp(-qmax, qmax)  # all-zero rows: q = 0
    if qdtype == INT4:
        nib = torch.round(v).to(torch.int16) & 15
        q = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    else:
        q = torch.round(v).to(torch.int8) if qdtype == torch.int8 else v.to(FP8)
    return q, scale.float()


E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor, group: int = 32):
    """(uint8 fp4 e2m1 pairs [E, N, K / 2], e8m0 scales [E, N, cdiv(K, group)]) of fp32 weights, as gpt-oss
    ships them: a power-of-two scale a group (the smallest with 6 x scale >= the group's amax), each value
    rounded to the nearest e2m1 code (ties to the lower magnitude)."""
    e, n, k = w.shape
    groups = -(-k // group)
    padded = torch.zeros(e, n, groups * group, dtype=torch.float32, device=w.device)
    padded[:, :, :k] = w
    amax = padded.view(e, n, groups, group).abs().amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-100) / 6.0)).clamp(-126, 127))
    v = w / scale.repeat_interleave(group, 2)[:, :, :k]
    grid = _FP4_GRID.to(w.device)
    code = (v.abs()[..., None] - grid).abs().argmin(-1) | ((v < 0).long() << 3)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), scale.to(E8M0)


def _layer(t, h, inter, e, k, dtype, qdtype, block_shape, seed, empty_expert=True, device=DEV):
    """Unit-scale inputs and weights; softmax routing that never picks the last expert (an expert with no
    rows) when ``empty_expert``. Returns the activations, fp32 weights, quantized weights and scales, routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w1 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    logits = torch.randn(t, e, generator=g)
    if empty_expert:
        logits[:, -1] = -1e4
    if qdtype == "mxfp4":
        (q1, s1), (q2, s2) = quantize_mxfp4(w1, block_shape[1]), quantize_mxfp4(w2, block_shape[1])
    else:
        q1, s1 = quantize_weight(w1, qdtype, block_shape)
        q2, s2 = quantize_weight(w2, qdtype, block_shape)
    x, w1, w2, q1, s1, q2, s2 = (v.to(device) for v in (x, w1, w2, q1, s1, q2, s2))
    # routed where kernels run (a CPU tensor on a GPU machine is refused), then moved to ``device``
    w, ids = (v.to(device) for v in topk_softmax(logits.to(DEV), k))
    return x, (w1, w2), (q1, q2, s1, s2), w, ids


def _check(y, x, wf, q, w, ids, block_shape, **kw):
    q1, q2, s1, s2 = q
    ref = fused_moe_ref(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape, **kw)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_rel_close(y, ref, tol=tolerance(x.dtype), name="against the quantized reference")
    plain = fused_moe_ref(x, wf[0], wf[1], w, ids, **kw)
    err = rel_error(y, plain)
    bound = _QUANT_BOUND["mxfp4" if s1.dtype == E8M0 else q1.dtype]
    assert err <= bound, f"against the unquantized layer: relative error {err:.3e}"


def test_reference_quantization_helpers():
    """The test's weight quantizer and the reference's dequantizer and activation quantizer agree with the
    formats' definitions on hand-checkable values."""
    w = torch.tensor([[[1.0, -2.0, 4.0], [0.0, 0.0, 0.0]]])  # [1, 2, 3]
    q, s = quantize_weight(w, torch.int8)
    assert torch.equal(s, torch.tensor([[4.0 / 127, 0.0]]))
    assert torch.equal(q[0, 0], torch.tensor([32, -64, 127], dtype=torch.int8))  # 31.75 -> 32, -63.5 -> -64
    assert torch.allclose(dequantize_weight_ref(q, s), w, atol=4.0 / 127 / 2)
    qb, sb = quantize_weight(w, FP8, [1, 2])
    assert sb.shape == (1, 2, 2) and torch.equal(sb[0, 0], torch.tensor([2.0 / 448, 4.0 / 448]))
    close = dict(rtol=1e-6, atol=0.0)  # the scales' fp32 rounding only
    assert torch.allclose(dequantize_weight_ref(qb, sb, [1, 2]), w, **close)  # q 224, -448, 448: exact in e4m3
    a = torch.tensor([[3.0, -1.5, 0.0, 0.0, 0.0]])
    assert torch.allclose(quantize_groups_ref(a, FP8, 5), a, **close)  # q 448 and -224: exact in e4m3
    assert torch.allclose(quantize_groups_ref(a, FP8, 2), a, **close)  # the all-zero group: scale 0, zeros
    assert torch.equal(quantize_groups_ref(torch.tensor([[127.0, 0.5, -0.5, 1.5]]), torch.int8, 4),
                       torch.tensor([[127.0, 0.0, -0.0, 2.0]]))  # ties to even  # fmt: skip
    packed = torch.tensor([[[0x1F, 0x87, 0x00]]], dtype=torch.uint8)  # low nibble first, two's complement
    assert torch.equal(unpack_int4_ref(packed), torch.tensor([[[-1, 1, 7, -8, 0, 0]]], dtype=torch.int8))
    q4, s4 = quantize_weight(torch.tensor([[[7.0, -3.5, 1.0, 0.0]]]), INT4, [1, 4])
    assert torch.equal(s4, torch.tensor([[[1.0]]])) and torch.equal(unpack_int4_ref(q4)[0, 0], torch.tensor(
        [7, -4, 1, 0], dtype=torch.int8))  # -3.5 -> -4: ties to even  # fmt: skip


@pytest.mark.parametrize("qdtype,block_shape", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("t,k", [(1, 1), (3, 2), (64, 2)])
def test_quant_matches_reference(qdtype, block_shape, t, k):
    x, wf, q, w, ids = _layer(t, 256, 128, 4, k, torch.bfloat16, qdtype, block_shape, seed=t * 7 + k)
    q1, q2, s1, s2 = q
    out = empty_poisoned(t, 256, dtype=torch.bfloat16, device=DEV)
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape, out=out)
    assert y is out
    _check(y, x, wf, q, w, ids, block_shape)


@pytest.mark.parametrize("qdtype,block_shape", MODES, ids=MODE_IDS)
def test_quant_fp16_gelu_router_weight_on_input(qdtype, block_shape):
    x, wf, q, w, ids = _layer(19, 256, 128, 4, 2, torch.float16, qdtype, block_shape, seed=5)
    w = w * 3.0  # away from 1, so weighting the input and the output differ
    q1, q2, s1, s2 = q
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape, activation="gelu",
                  apply_router_weight_on_input=True)  # fmt: skip
    _check(y, x, wf, q, w, ids, block_shape, activation="gelu", apply_router_weight_on_input=True)


@pytest.mark.parametrize(
    "h,inter,block_shape",
    [(200, 72, [128, 128]), (96, 80, [64, 32]), (72, 40, [48, 32])],
    ids=["partial-128", "up-rows-straddle-64x32", "bn48-bk32"],
)
@pytest.mark.parametrize("qdtype", [FP8, INT4], ids=["fp8", "int4"])
def test_block_scaled_shapes_not_multiples_of_the_block(h, inter, block_shape, qdtype):
    """Partial blocks at the ends of N and K; I not a multiple of block_n, so the up rows [I, 2I) of w1
    start inside a scale block (each column reads its own block's scale)."""
    x, wf, q, w, ids = _layer(23, h, inter, 4, 2, torch.bfloat16, qdtype, block_shape, seed=h + inter)
    q1, q2, s1, s2 = q
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape,
                  out=empty_poisoned(23, h, dtype=torch.bfloat16, device=DEV))  # fmt: skip
    _check(y, x, wf, q, w, ids, block_shape)


@pytest.mark.parametrize("qdtype", [FP8, torch.int8], ids=["fp8", "int8"])
def test_per_channel_odd_shapes(qdtype):
    """H and I off the tile grid (partial tiles in N and K) with per-channel scales."""
    x, wf, q, w, ids = _layer(23, 72, 40, 4, 2, torch.bfloat16, qdtype, None, seed=11)
    q1, q2, s1, s2 = q
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2,
                  out=empty_poisoned(23, 72, dtype=torch.bfloat16, device=DEV))  # fmt: skip
    _check(y, x, wf, q, w, ids, None)


@pytest.mark.skipif(E8M0 is None, reason="this torch has no float8_e8m0fnu")
@pytest.mark.parametrize("t,k,h,inter", [(1, 1, 256, 128), (3, 2, 256, 128), (64, 2, 256, 128), (23, 2, 96, 40)])
def test_mxfp4_matches_reference(t, k, h, inter):
    """MXFP4 weights (uint8 fp4 e2m1 pairs, e8m0 scales a 32-group, weight-only); I = 40: a partial group."""
    x, wf, q, w, ids = _layer(t, h, inter, 4, k, torch.bfloat16, "mxfp4", [1, 32], seed=t + h)
    q1, q2, s1, s2 = q
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[1, 32],
                  out=empty_poisoned(t, h, dtype=torch.bfloat16, device=DEV))  # fmt: skip
    _check(y, x, wf, q, w, ids, [1, 32])
    assert torch.equal(unpack_fp4_ref(torch.tensor([[0x9F, 0x70]], dtype=torch.uint8)),
                       torch.tensor([[-6.0, -0.5, 0.0, 6.0]]))  # fmt: skip


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 64), ("mxfp4", 32)])
def test_w4a8_fp8_activations(fmt, group):
    """4-bit weights with fp8 activations (``compute_dtype=torch.float8_e4m3fn``): x and the intermediate
    quantized in 1 x group groups, the 4-bit codes in an fp8 dot, both group scales each K step; I = 96 leaves
    a partial group of 64. Against the reference's same quantizations and the unquantized layer."""
    if fmt == "mxfp4" and E8M0 is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    x, wf, q, w, ids = _layer(19, 128, 96, 4, 2, torch.bfloat16, INT4 if fmt == "int4" else "mxfp4", [1, group],
                              seed=group)  # fmt: skip
    q1, q2, s1, s2 = q
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[1, group], compute_dtype=FP8,
                  out=empty_poisoned(19, 128, dtype=torch.bfloat16, device=DEV))  # fmt: skip
    _check(y, x, wf, q, w, ids, [1, group], compute_dtype=FP8)
    weight_only = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[1, group])
    assert not torch.equal(y, weight_only)  # the activations were quantized: another (close) result


def test_quant_scale_layouts_minus_one_slots_and_configs():
    """Per-channel scales as [E, N, 1] and transposed storage; -1 slots (expert parallelism); explicit tile
    configs, block_k below the scale block."""
    x, wf, q, w, ids = _layer(17, 256, 128, 4, 2, torch.bfloat16, FP8, None, seed=3)
    q1, q2, s1, s2 = q
    ids[::4, 1] = -1
    s1t = s1.t().contiguous().t()
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1t[:, :, None], w2_scale=s2[:, :, None])
    _check(y, x, wf, q, w, ids, None)
    x, wf, q, w, ids = _layer(17, 256, 128, 4, 2, torch.bfloat16, FP8, [128, 128], seed=4)
    q1, q2, s1, s2 = q
    for cfg in (MoeConfig(16, 16, 32, group_m=1), MoeConfig(32, 64, 64, group_m=2)):
        y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[128, 128], config=cfg)
        _check(y, x, wf, q, w, ids, [128, 128])


def test_quant_bad_input_names_the_argument():
    x, _, q, w, ids = _layer(6, 64, 32, 4, 2, torch.bfloat16, FP8, None, seed=2, device=torch.device("cpu"))
    q1, q2, s1, s2 = q
    qb1, sb1 = quantize_weight(torch.randn(4, 64, 64), FP8, [32, 32])
    qb2, sb2 = quantize_weight(torch.randn(4, 64, 32), FP8, [32, 32])
    block = dict(w1=qb1, w2=qb2, w1_scale=sb1, w2_scale=sb2, block_shape=[32, 32])
    q41, s41 = quantize_weight(torch.randn(4, 64, 64), INT4, [1, 32])
    q42, s42 = quantize_weight(torch.randn(4, 64, 32), INT4, [1, 32])
    int4 = dict(w1=q41, w2=q42, w1_scale=s41, w2_scale=s42, block_shape=[1, 32])
    bad = [
        (DTypeError, "w2_scale: expected dtype fp32", dict(int4, w2_scale=s42.to(E8M0))),
        (DTypeError, "w1_scale", dict(w1_scale=s1.to(E8M0))),
        (ArgumentError, "block_shape: required with uint8", dict(int4, block_shape=None)),
        (ShapeError, "w1: expected \\[E, 2 \\* I, 32\\] \\(uint8: packed int4", dict(int4, w1=qb1.view(torch.uint8))),
        (ShapeError, "w2: expected \\[4, 64, 16\\]", dict(int4, w2=q42[:, :, :8])),
        (ShapeError, "w1_scale: expected \\[4, 64, 2\\]", dict(int4, w1_scale=s41[:, :, :1])),
        (ArgumentError, "w1_scale: required", dict(w1_scale=None)),
        (ArgumentError, "w2_scale: required", dict(w2_scale=None)),
        (DTypeError, "w2: expected dtype fp8", dict(w2=q2.to(torch.bfloat16))),
        (DTypeError, "w2: expected dtype", dict(w2=q2.view(torch.int8))),
        (DTypeError, "w1: expected dtype bf16 .* fp8 e4m3, int8 or uint8", dict(w1=q1.to(torch.float16))),
        (DTypeError, "w1_scale", dict(w1_scale=s1.half())),
        (ShapeError, "w1_scale: expected \\[4, 64\\] or \\[4, 64, 1\\]", dict(w1_scale=s1[:, :32])),
        (ShapeError, "w2_scale: expected \\[4, 64\\]", dict(w2_scale=s2[:3])),
        (ShapeError, "w1_scale: expected \\[4, 2, 2\\]", dict(block, w1_scale=sb1[:, :1])),
        (ShapeError, "w2_scale: expected \\[4, 2, 1\\]", dict(block, w2_scale=sb1)),
        (ArgumentError, "block_shape: expected \\[block_n, block_k\\]", dict(block, block_shape=[32])),
        (ArgumentError, "block_shape: expected \\[block_n, block_k\\]", dict(block, block_shape=[32.0, 32])),
        (
            ArgumentError,
            "block_shape: expected block_n >= 1 and block_k a power of two",
            dict(block, block_shape=[32, 48]),
        ),
        (ArgumentError, "block_shape: expected block_n >= 1", dict(block, block_shape=[0, 32])),
        (ArgumentError, "block_shape: expected block_n >= 1", dict(block, block_shape=[32, 8])),
        (
            UnsupportedError,
            "block_shape: block-scaled weights are fp8 e4m3 or packed int4",
            dict(block, w1=qb1.view(torch.int8), w2=qb2.view(torch.int8)),
        ),
        (
            ArgumentError,
            "config: block_k 64 must divide block_shape's block_k 32",
            dict(block, config=MoeConfig(16, 32, 64)),
        ),
        (ArgumentError, "config: block_k 16 is below 32", dict(int4, config=MoeConfig(16, 32, 16))),
        (DTypeError, "compute_dtype: expected None or torch.float8_e4m3fn", dict(int4, compute_dtype=torch.float16)),
        (ArgumentError, "compute_dtype: fp8 activations go with 4-bit", dict(block, compute_dtype=FP8)),
        (UnsupportedError, "block_shape: 4-bit weights with fp8 activations need groups of at least 32",
         dict(int4, compute_dtype=FP8, w1_scale=s41.repeat_interleave(2, -1), w2_scale=s42.repeat_interleave(2, -1),
              block_shape=[1, 16])),
        (UnsupportedError, "block_shape: fp8 block-scaled weights need block_k >= 32",
         dict(block, w1_scale=sb1.repeat_interleave(2, -1), w2_scale=sb2.repeat_interleave(2, -1),
              block_shape=[32, 16])),
    ]
    for err, match, change in bad:
        args = dict(x=x, w1=q1, w2=q2, w=w, ids=ids, w1_scale=s1, w2_scale=s2)
        args.update(change)
        pos = [args.pop(n) for n in ("x", "w1", "w2", "w", "ids")]
        with pytest.raises(err, match=match):
            fused_moe(*pos, **args)


@pytest.mark.parametrize(
    "qdtype,block_shape,kernels",
    [(FP8, None, 8), (FP8, [128, 128], 8), (INT4, [1, 32], 6)],
    ids=["channel", "block", "int4"],
)
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_quant_host_path_only_allocates_and_launches(monkeypatch, qdtype, block_shape, kernels):
    """The activation quantization is flyc launches (no torch op computes on the host path): what CUDA graph
    capture needs. Kernels are recorded, not run; the CPU-only read of the ids' values is left out."""
    x, _, q, w, ids = _layer(9, 256, 128, 4, 2, torch.bfloat16, qdtype, block_shape, seed=1,
                             device=torch.device("cpu"))  # fmt: skip
    monkeypatch.setattr(moe_mod, "check_id_values", lambda ids, e: None)
    q1, q2, s1, s2 = q
    foreign, launches = host_work(fused_moe, x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape)
    assert not foreign, f"torch ops other than allocations and views: {foreign}"
    # alignment (3), two activation quantizations (8-bit weights; int4 is weight-only), two GEMMs, the reduce
    assert len(launches) == kernels, launches


# ------------------------------------------------------------------ GPU, the models' sizes


def _gpu_case(t, h, inter, e, k, qdtype, block_shape, seed, grouped=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16)
    w1 = torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5
    logits = torch.randn(t, e, device="cuda", generator=g)
    if grouped is None:
        w, ids = topk_softmax(logits, k)
    else:
        bias = torch.randn(e, device="cuda", generator=g) * 0.1
        w, ids = grouped_topk(logits, k, grouped[0], grouped[1], correction_bias=bias, routed_scaling_factor=2.5)
    # an expert at a time: the quantizers' fp32 temporaries of a whole layer would not fit
    if qdtype == "mxfp4":
        quant = lambda v: quantize_mxfp4(v, block_shape[1])  # noqa: E731
    else:
        quant = lambda v: quantize_weight(v, qdtype, block_shape)  # noqa: E731
    parts1 = [quant(w1[i : i + 1]) for i in range(e)]
    parts2 = [quant(w2[i : i + 1]) for i in range(e)]
    q1, s1 = (torch.cat([p[j] for p in parts1]) for j in (0, 1))
    q2, s2 = (torch.cat([p[j] for p in parts2]) for j in (0, 1))
    return x, (w1, w2), (q1, q2, s1, s2), w, ids


# (T, H, I, E, k, weight dtype, block_shape, grouped): DeepSeek-V3's layer shape and routing on 64 experts
# (the fp32 copies and the reference of 256 would not fit beside the layer) with block-scaled fp8 at decode,
# an odd prefill and a large one; Mixtral 8x7B fp8 per channel and int4 (group 128); Qwen3-30B-A3B int8,
# fp8 block-scaled and int4 (group 32); gpt-oss-120b's MXFP4 (E 128, top 4, H = I = 2880)
# w4a8 (fp8 activations with 4-bit weights): Qwen3-30B-A3B int4 (group 32) and gpt-oss-120b's MXFP4 prefill
GPU_W4A8_CASES = [(1000, 2048, 768, 128, 8, INT4, [1, 32], None), (1000, 2880, 2880, 128, 4, "mxfp4", [1, 32], None)]

GPU_CASES = [
    (1, 7168, 2048, 64, 6, FP8, [128, 128], (8, 4)),
    (513, 7168, 2048, 64, 6, FP8, [128, 128], (8, 4)),
    (4096, 7168, 2048, 64, 6, FP8, [128, 128], (8, 4)),
    (3, 4096, 14336, 8, 2, FP8, None, None),
    (1000, 4096, 14336, 8, 2, FP8, None, None),
    (1024, 2048, 768, 128, 8, torch.int8, None, None),
    (1024, 2048, 768, 128, 8, FP8, [128, 128], None),
    (3, 4096, 14336, 8, 2, INT4, [1, 128], None),
    (1000, 4096, 14336, 8, 2, INT4, [1, 128], None),
    (64, 2048, 768, 128, 8, INT4, [1, 32], None),
    (1, 2880, 2880, 128, 4, "mxfp4", [1, 32], None),
    (1000, 2880, 2880, 128, 4, "mxfp4", [1, 32], None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,inter,e,k,qdtype,block_shape,grouped", GPU_CASES)
def test_quant_gpu_model_sizes(t, h, inter, e, k, qdtype, block_shape, grouped):
    x, wf, q, w, ids = _gpu_case(t, h, inter, e, k, qdtype, block_shape, seed=t + e, grouped=grouped)
    q1, q2, s1, s2 = q
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape)
    _check(y, x, wf, q, w, ids, block_shape)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,inter,e,k,qdtype,block_shape,grouped", GPU_W4A8_CASES)
def test_w4a8_gpu_model_sizes(t, h, inter, e, k, qdtype, block_shape, grouped):
    x, wf, q, w, ids = _gpu_case(t, h, inter, e, k, qdtype, block_shape, seed=t + e + 1, grouped=grouped)
    q1, q2, s1, s2 = q
    y = fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=block_shape, compute_dtype=FP8)
    _check(y, x, wf, q, w, ids, block_shape, compute_dtype=FP8)


@pytest.mark.gpu
@pytest.mark.graph
def test_quant_gpu_block_scaled_odd_shapes_and_cuda_graph():
    """Shapes off the 128 grid on the device, and a quantized call captured in a CUDA graph (the host path
    launches only), replayed with fresh inputs."""
    x, wf, q, w, ids = _gpu_case(37, 1000, 328, 16, 4, FP8, [128, 128], seed=3)
    q1, q2, s1, s2 = q
    _check(fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[128, 128]), x, wf, q, w, ids,
           [128, 128])  # fmt: skip
    x, wf, q, w, ids = _gpu_case(64, 7168, 2048, 64, 6, FP8, [128, 128], seed=4)
    q1, q2, s1, s2 = q
    out = torch.empty_like(x)
    fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[128, 128], out=out)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[128, 128], out=out)
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.randint_like(ids, 0, 64))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, x, wf, q, w, ids, [128, 128])


# ------------------------------------------------------------------ the kernel compiles for the H200


def test_kernel_compiles_for_sm90_without_spills():
    """Triton's compiler (not the interpreter) takes the gated stage of every weight format at its default
    prefill tiles for sm_90, in a process of its own (moe_compile_sm90.py): tensor-core dots (wgmma, but the
    16-row decode tile: the warp-level MMA), and no spill, the 4-bit paths included (a scale an element for
    groups below the K step; w4a8's fp8 dot; MXFP4's inline-PTX decode)."""
    lines = run_compile_script(Path(__file__).with_name("moe_compile_sm90.py"))
    assert len(lines) == 11 and all(line.startswith("ok") for line in lines), "\n".join(lines)
    for line in lines:
        name, mma, usage = line.split()[1], line.split()[2], " ".join(line.split()[4:])
        assert mma == ("no-wgmma" if name.endswith("-decode") else "wgmma") and usage.endswith("STACK:0"), line
