"""The put fast paths give the same results as the general ones.

* terminal rows (consumed, stale, dead) are found through the table's in-memory terminal index,
  or DuckDB when the index is given up (point lookups for few keys, a join for many);
* small batches of new rows are inserted with ``INSERT … VALUES``;
* ``prepare_put`` has a fast path for small batches that must match the general path exactly,
  errors included.
"""
from __future__ import annotations

import pyarrow as pa
import pytest

import store.live
import store.writer
from store.errors import StaleVersion

COLUMNS = {"prompt": "string", "response": "string", "reward": "float64"}
SNAPSHOT = "SELECT * EXCLUDE (updated_at, created_at) FROM t ORDER BY sample_id, policy_version"


def _state(s, table="t"):
    st = s.stats(table)[table]
    return {k: st[k] for k in ("pending", "ready", "processing", "consumed", "stale", "dead")}


def _full(sid, reward=1.0):
    return {"sample_id": sid, "prompt": f"p {sid}", "response": f"r {sid}", "reward": reward}


def _consume_all(s, table="t"):
    while True:
        claim = s.claim(table, 1000)
        if not claim:
            return
        s.ack(claim.claim_id)


# -- terminal rows -------------------------------------------------------------------------------

@pytest.fixture(params=["index", "duckdb"])
def terminal_mode(request, monkeypatch):
    """Run with the in-memory terminal index, and with it given up (DuckDB answers)."""
    if request.param == "duckdb":
        monkeypatch.setattr(store.live, "TERMINAL_INDEX_MAX", 0)
    return request.param


@pytest.mark.parametrize("rows", [1, 3, 6, 40])
def test_rewrite_of_consumed_rows_updates_them_and_stays_consumed(open_store, terminal_mode, rows):
    s = open_store()
    s.create_table("t", COLUMNS)
    sids = [f"q{i}_0_{i % 4}" for i in range(rows)]
    s.put("t", [_full(sid) for sid in sids])
    _consume_all(s)
    s.put("t", [_full(sid, reward=2.0) for sid in sids])       # a re-send with new values
    assert not s.claim("t", 1000)
    st = _state(s)
    assert st["consumed"] == rows and st["ready"] == 0 and st["pending"] == 0
    got = s.query("SELECT reward, consumed FROM t").to_pylist()
    assert got == [{"reward": 2.0, "consumed": True}] * rows
    # Mixed with new keys in one batch: the new ones are inserted with dense row ids.
    s.put("t", [_full(sid, 3.0) for sid in sids] + [_full(f"n{i}_0_0") for i in range(rows)])
    assert s.query("SELECT count(*) AS n, max(row_id) AS m FROM t").to_pylist() == [
        {"n": 2 * rows, "m": 2 * rows - 1}]
    claim = s.claim("t", 1000)
    assert sorted(claim.data.column("sample_id").to_pylist()) == sorted(
        f"n{i}_0_0" for i in range(rows))
    s.close()
    # After a restart the terminal rows are still known.
    s = open_store()
    s.put("t", [_full(sid, 4.0) for sid in sids])
    assert s.query("SELECT count(*) FILTER (WHERE reward = 4.0) AS n FROM t").to_pylist() == [
        {"n": rows}]
    assert _state(s)["consumed"] == rows


def test_rewrite_of_dead_rows(open_store, terminal_mode):
    s = open_store()
    s.create_table("t", COLUMNS, max_deliveries=1)
    s.put("t", [_full("a_0_0"), _full("b_0_0")])
    claim = s.claim("t", 10)
    s.nack(claim.claim_id)
    assert _state(s)["dead"] == 2
    s.put("t", [_full("a_0_0", 5.0)])
    assert not s.claim("t", 10)
    assert _state(s)["dead"] == 2
    assert s.query("SELECT reward FROM t WHERE sample_id = 'a_0_0'").to_pylist() == [
        {"reward": 5.0}]


def test_terminal_rows_within_the_staleness_window_survive_a_bump(open_store, terminal_mode):
    s = open_store()
    s.create_table("t", COLUMNS, max_staleness=1)
    s.put("t", [_full("a_0_0")])
    _consume_all(s)
    s.bump_version("t")
    s.put("t", [_full("a_0_0", 7.0) | {"policy_version": 0}])
    assert _state(s)["consumed"] == 1 and not s.claim("t", 10)
    s.bump_version("t")
    with pytest.raises(StaleVersion):
        s.put("t", [_full("a_0_0") | {"policy_version": 0}])
    # The index keeps only versions a put may still carry.
    live = s._live["t"]
    if live.terminal is not None:
        assert all(v >= 1 for v in live.terminal)


def test_stale_rows_marked_by_a_bump(open_store, terminal_mode):
    s = open_store()
    s.create_table("t", COLUMNS, max_staleness=1)
    s.put("t", [_full("a_0_0"), {"sample_id": "b_0_0", "prompt": "only"}])
    s.bump_version("t")
    s.bump_version("t")
    assert _state(s)["stale"] == 2
    s.put("t", [_full("a_0_0") | {"policy_version": 1}])       # another key: a new row
    assert _state(s)["ready"] == 1


def test_index_given_up_past_its_limit(open_store, monkeypatch):
    monkeypatch.setattr(store.live, "TERMINAL_INDEX_MAX", 5)
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_full(f"q{i}_0_0") for i in range(3)])
    _consume_all(s)
    assert s._live["t"].terminal is not None
    s.put("t", [_full(f"r{i}_0_0") for i in range(4)])
    _consume_all(s)
    assert s._live["t"].terminal is None                       # DuckDB answers from now on
    s.put("t", [_full(f"q{i}_0_0", 9.0) for i in range(3)] + [_full(f"r{i}_0_0", 9.0)
                                                              for i in range(4)])
    s.put("t", [_full("q0_0_0", 8.0)])
    assert _state(s)["consumed"] == 7 and not s.claim("t", 10)
    s.close()
    s = open_store()                                           # too many to load: not kept
    assert s._live["t"].terminal is None
    s.put("t", [_full("r3_0_0", 1.5)])
    assert _state(s)["consumed"] == 7


def test_an_update_that_misses_its_row_fails_the_write(open_store):
    """The last line of defence against a wrong terminal index: nothing is silently lost."""
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_full("a_0_0")])
    live = s._live["t"]
    with s._lock:
        live.remember_terminal(0, "ghost_0_0", 12345)          # a row that does not exist
    with pytest.raises(Exception, match="updated 0 rows, expected 1"):
        s.put("t", [_full("ghost_0_0")])
    s.put("t", [_full("b_0_0")])                               # the store goes on
    assert _state(s)["ready"] == 2


# -- INSERT … VALUES for a few new rows -------------------------------------------------------------

TYPES = {"b": "bool", "i8": "int8", "i32": "int32", "u64": "uint64", "f32": "float32",
         "f64": "float64", "s": "string", "bin": "binary", "ts": "timestamp", "ids": "list<int32>"}


def _typed_rows(k):
    rows = []
    for i in range(k):
        rows.append({"sample_id": f"in{i}_{i}_{i % 3}", "b": [True, False, None][i % 3],
                     "i8": [-128, 127, None, 0][i % 4], "i32": [2**31 - 1, -(2**31), None][i % 3],
                     "u64": [2**64 - 1, 0, None][i % 3],
                     "f32": [1.1, float("nan"), -0.0, None, 3.4e38][i % 5],
                     "f64": [0.1, float("inf"), None, -1e-300][i % 4],
                     "s": ["ü\x00x", "", None, "x" * 600][i % 4],
                     "bin": [b"\x00\xff", None][i % 2], "ts": None,
                     "ids": [[1, 2], None, []][i % 3]})
    return rows


@pytest.mark.parametrize("k", [1, 2, 4, 5, 17])
@pytest.mark.parametrize("drop", [(), ("ids", "bin", "ts"), ("ids", "bin", "ts", "s", "b")])
def test_values_insert_matches_the_arrow_insert(open_store, tmp_path, monkeypatch, k, drop):
    rows = [{c: v for c, v in r.items() if c not in drop} for r in _typed_rows(k)]
    columns = {c: t for c, t in TYPES.items() if c not in drop}
    snapshots = []
    for limit in (store.writer.VALUES_INSERT_ROWS, 0):
        monkeypatch.setattr(store.writer, "VALUES_INSERT_ROWS", limit)
        s = open_store(str(tmp_path / f"v{limit}.duckdb"))
        s.create_table("t", columns, required=["b"] if "b" in columns else None)
        s.put("t", rows)
        s.put("t", rows[: k // 2] + [{"sample_id": "more_0_0", "f64": 2.0}])  # update + insert
        s.put("t", [{"sample_id": "st_0_0", "f64_status": False}])          # a status only
        snapshots.append((s.query(SNAPSHOT).to_pylist(), _state(s)))
    assert repr(snapshots[0]) == repr(snapshots[1])                 # repr: NaN == NaN
