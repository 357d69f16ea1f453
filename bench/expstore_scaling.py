"""expstore claim latency as the table grows (1e5 → 1e6 rows; 1e7 with ``--full``), with the
server's resident memory at each size. A size whose fill would take longer than the budget at
the ingest rate seen so far is left out, with a note."""

from __future__ import annotations

import time
from typing import Any

from bench import expstore_server
from bench.context import Ctx
from bench.expstore_claims import claim_latencies, fill
from bench.util import percentiles_ms
from bench.workloads import NARROW_COLUMNS

NAME = "expstore_scaling"
TITLE = "expstore claim latency vs table size"


def run(ctx: Ctx) -> None:
    import store

    uri = expstore_server.uri(ctx)
    s = store.connect(uri)
    table = expstore_server.table_name("scaling")
    s.create_table(table, dict(NARROW_COLUMNS), if_not_exists=True)
    sizes = ctx.pick([100_000], [100_000, 1_000_000], [100_000, 1_000_000, 10_000_000])
    fill_budget = ctx.pick(30.0, 60.0, 900.0)
    points: list[dict[str, Any]] = []
    have, rate = 0, None
    for size in sizes:
        if rate is not None and (size - have) / rate > fill_budget:
            print(f"  left out {size:,} rows: filling at {rate:,.0f} rows/s would take "
                  f"{(size - have) / rate:.0f} s (budget {fill_budget:.0f} s; --full raises it)")
            continue
        t0 = time.perf_counter()
        fill(s, table, size - have, start=have)
        rate = (size - have) / (time.perf_counter() - t0)
        have = size
        claims, _, _ = claim_latencies(s, table, ctx.pick(200, 500), 16, group=False,
                                    budget_s=ctx.pick(1.5, 3.0))
        p50, p99 = percentiles_ms(claims)
        label = f"{size:.0e}".replace("+0", "")
        ctx.record(f"claim16_p50_ms_{label}", p50, "ms", f"claim 16 p50 at {size:,} rows")
        ctx.record(f"claim16_p99_ms_{label}", p99, "ms", f"claim 16 p99 at {size:,} rows")
        rss = expstore_server.rss_mb()
        if rss is not None:
            ctx.record(f"server_rss_mb_{label}", rss, "MB", f"server RSS at {size:,} rows")
        points.append({"rows": size, "p50_ms": p50, "p99_ms": p99, "rss_mb": rss})
    ctx.series("points", points)
    s.close()
