"""numpy arrays ⇄ the store's Arrow tensor type (``struct<shape, data>``).

>>> import numpy as np
>>> arr = to_arrow([np.zeros((2, 3), np.float32)])
>>> to_numpy(arr)[0].shape
(2, 3)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from .types import is_tensor, one_array, tensor_type


def to_arrow(arrays: Sequence[np.ndarray | None], dtype: str | np.dtype | None = None) -> pa.Array:
    """Pack numpy arrays (any shapes, one dtype) into a tensor column; ``None`` stays null."""
    present = [a for a in arrays if a is not None]
    np_dtype = np.dtype(dtype) if dtype is not None else (
        np.asarray(present[0]).dtype if present else np.dtype("float32"))
    element = pa.from_numpy_dtype(np_dtype)
    shapes: list[list[int] | None] = []
    datas: list[pa.Array | None] = []
    for a in arrays:
        if a is None:
            shapes.append(None)
            datas.append(None)
            continue
        a = np.asarray(a, dtype=np_dtype)
        shapes.append(list(a.shape))
        datas.append(pa.array(a.reshape(-1), type=element))
    data = pa.array([d.to_pylist() if d is not None else None for d in datas],
                    type=pa.large_list(element)) if datas else pa.array([], pa.large_list(element))
    mask = pa.array([a is None for a in arrays], pa.bool_())
    return pa.StructArray.from_arrays([pa.array(shapes, pa.list_(pa.int64())), data],
                                      names=["shape", "data"], mask=mask)


def to_numpy(column: pa.Array | pa.ChunkedArray) -> list[np.ndarray | None]:
    """Unpack a tensor column into numpy arrays with their dtype and shape."""
    column = one_array(column)
    if not is_tensor(column.type):
        raise TypeError(f"column of type {column.type} is not a tensor column")
    element = column.type.field(1).type.value_type
    out: list[np.ndarray | None] = []
    shapes = column.field("shape")
    datas = column.field("data")
    for i in range(len(column)):
        if not column[i].is_valid:
            out.append(None)
            continue
        shape = shapes[i].as_py()
        flat = datas[i].values.to_numpy(zero_copy_only=False).astype(element.to_pandas_dtype(),
                                                                     copy=False)
        out.append(flat.reshape(shape))
    return out


__all__ = ["to_arrow", "to_numpy", "tensor_type"]
