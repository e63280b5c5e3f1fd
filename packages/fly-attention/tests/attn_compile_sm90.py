"""Compile the forward kernel for sm_90 without a GPU (Triton's compiler and its bundled ptxas), in a process
of its own: ``FLYDSL_INTERPRET=0 python attn_compile_sm90.py``. The interpreter accepts code the compiler
rejects (module globals that are not constexpr, type changes across a loop), so the CPU suite compiles the
kernel's variants too. Prints one line a variant: ``ok <shared bytes>`` or ``FAIL <error>``."""

from __future__ import annotations

# flydsl (through fly_attention) chooses compiled Triton before triton is imported: triton only inside functions
from fly_attention._kernels.flash_fwd import _flash_fwd_kernel
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, signature

_FLOATS = ("qk_scale", "cap_in", "cap_out")


def compile_variant(d, dv, block_m, block_n, warps, stages, windowed, softcap, varlen, lse, dtype="bf16"):
    import triton

    fn = _flash_fwd_kernel
    names = fn.arg_names
    const = {
        "HEAD_DIM": d, "HEAD_DIM_V": dv, "BLOCK_D": triton.next_power_of_2(d), "BLOCK_DV": triton.next_power_of_2(dv),
        "BLOCK_M": block_m, "BLOCK_N": block_n, "WINDOWED": windowed, "SOFTCAP": softcap, "VARLEN": varlen,
        "STORE_LSE": lse,
    }  # fmt: skip
    if not lse:
        const["lse_ptr"] = None
    if not varlen:
        const["cu_q_ptr"] = const["cu_k_ptr"] = None
    sig = signature(fn, {"lse_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}, pointer="*" + dtype,
                    floats=_FLOATS)  # fmt: skip
    # What a launch on real tensors specializes on: 16-byte aligned pointers and strides that are multiples
    # of 16 elements (as [B, S, H, D] tensors with H * D a multiple of 16 have); without it the loads cannot
    # be vectorized, and Triton pipelines no load narrower than 4 bytes.
    aligned = [n for n in names if n not in const and (n.endswith("_ptr") or n.startswith("stride_"))]
    return compile_sm90(fn, sig, const, divisible_by_16(aligned), num_warps=warps, num_stages=stages)


# (d, dv, block_m, block_n, warps, stages, windowed, softcap, varlen, lse, dtype): the defaults of each head-dim
# class with every option off, and with every option on (and fp16, a value head dim of its own)
VARIANTS = [
    (64, 64, 128, 128, 8, 2, False, False, False, False, "bf16"),
    (128, 128, 128, 64, 8, 3, True, True, True, True, "bf16"),
    (80, 80, 16, 64, 8, 3, True, False, False, True, "fp16"),
    (192, 128, 64, 64, 8, 2, True, True, False, True, "bf16"),
    (256, 256, 64, 64, 8, 2, False, False, True, False, "fp16"),
]

if __name__ == "__main__":
    for v in VARIANTS:
        try:
            print("ok", compile_variant(*v).metadata.shared, flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", v, type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
