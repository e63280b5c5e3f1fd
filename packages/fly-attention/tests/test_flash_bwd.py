"""The backward of flash_attn / flash_attn_varlen: dq, dk, dv against fp64 autograd of the torch-ops
reference on the same (fp16 / bf16) inputs, by relative error.

Every option and their combinations, GQA ratios (dK / dV summed over the group), sequence lengths both
ways off-square, padded head dims and a value head dim of its own, varlen with empty and length-1
sequences, rows that see no key (dq 0, no NaN anywhere), the transposed layout, torch.compile(fullgraph)
of forward + backward through the custom ops. Every gradient buffer is allocated poisoned (NaN, the
suite's ``_empty``), so an element the kernels should write and did not fails the comparison. CPU runs go
through Triton's interpreter at small shapes; ``gpu`` tests take the sizes the issue names.
"""

from __future__ import annotations

import pytest
import torch
from attn_helpers import rand_qkv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flydsl.arch
from fly_attention import attention as attn_mod
from fly_attention import flash_attn, flash_attn_ref, flash_attn_varlen, flash_attn_varlen_ref
from fly_attention.autotune import AttnBwdConfig, bwd_config_valid, default_bwd_config
from flydsl.errors import ArgumentError
from flydsl.testing import assert_rel_close, tolerance
from flydsl.testing.sm90 import run_compile_script


def _grad_tol(dtype):
    """The gradients' budget: the output's tolerance of the dtype. The kernels round P and dS to the input
    dtype for their dots (as the forward rounds P), so the gradients carry the same order of error."""
    return tolerance(dtype)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _check_grads(got, ref, dtype, names=("dq", "dk", "dv")):
    for g, r, name in zip(got, ref, names, strict=True):
        assert g is not None, f"{name}: no gradient"
        assert g.shape == r.shape and g.dtype == dtype, f"{name}: {g.shape} {g.dtype}"
        assert not torch.isnan(g).any(), f"{name}: NaN"
        if r.abs().max() == 0:  # e.g. dq of one key (softmax 1): 0 up to the rounding of O in delta
            assert g.abs().max() <= _grad_tol(dtype), f"{name}: expected ~0 (unit-scale inputs), got {g.abs().max()}"
        else:
            assert_rel_close(g, r.to(g.device), tol=_grad_tol(dtype), name=name)


def run_and_check(q, k, v, seed=7, **opts):
    """Forward + backward of flash_attn and of the fp64 reference from the same inputs and output gradient;
    returns the gradients and the output.

    The backward's inputs include the forward's output as stored, in the input dtype (flash attention's
    design, and that of torch's own backward of a 16-bit attention): its row terms ``delta = rowsum(dO * O)``
    come from the rounded O. Where ``dP - delta`` cancels (a row of a few keys), that rounding alone moves
    the exact gradient by more than the dtype's tolerance (fp16, 2 keys: 1.7e-3 from O's rounding, 2.3e-4
    from the kernel). So the reference is the exact fp64 gradient given that stored O: autograd's gradient
    with ``delta`` replaced, which adds ``-(delta_O16 - delta_O64) * lse`` to the loss (d lse / d s = P)."""
    qg, kg, vg = _leaves(q, k, v)
    out = flash_attn(qg, kg, vg, **opts)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    out.backward(dout)
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, lse = flash_attn_ref(qr, kr, vr, dtype=torch.float64, return_lse=True, **opts)
    d64 = dout.double()
    delta_shift = ((d64 * out.detach().double()).sum(-1) - (d64 * ref.detach()).sum(-1)).transpose(1, 2)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # rows that see no key: no term
    ((ref * d64).sum() - (delta_shift * lse).sum()).backward()
    _check_grads((qg.grad, kg.grad, vg.grad), (qr.grad, kr.grad, vr.grad), q.dtype)
    return (qg.grad, kg.grad, vg.grad), out


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, options)
CASES = [
    (1, 1, 1, 2, 2, 64, 64, {}),
    (2, 17, 17, 2, 2, 64, 64, {}),
    (1, 40, 40, 2, 2, 64, 64, {"causal": True}),
    (1, 17, 50, 2, 2, 64, 64, {"causal": True}),  # bottom-right: seqlen_q < seqlen_k
    (1, 50, 17, 2, 2, 64, 64, {"causal": True}),  # seqlen_q > seqlen_k: the first 33 rows see no key
    (1, 1, 45, 2, 2, 64, 64, {"causal": True}),
    # GQA 4:1 and MQA: dK / dV summed over the group
    (1, 33, 40, 8, 2, 64, 64, {"causal": True}),
    (2, 23, 23, 4, 1, 64, 64, {}),
    # padded head dims and a value head dim of its own
    (1, 33, 45, 2, 1, 80, 80, {}),
    (1, 29, 41, 2, 1, 80, 48, {"causal": True}),
    (1, 21, 21, 2, 2, 96, 64, {}),
    # windows, each side, both, with causal; one so narrow some rows see nothing
    (1, 70, 70, 2, 2, 64, 64, {"window": (16, -1)}),
    (1, 50, 77, 2, 1, 64, 64, {"window": (9, 20)}),
    (1, 77, 50, 2, 2, 64, 64, {"window": (7, 40), "causal": True}),
    (1, 60, 20, 2, 2, 64, 64, {"window": (0, 0)}),
    # softcap (its derivative), alone and with causal + window + GQA; an explicit scale
    (1, 45, 45, 2, 2, 64, 64, {"softcap": 2.0}),
    (2, 31, 50, 4, 2, 80, 80, {"softcap": 10.0, "causal": True, "window": (12, -1)}),
    (1, 36, 36, 2, 2, 64, 64, {"softmax_scale": 0.37, "causal": True}),
]


def _case_id(case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    tag = "-".join(f"{k}={v}" for k, v in opts.items())
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}/{dv}" + (f"-{tag}" if tag else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp16_gradients_against_fp64_autograd(device, case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    run_and_check(*rand_qkv(b, sq, sk, hq, hkv, d, dv, device=device, seed=sq + sk), **opts)


BF16_CASES = [CASES[i] for i in (1, 4, 6, 9, 13, 16)]


@pytest.mark.parametrize("case", BF16_CASES, ids=_case_id)
def test_bf16_gradients_against_fp64_autograd(device, case):
    b, sq, sk, hq, hkv, d, dv, opts = case
    run_and_check(*rand_qkv(b, sq, sk, hq, hkv, d, dv, dtype=torch.bfloat16, device=device, seed=sq + sk), **opts)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sq=st.integers(1, 60),
    sk=st.integers(1, 60),
    group=st.sampled_from([(2, 2), (4, 1), (4, 2)]),
    causal=st.booleans(),
    left=st.integers(-1, 30),
    right=st.integers(-1, 30),
    softcap=st.sampled_from([0.0, 3.0]),
)
def test_random_shapes_and_options(device, sq, sk, group, causal, left, right, softcap):
    """The block walks of both kernels (skipped, unmasked, edge blocks) at random lengths and windows."""
    q, k, v = rand_qkv(1, sq, sk, *group, 64, device=device, seed=sq * 131 + sk)
    run_and_check(q, k, v, causal=causal, window=(left, right), softcap=softcap)


def test_rows_that_see_no_key_get_zero_dq_and_no_nan(device):
    """seqlen_q > seqlen_k under causal: the first rows see no key (lse -inf): their dq is exactly 0 and no
    gradient holds a NaN (the -inf lse never meets a -inf score)."""
    q, k, v = rand_qkv(1, 40, 9, 2, 2, 64, device=device)
    (dq, dk, dv), _ = run_and_check(q, k, v, causal=True)
    assert (dq[:, :31] == 0).all() and (dq[:, 31:] != 0).any()
    # no key at all: dq 0, dk / dv empty
    q, k, v = _leaves(*rand_qkv(1, 5, 0, 2, 2, 64, device=device))
    flash_attn(q, k, v).sum().backward()
    assert (q.grad == 0).all() and k.grad.shape == k.shape


def test_transposed_layout(device):
    """``[B, H, S, D]`` storage seen through ``.transpose(1, 2)`` (and a strided output gradient): the
    gradients match the reference and those of contiguous inputs."""
    b, s, hq, hkv, d = 2, 37, 4, 2, 64
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in rand_qkv(b, s, s, hq, hkv, d, device=device))
    assert not q.is_contiguous()
    grads, _ = run_and_check(q, k, v, causal=True)
    qc, kc, vc = _leaves(q.contiguous(), k.contiguous(), v.contiguous())
    g = torch.Generator().manual_seed(7)
    flash_attn(qc, kc, vc, causal=True).backward(torch.randn(b, s, hq, d, generator=g).half().to(device))
    for got, want in zip(grads, (qc.grad, kc.grad, vc.grad), strict=True):
        assert torch.equal(got, want)
    # an output gradient that is not contiguous (its last stride is not 1) is read through a copy
    qg, kg, vg = _leaves(q, k, v)
    dout = torch.randn(b, s, hq, 2 * d, generator=g).half().to(device)[..., ::2]
    flash_attn(qg, kg, vg, causal=True).backward(dout)
    qc.grad = kc.grad = vc.grad = None
    flash_attn(qc, kc, vc, causal=True).backward(dout.contiguous())
    assert torch.equal(qg.grad, qc.grad) and torch.equal(kg.grad, kc.grad)


def test_return_lse_is_not_differentiable_and_deterministic_is_accepted(device):
    q, k, v = _leaves(*rand_qkv(1, 19, 19, 2, 2, 64, device=device))
    out, lse = flash_attn(q, k, v, causal=True, return_lse=True, deterministic=True)
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    first = (q.grad.clone(), k.grad.clone(), v.grad.clone())
    q.grad = k.grad = v.grad = None
    flash_attn(q, k, v, causal=True, deterministic=False).float().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(first, (q.grad, k.grad, v.grad), strict=True))
    with pytest.raises(ArgumentError, match="deterministic: expected a bool"):
        flash_attn(q, k, v, deterministic=1)


def test_only_the_inputs_that_need_it_get_a_gradient(device):
    q, k, v = rand_qkv(1, 24, 30, 4, 2, 64, device=device)
    kg = k.clone().requires_grad_(True)
    out = flash_attn(q, kg, v, causal=True)
    out.sum().backward()  # the output gradient arrives expanded (every stride 0): read through a copy
    assert kg.grad is not None and q.grad is None and v.grad is None
    kr = k.double().requires_grad_(True)
    flash_attn_ref(q.double(), kr, v.double(), causal=True, dtype=torch.float64).sum().backward()
    assert_rel_close(kg.grad, kr.grad, tol=_grad_tol(q.dtype))


@pytest.mark.parametrize(
    "cfg", [AttnBwdConfig(16, 16, 16, 16, num_stages=1), AttnBwdConfig(16, 64, 64, 16), AttnBwdConfig(32, 16, 16, 32)]
)
def test_backward_configs_agree(device, cfg):
    """Tile sizes change the block walks (skipped, unmasked, edge) but not the result."""
    q, k, v = rand_qkv(1, 75, 90, 4, 2, 80, device=device, seed=4)
    g = torch.Generator().manual_seed(1)
    for opts in ({"causal": True}, {"window": (20, 3)}, {"window": (-1, 10), "softcap": 5.0}):
        causal, window, softcap = opts.get("causal", False), opts.get("window", (-1, -1)), opts.get("softcap", 0.0)
        left, right = attn_mod._options(causal, None, window, softcap)
        out, lse = attn_mod._flash_attn(q, k, v, causal, None, left, right, softcap, True)
        dout = torch.randn(out.shape, generator=g).half().to(device)
        got = attn_mod._flash_attn_bwd(dout, q, k, v, out, lse, causal, None, left, right, softcap, cfg)
        qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
        flash_attn_ref(qr, kr, vr, dtype=torch.float64, **opts).backward(dout.double())
        _check_grads(got, (qr.grad, kr.grad, vr.grad), q.dtype)


def test_backward_config_default_and_predicate():
    arch = flydsl.arch.current(torch.device("cpu"))
    assert bwd_config_valid(default_bwd_config(64, 64, 128, 128, True, torch.float16, arch), 64, 64,
                            torch.float16, arch)  # fmt: skip
    assert not bwd_config_valid(AttnBwdConfig(24, 16, 16, 16), 64, 64, torch.float16, arch)  # not a power of 2
    assert not bwd_config_valid(AttnBwdConfig(16, 16, 16, 8), 64, 64, torch.float16, arch)  # under the dot's 16
    assert not bwd_config_valid(AttnBwdConfig(16, 16, 16, 16, num_warps=3), 64, 64, torch.float16, arch)
    huge = AttnBwdConfig(1024, 1024, 1024, 1024, num_stages=4)
    assert not bwd_config_valid(huge, 256, 256, torch.float16, arch)  # shared memory
    sm90 = flydsl.arch.SM90
    for d, dv in ((64, 64), (80, 80), (128, 128), (192, 128), (256, 256)):
        cfg = default_bwd_config(d, dv, 4096, 4096, True, torch.bfloat16, sm90)
        assert bwd_config_valid(cfg, d, dv, torch.bfloat16, sm90), (d, dv, cfg)
    # registers: 128 keys of fp32 dK + dV at head dim 256 do not fit one thread's share at 4 warps
    assert not bwd_config_valid(AttnBwdConfig(32, 128, 64, 32, num_warps=4, num_stages=1), 256, 256,
                                torch.bfloat16, sm90)  # fmt: skip


# ---------------------------------------------------------------- varlen


def _varlen_case(lens_q, lens_k, hq, hkv, d, dv, *, pad=(0, 0), dtype=torch.float16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32) + pad[0]
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32) + pad[0]
    tq, tk = int(cq[-1]) + pad[1], int(ck[-1]) + pad[1]
    q = torch.randn(tq, hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(tk, hkv, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(tk, hkv, dv, generator=g).to(device=device, dtype=dtype)
    return q, k, v, cq.to(device), ck.to(device)


@pytest.mark.parametrize(
    "lens_q,lens_k,heads,opts,pad",
    [
        ([5, 0, 1, 17], [5, 3, 1, 17], (2, 2), {"causal": True}, (0, 0)),
        ([9, 1, 20], [4, 12, 20], (4, 1), {"causal": True}, (2, 3)),  # tokens outside every sequence
        ([13, 0, 8], [0, 6, 30], (4, 2), {"window": (5, 2), "softcap": 4.0}, (0, 0)),
    ],
)
def test_varlen_gradients(device, lens_q, lens_k, heads, opts, pad):
    """Packed sequences (empty, length 1, seqlen_q > seqlen_k with causal): gradients against the fp64
    reference; tokens outside every sequence and keys no query sees get exactly 0."""
    q, k, v, cq, ck = _varlen_case(lens_q, lens_k, *heads, 64, 64, pad=pad, device=device, seed=len(lens_q))
    qg, kg, vg = _leaves(q, k, v)
    out = flash_attn_varlen(qg, kg, vg, cq, ck, max(lens_q), max(lens_k), **opts)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=out.dtype)
    out.backward(dout)
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    flash_attn_varlen_ref(qr, kr, vr, cq, ck, dtype=torch.float64, **opts).backward(dout.double())
    _check_grads((qg.grad, kg.grad, vg.grad), (qr.grad, kr.grad, vr.grad), q.dtype)
    if pad != (0, 0):
        assert (qg.grad[: pad[0]] == 0).all() and (qg.grad[q.shape[0] - pad[1] :] == 0).all()
        assert (kg.grad[: pad[0]] == 0).all() and (vg.grad[k.shape[0] - pad[1] :] == 0).all()


# ---------------------------------------------------------------- torch.compile through the custom ops


def test_forward_and_backward_under_torch_compile_fullgraph(device):
    """Traced through the custom ops (fake forward and backward, registered autograd), run: the same
    gradients as eager."""
    torch._dynamo.reset()
    q, k, v = rand_qkv(2, 19, 23, 4, 2, 64, device=device)

    def loss(q, k, v):
        return (flash_attn(q, k, v, causal=True, window=(7, -1)).float() ** 2).sum()

    qc, kc, vc = _leaves(q, k, v)
    torch.compile(loss, fullgraph=True, backend="aot_eager")(qc, kc, vc).backward()
    qe, ke, ve = _leaves(q, k, v)
    loss(qe, ke, ve).backward()
    for a, b in ((qc.grad, qe.grad), (kc.grad, ke.grad), (vc.grad, ve.grad)):
        assert_rel_close(a, b, tol=1e-6)

    q, k, v, cq, ck = _varlen_case([6, 1, 9], [6, 4, 9], 2, 2, 64, 64, device=device)

    def packed(q, k, v, cq, ck):
        return flash_attn_varlen(q, k, v, cq, ck, 9, 9, causal=True, softcap=3.0).float().sum()

    qc, kc, vc = _leaves(q, k, v)
    torch.compile(packed, fullgraph=True, backend="aot_eager")(qc, kc, vc, cq, ck).backward()
    qe, ke, ve = _leaves(q, k, v)
    packed(qe, ke, ve, cq, ck).backward()
    for a, b in ((qc.grad, qe.grad), (kc.grad, ke.grad), (vc.grad, ve.grad)):
        assert_rel_close(a, b, tol=1e-6)


def test_backward_ops_have_fake_implementations():
    meta = torch.device("meta")
    q = torch.empty(2, 7, 8, 192, dtype=torch.bfloat16, device=meta)
    k = torch.empty(2, 9, 2, 192, dtype=torch.bfloat16, device=meta)
    v = torch.empty(2, 9, 2, 128, dtype=torch.bfloat16, device=meta)
    out = torch.empty(2, 7, 8, 128, dtype=torch.bfloat16, device=meta)
    lse = torch.empty(2, 8, 7, dtype=torch.float32, device=meta)
    dq, dk, dv = torch.ops.fly_attention.flash_attn_bwd(out, q, k, v, out, lse, True, None, -1, 0, 0.0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.device == meta


# ---------------------------------------------------------------- the kernels compile for the H200


def test_backward_kernels_compile_for_sm90():
    """Triton's compiler (not the interpreter) takes the three kernels at each head-dim class's default for
    sm_90, options off and on, in a process of its own (the interpreter is chosen once per process)."""
    from pathlib import Path

    lines = run_compile_script(Path(__file__).with_name("attn_bwd_compile_sm90.py"))
    assert len(lines) == 15 and all(line.startswith("ok") for line in lines), "\n".join(lines)
    # The delta and dQ kernels stay within their registers (no stack). The dK / dV kernel of the d <= 128
    # default (64 keys held, 4 warps) spills 48-608 bytes, yet measured the fastest of ten configs on the H200
    # (300 TFLOP/s at d 128 against 95 for a spill-free one): a bound on its stack, not a ban.
    for line in lines:
        stack = int(line.rsplit("STACK:", 1)[1])
        assert stack == 0 or (" dkdv " in line and stack <= 1024), "\n".join(lines)


# ---------------------------------------------------------------- GPU: the sizes the issue names


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dims(device, d, dv, causal):
    run_and_check(*rand_qkv(2, 1000, 1000, 8, 2, d, dv, dtype=torch.bfloat16, device=device), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(4097, 4097), (1000, 4097), (4097, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_long_sequences(device, sq, sk, dtype):
    for heads, opts in (((4, 4), {}), ((8, 1), {"causal": True})):
        run_and_check(*rand_qkv(2, sq, sk, *heads, 128, dtype=dtype, device=device), **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{"window": (256, 0)}, {"softcap": 30.0, "causal": True}])
def test_gpu_window_and_softcap(device, opts):
    run_and_check(*rand_qkv(2, 1000, 1500, 8, 2, 128, dtype=torch.bfloat16, device=device), **opts)


@pytest.mark.gpu
def test_gpu_varlen(device):
    lens = [1, 0, 1000, 333, 4097]
    q, k, v, cq, ck = _varlen_case(lens, lens, 8, 2, 128, 128, dtype=torch.bfloat16, device=device)
    qg, kg, vg = _leaves(q, k, v)
    out = flash_attn_varlen(qg, kg, vg, cq, ck, max(lens), max(lens), causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    flash_attn_varlen_ref(qr, kr, vr, cq, ck, causal=True, dtype=torch.float64).backward(dout.double())
    _check_grads((qg.grad, kg.grad, vg.grad), (qr.grad, kr.grad, vr.grad), q.dtype)


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_cuda_graph_capture_of_forward_and_backward(device):
    """Forward + backward (dense and varlen) captured in one CUDA graph (no host sync inside), replayed on
    new inputs: the gradients of the new inputs."""
    q, k, v = _leaves(*rand_qkv(2, 300, 300, 8, 2, 128, dtype=torch.bfloat16, device=device))
    qv, kv, vv = _leaves(*(t.detach().reshape(-1, *t.shape[2:]) for t in (q, k, v)))
    cu = torch.tensor([0, 1, 250, 600], dtype=torch.int32, device=device)
    dout = torch.randn(2, 300, 8, 128, dtype=torch.bfloat16, device=device)
    dout_v = dout.reshape(600, 8, 128)

    def step():
        g = torch.autograd.grad(flash_attn(q, k, v, causal=True), (q, k, v), dout)
        g_v = torch.autograd.grad(flash_attn_varlen(qv, kv, vv, cu, cu, 350, 350, causal=True), (qv, kv, vv), dout_v)
        return g, g_v

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads, grads_v = step()
    for seed in (1, 2):
        new = rand_qkv(2, 300, 300, 8, 2, 128, dtype=torch.bfloat16, device=device, seed=seed)
        with torch.no_grad():
            for dst, src in zip((q, k, v), new, strict=True):
                dst.copy_(src)
            for dst, src in zip((qv, kv, vv), new, strict=True):
                dst.copy_(src.reshape(dst.shape))
        graph.replay()
        torch.cuda.synchronize()
        qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        flash_attn_ref(qr, kr, vr, causal=True, dtype=torch.float64).backward(dout.double())
        _check_grads(grads, (qr.grad, kr.grad, vr.grad), q.dtype)
        qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (qv, kv, vv))
        flash_attn_varlen_ref(qr, kr, vr, cu, cu, causal=True, dtype=torch.float64).backward(dout_v.double())
        _check_grads(grads_v, (qr.grad, kr.grad, vr.grad), q.dtype)


@pytest.mark.gpu
def test_gpu_deterministic_bits(device):
    q, k, v = rand_qkv(2, 1000, 1000, 8, 2, 128, dtype=torch.bfloat16, device=device)
    grads = []
    for det in (True, False, True):
        qg, kg, vg = _leaves(q, k, v)
        flash_attn(qg, kg, vg, causal=True, deterministic=det).float().sum().backward()
        grads.append((qg.grad, kg.grad, vg.grad))
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g, strict=True))


@pytest.mark.gpu
def test_gpu_torch_compile_inductor_backward(device):
    torch._dynamo.reset()
    q, k, v = rand_qkv(2, 500, 700, 8, 2, 64, dtype=torch.bfloat16, device=device)
    fn = torch.compile(lambda q, k, v: (flash_attn(q, k, v, causal=True).float() ** 2).sum(), fullgraph=True)
    qc, kc, vc = _leaves(q, k, v)
    fn(qc, kc, vc).backward()
    qe, ke, ve = _leaves(q, k, v)
    (flash_attn(qe, ke, ve, causal=True).float() ** 2).sum().backward()
    for a, b in ((qc.grad, qe.grad), (kc.grad, ke.grad), (vc.grad, ve.grad)):
        assert_rel_close(a, b, tol=1e-6)
