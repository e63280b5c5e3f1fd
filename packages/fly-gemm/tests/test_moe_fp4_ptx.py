"""The MXFP4 decode's inline PTX (``_kernels.moe_gemm._FP4_ASM``), which the interpreter cannot run: each of its
instructions emulated on the CPU, over every byte in every position of the 4-byte pack and scales from 2**-126
to 2**127, against the e2m1 table; and the launch rule that chooses it."""

from __future__ import annotations

import struct

import pytest
import torch

from fly_gemm._kernels.moe_gemm import _FP4_ASM, _fp4_asm
from fly_gemm.moe_config import MoeConfig

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte c[4i:4i+3] of {b, a}, or its sign
    replicated where bit 4i+3 of c is set."""
    src = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 15
        byte = src[sel & 7]
        if sel & 8:
            byte = 255 if byte & 128 else 0
        out |= byte << (8 * i)
    return out


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bf16_bits(x: float) -> int:
    return torch.tensor(x, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    """``fma.rn.bf16x2`` of halves: a * b + c rounded once to bf16 (exact products here, powers of two)."""
    out = 0
    for half in (0, 16):
        x, y, z = (_bf16(v >> half) for v in (a, b, c))
        r = x * y + z if not (x * y == 0 and z == 0) else x * y  # -0 + -0 stays -0; +0 + -0 is +0
        out |= _bf16_bits(r) << half
    return out


def _run(packed: int, scales: tuple[int, int]) -> list[int]:
    """Execute _FP4_ASM on one 4-byte pack with bf16x2 scale registers: the four output registers."""
    regs = {"$4": packed, "$5": scales[0], "$6": scales[1]}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & MASK if tok[0].isdigit() else regs[tok]

    body = _FP4_ASM.value if hasattr(_FP4_ASM, "value") else _FP4_ASM
    for stmt in body.replace("{", "").replace("}", "").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & MASK
        elif op == "prmt.b32":
            r = _prmt(*v)
        elif op == "fma.rn.bf16x2":
            r = _fma_bf16x2(*v)
        else:
            raise AssertionError(f"the emulator has no {op!r}")
        regs[d] = r
    return [regs[f"${i}"] for i in range(4)]


def _value(code: int) -> float:
    v = E2M1[code & 7]
    return -v if code & 8 else v


@pytest.mark.parametrize("exponent", [-126, -20, 0, 7, 127])
def test_fp4_ptx_decodes_every_byte_in_every_position(exponent):
    scale = _bf16_bits(2.0**exponent)
    scales = (scale | scale << 16, scale | scale << 16)
    for byte in range(256):
        for pos in range(4):
            filler = [0x5A, 0xC3, 0x07, 0xF0]  # other bytes of the pack, to catch cross-talk
            pack = [filler[(pos + i) % 4] for i in range(4)]
            pack[pos] = byte
            word = sum(b << (8 * i) for i, b in enumerate(pack))
            lo01, lo23, hi01, hi23 = _run(word, scales)
            lo = [lo01 & 0xFFFF, lo01 >> 16, lo23 & 0xFFFF, lo23 >> 16]
            hi = [hi01 & 0xFFFF, hi01 >> 16, hi23 & 0xFFFF, hi23 >> 16]
            for j, b in enumerate(pack):
                for got, code in ((lo[j], b & 15), (hi[j], b >> 4)):
                    want = _value(code) * 2.0**exponent
                    assert got == _bf16_bits(want), (hex(word), j, code, _bf16(got), want)


def test_fp4_ptx_rule():
    decode = MoeConfig(16, 64, 32, 1, 4)
    assert _fp4_asm(True, 32, decode)
    assert not _fp4_asm(False, 32, decode)  # fp16 activations or int4: the fp32 decode
    assert not _fp4_asm(True, 16, decode)  # a step over two scale groups
    assert not _fp4_asm(True, 32, MoeConfig(64, 128, 32, 1, 4))  # warpgroup-MMA tiles keep the fp32 decode
    assert not _fp4_asm(True, 32, MoeConfig(16, 32, 32, 1, 8))  # 512 bytes over 256 threads: not whole packs
