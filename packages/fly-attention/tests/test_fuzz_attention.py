"""Property-based fuzzing of every fly-attention op against its fp32 / fp64 reference (hypothesis).

Each draw picks shapes (length 1, odd lengths, each tile boundary of :func:`fly_attention.autotune.default_config`
/ :func:`~fly_attention.autotune.default_bwd_config` and of :mod:`fly_attention.decode_config` +-1: the
interpreter's 16 / 32 row and key tiles, the decode's 16 / 32 / 64 query rows a program and its cache blocks;
on a GPU also the 64 / 128 tiles and the seqlen_q <= 64 decode-like config), GQA / MQA ratios, head dims
(64, 80, 96, 128, 192, 256, a value head dim of its own, 192 / 128), layouts (contiguous and the
``[B, H, S, D].transpose(1, 2)`` view, strided slices), dtypes, every option, and values that stress the
numerics: large scores (a saturated softmax), rows of equal scores, rows that see no key (0 and lse -inf, as
documented), NaN (a NaN in q or k makes the rows that see it NaN, as torch's math does).

Ops: ``flash_attn`` (forward, lse, and dq / dk / dv through autograd), ``flash_attn_varlen`` (empty,
length-1 and odd sequences, tokens outside every sequence; forward and backward), the fp8 forward (against
``flash_attn_fp8_ref``), ``scaled_dot_product_attention`` (against torch's math SDPA, masks through its
fallback), ``paged_attention_decode`` and ``fused_rope_cache``.

Case counts. The shared profile (:mod:`flydsl.testing.fuzz`) runs 80 cases a test on the CPU; through the
interpreter six attention tests at 80 cases (each a forward, often a backward, and an fp64 reference) take
several minutes on CI's two cores, so this file's CPU profile runs :data:`CPU_EXAMPLES` a test (the GPU
profile keeps the shared count). ``FLYDSL_FUZZ_EXAMPLES`` still overrides both, and ``FLYDSL_FUZZ_SEED`` the
seed, which the module prints.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from torch.nn.attention import SDPBackend, sdpa_kernel

from fly_attention import decode as decode_mod
from fly_attention import (
    flash_attn,
    flash_attn_ref,
    flash_attn_varlen,
    flash_attn_varlen_ref,
    fused_rope_cache,
    paged_attention_decode,
    scaled_dot_product_attention,
)
from fly_attention import rope_cache as rope_mod
from fly_attention.decode_config import MAX_SPLITS
from fly_attention.decode_reference import fused_rope_cache_ref, paged_attention_decode_ref
from fly_attention.reference import attention_mask, flash_attn_fp8_ref
from flydsl.testing import assert_rel_close, cpu_select, default_device, empty_poisoned, gpu_available, tolerance
from flydsl.testing.fuzz import banner, finding, fuzz

GPU = gpu_available()
DEVICE = default_device()
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float16, torch.bfloat16]

# This file's CPU case count (module docstring); FLYDSL_FUZZ_EXAMPLES overrides it as it does the shared one.
CPU_EXAMPLES = 30


# Sequence lengths where a tile changes, +-1: the interpreter's 16 / 32 query and key tiles of the forward and
# the backward (and a few whole tiles); on a GPU the decode-like rows (seqlen_q <= 64) and the 64 / 128 tiles.
_CPU_EDGES = [1, 16, 32, 64]
_GPU_EDGES = [128, 256, 1024]
SEQ_EDGES = sorted({e + d for e in _CPU_EDGES + (_GPU_EDGES if GPU else []) for d in (-1, 0, 1)} - {0})
MAX_SEQ = 1100 if GPU else 70
HEAD_DIMS = [64, 80, 96, 128, 192, 256]
HEADS = [(1, 1), (2, 2), (3, 3), (2, 1), (3, 1), (4, 1), (4, 2), (6, 2), (6, 3)]  # (heads_q, heads_kv)
# CPU: the interpreter runs every element of a tile; keep a draw's work (b * hq * sq * sk * d) bounded.
_CPU_WORK = 1_500_000


@pytest.fixture(autouse=True, scope="module")
def _print_seed():
    print(banner("fly-attention", CPU_EXAMPLES))


@pytest.fixture(autouse=True, scope="module")
def _poisoned_decode_and_rope_buffers():
    """The decode's output and split workspace and the rotated q, allocated poisoned (NaN) as the conftest does
    flash_attn's: an element a kernel should write and did not fails."""
    with pytest.MonkeyPatch.context() as mp:
        for mod in (decode_mod, rope_mod):
            mp.setattr(mod, "_empty", lambda *shape, dtype, device: empty_poisoned(*shape, dtype=dtype,
                                                                                   device=device))  # fmt: skip
        yield


def _seq(lo=1, hi=MAX_SEQ):
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.sampled_from([e for e in SEQ_EDGES if lo <= e <= hi]))


@st.composite
def head_dims(draw):
    """(d, dv): an intended head dim, sometimes any in 1..256; dv the same, another, or 192 / 128."""
    pick = draw(st.integers(0, 9))
    if pick == 0:
        return 192, 128
    d = draw(st.sampled_from(HEAD_DIMS)) if pick > 1 else draw(st.integers(1, 256))
    dv = d if draw(st.integers(0, 3)) else draw(st.sampled_from(HEAD_DIMS + [8, 48]))
    return d, dv


def _gen(seed_):
    return torch.Generator().manual_seed(seed_)


def _randn(shape, gen, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """The same values as the ``.transpose(1, 2)`` view of ``[B, H, S, D]`` (3-D: ``[H, S, D]``) storage."""
    if t.dim() == 4:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.transpose(0, 1).contiguous().transpose(0, 1)


# ---------------------------------------------------------------- flash_attn / flash_attn_varlen


def _fill_values(q, k, v, kind, draw):
    """Values that stress the numerics, in place on fp64 q, k, v (``[..., S, H, D]``): "large" scores (a
    saturated softmax: q times 30 gives scores of +-100), "equal" (some query rows zero: every score of the
    row equal, p uniform), "nan" (a NaN in q, k or v). Returns (tensor name, index) of the NaN or None."""
    if kind == "large":
        q *= 30.0
    elif kind == "equal" and q.numel():
        rows = q.reshape(-1, q.shape[-2], q.shape[-1])
        pick = draw(st.lists(st.integers(0, rows.shape[0] - 1), min_size=1, max_size=3))
        rows[pick] = 0.0
    elif kind == "nan":
        name = draw(st.sampled_from(["q", "k", "v"]))
        t = {"q": q, "k": k, "v": v}[name]
        if t.numel() == 0:
            return None
        idx = tuple(draw(st.integers(0, n - 1)) for n in t.shape)
        t[idx] = float("nan")
        return name, idx
    return None


def _nan_expected(nan, out_shape, seen, group):
    """Where the output must be NaN (bool, out's shape ``[B, Sq, Hq, Dv]``) for one NaN input: a NaN in q
    makes its row NaN where the row sees a key; one in k every row of its KV head's group that sees the key;
    one in v that column of those rows. ``seen [B, Hq or 1, Sq, Sk]`` (bool). Rows that do not see a NaN key or
    value: the reference's p = 0 times NaN is NaN there, the kernel skips the key: those elements come back
    as the second mask, not compared."""
    exp = torch.zeros(out_shape, dtype=torch.bool)
    skip = torch.zeros(out_shape, dtype=torch.bool)
    name, idx = nan
    if name == "q":
        b, i, h, _ = idx
        if seen[b, min(h, seen.shape[1] - 1), i].any():
            exp[b, i, h, :] = True
        return exp, skip
    b, j, g, c = idx
    for h in range(g * group, (g + 1) * group):
        rows = seen[b, min(h, seen.shape[1] - 1), :, j]  # [Sq]
        if name == "k":
            exp[b, rows, h, :] = True
        else:
            exp[b, rows, h, c] = True
            skip[b, ~rows, h, c] = True
    return exp, skip


def _check_out(out, ref, tol, name, nan_exp=None, nan_skip=None):
    """NaN exactly where expected (never elsewhere: rows that see no key are 0); the rest against the reference."""
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    if nan_exp is None:
        assert not torch.isnan(o).any(), f"{name}: NaN in the output"
        assert_rel_close(o, r, tol=tol, name=name)
        return
    assert torch.isnan(o[nan_exp]).all(), f"{name}: an output that sees a NaN input is not NaN"
    keep = ~nan_exp & ~nan_skip
    assert not torch.isnan(o[keep]).any(), f"{name}: NaN in an output that sees no NaN input"
    clean = keep.flatten(0, -2).all(-1) if o.dim() else keep  # whole rows without NaN
    o2, r2 = o.flatten(0, -2)[clean], r.flatten(0, -2)[clean]
    assert_rel_close(o2, r2, tol=tol, name=name)


def _check_lse(lse, ref_lse, name="lse"):
    """The lse: the same rows at -inf (rows that see no key), NaN only in rows that see a NaN score, the finite
    ones close in fp32 (both from the same inputs)."""
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape, f"{name}: {lse.dtype} {tuple(lse.shape)}"
    got, ref = lse.detach().double().cpu(), ref_lse.detach().double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{name}: NaN in other rows than the reference's"
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{name}: rows at -inf differ"
    fin = torch.isfinite(ref)
    if fin.any():
        assert_rel_close(got[fin], ref[fin], tol=1e-5, name=name)


def _check_grads(leaves, dout, out, ref_fn, q, k, v, terms_fn=None, names=("dq", "dk", "dv")):
    """dq, dk, dv against fp64 autograd of the reference on the same 16-bit inputs and output gradient.

    As test_flash_bwd's check: the backward reads the forward's output as stored (16-bit), so its row terms
    ``delta = rowsum(dO * O)`` carry O's rounding, and the reference is the exact gradient given that O:
    autograd's with delta shifted, ``-(delta_O16 - delta_O64) * lse`` added to the loss (d lse / d s = p).

    dq and dk are sums of dS = p (dP - delta) times k or q, and dS cancels where a row's p is concentrated:
    one key (p = 1, dS = 0), a saturated softmax (the winning key's dP and delta agree to the others' p,
    e^-30 and less), so the exact dq can be tiny beside the fp32 terms the kernel subtracts (fp16, one key:
    the fp64 dq is 0, the kernel's 7e-7). They are held to their tolerance relative to the larger of their
    norm and the size of the terms before that cancellation, ``scale * ||(p * (|dP| + |delta|)) @ k||`` (q
    for dk), as the norm fuzz holds a cancelling dx; where nothing cancels that is about their own norm. dv
    (p^T dO, no cancellation) is held to the plain relative error."""
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))  # on the device: fp64 there
    ref, lse = ref_fn(qr, kr, vr)
    d64 = dout.detach().double()
    shift = ((d64 * out.detach().double()).sum(-1) - (d64 * ref.detach()).sum(-1)).transpose(-1, -2)
    lse0 = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # rows that see no key: no term
    loss = (ref * d64).sum() - (shift * lse0.detach()).sum()
    if loss.requires_grad:  # (no token in any sequence: the reference is a constant, every gradient 0)
        loss.backward()
    terms = terms_fn(qr.detach(), kr.detach(), vr.detach(), ref.detach(), lse.detach(), d64) if terms_fn else {}
    tol = tolerance(q.dtype)
    for leaf, ref_leaf, name in zip(leaves, (qr, kr, vr), names, strict=True):
        exp = ref_leaf.grad if ref_leaf.grad is not None else torch.zeros_like(ref_leaf)
        g = leaf.grad
        assert g is not None and g.shape == leaf.shape and g.dtype == leaf.dtype, f"{name}: {g}"
        got = g.detach().double()
        assert torch.isfinite(got).all(), f"{name}: non-finite gradient"
        scale = max(torch.linalg.vector_norm(exp).item(), terms.get(name, 0.0))
        if scale == 0.0:  # no key or no query row: the gradient is exactly 0
            assert not got.any(), f"{name}: expected 0, got max {got.abs().max().item()}"
            continue
        assert_rel_close(got, exp, tol=tol, name=name, terms=terms.get(name, 0.0))


def _dense_terms(case):
    """The size of the terms dq and dk sum (:func:`_check_grads`) for ``[B, S, H, D]`` fp64 tensors: p from
    the reference's scores and lse (softcap's derivative, <= 1, left out: a bound)."""

    def fn(q, k, v, out, lse, d64):
        group = q.shape[2] // max(k.shape[2], 1)
        kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scale = case["scale"] if case["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
        s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
        if case["softcap"] > 0:
            s = case["softcap"] * torch.tanh(s / case["softcap"])
        s = s.masked_fill(~attention_mask(q.shape[1], k.shape[1], case["causal"], case["window"], q.device),
                         float("-inf"))  # fmt: skip
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
        dp = torch.einsum("bqhd,bkhd->bhqk", d64, vv).abs()
        delta = (d64 * out).sum(-1).transpose(1, 2).abs()[..., None]  # [B, H, Sq, 1]
        mag = p * (dp + delta)
        dq = scale * torch.einsum("bhqk,bkhd->bqhd", mag, kk)
        dk = scale * torch.einsum("bhqk,bqhd->bkhd", mag, q)
        dk = dk.reshape(*k.shape[:3], group, q.shape[-1]).sum(3)  # a KV head's: summed over its group
        return {"dq": torch.linalg.vector_norm(dq).item(), "dk": torch.linalg.vector_norm(dk).item()}

    return fn


@st.composite
def flash_cases(draw):
    b = draw(st.integers(1, 2))
    sq, sk = draw(_seq()), draw(st.one_of(_seq(), st.just(0)) if draw(st.integers(0, 19)) == 0 else _seq())
    hq, hkv = draw(st.sampled_from(HEADS))
    d, dv = draw(head_dims())
    if not GPU:  # bound the interpreter's work: shorter sequences first, then one batch, then fewer heads
        while b * hq * sq * max(sk, 1) * max(d, dv) > _CPU_WORK and (b > 1 or hq > hkv or max(sq, sk) > 17):
            if b > 1:
                b = 1
            elif max(sq, sk) > 17:
                sq, sk = max(1, sq // 2), sk // 2
            else:
                hq = hkv
    causal = draw(st.booleans())
    window = (draw(st.sampled_from([-1, -1, 0, 1, 5, 16, 33])), draw(st.sampled_from([-1, -1, 0, 1, 7, 31])))
    case = {
        "b": b, "sq": sq, "sk": sk, "hq": hq, "hkv": hkv, "d": d, "dv": dv,
        "dtype": draw(st.sampled_from(DTYPES)), "causal": causal, "window": window,
        "softcap": draw(st.sampled_from([0.0, 0.0, 0.5, 3.0, 50.0])),
        "scale": draw(st.sampled_from([None, None, 0.05, 0.37, 1.0])),
        "lse": draw(st.booleans()), "layout": tuple(draw(st.booleans()) for _ in range(3)),
        "kind": draw(st.sampled_from(["normal", "normal", "large", "equal", "nan"])),
        "seed": draw(st.integers(0, 2**16)),
    }  # fmt: skip
    case["grad"] = case["kind"] != "nan" and draw(st.booleans())
    return case


def _opts(case):
    return {"causal": case["causal"], "window": case["window"], "softcap": case["softcap"],
            "softmax_scale": case["scale"]}  # fmt: skip


def _run_flash(case, draw):
    """One flash_attn draw: forward (and lse) against flash_attn_ref in fp64, then the gradients."""
    if currently_in_test_context():  # (also run directly, by the fixed examples below)
        note(str(case))
    g = _gen(case["seed"])
    b, sq, sk, hq, hkv, d, dv = (case[x] for x in ("b", "sq", "sk", "hq", "hkv", "d", "dv"))
    q, k, v = _randn((b, sq, hq, d), g), _randn((b, sk, hkv, d), g), _randn((b, sk, hkv, dv), g)
    nan = _fill_values(q, k, v, case["kind"], draw)
    dtype = case["dtype"]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    q, k, v = (_bhsd(t) if tr else t for t, tr in zip((q, k, v), case["layout"], strict=True))
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    leaves = [t.detach().clone().requires_grad_(case["grad"]) for t in (q, k, v)]
    if case["grad"]:  # the leaves keep the drawn layout (clone keeps strides): the kernels read them in place
        assert all(a.stride() == t.stride() for a, t in zip(leaves, (q, k, v), strict=True))
    opts = _opts(case)
    got = flash_attn(*leaves, return_lse=case["lse"], **opts)
    out, lse = got if case["lse"] else (got, None)
    ref, ref_lse = flash_attn_ref(q, k, v, dtype=torch.float64, return_lse=True, **opts)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype and out.is_contiguous()
    tol = tolerance(dtype)
    if nan is None:
        _check_out(out, ref, tol, "out")
    else:
        seen = attention_mask(sq, sk, case["causal"], case["window"])[None, None].expand(b, 1, sq, sk)
        exp, skip = _nan_expected(nan, out.shape, seen, hq // hkv)
        _check_out(out, ref, tol, "out", exp, skip)
    if lse is not None:
        _check_lse(lse, ref_lse)
    if not case["grad"]:
        return
    dout = _randn(out.shape, _gen(case["seed"] + 1)).to(dtype).to(DEVICE)
    out.backward(dout)
    _check_grads(leaves, dout, out, lambda q_, k_, v_: flash_attn_ref(q_, k_, v_, dtype=torch.float64,
                                                                      return_lse=True, **opts),
                 q, k, v, _dense_terms(case))  # fmt: skip


@fuzz(cpu_examples=CPU_EXAMPLES)
@given(data=st.data())
def test_fuzz_flash_attn(data):
    """flash_attn forward, lse and backward: MHA / GQA / MQA, causal (bottom-right for seqlen_q != seqlen_k),
    windows, softcap, scales, head dims and a value head dim of its own, both layouts, fp16 / bf16."""
    _run_flash(data.draw(flash_cases()), data.draw)


@fuzz(cpu_examples=CPU_EXAMPLES)
@given(data=st.data())
def test_fuzz_flash_attn_varlen(data):
    """flash_attn_varlen: 1-4 packed sequences of random lengths (0 and 1 included: the docs allow empty
    sequences), seqlen_q and seqlen_k of each its own (the causal / window alignment per sequence), tokens
    before the first and after the last sequence (0, lse -inf, gradient 0), max_seqlen past the longest; every
    option; forward, lse and backward against flash_attn_varlen_ref in fp64."""
    n = data.draw(st.integers(1, 4))
    hi = MAX_SEQ if GPU else 34  # (the 16 / 32 tiles +-1; the dense test has the longer ones)
    lens_q = data.draw(st.lists(st.one_of(st.just(0), _seq(1, hi)), min_size=n, max_size=n))
    lens_k = data.draw(st.lists(st.one_of(st.just(0), _seq(1, hi)), min_size=n, max_size=n))
    hq, hkv = data.draw(st.sampled_from(HEADS))
    d, dv = data.draw(head_dims())
    if not GPU:
        while sum(a * b for a, b in zip(lens_q, lens_k, strict=True)) * hq * max(d, dv) > _CPU_WORK:
            lens_q, lens_k = [x // 2 for x in lens_q], [x // 2 for x in lens_k]
    pad = (data.draw(st.sampled_from([0, 0, 2])), data.draw(st.sampled_from([0, 0, 3])))
    extra = data.draw(st.sampled_from([0, 0, 1, 9]))
    case = {"lens_q": lens_q, "lens_k": lens_k, "hq": hq, "hkv": hkv, "d": d, "dv": dv, "pad": pad, "extra": extra,
            "dtype": data.draw(st.sampled_from(DTYPES)), "causal": data.draw(st.booleans()),
            "window": (data.draw(st.sampled_from([-1, -1, 0, 3, 17])), data.draw(st.sampled_from([-1, -1, 0, 5]))),
            "softcap": data.draw(st.sampled_from([0.0, 0.0, 2.0])), "scale": data.draw(st.sampled_from([None, 0.3])),
            "kind": data.draw(st.sampled_from(["normal", "normal", "large", "equal"])),
            "layout": data.draw(st.booleans()), "grad": data.draw(st.booleans()),
            "seed": data.draw(st.integers(0, 2**16))}  # fmt: skip
    note(str(case))
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32) + pad[0]
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32) + pad[0]
    tq, tk = int(cq[-1]) + pad[1], int(ck[-1]) + pad[1]
    g = _gen(case["seed"])
    q, k, v = _randn((tq, hq, d), g), _randn((tk, hkv, d), g), _randn((tk, hkv, dv), g)
    _fill_values(q, k, v, case["kind"], data.draw)
    dtype = case["dtype"]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if case["layout"]:  # [H, T, D] storage seen as [T, H, D]
        q, k, v = (_bhsd(t) for t in (q, k, v))
    q, k, v, cq, ck = (t.to(DEVICE) for t in (q, k, v, cq, ck))
    leaves = [t.detach().clone().requires_grad_(case["grad"]) for t in (q, k, v)]
    opts = _opts(case)
    max_q, max_k = max(lens_q) + extra, max(lens_k) + extra
    out, lse = flash_attn_varlen(*leaves, cq, ck, max_q, max_k, return_lse=True, **opts)
    ref, ref_lse = flash_attn_varlen_ref(q, k, v, cq, ck, dtype=torch.float64, return_lse=True, **opts)
    assert out.shape == (tq, hq, dv) and out.dtype == dtype
    _check_out(out, ref, tolerance(dtype), "out")
    _check_lse(lse, ref_lse)
    if not case["grad"]:
        return
    dout = _randn(out.shape, _gen(case["seed"] + 1)).to(dtype).to(DEVICE)
    out.backward(dout)
    dense = _dense_terms(case)

    def terms(q_, k_, v_, out_, lse_, d64):
        """The dense terms, sequence by sequence (root of the summed squares)."""
        tot = {"dq": 0.0, "dk": 0.0}
        for b in range(n):
            q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
            if q1 > q0 and k1 > k0:
                part = dense(q_[None, q0:q1], k_[None, k0:k1], v_[None, k0:k1], out_[None, q0:q1],
                             lse_[None, :, q0:q1], d64[None, q0:q1])  # fmt: skip
                tot = {x: tot[x] + part[x] ** 2 for x in tot}
        return {x: y**0.5 for x, y in tot.items()}

    ref_fn = lambda q_, k_, v_: flash_attn_varlen_ref(q_, k_, v_, cq, ck, dtype=torch.float64,  # noqa: E731
                                                      return_lse=True, **opts)  # fmt: skip
    _check_grads(leaves, dout, out, ref_fn, q, k, v, terms)
    for t, lo, hi_ in ((leaves[0], pad[0], tq - pad[1]), (leaves[1], pad[0], tk - pad[1])):
        assert not t.grad[:lo].any() and not t.grad[hi_:].any(), "a token outside every sequence got a gradient"


# ---------------------------------------------------------------- fp8 forward

LN2 = math.log(2.0)
FP8_GPU_TOL = 2.0**-4  # P's rounding to e4m3 for P @ V (test_flash_fp8's module docstring)
# sm_90's fp8 dot accumulates with ~14 mantissa bits: the scores' error is relative to the size of the d
# products they sum (|q| . |k|), not to the score (which cancels), so the lse is held to 2^-13 of that size
FP8_LSE_TOL = 2.0**-13 if GPU else 1e-5


@fuzz(cpu_examples=CPU_EXAMPLES)
@given(data=st.data())
def test_fuzz_flash_attn_fp8(data):
    """The fp8 e4m3 forward against flash_attn_fp8_ref (the fp32 reference on the dequantized inputs): GQA,
    causal, windows, lse, descales as [1] / 0-d tensors, numbers and None, bf16 / fp16 output.

    On the CPU, Triton's interpreter rounds fp32 to e4m3 wrongly where the rounding carries into the next power
    of two (test_flash_fp8), so the CPU draws take scores whose probabilities are exact in e4m3: integer q
    and k, power-of-two q / k descales and ``softmax_scale = ln 2`` (every p a power of two; large integers give
    a saturated softmax), and no softcap (tanh leaves the powers of two); the output is then bf16 / fp16
    exact. The GPU draws take random values, any scale and softcap, at the kernel's documented 2^-4."""
    b = data.draw(st.integers(1, 2))
    sq, sk = data.draw(_seq()), data.draw(_seq())
    hq, hkv = data.draw(st.sampled_from(HEADS))
    d = data.draw(st.sampled_from([16, 32, 64, 80, 96, 128] + ([192, 256] if GPU else [])))
    dv = d if data.draw(st.booleans()) else data.draw(st.sampled_from([16, 48, 64]))
    if not GPU:
        while b * hq * sq * sk * max(d, dv) > _CPU_WORK and max(sq, sk) > 17:
            sq, sk = max(1, sq // 2), max(1, sk // 2)
    causal = data.draw(st.booleans())
    window = (data.draw(st.sampled_from([-1, -1, 0, 6])), data.draw(st.sampled_from([-1, -1, 0, 9])))
    large = data.draw(st.booleans())
    s0 = data.draw(st.integers(0, 2**16))
    g = _gen(s0)

    def descale(val):
        kind = data.draw(st.sampled_from(["number", "tensor1", "tensor0"] + (["none"] if val == 1.0 else [])))
        return {"none": None, "number": val, "tensor1": torch.tensor([val], device=DEVICE),
                "tensor0": torch.tensor(val, device=DEVICE)}[kind]  # fmt: skip

    # CPU: q and k descales powers of two whose product is a whole one (the scores stay integers)
    e_q = data.draw(st.integers(-2, 2))
    e_k = data.draw(st.integers(max(-2, -e_q), 2))
    if GPU:
        vals = [data.draw(st.sampled_from([0.37, 1.0, 1.5, 3.0])) for _ in range(2)]
    else:
        vals = [2.0**e_q, 2.0**e_k]
    descales = (descale(vals[0]), descale(vals[1]), descale(data.draw(st.sampled_from([0.37, 1.0, 1.5, 3.0]))))
    out_dtype = data.draw(st.sampled_from([None, torch.bfloat16, torch.float16]))
    if GPU:
        scale = data.draw(st.sampled_from([None, 0.2, LN2]))
        softcap = data.draw(st.sampled_from([0.0, 0.0, 5.0]))
        mag = 8.0 if large else 1.0
        q, k = _randn((b, sq, hq, d), g, mag), _randn((b, sk, hkv, d), g, mag)
    else:
        scale, softcap = LN2, 0.0
        lim = 4 if large else 1
        q = torch.randint(-lim, lim + 1, (b, sq, hq, d), generator=g).double()
        k = torch.randint(-lim, lim + 1, (b, sk, hkv, d), generator=g).double()
    v = _randn((b, sk, hkv, dv), g, 3.0)
    q, k, v = (t.to(FP8).to(DEVICE) for t in (q, k, v))
    opts = {"causal": causal, "window": window, "softmax_scale": scale, "softcap": softcap}
    note(f"b{b} {sq}x{sk} h{hq}/{hkv} d{d}/{dv} large={large} descales={descales} out={out_dtype} {opts} seed {s0}")
    out, lse = flash_attn(q, k, v, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                          out_dtype=out_dtype, return_lse=True, **opts)  # fmt: skip
    ref, ref_lse = flash_attn_fp8_ref(q.cpu(), k.cpu(), v.cpu(), *(x.cpu() if isinstance(x, torch.Tensor) else x
                                                                   for x in descales),
                                      return_lse=True, **opts)  # fmt: skip
    assert out.shape == (b, sq, hq, dv) and out.dtype == (out_dtype or torch.bfloat16)
    _check_out(out, ref, FP8_GPU_TOL if GPU else tolerance(out.dtype), "out")
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    got, r = lse.cpu().double(), ref_lse.double()
    assert torch.equal(torch.isneginf(got), torch.isneginf(r)) and not torch.isnan(got).any(), "lse: -inf / NaN rows"
    fin = torch.isfinite(r)
    if fin.any():
        qd, kd = (t.double().abs() * float(f if f is not None else 1.0)
                  for t, f in zip((q, k), descales[:2], strict=True))  # fmt: skip
        size = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(hq // hkv, dim=2)).amax(-1).cpu()
        size = size * (scale if scale is not None else 1.0 / math.sqrt(d))  # a row's largest |q| . |k|
        assert_rel_close(got[fin], r[fin], tol=FP8_LSE_TOL, name="lse",
                         terms=torch.linalg.vector_norm(size[fin]).item())  # fmt: skip


# ---------------------------------------------------------------- scaled_dot_product_attention


@fuzz(cpu_examples=CPU_EXAMPLES)
@given(data=st.data())
def test_fuzz_sdpa(data):
    """scaled_dot_product_attention against torch's math SDPA in fp32 on the same values: 3-D and 4-D,
    torch's top-left is_causal for any seqlen_q / seqlen_k, scale, enable_gqa and a single broadcast KV head,
    both layouts ([B, S, H, D] storage seen as [B, H, S, D] too), and boolean / additive masks (served by
    torch's SDPA, warned once). Rows a boolean mask leaves empty are kept out of the draws: torch's own
    backends disagree on them (NaN or 0), and the fallback is torch's."""
    rank = data.draw(st.sampled_from([3, 4, 4]))
    b = data.draw(st.integers(1, 2))
    sq, sk = data.draw(_seq(1, 40 if not GPU else MAX_SEQ)), data.draw(_seq(1, 40 if not GPU else MAX_SEQ))
    hq, hkv = data.draw(st.sampled_from(HEADS))
    gqa = hkv not in (hq, 1) or data.draw(st.booleans())
    d = data.draw(st.sampled_from([16, 32, 64, 80, 128]))
    dv = d if data.draw(st.booleans()) else data.draw(st.sampled_from([16, 48]))
    dtype = data.draw(st.sampled_from(DTYPES))
    is_causal = data.draw(st.booleans())
    scale = data.draw(st.sampled_from([None, None, 0.1, 1.0, 0.0]))
    mask = data.draw(st.sampled_from([None, None, None, "bool", "additive"]))
    large = data.draw(st.booleans())
    s0 = data.draw(st.integers(0, 2**16))
    g = _gen(s0)
    lead = (b,) if rank == 4 else ()
    q = _randn((*lead, hq, sq, d), g, 20.0 if large else 1.0).to(dtype)
    k, v = _randn((*lead, hkv, sk, d), g).to(dtype), _randn((*lead, hkv, sk, dv), g).to(dtype)
    if data.draw(st.booleans()):  # [.., S, H, D] storage
        q, k, v = (t.transpose(-2, -3).contiguous().transpose(-2, -3) for t in (q, k, v))
    attn_mask = None
    if mask is not None:
        keep = torch.rand(sq, sk, generator=g) < 0.7
        keep[:, 0] |= ~keep.any(-1)  # no empty row (docstring)
        if is_causal:  # torch refuses a mask with is_causal
            is_causal = False
        attn_mask = keep if mask == "bool" else torch.where(keep, _randn((sq, sk), g), -math.inf).to(dtype)
    note(f"rank {rank} b{b} {sq}x{sk} h{hq}/{hkv} gqa={gqa} d{d}/{dv} {dtype} causal={is_causal} scale={scale} "
         f"mask={mask} large={large} seed {s0}")  # fmt: skip
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    attn_mask = attn_mask.to(DEVICE) if attn_mask is not None else None
    kw = {"attn_mask": attn_mask, "is_causal": is_causal, "scale": scale, "enable_gqa": gqa}
    with warnings.catch_warnings():  # a mask's fallback warns once (test_sdpa checks it)
        warnings.simplefilter("ignore", UserWarning)
        out = scaled_dot_product_attention(q, k, v, **kw)
    m = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.float()
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **{**kw, "attn_mask": m})
    assert out.shape == ref.shape and out.dtype == dtype
    _check_out(out, ref, tolerance(dtype), "sdpa")


# ---------------------------------------------------------------- paged_attention_decode

PAGES = [1, 2, 4, 8, 16, 32, 64, 128, 256] if GPU else [1, 2, 4, 8, 16, 32, 64, 128]
# (GQA group, new tokens): rows a KV head of 15, 16, 17, 32, 33, 64 and 65, each side of the decode's 16 / 32 /
# 64 query rows a program (decode_block_m)
_ROW_EDGES = [(15, 1), (8, 2), (17, 1), (4, 8), (11, 3), (8, 8), (13, 5)]


@fuzz(cpu_examples=CPU_EXAMPLES)
@given(data=st.data())
def test_fuzz_paged_attention_decode(data):
    """paged_attention_decode against paged_attention_decode_ref: shuffled block tables (a shared prefix block,
    entries past a sequence's blocks -1), block sizes, seq_lens of 0 / 1 / a block +-1 / past the capacity /
    negative (both clamped, as documented), q_len 1..8 (3-D q for one token), GQA groups whose rows cross the
    16 / 32 / 64 rows of a program, splits (default, 1, more than the keys have steps, 64), fp8 caches with
    per-tensor and per-head scales as numbers and tensors, window, softcap, scale, dense caches, strided q
    and caches, ``out=``; large scores, equal scores, NaN in q."""
    batch = data.draw(st.integers(1, 3))
    page = data.draw(st.sampled_from(PAGES))
    if data.draw(st.integers(0, 3)) == 0:
        group, q_len = data.draw(st.sampled_from(_ROW_EDGES))
    else:
        group, q_len = data.draw(st.sampled_from([1, 2, 3, 4, 5, 8])), data.draw(st.integers(1, 8))
    hkv = data.draw(st.integers(1, 2))
    hq = group * hkv
    d = data.draw(st.sampled_from([16, 32, 64, 80, 128, 256] if GPU else [16, 32, 64, 80, 128]))
    cap_blocks = data.draw(st.integers(1, 4 if not GPU else 64))
    if not GPU:
        cap_blocks = max(1, min(cap_blocks, 160 // page))
    cap = cap_blocks * page
    paged = data.draw(st.integers(0, 4)) > 0
    kv_dtype = data.draw(st.sampled_from(["x", "x", "fp8"]))
    dtype = data.draw(st.sampled_from(DTYPES))
    # the most splits now and then (through the interpreter a 64-split call takes a second whatever its size)
    splits = MAX_SPLITS if data.draw(st.integers(0, 15)) == 0 else data.draw(st.sampled_from([None, None, 1, 2, 3, 7]))
    if not GPU and splits is not None and splits > 1:
        # the interpreter runs a program a split and a merge program an output row: bound both
        if splits == MAX_SPLITS:
            batch, q_len, hkv, group = 1, 1, 1, min(group, 2)
        while batch * q_len * group * hkv > 32 and (batch > 1 or q_len > 1):
            batch, q_len = (batch - 1, q_len) if batch > 1 else (batch, q_len // 2)
        hq = group * hkv
    lens_pool = [0, 1, page - 1, page, page + 1, cap - 1, cap, 2 * page + 1]
    seq_lens = [data.draw(st.one_of(st.sampled_from([x for x in lens_pool if 0 <= x <= cap]), st.integers(0, cap)))
                for _ in range(batch)]  # fmt: skip
    if data.draw(st.integers(0, 9)) == 0:  # values past the capacity or negative: clamped
        seq_lens[0] = data.draw(st.sampled_from([cap + 5, -3]))
    window = data.draw(st.sampled_from([-1, -1, 0, 1, 5, page]))
    softcap = data.draw(st.sampled_from([0.0, 0.0, 2.0, 30.0]))
    scale = data.draw(st.sampled_from([None, None, 0.2, 1.0]))
    kind = data.draw(st.sampled_from(["normal", "normal", "large", "equal", "nan"]))
    use_out = data.draw(st.booleans())
    strided = data.draw(st.booleans())
    s0 = data.draw(st.integers(0, 2**16))
    g = _gen(s0)
    note(f"lens {seq_lens} page {page} cap {cap} group {group} q_len {q_len} hkv {hkv} d {d} paged={paged} "
         f"{kv_dtype} {dtype} splits {splits} window {window} softcap {softcap} scale {scale} {kind} out={use_out} "
         f"strided={strided} seed {s0}")  # fmt: skip

    # the cache: every sequence its own blocks in shuffled order among spare ones, block 0's physical block
    # shared by all (a shared prompt); table entries past a sequence's blocks -1
    if paged:
        need = [-(-min(max(n, 0), cap) // page) for n in seq_lens]
        num_blocks = 1 + sum(max(x - 1, 0) for x in need) + data.draw(st.integers(0, 3))
        perm = torch.randperm(num_blocks, generator=g).int()
        table = torch.full((batch, cap_blocks), -1, dtype=torch.int32)
        at = 1
        for b_, x in enumerate(need):
            if x:
                table[b_, 0] = perm[0]
                table[b_, 1:x] = perm[at : at + x - 1]
                at += x - 1
        cache_shape = (num_blocks, page, hkv, d)
    else:
        table = None
        cache_shape = (batch, cap, hkv, d)
    q = _randn((batch, q_len, hq, d), g, 20.0 if kind == "large" else 1.0)
    kc, vc = _randn(cache_shape, g), _randn(cache_shape, g)
    if kind == "equal":  # every key the same: equal scores, p uniform over what a row sees
        kc[:] = kc.reshape(-1, d)[:1].reshape(1, 1, 1, d) if kc.numel() else kc
    nan_at = None
    if kind == "nan":
        nan_at = (data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, q_len - 1)),
                  data.draw(st.integers(0, hq - 1)))  # fmt: skip
        q[nan_at + (data.draw(st.integers(0, d - 1)),)] = float("nan")
    q = q.to(dtype)
    ks = vs = None
    if kv_dtype == "fp8":

        def scale_of():
            how = data.draw(st.sampled_from(["number", "tensor1", "tensor0", "per_head"]))
            vals = torch.tensor([data.draw(st.sampled_from([0.25, 0.5, 1.5, 3.0])) for _ in range(hkv)])
            return {"number": float(vals[0]), "tensor1": vals[:1], "tensor0": vals[0].clone(), "per_head": vals}[how]

        ks, vs = scale_of(), scale_of()
        kc, vc = kc.to(FP8), vc.to(FP8)
        ks, vs = (x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (ks, vs))
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    if strided:  # q a slice of wider heads; caches stored [blocks, heads, block, D] seen through a transpose
        wide = torch.zeros(batch, q_len, hq + 2, d, dtype=dtype)
        wide[:, :, 1 : 1 + hq] = q
        q = wide[:, :, 1 : 1 + hq]
        kc, vc = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (kc, vc))
    if q_len == 1 and data.draw(st.booleans()):
        q = q[:, 0]  # the one-token form [batch, heads_q, head_dim]
    q, kc, vc = (t.to(DEVICE) for t in (q, kc, vc))
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    if not paged and data.draw(st.integers(0, 3)) == 0:
        sl, seq_lens = None, [cap] * batch
    table = table.to(DEVICE) if table is not None else None
    opts = {"softmax_scale": scale, "k_scale": ks, "v_scale": vs, "window": window, "softcap": softcap}
    out_buf = empty_poisoned(*q.shape, dtype=dtype, device=DEVICE) if use_out else None
    out = paged_attention_decode(q, kc, vc, table, sl, num_splits=splits, out=out_buf, **opts)
    if use_out:
        assert out.data_ptr() == out_buf.data_ptr()
    ref = paged_attention_decode_ref(q, kc, vc, table, sl, **opts)
    assert out.shape == q.shape and out.dtype == dtype
    o4, r4 = (t.reshape(batch, q_len, hq, d) for t in (out, ref))
    exp = skip = None
    if nan_at is not None:  # the row with the NaN is NaN where it sees a key (the rest of it 0 where none)
        exp = torch.zeros(o4.shape, dtype=torch.bool)
        skip = torch.zeros(o4.shape, dtype=torch.bool)
        n = min(max(seq_lens[nan_at[0]], 0), cap)
        if n - q_len + nan_at[1] >= 0:
            exp[nan_at] = True
    _check_out(o4, r4, tolerance(dtype), "decode", exp, skip)


# ---------------------------------------------------------------- fused_rope_cache


def _cos_sin(max_pos, rot, dtype):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1).to(dtype)


@fuzz(cpu_examples=CPU_EXAMPLES)
@given(data=st.data())
def test_fuzz_fused_rope_cache(data):
    """fused_rope_cache against fused_rope_cache_ref: NeoX and GPT-J, partial rotary dims (any even one), a
    value head dim of its own, block sizes, shuffled slots with -1 (skipped) and slots past the cache (write
    nothing, as documented), positions past the table (clamped), int32 / int64 indices, fp32 or 16-bit
    cos / sin, slices of a fused QKV, fp8 caches with scales (numbers, [1], 0-d, per head; large values
    saturate to +-448). Cache rows of no token keep their values exactly; k and v are not modified."""
    tokens = data.draw(st.one_of(st.integers(0, 40), st.sampled_from([1, 15, 16, 17, 31, 32, 33])))
    hkv = data.draw(st.integers(1, 3))
    hq = hkv * data.draw(st.sampled_from([1, 2, 4]))
    d = data.draw(st.one_of(st.sampled_from([32, 64, 80, 128, 256]), st.integers(1, 128).map(lambda x: 2 * x)))
    dv = d if data.draw(st.booleans()) else data.draw(st.sampled_from([8, 32, 48, 128]))
    rot = d if data.draw(st.booleans()) else 2 * data.draw(st.integers(1, d // 2))
    page = data.draw(st.sampled_from([1, 2, 8, 16, 32]))
    dtype = data.draw(st.sampled_from(DTYPES))
    fp8 = data.draw(st.booleans())
    is_neox = data.draw(st.booleans())
    cs_dtype = data.draw(st.sampled_from([torch.float32, dtype]))
    idx_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    fused = data.draw(st.booleans())
    large = data.draw(st.booleans())
    s0 = data.draw(st.integers(0, 2**16))
    g = _gen(s0)
    num_blocks = -(-tokens // page) + data.draw(st.integers(1, 2))
    max_pos = data.draw(st.sampled_from([1, 7, 300]))
    note(f"t{tokens} h{hq}/{hkv} d{d}/{dv} rot {rot} page {page} {dtype} fp8={fp8} neox={is_neox} cs {cs_dtype} "
         f"{idx_dtype} fused={fused} large={large} blocks {num_blocks} max_pos {max_pos} seed {s0}")  # fmt: skip
    mag = (300.0 if dtype == torch.float16 else 1e4) if large else 1.0
    q, k, v = _randn((tokens, hq, d), g, mag), _randn((tokens, hkv, d), g, mag), _randn((tokens, hkv, dv), g, mag)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if fused:  # slices of one [tokens, (Hq + Hkv) * D + Hkv * Dv] projection
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, dv)
    slots = torch.randperm(num_blocks * page, generator=g)[:tokens]
    for t in data.draw(st.lists(st.integers(0, max(tokens - 1, 0)), max_size=3)) if tokens else []:
        slots[t] = data.draw(st.sampled_from([-1, -1, num_blocks * page + 3]))
    positions = torch.randint(0, max_pos + (3 if data.draw(st.booleans()) else 0), (tokens,), generator=g)
    cache_dtype = FP8 if fp8 else dtype
    kc = _randn((num_blocks, page, hkv, d), g).to(cache_dtype)
    vc = _randn((num_blocks, page, hkv, dv), g).to(cache_dtype)
    ks = vs = None
    if fp8:

        def scale_of():
            how = data.draw(st.sampled_from([None, "number", "tensor1", "tensor0", "per_head"]))
            vals = torch.tensor([data.draw(st.sampled_from([0.02, 0.5, 1.0, 3.0])) for _ in range(hkv)])
            if how is None:
                return None
            return {"number": float(vals[0]), "tensor1": vals[:1], "tensor0": vals[0].clone(), "per_head": vals}[how]

        ks, vs = scale_of(), scale_of()
    cs = _cos_sin(max_pos, rot, cs_dtype)
    args = [q, k, v, cs, positions.to(idx_dtype), kc, vc, slots.to(idx_dtype)]
    args = [t.to(DEVICE) for t in args]
    ks, vs = (x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (ks, vs))
    k0, v0 = args[1].clone(), args[2].clone()
    # the reference indexes: slots past the cache as -1, positions clamped into the table (the docs)
    ref_slots = torch.where(slots >= num_blocks * page, -1, slots)
    ref_args = [*args[:4], positions.clamp(0, max_pos - 1), args[5], args[6], ref_slots]
    ref_q, ref_kc, ref_vc = fused_rope_cache_ref(*ref_args, is_neox=is_neox, k_scale=ks, v_scale=vs)
    got = fused_rope_cache(*args, is_neox=is_neox, k_scale=ks, v_scale=vs)
    kc, vc = args[5], args[6]
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    _check_out(got, ref_q, tolerance(dtype), "q")
    assert torch.equal(args[1], k0) and torch.equal(args[2], v0), "k or v modified"
    if fp8:  # within one fp8 step of torch's rounding (the division may differ in its last bit): test_rope_cache's
        for name, c, r in (("k_cache", kc, ref_kc), ("v_cache", vc, ref_vc)):
            assert_rel_close(c.float(), r.float(), tol=0.07, name=name)
            assert c.float().abs().max() <= 448, f"{name}: not saturated to +-448"
    else:
        assert_rel_close(kc.float(), ref_kc.float(), tol=tolerance(dtype), name="k_cache")
        assert torch.equal(vc.cpu(), ref_vc), "v_cache: the copy is exact"
    written = torch.zeros(num_blocks * page, dtype=torch.bool)
    written[ref_slots[ref_slots >= 0]] = True
    keep = ~written.view(num_blocks, page)
    for name, c, r in (("k_cache", kc, ref_kc), ("v_cache", vc, ref_vc)):
        unchanged = torch.equal(cpu_select(c, keep).float(), cpu_select(r, keep).float())
        assert unchanged, f"{name}: a row of no token changed"


# ---------------------------------------------------------------- failures the fuzzing found, as fixed examples


@finding
@pytest.mark.parametrize("where", ["q", "k"])
def test_flash_attn_lse_of_a_row_with_a_nan_score_is_nan(where):
    """test_fuzz_flash_attn's draw (seed 1): b 2, 28 x 63, causal, softcap 50, scale 0.05, fp16, a NaN in q
    (k likewise). The row's output was NaN, as torch's, but its lse was -inf: the kernels took a row as one
    that saw no key where ``l > 0`` failed, and NaN > 0 is false, so the lse claimed "no key" for a row that saw
    63 and a NaN score (torch's logsumexp: NaN; and the backward then gave such rows dq 0). The forward kernels
    (16-bit, TMA, fp8) now test ``l != 0``: a row that saw no key keeps l exactly 0, a NaN row NaN."""
    g = _gen(65536)
    q, k, v = _randn((2, 28, 1, 128), g), _randn((2, 63, 1, 128), g), _randn((2, 63, 1, 128), g)
    (q if where == "q" else k)[1, 5, 0, 7] = float("nan")
    q, k, v = (t.half().to(DEVICE) for t in (q, k, v))
    opts = {"causal": True, "window": (-1, 0), "softcap": 50.0, "softmax_scale": 0.05}
    out, lse = flash_attn(q, k, v, return_lse=True, **opts)
    ref, ref_lse = flash_attn_ref(q.cpu(), k.cpu(), v.cpu(), dtype=torch.float64, return_lse=True, **opts)
    nan_rows = torch.isnan(ref).any(-1).transpose(1, 2)  # [B, H, Sq]
    assert nan_rows.any() and torch.equal(torch.isnan(lse).cpu(), nan_rows)
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref))
    _check_lse(lse, ref_lse)


@finding
@pytest.mark.parametrize("splits", [1, 64])
def test_decode_split_merge_keeps_a_nan_row(splits):
    """test_fuzz_paged_attention_decode's draw (seed 1): one sequence of 5 tokens, block size 8, 4 new tokens,
    GQA 5 (2 KV heads), head dim 32, window 0, softcap 2, fp16, 64 splits, a NaN in q. Without splits the
    row was NaN (as torch's); with them it was finite: the split's lse was written -inf (``l > 0`` is false
    for NaN: "saw no key"), so the merge weighed that split 0 and dropped it. The decode kernel now tests
    ``l != 0``: the split's lse is NaN and the merge's weighted sum keeps the NaN."""
    g = _gen(75)
    q = _randn((1, 4, 10, 32), g)
    q[0, 2, 3, 11] = float("nan")
    kc, vc = _randn((1, 8, 2, 32), g).half(), _randn((1, 8, 2, 32), g).half()
    table = torch.zeros(1, 1, dtype=torch.int32)
    sl = torch.tensor([5], dtype=torch.int32)
    q, kc, vc, table, sl = (t.to(DEVICE) for t in (q.half(), kc, vc, table, sl))
    out = paged_attention_decode(q, kc, vc, table, sl, num_splits=splits, window=0, softcap=2.0)
    ref = paged_attention_decode_ref(q, kc, vc, table, sl, window=0, softcap=2.0)
    nan = torch.zeros(out.shape, dtype=torch.bool)
    nan[0, 2, 3] = True
    assert torch.equal(torch.isnan(out).cpu(), nan), "the NaN row is not NaN (or another row is)"
    assert_rel_close(out[~nan.to(DEVICE)].float(), ref[~nan], tol=tolerance(torch.float16))


@finding
@pytest.mark.parametrize("d", [1, 2, 15, 17])
def test_flash_attn_head_dims_below_a_dot(d):
    """test_fuzz_flash_attn's GPU draw (seed 20261203): head dim 1, fp16, 255 x 1, GQA 3 / 1, causal,
    window (33, 7). The docs take head dims from 1, but the kernels' tile was the head dim's next power of
    two, and a tensor-core dot needs K >= 16: the kernel failed to compile (the interpreter's dot has no
    minimum, so the CPU profile passed). The tile is now at least 16, the columns past the head dim masked;
    forward, lse and gradients."""
    case = {"b": 1, "sq": 255, "sk": 1 if d == 1 else 40, "hq": 3, "hkv": 1, "d": d, "dv": d,
            "dtype": torch.float16, "causal": True, "window": (33, 7), "softcap": 0.0, "scale": 1.0, "lse": True,
            "layout": (False, True, True), "kind": "normal", "seed": 4513, "grad": True}  # fmt: skip
    _run_flash(case, None)


@finding
def test_flash_attn_varlen_of_empty_sequences_backward():
    """test_fuzz_flash_attn_varlen's GPU draw (seed 20261203): one sequence of 0 queries and 0 keys inside 3
    padding tokens, fp16, softcap 2, scale 0.3, with gradients. The kernels' output and gradients were right
    (zeros); the check's fp64 reference was then a constant with no autograd graph, and its backward raised.
    The check now takes a reference without a graph as all-zero gradients."""
    q, k, v = (torch.randn(3, 6 // (1 + (i > 0)), 128, generator=_gen(i)).half().to(DEVICE).requires_grad_()
               for i in range(3))  # fmt: skip
    cu = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    out = flash_attn_varlen(q, k, v, cu, cu, 0, 0, softcap=2.0, softmax_scale=0.3)
    assert out.shape == (3, 6, 128) and not out.any()
    out.backward(torch.randn(out.shape, generator=_gen(3)).half().to(DEVICE))
    assert all(t.grad is not None and not t.grad.any() for t in (q, k, v))
    ref_fn = lambda q_, k_, v_: flash_attn_varlen_ref(q_, k_, v_, cu, cu, dtype=torch.float64,  # noqa: E731
                                                      return_lse=True, softcap=2.0, softmax_scale=0.3)  # fmt: skip
    _check_grads([q, k, v], torch.ones_like(out), out, ref_fn, q, k, v)
