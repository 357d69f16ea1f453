"""The pieces a claim's answer is cut and sent with: rows of a cached put as slices, and the
hand-assembled Arrow IPC stream, each against what the plain pyarrow call gives."""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from store.ipc import ipc_stream
from store.row_cut import MAX_RUNS, RowCut


def _rows_of(table: pa.Table, indices: list[int]) -> pa.Table:
    """How a claim cuts rows of a cached put (store/claim_engine.py)."""
    return RowCut(indices).rows_of(table)


def _table(n: int) -> pa.Table:
    return pa.table({"i": pa.array(range(n), pa.int64()),
                     "s": [f"row {k}" if k % 5 else None for k in range(n)],
                     "l": [[k, k + 1] for k in range(n)]})


@pytest.mark.parametrize("seed", range(40))
def test_rows_of_equals_a_take_for_any_indices(seed):
    rng = random.Random(seed)
    table = _table(300)
    n = rng.randint(1, 40)
    kind = seed % 4
    if kind == 0:      # one ascending run
        start = rng.randint(0, 300 - n)
        indices = list(range(start, start + n))
    elif kind == 1:    # a few runs, in any order
        indices = []
        for _ in range(rng.randint(2, MAX_RUNS)):
            start = rng.randint(0, 290)
            indices += list(range(start, start + rng.randint(1, 10)))
    elif kind == 2:    # scattered: more runs than slices are worth
        indices = rng.sample(range(300), n)
    else:              # descending
        indices = list(range(200, 200 - n, -1))
    got = _rows_of(table, indices)
    assert got.combine_chunks().equals(table.take(indices))


def test_rows_of_slices_without_copying_a_few_runs():
    table = _table(100)
    got = _rows_of(table, [10, 11, 12, 50, 51, 5])
    assert got.column("i").to_pylist() == [10, 11, 12, 50, 51, 5]
    assert got.column("i").num_chunks == 3  # three zero-copy slices, not a take


@pytest.mark.parametrize("table", [
    _table(0),
    _table(17),
    pa.Table.from_batches([_table(3).to_batches()[0], _table(4).to_batches()[0]]),
    pa.table({"t": pa.FixedShapeTensorArray.from_numpy_ndarray(
        np.arange(24, dtype=np.float32).reshape(4, 2, 3))}),
    pa.table({"x": pa.array([1.5, None], pa.float64())}).replace_schema_metadata({"k": "v"}),
])
def test_ipc_stream_reads_back_as_the_same_table(table):
    raw = ipc_stream(table)
    back = pa.ipc.open_stream(pa.py_buffer(raw)).read_all()
    assert back.schema.equals(table.schema, check_metadata=True)
    assert back.equals(table)
    # what a stream writer makes reads back the same
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    assert pa.ipc.open_stream(sink.getvalue()).read_all().equals(back)


@pytest.mark.parametrize("seed", range(24))
def test_row_cut_of_a_whole_table_equals_a_take(seed):
    """A claim cuts its plain columns together (one slice, one join of runs, or one take): the
    same rows as a take, each column one array, from a table of one batch or of several."""
    rng = random.Random(seed)
    table = _table(300)
    if seed % 2:
        table = pa.Table.from_batches(table.to_batches(max_chunksize=70))
    kind = seed % 3
    if kind == 0:
        start = rng.randint(0, 280)
        rows = list(range(start, start + rng.randint(1, 20)))
    elif kind == 1:
        rows = []
        for _ in range(rng.randint(2, MAX_RUNS)):
            start = rng.randint(0, 290)
            rows += list(range(start, start + rng.randint(1, 10)))
    else:
        rows = rng.sample(range(300), rng.randint(MAX_RUNS + 2, 40))
    cut = RowCut(rows)
    assert (cut.runs is None) == (kind == 2)
    got = cut.columns(table)
    assert all(isinstance(c, pa.Array) for c in got)
    assert pa.Table.from_arrays(got, schema=table.schema).equals(table.take(rows).combine_chunks())
    assert cut.array(table.column("l")).equals(table.column("l").take(rows).combine_chunks())
