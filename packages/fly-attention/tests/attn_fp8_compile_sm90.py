"""Compile the fp8 forward kernel for sm_90 without a GPU (Triton's compiler, its bundled ptxas and cuobjdump), in
a process of its own: ``FLYDSL_INTERPRET=0 python attn_fp8_compile_sm90.py [variant ...]``. Prints one line a
variant: ``ok <i> <shared bytes> <REG:n STACK:n> wgmma_e4m3:<n> wgmma:<n>`` (the wgmma instructions whose
operands are e4m3, and all wgmma instructions, in the PTX) or ``FAIL <error>``. With ``--ptx DIR`` each
variant's PTX is written there too."""

from __future__ import annotations

# flydsl (through fly_attention) chooses compiled Triton before triton is imported: triton only inside functions
from fly_attention._kernels.flash_fwd_fp8 import MIN_BLOCK_D, _flash_fwd_fp8_kernel
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage, signature

_FP8_PTRS = ("q_ptr", "k_ptr", "vt_ptr")
_FLOATS = ("qk_scale", "cap_in", "cap_out", "out_scale")


def compile_variant(d, dv, block_m, block_n, warps, stages, windowed, softcap, lse, descales, out="bf16"):
    import triton

    fn = _flash_fwd_fp8_kernel
    names = fn.arg_names
    const = {
        "HEAD_DIM": d, "HEAD_DIM_V": dv, "BLOCK_D": max(MIN_BLOCK_D, triton.next_power_of_2(d)),
        "BLOCK_DV": max(MIN_BLOCK_D, triton.next_power_of_2(dv)), "BLOCK_M": block_m, "BLOCK_N": block_n,
        "WINDOWED": windowed, "SOFTCAP": softcap, "STORE_LSE": lse, "Q_DS": descales, "K_DS": descales,
        "V_DS": descales,
    }  # fmt: skip
    if not lse:
        const["lse_ptr"] = None
    if not descales:
        const["q_ds_ptr"] = const["k_ds_ptr"] = const["v_ds_ptr"] = None
    # the other pointers (lse and the descales) are fp32
    sig = signature(fn, {**dict.fromkeys(_FP8_PTRS, "*fp8e4nv"), "o_ptr": "*" + out}, pointer="*fp32", floats=_FLOATS)
    # As real launches specialize: 16-byte aligned tensors, strides multiples of 16 ([B, S, H, D] with H * D a
    # multiple of 16; the transposed V's rows padded to 16 bytes); not the lse's (a sequence length) and not the
    # descales' pointers (one fp32 value: 4-byte alignment is all a launch promises).
    aligned = [n for n in names if n not in const and (n in _FP8_PTRS or n == "o_ptr" or n.startswith("stride_"))
               and n not in ("stride_lb", "stride_lh")]  # fmt: skip
    return compile_sm90(fn, sig, const, divisible_by_16(aligned), num_warps=warps, num_stages=stages)


def wgmma_counts(ptx: str) -> tuple[int, int]:
    """(wgmma instructions with e4m3 operands, all wgmma mma_async instructions) in the PTX."""
    lines = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    return sum(".e4m3.e4m3" in ln for ln in lines), len(lines)


# (d, dv, block_m, block_n, warps, stages, windowed, softcap, lse, descales, out): each head-dim class's default
# with every option off and with every option on, a decode-like block, and an fp16 output
VARIANTS = [
    (64, 64, 128, 128, 8, 3, False, False, False, True, "bf16"),
    (64, 64, 128, 128, 8, 3, True, True, True, True, "fp16"),
    (128, 128, 128, 128, 8, 3, False, False, False, True, "bf16"),
    (128, 128, 128, 128, 8, 3, True, True, True, True, "bf16"),
    (256, 256, 64, 64, 8, 2, False, False, False, True, "bf16"),
    (256, 256, 64, 64, 8, 2, True, True, True, False, "fp16"),
    (128, 128, 16, 128, 8, 3, False, False, True, True, "bf16"),
]

if __name__ == "__main__":
    import sys
    from pathlib import Path

    args = sys.argv[1:]
    ptx_dir = None
    if "--ptx" in args:
        i = args.index("--ptx")
        ptx_dir = Path(args[i + 1])
        del args[i : i + 2]
    for i in [int(a) for a in args] or range(len(VARIANTS)):
        v = VARIANTS[i]
        try:
            k = compile_variant(*v)
            fp8, total = wgmma_counts(k.asm["ptx"])
            if ptx_dir is not None:
                (ptx_dir / f"fp8_{i}.ptx").write_text(k.asm["ptx"])
            print("ok", i, k.metadata.shared, resource_usage(k), f"wgmma_e4m3:{fp8} wgmma:{total}", flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", i, v, type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
