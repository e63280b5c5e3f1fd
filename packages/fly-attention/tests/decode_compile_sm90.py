"""Compile the decode, merge and RoPE + cache kernels for sm_90 without a GPU (Triton's compiler and its
bundled ptxas), in a process of its own: ``FLYDSL_INTERPRET=0 python decode_compile_sm90.py``. The
interpreter accepts code the compiler rejects (module globals that are not constexpr, type changes across a
loop), so the CPU suite compiles the kernels' variants too. Prints one line a variant: ``ok <name> <shared
bytes> REG:n STACK:n`` (STACK > 0 is a spill) or ``FAIL <error>``."""

from __future__ import annotations

# flydsl (through fly_attention) chooses compiled Triton before triton is imported: triton only inside functions
from fly_attention._kernels.decode import _decode_kernel, _decode_merge_kernel
from fly_attention._kernels.rope_cache import _rope_cache_kernel
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage

_FLOATS = ("qk_scale", "cap_in", "cap_out", "k_mul", "v_mul")


def _compile(fn, sig_of, const, warps, stages):
    names = fn.arg_names
    sig = {n: sig_of(n) for n in names if n not in const}
    # What a launch on real tensors specializes on: 16-byte aligned pointers and strides that are multiples
    # of 16 elements (head_dim 128 caches); without it the loads cannot be vectorized.
    aligned = [n for n in names if n not in const and (n.endswith("_ptr") or n.startswith("stride_"))
               and n not in ("stride_sl", "stride_bt")]  # fmt: skip
    return compile_sm90(fn, sig, const, divisible_by_16(aligned), num_warps=warps, num_stages=stages)


def decode_variant(d, block_m, block_n, page, kv="bf16", split=False, multi_q=False, windowed=False, softcap=False,
                   scales=False, warps=4, stages=3):  # fmt: skip
    ptr_types = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "bt_ptr": "*i32",
                 "sl_ptr": "*i32"}  # fmt: skip
    ptr_types.update((n, "*fp32") for n in ("po_ptr", "plse_ptr", "ks_ptr", "vs_ptr"))
    const = {"HEAD_DIM": d, "BLOCK_D": max(16, 1 << (d - 1).bit_length()), "BLOCK_M": block_m, "BLOCK_N": block_n,
             "PAGE": page, "HAS_SEQ_LENS": True, "SPLIT": split, "MULTI_Q": multi_q, "WINDOWED": windowed,
             "SOFTCAP": softcap, "K_SCALE": scales, "V_SCALE": scales}  # fmt: skip
    if not scales:
        const["ks_ptr"] = const["vs_ptr"] = None
    if not split:
        const["po_ptr"] = const["plse_ptr"] = None
    if page == 0:
        const["bt_ptr"] = None

    def sig_of(n):
        return ptr_types.get(n) or ("fp32" if n in _FLOATS else "i32")

    return _compile(_decode_kernel, sig_of, const, warps, stages)


def merge_variant(d, splits):
    const = {"HEAD_DIM": d, "BLOCK_D": max(16, 1 << (d - 1).bit_length()), "SPLITS": splits}
    ptr_types = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "o_ptr": "*bf16"}
    return _compile(_decode_merge_kernel, lambda n: ptr_types.get(n, "i32"), const, 4, 1)


def rope_variant(d, rot, block_h, page, neox=True, cache="bf16", scales=False):
    ptr_types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "cs_ptr": "*fp32", "pos_ptr": "*i64",
                 "slot_ptr": "*i64", "qo_ptr": "*bf16", "kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}",
                 "ks_ptr": "*fp32", "vs_ptr": "*fp32"}  # fmt: skip
    block_d = 1 << (d - 1).bit_length()
    const = {"HEAD_DIM": d, "HEAD_DIM_V": d, "ROT": rot, "BLOCK_D": block_d, "BLOCK_DV": block_d,
             "BLOCK_HALF": 1 << (rot // 2 - 1).bit_length(), "BLOCK_H": block_h, "PAGE": page, "NEOX": neox,
             "QUANT": cache != "bf16", "K_SCALE": scales, "V_SCALE": scales}  # fmt: skip
    if not scales:
        const["ks_ptr"] = const["vs_ptr"] = None
    floats = ("k_mul", "v_mul")
    return _compile(_rope_cache_kernel, lambda n: ptr_types.get(n) or ("fp32" if n in floats else "i32"), const, 4, 1)


# The default of head dim 128 in bf16 and fp8 paged, dense, and with every option on
VARIANTS = [
    lambda: decode_variant(128, 16, 64, 16),
    lambda: decode_variant(128, 16, 64, 16, kv="fp8e4nv", scales=True),
    lambda: decode_variant(128, 64, 64, 64, split=True, multi_q=True, windowed=True, softcap=True, scales=True),
    lambda: decode_variant(80, 32, 64, 0, split=True),
    lambda: decode_variant(256, 16, 32, 128, stages=2),
    lambda: merge_variant(128, 64),
    lambda: rope_variant(128, 128, 32, 16),
    lambda: rope_variant(128, 64, 32, 16, neox=False, cache="fp8e4nv", scales=True),
]

if __name__ == "__main__":
    for make in VARIANTS:
        try:
            k = make()
            print("ok", k.name, k.metadata.shared, resource_usage(k), flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
