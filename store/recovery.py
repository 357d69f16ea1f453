"""Rebuilding the in-memory index from DuckDB when a store opens.

DuckDB is the durable record: the catalog gives tables and versions, and every live row (not
consumed, stale or dead) is loaded with its status bits. Leases whose expiry was written before a
crash and has not passed yet are restored, so a trainer that claimed before the restart can still
ack; all other rows are ready (or pending) again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import duckdb

from .live import TERMINAL_INDEX_MAX, Lease, LiveTable, Row
from .naming import quote
from .schema import TableDef


@dataclass
class State:
    live: dict[str, LiveTable] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    weights: dict[str, str | None] = field(default_factory=dict)
    terminal_possible: set[str] = field(default_factory=set)
    leases: list[Lease] = field(default_factory=list)
    #: Claim ids whose lease ended before the restart (expired, nacked, or voided by the crash):
    #: a late ack or nack of one is refused with LeaseExpired, not reported as unknown.
    ended: list[str] = field(default_factory=list)


def load_state(con: duckdb.DuckDBPyConnection) -> State:
    state = State()
    for name, version in con.execute("SELECT name, version FROM _expstore_groups").fetchall():
        state.versions[name] = int(version)
    for group, uri in con.execute(
            "SELECT version_group, arg_max(weights_uri, version) FROM _expstore_versions "
            "GROUP BY 1").fetchall():
        state.weights[group] = uri
    now = time.time()
    leases: dict[str, Lease] = {}
    ended: set[str] = set()
    for name, definition in con.execute(
            "SELECT name, definition FROM _expstore_tables ORDER BY name").fetchall():
        tdef = TableDef.from_json(definition)
        max_row = con.execute(f"SELECT max(row_id), count(*) FILTER (WHERE consumed OR stale "
                              f"OR dead) FROM {quote(name)}").fetchone()
        assert max_row is not None  # an aggregate always returns one row
        live = LiveTable(tdef, next_row_id=(int(max_row[0]) + 1) if max_row[0] is not None else 0)
        if max_row[1]:
            state.terminal_possible.add(name)
        status = ", ".join(quote(s) for s in tdef.status_columns)
        cursor = con.execute(
            f"SELECT row_id, sample_id, policy_version, input_id, turn, trajectory_id, "
            f"is_processing, lease_id, lease_owner, epoch(lease_expires_at), delivery_count, "
            f"{status} FROM {quote(name)} WHERE NOT consumed AND NOT stale AND NOT dead")
        ncols = len(tdef.columns)
        bound = state.versions.get(tdef.version_group, 0) - tdef.max_staleness
        while True:
            chunk = cursor.fetchmany(10_000)
            if not chunk:
                break
            for rec in chunk:
                (row_id, sid, version, input_id, turn, traj, processing, lease_id, owner,
                 expires, deliveries) = rec[:11]
                mask = sum(1 << i for i in range(ncols) if rec[11 + i])
                row = Row(int(row_id), sid, int(version), input_id, int(turn), int(traj),
                          mask, int(deliveries))
                live.rows[row.key] = row
                if row.version < bound:
                    continue  # marked stale at the next bump; never delivered meanwhile
                if processing and lease_id and expires is not None and expires > now:
                    lease = leases.get(lease_id)
                    if lease is None:
                        lease = leases[lease_id] = Lease(lease_id, owner or "anonymous",
                                                         float(expires), [])
                    live.lease_row(row, lease)
                    row.deliveries -= 1  # lease_row counts a delivery; this one was counted
                    lease.rows.append((live, row))
                    continue
                if lease_id:
                    ended.add(lease_id)
                if live.is_complete(row):
                    live.make_ready(row)
        _load_terminal(con, live, bound)
        state.live[name] = live
    state.leases = list(leases.values())
    state.ended = sorted(ended - leases.keys())
    return state


def _load_terminal(con: duckdb.DuckDBPyConnection, live: LiveTable, bound: int) -> None:
    """Terminal rows a put may still address (versions >= ``bound``; see LiveTable.terminal)."""
    name = live.tdef.name
    cursor = con.execute(
        f"SELECT policy_version, sample_id, row_id FROM {quote(name)} "
        "WHERE (consumed OR stale OR dead) AND policy_version >= ?", [bound])
    while live.terminal is not None:
        chunk = cursor.fetchmany(10_000)
        if not chunk:
            break
        if live.terminal_count + len(chunk) > TERMINAL_INDEX_MAX:
            live.terminal = None  # too many to keep: the writer asks DuckDB
            live.terminal_count = 0
            break
        for version, sid, row_id in chunk:
            live.remember_terminal(int(version), sid, int(row_id))
