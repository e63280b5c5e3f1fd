"""The TMA forward (``AttnConfig(tma=True)``, ``_kernels/flash_fwd_tma.py``) against the fp32 reference: every
option of the 16-bit forward, dense and varlen, in each of its two forms (descriptor loads; the output
stored through a descriptor too).

CPU runs go through Triton's interpreter, which runs device-side tensor descriptors (out-of-shape rows and
columns read as zeros, stores clipped): the pointer kernel is made to fail in these tests, so a pass is the
TMA kernel's. Outputs are allocated poisoned (NaN) by conftest. ``gpu`` tests run every
``tma_candidates`` config at the sizes the issue names; the sm_90 compile test needs no GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attn_helpers import check_lse, rand_qkv
from test_flash_fwd import CASES, _case_id
from test_flash_varlen import CASES as VARLEN_CASES
from test_flash_varlen import _packed
from test_flash_varlen import _run as run_varlen

import flydsl.arch
from fly_attention import AttnConfig, flash_attn, flash_attn_ref
from fly_attention import attention as attn_mod
from fly_attention.autotune import config_valid, default_config, smem_bytes, tma_candidates
from flydsl.errors import ArgumentError
from flydsl.testing import assert_rel_close, tolerance
from flydsl.testing.sm90 import run_compile_script

# The three forms of the kernel: on the CPU at the interpreter's tiles (small: it executes every element), on a
# GPU at tiles sm_90 takes (warp specialisation wants 4 warps a group and 128 query rows).
_BASE = AttnConfig(32, 16, num_warps=4, num_stages=1, tma=True)
FORMS = {
    "loads": _BASE,
    "store": dataclasses.replace(_BASE, tma_store=True),
}
_GPU_BASE = AttnConfig(128, 64, num_warps=8, num_stages=2, tma=True)
GPU_FORMS = {
    "loads": _GPU_BASE,
    "store": dataclasses.replace(_GPU_BASE, tma_store=True),
}


def _fail(kernel):
    def launch(*args, **kwargs):
        raise AssertionError(f"the {kernel} kernel ran where the other should have")

    return launch


def _use(monkeypatch, cfg, pointer_ok=False):
    """Every forward call takes ``cfg``; the pointer kernel fails unless ``pointer_ok``."""
    monkeypatch.setattr(attn_mod, "_config_for", lambda *key: cfg)
    if not pointer_ok:
        monkeypatch.setattr(attn_mod, "launch_flash_fwd", _fail("pointer"))


@pytest.fixture(params=list(FORMS))
def form(request, monkeypatch, device):
    forms = FORMS if torch.device(device).type == "cpu" else GPU_FORMS
    _use(monkeypatch, forms[request.param])
    return request.param


def run_and_check(q, k, v, dtype=None, **opts):
    out, lse = flash_attn(q, k, v, return_lse=True, **opts)
    ref, ref_lse = flash_attn_ref(q, k, v, return_lse=True, **opts)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in the output"
    assert_rel_close(out, ref.to(out.device), tol=tolerance(dtype or q.dtype))
    check_lse(lse, ref_lse)
    return out, lse


# ---------------------------------------------------------------- CPU (interpreter) and GPU: every option


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp16_against_reference(device, form, case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    run_and_check(*rand_qkv(b, sq, sk, hq, hkv, d, dv, device=device), **opts)


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 5, 9, 13, 18, 22)], ids=_case_id)
def test_bf16_against_reference(device, form, case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    run_and_check(*rand_qkv(b, sq, sk, hq, hkv, d, dv, dtype=torch.bfloat16, device=device), **opts)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[0]}x{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-{c[5]}")
def test_varlen_against_reference(device, form, case):
    """Empty and length-1 sequences, per-sequence causal alignment: each program's descriptors start at its
    sequence's first token, and the programs past a short sequence's end store nothing."""
    lens_q, lens_k, hq, hkv, d, opts = case
    run_varlen(*_packed(lens_q, lens_k, hq, hkv, d, device=device), **opts)


def test_rows_that_see_no_key_give_zero_and_minus_inf(device, form):
    q, k, v = rand_qkv(1, 50, 10, 2, 2, 64, device=device)
    out, lse = run_and_check(q, k, v, causal=True)
    assert torch.equal(out[:, :40].float().cpu(), torch.zeros(1, 40, 2, 64))
    assert torch.isneginf(lse[:, :, :40]).all() and torch.isfinite(lse[:, :, 40:]).all()


def test_transposed_and_sliced_layouts_are_read_in_place(device, form):
    """``[B, H, S, D]`` storage through ``.transpose(1, 2)`` and heads sliced out of a wider tensor: strides the
    descriptors describe (16-byte multiples), read by the TMA kernel without a copy."""
    b, s, hq, hkv, d = 2, 37, 4, 2, 64
    g = torch.Generator().manual_seed(3)
    q_bhsd = torch.randn(b, hq, s, d, generator=g).half().to(device)
    k_wide = torch.randn(b, s, 2 * hkv, d, generator=g).half().to(device)
    v_bhsd = torch.randn(b, hkv, s, d, generator=g).half().to(device)
    q, k, v = q_bhsd.transpose(1, 2), k_wide[:, :, 1::2], v_bhsd.transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = run_and_check(q, k, v, causal=True)[0]
    assert_rel_close(out, flash_attn(q.contiguous(), k.contiguous(), v.contiguous(), causal=True), tol=1e-6)


def test_padded_head_dim_ignores_the_next_heads_columns(device, form):
    """Head dim 80 padded to 128 in the tiles: the descriptor's shape stops at 80, so the columns of the next
    head (here huge) never enter the scores or the output."""
    q, k, v = rand_qkv(1, 40, 40, 2, 2, 80, device=device, seed=9)
    k_wide = torch.full((1, 40, 2, 96), 1e4, dtype=k.dtype, device=device)
    k_wide[..., :80] = k
    v_wide = torch.full((1, 40, 2, 96), 1e4, dtype=v.dtype, device=device)
    v_wide[..., :80] = v
    run_and_check(q, k_wide[..., :80], v_wide[..., :80], causal=True)


# ---------------------------------------------------------------- layouts TMA cannot address


@pytest.mark.parametrize("what", ["row stride", "base address"])
def test_misaligned_layouts_run_the_pointer_kernel(device, monkeypatch, what):
    """A token stride that is not a multiple of 16 bytes, or a base that is not 16-byte aligned: a descriptor
    would read wrong data without an error, so these take the pointer kernel (same tiles), never the TMA one."""
    _use(monkeypatch, _BASE if torch.device(device).type == "cpu" else _GPU_BASE, pointer_ok=True)
    monkeypatch.setattr(attn_mod, "launch_flash_fwd_tma", _fail("TMA"))
    q, k, v = rand_qkv(1, 33, 33, 2, 2, 64, device=device, seed=5)
    if what == "row stride":  # k's tokens 2 * 64 + 3 elements apart
        wide = torch.zeros(1, 33, 2 * 64 + 3, dtype=k.dtype, device=device)
        wide[..., : 2 * 64] = k.reshape(1, 33, 128)
        k = wide[..., : 2 * 64].unflatten(-1, (2, 64))
    else:  # q one element past an aligned base
        flat = torch.zeros(q.numel() + 1, dtype=q.dtype, device=device)
        flat[1:] = q.flatten()
        q = flat[1:].view(q.shape)
    assert not attn_mod.tma_addressable(q, k, v)
    run_and_check(q, k, v, causal=True)


# ---------------------------------------------------------------- the configs


def test_tma_configs_are_refused_where_the_kernel_cannot_run():
    sm90, sm80 = flydsl.arch.SM90, dataclasses.replace(flydsl.arch.SM90, name="sm_80", capability=(8, 0))
    cfg = AttnConfig(128, 64, num_warps=8, num_stages=3, tma=True)
    assert config_valid(cfg, 128, 128, torch.bfloat16, sm90)
    assert config_valid(cfg, 80, 48, torch.float16, sm90)
    assert not config_valid(cfg, 128, 128, torch.bfloat16, sm80)  # no TMA before sm_90
    assert not config_valid(cfg, 128, 128, torch.float8_e4m3fn, sm90)  # 16-bit only
    assert not config_valid(cfg, 36, 36, torch.bfloat16, sm90)  # rows not whole 16-byte units
    assert not config_valid(cfg, 64, 36, torch.bfloat16, sm90)
    # the descriptor store is the TMA kernel's option
    assert not config_valid(AttnConfig(128, 64, num_warps=4, tma_store=True), 128, 128, torch.bfloat16, sm90)
    assert not config_valid(AttnConfig(128, 128, num_warps=8, num_stages=4, tma=True), 128, 128, torch.bfloat16,
                            sm90)  # shared memory  # fmt: skip


def test_an_invalid_tma_config_is_named(device):
    q, k, v = rand_qkv(1, 8, 8, 2, 2, 36, device=device)
    with pytest.raises(ArgumentError, match="^config: .*tma=True.* is not a valid launch config"):
        attn_mod._flash_attn(q, k, v, False, None, -1, -1, 0.0, False, _BASE)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 192, 256])
def test_tma_candidates(d):
    """A handful a head dim, each valid for sm_90 and a TMA config; both tile shapes where shared memory has
    room for them, with and without the descriptor store; nothing for fp8 or a GPU without TMA."""
    cands = tma_candidates(d, torch.bfloat16, flydsl.arch.SM90)
    assert 2 <= len(cands) <= 16 and len(set(cands)) == len(cands)
    assert all(c.tma and config_valid(c, d, d, torch.bfloat16, flydsl.arch.SM90) for c in cands)
    assert any(c.tma_store for c in cands) and any(not c.tma_store for c in cands)
    if d <= 128:
        assert {c.block_n for c in cands} == {64, 128}
    assert tma_candidates(d, torch.float8_e4m3fn, flydsl.arch.SM90) == []
    sm80 = dataclasses.replace(flydsl.arch.SM90, name="sm_80", capability=(8, 0))
    assert tma_candidates(d, torch.bfloat16, sm80) == []


def test_the_default_takes_tma_where_it_was_measured_faster():
    """On sm_90 the 16-bit default is the TMA kernel above head dim 64 (measured faster there; even at 64), with
    128 query rows; never for decode-like queries (small-row TMA tiles never ran on a GPU), fp8, head dims
    TMA cannot take, a GPU without TMA or the interpreter."""
    sm90, sm80 = flydsl.arch.SM90, dataclasses.replace(flydsl.arch.SM90, name="sm_80", capability=(8, 0))
    for d, tma in ((64, False), (80, True), (128, True), (192, True), (256, True)):
        cfg = default_config(d, d, 4096, 4096, True, torch.bfloat16, sm90)
        assert cfg.tma == tma and cfg.block_m == 128 and config_valid(cfg, d, d, torch.bfloat16, sm90), (d, cfg)
        assert not default_config(d, d, 4096, 4096, True, torch.bfloat16, sm80).tma
        assert not default_config(d, d, 4096, 4096, True, torch.bfloat16, flydsl.arch.INTERPRETER).tma
        assert not default_config(d, d, 64, 4096, True, torch.bfloat16, sm90).tma
        assert not default_config(d, d, 4096, 4096, True, torch.float8_e4m3fn, sm90).tma
    assert not default_config(100, 100, 4096, 4096, False, torch.float16, sm90).tma  # rows of 200 bytes
    assert default_config(192, 128, 4096, 4096, False, torch.float16, sm90).tma


# ---------------------------------------------------------------- the kernel compiles for the H200


def test_tma_kernel_compiles_for_sm90_with_tma_wgmma_and_no_spill():
    """Each variant of attn_tma_compile_sm90.py (every candidate) compiles for sm_90 in a process of its own
    (two in parallel): K / V / Q moved by ``cp.async.bulk.tensor``, both dots as wgmma, no stack (a register
    spill); and ``smem_bytes`` bounds the shared memory each takes."""
    import re
    from pathlib import Path

    from attn_tma_compile_sm90 import variants

    out = run_compile_script(Path(__file__).with_name("attn_tma_compile_sm90.py"), shards=2, timeout=900)
    lines = sorted((ln for ln in out if ln.startswith(("ok", "FAIL"))), key=lambda ln: int(ln.split()[1]))
    cases = variants()
    assert len(lines) == len(cases) and all(ln.startswith("ok") for ln in lines), "\n".join(lines)
    for line, ((d, dv), cfg, _) in zip(lines, cases, strict=True):
        m = re.search(r" (\d+) REG:(\d+) STACK:(\d+) (\S+)$", line)
        assert m, line
        shared, stack, marks = int(m.group(1)), int(m.group(3)), m.group(4).split(",")
        assert stack == 0, line
        assert "tma" in marks and "wgmma" in marks, line
        assert shared <= smem_bytes(cfg, d, dv, torch.bfloat16), line


# ---------------------------------------------------------------- GPU: every candidate at the sizes


def _candidates(d):
    return tma_candidates(d, torch.bfloat16, flydsl.arch.SM90)


_GPU_CANDIDATES = [(d, c) for d in (64, 128, 256) for c in _candidates(d)]


def _cand_id(dc):
    d, c = dc
    tiles = f"{c.block_m}x{c.block_n}-w{c.num_warps}-s{c.num_stages}"
    return f"d{d}-{tiles}-store{int(c.tma_store)}"


@pytest.mark.gpu
@pytest.mark.parametrize("dc", _GPU_CANDIDATES, ids=_cand_id)
def test_gpu_candidates_against_reference(device, monkeypatch, dc):
    d, cfg = dc
    _use(monkeypatch, cfg)
    for b, sq, sk, hq, hkv, opts in [
        (2, 1000, 1000, 8, 2, {}),
        (2, 1000, 1000, 8, 2, {"causal": True}),
        (2, 4097, 1000, 4, 4, {"causal": True}),  # rows that see no key
        (2, 1000, 4097, 8, 1, {"causal": True}),
        (1, 1, 4097, 4, 4, {}),
        (2, 1000, 1500, 8, 2, {"window": (100, 300), "softcap": 5.0}),
    ]:
        run_and_check(*rand_qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, device=device), **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dc", [dc for dc in _GPU_CANDIDATES if dc[0] == 128], ids=_cand_id)
def test_gpu_candidates_layouts_and_varlen(device, monkeypatch, dc):
    """The ``[B, H, S, D]`` storage through a transpose, a value head dim of its own (192 / 128 with the d 128
    tiles where valid), fp16, and packed sequences."""
    _, cfg = dc
    _use(monkeypatch, cfg)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in rand_qkv(2, 1000, 1000, 8, 8, 128, dtype=torch.bfloat16, device=device))  # fmt: skip
    run_and_check(q, k, v, causal=True)
    run_and_check(*rand_qkv(2, 777, 777, 8, 2, 128, dtype=torch.float16, device=device), causal=True)
    if config_valid(cfg, 192, 128, torch.bfloat16, flydsl.arch.current(torch.device(device))):
        run_and_check(*rand_qkv(2, 700, 900, 8, 2, 192, 128, dtype=torch.bfloat16, device=device), causal=True)
    lens = [1000, 0, 1, 517, 2048]
    run_varlen(*_packed(lens, lens, 8, 2, 128, dtype=torch.bfloat16, device=device), causal=True)
