"""Make Triton's CPU interpreter compute and check what the GPU does, where it differs.

fp32 <-> bf16. The interpreter converts fp32 to bf16 (``x.to(tl.bfloat16)``, and
every store of fp32 values through a bf16 pointer) by dropping the low 16 bits
of the fp32 word: truncation toward zero. Compiled kernels round to nearest even
(``cvt.rn.bf16.f32`` on NVIDIA), so an interpreted kernel gave a result up to
one bf16 unit away from the GPU's, and a kernel that rounds on purpose (a norm
normalizing the bf16 sum it stores as residual_out) computed something else on
the CPU than on the GPU. Its bf16 -> fp32 conversion turned bf16 subnormals
into wrong values or zero (the GPU's is exact: the bf16 bits are the fp32
word's upper half). Both conversions become the GPU's; every other cast is left
to the interpreter (fp32 -> fp16 goes through numpy's ``astype``, which already
rounds to nearest even).

Tensor descriptors. A TMA descriptor needs every stride but the last to be a
multiple of 16 bytes. Some interpreters (Triton 3.5's) count the stride in
elements against 16, refusing descriptors the GPU takes (an fp16 matrix of 40
columns: 80 bytes a row); the check becomes the byte one, the rest of the
validation unchanged.

:func:`apply` installs both; only the interpreter is touched, and only while
kernels run interpreted.
"""

from __future__ import annotations

import numpy as np

_APPLIED = False


def fp32_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) nearest to fp32 ``data`` (ties to even); NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return out.astype(np.uint16).reshape(np.shape(data))


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """The fp32 values of bf16 bit patterns (uint16): exact, subnormals included."""
    wide = np.ascontiguousarray(bits).view(np.uint16).astype(np.uint32) << np.uint32(16)
    return wide.view(np.float32).reshape(np.shape(bits))


def _validate_descriptor(self):
    """The interpreter's descriptor check, strides in bytes (the module docstring)."""
    assert self.base.data.item() % 16 == 0, "base must be 16-byte aligned"
    assert len(self.strides) == self.ndim
    assert len(self.block_shape) == self.ndim
    assert self.ndim >= 1, "descriptor cannot be 0 dimensional"
    itemsize = self.base.dtype.element_ty.primitive_bitwidth // 8
    for stride in self.strides[:-1]:
        assert stride.data.item() * itemsize % 16 == 0, "stride must be 16-byte aligned"
    assert self.strides[-1].data.item() == 1, "last dim must be contiguous"


def apply() -> bool:
    """Patch the interpreter's cast and descriptor check (idempotent); True when the cast patch is in place
    (the descriptor check is patched where the interpreter has descriptors)."""
    global _APPLIED
    if _APPLIED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - an interpreter-less Triton build
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if original is None or handle is None:  # pragma: no cover - a Triton laid out differently: leave it alone
        return False

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(fp32_to_bf16_bits(src.data), dst_type.scalar)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return handle(bf16_bits_to_fp32(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl.__wrapped__ = original
    builder.cast_impl = cast_impl
    descriptor = getattr(interpreter, "TensorDescHandle", None)
    if descriptor is not None and hasattr(descriptor, "validate"):
        descriptor.validate = _validate_descriptor
    _APPLIED = True
    return True
