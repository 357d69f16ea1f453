"""Read-only Arrow Flight SQL for expstore, served on the Flight server's own port.

The main server routes calls here with :meth:`FlightSqlHandler.is_flight_sql_descriptor`,
:meth:`~FlightSqlHandler.is_flight_sql_ticket` and :meth:`~FlightSqlHandler.is_flight_sql_action`;
any Flight SQL client (ADBC, JDBC, DBeaver, pandas/polars through ADBC) can then query the
experience tables. See ``docs/flightsql.md``.
"""
from __future__ import annotations

from .executor import ErrorMapper, SqlExecutor
from .handler import FlightSqlHandler

__all__ = ["ErrorMapper", "FlightSqlHandler", "SqlExecutor"]
