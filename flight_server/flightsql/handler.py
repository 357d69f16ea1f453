"""The read-only Arrow Flight SQL handler that expstore's Flight server delegates to.

Flight SQL rides on plain Flight RPCs, so it shares the server's port: the server asks the
``is_flight_sql_*`` predicates first and hands matching calls here. Flight SQL descriptors and
tickets are protobuf ``Any`` messages with the ``type.googleapis.com/arrow.flight.protocol.sql.``
type URL, which neither expstore's path descriptors nor its JSON tickets can be mistaken for.

Errors, and why each type (pyarrow converts the Python exception to the gRPC status):

* refused operations (updates, ingest, transactions, Substrait, XDBC type info) raise
  ``NotImplementedError`` -> ``UNIMPLEMENTED``. pyarrow has no Flight error class for that
  status; it is gRPC's "not supported by this server", which is what a read-only server means
  (SqlInfo says FLIGHT_SQL_SERVER_READ_ONLY), and ADBC reports it as ``NotSupportedError``.
  ``FlightUnauthorizedError`` (PERMISSION_DENIED) would wrongly suggest that other credentials
  could do it; ``FlightServerError`` (INTERNAL) would blame the server.
* malformed requests raise ``ValueError`` -> ``INVALID_ARGUMENT``;
* an unknown or expired prepared statement raises ``KeyError`` -> ``NOT_FOUND``;
* errors of the executor (the store's query path) pass through unchanged, or through
  ``error_mapper`` when one is given, so the server's single error boundary translates them.
"""
from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from . import messages, metadata, schemas, sqlinfo, tickets
from .executor import ErrorMapper, SqlExecutor
from .prepared import PreparedStatements

CREATE_PREPARED_STATEMENT = "CreatePreparedStatement"
CLOSE_PREPARED_STATEMENT = "ClosePreparedStatement"

#: DoAction types served here, with the descriptions for ListActions.
ACTIONS = {
    CREATE_PREPARED_STATEMENT:
        "Flight SQL: prepare a read-only query (ActionCreatePreparedStatementRequest)",
    CLOSE_PREPARED_STATEMENT:
        "Flight SQL: close a prepared statement (ActionClosePreparedStatementRequest)",
}
#: Flight SQL DoAction types refused because the endpoint is read-only or lacks the feature.
REFUSED_ACTIONS = frozenset({
    "BeginTransaction", "EndTransaction", "BeginSavepoint", "EndSavepoint",
    "CreatePreparedSubstraitPlan", "CancelQuery",
})
#: Flight SQL commands refused wherever they arrive (GetFlightInfo, GetSchema, DoPut).
REFUSED_COMMANDS = frozenset({
    "CommandStatementUpdate", "CommandPreparedStatementUpdate", "CommandStatementIngest",
    "CommandStatementSubstraitPlan", "CommandGetXdbcTypeInfo",
})
# Metadata commands, answered from the catalog; their ticket is the command itself.
_METADATA_COMMANDS = frozenset({
    "CommandGetSqlInfo", "CommandGetCatalogs", "CommandGetDbSchemas", "CommandGetTables",
    "CommandGetTableTypes", "CommandGetPrimaryKeys", "CommandGetExportedKeys",
    "CommandGetImportedKeys", "CommandGetCrossReference",
})
# Experience tables declare no primary or foreign keys: these answer empty results.
_KEY_COMMANDS = {
    "CommandGetPrimaryKeys": schemas.PRIMARY_KEYS,
    "CommandGetExportedKeys": schemas.FOREIGN_KEYS,
    "CommandGetImportedKeys": schemas.FOREIGN_KEYS,
    "CommandGetCrossReference": schemas.FOREIGN_KEYS,
}


def _server_version() -> str:
    try:
        return importlib.metadata.version("expstore")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class FlightSqlHandler:
    """Serves the read-only part of Flight SQL over a :class:`SqlExecutor`.

    Statement queries, prepared statements with bound parameters, GetSqlInfo, GetCatalogs,
    GetDbSchemas, GetTables, GetTableTypes (and empty key metadata) are served; writes,
    ingestion, transactions and Substrait are refused.

    Example (a Flight server delegating to it; ``executor`` is any :class:`SqlExecutor`)::

        handler = FlightSqlHandler(executor)

        class Server(flight.FlightServerBase):
            def get_flight_info(self, context, descriptor):
                if handler.is_flight_sql_descriptor(descriptor):
                    return handler.get_flight_info(context, descriptor)
                ...

        # then: adbc_driver_flightsql.dbapi.connect("grpc://127.0.0.1:<port>")

    Args:
        executor: runs the SQL; the handler adds no SQL of its own.
        catalog_name: the catalog reported for every table.
        schema_name: the database schema reported for every table.
        error_mapper: applied to exceptions raised by ``executor``; None re-raises them as is.
        server_name: FLIGHT_SQL_SERVER_NAME.
        server_version: FLIGHT_SQL_SERVER_VERSION; default, the installed expstore version.
        statement_idle_timeout_s: prepared statements unused this long are closed.
        max_prepared_statements: how many prepared statements may be open at once.
    """

    def __init__(self, executor: SqlExecutor, catalog_name: str = "expstore",
                 schema_name: str = "main", *, error_mapper: ErrorMapper | None = None,
                 server_name: str = "expstore", server_version: str | None = None,
                 statement_idle_timeout_s: float = 600.0,
                 max_prepared_statements: int = 1024) -> None:
        self.executor = executor
        self.catalog_name = catalog_name
        self.schema_name = schema_name
        self._error_mapper = error_mapper
        self._prepared = PreparedStatements(statement_idle_timeout_s, max_prepared_statements)
        self._sql_info = sqlinfo.default_sql_info(
            server_name, server_version or _server_version(),
            int(statement_idle_timeout_s * 1000))

    # -- routing -----------------------------------------------------------------------------

    def is_flight_sql_descriptor(self, descriptor: flight.FlightDescriptor) -> bool:
        """True for a CMD descriptor with a Flight SQL command (GetFlightInfo, GetSchema, DoPut)."""
        return (descriptor.descriptor_type == flight.DescriptorType.CMD
                and messages.peek(descriptor.command) is not None)

    def is_flight_sql_ticket(self, ticket: flight.Ticket) -> bool:
        """True for a ticket this handler issued (DoGet)."""
        return messages.peek(ticket.ticket) is not None

    def is_flight_sql_action(self, action_type: str) -> bool:
        """True for a Flight SQL action type, served or refused here (DoAction)."""
        return action_type in ACTIONS or action_type in REFUSED_ACTIONS

    def list_actions(self) -> list[flight.ActionType]:
        """The served action types, for the server's ListActions."""
        return [flight.ActionType(name, text) for name, text in ACTIONS.items()]

    # -- RPCs --------------------------------------------------------------------------------

    def get_flight_info(self, context: flight.ServerCallContext | None,
                        descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        """Plan a command: its result schema and one endpoint on this server."""
        name, command = self._command(descriptor)
        if name in _METADATA_COMMANDS:
            schema, ticket = self._metadata_schema(name, command), descriptor.command
        else:
            sql, parameters = self._statement(name, command)
            schema = self._schema(sql, parameters)
            ticket = messages.pack(messages.TicketStatementQuery(
                statement_handle=tickets.encode(sql, parameters)))
        endpoint = flight.FlightEndpoint(ticket, [])
        return flight.FlightInfo(schema, descriptor, [endpoint], total_records=-1, total_bytes=-1)

    def get_schema(self, context: flight.ServerCallContext | None,
                   descriptor: flight.FlightDescriptor) -> flight.SchemaResult:
        """The result schema of a command, without running it."""
        name, command = self._command(descriptor)
        if name in _METADATA_COMMANDS:
            return flight.SchemaResult(self._metadata_schema(name, command))
        sql, parameters = self._statement(name, command)
        return flight.SchemaResult(self._schema(sql, parameters))

    def do_get(self, context: flight.ServerCallContext | None,
               ticket: flight.Ticket) -> flight.FlightDataStream:
        """Run what a ticket from :meth:`get_flight_info` names and stream the result."""
        found = messages.peek(ticket.ticket)
        if found is None:
            raise ValueError("ticket is not a Flight SQL ticket: expected one from GetFlightInfo")
        name, payload = found
        if name == "TicketStatementQuery":
            handle = messages.unpack(name, payload).statement_handle
            sql, parameter_sets = tickets.decode(handle)
            table = self._run(sql, parameter_sets)
        elif name in _METADATA_COMMANDS:
            table = self._metadata_table(name, self._unpack_command(name, payload))
        else:
            raise ValueError(f"Flight SQL {name} is not a ticket: expected a ticket from "
                             "GetFlightInfo")
        return flight.RecordBatchStream(table)

    def do_action(self, context: flight.ServerCallContext | None,
                  action: flight.Action) -> Iterator[flight.Result]:
        """CreatePreparedStatement / ClosePreparedStatement; refuses transactions."""
        kind = action.type
        if kind in REFUSED_ACTIONS:
            raise NotImplementedError(
                f"Flight SQL action {kind!r} is not supported: this endpoint is read-only, "
                "without transactions, savepoints, Substrait or query cancellation")
        if kind not in ACTIONS:
            raise ValueError(f"unknown Flight SQL action {kind!r}; expected one of "
                             f"{sorted(ACTIONS)}")
        body = action.body.to_pybytes() if action.body is not None else b""
        if kind == CREATE_PREPARED_STATEMENT:
            request = self._action_body(body, "ActionCreatePreparedStatementRequest")
            self._refuse_transaction(request, kind)
            handle = self._prepared.open(request.query)
            # The schemas stay empty (allowed by the spec): a query with placeholders may have
            # no schema before parameters are bound; GetFlightInfo reports it after binding.
            result = messages.ActionCreatePreparedStatementResult(prepared_statement_handle=handle)
            return iter([flight.Result(messages.pack(result))])
        request = self._action_body(body, "ActionClosePreparedStatementRequest")
        self._prepared.close(request.prepared_statement_handle)
        return iter([])

    def do_put(self, context: flight.ServerCallContext | None,
               descriptor: flight.FlightDescriptor, reader: flight.MetadataRecordBatchReader,
               writer: flight.FlightMetadataWriter) -> None:
        """Bind parameters to a prepared query; refuse updates and ingestion."""
        name, command = self._command(descriptor)
        if name != "CommandPreparedStatementQuery":
            raise ValueError(f"Flight SQL {name} does not take DoPut; expected "
                             "CommandPreparedStatementQuery (parameter binding)")
        handle = command.prepared_statement_handle
        self._prepared.get(handle)  # fail before reading a stream for a closed statement
        self._prepared.bind(handle, reader.read_all())
        # Same handle: bindings live server-side, so legacy clients that ignore this answer work.
        answer = messages.DoPutPreparedStatementResult(prepared_statement_handle=handle)
        writer.write(pa.py_buffer(answer.SerializeToString()))

    # -- helpers -----------------------------------------------------------------------------

    def _command(self, descriptor: flight.FlightDescriptor) -> tuple[str, Any]:
        found = (messages.peek(descriptor.command)
                 if descriptor.descriptor_type == flight.DescriptorType.CMD else None)
        if found is None:
            raise ValueError("descriptor is not a Flight SQL command: expected a CMD descriptor "
                             "holding a google.protobuf.Any of arrow.flight.protocol.sql")
        name, payload = found
        if name in REFUSED_COMMANDS:
            raise NotImplementedError(
                f"Flight SQL {name} is not supported: this endpoint is read-only and runs SQL "
                "queries only (use CommandStatementQuery or a prepared SELECT)")
        return name, self._unpack_command(name, payload)

    def _unpack_command(self, name: str, payload: bytes) -> Any:
        if name in _KEY_COMMANDS:
            return None  # answered empty whatever the filters
        if name in _METADATA_COMMANDS or name in ("CommandStatementQuery",
                                                  "CommandPreparedStatementQuery"):
            return messages.unpack(name, payload)
        raise NotImplementedError(f"Flight SQL {name} is not supported by this endpoint")

    def _statement(self, name: str, command: Any) -> tuple[str, pa.Table | None]:
        """The SQL and bound parameters of a query command."""
        if name == "CommandStatementQuery":
            self._refuse_transaction(command, name)
            return command.query, None
        statement = self._prepared.get(command.prepared_statement_handle)
        return statement.sql, statement.parameters

    @staticmethod
    def _refuse_transaction(request: Any, where: str) -> None:
        if request.HasField("transaction_id"):
            raise NotImplementedError(f"{where} names a transaction, but this read-only "
                                      "endpoint has none (BeginTransaction is not supported)")

    @staticmethod
    def _action_body(body: bytes, expected: str) -> Any:
        found = messages.peek(body)
        if found is None or found[0] != expected:
            got = found[0] if found else f"{len(body)} bytes that are no Flight SQL message"
            raise ValueError(f"action body is {got}; expected a google.protobuf.Any of "
                             f"{expected}")
        return messages.unpack(*found)

    def _schema(self, sql: str, parameters: pa.Table | None) -> pa.Schema:
        sets = tickets.parameter_sets(parameters) if parameters is not None else None
        return self._guarded(self.executor.query_schema, sql, sets[0] if sets else None)

    def _run(self, sql: str, parameter_sets: list[list[object]] | None) -> pa.Table:
        if parameter_sets is None:
            return self._guarded(self.executor.query, sql, None)
        if not parameter_sets:
            raise ValueError("the prepared statement's bound parameters hold no rows; bind "
                             "at least one parameter set")
        # The spec runs every bound parameter set; their results are returned one after another.
        results = [self._guarded(self.executor.query, sql, params) for params in parameter_sets]
        return results[0] if len(results) == 1 else pa.concat_tables(results)

    def _guarded(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except Exception as e:
            if self._error_mapper is None:
                raise
            mapped = self._error_mapper(e)
            if mapped is e:
                raise
            raise mapped from e

    def _metadata_schema(self, name: str, command: Any) -> pa.Schema:
        if name == "CommandGetTables" and command.include_schema:
            return schemas.TABLES_WITH_SCHEMA
        return {
            "CommandGetSqlInfo": schemas.SQL_INFO,
            "CommandGetCatalogs": schemas.CATALOGS,
            "CommandGetDbSchemas": schemas.DB_SCHEMAS,
            "CommandGetTables": schemas.TABLES,
            "CommandGetTableTypes": schemas.TABLE_TYPES,
            **_KEY_COMMANDS,
        }[name]

    def _metadata_table(self, name: str, command: Any) -> pa.Table:
        if name == "CommandGetSqlInfo":
            return sqlinfo.sql_info_table(self._sql_info, command.info)
        if name == "CommandGetCatalogs":
            return metadata.catalogs_table(self.catalog_name)
        if name == "CommandGetDbSchemas":
            return metadata.db_schemas_table(self.catalog_name, self.schema_name, command)
        if name == "CommandGetTables":
            tables = self._guarded(self.executor.tables)
            return metadata.tables_table(self.catalog_name, self.schema_name, tables, command)
        if name == "CommandGetTableTypes":
            return metadata.table_types_table()
        return _KEY_COMMANDS[name].empty_table()
