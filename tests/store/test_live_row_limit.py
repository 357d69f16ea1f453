"""``max_live_rows``: a put that would take a table past its store's limit of live rows fails with
TableFull (retryable, nothing of it stored); rows it only updates take no room; consuming rows
makes room again. Embedded, and through the server on both put paths (the session for small
puts, do_put for large ones).
"""
from __future__ import annotations

import pytest

import store
from flight_fixtures import running_server
from store.errors import InvalidArgument, TableFull, Unavailable

LIMIT = 10


def _ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}_0_0" for i in range(n)]


def _fill(s, ids: list[str], **columns) -> None:
    s.put("t", {"sample_id": ids, **{k: v * len(ids) for k, v in columns.items()}})


def _live_rows_refused_then_accepted(s, big: int) -> None:
    s.create_table("t", {"response": "string", "reward": "float64"})
    _fill(s, _ids("a", LIMIT), response=["r"], reward=[1.0])
    with pytest.raises(TableFull, match=r"'t' holds 10 live rows .* would add 1, over the "
                                        r"store's max_live_rows of 10") as refused:
        _fill(s, _ids("b", 1), response=["r"], reward=[1.0])
    assert isinstance(refused.value, Unavailable)  # what producers/writer.py retries
    with pytest.raises(TableFull, match=f"would add {big:,}"):
        _fill(s, _ids("c", big), response=["r"], reward=[1.0])
    assert s.stats("t")["t"]["rows"] == LIMIT  # nothing of the refused puts stored
    # Rewriting live rows takes no room.
    _fill(s, _ids("a", LIMIT), response=["rewritten"], reward=[2.0])
    claim = s.claim("t", 4)
    s.ack(claim.claim_id)
    _fill(s, _ids("b", 4), response=["r"], reward=[1.0])  # room for 4 again
    with pytest.raises(TableFull):
        _fill(s, _ids("d", 1), response=["r"], reward=[1.0])
    assert s.stats("t")["t"]["rows"] == LIMIT + 4


def test_the_limit_refuses_new_rows_and_lets_updates_through(open_store):
    _live_rows_refused_then_accepted(open_store(max_live_rows=LIMIT), big=5000)


def test_a_pending_row_completed_at_the_limit_is_not_refused(open_store):
    s = open_store(max_live_rows=2)
    s.create_table("t", {"response": "string", "reward": "float64"})
    _fill(s, _ids("a", 2), response=["r"])  # pending: the reward comes last
    with pytest.raises(TableFull):
        _fill(s, _ids("b", 1), response=["r"])
    _fill(s, _ids("a", 2), reward=[1.0], policy_version=[0])
    assert s.claim("t", 2).data.num_rows == 2


@pytest.mark.parametrize("bad", [0, -1, 2.5, "10", True])
def test_a_bad_limit_is_refused(db_path, bad):
    with pytest.raises(InvalidArgument, match=f"max_live_rows {bad!r} is invalid"):
        store.connect(db_path, max_live_rows=bad)


def test_the_server_refuses_with_table_full_on_both_put_paths(tmp_path):
    with running_server(tmp_path / "x.duckdb", max_live_rows=LIMIT) as server:
        with store.connect(server.location) as s:
            _live_rows_refused_then_accepted(s, big=5000)
        with store.connect(server.location, sessions=False) as s:  # every put a do_put
            with pytest.raises(TableFull, match="max_live_rows of 10"):
                _fill(s, _ids("e", 1), response=["r"], reward=[1.0])


def test_the_experience_writer_waits_out_a_full_table(open_store):
    from producers.writer import ExperienceWriter
    from thread_helpers import run_threads

    s = open_store(max_live_rows=4)
    s.create_table("t", {"response": "string", "reward": "float64"})
    _fill(s, _ids("a", 4), response=["r"], reward=[1.0])
    writer = ExperienceWriter(s, "t", batch_rows=2, max_retries=20, backoff=0.05,
                              track_version=False)
    try:
        writer.write([{"sample_id": sid, "response": "late", "reward": 1.0}
                      for sid in _ids("b", 2)])

        def consume_later() -> None:
            import time
            time.sleep(0.3)  # the writer's first puts are refused meanwhile
            claim = s.claim("t", 2)
            s.ack(claim.claim_id)

        work = [consume_later, lambda: writer.flush(timeout=30)]
        assert run_threads(lambda k: work[k](), 2, timeout=60) == []
    finally:
        writer.close()
    assert s.stats("t")["t"]["rows"] == 6
