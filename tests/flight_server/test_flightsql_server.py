"""Flight SQL on the real expstore server, through the real ADBC driver, pandas and polars.

The handler's own tests use a purpose-built server; these run against
:class:`flight_server.ExpstoreFlightServer` itself, on the port that also serves our protocol.
"""
from __future__ import annotations

import threading
import time
import warnings

import pytest

import store
from flight_fixtures import TOKENS, running_server, write_tokens

dbapi = pytest.importorskip("adbc_driver_flightsql.dbapi",
                            reason="adbc-driver-flightsql (the dev extra) is not installed")
pd = pytest.importorskip("pandas", reason="pandas (the dev extra) is not installed")
pl = pytest.importorskip("polars", reason="polars (the dev extra) is not installed")


def _connect(location: str, token: str | None = None):
    kwargs = {}
    if token is not None:
        kwargs["db_kwargs"] = {"adbc.flight.sql.authorization_header": f"Bearer {token}"}
    with warnings.catch_warnings():  # "Cannot disable autocommit": the server is read-only
        warnings.simplefilter("ignore")
        return dbapi.connect(location, **kwargs)


def _fill(s) -> None:
    s.create_table("solver", {"prompt": "string", "response": "string", "reward": "float64"})
    s.create_table("verifier", {"verdict": "bool", "reward": "float64"})
    s.put("solver", {"sample_id": [f"q{i}_0_{j}" for i in range(3) for j in range(2)],
                     "prompt": ["p"] * 6, "response": ["r" * 2000] * 6,  # by reference
                     "reward": [float(i + j) for i in range(3) for j in range(2)]})
    s.put("verifier", {"sample_id": ["q0_1_0", "q1_1_0"], "verdict": [True, False],
                       "reward": [1.0, 0.0]})


@pytest.fixture
def served(tmp_path):
    with running_server(tmp_path / "x.duckdb") as server:
        s = store.connect(server.location)
        _fill(s)
        yield server, s
        s.close()


def test_adbc_queries_parameters_listing_pandas_polars(served):
    server, s = served
    conn = _connect(server.location)
    try:
        cur = conn.cursor()
        cur.execute("SELECT sample_id, reward FROM solver WHERE reward > ? ORDER BY sample_id",
                    parameters=[1.5])
        assert cur.fetch_arrow_table().column("sample_id").to_pylist() == \
            ["q1_0_1", "q2_0_0", "q2_0_1"]
        cur.execute("SELECT * FROM solver ORDER BY sample_id")
        table = cur.fetch_arrow_table()
        assert table.num_rows == 6 and table.column("response").to_pylist()[0] == "r" * 2000
        cur.execute("SELECT s.input_id, avg(s.reward) AS r, bool_or(v.verdict) AS ok "
                    "FROM solver s JOIN verifier v USING (input_id) GROUP BY 1 ORDER BY 1")
        assert cur.fetchall() == [("q0", 0.5, True), ("q1", 1.5, False)]
        cur.close()

        objects = conn.adbc_get_objects(depth="tables").read_all().to_pylist()
        tables = {t["table_name"] for c in objects for d in c["catalog_db_schemas"]
                  for t in d["db_schema_tables"]}
        assert {"solver", "verifier"} <= tables
        schema = conn.adbc_get_table_schema("solver")
        assert {"sample_id", "policy_version", "reward", "reward_status"} <= set(schema.names)

        frame = pd.read_sql("SELECT policy_version, count(*) AS n FROM solver GROUP BY 1", conn)
        assert frame.to_dict("records") == [{"policy_version": 0, "n": 6}]
        polars_frame = pl.read_database("SELECT sample_id FROM verifier ORDER BY 1", conn)
        assert polars_frame["sample_id"].to_list() == ["q0_1_0", "q1_1_0"]
    finally:
        conn.close()


@pytest.mark.parametrize("sql", [
    "DELETE FROM solver", "UPDATE solver SET reward = 0", "DROP TABLE solver",
    "INSERT INTO verifier (row_id, sample_id, input_id, turn, trajectory_id, policy_version) "
    "VALUES (99, 'x_0_0', 'x', 0, 0, 0)",
    "ATTACH 'other.duckdb' AS o", "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT 1; DROP TABLE solver",
])
def test_writes_and_file_access_are_refused_and_nothing_changes(served, sql):
    server, s = served
    before = s.query("SELECT count(*) AS n, sum(reward) AS r FROM solver").to_pylist()
    conn = _connect(server.location)
    try:
        cur = conn.cursor()
        with pytest.raises(dbapi.Error, match="refused|read-only|not supported|Unimplemented"):
            cur.execute(sql)
            cur.fetchall()
    finally:
        conn.close()
    assert s.query("SELECT count(*) AS n, sum(reward) AS r FROM solver").to_pylist() == before
    assert s.list_tables() == ["solver", "verifier"]


def test_a_runaway_flight_sql_query_is_cancelled_by_the_store_time_limit(tmp_path):
    with running_server(tmp_path / "x.duckdb", query_timeout=0.5) as server:
        conn = _connect(server.location)
        try:
            cur = conn.cursor()
            started = time.monotonic()
            with pytest.raises(dbapi.Error, match="limit|cancel|timed out|Timeout"):
                cur.execute("SELECT count(*) FROM range(100000000) a, range(100000) b")
                cur.fetchall()
            assert time.monotonic() - started < 20
        finally:
            conn.close()


def test_our_protocol_works_beside_flight_sql_on_the_same_port(served):
    server, s = served
    conn = _connect(server.location)
    stop = threading.Event()
    errors: list[BaseException] = []

    def sql_readers() -> None:
        try:
            cur = conn.cursor()
            while not stop.is_set():
                cur.execute("SELECT count(*) FROM solver")
                cur.fetchall()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    reader = threading.Thread(target=sql_readers, daemon=True)
    reader.start()
    try:
        for i in range(20):
            s.put("verifier", {"sample_id": [f"n{i}_1_0"], "verdict": [True], "reward": [1.0]})
        claimed = 0
        while claimed < 22:
            c = s.claim("verifier", 8)
            assert c, "ready rows were not claimable while Flight SQL queries ran"
            s.ack(c.claim_id)
            claimed += len(c)
        assert s.bump_version("verifier", expected=0) == 1
    finally:
        stop.set()
        reader.join(30)
        conn.close()
    assert not errors
    assert s.stats("verifier")["verifier"]["consumed"] == 22


def test_flight_sql_with_auth_needs_a_valid_token(tmp_path):
    with running_server(tmp_path / "x.duckdb", tokens_file=write_tokens(tmp_path / "t.json")) \
            as server:
        admin = store.connect(server.location, token=TOKENS["admin"])
        _fill(admin)
        admin.close()
        conn = _connect(server.location, TOKENS["reader"])
        try:
            cur = conn.cursor()
            cur.execute("SELECT count(*) FROM solver")
            assert cur.fetchall() == [(6,)]
        finally:
            conn.close()
        for token in (None, "not-a-valid-token-9999"):
            with pytest.raises(dbapi.Error):
                bad = _connect(server.location, token)
                try:
                    cur = bad.cursor()
                    cur.execute("SELECT count(*) FROM solver")
                    cur.fetchall()
                finally:
                    bad.close()


def test_unsupported_verbs_answer_unimplemented_not_internal(served, caplog):
    """Updates, ingest, transactions, savepoints and cancel: UNIMPLEMENTED through the real
    server's error boundary (ADBC's NotSupportedError), and no traceback in the server's log."""
    import adbc_driver_manager
    import pyarrow as pa
    import pyarrow.flight as flight
    from flight_server.flightsql import messages

    server, s = served
    before = s.query("SELECT count(*) AS n, sum(reward) AS r FROM solver").to_pylist()
    caplog.set_level("ERROR", logger="expstore")
    conn = _connect(server.location)
    try:
        cur = conn.cursor()
        cur.adbc_statement.set_sql_query("UPDATE solver SET reward = 0")
        with pytest.raises(adbc_driver_manager.NotSupportedError, match="read-only"):
            cur.adbc_statement.execute_update()
        with pytest.raises(adbc_driver_manager.NotSupportedError, match="read-only"):
            cur.executemany("UPDATE solver SET reward = ? WHERE sample_id = ?", [(0.0, "q0_0_0")])
        with pytest.raises(adbc_driver_manager.NotSupportedError, match="read-only"):
            cur.adbc_ingest("solver", pa.table({"sample_id": ["q9_0_0"]}), mode="append")
    finally:
        conn.close()
    client = flight.connect(server.location)
    for verb in ("BeginTransaction", "EndTransaction", "BeginSavepoint", "EndSavepoint",
                 "CancelQuery", "CreatePreparedSubstraitPlan"):
        with pytest.raises(pa.ArrowNotImplementedError, match="not supported"):
            list(client.do_action(flight.Action(verb, b"")))
    in_transaction = messages.pack(messages.CommandStatementQuery(query="SELECT 1",
                                                                  transaction_id=b"t1"))
    with pytest.raises(pa.ArrowNotImplementedError, match="transaction"):
        client.get_flight_info(flight.FlightDescriptor.for_command(in_transaction))
    client.close()
    assert not [r for r in caplog.records if "internal error" in r.getMessage()], \
        [r.getMessage() for r in caplog.records]
    assert s.query("SELECT count(*) AS n, sum(reward) AS r FROM solver").to_pylist() == before


@pytest.mark.parametrize("sql", [
    "SELECT sample_id FROM solver ORDER BY sample_id;",
    "SELECT sample_id FROM solver ORDER BY sample_id -- the first rows",
    "SELECT sample_id FROM solver ORDER BY sample_id; -- the first rows",
    "/* rows */ SELECT sample_id FROM solver ORDER BY sample_id /* sorted */ ;",
])
def test_statements_do_get_accepts_work_through_flight_sql(served, sql):
    server, s = served
    expected = s.query(sql).column("sample_id").to_pylist()
    assert len(expected) == 6
    conn = _connect(server.location)
    try:
        cur = conn.cursor()
        cur.execute(sql)
        assert cur.fetch_arrow_table().column("sample_id").to_pylist() == expected
    finally:
        conn.close()


@pytest.mark.parametrize("end", ["", ";", " -- by input"])
def test_pivot_works_through_flight_sql(served, end):
    server, s = served
    sql = ("PIVOT (SELECT input_id, trajectory_id, reward FROM solver) ON trajectory_id "
           f"IN (0, 1) USING sum(reward) ORDER BY input_id{end}")
    expected = s.query(sql)
    assert expected.num_rows == 3
    conn = _connect(server.location)
    try:
        cur = conn.cursor()
        cur.execute(sql)
        assert cur.fetch_arrow_table().to_pylist() == expected.to_pylist()
    finally:
        conn.close()
