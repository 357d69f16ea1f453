"""The put log: small fresh puts are durable here before DuckDB holds them.

Why: a one-row ``INSERT`` into an experience table costs ~1 ms of DuckDB's CPU (~25 µs per column
of the 29-column layout) and its ``COMMIT`` another ~0.8–1.4 ms, while appending the same row to a
file and fsyncing it takes ~0.1 ms here. So a group of puts whose rows are all new is appended to
this log, fsynced and acknowledged; the writer inserts the logged rows into DuckDB later, many puts
in one statement, at the start of its next DuckDB transaction (and at the latest
``MATERIALIZE_DELAY`` after the first, see writer.py). Every read of DuckDB waits for that, so SQL
sees every acknowledged write.

The file ``<database>.putlog`` holds the rows logged since the last materialization: records of
a 32-byte header (magic, version, header length, body length, XXH3-64 of both), a JSON header
naming the table, and the rows as an Arrow IPC stream in the table's own column names. After the
COMMIT that inserts them the file is cut back to empty. On open, :func:`replay` inserts what a
crash left there; rows whose key DuckDB already has were inserted by a COMMIT whose cut did not
happen, and are skipped. A torn last record was never acknowledged and is dropped.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import duckdb
import pyarrow as pa
import xxhash

from .errors import StorageError
from .naming import quote

MAGIC = b"EXPSTPL1"
_HEADER = struct.Struct("<8sIIQQ")  # magic, header length, 0 (reserved), body length, digest


def log_path(database: str) -> str:
    return f"{database}.putlog"


class PutLog:
    """Appends records and fsyncs them; cut back to empty once DuckDB holds them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = os.fstat(self._fd).st_size

    def append(self, records: list[tuple[str, pa.Table]]) -> None:
        """Write ``(table, rows)`` records; durable when this returns."""
        parts: list[bytes] = []
        for table, rows in records:
            header = json.dumps({"table": table}).encode()
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, rows.schema) as writer:
                writer.write_table(rows)
            body = sink.getvalue()
            digest = xxhash.xxh3_64(header)
            digest.update(memoryview(body))
            parts += [_HEADER.pack(MAGIC, len(header), 0, body.size, digest.intdigest()), header,
                      body.to_pybytes()]
        blob = memoryview(b"".join(parts))
        try:
            at = 0
            while at < len(blob):
                at += os.write(self._fd, blob[at:])
            os.fdatasync(self._fd)
        except OSError as e:
            self._cut_back()  # drop a torn tail: the put is refused, nothing of it may replay
            raise StorageError(f"the put log {self.path!r} could not be written: {e}") from e
        self.size += len(blob)

    def clear(self) -> None:
        """Cut the log back to empty (its rows are committed to DuckDB). Durable, so that no
        record outlives a later drop and re-create of its table."""
        if self.size:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            self.size = 0

    def _cut_back(self) -> None:
        try:
            os.ftruncate(self._fd, self.size)
        except OSError:
            pass

    def close(self) -> None:
        os.close(self._fd)


def read_records(path: str) -> Iterator[tuple[str, pa.Table]]:
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
            return
        check = xxhash.xxh3_64(data[start:start + hlen])
        check.update(data[start + hlen:end])
        if check.intdigest() != digest:
            return
        header = json.loads(data[start:start + hlen])
        with pa.ipc.open_stream(pa.py_buffer(data[start + hlen:end])) as reader:
            yield str(header["table"]), reader.read_all()
        at = end


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table,
                skip_existing: bool = False) -> int:
    """Insert logged rows into their table (inside the caller's transaction); returns how many
    were inserted."""
    names = ", ".join(quote(n) for n in rows.column_names)
    sql = f"INSERT INTO {quote(table)} ({names}) SELECT {names} FROM _expstore_logged AS b"
    if skip_existing:
        sql += (f" WHERE NOT EXISTS (SELECT 1 FROM {quote(table)} AS t WHERE "
                "t.sample_id = b.sample_id AND t.policy_version = b.policy_version)")
    con.register("_expstore_logged", rows)
    try:
        row = con.execute(sql).fetchone()
        return int(row[0]) if row else 0
    finally:
        con.unregister("_expstore_logged")


def replay(con: duckdb.DuckDBPyConnection, database: str) -> int:
    """Insert what a put log left behind (a crash before its rows reached DuckDB); returns the
    rows inserted. Runs before the store loads its state."""
    path = log_path(database)
    records = list(read_records(path))
    if not records:
        return 0
    tables = {r[0] for r in con.execute("SELECT name FROM _expstore_tables").fetchall()}
    inserted = 0
    con.execute("BEGIN TRANSACTION")
    try:
        for table, rows in records:
            if table not in tables:
                continue  # dropped after its rows were committed
            inserted += insert_rows(con, table, rows, skip_existing=True)
        con.execute("COMMIT")
    except BaseException as e:
        con.execute("ROLLBACK")
        raise StorageError(f"the put log {path!r} could not be replayed: {e}") from e
    log = PutLog(path)
    try:
        log.clear()
    finally:
        log.close()
    return inserted
