"""numpy arrays (and torch tensors, in) ⇄ the store's Arrow tensor type (``struct<shape, data>``).

>>> import numpy as np
>>> arr = to_arrow([np.zeros((2, 3), np.float32)])
>>> to_numpy(arr)[0].shape
(2, 3)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .halves import is_bfloat16
from .host_arrays import dtype_name, flat_arrow, is_host_array, shape_of
from .types import cast_problem, is_tensor, one_array, tensor_type, type_name


def to_arrow(arrays: Sequence[Any], dtype: str | np.dtype | pa.DataType | None = None
             ) -> pa.Array:
    """Pack numpy arrays or torch tensors (any shapes, one dtype) into a tensor column; ``None``
    stays null.

    Args:
        dtype: the element type, as numpy or Arrow spells it (bfloat16:
            :data:`store.halves.BFLOAT16`); default the first array's.
    """
    hosts = [a if a is None or is_host_array(a) else np.asarray(a) for a in arrays]
    flats = [None if a is None else flat_arrow(a) for a in hosts]
    present = [f for f in flats if f is not None]
    if isinstance(dtype, pa.DataType):
        element = dtype
    elif dtype is not None:
        element = pa.from_numpy_dtype(np.dtype(dtype))
    else:
        element = present[0].type if present else pa.float32()
    shapes: list[list[int] | None] = []
    datas: list[pa.Array] = []
    offsets = [0]
    for a, flat in zip(hosts, flats):
        if flat is None:
            shapes.append(None)
            offsets.append(offsets[-1])
        else:
            shapes.append(shape_of(a))
            datas.append(_elements(a, flat, element))
            offsets.append(offsets[-1] + len(datas[-1]))
    nulls = np.array([a is None for a in hosts], bool)
    mask = pa.array(nulls) if nulls.any() else None
    values = pa.concat_arrays(datas) if datas else pa.array([], element)
    data = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), values, mask=mask)
    return pa.StructArray.from_arrays([pa.array(shapes, pa.list_(pa.int64())), data],
                                      names=["shape", "data"], mask=pa.array(nulls))


def _elements(a: Any, flat: pa.Array, element: pa.DataType) -> pa.Array:
    """An array's values, flat, as ``element``: converted only where that keeps their meaning
    (``np.asarray(a, dtype)`` turned 1.5 into 1 and 2 into ``True`` without a word)."""
    if flat.type == element:
        return flat
    problem = cast_problem(flat.type, element)
    if problem is not None:
        raise ValueError(f"a tensor of {dtype_name(a)} is not written as {type_name(element)}: "
                         f"{problem}")
    try:
        return flat.cast(element, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(f"a tensor of {dtype_name(a)} does not convert to "
                         f"{type_name(element)}: {e}") from e


#: The most dimensions a tensor may have (numpy's own limit is 64) and the largest one.
MAX_TENSOR_DIMS = 32
MAX_TENSOR_DIM = 2**31 - 1


def tensor_problem(column: pa.Array) -> str | None:
    """What is wrong with the tensors of a column (a message naming the first bad row), or None.

    A tensor is valid when its shape and data are both present, its shape has at most
    :data:`MAX_TENSOR_DIMS` dimensions, each in ``[0, MAX_TENSOR_DIM]``, and their product is the
    number of values in its data (an empty shape: one value). Checked with a few numpy passes
    over the shapes, not per row in Python.
    """
    column = one_array(column)
    if len(column) == 0:
        return None
    if column.null_count == 0 and _all_match(column):
        return None
    shapes, datas = column.flatten()  # null where the tensor is
    if shapes.null_count != column.null_count or datas.null_count != column.null_count:
        present = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), bool)
        has_shape = np.asarray(shapes.is_valid().to_numpy(zero_copy_only=False), bool)
        row = int(np.argmax(present & ~(has_shape & np.asarray(
            datas.is_valid().to_numpy(zero_copy_only=False), bool))))
        return (f"row {row} has no {'shape' if not has_shape[row] else 'data'}; expected both a "
                "shape and data")
    dims_array = pc.list_flatten(shapes)
    parents = np.asarray(pc.list_parent_indices(shapes).to_numpy(), np.int64)
    if dims_array.null_count:
        row = int(parents[np.argmax(~np.asarray(dims_array.is_valid().to_numpy(
            zero_copy_only=False), bool))])
        return (f"row {row} has a null dimension in its shape {shapes[row].as_py()}; expected "
                "integers")
    ndims = np.bincount(parents, minlength=len(column))
    if ndims.max(initial=0) > MAX_TENSOR_DIMS:
        row = int(np.argmax(ndims > MAX_TENSOR_DIMS))
        return (f"row {row} has {int(ndims[row])} dimensions; expected at most "
                f"{MAX_TENSOR_DIMS}")
    dims = np.asarray(dims_array.to_numpy(zero_copy_only=False), np.int64)
    bad = (dims < 0) | (dims > MAX_TENSOR_DIM)
    if bad.any():
        row = int(parents[np.argmax(bad)])
        return (f"row {row} has the shape {shapes[row].as_py()}; expected each dimension in "
                f"[0, {MAX_TENSOR_DIM}]")
    # Products in float64 are exact up to 2**53; a larger one is no data length either. A null
    # tensor has no dimensions (product 1) and no data (length 0 below): it is skipped.
    products = np.ones(len(column), np.float64)
    np.multiply.at(products, parents, dims.astype(np.float64))
    lengths = np.asarray(pc.fill_null(pc.list_value_length(datas), -1).to_numpy(), np.float64)
    wrong = (products != lengths) & (lengths >= 0)
    if wrong.any():
        row = int(np.argmax(wrong))
        return (f"row {row} has the shape {shapes[row].as_py()} ({products[row]:.0f} values) "
                f"but {int(lengths[row])} values in its data; expected the product of the "
                "shape's dimensions to be the number of values")
    return None


def _all_match(column: pa.StructArray) -> bool:
    """The usual case, checked fast from the offsets (no nulls anywhere, every tensor valid):
    True if so; False sends :func:`tensor_problem` to its slower search for the bad row."""
    shapes, datas = column.field(0), column.field(1)
    if shapes.null_count or datas.null_count or shapes.values.null_count:
        return False
    offsets = shapes.offsets.to_numpy()
    ndims = np.diff(offsets)
    if ndims.size and ndims.max() > MAX_TENSOR_DIMS:
        return False
    dims = shapes.values.to_numpy()[offsets[0]:offsets[-1]]
    if dims.size and (dims.min() < 0 or dims.max() > MAX_TENSOR_DIM):
        return False
    if ndims.size and (ndims == ndims[0]).all():
        products = dims.astype(np.float64).reshape(len(ndims), int(ndims[0])).prod(axis=1)
    else:
        products = np.ones(len(ndims), np.float64)
        np.multiply.at(products, np.repeat(np.arange(len(ndims)), ndims), dims)
    return bool((products == np.diff(datas.offsets.to_numpy())).all())


def to_numpy(column: pa.Array | pa.ChunkedArray) -> list[np.ndarray | None]:
    """Unpack a tensor column into numpy arrays with their dtype and shape."""
    column = one_array(column)
    if not is_tensor(column.type):
        raise TypeError(f"column of type {column.type} is not a tensor column")
    element = column.type.field(1).type.value_type
    if is_bfloat16(element):
        raise TypeError("a bfloat16 tensor column has no numpy dtype; read it as torch "
                        "tensors (consumers.torch_collate.tensor_column) or its values as "
                        "float32 (store.halves.bfloat16_floats)")
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


__all__ = ["tensor_problem", "to_arrow", "to_numpy", "tensor_type"]
