"""Re-queueing dead rows (a *redrive*): which dead rows ``requeue`` brings back, and the statement
that does it.

A row is dead after ``max_deliveries`` deliveries, or when a cluster's coordinator dead-letters
it because its values were lost. Once the cause is fixed (a consumer that crashed on every row
of a kind, a bad deploy), an operator re-drives the dead rows, as SQS redrive or a Kafka DLQ
replay does: they are live again, their delivery count back to 0 (each gets
``max_deliveries`` new deliveries), ready where their required statuses are true (else pending).

Two kinds of dead rows stay dead, each counted in the answer:

* a row older than the table's staleness bound (``policy_version < version - max_staleness``):
  it would be stale at once, and a stale sample is never delivered (``skipped_stale``);
* a row whose values are gone (the coordinator names them: values held by lost data nodes
  only): it could never be delivered whole (``skipped_lost``).

The change goes through the writer like any other: durable on return, so after a restart (or a
``kill -9``) the rows are live, as DuckDB says. Like a put, it is refused (``TableFull``,
nothing requeued) where it would take the table past the store's ``max_live_rows``.
"""
from __future__ import annotations

from typing import Any

import duckdb

from .errors import TableFull
from .index import StoreIndex
from .live import LiveTable, Row
from .naming import quote
from .ops import CallOp
from .retention import DROPPABLE
from .schema import TableDef
from .sources import row_source

#: A dead row as ``stats`` counts it (dead, neither consumed nor stale).
DEAD = DROPPABLE["dead"]


def dead_row_ids(con: duckdb.DuckDBPyConnection, table: str) -> list[int]:
    """Row ids of ``table``'s dead rows."""
    rows = con.execute(f"SELECT row_id FROM {quote(table)} WHERE {DEAD} ORDER BY row_id"
                       ).fetchall()
    return [int(r[0]) for r in rows]


def requeue_rows(con: duckdb.DuckDBPyConnection, tdef: TableDef, row_ids: list[int],
                 bound: int) -> tuple[list[Row], int]:
    """Make the rows ``row_ids`` of ``tdef``'s table that are still dead and of a version at
    least ``bound`` live again (not dead, not processing, delivery count 0), in the caller's
    transaction.

    Returns the rows made live, as the in-memory index keeps them (status bits as on open, see
    store/recovery.py), and how many of ``row_ids`` stayed dead for being below ``bound``.
    """
    if not row_ids:
        return [], 0
    name = quote(tdef.name)
    status = ", ".join(quote(s) for s in tdef.status_columns)
    ids = {"row_id": ("BIGINT", row_ids)}
    with row_source(con, "_expstore_requeue", ids) as (source, params):
        below = con.execute(
            f"SELECT count(*) FROM {name} WHERE row_id IN (SELECT row_id FROM {source}) "
            f"AND {DEAD} AND policy_version < ?", [*params, bound]).fetchall()[0][0]
        revived = con.execute(
            f"UPDATE {name} SET dead = false, is_processing = false, delivery_count = 0, "
            "lease_expires_at = NULL, updated_at = now() "
            f"WHERE row_id IN (SELECT row_id FROM {source}) AND {DEAD} AND policy_version >= ? "
            f"RETURNING row_id, sample_id, policy_version, input_id, turn, trajectory_id, {status}",
            [*params, bound]).fetchall()
    rows = []
    for rec in revived:
        rid, sid, version, input_id, turn, traj = rec[:6]
        mask = sum(1 << i for i, done in enumerate(rec[6:]) if done)
        rows.append(Row(int(rid), sid, int(version), input_id, int(turn), int(traj), mask))
    return rows, int(below)


def requeue_op(index: StoreIndex, live: LiveTable, row_ids: list[int],
               skipped_lost: int) -> CallOp:
    """The writer's op for ``requeue``: the rows ``row_ids`` of ``live``'s table that are still
    dead and within the staleness bound made live, in DuckDB and then in the index; the op's
    answer: ``{"table", "requeued", "skipped_stale", "skipped_lost"}`` (the last as given: the
    caller left those rows out of ``row_ids``)."""
    name = live.tdef.name
    revived: list[Row] = []

    def run(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
        if index.live.get(name) is not live:
            raise index.no_table(name)  # dropped since
        rows, below = requeue_rows(con, live.tdef, row_ids,
                                   index.version_of(live) - live.tdef.max_staleness)
        limit = index.settings.max_live_rows
        if limit is not None and rows and len(live.rows) + len(rows) > limit:
            # (raised in the transaction: it rolls back, nothing is requeued)
            raise TableFull(
                f"requeue of {len(rows):,} dead rows would take table {name!r}, holding "
                f"{len(live.rows):,} live rows, past the store's max_live_rows of {limit:,}; "
                "requeue fewer at a time (where=…), or once consumers have acked rows")
        revived[:] = rows
        return {"table": name, "requeued": len(rows), "skipped_stale": below,
                "skipped_lost": skipped_lost}

    def apply(_: dict[str, Any]) -> None:
        if index.live.get(name) is live:
            for row in revived:
                live.revive(row)
            index.counters["rows_requeued"] += len(revived)

    return CallOp(run, apply)
