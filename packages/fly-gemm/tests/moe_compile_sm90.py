"""Compile the fused MoE grouped-GEMM kernel for sm_90 without a GPU (Triton's compiler and its bundled
ptxas), in a process of its own: ``FLYDSL_INTERPRET=0 python moe_compile_sm90.py``. One variant a weight
format at the default prefill tiles (the gated stage, the heavier one), the 4-bit paths that read a scale
an element (groups smaller than the K step), MXFP4's decode tile and one tile that keeps its fp32 decode.
Prints one line a variant: ``ok <name> <wgmma|no-wgmma> <shared bytes> REG:n STACK:n`` (STACK > 0 is a
spill) or ``FAIL <name> <error>``."""

from __future__ import annotations

# flydsl (through fly_gemm) chooses compiled Triton before triton is imported: triton only inside functions
from fly_gemm._kernels.moe_gemm import (
    QUANT_BLOCK,
    QUANT_CHANNEL,
    QUANT_NONE,
    QUANT_W4,
    QUANT_W4A8,
    _fp4_asm,
    _moe_gemm_kernel,
)
from fly_gemm.moe_config import MoeConfig
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage, signature

# every stride but the unit ones (which a launch specializes to the constant 1) a multiple of 16 elements
_ALIGNED = ["a_ptr", "b_ptr", "c_ptr", "sorted_ptr", "expert_ids_ptr", "w_ptr", "as_ptr", "bs_ptr", "N", "K", "KP",
            "up_offset", "stride_am", "stride_be", "stride_bn", "stride_cm"]  # fmt: skip


def variant(a, b, quant, tiles, warps, stages, scale_bk=1, fp4=False, int_acc=False):
    """The gated stage (gather, SiLU-and-multiply) of ``a`` activations and ``b`` weights in Triton types."""
    types = {"a_ptr": f"*{a}", "b_ptr": f"*{b}", "c_ptr": "*fp32" if quant != QUANT_NONE and quant != QUANT_W4
             else "*bf16", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "npad_ptr": "*i32", "w_ptr": "*fp32",
             "as_ptr": "*fp32", "bs_ptr": "*u8" if fp4 else "*fp32"}  # fmt: skip
    bm, bn, bk = tiles
    consts = {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1, "stride_bsk": 1, "stride_ask": 1,
              "GATHER_A": True, "GATED": True, "ACT": 1, "MUL_WEIGHT": False, "QUANT": quant, "INT_ACC": int_acc,
              "SCALE_BN": 1 if quant != QUANT_BLOCK else 128, "SCALE_BK": scale_bk, "FP4": fp4,
              "FP4_ASM": _fp4_asm(fp4 and quant == QUANT_W4 and a == "bf16", scale_bk, MoeConfig(bm, bn, bk, 1, warps)),
              "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}  # fmt: skip
    if quant == QUANT_NONE:  # (weight-only 4-bit launches pass ``a`` for the unread activation scales)
        consts["as_ptr"] = consts["bs_ptr"] = None
    sig = signature(_moe_gemm_kernel, types)
    aligned = [n for n in _ALIGNED if n not in consts]
    return compile_sm90(_moe_gemm_kernel, sig, consts, divisible_by_16(aligned), num_warps=warps, num_stages=stages)


# (name, make): the formats at their default prefill tiles (moe_config.default_moe_config: 128 x 128 x 64 for
# 16-bit operands, 128 x 64 x 128 for 8-bit ones), K steps cut as fused_moe cuts them (moe_config.fit_block_k)
VARIANTS = [
    ("bf16", lambda: variant("bf16", "bf16", QUANT_NONE, (128, 128, 64), 8, 4)),
    ("fp8-channel", lambda: variant("fp8e4nv", "fp8e4nv", QUANT_CHANNEL, (128, 64, 128), 8, 4)),
    ("int8-channel", lambda: variant("i8", "i8", QUANT_CHANNEL, (128, 64, 128), 8, 4, int_acc=True)),
    ("fp8-block128", lambda: variant("fp8e4nv", "fp8e4nv", QUANT_BLOCK, (128, 64, 128), 8, 4, scale_bk=128)),
    ("int4-g128", lambda: variant("bf16", "u8", QUANT_W4, (128, 128, 64), 8, 4, scale_bk=128)),
    ("int4-g16-step32", lambda: variant("bf16", "u8", QUANT_W4, (128, 128, 32), 8, 4, scale_bk=16)),
    ("mxfp4-g32", lambda: variant("bf16", "u8", QUANT_W4, (128, 128, 32), 8, 4, scale_bk=32, fp4=True)),
    # the decode tile (16 rows, warp-level MMA): MXFP4 through the inline-PTX decode
    ("mxfp4-g32-decode", lambda: variant("bf16", "u8", QUANT_W4, (16, 64, 32), 4, 4, scale_bk=32, fp4=True)),
    # a warpgroup-MMA tile whose shared layout sm_90's compiler rejected with the inline-PTX decode: the fp32 one
    ("mxfp4-g32-64x128x32", lambda: variant("bf16", "u8", QUANT_W4, (64, 128, 32), 4, 3, scale_bk=32, fp4=True)),
    ("w4a8-int4-g128", lambda: variant("fp8e4nv", "u8", QUANT_W4A8, (128, 64, 32), 8, 4, scale_bk=128)),
    ("w4a8-mxfp4-g32", lambda: variant("fp8e4nv", "u8", QUANT_W4A8, (128, 64, 32), 8, 4, scale_bk=32, fp4=True)),
]

if __name__ == "__main__":
    for name, make in VARIANTS:
        try:
            k = make()
            mma = "wgmma" if "wgmma.mma_async" in k.asm["ptx"] else "no-wgmma"
            print("ok", name, mma, k.metadata.shared, resource_usage(k), flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", name, type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
