"""Benchmarks of fly-attention against torch's SDPA backends, on the shared harness.

Run ``python packages/fly-attention/benchmarks/run.py [--quick] [--only NAME] [--sweep] [--seed N]`` or
``flydsl bench attention ...``. Every case is checked against the fp32 reference before it is timed; the
matmul ceiling (cuBLAS bf16 peak) is measured in the same run. Each (case, provider) gets ``gpu_us``
(GPU time, host hidden) and ``call_us`` (one public call at a time, host included).

Tuned set (``attn_fwd_bf16``): the forward in bf16 at head dims 64, 128 and 256, causal and not, seqlen
1K-16K at a fixed budget of 2^14 tokens (batch = 16384 / seqlen) and 2048 of hidden width (heads = 2048 /
head_dim), the setting of the flash-attention papers' forward tables. Flops: ``4 B H Sq Sk D``, halved
under causal. Peers: ``torch.nn.functional.scaled_dot_product_attention`` with one backend forced each
(``sdpa_kernel``): cuDNN, flash, efficient, as separate providers; a backend that refuses a case is
skipped with torch's reason. SDPA takes the ``[B, H, S, D]`` views of the same ``[B, S, H, D]`` tensors.

Sweep (``--sweep``, ``--seed N``): 60 shapes drawn from the seeded ``random.Random`` only: head dims from
64, 80, 96, 128, 192, 256, odd sequence lengths (half the time), GQA ratios 1, 2, 4, 8 and MQA, causal or
not (causal cases square, where SDPA's top-left causal and ours agree; non-causal ones may differ in
seqlen_q and seqlen_k), batch from the same token budget.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flydsl.testing import default_device
from flydsl_common.bench import Bench, Case, Provider, Skip, main_for, results_dir

from .attention import flash_attn
from .reference import flash_attn_ref

__all__ = ["benches", "main", "default_out_dir", "SweepRange", "GPU_SWEEP", "CPU_SWEEP", "sweep_shapes", "flops"]

_TOKENS = 1 << 14  # batch * seqlen of every tuned case
_HIDDEN = 2048  # heads * head_dim
_SEQLENS = (1024, 2048, 4096, 8192, 16384)
_HEAD_DIMS = (64, 128, 256)
SWEEP_HEAD_DIMS = (64, 80, 96, 128, 192, 256)
_GQA = (1, 2, 4, 8, 0)  # heads_q / heads_kv; 0: MQA (one KV head)
_BF16 = torch.bfloat16


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


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _seqlen(rng: random.Random, r: SweepRange) -> int:
    s = _log_uniform(rng, r.seq_min, r.seq_max)
    if rng.random() < 0.5:
        s |= 1  # odd: a ragged last tile
    return min(s, r.seq_max)


def sweep_shapes(rng: random.Random, count: int, r: SweepRange = GPU_SWEEP) -> list[Case]:
    """``count`` distinct cases drawn from ``rng`` alone (see the module docstring)."""
    cases: list[Case] = []
    seen: set[str] = set()
    tries = 0
    while len(cases) < count:
        tries += 1
        if tries > 100 * count + 100:
            raise ValueError(f"sweep_shapes: cannot draw {count} distinct shapes from {r}")
        d = rng.choice(SWEEP_HEAD_DIMS)
        hq = rng.choice(r.heads)
        ratio = rng.choice(_GQA)
        hkv = 1 if ratio == 0 else max(1, hq // ratio)
        causal = rng.random() < 0.5
        sq = _seqlen(rng, r)
        sk = sq if causal or rng.random() < 0.5 else _seqlen(rng, r)
        b = max(1, r.tokens // max(sq, sk))
        case = _case(b, sq, sk, hq, hkv, d, causal)
        if case.name in seen:
            continue
        seen.add(case.name)
        cases.append(case)
    return cases


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
                for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
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


# ------------------------------------------------------------------------------ entry points


def benches(sweep_range: SweepRange = GPU_SWEEP) -> list[Bench]:
    """Every bench of the family; ``sweep_range``: where the unseen shapes come from (tests shrink it)."""
    return [_fwd_bench(sweep_range)]


def default_out_dir() -> Path:
    return results_dir("fly-attention", __file__)


def main(argv: Sequence[str] | None = None) -> int:
    # Without a GPU the kernels run in the interpreter: the sweep then draws from CPU_SWEEP.
    on_gpu = default_device().type == "cuda"
    return main_for(benches(GPU_SWEEP if on_gpu else CPU_SWEEP), list(argv or []), default_out_dir())
