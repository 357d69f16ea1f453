"""Half-precision values (``float16``, ``bfloat16``): their Arrow types, and their DuckDB form.

Trainers keep logprobs, values, advantages and hidden states in 16-bit floats. The store keeps
them bit-exact:

* ``float16`` is Arrow's ``halffloat``.
* ``bfloat16`` has no Arrow type: it is the extension type :class:`BFloat16Type`
  (``expstore.bfloat16``) over ``uint16``, each value its 16-bit pattern. The extension name
  travels in the schema (Arrow IPC, Flight), so a reader that has not registered the type still
  gets the patterns and the name (field metadata ``ARROW:extension:name``); torch reads them
  with ``.view(torch.bfloat16)``, without a copy (:mod:`consumers.torch_collate`). A bfloat16
  value as Python sees it (``as_py()``, ``to_pylist()``) and a bfloat16 column in pandas
  (``to_pandas()``) are floats; ``to_numpy()`` gives the patterns (numpy has no bfloat16), and
  so does pandas for lists and tensors of them (:func:`widened` makes them float32 first).

DuckDB has neither type, and its storage does not keep a float's NaN sign and payload (a
FLOAT NaN read back from its file is the canonical one). Columns of them therefore hold the
16-bit patterns in DuckDB, as ``USMALLINT`` (``USMALLINT[]``, tensors' data ``USMALLINT[]``):
exact whatever the value, and a view of the same buffers both ways (:func:`to_stored`,
:func:`from_stored`). SQL sees the values as ``FLOAT``: each query cursor shadows such a table
with a view widening them (:func:`widened_from_stored`; :mod:`store.sqlvalues`), exact, since
every float16 and bfloat16 value is a float32 value.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class BFloat16Type(pa.ExtensionType):
    """Arrow extension type for bfloat16 values, stored as their uint16 bit patterns."""

    def __init__(self) -> None:
        super().__init__(pa.uint16(), "expstore.bfloat16")

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type: pa.DataType,
                                  serialized: bytes) -> "BFloat16Type":
        if storage_type != pa.uint16():
            raise TypeError(f"expstore.bfloat16 is stored as uint16, not {storage_type}")
        return cls()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return BFloat16Type, ()

    def __hash__(self) -> int:  # (types are dictionary keys and set members)
        return hash(self.extension_name)

    def __arrow_ext_scalar_class__(self) -> type:
        return BFloat16Scalar

    def to_pandas_dtype(self) -> object:
        """pandas' nullable ``Float32``, filled with the values (not their patterns) when a
        bfloat16 column reaches pandas (``to_pandas()``). Lists and tensors of bfloat16 reach
        pandas through Arrow's own conversion, as patterns: widen them first
        (:func:`widened`)."""
        return _pandas_dtype()()


@functools.cache
def _pandas_dtype() -> type:
    """pandas' ``Float32`` dtype filled from widened bfloat16 values (made once, on the first
    conversion: the store imports pandas only for a caller converting to it)."""
    import pandas as pd

    class BFloat16AsFloat32(pd.Float32Dtype):
        def __from_arrow__(self, array: pa.Array | pa.ChunkedArray) -> object:
            return pd.Float32Dtype().__from_arrow__(widened(array))

    return BFloat16AsFloat32


class BFloat16Scalar(pa.ExtensionScalar):
    """One bfloat16 value: ``as_py()`` (and so ``to_pylist()`` of arrays, lists and tables
    holding them) gives the number as a Python float (exact), not its 16-bit pattern."""

    def as_py(self, **kwargs: object) -> float | None:
        bits = self.value
        if bits is None:
            return None
        return float(_bfloat16_as_float32(np.array([bits.as_py()], np.uint16))[0])


BFLOAT16 = BFloat16Type()
FLOAT16 = pa.float16()
try:
    pa.register_extension_type(BFLOAT16)
except pa.ArrowKeyError:  # registered already (the module imported again under another name)
    pass

#: The extension name a reader finds in a bfloat16 field's metadata when it lacks the type.
BFLOAT16_NAME = b"expstore.bfloat16"


def is_half(t: pa.DataType) -> bool:
    """Whether ``t`` is one of the half-precision element types."""
    return t == FLOAT16 or is_bfloat16(t)


def is_bfloat16(t: pa.DataType) -> bool:
    return isinstance(t, pa.ExtensionType) and t.extension_name == BFLOAT16_NAME.decode()


def has_half(t: pa.DataType) -> bool:
    """Whether ``t`` holds half-precision values anywhere (itself, a list's or a tensor's
    elements)."""
    if is_half(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return has_half(t.value_type)
    if pa.types.is_struct(t):
        return any(has_half(t.field(i).type) for i in range(t.num_fields))
    return False


def widened_type(t: pa.DataType) -> pa.DataType:
    """``t`` with its half-precision elements as float32 (what DuckDB holds)."""
    return _map_type(t, lambda leaf: pa.float32() if is_half(leaf) else leaf)


def storage_type(t: pa.DataType) -> pa.DataType:
    """``t`` with its bfloat16 elements as their uint16 storage (the same buffers)."""
    return _map_type(t, lambda leaf: pa.uint16() if is_bfloat16(leaf) else leaf)


def stored_type(t: pa.DataType) -> pa.DataType:
    """``t`` with its half-precision elements as their uint16 patterns (what DuckDB holds)."""
    return _map_type(t, lambda leaf: pa.uint16() if is_half(leaf) else leaf)


def _map_type(t: pa.DataType, leaf: Callable[[pa.DataType], pa.DataType]) -> pa.DataType:
    if pa.types.is_large_list(t):
        return pa.large_list(_map_type(t.value_type, leaf))
    if pa.types.is_list(t):
        return pa.list_(_map_type(t.value_type, leaf))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_map_type(t.field(i).type, leaf))
                          for i in range(t.num_fields)])
    return leaf(t)


def widened(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """``values`` with half-precision elements widened to float32 (exact): what SQL sees."""
    if not has_half(values.type):
        return values
    if isinstance(values, pa.ChunkedArray):
        return pa.chunked_array([_map_leaves(c, _widen_leaf) for c in values.chunks],
                                widened_type(values.type))
    return _map_leaves(values, _widen_leaf)


def to_stored(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Half-precision values as their 16-bit patterns, for DuckDB (the same buffers)."""
    return _view(values, stored_type(values.type)) if has_half(values.type) else values


def from_stored(values: pa.Array | pa.ChunkedArray,
                target: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """16-bit patterns as DuckDB gives them back (its lists as ``list``) as ``target``'s
    half-precision values, bit for bit what :func:`to_stored` was given."""
    if not has_half(target) or values.type == target:
        return values
    stored = stored_type(target)
    if values.type != stored:
        values = values.cast(stored)
    return _view(values, target)


def _view(values: pa.Array | pa.ChunkedArray, t: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """The same buffers as type ``t`` (of the same layout)."""
    if isinstance(values, pa.ChunkedArray):
        return pa.chunked_array([c.view(t) for c in values.chunks], t)
    return values.view(t)


def widened_from_stored(values: pa.Array | pa.ChunkedArray,
                        target: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """What SQL sees of stored patterns of ``target``'s values: the values as float32."""
    return widened(from_stored(values, target))


def to_stored_table(table: pa.Table) -> pa.Table:
    """``table`` with each half-precision column as its patterns (:func:`to_stored`)."""
    for i, f in enumerate(table.schema):
        if has_half(f.type):
            table = table.set_column(i, f.with_type(stored_type(f.type)),
                                     to_stored(table.column(i)))
    return table


def from_stored_table(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` (as DuckDB gives it, columns in ``schema``'s order) as ``schema``: half-
    precision columns from their patterns (:func:`from_stored`), the others cast."""
    columns = [from_stored(table.column(i), f.type) if has_half(f.type) else table.column(i)
               for i, f in enumerate(schema)]
    return pa.Table.from_arrays(columns, names=schema.names).cast(schema)


def if_else(condition: pa.Array, left: pa.Array | pa.Scalar, right: pa.Array) -> pa.Array:
    """``pc.if_else`` that also takes bfloat16 values (Arrow has no kernel for extension types:
    it runs on their storage, the same buffers)."""
    t = right.type
    if not has_half(t) or storage_type(t) == t:
        return pc.if_else(condition, left, right)
    store_t = storage_type(t)
    if isinstance(left, pa.Scalar):
        left = pa.scalar(None, store_t) if not left.is_valid else \
            pa.array([left.as_py()], t).view(store_t)[0]
    else:
        left = left.view(store_t)
    return pc.if_else(condition, left, right.view(store_t)).view(t)


# -- leaves ---------------------------------------------------------------------------------


def _map_leaves(values: pa.Array, leaf: Callable[[pa.Array], pa.Array]) -> pa.Array:
    """``values`` with ``leaf`` applied to the flat arrays of its half-precision elements
    (through lists and structs), nulls and offsets as they were."""
    t = values.type
    mask = values.is_null() if values.null_count else None
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        cls = pa.LargeListArray if pa.types.is_large_list(t) else pa.ListArray
        offsets = values.offsets
        first = offsets[0].as_py()
        if first:  # a slice: offsets from 0 over its own elements (Arrow takes no other with nulls)
            offsets = pc.subtract(offsets, first)
        elements = values.values.slice(first, offsets[-1].as_py())
        return cls.from_arrays(offsets, _map_leaves(elements, leaf), mask=mask)
    if pa.types.is_struct(t):
        children = [values.field(i) for i in range(t.num_fields)]
        return pa.StructArray.from_arrays(
            [_map_leaves(c, leaf) for c in children],
            names=[t.field(i).name for i in range(t.num_fields)], mask=mask)
    return leaf(values)


def _bits(values: pa.Array, dtype: type) -> np.ndarray:
    """The values' buffer as numpy ``dtype`` (the fixed-width values, nulls' slots included)."""
    buf = values.buffers()[1]
    size = np.dtype(dtype).itemsize
    return np.frombuffer(buf, dtype, count=len(values), offset=values.offset * size) \
        if buf is not None else np.zeros(0, dtype)


def _with_nulls_of(values: pa.Array, data: np.ndarray, t: pa.DataType) -> pa.Array:
    if values.null_count:
        return pa.array(data, t, mask=values.is_null().to_numpy(zero_copy_only=False))
    return pa.array(data, t)


def _widen_leaf(values: pa.Array) -> pa.Array:
    if values.type == FLOAT16:
        return values.cast(pa.float32())
    if is_bfloat16(values.type):
        return _with_nulls_of(values, _bfloat16_as_float32(_bits(values, np.uint16)),
                              pa.float32())
    return values


def _bfloat16_as_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 patterns as the float32 values they are (exact: the upper half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# -- from floats ------------------------------------------------------------------------------


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even, as torch rounds), as their
    uint16 patterns; NaN stays NaN."""
    wide = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((wide.astype(np.uint64) + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(wide.view(np.float32))
    return np.where(nan, ((wide >> 16) | 0x0040).astype(np.uint16), rounded)


def bfloat16_floats(values: pa.Array) -> np.ndarray:
    """A flat bfloat16 array's values as float32 (exact), nulls as NaN."""
    wide = _bfloat16_as_float32(_bits(values, np.uint16))
    if values.null_count:
        wide = np.where(values.is_null().to_numpy(zero_copy_only=False), np.nan, wide)
    return wide


def float64_type(t: pa.DataType) -> pa.DataType:
    """``t`` with its half-precision elements as float64 (what Python numbers infer as)."""
    return _map_type(t, lambda leaf: pa.float64() if is_half(leaf) else leaf)


def rounded(values: pa.Array, target: pa.DataType) -> pa.Array:
    """Numbers (of :func:`float64_type` of ``target``) rounded to ``target``'s half-precision
    elements, to nearest (ties to even).

    Raises:
        ValueError: a finite number outside the half-precision type's range, named.
    """
    element = _half_of(target)
    values = values.cast(float64_type(target))

    def leaf(flat: pa.Array) -> pa.Array:
        if flat.type != pa.float64():
            return flat
        wide = flat.to_numpy(zero_copy_only=False)
        mask = flat.is_null().to_numpy(zero_copy_only=False) if flat.null_count else None
        with np.errstate(over="ignore"):
            if element == FLOAT16:
                narrow = wide.astype(np.float16)
                back = narrow.astype(np.float64)
                out = pa.array(narrow, FLOAT16, mask=mask)
            else:
                bits = bfloat16_bits(wide.astype(np.float32))
                back = _bfloat16_as_float32(bits).astype(np.float64)
                out = pa.array(bits, pa.uint16(), mask=mask)
        over = np.isfinite(wide) & ~np.isfinite(back)
        if mask is not None:
            over &= ~mask
        if over.any():
            bad = float(wide[np.argmax(over)])
            raise ValueError(f"{bad!r} is out of {'float16' if element == FLOAT16 else 'bfloat16'}"
                             f"'s range (largest finite: "
                             f"{'65504' if element == FLOAT16 else '3.39e38'})")
        return out

    converted = _map_leaves(values, leaf)
    return converted.view(target) if converted.type != target else converted


def _half_of(t: pa.DataType) -> pa.DataType:
    """The half-precision element type inside ``t``."""
    while not is_half(t):
        t = t.value_type if not pa.types.is_struct(t) else \
            next(t.field(i).type for i in range(t.num_fields) if has_half(t.field(i).type))
    return t
