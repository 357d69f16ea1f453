"""Flight SQL over the store: the executor the Flight SQL handler runs queries through.

Flight SQL queries go through the same read-only path as our own ``do_get`` tickets
(:meth:`EmbeddedStore.query`): the statement guard, the time limit and the query slots that keep
people's SQL from starving trainers and producers.
"""
from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa

from store.embedded import EmbeddedStore

from .errors import to_flight
from .flightsql import FlightSqlHandler


class StoreSqlExecutor:
    def __init__(self, store: EmbeddedStore) -> None:
        self._store = store

    def query(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        return self._store.query(sql, params)

    def query_schema(self, sql: str, params: list[Any] | None = None) -> pa.Schema:
        # The guard sees the user's statement as it is; then only its schema is computed.
        from store.sqlguard import check_select
        check_select(sql)
        return self._store.query(f"SELECT * FROM ({_statement_body(sql)}\n) AS _expstore_q "
                                 "LIMIT 0", params).schema

    def tables(self) -> list[tuple[str, pa.Schema]]:
        out = []
        for name in self._store.list_tables():
            out.append((name, self._store.query(f'SELECT * FROM "{name}" LIMIT 0').schema))
        return out


def _statement_body(sql: str) -> str:
    """``sql`` without the ``;`` and comments that may end a statement but not a subquery, so
    that every statement ``do_get`` runs also has a schema here (the guard checked it whole)."""
    end = len(sql)
    for start, kind in reversed(duckdb.tokenize(sql)):
        if kind == duckdb.token_type.comment or (kind == duckdb.token_type.operator
                                                 and sql[start:end].strip() == ";"):
            end = start
            continue
        break
    return sql[:end]


def make_handler(store: EmbeddedStore) -> FlightSqlHandler:
    return FlightSqlHandler(StoreSqlExecutor(store), error_mapper=to_flight)
