"""Checkpoints (store/opening.py ``run_checkpoint``, store/checkpoints.py): run on every core, and by
the writer between two groups once DuckDB's WAL is full, instead of inside a COMMIT."""
from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import duckdb

from store.settings import StoreSettings
import store
from store import checkpoints, opening

COLUMNS = {"reward": "float64", "tag": "string"}
ROWS = StoreSettings().log_put_rows + 1000  # over the put log's bound: committed to DuckDB's WAL


def _rows(start: int, n: int = ROWS) -> dict:
    return {"sample_id": [f"c{i}_0_0" for i in range(start, start + n)],
            "reward": [i / 3 for i in range(start, start + n)],
            "tag": [f"tag {i:032d}" for i in range(start, start + n)]}


def _wal_bytes(path) -> int:
    try:
        return os.path.getsize(f"{path}.wal")
    except OSError:
        return 0


def _full_wal_at(s, nbytes: int) -> None:
    """Move a running store's full-WAL threshold (the test learns the WAL's size as it goes)."""
    c = s._writer._checkpoints  # noqa: SLF001 - when the writer checkpoints: store/checkpoints.py
    c._settings = dataclasses.replace(c._settings, wal_checkpoint_bytes=nbytes)  # noqa: SLF001


def test_the_writer_checkpoints_a_full_wal_between_groups(db_path, wait_until):
    s = store.connect(db_path, checkpoint_idle_seconds=3600.0)  # no idle checkpoint
    try:
        s.create_table("t", COLUMNS)
        s.put("t", _rows(0))
        held = _wal_bytes(db_path)
        assert held > 0  # under the threshold: the WAL keeps the rows
        _full_wal_at(s, held + 1)
        s.put("t", _rows(ROWS))  # crosses it: the writer checkpoints after this group
        wait_until(lambda: _wal_bytes(db_path) < held, timeout=30)
        assert s.query("SELECT count(*) AS n, sum(reward) AS r FROM t").to_pylist() == \
            [{"n": 2 * ROWS, "r": sum(i / 3 for i in range(2 * ROWS))}]
        # the checkpoint's threads given back (a global setting; the query path refuses it)
        cursor = s._con.cursor()  # noqa: SLF001
        assert cursor.execute("SELECT current_setting('threads')").fetchall() == \
            [(opening.duckdb_threads(),)]
        cursor.close()
    finally:
        s.close()
    with store.connect(db_path) as again:
        assert again.stats("t")["t"]["rows"] == 2 * ROWS


def test_only_duckdb_commits_make_the_writer_measure_the_wal(db_path, monkeypatch):
    """Groups made durable in the put log (acks, small puts) leave DuckDB's WAL as it was, so
    the writer does not stat it after them; after a DuckDB commit it does."""
    wal = f"{db_path}.wal"
    measured: list[str] = []
    real_getsize = os.path.getsize

    def getsize(path):
        if os.fspath(path) == wal:
            measured.append(path)
        return real_getsize(path)

    monkeypatch.setattr(checkpoints.os.path, "getsize", getsize)
    # no idle checkpoint; logged rows stay logged
    s = store.connect(db_path, checkpoint_idle_seconds=3600.0, materialize_delay=3600.0)
    try:
        s.create_table("t", COLUMNS)
        s.put("t", _rows(0))
        assert measured  # a DuckDB commit: measured
        measured.clear()
        for i in range(20):  # logged groups: a small put, a claim's ack
            s.put("t", _rows(ROWS + i, 1))
            s.ack(s.claim("t", 4).claim_id)
        assert s._writer.logged_rows > 0 and measured == []  # noqa: SLF001
        s.put("t", _rows(2 * ROWS))  # over the put log's bound: DuckDB again
        assert measured
    finally:
        s.close()


def test_writes_the_put_log_takes_go_on_while_a_full_wal_is_checkpointed(db_path, monkeypatch,
                                                                          wait_until):
    """The checkpoint of a full WAL runs on the checkpoint thread: a small put, a claim's ack
    and a version bump are answered while it runs (held here until they are), and nothing is
    lost once it ends."""
    started, release = threading.Event(), threading.Event()
    real = checkpoints._checkpoint  # noqa: SLF001

    def held_checkpoint(cursor):
        started.set()
        release.wait(60)
        return real(cursor)

    monkeypatch.setattr(checkpoints, "_checkpoint", held_checkpoint)
    s = store.connect(db_path, checkpoint_idle_seconds=3600.0)  # no idle checkpoint
    calls = ThreadPoolExecutor(max_workers=1)
    try:
        s.create_table("t", COLUMNS)
        s.put("t", _rows(0))
        _full_wal_at(s, _wal_bytes(db_path) + 1)
        s.put("t", _rows(ROWS))  # crosses it: the writer starts the checkpoint after this group
        assert started.wait(30)
        small = _rows(2 * ROWS, 10)
        assert calls.submit(s.put, "t", small).result(10)["rows"] == 10
        claim = s.claim("t", 16)
        assert calls.submit(s.ack, claim.claim_id).result(10)["acked"] == 16
        assert calls.submit(s.bump_version, "t").result(10) == 1
        assert not release.is_set() and s._writer.logged_rows > 0  # noqa: SLF001
        release.set()
        wait_until(lambda: _wal_bytes(db_path) == 0 or s._writer.logged_rows == 0,  # noqa: SLF001
                   timeout=30)
        assert s.query("SELECT count(*) AS n, count(*) FILTER (consumed) AS acked FROM t"
                       ).to_pylist() == [{"n": 2 * ROWS + 10, "acked": 16}]
    finally:
        release.set()
        calls.shutdown()
        s.close()
    with store.connect(db_path) as again:
        assert again.stats("t")["t"]["rows"] == 2 * ROWS + 10
        assert again.get_version("t") == 1


class _Recorded:
    """A DuckDB connection that remembers the statements it ran."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con
        self.statements: list[str] = []

    def execute(self, sql: str):
        self.statements.append(sql)
        return self.con.execute(sql)


def test_a_checkpoint_runs_on_every_core_then_gives_duckdb_its_threads_back(tmp_path,
                                                                           monkeypatch):
    monkeypatch.delenv("EXPSTORE_DUCKDB_THREADS", raising=False)
    monkeypatch.setattr(opening, "_cores", lambda: 4)
    con = duckdb.connect(str(tmp_path / "x.duckdb"), config={"threads": 3})
    try:
        con.execute("CREATE TABLE t AS SELECT range AS x FROM range(1000)")
        recorded = _Recorded(con)
        opening.run_checkpoint(recorded)
        assert recorded.statements == ["SET threads = 4", "CHECKPOINT", "SET threads = 3"]
        assert con.execute("SELECT current_setting('threads')").fetchall() == [(3,)]
        # threads set by hand are kept for checkpoints too
        monkeypatch.setenv("EXPSTORE_DUCKDB_THREADS", "2")
        recorded = _Recorded(con)
        opening.run_checkpoint(recorded)
        assert recorded.statements == ["CHECKPOINT"]
    finally:
        con.close()
