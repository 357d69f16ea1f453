"""Readers see the store's tables, not the server (issue #29, item 7): the views and functions
that show settings, secret and extension directories, the log or the database's absolute path
are refused through both SQL doors of a real server, ``do_get`` and Flight SQL."""
from __future__ import annotations

import warnings

import pyarrow.flight as flight
import pytest

import store
from flight_fixtures import running_server
from store.errors import QueryRefused

dbapi = pytest.importorskip("adbc_driver_flightsql.dbapi",
                            reason="adbc-driver-flightsql (the dev extra) is not installed")

SERVER_VIEWS = [
    "SELECT * FROM pg_settings",
    "SELECT * FROM pg_catalog.pg_settings",
    "SELECT * FROM duckdb_settings()",
    "SELECT * FROM duckdb_databases",
    "SELECT * FROM duckdb_databases()",
    "SELECT * FROM pragma_database_list",
    "SELECT * FROM pragma_database_list()",
    "SELECT * FROM duckdb_secrets()",
    "SELECT * FROM duckdb_extensions()",
    "SELECT * FROM duckdb_logs",
    "SELECT * FROM duckdb_temporary_files()",
    "SELECT current_setting('temp_directory')",
    "SELECT getenv('HOME')",
    "SELECT getvariable('x')",
    "PRAGMA database_list",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    db = tmp_path_factory.mktemp("views") / "x.duckdb"
    with running_server(db) as server:
        s = store.connect(server.location)
        s.create_table("solver", {"reward": "float64"})
        s.put("solver", {"sample_id": ["q0_0_0"], "reward": [1.0]})
        yield server, s, str(db.parent)
        s.close()


@pytest.mark.parametrize("sql", SERVER_VIEWS)
def test_do_get_refuses_what_shows_the_server(served, sql):
    _, s, _ = served
    with pytest.raises(QueryRefused):
        s.query(sql)
    assert s.query("SELECT reward FROM solver").column(0).to_pylist() == [1.0]


@pytest.mark.parametrize("sql", SERVER_VIEWS)
def test_flight_sql_refuses_what_shows_the_server(served, sql):
    server, _, directory = served
    with warnings.catch_warnings():  # "Cannot disable autocommit": the server is read-only
        warnings.simplefilter("ignore")
        conn = dbapi.connect(server.location)
    try:
        cur = conn.cursor()
        with pytest.raises(dbapi.Error, match="refused|not supported|Unimplemented") as err:
            cur.execute(sql)
            cur.fetchall()
        assert directory not in str(err.value)
    finally:
        conn.close()


def test_the_raw_ticket_is_refused_with_its_code(served):
    server, _, _ = served
    client = flight.connect(server.location)
    try:
        with pytest.raises(flight.FlightError, match="query_refused"):
            client.do_get(flight.Ticket(b'{"sql": "SELECT path FROM duckdb_databases"}')).read_all()
    finally:
        client.close()
