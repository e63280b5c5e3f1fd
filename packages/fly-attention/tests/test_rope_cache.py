"""fused_rope_cache against torch's RoPE and indexing (decode_reference): NeoX and GPT-J, partial rotary
dims, slots of -1 (skipped) and shuffled slots, block sizes, fp8 caches with per-tensor and per-head scales,
strided inputs (slices of a fused QKV), a value head dim of its own; untouched cache rows stay as they were;
bad input named; meta tensors and torch.compile. CPU runs go through Triton's interpreter at small sizes;
``gpu`` tests take serving sizes.
"""

from __future__ import annotations

import pytest
import torch

from fly_attention import rope_cache as rope_mod
from fly_attention.decode import paged_attention_decode
from fly_attention.decode_reference import fused_rope_cache_ref, paged_attention_decode_ref
from fly_attention.rope_cache import fused_rope_cache
from flydsl.errors import ArgumentError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, cpu_select, empty_poisoned, tolerance

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def poisoned_q(monkeypatch):
    monkeypatch.setattr(rope_mod, "_empty", lambda *shape, dtype, device: empty_poisoned(*shape, dtype=dtype,
                                                                                         device=device))  # fmt: skip


def cos_sin(max_pos, rot, base=10000.0, dtype=torch.float32):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1).to(dtype)


def make(tokens, hq, hkv, d, rot, page, *, dv=None, dtype=torch.float16, cache_dtype=None, device="cpu", seed=0,
         pad=2, index_dtype=torch.int64):  # fmt: skip
    """Random inputs; slots a random permutation of the cache's slots for the tokens, the last ``pad`` of
    them -1 (padding); caches filled with random values (rows not written must keep them)."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    q = torch.randn(tokens, hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(tokens, hkv, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(tokens, hkv, dv, generator=g).to(device=device, dtype=dtype)
    num_blocks = -(-tokens // page) + 2
    slots = torch.randperm(num_blocks * page, generator=g)[:tokens]
    slots[tokens - pad :] = -1
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    cache_dtype = cache_dtype or dtype
    kc = torch.randn(num_blocks, page, hkv, d, generator=g).to(cache_dtype).to(device)
    vc = torch.randn(num_blocks, page, hkv, dv, generator=g).to(cache_dtype).to(device)
    return (q, k, v, cos_sin(4096, rot).to(device), positions.to(device=device, dtype=index_dtype), kc, vc,
            slots.to(device=device, dtype=index_dtype))  # fmt: skip


def check(args, tol=None, **opts):
    q, k, v, cs, pos, kc, vc, slots = args
    k0, v0 = k.clone(), v.clone()
    ref_q, ref_kc, ref_vc = fused_rope_cache_ref(*args, **opts)
    got = fused_rope_cache(*args, **opts)
    assert got.shape == q.shape and got.dtype == q.dtype and not torch.isnan(got).any()
    tol = tol or tolerance(q.dtype)
    assert_rel_close(got.float(), ref_q.to(got.device), tol=tol, name="q")
    assert torch.equal(k, k0) and torch.equal(v, v0), "k or v modified"
    if kc.dtype == FP8:  # within one fp8 step of torch's rounding (the division may differ in its last bit)
        for name, c, r in (("k_cache", kc, ref_kc), ("v_cache", vc, ref_vc)):
            assert_rel_close(c.float(), r.float().to(c.device), tol=0.07, name=name)
    else:
        assert_rel_close(kc.float(), ref_kc.float().to(kc.device), tol=tol, name="k_cache")
        assert torch.equal(vc.cpu(), ref_vc), "v_cache: the copy is exact"
    # rows of no token are untouched: exactly the reference's (which copies the cache first)
    written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    s = slots.cpu()
    written[s[s >= 0].long()] = True
    keep = ~written.view(kc.shape[0], kc.shape[1])
    for name, c, r in (("k_cache", kc, ref_kc), ("v_cache", vc, ref_vc)):
        unchanged = torch.equal(cpu_select(c, keep).float(), cpu_select(r, keep).float())
        assert unchanged, f"{name}: a row of no token changed"
    return got


# Cases as data: (tokens, heads_q, heads_kv, head_dim, rotary_dim, block size, options)
CASES = [
    (9, 4, 2, 32, 32, 16, {}),  # full rotary, NeoX
    (9, 4, 2, 32, 32, 16, {"is_neox": False}),  # GPT-J pairs
    (13, 4, 1, 64, 32, 8, {}),  # partial rotary (half the dims), MQA
    (13, 4, 1, 64, 16, 32, {"is_neox": False}),  # partial, GPT-J
    (5, 2, 2, 80, 80, 16, {}),  # a head dim that is not a power of two
    (7, 6, 3, 48, 24, 1, {}),  # odd head counts, block size 1
]


def _id(c):
    t, hq, hkv, d, rot, page, opts = c
    return f"t{t}-h{hq}/{hkv}-d{d}-rot{rot}-p{page}" + ("-gptj" if opts.get("is_neox") is False else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_against_torch_rope_and_indexing(device, case):
    t, hq, hkv, d, rot, page, opts = case
    check(make(t, hq, hkv, d, rot, page, device=device), **opts)


def test_bf16_int32_indices_and_value_head_dim(device):
    check(make(11, 4, 2, 64, 64, 16, dv=32, dtype=torch.bfloat16, device=device, index_dtype=torch.int32))


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache(device, per_head):
    args = make(12, 4, 2, 64, 32, 16, cache_dtype=FP8, device=device)
    ks = torch.tensor([0.02, 0.5] if per_head else [0.02], device=device)  # 0.02: saturates some values
    check(args, k_scale=ks, v_scale=torch.tensor(0.25, device=device))
    check(args, k_scale=0.5, is_neox=False)


def test_strided_slices_of_a_fused_qkv(device):
    """q, k, v as slices of one [tokens, (Hq + 2 Hkv) * D] projection, read in place."""
    q, k, v, *rest = make(8, 4, 2, 32, 32, 16, device=device)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs = qkv[:, :128].view(8, 4, 32)
    ks = qkv[:, 128:192].view(8, 2, 32)
    vs = qkv[:, 192:].view(8, 2, 32)
    assert qs.stride(0) == 256
    check((qs, ks, vs, *rest))


def test_every_slot_padding_writes_nothing(device):
    args = make(6, 2, 2, 32, 32, 16, device=device, pad=6)
    kc0 = args[5].clone()
    check(args)
    assert torch.equal(args[5], kc0)


def test_slots_past_the_cache_write_nothing(device):
    q, k, v, cs, pos, kc, vc, slots = make(4, 2, 2, 32, 32, 16, device=device, pad=0)
    slots = slots.clone()
    slots[1] = kc.shape[0] * kc.shape[1]  # one past the last slot
    kc0 = kc.clone()
    fused_rope_cache(q, k, v, cs, pos, kc, vc, slots)
    s = slots.cpu()
    written = set(s[[0, 2, 3]].tolist())
    for slot in range(kc.shape[0] * kc.shape[1]):
        if slot not in written:
            assert torch.equal(kc.view(-1, 2, 32)[slot], kc0.view(-1, 2, 32)[slot])


def test_empty_tokens():
    q, k, v, cs, pos, kc, vc, slots = make(3, 2, 2, 32, 32, 16, pad=0)
    assert fused_rope_cache(q[:0], k[:0], v[:0], cs, pos[:0], kc, vc, slots[:0]).shape == (0, 2, 32)


def test_then_decode(device):
    """The serving step: RoPE + cache write of one new token a sequence, then the decode over the cache."""
    hq, hkv, d, page = 4, 2, 32, 16
    lens = [5, 20]
    q, k, v, cs, *_ = make(2, hq, hkv, d, d, page, device=device, pad=0)
    kc, vc = (torch.randn(4, page, hkv, d).half().to(device) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    pos = torch.tensor([n - 1 for n in lens], device=device)
    slots = torch.stack([table[b, (n - 1) // page].long() * page + (n - 1) % page for b, n in enumerate(lens)])
    qr = fused_rope_cache(q, k, v, cs, pos, kc, vc, slots)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_decode(qr, kc, vc, table, sl)
    assert_rel_close(out.float(), paged_attention_decode_ref(qr, kc, vc, table, sl).to(device), tol=1e-3)


# ---------------------------------------------------------------- bad input

BAD = [
    (lambda a: {**a, "q": a["q"].float()}, DTypeError, "q: expected dtype"),
    (lambda a: {**a, "k": a["k"].bfloat16()}, DTypeError, "k: expected dtype fp16 (q's)"),
    (lambda a: {**a, "q": a["q"][0]}, ShapeError, "q: expected a 3-D tensor"),
    (lambda a: {**a, "k": a["k"][:2]}, ShapeError, "k, v: expected 4 tokens"),
    (lambda a: {**a, "k": a["k"][..., :16]}, ShapeError, "k: expected head_dim 32"),
    (lambda a: {**a, "v": a["v"][:, :1]}, ShapeError, "v: expected 2 heads"),
    (lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, LayoutError, "q: expected a unit"),
    (lambda a: {**a, "cos_sin_cache": a["cos_sin_cache"][:, :7]}, ShapeError, "cos_sin_cache: expected [max_po"),
    (lambda a: {**a, "cos_sin_cache": cos_sin(10, 64)}, ShapeError, "cos_sin_cache: expected [max_position"),
    (lambda a: {**a, "cos_sin_cache": a["cos_sin_cache"].double()}, DTypeError, "cos_sin_cache: expected dtype"),
    (lambda a: {**a, "positions": a["positions"].float()}, DTypeError, "positions: expected dtype"),
    (lambda a: {**a, "positions": a["positions"][:3]}, ShapeError, "positions: expected [4]"),
    (lambda a: {**a, "slot_mapping": a["slot_mapping"][None]}, ShapeError, "slot_mapping: expected a 1-D"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :, :1]}, ShapeError, "k_cache: expected [num_blocks, block_size, 2"),
    (lambda a: {**a, "v_cache": a["v_cache"].to(FP8)}, DTypeError, "v_cache: expected dtype"),
    (lambda a: {**a, "v_cache": a["v_cache"][:1]}, ShapeError, "v_cache: expected k_cache's blocks"),
    (lambda a: {**a, "k_cache": a["k_cache"].float()}, DTypeError, "k_cache: expected dtype"),
    (lambda a: {**a, "is_neox": 1}, ArgumentError, "is_neox: expected a bool"),
    (lambda a: {**a, "k_scale": 2.0}, ArgumentError, "k_scale: a scale quantizes an fp8 cache"),
    (lambda a: {**a, "k_cache": a["k_cache"].to(FP8), "v_cache": a["v_cache"].to(FP8), "v_scale": 0.0},
     ArgumentError, "v_scale: expected a nonzero scale"),
    (lambda a: {**a, "k_cache": a["k_cache"].to(FP8), "v_cache": a["v_cache"].to(FP8), "k_scale": torch.ones(3)},
     ShapeError, "k_scale: expected one element"),
]  # fmt: skip


@pytest.mark.parametrize("make_bad, err, msg", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_input_names_the_argument(make_bad, err, msg):
    names = ("q", "k", "v", "cos_sin_cache", "positions", "k_cache", "v_cache", "slot_mapping")
    a = make_bad(dict(zip(names, make(4, 4, 2, 32, 32, 16, pad=1), strict=True)))
    args = [a.pop(n) for n in names]
    with pytest.raises(err) as info:
        fused_rope_cache(*args, **a)
    assert msg in str(info.value)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_meta_and_torch_compile():
    meta = [t.to("meta") for t in make(4, 4, 2, 32, 32, 16)]
    assert fused_rope_cache(*meta).device.type == "meta"
    torch._dynamo.reset()
    args = make(5, 4, 2, 32, 16, 16, cache_dtype=FP8)
    ref_q, ref_kc, _ = fused_rope_cache_ref(*args, k_scale=0.5)
    got = torch.compile(lambda *a: fused_rope_cache(*a, k_scale=0.5) * 2, fullgraph=True, backend="aot_eager")(*args)
    assert_rel_close(got.float() / 2, ref_q, tol=tolerance(torch.float16))
    assert_rel_close(args[5].float(), ref_kc.float(), tol=0.07)


# ---------------------------------------------------------------- GPU: serving sizes


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens, rot", [(1, 128), (256, 128), (4099, 64)])
def test_gpu_serving_sizes(device, is_neox, tokens, rot):
    check(make(tokens, 32, 8, 128, rot, 16, dtype=torch.bfloat16, device=device, pad=3), is_neox=is_neox)


@pytest.mark.gpu
def test_gpu_fp8(device):
    args = make(1000, 32, 8, 128, 128, 16, dtype=torch.bfloat16, cache_dtype=FP8, device=device)
    check(args, k_scale=torch.full((8,), 0.05, device=device), v_scale=0.1)


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_cuda_graph_capture(device):
    args = make(64, 32, 8, 128, 128, 16, dtype=torch.bfloat16, device=device, pad=4)
    q, k, v, cs, pos, kc, vc, slots = args
    fused_rope_cache(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_rope_cache(*args)
    for seed in (1, 2):
        fresh = make(64, 32, 8, 128, 128, 16, dtype=torch.bfloat16, device=device, pad=4, seed=seed)
        for dst, src in zip(args, fresh, strict=True):
            dst.copy_(src)
        ref_q, ref_kc, _ = fused_rope_cache_ref(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out.float(), ref_q.to(device), tol=tolerance(q.dtype))
        assert_rel_close(kc.float(), ref_kc.float().to(device), tol=tolerance(q.dtype))


@pytest.mark.gpu
def test_gpu_replayed_calls_match_the_reference(device, monkeypatch):
    """Plain eager calls replay the first call's launch (flydsl.direct): every replay, on fresh inputs and
    caches of the same layouts, writes the caches and returns a fresh rotated q as the reference does."""
    from flydsl import direct

    replayed = []
    real = direct._Plan.replay
    monkeypatch.setattr(direct._Plan, "replay", lambda plan, args: replayed.append(1) or real(plan, args))
    # The poisoning fill is a torch op a replay would not redo, so a recording that sees it makes no plan:
    # plain allocations here (check() still finds a NaN or a wrong row in any output).
    monkeypatch.setattr(rope_mod, "_empty", torch.empty)
    rope_mod._REPLAYS.clear()
    outs = []
    for seed in range(4):  # the first call records, the next ones replay
        outs.append(check(make(256, 32, 8, 128, 128, 16, dtype=torch.bfloat16, device=device, pad=3, seed=seed),
                          k_scale=None))  # fmt: skip
    assert len({o.data_ptr() for o in outs}) == len(outs)
    assert len(replayed) == 3, "the calls after the first were not replayed"
