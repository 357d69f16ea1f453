"""The read-only Flight SQL handler, driven by real clients (ADBC, pandas, polars, pyarrow).

Until the main server delegates to it, each test starts a small pyarrow Flight server on a free
port that routes Flight SQL calls to the handler, over a real DuckDB file. The executor here
enforces read-only the way the store does (DuckDB parses; only one SELECT passes), so the
refusal tests exercise a real guard, not a mock.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_server.flightsql import FlightSqlHandler
from flight_server.flightsql import messages, metadata, sqlinfo, tickets
from flight_server.flightsql.prepared import PreparedStatements

adbc_dbapi = pytest.importorskip("adbc_driver_flightsql.dbapi")
adbc_manager = pytest.importorskip("adbc_driver_manager")
import adbc_driver_flightsql  # noqa: E402  (after importorskip)

TOKEN = "x"


class ReadOnlyViolation(Exception):
    """Stands in for the store's QueryRefused."""


class DuckDBExecutor:
    """A SqlExecutor over a DuckDB file: one SELECT per query, a cursor per call."""

    def __init__(self, path: Path) -> None:
        self._db = duckdb.connect(str(path))
        self._lock = threading.Lock()
        self.queries: list[tuple[str, list | None]] = []

    def _guard(self, sql: str) -> None:
        statements = duckdb.extract_statements(sql)
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
            kinds = [s.type.name for s in statements]
            raise ReadOnlyViolation(f"read-only: refused {kinds}, expected one SELECT")

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            return self._db.cursor()

    def query(self, sql: str, params: list | None = None) -> pa.Table:
        self._guard(sql)
        self.queries.append((sql, params))
        cursor = self._cursor()
        try:
            return cursor.sql(sql, params=params).to_arrow_table()
        finally:
            cursor.close()

    def query_schema(self, sql: str, params: list | None = None) -> pa.Schema:
        self._guard(sql)
        cursor = self._cursor()
        try:
            return cursor.sql(sql, params=params).limit(0).to_arrow_table().schema
        finally:
            cursor.close()

    def tables(self) -> list[tuple[str, pa.Schema]]:
        cursor = self._cursor()
        try:
            names = [r[0] for r in cursor.execute(
                "SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()]
            return [(n, cursor.table(n).limit(0).to_arrow_table().schema) for n in names]
        finally:
            cursor.close()

    def close(self) -> None:
        self._db.close()


class BearerAuth(flight.ServerMiddlewareFactory):
    """Accepts only calls carrying ``authorization: Bearer x``."""

    def start_call(self, info: flight.CallInfo, headers: dict[str, list[str]]) -> None:
        if headers.get("authorization") != [f"Bearer {TOKEN}"]:
            raise flight.FlightUnauthenticatedError("missing or wrong bearer token")
        return None


class DelegatingServer(flight.FlightServerBase):
    """What the main server does: Flight SQL calls go to the handler, the rest is its own."""

    def __init__(self, handler: FlightSqlHandler, auth: bool = False) -> None:
        middleware = {"auth": BearerAuth()} if auth else None
        super().__init__("grpc://127.0.0.1:0", middleware=middleware)
        self.handler = handler
        self.actions_seen: list[str] = []
        self.commands_seen: list[str] = []

    def get_flight_info(self, context, descriptor):
        if self.handler.is_flight_sql_descriptor(descriptor):
            self.commands_seen.append(messages.peek(descriptor.command)[0])
            return self.handler.get_flight_info(context, descriptor)
        raise flight.FlightServerError("expstore's own protocol is not part of this test")

    def get_schema(self, context, descriptor):
        if self.handler.is_flight_sql_descriptor(descriptor):
            return self.handler.get_schema(context, descriptor)
        raise flight.FlightServerError("expstore's own protocol is not part of this test")

    def do_get(self, context, ticket):
        if self.handler.is_flight_sql_ticket(ticket):
            return self.handler.do_get(context, ticket)
        raise flight.FlightServerError("expstore's own protocol is not part of this test")

    def do_put(self, context, descriptor, reader, writer):
        if self.handler.is_flight_sql_descriptor(descriptor):
            return self.handler.do_put(context, descriptor, reader, writer)
        raise flight.FlightServerError("expstore's own protocol is not part of this test")

    def do_action(self, context, action):
        self.actions_seen.append(action.type)
        if self.handler.is_flight_sql_action(action.type):
            return self.handler.do_action(context, action)
        raise flight.FlightServerError(f"unknown action {action.type!r}")

    def list_actions(self, context):
        return self.handler.list_actions()


SOLVER_ROWS = [
    ("1_0_0", 0, 0.5, [1, 2, 3], "a"),
    ("1_0_1", 0, 1.0, [4], "b"),
    ("2_0_0", 1, -0.25, [], None),
]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "exp.duckdb"
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE TABLE solver (sample_id VARCHAR, policy_version INTEGER, "
                    "reward DOUBLE, token_ids INTEGER[], response VARCHAR)")
        con.executemany("INSERT INTO solver VALUES (?, ?, ?, ?, ?)", SOLVER_ROWS)
        con.execute("CREATE TABLE verifier (sample_id VARCHAR, score FLOAT)")
        con.execute("INSERT INTO verifier VALUES ('1_0_0', 0.75)")
    return path


@pytest.fixture
def executor(db_path: Path) -> Iterator[DuckDBExecutor]:
    ex = DuckDBExecutor(db_path)
    yield ex
    ex.close()


@contextlib.contextmanager
def serve(executor: DuckDBExecutor, auth: bool = False,
          **handler_kwargs: Any) -> Iterator[DelegatingServer]:
    with DelegatingServer(FlightSqlHandler(executor, **handler_kwargs), auth=auth) as server:
        yield server


@pytest.fixture
def server(executor: DuckDBExecutor) -> Iterator[DelegatingServer]:
    with serve(executor) as s:
        yield s


def adbc_connect(server: DelegatingServer, token: str | None = None):
    kwargs = {}
    if token is not None:
        kwargs[adbc_driver_flightsql.DatabaseOptions.AUTHORIZATION_HEADER.value] = \
            f"Bearer {token}"
    return adbc_dbapi.connect(f"grpc://127.0.0.1:{server.port}", db_kwargs=kwargs,
                              autocommit=True)


def solver_table(executor: DuckDBExecutor) -> pa.Table:
    return executor.query("SELECT * FROM solver ORDER BY sample_id")


# -- queries through ADBC --------------------------------------------------------------------


def test_cursor_execute_returns_the_rows_and_types_duckdb_returns(server, executor):
    with adbc_connect(server) as conn, conn.cursor() as cur:
        cur.execute("SELECT * FROM solver ORDER BY sample_id")
        got = cur.fetch_arrow_table()
    assert got.equals(solver_table(executor))
    assert got.schema.field("token_ids").type == pa.list_(pa.int32())
    assert got.column("response").to_pylist() == ["a", "b", None]


def test_statement_query_without_prepare_streams_via_ticket_statement_query(server, executor):
    sql = "SELECT * FROM solver ORDER BY sample_id"
    with adbc_connect(server) as conn, conn.cursor() as cur:
        cur.adbc_statement.set_sql_query(sql)
        stream, _ = cur.adbc_statement.execute_query()
        got = pa.RecordBatchReader._import_from_c(stream.address).read_all()
    assert got.equals(solver_table(executor))
    assert "CommandStatementQuery" in server.commands_seen
    assert "CreatePreparedStatement" not in server.actions_seen

    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    descriptor = flight.FlightDescriptor.for_command(
        messages.pack(messages.CommandStatementQuery(query=sql)))
    info = client.get_flight_info(descriptor)
    [endpoint] = info.endpoints
    assert messages.peek(endpoint.ticket.ticket)[0] == "TicketStatementQuery"
    assert info.schema.equals(got.schema)
    assert client.get_schema(descriptor).schema.equals(got.schema)
    assert client.do_get(endpoint.ticket).read_all().equals(got)


def test_empty_result_keeps_its_schema(server):
    with adbc_connect(server) as conn, conn.cursor() as cur:
        cur.execute("SELECT sample_id, reward FROM solver WHERE reward > 100")
        got = cur.fetch_arrow_table()
    assert got.num_rows == 0
    assert got.schema.names == ["sample_id", "reward"]
    assert got.schema.field("reward").type == pa.float64()


def test_bound_parameters_select_rows_and_can_be_rebound(server, executor):
    with adbc_connect(server) as conn, conn.cursor() as cur:
        cur.execute("SELECT sample_id FROM solver WHERE policy_version = ? AND reward > ? "
                    "ORDER BY sample_id", (0, 0.6))
        assert cur.fetch_arrow_table().column(0).to_pylist() == ["1_0_1"]
        cur.execute("SELECT sample_id FROM solver WHERE policy_version = ? AND reward > ? "
                    "ORDER BY sample_id", (0, 0.0))
        assert cur.fetch_arrow_table().column(0).to_pylist() == ["1_0_0", "1_0_1"]
        cur.execute("SELECT ? || '-' || sample_id AS tagged FROM solver WHERE sample_id = ?",
                    ("v", "2_0_0"))
        assert cur.fetchall() == [("v-2_0_0",)]
    # The parameters reached the executor as values, not spliced into the SQL.
    assert ("SELECT sample_id FROM solver WHERE policy_version = ? AND reward > ? "
            "ORDER BY sample_id", [0, 0.6]) in executor.queries


def test_pandas_read_sql_over_adbc(server, executor):
    pd = pytest.importorskip("pandas")
    with adbc_connect(server) as conn:
        frame = pd.read_sql("SELECT sample_id, reward FROM solver ORDER BY sample_id", conn)
    assert list(frame.columns) == ["sample_id", "reward"]
    assert frame["sample_id"].tolist() == ["1_0_0", "1_0_1", "2_0_0"]
    assert frame["reward"].tolist() == [0.5, 1.0, -0.25]


def test_polars_read_database_over_adbc(server):
    pl = pytest.importorskip("polars")
    with adbc_connect(server) as conn:
        frame = pl.read_database(
            "SELECT s.sample_id, v.score FROM solver s JOIN verifier v USING (sample_id)", conn)
    assert frame.columns == ["sample_id", "score"]
    assert frame.rows() == [("1_0_0", 0.75)]


# -- catalog metadata through ADBC -----------------------------------------------------------


def test_get_objects_lists_catalog_schema_tables_and_columns(server):
    with adbc_connect(server) as conn:
        objects = conn.adbc_get_objects(depth="all").read_all().to_pylist()
    assert [c["catalog_name"] for c in objects] == ["expstore"]
    [db_schema] = objects[0]["catalog_db_schemas"]
    assert db_schema["db_schema_name"] == "main"
    tables = {t["table_name"]: t for t in db_schema["db_schema_tables"]}
    assert sorted(tables) == ["solver", "verifier"]
    assert tables["solver"]["table_type"] == "TABLE"
    columns = [c["column_name"] for c in tables["solver"]["table_columns"]]
    assert columns == ["sample_id", "policy_version", "reward", "token_ids", "response"]


def test_get_objects_filters_by_table_pattern_and_catalog(server):
    with adbc_connect(server) as conn:
        by_pattern = conn.adbc_get_objects(depth="tables", table_name_filter="sol%") \
            .read_all().to_pylist()
        other_catalog = conn.adbc_get_objects(depth="tables", catalog_filter="other") \
            .read_all().to_pylist()
    tables = by_pattern[0]["catalog_db_schemas"][0]["db_schema_tables"]
    assert [t["table_name"] for t in tables] == ["solver"]
    assert other_catalog == []


def test_get_table_schema_and_table_types(server, executor):
    with adbc_connect(server) as conn:
        schema = conn.adbc_get_table_schema("solver")
        types = conn.adbc_get_table_types()
    assert schema.equals(dict(executor.tables())["solver"])
    assert types == ["TABLE"]


def test_get_info_reports_vendor_version_and_arrow_version(executor):
    with serve(executor, server_version="1.2.3") as server, adbc_connect(server) as conn:
        info = conn.adbc_get_info()
    assert info["vendor_name"] == "expstore"
    assert info["vendor_version"] == "1.2.3"
    assert info["vendor_arrow_version"] == pa.__version__


def test_sql_info_states_read_only_and_no_transactions(server):
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    command = messages.pack(messages.CommandGetSqlInfo(info=[
        sqlinfo.FLIGHT_SQL_SERVER_READ_ONLY, sqlinfo.FLIGHT_SQL_SERVER_NAME,
        sqlinfo.FLIGHT_SQL_SERVER_TRANSACTION, 9_999_999]))
    info = client.get_flight_info(flight.FlightDescriptor.for_command(command))
    table = client.do_get(info.endpoints[0].ticket).read_all()
    assert table.schema.equals(info.schema)
    values = {row["info_name"]: row["value"] for row in table.to_pylist()}
    assert values == {sqlinfo.FLIGHT_SQL_SERVER_READ_ONLY: True,
                      sqlinfo.FLIGHT_SQL_SERVER_NAME: "expstore",
                      sqlinfo.FLIGHT_SQL_SERVER_TRANSACTION: 0}


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("sql", [
    "UPDATE solver SET reward = 0",
    "INSERT INTO solver (sample_id) VALUES ('evil')",
    "DELETE FROM solver",
    "DROP TABLE solver",
    "SELECT 1; DELETE FROM solver",
])
def test_writes_through_sql_are_refused_and_change_nothing(server, executor, sql):
    before = solver_table(executor)
    with adbc_connect(server) as conn, conn.cursor() as cur:
        with pytest.raises(adbc_manager.Error, match="read-only"):
            cur.execute(sql)
    assert solver_table(executor).equals(before)


def test_update_commands_ingest_and_transactions_are_unsupported(server, executor):
    before = solver_table(executor)
    with adbc_connect(server) as conn, conn.cursor() as cur:
        # CommandStatementUpdate
        cur.adbc_statement.set_sql_query("UPDATE solver SET reward = 0")
        with pytest.raises(adbc_manager.NotSupportedError, match="read-only"):
            cur.adbc_statement.execute_update()
        # CommandPreparedStatementUpdate (executemany prepares, binds and updates)
        with pytest.raises(adbc_manager.NotSupportedError, match="read-only"):
            cur.executemany("UPDATE solver SET reward = ? WHERE sample_id = ?", [(0.0, "1_0_0")])
        # CommandStatementIngest
        with pytest.raises(adbc_manager.NotSupportedError, match="read-only"):
            cur.adbc_ingest("solver", pa.table({"sample_id": ["new"]}), mode="append")
    assert solver_table(executor).equals(before)

    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    for action in ("BeginTransaction", "EndTransaction", "BeginSavepoint", "EndSavepoint"):
        with pytest.raises(NotImplementedError, match="not supported"):
            list(client.do_action(flight.Action(action, b"")))


def test_query_in_a_transaction_is_unsupported(server):
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    command = messages.pack(messages.CommandStatementQuery(query="SELECT 1",
                                                           transaction_id=b"t1"))
    with pytest.raises(NotImplementedError, match="transaction"):
        client.get_flight_info(flight.FlightDescriptor.for_command(command))


# -- bearer token ----------------------------------------------------------------------------


def test_bearer_token_is_sent_and_required(executor):
    with serve(executor, auth=True) as server:
        with adbc_connect(server, token=TOKEN) as conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) AS n FROM solver")
            assert cur.fetchall() == [(3,)]
            cur.execute("SELECT count(*) AS n FROM solver WHERE policy_version = ?", (0,))
            assert cur.fetchall() == [(2,)]
            assert [t for t in conn.adbc_get_table_types()] == ["TABLE"]
        for token in (None, "wrong"):
            with pytest.raises(adbc_manager.Error, match="bearer token"):
                with adbc_connect(server, token=token) as conn, conn.cursor() as cur:
                    cur.execute("SELECT 1")
                    cur.fetchall()


# -- the protocol, call by call (pyarrow client) ---------------------------------------------


def _create_prepared(client: flight.FlightClient, sql: str) -> bytes:
    body = messages.pack(messages.ActionCreatePreparedStatementRequest(query=sql))
    [result] = list(client.do_action(flight.Action("CreatePreparedStatement", body)))
    name, payload = messages.peek(result.body.to_pybytes())
    assert name == "ActionCreatePreparedStatementResult"
    return messages.unpack(name, payload).prepared_statement_handle


def _bind(client: flight.FlightClient, handle: bytes, params: pa.Table) -> bytes:
    descriptor = flight.FlightDescriptor.for_command(
        messages.pack(messages.CommandPreparedStatementQuery(prepared_statement_handle=handle)))
    writer, reader = client.do_put(descriptor, params.schema)
    writer.write_table(params)
    writer.done_writing()
    answer = reader.read()
    writer.close()
    return messages.DoPutPreparedStatementResult.FromString(answer.to_pybytes()) \
        .prepared_statement_handle


def test_prepared_statement_lifecycle_and_ticket_snapshot(server):
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    sql = "SELECT sample_id FROM solver WHERE policy_version = ? ORDER BY sample_id"
    handle = _create_prepared(client, sql)
    assert _bind(client, handle, pa.table({"0": [0]})) == handle
    descriptor = flight.FlightDescriptor.for_command(
        messages.pack(messages.CommandPreparedStatementQuery(prepared_statement_handle=handle)))
    assert client.get_schema(descriptor).schema.names == ["sample_id"]
    info_v0 = client.get_flight_info(descriptor)
    _bind(client, handle, pa.table({"0": [1]}))
    info_v1 = client.get_flight_info(descriptor)
    # Each ticket keeps the binding of its GetFlightInfo, even after a re-bind and a close.
    list(client.do_action(flight.Action("ClosePreparedStatement", messages.pack(
        messages.ActionClosePreparedStatementRequest(prepared_statement_handle=handle)))))
    assert client.do_get(info_v0.endpoints[0].ticket).read_all().column(0).to_pylist() == \
        ["1_0_0", "1_0_1"]
    assert client.do_get(info_v1.endpoints[0].ticket).read_all().column(0).to_pylist() == \
        ["2_0_0"]
    with pytest.raises(KeyError, match="not open"):
        client.get_flight_info(descriptor)


def test_several_parameter_sets_run_as_one_result(server):
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    handle = _create_prepared(client, "SELECT sample_id FROM solver WHERE sample_id = ?")
    _bind(client, handle, pa.table({"0": ["2_0_0", "1_0_0"]}))
    descriptor = flight.FlightDescriptor.for_command(
        messages.pack(messages.CommandPreparedStatementQuery(prepared_statement_handle=handle)))
    info = client.get_flight_info(descriptor)
    assert client.do_get(info.endpoints[0].ticket).read_all().column(0).to_pylist() == \
        ["2_0_0", "1_0_0"]


def test_metadata_commands_answer_their_spec_schemas(server):
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    for command, names in [
        (messages.CommandGetCatalogs(), ["catalog_name"]),
        (messages.CommandGetDbSchemas(), ["catalog_name", "db_schema_name"]),
        (messages.CommandGetTables(include_schema=True),
         ["catalog_name", "db_schema_name", "table_name", "table_type", "table_schema"]),
        (messages.CommandGetTableTypes(), ["table_type"]),
    ]:
        descriptor = flight.FlightDescriptor.for_command(messages.pack(command))
        info = client.get_flight_info(descriptor)
        assert client.get_schema(descriptor).schema.equals(info.schema)
        table = client.do_get(info.endpoints[0].ticket).read_all()
        assert table.schema.names == names
        assert table.schema.equals(info.schema)
        assert table.num_rows >= 1


def test_executor_errors_pass_through_or_through_the_mapper(executor):
    with serve(executor) as server:
        client = flight.connect(f"grpc://127.0.0.1:{server.port}")
        descriptor = flight.FlightDescriptor.for_command(
            messages.pack(messages.CommandStatementQuery(query="DELETE FROM solver")))
        # Unmapped, the executor's exception reaches pyarrow as is (an unknown-status error).
        with pytest.raises(flight.FlightServerError, match="read-only"):
            client.get_flight_info(descriptor)

    def mapper(error: Exception) -> BaseException:
        if isinstance(error, ReadOnlyViolation):
            return flight.FlightUnauthorizedError(f"refused: {error}")
        return error

    with serve(executor, error_mapper=mapper) as server:
        client = flight.connect(f"grpc://127.0.0.1:{server.port}")
        with pytest.raises(flight.FlightUnauthorizedError, match="refused: read-only"):
            client.get_flight_info(descriptor)
        # Errors the mapper returns unchanged are re-raised unchanged.
        with pytest.raises(flight.FlightServerError, match="syntax error"):
            client.get_flight_info(flight.FlightDescriptor.for_command(
                messages.pack(messages.CommandStatementQuery(query="SELEKT 1"))))


def test_executor_error_is_the_same_object_without_a_mapper(executor):
    handler = FlightSqlHandler(executor)
    descriptor = flight.FlightDescriptor.for_command(
        messages.pack(messages.CommandStatementQuery(query="DROP TABLE solver")))
    with pytest.raises(ReadOnlyViolation):
        handler.get_flight_info(None, descriptor)


def test_list_actions_names_the_served_actions(server):
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    assert sorted(a.type for a in client.list_actions()) == \
        ["ClosePreparedStatement", "CreatePreparedStatement"]


# -- routing predicates ----------------------------------------------------------------------


def test_routing_claims_flight_sql_and_nothing_of_expstore(executor):
    handler = FlightSqlHandler(executor)
    sql_command = messages.pack(messages.CommandStatementQuery(query="SELECT 1"))
    assert handler.is_flight_sql_descriptor(flight.FlightDescriptor.for_command(sql_command))
    ingest = messages.TYPE_URL_PREFIX + "CommandStatementIngest"
    from google.protobuf import any_pb2
    refused = any_pb2.Any(type_url=ingest, value=b"").SerializeToString()
    assert handler.is_flight_sql_descriptor(flight.FlightDescriptor.for_command(refused))

    assert not handler.is_flight_sql_descriptor(flight.FlightDescriptor.for_path("solver"))
    assert not handler.is_flight_sql_descriptor(
        flight.FlightDescriptor.for_command(b'{"table": "solver"}'))
    other_any = any_pb2.Any(type_url="type.googleapis.com/other.Message").SerializeToString()
    assert not handler.is_flight_sql_descriptor(flight.FlightDescriptor.for_command(other_any))

    info = handler.get_flight_info(None, flight.FlightDescriptor.for_command(sql_command))
    assert handler.is_flight_sql_ticket(info.endpoints[0].ticket)
    assert not handler.is_flight_sql_ticket(flight.Ticket(b'{"sql": "SELECT 1"}'))

    for action in ("CreatePreparedStatement", "ClosePreparedStatement", "BeginTransaction",
                   "EndTransaction", "BeginSavepoint", "EndSavepoint", "CancelQuery"):
        assert handler.is_flight_sql_action(action)
    for action in ("create_table", "claim", "ack", "stats", "health", "CancelFlightInfo"):
        assert not handler.is_flight_sql_action(action)


# -- pieces ----------------------------------------------------------------------------------


def test_like_patterns_follow_sql_with_backslash_escape():
    assert metadata.like_pattern("sol%").fullmatch("solver")
    assert metadata.like_pattern("s_lver").fullmatch("solver")
    assert not metadata.like_pattern("s_lver").fullmatch("sover")
    assert metadata.like_pattern(r"a\_b").fullmatch("a_b")
    assert not metadata.like_pattern(r"a\_b").fullmatch("axb")
    assert metadata.like_pattern("a.b").fullmatch("a.b")
    assert not metadata.like_pattern("a.b").fullmatch("axb")


def test_ticket_handles_round_trip_and_reject_foreign_bytes():
    params = pa.table({"0": [1, 2], "1": ["a", None]})
    assert tickets.decode(tickets.encode("SELECT ?, ?", params)) == \
        ("SELECT ?, ?", [[1, "a"], [2, None]])
    assert tickets.decode(tickets.encode("SELECT 1")) == ("SELECT 1", None)
    with pytest.raises(ValueError, match="not one this server issued"):
        tickets.decode(b"garbage")


def test_prepared_statements_expire_when_idle_and_are_bounded():
    now = [0.0]
    registry = PreparedStatements(idle_timeout_s=10.0, max_open=2, clock=lambda: now[0])
    first = registry.open("SELECT 1")
    now[0] = 5.0
    second = registry.open("SELECT 2")
    with pytest.raises(flight.FlightUnavailableError, match="limit is 2"):
        registry.open("SELECT 3")
    now[0] = 12.0  # first idle for 12 s, second for 7 s
    third = registry.open("SELECT 3")
    with pytest.raises(KeyError, match="not open"):
        registry.get(first)
    assert registry.get(second).sql == "SELECT 2"
    assert registry.get(third).sql == "SELECT 3"
    registry.close(third)
    registry.close(third)  # idempotent
    assert len(registry) == 1


def test_messages_match_the_checked_in_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    proto_dir = Path(messages.__file__).parent
    out = tmp_path / "flightsql.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}",
                    f"--descriptor_set_out={out}", str(proto_dir / "FlightSql.proto")],
                   check=True)
    [compiled] = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    compiled.name = messages.PROTO_FILE
    assert compiled == messages.file_descriptor()
