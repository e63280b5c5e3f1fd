"""The seed library's builder, for users porting from it: :func:`compile_preshuffle_gemm`.

It returns a launcher with the seed's signature over :func:`fly_gemm.gemm`'s kernels. The seed's B operand
was pre-shuffled for AMD's matrix cores; here B is the plain ``[N, K]`` weight (or a
:class:`~fly_gemm.PackedWeight`), which is what the Hopper kernels read directly. Options that tuned the
seed's AMD pipeline (``waves_per_eu``, ``enable_scheduler``, ``use_async_copy``, ``xcd_swizzle``) are
accepted and have no effect here.
"""

from __future__ import annotations

import torch

import flydsl.arch
import flydsl.compiler as flyc
from flydsl.checks import describe, dtype_name, parse_dtype
from flydsl.errors import ArgumentError, DTypeError, ShapeError

from .autotune import GemmConfig, config_valid
from .gemm import _gemm
from .prepack import PackedWeight

__all__ = ["compile_preshuffle_gemm", "EPILOGUES"]

# the seed's epilogue names -> (bias used, activation)
EPILOGUES = {
    "none": (False, None), "bias": (True, None), "bias_relu": (True, "relu"), "bias_silu": (True, "silu"),
    "bias_gelu": (True, "gelu_tanh"),  # the seed's gelu: the tanh approximation
    "bias_gelu_erf": (True, "gelu"),
}  # fmt: skip
_IN = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "fp16": torch.float16, "bf16": torch.bfloat16}


def _operand(name: str, t, rows: int, cols: int, dtype) -> torch.Tensor:
    """``t`` as ``[rows, cols]``: a 2-D tensor of at least that many rows, or a flat contiguous buffer."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise DTypeError(f"{name}: expected dtype {dtype_name(dtype)}, got {describe(t)}")
    if t.dim() == 2 and t.shape[0] >= rows and t.shape[1] == cols:
        return t[:rows]
    if t.dim() == 1 and t.is_contiguous() and t.numel() >= rows * cols:
        return t[: rows * cols].view(rows, cols)
    raise ShapeError(f"{name}: expected [>= {rows}, {cols}] or a flat buffer of >= {rows * cols} elements, "
                     f"got {describe(t)}")  # fmt: skip


def compile_preshuffle_gemm(
    *,
    N: int,  # noqa: N803 - the seed's names
    K: int,  # noqa: N803
    tile_m: int = 128,
    tile_n: int = 128,
    tile_k: int = 64,
    in_dtype: str = "fp8",
    out_dtype: str = "bf16",
    epilogue: str = "none",
    lds_stage: int = 2,
    waves_per_eu: int | None = None,
    enable_scheduler: bool = True,
    use_async_copy: bool = False,
    xcd_swizzle: int = 0,
):
    """A launcher of ``C[M, N] = epilogue((A[M, K] @ B[N, K]^T) * scale_a * scale_b)`` with runtime M.

    Args:
        N, K: the GEMM's fixed dimensions. tile_m, tile_n, tile_k: the C tile of a program and its K step
            (powers of two >= 16). in_dtype: "fp8", "int8", "fp16" or "bf16"; out_dtype: "bf16", "fp16" or
            "f32". epilogue: "none", "bias", "bias_relu", "bias_silu", "bias_gelu" (tanh approximation, as
            the seed) or "bias_gelu_erf". lds_stage: software-pipeline buffers (Triton's num_stages).

    Returns:
        ``launch(arg_c, arg_a, arg_b, arg_scale_a, arg_scale_b, arg_bias, M_val, N_val, stream=None)``:
        buffers as ``[M, N]`` / ``[M, K]`` / ``[N, K]`` tensors or flat contiguous buffers (arg_b may be a
        :class:`~fly_gemm.PackedWeight`); fp8 / int8 take fp32 per-row ``arg_scale_a`` ``[M]`` and
        per-column ``arg_scale_b`` ``[N]`` (or one value each), 16-bit inputs None; ``arg_bias`` ``[N]``
        when the epilogue has one.
    """
    del waves_per_eu, enable_scheduler, use_async_copy, xcd_swizzle  # AMD pipeline knobs of the seed
    if epilogue not in EPILOGUES:
        raise ArgumentError(f"epilogue: expected one of {list(EPILOGUES)}, got {epilogue!r}")
    if in_dtype not in _IN:
        raise ArgumentError(f"in_dtype: expected one of {list(_IN)}, got {in_dtype!r}")
    a_dtype = _IN[in_dtype]
    c_dtype = parse_dtype("out_dtype", out_dtype, (torch.bfloat16, torch.float16, torch.float32))
    for name, v in (("N", N), ("K", K)):
        if not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name}: expected a positive int, got {v!r}")
    # the persistent TMA kernel on Hopper for tiles of 64+ rows (operands it cannot address fall back)
    cfg = GemmConfig(tile_m, tile_n, tile_k, group_m=8, num_warps=8 if tile_m * tile_n >= 128 * 128 else 4,
                     num_stages=max(1, lds_stage), tma=tile_m >= 64 and flydsl.arch.current().is_hopper)  # fmt: skip
    if not config_valid(cfg, a_dtype, flydsl.arch.SM90, c_dtype.itemsize):
        raise ArgumentError(f"tile_m/tile_n/tile_k/lds_stage: {cfg} is not a valid config (powers of two >= 16, "
                            "within shared memory)")  # fmt: skip
    has_bias, act = EPILOGUES[epilogue]
    quantized = a_dtype.itemsize == 1

    @flyc.jit(skip_empty=False)
    def launch_preshuffle_gemm(arg_c, arg_a, arg_b, arg_scale_a, arg_scale_b, arg_bias, M_val, N_val, stream=None):  # noqa: N803
        if N_val != N:
            raise ShapeError(f"N_val: this launcher was built for N = {N}, got {N_val}")
        c = _operand("arg_c", arg_c, M_val, N, c_dtype)
        a = _operand("arg_a", arg_a, M_val, K, a_dtype)
        b = arg_b.weight if isinstance(arg_b, PackedWeight) else _operand("arg_b", arg_b, N, K, a_dtype)
        if has_bias and arg_bias is None:
            raise ArgumentError(f"arg_bias: epilogue {epilogue!r} adds a bias; got None")
        sa, sb = (arg_scale_a, arg_scale_b) if quantized else (None, None)
        if isinstance(arg_b, PackedWeight) and arg_b.quantized and sb is None:
            sb = arg_b.scale
        _gemm(a, b, arg_bias if has_bias else None, act, c_dtype, sa, sb, c, "nk", cfg)

    return launch_preshuffle_gemm
