"""Small puts are prepared by the writer, many at once (store/writer.py, ``SmallPutOp``); bulk
puts taken in one group share a transaction.

Each test holds the writer inside a transaction while it queues puts, so that the puts are
certainly taken as one group; then every caller must get its own answer, a bad put must fail
alone, and the stored rows must be what the same puts made one by one.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import pyarrow as pa
import pytest

from store.errors import InvalidArgument, NotFound, SchemaMismatch, StaleVersion
from store.settings import StoreSettings
from store.ops import CallOp
from thread_helpers import run_threads

COLUMNS = {"prompt": "string", "reward": "float64"}
SNAPSHOT = ("SELECT * EXCLUDE (updated_at, created_at, row_id) FROM {} "
            "ORDER BY sample_id, policy_version")


@contextmanager
def writer_held(s) -> Iterator[None]:
    """Keep the writer busy in a transaction of its own until the block ends."""
    entered, release = threading.Event(), threading.Event()

    def hold(con):
        entered.set()
        release.wait(30)

    done = s._writer.submit(CallOp(hold))  # noqa: SLF001 - the writer is what is tested
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        done.result(30)


def one(sid: str, **values) -> pa.Table:
    return pa.table({"sample_id": [sid], **{k: [v] for k, v in values.items()}})


def test_queued_small_puts_commit_together_and_each_caller_gets_its_own_answer(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    commits = s._writer.commits  # noqa: SLF001
    with writer_held(s):
        futures = [s.put_async("t", pa.table({"sample_id": [f"q{i}_0_{j}" for j in range(i)],
                                              "reward": [float(i)] * i}))
                   for i in range(1, 9)]
    assert [f.result(30) for f in futures] == [{"rows": i, "version": 0} for i in range(1, 9)]
    assert s._writer.commits - commits == 2  # noqa: SLF001 - the hold, then all eight puts
    assert s.counters["puts"] == 8 and s.counters["rows_put"] == 36
    assert s.stats("t")["t"]["rows"] == 36


@pytest.mark.parametrize("bad, error, words, good", [
    # the same schema as the good puts: prepared in the same merged batch, which fails
    (one("no-turn-here", reward=1.0), InvalidArgument, "no-turn-here", {}),
    (pa.table({"sample_id": ["q9_0_0", None], "reward": [1.0, 2.0]}), InvalidArgument, "null",
     {}),
    # prepared fine, refused in the transaction: the group is retried put by put
    (one("q9_0_0", reward=1.0, policy_version=3), StaleVersion, "ahead", {"policy_version": 0}),
    (one("q9_0_0", reward=1.0, policy_version=3), StaleVersion, "ahead", {}),
])
def test_a_bad_put_fails_alone_and_the_others_commit(open_store, bad, error, words, good):
    s = open_store()
    s.create_table("t", COLUMNS)
    with writer_held(s):
        before = [s.put_async("t", one(f"a{i}_0_0", reward=float(i), **good)) for i in range(5)]
        failing = s.put_async("t", bad)
        after = [s.put_async("t", one(f"b{i}_0_0", reward=float(i), **good)) for i in range(5)]
    with pytest.raises(error, match=words):
        failing.result(30)
    assert all(f.result(30)["rows"] == 1 for f in before + after)
    assert sorted(r["sample_id"] for r in s.query("SELECT sample_id FROM t").to_pylist()) == \
        [f"a{i}_0_0" for i in range(5)] + [f"b{i}_0_0" for i in range(5)]


def test_column_errors_still_raise_at_the_call(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    with pytest.raises(SchemaMismatch, match="bogus"):
        s.put_async("t", pa.table({"sample_id": ["q1_0_0"], "bogus": [1]}))
    with pytest.raises(SchemaMismatch, match="sample_id"):
        s.put_async("t", pa.table({"reward": [1.0]}))
    with pytest.raises(NotFound, match="nope"):
        s.put_async("nope", one("q1_0_0", reward=1.0))
    with pytest.raises(InvalidArgument, match="no rows"):
        s.put_async("t", pa.table({"sample_id": pa.array([], pa.string())}))


def _writes() -> list[tuple[str, pa.Table]]:
    """Partial writes, re-sends and two tables, interleaved as producers would send them."""
    return [
        ("t", one("x1_0_0", prompt="p1")),
        ("u", one("x1_0_0", prompt="u1")),
        ("t", one("x2_0_0", prompt="p2")),
        ("t", one("x1_0_0", reward=1.0)),                 # the same sample, another column
        ("t", one("x3_0_0", prompt="p3", reward=3.0)),
        ("t", one("x2_0_0", reward=2.0)),
        ("t", one("x2_0_0", reward=2.5)),                 # the same sample again: last wins
        ("t", one("x4_0_0", prompt="p4")),
        ("t", one("x4_0_0", prompt="p4 again")),          # same schema, same sample
        ("u", one("x2_0_0", prompt="u2", reward=0.0)),
        ("t", pa.table({"sample_id": ["x5_0_0", "x5_0_0"], "reward": [5.0, 5.5]})),
    ]


def test_merged_puts_store_what_puts_one_by_one_store(open_store, tmp_path):
    grouped = open_store(str(tmp_path / "grouped.duckdb"))
    single = open_store(str(tmp_path / "single.duckdb"))
    for s in (grouped, single):
        s.create_table("t", COLUMNS)
        s.create_table("u", COLUMNS)
    with writer_held(grouped):
        futures = [grouped.put_async(t, data) for t, data in _writes()]
    for (t, data), f in zip(_writes(), futures):
        assert f.result(30) == single.put(t, data)
    for t in ("t", "u"):
        assert grouped.query(SNAPSHOT.format(t)).to_pylist() == \
            single.query(SNAPSHOT.format(t)).to_pylist()
        assert grouped.stats(t) == single.stats(t)
    # the ready rows (every required column written) are claimable in both, alike
    a, b = grouped.claim("t", 10), single.claim("t", 10)
    assert sorted(a.data.column("sample_id").to_pylist()) == \
        sorted(b.data.column("sample_id").to_pylist()) == ["x1_0_0", "x2_0_0", "x3_0_0"]


def _bulk(prefix: str, ids: range, reward: float) -> pa.Table:
    return pa.table({"sample_id": [f"{prefix}{i}_0_0" for i in ids],
                     "reward": [reward] * len(ids)})


def test_bulk_puts_of_one_group_that_rewrite_each_others_rows_store_what_one_by_one_store(
        open_store, tmp_path):
    # Over the put log's bound, so one DuckDB transaction: the second put rewrites half of the
    # first's new rows (found among the transaction's new keys), the third is new again.
    n = StoreSettings().log_put_rows + 100
    writes = [_bulk("b", range(n), 1.0), _bulk("b", range(n // 2, n + n // 2), 2.0),
              _bulk("c", range(n), 3.0)]
    grouped = open_store(str(tmp_path / "grouped.duckdb"))
    single = open_store(str(tmp_path / "single.duckdb"))
    for s in (grouped, single):
        s.create_table("t", COLUMNS)
    commits = grouped._writer.commits  # noqa: SLF001
    with writer_held(grouped):
        futures = [grouped.put_async("t", data) for data in writes]
    for data, f in zip(writes, futures):
        assert f.result(30) == single.put("t", data)
    assert grouped._writer.commits - commits == 2  # noqa: SLF001 - the hold, then the 3 puts
    assert grouped.query(SNAPSHOT.format("t")).to_pylist() == \
        single.query(SNAPSHOT.format("t")).to_pylist()
    assert grouped.stats("t")["t"]["rows"] == n + n // 2 + n


def test_many_threads_of_one_sample_puts(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    def produce(k: int) -> None:
        for i in range(25):
            assert s.put("t", one(f"k{k}n{i}_0_0", prompt="p", reward=float(k)))["rows"] == 1

    errors = run_threads(produce, 32, timeout=120)
    assert not errors, errors[:3]
    assert s.stats("t")["t"]["ready"] == 800
    assert s.query("SELECT sum(reward) AS r FROM t").to_pylist() == [
        {"r": float(sum(range(32)) * 25)}]
