"""The rollout side's buffered writer.

Rollout code calls :meth:`ExperienceWriter.write` from any thread as samples (or parts of them)
finish; a background thread sends them in batches. The writer

* is a context manager whose exit flushes and closes (as Reverb's trajectory writer);
* applies back-pressure: a full buffer blocks ``write`` (up to ``write_timeout``) instead of
  growing without bound;
* keeps up to ``puts_in_flight`` puts on their way at once (``put_async``), so that a put's round
  trips and durable commits overlap the next one's instead of adding up; their outcomes are
  settled in the order they were sent;
* retries transient failures (server restarting, network) with exponential backoff (after the
  last retry its error names the table and the first sample not stored); resending is
  harmless because writes are upserts, and a put retried after later ones were sent leaves out
  the columns of its samples that those later puts wrote, so that an older part never
  overwrites a newer one;
* stores the good samples of a put that the table refuses in part (a value of the wrong type, an
  unknown column): the put is sent again one sample at a time, and the refused samples end the
  writer with a ``SchemaMismatch`` naming the first of them;
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

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import store as store_pkg
from store.errors import ExpstoreError, InvalidArgument, SchemaMismatch, StaleVersion, \
    StoreClosed, Unavailable
from store.naming import parse_sample_id

log = logging.getLogger("expstore.producer")

TRANSIENT = (Unavailable,)
#: how many puts a writer keeps on their way at once by default
PUTS_IN_FLIGHT = 4
#: the columns of a row that name it rather than carry a value
_KEY_COLUMNS = ("sample_id", "policy_version")


class _Put(NamedTuple):
    """A batch of samples sent with ``put_async``, not yet settled."""
    rows: list[dict[str, Any]]
    answer: Future


class ExperienceWriter:
    """Buffered, retrying, version-aware writer of samples to one table.

    Args:
        target: a store (``store.connect(...)``) or a URI/path to connect to.
        table: the experience table.
        batch_rows: send when this many samples are buffered.
        flush_interval: send at least this often (seconds) while anything is buffered.
        max_buffer_rows: back-pressure: ``write`` blocks while this many samples wait; a put
            takes at most ``max(batch_rows, max_buffer_rows // puts_in_flight)`` of them, so
            that those buffered and those on their way are at most about twice this.
        write_timeout: how long ``write`` may block on a full buffer before raising.
        max_retries, backoff: retry transient errors ``max_retries`` times, doubling ``backoff``.
        track_version: keep :attr:`version` fresh with a background long-poll.
        puts_in_flight: how many puts may be on their way at once (1: each waits for the one
            before to be durable).
    """

    def __init__(self, target: Any, table: str, *, batch_rows: int = 256,
                 flush_interval: float = 0.05, max_buffer_rows: int = 16384,
                 write_timeout: float | None = 60.0, max_retries: int = 8,
                 backoff: float = 0.05, track_version: bool = True,
                 puts_in_flight: int = PUTS_IN_FLIGHT) -> None:
        if batch_rows < 1 or max_buffer_rows < batch_rows:
            raise InvalidArgument(f"batch_rows {batch_rows} must be ≥ 1 and ≤ max_buffer_rows "
                                  f"{max_buffer_rows}")
        if isinstance(puts_in_flight, bool) or not isinstance(puts_in_flight, int) \
                or puts_in_flight < 1:
            raise InvalidArgument(f"puts_in_flight {puts_in_flight!r} is invalid; expected an "
                                  "integer ≥ 1")
        self._owns_store = isinstance(target, str)
        self.store = store_pkg.connect(target) if isinstance(target, str) else target
        self.table = table
        self.batch_rows = batch_rows
        self.flush_interval = flush_interval
        self.max_buffer_rows = max_buffer_rows
        self.write_timeout = write_timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.puts_in_flight = puts_in_flight
        self.version = self.store.get_version(table)
        self.rows_written = 0
        self._buffer: dict[tuple[str, int | None], dict[str, Any]] = {}
        #: puts sent and not yet settled, oldest first; the samples they carry
        self._window: deque[_Put] = deque()
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
            InvalidArgument: a row that is no dict, or has no valid ``sample_id`` (refused here,
                with none of the rows of this call buffered, rather than failing a later put
                together with the good samples sent in it).
            StoreClosed: the writer is closed.
            the first error the background sender hit (it is not retried again), or
            TimeoutError when the buffer stayed full for ``write_timeout`` seconds.
        """
        batch = _checked_rows(rows)
        deadline = None if self.write_timeout is None else time.monotonic() + self.write_timeout
        with self._cond:
            if self._closed:
                raise StoreClosed(f"the writer of {self.table!r} is closed; its samples were "
                                  "sent when it closed, and it takes no more")
            for row in batch:
                self._raise_if_failed()
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

    @property
    def buffered_rows(self) -> int:
        """Samples written and not yet sent."""
        return len(self._buffer)

    @property
    def in_flight_rows(self) -> int:
        """Samples sent in puts that are not yet settled (answered, or retried)."""
        return self._in_flight

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
        deadline = time.monotonic() + self.flush_interval   # a partial batch goes by then
        while True:
            with self._cond:
                rows = self._next_batch(deadline)
                if rows is None and not self._window:
                    return                       # closed, and everything settled
            if rows is None:
                self._settle_oldest()
            else:
                self._send(rows)
                deadline = time.monotonic() + self.flush_interval

    def _next_batch(self, deadline: float) -> list[dict[str, Any]] | None:
        """Under the lock: wait until the oldest put is answered (None: settle it), or a batch
        is due and a put may start (the batch, taken from the buffer), or the writer is closed
        with nothing buffered (None)."""
        while True:
            if self._window and self._window[0].answer.done():
                return None
            if self._error is not None and self._buffer:
                self._buffer.clear()             # nothing more is sent after an error
                self._cond.notify_all()
            if self._closed and not self._buffer:
                if not self._window:
                    return None
            elif self._buffer and len(self._window) < self.puts_in_flight and (
                    len(self._buffer) >= self.batch_rows or self._closed or self._flushing
                    or time.monotonic() >= deadline):
                take = max(self.batch_rows, self.max_buffer_rows // self.puts_in_flight)
                keys = list(itertools.islice(self._buffer, take))
                rows = [self._buffer.pop(k) for k in keys]
                self._in_flight += len(rows)
                self._cond.notify_all()
                return rows
            remaining = deadline - time.monotonic()
            self._cond.wait(remaining if remaining > 0 else self.flush_interval)

    def _send(self, rows: list[dict[str, Any]]) -> None:
        version = self.version
        for row in rows:
            if row.get("policy_version") is None:
                row["policy_version"] = version
        try:
            answer = self.store.put_async(self.table, rows)
        except BaseException as e:  # noqa: BLE001 - settled (retried or surfaced) in order
            answer = Future()
            answer.set_exception(e)
        with self._cond:
            self._window.append(_Put(rows, answer))
        answer.add_done_callback(self._answered)

    def _answered(self, _: Future) -> None:
        with self._cond:
            self._cond.notify_all()

    def _settle_oldest(self) -> None:
        """The oldest put's outcome: counted, or retried (without the columns later puts
        wrote), or the writer's error."""
        put = self._window[0]
        error = put.answer.exception()
        if error is not None and self._error is None:
            try:
                self._retry(put, error)
            except BaseException as e:  # noqa: BLE001 - surfaced to the producer on write/flush
                with self._cond:
                    self._error = e
            else:
                error = None
        with self._cond:
            self._window.popleft()
            if error is None:
                self.rows_written += len(put.rows)
            self._in_flight -= len(put.rows)
            self._cond.notify_all()

    def _retry(self, put: _Put, error: BaseException) -> None:
        """Send a failed put's samples again, in a put (or, after StaleVersion, one by one)
        that waits, leaving out what the puts sent after it wrote: being sent again after
        them, those values of the retry would otherwise overwrite newer ones."""
        rows = _without_superseded(put.rows, [later.rows for later in
                                              itertools.islice(self._window, 1, None)])
        if isinstance(error, (StaleVersion, SchemaMismatch)):
            # A bump overtook some samples (handed back), or some do not fit the table (they
            # end the writer, named): either way the other samples of the put are stored.
            self._put_rows_singly(rows)
            return
        if not isinstance(error, TRANSIENT):
            raise error
        try:
            if self.max_retries == 0:
                raise error
            log.warning("put to %r failed (%s); retry 1 in %.2f s", self.table, error,
                        self.backoff)
            if rows:
                self._put_with_retries(rows, first_delay=self.backoff)
        except TRANSIENT as e:
            # The same class (a caller may tell a full table from a server away), saying what
            # the producer has to write again.
            raise type(e)(f"the writer of {self.table!r} gave up after {self.max_retries} "
                          f"retries: {len(put.rows)} samples sent in the put (the first "
                          f"{put.rows[0]['sample_id']!r}) and those written after them are not "
                          f"stored; write them again once the store is back: {e}") from e

    def _put_with_retries(self, rows: list[dict[str, Any]], first_delay: float) -> None:
        delay = first_delay
        for attempt in range(1, self.max_retries + 1):
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            try:
                self.store.put(self.table, rows)
                return
            except (StaleVersion, SchemaMismatch):
                self._put_rows_singly(rows)
                return
            except TRANSIENT as e:
                if attempt == self.max_retries:
                    raise
                log.warning("put to %r failed (%s); retry %d in %.2f s", self.table, e,
                            attempt + 1, delay)

    def _put_rows_singly(self, rows: list[dict[str, Any]]) -> None:
        """Put ``rows`` one by one: stale ones are handed back; refused ones (values that do
        not fit the table) raise SchemaMismatch naming them, after every other row is stored."""
        refused: list[tuple[Any, SchemaMismatch]] = []
        for row in rows:
            try:
                self._put_with_retries_one(row)
            except SchemaMismatch as e:
                refused.append((row.get("sample_id"), e))
            except StaleVersion as e:
                with self._cond:
                    self.stale_rows.append(row)
                for callback in list(self._on_stale):
                    try:
                        callback(row, e)
                    except Exception:  # noqa: BLE001 - a producer's callback must not kill us
                        log.exception("on_stale callback failed")
                log.info("dropped stale sample %r: %s", row.get("sample_id"), e)
        if refused:
            first, error = refused[0]
            raise SchemaMismatch(
                f"table {self.table!r} refused {len(refused)} sample(s) of a put, the first "
                f"{first!r}: {error}; the put's other {len(rows) - len(refused)} samples were "
                "stored, and the writer sends nothing more") from error

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


def _checked_rows(rows: Any) -> list[Mapping[str, Any]]:
    """``write``'s argument as a list of rows, each a mapping with a valid sample id."""
    if isinstance(rows, Mapping):
        batch = [rows]
    elif isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise InvalidArgument(f"write takes a sample (a dict of column values) or a list of "
                              f"them; got {type(rows).__name__} {repr(rows)[:200]}")
    else:
        batch = list(rows)
    for row in batch:
        if not isinstance(row, Mapping):
            raise InvalidArgument(f"a sample to write is {type(row).__name__} "
                                  f"{repr(row)[:200]}; expected a dict of column values with a "
                                  "'sample_id'")
        if "sample_id" not in row:
            raise InvalidArgument(f"row {dict(row)!r} has no 'sample_id'")
        parse_sample_id(row["sample_id"])
    return batch


def _without_superseded(rows: list[dict[str, Any]],
                        later: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """``rows`` less the values the ``later`` batches write to the same samples (a column with
    a value there, and its status column, which that write sets); rows left with no value are
    dropped."""
    written: dict[tuple[Any, Any], set[str]] = {}
    for batch in later:
        for row in batch:
            columns = written.setdefault((row["sample_id"], row.get("policy_version")), set())
            for column, value in row.items():
                if value is not None and column not in _KEY_COLUMNS:
                    columns.add(column)
                    columns.add(f"{column}_status")
    if not written:
        return rows
    kept = []
    for row in rows:
        gone = written.get((row["sample_id"], row.get("policy_version")))
        if not gone:
            kept.append(row)
            continue
        rest = {c: v for c, v in row.items() if c not in gone}
        if any(c not in _KEY_COLUMNS for c in rest):
            kept.append(rest)
    return kept
