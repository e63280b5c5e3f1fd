"""Check tensor descriptors in Triton's CPU interpreter as the GPU does: strides in bytes.

A TMA descriptor needs every stride but the last to be a multiple of 16 bytes. Triton 3.5's interpreter
checks the stride in elements against 16 instead, so it refuses descriptors the GPU takes (an fp16 matrix
of 40 columns: 80 bytes a row), and the CPU suites failed there while the GPU passed. From 3.6 the
interpreter checks bytes. :func:`apply` installs the byte check wherever the interpreter has descriptors;
the rest of the validation is unchanged.
"""

from __future__ import annotations

_APPLIED = False


def apply() -> bool:
    """Patch the interpreter's descriptor validation (idempotent); True when the patch is in place."""
    global _APPLIED
    if _APPLIED:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - an interpreter-less Triton build
        return False
    handle = getattr(interpreter, "TensorDescHandle", None)
    if handle is None or not hasattr(handle, "validate"):  # no descriptors in this interpreter
        return False

    def validate(self):
        assert self.base.data.item() % 16 == 0, "base must be 16-byte aligned"
        assert len(self.strides) == self.ndim
        assert len(self.block_shape) == self.ndim
        assert self.ndim >= 1, "descriptor cannot be 0 dimensional"
        itemsize = self.base.dtype.element_ty.primitive_bitwidth // 8
        for stride in self.strides[:-1]:
            assert stride.data.item() * itemsize % 16 == 0, "stride must be 16-byte aligned"
        assert self.strides[-1].data.item() == 1, "last dim must be contiguous"

    handle.validate = validate
    _APPLIED = True
    return True
