"""The read side's cursors and limits: one registry of per-thread cursors, the query slots, and
running users' SQL under a time limit in a read-only transaction.

Why cursors per thread: a DuckDB connection must not be shared between threads; each reading
thread gets cursors of its own from one root cursor, kept here (not in thread-locals) so that
closing the store, or reopening the database after DuckDB invalidated it, drops every one of
them, also those of threads that live on (gRPC's pool). A thread has up to two: a plain cursor
for the store's own reads (claims' values, raw blob keys), and a value cursor for users' SQL and
claim predicates, whose tables show by-reference values (see store/sqlvalues.py).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import duckdb
import pyarrow as pa

from .blobs import BlobStore
from .deadlines import Deadlines
from .errors import QueryBusy, QueryRefused, QueryTimeout, StorageError, StoreClosed, \
    Unavailable
from .index import StoreIndex
from .sqlvalues import ValueCursor, ValueViews

# Every store's query time limits, on one thread (see store/deadlines.py).
_DEADLINES = Deadlines("expstore-query-limits")


@dataclass
class _ThreadCursors:
    plain: duckdb.DuckDBPyConnection | None = None
    values: ValueCursor | None = None


class Readers:
    """The cursors, query slots and SQL runner of one store.

    Args:
        con: the database connection the cursors come from.
        index: the in-memory index (the tables the query views show).
        blobs: the blob store the query views read by-reference values from.
        max_concurrent_queries: query slots (users' SQL and claim predicates share them).
        materialize: returns once every acknowledged write is in DuckDB (the writer's).
        read_fault: the error for a read while the database cannot be read, if it cannot.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, index: StoreIndex, blobs: BlobStore,
                 max_concurrent_queries: int, materialize: Callable[[], None],
                 read_fault: Callable[[], Exception | None]) -> None:
        self._index = index
        self._views = ValueViews(blobs)
        self._materialize = materialize
        self._read_fault = read_fault
        self._slots = threading.BoundedSemaphore(max_concurrent_queries)
        self._cursors: dict[int, _ThreadCursors] = {}
        self._root = con.cursor()
        self._lock = threading.Lock()  # guards _root and new cursors against close and reopen
        self._closed = False
        # Cursors running users' SQL now, and why they are ended (see end_queries).
        self._running: set[duckdb.DuckDBPyConnection] = set()
        self._ended: str | None = None

    # -- cursors ------------------------------------------------------------------------------
    def cursor(self, materialize: bool = True) -> duckdb.DuckDBPyConnection:
        """This thread's plain cursor; first, unless told not to, every acknowledged write
        reaches DuckDB (see :meth:`Writer.materialize`)."""
        if materialize:
            self._materialize()
        mine = self._cursors.get(threading.get_ident())
        if mine is not None and mine.plain is not None:
            return mine.plain
        with self._lock:
            mine = self._mine()
            mine.plain = self._root.cursor()
            return mine.plain

    def value_cursor(self) -> ValueCursor:
        """This thread's value cursor, its views in step with the tables (see sqlvalues)."""
        self._materialize()  # every acknowledged write is in DuckDB before a read
        mine = self._cursors.get(threading.get_ident())
        values = None if mine is None else mine.values
        if values is None:
            with self._lock:
                mine = self._mine()
                values = mine.values = self._views.cursor(self._root.cursor())
        index = self._index
        with index.lock:
            seq, tables = index.ddl_seq, [live.tdef for live in index.live.values()]
        try:
            self._views.refresh(values, tables, seq)
        except duckdb.Error as e:
            raise StorageError(f"cannot prepare the query views of by-reference columns: {e}") \
                from e
        return values

    def _mine(self) -> _ThreadCursors:
        """This thread's entry (``_lock`` held); refused once the store is closing."""
        if self._closed:
            raise StoreClosed("the store is closed")
        return self._cursors.setdefault(threading.get_ident(), _ThreadCursors())

    def reopen(self, reopen: Callable[[], duckdb.DuckDBPyConnection]) -> duckdb.DuckDBPyConnection:
        """Close every cursor, let ``reopen`` open the database again, and take cursors from the
        new connection from now on; its connection."""
        with self._lock:
            self._close_cursors()
            con = reopen()
            self._root = con.cursor()
        return con

    def closing(self) -> None:
        """The store is closing: no new cursors."""
        self._closed = True

    def close(self) -> None:
        """Close every cursor."""
        with self._lock:
            self._closed = True
            self._close_cursors()

    def _close_cursors(self) -> None:
        """Close every cursor, the root too (``_lock`` held); threads get new ones on their next
        read."""
        cursors: list[duckdb.DuckDBPyConnection] = []
        for mine in self._cursors.values():
            if mine.values is not None:
                cursors.append(mine.values.cursor)
            if mine.plain is not None:
                cursors.append(mine.plain)
        for cursor in cursors + [self._root]:
            try:
                cursor.close()
            except duckdb.Error:
                pass
        self._cursors.clear()

    # -- users' SQL ---------------------------------------------------------------------------
    def take_query_slot(self, limit: float, what: str) -> float:
        """Take one of the query slots, waiting at most ``limit`` seconds; return the deadline
        (monotonic) by which the work must end, the wait included. The caller releases it
        (:meth:`release_query_slot`)."""
        deadline = time.monotonic() + limit
        if not self._slots.acquire(timeout=limit):
            raise QueryBusy(f"no query slot became free within {limit} s for {what}; too "
                            "many concurrent queries (and claim predicates)")
        return deadline

    def release_query_slot(self) -> None:
        self._slots.release()

    def end_queries(self, reason: str | None) -> None:
        """Cancel the SQL running now and refuse more, each with ``Unavailable(reason)`` (a
        server that stops must not wait for a query to run to its time limit); ``None``
        takes queries again."""
        with self._lock:
            self._ended = reason
            running = list(self._running) if reason is not None else []
        for cursor in running:
            cursor.interrupt()

    def run(self, sql: str, params: list[Any], timeout: float,
            deadline: float | None = None, stored: str | None = None) -> pa.Table:
        """Run users' SQL (a query or a claim predicate) on this thread's value cursor;
        cancelled after ``timeout`` seconds, or at ``deadline`` (monotonic). ``stored``: read
        that table whole as stored (keys, no values) instead of running ``sql``."""
        left = timeout if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise QueryTimeout(f"query ran past its {timeout} s limit (waiting for a query slot "
                               "included) and was cancelled")
        values = self.value_cursor()
        cursor = values.cursor
        values.take_error()
        with self._lock:
            if self._ended is not None:
                raise Unavailable(self._ended)
            self._running.add(cursor)
        limit = _DEADLINES.arm(left, cursor.interrupt)
        try:
            if stored is not None:
                # The store's own SELECT of one table: no user SQL to fence in a transaction.
                return values.stored_relation(stored).to_arrow_table()
            # The second layer under the SQL guard: the engine itself refuses any write in a
            # read-only transaction, whatever syntax slips past the guard.
            cursor.execute("BEGIN TRANSACTION READ ONLY")
            try:
                return cursor.sql(sql, params=params).to_arrow_table()
            finally:
                try:
                    cursor.execute("ROLLBACK")
                except duckdb.Error:
                    pass
        except duckdb.InterruptException as e:
            if self._ended is not None:
                raise Unavailable(self._ended) from e
            raise QueryTimeout(f"query ran past its {timeout} s limit and was cancelled") from e
        except duckdb.Error as e:
            fault = self._read_fault()
            if fault is not None:  # the database was invalidated under the query
                raise fault from e
            blob_error = values.take_error()
            if blob_error is not None:  # a by-reference value could not be read
                raise blob_error from e
            raise QueryRefused(f"query failed: {e}") from e
        finally:
            _DEADLINES.cancel(limit)
            with self._lock:
                self._running.discard(cursor)
