"""Benchmarks of fly-attention against torch's SDPA backends, on the shared harness.

Run ``python packages/fly-attention/benchmarks/run.py [--quick] [--only NAME] [--sweep] [--seed N]`` or
``flydsl bench attention ...``. Every case is checked against an fp32 reference before it is timed; the
matmul ceiling (cuBLAS bf16 peak) is measured in the same run. Each (case, provider) gets ``gpu_us``
(GPU time, host hidden; the TFLOP/s come from it), ``call_us`` (one public call at a time, host included)
and, where a bench says so, ``step_us`` (a training step on a fresh graph).

Shapes of the tuned sets: a fixed budget of 2^14 tokens (batch = 16384 / seqlen) and 2048 of hidden width
(heads = 2048 / head_dim), the setting of the flash-attention papers' tables. SDPA takes the
``[B, H, S, D]`` views (``.transpose(1, 2)``) of the same ``[B, S, H, D]`` tensors, with one backend forced
each (``sdpa_kernel``); a backend that refuses a case is skipped with torch's reason. Ratios: the best
peer's time over ours, per timing.

- ``attn_fwd_bf16``: the forward in bf16 at head dims 64, 128 and 256, causal and not, seqlen 1K-16K.
  Flops ``4 B H Sq Sk D``, halved under causal. Peers: SDPA cuDNN, flash, efficient. gpu and call.
- ``attn_bwd_bf16``: the backward in bf16, head dim 128 causal and not at 1K-16K, head dims 64 and 256 at
  4K. gpu and call time the backward alone: the forward's graph is built once, then
  ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` is repeated (dq, dk, dv). step: one
  training step, new leaves q, k, v requiring grad (``detach().requires_grad_()``), the forward, then
  ``backward(dout)``. Flops: 2.5x the forward's (five matmuls against two) for the backward alone; the
  step's time is reported as is. Peers: the three SDPA backends, their graph and step through the same
  transposed views (dout reaches SDPA as the ``[B, H, S, D]`` view of the ``[B, S, H, D]`` gradient, as in
  a model that transposes back). Checked: dq, dk and dv against a chunked fp32 backward, each gradient
  divided by its reference's norm so that each weighs the same in the one relative error.
- ``attn_varlen_bf16``: ``flash_attn_varlen`` on 2^14 packed tokens, head dim 128, 16 heads, causal and
  not (each sequence attends to itself: seqlen_q = seqlen_k). Equal lengths 1K-16K, where the peer
  ``flydsl.dense`` runs ``flash_attn`` on the same tokens as ``[B, S, H, D]`` (the ratio is the dense
  kernel's time over the varlen path's on the same work); mixed lengths drawn from a fixed seed (mean 1K
  and 4K, with one empty and one length-1 sequence), varlen alone. Flops: the sum over sequences of
  ``4 H s^2 D``, halved under causal. gpu and call (call includes the cu_seqlens checks' host sync).
- ``attn_fwd_fp8``: the forward with q, k, v in float8 e4m3 and per-tensor descales (fp32 ``[1]`` tensors,
  ``amax / 448`` of bf16 random data), bf16 output; head dim 128, causal and not, 1K-16K. Peers: our own
  bf16 forward (``flydsl.bf16``) and SDPA cuDNN in bf16, both on the dequantized inputs. Checked against
  the fp32 reference on the dequantized inputs. gpu and call.

Sweep (``--sweep``, ``--seed N``): every bench draws its own shapes from the seeded ``random.Random``
(``sweep_cases`` seeds each bench by its name). The forward, backward and fp8 benches use
:func:`sweep_shapes`: head dims from 64, 80, 96, 128, 192, 256, odd sequence lengths (half the time), GQA
ratios 1, 2, 4, 8 and MQA, causal or not (causal cases square, where SDPA's top-left causal and ours agree;
non-causal ones may differ in seqlen_q and seqlen_k), batch from the same token budget. The varlen bench
uses :func:`varlen_sweep_shapes`: the same head dims, heads and GQA ratios, half the packs equal lengths
(the dense peer runs), half mixed lengths around a random mean (sometimes with an empty and a length-1
sequence).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flydsl.testing import default_device
from flydsl_common.bench import (
    Bench,
    Case,
    GradCheck,
    Provider,
    Skip,
    distinct_cases,
    log_uniform,
    main_for,
    results_dir,
)

from .attention import flash_attn, flash_attn_varlen
from .reference import flash_attn_ref, flash_attn_varlen_ref

__all__ = [
    "CPU_SWEEP",
    "GPU_SWEEP",
    "SweepRange",
    "attn_grads_ref",
    "benches",
    "bwd_flops",
    "default_out_dir",
    "flops",
    "main",
    "mixed_lengths",
    "quantize_fp8",
    "sweep_shapes",
    "varlen_flops",
    "varlen_sweep_shapes",
]

_TOKENS = 1 << 14  # batch * seqlen of every tuned case
_HIDDEN = 2048  # heads * head_dim
_SEQLENS = (1024, 2048, 4096, 8192, 16384)
_HEAD_DIMS = (64, 128, 256)
SWEEP_HEAD_DIMS = (64, 80, 96, 128, 192, 256)
_GQA = (1, 2, 4, 8, 0)  # heads_q / heads_kv; 0: MQA (one KV head)
_BF16 = torch.bfloat16
_SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def _case(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, causal: bool) -> Case:
    name = f"d{d}{'-causal' if causal else ''}-{b}x{sq}" + (f"x{sk}" if sk != sq else "") + f"-h{hq}"
    if hkv != hq:
        name += f"/{hkv}"
    return Case(name, {"B": b, "Sq": sq, "Sk": sk, "Hq": hq, "Hkv": hkv, "D": d, "causal": causal, "seqlen": sq})


def _tuned_cases() -> list[Case]:
    return [_case(_TOKENS // s, s, s, _HIDDEN // d, _HIDDEN // d, d, c)
            for d in _HEAD_DIMS for c in (False, True) for s in _SEQLENS]  # fmt: skip


# The interpreter's smoke cases: one tile and a ragged one, causal and not
_QUICK = [_case(1, 32, 32, 2, 2, 64, False), _case(1, 40, 40, 4, 2, 64, True)]


def flops(case: Case) -> int:
    """``4 B H Sq Sk D`` (two matmuls of 2 flops a multiply-add), halved under causal."""
    p = case.params
    f = 4 * p["B"] * p["Hq"] * p["Sq"] * p["Sk"] * p["D"]
    return f // 2 if p["causal"] else f


# ------------------------------------------------------------------------------ sweep


@dataclass(frozen=True)
class SweepRange:
    """Where unseen shapes come from: sequence lengths log-uniform in [seq_min, seq_max], batch from the
    token budget ``tokens``, query heads from ``heads``."""

    seq_min: int = 100
    seq_max: int = 16384
    tokens: int = _TOKENS
    heads: tuple[int, ...] = (8, 16, 32)


GPU_SWEEP = SweepRange()
# The interpreter's range (CPU smoke runs and tests): the same classes at sizes it runs in seconds.
CPU_SWEEP = SweepRange(seq_min=1, seq_max=64, tokens=64, heads=(2, 4))


def _seqlen(rng: random.Random, r: SweepRange) -> int:
    s = log_uniform(rng, r.seq_min, r.seq_max)
    if rng.random() < 0.5:
        s |= 1  # odd: a ragged last tile
    return min(s, r.seq_max)


def sweep_shapes(rng: random.Random, count: int, r: SweepRange = GPU_SWEEP) -> list[Case]:
    """``count`` distinct cases drawn from ``rng`` alone (see the module docstring)."""

    def draw() -> Case:
        d = rng.choice(SWEEP_HEAD_DIMS)
        hq = rng.choice(r.heads)
        ratio = rng.choice(_GQA)
        hkv = 1 if ratio == 0 else max(1, hq // ratio)
        causal = rng.random() < 0.5
        sq = _seqlen(rng, r)
        sk = sq if causal or rng.random() < 0.5 else _seqlen(rng, r)
        return _case(max(1, r.tokens // max(sq, sk)), sq, sk, hq, hkv, d, causal)

    return distinct_cases(count, draw, f"sweep_shapes from {r}")


def _sweep(r: SweepRange):
    return lambda rng, count: sweep_shapes(rng, count, r)


# ------------------------------------------------------------------------------ providers


def _setup(case: Case, device):
    p = case.params
    g = torch.Generator(device="cpu").manual_seed(p["Sq"] * 7 + p["D"])
    q = torch.randn(p["B"], p["Sq"], p["Hq"], p["D"], generator=g).to(device=device, dtype=_BF16)
    k = torch.randn(p["B"], p["Sk"], p["Hkv"], p["D"], generator=g).to(device=device, dtype=_BF16)
    v = torch.randn(p["B"], p["Sk"], p["Hkv"], p["D"], generator=g).to(device=device, dtype=_BF16)
    return q, k, v, p["causal"]


def _ours(t):
    q, k, v, causal = t
    return lambda: flash_attn(q, k, v, causal=causal)


def _sdpa(backend_name: str):
    """SDPA with one backend forced; a refusal (torch's own rules: head dims, GQA, layouts, devices) is a
    Skip with torch's words."""

    def make(t):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v, causal = t
        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views of the same storage
        gqa = q.shape[2] != k.shape[2]
        if causal and q.shape[1] != k.shape[1]:  # SDPA's causal is aligned top-left, ours bottom-right
            raise Skip("SDPA's is_causal aligns the diagonal top-left; the case has seqlen_q != seqlen_k")

        def call():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

        try:
            call()
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise Skip(f"SDPA {backend_name} refuses this case: {first}") from e
        return call

    return make


def _bhsd_to_bshd(o):
    return o.transpose(1, 2)


def _reference(t):
    q, k, v, causal = t
    return flash_attn_ref(q, k, v, causal=causal)


def _fwd_bench(sweep_range: SweepRange) -> Bench:
    return Bench(
        name="attn_fwd_bf16",
        cases=_tuned_cases(),
        quick_cases=_QUICK,
        setup=_setup,
        providers=[
            Provider("flydsl", _ours, is_ours=True),
            *(
                Provider(f"sdpa.{name.split('_')[0].lower()}", _sdpa(name), output=_bhsd_to_bshd)
                for name in _SDPA_BACKENDS
            ),  # fmt: skip
        ],
        flops=flops,
        reference=_reference,
        tolerance=1e-2,
        x_param="seqlen",
        group_by=("D", "causal"),
        description=(
            f"flash attention forward, bf16, [B, S, H, D]; B * S = {_TOKENS} tokens, H * D = {_HIDDEN}; "
            "flops 4 B H Sq Sk D (halved under causal)"
        ),  # fmt: skip
        sweep=_sweep(sweep_range),
        timings=("gpu", "call"),
    )


# ------------------------------------------------------------------------------ backward


_BWD_SEQLENS = _SEQLENS  # head dim 128: the forward's tuned seqlens
_BWD_OTHER_DIMS = (64, 256)  # informative: one seqlen each
_BWD_OTHER_SEQLEN = 4096
# The backward's reference holds at most this many fp32 scores of one (batch, head-chunk, query-block) at a
# time (each of the score-sized temporaries: scores, probabilities, dP, dS): 2^26 elements = 256 MiB, so a
# 16K x 16K case is checked in about 1 GiB of temporaries instead of 4 GiB a head.
_REF_SCORES = 1 << 26


def _bwd_cases() -> list[Case]:
    def case(s, d, c):
        return _case(_TOKENS // s, s, s, _HIDDEN // d, _HIDDEN // d, d, c)

    d128 = [case(s, 128, c) for c in (False, True) for s in _BWD_SEQLENS]
    return d128 + [case(_BWD_OTHER_SEQLEN, d, c) for d in _BWD_OTHER_DIMS for c in (False, True)]


def bwd_flops(case: Case) -> int:
    """The backward alone: 2.5x the forward's (five matmuls, ``QK^T`` recomputed, ``dP = dO V^T``,
    ``dV = P^T dO``, ``dQ = dS K``, ``dK = dS^T Q``, against the forward's two), halved under causal."""
    return 5 * flops(case) // 2


def attn_grads_ref(q, k, v, dout, causal: bool = False, softmax_scale: float | None = None, *, max_scores=None):
    """fp32 ``(dq, dk, dv)`` of ``softmax(q k^T * scale, bottom-right causal mask) v`` for the upstream
    gradient ``dout``, on ``[B, S, H, D]`` tensors (GQA / MQA: dk, dv summed over each KV head's group).

    Computed one (batch, chunk of query heads, block of query rows) at a time, at most ``max_scores`` (default
    ``_REF_SCORES``) scores each, so no full ``[H, Sq, Sk]`` matrix is ever held: per block, the scores, their
    softmax (each row sees every key, so a block of rows is exact), ``o = P v``, ``dv += P^T do``,
    ``dP = do v^T``, ``dS = P * (dP - rowsum(do * o))``, ``dq = dS k * scale``, ``dk += dS^T q * scale``."""
    from .reference import attention_mask

    budget = int(max_scores or _REF_SCORES)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dev = q.device
    dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=dev)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    if sq == 0 or sk == 0:
        return dq, dk, dv
    heads = max(1, min(hq, budget // (sq * sk)))
    rows = max(1, min(sq, budget // (heads * sk)))
    for bi in range(b):
        for h0 in range(0, hq, heads):
            h1 = min(hq, h0 + heads)
            kv_heads = torch.arange(h0, h1, device=dev) // group  # the KV head each query head reads
            kf = k[bi].index_select(1, kv_heads).float()  # [Sk, h, D]
            vf = v[bi].index_select(1, kv_heads).float()
            dk_h = torch.zeros_like(kf)
            dv_h = torch.zeros_like(vf)
            for r0 in range(0, sq, rows):
                r1 = min(sq, r0 + rows)
                qf = q[bi, r0:r1, h0:h1].float()  # [r, h, D]
                do = dout[bi, r0:r1, h0:h1].float()
                s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
                ok = attention_mask(sq, sk, causal, device=dev, rows=range(r0, r1))
                s.masked_fill_(~ok, float("-inf"))
                lse = torch.logsumexp(s, dim=-1)
                lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # a row seeing no key: p = 0
                p = torch.exp(s - lse[..., None])
                del s
                o = torch.einsum("hqk,khd->qhd", p, vf)
                dv_h += torch.einsum("hqk,qhd->khd", p, do)
                dp = torch.einsum("qhd,khd->hqk", do, vf)
                delta = (do * o).sum(-1).transpose(0, 1)  # [h, r]
                ds = p * (dp - delta[..., None])
                del p, dp
                dq[bi, r0:r1, h0:h1] = torch.einsum("hqk,khd->qhd", ds, kf) * scale
                dk_h += torch.einsum("hqk,qhd->khd", ds, qf) * scale
                del ds
            dk[bi].index_add_(1, kv_heads, dk_h)
            dv[bi].index_add_(1, kv_heads, dv_h)
    return dq, dk, dv


def _setup_bwd(case: Case, device):
    q, k, v, causal = _setup(case, device)
    p = case.params
    g = torch.Generator(device="cpu").manual_seed(p["Sq"] * 7 + p["D"] + 1)
    dout = torch.randn(q.shape, generator=g).to(device=device, dtype=_BF16)
    return q, k, v, dout, causal


def _leaves(*tensors):
    return tuple(t.detach().requires_grad_() for t in tensors)


def _ours_bwd(t):
    q, k, v, dout, causal = t
    leaves = _leaves(q, k, v)
    out = flash_attn(*leaves, causal=causal)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def _ours_step(t):
    q, k, v, dout, causal = t

    def call():
        flash_attn(*_leaves(q, k, v), causal=causal).backward(dout)

    return call


def _sdpa_graph(backend_name: str, q, k, v, causal):
    """SDPA with one backend forced on the ``[B, H, S, D]`` views of new leaves: ``(leaves, out)``;
    a refusal is a Skip with torch's words (the caller's first backward may refuse too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if causal and q.shape[1] != k.shape[1]:  # SDPA's causal is aligned top-left, ours bottom-right
        raise Skip("SDPA's is_causal aligns the diagonal top-left; the case has seqlen_q != seqlen_k")
    leaves = _leaves(q, k, v)
    with sdpa_kernel([getattr(SDPBackend, backend_name)]):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), is_causal=causal,
                                             enable_gqa=q.shape[2] != k.shape[2])  # fmt: skip
    return leaves, out


def _refusal(backend_name: str, e: Exception) -> Skip:
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return Skip(f"SDPA {backend_name} refuses this case: {first}")


def _sdpa_bwd(backend_name: str):
    def make(t):
        q, k, v, dout, causal = t
        dout_t = dout.transpose(1, 2)
        try:
            leaves, out = _sdpa_graph(backend_name, q, k, v, causal)
            torch.autograd.grad(out, leaves, dout_t, retain_graph=True)
        except RuntimeError as e:
            raise _refusal(backend_name, e) from e
        return lambda: torch.autograd.grad(out, leaves, dout_t, retain_graph=True)

    return make


def _sdpa_step(backend_name: str):
    def step(t):
        q, k, v, dout, causal = t
        dout_t = dout.transpose(1, 2)

        def call():
            _, out = _sdpa_graph(backend_name, q, k, v, causal)
            out.backward(dout_t)

        try:
            call()
        except RuntimeError as e:
            raise _refusal(backend_name, e) from e
        return call

    return step


# The interpreter's smoke cases of the backward: a tile, and a ragged causal one with MQA (its dk / dv summed
# over the group); few heads, as the backward's three kernels cost several times the forward there.
_QUICK_BWD = [_case(1, 32, 32, 2, 2, 64, False), _case(1, 40, 40, 2, 1, 64, True)]


def _bwd_bench(sweep_range: SweepRange) -> Bench:
    check = GradCheck(lambda t: attn_grads_ref(*t))  # dq, dk, dv, each weighed by its reference's norm
    return Bench(
        name="attn_bwd_bf16",
        cases=_bwd_cases(),
        quick_cases=_QUICK_BWD,
        setup=_setup_bwd,
        providers=[
            Provider("flydsl", _ours_bwd, is_ours=True, step=_ours_step),
            *(
                Provider(f"sdpa.{name.split('_')[0].lower()}", _sdpa_bwd(name), step=_sdpa_step(name))
                for name in _SDPA_BACKENDS
            ),  # fmt: skip
        ],
        flops=bwd_flops,
        reference=check.reference,
        output=check.output,
        tolerance=1e-2,
        x_param="seqlen",
        group_by=("D", "causal"),
        description=(
            f"flash attention backward, bf16, [B, S, H, D]; B * S = {_TOKENS} tokens, H * D = {_HIDDEN}. gpu and "
            "call: the backward alone (the forward's graph built once, torch.autograd.grad of a fixed dout for "
            "dq, dk, dv with retain_graph), flops 2.5x the forward's (10 B H Sq Sk D, halved under causal); "
            "step: new leaves q, k, v, forward, backward(dout), reported as timed"
        ),  # fmt: skip
        sweep=_sweep(sweep_range),
        timings=("gpu", "call", "step"),
    )


# ------------------------------------------------------------------------------ varlen


_VARLEN_D = 128
_VARLEN_HEADS = _HIDDEN // _VARLEN_D
_VARLEN_MEANS = (1024, 4096)  # the mixed packs' mean lengths
_MIXED_SEED = 34  # the mixed packs' lengths: random.Random(f"{_MIXED_SEED}:{mean}")


def mixed_lengths(rng: random.Random, total: int, mean: int, *, extremes: bool = True) -> tuple[int, ...]:
    """Sequence lengths summing to ``total``, about ``total / mean`` of them, spread as exponential draws (many
    short, a few long), in the order drawn; with ``extremes`` one empty and one length-1 sequence at random
    places among them. Every number comes from ``rng``."""
    if total < 3 or mean < 1:
        raise ValueError(f"mixed_lengths: need total >= 3 and mean >= 1, got total={total}, mean={mean}")
    rest = total - 1 if extremes else total
    n = max(1, min(rest, round(rest / mean)))
    w = [rng.expovariate(1.0) + 1e-3 for _ in range(n)]
    lens = [max(1, round(x / sum(w) * rest)) for x in w]
    longest = max(range(n), key=lambda i: lens[i])
    lens[longest] += rest - sum(lens)  # rounding lands on the longest, which stays >= 1
    if lens[longest] < 1:
        raise ValueError(f"mixed_lengths: cannot split {rest} tokens into {n} sequences")
    if extremes:
        for extra in (0, 1):
            lens.insert(rng.randrange(len(lens) + 1), extra)
    return tuple(lens)


def _varlen_case(lens: Sequence[int], hq: int, hkv: int, d: int, causal: bool, mean: int | None = None) -> Case:
    """A pack of sequences of lengths ``lens``: equal lengths when ``mean`` is None, else mixed lengths drawn
    around ``mean`` (the case's x value and name)."""
    lens = tuple(int(s) for s in lens)
    equal = mean is None
    kind = f"{len(lens)}x{lens[0]}" if equal else f"mixed{mean}-{len(lens)}seqs-max{max(lens)}"
    name = f"d{d}{'-causal' if causal else ''}-{kind}-h{hq}" + (f"/{hkv}" if hkv != hq else "")
    params = {"lens": lens, "tokens": sum(lens), "Hq": hq, "Hkv": hkv, "D": d, "causal": causal,
              "lengths": "equal" if equal else "mixed", "seqlen": lens[0] if equal else mean}  # fmt: skip
    return Case(name, params)


def _varlen_cases() -> list[Case]:
    h = _VARLEN_HEADS
    equal = [_varlen_case((s,) * (_TOKENS // s), h, h, _VARLEN_D, c) for c in (False, True) for s in _SEQLENS]
    mixed = [
        _varlen_case(mixed_lengths(random.Random(f"{_MIXED_SEED}:{m}"), _TOKENS, m), h, h, _VARLEN_D, c, m)
        for c in (False, True) for m in _VARLEN_MEANS
    ]  # fmt: skip
    return equal + mixed


_QUICK_VARLEN = [_varlen_case((32, 32), 2, 2, 64, False), _varlen_case((17, 0, 1, 40), 4, 2, 64, True, 20)]


def varlen_flops(case: Case) -> int:
    """The sum over sequences of ``4 H s^2 D`` (each sequence attends to itself), halved under causal."""
    p = case.params
    f = sum(4 * p["Hq"] * s * s * p["D"] for s in p["lens"])
    return f // 2 if p["causal"] else f


def varlen_sweep_shapes(rng: random.Random, count: int, r: SweepRange = GPU_SWEEP) -> list[Case]:
    """``count`` distinct packs drawn from ``rng`` alone (see the module docstring): half equal lengths (one
    drawn seqlen, as many sequences as the token budget holds), half mixed around a log-uniform mean."""

    def draw() -> Case:
        d = rng.choice(SWEEP_HEAD_DIMS)
        hq = rng.choice(r.heads)
        ratio = rng.choice(_GQA)
        hkv = 1 if ratio == 0 else max(1, hq // ratio)
        causal = rng.random() < 0.5
        if rng.random() < 0.5:
            s = _seqlen(rng, r)
            case = _varlen_case((s,) * max(1, r.tokens // s), hq, hkv, d, causal)
        else:
            mean = log_uniform(rng, max(2, r.seq_min), max(2, min(r.seq_max, r.tokens) // 2))
            lens = mixed_lengths(rng, max(3, r.tokens), mean, extremes=rng.random() < 0.5)
            case = _varlen_case(lens, hq, hkv, d, causal, mean)
        return case

    return distinct_cases(count, draw, f"varlen_sweep_shapes from {r}")


def _setup_varlen(case: Case, device):
    p = case.params
    lens = p["lens"]
    total = sum(lens)
    g = torch.Generator(device="cpu").manual_seed(total * 7 + p["D"] + len(lens))
    q = torch.randn(total, p["Hq"], p["D"], generator=g).to(device=device, dtype=_BF16)
    k = torch.randn(total, p["Hkv"], p["D"], generator=g).to(device=device, dtype=_BF16)
    v = torch.randn(total, p["Hkv"], p["D"], generator=g).to(device=device, dtype=_BF16)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    dense = (len(lens), lens[0]) if p["lengths"] == "equal" else None
    return q, k, v, cu, max(lens), p["causal"], dense


def _ours_varlen(t):
    q, k, v, cu, max_len, causal, _ = t
    return lambda: flash_attn_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal)


def _dense_of_varlen(t):
    """flash_attn on the same tokens as ``[B, S, H, D]`` views (equal lengths only)."""
    q, k, v, _, _, causal, dense = t
    if dense is None:
        raise Skip("mixed lengths: no dense [B, S, H, D] layout holds these tokens")
    b, s = dense
    qd, kd, vd = (x.view(b, s, *x.shape[1:]) for x in (q, k, v))
    return lambda: flash_attn(qd, kd, vd, causal=causal)


def _varlen_reference(t):
    q, k, v, cu, _, causal, _ = t
    return flash_attn_varlen_ref(q, k, v, cu, cu, causal=causal)


def _varlen_bench(sweep_range: SweepRange) -> Bench:
    return Bench(
        name="attn_varlen_bf16",
        cases=_varlen_cases(),
        quick_cases=_QUICK_VARLEN,
        setup=_setup_varlen,
        providers=[
            Provider("flydsl", _ours_varlen, is_ours=True),
            Provider("flydsl.dense", _dense_of_varlen, output=lambda o: o.flatten(0, 1)),
        ],
        flops=varlen_flops,
        reference=_varlen_reference,
        tolerance=1e-2,
        x_param="seqlen",
        group_by=("lengths", "causal"),
        description=(
            f"flash_attn_varlen forward, bf16, packed [tokens, H, D], {_TOKENS} tokens, H * D = {_HIDDEN}, each "
            "sequence attending to itself; equal lengths against flydsl.dense (flash_attn on the same tokens as "
            "[B, S, H, D]); mixed lengths (fixed seed, mean 1K and 4K, one empty and one length-1 sequence) varlen "
            "alone, x = the mean length. flops: sum over sequences of 4 H s^2 D (halved under causal)"
        ),  # fmt: skip
        sweep=lambda rng, count: varlen_sweep_shapes(rng, count, sweep_range),
        timings=("gpu", "call"),
    )


# ------------------------------------------------------------------------------ fp8


_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # e4m3's largest finite value
_FP8_HEAD_DIM = 128
# The check's budget: the fp8 kernel rounds the probabilities P to e4m3 for the P @ V dot (3 mantissa bits: a
# relative rounding of at most 2^-4 an element); the output's expected relative error is that rounding's rms
# (~2^-4 / sqrt(3) ~ 3.6e-2), under 2^-4. Q, K and V carry no error here: the reference takes the same
# dequantized values. The bf16 peers pass by far; zeros or a lost descale (error ~1) fail.
_FP8_TOLERANCE = 2.0**-4
# Per-tensor magnitudes of q, k, v before quantizing: distinct descales (a descale applied to the wrong
# tensor changes the result), while q k^T keeps the unit-variance scores of the bf16 benches.
_FP8_MAGNITUDES = (2.0, 0.5, 4.0)


def _fp8_cases() -> list[Case]:
    h = _HIDDEN // _FP8_HEAD_DIM
    return [_case(_TOKENS // s, s, s, h, h, _FP8_HEAD_DIM, c) for c in (False, True) for s in _SEQLENS]


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3: ``(x8, descale)`` with ``descale = amax / 448`` (fp32, shape [1]) and ``x8 = x /
    descale`` rounded to e4m3, so ``x8.float() * descale`` is the dequantized tensor."""
    amax = x.detach().abs().amax().float().clamp_min(1e-12)
    descale = (amax / _FP8_MAX).reshape(1)
    x8 = (x.float() / descale).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return x8, descale


def _setup_fp8(case: Case, device):
    q, k, v, causal = _setup(case, device)
    quantized = [quantize_fp8(x * m) for x, m in zip((q, k, v), _FP8_MAGNITUDES, strict=True)]
    deq = [(x8.float() * s).to(_BF16) for x8, s in quantized]
    (q8, qs), (k8, ks), (v8, vs) = quantized
    return q8, k8, v8, qs, ks, vs, *deq, causal


def _ours_fp8(t):
    q8, k8, v8, qs, ks, vs, *_, causal = t
    return lambda: flash_attn(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)


def _bf16_of_fp8(t):
    """The dequantized inputs in bf16: ``(q, k, v, causal)`` as the bf16 forward bench's inputs."""
    return (*t[6:9], t[9])


def _fp8_reference(t):
    q8, k8, v8, qs, ks, vs, *_, causal = t
    return flash_attn_ref(q8.float() * qs, k8.float() * ks, v8.float() * vs, causal=causal)


def _fp8_bench(sweep_range: SweepRange) -> Bench:
    return Bench(
        name="attn_fwd_fp8",
        cases=_fp8_cases(),
        quick_cases=_QUICK,
        setup=_setup_fp8,
        providers=[
            Provider("flydsl", _ours_fp8, is_ours=True),
            Provider("flydsl.bf16", lambda t: _ours(_bf16_of_fp8(t))),
            Provider("sdpa.cudnn", lambda t: _sdpa("CUDNN_ATTENTION")(_bf16_of_fp8(t)), output=_bhsd_to_bshd),
        ],
        flops=flops,
        reference=_fp8_reference,
        tolerance=_FP8_TOLERANCE,
        x_param="seqlen",
        group_by=("D", "causal"),
        description=(
            f"flash attention forward, q, k, v float8 e4m3 with per-tensor descales (fp32 [1]), bf16 out, [B, S, H, "
            f"D]; B * S = {_TOKENS} tokens, H * D = {_HIDDEN}; peers: flydsl.bf16 (our bf16 forward) and SDPA cuDNN "
            "(bf16), both on the dequantized inputs; flops 4 B H Sq Sk D (halved under causal)"
        ),  # fmt: skip
        sweep=_sweep(sweep_range),
        timings=("gpu", "call"),
    )


# ------------------------------------------------------------------------------ entry points


def benches(sweep_range: SweepRange = GPU_SWEEP) -> list[Bench]:
    """Every bench of the family (prefill here, then decode and the RoPE / cache write from
    :mod:`.decode_bench`); ``sweep_range``: where the prefill's unseen shapes come from (tests shrink it; the
    decode benches then draw from their CPU range too)."""
    from . import decode_bench

    decode_range = decode_bench.GPU_RANGE if sweep_range is GPU_SWEEP else decode_bench.CPU_RANGE
    return [_fwd_bench(sweep_range), _bwd_bench(sweep_range), _varlen_bench(sweep_range), _fp8_bench(sweep_range),
            *decode_bench.benches(decode_range)]  # fmt: skip


def default_out_dir() -> Path:
    return results_dir("fly-attention", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    # Without a GPU the kernels run in the interpreter: the sweep then draws from CPU_SWEEP.
    on_gpu = default_device().type == "cuda"
    return main_for(benches(GPU_SWEEP if on_gpu else CPU_SWEEP), list(argv or []), default_out_dir())
