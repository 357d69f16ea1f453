"""expstore ingest: bulk puts, one-sample puts (1 and 64 producers), partial writes.

Everything goes through the server (``grpc://``) unless labelled embedded. A bulk put is one
``put()`` of a table in 4,096-row batches (the client streams them in one do_put); every put
uses fresh sample IDs, so it measures inserts, not upserts of existing rows. Each measurement
runs for a time budget (or a maximum count), so a slow store makes the run slower, not endless.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from bench import expstore_server
from bench.context import Ctx
from bench.load import run_load
from bench.util import percentiles_ms, run_for
from bench.workloads import (BATCH_ROWS, NARROW_COLUMNS, WIDE_COLUMNS, mb, narrow_table, rebatch,
                             sample_ids, wide_table)

NAME = "expstore_ingest"
TITLE = "expstore ingest through the Flight server"

_ids = itertools.count()
_ids_lock = threading.Lock()


def bulk_rate(s: Any, table: str, base: pa.Table, budget_s: float, max_puts: int,
              unit_of: Callable[[pa.Table], float], first_id: int = 0,
              batch_rows: int = BATCH_ROWS,
              settle: Callable[[], object] | None = None) -> tuple[float, float]:
    """Units per second over bulk puts of ``base`` (fresh sample IDs each time), after one
    uncounted warm-up put, until ``budget_s`` passed or ``max_puts`` were made; and the same
    counting ``settle()`` after the last put too (``settle`` is called untimed after the warm-up
    as well; without it both figures are the same).

    Why settle: a store may acknowledge rows before it has done all it must do with them, e.g.
    compress them into its file at a later checkpoint; sustained ingest pays for that too.
    """
    n = base.num_rows
    units = secs = 0.0
    for i in range(max_puts + 1):
        data = rebatch(base.set_column(0, "sample_id", sample_ids(n, first_id + i * n)),
                       batch_rows)
        t0 = time.perf_counter()
        s.put(table, data)
        dt = time.perf_counter() - t0
        if i:  # the first put warms up the table (and the blob store)
            units += unit_of(data)
            secs += dt
            if secs > budget_s:
                break
        elif settle is not None:
            settle()
    settle_s = 0.0
    if settle is not None:
        t0 = time.perf_counter()
        settle()
        settle_s = time.perf_counter() - t0
    return units / secs, units / (secs + settle_s)


def put_one_op(uri: str, table: str) -> tuple[Any, Any]:
    """Load factory: one ``put()`` of one fresh sample per op."""
    import store

    s = store.connect(uri)
    base = narrow_table(1, seed=3)
    # input ids unique across threads and processes
    with _ids_lock:
        prefix = os.getpid() * 10**9 + next(_ids) * 10**6
    counter = itertools.count()

    def op() -> None:
        s.put(table, base.set_column(0, "sample_id", pa.array([f"{prefix + next(counter)}_0_0"])))

    return op, s.close


def partial_rate(s: Any, table: str, budget_s: float, chunk: int = 512) -> tuple[float, float]:
    """(samples/s, MB/s) of writing samples in three stages: prompt, then response with its
    tokens and logprobs, then reward — each stage a ``put()`` of ``chunk`` samples."""
    w = wide_table(chunk)
    reward = narrow_table(chunk).column("reward")
    samples = 0
    secs = 0.0
    for i in itertools.count():
        part = w.set_column(0, "sample_id", sample_ids(chunk, 10**8 + i * chunk))
        t0 = time.perf_counter()
        s.put(table, part.select(["sample_id", "prompt"]))
        s.put(table, part.select(["sample_id", "response", "token_ids", "logprobs"]))
        s.put(table, pa.table({"sample_id": part.column("sample_id"), "reward": reward}))
        secs += time.perf_counter() - t0
        samples += chunk
        if secs > budget_s:
            break
    per_sample = (mb(w) + reward.nbytes / 1e6) / chunk
    return samples / secs, samples * per_sample / secs


def run(ctx: Ctx) -> None:
    import store

    uri = expstore_server.uri(ctx)
    s = store.connect(uri)
    narrow_t, wide_t = expstore_server.table_name("narrow"), expstore_server.table_name("wide")
    s.create_table(narrow_t, dict(NARROW_COLUMNS), if_not_exists=True)
    s.create_table(wide_t, dict(WIDE_COLUMNS), if_not_exists=True)
    narrow = narrow_table(ctx.pick(65_536, 262_144))
    # As much per put() as the raw Flight baseline streams per do_put (100 / 300 MB), so that
    # both overlap sending one batch with handling the one before.
    wide = wide_table(4096 * ctx.pick(2, 6))
    budget = ctx.pick(2.0, 5.0)
    rows = lambda t: t.num_rows  # noqa: E731
    # The checkpoint compresses into the database file the rows that small group commits wrote
    # to DuckDB's WAL; sustained ingest pays it inside a commit each time the WAL reaches
    # DuckDB's threshold (512 MB: every ~3 M narrow rows).
    rate, settled = bulk_rate(s, narrow_t, narrow, budget, ctx.pick(4, 8), rows,
                              settle=s.checkpoint)
    ctx.record("narrow_rows_per_s", rate, "rows/s", "put narrow, 4,096-row batches")
    ctx.record("narrow_checkpointed_rows_per_s", settled, "rows/s",
               "  … counting the CHECKPOINT after the last put")
    rate, _ = bulk_rate(s, wide_t, wide, budget, ctx.pick(2, 4), mb)
    ctx.record("wide_mb_per_s", rate, "MB/s", "put wide, 4,096-row batches")
    rate, _ = bulk_rate(s, wide_t, wide, budget, ctx.pick(2, 4), mb, first_id=10**8,
                        batch_rows=512)
    ctx.record("wide512_mb_per_s", rate, "MB/s", "put wide, 512-row batches")

    lat = run_for(put_one_op(uri, narrow_t)[0], budget, ctx.pick(300, 1000))
    ctx.record("put1_per_s", len(lat) / sum(lat), "puts/s", "one-sample puts, 1 producer")
    p50, p99 = percentiles_ms(lat)
    ctx.record("put1_p50_ms", p50, "ms", "one-sample put p50, 1 producer")
    ctx.record("put1_p99_ms", p99, "ms", "one-sample put p99, 1 producer")
    res = run_load("bench.expstore_ingest:put_one_op", (uri, narrow_t), connections=64,
                   processes=2, seconds=ctx.pick(1.5, 3.0))
    ctx.record("put1_64_per_s", res.rate, "puts/s", "one-sample puts, 64 producers")
    if res.ops:
        ctx.record("put1_64_p99_ms", res.p99_ms, "ms", "  … p99 per put")
    if res.errors:
        ctx.record("put1_64_errors", res.errors, "errors", f"  … failed puts ({res.first_error})")

    partial_t = expstore_server.table_name("partial")
    s.create_table(partial_t, {**WIDE_COLUMNS, "reward": "float64"}, if_not_exists=True)
    per_s, mb_s = partial_rate(s, partial_t, budget)
    ctx.record("partial_samples_per_s", per_s, "samples/s",
               "partial writes (prompt, response, reward), 512/put")
    ctx.record("partial_mb_per_s", mb_s, "MB/s", "  … as wide MB/s")
    rss = expstore_server.rss_mb()
    if rss is not None:
        ctx.record("server_rss_mb", rss, "MB", "server RSS after ingest")
    s.close()

    with tempfile.TemporaryDirectory(prefix="bench-embedded-") as tmp:
        e = store.connect(str(Path(tmp, "embedded.duckdb")))
        try:
            e.create_table("narrow", dict(NARROW_COLUMNS), if_not_exists=True)
            e.create_table("wide", dict(WIDE_COLUMNS), if_not_exists=True)
            rate, _ = bulk_rate(e, "narrow", narrow, budget, ctx.pick(4, 8), rows)
            ctx.record("embedded_narrow_rows_per_s", rate, "rows/s", "embedded put narrow")
            rate, _ = bulk_rate(e, "wide", wide, budget, ctx.pick(2, 4), mb)
            ctx.record("embedded_wide_mb_per_s", rate, "MB/s", "embedded put wide")
        finally:
            e.close()
