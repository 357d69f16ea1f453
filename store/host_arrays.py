"""numpy arrays and torch tensors in a write, as Arrow arrays of their own element type.

A torch tensor is recognised by its class's module, and converted through the torch module its
caller has already imported (``sys.modules``): the store never imports torch itself. A bfloat16
tensor (numpy has no bfloat16) becomes the store's bfloat16 extension array over the same bit
patterns (:mod:`store.halves`); every other dtype goes through ``Tensor.numpy()``.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pyarrow as pa

from .halves import BFLOAT16


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (without importing torch)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "detach") \
        and hasattr(value, "dtype")


def is_host_array(value: Any) -> bool:
    """Whether ``value`` is a numpy array, a torch tensor or an Arrow array (one dimension)."""
    return isinstance(value, (np.ndarray, pa.Array)) or is_torch(value)


def dtype_name(value: Any) -> str:
    """The value's element type as its library spells it (``float16``, ``torch.bfloat16``)."""
    return str(value.type if isinstance(value, pa.Array) else value.dtype)


def shape_of(value: Any) -> list[int]:
    if isinstance(value, pa.Array):
        return [len(value)]
    return [int(d) for d in value.shape]


def flat_arrow(value: Any) -> pa.Array:
    """A numpy array's or torch tensor's values, flattened in C order, as an Arrow array of
    their own element type (no copy where the values are contiguous in host memory)."""
    if isinstance(value, pa.Array):
        return value
    if is_torch(value):
        torch = sys.modules["torch"]
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            bits = tensor.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
            return pa.ExtensionArray.from_storage(BFLOAT16, pa.array(bits, pa.uint16()))
        value = tensor.numpy()
    return pa.array(np.ascontiguousarray(value).reshape(-1))


def list_rows(values: list[Any]) -> pa.Array:
    """Rows of a list column given as 1-D arrays or tensors (``None``: a null row) as one
    ``large_list`` array of their element type.

    Raises:
        ValueError: a row that is not 1-D, or rows of different element types.
    """
    flats: list[pa.Array] = []
    offsets = [0]
    nulls: list[bool] = []
    for i, v in enumerate(values):
        nulls.append(v is None)
        if v is not None:
            if not is_host_array(v):
                v = np.asarray(v)
            if len(shape_of(v)) != 1:
                raise ValueError(f"row {i} is an array of shape {shape_of(v)}; expected one "
                                 "dimension (a list per row)")
            flats.append(flat_arrow(v))
        offsets.append(offsets[-1] + (len(flats[-1]) if v is not None else 0))
    types = {f.type for f in flats}
    if len(types) > 1:
        raise ValueError(f"rows hold arrays of different element types "
                         f"{sorted(str(t) for t in types)}; expected one")
    element = flats[0].type if flats else pa.null()
    data = pa.concat_arrays(flats) if flats else pa.array([], element)
    mask = pa.array(nulls, pa.bool_()) if any(nulls) else None
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), data, mask=mask)


def scalar_rows(values: list[Any]) -> pa.Array:
    """Rows of a column of numbers given as 0-d arrays or tensors (``None``: a null row), as
    one array of their element type.

    Raises:
        ValueError: a row holding more than one value, or rows of different element types.
    """
    flats: list[pa.Array | None] = []
    for i, v in enumerate(values):
        if v is None:
            flats.append(None)
            continue
        if not is_host_array(v):
            v = np.asarray(v)
        if isinstance(v, pa.Array) or len(v.shape):
            raise ValueError(f"row {i} is an array of shape {shape_of(v)}; expected one value "
                             "per row (a 0-d array or tensor)")
        flats.append(flat_arrow(v))
    types = {f.type for f in flats if f is not None}
    if len(types) > 1:
        raise ValueError(f"rows hold values of different element types "
                         f"{sorted(str(t) for t in types)}; expected one")
    element = types.pop() if types else pa.null()
    return pa.concat_arrays([pa.nulls(1, element) if f is None else f for f in flats])
