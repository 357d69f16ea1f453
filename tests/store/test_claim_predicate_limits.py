"""Claim predicates are SQL like any query (issue #29, item 2): the guard checks the query they
run in, and they share the query path's slots and time limit."""
from __future__ import annotations

import threading

import pyarrow.flight as flight
import pytest

import store
from flight_fixtures import action, running_server
from store.errors import QueryBusy, QueryRefused, QueryTimeout
from waiting import wait_until

SLOW = "SELECT count(*) FROM range(100000000) a, range(100000) b"


def _fill(s) -> None:
    s.create_table("solver", {"reward": "float64"})
    s.put("solver", {"sample_id": [f"q{i}_0_0" for i in range(8)],
                     "reward": [float(i % 2) for i in range(8)]})


@pytest.mark.parametrize("where", [
    "reward > 0) ORDER BY (1",          # would sort, limit or group the claim's own query
    "reward > 0) LIMIT (1",
    "reward > 0) GROUP BY (row_id",
    "reward > 0), (1",                  # a second column
    "reward > ?",                       # a parameter the claim does not bind
    "reward > 0); SELECT (1",
    "reward > 0) FROM solver WHERE (1",
])
def test_a_predicate_that_changes_the_query_around_it_is_refused(tmp_path, where):
    with store.connect(str(tmp_path / "x.duckdb")) as s:
        _fill(s)
        with pytest.raises(QueryRefused, match="predicate"):
            s.claim("solver", 8, where=where)
        assert s.stats("solver")["solver"]["ready"] == 8  # nothing leased


@pytest.mark.parametrize("where, rewards", [
    ("reward > 0", [1.0] * 4),
    ("reward > 0) OR (1=1", [0.0, 1.0] * 4),  # one expression: (reward > 0) OR (1=1)
    ("reward > 0 -- the claim's parenthesis is not commented out", [1.0] * 4),
    ("reward = 0 OR reward = 2", [0.0] * 4),
    ("x /* ) OR (1=1 */ IS NULL OR reward > 0".replace("x", "reward"), [1.0] * 4),
])
def test_a_predicate_runs_as_one_expression(tmp_path, where, rewards):
    with store.connect(str(tmp_path / "x.duckdb")) as s:
        _fill(s)
        claim = s.claim("solver", 8, where=where)
        assert sorted(claim.data.column("reward").to_pylist()) == sorted(rewards)


def test_a_claim_predicate_waits_for_a_query_slot_within_the_time_limit(tmp_path):
    """With the only query slot taken by a long query, a claim with a predicate fails with
    query_timeout after the time limit, instead of running beside it; claims without a
    predicate are not held up."""
    with store.connect(str(tmp_path / "x.duckdb"), query_timeout=1.0,
                       max_concurrent_queries=1) as s:
        _fill(s)
        errors: list[BaseException] = []

        def long_query() -> None:
            try:
                s.query(SLOW, timeout=6.0)  # holds the slot well past the claim's limit
            except QueryTimeout as e:
                errors.append(e)

        runner = threading.Thread(target=long_query, daemon=True)
        runner.start()
        wait_until(lambda: s._readers._slots._value == 0, timeout=10,
                   message="the long query never took the query slot")
        with pytest.raises(QueryBusy, match="query slot.*claim predicate") as err:
            s.claim("solver", 4, where="reward > 0")
        assert err.value.code == "query_busy"
        # A subscription does not end for it: it waits, as for rows, and delivers once the
        # slot is free.
        sub = s.subscribe("solver", 2, 2, where="reward > 0")
        assert sub.next(timeout=0.5) is None
        assert len(s.claim("solver", 2)) == 2  # claims without a predicate are not held up
        runner.join(timeout=30)
        assert errors, "the long query should have been cancelled at its limit"
        batch = sub.next(timeout=30)
        assert batch is not None and batch.data.column("reward").to_pylist() == [1.0, 1.0]
        sub.close()


def test_a_slow_claim_predicate_is_cancelled_at_the_time_limit(tmp_path):
    with store.connect(str(tmp_path / "x.duckdb"), query_timeout=0.5) as s:
        _fill(s)
        with pytest.raises(QueryTimeout, match="claim predicate"):
            s.claim("solver", 4, where=f"reward > 0 AND ({SLOW}) > 0")
        assert s.stats("solver")["solver"]["ready"] == 8
        assert len(s.claim("solver", 8, where="reward > 0")) == 4


def test_the_server_refuses_an_escaping_predicate_with_query_refused(tmp_path):
    with running_server(tmp_path / "x.duckdb") as server:
        remote = store.connect(server.location)
        try:
            _fill(remote)
            with pytest.raises(QueryRefused, match="predicate"):
                remote.claim("solver", 8, where="reward > 0) LIMIT (1")
            client = flight.connect(server.location)
            try:
                with pytest.raises(flight.FlightError, match="query_refused"):
                    action(client, "claim", {"table": "solver", "limit": 8,
                                             "where": "reward > 0) ORDER BY (1"})
            finally:
                client.close()
            assert remote.stats("solver")["solver"]["ready"] == 8
        finally:
            remote.close()


def test_a_predicate_naming_an_unknown_column_is_refused_with_no_row_ready(any_store):
    """A claim's predicate is bound to its table even when no row is ready to test it on: a
    typo fails the first claim, not the first one that finds rows (possibly hours later). Once
    it has bound, a table with nothing ready costs no query per claim; a table made again
    under the same name binds it again."""
    s = any_store
    s.create_table("solver", {"reward": "float64"})
    with pytest.raises(QueryRefused, match="rewrd"):
        s.claim("solver", 4, where="rewrd > 0")
    assert s.claim("solver", 4, where="reward > 0").data.num_rows == 0
    s.drop_table("solver")
    s.create_table("solver", {"score": "float64"})
    with pytest.raises(QueryRefused, match="reward"):
        s.claim("solver", 4, where="reward > 0")
    s.put("solver", {"sample_id": ["q0_0_0", "q1_0_0"], "score": [1.0, -1.0]})
    got = s.claim("solver", 4, where="score > 0")
    assert got.data.column("sample_id").to_pylist() == ["q0_0_0"]
