"""Read-only SQL over live data: joins, catalog tables, hostile statements, time limits."""
from __future__ import annotations

import os
import threading
import time

import pytest

from store.errors import QueryBusy, QueryRefused, QueryTimeout

SNAPSHOT = "SELECT * EXCLUDE (updated_at) FROM solver ORDER BY sample_id"


@pytest.fixture
def agents(any_store):
    s = any_store
    s.create_table("solver", {"response": "string", "reward": "float64",
                              "next_agent_id": "int32"})
    s.create_table("verifier", {"verdict": "bool", "score": "float32"})
    s.put("solver", {"sample_id": ["q1_0_0", "q1_0_1", "q2_0_0"], "response": ["4", "5", "x"],
                     "reward": [1.0, 0.0, 0.5], "next_agent_id": [1, 1, 0]})
    s.put("verifier", {"sample_id": ["q1_0_0", "q1_0_1"], "verdict": [True, False],
                       "score": [0.9, 0.1]})
    return s


def test_select_and_join_across_agent_tables(agents):
    s = agents
    joined = s.query(
        "SELECT s.sample_id, s.reward, v.verdict FROM solver s "
        "JOIN verifier v USING (sample_id, policy_version) ORDER BY s.sample_id")
    assert joined.to_pylist() == [
        {"sample_id": "q1_0_0", "reward": 1.0, "verdict": True},
        {"sample_id": "q1_0_1", "reward": 0.0, "verdict": False},
    ]
    grouped = s.query("SELECT input_id, count(*) AS n, avg(reward) AS mean FROM solver "
                      "WHERE next_agent_id = ? GROUP BY input_id ORDER BY input_id", [1])
    assert grouped.to_pylist() == [{"input_id": "q1", "n": 2, "mean": 0.5}]
    cte = s.query("WITH r AS (SELECT * FROM range(3) t(i)) SELECT sum(i) AS s FROM r")
    assert cte.column("s").to_pylist() == [3]


def test_select_over_catalog_tables(agents):
    s = agents
    s.bump_version("solver", weights_uri="file:///w/1")
    tables = s.query("SELECT name, version_group FROM _expstore_tables ORDER BY name")
    assert tables.to_pylist() == [{"name": "solver", "version_group": "solver"},
                                  {"name": "verifier", "version_group": "verifier"}]
    versions = s.query("SELECT version, weights_uri FROM _expstore_versions "
                       "WHERE version_group = 'solver' ORDER BY version")
    assert versions.to_pylist() == [{"version": 0, "weights_uri": None},
                                    {"version": 1, "weights_uri": "file:///w/1"}]
    cols = s.query("SELECT column_name FROM duckdb_columns() WHERE table_name = 'verifier' "
                   "AND column_name LIKE '%status'").column(0).to_pylist()
    assert sorted(cols) == ["score_status", "verdict_status"]


def test_meta_columns_visible(agents):
    s = agents
    claim = s.claim("solver", 1)
    s.ack(claim.claim_id)
    row = s.query("SELECT sample_id, consumed, consumed_version, stale, dead, row_id, "
                  "created_at IS NOT NULL AS has_created FROM solver WHERE consumed").to_pylist()
    assert row == [{"sample_id": "q1_0_0", "consumed": True, "consumed_version": 0,
                    "stale": False, "dead": False, "row_id": row[0]["row_id"],
                    "has_created": True}]


HOSTILE = [
    "INSERT INTO solver (row_id, sample_id, input_id, turn, trajectory_id, policy_version) "
    "VALUES (99, 'z_0_0', 'z', 0, 0, 0)",
    "UPDATE solver SET reward = 100",
    "DELETE FROM solver",
    "DROP TABLE solver",
    "CREATE TABLE evil (a INT)",
    "CREATE VIEW evil AS SELECT 1",
    "CREATE MACRO evil() AS 1",
    "ALTER TABLE solver ADD COLUMN evil INT",
    "ATTACH '{tmp}/evil.duckdb' AS evil",
    "DETACH solver",
    "COPY solver TO '{tmp}/out.csv'",
    "EXPORT DATABASE '{tmp}/export'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET memory_limit = '1GB'",
    "SET enable_external_access = true",
    "PRAGMA database_list",
    "CALL pragma_version()",
    "CHECKPOINT",
    "VACUUM",
    "BEGIN TRANSACTION",
    "PREPARE p AS SELECT 1",
    "SELECT 1; SELECT 2",
    "SELECT 1; DROP TABLE solver",
    "WITH x AS (SELECT 1) DELETE FROM solver",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_csv_auto('/etc/passwd')",
    "SELECT * FROM read_parquet('{tmp}/x.parquet')",
    "SELECT * FROM read_json('{tmp}/x.json')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_blob('/etc/passwd')",
    "SELECT * FROM glob('/etc/*')",
    "SELECT * FROM '/etc/passwd'",
    "FROM '/etc/passwd'",
    "SELECT * FROM (FROM '/etc/hostname')",
    "SELECT * FROM 'https://example.com/x.csv'",
    "SELECT (SELECT count(*) FROM read_csv('/etc/passwd'))",
    "SELECT * FROM solver WHERE response IN (SELECT content FROM read_text('/etc/passwd'))",
    "SELECT * FROM range(3) r, read_text('/etc/hostname')",
    "SELECT * FROM query('DELETE FROM solver')",
    "SELECT * FROM query_table('solver')",
    "SELECT getenv('HOME')",
    "SELECT current_setting('memory_limit')",
    "SELECT * FROM duckdb_settings()",
    "SELECT * FROM duckdb_secrets()",
    "SELECT * FROM duckdb_extensions()",
    "SELECT * FROM sniff_csv('/etc/passwd')",
    "SELECT * FROM parquet_metadata('{tmp}/x.parquet')",
    "SELECT * FROM sqlite_scan('{tmp}/x.db', 't')",
    "SELECT * FROM pragma_table_info('solver')",
    "SELECT setseed(0.5)",
    "",
    "   ",
]


@pytest.mark.parametrize("sql", HOSTILE)
def test_hostile_statements_refused(agents, tmp_path, sql):
    s = agents
    before = s.query(SNAPSHOT)
    tables = s.list_tables()
    with pytest.raises(QueryRefused):
        s.query(sql.format(tmp=tmp_path))
    assert s.query(SNAPSHOT).equals(before)
    assert s.list_tables() == tables
    # Nothing was written beside the database.
    assert sorted(os.listdir(tmp_path)) == sorted(
        p for p in os.listdir(tmp_path) if p.startswith("x.duckdb"))


def test_non_string_query_refused(agents):
    with pytest.raises(QueryRefused):
        agents.query(None)
    with pytest.raises(QueryRefused):
        agents.query(b"SELECT 1")


def test_invalid_sql_refused(agents):
    with pytest.raises(QueryRefused, match="nope"):
        agents.query("SELECT nope FROM solver")
    with pytest.raises(QueryRefused):
        agents.query("SELEC 1")


def test_runaway_query_times_out(agents):
    s = agents
    t0 = time.monotonic()
    with pytest.raises(QueryTimeout, match="0.5"):
        s.query("SELECT count(*) FROM range(1000000000) a, range(1000000000) b", timeout=0.5)
    assert time.monotonic() - t0 < 10
    # The store and the same thread's reader keep working afterwards.
    assert s.query("SELECT count(*) AS n FROM solver").column("n").to_pylist() == [3]
    s.put("solver", {"sample_id": ["q3_0_0"], "response": ["y"], "reward": [1.0],
                     "next_agent_id": [0]})
    assert s.claim("solver", 10).num_rows == 4


def _query_slots_taken(s) -> bool:
    """Whether a query finds every query slot taken (it is refused with QueryBusy)."""
    try:
        s.query("SELECT 1", timeout=0.1)
    except QueryBusy:
        return True
    except QueryTimeout:  # a slow machine ran past the probe's own limit
        pass
    return False


def test_queries_do_not_starve_writes_and_claims(agents, wait_until):
    s = agents
    # Warm up the write and claim paths, so that first-call costs are not measured.
    s.ack(s.claim("solver", 1).claim_id)
    errors: list[BaseException] = []

    def runaway() -> None:
        try:
            s.query("SELECT count(*) FROM range(1000000000) a, range(1000000000) b", timeout=3)
        except QueryTimeout:
            pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=runaway) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: _query_slots_taken(s), timeout=30,
               message="the runaway queries holding both query slots")
    # A put, claim or ack that waited for a query would be answered only once the queries
    # ended (at their 3 s limit). Counted: the rounds answered while both still ran, however
    # long each took on this machine.
    answered_while_running, i = 0, 0
    while answered_while_running < 10 and all(t.is_alive() for t in threads):
        s.put("solver", {"sample_id": [f"w{i}_0_0"], "response": ["r"], "reward": [1.0],
                         "next_agent_id": [0]})
        claim = s.claim("solver", 1)
        s.ack(claim.claim_id)
        i += 1
        answered_while_running += all(t.is_alive() for t in threads)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert answered_while_running >= 3, (
        f"{answered_while_running} of {i} put+claim+ack rounds were answered while the "
        "queries ran")
