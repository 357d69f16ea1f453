"""Baseline: in-process DuckDB bulk inserts from Arrow into a database file, no server.

Every 4,096-row batch is one ``INSERT … SELECT`` committed on its own (what a durable 4,096-row
put costs at least); a single whole-table insert is reported beside it, also with the
``CHECKPOINT`` after it counted (DuckDB compresses and writes row groups then; the store's narrow
ingest is compared counting its checkpoint too). Wide rows are stored by value, and the explicit
``CHECKPOINT`` afterwards (string compression) is timed on its own.

One more figure is not a baseline but what is in the way: the same narrow rows inserted straight
into a table of the store's own layout (made by ``store.create_table``: meta, lease and status
columns), in 32,768-row transactions and a CHECKPOINT, with the store's DuckDB settings: what
DuckDB alone does with that layout, the ceiling of the store's narrow ingest.

And one figure of the disk itself: sequential ``O_DIRECT`` writes of 48 MB into a new file in
the same folder, then ``fsync``. Any store that answers a wide put once its bytes are durable
writes every byte once, so this bounds durable wide ingest on the machine.
"""

from __future__ import annotations

import errno
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import duckdb
import pyarrow as pa

from bench.context import Ctx
from bench.workloads import BATCH_ROWS, mb, narrow_table, rebatch, wide_table

NAME = "duckdb_bulk"
TITLE = "in-process DuckDB bulk insert (file, no server)"

NARROW_DDL = ("CREATE TABLE t (sample_id VARCHAR, reward DOUBLE, done BOOLEAN, truncated BOOLEAN,"
              " correct BOOLEAN, tag VARCHAR)")
WIDE_DDL = ("CREATE TABLE t (sample_id VARCHAR, prompt VARCHAR, response VARCHAR,"
            " token_ids INTEGER[], logprobs FLOAT[])")


def _insert_batches(path: Path, ddl: str, table: pa.Table) -> tuple[float, float]:
    """Seconds to insert ``table`` batch by batch (one commit each), then to checkpoint."""
    con = duckdb.connect(str(path))
    try:
        con.execute(ddl)
        t0 = time.perf_counter()
        for batch in table.to_batches():
            con.register("incoming", batch)
            con.execute("INSERT INTO t SELECT * FROM incoming")
            con.unregister("incoming")
        t1 = time.perf_counter()
        con.execute("CHECKPOINT")
        return t1 - t0, time.perf_counter() - t1
    finally:
        con.close()


def _insert_whole(path: Path, ddl: str, table: pa.Table) -> tuple[float, float]:
    """Seconds of one INSERT of the whole table, and of the CHECKPOINT after it."""
    con = duckdb.connect(str(path))
    try:
        con.execute(ddl)
        con.register("incoming", table)
        t0 = time.perf_counter()
        con.execute("INSERT INTO t SELECT * FROM incoming")
        t1 = time.perf_counter()
        con.execute("CHECKPOINT")
        return t1 - t0, time.perf_counter() - t1
    finally:
        con.close()


STORE_LAYOUT_ROWS = 32_768
# The writer's INSERT of new rows, without the server: ids parsed by DuckDB, every status true.
STORE_LAYOUT_INSERT = (
    "INSERT INTO narrow (row_id, sample_id, input_id, turn, trajectory_id, policy_version, "
    "finished_version, created_at, updated_at, reward, done, truncated, correct, tag, "
    "reward_status, done_status, truncated_status, correct_status, tag_status) "
    "SELECT row_id, sample_id, split_part(sample_id, '_', 1), 0, 0, 0, 0, now(), now(), reward, "
    "done, truncated, correct, tag, true, true, true, true, true FROM incoming")


def _insert_store_layout(path: Path, table: pa.Table) -> float | None:
    """Rows/s of ``table`` inserted into a table of the store's layout (None: no store package)."""
    try:
        import store
        from store.opening import duckdb_config
    except ImportError:
        return None
    from bench.workloads import NARROW_COLUMNS

    s = store.connect(str(path))
    s.create_table("narrow", dict(NARROW_COLUMNS))
    s.close()
    con = duckdb.connect(str(path), config=duckdb_config(None))
    try:
        table = table.append_column("row_id", pa.array(range(table.num_rows), pa.int64()))
        t0 = time.perf_counter()
        for start in range(0, table.num_rows, STORE_LAYOUT_ROWS):
            con.execute("BEGIN TRANSACTION")
            con.register("incoming", table.slice(start, STORE_LAYOUT_ROWS))
            con.execute(STORE_LAYOUT_INSERT)
            con.unregister("incoming")
            con.execute("COMMIT")
        con.execute("CHECKPOINT")  # the compression the store's ingest pays for too
        return table.num_rows / (time.perf_counter() - t0)
    finally:
        con.close()


def _disk_write_rate(path: Path, pieces: int, piece_bytes: int = 48 << 20) -> tuple[float, str]:
    """(MB/s, how) of writing ``pieces`` pieces of random bytes sequentially into a new file,
    then fsync: with O_DIRECT (from page-aligned memory) where the filesystem accepts it, else
    buffered."""
    buf = mmap.mmap(-1, piece_bytes)              # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (piece_bytes >> 20))
    try:
        direct = getattr(os, "O_DIRECT", None)
        if direct is not None:
            try:
                return _timed_writes(path, buf, pieces, direct), "O_DIRECT"
            except OSError as e:                  # tmpfs and others refuse O_DIRECT
                if e.errno != errno.EINVAL:
                    raise
        return _timed_writes(path, buf, pieces, 0), "buffered"
    finally:
        buf.close()


def _timed_writes(path: Path, buf: mmap.mmap, pieces: int, flags: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(pieces):
            os.pwrite(fd, buf, i * len(buf))
        os.fsync(fd)
        return pieces * len(buf) / 1e6 / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)


def run(ctx: Ctx) -> None:
    narrow = rebatch(narrow_table(ctx.pick(250_000, 1_000_000)))
    wide = rebatch(wide_table(ctx.pick(1024, 2048)), 512)
    repeats = ctx.pick(2, 3)
    with tempfile.TemporaryDirectory(prefix="bench-duckdb-") as tmp:
        runs = [_insert_batches(Path(tmp, f"n{i}.duckdb"), NARROW_DDL, narrow)
                for i in range(repeats)]
        secs = statistics.median(r[0] for r in runs)
        ctx.record("narrow_rows_per_s", narrow.num_rows / secs, "rows/s",
                   f"narrow, {BATCH_ROWS:,}-row inserts, one commit each")
        runs = [_insert_whole(Path(tmp, f"nw{i}.duckdb"), NARROW_DDL, narrow)
                for i in range(repeats)]
        secs = statistics.median(insert_s for insert_s, _ in runs)
        ctx.record("narrow_whole_rows_per_s", narrow.num_rows / secs, "rows/s",
                   "narrow, one whole-table insert")
        secs = statistics.median(insert_s + checkpoint_s for insert_s, checkpoint_s in runs)
        ctx.record("narrow_whole_checkpointed_rows_per_s", narrow.num_rows / secs, "rows/s",
                   "  … counting the CHECKPOINT after it")
        rate = _insert_store_layout(Path(tmp, "store-layout.duckdb"), narrow)
        if rate is not None:
            ctx.record("narrow_store_layout_rows_per_s", rate, "rows/s",
                       "narrow, store's table layout, 32 k-row commits, then CHECKPOINT")
        insert_s, checkpoint_s = _insert_batches(Path(tmp, "w.duckdb"), WIDE_DDL, wide)
        ctx.record("wide_mb_per_s", mb(wide) / insert_s, "MB/s",
                   "wide by value, 512-row inserts, one commit each")
        ctx.record("wide_checkpoint_mb_per_s", mb(wide) / checkpoint_s, "MB/s",
                   "wide by value, CHECKPOINT afterwards")
        rate, how = _disk_write_rate(Path(tmp, "disk.bin"), ctx.pick(4, 10))
        ctx.record("disk_write_mb_per_s", rate, "MB/s",
                   f"disk: 48 MB {how} writes into a new file, then fsync")
