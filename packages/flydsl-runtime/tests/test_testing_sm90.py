"""``flydsl.testing.sm90``: compiling a kernel for sm_90 on a machine without a GPU (Triton's bundled ptxas and
cuobjdump), the argument rules, and the resource report the families' compile checks parse."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

from flydsl.testing import sm90

# Compiled in a process of its own: the process must compile, not interpret, and flydsl chooses that once,
# before triton is imported. One kernel, compiled with its pointers and length marked divisible by 16 (some by
# name, one by Triton's index key) and without: the marks must reach the compiler (vector loads) or the code
# compiled is not the code a GPU launch runs.
_SCRIPT = """
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.testing.sm90 import compile_sm90, divisible_by_16, resource_usage, signature


@flyc.kernel
def add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: fx.constexpr):
    offs = fx.program_id(0) * BLOCK + fx.arange(0, BLOCK)
    mask = offs < n
    x = fx.load(x_ptr + offs, mask=mask)
    y = fx.load(y_ptr + offs, mask=mask)
    fx.store(out_ptr + offs, x + alpha * y, mask=mask)


sig = signature(add_kernel, pointer="*fp32", floats=("alpha",))
out_index = add_kernel.arg_names.index("out_ptr")
attrs = {**divisible_by_16(["x_ptr", "y_ptr", "n"]), (out_index,): [["tt.divisibility", 16]]}
for name, marks in (("aligned", attrs), ("plain", None)):
    k = compile_sm90(add_kernel, sig, {"BLOCK": 1024}, marks, num_warps=4, num_stages=2)
    ptx = k.asm["ptx"]
    print(name, resource_usage(k), f"target:{int('.target sm_90' in ptx)}", f"ld:{int('ld.global' in ptx)}",
          f"st:{int('st.global' in ptx)}", f"v4:{int('ld.global.v4' in ptx)}", flush=True)
"""


def _compile_lines(tmp_path) -> dict[str, str]:
    tools = sm90.toolchain_dir()
    missing = [t for t in ("ptxas", "cuobjdump") if not (tools / t).exists()]
    if missing:
        pytest.skip(f"cannot compile for sm_90 here: this Triton ships no {' / '.join(missing)} in {tools}")
    script = tmp_path / "add_sm90.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = {**os.environ, "FLYDSL_INTERPRET": "0", "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode:
        first = (res.stderr.strip().splitlines() or ["?"])[-1]
        if "ptxas" in res.stderr or "CUDA" in first:  # no usable toolchain on this machine: nothing to learn here
            pytest.skip(f"cannot compile for sm_90 here: {first}")
        raise AssertionError(res.stderr[-3000:])
    return {ln.split()[0]: ln for ln in res.stdout.splitlines()}


def test_compiles_for_sm90_with_register_count_no_spill_and_the_ptx(tmp_path):
    lines = _compile_lines(tmp_path)
    assert set(lines) == {"aligned", "plain"}, lines
    for line in lines.values():
        m = re.search(r"REG:(\d+) STACK:(\d+)", line)
        assert m, line
        assert 0 < int(m.group(1)) <= 255 and int(m.group(2)) == 0, line
        assert "target:1 ld:1 st:1" in line, line
    # the divisibility marks reach the compiler: 16-byte loads only where the pointers are known aligned
    assert "v4:1" in lines["aligned"] and "v4:0" in lines["plain"], lines


def _fake_kernel(*names):
    return types.SimpleNamespace(arg_names=list(names), fn=types.SimpleNamespace(__name__="k"))


def test_signature_rule():
    fn = _fake_kernel("a_ptr", "b_ptr", "scale", "n", "BLOCK")
    got = sm90.signature(fn, {"b_ptr": "*i32", "other_kernels_ptr": "*fp8e4nv"}, pointer="*bf16", floats=("scale",))
    assert got == {"a_ptr": "*bf16", "b_ptr": "*i32", "scale": "fp32", "n": "i32", "BLOCK": "i32"}
    # without a pointer type, pointers need an entry of their own or take the default
    assert sm90.signature(fn, default="i64")["a_ptr"] == "i64"
    assert sm90.divisible_by_16(["a_ptr"]) == {"a_ptr": [["tt.divisibility", 16]]}


@pytest.mark.parametrize(
    "sig, consts, attrs, message",
    [
        ({"a_ptr": "*fp32", "n": "i32"}, {"BLOCKK": 4}, None, "constexprs: 'BLOCKK' is not an argument of k"),
        ({"a_ptr": "*fp32", "m": "i32"}, {"BLOCK": 4}, None, "signature: 'm' is not an argument of k"),
        ({"a_ptr": "*fp32"}, {"BLOCK": 4}, None, "signature: no type for 'n' of k"),
        ({"a_ptr": "*fp32", "n": "i32"}, {"BLOCK": 4}, {"x_ptr": []}, "attrs: 'x_ptr' is not an argument of k"),
    ],
)
def test_bad_arguments_are_named(sig, consts, attrs, message):
    fn = _fake_kernel("a_ptr", "n", "BLOCK")
    with pytest.raises(ValueError, match=re.escape(message)):
        sm90.compile_sm90(fn, sig, consts, attrs, num_warps=4, num_stages=2)


def test_resource_usage_without_a_report_is_unknown():
    if not (sm90.toolchain_dir() / "cuobjdump").exists():
        pytest.skip(f"this Triton ships no cuobjdump in {sm90.toolchain_dir()}")
    not_a_cubin = types.SimpleNamespace(asm={"cubin": b"\x7fELF but not a cubin"})
    assert sm90.resource_usage(not_a_cubin) == "REG:? STACK:?"
