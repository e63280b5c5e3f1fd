"""Registration of fly-attention with the ``flydsl`` CLI (entry point ``flydsl.families: attention``).

Cheap to import: kernels are imported inside the callables.
"""

from __future__ import annotations

from flydsl.families import DemoCase, DemoRun, Family

from ._version import __version__


def _sdpa_bshd(q, k, v, causal):
    """torch's SDPA on [B, S, H, D] tensors (what a user calls instead), GQA through enable_gqa."""
    import torch.nn.functional as F

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa).transpose(1, 2)


def _flash_case(device) -> DemoRun:
    import torch

    from .attention import flash_attn
    from .reference import flash_attn_ref

    gpu = device.type == "cuda"
    b, s, hq, hkv, d = (4, 4096, 32, 8, 128) if gpu else (1, 48, 4, 2, 64)
    dt = torch.bfloat16
    q = torch.randn(b, s, hq, d, device=device, dtype=dt)
    k, v = (torch.randn(b, s, hkv, d, device=device, dtype=dt) for _ in range(2))
    return DemoRun(lambda: flash_attn(q, k, v, causal=True),
                   lambda: flash_attn_ref(q, k, v, causal=True),
                   lambda: _sdpa_bshd(q, k, v, True), "F.scaled_dot_product_attention", 2e-2)  # fmt: skip


def _varlen_case(device) -> DemoRun:
    import torch

    from .attention import flash_attn_varlen
    from .reference import flash_attn_varlen_ref

    gpu = device.type == "cuda"
    lens = [1000, 1, 3000, 0, 517] if gpu else [17, 1, 30, 0, 5]
    h, d = (16, 128) if gpu else (2, 64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    dt = torch.bfloat16
    q, k, v = (torch.randn(sum(lens), h, d, device=device, dtype=dt) for _ in range(3))
    m = max(lens)

    def per_sequence():  # what a user without a varlen kernel writes: SDPA a sequence at a time
        outs = [_sdpa_bshd(q[a:z][None], k[a:z][None], v[a:z][None], True)[0]
                for a, z in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True) if z > a]  # fmt: skip
        return torch.cat(outs)

    return DemoRun(lambda: flash_attn_varlen(q, k, v, cu, cu, m, m, causal=True),
                   lambda: flash_attn_varlen_ref(q, k, v, cu, cu, causal=True),
                   per_sequence, "SDPA per sequence", 2e-2)  # fmt: skip


def _tunables():
    from .autotune import BWD_TUNABLE, FWD_TUNABLE

    return [FWD_TUNABLE, BWD_TUNABLE]


def _demo_cases():
    return [DemoCase("flash_attn causal GQA", _flash_case), DemoCase("flash_attn_varlen causal", _varlen_case)]


def _bench(argv) -> int:
    from .bench import main

    return main(list(argv))


FAMILY = Family(
    name="attention",
    distribution="fly-attention",
    module="fly_attention",
    version=__version__,
    description="flash attention forward (dense, varlen; GQA, causal, window, softcap); decode and paged KV to come",
    tunables=_tunables,
    demo_cases=_demo_cases,
    bench=_bench,
)
