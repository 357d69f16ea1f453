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

import reliability_helpers as rh
import store.live
import store.rows_sql
from store.settings import StoreSettings
from store.errors import StaleVersion

COLUMNS = {"prompt": "string", "response": "string", "reward": "float64"}
SNAPSHOT = "SELECT * EXCLUDE (updated_at, created_at) FROM t ORDER BY sample_id, policy_version"


def _state(s, table="t"):
    st = s.stats(table)[table]
    return {k: st[k] for k in ("pending", "ready", "processing", "consumed", "stale", "dead")}


def _full(sid, reward=1.0):
    return {"sample_id": sid, "prompt": f"p {sid}", "response": f"r {sid}", "reward": reward}


def _assert_one_row_per_key(s, table="t"):
    n, keys = rh.rows_and_keys(s, table)
    assert n == keys, f"duplicate keys in {table}: {n} rows for {keys} keys"
    return n


def _consume_all(s, table="t"):
    while True:
        claim = s.claim(table, 1000)
        if not claim:
            return
        s.ack(claim.claim_id)


# -- terminal rows -------------------------------------------------------------------------------

@pytest.fixture(params=["index", "duckdb"])
def terminal_mode(request):
    """Store options: the in-memory terminal index, or the index given up (DuckDB answers)."""
    return {"terminal_index_max": 0} if request.param == "duckdb" else {}


@pytest.mark.parametrize("rows", [1, 3, 6, 40])
def test_rewrite_of_consumed_rows_updates_them_and_stays_consumed(open_store, terminal_mode, rows):
    s = open_store(**terminal_mode)
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
    s = open_store(**terminal_mode)
    s.put("t", [_full(sid, 4.0) for sid in sids])
    assert s.query("SELECT count(*) FILTER (WHERE reward = 4.0) AS n FROM t").to_pylist() == [
        {"n": rows}]
    assert _state(s)["consumed"] == rows
    assert _assert_one_row_per_key(s) == 2 * rows


def test_rewrite_of_dead_rows(open_store, terminal_mode):
    s = open_store(**terminal_mode)
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
    s = open_store(**terminal_mode)
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
    live = s._index.live["t"]
    if live.terminal is not None:
        assert all(v >= 1 for v in live.terminal)


def test_stale_rows_marked_by_a_bump(open_store, terminal_mode):
    s = open_store(**terminal_mode)
    s.create_table("t", COLUMNS, max_staleness=1)
    s.put("t", [_full("a_0_0"), {"sample_id": "b_0_0", "prompt": "only"}])
    s.bump_version("t")
    s.bump_version("t")
    assert _state(s)["stale"] == 2
    s.put("t", [_full("a_0_0") | {"policy_version": 1}])       # another key: a new row
    assert _state(s)["ready"] == 1


def test_index_given_up_past_its_limit(open_store):
    s = open_store(terminal_index_max=5)
    s.create_table("t", COLUMNS)
    s.put("t", [_full(f"q{i}_0_0") for i in range(3)])
    _consume_all(s)
    assert s._index.live["t"].terminal is not None
    s.put("t", [_full(f"r{i}_0_0") for i in range(4)])
    _consume_all(s)
    assert s._index.live["t"].terminal is None                       # DuckDB answers from now on
    s.put("t", [_full(f"q{i}_0_0", 9.0) for i in range(3)] + [_full(f"r{i}_0_0", 9.0)
                                                              for i in range(4)])
    s.put("t", [_full("q0_0_0", 8.0)])
    assert _state(s)["consumed"] == 7 and not s.claim("t", 10)
    assert _assert_one_row_per_key(s) == 7
    s.close()
    s = open_store(terminal_index_max=5)                       # too many to load: not kept
    assert s._index.live["t"].terminal is None
    s.put("t", [_full("r3_0_0", 1.5)])
    s.put("t", [_full(f"q{i}_0_0", 2.5) for i in range(3)])   # a join, not point lookups
    assert _state(s)["consumed"] == 7
    assert _assert_one_row_per_key(s) == 7


def test_an_update_that_misses_its_row_fails_the_write(open_store):
    """The last line of defence against a wrong terminal index: nothing is silently lost."""
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_full("a_0_0")])
    live = s._index.live["t"]
    with s._index.lock:
        live.remember_terminal(0, "ghost_0_0", 12345)          # a row that does not exist
    with pytest.raises(Exception, match="updated 0 rows, expected 1"):
        s.put("t", [_full("ghost_0_0")])
    s.put("t", [_full("b_0_0")])                               # the store goes on
    assert _state(s)["ready"] == 2


# -- bulk puts of new rows: numbered and indexed in one step -----------------------------------

def test_all_fresh_sees_live_new_and_terminal_keys(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [{"sample_id": "live_0_0", "prompt": "p"}])             # live, pending
    s.put("t", [_full("done_0_0")])
    _consume_all(s)                                                     # terminal at version 0
    live = s._index.live["t"]
    fresh = store.rows_sql._all_fresh
    assert fresh(live, {}, [("x_0_0", 0), ("y_0_0", 0)])
    assert not fresh(live, {}, [("x_0_0", 0), ("live_0_0", 0)])
    assert not fresh(live, {("x_0_0", 0): 7}, [("y_0_0", 0), ("x_0_0", 0)])  # new in this txn
    assert not fresh(live, {}, [("x_0_0", 0), ("done_0_0", 0)])
    assert fresh(live, {}, [("x_0_0", 1), ("done_0_0", 1)])             # another version: new
    assert not fresh(live, {}, [("x_0_0", 1), ("done_0_0", 0)])         # versions mixed
    assert fresh(live, {}, [("done_0_0", 1), ("x_0_0", 0)])
    with s._index.lock:
        live.terminal = None                                            # given up: ask DuckDB
    assert not fresh(live, {}, [("x_0_0", 0)])


def _claimed(s, table="t"):
    out = []
    while claim := s.claim(table, 7):
        out.append(claim.data.to_pylist())
        s.ack(claim.claim_id)
    return out


def test_bulk_put_of_new_rows_matches_the_general_path(open_store, tmp_path, monkeypatch):
    """The same writes through the bulk path and through the per-key one (forced) leave the
    same table, the same states and the same claims, in the same order."""
    sids = [f"in{i // 4}_{i % 2}_{i % 4}" for i in range(60)]
    writes = [
        [_full(sid, float(i)) for i, sid in enumerate(sids[:40])],         # new, complete
        [{"sample_id": sid, "prompt": "only"} for sid in sids[40:]],        # new, pending
        [_full(sid, 9.0) for sid in sids[35:45]],                           # live: updates
        [{"sample_id": f"v{i}_0_0", "policy_version": 0, "reward": 1.0} for i in range(20)],
    ]
    results = []
    for general in (False, True):
        if general:
            monkeypatch.setattr(store.rows_sql, "_all_fresh", lambda *a: False)
        s = open_store(str(tmp_path / f"g{general}.duckdb"))
        s.create_table("t", COLUMNS)
        for w in writes:
            s.put("t", w)
        before = (s.query(SNAPSHOT).to_pylist(), _state(s))
        results.append((before, _claimed(s), _state(s)))
        s.close()
    assert repr(results[0]) == repr(results[1])
    assert results[0][0][1]["ready"] == 45 and results[0][0][1]["pending"] == 35


def _blocked(s, table="t"):
    """How many live rows are still held in bulk-put blocks (not built as objects)."""
    return sum(type(r) is store.live.RowBlock for r in s._index.live[table].rows.values())


def test_bulk_put_rows_stay_in_a_block_until_a_claim_or_write_touches_them(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_full(f"g{i // 8}_0_{i % 8}", float(i)) for i in range(40)])
    assert _blocked(s) == 40 and _state(s)["ready"] == 40
    claim = s.claim("t", 8)                                      # one whole group is built
    assert claim.data.column("sample_id").to_pylist() == [f"g0_0_{t}" for t in range(8)]
    assert claim.data.column("reward").to_pylist() == [float(t) for t in range(8)]
    assert _blocked(s) == 32
    s.put("t", [{"sample_id": "g1_0_3", "reward": -1.0}])        # a write builds its group
    assert _blocked(s) == 24
    s.put("t", [{"sample_id": "g2_0_0", "reward_status": False}])  # and may make it pending
    st = _state(s)
    assert (st["processing"], st["ready"], st["pending"]) == (8, 31, 1)
    got = {r["sample_id"]: r["reward"] for r in s.claim("t", 100).data.to_pylist()}
    assert len(got) == 31 and got["g1_0_3"] == -1.0 and "g2_0_0" not in got
    assert _blocked(s) == 0


def test_group_claims_take_rows_from_several_blocks(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_full(f"q{i}_0_{t}") for i in range(3) for t in range(4)] * 1)
    s.put("t", [_full(f"q{i}_0_{t}") for i in range(3) for t in range(4, 8)])
    assert _blocked(s) == 24
    claim = s.claim("t", 16, group_by="input_id", group_size=8)
    assert claim.data.column("sample_id").to_pylist() == [
        f"q{i}_0_{t}" for i in range(2) for t in range(8)]


def test_groups_interleaved_in_blocks_are_claimed_in_write_order(open_store):
    """A block keeps each group's rows as positions in one flat order; groups written
    interleaved, over three bulk puts, come back whole and in the order written."""
    s = open_store()
    s.create_table("t", COLUMNS)
    for turns in (range(0, 3), range(3, 6), range(6, 8)):
        s.put("t", [_full(f"q{i}_0_{t}", float(10 * i + t)) for t in turns for i in range(3)])
    assert _blocked(s) == 24
    claim = s.claim("t", 16, group_by="input_id", group_size=8)
    assert claim.data.column("sample_id").to_pylist() == [
        f"q{i}_0_{t}" for i in range(2) for t in range(8)]
    assert claim.data.column("reward").to_pylist() == [
        float(10 * i + t) for i in range(2) for t in range(8)]
    assert s.claim("t", 8).data.column("sample_id").to_pylist() == [f"q2_0_{t}" for t in range(8)]
    assert _blocked(s) == 0


def test_a_group_is_claimed_in_turn_and_trajectory_order_however_its_rows_come_back(open_store):
    """A block keeps each group's rows in claim order (turn, trajectory) whatever order they
    were written in, so a claim takes them unsorted; rows that come back to a group (a nack,
    a lease that ends) are put in their place again."""
    s = open_store()
    s.create_table("t", COLUMNS, lease_seconds=60)
    order = [(turn, traj) for turn in range(2) for traj in range(4)]
    for q in ("q0", "q1"):                                       # written backwards
        s.put("t", [_full(f"{q}_{turn}_{traj}") for turn, traj in reversed(order)])
    assert _blocked(s) == 16

    def ids(claim):
        return claim.data.column("sample_id").to_pylist()

    first = s.claim("t", 3)
    assert ids(first) == ["q0_0_0", "q0_0_1", "q0_0_2"]
    s.nack(first.claim_id)                     # back into q0, after the rows that stayed
    again = s.claim("t", 8)
    assert ids(again) == [f"q0_{turn}_{traj}" for turn, traj in order]
    assert again.data.column("delivery_count").to_pylist() == [2, 2, 2] + [1] * 5
    assert ids(s.claim("t", 8, group_by="input_id", group_size=8)) == [
        f"q1_{turn}_{traj}" for turn, traj in order]
    assert _state(s)["processing"] == 16 and _blocked(s) == 0


def test_a_bump_marks_rows_of_blocks_stale(open_store):
    s = open_store()
    s.create_table("t", COLUMNS, max_staleness=1)
    s.put("t", [_full(f"a{i}_0_0") for i in range(20)])
    assert _blocked(s) == 20
    s.bump_version("t")
    assert _state(s)["ready"] == 20                            # within the staleness bound
    s.bump_version("t")
    assert _state(s) == {"pending": 0, "ready": 0, "processing": 0, "consumed": 0,
                         "stale": 20, "dead": 0}
    assert not s.claim("t", 100) and _blocked(s) == 0


def test_bulk_parse_of_sample_ids_matches_parse_sample_id():
    """The vectorised path (over FAST_PREPARE_ROWS rows) cuts ids at their last two
    underscores."""
    from store.naming import parse_sample_id
    tricky = ["q1_0_0", "gsm8k_17_2_5", "a_b_c_d_3_4", "__x__12_999999999_0", "ü_1_2",
              "x_7_10", "x_00_1_2", "日本_3_4", "a__1_2"]
    ids = tricky + [f"pad{i}_0_0" for i in range(prepare.FAST_PREPARE_ROWS)]
    p = prepare.prepare_put(TDEF, [{"sample_id": t} for t in ids], 0, 64)
    got = list(zip(p.physical.column("input_id").to_pylist(),
                   p.physical.column("turn").to_pylist(),
                   p.physical.column("trajectory_id").to_pylist()))
    want = [(x.input_id, x.turn, x.trajectory_id) for x in map(parse_sample_id, ids)]
    assert got == want


# -- INSERT … VALUES for a few new rows ---------------------------------------------------

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
    for limit in (StoreSettings().values_insert_rows, 0):
        s = open_store(str(tmp_path / f"v{limit}.duckdb"), values_insert_rows=limit,
                       values_update_rows=limit)
        s.create_table("t", columns, required=["b"] if "b" in columns else None)
        s.put("t", rows)
        s.put("t", rows[: k // 2] + [{"sample_id": "more_0_0", "f64": 2.0}])  # update + insert
        s.put("t", [{"sample_id": "st_0_0", "f64_status": False}])          # a status only
        for r in rows[:3]:                                       # one-row partial updates
            s.put("t", [{c: v for c, v in r.items() if c in ("sample_id", "s", "f32", "u64")}])
            s.put("t", [{"sample_id": r["sample_id"], "i8": None, "i8_status": True}])
            s.put("t", [{"sample_id": r["sample_id"], "f64": 5.5, "f64_status": False}])
        s.put("t", [{"sample_id": "st_0_0", "f64": None}, {"sample_id": "more_0_0", "f64": 3.0},
                    {"sample_id": rows[0]["sample_id"], "finished_version": 9}])
        snapshots.append((s.query(SNAPSHOT).to_pylist(), _state(s)))
    assert repr(snapshots[0]) == repr(snapshots[1])                 # repr: NaN == NaN


# -- prepare_put: the small-batch fast path against the general path -----------------------

import numpy as np  # noqa: E402

import store.prepare as prepare  # noqa: E402
from store.schema import TableDef  # noqa: E402

PREP_COLUMNS = {"prompt": "string", "reward": "float64", "done": "bool", "n": "int32",
                "blob": "binary", "ids": "list<int32>", "emb": "tensor<float32>",
                "note": "string", "when": "timestamp"}
TDEF = TableDef.build("t", PREP_COLUMNS, storage={"note": "ref", "prompt": "auto",
                                                  "ids": "value"})


def _run(data, fast, version=3, threshold=64):
    limit = prepare.FAST_PREPARE_ROWS if fast else 0
    old, prepare.FAST_PREPARE_ROWS = prepare.FAST_PREPARE_ROWS, limit
    try:
        return prepare.prepare_put(TDEF, data, version, threshold), None
    except Exception as e:  # noqa: BLE001 - compared below
        return None, (type(e), str(e))
    finally:
        prepare.FAST_PREPARE_ROWS = old


def _chunk_bytes(chunks):
    """A put's chunks as bytes (a ColumnChunk serialised as its write would)."""
    from store.blob_chunks import ColumnChunk
    return {name: (c.serialized() if isinstance(c, ColumnChunk) else pa.py_buffer(c)).to_pybytes()
            for name, c in chunks.items()}


def _same(a, b):
    assert a.table == b.table
    assert a.physical.schema == b.physical.schema
    assert a.physical.equals(b.physical)
    assert a.keys == b.keys
    assert (a.data_columns, a.status_columns) == (b.data_columns, b.status_columns)
    assert _chunk_bytes(a.chunks) == _chunk_bytes(b.chunks)
    assert np.array_equal(a.set_mask, b.set_mask) and a.set_mask.dtype == b.set_mask.dtype
    assert np.array_equal(a.clear_mask, b.clear_mask) and a.clear_mask.dtype == b.clear_mask.dtype
    assert (a.versions_given, a.rows) == (b.versions_given, b.rows)


def _shapes():
    long_text = "y" * 100
    yield "one row", [{"sample_id": "q_0_0", "prompt": "p", "reward": 1.0}]
    yield "statuses", [{"sample_id": "q_0_0", "prompt_status": False, "reward_status": True},
                       {"sample_id": "q_0_1", "prompt": "x", "prompt_status": False},
                       {"sample_id": "q_0_2", "prompt": None, "prompt_status": None}]
    yield "nulls", {"sample_id": ["a_0_0", "b_1_2", "c_3_4"], "reward": [None, 1.0, None],
                    "done": [None, None, None], "n": [1, None, 3]}
    yield "versions", {"sample_id": ["a_0_0", "a_0_0"], "policy_version": [2, 3],
                       "finished_version": [None, 5], "reward": [1.0, 2.0]}
    yield "null version", {"sample_id": ["a_0_0", "b_0_0"], "policy_version": [None, 2]}
    yield "int32 versions", pa.table({"sample_id": ["a_0_0"],
                                      "policy_version": pa.array([1], pa.int32())})
    yield "everything", [{"sample_id": f"g{i}_{i}_{i % 3}", "prompt": "p" * (i * 10),
                          "reward": i / 3, "done": bool(i % 2), "n": i, "blob": b"\x00" * i,
                          "ids": list(range(i)), "emb": np.ones((i, 2), np.float32),
                          "note": None if i % 3 == 0 else f"n{i}", "when": None,
                          "note_status": None if i % 2 else False}
                         for i in range(16)]
    yield "17 rows", [{"sample_id": f"g{i}_0_0", "reward": float(i)} for i in range(17)]
    yield "256 rows", [{"sample_id": f"g{i % 40}_{i // 40}_{i % 7}", "prompt": "p" * (i % 90),
                        "reward": None if i % 5 == 0 else i / 7, "done": bool(i % 2),
                        "note": None if i % 3 == 0 else f"n{i}", "ids": list(range(i % 4)),
                        "reward_status": None if i % 4 else False} for i in range(256)]
    yield "257 rows", [{"sample_id": f"g{i}_0_0", "reward": float(i)} for i in range(257)]
    yield "by reference", [{"sample_id": "a_0_0", "prompt": long_text, "note": "short"},
                           {"sample_id": "b_0_0", "prompt": "short", "note": None}]
    yield "small but many bytes", [{"sample_id": f"a_0_{i}", "prompt": "z" * 40} for i in range(3)]
    chunked = pa.Table.from_batches([
        pa.record_batch({"sample_id": ["a_0_0"], "prompt": ["x"]}),
        pa.record_batch({"sample_id": ["a_0_1"], "prompt": [long_text]})])
    yield "chunked", chunked
    yield "sliced", pa.table({"sample_id": ["a_0_0", "b_0_0", "c_0_0"],
                              "prompt": ["x" * 200, "y", "z"]}).slice(1, 2)
    yield "string types", pa.table({"sample_id": pa.array(["a_0_0"], pa.string()),
                                    "prompt": pa.array(["p"], pa.string()),
                                    "blob": pa.array([b"b"], pa.binary())})
    yield "unicode", [{"sample_id": "ü_é_1_2", "prompt": "ü"}, {"sample_id": "日本_3_4"}]
    yield "underscores", [{"sample_id": "a_1_2_3"}, {"sample_id": "__x__12_999999999_0"}]
    # duplicates: merged by the general path
    yield "duplicates", [{"sample_id": "a_0_0", "prompt": "p"},
                         {"sample_id": "a_0_0", "reward": 1.0},
                         {"sample_id": "a_0_0", "prompt": None, "reward": 2.0}]
    # errors
    for bad in ["q1", "q_x_0", "_0_0", "q_0_1234567890", "q_٣_0", "q_0_0\n", "q\n_0_0",
                "x" * 600 + "_0_0", "q_0_0 ", "q__0", ""]:
        yield f"bad id {bad[:10]!r}", [{"sample_id": "ok_0_0"}, {"sample_id": bad}]
    yield "null id", {"sample_id": ["a_0_0", None]}
    yield "int ids", pa.table({"sample_id": pa.array([1], pa.int64())})
    yield "no rows", pa.table({"sample_id": pa.array([], pa.string())})
    yield "no id", [{"prompt": "p"}]
    yield "unknown column", [{"sample_id": "a_0_0", "nope": 1}]
    yield "meta column", [{"sample_id": "a_0_0", "consumed": True}]
    yield "bad type", pa.table({"sample_id": ["a_0_0"], "reward": ["x"]})
    yield "bad status type", pa.table({"sample_id": ["a_0_0"], "reward_status": ["x"]})
    yield "lossy cast", pa.table({"sample_id": ["a_0_0"], "n": pa.array([2**40], pa.int64())})
    yield "bad version", pa.table({"sample_id": ["a_0_0"], "policy_version": ["v"]})
    yield "repeated column", pa.table([pa.array(["a_0_0"]), pa.array(["b_0_0"])],
                                      names=["sample_id", "sample_id"])
    yield "not rows", ["a_0_0"]
    yield "mixed", [{"sample_id": "a_0_0", "reward": "high"}]
    yield from _refused_shapes()


def _refused_shapes():
    """Writes refused since issue #29 (item 6), each on both paths with the same error."""
    for bad in ["q1_00_0", "q1_0_01", "q_000000000_0", "q\x00_0_0", "q\t_1_2", "\x1b[31m_0_0",
                "q\x7f_0_0", "q\x85_0_0"]:
        yield f"bad id {bad[:10]!r}", [{"sample_id": "ok_0_0"}, {"sample_id": bad}]
    # conversions that change what was written, and tensors that are not tensors
    yield "int to bool", pa.table({"sample_id": ["a_0_0"], "done": pa.array([2], pa.int64())})
    yield "float to bool", pa.table({"sample_id": ["a_0_0"], "done": [0.5]})
    yield "bool to float", pa.table({"sample_id": ["a_0_0"], "reward": [True]})
    yield "bool to int", pa.table({"sample_id": ["a_0_0"], "n": [True]})
    yield "float to string", pa.table({"sample_id": ["a_0_0"], "prompt": [1.5]})
    yield "int to string", pa.table({"sample_id": ["a_0_0"], "prompt": [7]})
    yield "date to string", pa.table({"sample_id": ["a_0_0"],
                                      "prompt": pa.array([1], pa.date32())})
    yield "timestamp to string", pa.table({"sample_id": ["a_0_0"],
                                           "note": pa.array([1], pa.timestamp("s"))})
    yield "text to number", pa.table({"sample_id": ["a_0_0"], "n": ["12"]})
    yield "int to timestamp", pa.table({"sample_id": ["a_0_0"], "when": [5]})
    yield "int status", pa.table({"sample_id": ["a_0_0"], "reward_status": [1]})
    yield "fraction to int", pa.table({"sample_id": ["a_0_0"], "n": [1.5]})
    yield "bools in a list", pa.table({"sample_id": ["a_0_0"], "ids": [[True, False]]})
    yield "python bool to float", [{"sample_id": "a_0_0", "reward": True}]
    yield "python fraction to int", [{"sample_id": "a_0_0", "n": 1.5}]
    yield "python float to bool", [{"sample_id": "a_0_0", "done": 1.0}]
    yield "python bool in a list", [{"sample_id": "a_0_0", "ids": [1, True]}]
    yield "tensor of bools", pa.table({"sample_id": ["a_0_0"], "emb": _tensors(
        [[2]], [[True, False]], pa.bool_())})
    for label, shape, values in [("shape and data disagree", [2, 3], 5),
                                 ("negative dimension", [-2, -3], 6),
                                 ("absurd dimension", [0, 2**40], 0),
                                 ("too many dimensions", [1] * 40, 1),
                                 ("product past int64", [2**31 - 1] * 4, 3)]:
        yield f"tensor: {label}", pa.table({"sample_id": ["a_0_0", "b_0_0"], "emb": _tensors(
            [[2], shape], [[0.0, 1.0], [0.5] * values], pa.float32())})
    yield "tensor: null shape", pa.table({"sample_id": ["a_0_0"], "emb": _tensors(
        [None], [[1.0]], pa.float32())})
    yield "python tensor of bools", [{"sample_id": "a_0_0", "emb": np.ones((2,), bool)}]


def _tensors(shapes, datas, element):
    """A tensor column built from raw shapes and data (which need not agree)."""
    return pa.StructArray.from_arrays(
        [pa.array(shapes, pa.list_(pa.int64())), pa.array(datas, pa.large_list(element))],
        names=["shape", "data"])


@pytest.mark.parametrize("label, data", list(_shapes()), ids=[lbl for lbl, _ in _shapes()])
def test_prepare_fast_path_matches_the_general_path(label, data):
    fast, fast_error = _run(data, fast=True)
    slow, slow_error = _run(data, fast=False)
    assert fast_error == slow_error
    if slow is not None:
        _same(fast, slow)
        table = prepare.to_arrow_table(TDEF, data)
        if table.num_rows <= prepare.FAST_PREPARE_ROWS:
            taken = prepare._prepare_small(TDEF, table, table.column_names, 3, 64) is not None
            assert taken == (label not in ("null version", "duplicates"))


@pytest.mark.parametrize("label, data", list(_refused_shapes()),
                         ids=[lbl for lbl, _ in _refused_shapes()])
def test_values_that_would_change_or_clash_are_refused(label, data):
    """Both paths refuse them with the same invalid_argument (or schema_mismatch) error, naming
    the column or sample id and what was expected."""
    from store.errors import InvalidArgument
    for fast in (True, False):
        done, error = _run(data, fast=fast)
        assert done is None and error is not None, f"{label}: accepted"
        kind, message = error
        assert issubclass(kind, InvalidArgument), (label, error)
        assert "sample_id" in message or "column" in message, message
        assert "expected" in message or "send" in message, message


def test_prepare_fast_path_is_taken(monkeypatch):
    calls = []
    monkeypatch.setattr(prepare, "_split", lambda *a: calls.append(a))
    p = prepare.prepare_put(TDEF, [{"sample_id": "a_0_0", "prompt": "x", "reward": 1.0}], 0, 64)
    assert p.rows == 1 and not calls                     # no compute kernels, no _split


# -- wide rows: every value by reference ----------------------------------------------------------

@pytest.mark.parametrize("sliced", [False, True])
def test_split_of_all_big_values_matches_the_take_path(sliced):
    from store.blob_chunks import serialize_chunk_buffer
    values = pa.array([["x" * 50] * 3, ["y" * 70], ["z"] * 40, ["w"] * 90], pa.large_list(
        pa.large_string()))
    if sliced:
        values = values.slice(1, 3)
    inline, ref_index, chunk = prepare._split("c", values, "auto", 4)
    n = len(values)
    assert inline.type == values.type and inline.null_count == n
    assert ref_index.equals(pa.array(np.arange(n, dtype=np.int64)))
    assert chunk.equals(serialize_chunk_buffer(values.take(pa.array(np.arange(n), pa.int64()))))


@pytest.mark.parametrize("sliced", [False, True])
def test_wide_rows_round_trip(open_store, sliced):
    s = open_store()
    s.create_table("w", {"text": "string", "ids": "list<int32>"})
    n = 40
    table = pa.table({
        "sample_id": [f"w{i}_0_{i % 8}" for i in range(n)],
        "text": [chr(65 + i % 26) * (3000 + i) for i in range(n)],
        "ids": [list(range(i, i + 500)) for i in range(n)],
    })
    if sliced:
        table = table.slice(5, 30)
    s.put("w", table)
    got = s.claim("w", 100).data
    want = {sid: (t, ids) for sid, t, ids in zip(table.column("sample_id").to_pylist(),
                                                 table.column("text").to_pylist(),
                                                 table.column("ids").to_pylist())}
    assert len(got) == len(want)
    for sid, t, ids in zip(got.column("sample_id").to_pylist(), got.column("text").to_pylist(),
                           got.column("ids").to_pylist()):
        assert want[sid] == (t, ids)
    refs = s.query("SELECT count(text__ref) AS t, count(ids__ref) AS i FROM w").to_pylist()
    assert refs == [{"t": len(want), "i": len(want)}]            # all stored by reference


def test_group_numbers_from_arrow_match_numbering_row_by_row():
    """A bulk put's groups are numbered in the order they first appear: by dictionary-encoding
    the input ids when the rows share a version, by a dict row by row when they do not; both
    number the same rows the same way."""
    iids = ["b", "a", "b", "c", "a", "ä", "c", "b"]
    one = pa.table({"policy_version": pa.array([3] * 8, pa.int64()),
                    "input_id": pa.chunked_array([iids[:3], iids[3:]], pa.large_string())})
    codes, groups = store.rows_sql._group_codes(one)
    assert codes.tolist() == [0, 1, 0, 2, 1, 3, 2, 0]
    assert groups == [(3, "b"), (3, "a"), (3, "c"), (3, "ä")]
    versions = [3, 3, 4, 3, 3, 4, 3, 4]
    mixed = pa.table({"policy_version": pa.array(versions, pa.int64()),
                      "input_id": pa.array(iids, pa.large_string())})
    codes, groups = store.rows_sql._group_codes(mixed)
    assert codes.tolist() == [0, 1, 2, 3, 1, 4, 3, 2]
    assert groups == [(3, "b"), (3, "a"), (4, "b"), (3, "c"), (4, "ä")]


def test_a_block_with_two_versions_is_claimed_by_version_then_input_id(open_store):
    s = open_store()
    s.create_table("t", COLUMNS, max_staleness=2)
    s.bump_version("t")
    rows = [{**_full(f"q{i}_0_{t}", float(t)), "policy_version": v}
            for v in (1, 0) for i in (1, 0) for t in (1, 0)]
    s.put("t", rows)
    assert _blocked(s) == 8
    got = s.claim("t", 8).data
    assert list(zip(got.column("policy_version").to_pylist(),
                    got.column("sample_id").to_pylist())) == [
        (v, f"q{i}_0_{t}") for v in (0, 1) for i in (0, 1) for t in (0, 1)]
    assert _blocked(s) == 0


def test_a_predicate_claim_leaves_the_backlog_it_did_not_need_unbuilt(open_store):
    """Rows a bulk put made ready stay in its block until something reads them; a claim with a
    predicate that the first rows satisfy reads a few hundred rows, not the whole backlog."""
    s = open_store()
    s.create_table("t", {"reward": "float64"})
    s.put("t", {"sample_id": [f"q{i}_0_{t}" for i in range(5000) for t in range(4)],
                "reward": [1.0] * 20000})
    claim = s.claim("t", 16, where="reward > 0.5")
    assert claim.num_rows == 16
    assert _blocked(s) > 19000
    assert s.claim("t", 16, where="reward > 2").num_rows == 0   # no match: all rows read
    assert _blocked(s) == 0


def _counts_match_the_index(s, table="t"):
    """The live table's counters agree with the rows it holds (what stats and gauges report)."""
    live = s._index.live[table]
    rows = [r for r in live.rows.values() if type(r) is store.live.Row]
    blocked = len(live.rows) - len(rows)
    assert live.leased_count == sum(r.state == store.live.LEASED for r in rows)
    assert live.ready_count == blocked + sum(r.state == store.live.READY for r in rows)
    assert all((r.lease is not None) == (r.state == store.live.LEASED) for r in rows)


def test_a_claim_of_part_of_a_block_leaves_the_rest_ready_in_order(open_store):
    """A claim builds a block's group leased and files only what it leaves as ready; a claim
    that falls short of its min_rows (here: of a second table) gives back what it took, its
    delivery not counted, and the rows come back in claim order."""
    from store.claims import ClaimRequest
    s = open_store()
    s.create_table("t", COLUMNS)
    s.create_table("u", COLUMNS)
    s.put("t", [_full(f"q{i}_0_{t}") for i in range(2) for t in range(8)])
    assert _blocked(s) == 16
    first = s.claim("t", 3)
    assert first.data.column("sample_id").to_pylist() == ["q0_0_0", "q0_0_1", "q0_0_2"]
    assert _state(s)["ready"] == 13 and _state(s)["processing"] == 3
    _counts_match_the_index(s)
    short = s.claim_many([ClaimRequest("t", 10), ClaimRequest("u", 1, min_rows=1)])
    assert not short and _state(s)["ready"] == 13 and _state(s)["processing"] == 3
    _counts_match_the_index(s)
    assert not s.claim("t", 16, group_by="input_id", group_size=8, min_rows=16)
    _counts_match_the_index(s)
    rest = s.claim("t", 16)
    assert rest.data.column("sample_id").to_pylist() == (
        [f"q0_0_{t}" for t in range(3, 8)] + [f"q1_0_{t}" for t in range(8)])
    assert rest.data.column("delivery_count").to_pylist() == [1] * 13
    _counts_match_the_index(s)
    s.ack(first.claim_id)
    s.nack(rest.claim_id)
    assert _state(s) == {"pending": 0, "ready": 13, "processing": 0, "consumed": 3, "stale": 0,
                         "dead": 0}
    _counts_match_the_index(s)
    again = s.claim("t", 16, group_by="input_id", group_size=8)
    assert again.data.column("sample_id").to_pylist() == [f"q1_0_{t}" for t in range(8)]
    assert again.data.column("delivery_count").to_pylist() == [2] * 8
    _counts_match_the_index(s)


def test_a_group_claim_takes_whole_groups_of_a_block_and_leaves_the_rest(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_full(f"q0_0_{t}") for t in range(8)] + [_full(f"q1_0_{t}") for t in range(4)]
          + [_full(f"q2_0_{t}") for t in range(8)])
    claim = s.claim("t", 16, group_by="input_id", group_size=8)
    assert claim.data.column("sample_id").to_pylist() == (
        [f"q0_0_{t}" for t in range(8)] + [f"q2_0_{t}" for t in range(8)])
    assert _state(s)["ready"] == 4 and _state(s)["processing"] == 16
    _counts_match_the_index(s)
    assert s.ack(claim.claim_id)["acked"] == 16
    _counts_match_the_index(s)
    assert s.claim("t", 8).data.column("sample_id").to_pylist() == [f"q1_0_{t}" for t in range(4)]
    _counts_match_the_index(s)


def _model_claim(groups, limit, group_size):
    """What a claim takes from ``groups`` (group key -> its ready sample ids in claim order,
    removed as taken): groups in key order, each's first rows (whole groups of ``group_size``),
    until the claim is full."""
    chosen = []
    for key in sorted(groups):
        room = limit - len(chosen)
        rows = groups[key]
        n = min(len(rows), room) // group_size * group_size if group_size else \
            min(len(rows), room)
        chosen += rows[:n]
        del rows[:n]
        if not rows:
            del groups[key]
        if len(chosen) + (group_size or 1) > limit:
            break
    return chosen


@pytest.mark.parametrize("seed", range(6))
def test_claims_of_many_groups_of_blocks_take_what_the_group_order_says(open_store, seed):
    """A claim takes consecutive groups of one block in one pass: groups of several blocks
    interleaved in claim order, groups numbered in a block out of claim order, groups split
    over blocks and groups shorter than the group size all come back as the group order
    says, claim after claim."""
    import random
    rng = random.Random(seed)
    s = open_store()
    s.create_table("t", COLUMNS)
    groups, written = {}, set()
    for _ in range(4):                         # bulk puts (blocks) of new rows
        names = rng.sample(range(30), rng.randint(3, 12))
        rows = [(f"q{i}", turn, traj) for i in names
                for turn in range(rng.randint(1, 2)) for traj in range(rng.randint(1, 6))
                if (f"q{i}", turn, traj) not in written]
        written.update(rows)
        rng.shuffle(rows)
        if not rows:
            continue
        s.put("t", [_full(f"{q}_{turn}_{traj}") for q, turn, traj in rows])
        for q, turn, traj in rows:
            groups.setdefault(q, []).append((turn, traj))
    groups = {(0, q): [f"{q}_{t}_{j}" for t, j in sorted(rows)] for q, rows in groups.items()}
    while groups:
        limit = rng.choice([1, 3, 8, 16, 40])
        group_size = rng.choice([None, None, 2, 4, 8])
        if group_size and group_size > limit:
            group_size = None
        expected = _model_claim(groups, limit, group_size)
        got = s.claim("t", limit, **({"group_by": "input_id", "group_size": group_size}
                                     if group_size else {}))
        assert got.data.column("sample_id").to_pylist() == expected, (limit, group_size)
        _counts_match_the_index(s)
