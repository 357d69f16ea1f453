"""Rebuilding the in-memory index from DuckDB when a store opens.

DuckDB is the durable record: the catalog gives tables and versions, and every live row (not
consumed, stale or dead) is loaded with its status bits, ready (or pending) again.

Leases are soft state (docs/architecture.md): opening the store voids every lease, whether its
bookkeeping reached DuckDB before the restart or not. Why not restore the ones written: their
bookkeeping is written lazily (within settings.lease_flush_delay), so a restore could only be partial
— a claim taken just before a kill came back, one taken a moment later did not. Void for all is
one rule a trainer can rely on: after a restart, every claim it holds is over, its rows are
delivered again (the delivery count keeps the one cut short), and a late ack or nack of it is
refused with LeaseExpired naming the restart.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import duckdb

from .barrier import SETTING_PREFIX
from .live import LiveTable, Row
from .settings import StoreSettings
from .naming import quote
from .putlog import LeaseUpdate
from .schema import TableDef


@dataclass
class State:
    live: dict[str, LiveTable] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    weights: dict[str, str | None] = field(default_factory=dict)
    #: Version group → its barrier timeout in seconds, where one was set.
    barrier_timeouts: dict[str, float] = field(default_factory=dict)
    terminal_possible: set[str] = field(default_factory=set)
    #: Claim ids found on live rows: leases that ended before the restart or that it voided. A
    #: late ack or nack of one is refused with LeaseExpired, not reported as unknown.
    ended: list[str] = field(default_factory=list)
    #: Per table, the bookkeeping that clears the lease columns of rows whose lease the restart
    #: voided (DuckDB still says processing until the writer writes it).
    voided: dict[str, list[LeaseUpdate]] = field(default_factory=dict)


def load_state(con: duckdb.DuckDBPyConnection,
               terminal_max: int = StoreSettings.terminal_index_max) -> State:
    state = State()
    for name, version in con.execute("SELECT name, version FROM _expstore_groups").fetchall():
        state.versions[name] = int(version)
    for group, uri in con.execute(
            "SELECT version_group, arg_max(weights_uri, version) FROM _expstore_versions "
            "GROUP BY 1").fetchall():
        state.weights[group] = uri
    for key, value in con.execute("SELECT key, value FROM _expstore_settings WHERE "
                                  "starts_with(key, ?)", [SETTING_PREFIX]).fetchall():
        state.barrier_timeouts[key[len(SETTING_PREFIX):]] = float(value)
    ended: set[str] = set()
    for name, definition in con.execute(
            "SELECT name, definition FROM _expstore_tables ORDER BY name").fetchall():
        tdef = TableDef.from_json(definition)
        max_row = con.execute(f"SELECT max(row_id), count(*) FILTER (WHERE consumed OR stale "
                              f"OR dead) FROM {quote(name)}").fetchone()
        assert max_row is not None  # an aggregate always returns one row
        live = LiveTable(tdef, next_row_id=(int(max_row[0]) + 1) if max_row[0] is not None else 0,
                         terminal_max=terminal_max)
        if max_row[1]:
            state.terminal_possible.add(name)
        status = ", ".join(quote(s) for s in tdef.status_columns)
        cursor = con.execute(
            f"SELECT row_id, sample_id, policy_version, input_id, turn, trajectory_id, "
            f"is_processing, lease_id, delivery_count, "
            f"{status} FROM {quote(name)} WHERE NOT consumed AND NOT stale AND NOT dead")
        ncols = len(tdef.columns)
        bound = state.versions.get(tdef.version_group, 0) - tdef.max_staleness
        while True:
            chunk = cursor.fetchmany(10_000)
            if not chunk:
                break
            for rec in chunk:
                (row_id, sid, version, input_id, turn, traj, processing, lease_id,
                 deliveries) = rec[:9]
                mask = sum(1 << i for i in range(ncols) if rec[9 + i])
                row = Row(int(row_id), sid, int(version), input_id, int(turn), int(traj),
                          mask, int(deliveries))
                live.rows[row.key] = row
                if lease_id:
                    ended.add(lease_id)
                if processing:  # its lease is void: see the module docstring
                    state.voided.setdefault(name, []).append(
                        LeaseUpdate.released(row.row_id, row.deliveries))
                if row.version < bound:
                    continue  # marked stale at the next bump; never delivered meanwhile
                if live.is_complete(row):
                    live.make_ready(row)
        _load_terminal(con, live, bound)
        state.live[name] = live
    state.ended = sorted(ended)
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
        if live.terminal_count + len(chunk) > live.terminal_max:
            live.terminal = None  # too many to keep: the writer asks DuckDB
            live.terminal_count = 0
            break
        for version, sid, row_id in chunk:
            live.remember_terminal(int(version), sid, int(row_id))
