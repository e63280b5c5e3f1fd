"""Compile the all-reduce kernels for sm_90 without a GPU (Triton's compiler and its bundled ptxas), in a process
of its own: ``FLYDSL_INTERPRET=0 python comm_compile_sm90.py``. Prints one line a variant: ``ok <name> <dtype>
<world> REG:n STACK:n <instructions>`` (the memory-ordering and vector instructions found in its PTX) or
``FAIL <error>``."""

from __future__ import annotations

import re

# flydsl (through fly_comm) chooses compiled Triton before triton is imported: triton only inside functions
from fly_comm._kernels.allreduce import (
    ALL_STAGES_ONE_SHOT,
    ALL_STAGES_TWO_SHOT,
    OPS,
    _one_shot_kernel,
    _two_shot_kernel,
)
from fly_comm.allreduce import NUM_WARPS
from fly_comm.layout import DATA_OFFSET, MAX_WORLD, TIMEOUT_SLOT
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage

_TYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
# What the tests look for: the release signal and the acquire wait at system scope, the barrier, 16-byte vector
# loads of peer data through L2 (.cg) and 16-byte stores.
_PATTERN = re.compile(r"atom\.global\.sys\.release\.exch\.b64|ld\.global\.sys\.acquire\.b64|"
                      r"atom\.global\.sys\.acquire\.add\.u64|bar\.sync|ld\.global\.cg\.v4\.b32|st\.global\.v4\.b32")


def variant(kernel, dtype, world, spin_limit=0, op="sum"):
    two = kernel is _two_shot_kernel
    sig = {"inp": f"*{dtype}", "out": f"*{dtype}", "ptrs": "*i64", "state": "*i64", "n": "i32", "rank": "i32"}
    if two:
        sig["S"] = "i32"
    const = dict(WORLD=world, BLOCK=(16 // _TYPES[dtype]) * 32 * NUM_WARPS, HALF_BYTES=8 << 20, OP=OPS[op],
                 STAGES=ALL_STAGES_TWO_SHOT if two else ALL_STAGES_ONE_SHOT, SPIN_LIMIT=spin_limit,
                 DATA_OFF=DATA_OFFSET, MAX_W=MAX_WORLD, TIMEOUTS=TIMEOUT_SLOT)  # fmt: skip
    # A launch on real tensors: 16-byte aligned pointers, n a multiple of 16 (odd sizes compile a masked variant)
    aligned = divisible_by_16(["inp", "out", "ptrs", "state", "n", *(["S"] if two else [])])
    return compile_sm90(kernel, sig, const, aligned, num_warps=NUM_WARPS, num_stages=1)


VARIANTS = [
    (_one_shot_kernel, "bf16", 2), (_one_shot_kernel, "fp32", 8), (_one_shot_kernel, "fp16", 4),
    (_two_shot_kernel, "bf16", 8), (_two_shot_kernel, "fp32", 2), (_two_shot_kernel, "fp16", 4),
]  # fmt: skip

if __name__ == "__main__":
    for kernel, dtype, world in VARIANTS:
        try:
            k = variant(kernel, dtype, world)
            found = sorted(set(_PATTERN.findall(k.asm["ptx"])))
            print("ok", kernel.__name__, dtype, world, resource_usage(k), ",".join(found), flush=True)
        except Exception as e:  # report every variant, then let the test name the failures
            print("FAIL", type(e).__name__, str(e).strip().splitlines()[-1][:300], flush=True)
    k = variant(_one_shot_kernel, "bf16", 2, spin_limit=100)  # the debugging variant compiles too
    print("ok spin_limit", resource_usage(k), flush=True)
