"""paged_attention_decode against the fp32 reference gathered through the block table with plain indexing:
shuffled block tables with shared prefix blocks, boundary sequence lengths in one batch (0, 1, a block
minus / plus one), every block size, GQA ratios, several new tokens (bottom-right causal), windows,
softcap, fp8 caches with per-tensor and per-head scales, splits 1 and many agreeing, dense caches,
strided layouts, ``out=``; the host side (bad input named, meta tensors, torch.compile); the config's pure
functions.

CPU runs go through Triton's interpreter at small shapes; every output and workspace is allocated poisoned
(NaN), so an element the kernel should write and did not fails. ``gpu`` tests take the sizes the issue names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import flydsl.arch
from fly_attention import decode as decode_mod
from fly_attention.decode import paged_attention_decode
from fly_attention.decode_config import (
    MAX_SPLITS,
    DecodeConfig,
    decode_block_m,
    decode_config_valid,
    decode_splits,
    default_decode_config,
)
from fly_attention.decode_reference import paged_attention_decode_ref
from flydsl.errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, empty_poisoned, tolerance
from flydsl.testing.sm90 import run_compile_script

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def poisoned_decode_buffers(monkeypatch):
    monkeypatch.setattr(decode_mod, "_empty", lambda *shape, dtype, device: empty_poisoned(*shape, dtype=dtype,
                                                                                           device=device))  # fmt: skip


def make_paged(seq_lens, hkv, d, page, *, dtype=torch.float16, device="cpu", shared_prefix=0, spare=3, seed=0,
               q_len=1, hq=None):  # fmt: skip
    """Random q, paged caches and a shuffled block table: every sequence's first ``shared_prefix`` blocks are
    the same physical blocks (a shared prompt), the rest its own, all in random order among ``spare`` unused
    blocks; table entries past a sequence's blocks hold -1 (a read of them would show)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    need = [-(-n // page) for n in seq_lens]
    max_blocks = max(max(need), 1)
    own = sum(max(n - shared_prefix, 0) for n in need)
    num_blocks = shared_prefix + own + spare
    perm = torch.randperm(num_blocks, generator=g)
    prefix, rest = perm[:shared_prefix], perm[shared_prefix:]
    table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        k = min(n, shared_prefix)
        table[b, :k] = prefix[:k].int()
        table[b, k:n] = rest[at : at + n - k].int()
        at += n - k
    hq = hq or hkv
    q = torch.randn(batch, q_len, hq, d, generator=g)
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g)
    kv_dtype = dtype
    q = q.to(device=device, dtype=dtype)
    k_cache, v_cache = (t.to(device=device, dtype=kv_dtype) for t in (k_cache, v_cache))
    return q, k_cache, v_cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def check(q, k_cache, v_cache, table, seq_lens, tol=None, **opts):
    out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, **opts)
    ref_opts = {k: v for k, v in opts.items() if k not in ("num_splits", "out")}
    ref = paged_attention_decode_ref(q, k_cache, v_cache, table, seq_lens, **ref_opts)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in the output"
    assert_rel_close(out.float(), ref.to(out.device), tol=tol or tolerance(q.dtype))
    return out


# Cases as data: (seq_lens, heads_q, heads_kv, head_dim, block size, q_len, options)
CASES = [
    # lengths around a block's boundary in one batch, one token a sequence, MHA
    ([1, 15, 16, 17, 40], 2, 2, 32, 16, 1, {}),
    # GQA 4:1 and MQA (every query head on one KV head): the group packed in a program's rows
    ([3, 33, 70], 8, 2, 64, 16, 1, {}),
    ([50, 9], 8, 1, 64, 32, 1, {}),
    # several new tokens: bottom-right causal; a sequence shorter than the drafts (rows with no key give 0)
    ([20, 47, 2], 4, 2, 32, 16, 4, {}),
    ([37, 64], 8, 1, 64, 16, 8, {}),
    # a head dim that is not a power of two (padded and masked), a block of 64 and of 128
    ([90, 130], 4, 2, 80, 64, 1, {}),
    ([150], 2, 1, 48, 128, 2, {}),
    # split-KV: more splits than the short sequences have steps (empty splits), and a given scale
    ([1, 16, 100], 4, 2, 32, 16, 1, {"num_splits": 5, "softmax_scale": 0.3}),
    ([77, 0], 4, 4, 32, 32, 3, {"num_splits": 3}),
    # sliding window alone, with softcap, with splits and several tokens
    ([60, 25], 4, 2, 32, 16, 1, {"window": 10}),
    ([60, 33], 4, 2, 32, 16, 3, {"window": 0, "softcap": 5.0, "num_splits": 4}),
    ([45], 2, 2, 64, 16, 1, {"softcap": 2.0}),
]


def _id(case):
    lens, hq, hkv, d, page, q_len, opts = case
    tag = "-".join(f"{k}={v}" for k, v in opts.items())
    return f"L{'_'.join(map(str, lens))}-h{hq}/{hkv}-d{d}-p{page}-q{q_len}" + (f"-{tag}" if tag else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fp16_against_reference(device, case):
    lens, hq, hkv, d, page, q_len, opts = case
    q, kc, vc, table, sl = make_paged(lens, hkv, d, page, hq=hq, q_len=q_len, shared_prefix=1, device=device)
    if q_len == 1:
        q = q[:, 0]  # the one-token form [batch, heads_q, head_dim]
    check(q, kc, vc, table, sl, **opts)


@pytest.mark.parametrize("page", [1, 8, 16, 32, 64, 128])
def test_every_block_size_bf16(device, page):
    q, kc, vc, table, sl = make_paged([1, 15, 17, 129], 2, 32, page, hq=8, dtype=torch.bfloat16, device=device,
                                      shared_prefix=2 if page <= 16 else 0)  # fmt: skip
    check(q, kc, vc, table, sl)


@pytest.mark.parametrize("splits", [2, 7])
def test_splits_agree_with_one(device, splits):
    """Split-KV (empty splits included) and the one-pass kernel give the same result within rounding."""
    q, kc, vc, table, sl = make_paged([3, 64, 97], 2, 32, 16, hq=4, q_len=2, device=device, shared_prefix=1)
    one = check(q, kc, vc, table, sl, num_splits=1)
    many = check(q, kc, vc, table, sl, num_splits=splits)
    assert_rel_close(many.float(), one.float(), tol=tolerance(q.dtype))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_against_dequantized_reference(device, per_head, dtype):
    q, kc, vc, table, sl = make_paged([5, 40, 66], 2, 64, 16, hq=8, dtype=dtype, device=device)
    kc8, vc8 = (t.float().div(2.0).to(FP8) for t in (kc, vc))
    if per_head:
        ks = torch.tensor([2.0, 0.5], device=device)
        vs = torch.tensor([1.5, 3.0], device=device)
    else:
        ks, vs = torch.tensor([2.0], device=device), torch.tensor(0.75, device=device)
    check(q, kc8, vc8, table, sl, k_scale=ks, v_scale=vs)
    check(q, kc8, vc8, table, sl, k_scale=ks, v_scale=vs, num_splits=3)
    check(q, kc8, vc8, table, sl, k_scale=1.25, v_scale=0.5)  # numbers: per tensor


def test_dense_cache(device):
    """No block table: contiguous [batch, seqlen, heads_kv, D] caches, with lengths and without (full)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 8, 64, generator=g).half().to(device)
    kc = torch.randn(3, 50, 2, 64, generator=g).half().to(device)
    vc = torch.randn(3, 50, 2, 64, generator=g).half().to(device)
    sl = torch.tensor([50, 1, 17], dtype=torch.int32, device=device)
    check(q, kc, vc, None, sl)
    check(q, kc, vc, None, None, num_splits=3)


def test_strided_layouts_and_out_buffer(device):
    """q as a slice of a wider tensor, caches stored [num_blocks, heads, block, D] seen through a transpose,
    a preallocated output that is a strided view: read and written in place."""
    q, kc, vc, table, sl = make_paged([10, 33], 2, 32, 16, hq=4, device=device)
    wide = torch.randn(2, 1, 6, 32).half().to(device)
    wide[:, :, 1:5] = q
    qv = wide[:, :, 1:5]
    kt = kc.transpose(1, 2).contiguous().transpose(1, 2)
    vt = vc.transpose(1, 2).contiguous().transpose(1, 2)
    buf = torch.full((2, 1, 4, 64), 7.0, dtype=torch.float16, device=device)
    out = buf[..., :32]
    got = check(qv, kt, vt, table, sl, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert (buf[..., 32:] == 7.0).all()  # nothing written outside the view


def test_zero_length_sequences_give_zero(device):
    q, kc, vc, table, sl = make_paged([0, 0, 5], 2, 32, 16, hq=4, q_len=2, device=device)
    for splits in (1, 4):
        out = check(q, kc, vc, table, sl, num_splits=splits)
        assert (out[:2] == 0).all()


def test_lengths_past_capacity_are_clamped(device):
    q, kc, vc, table, sl = make_paged([20, 32], 2, 32, 16, hq=2, device=device)
    sl_big = torch.tensor([20, 1000], dtype=torch.int32, device=device)  # capacity: 2 blocks = 32 keys
    out = paged_attention_decode(q, kc, vc, table, sl_big)
    assert_rel_close(out.float(), paged_attention_decode_ref(q, kc, vc, table, sl).to(device), tol=1e-3)


def test_empty_batch():
    q, kc, vc, table, sl = make_paged([4], 2, 32, 16)
    out = paged_attention_decode(q[:0], kc, vc, table[:0], sl[:0])
    assert out.shape == (0, 1, 2, 32)


# ---------------------------------------------------------------- bad input


def _args():
    q, kc, vc, table, sl = make_paged([4, 9], 2, 32, 16, hq=4)
    return {"q": q[:, 0], "k_cache": kc, "v_cache": vc, "block_tables": table, "seq_lens": sl}


BAD = [
    (lambda a: {**a, "q": a["q"].float()}, DTypeError, "q: expected dtype"),
    (lambda a: {**a, "q": a["q"][0]}, ShapeError, "q: expected [batch, heads_q, head_dim]"),
    (lambda a: {**a, "q": a["q"].unsqueeze(1).expand(2, 9, 4, 32)}, ShapeError, "q: expected at most 8"),
    (lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, LayoutError, "q: expected a unit"),
    (lambda a: {**a, "k_cache": a["k_cache"].float()}, DTypeError, "k_cache: expected dtype"),
    (lambda a: {**a, "v_cache": a["v_cache"].to(FP8)}, DTypeError, "v_cache: expected dtype"),
    (lambda a: {**a, "v_cache": a["v_cache"][:-1]}, ShapeError, "v_cache: expected k_cache's shape"),
    (lambda a: {**a, "k_cache": a["k_cache"][..., :16], "v_cache": a["v_cache"][..., :16]}, ShapeError,
     "k_cache: expected head_dim 32"),
    (lambda a: {**a, "k_cache": a["k_cache"].repeat(1, 1, 3, 1), "v_cache": a["v_cache"].repeat(1, 1, 3, 1)},
     ShapeError, "k_cache: expected a number of KV heads"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :12], "v_cache": a["v_cache"][:, :12]}, ShapeError,
     "k_cache: expected a block size"),
    (lambda a: {**a, "block_tables": a["block_tables"].long()}, DTypeError, "block_tables: expected dtype"),
    (lambda a: {**a, "block_tables": a["block_tables"][:1]}, ShapeError, "block_tables: expected [batch = 2"),
    (lambda a: {**a, "seq_lens": a["seq_lens"].long()}, DTypeError, "seq_lens: expected dtype"),
    (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, ShapeError, "seq_lens: expected [batch = 2]"),
    (lambda a: {**a, "seq_lens": None}, ArgumentError, "seq_lens: expected an int32 tensor"),
    (lambda a: {**a, "seq_lens": a["seq_lens"].to("meta")}, DeviceError, "seq_lens: expected a tensor on cpu"),
    (lambda a: {**a, "block_tables": None}, ShapeError, "k_cache: expected a dense cache"),
    (lambda a: {**a, "k_scale": torch.ones(3)}, ShapeError, "k_scale: expected one element"),
    (lambda a: {**a, "v_scale": torch.ones(2, dtype=torch.float64)}, DTypeError, "v_scale: expected dtype"),
    (lambda a: {**a, "k_scale": float("nan")}, ArgumentError, "k_scale: expected a finite number"),
    (lambda a: {**a, "window": -2}, ArgumentError, "window: expected an int >= -1"),
    (lambda a: {**a, "window": 1.5}, ArgumentError, "window: expected an int >= -1"),
    (lambda a: {**a, "softcap": -1.0}, ArgumentError, "softcap: expected a finite number >= 0"),
    (lambda a: {**a, "softmax_scale": "x"}, ArgumentError, "softmax_scale: expected None or a finite number"),
    (lambda a: {**a, "num_splits": 0}, ArgumentError, f"num_splits: expected None (chosen from the SM count) or "
                                                      f"an int in 1..{MAX_SPLITS}"),
    (lambda a: {**a, "out": torch.empty(2, 4, 16, dtype=torch.float16)}, ShapeError, "out: expected q's shape"),
    (lambda a: {**a, "out": torch.empty(2, 4, 32)}, DTypeError, "out: expected dtype"),
    (lambda a: {**a, "q": [1.0]}, ArgumentError, "q: expected a torch.Tensor"),
]  # fmt: skip


@pytest.mark.parametrize("make, err, msg", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_input_names_the_argument(make, err, msg):
    a = make(_args())
    with pytest.raises(err) as info:
        paged_attention_decode(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("block_tables"),
                               a.pop("seq_lens"), **a)  # fmt: skip
    assert msg in str(info.value)


def test_bad_config_is_refused():
    a = _args()
    with pytest.raises(ArgumentError, match="config: expected a valid"):
        decode_mod._decode(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], None, None, None,
                           None, -1, 0.0, None, config=DecodeConfig(block_n=24))  # fmt: skip


# ---------------------------------------------------------------- meta tensors and torch.compile


def test_meta_tensors_give_meta_outputs():
    meta = torch.device("meta")
    q = torch.empty(4, 3, 32, 128, dtype=torch.bfloat16, device=meta)
    kc = torch.empty(100, 16, 8, 128, dtype=FP8, device=meta)
    table = torch.empty(4, 30, dtype=torch.int32, device=meta)
    sl = torch.empty(4, dtype=torch.int32, device=meta)
    out = paged_attention_decode(q, kc, kc, table, sl, k_scale=torch.empty(8, device=meta))
    assert out.device == meta and out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_ops_trace_under_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, kc, vc, table, sl = make_paged([7, 30], 2, 32, 16, hq=4)
    ks = torch.tensor([0.5, 2.0])

    def fn(q, kc, vc, table, sl, buf):
        a = paged_attention_decode(q, kc, vc, table, sl, k_scale=ks, v_scale=1.5, num_splits=2)
        paged_attention_decode(q, kc, vc, table, sl, out=buf)
        return a * 2

    buf = torch.empty_like(q)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, kc, vc, table, sl, buf)
    ref = paged_attention_decode_ref(q, kc, vc, table, sl, k_scale=ks, v_scale=1.5)
    assert_rel_close(got.float() / 2, ref, tol=tolerance(q.dtype))
    assert_rel_close(buf.float(), paged_attention_decode_ref(q, kc, vc, table, sl), tol=tolerance(q.dtype))


# ---------------------------------------------------------------- the config's pure functions

SM90 = flydsl.arch.SM90


def test_splits_fill_the_gpu_at_small_batch_only():
    # batch 1, 8 KV heads, 128K keys: 8 programs without splits; splits bring it near 2 x 132 programs
    s = decode_splits(1, 8, 131072, 132)
    assert 8 * s >= 0.85 * 264 / 2 and s <= MAX_SPLITS
    # a full grid already (256 sequences x 8 KV heads): no split
    assert decode_splits(256, 8, 4096, 132) == 1
    # short caches are not split below MIN_KEYS_PER_SPLIT keys a split
    assert decode_splits(1, 8, 512, 132) == 2
    assert decode_splits(1, 1, 100, 132) == 1
    # more row blocks a KV head count as programs
    assert decode_splits(4, 8, 65536, 132, row_blocks=4) < decode_splits(4, 8, 65536, 132)
    # degenerate inputs
    assert decode_splits(0, 8, 100, 132) == 1 and decode_splits(1, 8, 0, 132) == 1


def test_splits_fill_the_last_wave():
    """GQA 32/8 on 132 SMs: the counts the H200 ran fastest at 16K-128K keys (a grid of 256 programs, not the
    232 / 224 of an 85% rule)."""
    assert [decode_splits(b, 8, 131072, 132) for b in (1, 2, 4)] == [32, 16, 8]
    assert decode_splits(4, 8, 16384, 132) == 8 and decode_splits(16, 8, 4096, 132) == 2


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7, 16, 33, 64, 256])
@pytest.mark.parametrize("seqlen", [1, 300, 4096, 131072])
def test_splits_bounds(batch, seqlen):
    for hkv in (1, 8, 32):
        s = decode_splits(batch, hkv, seqlen, 132)
        assert 1 <= s <= MAX_SPLITS
        assert s == 1 or seqlen // s >= 256  # every split keeps enough keys
        assert s == 1 or batch * hkv * (s - 1) < 2 * 132  # no split past what fills two programs an SM


def test_block_m():
    assert [decode_block_m(r) for r in (1, 4, 16, 17, 64, 65, 512)] == [16, 16, 16, 32, 64, 64, 64]


@pytest.mark.parametrize("d", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("kv", [torch.bfloat16, FP8])
@pytest.mark.parametrize("rows", [1, 4, 8, 32, 64])
def test_default_configs_are_valid(d, kv, rows):
    for arch in (SM90, flydsl.arch.INTERPRETER):
        for paged, programs in ((False, None), (True, None), (True, 1), (True, arch.sm_count)):
            cfg = default_decode_config(d, rows, kv, arch, paged=paged, programs=programs)
            assert decode_config_valid(cfg, d, rows, kv, arch), (cfg, paged, programs)


def test_default_tile_follows_the_h200_timings():
    """Head dim 128 on sm_90 (PERF.md): the paged walk takes 128 keys a step (fp8: always; 16-bit caches:
    while the grid before splitting is under one program an SM); the dense walk and large grids keep the
    64-key tile."""
    small, full = SM90.sm_count - 1, SM90.sm_count
    bf16, wide, narrow = torch.bfloat16, DecodeConfig(128, 8, 2), DecodeConfig(64, 4, 3)

    def dflt(rows, kv, **kw):
        return default_decode_config(128, rows, kv, SM90, **kw)

    for rows in (1, 4, 8):
        assert dflt(rows, bf16, paged=True, programs=small) == wide
        assert dflt(rows, bf16, paged=True, programs=full) == narrow
        assert dflt(rows, bf16, paged=False, programs=small) == narrow
        for programs in (1, full):
            assert dflt(rows, FP8, paged=True, programs=programs) == DecodeConfig(128, 4, 3)
        assert dflt(rows, FP8) == narrow
    assert default_decode_config(80, 4, bf16, SM90, paged=True, programs=small) == wide
    assert default_decode_config(256, 4, bf16, SM90, paged=True, programs=small).block_n == 32


def test_validity_predicate_refuses():
    ok = DecodeConfig(64, 4, 2)
    assert decode_config_valid(ok, 128, 4, torch.bfloat16, SM90)
    for bad in (dataclasses.replace(ok, block_n=48), dataclasses.replace(ok, block_n=8),
                dataclasses.replace(ok, num_warps=3), dataclasses.replace(ok, num_stages=0),
                DecodeConfig(2048, 4, 8)):  # fmt: skip
        assert not decode_config_valid(bad, 128, 4, torch.bfloat16, SM90), bad
    assert not decode_config_valid("fast", 128, 4, torch.bfloat16, SM90)


# ---------------------------------------------------------------- the kernels compile for the H200


def test_kernels_compile_for_sm90():
    """Triton's compiler (not the interpreter) takes the decode and merge kernels' variants for sm_90, in a
    process of its own (the interpreter is chosen once per process)."""
    lines = run_compile_script(Path(__file__).with_name("decode_compile_sm90.py"))
    assert lines and all(line.startswith("ok") for line in lines), "\n".join(lines)


# ---------------------------------------------------------------- GPU: the issue's sizes


def _gpu_case(device, lens, hq, hkv, page, dtype=torch.bfloat16, q_len=1, d=128):
    return make_paged(lens, hkv, d, page, hq=hq, q_len=q_len, dtype=dtype, device=device, shared_prefix=2,
                      spare=16)  # fmt: skip


ISSUE_LENS = [1, 15, 16, 17, 1000, 32768]


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (32, 8), (32, 4), (32, 1)])  # GQA 1, 4, 8, all
def test_gpu_issue_lengths(device, page, hq, hkv):
    q, kc, vc, table, sl = _gpu_case(device, ISSUE_LENS, hq, hkv, page)
    check(q, kc, vc, table, sl)
    check(q, kc, vc, table, sl, num_splits=16)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [2, 8])
def test_gpu_speculative_tokens(device, q_len):
    q, kc, vc, table, sl = _gpu_case(device, [3, 17, 1000, 4097], 32, 8, 16, q_len=q_len)
    check(q, kc, vc, table, sl)
    check(q, kc, vc, table, sl, num_splits=7, window=300, softcap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True])
def test_gpu_fp8(device, per_head):
    q, kc, vc, table, sl = _gpu_case(device, ISSUE_LENS, 32, 8, 16)
    kc8, vc8 = (t.float().mul(4.0).to(FP8) for t in (kc, vc))
    ks = torch.full((8,) if per_head else (1,), 0.25, device=device)
    if per_head:
        ks[::2] = 0.5
    check(q, kc8, vc8, table, sl, k_scale=ks, v_scale=ks)


# The tiles the H200 sweep timed fastest (PERF.md): 128 keys a step with 8 warps (bf16) or 4 warps and 3
# stages (fp8), beside the smallest tile; each against the reference before any becomes a default.
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [DecodeConfig(128, 8, 2), DecodeConfig(128, 4, 3), DecodeConfig(32, 4, 2)],
                         ids=lambda c: f"n{c.block_n}-w{c.num_warps}-s{c.num_stages}")  # fmt: skip
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_configs_against_the_reference(device, cfg, fp8):
    q, kc, vc, table, sl = _gpu_case(device, [1, 17, 130, 1000, 4097], 32, 8, 16)
    ks = None
    if fp8:
        kc, vc = (t.float().mul(4.0).to(FP8) for t in (kc, vc))
        ks = torch.full((8,), 0.25, device=device)
    ref = paged_attention_decode_ref(q, kc, vc, table, sl, k_scale=ks, v_scale=ks)
    for splits in (1, 5):
        out = decode_mod._decode(q, kc, vc, table, sl, None, splits, ks, ks, -1, 0.0, None, config=cfg)
        assert not torch.isnan(out).any(), f"NaN with {cfg}, {splits} splits"
        assert_rel_close(out.float(), ref.to(out.device), tol=tolerance(q.dtype), name=f"{cfg}, {splits} splits")


@pytest.mark.gpu
def test_gpu_splits_agree(device):
    q, kc, vc, table, sl = _gpu_case(device, ISSUE_LENS, 32, 8, 64)
    one = check(q, kc, vc, table, sl, num_splits=1)
    for s in (3, 64, None):
        assert_rel_close(check(q, kc, vc, table, sl, num_splits=s).float(), one.float(), tol=tolerance(q.dtype))


@pytest.mark.gpu
def test_gpu_head_dims(device):
    for d in (64, 80, 256):
        check(*_gpu_case(device, [1, 300, 2049], 16, 4, 16, d=d))


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_cuda_graph_capture(device):
    """Captured once with a fixed output buffer (no host sync inside), replayed with new lengths, queries
    and cache contents (the sequences grow into their blocks: the serving loop)."""
    q, kc, vc, table, sl = _gpu_case(device, [160, 2048, 16, 704], 32, 8, 16)  # blocks for the growth
    sl.copy_(torch.tensor([100, 2000, 5, 700], dtype=torch.int32))
    out = torch.empty_like(q)
    paged_attention_decode(q, kc, vc, table, sl, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(q, kc, vc, table, sl, out=out)
    for lens in ([101, 2001, 6, 701], [0, 2048, 1, 16]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        for t in (q, kc, vc):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_decode_ref(q, kc, vc, table, sl)
        assert_rel_close(out.float(), ref.to(device), tol=tolerance(q.dtype))


@pytest.mark.gpu
def test_gpu_torch_compile_inductor(device):
    torch._dynamo.reset()
    q, kc, vc, table, sl = _gpu_case(device, [5, 1000], 32, 8, 16)
    fn = torch.compile(lambda *a: paged_attention_decode(*a) * 2, fullgraph=True)
    assert_rel_close(fn(q, kc, vc, table, sl).float() / 2, paged_attention_decode_ref(q, kc, vc, table, sl).to(device),
                     tol=tolerance(q.dtype))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_replayed_calls_match_the_reference(device, splits, monkeypatch):
    """Plain eager calls replay the first call's launches (flydsl.direct): every replay, on fresh caches,
    tables and lengths of the same layouts, matches the reference and returns a fresh output."""
    from flydsl import direct

    replayed = []
    real = direct._Plan.replay
    monkeypatch.setattr(direct._Plan, "replay", lambda plan, args: replayed.append(1) or real(plan, args))
    # The poisoning fill of the outputs is a torch op a replay would not redo, so a recording that sees it makes
    # no plan: plain allocations here (the first call's output is still checked against the reference).
    monkeypatch.setattr(decode_mod, "_empty", torch.empty)
    decode_mod._REPLAYS.clear()
    outs = []
    for seed in range(4):  # the first call records, the next ones replay
        q, kc, vc, table, sl = make_paged([5, 700, 4097], 8, 128, 16, hq=32, dtype=torch.bfloat16, device=device,
                                          shared_prefix=1, spare=8, seed=seed)  # fmt: skip
        outs.append(check(q, kc, vc, table, sl, num_splits=splits))
    assert len({o.data_ptr() for o in outs}) == len(outs)
    assert len(replayed) == 3, "the calls after the first were not replayed"
