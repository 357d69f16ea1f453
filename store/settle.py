"""Settling leases and bumping versions inside the writer's group transaction.

Each function runs a change's statements (or, in a group going to the put log, records them; see
:func:`record`) and queues its effect on the in-memory index for after the commit.

The caller's side of an ack or nack (the checks that answer at once, the Future it waits on) is
store/settler.py.
"""
from __future__ import annotations

import datetime as dt
import functools
from typing import Any

import duckdb
import pyarrow as pa

from .errors import NotFound, VersionConflict
from .index import StoreIndex
from .live import Lease, LiveTable, Row
from .naming import quote
from .ops import BumpOp, SettleOp, Txn
from .putlog import (LEASE_COLUMNS, LeaseUpdate, Record, ack_record, apply_records, lease_table,
                     lease_update)
from .sources import ListColumns, row_source


def settle(con: duckdb.DuckDBPyConnection, index: StoreIndex, txn: Txn,
           op: SettleOp) -> dict[str, Any]:
    """Ack (consume) or nack (return) the rows of a lease; memory follows after the commit."""
    lease = op.lease
    if op.ack:
        return _ack(con, index, txn, lease)
    with index.lock:
        plan = index.settle_plan(lease)
        index.supersede_row_updates(lease, plan)
    for tname, rows in plan.items():
        if tname not in index.live:
            continue
        nacked: ListColumns = {"row_id": ("BIGINT", [r.row_id for r, _ in rows]),
                               "delivery_count": ("INTEGER", [r.deliveries for r, _ in rows]),
                               "dead": ("BOOLEAN", [o == "dead" for _, o in rows]),
                               "stale": ("BOOLEAN", [o == "stale" for _, o in rows])}
        with row_source(con, "_expstore_nack", nacked) as (source, params):
            con.execute(
                f"UPDATE {quote(tname)} AS t SET is_processing = false, "
                "lease_expires_at = NULL, delivery_count = b.delivery_count, "
                "dead = b.dead, stale = t.stale OR b.stale, updated_at = now() "
                f"FROM {source} AS b WHERE t.row_id = b.row_id", params)
    txn.applies.append(functools.partial(index.settled, lease, plan, "nack"))
    return {"claim_id": lease.claim_id, "nacked": len(lease.rows)}


def _ack(con: duckdb.DuckDBPyConnection, index: StoreIndex, txn: Txn,
         lease: Lease) -> dict[str, Any]:
    """Consume the rows of a lease: :func:`settle` of an ack, every row's outcome known."""
    with index.lock:
        plan = index.ack_plan(lease)
    for tname, (live, _, row_ids, deliveries) in plan.items():
        if tname not in index.live:
            continue
        # The claim's lease columns may not be flushed yet (and never will be once the
        # row is consumed), so the ack writes the delivery count and owner itself.
        record(con, index, txn, ack_record(tname, row_ids, deliveries, index.version_of(live),
                                           lease.claim_id, lease.owner))
    txn.applies.append(functools.partial(index.acked, lease, plan))
    return {"claim_id": lease.claim_id, "acked": len(lease.rows)}


def record(con: duckdb.DuckDBPyConnection, index: StoreIndex, txn: Txn, record: Record) -> None:
    """A change as the put log holds it: logged in a logged group, else applied now (one
    statement text for either way, in store/putlog.py)."""
    if txn.logged is not None:
        txn.logged.append(record)
    else:
        apply_records(con, [record], index.live)


def bump(con: duckdb.DuckDBPyConnection, index: StoreIndex, txn: Txn, op: BumpOp) -> int:
    """Advance a version group's version (compare-and-set on ``op.expected``); rows below the
    new staleness bound become stale."""
    if op.group not in index.versions:
        raise NotFound(f"version group {op.group!r} does not exist")
    current = index.versions[op.group]
    if op.expected is not None and op.expected != current:
        raise VersionConflict(f"version of {op.group!r} is {current}, not the expected "
                              f"{op.expected}; another trainer bumped it first")
    new = current + 1
    stale: list[tuple[LiveTable, list[Row]]] = []
    for live in index.live.values():
        if live.tdef.version_group != op.group:
            continue
        bound = new - live.tdef.max_staleness
        with index.lock:  # building rows of blocks changes the ready index claims read
            live.build_blocks_below(bound)
        rows = live.stale_rows(bound)
        if rows:
            stale.append((live, rows))
    record(con, index, txn, ("bump", {
        "group": op.group, "version": new, "weights_uri": op.weights_uri,
        "at": dt.datetime.now(dt.timezone.utc).isoformat()}, pa.table({
            "table": pa.array([live.tdef.name for live, rows in stale for _ in rows],
                              pa.string()),
            "row_id": pa.array([r.row_id for _, rows in stale for r in rows],
                               pa.int64())})))

    txn.applies.append(functools.partial(index.apply_bump, op.group, new, op.weights_uri,
                                         stale))
    return new


def write_lease_updates(con: duckdb.DuckDBPyConnection, index: StoreIndex, txn: Txn) -> None:
    """Write the lease columns (and stale/dead flags) that claims and expiries changed."""
    updates = index.take_row_updates()
    if not updates:
        return
    txn.row_updates = updates
    for tname, rows in updates.items():
        if tname not in index.live:
            continue
        leases: ListColumns = {name: (kind, [getattr(r, name) for r in rows])
                               for name, kind in LEASE_COLUMNS}
        with row_source(con, "_expstore_leases", leases) as (source, params):
            con.execute(lease_update(tname, source), params)


def log_lease_updates(index: StoreIndex, txn: Txn) -> dict[str, list[LeaseUpdate]]:
    """The lease bookkeeping a logged group carries (as a DuckDB transaction would)."""
    assert txn.logged is not None
    updates = index.take_row_updates()
    for tname, rows in updates.items():
        if tname in index.live:
            txn.logged.append(("leases", {"table": tname}, lease_table(rows)))
    return updates
