"""build_flash_attn_func_module: the seed's builder and calling convention (flat ``.view(-1)`` buffers or 4-D
tensors, ``batch`` and ``seqlen`` at run time) against the fp32 reference; the output written in place over
a NaN-poisoned buffer; bad parameters refused at build time and buffers that do not fit them at launch, each
named.
"""

from __future__ import annotations

import pytest
import torch
from attn_helpers import rand_qkv

from fly_attention import build_flash_attn_func_module, flash_attn, flash_attn_ref
from fly_attention.reference import flash_attn_fp8_ref
from flydsl.errors import ArgumentError, DTypeError, ShapeError
from flydsl.testing import assert_rel_close, tolerance


@pytest.mark.parametrize("dtype_str,dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_launch_against_reference(dtype_str, dtype, hq, hkv, causal):
    b, s, d = 2, 21, 64
    exe = build_flash_attn_func_module(hq, d, causal=causal, dtype_str=dtype_str, num_kv_heads=hkv)
    q, k, v = rand_qkv(b, s, s, hq, hkv, d, dtype=dtype)
    o = torch.full_like(q, float("nan"))
    assert exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), b, s) is None
    assert_rel_close(o, flash_attn_ref(q, k, v, causal=causal), tol=tolerance(dtype))


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_4d_buffers_and_a_larger_flat_one():
    """4-D tensors (strided views too) are taken as they are; a flat buffer larger than needed is used from
    its start and the rest left alone."""
    b, s, h, d = 1, 13, 2, 32
    exe = build_flash_attn_func_module(h, d, causal=True, dtype_str="fp16")
    q, k, v = rand_qkv(b, s, s, h, h, d)
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] view of [B, H, S, D] storage
    o = torch.full((b * s * h * d + 7,), float("nan"), dtype=torch.float16)
    exe(q, kt, v, o, b, s)
    assert_rel_close(o[:-7].view(b, s, h, d), flash_attn_ref(q, k, v, causal=True), tol=tolerance(torch.float16))
    assert torch.isnan(o[-7:]).all()


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_default_num_kv_heads_is_num_heads():
    exe = build_flash_attn_func_module(2, 16)  # bf16, MHA
    q, k, v = rand_qkv(1, 5, 5, 2, 2, 16, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), 1, 5)
    assert_rel_close(o, flash_attn_ref(q, k, v), tol=tolerance(torch.bfloat16))
    with pytest.raises(ShapeError, match="k"):  # one KV head: the builder was told 2
        exe(q.view(-1), k[:, :, :1].contiguous().view(-1), v.view(-1), o.view(-1), 1, 5)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_empty_batch():
    exe = build_flash_attn_func_module(2, 16, dtype_str="f16")
    e = torch.empty(0, dtype=torch.float16)
    exe(e, e, e, e, 0, 9)


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"num_heads": 0, "head_dim": 64}, ArgumentError, "num_heads"),
        ({"num_heads": 4, "head_dim": 320}, ArgumentError, "head_dim"),
        ({"num_heads": 4, "head_dim": 64.0}, ArgumentError, "head_dim"),
        ({"num_heads": 4, "head_dim": 64, "num_kv_heads": 3}, ArgumentError, "num_kv_heads"),
        ({"num_heads": 4, "head_dim": 64, "dtype_str": "f32"}, DTypeError, "dtype_str"),
        ({"num_heads": 4, "head_dim": 64, "dtype_str": "half-ish"}, DTypeError, "dtype_str"),
        ({"num_heads": 4, "head_dim": 64, "causal": "yes"}, ArgumentError, "causal"),
        ({"num_heads": 4, "head_dim": 64, "num_kv_splits": 0}, ArgumentError, "num_kv_splits"),
    ],
)
def test_bad_build_parameters(kwargs, err, match):
    with pytest.raises(err, match=match):
        build_flash_attn_func_module(**kwargs)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_bad_buffers_named():
    b, s, hq, hkv, d = 2, 7, 4, 2, 16
    exe = build_flash_attn_func_module(hq, d, dtype_str="bf16", num_kv_heads=hkv)
    q, k, v = rand_qkv(b, s, s, hq, hkv, d, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    flat = [t.view(-1) for t in (q, k, v, o)]
    with pytest.raises(ShapeError, match=r"^v: expected \[batch, seqlen, heads, head_dim\] = \[2, 7, 2, 16\]"):
        exe(flat[0], flat[1], flat[2][:-1], flat[3], b, s)  # one element short
    with pytest.raises(ShapeError, match="^o:"):
        exe(flat[0], flat[1], flat[2], o[:, :, :2], b, s)  # 4-D of the wrong shape
    with pytest.raises(ShapeError, match="^q:"):
        exe(q.transpose(1, 2).reshape(-1)[::2], flat[1], flat[2], flat[3], b, s // 2)  # flat but not contiguous
    with pytest.raises(DTypeError, match="^k: expected dtype bf16"):
        exe(flat[0], flat[1].half(), flat[2], flat[3], b, s)
    with pytest.raises(DTypeError, match="^o: expected dtype bf16"):
        exe(flat[0], flat[1], flat[2], flat[3].float(), b, s)
    with pytest.raises(ArgumentError, match="seqlen"):
        exe(*flat, b, -1)
    with pytest.raises(ArgumentError, match="q_descale"):
        exe(*flat, b, s, q_descale=torch.ones(1))
    with pytest.raises(ShapeError, match="^q:"):  # a larger seqlen than the buffers hold
        exe(*flat, b, s + 1)


@pytest.mark.gpu
def test_gpu_launch_on_a_stream(device):
    b, s, hq, hkv, d = 2, 1000, 32, 8, 128
    exe = build_flash_attn_func_module(hq, d, causal=True, dtype_str="bf16", num_kv_heads=hkv)
    q, k, v = rand_qkv(b, s, s, hq, hkv, d, dtype=torch.bfloat16, device=device)
    o = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), b, s, stream=stream)
    torch.cuda.current_stream().wait_stream(stream)
    assert_rel_close(o, flash_attn_ref(q, k, v, causal=True), tol=tolerance(torch.bfloat16))


FP8 = torch.float8_e4m3fn


def _fp8_qkv(b, s, hq, hkv, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = (torch.randn(b, s, hq, d, generator=g), torch.randn(b, s, hkv, d, generator=g),
          torch.randn(b, s, hkv, d, generator=g))  # fmt: skip
    return tuple(t.to(device=device, dtype=FP8) for t in ts)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_launch_is_flash_attn_fp8(device, out_dtype, causal):
    """The fp8 launcher writes, bit for bit, what flash_attn's fp8 forward returns for the same descales
    (tensors or numbers), into a poisoned o of the caller's dtype; its accuracy against the dequantized
    reference is flash_attn's (test_flash_fp8.py) and the GPU test below."""
    b, s, hq, hkv, d = 2, 19, 4, 2, 64
    exe = build_flash_attn_func_module(hq, d, causal=causal, dtype_str="fp8", num_kv_heads=hkv)
    q, k, v = _fp8_qkv(b, s, hq, hkv, d, device)
    qd, vd = torch.tensor([0.5], device=device), torch.tensor([1.5], device=device)
    o = torch.full((b, s, hq, d), float("nan"), dtype=out_dtype, device=device)
    exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), b, s, q_descale=qd, k_descale=2.0, v_descale=vd)
    want = flash_attn(q, k, v, causal=causal, q_descale=qd, k_descale=2.0, v_descale=vd, out_dtype=out_dtype)
    assert torch.equal(o, want)
    exe(q, k, v, o, b, s)  # no descales: 1
    assert torch.equal(o, flash_attn(q, k, v, causal=causal, out_dtype=out_dtype))


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_fp8_bad_buffers_named():
    b, s, h, d = 1, 5, 2, 32
    exe = build_flash_attn_func_module(h, d, dtype_str="fp8")
    q, k, v = _fp8_qkv(b, s, h, h, d, "cpu")
    with pytest.raises(DTypeError, match="^o: expected dtype bf16 or fp16"):
        exe(q, k, v, torch.empty(b, s, h, d), b, s)
    with pytest.raises(DTypeError, match="^o: expected dtype bf16 or fp16"):
        exe(q, k, v, torch.empty(b, s, h, d, dtype=FP8), b, s)
    with pytest.raises(DTypeError, match="^k: expected dtype fp8"):
        exe(q, k.to(torch.bfloat16), v, torch.empty(b, s, h, d, dtype=torch.bfloat16), b, s)
    with pytest.raises(ShapeError, match="q_descale"):
        exe(q, k, v, torch.empty(b, s, h, d, dtype=torch.bfloat16), b, s, q_descale=torch.ones(2))


@pytest.mark.gpu
def test_gpu_fp8_launch_against_reference(device):
    b, s, hq, hkv, d = 2, 333, 8, 2, 128
    exe = build_flash_attn_func_module(hq, d, causal=True, dtype_str="fp8", num_kv_heads=hkv)
    q, k, v = _fp8_qkv(b, s, hq, hkv, d, device, seed=3)
    o = torch.full((b, s, hq, d), float("nan"), dtype=torch.bfloat16, device=device)
    qd, kd, vd = (torch.tensor([x], device=device) for x in (0.25, 0.5, 2.0))
    exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), b, s, q_descale=qd, k_descale=kd, v_descale=vd)
    ref = flash_attn_fp8_ref(q, k, v, qd, kd, vd, causal=True)
    assert_rel_close(o, ref.to(o.device), tol=2.0**-4)  # P's rounding to e4m3: see test_flash_fp8.py
