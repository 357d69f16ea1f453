"""Ways to hand a statement its rows: an Arrow table registered for it, or list parameters."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import duckdb
import numpy as np
import pyarrow as pa

from .naming import quote


@contextmanager
def registered(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> Iterator[None]:
    """Expose an Arrow table to SQL for one statement."""
    con.register(name, table)
    try:
        yield
    finally:
        try:
            con.unregister(name)
        except duckdb.Error:  # an aborted transaction refuses even this; ROLLBACK follows
            pass


# Up to this many rows, a statement reads its rows from list parameters (``unnest``) instead of
# a registered Arrow table: for an ack's few rows, list parameters cost less than registering
# and unregistering a table; from a couple of thousand rows on, the registered table wins.
LIST_SOURCE_ROWS = 1024
ListColumns = dict[str, tuple[str, list[Any]]]  # column name → (DuckDB type, values)
LIST_TYPES = {"BIGINT": pa.int64(), "INTEGER": pa.int32(), "BOOLEAN": pa.bool_(),
              "VARCHAR": pa.string(), "TIMESTAMPTZ": pa.timestamp("us", tz="UTC")}


@contextmanager
def row_source(con: duckdb.DuckDBPyConnection, name: str,
               columns: ListColumns) -> Iterator[tuple[str, list[Any]]]:
    """A FROM item reading ``columns``, and its parameters (they follow the statement's own):
    list parameters for a few rows, the columns registered as an Arrow table ``name`` for many."""
    rows = len(next(iter(columns.values()))[1])
    if rows <= LIST_SOURCE_ROWS:
        select = ", ".join(f"unnest(?::{kind}[]) AS {quote(c)}"
                           for c, (kind, _) in columns.items())
        yield f"(SELECT {select})", [values for _, values in columns.values()]
        return
    table = pa.table({c: pa.array(values, LIST_TYPES[kind])
                      for c, (kind, values) in columns.items()})
    with registered(con, name, table):
        yield name, []


_TIMESTAMPTZ = pa.timestamp("us", "UTC")


def now_column(n: int) -> pa.Array:
    """The time now, ``n`` times, as DuckDB's now() would give it to a TIMESTAMPTZ column (for
    rows the put log carries instead of a statement)."""
    now = time.time_ns() // 1000
    if n <= 64:  # (for a few rows a list is cheaper than numpy's set-up)
        return pa.array([now] * n, _TIMESTAMPTZ)
    return pa.array(np.full(n, now, "datetime64[us]"), _TIMESTAMPTZ)
