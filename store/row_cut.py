"""Cutting a claim's rows out of the columns of a cached put: worked out once per claim, applied
to every column.

A claim takes rows of a put by their row numbers in claim order. Claims take rows in sample-id
order, which runs through a put in one stretch, or in a few where the ids' digit counts differ;
so the rows are cut as one zero-copy slice when they are consecutive, as slices joined by one
copy when they form a few runs, else by a ``take``.

Why not always a take: Arrow's take of list and string values is several times slower than
copying the same bytes a run at a time (16 rows of 10 list columns in two runs: ~0.84 ms against
~0.2 ms). Why once per claim: finding the runs again for each of a claim's columns, and cutting
each of its plain columns alone, cost more than the cut (a claim returns 10-30 columns).

>>> import pyarrow as pa
>>> rows = RowCut([4, 5, 6, 0, 1])
>>> rows.runs
[(4, 3), (0, 2)]
>>> rows.array(pa.array(range(10))).to_pylist()
[4, 5, 6, 0, 1]
"""
from __future__ import annotations

from typing import Any, Sequence

import pyarrow as pa

from .types import one_array

#: Rows in at most this many runs of consecutive rows are cut as slices joined by one copy;
#: more take a ``take``.
MAX_RUNS = 8


class RowCut:
    """Rows ``rows`` of a put (row numbers, in the order wanted), as runs of consecutive rows.

    Attributes:
        rows: the row numbers.
        runs: ``(first row, length)`` of each run in order, or None where there are more than
            :data:`MAX_RUNS` (then the rows are taken).
    """

    __slots__ = ("rows", "runs", "_indices")

    def __init__(self, rows: Sequence[int]) -> None:
        if not len(rows):
            raise ValueError("a cut needs at least one row")
        self.rows = rows
        self._indices: pa.Array | None = None
        self.runs = runs_of(rows)

    def indices(self) -> pa.Array:
        """The rows as an Arrow int64 array (for a take)."""
        if self._indices is None:
            self._indices = pa.array(self.rows, pa.int64())
        return self._indices

    def array(self, values: pa.Array | pa.ChunkedArray) -> pa.Array:
        """The rows of one column, in order, as one array."""
        runs = self.runs
        if runs is None:
            return one_array(values.take(self.indices()))
        if len(runs) == 1:
            return one_array(values.slice(*runs[0]))
        pieces: list[pa.Array] = []
        for at, length in runs:
            part = values.slice(at, length)
            pieces.extend([part] if isinstance(part, pa.Array) else part.chunks)
        return pa.concat_arrays(pieces)

    def columns(self, data: pa.Table) -> list[pa.Array]:
        """The rows of every column of ``data``, each as one array, cut in one step for the
        whole table (one slice, one join of the runs, or one take)."""
        batches = data.to_batches()
        if len(batches) == 1:
            return self.rows_of(batches[0]).columns
        return [one_array(c) for c in self.rows_of(data).columns]

    def rows_of(self, data: Any) -> Any:
        """The rows of ``data`` (a table or a record batch), in order: one slice, one join of
        the runs, or one take."""
        runs = self.runs
        if runs is None:
            return data.take(self.indices())
        if len(runs) == 1:
            return data.slice(*runs[0])
        pieces = [data.slice(at, n) for at, n in runs]
        return pa.concat_batches(pieces) if isinstance(data, pa.RecordBatch) \
            else pa.concat_tables(pieces)


def runs_of(rows: Sequence[int]) -> list[tuple[int, int]] | None:
    """``(first row, length)`` of each run of consecutive rows, or None past :data:`MAX_RUNS`
    (a loop: for the few dozen rows of a claim, faster than numpy's calls)."""
    first = rows[0]
    if isinstance(rows, range) and rows.step == 1:
        return [(first, len(rows))]
    if rows[-1] - first == len(rows) - 1 and list(rows) == list(range(first, first + len(rows))):
        return [(first, len(rows))]
    runs: list[tuple[int, int]] = []
    start = previous = first
    for row in rows[1:]:
        if row != previous + 1:
            runs.append((start, previous - start + 1))
            if len(runs) >= MAX_RUNS:
                return None
            start = row
        previous = row
    runs.append((start, previous - start + 1))
    return runs


def cut(values: pa.Array | pa.ChunkedArray, rows: Sequence[int]) -> pa.Array:
    """Rows ``rows`` of ``values``, in that order, as one array (see :class:`RowCut`)."""
    return RowCut(rows).array(values)
