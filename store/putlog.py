"""The put log: small fresh puts, acks and version bumps are durable here before DuckDB has them.

Why: a one-row ``INSERT`` into an experience table costs DuckDB CPU that grows with the table's
width, and its ``COMMIT`` about as much again; an ack's ``UPDATE`` and a bump's two statements
cost about as much, each with its own ``BEGIN``/``COMMIT``. Appending the same change to a file
and fsyncing it takes a small fraction of that (the figures: docs/bench/history.md, "The round of
2026-11-24 01:18: the put log"). So the writer appends such a group to this log, fsyncs it and
acknowledges it (memory changes as after a commit); it applies the logged changes to DuckDB
later, many in one statement, at the start of its next DuckDB transaction (and at the latest
``settings.materialize_delay`` after the first, see writer.py). Every read of DuckDB waits for
that, so SQL sees every acknowledged change.

The file ``<database>.putlog`` holds the changes logged since the last materialization: records
of a 32-byte header (magic, header length, body length, XXH3-64 of both), a JSON header (the kind
of change and what it names) and a body, an Arrow IPC stream (the rows to insert, in the table's
own column names; the rows a bump makes stale). An ack's record has no body: the rows it consumes
are lists in its header (:func:`ack_record`; logs written before that carry them as a body, and
still replay). After the COMMIT that
applies them the file is cut back to empty. On open, :func:`replay` applies what a crash left
there. Applying a record twice changes nothing (a COMMIT whose cut did not happen): rows whose key
DuckDB already has are not inserted again, an ack or a bump writes the same values again. A torn
or damaged last record was never acknowledged and is dropped.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import struct
import time
from typing import Any, Iterator, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import xxhash

from .errors import StorageError
from .ipc import ipc_stream
from .naming import quote
from .sources import LIST_TYPES, registered

MAGIC = b"EXPSTPL1"
_HEADER = struct.Struct("<8sIIQQ")  # magic, header length, 0 (reserved), body length, digest

log = logging.getLogger("expstore.putlog")

#: (kind, header, body): kind "rows" {"table"} / rows to insert; "ack" {"table", and the
#: ACK_SCHEMA columns: see ack_record} / None (logs of earlier versions: {"table"} / the
#: ACK_SCHEMA columns); "leases" {"table"} / lease bookkeeping (LEASE_COLUMNS); "bump" {"group",
#: "version", "weights_uri", "at"} / table, row_id of the rows it makes stale.
Record = tuple[str, dict[str, Any], pa.Table | None]

#: The rows an ack consumes, as its UPDATE reads them.
ACK_SCHEMA = pa.schema([("row_id", pa.int64()), ("delivery_count", pa.int32()),
                        ("consumed_version", pa.int64()), ("lease_id", pa.string()),
                        ("lease_owner", pa.string()), ("updated_at", pa.timestamp("us", "UTC"))])



class LeaseUpdate(NamedTuple):
    """The lease bookkeeping of one row that a claim, a release or an expiry changed, queued by
    the store and written by the writer (to DuckDB, or to the put log as a "leases" record)."""
    row_id: int
    is_processing: bool
    lease_id: str | None
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    delivery_count: int
    stale: bool
    dead: bool

    @classmethod
    def released(cls, row_id: int, deliveries: int, *, stale: bool = False,
                 dead: bool = False) -> "LeaseUpdate":
        """A row out of its lease: ready again, or marked stale or dead."""
        return cls(row_id, False, None, None, None, deliveries, stale, dead)


# The DuckDB column (and its type) of each LeaseUpdate field, in the same order.
LEASE_COLUMNS = tuple(zip(LeaseUpdate._fields, (
    "BIGINT", "BOOLEAN", "VARCHAR", "VARCHAR", "TIMESTAMPTZ", "INTEGER", "BOOLEAN", "BOOLEAN")))


def ack_record(table: str, row_ids: list[int], deliveries: list[int], version: int,
               lease_id: str, owner: str) -> Record:
    """The rows an ack consumes in ``table``, as the put log holds them: their ids and delivery
    counts as lists in the record's JSON header, with the version, the lease and the time once;
    no body.

    Why not a body of Arrow rows (as logs of earlier versions hold acks, still read): building
    and serialising a small Arrow table per ack was the larger part of what an ack cost the
    writer before its ``fdatasync``, on the path of every waited ack. The acks that wait for
    DuckDB become one table when they are applied (:func:`apply_records`).
    """
    return ("ack", {"table": table, "row_id": row_ids, "delivery_count": deliveries,
                    "consumed_version": version, "lease_id": lease_id, "lease_owner": owner,
                    "updated_at": time.time_ns() // 1000}, None)


def record_rows(record: Record) -> int:
    """The rows a record inserts or changes."""
    _, header, rows = record
    return len(header["row_id"]) if rows is None else rows.num_rows


def log_path(database: str) -> str:
    return f"{database}.putlog"


class PutLog:
    """Appends records and fsyncs them; cut back to empty once DuckDB holds them."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise StorageError(f"the put log {path!r} cannot be opened: {e}") from e
        self.size = os.fstat(self._fd).st_size
        self._cut_unsynced = False

    def append(self, records: list[Record]) -> None:
        """Write records; durable when this returns."""
        self.write(encode(records))

    def write(self, blob: memoryview) -> None:
        """Write :func:`encode`'s bytes; durable when this returns."""
        try:
            at = 0
            while at < len(blob):
                at += os.write(self._fd, blob[at:])
            if self._cut_unsynced:  # the cut and the new records, durable together
                os.fsync(self._fd)
                self._cut_unsynced = False
            else:
                os.fdatasync(self._fd)
        except OSError as e:
            self._cut_back()  # drop a torn tail: the change is refused, nothing of it may replay
            raise StorageError(f"the put log {self.path!r} could not be written: {e}") from e
        self.size += len(blob)

    def clear(self) -> None:
        """Cut the log back to empty (its changes are committed to DuckDB).

        The cut becomes durable with the next append, or with :meth:`sync_cut`, which the writer
        calls before any other DuckDB commit. Until then a crash may leave the records, which
        replay to what DuckDB has already (applying a record twice changes nothing) as long as
        no other commit came after them. An fsync of its own here cost more per
        materialization than the appends it follows.
        """
        if self.size:
            os.ftruncate(self._fd, 0)
            self.size = 0
            self._cut_unsynced = True

    def sync_cut(self) -> None:
        """Make a cut durable: a later DuckDB commit (a nack, DDL: not logged) must not be
        followed, after a crash, by the replay of records it came after."""
        if self._cut_unsynced:
            os.fsync(self._fd)
            self._cut_unsynced = False

    def _cut_back(self) -> None:
        try:
            os.ftruncate(self._fd, self.size)
        except OSError:
            pass

    def close(self) -> None:
        os.close(self._fd)


def encode(records: list[Record]) -> memoryview:
    """Records as the bytes :meth:`PutLog.write` appends."""
    parts: list[bytes] = []
    for kind, header, rows in records:
        head = json.dumps({"kind": kind, **header}).encode()
        body = b"" if rows is None else ipc_stream(rows)
        digest = xxhash.xxh3_64(head)
        digest.update(body)
        parts += [_HEADER.pack(MAGIC, len(head), 0, len(body), digest.intdigest()), head, body]
    return memoryview(b"".join(parts))


def read_records(path: str) -> Iterator[Record]:
    """The whole records of a put log, in order; stops at a torn or damaged tail."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    at = 0
    while at + _HEADER.size <= len(data):
        magic, hlen, _, blen, digest = _HEADER.unpack_from(data, at)
        start = at + _HEADER.size
        end = start + hlen + blen
        if magic != MAGIC or end > len(data):
            break
        check = xxhash.xxh3_64(data[start:start + hlen])
        check.update(data[start + hlen:end])
        if check.intdigest() != digest:
            break
        header = json.loads(data[start:start + hlen])
        if not blen:  # an ack's lists in its header (ack_record)
            yield str(header.pop("kind")), header, None
        else:
            with pa.ipc.open_stream(pa.py_buffer(data[start + hlen:end])) as reader:
                yield str(header.pop("kind")), header, reader.read_all()
        at = end
    if at < len(data):
        log.warning("put log %r: %d bytes after the last whole record ignored (a write the "
                    "crash cut short, never acknowledged)", path, len(data) - at)


def apply_records(con: duckdb.DuckDBPyConnection, records: list[Record],
                  tables: set[str] | dict[str, Any], replaying: bool = False) -> int:
    """Apply logged changes to DuckDB (inside the caller's transaction); changes to tables not in
    ``tables`` are skipped (dropped since). ``replaying``: after a crash, when DuckDB may have
    some of the rows already. Returns the rows inserted.

    One statement per kind and table, not one per record (each statement has a fixed cost far
    above a record's; records alternate when acks and puts interleave), in an order that gives what the log order gives:
    first the inserts (every other change is of rows inserted before it, and a row is inserted
    once), then the acks (each row once: a consumed row is never claimed again), then the lease
    bookkeeping (the last entry of a row wins; it never touches a consumed row, so an ack
    logged after it wins either way: it writes the lease columns a consumed row keeps), then
    the bumps in order (they mark rows stale with an OR, as lease bookkeeping does).
    """
    # Per table, its rows grouped by schema (compared with equals: hashing a schema as wide as
    # a store table's, once per record, was a large part of an apply of one-row puts).
    inserts: dict[str, list[tuple[pa.Schema, list[pa.Table]]]] = {}
    acks: dict[str, list[pa.Table | dict[str, Any]]] = {}
    leases: dict[str, list[pa.Table]] = {}
    bumps: list[tuple[dict[str, Any], pa.Table]] = []
    for kind, header, rows in records:
        if kind not in ("rows", "ack", "leases", "bump"):
            raise StorageError(f"the put log holds a change of unknown kind {kind!r}")
        if kind == "ack":
            if header["table"] in tables:
                acks.setdefault(header["table"], []).append(header if rows is None else rows)
        elif rows is None:  # (only an ack's record has no body)
            raise StorageError(f"the put log holds a {kind!r} change without its rows")
        elif kind == "bump":
            bumps.append((header, rows))
        elif header["table"] not in tables:
            continue
        elif kind == "rows":
            shapes = inserts.setdefault(header["table"], [])
            schema = rows.schema
            for known, parts in shapes:
                if known.equals(schema):
                    parts.append(rows)
                    break
            else:
                shapes.append((schema, [rows]))
        else:
            leases.setdefault(header["table"], []).append(rows)
    inserted = 0
    for table, shapes in inserts.items():
        for _, parts in shapes:
            inserted += _insert(con, table, _one(parts), replaying)
    for table, acked in acks.items():
        _ack(con, table, _acked(acked))
    for table, parts in leases.items():
        rows = _one(parts)
        if len(parts) > 1:  # the last entry of each row
            ids = rows.column("row_id").to_numpy()[::-1]
            _, first = np.unique(ids, return_index=True)
            rows = rows.take(pa.array(len(ids) - 1 - first))
        with registered(con, "_expstore_logged", rows):
            con.execute(lease_update(table, "_expstore_logged"))
    for header, stale in bumps:
        _bump(con, header, stale, tables)
    return inserted


def _one(parts: list[pa.Table]) -> pa.Table:
    """One table of one chunk: DuckDB scans a table of many one-row chunks far slower."""
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts).combine_chunks()


def _acked(acks: list[pa.Table | dict[str, Any]]) -> pa.Table:
    """The rows some acks consumed as one table (ACK_SCHEMA): from the headers of
    :func:`ack_record`'s records, and the bodies of an earlier version's."""
    tables = [a for a in acks if isinstance(a, pa.Table)]
    listed = [a for a in acks if isinstance(a, dict)]
    if listed:
        counts = [len(h["row_id"]) for h in listed]

        def each(field: str) -> list[Any]:  # one value per ack, for each of its rows
            return [h[field] for h, n in zip(listed, counts) for _ in range(n)]
        tables.append(pa.Table.from_arrays([
            pa.array([i for h in listed for i in h["row_id"]], pa.int64()),
            pa.array([d for h in listed for d in h["delivery_count"]], pa.int32()),
            *(pa.array(each(f.name), f.type) for f in list(ACK_SCHEMA)[2:])], schema=ACK_SCHEMA))
    return _one(tables)


def _insert(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table, replaying: bool) -> int:
    """Insert logged rows. Replaying, keys DuckDB already has were inserted before the crash
    and are skipped (a join with the whole table: only then)."""
    names = ", ".join(quote(n) for n in rows.column_names)
    sql = f"INSERT INTO {quote(table)} ({names}) SELECT {names} FROM _expstore_logged AS b"
    if replaying:
        sql += (f" WHERE NOT EXISTS (SELECT 1 FROM {quote(table)} AS t WHERE "
                "t.sample_id = b.sample_id AND t.policy_version = b.policy_version)")
    with registered(con, "_expstore_logged", rows):
        row = con.execute(sql).fetchone()
    return int(row[0]) if row else 0


def lease_table(rows: list[LeaseUpdate]) -> pa.Table:
    """Lease bookkeeping entries as an Arrow table (columns as LEASE_COLUMNS)."""
    return pa.table({name: pa.array([getattr(r, name) for r in rows], LIST_TYPES[kind])
                     for name, kind in LEASE_COLUMNS})


def lease_update(table: str, source: str) -> str:
    """The UPDATE writing lease bookkeeping from ``source`` (columns as LEASE_COLUMNS).
    Rows consumed meanwhile stay consumed: only unconsumed ones are touched."""
    return (f"UPDATE {quote(table)} AS t SET is_processing = b.is_processing, "
            "lease_id = coalesce(b.lease_id, t.lease_id), "
            "lease_owner = coalesce(b.lease_owner, t.lease_owner), "
            "lease_expires_at = b.lease_expires_at, delivery_count = b.delivery_count, "
            "stale = t.stale OR b.stale, dead = t.dead OR b.dead "
            f"FROM {source} AS b WHERE t.row_id = b.row_id AND NOT t.consumed")


def _ack(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
    with registered(con, "_expstore_logged", rows):
        con.execute(
            f"UPDATE {quote(table)} AS t SET consumed = true, is_processing = false, "
            "consumed_version = b.consumed_version, lease_id = b.lease_id, "
            "lease_owner = b.lease_owner, delivery_count = b.delivery_count, "
            "updated_at = b.updated_at FROM _expstore_logged AS b WHERE t.row_id = b.row_id")


def _bump(con: duckdb.DuckDBPyConnection, header: dict[str, Any], stale: pa.Table,
          tables: set[str] | dict[str, Any]) -> None:
    group, version, at = header["group"], int(header["version"]), header["at"]
    # Never backwards, whatever a replay finds.
    con.execute("UPDATE _expstore_groups SET version = ?, updated_at = ?::TIMESTAMPTZ "
                "WHERE name = ? AND version < ?", [version, at, group, version])
    con.execute("INSERT INTO _expstore_versions (version_group, version, weights_uri, bumped_at) "
                "SELECT ?, ?, ?, ?::TIMESTAMPTZ WHERE NOT EXISTS (SELECT 1 FROM "
                "_expstore_versions WHERE version_group = ? AND version = ?)",
                [group, version, header.get("weights_uri"), at, group, version])
    by_table: dict[str, list[int]] = {}
    for table, row_id in zip(stale.column("table").to_pylist(),
                             stale.column("row_id").to_pylist()):
        by_table.setdefault(table, []).append(row_id)
    for table, row_ids in by_table.items():
        if table in tables:
            con.execute(f"UPDATE {quote(table)} SET stale = true, updated_at = ?::TIMESTAMPTZ "
                        "WHERE row_id IN (SELECT unnest(?::BIGINT[]))", [at, row_ids])


def replay(con: duckdb.DuckDBPyConnection, database: str) -> int:
    """Apply what a put log left behind (a crash before its changes reached DuckDB); returns the
    rows inserted. Runs before the store loads its state."""
    path = log_path(database)
    records = list(read_records(path))
    if records:
        tables = {r[0] for r in con.execute("SELECT name FROM _expstore_tables").fetchall()}
        con.execute("BEGIN TRANSACTION")
        try:
            inserted = apply_records(con, records, tables, replaying=True)
            con.execute("COMMIT")
        except BaseException as e:
            con.execute("ROLLBACK")
            raise StorageError(f"the put log {path!r} could not be replayed: {e}") from e
    else:
        inserted = 0
    if os.path.exists(path):
        log_file = PutLog(path)
        try:
            log_file.clear()
            log_file.sync_cut()
        finally:
            log_file.close()
    return inserted
