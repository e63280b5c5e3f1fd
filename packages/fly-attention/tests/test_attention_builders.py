"""build_flash_attn_func_module: the seed's builder and calling convention (flat ``.view(-1)`` buffers or 4-D
tensors, ``batch`` and ``seqlen`` at run time) against the fp32 reference; the output written in place over
a NaN-poisoned buffer; bad parameters refused at build time and buffers that do not fit them at launch, each
named.
"""

from __future__ import annotations

import pytest
import torch
from attn_helpers import rand_qkv

from fly_attention import build_flash_attn_func_module, flash_attn_ref
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, tolerance


@pytest.mark.parametrize("dtype_str,dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_launch_against_reference(dtype_str, dtype, hq, hkv, causal):
    b, s, d = 2, 21, 64
    exe = build_flash_attn_func_module(hq, d, causal=causal, dtype_str=dtype_str, num_kv_heads=hkv)
    q, k, v = rand_qkv(b, s, s, hq, hkv, d, dtype=dtype)
    o = torch.full_like(q, float("nan"))
    assert exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), b, s) is None
    assert_rel_close(o, flash_attn_ref(q, k, v, causal=causal), tol=tolerance(dtype))


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


def test_default_num_kv_heads_is_num_heads():
    exe = build_flash_attn_func_module(2, 16)  # bf16, MHA
    q, k, v = rand_qkv(1, 5, 5, 2, 2, 16, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    exe(q.view(-1), k.view(-1), v.view(-1), o.view(-1), 1, 5)
    assert_rel_close(o, flash_attn_ref(q, k, v), tol=tolerance(torch.bfloat16))
    with pytest.raises(ShapeError, match="k"):  # one KV head: the builder was told 2
        exe(q.view(-1), k[:, :, :1].contiguous().view(-1), v.view(-1), o.view(-1), 1, 5)


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
        ({"num_heads": 4, "head_dim": 64, "dtype_str": "fp8"}, UnsupportedError, "dtype_str"),
        ({"num_heads": 4, "head_dim": 64, "causal": "yes"}, ArgumentError, "causal"),
        ({"num_heads": 4, "head_dim": 64, "num_kv_splits": 0}, ArgumentError, "num_kv_splits"),
    ],
)
def test_bad_build_parameters(kwargs, err, match):
    with pytest.raises(err, match=match):
        build_flash_attn_func_module(**kwargs)


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
