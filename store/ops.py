"""What the writer is asked to do (the queued operations) and what one group transaction
collects on the way (its effects on memory, its new rows, its put-log records).

A caller queues an :class:`Op` and waits on its ``future``, which resolves after the commit (or
the put-log append) that made the change durable; see store/writer.py.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import duckdb
import pyarrow as pa

from .errors import ExpstoreError, StorageError
from .live import Lease, LiveTable, Row
from .prepare import PreparedPut
from .putlog import LeaseUpdate, Record


class KeyedRows(NamedTuple):
    """A put's rows with blob keys in its ``__ref`` columns (``rows``), and by such column the
    chunk (segment, offset, length) whose rows 0 … n-1 it names in order, else None
    (``whole``)."""

    rows: pa.Table
    whole: dict[str, tuple[int, int, int] | None]


@dataclass
class Op:
    """A queued change. ``future`` resolves after the commit that made it durable."""

    future: Future = field(default_factory=Future, init=False)


@dataclass
class PutOp(Op):
    prepared: PreparedPut


@dataclass
class SmallPutOp(Op):
    """A write of a few rows whose columns were checked, not yet its values.

    Why: preparing a one-sample put costs about as much Python as preparing 64 rows at once;
    with many producers, preparing each on its own thread also starves the writer of the GIL.
    The writer prepares runs of consecutive small puts to one table as one batch.
    """

    table: str
    data: pa.Table


@dataclass
class MergedPutOp(PutOp):
    """Several small puts prepared as one; each caller is answered for its own rows."""

    members: list[SmallPutOp]


@dataclass
class SettleOp(Op):
    """Ack (consume) or nack (return) the rows of a lease."""

    lease: Lease
    ack: bool


@dataclass
class BumpOp(Op):
    group: str
    expected: int | None
    weights_uri: str | None


@dataclass
class FlushOp(Op):
    """Nothing but a DuckDB transaction: it inserts the rows waiting in the put log; with
    ``leases``, it also writes the lease bookkeeping waiting, due or not (``requeue`` must find
    in DuckDB the rows that expired leases made dead)."""

    leases: bool = False


@dataclass
class ReadOp(Op):
    """A read of DuckDB and memory together (``stats``), run by the writer between two groups:
    DuckDB then holds every logged change and nothing commits until ``run(con)`` returns, so the
    two agree.

    Why not a reader cursor: a reader cannot see DuckDB and memory at one instant; under a steady
    stream of commits, ``stats`` retried its two queries up to 200 times (seconds under load).
    """

    run: Callable[[duckdb.DuckDBPyConnection], Any]


class NotLoggable(Exception):
    """A group that must go through DuckDB at once (see Writer._log_puts)."""


@dataclass
class CallOp(Op):
    """DDL and maintenance: ``run(con)`` inside the transaction, ``apply()`` after commit."""

    run: Callable[[duckdb.DuckDBPyConnection], Any]
    apply: Callable[[Any], Any] | None = None


class Txn:
    """Effects of one group transaction, applied to memory after the commit."""

    def __init__(self) -> None:
        self.applies: list[Callable[[], None]] = []
        self._new_rows: dict[str, dict[tuple[str, int], int]] = {}  # table -> key -> row id
        # Bulk puts' new keys (keys, first row id), put into _new_rows only if another put of
        # the transaction asks: building a dict of a bulk put's keys is a noticeable share of
        # the put.
        self._new_runs: dict[str, list[tuple[list[tuple[str, int]], int]]] = {}
        self.next_row_id: dict[str, int] = {}
        # Rows that became ready without their values at hand (partial writes): their payload is
        # read from DuckDB once, after the commit, so claims need no read of their own.
        self.need_payload: list[tuple[LiveTable, Row]] = []
        # Lease bookkeeping taken for this transaction: put back if it does not commit.
        self.row_updates: dict[str, list[LeaseUpdate]] = {}
        # id(put op) -> its rows with blob keys, made before any statement runs.
        self.physical: dict[int, KeyedRows] = {}
        # Set for a group going to the put log: the records of its changes.
        self.logged: list[Record] | None = None
        # The cached values of a logged group's rows, which the claim cache may drop once
        # DuckDB has them: (live table, the rows' keys, the values' Arrow table).
        self.logged_values: list[tuple[LiveTable, list[tuple[str, int]], pa.Table]] = []

    def new_rows(self, table: str) -> dict[tuple[str, int], int]:
        """Keys new in ``table`` in this transaction and their row ids (callers may add)."""
        rows = self._new_rows.setdefault(table, {})
        for keys, first in self._new_runs.pop(table, ()):
            rows.update(zip(keys, range(first, first + len(keys))))
        return rows

    def add_new_run(self, table: str, keys: list[tuple[str, int]], first: int) -> None:
        """Record ``keys`` as new in ``table``, numbered from ``first`` (see :meth:`new_rows`)."""
        self._new_runs.setdefault(table, []).append((keys, first))


def futures(op: Op) -> list[Future]:
    """The futures that answer an op's callers (one for each put of a merged put)."""
    if isinstance(op, MergedPutOp):
        return [m.future for m in op.members]
    return [op.future]


def resolve(op: Op, result: Any) -> None:
    results = result if isinstance(op, MergedPutOp) else [result]
    for future, one in zip(futures(op), results):
        if not future.done():
            future.set_result(one)


def fail(op: Op, error: BaseException) -> None:
    if not isinstance(error, ExpstoreError):
        if isinstance(error, duckdb.Error):
            error = StorageError(f"the store could not apply the change: {error}")
    for future in futures(op):
        if not future.done():
            future.set_exception(error)

