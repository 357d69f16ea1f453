"""What the Flight SQL handler needs from the store: read-only SQL and the table list.

The handler never touches DuckDB; the store's query path (statement guard, time limit, reader
cursors) stays the one place that decides what SQL may run.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import pyarrow as pa


class SqlExecutor(Protocol):
    """Read-only SQL over the experience tables."""

    def query(self, sql: str, params: list | None = None) -> pa.Table:
        """Run one guarded, time-limited SELECT; raise the store's errors otherwise."""
        ...

    def query_schema(self, sql: str, params: list | None = None) -> pa.Schema:
        """The result schema ``query`` would return, without fetching the rows."""
        ...

    def tables(self) -> list[tuple[str, pa.Schema]]:
        """The experience tables as ``(name, arrow schema)``."""
        ...


#: Turns an executor error into the exception the client should see (for instance a Flight
#: error type); returning the error itself re-raises it unchanged.
ErrorMapper = Callable[[Exception], BaseException]
