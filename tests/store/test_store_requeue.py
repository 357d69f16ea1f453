"""Re-queueing dead rows (``requeue``, store/requeue.py): an operator re-drives dead-lettered rows
once the cause is fixed; they are live again with a fresh delivery count, durably.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from store.errors import NotFound, QueryRefused, TableFull

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dead_table(s, n: int = 4, **options) -> list[str]:
    """Table ``t`` whose ``n`` rows were all delivered once and nacked: dead (max_deliveries 1)."""
    s.create_table("t", {"text": "string", "reward": "float64"}, storage={"text": "ref"},
                   max_deliveries=1, **options)
    ids = [f"q{i}_0_0" for i in range(n)]
    s.put("t", {"sample_id": ids, "text": [f"text of {sid}" for sid in ids],
                "reward": [float(i) for i in range(n)]})
    claim = s.claim("t", n)
    assert claim.data.num_rows == n
    s.nack(claim.claim_id)
    assert s.stats("t")["t"]["dead"] == n
    return ids


def _states(s) -> tuple[int, int, int]:
    st = s.stats("t")["t"]
    return st["ready"], st["dead"], st["pending"]


def test_requeued_rows_are_delivered_again_with_a_fresh_delivery_count_after_a_reopen(
        open_store):
    s = open_store()
    ids = _dead_table(s)

    assert s.requeue("t") == {"table": "t", "requeued": 4, "skipped_stale": 0,
                              "skipped_lost": 0}
    assert _states(s) == (4, 0, 0)
    assert s.query("SELECT count(*) FROM t WHERE dead OR delivery_count <> 0").column(0)[0] \
        .as_py() == 0
    s.close()

    s = open_store()                                  # what a restart finds: DuckDB's word
    assert _states(s) == (4, 0, 0)
    claim = s.claim("t", 8)
    assert claim.data.column("sample_id").to_pylist() == ids
    assert claim.data.column("delivery_count").to_pylist() == [1] * 4
    assert claim.data.column("text").to_pylist() == [f"text of {sid}" for sid in ids]
    s.nack(claim.claim_id)                            # max_deliveries 1 again: dead again
    assert _states(s) == (0, 4, 0)
    assert s.requeue("t")["requeued"] == 4            # and re-driven again
    assert s.counters["rows_requeued"] == 4           # (this open's)


def test_requeue_where_picks_dead_rows_by_a_predicate_over_their_values(open_store):
    s = open_store()
    _dead_table(s)
    # a predicate on a by-reference column sees its values, as a claim's does
    answer = s.requeue("t", where="text LIKE '%q1_%' OR reward >= 3")
    assert answer["requeued"] == 2
    assert sorted(s.claim("t", 8).data.column("sample_id").to_pylist()) == ["q1_0_0", "q3_0_0"]
    assert s.stats("t")["t"]["dead"] == 2
    assert s.requeue("t", where="reward > 100")["requeued"] == 0
    assert s.requeue("t", where="sample_id = 'q1_0_0'")["requeued"] == 0   # leased, not dead


def test_rows_below_the_staleness_bound_stay_dead_and_are_counted(open_store):
    s = open_store()
    _dead_table(s, max_staleness=1)
    s.bump_version("t")                               # version 1: version 0 still in the window
    s.put("t", {"sample_id": ["n0_0_0"], "text": ["new"], "reward": [9.0]})
    s.nack(s.claim("t", 1).claim_id)                  # a dead row of version 1
    s.bump_version("t")                               # version 2: version 0 is out of reach

    assert s.requeue("t") == {"table": "t", "requeued": 1, "skipped_stale": 4,
                              "skipped_lost": 0}
    assert s.claim("t", 8).data.column("sample_id").to_pylist() == ["n0_0_0"]
    assert s.stats("t")["t"]["dead"] == 4


def test_a_requeued_row_missing_a_required_value_is_pending_until_it_is_written(open_store):
    s = open_store()
    _dead_table(s, n=2)
    # a write to a dead row reaches DuckDB (an at-least-once producer re-sending), here a
    # streamed value marked incomplete again
    s.put("t", {"sample_id": ["q0_0_0"], "text": ["partial"], "text_status": [False]})
    assert s.requeue("t")["requeued"] == 2
    assert _states(s) == (1, 0, 1)
    s.put("t", {"sample_id": ["q0_0_0"], "text": ["whole"]})
    assert _states(s) == (2, 0, 0)


def test_requeue_refuses_a_bad_predicate_and_an_unknown_table(open_store):
    s = open_store()
    _dead_table(s, n=1)
    with pytest.raises(QueryRefused, match="requeue where 'no_such_column > 1' failed"):
        s.requeue("t", where="no_such_column > 1")
    with pytest.raises(QueryRefused, match="LIMIT"):
        s.requeue("t", where="true) LIMIT (1")
    with pytest.raises(NotFound, match="'nope'"):
        s.requeue("nope")
    assert s.stats("t")["t"]["dead"] == 1             # nothing requeued by the refusals


CHILD = textwrap.dedent("""
    import os, signal, sys
    import store

    s = store.connect(sys.argv[1])
    print(s.requeue("t", where="reward < 2")["requeued"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)              # no close: what a crash leaves
""")


def test_requeued_rows_are_ready_after_a_kill_9(open_store, db_path):
    s = open_store()
    _dead_table(s)
    s.close()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, "-c", CHILD, db_path], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr[-2000:]
    assert child.stdout.split() == ["2"]

    s = open_store()
    assert _states(s) == (2, 2, 0)
    assert s.claim("t", 8).data.column("sample_id").to_pylist() == ["q0_0_0", "q1_0_0"]


def test_every_store_requeues_dead_rows_and_refuses_bad_requests_alike(any_store):
    """The embedded store and the remote one (the ``requeue`` action) answer the same."""
    s = any_store
    ids = _dead_table(s, n=3)
    assert s.requeue("t", where="reward > 0") == {"table": "t", "requeued": 2,
                                                  "skipped_stale": 0, "skipped_lost": 0}
    claim = s.claim("t", 8)
    assert claim.data.column("sample_id").to_pylist() == ids[1:]
    assert claim.data.column("delivery_count").to_pylist() == [1, 1]
    with pytest.raises(QueryRefused, match="no_such_column"):
        s.requeue("t", where="no_such_column > 1")
    with pytest.raises(NotFound, match="'nope'"):
        s.requeue("nope")
    assert s.stats("t")["t"]["dead"] == 1


def test_rows_an_expired_lease_made_dead_are_requeued_before_their_flags_are_due(
        slow_inserts, wait_until):
    """An expired lease's rows are dead at once (stats counts them) while their flags wait,
    like all lease bookkeeping, for the next flush (here never due by itself): requeue writes
    them first, and finds the rows."""
    s = slow_inserts()
    s.create_table("t", {"reward": "float64"}, max_deliveries=1)
    s.put("t", {"sample_id": ["q0_0_0", "q1_0_0"], "reward": [0.0, 1.0]})
    s.claim("t", 2, lease_seconds=0.05)
    wait_until(lambda: s.stats("t")["t"]["dead"] == 2, timeout=30,
               message="the lease expired and its rows were dead-lettered")
    assert s.requeue("t")["requeued"] == 2
    assert _states(s) == (2, 0, 0)
    assert s.claim("t", 8).data.column("delivery_count").to_pylist() == [1, 1]


def test_requeue_is_refused_past_max_live_rows_as_a_put_is(open_store):
    s = open_store(max_live_rows=4)
    _dead_table(s)                                    # 4 dead rows, none live
    s.put("t", {"sample_id": ["n0_0_0", "n1_0_0"], "text": ["a", "b"], "reward": [0.0, 0.0]})
    with pytest.raises(TableFull, match="max_live_rows of 4"):
        s.requeue("t")                                # 2 live + 4 > 4
    assert _states(s) == (2, 4, 0)                    # nothing requeued
    assert s.requeue("t", where="reward < 2")["requeued"] == 2
    assert _states(s) == (4, 2, 0)
