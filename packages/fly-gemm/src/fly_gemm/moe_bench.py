"""Benchmarks of ``fused_moe`` (bf16; fp8 block-scaled) against the peers issue 37 names, on the shared harness.

Models (E experts, top k, hidden H, intermediate I): Mixtral-8x7B (8, 2, 4096, 14336), Qwen3-30B-A3B (128,
8, 2048, 768) and DeepSeek-V3 (256, 8, 7168, 2048; grouped top-k: 8 groups, 4 kept, a correction bias).
Routing is drawn from seeded logits on the CPU by the references (so every provider and the bytes model
see the same ids).

- ``moe_bf16``: tokens 1024-16384; TFLOP/s of ``6 T k H I`` flops (the two projections of every routed row);
- ``moe_bf16_decode``: tokens 1-64; the bytes of the routed experts' weights (each read once) plus the
  activations, against the copy bandwidth;
- ``moe_fp8`` (:func:`fp8_bench`): block-scaled fp8 experts against our bf16 layer, tokens 1024-16384.
- ``moe_mxfp4_decode`` (:func:`mxfp4_decode_bench`): MXFP4 experts (fp4 e2m1, e8m0 scales a 32-group,
  weight-only) against our bf16 layer at decode, tokens 1-64 (the bar: 3x, a quarter of the bytes).
- ``moe_w4a8`` (:func:`w4a8_bench`): MXFP4 experts with fp8 activations against the weight-only MXFP4 layer
  and our bf16 one, tokens 1024-16384.
- ``grouped_gemm`` (:func:`grouped_gemm_bench`): the training grouped GEMM (rows grouped by expert, the
  models' gate/up and down projections), forward and forward + backward against ``torch._grouped_mm``.

Providers: ``flydsl`` (:func:`fused_moe`); ``torch`` (what a plain implementation does: sort the routed
rows by expert, one GEMM pair per expert, weight and add back); ``torch._grouped_mm`` (the same pipeline
with the two grouped GEMMs of torch, where this torch has them: CUDA, sm_90+); ``dense`` (the ceiling a
MoE layer can reach: cuBLAS on E dense GEMM pairs of the mean per-expert rows, same N and K, not checked:
it computes another function). Part of the family's run (:func:`fly_gemm.bench.benches`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from flydsl_common.bench import Bench, Case, Provider, Skip, log_uniform

from .grouped_gemm import grouped_gemm
from .moe import fused_moe
from .moe_reference import fused_moe_ref, grouped_topk_ref, topk_softmax_ref
from .reference import grouped_gemm_ref

__all__ = [
    "benches", "fp8_bench", "mxfp4_decode_bench", "w4a8_bench", "grouped_gemm_bench", "MODELS", "routing",
    "QUICK_MODEL", "FP8_BLOCK", "MXFP4_GROUP",
]  # fmt: skip

# name -> (E, k, H, I, grouped top-k (groups, kept) or None)
MODELS = {
    "mixtral-8x7b": (8, 2, 4096, 14336, None),
    "qwen3-30b-a3b": (128, 8, 2048, 768, None),
    "deepseek-v3": (256, 8, 7168, 2048, (8, 4)),
}
QUICK_MODEL = ("tiny", (4, 2, 64, 32, None))  # the interpreter's smoke case: seconds on the CPU
_TOKENS_LARGE = (1024, 4096, 16384)
_TOKENS_DECODE = (1, 16, 64)
_BF16 = torch.bfloat16


def _shape(case: Case):
    p = case.params
    return p["E"], p["k"], p["H"], p["I"], p["tokens"]


def routing(case: Case):
    """(weights fp32 [T, k], ids int32 [T, k]) of a case, on the CPU: seeded logits through the reference
    routing of the case's model (softmax top-k, or DeepSeek-V3's grouped top-k with a correction bias)."""
    e, k, _, _, t = _shape(case)
    g = torch.Generator().manual_seed(case.params.get("seed", 0))
    logits = torch.randn(t, e, generator=g)
    grouped = case.params.get("grouped")
    if grouped is None:
        return topk_softmax_ref(logits, k)
    bias = torch.randn(e, generator=g) * 0.1
    return grouped_topk_ref(logits, k, grouped[0], grouped[1], correction_bias=bias, routed_scaling_factor=2.5)


def _case(model: str, spec, tokens: int, seed: int = 0) -> Case:
    e, k, h, inter, grouped = spec
    return Case(f"{model}/T{tokens}", {"model": model, "E": e, "k": k, "H": h, "I": inter, "grouped": grouped,
                                       "tokens": tokens, "seed": seed})  # fmt: skip


def _setup(case: Case, device):
    e, k, h, inter, t = _shape(case)
    g = torch.Generator(device=device).manual_seed(case.params.get("seed", 0) + 1)
    x = torch.randn(t, h, device=device, generator=g, dtype=_BF16)
    # unit-scale outputs, as a trained layer's; filled in bf16 a slice at a time (DeepSeek-V3's w1 is 15 GB)
    w1 = torch.empty(e, 2 * inter, h, device=device, dtype=_BF16)
    w2 = torch.empty(e, h, inter, device=device, dtype=_BF16)
    for i in range(e):
        w1[i].normal_(0.0, h**-0.5, generator=g)
        w2[i].normal_(0.0, inter**-0.5, generator=g)
    w, ids = routing(case)
    return x, w1, w2, w.to(device), ids.to(device)


def _flops(case: Case) -> int:
    e, k, h, inter, t = _shape(case)
    return 6 * t * k * h * inter


def _bytes(case: Case) -> int:
    """Each routed expert's weights read once, x read and the output written once (bf16)."""
    _, _, h, inter, t = _shape(case)
    touched = int(torch.unique(routing(case)[1]).numel())
    return 2 * (touched * 3 * h * inter + 2 * t * h)


def _sorted_rows(ids, e):
    """The routed rows sorted by expert (stable), their tokens and the per-expert counts (on the device)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    return order, order // ids.shape[1], counts


def _torch_loop(t):
    x, w1, w2, w, ids = t
    e, inter = w1.shape[0], w1.shape[1] // 2

    def call():
        order, tok, counts = _sorted_rows(ids, e)
        xs = x[tok]
        ys = torch.empty(xs.shape[0], x.shape[1], device=x.device, dtype=x.dtype)
        start = 0
        for i, c in enumerate(counts.tolist()):  # a plain implementation reads the counts on the host
            if c:
                gate_up = xs[start : start + c] @ w1[i].t()
                ys[start : start + c] = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[i].t()
                start += c
        ys = ys.float() * w.reshape(-1)[order, None]
        return torch.zeros(x.shape, device=x.device, dtype=torch.float32).index_add_(0, tok, ys).to(x.dtype)

    return call


def _grouped_mm(t):
    x, w1, w2, w, ids = t
    if not hasattr(torch, "_grouped_mm"):
        raise Skip("this torch has no torch._grouped_mm")
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] < 9:
        raise Skip("torch._grouped_mm runs on CUDA sm_90+ only")
    e, inter = w1.shape[0], w1.shape[1] // 2
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views, as torch._grouped_mm takes them

    def call():
        order, tok, counts = _sorted_rows(ids, e)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x[tok], w1t, offs=offs)
        ys = torch._grouped_mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2t, offs=offs)
        ys = ys.float() * w.reshape(-1)[order, None]
        return torch.zeros(x.shape, device=x.device, dtype=torch.float32).index_add_(0, tok, ys).to(x.dtype)

    try:
        call()
    except RuntimeError as err:
        raise Skip(f"torch._grouped_mm refuses this case: {str(err).strip().splitlines()[0][:160]}") from err
    return call


def _dense(t):
    x, w1, w2, _, ids = t
    e, inter = w1.shape[0], w1.shape[1] // 2
    rows = max(1, ids.numel() // e)  # the mean rows an expert
    a = torch.randn(rows, x.shape[1], device=x.device, dtype=x.dtype)
    w1t, w2t = [w1[i].t() for i in range(e)], [w2[i].t() for i in range(e)]

    def call():
        for i in range(e):
            gate_up = a @ w1t[i]
            (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2t[i]

    return call


def _providers() -> list[Provider]:
    return [
        Provider("flydsl", lambda t: lambda: fused_moe(*t), is_ours=True),
        Provider("torch", _torch_loop),
        Provider("torch._grouped_mm", _grouped_mm),
        Provider("dense", _dense, check=False),
    ]


def _reference(t):
    x, w1, w2, w, ids = t
    return fused_moe_ref(x, w1, w2, w, ids)


def _sweep(tokens_lo: int, tokens_hi: int, models):
    def sweep(rng: random.Random, count: int) -> list[Case]:
        cases, seen = [], set()
        while len(cases) < count:
            model = rng.choice(sorted(models))
            tokens = log_uniform(rng, tokens_lo, tokens_hi)
            if rng.random() < 0.5:
                tokens |= 1  # odd counts: partial blocks everywhere
            if (model, tokens) in seen:
                if len(seen) >= len(models) * (tokens_hi - tokens_lo + 1):
                    break
                continue
            seen.add((model, tokens))
            cases.append(_case(model, models[model], tokens, seed=rng.randrange(1 << 30)))
        return cases

    return sweep


def _bench(name: str, tokens: Sequence[int], decode: bool, models, sweep_range, sweep_models) -> Bench:
    return Bench(
        name=name,
        cases=[_case(m, spec, t) for m, spec in models.items() for t in tokens],
        quick_cases=[_case(QUICK_MODEL[0], QUICK_MODEL[1], 8 if decode else 24)],
        setup=_setup,
        providers=_providers(),
        bytes=_bytes if decode else None,
        flops=_flops,
        reference=_reference,
        tolerance=1e-2,
        x_param="tokens",
        group_by=("model",),
        description="fused MoE, bf16, SiLU: "
        + ("bytes: routed experts' weights + x + out" if decode else "6 T k H I flops"),  # fmt: skip
        sweep=_sweep(*sweep_range, sweep_models),
        timings=("gpu", "call"),
    )


# ------------------------------------------------------------------ fp8 block-scaled

FP8_BLOCK = [128, 128]  # DeepSeek-V3's weight blocks (activations in 1 x 128 groups)
# the bound of the fp8 layer against the unquantized one (four e4m3 roundings: x, W1, the intermediate, W2;
# each <= 2**-4 / sqrt(3) ~ 3.6% rms, ~7% together; twice that), as tests/test_moe_quant.py argues it
_FP8_TOLERANCE = 0.15


def _quantize_blocks(w: torch.Tensor):
    """(fp8 e4m3 q, fp32 scales [E, cdiv(N, 128), cdiv(K, 128)]) of bf16 weights [E, N, K], an expert at a
    time (DeepSeek-V3's w1 in fp32 at once would be 30 GB)."""
    e, n, k = w.shape
    bn, bk = FP8_BLOCK
    gn, gk = -(-n // bn), -(-k // bk)
    q = torch.empty(e, n, k, device=w.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(e, gn, gk, device=w.device, dtype=torch.float32)
    for i in range(e):
        padded = torch.zeros(gn * bn, gk * bk, device=w.device, dtype=torch.float32)
        padded[:n, :k] = w[i]
        s = padded.view(gn, bn, gk, bk).abs().amax((1, 3)) / 448.0
        full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        q[i] = (w[i].float() / torch.where(full > 0, full, torch.ones_like(full))).clamp(-448.0, 448.0)
        scale[i] = s
    return q, scale


def _setup_fp8(case: Case, device):
    """The bf16 layer of :func:`_setup` and its block-scaled fp8 copy: (bf16 inputs, fp8 inputs)."""
    x, w1, w2, w, ids = _setup(case, device)
    q1, s1 = _quantize_blocks(w1)
    q2, s2 = _quantize_blocks(w2)
    return (x, w1, w2, w, ids), (x, q1, q2, w, ids, s1, s2)


def _fused_fp8(t):
    x, q1, q2, w, ids, s1, s2 = t[1]
    return lambda: fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=FP8_BLOCK)


def _quantized_bench(name, tokens, quick_tokens, setup, providers, tolerance, description, models, bytes_=None):
    """A quantized layer's bench: the models at ``tokens``, inputs ``(bf16 layer, quantized layer)`` from
    ``setup``, ``providers`` (ours first, then our bf16 layer and the like), ``6 T k H I`` flops (and
    ``bytes_``), checked against the unquantized fp32 layer within ``tolerance``."""
    models = MODELS if models is None else models
    return Bench(
        name=name,
        cases=[_case(m, spec, t) for m, spec in models.items() for t in tokens],
        quick_cases=[_case(QUICK_MODEL[0], QUICK_MODEL[1], quick_tokens)],
        setup=setup,
        providers=[*providers, Provider("flydsl.bf16", lambda t: lambda: fused_moe(*t[0]))],
        bytes=bytes_,
        flops=_flops,
        reference=lambda t: fused_moe_ref(*t[0]),
        tolerance=tolerance,
        x_param="tokens",
        group_by=("model",),
        description=description,
        timings=("gpu", "call"),
    )


def fp8_bench(models: dict | None = None) -> Bench:
    """``moe_fp8``: DeepSeek-V3's block-scaled fp8 experts (``fused_moe`` with ``block_shape=[128, 128]``)
    against our bf16 layer of the same weights (the issue's bar: >= 1.6x at >= 4096 tokens), tokens
    1024-16384, ``6 T k H I`` flops; checked against the unquantized fp32 layer within the fp8 bound."""
    ours = Provider("flydsl", _fused_fp8, is_ours=True)
    return _quantized_bench("moe_fp8", _TOKENS_LARGE, 24, _setup_fp8, [ours], _FP8_TOLERANCE,
                            "fused MoE, fp8 e4m3 128 x 128 block-scaled weights vs our bf16, SiLU: 6 T k H I flops",
                            models)  # fmt: skip


# ------------------------------------------------------------------ MXFP4 (weight-only at decode; w4a8)

MXFP4_GROUP = 32  # the MX format's block: an e8m0 scale a 32 values along K
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
# e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: the midpoints between neighbours (a tie goes to the lower code)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# the bound of the MXFP4 layer against the unquantized one (tests/test_moe_quant.py's argument: ~13% rms a
# factor for the three noisy ones, ~23% together, twice that)
_MXFP4_TOLERANCE = 0.45


def _quantize_mxfp4(w: torch.Tensor):
    """(uint8 fp4 e2m1 pairs [E, N, K / 2], e8m0 scales [E, N, K / 32]) of weights [E, N, K] (K a multiple of
    32), an expert at a time: a power-of-two scale a group, the smallest with 6 x scale >= the group's amax,
    each value rounded to the nearest e2m1 code."""
    e, n, k = w.shape
    q = torch.empty(e, n, k // 2, device=w.device, dtype=torch.uint8)
    scale = torch.empty(e, n, k // MXFP4_GROUP, device=w.device, dtype=_E8M0)
    mids = torch.tensor(_FP4_MIDPOINTS, device=w.device)
    for i in range(e):
        g = w[i].float().view(n, k // MXFP4_GROUP, MXFP4_GROUP)
        exp = torch.ceil(torch.log2(torch.clamp(g.abs().amax(-1), min=2.0**-100) / 6.0)).clamp(-126, 127)
        v = g / torch.exp2(exp)[..., None]
        code = (torch.bucketize(v.abs(), mids) | ((v < 0).long() << 3)).view(n, k)
        q[i] = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
        scale[i] = torch.exp2(exp).to(_E8M0)
    return q, scale


def _setup_mxfp4(case: Case, device):
    """The bf16 layer of :func:`_setup` and its MXFP4 copy: (bf16 inputs, MXFP4 inputs)."""
    if _E8M0 is None:
        raise Skip("this torch has no float8_e8m0fnu (MXFP4's scales)")
    x, w1, w2, w, ids = _setup(case, device)
    q1, s1 = _quantize_mxfp4(w1)
    q2, s2 = _quantize_mxfp4(w2)
    return (x, w1, w2, w, ids), (x, q1, q2, w, ids, s1, s2)


def _fused_mxfp4(compute_dtype=None):
    def make(t):
        x, q1, q2, w, ids, s1, s2 = t[1]
        return lambda: fused_moe(x, q1, q2, w, ids, w1_scale=s1, w2_scale=s2, block_shape=[1, MXFP4_GROUP],
                                 compute_dtype=compute_dtype)  # fmt: skip

    return make


def _bytes_mxfp4(case: Case) -> int:
    """Each routed expert's MXFP4 weights (half a byte a value, a scale byte a 32) read once, x read and the
    output written once (bf16)."""
    _, _, h, inter, t = _shape(case)
    touched = int(torch.unique(routing(case)[1]).numel())
    return touched * 3 * h * inter * (MXFP4_GROUP // 2 + 1) // MXFP4_GROUP + 2 * 2 * t * h


def mxfp4_decode_bench(models: dict | None = None) -> Bench:
    """``moe_mxfp4_decode``: MXFP4 experts (weight-only: each tile dequantized to bf16 in the kernel) against
    our bf16 layer of the same weights at decode, tokens 1-64 (the issue's bar: >= 3x, a quarter of the
    bytes); bytes of the MXFP4 weights read; checked against the unquantized fp32 layer within the MXFP4
    bound."""
    return _quantized_bench("moe_mxfp4_decode", _TOKENS_DECODE, 8, _setup_mxfp4,
                            [Provider("flydsl", _fused_mxfp4(), is_ours=True)], _MXFP4_TOLERANCE,
                            "fused MoE at decode, MXFP4 weights (weight-only) vs our bf16, SiLU: bytes of the routed "
                            "experts' MXFP4 weights + x + out", models, bytes_=_bytes_mxfp4)  # fmt: skip


def w4a8_bench(models: dict | None = None) -> Bench:
    """``moe_w4a8``: MXFP4 experts with fp8 activations (``compute_dtype=torch.float8_e4m3fn``: the codes in
    an fp8 dot) against the weight-only MXFP4 layer and our bf16 layer of the same weights, tokens
    1024-16384, ``6 T k H I`` flops; checked against the unquantized fp32 layer within the MXFP4 bound."""
    providers = [Provider("flydsl", _fused_mxfp4(torch.float8_e4m3fn), is_ours=True),
                 Provider("flydsl.mxfp4", _fused_mxfp4())]  # fmt: skip
    return _quantized_bench("moe_w4a8", _TOKENS_LARGE, 24, _setup_mxfp4, providers, _MXFP4_TOLERANCE,
                            "fused MoE, MXFP4 weights with fp8 activations vs weight-only MXFP4 and our bf16, SiLU: "
                            "6 T k H I flops", models)  # fmt: skip


# ------------------------------------------------------------------ grouped_gemm (training)

_TOKENS_TRAIN = (4096, 16384)


def _grouped_case(model: str, spec, tokens: int, proj: str) -> Case:
    case = _case(model, spec, tokens)
    return Case(f"{model}/{proj}/T{tokens}", {**case.params, "proj": proj})


def _grouped_shape(case: Case):
    """(rows M, N, K, groups) of a case: the routed rows, and the gate/up projection ([E, 2I, H]) or the
    down one ([E, H, I])."""
    e, k, h, inter, t = _shape(case)
    n, kk = (2 * inter, h) if case.params["proj"] == "w1" else (h, inter)
    return t * k, n, kk, e


def _setup_grouped(case: Case, device):
    """(a [M, K], b [E, N, K], offsets int32 [E], dy [M, N]) in bf16: the case's routed rows grouped by expert
    (the routing's per-expert counts), unit-scale values."""
    m, n, kk, e = _grouped_shape(case)
    counts = torch.bincount(routing(case)[1].reshape(-1).long(), minlength=e)
    offsets = counts.cumsum(0).to(torch.int32).to(device)
    g = torch.Generator(device=device).manual_seed(case.params.get("seed", 0) + 2)
    a = torch.randn(m, kk, device=device, generator=g, dtype=_BF16)
    b = torch.empty(e, n, kk, device=device, dtype=_BF16)
    for i in range(e):
        b[i].normal_(0.0, kk**-0.5, generator=g)
    dy = torch.randn(m, n, device=device, generator=g, dtype=_BF16)
    return a, b, offsets, dy


def _grouped_ours(t):
    a, b, offsets, _ = t
    return lambda: grouped_gemm(a, b, offsets)


def _need_grouped_mm(a) -> None:
    if a.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        raise Skip("torch._grouped_mm needs CUDA (sm_90+) and a torch that has it")


def _torch_grouped_forward(a, b, offsets):
    """``torch._grouped_mm`` on our operands (its B is [G, K, N]: b's transposed view, no copy)."""
    _need_grouped_mm(a)
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)


def _grouped_torch(t):
    a, b, offsets, _ = t
    _need_grouped_mm(a)
    return lambda: _torch_grouped_forward(a, b, offsets)


def _grouped_step(forward):
    """A training step: fresh leaves of a and b (gradients cleared), the forward, backward with the case's
    upstream gradient (dA and dB filled). Run once here, so a lazy compile stays out of the timing."""

    def make(t):
        a, b, offsets, dy = t
        al, bl = a.detach().requires_grad_(), b.detach().requires_grad_()

        def step() -> None:
            al.grad = bl.grad = None
            forward(al, bl, offsets).backward(dy)

        try:
            step()
        except (RuntimeError, NotImplementedError) as e:  # a peer without a backward
            raise Skip(f"no backward: {str(e).strip().splitlines()[0][:120]}") from e
        return step

    return make


def _grouped_flops(case: Case) -> int:
    m, n, kk, _ = _grouped_shape(case)
    return 2 * m * n * kk


def grouped_gemm_bench(models: dict | None = None) -> Bench:
    """``grouped_gemm``: :func:`fly_gemm.grouped_gemm` on the models' routed rows (tokens 4096 and 16384 x
    top-k, grouped by expert as their routing falls), the gate/up projection (N = 2I, K = H) and the down one
    (N = H, K = I), forward (``gpu`` / ``call``) and forward + backward (``step``: dA and dB) against
    ``torch._grouped_mm`` (the issue's bar: >= 1.1x on the same groups); ``2 M N K`` flops (the forward's)."""
    models = MODELS if models is None else models
    return Bench(
        name="grouped_gemm",
        cases=[_grouped_case(m, spec, t, proj) for m, spec in models.items() for t in _TOKENS_TRAIN
               for proj in ("w1", "w2")],  # fmt: skip
        quick_cases=[_grouped_case(QUICK_MODEL[0], QUICK_MODEL[1], 24, "w1")],
        setup=_setup_grouped,
        providers=[
            Provider("flydsl", _grouped_ours, is_ours=True, step=_grouped_step(grouped_gemm)),
            Provider("torch._grouped_mm", _grouped_torch, step=_grouped_step(_torch_grouped_forward)),
        ],
        flops=_grouped_flops,
        reference=lambda t: grouped_gemm_ref(t[0], t[1], t[2]),
        tolerance=1e-2,
        x_param="tokens",
        group_by=("model", "proj"),
        description="grouped GEMM of routed rows, bf16: 2 M N K flops (forward); step = forward + dA + dB",
        timings=("gpu", "call", "step"),
    )


def benches(models: dict | None = None, *, interpreter: bool = False) -> list[Bench]:
    """The MoE benches: ``moe_bf16`` (tokens 1024-16384) and ``moe_bf16_decode`` (tokens 1-64) over
    ``models`` (default :data:`MODELS`); their sweeps draw a model and a token count (odd half the time).
    ``interpreter``: the sweeps draw the quick model at up to 24 tokens (sizes the CPU runs in seconds).
    Then ``moe_fp8``, ``moe_mxfp4_decode``, ``moe_w4a8`` and ``grouped_gemm`` (no sweeps)."""
    models = MODELS if models is None else models
    if interpreter:
        large, decode, drawn = (17, 24), (1, 16), dict([QUICK_MODEL])
    else:
        large, decode, drawn = (65, 16384), (1, 64), models
    return [
        _bench("moe_bf16", _TOKENS_LARGE, False, models, large, drawn),
        _bench("moe_bf16_decode", _TOKENS_DECODE, True, models, decode, drawn),
        fp8_bench(models),
        mxfp4_decode_bench(models),
        w4a8_bench(models),
        grouped_gemm_bench(models),
    ]
