"""Wide puts run as a pipeline: the server prepares a large batch on a pool thread while it
receives the next (in stream order), and the writer writes a group's blob chunks on its blob
thread while the group's statements run (the COMMIT waits for them). Order, answers,
durability and failures on either side are checked here, through the real server and store."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from store.settings import StoreSettings
import store
import store.blob_chunks as blob_chunks
import store.blobs as blobs
import store.writer as writer
from flight_fixtures import put_batches, query, running_server
from flight_server.server import PREPARE_APART_BYTES
from store.errors import InvalidArgument, StaleVersion, StorageError

COLUMNS = {"prompt": "string", "response": "string", "reward": "float64"}
ROWS = 100
WIDTH = 12_000                       # 100 rows of 12 KB: a 1.2 MB batch, a 1.2 MB blob chunk


def _text(tag: str, i: int) -> str:
    return (f"{tag}-{i}:" + "abcdefghij" * (WIDTH // 10))[:WIDTH]


def _batch(tag: str, *, prompt: bool = False, response: bool = False,
           reward: float | None = None, ids: list[str] | None = None) -> pa.RecordBatch:
    ids = ids or [f"s{i}_0_0" for i in range(ROWS)]
    n = len(ids)
    return pa.record_batch({
        "sample_id": pa.array(ids, pa.large_string()),
        "prompt": pa.array([_text(f"p{tag}", i) for i in range(n)] if prompt else [None] * n,
                           pa.large_string()),
        "response": pa.array([_text(f"r{tag}", i) for i in range(n)] if response
                             else [None] * n, pa.large_string()),
        "reward": pa.array([reward] * n, pa.float64()),
    })


@contextlib.contextmanager
def _served(tmp_path):
    """A running server over a fresh file, with table ``t`` (COLUMNS) created."""
    with running_server(tmp_path / "w.duckdb") as srv:
        with store.connect(f"grpc://127.0.0.1:{srv.port}") as s:
            s.create_table("t", COLUMNS)
        yield srv


def _stream(client: flight.FlightClient,
            batches: list[pa.RecordBatch]) -> tuple[list, Exception | None]:
    """Send every batch first, then read the answers (the server pipelines them)."""
    writer_, reader = client.do_put(flight.FlightDescriptor.for_path("t"), batches[0].schema)
    answers, error = [], None
    try:
        for b in batches:
            writer_.write_batch(b)
        writer_.done_writing()
        while (buf := reader.read()) is not None:
            answers.append(json.loads(buf.to_pybytes()))
        writer_.close()
    except flight.FlightError as e:
        error = e
    return answers, error


def test_large_batches_are_prepared_apart_and_applied_in_stream_order(tmp_path):
    assert _batch("x", prompt=True).nbytes >= PREPARE_APART_BYTES
    with running_server(tmp_path / "w.duckdb") as srv:
        s = store.connect(f"grpc://127.0.0.1:{srv.port}")
        try:
            s.create_table("t", COLUMNS)
            with flight.FlightClient(srv.location) as c:
                # prompt, then response, then a small reward-only batch (prepared inline), then
                # another response that must win over the first: order across both paths.
                answers, error = _stream(c, [
                    _batch("1", prompt=True), _batch("1", response=True),
                    _batch("s", reward=0.5), _batch("2", response=True)])
                assert error is None
                assert [a["batch"] for a in answers] == [0, 1, 2, 3]
                assert all(a["rows"] == ROWS for a in answers)
                got = query(c, "SELECT * FROM t ORDER BY sample_id").to_pylist()
        finally:
            s.close()
    assert len(got) == ROWS
    for row in got:
        i = int(row["sample_id"].split("_")[0][1:])
        assert row["prompt"] == _text("p1", i)
        assert row["response"] == _text("r2", i)
        assert row["reward"] == 0.5
    # Reopened from the file: what was answered is there, blobs included.
    with store.connect(str(tmp_path / "w.duckdb")) as again:
        rows = again.query("SELECT * FROM t WHERE sample_id = 's7_0_0'").to_pylist()
    assert [r["response"] for r in rows] == [_text("r2", 7)]


def test_a_producer_pacing_on_each_large_batchs_answer_gets_it(tmp_path):
    """A client that waits for batch k's answer before it sends batch k+1 (pacing itself on
    durability) is answered although the server prepares that batch apart."""
    with _served(tmp_path) as srv:
        with flight.FlightClient(srv.location) as c:
            answers = put_batches(c, "t", [_batch("1", prompt=True), _batch("2", response=True),
                                           _batch("3", prompt=True)],
                                  flight.FlightCallOptions(timeout=60))
            got = query(c, "SELECT * FROM t WHERE sample_id = 's3_0_0'").to_pylist()
    assert [a["batch"] for a in answers] == [0, 1, 2]
    assert [(r["prompt"], r["response"]) for r in got] == [(_text("p3", 3), _text("r2", 3))]


def test_a_pacing_producer_learns_of_its_bad_large_batch_at_once(tmp_path):
    with _served(tmp_path) as srv:
        bad = _batch("b", prompt=True, ids=["b1_0_0", "oops"] + [f"b{i}_0_0"
                                                                  for i in range(2, ROWS)])
        with flight.FlightClient(srv.location) as c:
            writer_, reader = c.do_put(flight.FlightDescriptor.for_path("t"), bad.schema,
                                       flight.FlightCallOptions(timeout=60))
            writer_.write_batch(_batch("1", prompt=True))
            first = json.loads(reader.read().to_pybytes())
            writer_.write_batch(bad)
            second = json.loads(reader.read().to_pybytes())  # before any further batch
            writer_.done_writing()
            with pytest.raises(flight.FlightError, match="oops"):
                while reader.read() is not None:
                    pass
                writer_.close()
    assert first == {"batch": 0, "rows": ROWS, "version": 0}
    assert second["batch"] == 1 and "oops" in second["error"]["message"]


def test_a_bad_large_batch_fails_the_stream_and_keeps_what_came_before(tmp_path):
    with _served(tmp_path) as srv:
        with flight.FlightClient(srv.location) as c:
            bad = _batch("b", prompt=True, ids=[f"b{i}_0_0" for i in range(ROWS - 1)]
                         + ["not-a-sample-id"])
            answers, error = _stream(c, [_batch("1", prompt=True), bad,
                                         _batch("3", prompt=True, ids=[f"z{i}_0_0"
                                                                      for i in range(ROWS)])])
            assert error is not None and "not-a-sample-id" in str(error)
            assert [a["batch"] for a in answers if "error" not in a] == [0]
            # The bad batch is answered with its error as soon as it is found.
            assert [(a["batch"], "not-a-sample-id" in a["error"]["message"])
                    for a in answers if "error" in a] in ([], [(1, True)])
            counts = query(c, "SELECT substr(sample_id, 1, 1) AS k, count(*) AS n FROM t "
                              "GROUP BY 1 ORDER BY 1").to_pylist()
    assert counts == [{"k": "s", "n": ROWS}]


CHILD = textwrap.dedent("""
    import os, sys
    import pyarrow as pa, pyarrow.flight as flight
    uri, batches, rows, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    client = flight.FlightClient(uri)
    schema = pa.schema([("sample_id", pa.large_string()), ("prompt", pa.large_string())])
    writer, _ = client.do_put(flight.FlightDescriptor.for_path("t"), schema)
    for b in range(batches):
        writer.write_batch(pa.record_batch(
            [pa.array([f"k{b}x{i}_0_0" for i in range(rows)], pa.large_string()),
             pa.array([f"{b}:{i}:" + "z" * width for i in range(rows)], pa.large_string())],
            schema=schema))
    os._exit(0)   # gone mid-stream: no done_writing, no close, answers unread
""")


def test_a_producer_gone_mid_stream_leaves_whole_batches_in_order(tmp_path):
    """Every batch the server received is written whole, in order, and the server goes on."""
    with running_server(tmp_path / "w.duckdb") as srv:
        uri = f"grpc://127.0.0.1:{srv.port}"
        s = store.connect(uri)
        try:
            s.create_table("t", COLUMNS)
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            subprocess.run([sys.executable, "-c", CHILD, uri, "12", str(ROWS), str(WIDTH)],
                           check=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
            counts = _settled(lambda: {r["b"]: r["n"] for r in s.query(
                "SELECT split_part(sample_id, 'x', 1) AS b, count(*) AS n FROM t "
                "GROUP BY 1").to_pylist()})
            s.put("t", _wide(s, "after", range(3)))
            assert s.query("SELECT count(*) AS n FROM t WHERE sample_id LIKE 'after%'")\
                .to_pylist() == [{"n": 3}]
        finally:
            s.close()
    assert set(counts.values()) <= {ROWS}, counts
    present = sorted(int(b[1:]) for b in counts)
    assert present == list(range(len(present))), present


def _settled(read, tries: int = 60):
    """``read()`` once two reads half a second apart agree (the server finishing what it read
    after the client went away)."""
    last = read()
    for _ in range(tries):
        time.sleep(0.5)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError(f"still changing after {tries / 2:.0f} s: {last}")


def _wide(s, tag: str, ids: range, **extra) -> dict:
    return {"sample_id": [f"{tag}{i}_0_0" for i in ids],
            "prompt": [_text(tag, i) for i in ids], **extra}


def _blob_threads(monkeypatch) -> list[str]:
    """Record which thread runs each blob sync (observes the real BlobStore.sync)."""
    seen: list[str] = []
    real = blobs.BlobStore.sync

    def sync(self):
        if self.pending_bytes:
            seen.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(blobs.BlobStore, "sync", sync)
    return seen


def test_a_large_group_writes_its_blobs_on_the_blob_thread(embedded_store, monkeypatch):
    s = embedded_store
    s.create_table("t", COLUMNS)
    seen = _blob_threads(monkeypatch)
    s.put("t", _wide(s, "a", range(ROWS)))        # 1.2 MB of chunks: overlapped
    s.put("t", _wide(s, "b", range(3)))           # 36 KB: inline, on the writer's thread
    assert seen[0].startswith("expstore-blob-io") and seen[1] == "expstore-writer"
    rows = s.query("SELECT * FROM t").to_pylist()
    assert {r["sample_id"]: r["prompt"] for r in rows} == \
        {f"{t}{i}_0_0": _text(t, i) for t, n in (("a", ROWS), ("b", 3)) for i in range(n)}


def test_a_failed_overlapped_blob_write_commits_nothing(embedded_store, monkeypatch):
    s = embedded_store
    s.create_table("t", COLUMNS)
    s.put("t", _wide(s, "a", range(ROWS)))
    real_fsync = blobs.os.fsync

    def no_space(fd):
        if threading.current_thread().name.startswith("expstore-blob-io"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(blobs.os, "fsync", no_space)
    with pytest.raises(StorageError, match="No space left"):
        s.put("t", _wide(s, "lost", range(ROWS)))
    monkeypatch.undo()
    s.put("t", _wide(s, "c", range(ROWS)))
    got = s.query("SELECT substr(sample_id, 1, 1) AS k, count(*) AS n FROM t "
                  "GROUP BY 1 ORDER BY 1").to_pylist()
    assert got == [{"k": "a", "n": ROWS}, {"k": "c", "n": ROWS}]
    rows = s.query("SELECT * FROM t ORDER BY sample_id").to_pylist()
    assert {r["sample_id"]: r["prompt"] for r in rows} == \
        {f"{t}{i}_0_0": _text(t, i) for t in "ac" for i in range(ROWS)}


def test_a_failed_statement_waits_for_the_blob_write_and_commits_nothing(embedded_store):
    s = embedded_store
    s.create_table("t", COLUMNS)
    assert ROWS * WIDTH >= StoreSettings().overlap_blob_bytes
    # Version 5 is ahead of the table's version 0: refused by the writer after it started
    # writing the put's chunks.
    with pytest.raises(StaleVersion, match="policy_version 5 is ahead"):
        s.put("t", _wide(s, "v", range(ROWS), policy_version=[5] * ROWS))
    with pytest.raises(InvalidArgument):
        s.put("t", _wide(s, "w", range(ROWS), reward=["x"] * ROWS))
    s.put("t", _wide(s, "ok", range(ROWS)))
    assert s.query("SELECT count(*) AS n FROM t").to_pylist() == [{"n": ROWS}]
    assert [r["prompt"] for r in s.query("SELECT * FROM t WHERE sample_id = 'ok9_0_0'")
            .to_pylist()] == [_text("ok", 9)]


# -- large columns sent by Flight: serialised when written, kept as they arrived ------------------

def test_large_columns_sent_by_flight_read_back_the_same_every_way(tmp_path, monkeypatch):
    """Columns of 4 MB and more that arrive in a Flight batch are written by the blob thread
    (store.blob_chunks.ColumnChunk) and the newest stay in memory as they arrived, not as a copy:
    claims, ``SELECT *`` and a query taking the values through DuckDB all give back what was
    sent, fresh (from memory) and after the server restarted (from the segments)."""
    import numpy as np
    rows, width = 1100, 1024
    floats = np.arange(rows * width, dtype=np.float32)
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    def table(tag: str, shift: float) -> pa.Table:
        return pa.table({
            "sample_id": [f"q{i}_0_0" for i in range(rows)],
            "v": pa.ListArray.from_arrays(offsets, pa.array(floats + np.float32(shift))),
            "t": [f"{tag}{i}:" + "x" * 4000 for i in range(rows)],
        })

    sent = table("a", 0.0)
    expected = {r["sample_id"]: (r["v"], r["t"]) for r in sent.to_pylist()}

    def check(s) -> None:
        got = s.query("SELECT * FROM big").to_pylist()
        assert {r["sample_id"]: (r["v"], r["t"]) for r in got} == expected
        some = s.query("SELECT sample_id, v, t FROM big WHERE input_id IN ('q7', 'q900')"
                       ).to_pylist()
        assert {r["sample_id"]: (r["v"], r["t"]) for r in some} == \
            {k: expected[k] for k in ("q7_0_0", "q900_0_0")}

    written = []
    real = blob_chunks.ColumnChunk.write_into
    monkeypatch.setattr(blob_chunks.ColumnChunk, "write_into",
                        lambda self, into: written.append(len(self)) or real(self, into))
    db = tmp_path / "big.duckdb"
    with running_server(db) as srv:
        with store.connect(f"grpc://127.0.0.1:{srv.port}") as s:
            s.create_table("big", {"v": "list<float32>", "t": "string"},
                           storage={"v": "ref", "t": "ref"})
            s.put("big", sent)
            assert len(written) == 2 and min(written) >= blob_chunks.DEFER_MIN_BYTES
            check(s)
            for size in (16, 64):
                c = s.claim("big", size)
                assert c.data.num_rows == size
                for r in c.data.to_pylist():
                    assert (r["v"], r["t"]) == expected[r["sample_id"]]
            # The same samples again: an update, committed through DuckDB, not the put log.
            sent = table("b", 0.5)
            expected = {r["sample_id"]: (r["v"], r["t"]) for r in sent.to_pylist()}
            s.put("big", sent)
            assert len(written) == 4
            check(s)
    with running_server(db) as srv:
        with store.connect(f"grpc://127.0.0.1:{srv.port}") as s:
            check(s)
