"""What ``stats`` and ``leases`` report: a table's rows by state and version, and the claims
leased now.

The store's facade (store/embedded.py) answers its ``stats`` and ``leases`` with these
functions, giving each the index it reads.
"""
from __future__ import annotations

from typing import Any

import duckdb

from .index import StoreIndex
from .live import LiveTable
from .naming import quote


def table_stats(index: StoreIndex, live: LiveTable,
                con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """One table's stats: rows by state (pending, ready, processing, consumed, stale, dead),
    its version and rows per version. Run on the writer thread between two groups (see
    :class:`store.ops.ReadOp`), so that the counts in DuckDB and in memory agree.

    Raises:
        NotFound: the table was dropped since the caller looked it up.
    """
    name = live.tdef.name
    if index.live.get(name) is not live:
        raise index.no_table(name)
    per_version = con.execute(
        f"SELECT policy_version, count(*), count(*) FILTER (WHERE consumed), "
        f"count(*) FILTER (WHERE stale AND NOT consumed), "
        f"count(*) FILTER (WHERE dead AND NOT consumed AND NOT stale) "
        f"FROM {quote(name)} GROUP BY 1 ORDER BY 1").fetchall()
    with index.lock:
        ready, processing = live.ready_count, live.leased_count
        live_rows = len(live.rows)
        version = index.version_of(live)
        # Expired leases' stale/dead rows left memory; their flags are not written yet.
        unflushed = index.unwritten_row_updates(name)
    total, consumed, stale, dead = (sum(int(r[i]) for r in per_version) for i in (1, 2, 3, 4))
    stale += sum(1 for u in unflushed if u.stale)
    dead += sum(1 for u in unflushed if u.dead and not u.stale)
    return {
        "version": version, "version_group": live.tdef.version_group,
        "rows": total, "pending": live_rows - ready - processing, "ready": ready,
        "processing": processing, "consumed": consumed, "stale": stale, "dead": dead,
        "rows_per_version": {int(r[0]): int(r[1]) for r in per_version},
    }


def lease_list(index: StoreIndex, table: str | None) -> list[dict[str, Any]]:
    """The claims leased now (of those with rows of ``table``, when given), soonest expiry
    first: ``claim_id``, ``consumer``, ``expires_at``, ``state`` and rows per table.

    Raises:
        NotFound: ``table`` is unknown (as for stats).
    """
    if table is not None:
        index.live_table(table)
    with index.lock:
        out = []
        for lease in index.claims.values():
            tables: dict[str, int] = {}
            for live, _ in lease.rows:
                tables[live.tdef.name] = tables.get(live.tdef.name, 0) + 1
            if table is not None and table not in tables:
                continue
            out.append({"claim_id": lease.claim_id, "consumer": lease.owner,
                        "expires_at": lease.expires_at, "state": lease.state,
                        "rows": tables})
        return sorted(out, key=lambda d: d["expires_at"])
