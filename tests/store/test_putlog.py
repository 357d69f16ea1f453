"""The put log: small fresh puts are durable in ``<db>.putlog`` before DuckDB holds them.

What must hold: an acknowledged put survives a kill -9 before its rows reach DuckDB; every read
(SQL, stats, claim predicates) sees every acknowledged put; rows the log and DuckDB both hold
are not inserted twice; a torn tail is dropped; writes that are not all-new, DDL and updates of
logged rows go through DuckDB in order.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pytest

import store
from conftest import SLOW_INSERTS
from waiting import wait_until
from store.errors import StaleVersion
from store.putlog import PutLog, Record, ack_record, log_path, read_records
from store import checkpoints
from store.settings import StoreSettings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = {"prompt": "string", "response": "string", "reward": "float64"}


def _row(i: int, **extra: object) -> dict:
    return {"sample_id": f"q{i}_0_0", "prompt": f"p{i}", "response": f"r{i}",
            "reward": float(i), **extra}



def test_a_one_row_put_is_logged_then_inserted(db_path, slow_inserts):
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    # Acknowledged, durable in the log, not yet in DuckDB.
    assert s._writer.logged_rows == 1
    assert os.path.getsize(log_path(db_path)) > 0
    assert [(k, h) for k, h, _ in read_records(log_path(db_path))] == [("rows", {"table": "t"})]
    # A read inserts it first: SQL sees every acknowledged put.
    got = s.query("SELECT sample_id, prompt, response, reward, reward_status, input_id, turn, "
                  "trajectory_id, finished_version, created_at IS NOT NULL AS stamped FROM t")
    assert got.to_pylist() == [{"sample_id": "q1_0_0", "prompt": "p1", "response": "r1",
                                "reward": 1.0, "reward_status": True, "input_id": "q1",
                                "turn": 0, "trajectory_id": 0, "finished_version": 0,
                                "stamped": True}]
    assert s._writer.logged_rows == 0
    assert os.path.getsize(log_path(db_path)) == 0


def test_logged_rows_reach_duckdb_without_a_read(open_store, db_path):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    wait_until(lambda: s._writer.logged_rows == 0, timeout=StoreSettings().materialize_delay * 50)
    assert os.path.getsize(log_path(db_path)) == 0


def test_logged_rows_are_claimed_and_acked(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    for i in range(5):
        s.put("t", [_row(i)])
    claim = s.claim("t", 16)
    assert sorted(claim.data.column("sample_id").to_pylist()) == [f"q{i}_0_0" for i in range(5)]
    assert claim.data.column("response").to_pylist() == [f"r{i}" for i in range(5)]
    assert s.ack(claim.claim_id)["acked"] == 5
    assert s.query("SELECT count(*) AS n FROM t WHERE consumed").column("n").to_pylist() == [5]
    assert s.stats("t")["t"]["consumed"] == 5


def test_stats_and_claim_predicates_see_logged_rows(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1), _row(2)])
    st = s.stats("t")["t"]
    assert (st["rows"], st["ready"], st["pending"]) == (2, 2, 0)
    s.put("t", [_row(3)])
    claim = s.claim("t", 16, where="reward >= 2")
    assert sorted(claim.data.column("sample_id").to_pylist()) == ["q2_0_0", "q3_0_0"]


def test_a_partial_write_of_a_logged_row_updates_it(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [{"sample_id": "q1_0_0", "prompt": "first"}])  # new, not ready: logged
    s.put("t", [{"sample_id": "q1_0_0", "response": "then", "reward": 0.5}])  # an update
    claim = s.claim("t", 4)
    assert claim.data.select(["prompt", "response", "reward"]).to_pylist() == [
        {"prompt": "first", "response": "then", "reward": 0.5}]
    got = s.query("SELECT prompt, response, prompt_status, response_status FROM t")
    assert got.to_pylist() == [{"prompt": "first", "response": "then", "prompt_status": True,
                                "response_status": True}]


def test_a_resent_put_of_a_logged_row_is_harmless(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    s.put("t", [_row(1)])  # at-least-once producer: same key, goes through DuckDB
    assert s.query("SELECT count(*) AS n FROM t").column("n").to_pylist() == [1]


def test_drop_and_recreate_with_logged_rows(open_store, db_path):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    s.drop_table("t")
    s.create_table("t", COLUMNS)
    assert s.query("SELECT count(*) AS n FROM t").column("n").to_pylist() == [0]
    s.close()
    s = open_store()
    assert s.query("SELECT count(*) AS n FROM t").column("n").to_pylist() == [0]


def test_a_bad_put_in_a_group_fails_alone(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    futures = [s.put_async("t", [_row(i)]) for i in range(3)]
    bad = s.put_async("t", [{"sample_id": "q9_0_0", "policy_version": 7, "prompt": "x"}])
    futures += [s.put_async("t", [_row(i)]) for i in range(3, 6)]
    for f in futures:
        f.result(10)
    with pytest.raises(StaleVersion, match="version"):
        bad.result(10)
    assert s.query("SELECT count(*) AS n FROM t").column("n").to_pylist() == [6]


CHILD = textwrap.dedent("""
    import os, signal, sys
    import store
    s = store.connect(sys.argv[1], materialize_delay=3600.0)  # rows still logged when killed
    s.create_table("t", {"prompt": "string", "response": "string", "reward": "float64"})
    pad = "x" * int(sys.argv[3])  # 4,000: the response goes to the blob store
    for i in range(int(sys.argv[2])):
        s.put("t", [{"sample_id": f"q{i}_0_0", "prompt": f"p{i}", "response": f"r{i}" + pad,
                     "reward": float(i)}])
    assert s._writer.logged_rows > 0, "the rows should still wait in the put log"
    print("PUT", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("pad", [0, 4000], ids=["by-value", "blob"])
def test_kill_9_before_insert_loses_no_acknowledged_put(open_store, db_path, pad):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-c", CHILD, db_path, "20", str(pad)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.strip() == "PUT"
    assert len(list(read_records(log_path(db_path)))) >= 1
    s = open_store()
    got = s.query("SELECT sample_id, response, response__ref FROM t ORDER BY reward")
    assert got.select(["sample_id", "response"]).to_pylist() == [
        {"sample_id": f"q{i}_0_0", "response": f"r{i}" + "x" * pad} for i in range(20)]
    by_ref = s.query("SELECT count(*) FILTER (WHERE response__ref IS NOT NULL) AS n FROM t")
    assert by_ref.column("n").to_pylist() == [0 if pad == 0 else 20]
    assert os.path.getsize(log_path(db_path)) == 0
    assert s.stats("t")["t"]["ready"] == 20
    claim = s.claim("t", 32)
    assert sorted(claim.data.column("response").to_pylist()) == sorted(
        f"r{i}" + "x" * pad for i in range(20))
    s.put("t", [_row(20)])  # row ids go on after the replayed ones
    assert s.query("SELECT count(DISTINCT row_id) AS n FROM t").column("n").to_pylist() == [21]


def _logged_records(db_path: str) -> list[Record]:
    return list(read_records(log_path(db_path)))


def _as_sample(rows: pa.Table, i: int, row_id: int) -> pa.Table:
    """A logged one-row record made into sample ``q{i}_0_0`` with row id ``row_id``."""
    for name, value in (("row_id", pa.array([row_id], pa.int64())),
                        ("sample_id", pa.array([f"q{i}_0_0"])), ("input_id", pa.array([f"q{i}"]))):
        at = rows.schema.get_field_index(name)
        rows = rows.set_column(at, name, value.cast(rows.schema.field(at).type))
    return rows


def _append(db_path: str, records: list[Record]) -> None:
    log = PutLog(log_path(db_path))
    try:
        log.append(records)
    finally:
        log.close()


def test_replay_skips_rows_duckdb_already_has(db_path, slow_inserts):
    """A crash after the COMMIT that inserted logged rows but before the log was cut back."""
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    records = _logged_records(db_path)
    s.query("SELECT 1")  # inserts them
    s.close()
    _append(db_path, records)
    s = slow_inserts()
    assert s.query("SELECT count(*) AS n FROM t").column("n").to_pylist() == [1]
    assert os.path.getsize(log_path(db_path)) == 0


def _one_row_record(open_store, db_path: str) -> Record:
    """The record of a put of q1 (which the close then applies): a template for others."""
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    (record,) = _logged_records(db_path)
    s.close()
    return record


def test_replay_keeps_whole_records_and_drops_a_torn_tail(db_path, slow_inserts):
    kind, header, rows = _one_row_record(slow_inserts, db_path)
    # One whole record (q5), then half of another (q6): a crash in the middle of its write,
    # so q6 was never acknowledged.
    _append(db_path, [(kind, header, _as_sample(rows, 5, 100))])
    whole = os.path.getsize(log_path(db_path))
    _append(db_path, [(kind, header, _as_sample(rows, 6, 101))])
    with open(log_path(db_path), "r+b") as f:
        f.truncate(whole + (os.path.getsize(log_path(db_path)) - whole) // 2)
    assert [r.column("sample_id").to_pylist() for _, _, r in _logged_records(db_path)] == [
        ["q5_0_0"]]
    s = slow_inserts()
    assert sorted(s.query("SELECT sample_id FROM t").column(0).to_pylist()) == [
        "q1_0_0", "q5_0_0"]
    assert s.stats("t")["t"]["ready"] == 2


def test_a_log_record_of_a_dropped_table_is_ignored(db_path, slow_inserts):
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    records = _logged_records(db_path)
    s.drop_table("t")
    s.close()
    _append(db_path, records)
    s = slow_inserts()
    assert s.list_tables() == []
    assert os.path.getsize(log_path(db_path)) == 0


def test_a_damaged_record_is_not_replayed(db_path, slow_inserts):
    kind, header, rows = _one_row_record(slow_inserts, db_path)
    _append(db_path, [(kind, header, _as_sample(rows, 7, 100))])
    raw = bytearray(open(log_path(db_path), "rb").read())
    raw[-5] ^= 0xFF  # a flipped bit in the body: the digest no longer matches
    open(log_path(db_path), "wb").write(raw)
    assert _logged_records(db_path) == []
    s = slow_inserts()
    assert s.query("SELECT sample_id FROM t").column(0).to_pylist() == ["q1_0_0"]


def test_through_the_server_sql_and_subscriptions_see_logged_puts(tmp_path, slow_inserts):
    from flight_fixtures import running_server

    with running_server(tmp_path / "s.duckdb", **SLOW_INSERTS) as srv:
        uri = f"grpc://127.0.0.1:{srv.port}"
        with store.connect(uri) as producer, store.connect(uri) as trainer:
            producer.create_table("t", COLUMNS)
            sub = trainer.subscribe("t", micro_batch_size=2, global_batch_size=4)
            for i in range(4):
                producer.put("t", [_row(i)])
            logged = srv.store._writer._logged.records  # acknowledged from the log
            assert sum(r.num_rows for kind, _, r in logged if kind == "rows") == 4
            got = producer.query("SELECT count(*) AS n, sum(reward) AS r FROM t")
            assert got.to_pylist() == [{"n": 4, "r": 6.0}]
            batches = [sub.next(timeout=10) for _ in range(2)]
            assert sorted(s for b in batches for s in b.data.column("sample_id").to_pylist()) \
                == [f"q{i}_0_0" for i in range(4)]
            for b in batches:
                b.ack()
            assert batches[-1].is_boundary
            sub.close()


# -- acks and bumps ---------------------------------------------------------------------------
def test_acks_and_bumps_are_logged_and_sql_sees_them(db_path, slow_inserts):
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    for i in range(6):
        s.put("t", [_row(i)])
    claim = s.claim("t", 4)
    s.query("SELECT 1")  # inserts the rows: what follows is logged on its own
    assert s.ack(claim.claim_id)["acked"] == 4
    assert s.bump_version("t", weights_uri="file:///w/1") == 1
    assert [k for k, _, _ in _logged_records(db_path)] == ["ack", "bump"]
    got = s.query("SELECT count(*) FILTER (WHERE consumed) AS consumed, "
                  "count(*) FILTER (WHERE stale) AS stale, "
                  "max(consumed_version) AS v, max(delivery_count) AS d FROM t")
    assert got.to_pylist() == [{"consumed": 4, "stale": 2, "v": 0, "d": 1}]
    history = s.query("SELECT version, weights_uri FROM _expstore_versions ORDER BY version")
    assert history.to_pylist() == [{"version": 0, "weights_uri": None},
                                   {"version": 1, "weights_uri": "file:///w/1"}]
    assert s._writer.logged_rows == 0


def test_a_nack_after_logged_changes_keeps_their_order(slow_inserts):
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])  # logged
    claim = s.claim("t", 4)
    s.nack(claim.claim_id)  # through DuckDB: the logged row goes in first
    again = s.claim("t", 4)
    assert again.data.column("delivery_count").to_pylist() == [2]
    s.ack(again.claim_id)
    got = s.query("SELECT consumed, delivery_count FROM t")
    assert got.to_pylist() == [{"consumed": True, "delivery_count": 2}]


CHILD_ACKS = textwrap.dedent("""
    import os, signal, sys
    import store
    s = store.connect(sys.argv[1], materialize_delay=3600.0)  # changes still logged when killed
    s.create_table("t", {"prompt": "string", "reward": "float64"})
    for i in range(10):
        s.put("t", [{"sample_id": f"q{i}_0_0", "prompt": f"p{i}", "reward": float(i)}])
    s.query("SELECT 1")
    claim = s.claim("t", 6)
    s.ack(claim.claim_id)
    s.bump_version("t", weights_uri="file:///w/1")
    kinds = [r[0] for r in s._writer._logged.records]
    assert kinds == ["ack", "bump"], kinds
    print("DONE", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_kill_9_loses_no_logged_ack_or_bump(open_store, db_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-c", CHILD_ACKS, db_path], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.strip() == "DONE"
    s = open_store()
    assert s.get_version("t") == 1
    assert s.weights_uri("t") == "file:///w/1"
    st = s.stats("t")["t"]
    assert (st["consumed"], st["stale"], st["ready"]) == (6, 4, 0)
    assert s.claim("t", 16).data.num_rows == 0  # nothing of version 0 is handed out again
    got = s.query("SELECT count(*) AS n FROM t WHERE consumed AND lease_id IS NOT NULL "
                  "AND consumed_version = 0")
    assert got.column("n").to_pylist() == [6]


def test_replaying_acks_and_bumps_twice_changes_nothing(db_path, slow_inserts):
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    for i in range(3):
        s.put("t", [_row(i)])
    s.query("SELECT 1")
    claim = s.claim("t", 2)
    s.ack(claim.claim_id)
    s.bump_version("t")
    records = _logged_records(db_path)
    before = s.query("SELECT sample_id, consumed, stale, delivery_count, consumed_version "
                     "FROM t ORDER BY sample_id").to_pylist()
    s.close()
    _append(db_path, records)  # as if the log had not been cut back after their COMMIT
    s = slow_inserts()
    assert s.query("SELECT sample_id, consumed, stale, delivery_count, consumed_version "
                   "FROM t ORDER BY sample_id").to_pylist() == before
    assert s.query("SELECT count(*) AS n FROM _expstore_versions").column(0).to_pylist() == [2]
    assert s.get_version("t") == 1


def _row_ids(s) -> dict[str, int]:
    got = s.query("SELECT sample_id, row_id FROM t").to_pydict()
    return dict(zip(got["sample_id"], got["row_id"]))


def test_an_ack_is_logged_as_lists_in_its_header(db_path, slow_inserts):
    """An ack's record carries the rows it consumes as lists in its JSON header and has no
    body: no Arrow table is built and serialised per ack."""
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    for i in range(3):
        s.put("t", [_row(i)])
    ids = _row_ids(s)  # (the read inserts the rows: the ack is logged on its own)
    claim = s.claim("t", 2, consumer="trainer-1")
    s.ack(claim.claim_id)
    ((kind, header, body),) = _logged_records(db_path)
    assert (kind, body) == ("ack", None)
    at = header.pop("updated_at")
    assert isinstance(at, int) and at > 0
    assert header == {"table": "t", "row_id": [ids["q0_0_0"], ids["q1_0_0"]],
                      "delivery_count": [1, 1], "consumed_version": 0,
                      "lease_id": claim.claim_id, "lease_owner": "trainer-1"}


def test_acks_logged_as_rows_by_an_earlier_version_still_replay(db_path, slow_inserts):
    """A put log left by a crash of an earlier version holds an ack's rows as an Arrow body;
    it replays beside acks logged as header lists, each row consumed as its record says."""
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    for i in range(3):
        s.put("t", [_row(i)])
    ids = _row_ids(s)
    s.close()
    old = pa.table({"row_id": pa.array([ids["q0_0_0"], ids["q1_0_0"]], pa.int64()),
                    "delivery_count": pa.array([1, 2], pa.int32()),
                    "consumed_version": pa.array([0, 0], pa.int64()),
                    "lease_id": pa.array(["c-old", "c-old"]),
                    "lease_owner": pa.array(["old", "old"]),
                    "updated_at": pa.array([1_700_000_000_000_000] * 2,
                                           pa.timestamp("us", "UTC"))})
    _append(db_path, [("ack", {"table": "t"}, old),
                      ack_record("t", [ids["q2_0_0"]], [3], 0, "c-new", "new")])
    s = slow_inserts()
    got = s.query("SELECT sample_id, consumed, delivery_count, lease_id, lease_owner FROM t "
                  "ORDER BY sample_id").to_pylist()
    assert got == [
        {"sample_id": "q0_0_0", "consumed": True, "delivery_count": 1, "lease_id": "c-old",
         "lease_owner": "old"},
        {"sample_id": "q1_0_0", "consumed": True, "delivery_count": 2, "lease_id": "c-old",
         "lease_owner": "old"},
        {"sample_id": "q2_0_0", "consumed": True, "delivery_count": 3, "lease_id": "c-new",
         "lease_owner": "new"}]
    assert s.stats("t")["t"]["ready"] == 0


def test_logged_changes_of_one_row_apply_in_log_order(db_path, slow_inserts):
    """Records are applied one statement per kind and table: the last lease of a row wins, and
    acks interleaved with puts land on the rows the puts inserted."""
    s = slow_inserts(lease_flush_delay=0.0)  # every lease's bookkeeping is logged at once
    s.create_table("t", COLUMNS, lease_seconds=60.0)
    s.put("t", [_row(0)])
    first = s.claim("t", 1, lease_seconds=0.2)
    s.put("t", [_row(1)])
    wait_until(lambda: not s.leases("t"), timeout=10)  # expired: q0 is ready again
    second = s.claim("t", 2)
    assert second.data.column("sample_id").to_pylist() == ["q0_0_0", "q1_0_0"]
    s.put("t", [_row(2)])
    for i in range(3, 9):  # puts and acks alternating
        s.put("t", [_row(i)])
        s.ack(s.claim("t", 1).claim_id)
    kinds = [k for k, _, _ in _logged_records(db_path)]
    assert kinds.count("leases") >= 2 and kinds.count("ack") == 6 and kinds.count("rows") == 9
    got = s.query("SELECT sample_id, is_processing, lease_id, delivery_count, consumed FROM t "
                  "WHERE NOT consumed ORDER BY sample_id").to_pylist()
    assert got == [
        {"sample_id": "q0_0_0", "is_processing": True, "lease_id": second.claim_id,
         "delivery_count": 2, "consumed": False},
        {"sample_id": "q1_0_0", "is_processing": True, "lease_id": second.claim_id,
         "delivery_count": 1, "consumed": False},
        {"sample_id": "q8_0_0", "is_processing": False, "lease_id": None, "delivery_count": 0,
         "consumed": False}]  # the claims in the loop took q2..q7 in order
    assert first.claim_id != second.claim_id
    assert s.query("SELECT count(*) AS n FROM t WHERE consumed").column(0).to_pylist() == [6]


def test_a_claim_acked_before_its_bookkeeping_is_due_never_writes_it(db_path, slow_inserts):
    """Groups that commit before a claim's lease bookkeeping is due leave it waiting; the ack
    supersedes it, so a claim acked in time costs the log one ack record and no lease record."""
    s = slow_inserts(lease_flush_delay=60.0)
    s.create_table("t", COLUMNS)
    for i in range(3):
        s.put("t", [_row(i)])
    acked = s.claim("t", 1)
    s.put("t", [_row(3)])                  # commits before the bookkeeping is due
    s.ack(acked.claim_id)
    held = s.claim("t", 1)
    s.put("t", [_row(4)])
    kinds = [k for k, _, _ in _logged_records(db_path)]
    assert kinds.count("leases") == 0 and kinds.count("ack") == 1 and kinds.count("rows") == 5
    assert s.query("SELECT sample_id, lease_id, delivery_count, consumed FROM t WHERE "
                   "delivery_count > 0").to_pylist() == [
        {"sample_id": "q0_0_0", "lease_id": acked.claim_id, "delivery_count": 1,
         "consumed": True}]
    assert [r["claim_id"] for r in s.leases("t")] == [held.claim_id]


def test_a_replayed_old_bump_never_takes_the_version_back(db_path, slow_inserts):
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    s.bump_version("t")
    old = _logged_records(db_path)
    s.query("SELECT 1")
    s.bump_version("t")
    s.close()
    _append(db_path, old)  # a cut that did not survive, records of version 1 found again
    s = slow_inserts()
    assert s.get_version("t") == 2
    assert s.query("SELECT version FROM _expstore_groups").column(0).to_pylist() == [2]


def test_a_cut_is_durable_before_another_commit(db_path, slow_inserts):
    s = slow_inserts()
    s.create_table("t", COLUMNS)
    s.put("t", [_row(1)])
    s.query("SELECT 1")  # applies the record, cuts the log
    assert os.path.getsize(log_path(db_path)) == 0
    assert s._writer._logged.putlog._cut_unsynced
    claim = s.claim("t", 1)
    s.nack(claim.claim_id)  # a DuckDB commit: the cut is made durable first
    assert not s._writer._logged.putlog._cut_unsynced


def test_puts_acks_and_bumps_do_not_wait_for_an_idle_checkpoint(tmp_path, monkeypatch):
    """The checkpoint an idle writer starts runs on a thread of its own: a put, an ack and a bump
    arriving meanwhile are logged and answered while it runs; SQL (a DuckDB transaction of the
    writer first) waits for it and sees everything."""
    entered, release = threading.Event(), threading.Event()
    real = checkpoints._checkpoint

    def held(cursor):
        entered.set()
        assert release.wait(30), "the test never let the checkpoint finish"
        return real(cursor)

    monkeypatch.setattr(checkpoints, "_checkpoint", held)
    s = store.connect(str(tmp_path / "x.duckdb"), checkpoint_idle_seconds=0.05)
    try:
        s.create_table("t", COLUMNS, max_staleness=0)
        s.put("t", [_row(i) for i in range(3)])
        assert entered.wait(20), "the idle writer did not start a checkpoint"
        claim = s.claim("t", 2)
        # Each is answered from the log while the checkpoint is held (a TimeoutError otherwise).
        assert s.put_async("t", [_row(10)]).result(10)["rows"] == 1
        assert s.ack_async(claim.claim_id).result(10)["acked"] == 2
        bumped: list[int] = []
        bump = threading.Thread(target=lambda: bumped.append(s.bump_version("t")))
        bump.start()
        bump.join(10)
        assert bumped == [1] and not release.is_set()
        release.set()
        rows = s.query("SELECT sample_id, consumed, stale FROM t").to_pylist()
        acked = set(claim.data.column("sample_id").to_pylist())
        assert {(r["sample_id"], r["consumed"], r["stale"]) for r in rows} == {
            (sid, sid in acked, sid not in acked) for sid in ("q0_0_0", "q1_0_0", "q2_0_0",
                                                              "q10_0_0")}
    finally:
        release.set()
        s.close()
