"""Benchmarks of the serving ops (:func:`paged_attention_decode`, :func:`fused_rope_cache`) on the shared
harness; ``benches()`` lists them for the family's benchmark command.

``attn_decode_bf16``: one new token a sequence, 32 query heads on 8 KV heads (GQA 4), head dim 128, block
size 16 with shuffled block tables; batch 1-256 and KV lengths 512-131072 (batch x length at most 2^21
tokens: 8 GB of cache). Bytes: the KV cache read (``B S Hkv D`` x 2 tensors x 2 bytes) + q + out; the
floor is those bytes over the device copy bandwidth the harness measures in the same run. Peers: SDPA on
the dense cache ``[B, Hkv, S, D]`` (views of ``[B, S, Hkv, D]``) with ``enable_gqa``, each backend forced
(cuDNN, flash, efficient; a refusal is a skip with torch's words), and our own decode on the dense cache.
``attn_decode_fp8``: the same shapes with an fp8 e4m3 cache and per-head scales; peer: our bf16 decode
on the same values (the fp8 cache dequantized into bf16, exactly). ``rope_cache``: RoPE (NeoX, full
rotary) + the paged cache write for 1-16384 tokens, 32 / 8 heads, head dim 128, bf16; bytes: q, k, v read
once, q out and the cache rows written once, the cos / sin rows and the indices; peers: torch eager RoPE
+ ``index_put_``, and the same under ``torch.compile``.

Sweeps (``--sweep``): decode shapes drawn from the seeded ``random.Random`` alone: batch log-uniform in
1-256, odd KV lengths half the time, GQA 1 / 4 / 8, head dims 64 / 128, block sizes 16-128; RoPE token
counts log-uniform in 1-16384 (odd half the time), head counts, partial rotary, GPT-J style.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flydsl_common.bench import Bench, Case, CompiledPeer, Provider, Skip, distinct_cases, log_uniform

from .decode import paged_attention_decode
from .rope_cache import fused_rope_cache

__all__ = ["benches", "decode_bytes", "rope_bytes", "DecodeRange", "GPU_RANGE", "CPU_RANGE", "decode_sweep",
           "rope_sweep"]  # fmt: skip

_BF16 = torch.bfloat16
_FP8 = torch.float8_e4m3fn
_TOKEN_BUDGET = 1 << 21  # batch x KV length of the largest case (8 GB of bf16 cache at 8 x 128)
_BATCHES = (1, 4, 16, 64, 256)
_KV_LENS = (512, 2048, 8192, 32768, 131072)
_ROPE_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class DecodeRange:
    """Where the sweeps' shapes come from (the CPU's range is small enough for the interpreter)."""

    batch_max: int = 256
    kv_min: int = 100
    kv_max: int = 131072
    tokens: int = _TOKEN_BUDGET
    heads_q: tuple[int, ...] = (32, 64)
    rope_tokens_max: int = 16384


GPU_RANGE = DecodeRange()
CPU_RANGE = DecodeRange(batch_max=3, kv_min=1, kv_max=80, tokens=160, heads_q=(4, 8), rope_tokens_max=12)


def _decode_case(b, s, hq, hkv, d, page, tag="") -> Case:
    return Case(f"b{b}-kv{s}-h{hq}/{hkv}-d{d}-p{page}{tag}",
                {"B": b, "S": s, "Hq": hq, "Hkv": hkv, "D": d, "page": page, "kv_tokens": b * s})  # fmt: skip


def _tuned_decode_cases() -> list[Case]:
    return [_decode_case(b, s, 32, 8, 128, 16) for b in _BATCHES for s in _KV_LENS if b * s <= _TOKEN_BUDGET]


_QUICK_DECODE = [_decode_case(2, 40, 4, 2, 32, 16), _decode_case(1, 17, 4, 1, 64, 16)]


def decode_bytes(case: Case, kv_itemsize: int = 2) -> int:
    """The KV cache read once (K and V), q read and out written (2-byte q)."""
    p = case.params
    return 2 * p["B"] * p["S"] * p["Hkv"] * p["D"] * kv_itemsize + 2 * p["B"] * p["Hq"] * p["D"] * 2


def decode_sweep(rng: random.Random, count: int, r: DecodeRange = GPU_RANGE) -> list[Case]:
    def draw() -> Case:
        b = log_uniform(rng, 1, r.batch_max)
        s = log_uniform(rng, r.kv_min, r.kv_max)
        if rng.random() < 0.5:
            s |= 1
        if b * s > r.tokens:
            s = max(1, r.tokens // b)
        hq = rng.choice(r.heads_q)
        hkv = hq // rng.choice((1, 4, 8))
        case = _decode_case(b, s, hq, max(hkv, 1), rng.choice((64, 128)), rng.choice((16, 32, 64, 128)))
        return case

    return distinct_cases(count, draw, f"decode_sweep from {r}")


# ------------------------------------------------------------------------------ decode inputs


def _scatter(x, table, page):
    """The dense ``[B, S, H, D]`` cache scattered into the blocks ``table [B, blocks]`` names."""
    b, s, h, d = x.shape
    per = table.shape[1]
    cache = torch.zeros(b * per, page, h, d, dtype=x.dtype, device=x.device)
    padded = F.pad(x.view(torch.uint8) if x.dtype == _FP8 else x, (0, 0, 0, 0, 0, per * page - s))
    cache.view(torch.uint8 if x.dtype == _FP8 else x.dtype)[table.view(-1).long()] = padded.view(b * per, page, h, d)
    return cache


def _decode_setup(fp8: bool):
    def setup(case: Case, device):
        p = case.params
        seed = p["B"] * 131 + p["S"] * 7 + p["Hq"] + p["page"]
        g = torch.Generator(device=device).manual_seed(seed)  # on the device: GB of random numbers
        b, s, hq, hkv, d, page = p["B"], p["S"], p["Hq"], p["Hkv"], p["D"], p["page"]
        q = torch.randn(b, hq, d, generator=g, device=device).to(_BF16)
        k = torch.randn(b, s, hkv, d, generator=g, device=device).to(_BF16)
        v = torch.randn(b, s, hkv, d, generator=g, device=device).to(_BF16)
        per = -(-s // page)
        table = torch.randperm(b * per, generator=torch.Generator().manual_seed(seed)).view(b, per)
        table = table.to(device=device, dtype=torch.int32)  # shuffled blocks
        kc8 = vc8 = ks = vs = None
        if fp8:  # per-head scales; the bf16 caches hold the fp8 values exactly (what the bf16 peer reads)
            ks = torch.linspace(0.02, 0.05, hkv, device=device)
            vs = torch.linspace(0.03, 0.06, hkv, device=device)
            k8 = (k.float() / ks[:, None]).clamp(-448, 448).to(_FP8)
            v8 = (v.float() / vs[:, None]).clamp(-448, 448).to(_FP8)
            k, v = (k8.float() * ks[:, None]).to(_BF16), (v8.float() * vs[:, None]).to(_BF16)
            kc8, vc8 = _scatter(k8, table, page), _scatter(v8, table, page)
        kc, vc = _scatter(k, table, page), _scatter(v, table, page)
        sl = torch.full((b,), s, dtype=torch.int32, device=device)
        return q, kc, vc, table, sl, k, v, kc8, vc8, ks, vs

    return setup


def _ours_paged(t):
    q, kc, vc, table, sl, *_ = t
    return lambda: paged_attention_decode(q, kc, vc, table, sl)


def _ours_dense(t):
    q, _, _, _, sl, k, v, *_ = t
    return lambda: paged_attention_decode(q, k, v, None, sl)


def _ours_fp8(t):
    q, _, _, table, sl, _, _, kc8, vc8, ks, vs = t
    return lambda: paged_attention_decode(q, kc8, vc8, table, sl, k_scale=ks, v_scale=vs)


def _sdpa(backend_name: str):
    def make(t):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, _, _, _, _, k, v, *_ = t
        qt = q.unsqueeze(2)  # [B, Hq, 1, D]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D] views of the dense cache
        backend = getattr(SDPBackend, backend_name)

        def call():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        try:
            call()
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise Skip(f"SDPA {backend_name} refuses this case: {first}") from e
        return call

    return make


def _squeeze_token(o):
    return o.squeeze(2)


def _decode_reference(t):
    """fp32 attention on the dense cache (which the paged one scatters), a few sequences at a time."""
    q, _, _, _, _, k, v, *_ = t
    group = q.shape[1] // k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 18) // k.shape[1])
    for b0 in range(0, q.shape[0], step):
        qs = q[b0 : b0 + step].float()
        ks = k[b0 : b0 + step].float().repeat_interleave(group, dim=2)
        vs = v[b0 : b0 + step].float().repeat_interleave(group, dim=2)
        s = torch.einsum("bhd,bshd->bhs", qs, ks) / math.sqrt(q.shape[-1])
        out[b0 : b0 + step] = torch.einsum("bhs,bshd->bhd", s.softmax(-1), vs)
    return out


def _decode_bench(r: DecodeRange) -> Bench:
    return Bench(
        name="attn_decode_bf16",
        cases=_tuned_decode_cases(),
        quick_cases=_QUICK_DECODE,
        setup=_decode_setup(False),
        providers=[
            Provider("flydsl", _ours_paged, is_ours=True),
            Provider("flydsl.dense", _ours_dense, is_ours=True),
            *(
                Provider(f"sdpa.{name.split('_')[0].lower()}", _sdpa(name), output=_squeeze_token)
                for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
            ),
        ],  # fmt: skip
        bytes=decode_bytes,
        reference=_decode_reference,
        tolerance=1e-2,
        x_param="kv_tokens",
        group_by=("B",),
        description="decode attention, one token a sequence, bf16 paged cache (block 16, shuffled), GQA 32/8, "
        "D 128; bytes: KV read + q + out",
        sweep=lambda rng, count: decode_sweep(rng, count, r),
        timings=("gpu", "call"),
    )


def _fp8_bench(r: DecodeRange) -> Bench:
    return Bench(
        name="attn_decode_fp8",
        cases=_tuned_decode_cases(),
        quick_cases=_QUICK_DECODE[:1],
        setup=_decode_setup(True),
        providers=[
            Provider("flydsl", _ours_fp8, is_ours=True),
            Provider("flydsl.bf16", _ours_paged),  # the peer: our bf16 decode, on the same values
        ],
        bytes=lambda case: decode_bytes(case, 1),
        reference=_decode_reference,
        tolerance=1e-2,
        x_param="kv_tokens",
        group_by=("B",),
        description="decode attention over an fp8 e4m3 paged cache (per-head scales) against our bf16 decode; "
        "bytes: KV read (1 byte) + q + out",
        sweep=lambda rng, count: decode_sweep(rng, count, r),
        timings=("gpu", "call"),
    )


# ------------------------------------------------------------------------------ RoPE + cache write


def _rope_case(t, hq=32, hkv=8, d=128, rot=128, neox=True, page=16) -> Case:
    name = f"t{t}-h{hq}/{hkv}-d{d}" + (f"-rot{rot}" if rot != d else "") + ("" if neox else "-gptj")
    return Case(name, {"T": t, "Hq": hq, "Hkv": hkv, "D": d, "rot": rot, "neox": neox, "page": page, "tokens": t})


def rope_bytes(case: Case) -> int:
    """q, k, v read, q written, k and v written into the cache (2 bytes each), the cos / sin rows (fp32) and
    the positions and slots (int64)."""
    p = case.params
    t, hq, hkv, d = p["T"], p["Hq"], p["Hkv"], p["D"]
    return t * (2 * (2 * hq + 4 * hkv) * d + 4 * p["rot"] + 16)


def rope_sweep(rng: random.Random, count: int, r: DecodeRange = GPU_RANGE) -> list[Case]:
    def draw() -> Case:
        t = log_uniform(rng, 1, r.rope_tokens_max)
        if rng.random() < 0.5:
            t |= 1
        hq = rng.choice(r.heads_q)
        hkv = max(1, hq // rng.choice((1, 4, 8)))
        d = rng.choice((64, 128))
        case = _rope_case(t, hq, hkv, d, rng.choice((d, d // 2)), rng.random() < 0.7, rng.choice((16, 32)))
        return case

    return distinct_cases(count, draw, f"rope_sweep from {r}")


def _cos_sin(max_pos, rot, device):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot)
    f = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1)


def _rope_setup(case: Case, device):
    p = case.params
    g = torch.Generator(device="cpu").manual_seed(p["T"] * 7 + p["D"])
    t, hq, hkv, d, page = p["T"], p["Hq"], p["Hkv"], p["D"], p["page"]
    q = torch.randn(t, hq, d, generator=g).to(device=device, dtype=_BF16)
    k = torch.randn(t, hkv, d, generator=g).to(device=device, dtype=_BF16)
    v = torch.randn(t, hkv, d, generator=g).to(device=device, dtype=_BF16)
    blocks = -(-t // page) + 1
    kc = torch.zeros(blocks, page, hkv, d, dtype=_BF16, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * page, generator=g)[:t].to(device)  # every slot valid: the torch peer's case
    positions = torch.randint(0, 8192, (t,), generator=g).to(device)
    return q, k, v, _cos_sin(8192, p["rot"], device), positions, kc, vc, slots, p["neox"]


def _torch_rope(x, cos_sin_cache, positions, neox):
    """Rotary embedding as torch eager code writes it (fp32 math, the input's dtype out)."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    xr, rest = x[..., :rot].float(), x[..., rot:]
    if neox:
        a, b = xr.chunk(2, dim=-1)
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def _torch_rope_cache(q, k, v, cos_sin_cache, positions, kc, vc, slots, neox):
    qr = _torch_rope(q, cos_sin_cache, positions, neox)
    kr = _torch_rope(k, cos_sin_cache, positions, neox)
    kc.view(-1, *kc.shape[2:]).index_put_((slots,), kr)
    vc.view(-1, *vc.shape[2:]).index_put_((slots,), v)
    return qr


def _ours_rope(t):
    q, k, v, cs, pos, kc, vc, slots, neox = t
    return lambda: fused_rope_cache(q, k, v, cs, pos, kc, vc, slots, is_neox=neox)


def _eager_rope(t):
    return lambda: _torch_rope_cache(*t)


_COMPILED_ROPE = CompiledPeer(_torch_rope_cache)


def _compiled_rope(t):
    q, *_, neox = t
    return _COMPILED_ROPE.make((tuple(q.shape), t[1].shape, t[3].shape[1], neox), *t)


def _rope_reference(t):
    q, _, _, cs, pos, _, _, _, neox = t
    return _torch_rope(q.float(), cs, pos, neox)


def _rope_bench(r: DecodeRange) -> Bench:
    return Bench(
        name="rope_cache",
        cases=[_rope_case(t) for t in _ROPE_TOKENS],
        quick_cases=[_rope_case(5, 4, 2, 32, 32), _rope_case(3, 4, 1, 64, 32, False)],
        setup=_rope_setup,
        providers=[
            Provider("flydsl", _ours_rope, is_ours=True),
            Provider("torch", _eager_rope),
            Provider("torch.compile", _compiled_rope),
        ],
        bytes=rope_bytes,
        reference=_rope_reference,
        tolerance=1e-2,
        x_param="tokens",
        description="RoPE (NeoX, full rotary) on q and k + the paged cache write of k and v, bf16, 32 / 8 heads, "
        "D 128, block 16; bytes: q, k, v read, q and the cache rows written, cos / sin rows, indices",
        sweep=lambda rng, count: rope_sweep(rng, count, r),
        timings=("gpu", "call"),
    )


# ------------------------------------------------------------------------------ entry point


def benches(r: DecodeRange | None = None) -> list[Bench]:
    """The serving benches; ``r``: where the sweeps' shapes come from (default: the GPU's range when a GPU is
    present, else the interpreter's)."""
    if r is None:
        r = GPU_RANGE if torch.cuda.is_available() else CPU_RANGE
    return [_decode_bench(r), _fp8_bench(r), _rope_bench(r)]
