"""Compile fly-conv's kernels for sm_90 without a GPU (Triton's compiler and its bundled ptxas), in a process of
its own: ``FLYDSL_INTERPRET=0 python conv_compile_sm90.py``. The interpreter accepts code the compiler rejects
(globals that are not constexpr, a loop-carried value changing type), so the CPU suite compiles the kernels'
variants at their sm_90 defaults too.

Each variant calls the package's own launcher on meta tensors of a real layer (channels-last, as the
convolution passes them) and compiles what that launch would compile: its arguments specialized the way
Triton's launcher specializes them (ints equal to 1 as constants, ints and pointers divisible by 16 marked so,
``do_not_specialize`` honoured), its constexprs and options as given. Prints one line a variant:
``ok <name> <shared bytes> REG:n STACK:n WGMMA:<0|1> WGMMA_E4M3:<0|1> CP_ASYNC:<0|1> PIPELINE:<bytes>`` (STACK >
0 is a spill; WGMMA_E4M3: a ``wgmma.mma_async`` on e4m3 operands, the fp8 path's tensor-core dot;
CP_ASYNC: the K loop's loads are asynchronous copies; PIPELINE: ``autotune.smem_bytes`` of the config, its
A and B tiles times num_stages, which shared memory reaches only when the loop is multi-buffered; TMA: the
tensor-descriptor loads in the PTX, the loop's and those its prologue issues ahead) or
``FAIL <name> <error>``.

``--split`` compiles the split-K forward instead (:data:`SPLIT_VARIANTS`: the partial-sum launch and the
epilogue-reduce launch at the default of a layer whose grid is under a wave), in lines of the same form."""

from __future__ import annotations

import dataclasses

# flydsl (through fly_conv) chooses compiled Triton before triton is imported: triton only inside functions
import torch

import flydsl.compiler as flyc
from fly_conv._kernels.direct import launch_direct
from fly_conv._kernels.implicit_gemm import k_splits, launch_implicit_gemm, launch_split_epilogue
from fly_conv._kernels.rows_gemm import launch_rows_gemm
from fly_conv._kernels.wgrad import launch_depthwise_wgrad, launch_wgrad, launch_wgrad_rows
from fly_conv.autotune import (
    ConvProblem,
    default_config,
    depthwise_wgrad_config,
    smem_bytes,
    wgrad_over_taps,
    wgrad_splits,
)
from flydsl.arch import SM90
from flydsl.testing.sm90 import resource_usage

_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv"}


def _record(launcher, *args):
    """The (kernel, args, meta) of the one kernel launch ``launcher(*args)`` makes (nothing runs)."""
    seen = []
    real = flyc.launch
    flyc.launch = lambda kernel, grid, *a, **meta: seen.append((kernel, a, meta))
    try:
        launcher(*args)
    finally:
        flyc.launch = real
    assert len(seen) == 1, f"expected one launch, got {len(seen)}"
    return seen[0]


def _specialize(backend, arg, specialize_value: bool):
    """(Triton type, specialization) of a scalar argument as Triton's launcher finds it: its C function from
    Triton 3.6, the Python one before."""
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:
        from triton.runtime.jit import create_specialize_impl

        return create_specialize_impl(backend.get_arg_specialization)(arg, False, specialize_value, True)
    return native_specialize_impl(backend, arg, False, specialize_value, True)


def compile_launch(kernel, args: tuple, meta: dict):
    """Compile for sm_90 what ``flyc.launch(kernel, grid, *args, **meta)`` compiles on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    meta = dict(meta)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    names = kernel.arg_names
    sig, const, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params, strict=True)):
        if param.is_constexpr:
            sig[name], const[(i,)] = "constexpr", meta[name]
            continue
        arg = args[i]
        if arg is None:
            sig[name], const[(i,)] = "constexpr", None
            continue
        if isinstance(arg, torch.Tensor):  # meta tensors: a data pointer of 0, 16-byte aligned as allocations are
            sig[name] = "*" + _DT[arg.dtype]
            if not param.do_not_specialize_on_alignment:
                attrs[(i,)] = CUDABackend.parse_attr("D")
            continue
        kind, spec = _specialize(CUDABackend, arg, not param.do_not_specialize)
        if kind == "constexpr":
            sig[name], const[(i,)] = "constexpr", spec
        else:
            sig[name] = kind
            if spec:
                attrs[(i,)] = CUDABackend.parse_attr(spec)
    src = ASTSource(kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _cl(n: int, c: int, spatial: tuple, dtype) -> torch.Tensor:
    """A channels-last ``[N, D, H, W, C]`` meta tensor (what the convolution hands its launchers)."""
    spatial = (1,) * (3 - len(spatial)) + tuple(spatial)
    return torch.empty((n, *spatial, c), dtype=dtype, device="meta")


def _geom(k: int, stride: int, pad: int, rank: int = 2):
    one = (1,) * (3 - rank)
    return one + (k,) * rank, one + (stride,) * rank, (0,) * (3 - rank) + (pad,) * rank, (1, 1, 1)


def _out(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def _implicit(dtype, n, c_in, k_out, size, k, stride=1, pad=0, groups=1, bias=True, act=1, transposed=False,
              w_scale=None, split_reduce=False, rows=None):  # fmt: skip
    """The implicit GEMM of a 2D layer (forward, or its input gradient with ``transposed``). fp8 ``dtype``: the
    scaled forward, bf16 output and bias, x's scale per tensor, the weight's ``w_scale`` (``"tensor"`` or
    ``"channel"``). A default with split-K records its partial-sum launch, or with ``split_reduce`` its
    epilogue-reduce launch. ``rows``: a ``(block_m, block_n, block_k, warps, stages)`` tile of the row-block
    kernel (``tma``; a 'same' stride-1 layer)."""
    fp8 = dtype == torch.float8_e4m3fn
    osz = _out(size, k, stride, pad)
    taps = k * k
    if transposed:  # gathers the output gradient, writes the input's
        x5, y5 = _cl(n, k_out, (osz, osz), dtype), _cl(n, c_in, (size, size), dtype)
        w2 = torch.empty((c_in, taps * (k_out // groups)), dtype=dtype, device="meta")
        problem = ConvProblem("implicit", n * size * size, c_in // groups, k_out // groups, taps, groups, dtype)
    else:
        x5, y5 = _cl(n, c_in, (size, size), dtype), _cl(n, k_out, (osz, osz), BF16 if fp8 else dtype)
        w2 = torch.empty((k_out, taps * (c_in // groups)), dtype=dtype, device="meta")
        problem = ConvProblem("implicit", n * osz * osz, k_out // groups, c_in // groups, taps, groups, dtype)
    b = torch.empty((y5.shape[-1],), dtype=y5.dtype, device="meta") if bias else None
    scales = ()
    if fp8:
        ws = torch.empty((k_out if w_scale == "channel" else 1,), dtype=torch.float32, device="meta")
        scales = (torch.empty((1,), dtype=torch.float32, device="meta"), ws)
    cfg = default_config(problem, SM90)
    geom = _geom(k, stride, pad)
    if rows is not None:
        bm, bn, bk, w, s = rows
        cfg = dataclasses.replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, split_k=1,
                                  tma=True)  # fmt: skip
        return _record(launch_rows_gemm, x5, w2, y5, b, geom, act, transposed, cfg), cfg, problem
    if split_reduce or cfg.split_k > 1:  # split-K: the partial sums into a workspace, or the reduce pass
        assert cfg.split_k > 1, cfg
        parts = torch.empty((k_splits(x5, geom, groups, cfg)[0], *y5.shape), dtype=torch.float32, device="meta")
        if split_reduce:
            return _record(launch_split_epilogue, parts, y5, b, act, *scales), cfg, problem
        scales = scales or (None, None)
        return _record(launch_implicit_gemm, x5, w2, y5, b, geom, act, False, groups, cfg, *scales, parts), cfg, problem
    return _record(launch_implicit_gemm, x5, w2, y5, b, geom, act, transposed, groups, cfg, *scales), cfg, problem


def _direct(dtype, n, c, size, k, cg=1, input_grad=False):
    x5, y5 = _cl(n, c, (size, size), dtype), _cl(n, c, (size, size), dtype)
    w2 = torch.empty((c, k * k * cg) if input_grad else (cg * k * k, c), dtype=dtype, device="meta")
    problem = ConvProblem("direct", n * size * size, c, cg, k * k, c // cg, dtype)
    cfg = default_config(problem, SM90)
    b = None if input_grad else torch.empty((c,), dtype=dtype, device="meta")
    args = (x5, w2, y5, b, _geom(k, 1, k // 2), c // cg, 0 if input_grad else 2, cfg, input_grad)
    return _record(launch_direct, *args), cfg, problem


def _wgrad(dtype, n, c_in, k_out, size, k, taps=1, rows=False):
    """The weight gradient of a 'same' 2D layer at its default tile; ``taps``: the tuning space's several-taps
    tile; ``rows``: the row-block kernel (``tma``) at the default tile."""
    dy5, x5 = _cl(n, k_out, (size, size), dtype), _cl(n, c_in, (size, size), dtype)
    problem = ConvProblem("wgrad", n * size * size, k_out, c_in, k * k, 1, dtype)
    cfg = default_config(problem, SM90)
    if taps > 1:
        cfg = wgrad_over_taps(cfg, taps)
    if rows:
        cfg = dataclasses.replace(cfg, tma=True)
    splits = wgrad_splits(cfg, problem, SM90)
    out = torch.empty((splits, k_out, c_in, k * k), dtype=torch.float32, device="meta")
    steps = -(-problem.m // cfg.block_k)
    geom = _geom(k, 1, k // 2)
    if rows:
        return _record(launch_wgrad_rows, dy5, x5, out, geom, splits, -(-steps // splits), cfg), cfg, problem
    return _record(launch_wgrad, dy5, x5, out, geom, 1, splits, -(-steps // splits), cfg), cfg, problem


def _depthwise_wgrad(dtype, n, c, size, k):
    dy5, x5 = _cl(n, c, (size, size), dtype), _cl(n, c, (size, size), dtype)
    problem = ConvProblem("wgrad", n * size * size, 1, 1, k * k, c, dtype)
    cfg = depthwise_wgrad_config(problem, SM90)
    out = torch.empty((cfg.split_k, c, k * k), dtype=torch.float32, device="meta")
    steps = -(-problem.m // cfg.block_m)
    args = (dy5, x5, out, _geom(k, 1, k // 2), cfg.split_k, -(-steps // cfg.split_k), cfg)
    return _record(launch_depthwise_wgrad, *args), cfg, problem


BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
# (name, launch): the forward at the ResNet 3x3 default (128 x 128 x 64), a strided 3x3 (int32 addressing
# through a stride), a grouped layer's narrow tiles (16 channels a group, the narrowest a 16-bit layer runs
# there: narrower groups run the direct kernel), the pointwise GEMM, the input gradient (stride 1: the taps
# reversed; stride 2: the division path), fp16 with gelu, fp32 (the full-precision dot: no tensor cores,
# checked for spills only), the direct kernel (depthwise, 4 and 8 channels a group, a depthwise input
# gradient) and the weight gradient (tiled, over one and four taps a program, and depthwise's); the row-block
# forward (128 x 128 and 128 x 256 tiles, 3x3 256 -> 256; fp8 too; 1x1 256 -> 64) and input gradient (3x3
# 64 -> 64); the fp8
# forward (e4m3 wgmma): the 3x3 default with per-channel weight scales, a strided 3x3 with a per-tensor one, a
# grouped layer and the pointwise GEMM
VARIANTS = [
    ("implicit_3x3", lambda: _implicit(BF16, 32, 256, 256, 56, 3, pad=1)),
    ("implicit_3x3_s2", lambda: _implicit(BF16, 32, 128, 128, 56, 3, stride=2, pad=1)),
    ("implicit_grouped", lambda: _implicit(BF16, 32, 256, 256, 28, 3, pad=1, groups=16)),
    ("pointwise", lambda: _implicit(BF16, 32, 64, 256, 56, 1, bias=False, act=0)),
    ("dgrad", lambda: _implicit(BF16, 32, 64, 64, 56, 3, pad=1, bias=False, act=0, transposed=True)),
    ("dgrad_s2", lambda: _implicit(BF16, 32, 128, 128, 56, 3, 2, 1, bias=False, act=0, transposed=True)),
    ("implicit_fp16_gelu", lambda: _implicit(torch.float16, 8, 128, 128, 64, 3, pad=1, act=4)),
    ("implicit_fp32", lambda: _implicit(torch.float32, 32, 128, 128, 56, 3, pad=1)),
    ("dgrad_s2_fp32", lambda: _implicit(torch.float32, 32, 128, 128, 56, 3, 2, 1, bias=False, act=0, transposed=True)),
    ("depthwise", lambda: _direct(BF16, 32, 384, 28, 3)),
    ("direct_cg4", lambda: _direct(BF16, 32, 128, 56, 3, cg=4)),
    ("direct_cg8", lambda: _direct(BF16, 32, 256, 28, 3, cg=8)),
    ("direct_dgrad_7x7", lambda: _direct(BF16, 64, 128, 56, 7, input_grad=True)),
    ("wgrad", lambda: _wgrad(BF16, 32, 64, 64, 56, 3)),
    ("wgrad_taps4", lambda: _wgrad(BF16, 32, 64, 64, 56, 3, taps=4)),
    ("wgrad_rows", lambda: _wgrad(BF16, 32, 64, 64, 56, 3, rows=True)),
    ("rows_3x3", lambda: _implicit(BF16, 32, 256, 256, 56, 3, pad=1, rows=(128, 128, 64, 8, 4))),
    ("rows_3x3_256", lambda: _implicit(BF16, 32, 256, 256, 56, 3, pad=1, rows=(128, 256, 64, 8, 3))),
    ("rows_dgrad", lambda: _implicit(BF16, 32, 64, 64, 56, 3, pad=1, bias=False, act=0, transposed=True,
                                     rows=(128, 64, 64, 4, 4))),
    ("rows_1x1", lambda: _implicit(BF16, 32, 256, 64, 56, 1, bias=False, act=0, rows=(128, 64, 64, 8, 4))),
    ("rows_3x3_fp8", lambda: _implicit(FP8, 32, 256, 256, 56, 3, pad=1, w_scale="channel",
                                       rows=(128, 128, 128, 8, 4))),
    ("wgrad_depthwise_7x7", lambda: _depthwise_wgrad(BF16, 32, 384, 28, 7)),
    ("implicit_3x3_fp8", lambda: _implicit(FP8, 32, 256, 256, 56, 3, pad=1, w_scale="channel")),
    ("implicit_3x3_s2_fp8", lambda: _implicit(FP8, 32, 128, 128, 56, 3, stride=2, pad=1, w_scale="tensor")),
    ("implicit_grouped_fp8", lambda: _implicit(FP8, 32, 256, 256, 28, 3, pad=1, groups=8, w_scale="channel")),
    ("pointwise_fp8", lambda: _implicit(FP8, 32, 64, 256, 56, 1, bias=False, act=0, w_scale="channel")),
]

# split-K (``--split``): the 7x7 512 -> 512 3x3 layer at batch 32 (52 tiles of 128 x 128: split 2 by default),
# bf16 and fp8 (per-channel weight scales); the partial-sum kernel and the reduce pass with the epilogue
SPLIT_VARIANTS = [
    ("implicit_7x7_split", lambda: _implicit(BF16, 32, 512, 512, 7, 3, pad=1)),
    ("split_epilogue", lambda: _implicit(BF16, 32, 512, 512, 7, 3, pad=1, split_reduce=True)),
    ("implicit_7x7_split_fp8", lambda: _implicit(FP8, 32, 512, 512, 7, 3, pad=1, w_scale="channel")),
    ("split_epilogue_fp8", lambda: _implicit(FP8, 32, 512, 512, 7, 3, pad=1, w_scale="channel", split_reduce=True)),
]

if __name__ == "__main__":
    import re
    import sys

    for name, launch in SPLIT_VARIANTS if "--split" in sys.argv[1:] else VARIANTS:
        try:
            record, cfg, problem = launch()
            k = compile_launch(*record)
            ptx = k.asm["ptx"]
            e4m3 = re.search(r"wgmma\.mma_async\S*e4m3", ptx) is not None
            print("ok", name, k.metadata.shared, resource_usage(k), f"WGMMA:{int('wgmma' in ptx)}",
                  f"WGMMA_E4M3:{int(e4m3)}", f"CP_ASYNC:{int('cp.async' in ptx)}",
                  f"PIPELINE:{smem_bytes(cfg, problem)}", f"TMA:{ptx.count('cp.async.bulk.tensor')}",
                  flush=True)  # fmt: skip
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", name, type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
