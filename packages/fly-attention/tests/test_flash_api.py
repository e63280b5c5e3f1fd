"""The host side of flash_attn / flash_attn_varlen: bad input named before anything launches, meta tensors,
the custom ops under torch.compile(fullgraph=True), and the launch config's default and validity predicate
(pure, CPU). Gradients: test_flash_bwd.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attn_helpers import rand_qkv

import flydsl.arch
from fly_attention import AttnConfig, flash_attn, flash_attn_ref, flash_attn_varlen, flash_attn_varlen_ref
from fly_attention.autotune import config_valid, default_config, smem_bytes
from flydsl.errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError
from flydsl.testing import assert_rel_close, tolerance
from flydsl.testing.sm90 import run_compile_script

# ---------------------------------------------------------------- bad input


def _good():
    return rand_qkv(1, 8, 8, 4, 2, 64)


BAD_DENSE = [
    # (what to change, error type, words the message must hold)
    (lambda q, k, v: (q, k[:, :, :, :32], v), ShapeError, "k: expected head_dim 64"),
    (lambda q, k, v: (q, k, v[:, :5]), ShapeError, "v: expected the sequence and heads of k"),
    (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ShapeError, "k, v: expected batch 1"),
    (
        lambda q, k, v: (q, k[:, :, :1].expand(1, 8, 3, 64), v[:, :, :1].expand(1, 8, 3, 64)),
        ShapeError,
        "divides q's 4",
    ),  # fmt: skip
    (lambda q, k, v: (q.new_zeros(1, 8, 4, 320), k.new_zeros(1, 8, 2, 320), v), ShapeError, "head_dim in 1..256"),
    (lambda q, k, v: (q, k, v.new_zeros(1, 8, 2, 512)), ShapeError, "v: expected a head_dim in 1..256"),
    (lambda q, k, v: (q, k.bfloat16(), v), DTypeError, "k: expected dtype fp16 (q's)"),
    (lambda q, k, v: (q.float(), k.float(), v.float()), DTypeError, "q: expected dtype fp16 or bf16"),
    (lambda q, k, v: (q[0], k[0], v[0]), ShapeError, "q: expected a 4-D tensor"),
    (lambda q, k, v: (q.new_zeros(1, 8, 4, 128)[..., ::2], k, v), LayoutError, "q: expected a unit stride"),
    (lambda q, k, v: (q, k.to("meta"), v), DeviceError, "k: expected a tensor on cpu"),
]


@pytest.mark.parametrize("change,error,words", BAD_DENSE)
def test_bad_tensors_are_named(change, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        flash_attn(*change(*_good()))


@pytest.mark.parametrize(
    "opts,words",
    [
        ({"window": (-2, 0)}, "window: each side must be >= -1"),
        ({"window": (3,)}, "window: expected a pair of ints"),
        ({"window": (1.5, 2)}, "window: expected a pair of ints"),
        ({"softcap": -1.0}, "softcap: expected a finite number >= 0"),
        ({"softcap": float("nan")}, "softcap: expected a finite number >= 0"),
        ({"softmax_scale": float("inf")}, "softmax_scale: expected None or a finite number"),
        ({"causal": 1}, "causal: expected a bool"),
    ],
)
def test_bad_options_are_named(opts, words):
    with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        flash_attn(*_good(), **opts)


def _varlen_inputs():
    q, k, v = (t[0] for t in rand_qkv(1, 10, 10, 2, 2, 64))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    return q, k, v, cu, cu.clone()


@pytest.mark.parametrize(
    "change,error,words",
    [
        (lambda a: {**a, "cu_q": a["cu_q"].long()}, DTypeError, "cu_seqlens_q: expected dtype int32"),
        (lambda a: {**a, "cu_k": a["cu_k"].float()}, DTypeError, "cu_seqlens_k: expected dtype int32"),
        (lambda a: {**a, "cu_q": torch.tensor([0, 6, 4], dtype=torch.int32)}, ArgumentError, "non-decreasing"),
        (
            lambda a: {**a, "cu_k": torch.tensor([0, 4, 11], dtype=torch.int32)},
            ArgumentError,
            "cu_seqlens_k: expected offsets within the 10 packed tokens",
        ),  # fmt: skip
        (
            lambda a: {**a, "cu_k": torch.tensor([0, 10], dtype=torch.int32)},
            ShapeError,
            "cu_seqlens_k: expected 3 offsets",
        ),  # fmt: skip
        (lambda a: {**a, "cu_q": a["cu_q"].to("meta")}, DeviceError, "cu_seqlens_q: expected a tensor on cpu"),
        (lambda a: {**a, "cu_q": a["cu_q"][None]}, ShapeError, "cu_seqlens_q: expected a 1-D tensor"),
        (lambda a: {**a, "max_q": 5}, ArgumentError, "max_seqlen_q: a sequence of cu_seqlens_q has 6 tokens"),
        (lambda a: {**a, "max_k": -1}, ArgumentError, "max_seqlen_k: expected an int >= 0"),
        (lambda a: {**a, "q": a["q"][None]}, ShapeError, "q: expected a 3-D tensor"),
    ],
)
def test_bad_varlen_input_is_named(change, error, words):
    q, k, v, cu_q, cu_k = _varlen_inputs()
    a = change({"q": q, "cu_q": cu_q, "cu_k": cu_k, "max_q": 6, "max_k": 6})
    with pytest.raises(error, match=words):
        flash_attn_varlen(a["q"], k, v, a["cu_q"], a["cu_k"], a["max_q"], a["max_k"])


# ---------------------------------------------------------------- meta tensors and torch.compile


def test_meta_tensors_give_meta_outputs():
    meta = torch.device("meta")
    q = torch.empty(2, 7, 8, 192, dtype=torch.bfloat16, device=meta)
    k = torch.empty(2, 9, 2, 192, dtype=torch.bfloat16, device=meta)
    v = torch.empty(2, 9, 2, 128, dtype=torch.bfloat16, device=meta)
    out, lse = flash_attn(q, k, v, causal=True, return_lse=True)
    assert out.device == meta and out.shape == (2, 7, 8, 128) and out.dtype == torch.bfloat16
    assert lse.device == meta and lse.shape == (2, 8, 7) and lse.dtype == torch.float32
    cu = torch.empty(3, dtype=torch.int32, device=meta)
    out, lse = flash_attn_varlen(q[0], k[0], v[0], cu, cu, 5, 5, return_lse=True)
    assert out.device == meta and out.shape == (7, 8, 128) and lse.shape == (8, 7)


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_ops_trace_under_torch_compile_fullgraph():
    """Traced through the custom ops (fake implementations for the shapes) and run: the same result as
    eager."""
    torch._dynamo.reset()
    q, k, v = rand_qkv(2, 19, 23, 4, 2, 64)

    def dense(q, k, v):
        out, lse = flash_attn(q, k, v, causal=True, window=(7, -1), return_lse=True)
        return out.float() * 2, lse

    out, lse = torch.compile(dense, fullgraph=True, backend="aot_eager")(q, k, v)
    ref, ref_lse = flash_attn_ref(q, k, v, causal=True, window=(7, -1), return_lse=True)
    assert_rel_close(out / 2, ref, tol=tolerance(q.dtype))
    assert_rel_close(lse, ref_lse, tol=1e-5)

    qv, kv, vv, cu, _ = _varlen_inputs()

    def packed(q, k, v, cu):
        return flash_attn_varlen(q, k, v, cu, cu, 6, 6, causal=True, softcap=3.0)

    got = torch.compile(packed, fullgraph=True, backend="aot_eager")(qv, kv, vv, cu)
    assert_rel_close(got, flash_attn_varlen_ref(qv, kv, vv, cu, cu, causal=True, softcap=3.0), tol=tolerance(qv.dtype))


@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_fake_implementations_agree_with_the_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = rand_qkv(1, 5, 6, 4, 1, 80, 48)
    real_out, real_lse = torch.ops.fly_attention.flash_attn_fwd(q, k, v, True, None, -1, 0, 0.0, True)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, lse = torch.ops.fly_attention.flash_attn_fwd(fq, fk, fv, True, None, -1, 0, 0.0, True)
        _, no_lse = torch.ops.fly_attention.flash_attn_fwd(fq, fk, fv, True, None, -1, 0, 0.0, False)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (real_out.shape, real_out.dtype, real_lse.shape,
                                                            real_lse.dtype)  # fmt: skip
    assert no_lse.numel() == 0


# ---------------------------------------------------------------- launch config (pure, CPU)

HEAD_DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)]
ARCHES = [flydsl.arch.SM90, flydsl.arch.INTERPRETER]


@pytest.mark.parametrize("d,dv", HEAD_DIMS)
@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_default_config_is_valid_and_pure(d, dv, arch, dtype):
    for sq, sk in ((1, 1), (1, 4096), (17, 33), (1000, 1000), (16384, 16384)):
        for causal in (False, True):
            cfg = default_config(d, dv, sq, sk, causal, dtype, arch)
            assert config_valid(cfg, d, dv, dtype, arch), (cfg, d, dv, sq, sk)
            assert cfg == default_config(d, dv, sq, sk, causal, dtype, arch)  # a function of its arguments only
            if arch.is_hopper and sq >= 1000:
                assert cfg.block_m in (64, 128) and 64 <= cfg.block_n <= 128 and cfg.num_warps in (4, 8)
                assert 2 <= cfg.num_stages <= 4
            if sq == 1 and not arch.is_interpreter:
                assert cfg.block_m == 16  # a decode-size query block, not 128 rows of padding


def test_config_valid_rejects_what_cannot_launch():
    sm90 = flydsl.arch.SM90
    good = AttnConfig(128, 64, num_warps=8, num_stages=3)
    assert config_valid(good, 128, 128, torch.bfloat16, sm90)
    for bad in (
        dataclasses.replace(good, block_m=96),  # not a power of two
        dataclasses.replace(good, block_n=8),  # under the dot's minimum
        dataclasses.replace(good, num_warps=3),
        dataclasses.replace(good, num_stages=0),
        AttnConfig(128, 128, num_warps=8, num_stages=4),  # shared memory past 227 KB at head dim 256
        AttnConfig(128, 128, num_warps=4, num_stages=1),  # registers: 128 x (256 + 128) fp32 over 128 threads
    ):
        assert not config_valid(bad, 256, 256, torch.bfloat16, sm90), bad
    assert smem_bytes(good, 80, 80, torch.bfloat16) == (128 * 128 + 3 * 64 * 256) * 2  # 80 pads to 128


# ---------------------------------------------------------------- the reference itself


def test_reference_in_row_blocks_matches_whole(monkeypatch):
    """Long sequences are referenced in blocks of query rows (the benchmark's 16K cases): the same result."""
    from fly_attention import reference

    q, k, v = rand_qkv(2, 37, 29, 4, 2, 64)
    opts = {"causal": True, "window": (5, -1), "softcap": 3.0}
    whole, whole_lse = flash_attn_ref(q, k, v, return_lse=True, **opts)
    monkeypatch.setattr(reference, "_CHUNK_SCORES", 4 * 29 * 8)  # 8 rows a block
    parts, parts_lse = flash_attn_ref(q, k, v, return_lse=True, **opts)
    assert torch.equal(whole, parts) and torch.equal(whole_lse, parts_lse)


# ---------------------------------------------------------------- the kernel compiles for the H200


def test_kernel_compiles_for_sm90():
    """Triton's compiler (not the interpreter) takes every variant of the kernel for sm_90, in a process of
    its own (the interpreter is chosen once per process)."""
    from pathlib import Path

    lines = run_compile_script(Path(__file__).with_name("attn_compile_sm90.py"))
    assert len(lines) == 5 and all(line.startswith("ok") for line in lines), "\n".join(lines)


@pytest.mark.parametrize("shape", [(0, 8, 8), (2, 0, 8), (2, 0, 0)])
@pytest.mark.interpreter  # CPU tensors through the kernels' launchers
def test_empty_shapes(shape):
    """batch 0, seqlen_q 0 (with and without keys): empty outputs of the right shape, nothing launched."""
    b, sq, sk = shape
    q, k, v = rand_qkv(b, sq, sk, 4, 2, 64, 48)
    out, lse = flash_attn(q, k, v, causal=True, return_lse=True)
    assert out.shape == (b, sq, 4, 48) and lse.shape == (b, 4, sq)


# ---------------------------------------------------------------- GPU: graphs and inductor


@pytest.mark.gpu
@pytest.mark.graph
def test_gpu_cuda_graph_capture_and_replay(device):
    """Dense and varlen forwards captured in one CUDA graph (no host sync inside), replayed on new inputs."""
    q, k, v = rand_qkv(2, 300, 300, 8, 2, 128, dtype=torch.bfloat16, device=device)
    qv, kv, vv = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    cu = torch.tensor([0, 1, 250, 600], dtype=torch.int32, device=device)
    flash_attn(q, k, v, causal=True)  # compile outside the capture
    flash_attn_varlen(qv, kv, vv, cu, cu, 350, 350, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn(q, k, v, causal=True)
        out_v = flash_attn_varlen(qv, kv, vv, cu, cu, 350, 350, causal=True)
    for seed in (1, 2):
        for dst, src in zip((q, k, v), rand_qkv(2, 300, 300, 8, 2, 128, dtype=torch.bfloat16, device=device,
                                                seed=seed), strict=True):  # fmt: skip
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_rel_close(out, flash_attn_ref(q, k, v, causal=True), tol=tolerance(q.dtype))
        assert_rel_close(out_v, flash_attn_varlen_ref(qv, kv, vv, cu, cu, causal=True), tol=tolerance(q.dtype))


@pytest.mark.gpu
def test_gpu_torch_compile_inductor(device):
    torch._dynamo.reset()
    q, k, v = rand_qkv(2, 500, 700, 8, 8, 64, dtype=torch.bfloat16, device=device)
    fn = torch.compile(lambda q, k, v: flash_attn(q, k, v, causal=True, softcap=20.0) * 2, fullgraph=True)
    assert_rel_close(fn(q, k, v) / 2, flash_attn_ref(q, k, v, causal=True, softcap=20.0), tol=tolerance(q.dtype))
