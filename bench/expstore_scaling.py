"""expstore as its table grows from 1e5 to 1e7 narrow rows: at each size, claim latency (plain,
and with a predicate half the rows satisfy), ingest (a bulk put and one-sample puts into the
table), put → delivered latency and the server's resident memory.

The table's rows stay ready (nothing claims them while it grows), so a claim is served from a
backlog of that many rows: the in-memory index at its largest. What a put → delivered latency
means with such a backlog is queueing (a new row waits behind the backlog), so it is measured
on a second, empty table of the same server while the big one is live: what the big table costs
a delivery elsewhere (memory, the garbage collector walking its index). Puts into the big table
are measured as puts (one sample; a bulk put of ``PROBE_ROWS``), which is where its size could
cost a writer (key checks against its index).

A size whose fill would take longer than the budget at the rate seen so far, or whose rows would
not fit in the machine's free memory, is left out with a note.
"""

from __future__ import annotations

import time
from typing import Any

from bench import expstore_server
from bench.context import Ctx
from bench.expstore_claims import claim_latencies, fill, put_to_delivery
from bench.expstore_ingest import put_one_op
from bench.util import available_mb, percentiles_ms, run_for
from bench.workloads import NARROW_COLUMNS, narrow_table, rebatch

NAME = "expstore_scaling"
TITLE = "expstore as the table grows (1e5 → 1e7 rows)"

#: Rows of the bulk put timed at each size (the last rows of its fill).
PROBE_ROWS = 65_536
#: A claim predicate that half the rows satisfy (rewards are uniform in [0, 1)).
HALF = "reward < 0.5"
#: Server memory per ready narrow row, with room to spare (~450 bytes measured at 1e7): a size is
#: left out when the machine's available memory would not hold it.
BYTES_PER_ROW = 1_000


def label_of(size: int) -> str:
    return f"{size:.0e}".replace("+0", "")


def _record_percentiles(ctx: Ctx, name: str, samples: list[float], what: str,
                        size: int) -> tuple[float, float]:
    """Record ``samples``' p50 and p99 (ms) as ``<name>_p50_ms_<size>`` / ``…_p99_…``; ``what``
    names them, ``{q}`` standing for the percentile."""
    p50, p99 = percentiles_ms(samples)
    label = label_of(size)
    for q, value in (("p50", p50), ("p99", p99)):
        ctx.record(f"{name}_{q}_ms_{label}", value, "ms",
                   f"{what.format(q=q)} at {size:,} rows")
    return p50, p99


def run(ctx: Ctx) -> None:
    import store

    uri = expstore_server.uri(ctx)
    s = store.connect(uri)
    table = expstore_server.table_name("scaling")
    probe_t = expstore_server.table_name("scaling_deliver")
    s.create_table(table, dict(NARROW_COLUMNS), if_not_exists=True)
    s.create_table(probe_t, dict(NARROW_COLUMNS), if_not_exists=True)
    sub_store = store.connect(uri)
    sizes = ctx.pick([100_000], [100_000, 1_000_000, 10_000_000])
    fill_budget = ctx.pick(30.0, 150.0, 900.0)
    budget = ctx.pick(1.0, 2.0)
    points: list[dict[str, Any]] = []
    have, rate = 0, None
    put_op = put_one_op(uri, table)
    try:
        for size in sizes:
            if rate is not None and (size - have) / rate > fill_budget:
                print(f"  left out {size:,} rows: filling at {rate:,.0f} rows/s would take "
                      f"{(size - have) / rate:.0f} s (budget {fill_budget:.0f} s; --full "
                      "raises it)")
                continue
            free = available_mb()
            need = (size - have) * BYTES_PER_ROW / 1e6
            if free is not None and need > 0.75 * free:
                print(f"  left out {size:,} rows: they would take ~{need:,.0f} MB of the "
                      f"{free:,.0f} MB available")
                continue
            label = label_of(size)
            t0 = time.perf_counter()
            fill(s, table, size - have - PROBE_ROWS, start=have)
            probe = rebatch(narrow_table(PROBE_ROWS, start=size - PROBE_ROWS))
            t1 = time.perf_counter()
            s.put(table, probe)
            ingest = PROBE_ROWS / (time.perf_counter() - t1)
            rate = (size - have) / (time.perf_counter() - t0)
            have = size
            ctx.record(f"ingest_rows_per_s_{label}", ingest, "rows/s",
                       f"put of {PROBE_ROWS:,} narrow rows at {size:,} rows")

            claims, _, _ = claim_latencies(s, table, ctx.pick(200, 500), 16, group=False,
                                           budget_s=budget)
            c50, c99 = _record_percentiles(ctx, "claim16", claims, "claim 16 {q}", size)
            filtered, _, _ = claim_latencies(s, table, ctx.pick(100, 200), 16, group=False,
                                             budget_s=budget / 2, where=HALF)
            f50, f99 = _record_percentiles(
                ctx, "claim16_where", filtered,
                "claim 16 with a predicate (half the rows match) {q}", size)
            puts = run_for(put_op[0], budget, ctx.pick(200, 500))
            p50, p99 = _record_percentiles(ctx, "put1", puts, "one-sample put {q}", size)
            delivered = put_to_delivery(s, sub_store, probe_t, ctx.pick(200, 500), budget,
                                        start=len(points) * 10**6)
            d50, d99 = _record_percentiles(ctx, "deliver", delivered,
                                           "put → delivered {q} (second table)", size)

            rss = expstore_server.rss_mb()
            if rss is not None:
                ctx.record(f"server_rss_mb_{label}", rss, "MB", f"server RSS at {size:,} rows")
            points.append({"rows": size, "p50_ms": c50, "p99_ms": c99, "where_p50_ms": f50,
                           "where_p99_ms": f99, "put_p50_ms": p50,
                           "put_p99_ms": p99, "deliver_p50_ms": d50, "deliver_p99_ms": d99,
                           "ingest_rows_per_s": ingest, "rss_mb": rss})
    finally:
        put_op[1]()
        sub_store.close()
        s.close()
    ctx.series("points", points)
