"""Compile the backward kernels for sm_90 without a GPU (Triton's compiler and its bundled ptxas), in a process
of its own: ``FLYDSL_INTERPRET=0 python attn_bwd_compile_sm90.py``. The interpreter accepts code the compiler
rejects, so the CPU suite compiles the kernels' variants too. Prints one line a kernel of a variant: ``ok <variant>
<kernel> <shared bytes> REG:<n> STACK:<n>`` or ``FAIL <error>``."""

from __future__ import annotations

# flydsl (through fly_attention) chooses compiled Triton before triton is imported: triton only inside functions
from fly_attention._kernels.flash_bwd import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage, signature

_FLOATS = ("qk_scale", "cap_in", "cap_out", "dk_scale", "dq_scale")
_PTR_TYPES = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}


def compile_kernel(fn, const, dtype="bf16", warps=8, stages=2):
    names = fn.arg_names
    const = {n: c for n, c in const.items() if n in names}
    sig = signature(fn, _PTR_TYPES, pointer="*" + dtype, floats=_FLOATS)
    # as real launches specialize: 16-byte aligned pointers, strides multiples of 16 elements (not the lse's
    # head stride, a sequence length)
    aligned = [n for n in names if n not in const and (n.endswith("_ptr") or n.startswith("stride_"))
               and n not in ("stride_lh", "stride_lb")]  # fmt: skip
    return compile_sm90(fn, sig, const, divisible_by_16(aligned), num_warps=warps, num_stages=stages)


def compile_variant(d, dv, dkdv_m, dkdv_n, dq_m, dq_n, warps, stages, windowed, softcap, varlen, dtype="bf16"):
    import triton

    base = {"HEAD_DIM": d, "HEAD_DIM_V": dv, "BLOCK_D": triton.next_power_of_2(d),
            "BLOCK_DV": triton.next_power_of_2(dv), "SOFTCAP": softcap, "VARLEN": varlen}  # fmt: skip
    if not varlen:
        base["cu_q_ptr"] = base["cu_k_ptr"] = None
    out = []
    for name, fn, extra in (
        ("delta", _bwd_delta_kernel, {"BLOCK_M": dq_m}),
        ("dkdv", _bwd_dkdv_kernel, {"BLOCK_M": dkdv_m, "BLOCK_N": dkdv_n}),
        ("dq", _bwd_dq_kernel, {"BLOCK_M": dq_m, "BLOCK_N": dq_n, "WINDOWED": windowed}),
    ):
        k = compile_kernel(fn, {**base, **extra}, dtype, warps, stages)
        out.append((name, k.metadata.shared, resource_usage(k)))
    return out


# (d, dv, dkdv_block_m, dkdv_block_n, dq_block_m, dq_block_n, warps, stages, windowed, softcap, varlen, dtype):
# the default of each head-dim class (autotune.default_bwd_config), with options off and on
VARIANTS = [
    (64, 64, 32, 64, 64, 32, 4, 2, False, False, False, "bf16"),
    (128, 128, 32, 64, 64, 32, 4, 2, True, True, True, "bf16"),
    (80, 80, 32, 64, 64, 32, 4, 2, True, False, False, "fp16"),
    (192, 128, 32, 32, 32, 32, 4, 2, True, True, False, "bf16"),
    (256, 256, 32, 32, 32, 32, 4, 2, True, True, True, "fp16"),
]

if __name__ == "__main__":
    import sys

    only = [int(a) for a in sys.argv[1:]] or range(len(VARIANTS))
    for i in only:
        v = VARIANTS[i]
        try:
            for name, shared, usage in compile_variant(*v):
                print("ok", i, name, shared, usage, flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", v, type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
