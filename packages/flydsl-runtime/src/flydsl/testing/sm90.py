"""Compile a kernel for sm_90 (H100 / H200) on a machine without a GPU, to check what the compiler makes of it.

Triton's interpreter, which runs the CPU suites, accepts code the compiler rejects (module globals that are not
constexpr, a loop-carried value changing type) and says nothing about registers, spills or the instructions a
kernel becomes. These helpers compile for ``GPUTarget("cuda", 90, 32)`` with the ``ptxas`` and ``cuobjdump``
bundled in Triton's wheel (``triton/backends/nvidia/bin``), so a CPU-only test can assert that a kernel
compiles, that it does not spill (``resource_usage``: ``STACK:0``), how much shared memory it takes
(``compiled.metadata.shared``) and what its PTX holds (``compiled.asm["ptx"]``: ``wgmma.mma_async``,
``cp.async.bulk.tensor``, ...).

The process must compile rather than interpret, and ``flydsl`` picks that once, before ``triton`` is
imported: tests run a script of their own in a fresh process with ``FLYDSL_INTERPRET=0`` (this module imports
``triton`` only inside its functions), have it print one line a variant, and parse those lines; a machine
whose Triton lacks the toolchain makes the script fail with a ptxas / CUDA error, and the test skips::

    from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage, signature

    k = compile_sm90(kernel, signature(kernel, {"x_ptr": "*bf16"}, floats=("scale",)), {"BLOCK": 128},
                     divisible_by_16(["x_ptr", "stride_x"]), num_warps=4, num_stages=2)
    print("ok", k.metadata.shared, resource_usage(k))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "SM90", "compile_sm90", "signature", "divisible_by_16", "resource_usage", "toolchain_dir", "run_compile_script",
]  # fmt: skip

# (backend, compute capability, warp size) of the target
SM90 = ("cuda", 90, 32)


def _arg_index(fn, name: str, what: str) -> int:
    names = list(fn.arg_names)
    try:
        return names.index(name)
    except ValueError:
        raise ValueError(f"{what}: {name!r} is not an argument of {_fn_name(fn)} (arguments: {names})") from None


def _fn_name(fn) -> str:
    return getattr(getattr(fn, "fn", fn), "__name__", repr(fn))


def signature(
    fn,
    types: Mapping[str, str] | None = None,
    *,
    pointer: str | None = None,
    floats: Iterable[str] = (),
    default: str = "i32",
) -> dict[str, str]:
    """The Triton type of every argument of ``fn``, by a rule: ``types[name]`` where given, else ``pointer``
    for a name ending in ``_ptr`` (when ``pointer`` is given), else ``"fp32"`` for a name in ``floats``, else
    ``default``. Names that are not arguments of ``fn`` are ignored, so one rule serves kernels of one family;
    constexpr arguments need no entry: :func:`compile_sm90` marks them itself."""
    types = dict(types or {})
    floats = set(floats)
    out = {}
    for name in fn.arg_names:
        if name in types:
            out[name] = types[name]
        elif pointer is not None and name.endswith("_ptr"):
            out[name] = pointer
        elif name in floats:
            out[name] = "fp32"
        else:
            out[name] = default
    return out


def divisible_by_16(names: Iterable[str]) -> dict[str, list]:
    """``attrs`` for :func:`compile_sm90` marking ``names`` divisible by 16 (pointers 16-byte aligned, integers
    multiples of 16), as Triton's launcher marks such arguments of a real launch; without it loads are not
    vectorized and the compiled code is not the code a GPU runs."""
    return {name: [["tt.divisibility", 16]] for name in names}


def compile_sm90(
    fn,
    signature: Mapping[str, str],
    constexprs: Mapping[str, object],
    attrs: Mapping[Any, list] | None = None,
    *,
    num_warps: int,
    num_stages: int,
    **options,
):
    """Compile the Triton kernel ``fn`` for sm_90 and return the compiled kernel (``.asm["ptx"]``,
    ``.asm["cubin"]``, ``.metadata.shared``, ...).

    ``signature``: argument name -> Triton type (``"*bf16"``, ``"fp32"``, ``"i32"``, ...) of every argument that
    is not in ``constexprs``. ``constexprs``: argument name -> value, for ``tl.constexpr`` parameters and for
    arguments specialized to a constant (``None`` for a pointer a variant does not use); they take precedence
    over ``signature``. ``attrs``: argument name (or Triton's ``(index,)`` key) -> Triton attributes, e.g. from
    :func:`divisible_by_16`. Further ``options`` go to ``triton.compile`` with ``num_warps`` / ``num_stages``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {(_arg_index(fn, name, "constexprs"),): value for name, value in constexprs.items()}
    for name in signature:
        _arg_index(fn, name, "signature")
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in signature:
            sig[name] = signature[name]
        else:
            raise ValueError(f"signature: no type for {name!r} of {_fn_name(fn)} (and it is not in constexprs)")
    keyed = {}
    for key, value in (attrs or {}).items():
        keyed[(_arg_index(fn, key, "attrs"),) if isinstance(key, str) else tuple(key)] = value
    src = ASTSource(fn, sig, consts, keyed)
    opts = {"num_warps": num_warps, "num_stages": num_stages, **options}
    return triton.compile(src, target=GPUTarget(*SM90), options=opts)


def toolchain_dir():
    """The folder of the ``ptxas`` / ``cuobjdump`` bundled with Triton (a ``pathlib.Path``; it may not exist)."""
    from pathlib import Path

    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def resource_usage(compiled) -> str:
    """``"REG:n STACK:n"`` of the compiled kernel's cubin, from ``cuobjdump -res-usage`` (Triton's bundled
    one); ``"REG:? STACK:?"`` when the tool reports no such line. STACK > 0 is a register spill (a local-memory
    stack frame); REG is the registers a thread holds, which bounds the blocks an SM keeps resident."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        res = subprocess.run(
            [str(toolchain_dir() / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True
        )
    m = re.search(r"REG:(\d+) STACK:(\d+)", res.stdout)
    return m.group(0) if m else "REG:? STACK:?"


def run_compile_script(script, *args: str, shards: int = 1, timeout: float = 600) -> list[str]:
    """Run a compile script in fresh processes with compiled Triton (``FLYDSL_INTERPRET=0``) and return the lines
    it printed (stdout, every process's in shard order). ``script``: a path (run from its folder, so it imports
    its neighbours) or Python source (``python -c``). ``shards`` > 1 runs that many processes at once, the i-th
    with the arguments ``i shards`` after ``args``. A test calling this is skipped when this machine cannot
    compile for sm_90 (a ptxas / CUDA failure and no output); any other failure raises with the stderr."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    from .. import env as _env

    env = _env.child_environment(FLYDSL_INTERPRET="0", TRITON_INTERPRET="0")
    if isinstance(script, Path):
        cmd, cwd = [sys.executable, str(script)], str(script.parent)
    else:
        cmd, cwd = [sys.executable, "-c", str(script)], None
    runs = [[*args, str(i), str(shards)] if shards > 1 else list(args) for i in range(shards)]
    procs = [subprocess.Popen([*cmd, *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=cwd) for a in runs]  # fmt: skip
    outs = [p.communicate(timeout=timeout) for p in procs]
    lines = [ln for out, _ in outs for ln in out.strip().splitlines() if ln.strip()]
    err = "".join(e for _, e in outs)
    if any(p.returncode for p in procs):
        first = (err.strip().splitlines() or ["(no output)"])[-1]
        if not lines and ("ptxas" in err or "CUDA" in first):  # no toolchain on this machine: nothing to learn
            pytest.skip(f"cannot compile for sm_90 here: {first}")
        raise AssertionError("\n".join(lines[-20:]) + "\n" + err[-3000:])
    return lines
