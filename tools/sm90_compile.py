"""Compile FlyDSL kernels for sm_90 on a machine without a GPU and report registers and spills.

    python tools/sm90_compile.py norm_fwd norm_bwd      (cases below; default: all)
    python tools/sm90_compile.py --ops DIR staged       (also each case's SASS opcodes, one a line, in DIR)
    python tools/sass_compare.py DIR_A DIR_B            (two trees' opcodes: counts and how alike)

Triton compiles for an explicit target without a device; ptxas (shipped in the
triton wheel) reports each kernel's registers and stack; no launch happens.
Used to check register budgets before spending device time: a program of
W warps that needs more than 65536 / (32 * W * k) registers a thread cannot
keep k programs resident on an SM.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("FLYDSL_INTERPRET", "0")  # compile for the GPU target even on a machine without one
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import flydsl  # noqa: E402, F401 - backend choice before triton
from fly_norm import _split_host as split_host  # noqa: E402
from fly_norm import routing  # noqa: E402
from fly_norm._exchange_host import slot_lanes  # noqa: E402
from fly_norm._kernels import norm, resident, split  # noqa: E402
from fly_norm._kernels import softmax as softmax_kernels  # noqa: E402
from fly_norm.autotune import bwd_default_row_config  # noqa: E402

softmax = importlib.import_module("fly_norm.softmax")  # the module (the package exports the function)

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(kernel, signature: dict, constexprs: dict, num_warps: int, maxnreg=None, ops: Path | None = None) -> str:
    """'REG:n STACK:n SHARED:n' of ``kernel`` compiled for sm_90 with ``signature`` (name -> Triton type);
    with ``ops``, the SASS opcodes (predicates and operands dropped) written there, one a line."""
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    # pointers 16-byte aligned, and N and row strides multiples of 16 (as Triton specializes them for the
    # benchmarks' widths: it is what lets masked row loads vectorize)
    aligned = [n for n, t in sig.items() if t.startswith("*") or n == "N" or n.startswith("stride")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    if getattr(kernel, "_flydsl_gluon", False):  # flyc.gluon_kernel
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(kernel, sig, constexprs, attrs)
    else:
        src = ASTSource(kernel, sig, constexprs, attrs)
    compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "maxnreg": maxnreg})
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "-sass", cubin], capture_output=True, text=True).stdout if ops else ""
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    report = m.group(0) if m else out.strip()
    if ops:
        lines = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", x).split(";")[0].strip() for x in sass.splitlines()
                 if re.match(r"^\s*/\*[0-9a-f]{4}\*/", x)]  # fmt: skip
        codes = [re.sub(r"^@!?U?P[0-9T] ", "", x).split(" ")[0] for x in lines if x]
        ops.write_text("\n".join(codes) + "\n")
        report += f" INSTRUCTIONS:{len(codes)}"
    return report


def _norm_fwd_operands(quant=0, residual=False, stats=False, bias=False):
    """(pointer signature, None constexprs) of the norm forward kernels' optional operands."""
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*i8" if quant else "*bf16"}
    present = {"qs_ptr": quant, "r_ptr": residual, "h_ptr": residual, "rstd_ptr": stats, "mean_ptr": stats,
               "b_ptr": bias, "s_ptr": False}
    dtypes = {"qs_ptr": "*fp32", "rstd_ptr": "*fp32", "mean_ptr": "*fp32"}
    ptrs.update({k: dtypes.get(k, "*bf16") for k, on in present.items() if on})
    return ptrs, {k: None for k, on in present.items() if not on}


def _fwd(block_m, block_n, warps, single, is_rms=True, residual=False, stats=False, fixed=0):
    ptrs, consts = _norm_fwd_operands(residual=residual, stats=stats)
    sig = {**ptrs, "M": "i32", "N": "i32", "stride_x": "i32", "stride_r": "i32", "stride_y": "i32",
           "stride_h": "i32", "eps": "fp32", "weight_offset": "fp32"}
    consts.update(IS_RMS=is_rms, HAS_RESIDUAL=residual, HAS_WEIGHT=True, HAS_BIAS=False, HAS_SMOOTH=False,
                  STORE_STATS=stats, QUANT=0, QMAX=127.0, BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single,
                  N_FIXED=fixed, PACKED=False)
    return norm.norm_fwd_kernel, sig, consts, warps


def _bwd(block_m, block_n, warps, single, is_rms=True, db=False, pipelined=0):
    sig = {"h_ptr": "*bf16", "w_ptr": "*bf16", "dy_ptr": "*bf16", "dres_ptr": "*bf16", "mean_ptr": "*fp32",
           "rstd_ptr": "*fp32", "dx_ptr": "*bf16", "dwp_ptr": "*fp32", "dbp_ptr": "*fp32", "c_ptr": "*fp32",
           "M": "i32", "N": "i32", "stride_h": "i32", "stride_dy": "i32", "stride_dres": "i32", "stride_dx": "i32",
           "weight_offset": "fp32"}
    consts = dict(IS_RMS=is_rms, HAS_WEIGHT=True, HAS_DRES=False, COMPUTE_DW=True, COMPUTE_DB=db,
                  BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, PIPELINED=pipelined)
    return norm.norm_bwd_kernel, sig, consts, warps


def _split(is_rms=True, residual=False, stats=False, parts=16, quant=0, cfg=None):
    """The split norm forward at its default (slice, warps, cap) config, or ``cfg``."""
    cfg = cfg or (split_host.FWD_SLICE if is_rms else split_host.LN_FWD_SLICE)
    ptrs, consts = _norm_fwd_operands(quant, residual, stats, bias=not is_rms)
    ptrs.update(slot_ptr="*i64")
    sig = {**ptrs, "M": "i32", "N": "i32", "parts": "i32", "stride_x": "i32", "stride_r": "i32", "stride_y": "i32",
           "stride_h": "i32", "eps": "fp32", "weight_offset": "fp32"}
    consts.update(IS_RMS=is_rms, HAS_RESIDUAL=residual, HAS_WEIGHT=True, HAS_BIAS=not is_rms, HAS_SMOOTH=False,
                  STORE_STATS=stats, QUANT=quant, QMAX=127.0, SLICE=cfg.slice_cols, PARTS_POW2=parts,
                  SPIN_LIMIT=split_host.SPIN_LIMIT)
    return split.norm_fwd_split_kernel, sig, consts, (cfg.warps, cfg.maxnreg)


def _softmax_split(backward=False, parts=16, cfg=None):
    cfg = cfg or (split_host.SOFTMAX_BWD_SLICE if backward else split_host.FWD_SLICE)
    slice_cols, warps = cfg.slice_cols, (cfg.warps, cfg.maxnreg)
    consts = dict(SLICE=slice_cols, PARTS_POW2=parts, SPIN_LIMIT=split_host.SPIN_LIMIT)
    if backward:
        sig = {"dy_ptr": "*bf16", "y_ptr": "*bf16", "dx_ptr": "*bf16", "slot_ptr": "*i64",
               "M": "i32", "N": "i32", "parts": "i32", "stride_dy": "i32", "stride_y": "i32", "stride_dx": "i32"}
        consts["LANES"] = slot_lanes(parts, cfg.warps, 32)
        return split.softmax_bwd_split_kernel, sig, consts, warps
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "slot_ptr": "*i64", "M": "i32", "N": "i32",
           "parts": "i32", "stride_x": "i32", "stride_y": "i32"}
    return split.softmax_fwd_split_kernel, sig, consts, warps


def _bwd_split(is_rms=True, parts=4):
    sig = {"h_ptr": "*bf16", "w_ptr": "*bf16", "dy_ptr": "*bf16", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
           "dx_ptr": "*bf16", "dwp_ptr": "*fp32", "slot_ptr": "*i64", "M": "i32", "N": "i32",
           "parts": "i32", "stride_h": "i32", "stride_dy": "i32", "stride_dres": "i32", "stride_dx": "i32",
           "weight_offset": "fp32"}
    consts = dict(dres_ptr=None, IS_RMS=is_rms, HAS_WEIGHT=True, HAS_DRES=False, COMPUTE_DW=True,
                  COMPUTE_DB=not is_rms, SLICE=split_host.BWD_SLICE.slice_cols, PARTS_POW2=parts,
                  SPIN_LIMIT=split_host.SPIN_LIMIT, ROWS=split_host.BWD_ROWS)
    if is_rms:
        consts.update(dbp_ptr=None)
    else:
        sig.update(dbp_ptr="*fp32")
    return split.norm_bwd_split_kernel, sig, consts, (split_host.BWD_SLICE.warps, split_host.BWD_SLICE.maxnreg)


def _bwd_tiled(is_rms=True, cfg=(1024, 4, None, 4)):
    """The tiled split backward (split.BWD_TILED) at a (slice, warps, cap, rows[, lead]) config."""
    _, sig, consts, _ = _bwd_split(is_rms)
    cfg = split_host.TiledConfig(*cfg)
    return split.norm_bwd_tiled_kernel, sig, dict(consts, SLICE=cfg.slice_cols, ROWS=cfg.tile_rows, LEAD=cfg.lead), (
        cfg.warps, cfg.maxnreg)


def _bwd_staged(is_rms=True, dres=False, cfg=None):
    """The staged split backward (split.BWD_STAGED: slice, warps, stages), bf16 rows."""
    _, sig, consts, _ = _bwd_split(is_rms)
    cfg = split_host.StagedConfig(*cfg) if cfg else split_host.BWD_STAGED
    slice_cols, warps, stages = cfg.slice_cols, cfg.warps, cfg.stages
    consts = dict(consts, SLICE=slice_cols, STAGES=stages, HAS_DRES=dres, PARTS_POW2=4)
    del consts["ROWS"]
    if dres:
        del consts["dres_ptr"]
        sig = dict(sig, dres_ptr="*bf16")
    return split.norm_bwd_staged_kernel, sig, consts, warps


def _fwd_staged(is_rms=True, parts=16):
    """The staged norm forward (split.FWD_STAGED: slice, warps, stages), bf16 rows, weight (and bias), stats,
    the pooled slots' clear."""
    cfg = split_host.FWD_STAGED
    slice_cols, warps, stages = cfg.slice_cols, cfg.warps, cfg.stages
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "mean_ptr": "*fp32",
           "rstd_ptr": "*fp32", "slot_ptr": "*i64", "clear_ptr": "*i64", "M": "i32", "N": "i32", "parts": "i32",
           "stride_x": "i32", "stride_y": "i32", "eps": "fp32", "weight_offset": "fp32", "clear_n": "i32"}
    consts = dict(IS_RMS=is_rms, HAS_WEIGHT=True, HAS_BIAS=not is_rms, STORE_STATS=True, SLICE=slice_cols,
                  PARTS_POW2=parts, SPIN_LIMIT=split_host.SPIN_LIMIT, STAGES=stages)
    if is_rms:
        del sig["b_ptr"], sig["mean_ptr"]
        consts.update(b_ptr=None, mean_ptr=None)
    return split.norm_fwd_staged_kernel, sig, consts, warps


def _softmax_fwd(block_m, block_n, warps, single):
    """The softmax forward kernel (fly_norm.softmax) at one row config."""
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "stride_x": "i32", "stride_y": "i32"}
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, N_FIXED=0)
    return softmax_kernels.softmax_fwd_kernel, sig, consts, warps


def _resident(chunks, parts=1, even=True):
    """The resident softmax forward (resident.RESIDENT) with slices of ``chunks`` chunks, ``parts`` a row."""
    cfg = split_host.RESIDENT
    chunk, ring, warps = cfg.chunk, cfg.ring, cfg.warps
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "slot_ptr": "*i64", "M": "i32", "N": "i32", "P": "i32",
           "groups": "i32", "stride_x": "i32", "stride_y": "i32"}
    consts = dict(CHUNK=chunk, CHUNKS=chunks, RING=ring, WARPS=warps, EVEN=even, PP=parts,
                  SPIN_LIMIT=split_host.SPIN_LIMIT)
    return resident.softmax_fwd_resident_kernel, sig, consts, warps


CASES = {
    "norm_split": [("rms bwd", _bwd_split()), ("ln bwd", _bwd_split(is_rms=False)),
                   ("rms", _split()), ("ln", _split(is_rms=False)),
                   ("ln res+stats", _split(is_rms=False, residual=True, stats=True)),
                   ("rms int8", _split(quant=1)),
                   ("softmax fwd", _softmax_split()), ("softmax bwd", _softmax_split(backward=True)),
                   ("rms bwd tiled 1024x4 w4", _bwd_tiled()), ("ln bwd tiled 1024x4 w4", _bwd_tiled(is_rms=False)),
                   ("rms bwd tiled 2048x4 w4", _bwd_tiled(cfg=(2048, 4, None, 4))),
                   ("rms bwd tiled 2048x4 w4 lead", _bwd_tiled(cfg=(2048, 4, None, 4, 1))),
                   ("ln bwd tiled 1024x4 w4 lead", _bwd_tiled(is_rms=False, cfg=(1024, 4, None, 4, 1))),
                   ("rms bwd tiled 2048x2 w4 lead", _bwd_tiled(cfg=(2048, 4, None, 2, 1))),
                   ("rms bwd tiled 2048x2 w4 lead2", _bwd_tiled(cfg=(2048, 4, None, 2, 2))),
                   ("ln bwd tiled 1024x4 w4 lead2", _bwd_tiled(is_rms=False, cfg=(1024, 4, None, 4, 2))),
                   ("rms bwd staged", _bwd_staged()), ("ln bwd staged", _bwd_staged(is_rms=False)),
                   ("rms bwd staged dres", _bwd_staged(dres=True)),
                   ("ln bwd staged dres", _bwd_staged(is_rms=False, dres=True))],
    # The staged kernels (bf16 rows from 64K columns forward, 8K+ backward)
    "staged": [("ln fwd staged", _fwd_staged(is_rms=False)), ("rms fwd staged", _fwd_staged()),
               ("ln bwd staged", _bwd_staged(is_rms=False)), ("rms bwd staged", _bwd_staged())],
    "resident": [("softmax 64K (four slices)", _resident(8, parts=4)), ("softmax 128K (eight)", _resident(8, parts=8)),
                 ("softmax 1M (sixty-four)", _resident(8, parts=64))],
    "softmax_fwd": [("softmax chunked 4096 w16", _softmax_fwd(1, 4096, 16, False)),
                    ("softmax 1x16384 w8", _softmax_fwd(1, 16384, 8, True))],
    # The wide rows' slices (split_host.FWD_SLICE_WIDE)
    "split_wide": [("rms wide", _split(cfg=split_host.FWD_SLICE_WIDE, parts=32)),
                   ("softmax wide", _softmax_split(cfg=split_host.FWD_SLICE_WIDE, parts=32)),
                   ("softmax bwd wide",
                    _softmax_split(backward=True, parts=128, cfg=split_host.SOFTMAX_BWD_SLICE_WIDE))],
    "norm_fwd": [("rms 4x1024 w4", _fwd(4, 1024, 4, True)), ("rms 1x16384 w16", _fwd(1, 16384, 16, True)),
                 ("rms 1x32768 w16", _fwd(1, 32768, 16, True)), ("rms 1x32768 w32", _fwd(1, 32768, 32, True)),
                 ("ln 1x16384 w16", _fwd(1, 16384, 16, True, is_rms=False)),
                 ("rms chunked 4096 w16", _fwd(1, 4096, 16, False)),
                 ("ln chunked 4096 w16", _fwd(1, 4096, 16, False, is_rms=False)),
                 ("rms chunked 4096 w32 N=32768", _fwd(1, 4096, 32, False, fixed=32768)),
                 ("ln chunked 8192 w32 N=32768", _fwd(1, 8192, 32, False, is_rms=False, fixed=32768)),
                 ("ln chunked 4096 w16 N=16384", _fwd(1, 4096, 16, False, is_rms=False, fixed=16384)),
                 ("rms res+stats 1x4096 w8", _fwd(1, 4096, 8, True, residual=True, stats=True))],
    # The backward defaults of both norms (fly_norm.autotune), row widths 256-16K.
    "norm_bwd": [
        (f"{op} {c.block_m}x{c.block_n} w{c.num_warps}",
         _bwd(c.block_m, c.block_n, c.num_warps, c.single_pass, is_rms=op == "rms", db=op == "ln"))
        for op, elems in (("rms", 16), ("ln", 8))
        for c in (bwd_default_row_config(n, "sm_90", elems) for n in (256, 1024, 2048, 4096, 8192, 16384))
    ] + [("rms pipelined 1x16384 w16", _bwd(1, 16384, 16, True, pipelined=routing.PIPELINED_BWD_STAGES))],
}


def main(argv: list[str]) -> int:
    ops_dir = None
    if argv[:1] == ["--ops"]:
        ops_dir = Path(argv[1])
        ops_dir.mkdir(parents=True, exist_ok=True)
        argv = argv[2:]
    for group in argv or list(CASES):
        for label, (kernel, sig, consts, warps) in CASES[group]:
            opts = warps if isinstance(warps, tuple) else (warps,)  # num_warps[, maxnreg]
            ops = ops_dir / f"{group}-{label.replace(' ', '_')}.ops" if ops_dir else None
            try:
                print(f"{group:9s} {label:28s} {resources(kernel, sig, consts, *opts, ops=ops)}", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the next case
                print(f"{group:9s} {label:28s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
