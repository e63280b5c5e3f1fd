"""flash_attn on fp8 e4m3 inputs with per-tensor descales, against the fp32 reference on the dequantized inputs
(``flash_attn_fp8_ref``): masks, GQA, odd lengths, padded head dims, lse, descales as tensors and numbers, the
bad inputs, and the fp8 kernel's sm_90 compile (wgmma with e4m3 operands for both dots, no spill).

The tolerance. The reference computes on the same fp8 values dequantized, so the inputs' own rounding is no
error; the kernel's one rounding of consequence is P's, to e4m3 for the P @ V dot: a relative error
``|d_j| <= 2^-4`` in each probability (3 mantissa bits, round to nearest; the kernel scales P by 2^8 so that
every probability above 2^-14 is a normal number). The output error is ``e = sum_j p_j d_j v_j / l`` against
``o = sum_j p_j v_j / l``: with V's entries independent of the rounding, ``||e|| / ||o||`` is the rms of
``d_j``, at most 2^-4 (about 0.036 for rounding errors spread evenly). The fp32 accumulation (reduced precision
within one block on sm_90), exp2 and the bf16 output add under 2^-8. So the GPU tests hold 2^-4.

On the CPU, Triton 3.6's interpreter rounds fp32 to e4m3 wrongly where the rounding carries into the next
power of two (127.5 gives 64, not 128), so P's rounding there is not the GPU's. The CPU tests therefore take
scores whose probabilities are exact in e4m3: integer-valued q and k and ``softmax_scale = ln 2`` make every
score an integer in log2 units, so each p is a power of two and the kernel's only rounding left is the bf16
output's (tolerance 1e-2, bf16's). They check the walk, masks, GQA, descales and lse; the GPU tests check the
rounding of P.
"""

from __future__ import annotations

import math

import pytest
import torch

from fly_attention import attention as attn_mod
from fly_attention import flash_attn, flash_attn_varlen
from fly_attention.reference import flash_attn_fp8_ref
from flydsl.errors import ArgumentError, DeviceError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, tolerance
from flydsl.testing.sm90 import run_compile_script

FP8 = torch.float8_e4m3fn
LN2 = math.log(2.0)
GPU_TOL = 2.0**-4  # see the module docstring
# The lse carries no P rounding, only the scores': sm_90's fp8 tensor cores accumulate a dot with about 14
# mantissa bits, not fp32's 24 (measured on Hopper by others; the interpreter's dots are exact fp32). Over
# head_dim products that leaves relative errors up to ~2^-13 in a score, hence in the lse (measured here: 1.1e-5
# at d 256, causal, 1000 x 1000).
LSE_TOL = 2.0**-13


def int_qkv(b, sq, sk, hq, hkv, d, dv=None, *, device="cpu", seed=0):
    """fp8 q, k with small integer entries (scores are integers) and random fp8 v."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randint(-1, 2, (b, sq, hq, d), generator=g).float()
    k = torch.randint(-1, 2, (b, sk, hkv, d), generator=g).float()
    v = torch.randn(b, sk, hkv, dv, generator=g) * 3
    return tuple(t.to(device=device, dtype=FP8) for t in (q, k, v))


def rand_qkv8(b, sq, sk, hq, hkv, d, dv=None, *, device="cpu", seed=0):
    """fp8 q, k, v from unit normals (scores of order sqrt(d) before the scale)."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    ts = (torch.randn(b, sq, hq, d, generator=g), torch.randn(b, sk, hkv, d, generator=g),
          torch.randn(b, sk, hkv, dv, generator=g))  # fmt: skip
    return tuple(t.to(device=device, dtype=FP8) for t in ts)


def check_fp8(q, k, v, descales=(None, None, None), tol=None, out_dtype=None, **opts):
    out, lse = flash_attn(q, k, v, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                          return_lse=True, out_dtype=out_dtype, **opts)  # fmt: skip
    ref, ref_lse = flash_attn_fp8_ref(q, k, v, *descales, return_lse=True, **opts)
    assert out.dtype == (out_dtype or torch.bfloat16) and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the output"
    assert_rel_close(out, ref.to(out.device), tol=tol if tol is not None else tolerance(torch.bfloat16))
    ref_lse = ref_lse.to(lse.device)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: rows at -inf differ"
    fin = torch.isfinite(ref_lse)
    if fin.any():  # the lse holds no P rounding, only the scores' accumulation
        assert_rel_close(lse[fin], ref_lse[fin], tol=LSE_TOL if q.is_cuda else 1e-5, name="lse")
    return out, lse


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, options)
CASES = [
    (1, 1, 1, 2, 2, 64, 64, {}),
    (2, 17, 17, 2, 2, 64, 64, {}),
    (1, 70, 70, 2, 2, 64, 64, {"causal": True}),
    (2, 17, 50, 4, 1, 64, 64, {"causal": True}),
    (1, 50, 17, 2, 2, 64, 64, {"causal": True}),
    (1, 40, 57, 8, 2, 32, 32, {}),
    (1, 33, 45, 2, 1, 80, 48, {"window": (9, 3)}),
    (1, 45, 33, 4, 2, 96, 96, {"window": (7, 20), "causal": True}),
]


def _case_id(case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    tag = "-".join(f"{k}={v}" for k, v in opts.items())
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}/{dv}" + (f"-{tag}" if tag else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_exact_probabilities_against_reference(device, case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    q, k, v = int_qkv(b, sq, sk, hq, hkv, d, dv, device=device, seed=sq + sk)
    # descales of powers of two keep the scores integers; v's descale is any value
    qd = torch.tensor([0.5], device=device)
    check_fp8(q, k, v, (qd, 2.0, torch.tensor([0.37], device=device)), softmax_scale=LN2, **opts)


def test_descales_as_numbers_and_none_match_tensors(device):
    q, k, v = int_qkv(1, 30, 40, 4, 2, 64, device=device, seed=5)
    t = [torch.tensor([x], device=device) for x in (0.5, 2.0, 1.5)]
    a = flash_attn(q, k, v, q_descale=t[0], k_descale=t[1], v_descale=t[2], softmax_scale=LN2, causal=True)
    b = flash_attn(q, k, v, q_descale=0.5, k_descale=2.0, v_descale=1.5, softmax_scale=LN2, causal=True)
    assert torch.equal(a, b)
    # None is 1: q_descale 0.5 and k_descale 2 cancel in the scores; a scalar (0-d) tensor is taken too
    c = flash_attn(q, k, v, v_descale=torch.tensor(1.5, device=device), softmax_scale=LN2, causal=True)
    assert torch.equal(a, c)
    check_fp8(q, k, v, softmax_scale=LN2, causal=True)


def test_fp16_output_and_rows_that_see_no_key(device):
    q, k, v = int_qkv(1, 50, 10, 2, 2, 64, device=device)
    out, lse = check_fp8(q, k, v, softmax_scale=LN2, causal=True, out_dtype=torch.float16)
    assert torch.equal(out[:, :40].float().cpu(), torch.zeros(1, 40, 2, 64))
    assert torch.isneginf(lse[:, :, :40]).all()
    q, k, v = int_qkv(1, 5, 0, 2, 2, 64, device=device)
    out, lse = flash_attn(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_default_scale_and_random_inputs_run(device):
    """Random inputs with the default scale on the CPU: finite and the right shape (their accuracy is the GPU
    tests'; see the module docstring)."""
    q, k, v = rand_qkv8(1, 37, 41, 4, 2, 64, device=device)
    out = flash_attn(q, k, v, causal=True)
    assert out.shape == (1, 37, 4, 64) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("shape", [(0, 8, 8), (2, 0, 8)])
def test_empty_shapes(shape):
    b, sq, sk = shape
    q, k, v = int_qkv(b, sq, sk, 4, 2, 64)
    out, lse = flash_attn(q, k, v, return_lse=True)
    assert out.shape == (b, sq, 4, 64) and out.dtype == torch.bfloat16 and lse.shape == (b, 4, sq)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_meta_tensors_and_torch_compile():
    q, k, v = (t.to("meta") for t in int_qkv(2, 9, 11, 4, 2, 64))
    out, lse = flash_attn(q, k, v, q_descale=torch.ones(1, device="meta"), return_lse=True)
    assert out.is_meta and out.shape == (2, 9, 4, 64) and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 9)
    q, k, v = int_qkv(1, 20, 20, 2, 2, 64)
    ds = torch.tensor([2.0])
    fn = torch.compile(lambda q, k, v, s: flash_attn(q, k, v, q_descale=s, k_descale=0.5, softmax_scale=LN2),
                       fullgraph=True, backend="aot_eager")  # fmt: skip
    got = fn(q, k, v, ds)
    assert torch.equal(got, flash_attn(q, k, v, q_descale=ds, k_descale=0.5, softmax_scale=LN2))


def test_v_transposed_copy_is_padded_with_zeros():
    v = torch.randn(2, 37, 3, 48).to(FP8)
    vt = attn_mod._v_transposed(v, 32)
    assert vt.shape == (2, 3, 48, 64) and vt.stride(-1) == 1
    assert torch.equal(vt[..., :37].float(), v.permute(0, 2, 3, 1).float())
    assert (vt[..., 37:].view(torch.uint8) == 0).all()


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_are_named():
    q, k, v = int_qkv(1, 8, 8, 2, 2, 64)
    bf = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(DTypeError, match="^k: expected float8_e4m3fn like q"):
        flash_attn(q, bf, v)
    with pytest.raises(DTypeError, match="^q: expected float8_e4m3fn like k"):
        flash_attn(bf, k, v)
    with pytest.raises(DTypeError, match="^v: fp8 e5m2 is not supported"):
        flash_attn(q, k, v.to(torch.float8_e5m2))
    with pytest.raises(ShapeError, match="^q_descale: expected one value"):
        flash_attn(q, k, v, q_descale=torch.ones(2))
    with pytest.raises(DTypeError, match="^k_descale"):
        flash_attn(q, k, v, k_descale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ArgumentError, match="^v_descale: expected None, a number"):
        flash_attn(q, k, v, v_descale="1.0")
    with pytest.raises(ArgumentError, match="^q_descale: expected a finite number"):
        flash_attn(q, k, v, q_descale=float("nan"))
    with pytest.raises(DTypeError, match="^out_dtype"):
        flash_attn(q, k, v, out_dtype=torch.float32)
    with pytest.raises(ArgumentError, match="^q_descale: descales are for fp8"):
        flash_attn(bf, bf, bf, q_descale=1.0)
    with pytest.raises(ArgumentError, match="^out_dtype"):
        flash_attn(bf, bf, bf, out_dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="^q: fp8 attention is dense only"):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        flash_attn_varlen(q[0], k[0], v[0], cu, cu, 8, 8)
    qg = q.clone().requires_grad_(True)
    with pytest.raises(UnsupportedError, match="^q: the fp8 forward has no backward"):
        flash_attn(qg, k, v)
    with pytest.raises(ShapeError, match="^k: expected a number of heads"):
        flash_attn(q, int_qkv(1, 8, 8, 2, 3, 64)[1], int_qkv(1, 8, 8, 2, 3, 64)[2])


@pytest.mark.gpu
def test_gpu_descale_on_another_device_is_named(device):
    q, k, v = int_qkv(1, 8, 8, 2, 2, 64, device=device)
    with pytest.raises(DeviceError, match="^v_descale: expected a tensor on"):
        flash_attn(q, k, v, v_descale=torch.ones(1))


# ---------------------------------------------------------------- the kernel compiles for the H200


def test_fp8_kernel_compiles_for_sm90_with_wgmma_and_no_spill():
    """Each variant of attn_fp8_compile_sm90.py compiles for sm_90 (a process of its own: the interpreter is
    chosen once per process); the 64-row-and-up ones run both dots as wgmma with e4m3 operands (the score dot
    and P @ V: at least two per key loop), and none uses a stack (a register spill)."""
    import re
    from pathlib import Path

    from attn_fp8_compile_sm90 import VARIANTS

    lines = [ln for ln in run_compile_script(Path(__file__).with_name("attn_fp8_compile_sm90.py"))
             if ln.startswith(("ok", "FAIL"))]  # fmt: skip
    assert len(lines) == len(VARIANTS) and all(ln.startswith("ok") for ln in lines), "\n".join(lines)
    for line, variant in zip(lines, VARIANTS, strict=True):
        m = re.search(r"STACK:(\d+) wgmma_e4m3:(\d+) wgmma:(\d+)", line)
        assert m and m.group(1) == "0", line
        fp8, total = int(m.group(2)), int(m.group(3))
        if variant[2] >= 64:  # block_m: a warpgroup's wgmma takes 64 rows
            windowed = variant[6]
            loops = 3 if windowed else 2
            assert fp8 == total and fp8 >= 2 * loops, line


# ---------------------------------------------------------------- GPU: rounding of P, the sizes


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (1000, 1000), (4097, 4097), (1, 4097), (1000, 4097)])
def test_gpu_against_dequantized_reference(device, d, causal, sq, sk):
    q, k, v = rand_qkv8(2, sq, sk, 8, 2, d, device=device, seed=sq + d)
    ds = tuple(torch.tensor([x], device=device) for x in (0.8, 1.3, 2.5))
    check_fp8(q, k, v, ds, tol=GPU_TOL, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{"window": (256, 0)}, {"softcap": 30.0, "causal": True}, {"window": (100, 300)}])
def test_gpu_window_softcap_gqa(device, opts):
    q, k, v = rand_qkv8(2, 1000, 1500, 16, 2, 128, device=device, seed=7)
    check_fp8(q, k, v, (0.9, torch.tensor([1.1], device=device), 0.7), tol=GPU_TOL, out_dtype=torch.float16, **opts)


@pytest.mark.gpu
def test_gpu_exact_probabilities(device):
    """Integer scores on the GPU: no P rounding, so the bf16 output's tolerance holds (the kernel's walk at
    the issue's sizes, apart from P's rounding)."""
    q, k, v = int_qkv(2, 4097, 4097, 8, 1, 128, device=device)
    check_fp8(q, k, v, (0.5, 2.0, 3.0), softmax_scale=LN2, causal=True)


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_cuda_graph_reads_descales_from_memory(device):
    """Captured once, replayed with new descale values in the same tensors: the kernel reads them at run
    time (no host copy of their values)."""
    q, k, v = rand_qkv8(1, 300, 300, 4, 2, 128, device=device)
    ds = [torch.tensor([x], device=device) for x in (1.0, 1.0, 1.0)]
    flash_attn(q, k, v, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn(q, k, v, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    for d, x in zip(ds, (0.7, 1.9, 2.5), strict=True):
        d.fill_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(out, flash_attn_fp8_ref(q, k, v, *ds), tol=GPU_TOL)
