"""Column types: the spellings users write, and their Arrow and DuckDB forms.

A type is written as a short string (``"int32"``, ``"list<float32>"``, ``"tensor<float32>"``) or
given as a ``pyarrow.DataType``. Tensors of any shape are an Arrow
``struct<shape: list<int64>, data: list<T>>`` so that they round-trip through Arrow, DuckDB and
Flight without extension types; :mod:`store.tensors` converts numpy arrays to and from it.
Half-precision elements (``float16``, ``bfloat16``; the latter an extension type) are
described in :mod:`store.halves`.
"""
from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from .errors import InvalidArgument
from .halves import BFLOAT16, FLOAT16, is_half

SCALARS: dict[str, pa.DataType] = {
    "bool": pa.bool_(),
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "float16": FLOAT16, "bfloat16": BFLOAT16, "float32": pa.float32(), "float64": pa.float64(),
    "string": pa.large_string(), "binary": pa.large_binary(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}
ALIASES = {"int": "int64", "float": "float64", "double": "float64", "str": "string",
           "text": "string", "bytes": "binary", "boolean": "bool", "half": "float16",
           "bf16": "bfloat16"}
NUMERIC_ELEMENTS = [n for n in SCALARS
                    if n.startswith(("int", "uint", "float", "bfloat")) or n == "bool"]
ALLOWED = sorted(SCALARS) + ["list<T>", "tensor<T>"]

_WRAPPED = re.compile(r"^(list|tensor)<\s*(.+?)\s*>$")


def parse_type(spec: str | pa.DataType) -> pa.DataType:
    """Turn a type spelling into its Arrow type.

    Raises:
        InvalidArgument: naming the spelling and the allowed ones.
    """
    if isinstance(spec, pa.DataType):
        return _check_arrow(spec)
    if not isinstance(spec, str):
        raise InvalidArgument(f"column type {spec!r} is not a string or pyarrow type; "
                              f"expected one of {', '.join(ALLOWED)}")
    text = spec.strip().lower()
    text = ALIASES.get(text, text)
    if text in SCALARS:
        return SCALARS[text]
    match = _WRAPPED.match(text)
    if match:
        outer, inner = match.groups()
        inner = ALIASES.get(inner, inner)
        if outer == "list":
            return pa.large_list(parse_type(inner))
        if inner not in NUMERIC_ELEMENTS:
            raise InvalidArgument(f"tensor element type {inner!r} is not supported; expected one of "
                                  f"{', '.join(NUMERIC_ELEMENTS)}")
        return tensor_type(SCALARS[inner])
    raise InvalidArgument(f"unknown column type {spec!r}; expected one of {', '.join(ALLOWED)}")


def tensor_type(element: pa.DataType) -> pa.DataType:
    return pa.struct([("shape", pa.list_(pa.int64())), ("data", pa.large_list(element))])


def is_tensor(t: pa.DataType) -> bool:
    return (pa.types.is_struct(t) and t.num_fields == 2 and t.field(0).name == "shape"
            and t.field(1).name == "data")


def is_complex(t: pa.DataType) -> bool:
    """Complex values (strings, bytes, lists, tensors) may be stored by reference."""
    return (pa.types.is_large_string(t) or pa.types.is_large_binary(t)
            or pa.types.is_large_list(t) or is_tensor(t))


def type_name(t: pa.DataType) -> str:
    """The user spelling of an Arrow type produced by :func:`parse_type`."""
    for name, scalar in SCALARS.items():
        if t == scalar:
            return name
    if is_tensor(t):
        return f"tensor<{type_name(t.field(1).type.value_type)}>"
    if pa.types.is_large_list(t):
        return f"list<{type_name(t.value_type)}>"
    return str(t)


def _check_arrow(t: pa.DataType) -> pa.DataType:
    """Normalise an Arrow type to the store's canonical (large) variants."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.large_string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.large_binary()
    if pa.types.is_timestamp(t):
        return SCALARS["timestamp"]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.large_list(_check_arrow(t.value_type))
    if is_tensor(t):
        return tensor_type(_check_arrow(t.field(1).type.value_type))
    for scalar in SCALARS.values():
        if t == scalar:
            return t
    raise InvalidArgument(f"column type {t} is not supported; expected one of {', '.join(ALLOWED)}")


_DUCK_SCALARS = {
    "bool": "BOOLEAN", "int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER",
    "int64": "BIGINT", "uint8": "UTINYINT", "uint16": "USMALLINT", "uint32": "UINTEGER",
    "uint64": "UBIGINT", "float32": "FLOAT", "float64": "DOUBLE", "string": "VARCHAR",
    "binary": "BLOB", "timestamp": "TIMESTAMPTZ",
    # their 16-bit patterns (see store/halves.py)
    "float16": "USMALLINT", "bfloat16": "USMALLINT",
}


def duckdb_type(t: pa.DataType) -> str:
    """The DuckDB column type holding values of Arrow type ``t`` (half-precision values as
    their 16-bit patterns, ``USMALLINT``, see :mod:`store.halves`)."""
    if is_tensor(t):
        return f"STRUCT(shape BIGINT[], data {duckdb_type(t.field(1).type.value_type)}[])"
    if pa.types.is_large_list(t):
        return f"{duckdb_type(t.value_type)}[]"
    return _DUCK_SCALARS[type_name(t)]


_BOOLS = {value: pa.array(np.full(1024, value)) for value in (True, False)}


def constant_bools(value: bool, n: int) -> pa.BooleanArray:
    """``n`` times ``value``, as a slice of a shared array where ``n`` is small.

    Why: a one-sample put fills a written flag and a status column per data column; building
    each from a Python list costs many times what a slice of a shared array does. Arrays are
    immutable, so sharing is safe.
    """
    return _BOOLS[value].slice(0, n) if n <= 1024 else pa.array(np.full(n, value))


def empty_table(schema: pa.Schema) -> pa.Table:
    """A table of no rows with ``schema`` (one empty record batch).

    Why not ``schema.empty_table()``: pyarrow 26 builds its columns with ``pa.array([])``, which
    raises ArrowNotImplementedError for an extension type inside a list or struct, as a
    ``list<bfloat16>`` or ``tensor<bfloat16>`` column is; ``pa.nulls(0, type)`` builds any."""
    return pa.Table.from_batches(
        [pa.RecordBatch.from_arrays([pa.nulls(0, f.type) for f in schema], schema=schema)])


def one_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column as one Array, without a copy when it already is one chunk.

    Why: ``ChunkedArray.combine_chunks`` copies even a single chunk, a cost that grows with the
    column's bytes.
    The result shares its buffers with ``column``: where it is kept (a put's prepared columns),
    the copy is what frees the rest of the source (see ``prepare._as_type``).
    """
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column


def cast_problem(source: pa.DataType, target: pa.DataType) -> str | None:
    """Why values of Arrow type ``source`` must not be written to a column of type ``target``,
    or None when they convert without changing meaning.

    Arrow converts far more than a store should take silently: a written 2 became ``true``, a
    ``true`` became 1.0, a float or a date became text. Refused: anything to or from ``bool``
    but ``bool``; numbers, dates and timestamps to ``string`` or ``binary``; text to numbers or
    timestamps; anything but dates and timestamps to ``timestamp``. Kept: integers and floats
    between each other (a value that does not fit, or a fraction written to an integer, is still
    refused by the conversion itself; a float64 written to a float32 column is rounded to
    float32's precision, as numpy would), ``string`` and ``binary`` between each other (text
    must be valid UTF-8), list and tensor elements by the same rules. Half-precision columns
    (``float16``, ``bfloat16``) take only values of their own type: rounding wider floats to
    16 bits loses most of their precision (and a float16 overflows past 65504), which a
    trainer must decide, not the store; half-precision values are not written to other
    columns either but float16 to float32 and float64, which hold them exactly.
    """
    if pa.types.is_dictionary(source):
        source = source.value_type
    if source == target or pa.types.is_null(source):
        return None
    if is_half(target) or is_half(source):
        if source == FLOAT16 and target in (pa.float32(), pa.float64()):
            return None
        return (f"{type_name(source)} values are not {type_name(target)}; half-precision "
                "values are written only as they are, never converted (convert them first, "
                "e.g. numpy .astype(np.float16), torch .half() or .bfloat16())")
    if is_tensor(target):
        if not (pa.types.is_struct(source) and source.get_field_index("shape") >= 0
                and source.get_field_index("data") >= 0):
            return f"{source} is not a tensor (a struct of shape and data)"
        shape = source.field("shape").type
        data = source.field("data").type
        if not (_is_list(shape) and pa.types.is_integer(shape.value_type)):
            return f"a tensor's shape of type {shape} is not a list of integers"
        if not _is_list(data):
            return f"a tensor's data of type {data} is not a list"
        return cast_problem(data.value_type, target.field(1).type.value_type)
    if _is_list(target):
        if not _is_list(source):
            return f"{source} is not a list"
        return cast_problem(source.value_type, target.value_type)
    kind, wanted = _kind(source), _kind(target)
    if kind == wanted or {kind, wanted} == {"number"} or {kind, wanted} <= {"text", "bytes"}:
        return None
    if wanted == "time" and kind == "date":
        return None
    return f"{_KIND_NAMES.get(kind, str(source))} would become {_KIND_NAMES[wanted]}"


_KIND_NAMES = {"bool": "true/false", "number": "numbers", "text": "text", "bytes": "bytes",
               "time": "timestamps", "date": "dates"}


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _kind(t: pa.DataType) -> str:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "text"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or \
            pa.types.is_fixed_size_binary(t) or pa.types.is_binary_view(t):
        return "bytes"
    if pa.types.is_timestamp(t):
        return "time"
    if pa.types.is_date(t):
        return "date"
    return str(t)
