"""The smallest case of each group of a test's parametrized cases, for runs whose cost follows the size of
the kernels' work (compute-sanitizer's racecheck, initcheck and synccheck: one 256 x 4096 x 4096 GEMM test
takes ~90 s under racecheck on an H200).

A parametrized case's **size** is the product of the integers in its parameters (in tuples, lists, dicts,
dataclasses and named tuples too; booleans are not sizes); its **group** is its test function and every
parameter with those integers blanked out (dtypes, modes, option names, flags). Each group keeps its
smallest case, so every test function runs with every combination of its non-numeric options, at the
smallest shape it lists. What that gives up: configurations that only large shapes select (a tile
heuristic's large-problem branch) and numeric options such as strides are run only as far as the smallest
case of their group has them. Unparametrized tests are all kept.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["case_size_and_shape", "smallest_cases"]


def _walk(value: Any, ints: list[int]) -> Any:
    """``value`` with each integer replaced by ``"#"`` (recorded in ``ints``), as a hashable shape."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        ints.append(abs(value))
        return "#"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple(
            (f.name, _walk(getattr(value, f.name), ints)) for f in dataclasses.fields(value)
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return (type(value).__name__,) + tuple((k, _walk(v, ints)) for k, v in zip(value._fields, value, strict=True))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_walk(v, ints) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((repr(k), _walk(v, ints)) for k, v in value.items())
    return repr(value)


def case_size_and_shape(params: dict[str, Any]) -> tuple[int, tuple]:
    """(size, group shape) of one parametrized case: the product of its integers (each at least 1), and its
    parameters with the integers blanked out."""
    ints: list[int] = []
    shape = tuple((name, _walk(params[name], ints)) for name in sorted(params))
    return math.prod(max(1, i) for i in ints), shape


def smallest_cases(items: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(kept, dropped) pytest items: each group's smallest case kept (the first collected on a tie), every
    unparametrized item kept; collection order preserved."""
    params = [_params(item) for item in items]
    best: dict[tuple, tuple[int, int]] = {}
    for index, (item, p) in enumerate(zip(items, params, strict=True)):
        if p is None:
            continue
        size, shape = case_size_and_shape(p)
        key = (item.nodeid.split("[", 1)[0], shape)
        if key not in best or size < best[key][0]:
            best[key] = (size, index)
    keep = {index for _, index in best.values()}
    kept, dropped = [], []
    for index, (item, p) in enumerate(zip(items, params, strict=True)):
        (kept if p is None or index in keep else dropped).append(item)
    return kept, dropped


def _params(item: Any) -> dict[str, Any] | None:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None and callspec.params else None
