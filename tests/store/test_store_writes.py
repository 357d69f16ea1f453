"""Writes: sample ids, upserts of partial rows, status columns, idempotent re-sends, versions."""
from __future__ import annotations

import pyarrow as pa
import pytest

from store import format_sample_id, parse_sample_id
from store.errors import InvalidArgument, SchemaMismatch, StaleVersion

COLUMNS = {"prompt": "string", "response": "string", "reward": "float64"}
# Everything except the timestamp a re-send is allowed to touch.
SNAPSHOT = "SELECT * EXCLUDE (updated_at) FROM t ORDER BY sample_id, policy_version"


def _state(s, table="t"):
    st = s.stats(table)[table]
    return {k: st[k] for k in ("pending", "ready", "processing", "consumed", "stale", "dead")}


# -- sample ids --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, input_id, turn, traj", [
    ("q1_0_0", "q1", 0, 0),
    ("gsm8k_17_2_5", "gsm8k_17", 2, 5),
    ("a_b_c_d_3_4", "a_b_c_d", 3, 4),
    ("__x__12_999999999_0", "__x__12", 999999999, 0),
    ("ü_1_2", "ü", 1, 2),
])
def test_parse_sample_id(text, input_id, turn, traj):
    sid = parse_sample_id(text)
    assert (sid.input_id, sid.turn, sid.trajectory_id) == (input_id, turn, traj)
    assert str(sid) == text
    assert format_sample_id(input_id, turn, traj) == text


MALFORMED = ["q1", "q1_0", "_0_0", "q_x_0", "q_0_y", "q_-1_0", "q_0_1234567890", "q_0_0 ",
             "q__0", "q_0_", "q_1.5_0", "x" * 600 + "_0_0", "q_٣_0"]


@pytest.mark.parametrize("bad", MALFORMED)
def test_parse_sample_id_refuses_malformed(bad):
    with pytest.raises(InvalidArgument) as err:
        parse_sample_id(bad)
    assert repr(bad[:80]) in str(err.value)


@pytest.mark.parametrize("bad", [None, 17, b"q_0_0"])
def test_parse_sample_id_refuses_non_strings(bad):
    with pytest.raises(InvalidArgument, match=repr(bad).replace("(", r"\(")):
        parse_sample_id(bad)


@pytest.mark.parametrize("bad", ["q1", "q_x_0", "_0_0", "q_0_1234567890", "q_٣_0"])
def test_put_refuses_malformed_sample_id(any_store, bad):
    s = any_store
    s.create_table("t", COLUMNS)
    with pytest.raises(InvalidArgument) as err:
        s.put("t", {"sample_id": ["good_0_0", bad], "reward": [1.0, 2.0]})
    assert repr(bad) in str(err.value)
    # The whole batch is refused, the good row included.
    assert s.query("SELECT count(*) AS n FROM t").column("n").to_pylist() == [0]


def test_put_parses_ids_into_meta_columns(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["gsm8k_17_2_5", "a_b_0_1"], "reward": [1.0, 2.0]})
    rows = s.query("SELECT sample_id, input_id, turn, trajectory_id FROM t "
                   "ORDER BY sample_id").to_pylist()
    assert rows == [
        {"sample_id": "a_b_0_1", "input_id": "a_b", "turn": 0, "trajectory_id": 1},
        {"sample_id": "gsm8k_17_2_5", "input_id": "gsm8k_17", "turn": 2, "trajectory_id": 5},
    ]


def test_sample_id_unique_per_policy_version(any_store):
    s = any_store
    s.create_table("t", COLUMNS, max_staleness=3)
    s.put("t", {"sample_id": ["q_0_0"], "reward": [1.0]})
    s.put("t", {"sample_id": ["q_0_0"], "reward": [2.0]})           # same key: an upsert
    s.bump_version("t")
    s.put("t", {"sample_id": ["q_0_0"], "reward": [3.0]})           # a new key at version 1
    s.put("t", {"sample_id": ["q_0_0"], "policy_version": [0], "reward": [4.0]})
    rows = s.query("SELECT policy_version, reward FROM t ORDER BY policy_version").to_pylist()
    assert rows == [{"policy_version": 0, "reward": 4.0}, {"policy_version": 1, "reward": 3.0}]


def test_duplicate_ids_in_one_batch_last_wins(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["q_0_0", "q_0_1", "q_0_0"], "reward": [1.0, 5.0, 2.0]})
    rows = s.query("SELECT sample_id, reward FROM t ORDER BY sample_id").to_pylist()
    assert rows == [{"sample_id": "q_0_0", "reward": 2.0}, {"sample_id": "q_0_1", "reward": 5.0}]


def test_finished_version_stamps(any_store):
    s = any_store
    s.create_table("t", COLUMNS, max_staleness=5)
    s.put("t", {"sample_id": ["a_0_0", "b_0_0"], "prompt": ["pa", "pb"]})
    s.bump_version("t")
    s.bump_version("t")
    # The last write arrives at version 2: policy_version stays 0, finished_version is 2.
    s.put("t", {"sample_id": ["a_0_0"], "policy_version": [0], "response": ["r"], "reward": [1.0]})
    # Or the producer says when generation finished.
    s.put("t", {"sample_id": ["b_0_0"], "policy_version": [0], "response": ["r"], "reward": [1.0],
                "finished_version": [1]})
    # A new sample written now starts and finishes at version 2.
    s.put("t", {"sample_id": ["c_0_0"], "prompt": ["p"], "response": ["r"], "reward": [0.0]})
    rows = s.query("SELECT sample_id, policy_version, finished_version FROM t "
                   "ORDER BY sample_id").to_pylist()
    assert rows == [
        {"sample_id": "a_0_0", "policy_version": 0, "finished_version": 2},
        {"sample_id": "b_0_0", "policy_version": 0, "finished_version": 1},
        {"sample_id": "c_0_0", "policy_version": 2, "finished_version": 2},
    ]
    claimed = s.claim("t", 10).data
    assert claimed.column("finished_version").to_pylist() == [2, 1, 2]
    assert claimed.column("policy_version").to_pylist() == [0, 0, 2]


# -- upserts -----------------------------------------------------------------------------------

def test_partial_writes_become_ready_when_complete(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["q_0_0"], "prompt": ["2+2?"]})
    assert _state(s)["pending"] == 1 and not s.claim("t", 10)
    s.put("t", [{"sample_id": "q_0_0", "response": "4"}])
    assert _state(s)["pending"] == 1 and not s.claim("t", 10)
    status = s.query("SELECT prompt_status, response_status, reward_status FROM t").to_pylist()
    assert status == [{"prompt_status": True, "response_status": True, "reward_status": False}]
    s.put("t", pa.table({"sample_id": ["q_0_0"], "reward": [1.0]}))
    assert _state(s)["ready"] == 1
    claim = s.claim("t", 10)
    assert claim.data.select(["prompt", "response", "reward"]).to_pylist() == [
        {"prompt": "2+2?", "response": "4", "reward": 1.0}]


def test_required_columns_only(any_store):
    s = any_store
    s.create_table("t", COLUMNS, required=["reward"])
    s.put("t", {"sample_id": ["q_0_0"], "reward": [0.5]})   # prompt/response never written
    claim = s.claim("t", 10)
    assert claim.data.column("sample_id").to_pylist() == ["q_0_0"]
    assert claim.data.column("prompt_status").to_pylist() == [False]


def test_streaming_write_stays_pending(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["q_0_0"], "prompt": ["p"], "reward": [1.0],
                "response": ["partial"], "response_status": [False]})
    assert _state(s)["pending"] == 1 and not s.claim("t", 10)
    s.put("t", {"sample_id": ["q_0_0"], "response": ["partial and more"],
                "response_status": [False]})
    assert not s.claim("t", 10)
    assert s.query("SELECT response FROM t").column("response").to_pylist() == [
        "partial and more"]
    # Completing the response makes the row ready with the final text.
    s.put("t", {"sample_id": ["q_0_0"], "response": ["partial and more, done"]})
    claim = s.claim("t", 10)
    assert claim.data.column("response").to_pylist() == ["partial and more, done"]


def test_status_can_be_cleared_again(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["q_0_0"], "prompt": ["p"], "response": ["r"], "reward": [1.0]})
    assert _state(s)["ready"] == 1
    s.put("t", {"sample_id": ["q_0_0"], "response_status": [False]})
    assert _state(s) == {"pending": 1, "ready": 0, "processing": 0, "consumed": 0, "stale": 0,
                         "dead": 0}
    assert not s.claim("t", 10)
    s.put("t", {"sample_id": ["q_0_0"], "response_status": [True]})
    assert s.claim("t", 10).data.column("response").to_pylist() == ["r"]


def test_null_value_leaves_stored_value(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["a_0_0", "b_0_0"], "prompt": ["pa", "pb"],
                "response": ["ra", "rb"], "reward": [1.0, 2.0]})
    s.put("t", {"sample_id": ["a_0_0", "b_0_0"], "response": [None, "rb2"],
                "reward": [None, 3.0]})
    rows = s.query("SELECT sample_id, response, reward, response_status FROM t "
                   "ORDER BY sample_id").to_pylist()
    assert rows == [
        {"sample_id": "a_0_0", "response": "ra", "reward": 1.0, "response_status": True},
        {"sample_id": "b_0_0", "response": "rb2", "reward": 3.0, "response_status": True},
    ]


def test_null_value_does_not_complete_a_column(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["q_0_0"], "prompt": ["p"], "response": [None], "reward": [1.0]})
    assert s.query("SELECT response_status FROM t").column(0).to_pylist() == [False]
    assert not s.claim("t", 10)


def test_resend_changes_nothing(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    write = {"sample_id": ["a_0_0", "b_0_0", "c_0_0"], "prompt": ["p1", "p2", "p3"],
             "response": ["r1", "r2", None], "reward": [1.0, 0.0, None]}
    s.put("t", write)
    before = s.query(SNAPSHOT)
    states = _state(s)
    s.put("t", write)
    s.put("t", write)
    assert s.query(SNAPSHOT).equals(before)
    assert _state(s) == states


def test_resend_after_consumed_is_not_delivered_again(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    write = {"sample_id": ["a_0_0", "b_0_0"], "prompt": ["p1", "p2"], "response": ["r1", "r2"],
             "reward": [1.0, 0.0]}
    s.put("t", write)
    claim = s.claim("t", 10)
    assert claim.num_rows == 2
    s.ack(claim.claim_id)
    before = s.query(SNAPSHOT)
    s.put("t", write)                                     # an at-least-once producer re-sends
    assert not s.claim("t", 10)
    assert s.query(SNAPSHOT).equals(before)
    st = _state(s)
    assert st["consumed"] == 2 and st["ready"] == 0 and st["pending"] == 0
    # A partial re-send does not resurrect the rows either.
    s.put("t", {"sample_id": ["a_0_0"], "response_status": [False]})
    s.put("t", {"sample_id": ["a_0_0"], "response_status": [True]})
    assert not s.claim("t", 10)
    assert _state(s)["consumed"] == 2


def test_resend_while_processing_keeps_the_lease(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    write = {"sample_id": ["a_0_0"], "prompt": ["p"], "response": ["r"], "reward": [1.0]}
    s.put("t", write)
    claim = s.claim("t", 10)
    s.put("t", write)
    assert not s.claim("t", 10)                           # still held by the first claim
    assert _state(s)["processing"] == 1
    s.ack(claim.claim_id)
    assert _state(s)["consumed"] == 1 and not s.claim("t", 10)


def test_put_input_forms(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64", "ids": "list<int32>"})
    assert s.put("t", {"sample_id": ["a_0_0"], "reward": [1.0], "ids": [[1]]}) == {
        "rows": 1, "version": 0}
    assert s.put("t", [{"sample_id": "b_0_0", "reward": 2.0, "ids": [2, 3]}])["rows"] == 1
    batch = pa.record_batch({"sample_id": ["c_0_0"], "reward": [3.0]})
    assert s.put("t", batch)["rows"] == 1
    assert s.put("t", pa.table({"sample_id": ["d_0_0"], "reward": pa.array([4], pa.int32())}))[
        "rows"] == 1                                         # int32 casts to float64 safely
    rows = s.query("SELECT sample_id, reward FROM t ORDER BY 1").to_pylist()
    assert [r["reward"] for r in rows] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("write, bad", [
    ({"sample_id": ["a_0_0"], "nope": [1]}, "'nope'; writable columns: sample_id, policy_version, "
                                            "finished_version, prompt, response, reward and"),
    ({"sample_id": ["a_0_0"], "consumed": [True]}, "'consumed'"),
    ({"sample_id": ["a_0_0"], "row_id": [5]}, "'row_id'"),
    ({"reward": [1.0]}, "'sample_id'"),
    ({"sample_id": ["a_0_0"], "reward": ["not a number"]}, "'reward'"),
])
def test_put_refuses_bad_columns(any_store, write, bad):
    s = any_store
    s.create_table("t", COLUMNS)
    with pytest.raises(SchemaMismatch, match=bad):
        s.put("t", write)
    assert s.query("SELECT count(*) FROM t").column(0).to_pylist() == [0]


def test_put_refuses_null_sample_id_and_empty_batch(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    with pytest.raises(InvalidArgument, match="sample_id"):
        s.put("t", {"sample_id": [None], "reward": [1.0]})
    with pytest.raises(InvalidArgument, match="no rows"):
        s.put("t", pa.table({"sample_id": pa.array([], pa.string())}))


# -- versions on writes -----------------------------------------------------------------------

def test_write_at_future_version_refused(any_store):
    s = any_store
    s.create_table("t", COLUMNS)
    with pytest.raises(StaleVersion, match="1"):
        s.put("t", {"sample_id": ["q_0_0"], "policy_version": [1], "reward": [1.0]})
    assert s.query("SELECT count(*) FROM t").column(0).to_pylist() == [0]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_write_at_stale_version_refused(any_store, max_staleness):
    s = any_store
    s.create_table("t", COLUMNS, max_staleness=max_staleness)
    for _ in range(max_staleness + 1):
        s.bump_version("t")
    current = s.get_version("t")
    # The oldest accepted version is current - max_staleness.
    s.put("t", {"sample_id": ["ok_0_0"], "policy_version": [current - max_staleness],
                "reward": [1.0]})
    with pytest.raises(StaleVersion, match=str(current - max_staleness - 1)):
        s.put("t", {"sample_id": ["q_0_0", "r_0_0"],
                    "policy_version": [current, current - max_staleness - 1],
                    "reward": [1.0, 2.0]})
    assert s.query("SELECT sample_id FROM t").column(0).to_pylist() == ["ok_0_0"]
