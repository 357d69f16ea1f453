"""SQL sees every value: a by-reference column reads as its value on every query path — the
store's ``query``, ``do_get``, Flight SQL (ADBC), the CLI's ``query`` and ``export --sql``, and
claim predicates — while queries that do not use such a column never read the blob store."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from click.testing import CliRunner

import store
from expstore.cli import cli
from flight_fixtures import query as flight_query, running_server
from store import tensors
from store.errors import QueryRefused, StorageError
from store.sqlvalues import _resolve

BIG = "long " + "x" * 2000           # above the 512-byte threshold: stored by reference
ROWS = 6


def _response(i: int) -> str:
    return f"{i} {BIG}" if i % 2 == 0 else f"{i} short"


def _fill(s) -> None:
    s.create_table("t", {"response": "string", "note": "string", "ids": "list<int32>",
                         "tt": "tensor<float32>", "reward": "float64"},
                   storage={"note": "ref"})
    s.put("t", {"sample_id": [f"q{i // 2}_0_{i % 2}" for i in range(ROWS)],
                "response": [_response(i) for i in range(ROWS)],
                "note": [f"n{i}" for i in range(ROWS)],
                "ids": [list(range(300)) if i % 2 == 0 else [i] for i in range(ROWS)],
                "tt": tensors.to_arrow([np.full((20, 20) if i % 2 == 0 else (2,), i, np.float32)
                                        for i in range(ROWS)]),
                "reward": [float(i) for i in range(ROWS)]})


def _sid(i: int) -> str:
    return f"q{i // 2}_0_{i % 2}"


LONG = [_sid(i) for i in range(0, ROWS, 2)]
INDEX = {_sid(i): i for i in range(ROWS)}


@pytest.fixture
def filled(any_store):
    _fill(any_store)
    return any_store


def _rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


# -- the store's query --------------------------------------------------------------------------
def test_projections_functions_filters_and_groups_see_values(filled):
    s = filled
    got = _rows(s.query("SELECT sample_id, response, note, len(ids) AS n_ids, tt.shape AS shape "
                        "FROM t ORDER BY reward"))
    assert got == [{"sample_id": _sid(i), "response": _response(i), "note": f"n{i}",
                    "n_ids": 300 if i % 2 == 0 else 1,
                    "shape": [20, 20] if i % 2 == 0 else [2]} for i in range(ROWS)]
    lengths = s.query("SELECT length(response) AS n FROM t ORDER BY reward").column(0)
    assert lengths.to_pylist() == [len(_response(i)) for i in range(ROWS)]
    liked = s.query("SELECT sample_id FROM t WHERE response LIKE '%long x%' ORDER BY 1")
    assert liked.column(0).to_pylist() == LONG
    grouped = _rows(s.query("SELECT length(response) > 1000 AS long, count(*) AS n, "
                            "sum(list_sum(ids)) AS ids FROM t GROUP BY 1 ORDER BY 1"))
    assert grouped == [{"long": False, "n": 3, "ids": 1 + 3 + 5},
                       {"long": True, "n": 3, "ids": 3 * sum(range(300))}]
    top = s.query("SELECT sample_id, response FROM t ORDER BY reward DESC LIMIT 2")
    assert _rows(top) == [{"sample_id": _sid(i), "response": _response(i)} for i in (5, 4)]
    nested = s.query("WITH l AS (SELECT response FROM t WHERE reward = 2) SELECT a.sample_id "
                     "FROM t a JOIN l ON a.response = l.response")
    assert nested.column(0).to_pylist() == [_sid(2)]


def test_select_star_has_values_and_keys_stay_visible_on_request(filled):
    s = filled
    star = s.query("SELECT * FROM t ORDER BY reward")
    assert not [c for c in star.column_names if c.endswith("__ref")]
    assert star.column("response").to_pylist() == [_response(i) for i in range(ROWS)]
    assert star.column("note").to_pylist() == [f"n{i}" for i in range(ROWS)]
    # The key still says where a value is stored (only by-reference values have one).
    keys = s.query("SELECT response__ref, note__ref FROM t ORDER BY reward").to_pylist()
    assert [k["response__ref"] is not None for k in keys] == [i % 2 == 0 for i in range(ROWS)]
    assert all(k["note__ref"] for k in keys)


def test_claim_predicates_see_values(filled):
    s = filled
    claim = s.claim("t", 10, where="response LIKE '%long x%' AND note <> 'n0'")
    assert sorted(claim.data.column("sample_id").to_pylist()) == LONG[1:]
    assert claim.data.column("response").to_pylist() == [_response(2), _response(4)]
    s.nack(claim.claim_id)
    groups = s.claim("t", 10, where="input_id IN (SELECT input_id FROM t GROUP BY 1 "
                                    "HAVING max(length(response)) > 1000 AND min(note) = 'n2')")
    assert sorted(groups.data.column("sample_id").to_pylist()) == [_sid(2), _sid(3)]
    s.ack(groups.claim_id)
    rest = s.claim("t", 10, where="list_contains(ids, 299)")
    assert sorted(rest.data.column("sample_id").to_pylist()) == [_sid(0), _sid(4)]


def test_subscription_predicates_see_values(filled):
    s = filled
    sub = s.subscribe("t", micro_batch_size=1, global_batch_size=3,
                      where="response LIKE '%long x%'")
    try:
        got = []
        for _ in range(3):
            mb = sub.next(timeout=20)
            assert mb is not None, "no micro-batch within 20 s"
            [sid] = mb.data.column("sample_id").to_pylist()
            assert mb.data.column("response").to_pylist() == [_response(INDEX[sid])]
            got.append(sid)
            mb.ack()
        assert sorted(got) == LONG
    finally:
        sub.close()


def test_by_value_queries_never_read_the_blob_store(open_store, db_path):
    s = open_store()
    _fill(s)
    s.create_table("plain", {"reward": "float64", "done": "bool"})
    s.put("plain", {"sample_id": ["a_0_0", "a_0_1"], "reward": [1.0, 2.0], "done": [True, False]})
    s.close()
    blobs = Path(db_path + ".blobs")
    segments = sorted(blobs.glob("seg-*.arrow"))
    assert segments
    for seg in segments:                      # every by-reference value becomes unreadable
        seg.rename(seg.with_suffix(".moved"))
    s = open_store()
    # Queries that do not use a by-reference column (or only its key) run as before.
    assert _rows(s.query("SELECT count(*) AS n, sum(reward) AS r FROM t")) == [
        {"n": ROWS, "r": float(sum(range(ROWS)))}]
    assert s.query("SELECT sample_id FROM t WHERE reward > 3 ORDER BY 1").column(0).to_pylist() \
        == [_sid(4), _sid(5)]
    assert s.query("SELECT count(response__ref) AS n FROM t").column(0).to_pylist() == [3]
    # Rows a filter on other columns drops are never resolved: inline values are read.
    inline = s.query("SELECT response FROM t WHERE response__ref IS NULL ORDER BY reward")
    assert inline.column(0).to_pylist() == [_response(i) for i in (1, 3, 5)]
    assert s.query("SELECT response FROM t WHERE reward = 3").column(0).to_pylist() == \
        [_response(3)]
    # A table without by-reference columns is the table itself.
    assert s.query("SELECT * FROM plain ORDER BY row_id").equals(
        s._readers.cursor().sql("SELECT * FROM plain ORDER BY row_id").to_arrow_table())
    # What needs a missing value says which segment is missing.
    for sql in ("SELECT response FROM t", "SELECT * FROM t", "SELECT count(*) FROM t WHERE "
                "note = 'n1'"):
        with pytest.raises(StorageError, match=r"seg-\d{8}\.arrow"):
            s.query(sql)
    with pytest.raises(StorageError, match=r"seg-\d{8}\.arrow"):
        s.claim("t", 10, where="note = 'n1'")
    assert s.stats("t")["t"]["processing"] == 0


# -- safety ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sql", [
    "SELECT expstore_value_0('0:0:16:0')",
    "SELECT EXPSTORE_VALUE_0(response__ref) FROM t",
    "SELECT * FROM t WHERE expstore_anything('/etc/passwd') IS NOT NULL",
    "DROP VIEW t",
    "CREATE OR REPLACE TEMP VIEW t AS SELECT 1 AS response",
    "CREATE TEMP MACRO v(k) AS k",
    "ATTACH '/tmp/evil.duckdb' AS evil",
    "UPDATE t SET response = 'changed'",
    "INSERT INTO t (row_id, sample_id, input_id, turn, trajectory_id, policy_version) "
    "VALUES (99, 'z_0_0', 'z', 0, 0, 0)",
])
def test_the_query_path_stays_read_only_and_keeps_the_resolver_internal(filled, sql):
    s = filled
    before = s.query("SELECT * EXCLUDE (updated_at) FROM t ORDER BY row_id")
    with pytest.raises(QueryRefused):
        s.query(sql)
    with pytest.raises(QueryRefused):
        s.claim("t", 1, where="expstore_value_0(response__ref) IS NOT NULL")
    assert s.query("SELECT * EXCLUDE (updated_at) FROM t ORDER BY row_id").equals(before)


def test_the_resolver_takes_only_keys_of_the_store(embedded_store):
    s = embedded_store
    _fill(s)
    key = s.query("SELECT response__ref FROM t WHERE reward = 0").column(0)[0].as_py()
    assert _resolve(s.blobs, pa.array([key, None]), pa.string()).to_pylist() == [_response(0),
                                                                               None]
    for bad in ("/etc/passwd", "../../x.duckdb", "0:0:16", "0:0:16:0:1", "-1:0:16:0",
                "0:0:16:0;", " 0:0:16:0"):
        with pytest.raises(StorageError, match="is not a key of this store"):
            _resolve(s.blobs, pa.array([key, bad]), pa.string())


def test_views_follow_tables_created_and_dropped(embedded_store):
    s = embedded_store
    _fill(s)
    assert s.query("SELECT count(*) FROM t WHERE response LIKE '%long x%'").column(0).to_pylist() == [3]
    s.drop_table("t")
    with pytest.raises(QueryRefused, match="t"):
        s.query("SELECT response FROM t")
    s.create_table("t", {"answer": "string"}, storage={"answer": "ref"})
    s.create_table("u", {"text": "string"})
    s.put("t", {"sample_id": ["a_0_0"], "answer": ["forty-two"]})
    s.put("u", {"sample_id": ["b_0_0"], "text": [BIG]})
    assert _rows(s.query("SELECT answer, (SELECT text FROM u) AS text FROM t")) == [
        {"answer": "forty-two", "text": BIG}]


# -- the server, Flight SQL and the CLI --------------------------------------------------------
def test_do_get_flight_sql_and_remote_claims_see_values(tmp_path):
    dbapi = pytest.importorskip("adbc_driver_flightsql.dbapi",
                                reason="adbc-driver-flightsql (the dev extra) is not installed")
    with running_server(tmp_path / "x.duckdb") as server:
        with store.connect(server.location) as s:
            _fill(s)
            got = flight_query(flight.connect(server.location), "SELECT sample_id, length(response) AS n "
                               "FROM t WHERE response LIKE ? ORDER BY 1", ["%long x%"])
            assert _rows(got) == [{"sample_id": sid, "n": len(_response(i))}
                                  for i, sid in zip(range(0, ROWS, 2), LONG)]
            star = flight_query(flight.connect(server.location), "SELECT * FROM t ORDER BY reward")
            assert star.column("response").to_pylist() == [_response(i) for i in range(ROWS)]
            assert "response__ref" not in star.column_names
            claim = s.claim("t", 10, where="length(note) = 2 AND response LIKE '%long x%'")
            assert sorted(claim.data.column("sample_id").to_pylist()) == LONG
            s.ack(claim.claim_id)
        with warnings.catch_warnings():  # "Cannot disable autocommit": the server is read-only
            warnings.simplefilter("ignore")
            conn = dbapi.connect(server.location)
        try:
            cur = conn.cursor()
            cur.execute("SELECT sample_id, response, note FROM t WHERE response LIKE ? "
                        "ORDER BY reward", parameters=["%short%"])
            assert cur.fetch_arrow_table().to_pylist() == [
                {"sample_id": _sid(i), "response": _response(i), "note": f"n{i}"}
                for i in (1, 3, 5)]
            cur.execute("SELECT max(length(response)) AS n FROM t")
            assert cur.fetch_arrow_table().column(0).to_pylist() == [len(_response(4))]
            cur.close()
        finally:
            conn.close()


def _cli(*args: str):
    env = {"EXPSTORE_DB": None, "EXPSTORE_URI": None, "EXPSTORE_TOKEN": None}
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.mark.parametrize("remote", [False, True], ids=["embedded", "remote"])
def test_cli_query_and_export_see_values(tmp_path, remote):
    db = str(tmp_path / "x.duckdb")
    with store.connect(db) as s:
        _fill(s)

    def run(target: list[str]) -> None:
        rows = json.loads(_cli("query", "SELECT sample_id, response, length(note) AS n FROM t "
                               "WHERE response LIKE '%long x%' ORDER BY 1", "--json",
                               *target).stdout)
        assert rows == [{"sample_id": sid, "response": _response(i), "n": 2}
                        for i, sid in zip(range(0, ROWS, 2), LONG)]
        out = tmp_path / f"out-{remote}.jsonl"
        _cli("export", "--sql", "SELECT sample_id, response, note FROM t ORDER BY reward",
             "-o", str(out), *target)
        exported = [json.loads(line) for line in out.read_text().splitlines()]
        assert exported == [{"sample_id": _sid(i), "response": _response(i), "note": f"n{i}"}
                            for i in range(ROWS)]

    if not remote:
        run(["--db", db])
        return
    with running_server(db) as server:
        run(["--uri", server.location])


def test_select_star_of_a_put_resolves_its_keys_in_bulk(embedded_store, monkeypatch):
    from store.blobs import BlobStore
    s = embedded_store
    n = 300
    s.create_table("big", {"text": "string", "ids": "list<int32>"},
                   storage={"text": "ref", "ids": "ref"})
    s.put("big", {"sample_id": [f"q{i}_0_0" for i in range(n)],
                  "text": [f"row {i} " * 30 for i in range(n)],
                  "ids": [list(range(i, i + 50)) for i in range(n)]})
    per_key = []
    real = BlobStore.resolve
    monkeypatch.setattr(BlobStore, "resolve",
                        lambda self, keys, typ: per_key.append(len(keys)) or real(self, keys, typ))
    got = s.query("SELECT sample_id, text, ids FROM big").to_pylist()
    assert sorted((r["sample_id"], r["text"], r["ids"]) for r in got) == sorted(
        (f"q{i}_0_0", f"row {i} " * 30, list(range(i, i + 50))) for i in range(n))
    assert per_key == []
    # a few rows picked by a filter still go key by key, and agree
    few = s.query("SELECT text FROM big WHERE sample_id = 'q7_0_0'").column(0).to_pylist()
    assert few == ["row 7 " * 30]


@pytest.mark.parametrize("sql, table", [
    ('SELECT * FROM t', "t"), ('select * from "t"', "t"), ("SELECT * FROM main.t", "t"),
    ("SELECT * FROM t WHERE reward > 1", None), ("SELECT * FROM t LIMIT 3", None),
    ("SELECT * FROM t ORDER BY reward", None), ("SELECT *, 1 FROM t", None),
    ("SELECT * EXCLUDE (note) FROM t", None), ("SELECT * REPLACE (1 AS note) FROM t", None),
    ("SELECT response FROM t", None), ("SELECT DISTINCT * FROM t", None),
    ("SELECT * FROM t AS x", None), ("SELECT * FROM t, t AS u", None),
    ("WITH u AS (SELECT 1) SELECT * FROM t", None), ("SELECT * FROM t USING SAMPLE 5", None),
    ("SELECT * FROM other.main.t", None), ("SELECT * FROM (SELECT * FROM t)", None),
    ("SELECT * FROM t UNION ALL SELECT * FROM t", None),
])
def test_whole_table_reads_are_told_apart(sql, table):
    from store.sqlvalues import whole_table
    assert whole_table(sql) == table


def test_a_whole_table_is_read_as_stored_and_its_values_cut_afterwards(embedded_store,
                                                                       monkeypatch):
    import store.sqlvalues as sqlvalues
    s = embedded_store
    _fill(s)
    s.put("t", {"sample_id": [f"z{i}_0_0" for i in range(200)],   # a second put, another chunk
                "response": [_response(i) for i in range(200)],
                "note": [f"m{i}" if i % 3 else None for i in range(200)],
                "ids": [list(range(i, i + 300)) for i in range(200)],
                "tt": tensors.to_arrow([np.full((4, 4), i, np.float32) for i in range(200)]),
                "reward": [float(i) for i in range(200)]})
    through_duckdb = []
    real = sqlvalues._resolve
    monkeypatch.setattr(sqlvalues, "_resolve", lambda *a: through_duckdb.append(1) or real(*a))
    whole = s.query("SELECT * FROM t")
    assert through_duckdb == []                 # no value went through DuckDB
    filtered = s.query("SELECT * FROM t WHERE true")
    assert through_duckdb                       # (the same rows, through the resolving view)
    assert whole.equals(filtered)
    assert whole.num_rows == ROWS + 200 and "response__ref" not in whole.column_names
    assert sorted(whole.column("note").to_pylist(), key=str) == sorted(
        [f"n{i}" for i in range(ROWS)] + [f"m{i}" if i % 3 else None for i in range(200)], key=str)


def test_a_whole_table_read_again_sees_what_changed_since(embedded_store):
    """The read of a whole table as stored is kept per cursor between queries: it must show
    each query the table as it is then (rows put and consumed since, a table dropped and
    created again with other columns), never what an earlier query read."""
    s = embedded_store
    _fill(s)
    first = s.query("SELECT * FROM t")
    assert first.num_rows == ROWS and not any(first.column("consumed").to_pylist())
    s.put("t", {"sample_id": ["late_0_0"], "response": [BIG], "note": ["late"],
                "ids": [[1, 2]], "tt": tensors.to_arrow([np.zeros(3, np.float32)]),
                "reward": [9.0]})
    claim = s.claim("t", 2)
    s.ack(claim.claim_id)
    again = s.query("SELECT * FROM t")
    assert again.num_rows == ROWS + 1
    assert sorted(again.column("note").to_pylist()) == sorted(
        [f"n{i}" for i in range(ROWS)] + ["late"])
    assert again.column("consumed").to_pylist().count(True) == 2
    s.drop_table("t")
    s.create_table("t", {"answer": "string"}, storage={"answer": "ref"})
    s.put("t", {"sample_id": ["a_0_0"], "answer": ["forty-two"]})
    last = s.query("SELECT * FROM t")
    assert last.column("answer").to_pylist() == ["forty-two"]
    assert "note" not in last.column_names
