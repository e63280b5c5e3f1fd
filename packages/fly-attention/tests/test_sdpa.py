"""scaled_dot_product_attention against torch's own SDPA in fp32: torch's top-left causal for seqlen_q below,
equal to and above seqlen_k, scale, enable_gqa and head broadcast, 2-D / 3-D / 5-D inputs with broadcast
batch dims; the fallbacks (masks, fp32, head dims over 256: torch's result, warned once per reason); dropout
refused; bad input named. Outputs are poisoned (conftest): an element the kernel does not write fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fly_attention
from fly_attention import sdpa as sdpa_mod
from fly_attention.sdpa import scaled_dot_product_attention as sdpa
from flydsl.errors import ArgumentError, DTypeError, ShapeError, UnsupportedError
from flydsl.testing import assert_rel_close, tolerance


def rand(*shape, dtype=torch.float16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check(q, k, v, **kw):
    """Ours against torch's SDPA on the same values in fp32, its math backend (the CPU's fused one returns NaN
    for scale=0 with is_causal)."""
    out = sdpa(q, k, v, **kw)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_rel_close(out, ref, tol=tolerance(q.dtype))
    return out


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees the once-per-process warnings afresh."""
    sdpa_mod._warned.clear()
    yield
    sdpa_mod._warned.clear()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sq,sk", [(13, 40), (40, 13), (24, 24), (1, 17), (17, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_against_torch(dtype, sq, sk, is_causal):
    """is_causal is torch's top-left triangle whatever the lengths (flash_attn's own causal is bottom-right:
    a missing translation shows as an O(1) error for sq != sk)."""
    q, k, v = rand(2, 3, sq, 32, dtype=dtype), rand(2, 3, sk, 32, dtype=dtype, seed=1), rand(2, 3, sk, 32, dtype=dtype,
                                                                                                 seed=2)  # fmt: skip
    check(q, k, v, is_causal=is_causal)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_causal_top_left_differs_from_bottom_right():
    """The test above can fail: for sq != sk the two alignments give different results."""
    q, k, v = rand(1, 2, 9, 16), rand(1, 2, 20, 16, seed=1), rand(1, 2, 20, 16, seed=2)
    ours = sdpa(q, k, v, is_causal=True)
    bottom_right = fly_attention.flash_attn(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2)
    assert (ours.float() - bottom_right.float()).abs().max() > 0.1


@pytest.mark.parametrize("scale", [0.05, 1.0, 0.0])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_scale(scale):
    q, k, v = rand(1, 2, 19, 64), rand(1, 2, 23, 64, seed=1), rand(1, 2, 23, 64, seed=2)
    check(q, k, v, scale=scale, is_causal=True)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_enable_gqa(hq, hkv, is_causal):
    q, k, v = rand(2, hq, 11, 32), rand(2, hkv, 15, 32, seed=1), rand(2, hkv, 15, 32, seed=2)
    check(q, k, v, is_causal=is_causal, enable_gqa=True)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_single_kv_head_broadcasts_without_gqa():
    """torch broadcasts one KV head over the query heads even without enable_gqa."""
    q, k, v = rand(2, 4, 11, 32), rand(2, 1, 15, 32, seed=1), rand(2, 1, 15, 32, seed=2)
    check(q, k, v)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_value_head_dim_differs():
    q, k, v = rand(1, 2, 12, 48), rand(1, 2, 18, 48, seed=1), rand(1, 2, 18, 24, seed=2)
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    "qs,ks",
    [((7, 16), (11, 16)), ((3, 7, 16), (3, 11, 16)), ((2, 3, 2, 7, 16), (3, 2, 11, 16)), ((4, 7, 16), (1, 11, 16)),
     ((2, 3, 7, 16), (1, 3, 11, 16))],
)  # fmt: skip
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_ranks_and_broadcast(qs, ks):
    """2-D, 3-D and 5-D inputs, and batch dims that broadcast (missing or of size 1), as torch allows."""
    q, k, v = rand(*qs), rand(*ks, seed=1), rand(*ks, seed=2)
    check(q, k, v, is_causal=True)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_served_through_views_without_copy(monkeypatch):
    """flash_attn reads the caller's [B, H, S, D] storage through .transpose(1, 2) views; the result is the
    transposed view of its output."""
    seen = {}
    real = sdpa_mod.flash_attn

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, kw=kw)
        seen["out"] = real(q, k, v, **kw)
        return seen["out"]

    monkeypatch.setattr(sdpa_mod, "flash_attn", spy)
    q, k, v = rand(2, 4, 10, 32), rand(2, 2, 30, 32, seed=1), rand(2, 2, 30, 32, seed=2)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert seen[name].data_ptr() == t.data_ptr() and seen[name].stride() == t.transpose(1, 2).stride()
    assert seen["k"].shape[1] == 10  # top-left causal with sq < sk: only the first sq keys are ever seen
    assert seen["kw"]["causal"] is True and out.data_ptr() == seen["out"].data_ptr()


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_empty_and_keyless():
    q = rand(1, 2, 5, 16)
    k = v = rand(1, 2, 0, 16)
    for causal in (False, True):
        out = sdpa(q, k, v, is_causal=causal)
        assert torch.equal(out.float(), F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                       is_causal=causal))  # fmt: skip
    assert sdpa(rand(1, 2, 0, 16), rand(1, 2, 4, 16), rand(1, 2, 4, 16)).shape == (1, 2, 0, 16)


def test_meta_tensors_give_meta_outputs():
    meta = torch.device("meta")
    q = torch.empty(2, 8, 9, 192, dtype=torch.bfloat16, device=meta)
    k = torch.empty(2, 2, 5, 192, dtype=torch.bfloat16, device=meta)
    v = torch.empty(2, 2, 5, 128, dtype=torch.bfloat16, device=meta)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert out.device == meta and out.shape == (2, 8, 9, 128) and out.dtype == torch.bfloat16


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_traces_under_torch_compile_fullgraph():
    """The translation is plain tensor views around flash_attn's custom op: one graph, eager's result."""
    torch._dynamo.reset()
    q, k, v = rand(1, 4, 13, 32), rand(1, 2, 21, 32, seed=1), rand(1, 2, 21, 32, seed=2)

    def f(q, k, v):
        return sdpa(q, k, v, is_causal=True, enable_gqa=True, scale=0.2) * 2

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, f(q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True,
                                             scale=0.2)  # fmt: skip
    assert_rel_close(got / 2, ref, tol=tolerance(q.dtype))


# ------------------------------------------------------------------ fallbacks


def _records(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    return out, [r for r in rec if "fly_attention.scaled_dot_product_attention" in str(r.message)]


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_falls_back_to_torch_warned_once(kind):
    q, k, v = rand(1, 2, 6, 16), rand(1, 2, 9, 16, seed=1), rand(1, 2, 9, 16, seed=2)
    mask = torch.rand(6, 9, generator=torch.Generator().manual_seed(3)) > 0.3
    if kind == "additive":
        mask = torch.zeros(6, 9, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    mask[:, 0] = True if kind == "bool" else 0.0  # every row sees a key
    out, rec = _records(lambda: sdpa(q, k, v, attn_mask=mask))
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert len(rec) == 1 and "attn_mask" in str(rec[0].message)
    _, rec = _records(lambda: sdpa(q, k, v, attn_mask=mask))
    assert rec == []  # once per process


def test_fp32_falls_back_to_torch_warned_once():
    q, k, v = rand(1, 2, 6, 16, dtype=torch.float32), rand(1, 2, 9, 16, dtype=torch.float32, seed=1), rand(
        1, 2, 9, 16, dtype=torch.float32, seed=2)  # fmt: skip
    out, rec = _records(lambda: sdpa(q, k, v, is_causal=True))
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert len(rec) == 1 and "fp16 / bf16" in str(rec[0].message)
    assert _records(lambda: sdpa(q, k, v))[1] == []


def test_head_dim_over_256_falls_back():
    q, k, v = rand(1, 1, 4, 320), rand(1, 1, 5, 320, seed=1), rand(1, 1, 5, 320, seed=2)
    out, rec = _records(lambda: sdpa(q, k, v))
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v)) and len(rec) == 1


def test_dropout_raises_on_the_flash_path():
    q = rand(1, 2, 6, 16)
    with pytest.raises(UnsupportedError, match="dropout_p"):
        sdpa(q, q, q, dropout_p=0.1)
    # a fallback call is torch's in full, dropout included
    out, _ = _records(lambda: sdpa(q.float(), q.float(), q.float(), dropout_p=0.5))
    assert out.shape == q.shape


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "make,err,match",
    [
        (lambda q: (q, rand(1, 2, 9, 16), rand(1, 2, 9, 16), {}), ShapeError, "key.*enable_gqa"),
        (lambda q: (q, rand(1, 3, 9, 16), rand(1, 3, 9, 16), {"enable_gqa": True}), ShapeError, "key.*divide"),
        (lambda q: (q, rand(1, 4, 9, 8), rand(1, 4, 9, 16), {}), ShapeError, "key.*head_dim"),
        (lambda q: (q, rand(1, 4, 9, 16), rand(1, 4, 8, 16), {}), ShapeError, "value.*seqlen"),
        (lambda q: (q, rand(1, 4, 9, 16), rand(1, 2, 9, 16), {"enable_gqa": True}), ShapeError, "value.*heads"),
        (lambda q: (q, rand(3, 4, 9, 16), rand(3, 4, 9, 16), {}), ShapeError, "batch"),
        (lambda q: (q, rand(1, 4, 9, 16, dtype=torch.bfloat16), rand(1, 4, 9, 16), {}), DTypeError, "key"),
        (lambda q: (q, rand(1, 4, 9, 16), rand(1, 4, 9, 16, dtype=torch.bfloat16), {}), DTypeError, "value"),
        (lambda q: (q, [1.0], rand(1, 4, 9, 16), {}), ArgumentError, "key"),
        (lambda q: (q, q, q, {"is_causal": 1}), ArgumentError, "is_causal"),
        (lambda q: (q, q, q, {"scale": float("nan")}), ArgumentError, "scale"),
        (lambda q: (q, q, q, {"dropout_p": 1.5}), ArgumentError, "dropout_p"),
        (lambda q: (q, q, q, {"enable_gqa": "yes"}), ArgumentError, "enable_gqa"),
        (lambda q: (q[0, 0, 0], q, q, {}), ShapeError, "query"),
        (lambda q: (q, q[:, :0], q[:, :0], {"enable_gqa": True}), ShapeError, "key.*one head"),
    ],
)
def test_bad_input_named(make, err, match):
    q, k, v, kw = make(rand(2, 4, 6, 16))
    with pytest.raises(err, match=match):
        sdpa(q, k, v, **kw)


def test_exported():
    assert fly_attention.scaled_dot_product_attention is sdpa
    assert "scaled_dot_product_attention" in fly_attention.__all__


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(1000, 4097), (4097, 1000), (2048, 2048)])
def test_gpu_against_torch(device, sq, sk):
    """The issue's sizes on the GPU: bf16, GQA 4:1, head dim 128, torch's causal both ways."""
    q = rand(2, 16, sq, 128, dtype=torch.bfloat16).to(device)
    k, v = (rand(2, 4, sk, 128, dtype=torch.bfloat16, seed=s).to(device) for s in (1, 2))
    for causal in (False, True):
        out = sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
        assert_rel_close(out, ref, tol=tolerance(torch.bfloat16))
