"""Turning a producer's write into what the writer thread commits.

Everything that can be checked without the database happens here: column names and types,
sample ids (parsed vectorised), duplicate ids in one batch, and the serialisation of large values
into blob chunks. The writer then only appends chunks, assigns row ids and runs one INSERT and one
UPDATE per group of puts. Large writes are prepared on the caller's thread (overlapping the
writer's commits); small ones only pass :func:`check_columns` there and are prepared by the writer,
many at once (see ``store/writer.py``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import tensors
from .blob_chunks import Chunk, column_chunk, read_only
from .errors import InvalidArgument, SchemaMismatch
from .halves import float64_type, has_half, if_else, rounded
from .host_arrays import flat_arrow, is_host_array, is_torch, list_rows, scalar_rows
from .schema import META_NAMES, WRITABLE_META, TableDef
from .naming import MAX_SAMPLE_ID, SAMPLE_ID_PATTERN, sample_id_problem
from .tensors import tensor_problem
from .types import cast_problem, constant_bools, is_complex, is_tensor, type_name

# The same pattern for Python's re in the fast path (fullmatch: no "$" before a final newline).
_SAMPLE_ID = re.compile(SAMPLE_ID_PATTERN.removeprefix("^").removesuffix("$"))
#: Writes of at most this many rows are small: the writer thread prepares them (many at once).
SMALL_ROWS = 16
#: Batches of at most this many rows are prepared without compute kernels (Python lists): that
#: is faster up to a few hundred rows, which covers the batches the writer merges from many
#: producers' one-sample puts; by a thousand rows the kernels are faster.
FAST_PREPARE_ROWS = 256


@dataclass
class PreparedPut:
    """A validated write, ready for the writer.

    ``physical`` has the meta columns, then for each written data column its inline value, its
    ``__ref`` row index into the column's chunk (null when inline) and a ``__w`` written flag,
    then the effective status of each status column (null: leave as is).
    """

    table: str
    physical: pa.Table
    keys: list[tuple[str, int]]
    data_columns: list[str]
    status_columns: list[str]
    chunks: dict[str, Chunk]
    set_mask: np.ndarray
    clear_mask: np.ndarray
    versions_given: bool
    row_ids: np.ndarray | None = field(default=None)

    @property
    def rows(self) -> int:
        return self.physical.num_rows

    def signature(self) -> tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return (self.table, tuple(self.data_columns), tuple(self.status_columns),
                tuple(self.chunks))


#: The refusal of an empty write, by either store.
NO_ROWS = "the write holds no rows; a put needs at least one sample"


def put_timeout(table: str, timeout: float | None) -> TimeoutError:
    """The error of a put not answered within the caller's ``timeout``, by either store."""
    return TimeoutError(f"the put to {table!r} was not answered as durable within {timeout} s; "
                        "it may still be applied (writes are idempotent: sending it again is "
                        "safe)")


def to_arrow_table(tdef: TableDef, data: Any) -> pa.Table:
    """Accept a RecordBatch, Table, dict of columns or list of row dicts, or a data frame
    (pandas, polars, …: anything with the Arrow PyCapsule stream interface)."""
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        return data
    if hasattr(data, "__arrow_c_stream__") and not isinstance(data, Mapping):
        try:
            return pa.table(data)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as e:
            raise SchemaMismatch(f"the {type(data).__name__} to write does not convert to "
                                 f"Arrow: {e}; expected columns of one type each") from e
    if isinstance(data, Mapping):
        for name, values in data.items():
            if isinstance(values, (str, bytes, bytearray, Mapping)) \
                    or not hasattr(values, "__iter__"):
                raise InvalidArgument(
                    f"column {name!r} of a dict of columns is one {type(values).__name__} "
                    f"{values!r}; expected a list of values, one per row (for one row: "
                    f"{{{name!r}: [value], …}} or a list of row dicts [{{…}}])")
        arrays = _columns_to_arrays(tdef, data)
        lengths = {name: len(values) for name, values in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise InvalidArgument(f"the columns of a dict of columns have different lengths "
                                  f"{lengths}; expected one value per row in every column")
        return pa.table(arrays)
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if not data:
            raise InvalidArgument(NO_ROWS)
        if not all(isinstance(r, Mapping) for r in data):
            raise InvalidArgument("rows must be mappings of column name to value")
        names: list[str] = []
        for r in data:
            names.extend(k for k in r if k not in names)
        cols = {n: [r.get(n) for r in data] for n in names}
        return pa.table(_columns_to_arrays(tdef, cols))
    raise InvalidArgument(f"cannot write {type(data).__name__}; expected a pyarrow Table or "
                          "RecordBatch, a dict of columns, a list of row dicts or a data frame "
                          "(pandas, polars)")


def _columns_to_arrays(tdef: TableDef, cols: Mapping[str, Any]) -> dict[str, pa.Array]:
    out: dict[str, pa.Array] = {}
    logical = {f.name: f.type for f in tdef.write_schema()}
    for name, values in cols.items():
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            out[name] = values
            continue
        target = logical.get(name)
        if target is None:
            _unknown_column(tdef, name)
        try:
            assert target is not None
            if is_tensor(target):
                out[name] = tensors.to_arrow(list(values), dtype=target.field(1).type.value_type)
            elif is_host_array(values) and (has_half(target) or is_torch(values)):
                out[name] = _converted(name, _column_array(name, values, target), target)
            else:
                rows = list(values)
                # rows as arrays or tensors, 0-d or a list's values (the first row tells)
                first = next((v for v in rows if v is not None), None)
                if is_host_array(first) and (has_half(target) or is_torch(first)):
                    by_rows = list_rows if pa.types.is_large_list(target) else scalar_rows
                    out[name] = _converted(name, by_rows(rows), target)
                else:
                    out[name] = _python_values(name, rows, target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError,
                ValueError, OverflowError) as e:
            raise SchemaMismatch(f"values of column {name!r} do not fit its type "
                                 f"{type_name(target)}: {e}; expected {type_name(target)} "
                                 "values") from e
    return out


def _column_array(name: str, values: Any, target: pa.DataType) -> pa.Array:
    """A whole column given as one numpy array or torch tensor: one dimension for a column of
    numbers, two (a row each) for a list column."""
    dims = len(values.shape)
    if dims == 1 and not pa.types.is_large_list(target):
        return flat_arrow(values)
    if dims == 2 and pa.types.is_large_list(target):
        return list_rows(list(values))
    raise SchemaMismatch(f"column {name!r} is an array of shape {list(values.shape)}; expected "
                         f"one dimension for a {type_name(target)} column, or a list of "
                         "values, one per row")


def _python_values(name: str, values: list[Any], target: pa.DataType) -> pa.Array:
    """Python values of one column as an Array of ``target``'s type, under the conversion rules
    of Arrow input (:func:`store.types.cast_problem`).

    Why not ``pa.array(values, type=target)`` alone: it turns ``True`` into 1.0 and 1.5 into 1.
    The values' own Arrow type is inferred first and converted as a batch's column would be;
    values Arrow cannot infer (an integer past int64 for a uint64 column) are converted to the
    target directly, where no ``bool`` may stand for a number."""
    try:
        inferred = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        if not pa.types.is_boolean(target) and any(isinstance(v, bool) for v in values):
            raise SchemaMismatch(f"column {name!r} holds true/false among other values; "
                                 f"expected {type_name(target)} values") from None
        return pa.array(values, type=target)
    if has_half(target) and not has_half(inferred.type):
        # Python numbers carry no precision of their own: rounded to the column's, as
        # pa.array(values, type=float16) would, refused where a number would overflow it.
        problem = cast_problem(inferred.type, float64_type(target))
        if problem is not None:
            raise SchemaMismatch(f"column {name!r} holds {inferred.type} values, which are not "
                                 f"written to a {type_name(target)} column: {problem}; send "
                                 "numbers")
        return rounded(inferred, target)
    return _converted(name, inferred, target)


def _unknown_column(tdef: TableDef, name: str) -> None:
    if name in META_NAMES:
        raise SchemaMismatch(f"column {name!r} is a meta column the store sets; a write may "
                             f"carry only {', '.join(sorted(WRITABLE_META))} of the meta columns")
    raise SchemaMismatch(
        f"table {tdef.name!r} has no column {name!r}; writable columns: sample_id, "
        f"policy_version, finished_version, {', '.join(c.name for c in tdef.columns)} and "
        f"their '_status' columns")


def check_columns(tdef: TableDef, table: pa.Table) -> list[str]:
    """The checks a write passes before any value is read: its column names, and rows.

    Returns the column names.
    """
    names = table.column_names
    if len(set(names)) != len(names):
        raise SchemaMismatch(f"the batch repeats a column name: {names}")
    if "sample_id" not in names:
        raise SchemaMismatch(f"the batch has no 'sample_id' column; every write names its "
                             f"samples. Columns given: {names}")
    status_of = {c.status: c for c in tdef.columns}
    for n in names:
        if n not in WRITABLE_META and not tdef.has_column(n) and n not in status_of:
            _unknown_column(tdef, n)
    if table.num_rows == 0:
        raise InvalidArgument(NO_ROWS)
    return names


def put_versions(table: pa.Table, current_version: int) -> pa.Array:
    """A write's policy versions: its ``policy_version`` column, nulls taken as the current
    version, or the current version for every row."""
    if "policy_version" not in table.column_names:
        return pa.array(np.full(table.num_rows, current_version, np.int64))
    versions = _as_type(table, "policy_version", pa.int64())
    return pc.fill_null(versions, current_version) if versions.null_count else versions


def prepare_put(tdef: TableDef, data: Any, current_version: int,
                ref_threshold: int) -> PreparedPut:
    """Validate and convert one write (see :class:`PreparedPut`)."""
    table = to_arrow_table(tdef, data)
    names = check_columns(tdef, table)
    if table.num_rows <= FAST_PREPARE_ROWS:
        try:
            fast = _prepare_small(tdef, table, names, current_version, ref_threshold)
        except Exception:  # noqa: BLE001 - the general path below gives the answer, or the error
            fast = None
        if fast is not None:
            return fast

    sid = _as_type(table, "sample_id", pa.large_string())
    if sid.null_count:
        raise InvalidArgument("sample_id is null in some rows; every row needs one")
    too_long = pc.any(pc.greater(pc.utf8_length(sid), MAX_SAMPLE_ID)).as_py()
    # Matching, then cutting at the last two underscores, costs much less than extracting the
    # pattern's groups; a matching id has exactly those parts.
    valid = pc.match_substring_regex(sid, SAMPLE_ID_PATTERN)
    if not pc.all(valid).as_py() or too_long:
        bad = next(s for s, ok in zip(sid.to_pylist(), valid.to_pylist())
                   if not ok or len(s) > MAX_SAMPLE_ID)
        raise InvalidArgument(sample_id_problem(bad) or f"sample_id {bad[:80]!r} is malformed")
    n = table.num_rows
    versions = put_versions(table, current_version)
    finished = (_as_type(table, "finished_version", pa.int64()) if "finished_version" in names
                else pa.nulls(n, pa.int64()))

    keys = list(zip(sid.to_pylist(), versions.to_numpy().tolist()))  # no nulls left
    if len(set(keys)) != n:
        table = _merge_duplicates(table, keys)
        return prepare_put(tdef, table, current_version, ref_threshold)

    parts = pc.split_pattern(sid, "_", max_splits=2, reverse=True)
    columns: dict[str, pa.Array] = {
        "sample_id": sid,
        "input_id": pc.list_element(parts, 0),
        "turn": pc.list_element(parts, 1).cast(pa.int32()),
        "trajectory_id": pc.list_element(parts, 2).cast(pa.int32()),
        "policy_version": versions,
        "finished_version": finished,
    }
    data_columns = [c.name for c in tdef.columns if c.name in names]
    status_columns = [c.status for c in tdef.columns if c.name in names or c.status in names]
    chunks: dict[str, Chunk] = {}
    set_mask = np.zeros(n, np.int64)
    clear_mask = np.zeros(n, np.int64)
    for bit, col in enumerate(tdef.columns):
        written = None
        if col.name in names:
            values = _as_type(table, col.name, col.type, copy=col.ref is None)
            written = pc.is_valid(values)
            inline, ref_index, chunk = _split(col.name, values, col.storage, ref_threshold,
                                              read_only(table.column(col.name)))
            columns[col.name] = inline
            if col.ref:
                columns[col.ref] = ref_index
                if chunk is not None:
                    chunks[col.name] = chunk
            columns[f"{col.name}__w"] = written
        if written is not None and col.status not in names and values.null_count == 0:
            columns[col.status] = written  # every row writes it: every status true (bulk case)
            set_mask |= 1 << bit
        elif col.status in names or written is not None:
            explicit = (_as_type(table, col.status, pa.bool_()) if col.status in names
                        else pa.nulls(n, pa.bool_()))
            implied = pc.if_else(written, True, None) if written is not None else explicit
            effective = pc.coalesce(explicit, implied)
            columns[col.status] = effective
            eff = effective.to_numpy(zero_copy_only=False)
            set_mask |= np.where(eff == True, 1 << bit, 0)  # noqa: E712 (object array)
            clear_mask |= np.where(eff == False, 1 << bit, 0)  # noqa: E712
    physical = pa.table(columns)
    return PreparedPut(tdef.name, physical, keys, data_columns, status_columns, chunks,
                       set_mask, clear_mask, "policy_version" in names)


def _prepare_small(tdef: TableDef, table: pa.Table, names: list[str], current_version: int,
                   ref_threshold: int) -> PreparedPut | None:
    """:func:`prepare_put` for a few rows without compute kernels, whose fixed cost per call
    outweighs their speed on so few values. Gives exactly the general path's result, or None
    where that path must decide (any unusual input, and every error: the general path raises
    it)."""
    n = table.num_rows
    sid = _as_type(table, "sample_id", pa.large_string())
    if sid.null_count:
        return None
    sids = sid.to_pylist()
    inputs: list[str] = []
    turns: list[int] = []
    trajs: list[int] = []
    for text in sids:
        m = _SAMPLE_ID.fullmatch(text)
        if m is None or len(text) > MAX_SAMPLE_ID:
            return None
        inputs.append(m.group(1))
        turns.append(int(m.group(2)))
        trajs.append(int(m.group(3)))
    if "policy_version" in names:
        versions = _as_type(table, "policy_version", pa.int64())
        if versions.null_count:
            return None
        version_list = versions.to_pylist()
    else:
        versions = pa.array(np.full(n, current_version, np.int64))
        version_list = [current_version] * n
    finished = (_as_type(table, "finished_version", pa.int64()) if "finished_version" in names
                else pa.nulls(n, pa.int64()))
    keys = list(zip(sids, version_list))
    if len(set(keys)) != n:
        return None
    columns: dict[str, pa.Array] = {
        "sample_id": sid,
        "input_id": pa.array(inputs, pa.large_string()),
        "turn": pa.array(turns, pa.int32()),
        "trajectory_id": pa.array(trajs, pa.int32()),
        "policy_version": versions,
        "finished_version": finished,
    }
    data_columns = [c.name for c in tdef.columns if c.name in names]
    status_columns = [c.status for c in tdef.columns if c.name in names or c.status in names]
    chunks: dict[str, Chunk] = {}
    set_mask = np.zeros(n, np.int64)
    clear_mask = np.zeros(n, np.int64)
    trues = constant_bools(True, n)
    for bit, col in enumerate(tdef.columns):
        written: list[bool] | None = None
        every_row = False  # every row writes this column
        ref = col.ref
        if col.name in names:
            values = _as_type(table, col.name, col.type, copy=ref is None)
            every_row = values.null_count == 0
            if every_row:
                written, written_array = [True] * n, trues
            elif values.null_count == n:
                written, written_array = [False] * n, constant_bools(False, n)
            else:
                written = pc.is_valid(values).to_pylist()
                written_array = pa.array(written, pa.bool_())
            if ref is None:
                inline, ref_index, chunk = values, pa.nulls(n, pa.int64()), None
            elif col.storage == "auto" and _at_most(values, ref_threshold):
                inline, ref_index, chunk = _owned(values), pa.nulls(n, pa.int64()), None
            else:
                inline, ref_index, chunk = _split(col.name, values, col.storage, ref_threshold,
                                                  read_only(table.column(col.name)))
            columns[col.name] = inline
            if ref:
                columns[ref] = ref_index
                if chunk is not None:
                    chunks[col.name] = chunk
            columns[f"{col.name}__w"] = written_array
        if every_row and col.status not in names:
            # every status true (the usual one-sample put)
            columns[col.status] = trues
            set_mask |= 1 << bit
        elif col.status in names or written is not None:
            explicit = (_as_type(table, col.status, pa.bool_()).to_pylist() if col.status in names
                        else [None] * n)
            implied = [True if w else None for w in written] if written is not None else explicit
            effective = [e if e is not None else i for e, i in zip(explicit, implied)]
            columns[col.status] = pa.array(effective, pa.bool_())
            bit_value = 1 << bit
            for i, e in enumerate(effective):
                if e is True:
                    set_mask[i] |= bit_value
                elif e is False:
                    clear_mask[i] |= bit_value
    physical = pa.table(columns)
    return PreparedPut(tdef.name, physical, keys, data_columns, status_columns, chunks,
                       set_mask, clear_mask, "policy_version" in names)


def _at_most(values: pa.Array, threshold: int) -> bool:
    """Whether no string or bytes value can be over ``threshold`` bytes (their data buffer, which
    holds them all, is not); False where unsure."""
    if not (pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type)):
        return False
    data = values.buffers()[2]
    return data is None or data.size <= threshold


def _merge_duplicates(table: pa.Table, keys: list[tuple[str, int]]) -> pa.Table:
    """Several writes of one sample in one batch: merge them in order, as if sent one by one
    (a later non-null value wins, a null leaves the earlier value)."""
    rows = table.to_pylist()
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for key, row in zip(keys, rows):
        into = merged.setdefault(key, {})
        for column, value in row.items():
            if value is not None or column not in into:
                into[column] = value
    for key, row in merged.items():
        row["policy_version"] = key[1]
    schema = table.schema
    if "policy_version" not in schema.names:
        schema = schema.append(pa.field("policy_version", pa.int64()))
    return pa.Table.from_pylist(list(merged.values()), schema=schema)


def _as_type(table: pa.Table, name: str, target: pa.DataType, *,
             copy: bool = True) -> pa.Array:
    """A column as one Array of ``target``'s type, in buffers of its own (``copy=False``: may
    point into the table; :func:`_split` takes those and copies whatever it keeps).

    Why the copy (``combine_chunks`` copies even one chunk): a batch the server receives is one
    buffer with every column in it, and a column kept without a copy (in the cache of claimable
    values) keeps all of it alive, large values included: without it, ingesting wide rows ran
    far slower while the server's memory grew by each batch. Values stored by reference are
    copied once, into their chunk when it is written (:class:`store.blob_chunks.ColumnChunk`), not
    into buffers of their own as well; the blob store decides whether to keep them as they
    came.
    """
    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        arr = col.chunk(0) if not copy and col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    return _converted(name, arr, target)


def _converted(name: str, arr: pa.Array, target: pa.DataType) -> pa.Array:
    """``arr`` as ``target``'s type if it converts without changing meaning
    (:func:`store.types.cast_problem`), tensors checked (:func:`store.tensors.tensor_problem`)."""
    if arr.type != target:
        if pa.types.is_null(arr.type):
            return pa.nulls(len(arr), target)
        problem = cast_problem(arr.type, target)
        if problem is not None:
            raise SchemaMismatch(f"column {name!r} has type {type_name(arr.type)}, which is not "
                                 f"written to a {type_name(target)} column: {problem}; send "
                                 f"{type_name(target)} values")
        try:
            arr = arr.cast(target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise SchemaMismatch(f"column {name!r} has type {arr.type}, which does not convert "
                                 f"to the expected {type_name(target)}: {e}") from e
    if is_tensor(target):
        problem = tensor_problem(arr)
        if problem is not None:
            raise SchemaMismatch(f"tensor column {name!r}: {problem}")
    return arr


def _split(name: str, values: pa.Array, storage: str, threshold: int,
           sent_read_only: bool = False) -> tuple[pa.Array, pa.Array, Chunk | None]:
    """Split a column into inline values and by-reference rows (index into one chunk).

    The values of a column that can be stored by reference may point into the received batch
    (``_as_type(copy=False)``): what is kept inline is a copy, and the chunk is serialised when
    the blob store writes it where the column was sent in read-only buffers
    (``sent_read_only``, see :func:`store.blob_chunks.column_chunk`), else now. Those of a column
    stored only by value are already a copy."""
    n = len(values)
    null_index = pa.nulls(n, pa.int64())
    if storage == "value" or not is_complex(values.type):
        return values, null_index, None
    if storage == "ref":
        big = pc.is_valid(values)
    else:
        big = pc.and_(pc.is_valid(values), pc.greater(_value_bytes(values), threshold))
    big = pc.fill_null(big, False)
    big_np = big.to_numpy(zero_copy_only=False).astype(bool)
    count = int(big_np.sum())
    if count == 0:
        return _owned(values), null_index, None
    if count == n:
        # Every row by reference (wide rows): serialise the values as they are, no copy by
        # ``take`` (it copies every byte) and no if_else over them to null them inline.
        index = np.arange(n, dtype=np.int64)
        return (pa.nulls(n, values.type), pa.array(index, mask=index < 0),
                column_chunk(values, owned=sent_read_only))
    positions = np.nonzero(big_np)[0]
    chunk = column_chunk(values.take(pa.array(positions, pa.int64())), owned=True)
    index = np.full(n, -1, np.int64)
    index[positions] = np.arange(count)
    ref_index = pa.array(index, mask=index < 0)
    inline = if_else(big, pa.nulls(1, values.type)[0], values)
    return inline, ref_index, chunk


def _owned(values: pa.Array) -> pa.Array:
    """``values`` in buffers of their own (a copy)."""
    return pa.concat_arrays([values])


def _value_bytes(values: pa.Array) -> pa.Array:
    t = values.type
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return pc.binary_length(values)
    if is_tensor(t):
        data = values.field("data")
        return pc.multiply(pc.list_value_length(data), data.type.value_type.bit_width // 8)
    try:
        width = max(t.value_type.bit_width // 8, 1)
    except ValueError:  # variable-width elements (list<string>): count 8 bytes each at least
        width = 8
    return pc.multiply(pc.list_value_length(values), width)
