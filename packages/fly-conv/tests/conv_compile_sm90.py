"""Compile fly-conv's kernels for sm_90 without a GPU (Triton's compiler and its bundled ptxas), in a process of
its own: ``FLYDSL_INTERPRET=0 python conv_compile_sm90.py``. The interpreter accepts code the compiler rejects
(globals that are not constexpr, a loop-carried value changing type), so the CPU suite compiles the kernels'
variants at their sm_90 defaults too. Prints one line a variant: ``ok <name> <shared bytes> REG:n STACK:n
WGMMA:<0|1>`` (STACK > 0 is a spill) or ``FAIL <name> <error>``."""

from __future__ import annotations

# flydsl (through fly_conv) chooses compiled Triton before triton is imported: triton only inside functions
import torch

from fly_conv._kernels.depthwise import _conv_depthwise_kernel
from fly_conv._kernels.implicit_gemm import _conv_implicit_kernel
from fly_conv._kernels.wgrad import _conv_wgrad_kernel
from fly_conv.autotune import ConvProblem, default_config
from flydsl.arch import SM90

_DT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_kernel(fn, const: dict, ptr_types: dict, cfg):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: "constexpr" if n in const else ptr_types.get(n, "i32") for n in names}
    # What a launch on channels-last tensors with channel counts a multiple of 16 specializes on: 16-byte
    # aligned pointers, channel strides of 1 and other strides multiples of 16 (so the gathers vectorize).
    attrs = {}
    for n in names:
        if n in const or sig[n] == "i32" and not n.startswith("s"):
            continue
        if n.endswith("_c"):
            const[n] = 1
            sig[n] = "constexpr"
        else:
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})  # fmt: skip


def _usage(compiled) -> str:
    import os
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return m.group(0) if m else "REG:? STACK:?"


def _implicit(dtype, problem, transposed=False, pointwise=False, bias=True, act=1):
    cfg = default_config(problem, SM90)
    const = {"HAS_BIAS": bias, "ACT": act, "TRANSPOSED": transposed, "POINTWISE": pointwise, "IEEE": False}
    const.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)
    if not bias:
        const["bias_ptr"] = None
    ptrs = {n: "*" + _DT[dtype] for n in ("x_ptr", "w_ptr", "y_ptr", "bias_ptr")}
    return compile_kernel(_conv_implicit_kernel, const, ptrs, cfg)


def _depthwise(dtype, problem):
    cfg = default_config(problem, SM90)
    const = {"HAS_BIAS": True, "ACT": 2, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}
    ptrs = {n: "*" + _DT[dtype] for n in ("x_ptr", "w_ptr", "y_ptr", "bias_ptr")}
    return compile_kernel(_conv_depthwise_kernel, const, ptrs, cfg)


def _wgrad(dtype, problem):
    cfg = default_config(problem, SM90)
    const = {"IEEE": False, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    ptrs = {"dy_ptr": "*" + _DT[dtype], "x_ptr": "*" + _DT[dtype], "out_ptr": "*fp32"}
    return compile_kernel(_conv_wgrad_kernel, const, ptrs, cfg)


BF16 = torch.bfloat16
# (name, builder): the forward at the ResNet 3x3 default (128 x 128 x 64), a grouped layer's narrow tiles, the
# pointwise GEMM, the input gradient (transposed), fp16, the depthwise kernel and the weight gradient
VARIANTS = [
    ("implicit_3x3", lambda: _implicit(BF16, ConvProblem("implicit", 32 * 56 * 56, 256, 256, 9, 1, BF16))),
    ("implicit_grouped", lambda: _implicit(BF16, ConvProblem("implicit", 32 * 28 * 28, 8, 8, 9, 32, BF16))),
    ("pointwise", lambda: _implicit(BF16, ConvProblem("implicit", 32 * 56 * 56, 64, 256, 1, 1, BF16),
                                    pointwise=True, bias=False, act=0)),  # fmt: skip
    ("dgrad", lambda: _implicit(BF16, ConvProblem("implicit", 32 * 56 * 56, 64, 64, 9, 1, BF16), transposed=True,
                                bias=False, act=0)),  # fmt: skip
    ("implicit_fp16_gelu", lambda: _implicit(torch.float16, ConvProblem("implicit", 8 * 64 * 64, 128, 128, 9, 1,
                                                                        torch.float16), act=4)),  # fmt: skip
    ("depthwise", lambda: _depthwise(BF16, ConvProblem("depthwise", 32 * 28 * 28, 384, 1, 9, 384, BF16))),
    ("wgrad", lambda: _wgrad(BF16, ConvProblem("wgrad", 32 * 56 * 56, 64, 64, 9, 1, BF16))),
]

if __name__ == "__main__":
    for name, build in VARIANTS:
        try:
            k = build()
            wgmma = int("wgmma" in k.asm["ptx"])
            print("ok", name, k.metadata.shared, _usage(k), f"WGMMA:{wgmma}", flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", name, type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
