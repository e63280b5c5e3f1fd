"""Compile the TMA forward kernel for sm_90 without a GPU (Triton's compiler and its bundled ptxas), in a process
of its own: ``FLYDSL_INTERPRET=0 python attn_tma_compile_sm90.py``. Every config of
``fly_attention.autotune.tma_candidates`` at head dims 64, 128 and 256, plus padded head dims and a value head
dim of its own. Prints one line a variant: ``ok <variant> <shared bytes> REG:<n> STACK:<n> <marks>``, the
marks being ``tma`` (``cp.async.bulk.tensor`` in the PTX) and ``wgmma``, or ``FAIL <variant> <error>``."""

from __future__ import annotations

import sys

import torch

import flydsl.arch

# flydsl (through fly_attention) chooses compiled Triton before triton is imported: triton only inside functions
from fly_attention._kernels.flash_fwd_tma import _flash_fwd_tma_kernel
from fly_attention.autotune import AttnConfig, config_valid, tma_candidates
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage, signature

_FLOATS = ("qk_scale", "cap_in", "cap_out")
HOPPER = flydsl.arch.SM90


def compile_variant(d, dv, cfg: AttnConfig, windowed, softcap, varlen, lse, dtype="bf16"):
    import triton

    fn = _flash_fwd_tma_kernel
    names = fn.arg_names
    const = {
        "HEAD_DIM": d, "HEAD_DIM_V": dv, "BLOCK_D": triton.next_power_of_2(d), "BLOCK_DV": triton.next_power_of_2(dv),
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "WINDOWED": windowed, "SOFTCAP": softcap, "VARLEN": varlen,
        "STORE_LSE": lse, "TMA_STORE": cfg.tma_store,
    }  # fmt: skip
    if not lse:
        const["lse_ptr"] = None
    if not varlen:
        const["cu_q_ptr"] = const["cu_k_ptr"] = None
    sig = signature(fn, {"lse_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}, pointer="*" + dtype,
                    floats=_FLOATS)  # fmt: skip
    # What a launch of TMA-addressable tensors specializes on: 16-byte aligned pointers, strides multiples of
    # 16 elements (as [B, S, H, D] tensors with H * D a multiple of 16 have).
    aligned = [n for n in names if n not in const and (n.endswith("_ptr") or n.startswith("stride_"))]
    return compile_sm90(fn, sig, const, divisible_by_16(aligned), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def marks(compiled) -> str:
    ptx = compiled.asm["ptx"]
    out = []
    if "cp.async.bulk.tensor" in ptx:
        out.append("tma")
    if "wgmma.mma_async" in ptx:
        out.append("wgmma")
    return ",".join(out) or "-"


# (windowed, softcap, varlen, lse, dtype): every option on (every loop of the kernel, the varlen prologue), and
# every option off (the plainest kernel, at d 128 only)
ALL_ON = (True, True, True, True, "fp16")
ALL_OFF = (False, False, False, False, "bf16")
HEAD_DIMS = (64, 128, 256)
# the head dims that are not powers of two (padded tiles) and a value head dim of its own, at 128 x 64 tiles
EXTRA = [
    ((80, 80), AttnConfig(128, 64, num_warps=8, num_stages=3, tma=True), (True, False, False, True, "fp16")),
    ((96, 96), AttnConfig(128, 64, num_warps=8, num_stages=3, tma=True), ALL_ON),
    ((192, 128), AttnConfig(128, 64, num_warps=8, num_stages=2, tma=True, tma_store=True), ALL_ON),
]


def variants():
    """((d, dv), cfg, options) of every compile: each candidate of each head dim with every option on, the d 128
    candidates with every option off too, and EXTRA."""
    out = []
    for d in HEAD_DIMS:
        for cfg in tma_candidates(d, torch.bfloat16, HOPPER):
            out.append(((d, d), cfg, ALL_ON))
            if d == 128:
                out.append(((d, d), cfg, ALL_OFF))
    for dims, cfg, opts in EXTRA:
        if not config_valid(cfg, *dims, torch.bfloat16, HOPPER):
            raise AssertionError(f"{cfg} is not valid at head dims {dims}")
        out.append((dims, cfg, opts))
    return out


if __name__ == "__main__":
    # ``python attn_tma_compile_sm90.py [shard count]``: the variants i with i % count == shard (parallel runs)
    shard, count = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (0, 1)
    for i, ((d, dv), cfg, opts) in enumerate(variants()):
        if i % count != shard:
            continue
        tag = f"{i} d{d}/{dv} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
        tag += f" store={int(cfg.tma_store)} opts={int(opts[0])}"
        try:
            c = compile_variant(d, dv, cfg, *opts)
            print("ok", tag, c.metadata.shared, resource_usage(c), marks(c), flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", tag, type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
