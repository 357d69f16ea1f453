"""The rollout side's buffered writer.

Rollout code calls :meth:`ExperienceWriter.write` from any thread as samples (or parts of them)
finish; a background thread sends them in batches. The writer

* is a context manager whose exit flushes and closes (as Reverb's trajectory writer);
* applies back-pressure: a full buffer blocks ``write`` (up to ``write_timeout``) instead of
  growing without bound;
* retries transient failures (server restarting, network) with exponential backoff; resending is
  harmless because writes are upserts;
* is version-aware: rows without ``policy_version`` are stamped with the current version, which a
  background long-poll keeps fresh (no polling loop), and ``on_bump`` callbacks fire on a bump
  so that the rollout reloads weights.

>>> import store, tempfile, os
>>> s = store.connect(os.path.join(tempfile.mkdtemp(), "x.duckdb"))
>>> _ = s.create_table("solver", {"prompt": "string", "reward": "float64"})
>>> with ExperienceWriter(s, "solver") as w:
...     w.write({"sample_id": "q1_0_0", "prompt": "2+2?"})
...     w.write({"sample_id": "q1_0_0", "reward": 1.0})     # parts of one sample merge
>>> s.query("SELECT prompt, reward FROM solver").to_pylist()
[{'prompt': '2+2?', 'reward': 1.0}]
>>> s.close()
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import store as store_pkg
from store.errors import ExpstoreError, InvalidArgument, StaleVersion, StoreClosed, Unavailable

log = logging.getLogger("expstore.producer")

TRANSIENT = (Unavailable,)


class ExperienceWriter:
    """Buffered, retrying, version-aware writer of samples to one table.

    Args:
        target: a store (``store.connect(...)``) or a URI/path to connect to.
        table: the experience table.
        batch_rows: send when this many samples are buffered.
        flush_interval: send at least this often (seconds) while anything is buffered.
        max_buffer_rows: back-pressure: ``write`` blocks while this many samples wait.
        write_timeout: how long ``write`` may block on a full buffer before raising.
        max_retries, backoff: retry transient errors ``max_retries`` times, doubling ``backoff``.
        track_version: keep :attr:`version` fresh with a background long-poll.
    """

    def __init__(self, target: Any, table: str, *, batch_rows: int = 256,
                 flush_interval: float = 0.05, max_buffer_rows: int = 16384,
                 write_timeout: float | None = 60.0, max_retries: int = 8,
                 backoff: float = 0.05, track_version: bool = True) -> None:
        if batch_rows < 1 or max_buffer_rows < batch_rows:
            raise InvalidArgument(f"batch_rows {batch_rows} must be ≥ 1 and ≤ max_buffer_rows "
                                  f"{max_buffer_rows}")
        self._owns_store = isinstance(target, str)
        self.store = store_pkg.connect(target) if isinstance(target, str) else target
        self.table = table
        self.batch_rows = batch_rows
        self.flush_interval = flush_interval
        self.max_buffer_rows = max_buffer_rows
        self.write_timeout = write_timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.version = self.store.get_version(table)
        self.rows_written = 0
        self._buffer: dict[tuple[str, int | None], dict[str, Any]] = {}
        self._in_flight = 0
        self._flushing = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._on_bump: list[Callable[[int, str | None], None]] = []
        self._on_stale: list[Callable[[dict[str, Any], StaleVersion], None]] = []
        #: Samples refused because their policy version went stale before they were sent.
        self.stale_rows: list[dict[str, Any]] = []
        self._sender = threading.Thread(target=self._send_loop, name="expstore-writer-send",
                                        daemon=True)
        self._sender.start()
        self._watcher: threading.Thread | None = None
        if track_version:
            self._watcher = threading.Thread(target=self._watch_version,
                                             name="expstore-writer-version", daemon=True)
            self._watcher.start()

    # -- writing -----------------------------------------------------------------------------------
    def write(self, rows: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> None:
        """Buffer one sample (a dict) or several; parts of one sample merge in order.

        Raises:
            the first error the background sender hit (it is not retried again), or
            TimeoutError when the buffer stayed full for ``write_timeout`` seconds.
        """
        batch = [rows] if isinstance(rows, Mapping) else list(rows)
        deadline = None if self.write_timeout is None else time.monotonic() + self.write_timeout
        with self._cond:
            for row in batch:
                self._raise_if_failed()
                if "sample_id" not in row:
                    raise InvalidArgument(f"row {dict(row)!r} has no 'sample_id'")
                while len(self._buffer) >= self.max_buffer_rows:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"the write buffer stayed full ({self.max_buffer_rows} "
                                           f"samples) for {self.write_timeout} s: the store is "
                                           "not keeping up")
                    self._cond.wait(remaining)
                    self._raise_if_failed()
                key = (row["sample_id"], row.get("policy_version"))
                into = self._buffer.setdefault(key, {})
                for column, value in row.items():
                    if value is not None or column not in into:
                        into[column] = value
            if len(self._buffer) >= self.batch_rows:
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything written so far is durable (or raise the sender's error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flushing += 1  # the sender sends now instead of waiting for flush_interval
            self._cond.notify_all()
            try:
                self._wait_sent(deadline, timeout)
            finally:
                self._flushing -= 1

    def _wait_sent(self, deadline: float | None, timeout: float | None) -> None:
        with self._cond:
            while self._buffer or self._in_flight:
                self._raise_if_failed()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"flush did not finish within {timeout} s "
                                       f"({len(self._buffer) + self._in_flight} samples left)")
                self._cond.wait(remaining if remaining is not None else 0.5)
            self._raise_if_failed()

    def on_stale(self, callback: Callable[[dict[str, Any], StaleVersion], None]) -> None:
        """Call ``callback(row, error)`` for each sample refused as stale (a bump overtook it).

        Such samples are not written and are kept in :attr:`stale_rows`: regenerate them with the
        current policy. They never poison the writer: other samples are still sent.
        """
        self._on_stale.append(callback)

    def on_bump(self, callback: Callable[[int, str | None], None]) -> None:
        """Call ``callback(new_version, weights_uri)`` after each version bump."""
        self._on_bump.append(callback)

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the background threads, close the store if this writer opened it."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._sender.join(timeout=10)
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> "ExperienceWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # keep the original error; still try to send what was written
            try:
                self.close(timeout=30)
            except Exception as e:  # noqa: BLE001
                log.warning("flushing on error exit failed: %s", e)

    # -- background ---------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                deadline = time.monotonic() + self.flush_interval
                while not self._closed and len(self._buffer) < self.batch_rows:
                    remaining = deadline - time.monotonic()
                    if (remaining <= 0 or self._flushing) and self._buffer:
                        break
                    self._cond.wait(remaining if remaining > 0 else self.flush_interval)
                if self._closed and not self._buffer:
                    return
                if self._error is not None:
                    self._buffer.clear()
                    self._cond.notify_all()
                    if self._closed:
                        return
                    continue
                rows = list(self._buffer.values())
                self._buffer.clear()
                self._in_flight = len(rows)
                self._cond.notify_all()
            version = self.version
            for row in rows:
                if row.get("policy_version") is None:
                    row["policy_version"] = version
            try:
                self._put_with_retries(rows)
            except BaseException as e:  # noqa: BLE001 - surfaced to the producer on write/flush
                with self._cond:
                    self._error = e
            with self._cond:
                if self._error is None:
                    self.rows_written += len(rows)
                self._in_flight = 0
                self._cond.notify_all()

    def _put_with_retries(self, rows: list[dict[str, Any]]) -> None:
        delay = self.backoff
        for attempt in range(self.max_retries + 1):
            try:
                self.store.put(self.table, rows)
                return
            except StaleVersion:
                # A bump overtook some samples: keep the rest, hand the stale ones back.
                self._put_rows_singly(rows)
                return
            except TRANSIENT as e:
                if attempt == self.max_retries:
                    raise
                log.warning("put to %r failed (%s); retry %d in %.2f s", self.table, e,
                            attempt + 1, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _put_rows_singly(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            try:
                self._put_with_retries_one(row)
            except StaleVersion as e:
                with self._cond:
                    self.stale_rows.append(row)
                for callback in list(self._on_stale):
                    try:
                        callback(row, e)
                    except Exception:  # noqa: BLE001 - a producer's callback must not kill us
                        log.exception("on_stale callback failed")
                log.info("dropped stale sample %r: %s", row.get("sample_id"), e)

    def _put_with_retries_one(self, row: dict[str, Any]) -> None:
        delay = self.backoff
        for attempt in range(self.max_retries + 1):
            try:
                self.store.put(self.table, [row])
                return
            except TRANSIENT:
                if attempt == self.max_retries:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _watch_version(self) -> None:
        while not self._closed:
            try:
                version = self.store.wait_version(self.table, self.version + 1, timeout=1.0)
            except StoreClosed:
                return  # the store went away: nothing left to watch
            except Unavailable:
                if self._closed:
                    return
                time.sleep(self.backoff)
                continue
            except ExpstoreError as e:
                log.warning("version watch stopped: %s", e)
                return
            if version > self.version:
                self.version = version
                uri = None
                try:
                    uri = self.store.weights_uri(self.table)
                except ExpstoreError:
                    pass
                for callback in list(self._on_bump):
                    try:
                        callback(version, uri)
                    except Exception:  # noqa: BLE001 - a producer's callback must not kill us
                        log.exception("on_bump callback failed")
