"""The writer's put-log path: changes made durable in the put log before DuckDB has them.

A group of only fresh puts, acks and a bump (see ``Writer._log_puts``) becomes records
(store/putlog.py) appended to the log with one fsync, instead of a DuckDB transaction. The
records wait here, oldest first, until the writer applies them to DuckDB at the start of its
next transaction (at once when enough rows wait, else after ``settings.materialize_delay``; less
often while applying them keeps failing). The values of their rows stay in the claim cache until
then: DuckDB cannot serve them before.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa

from .blobs import BlobStore
from .index import StoreIndex
from .live import LiveTable
from .ops import Txn
from .putlog import LeaseUpdate, PutLog, Record, encode, record_rows
from .settings import StoreSettings

log = logging.getLogger("expstore.writer")


class LoggedChanges:
    """What the put log holds and DuckDB does not yet (see the module docstring).

    Args:
        putlog: the log file; None for a store without one (every group goes to DuckDB).
        index: the in-memory index (its claim cache holds the logged rows' values).
        blobs: the blob store, whose chunks are durable before any record that names them.
        settings: ``materialize_*`` and ``overlap_blob_bytes``.
    """

    def __init__(self, putlog: PutLog | None, index: StoreIndex, blobs: BlobStore,
                 settings: StoreSettings) -> None:
        self.putlog = putlog
        self._index = index
        self._blobs = blobs
        self._settings = settings
        #: The records, oldest first.
        self.records: list[Record] = []
        # The cached values of the logged rows, which the claim cache may drop once DuckDB
        # has them: (live table, the rows' keys, the values' Arrow table).
        self._values: list[tuple[LiveTable, list[tuple[str, int]], pa.Table]] = []
        #: Rows the records carry.
        self.rows = 0
        self._since: float | None = None  # when the oldest record was logged (monotonic)
        # After a failed insert of logged rows (a full disk), wait this long before the next try.
        self._retry_delay = settings.materialize_delay
        self._retry_at = 0.0
        #: After DuckDB was opened again: the records may be in it already (see Writer._recover).
        self.replay = False
        self._failing = False  # a put log write failed (logged once until one works)

    def __len__(self) -> int:
        return len(self.records)

    # -- when to apply them -------------------------------------------------------------------
    def seconds_to_due(self) -> float | None:
        """Seconds until the records are due by age (None without records)."""
        if self._since is None:
            return None
        return max(self._since + self._settings.materialize_delay,
                   self._retry_at) - time.monotonic()

    def due(self, checkpoint_running: bool) -> bool:
        """Whether to apply the records to DuckDB now: enough rows wait, or the oldest has
        waited long enough (while a checkpoint runs, only past ``materialize_max_rows``)."""
        if self._since is None:
            return False
        if checkpoint_running and self.rows < self._settings.materialize_max_rows:
            return False
        now = time.monotonic()
        return now >= self._retry_at and (
            self.rows >= self._settings.materialize_rows
            or now - self._since >= self._settings.materialize_delay)

    # -- appending ----------------------------------------------------------------------------
    def append(self, txn: Txn, updates: dict[str, list[LeaseUpdate]],
               blob_io: ThreadPoolExecutor) -> bool:
        """Make a logged group durable: its blob chunks (on ``blob_io`` while the records are
        encoded, when they are large), then its records (``txn.logged``, with the lease
        bookkeeping ``updates`` it carries). False when the log could not be written: nothing
        is applied, its chunks are rolled back and ``updates`` put back; DuckDB takes the group.
        """
        assert self.putlog is not None and txn.logged is not None
        blobs = self._blobs
        writing: Future | None = blob_io.submit(blobs.sync) \
            if blobs.pending_bytes >= self._settings.overlap_blob_bytes else None
        try:
            encoded = encode(txn.logged)
            if writing is None:
                blobs.sync()
            else:
                done, writing = writing, None
                done.result()  # the chunks are durable before any key to them is
            self.putlog.write(encoded)
        except Exception as e:  # noqa: BLE001 - nothing is applied yet: DuckDB takes the group
            if writing is not None:
                try:
                    writing.result()
                except Exception:  # noqa: BLE001 - the first error is the one logged
                    pass
            blobs.rollback()
            self._index.requeue_row_updates(updates)
            # Once until a write works again: on a full disk every group would log it.
            (log.debug if self._failing else log.warning)(
                "put log not written, the group goes to DuckDB: %s", e)
            self._failing = True
            return False
        self._failing = False
        self.records.extend(txn.logged)
        self._values.extend(txn.logged_values)
        self.rows += sum(record_rows(r) for r in txn.logged)
        if self._since is None:
            self._since = time.monotonic()
        return True

    # -- after applying them ------------------------------------------------------------------
    def applied(self) -> None:
        """The records are committed to DuckDB: forget them and cut the log back."""
        self.records = []
        self._evict_values()
        self.rows = 0
        self._since = None
        self._retry_delay = self._settings.materialize_delay
        self._retry_at = 0.0
        assert self.putlog is not None
        try:
            self.putlog.clear()
        except OSError as e:  # replay skips rows DuckDB has; only a drop + re-create could mind
            log.error("the put log could not be cut back: %s", e)

    def apply_failed(self) -> None:
        """Applying the records to DuckDB failed: try again later, less often while it keeps
        failing."""
        self._retry_at = time.monotonic() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, 5.0)

    def _evict_values(self) -> None:
        """Drop the cached values of rows just applied from the put log, newest first, while the
        claim cache is over its limit: DuckDB can serve them now."""
        values, self._values = self._values, []
        index = self._index
        if not index.cache.full:
            return
        with index.lock:
            while values and index.cache.full:
                live, keys, table = values.pop()
                live.evict(keys, table)
                del table  # the last reference: the cache counts its bytes back now

    def close(self) -> None:
        if self.putlog is not None:
            self.putlog.close()
