"""When and where the writer folds DuckDB's WAL into the database file (a CHECKPOINT).

Why on a thread of their own: a put, ack or bump that arrives meanwhile (a trainer's bump after
seconds of training) goes to the put log at once instead of waiting for the checkpoint (long next
to a write even for a small WAL, seconds for a large one). The writer's own DuckDB transactions
wait for it (:meth:`Checkpoints.finish`).

Why the writer starts them, not DuckDB's own WAL threshold: under sustained ingest (no idle time)
DuckDB checkpoints inside the COMMIT that crosses it, on its usual threads (every core but one:
one thread on 2 cores): every few million rows one bulk put took many times as long as the
others, and every write waited behind it. Here the same checkpoint runs on the checkpoint thread
with every core (so it ends sooner), as an idle one does.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import duckdb

from .opening import invalidated, run_checkpoint
from .settings import StoreSettings

log = logging.getLogger("expstore.writer")


class Checkpoints:
    """The writer's checkpoints: at most one running, on the checkpoint thread.

    Args:
        settings: ``checkpoint_idle_seconds`` and ``wal_checkpoint_bytes``.
        wal_path: DuckDB's WAL file, measured after commits.
        wake: called when a checkpoint ends (logged rows may be waiting for it).
    """

    def __init__(self, settings: StoreSettings, wal_path: str, wake: Callable[[], None]) -> None:
        self._settings = settings
        self._wal_path = wal_path
        self._wake = wake
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expstore-checkpoint")
        self._running: Future | None = None
        self._last_commit = time.monotonic()
        self._dirty = False
        self._wal_retry_at = 0.0  # after a deferred checkpoint of a full WAL, when to try again
        # Whether the WAL may have reached settings.wal_checkpoint_bytes since it was last
        # measured: only the writer's DuckDB commits grow it, so groups made durable in the put
        # log (a trainer's acks, small puts) do not measure it again.
        self._wal_may_be_full = True

    def committed(self) -> None:
        """A DuckDB transaction of the writer committed: the WAL grew."""
        self._last_commit = time.monotonic()
        self._dirty = True
        self._wal_may_be_full = True

    def reopened(self) -> None:
        """DuckDB was opened again (it replayed its WAL): forget a checkpoint that ran on the
        invalid database."""
        if self._running is not None:
            try:
                self._running.result()
            except Exception:  # noqa: BLE001 - it failed on the invalid database: expected
                pass
            self._running = None
        self._wal_may_be_full = True
        self._dirty = True

    def start_if_idle(self, con: duckdb.DuckDBPyConnection) -> None:
        """Start a CHECKPOINT once DuckDB has been idle a while.

        Why idle: checkpoints compress strings and can stall for seconds; run them when idle,
        not when DuckDB's WAL threshold happens to trip in the middle of a producer's put.
        """
        if self._running is not None or not self._dirty or \
                time.monotonic() - self._last_commit < self._settings.checkpoint_idle_seconds:
            return
        self._start(con)

    def start_if_wal_full(self, con: duckdb.DuckDBPyConnection) -> None:
        """Start a CHECKPOINT, on every core, once DuckDB's WAL holds
        settings.wal_checkpoint_bytes (see the module docstring)."""
        if not self._wal_may_be_full or self._running is not None:
            return
        try:
            size = os.path.getsize(self._wal_path)
        except OSError:  # no WAL: nothing committed since the last checkpoint
            size = 0
        if size < self._settings.wal_checkpoint_bytes:
            self._wal_may_be_full = False
        elif time.monotonic() >= self._wal_retry_at:
            self._start(con)  # measured again once it ends (deferred: still full)

    def _start(self, con: duckdb.DuckDBPyConnection) -> None:
        self._dirty = False
        self._running = self._io.submit(_checkpoint, con.cursor())
        self._running.add_done_callback(lambda _: self._wake())

    @property
    def running(self) -> bool:
        """Whether a checkpoint was started and not yet reaped by :meth:`finish`."""
        return self._running is not None

    def ended(self) -> bool:
        """Whether a started checkpoint has ended (reap it with :meth:`finish`)."""
        return self._running is not None and self._running.done()

    def finish(self, con: duckdb.DuckDBPyConnection) -> duckdb.Error | None:
        """Wait for a running checkpoint (before any DuckDB transaction of the writer); the
        error when it invalidated the database (a full disk: see storage_fault.py)."""
        if self._running is None:
            return None
        running, self._running = self._running, None
        error = running.result()
        if error is not None and invalidated(con, error):
            return error
        if error is not None:
            # deferred (a reader's snapshot): again when next idle, or in a second if the
            # WAL is full; DuckDB's own threshold remains behind it
            self._dirty = True
            self._wal_retry_at = time.monotonic() + 1.0
        return None

    def close(self) -> None:
        self._io.shutdown()


def _checkpoint(cursor: duckdb.DuckDBPyConnection) -> duckdb.Error | None:
    """Run a CHECKPOINT on a cursor of its own (then closed); the error when it failed (the
    caller tells a deferred one from one that invalidated the database)."""
    try:
        run_checkpoint(cursor)
        return None
    except duckdb.Error as e:  # a reader holding a snapshot can defer it; the caller retries
        log.debug("checkpoint deferred or failed: %s", e)
        return e
    finally:
        cursor.close()
