"""Argument validation shared by every family's host API.

Each check names the argument, says what was expected and what was given
(dtype, device, shape, stride, alignment), and raises the matching
:mod:`flydsl.errors` type before anything is launched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .errors import ArgumentError, DeviceError, DTypeError, LayoutError, ShapeError

__all__ = [
    "describe",
    "dtype_name",
    "check_tensor",
    "check_same_device",
    "check_same_dtype",
    "check_shape",
    "check_last_dim_contiguous",
    "check_alignment",
    "DTYPE_NAMES",
    "parse_dtype",
]

DTYPE_NAMES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "f16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "f64": torch.float64,
    "float64": torch.float64,
    "int8": torch.int8,
    "i8": torch.int8,
    "int32": torch.int32,
    "i32": torch.int32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "float8_e5m2": torch.float8_e5m2,
}

_SHORT = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


def parse_dtype(name: str, value: str | torch.dtype, allowed: Iterable[torch.dtype] | None = None) -> torch.dtype:
    """Turn "bf16" / "float16" / torch.float16 into a torch dtype, checking it is allowed."""
    if isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = DTYPE_NAMES.get(str(value).lower())
        if dtype is None:
            raise DTypeError(f"{name}: unknown dtype {value!r}; expected one of {sorted(DTYPE_NAMES)}")
    if allowed is not None:
        allowed = tuple(allowed)
        if dtype not in allowed:
            raise DTypeError(
                f"{name}: expected dtype {' or '.join(dtype_name(d) for d in allowed)}, got {dtype_name(dtype)}"
            )
    return dtype


def describe(t: torch.Tensor) -> str:
    """One-line description: dtype, shape, strides and device."""
    return f"{dtype_name(t.dtype)} tensor of shape {tuple(t.shape)}, strides {tuple(t.stride())}, on {t.device}"


def check_tensor(
    name: str,
    t,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    min_ndim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with an allowed dtype, rank and device; returns it."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise DTypeError(
                f"{name}: expected dtype {' or '.join(dtype_name(d) for d in dtypes)}, got {describe(t)}"
            )
    if ndim is not None and t.dim() != ndim:
        raise ShapeError(f"{name}: expected a {ndim}-D tensor, got {describe(t)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ShapeError(f"{name}: expected at least {min_ndim} dimension(s), got {describe(t)}")
    if device is not None and t.device != device:
        raise DeviceError(f"{name}: expected a tensor on {device}, got {describe(t)}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device | None:
    """All given (non-None) tensors on one device; returns it."""
    first_name = device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            first_name, device = name, t.device
        elif t.device != device:
            raise DeviceError(f"{name}: expected a tensor on {device} (like {first_name}), got {describe(t)}")
    return device


def check_same_dtype(**tensors: torch.Tensor | None) -> torch.dtype | None:
    """All given (non-None) tensors have one dtype; returns it."""
    first_name = dtype = None
    for name, t in tensors.items():
        if t is None:
            continue
        if dtype is None:
            first_name, dtype = name, t.dtype
        elif t.dtype != dtype:
            raise DTypeError(
                f"{name}: expected dtype {dtype_name(dtype)} (the dtype of {first_name}), got {describe(t)}"
            )
    return dtype


def check_shape(name: str, t: torch.Tensor, shape: tuple, what: str = "") -> None:
    """Exact shape match; ``what`` says where the expected shape comes from."""
    if tuple(t.shape) != tuple(shape):
        hint = f" ({what})" if what else ""
        raise ShapeError(f"{name}: expected shape {tuple(shape)}{hint}, got {describe(t)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """The innermost dimension must be dense (stride 1) unless it has one element."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise LayoutError(f"{name}: the last dimension must be contiguous (stride 1), got {describe(t)}")


def check_alignment(name: str, t: torch.Tensor, nbytes: int) -> bool:
    """True when the data pointer and every non-unit stride are multiples of ``nbytes`` bytes."""
    esize = t.element_size()
    if t.data_ptr() % nbytes:
        return False
    return all((s * esize) % nbytes == 0 for s, n in zip(t.stride(), t.shape, strict=True) if n > 1 and s != 1)
