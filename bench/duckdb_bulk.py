"""Baseline: in-process DuckDB bulk inserts from Arrow into a database file, no server.

Every 4,096-row batch is one ``INSERT … SELECT`` committed on its own (what a durable 4,096-row
put costs at least); a single whole-table insert is reported beside it. Wide rows are stored by
value, and the explicit ``CHECKPOINT`` afterwards (string compression) is timed on its own.
"""

from __future__ import annotations

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


def _insert_whole(path: Path, ddl: str, table: pa.Table) -> float:
    con = duckdb.connect(str(path))
    try:
        con.execute(ddl)
        con.register("incoming", table)
        t0 = time.perf_counter()
        con.execute("INSERT INTO t SELECT * FROM incoming")
        return time.perf_counter() - t0
    finally:
        con.close()


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
        secs = statistics.median(_insert_whole(Path(tmp, f"nw{i}.duckdb"), NARROW_DDL, narrow)
                                 for i in range(repeats))
        ctx.record("narrow_whole_rows_per_s", narrow.num_rows / secs, "rows/s",
                   "narrow, one whole-table insert")
        insert_s, checkpoint_s = _insert_batches(Path(tmp, "w.duckdb"), WIDE_DDL, wide)
        ctx.record("wide_mb_per_s", mb(wide) / insert_s, "MB/s",
                   "wide by value, 512-row inserts, one commit each")
        ctx.record("wide_checkpoint_mb_per_s", mb(wide) / checkpoint_s, "MB/s",
                   "wide by value, CHECKPOINT afterwards")
