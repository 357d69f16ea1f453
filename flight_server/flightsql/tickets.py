"""Statement handles of TicketStatementQuery: the SQL and its bound parameters, self-contained.

A ticket carries everything DoGet needs, so DoGet keeps no server state: it works after the
prepared statement was closed, after a client re-bound other parameters (the ticket keeps the
binding of its GetFlightInfo), and on any server process. The handle is an Arrow IPC stream:
the SQL in the schema metadata, the parameter sets as rows of the batches. A forged ticket gains
nothing: its SQL goes through the same read-only executor as any CommandStatementQuery.
"""
from __future__ import annotations

import pyarrow as pa

_SQL_KEY = b"expstore.flightsql.sql"


def encode(sql: str, parameters: pa.Table | None = None) -> bytes:
    """The statement handle of ``sql`` with ``parameters`` (one parameter set per row)."""
    table = parameters if parameters is not None else pa.table({})
    table = table.replace_schema_metadata({_SQL_KEY: sql.encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode(handle: bytes) -> tuple[str, list[list[object]] | None]:
    """The SQL and parameter sets of a handle from :func:`encode`.

    Raises:
        ValueError: the handle was not made by :func:`encode`.
    """
    try:
        table = pa.ipc.open_stream(pa.py_buffer(handle)).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"statement handle of {len(handle)} bytes is not one this server "
                         "issued: expected a handle from GetFlightInfo") from e
    metadata = table.schema.metadata or {}
    if _SQL_KEY not in metadata:
        raise ValueError("statement handle carries no SQL: expected a handle from GetFlightInfo")
    return metadata[_SQL_KEY].decode(), parameter_sets(table)


def parameter_sets(parameters: pa.Table) -> list[list[object]] | None:
    """Rows of ``parameters`` as positional value lists; None when there are no columns."""
    if parameters.num_columns == 0:
        return None
    columns = [column.to_pylist() for column in parameters.columns]
    return [list(row) for row in zip(*columns)]
