"""Bad input classes of fly-attention's public ops, one test a class (the table of issue 40 cites these
names), each parametrized over the ops: flash_attn, flash_attn_varlen, paged_attention_decode,
fused_rope_cache, the SDPA drop-in and build_flash_attn_func_module's launcher. The per-op suites hold the
longer lists (test_flash_api, test_decode, test_rope_cache, test_sdpa, test_attention_builders); here each
class gets one check an op. Every output the ops allocate starts as NaN (conftest.py and the fixture below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import rand_qkv

from fly_attention import (
    build_flash_attn_func_module,
    flash_attn,
    flash_attn_ref,
    flash_attn_varlen,
    flash_attn_varlen_ref,
    fused_rope_cache,
    paged_attention_decode,
)
from fly_attention import decode as decode_mod
from fly_attention import rope_cache as rope_mod
from fly_attention import scaled_dot_product_attention as sdpa
from fly_attention.decode_reference import fused_rope_cache_ref, gather_kv_ref, paged_attention_decode_ref
from flydsl.errors import DeviceError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, default_device, empty_poisoned, tolerance

F16 = torch.float16
OPS = ["flash_attn", "flash_attn_varlen", "paged_attention_decode", "fused_rope_cache", "sdpa", "builder"]


@pytest.fixture(autouse=True)
def poisoned_decode_and_rope(monkeypatch):
    alloc = lambda *shape, dtype, device: empty_poisoned(*shape, dtype=dtype, device=device)  # noqa: E731
    monkeypatch.setattr(decode_mod, "_empty", alloc)
    monkeypatch.setattr(rope_mod, "_empty", alloc)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def paged(lens, *, hq=4, hkv=2, d=32, page=16, device="cpu", pad=0, seed=0):
    """q ``[batch, hq, d]``, paged caches (a shuffled block table, -1 past each sequence's blocks, two spare
    blocks), int32 seq_lens. ``pad`` > 0: q and the caches are views one element into a buffer whose last
    dim is ``d + pad`` wide (a base pointer off by one element, odd strides for odd ``d + pad``)."""
    g = _gen(seed)
    need = [-(-n // page) for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g)
    table = torch.full((len(lens), max(max(need, default=0), 1)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n

    def make(*shape):
        t = torch.randn(*shape[:-1], shape[-1] + pad, generator=g).to(device=device, dtype=F16)
        return t[..., pad:] if pad else t

    q, kc, vc = make(len(lens), hq, d), make(nb, page, hkv, d), make(nb, page, hkv, d)
    return q, kc, vc, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def rope_args(tokens=4, *, hq=4, hkv=2, d=32, page=16, device="cpu", pad=0, seed=0):
    """fused_rope_cache's 8 arguments: random q, k, v (views one element into wider rows for ``pad`` > 0),
    a cos/sin cache, positions, caches and a slot mapping with the last token's slot -1."""
    g = _gen(seed)

    def make(*shape):
        t = torch.randn(*shape[:-1], shape[-1] + pad, generator=g).to(device=device, dtype=F16)
        return t[..., pad:] if pad else t

    q, k, v = make(tokens, hq, d), make(tokens, hkv, d), make(tokens, hkv, d)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.arange(64, dtype=torch.float64)[:, None] * inv[None, :]
    cs = torch.cat([f.cos(), f.sin()], dim=1).float().to(device)
    nb = -(-tokens // page) + 1
    slots = torch.randperm(nb * page, generator=g)[:tokens]
    if tokens:
        slots[-1] = -1
    pos = torch.randint(0, 64, (tokens,), generator=g).to(device)
    kc, vc = make(nb, page, hkv, d), make(nb, page, hkv, d)
    return [q, k, v, cs, pos, kc, vc, slots.to(device)]


def check_rope(args):
    ref_q, ref_kc, ref_vc = fused_rope_cache_ref(*args)
    got = fused_rope_cache(*args)
    assert_rel_close(got, ref_q, tol=tolerance(F16), name="q")
    assert_rel_close(args[5], ref_kc, tol=tolerance(F16), name="k_cache")
    assert_rel_close(args[6], ref_vc, tol=tolerance(F16), name="v_cache")


def check_decode(q, kc, vc, table, sl, **kw):
    out = paged_attention_decode(q, kc, vc, table, sl, **kw)
    assert_rel_close(out.float(), paged_attention_decode_ref(q, kc, vc, table, sl).to(out.device), tol=1e-3)
    return out


def varlen_args(lens=(4, 6), *, hq=4, hkv=2, d=32, device="cpu"):
    total = sum(lens)
    q, k, v = (t[0] for t in rand_qkv(1, total, total, hq, hkv, d, device=device))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu, max(lens, default=0)


def bhsd(b, s, h, d, *, device="cpu", seed=0):
    """A ``[B, H, S, D]`` tensor for the SDPA drop-in."""
    return torch.randn(b, h, s, d, generator=_gen(seed)).to(device=device, dtype=F16)


def sdpa_ref(q, k, v, **kw):
    return F.scaled_dot_product_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), **kw)


# ---------------------------------------------------------------- dtype


@pytest.mark.parametrize("op", OPS)
def test_dtype(op):
    """A dtype the op does not take, or one that differs from q's, names the argument first (longer lists:
    test_flash_api.BAD_DENSE, test_decode.BAD, test_rope_cache.BAD, test_sdpa, test_attention_builders)."""
    if op == "flash_attn":
        q, k, v = rand_qkv(1, 4, 4, 2, 2, 16, dtype=torch.float32)
        with pytest.raises(DTypeError, match=r"^q: expected dtype fp16 or bf16, got fp32"):
            flash_attn(q, k, v)
    elif op == "flash_attn_varlen":
        q, k, v, cu, m = varlen_args()
        with pytest.raises(DTypeError, match=r"^k: expected dtype fp16 \(q's\), got bf16"):
            flash_attn_varlen(q, k.bfloat16(), v, cu, cu, m, m)
        with pytest.raises(DTypeError, match=r"^cu_seqlens_q: expected dtype int32"):
            flash_attn_varlen(q, k, v, cu.long(), cu, m, m)
    elif op == "paged_attention_decode":
        q, kc, vc, table, sl = paged([3, 20])
        with pytest.raises(DTypeError, match=r"^k_cache: expected dtype"):
            paged_attention_decode(q, kc.float(), vc.float(), table, sl)
        with pytest.raises(DTypeError, match=r"^block_tables: expected dtype int32"):
            paged_attention_decode(q, kc, vc, table.long(), sl)
    elif op == "fused_rope_cache":
        a = rope_args()
        a[4] = a[4].float()
        with pytest.raises(DTypeError, match=r"^positions: expected dtype"):
            fused_rope_cache(*a)
    elif op == "sdpa":
        q = bhsd(1, 5, 2, 16)
        with pytest.raises(DTypeError, match=r"^value: expected query's dtype fp16, got bf16"):
            sdpa(q, q, q.bfloat16())
    else:
        exe = build_flash_attn_func_module(2, 16)
        q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=default_device())  # a GPU launcher refuses CPU
        with pytest.raises(DTypeError, match=r"^k: expected dtype bf16 \(the builder's\), got fp16"):
            exe(q, q.half(), q, torch.empty_like(q), 1, 4)


# ---------------------------------------------------------------- device


@pytest.mark.parametrize("op", OPS)
def test_device(op, device):
    """One tensor on another device names it (DeviceError) before anything launches; all-meta inputs give a
    meta result of the right shape (test_flash_api / test_decode / test_sdpa test_meta_tensors_*); a second
    GPU, where there is one, computes there and refuses a mix with the first."""
    meta = torch.device("meta")
    if op == "flash_attn":
        q, k, v = rand_qkv(1, 4, 6, 4, 2, 16, dtype=F16, device=device)
        with pytest.raises(DeviceError, match=r"^v: expected a tensor on .* \(like q\)"):
            flash_attn(q, k, v.to(meta))
        out = flash_attn(q.to(meta), k.to(meta), v.to(meta))
        assert out.device == meta and out.shape == (1, 4, 4, 16)
    elif op == "flash_attn_varlen":
        q, k, v, cu, m = varlen_args(device=device)
        with pytest.raises(DeviceError, match=r"^cu_seqlens_k: expected a tensor on .* \(q's device\)"):
            flash_attn_varlen(q, k, v, cu, cu.to(meta), m, m)
        out = flash_attn_varlen(q.to(meta), k.to(meta), v.to(meta), cu.to(meta), cu.to(meta), m, m)
        assert out.device == meta and out.shape == q.shape
    elif op == "paged_attention_decode":
        q, kc, vc, table, sl = paged([3, 20], device=device)
        with pytest.raises(DeviceError, match=r"^block_tables: expected a tensor on .* \(like q\)"):
            paged_attention_decode(q, kc, vc, table.to(meta), sl)
        out = paged_attention_decode(*(t.to(meta) for t in (q, kc, vc, table, sl)))
        assert out.device == meta and out.shape == q.shape
    elif op == "fused_rope_cache":
        a = rope_args(device=device)
        bad = list(a)
        bad[7] = bad[7].to(meta)
        with pytest.raises(DeviceError, match=r"^slot_mapping: expected a tensor on .* \(like q\)"):
            fused_rope_cache(*bad)
        out = fused_rope_cache(*(t.to(meta) for t in a))
        assert out.device == meta and out.shape == a[0].shape
    elif op == "sdpa":
        q = bhsd(1, 5, 2, 16, device=device)
        with pytest.raises(DeviceError, match="expected a tensor on"):
            sdpa(q, q.to(meta), q)
        out = sdpa(q.to(meta), q.to(meta), q.to(meta))
        assert out.device == meta and out.shape == q.shape
    else:
        exe = build_flash_attn_func_module(2, 16)
        q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=device)
        with pytest.raises(DeviceError, match=r"different devices \(argument 0 on .*, argument 3 on meta\)"):
            exe(q, q, q, torch.empty_like(q, device=meta), 1, 4)
    if device.type == "cuda" and torch.cuda.device_count() >= 2 and op == "flash_attn":
        q, k, v = rand_qkv(1, 40, 40, 4, 2, 64, dtype=F16, device="cuda:1")
        out = flash_attn(q, k, v, causal=True)
        assert out.device == q.device
        assert_rel_close(out, flash_attn_ref(q, k, v, causal=True), tol=tolerance(F16))
        with pytest.raises(DeviceError, match="^k: expected a tensor on cuda:1"):
            flash_attn(q, k.to("cuda:0"), v)


@pytest.mark.parametrize("op", ["paged_attention_decode", "fused_rope_cache"])
def test_device_scale_on_another_device(op):
    """A scale tensor on another device than the caches' is a DeviceError, as every device mismatch (it was
    an ArgumentError)."""
    fp8 = torch.float8_e4m3fn
    with pytest.raises(DeviceError, match="^k_scale: expected a tensor on cpu"):
        if op == "paged_attention_decode":
            q, kc, vc, table, sl = paged([3, 20])
            paged_attention_decode(q, kc.to(fp8), vc.to(fp8), table, sl, k_scale=torch.ones(1, device="meta"))
        else:
            a = rope_args()
            a[5], a[6] = a[5].to(fp8), a[6].to(fp8)
            fused_rope_cache(*a, k_scale=torch.ones(1, device="meta"))


# ---------------------------------------------------------------- shape


@pytest.mark.parametrize("op", OPS)
def test_shape(op):
    """A wrong rank or sizes that do not agree name the argument first."""
    if op == "flash_attn":
        q, k, v = rand_qkv(1, 4, 6, 4, 2, 16)
        with pytest.raises(ShapeError, match=r"^q: expected a 4-D tensor"):
            flash_attn(q[0], k, v)
        with pytest.raises(ShapeError, match=r"^v: expected the sequence and heads of k"):
            flash_attn(q, k, v[:, :5])
    elif op == "flash_attn_varlen":
        q, k, v, cu, m = varlen_args()
        with pytest.raises(ShapeError, match=r"^cu_seqlens_k: expected 3 offsets"):
            flash_attn_varlen(q, k, v, cu, cu[:2], m, m)
    elif op == "paged_attention_decode":
        q, kc, vc, table, sl = paged([3, 20])
        with pytest.raises(ShapeError, match=r"^block_tables: expected \[batch = 2"):
            paged_attention_decode(q, kc, vc, table[:1], sl)
        with pytest.raises(ShapeError, match=r"^q: expected \[batch, heads_q, head_dim\]"):
            paged_attention_decode(q[0], kc, vc, table, sl)
    elif op == "fused_rope_cache":
        a = rope_args()
        a[4] = a[4][:3]
        with pytest.raises(ShapeError, match=r"^positions: expected \[4\]"):
            fused_rope_cache(*a)
    elif op == "sdpa":
        q = bhsd(1, 5, 2, 16)
        with pytest.raises(ShapeError, match=r"^value: expected key's seqlen 5"):
            sdpa(q, q, bhsd(1, 4, 2, 16))
    else:
        exe = build_flash_attn_func_module(2, 16)
        q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16, device=default_device())
        with pytest.raises(ShapeError, match=r"^v: expected \[batch, seqlen, heads, head_dim\] = \[1, 4, 2, 16\]"):
            exe(q, q, q[:, :3], torch.empty_like(q), 1, 4)


# ---------------------------------------------------------------- stride


@pytest.mark.parametrize("op", OPS)
def test_stride(op, device):
    """Transposed and sliced views with a unit last stride are read in place, right against the reference
    (more layouts: test_flash_fwd.test_transposed_and_strided_layouts_are_read_in_place,
    test_decode.test_strided_layouts_and_out_buffer, test_rope_cache.test_strided_slices_of_a_fused_qkv); a
    non-unit last stride is a LayoutError naming the argument, as documented."""
    if op == "flash_attn":
        g = _gen()
        q = torch.randn(2, 8, 7, 32, generator=g).to(device=device, dtype=F16).transpose(1, 2)  # [B, H, S, D] seen
        kv = torch.randn(2, 9, 2, 3, 32, generator=g).to(device=device, dtype=F16)  # fused K/V, 3 heads
        k, v = kv[:, :, 0, ::2], kv[:, :, 1, 1:3]  # head slices: strides of a fused buffer
        assert_rel_close(flash_attn(q, k, v, causal=True), flash_attn_ref(q, k, v, causal=True), tol=tolerance(F16))
        with pytest.raises(LayoutError, match=r"^k: expected a unit stride in the last \(head_dim\) dimension"):
            flash_attn(q, torch.randn(2, 9, 2, 64, device=device, dtype=F16)[..., ::2], v)
    elif op == "flash_attn_varlen":
        q, k, v, cu, m = varlen_args(hq=4, hkv=2)
        qkv = torch.cat([q, k, v], dim=1).to(device)  # a fused QKV projection, [total, 8, D]
        q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
        cu = cu.to(device)
        got = flash_attn_varlen(q, k, v, cu, cu, m, m, causal=True)
        assert_rel_close(got, flash_attn_varlen_ref(q, k, v, cu, cu, causal=True), tol=tolerance(F16))
    elif op == "paged_attention_decode":
        q, kc, vc, table, sl = paged([5, 23], device=device)
        kv = torch.stack([kc, vc], dim=2)  # [blocks, page, 2, Hkv, D]: caches of one buffer
        check_decode(q, kv[:, :, 0], kv[:, :, 1], table, sl)
        with pytest.raises(LayoutError, match=r"^q: expected a unit stride"):
            paged_attention_decode(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, table, sl)
    elif op == "fused_rope_cache":
        a = rope_args(device=device)
        qkv = torch.cat(a[:3], dim=1)  # [tokens, 8, D]
        a[:3] = [qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]]
        check_rope(a)
    elif op == "sdpa":
        x = torch.randn(2, 6, 4, 16, generator=_gen()).to(device=device, dtype=F16)  # [B, S, H, D] memory
        q = k = v = x.transpose(1, 2)
        assert_rel_close(sdpa(q, k, v, is_causal=True), sdpa_ref(q, k, v, is_causal=True), tol=tolerance(F16))
    else:
        exe = build_flash_attn_func_module(2, 16, causal=True, dtype_str="f16")
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in rand_qkv(1, 5, 5, 2, 2, 16, device=device))
        o = empty_poisoned(1, 5, 2, 16, dtype=F16, device=device)
        exe(q, k, v, o, 1, 5)
        assert_rel_close(o, flash_attn_ref(q, k, v, causal=True), tol=tolerance(F16))
        with pytest.raises(ShapeError, match="^q:"):  # flat buffers must be contiguous, as documented
            exe(q.reshape(-1)[::2], k.reshape(-1), v.reshape(-1), o.view(-1), 1, 2)


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize("op", ["flash_attn", "flash_attn_varlen", "paged_attention_decode", "fused_rope_cache",
                                "sdpa"])  # fmt: skip
def test_alignment(op, device):
    """Every tensor a view one element into rows of D + 1 (odd) elements: a base pointer off 16 bytes and odd
    strides; right against the reference (the builder takes 4-D views the same way: flash_attn's path)."""
    d = 32

    def off(*shape, seed):
        t = torch.randn(*shape[:-1], shape[-1] + 1, generator=_gen(seed)).to(device=device, dtype=F16)
        return t[..., 1:]

    if op == "flash_attn":
        q, k, v = off(2, 7, 4, d, seed=0), off(2, 9, 2, d, seed=1), off(2, 9, 2, d, seed=2)
        assert q.data_ptr() % 16 and q.stride(2) % 2
        assert_rel_close(flash_attn(q, k, v), flash_attn_ref(q, k, v), tol=tolerance(F16))
    elif op == "flash_attn_varlen":
        q, k, v = off(10, 4, d, seed=0), off(10, 2, d, seed=1), off(10, 2, d, seed=2)
        cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
        got = flash_attn_varlen(q, k, v, cu, cu, 7, 7, causal=True)
        assert_rel_close(got, flash_attn_varlen_ref(q, k, v, cu, cu, causal=True), tol=tolerance(F16))
    elif op == "paged_attention_decode":
        check_decode(*paged([5, 23], device=device, pad=1))
    elif op == "fused_rope_cache":
        check_rope(rope_args(device=device, pad=1))
    else:
        q, k = off(1, 2, 6, d, seed=0), off(1, 2, 8, d, seed=1)
        assert_rel_close(sdpa(q, k, k), sdpa_ref(q, k, k), tol=tolerance(F16))


# ---------------------------------------------------------------- empty


@pytest.mark.parametrize("op", OPS)
def test_empty(op, device):
    """Zero batch / zero sequence / no key: an empty result, or zeros where rows see no key (test_flash_api,
    test_decode, test_rope_cache, test_sdpa and test_attention_builders have more empty cases)."""
    if op == "flash_attn":
        for b, sq, sk in ((0, 4, 4), (2, 0, 4)):
            q, k, v = rand_qkv(b, sq, sk, 4, 2, 16, device=device)
            assert flash_attn(q, k, v).shape == (b, sq, 4, 16)
        q, k, v = rand_qkv(2, 3, 0, 4, 2, 16, device=device)  # no key: every row 0, lse -inf
        out, lse = flash_attn(q, k, v, return_lse=True)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    elif op == "flash_attn_varlen":
        q, k, v, cu, m = varlen_args((0, 5, 0), device=device)  # empty sequences among others
        got = flash_attn_varlen(q, k, v, cu, cu, m, m)
        assert_rel_close(got, flash_attn_varlen_ref(q, k, v, cu, cu), tol=tolerance(F16))
        z = torch.zeros(1, dtype=torch.int32, device=device)
        assert flash_attn_varlen(q[:0], k[:0], v[:0], z, z, 0, 0).shape == (0, 4, 32)
    elif op == "paged_attention_decode":
        out = check_decode(*paged([0, 9], device=device))  # a sequence of no key gives 0
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        q, kc, vc, table, sl = paged([4], device=device)
        assert paged_attention_decode(q[:0], kc, vc, table[:0], sl[:0]).shape == (0, 4, 32)
    elif op == "fused_rope_cache":
        a = rope_args(tokens=0, device=device)
        kc0, vc0 = a[5].clone(), a[6].clone()
        assert fused_rope_cache(*a).shape == (0, 4, 32)
        assert torch.equal(a[5], kc0) and torch.equal(a[6], vc0)
    elif op == "sdpa":
        e = bhsd(0, 5, 2, 16, device=device)
        assert sdpa(e, e, e).shape == (0, 2, 5, 16)
        q, k = bhsd(1, 3, 2, 16, device=device), bhsd(1, 0, 2, 16, device=device)
        out = sdpa(q, k, k)
        assert torch.equal(out.double().cpu(), sdpa_ref(q, k, k))  # torch: zeros
    else:
        exe = build_flash_attn_func_module(2, 16, dtype_str="f16")
        q = torch.zeros(0, 4, 2, 16, dtype=F16, device=device)
        exe(q, q, q, torch.empty_like(q), 0, 4)
        buf = torch.full((8,), 3.0, dtype=F16, device=device)
        exe(buf, buf, buf, buf, 1, 0)  # seqlen 0: o (flat) untouched
        assert (buf == 3.0).all()


# ---------------------------------------------------------------- huge dimension


@pytest.mark.gpu
def test_huge_dimension():
    """flash_attn over q, k, v past 2^31 elements each (batch * seqlen * heads * head_dim): the last batch
    element, at the far end of every tensor, against the reference computed on that element only."""
    b, s, h, d = 2**14 + 1, 128, 8, 128  # 2^31 + 2^17 elements a tensor
    need = 4 * b * s * h * d * 2 + (2 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    q, k, v = (torch.zeros(b, s, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    assert q.numel() > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in (q, k, v):
        t[-1].normal_(generator=g)
    out = flash_attn(q, k, v, causal=True)
    ref = flash_attn_ref(q[-1:], k[-1:], v[-1:], causal=True)
    assert_rel_close(out[-1:], ref, tol=tolerance(torch.bfloat16))
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # zero inputs: zero rows, nothing written astray
    del q, k, v, out
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- NaN / Inf


def _same_non_finite(got, ref, what):
    got, ref = got.double().cpu(), ref.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN positions differ from torch's"
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"{what}: Inf positions differ from torch's"
    fin = torch.isfinite(ref)
    assert fin.any() and (~fin).any(), what  # the case has both kinds of rows
    assert_rel_close(got[fin], ref[fin], tol=tolerance(F16), name=what)


@pytest.mark.parametrize("op", ["flash_attn", "paged_attention_decode"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NaN arithmetic
def test_nan_inf(op, device):
    """A NaN key poisons exactly the rows that see it, and an Inf in one key's component poisons the rows whose
    score with it is +inf (those where it is -inf ignore that key), as torch's fp32 SDPA on the CPU does; keys
    nobody sees (causally later ones, cache slots past a sequence's length) poison nothing."""
    if op == "flash_attn":
        q, k, v = rand_qkv(2, 12, 12, 4, 2, 32, device="cpu")
        k[0, 5, 0] = float("nan")  # KV head 0 of batch 0: query heads 0 and 1, causal rows 5..11
        k[1, 3, 1, 0] = float("inf")  # +-inf scores in query heads 2 and 3 of batch 1, by q's sign
        ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                             v.float().transpose(1, 2), is_causal=True,
                                             enable_gqa=True).transpose(1, 2)  # fmt: skip
        assert torch.isnan(ref[0, :5]).sum() == 0 and torch.isnan(ref[0, 5:, :2]).all()
        got = flash_attn(q.to(device), k.to(device), v.to(device), causal=True)
        _same_non_finite(got, ref, "flash_attn")
    else:
        q, kc, vc, table, sl = paged([20, 9], device="cpu")
        kc[table[0, 0], 7, 1] = float("nan")  # sequence 0, key 7, KV head 1: query heads 2 and 3
        kc[table[0, 1], 6:, :] = float("nan")  # sequence 0's slots past its 20 keys (block 1, rows 6..)
        vc[table[0, 1], 6:, :] = float("inf")
        kc[table[1, 0], 9:, :] = float("nan")  # sequence 1's slots past its 9 keys
        ref = torch.stack([  # torch's SDPA over each sequence's keys (the package's reference maps NaN to 0)
            F.scaled_dot_product_attention(q[b, :, None].float(), *(gather_kv_ref(c, table, b, n).transpose(0, 1)
                                           for c in (kc, vc)), enable_gqa=True)[:, 0]
            for b, n in enumerate(sl.tolist())
        ])  # fmt: skip
        assert torch.isnan(ref[0, 2:]).all() and torch.isfinite(ref[0, :2]).all() and torch.isfinite(ref[1]).all()
        got = paged_attention_decode(*(t.to(device) for t in (q, kc, vc, table, sl)))
        _same_non_finite(got, ref, "paged_attention_decode")
