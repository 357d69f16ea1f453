"""Keeping a store's files in hand and reporting on them: garbage collection of rows and blob
segments, the store's health, the gauges monitoring samples and the bytes on disk.

The store's facade (store/embedded.py) answers its ``gc``, ``health``, ``gauges`` and
``disk_bytes`` with these functions, giving each the parts it reads.
"""
from __future__ import annotations

import os
from typing import Any

import duckdb
import pyarrow as pa

from .blobs import BlobStore
from .index import StoreIndex
from .naming import quote
from .ops import CallOp
from .putlog import log_path
from .retention import drop_finished_rows
from .writer import Writer


def gc_op(index: StoreIndex, blobs: BlobStore, states: tuple[str, ...],
          keep_versions: int) -> CallOp:
    """The writer's op for ``gc``: drop the finished rows in ``states`` that no write can reach
    any more (store/retention.py) outside the newest ``keep_versions`` versions, then delete
    the blob segments no row references; the op's answer: ``segments_removed``,
    ``bytes_freed`` and ``rows_dropped``.
    """
    def run(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
        dropped = 0
        for live in index.live.values():
            dropped += drop_finished_rows(
                con, live.tdef.name, states,
                index.version_of(live) - max(live.tdef.max_staleness, keep_versions))
        blobs.roll()
        live_segments: set[int] = set()
        for live in index.live.values():
            for c in live.tdef.columns:
                if c.ref:
                    rows = con.execute(
                        f"SELECT DISTINCT CAST(split_part({quote(c.ref)}, ':', 1) AS BIGINT) "
                        f"FROM {quote(live.tdef.name)} WHERE {quote(c.ref)} IS NOT NULL"
                    ).fetchall()
                    live_segments.update(int(r[0]) for r in rows)
        return {**blobs.collect(live_segments), "rows_dropped": dropped}
    return CallOp(run)


def health(index: StoreIndex, writer: Writer, closed: bool) -> dict[str, Any]:
    """The answer of ``EmbeddedStore.health``: ``status`` ok, closed or failed, with the cause
    in ``error`` (and, for a database that cannot be written, what waits in ``storage``)."""
    fatal, fault = writer.fatal, writer.fault
    failed = fatal is not None or fault is not None
    out: dict[str, Any] = {
        "status": "closed" if closed else "failed" if failed else "ok",
        "tables": len(index.live), "commits": writer.commits,
        "claim_cache_bytes": index.cache.used, "claim_cache_limit": index.cache.limit}
    if fatal is not None:
        out["error"] = repr(fatal)
    elif fault is not None:
        out["error"] = f"the database cannot be written: {fault.cause}"
        out["storage"] = fault.describe(writer.waiting_changes)
    return out


def gauges(index: StoreIndex, writer: Writer, disk: dict[str, int]) -> dict[str, Any]:
    """The answer of ``EmbeddedStore.gauges``: per table its version and rows by state, the
    writer's queue depth and whether it runs, and ``disk`` (:func:`disk_bytes`)."""
    return {"tables": index.table_gauges(), "writer_queue_depth": writer.queue_depth,
            "writer_running": writer.fatal is None, "disk": disk}


def disk_bytes(path: str, blobs: BlobStore) -> dict[str, int]:
    """Bytes on disk of the database at ``path``: ``database``, ``wal``, ``putlog``, ``blobs``
    (a file not there: 0)."""
    def size(file: str) -> int:
        try:
            return os.path.getsize(file)
        except OSError:
            return 0
    try:
        blob_bytes = blobs.disk_bytes()
    except (OSError, pa.ArrowException):  # a remote filesystem that cannot answer now
        blob_bytes = 0
    return {"database": size(path), "wal": size(f"{path}.wal"), "putlog": size(log_path(path)),
            "blobs": blob_bytes}
