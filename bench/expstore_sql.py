"""What SQL pays to see by-reference values, against the same queries that do not read them.

One embedded store (no server: the cost is the store's, the transport is measured elsewhere)
holds rows whose ``response`` (1 KiB) is stored by reference, with a small ``prompt`` and a
``reward`` by value. Reading the whole column is timed once cold (a freshly opened store: blob
chunks read from the segment files and checked); then every query warm (chunks in the blob
store's small cache), alternated with its baseline run by run (the machine is shared: drift in
its load falls on both), medians. Baselines from the same run:

* the same query, through the same query path (guard, read-only transaction, time limit), on
  the table as stored, named with its catalog (``"x".main.t``, which the query view does not
  shadow), where ``response`` is NULL for by-reference values: what the query costs without
  resolving anything. For the query that does not use ``response`` the two must be equal: that
  is the fast path kept;
* for a whole-column read, :meth:`BlobStore.resolve` over all keys at once after the query
  (how ``SELECT *`` was resolved before the query views).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from bench.context import Ctx

NAME = "expstore_sql"
TITLE = "SQL over by-reference values (embedded store)"

VALUE_BYTES = 1024
PUT_ROWS = 4096

QUERIES = {
    # name: (SQL, what it shows)
    "by_value": ("SELECT input_id, avg(reward) AS r, max(length(prompt)) AS p FROM t "
                 "GROUP BY input_id ORDER BY input_id LIMIT 5",
                 "a query not touching the by-reference column"),
    "point": ("SELECT sample_id, reward FROM t WHERE row_id = 5",
              "one row's by-value columns (the view's fixed cost)"),
    "whole_column": ("SELECT sample_id, response FROM t", "every value of the column"),
    "like": ("SELECT count(*) FROM t WHERE response LIKE '%needle%'",
             "a function over every value"),
    "filtered": ("SELECT sample_id, response FROM t WHERE reward > 0.99",
                 "1 % of rows chosen by a by-value column"),
    "top": ("SELECT sample_id, response FROM t ORDER BY reward DESC LIMIT 10",
            "ORDER BY a by-value column, LIMIT 10"),
}


def _fill(s: Any, rows: int) -> None:
    import numpy as np

    s.create_table("t", {"prompt": "string", "response": "string", "reward": "float64"},
                   storage={"response": "ref"})
    rng = np.random.default_rng(0)
    for start in range(0, rows, PUT_ROWS):
        n = min(PUT_ROWS, rows - start)
        body = "x" * (VALUE_BYTES - 16)
        s.put("t", {"sample_id": [f"q{i // 8}_0_{i % 8}" for i in range(start, start + n)],
                    "prompt": [f"prompt {i}" for i in range(start, start + n)],
                    "response": [f"{i:>15} {body}" for i in range(start, start + n)],
                    "reward": rng.random(n).tolist()})


def _paired(fn: Callable[[], Any], base: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``base``, run alternately."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for i, f in enumerate((fn, base)):
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def run(ctx: Ctx) -> None:
    from store.embedded import EmbeddedStore

    rows = ctx.pick(20_000, 100_000)
    repeats = ctx.pick(5, 9)
    with tempfile.TemporaryDirectory(prefix="expstore-bench-sql-") as tmp:
        path = str(Path(tmp) / "x.duckdb")
        with EmbeddedStore(path) as s:
            _fill(s, rows)
        with EmbeddedStore(path) as s:
            def raw(sql: str) -> Any:
                return s.query(sql.replace("FROM t", 'FROM "x".main.t'))

            t0 = time.perf_counter()
            s.query(QUERIES["whole_column"][0])    # the first read of every blob chunk
            ctx.record("whole_column_cold_ms", (time.perf_counter() - t0) * 1e3, "ms",
                       "every value of the column, cold")
            for name, (sql, label) in QUERIES.items():
                warm, base = _paired(lambda: s.query(sql), lambda: raw(sql), repeats)
                ctx.record(f"{name}_ms", warm * 1e3, "ms", label)
                ctx.record(f"{name}_vs_stored", warm / base, "x",
                           f"{label}: / the same query unresolved")
                if name == "whole_column":
                    ctx.record("whole_column_mb_per_s", rows * VALUE_BYTES / 1e6 / warm, "MB/s",
                               "every value of the column")

            def after() -> Any:
                keys = s.query("SELECT sample_id, response__ref FROM t").column(1).to_pylist()
                return s.blobs.resolve(keys, pa.string())

            views, once = _paired(lambda: s.query(QUERIES["whole_column"][0]), after, repeats)
            ctx.record("whole_column_vs_after", views / once, "x",
                       "every value: query views / one resolve after the query")
