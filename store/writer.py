"""The writer thread: the one owner of DuckDB writes, committing in groups.

Why one owner: DuckDB gives write-write conflicts when two connections update the same table, and
a small transaction costs far more than the change it carries. So every durable change (puts,
acks, nacks, version bumps, DDL, lease bookkeeping) is queued here; the thread takes everything
waiting, runs it in ONE transaction (its blob chunks written and fsynced before the COMMIT),
commits, then applies the effects to the in-memory index and answers each caller. A caller's
future resolves only after the commit, so a returned write is durable.

A group of only fresh puts (up to ``settings.log_put_rows`` rows), acks and a bump is made
durable in the put log instead (an append and an fsync; see store/putlog.py) and applied to
DuckDB, in log order, at the start of the next DuckDB transaction.

If a group fails, each operation is retried alone so that one bad operation fails only its caller.
If DuckDB itself cannot be written (a full disk; a failed checkpoint invalidates the database),
the writer refuses every change until it recovers (see store/storage_fault.py).
"""
from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .blobs import BlobStore, keys_for
from .index import StoreIndex
from .errors import ExpstoreError, NotFound, StaleVersion, StorageError, StorageUnavailable, \
    StoreClosed, VersionConflict
from .live import LEASED, Lease, LiveTable, Row, RowBlock
from .naming import quote
from .opening import run_checkpoint
from .prepare import PreparedPut
from .putlog import LEASE_COLUMNS, LeaseUpdate, PutLog, Record, apply_records, encode, lease_table, \
    lease_update
from .sources import ListColumns, registered, row_source
from .settings import StoreSettings
from .storage_fault import StorageFault
from .types import one_array

#: Rows' claimable values by row id: a cached Arrow table and the row's index in it.
Payloads = dict[int, tuple[pa.Table, int]]

log = logging.getLogger("expstore.writer")

_WAKE = object()  # queued by Writer.poke


@dataclass
class Op:
    """A queued change. ``future`` resolves after the commit that made it durable."""

    future: Future = field(default_factory=Future, init=False)


@dataclass
class PutOp(Op):
    prepared: PreparedPut


@dataclass
class SmallPutOp(Op):
    """A write of a few rows whose columns were checked, not yet its values.

    Why: preparing a one-sample put costs about as much Python as preparing 64 rows at once;
    with many producers, preparing each on its own thread also starves the writer of the GIL.
    The writer prepares runs of consecutive small puts to one table as one batch.
    """

    table: str
    data: pa.Table


@dataclass
class MergedPutOp(PutOp):
    """Several small puts prepared as one; each caller is answered for its own rows."""

    members: list[SmallPutOp]


@dataclass
class SettleOp(Op):
    """Ack (consume) or nack (return) the rows of a lease."""

    lease: Lease
    ack: bool


@dataclass
class BumpOp(Op):
    group: str
    expected: int | None
    weights_uri: str | None


@dataclass
class FlushOp(Op):
    """Nothing but a DuckDB transaction: it inserts the rows waiting in the put log."""


@dataclass
class ReadOp(Op):
    """A read of DuckDB and memory together (``stats``), run by the writer between two groups:
    DuckDB then holds every logged change and nothing commits until ``run(con)`` returns, so the
    two agree.

    Why not a reader cursor: a reader cannot see DuckDB and memory at one instant; under a steady
    stream of commits, ``stats`` retried its two queries up to 200 times (seconds under load).
    """

    run: Callable[[duckdb.DuckDBPyConnection], Any]


class _NotLoggable(Exception):
    """A group that must go through DuckDB at once (see Writer._log_puts)."""


@dataclass
class CallOp(Op):
    """DDL and maintenance: ``run(con)`` inside the transaction, ``apply()`` after commit."""

    run: Callable[[duckdb.DuckDBPyConnection], Any]
    apply: Callable[[Any], Any] | None = None


class _Txn:
    """Effects of one group transaction, applied to memory after the commit."""

    def __init__(self) -> None:
        self.applies: list[Callable[[], None]] = []
        self._new_rows: dict[str, dict[tuple[str, int], int]] = {}  # table -> key -> row id
        # Bulk puts' new keys (keys, first row id), put into _new_rows only if another put of
        # the transaction asks: building a dict of a bulk put's keys is a noticeable share of
        # the put.
        self._new_runs: dict[str, list[tuple[list[tuple[str, int]], int]]] = {}
        self.next_row_id: dict[str, int] = {}
        # Rows that became ready without their values at hand (partial writes): their payload is
        # read from DuckDB once, after the commit, so claims need no read of their own.
        self.need_payload: list[tuple[LiveTable, Row]] = []
        # Lease bookkeeping taken for this transaction: put back if it does not commit.
        self.row_updates: dict[str, list[LeaseUpdate]] = {}
        # id(put op) -> its rows with blob keys, made before any statement runs.
        self.physical: dict[int, pa.Table] = {}
        # Set for a group going to the put log: the records of its changes.
        self.logged: list[Record] | None = None
        # The cached values of a logged group's rows, which the claim cache may drop once
        # DuckDB has them: (live table, the rows' keys, the values' Arrow table).
        self.logged_values: list[tuple[LiveTable, list[tuple[str, int]], pa.Table]] = []

    def new_rows(self, table: str) -> dict[tuple[str, int], int]:
        """Keys new in ``table`` in this transaction and their row ids (callers may add)."""
        rows = self._new_rows.setdefault(table, {})
        for keys, first in self._new_runs.pop(table, ()):
            rows.update(zip(keys, range(first, first + len(keys))))
        return rows

    def add_new_run(self, table: str, keys: list[tuple[str, int]], first: int) -> None:
        """Record ``keys`` as new in ``table``, numbered from ``first`` (see :meth:`new_rows`)."""
        self._new_runs.setdefault(table, []).append((keys, first))


class Writer:
    """Runs in its own thread; see the module docstring."""

    def __init__(self, index: StoreIndex, con: duckdb.DuckDBPyConnection,
                 settings: StoreSettings, putlog: PutLog | None = None, *, blobs: BlobStore,
                 wal_path: str, reopen: Callable[[], duckdb.DuckDBPyConnection],
                 load_payloads: Callable[[LiveTable, list[int]], Payloads]) -> None:
        self._index = index
        self._blobs = blobs
        # Close every connection to the database and open it again (see _reopen).
        self._reopen_database = reopen
        # Read rows' claimable values from DuckDB into the claim cache (see _fill_payloads).
        self._load_payloads = load_payloads
        self._settings = settings
        self._con = con
        self._putlog = putlog
        # Changes durable in the put log, not yet in DuckDB, oldest first.
        self._logged: list[Record] = []
        self._logged_values: list[tuple[LiveTable, list[tuple[str, int]], pa.Table]] = []
        self.logged_rows = 0
        self._logged_since: float | None = None
        # After a failed insert of logged rows (a full disk), wait this long before the next try.
        self._retry_delay = self._settings.materialize_delay
        self._retry_at = 0.0
        # Ops; None: close; _WAKE: recompute how long to sleep (see poke)
        self._queue: queue.Queue[Op | object | None] = queue.Queue()
        self._flush_due: float | None = None
        self._closed = False
        self._fatal: BaseException | None = None
        self._taken: list[Op] = []  # the ops of the group being run
        # Set while the database cannot be written (see store/storage_fault.py).
        self._fault: StorageFault | None = None
        # After DuckDB was opened again: the logged changes may be in it already (see _recover).
        self._replay_logged = False
        self._putlog_failing = False  # a put log write failed (logged once until one works)
        self.commits = 0  # group commits: DuckDB transactions and put-log appends
        self._last_commit = time.monotonic()
        self._dirty_since_checkpoint = False
        self._blob_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expstore-blob-io")
        # CHECKPOINTs run on a thread (and cursor) of their own: see _maybe_checkpoint.
        self._checkpoint_io = ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="expstore-checkpoint")
        self._checkpointing: Future | None = None
        self._wal_path = wal_path
        self._wal_retry_at = 0.0  # after a deferred checkpoint of a full WAL, when to try again
        # Whether the WAL may have reached settings.wal_checkpoint_bytes since it was last measured: only
        # the writer's DuckDB commits grow it, so groups made durable in the put log (a
        # trainer's acks, small puts) do not measure it again.
        self._wal_may_be_full = True
        self._thread = threading.Thread(target=self._loop, name="expstore-writer", daemon=True)
        self._thread.start()

    # -- submitting ------------------------------------------------------------------------------
    def submit(self, op: Op) -> Future:
        if self._closed:
            raise StoreClosed("the store is closed")
        if self._fatal is not None:
            raise self._stopped()
        fault = self._fault
        if fault is not None:  # refused at once: nothing of it is stored (retryable)
            _fail(op, fault.error(len(self._logged), read=isinstance(op, ReadOp)))
            return op.future
        self._queue.put(op)
        if self._fatal is not None:  # it stopped meanwhile, maybe after draining the queue
            self._drain(self._stopped())
        return op.future

    def _stopped(self) -> StoreClosed:
        return StoreClosed(f"the store's writer stopped after an unexpected error: "
                           f"{self._fatal!r}; open the store again (restart the server)")

    def call(self, op: Op, timeout: float | None = None) -> Any:
        return self.submit(op).result(timeout)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def poke(self) -> None:
        """Ask for a flush of lease bookkeeping within settings.lease_flush_delay (never blocks)."""
        if self._flush_due is None:
            self._flush_due = time.monotonic() + self._settings.lease_flush_delay
            # An idle writer sleeps until the next lease expiry or checkpoint (at most
            # settings.checkpoint_idle_seconds): wake it to sleep until the flush is due instead.
            self._queue.put(_WAKE)

    def materialize(self) -> None:
        """Return once every row acknowledged so far is in DuckDB (readers call this first, so
        that SQL sees every acknowledged write).

        Raises:
            StorageUnavailable: DuckDB cannot be written (a full disk) or was invalidated: a read
                now would miss acknowledged changes, or fail, until the store recovers.
        """
        fault = self._fault
        if fault is not None:
            raise fault.error(len(self._logged), read=True)
        if self._logged and threading.current_thread() is not self._thread:
            self.call(FlushOp())

    @property
    def fault(self) -> StorageFault | None:
        """Why the database cannot be written now, if it cannot (see store/storage_fault.py)."""
        return self._fault

    @property
    def waiting_changes(self) -> int:
        """Acknowledged changes in the put log that DuckDB does not hold yet."""
        return len(self._logged)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._checkpoint_io.shutdown()
        self._blob_io.shutdown()
        if self._putlog is not None:
            self._putlog.close()

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Serve the queue; on an unexpected error (a bug, exhausted memory), stop loudly.

        Why stop: memory may no longer match DuckDB after an error half-way through a group,
        and going on could write on top of it. Why fail everything waiting: each write's caller
        would otherwise wait for ever. What was acknowledged is durable; opening the store
        again rebuilds memory from DuckDB and the put log.
        """
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - logged, and told to every caller
            self._fatal = e
            log.critical("the store's writer stopped after an unexpected error; every write "
                         "fails until the store is opened again (what was acknowledged is "
                         "durable)", exc_info=True)
            error = self._stopped()
            for op in self._taken:
                if not op.future.done():
                    op.future.set_exception(error)
            self._drain(error)

    @property
    def fatal(self) -> BaseException | None:
        """The error that stopped the writer, if one did."""
        return self._fatal

    def _serve(self) -> None:
        while True:
            timeout = self._index.next_expiry_in()
            idle = self._settings.checkpoint_idle_seconds
            timeout = idle if timeout is None else min(timeout, idle)
            if self._flush_due is not None:
                timeout = max(0.0, min(timeout, self._flush_due - time.monotonic()))
            if self._logged_since is not None and not self._checkpoint_running():
                # (a running checkpoint wakes the loop when it ends: see _start_checkpoint)
                timeout = max(0.0, min(timeout, max(self._logged_since + self._settings.materialize_delay,
                                                    self._retry_at) - time.monotonic()))
            if self._fault is not None:
                timeout = min(timeout, self._fault.seconds_to_retry())
            try:
                first = self._queue.get(timeout=timeout)
                if first is _WAKE:
                    continue
            except queue.Empty:
                self._index.expire_leases()
                if self._fault is not None:
                    self._recover()  # nothing else touches DuckDB meanwhile
                    continue
                due = self._flush_due is not None and time.monotonic() >= self._flush_due
                if due or (self._flush_due is None and self._index.has_pending_row_updates()):
                    self._flush_due = None
                    self._run_group([])
                if self._materialize_due():
                    self._materialize()
                self._maybe_checkpoint()
                continue
            ops: list[Op] = []
            self._taken = ops
            stop = first is None
            if isinstance(first, Op):
                ops.append(first)
            while not stop and len(ops) < self._settings.max_group_ops:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                elif isinstance(nxt, Op):
                    ops.append(nxt)
            self._index.expire_leases()
            if self._fault is not None and not self._recover(force=stop):
                error = self._fault.error(len(self._logged))
                for op in ops:  # queued before the store knew: refused as later ones are
                    _fail(op, error)
                if stop:
                    self._stop_faulted()
                    return
                continue
            self._flush_due = None  # this group writes any pending lease bookkeeping too
            if ops or self._index.has_pending_row_updates():
                for part in _reads_apart(ops):
                    if isinstance(part, ReadOp):
                        self._read(part)
                        continue
                    for group in _bumps_apart(part):
                        self._run_group(group)
            if self._materialize_due() or (stop and self._logged):
                self._materialize()
            self._checkpoint_if_wal_full()
            if stop:
                self._drain(StoreClosed("the store is closed"))
                return

    def _read(self, op: ReadOp) -> None:
        if self._logged:
            self._materialize()
        if self._fault is not None:  # DuckDB misses acknowledged changes, or cannot be read
            _fail(op, self._fault.error(len(self._logged), read=True))
            return
        try:
            _resolve(op, op.run(self._con))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            _fail(op, e)

    def _materialize(self) -> None:
        """Apply the logged changes to DuckDB now (a transaction of nothing else)."""
        try:
            self._transaction([])
        except StorageUnavailable:
            pass  # the store is in a storage fault now: logged once, retried on a back-off
        except Exception as e:  # noqa: BLE001 - tried again later (see _retry_at)
            log.error("applying the put log to DuckDB failed: %s", e)

    # -- storage faults (see store/storage_fault.py) -------------------------------------------
    def _enter_fault(self, error: BaseException, invalid: bool) -> StorageFault:
        """Note that DuckDB cannot be written (``invalid``: it invalidated the database)."""
        cause = _cause(error)
        fault = self._fault
        if fault is None:
            fault = self._fault = StorageFault(cause, invalid)
            log.error("the database cannot be written: %s; every change is refused (a "
                      "retryable storage_unavailable error) until it can be%s; %d acknowledged "
                      "changes wait in the put log", cause,
                      ", then DuckDB is opened again" if invalid else "", len(self._logged))
        else:
            fault.update(cause, invalid)
        return fault

    def _recover(self, force: bool = False) -> bool:
        """Try to leave the storage fault (when its back-off is due, or ``force``): open DuckDB
        again if it was invalidated, then apply the changes waiting in the put log in one
        transaction. True once the store takes changes again."""
        fault = self._fault
        if fault is None:
            return True
        if not force and not fault.due():
            return False
        fault.attempts += 1
        try:
            if fault.invalid:
                self._reopen()
                fault.invalid = False
            self._transaction([])  # the logged changes, and any lease bookkeeping
            if fault.checkpoint_due:
                # What invalidated it was a checkpoint (or a write) that found no room: one
                # that succeeds shows there is room again; otherwise the next one would fail
                # the same way and the store would go round the fault again.
                self._checkpoint_finished()
                run_checkpoint(self._con)
                fault.checkpoint_due = False
        except Exception as e:  # noqa: BLE001 - still failing: the fault notes it, back off
            fault.update(_cause(e), _invalidated(self._con, e))
            fault.failed_try()
            return False
        self._fault = None
        log.warning("the database can be written again after %.1f s (%d tries); changes are "
                    "taken again", time.time() - fault.since, fault.attempts)
        return True

    def _reopen(self) -> None:
        """Open DuckDB again after it invalidated the database (what a restart would do: DuckDB
        replays its WAL). Memory is kept: it holds what was acknowledged, which DuckDB and the
        put log hold together."""
        if self._checkpointing is not None:
            try:
                self._checkpointing.result()
            except Exception:  # noqa: BLE001 - it failed on the invalid database: expected
                pass
            self._checkpointing = None
        self._con = self._reopen_database()
        # The changes logged before may have reached DuckDB's WAL in the COMMIT that failed.
        self._replay_logged = bool(self._logged)
        self._wal_may_be_full = True
        self._dirty_since_checkpoint = True

    def _stop_faulted(self) -> None:
        """Close while the database cannot be written: what was acknowledged stays in the put
        log, applied when the store is opened again."""
        if self._logged:
            log.warning("closing while the database cannot be written: %d acknowledged changes "
                        "stay in the put log %r and are applied when the store opens again",
                        len(self._logged), getattr(self._putlog, "path", None))
        self._drain(StoreClosed("the store is closed"))

    def _materialize_due(self) -> bool:
        if self._logged_since is None:
            return False
        if self._checkpoint_running() and self.logged_rows < self._settings.materialize_max_rows:
            return False
        now = time.monotonic()
        return now >= self._retry_at and (
            self.logged_rows >= self._settings.materialize_rows
            or now - self._logged_since >= self._settings.materialize_delay)

    def _drain(self, error: ExpstoreError) -> None:
        """Fail every op still queued with ``error``."""
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, Op) and not op.future.done():
                op.future.set_exception(error)

    def _maybe_checkpoint(self) -> None:
        """Start a CHECKPOINT once DuckDB has been idle a while.

        Why idle: checkpoints compress strings and can stall for seconds; run them when idle,
        not when DuckDB's WAL threshold happens to trip in the middle of a producer's put. Why on
        a thread of their own: a put, ack or bump that arrives meanwhile (a trainer's bump after
        seconds of training) goes to the put log at once instead of waiting for the checkpoint
        (long next to a write even for a small WAL, seconds for a large one). The writer's own
        DuckDB transactions wait for it (see _checkpoint_finished).
        """
        if self._fault is not None or self._checkpoint_running() or \
                not self._dirty_since_checkpoint or \
                time.monotonic() - self._last_commit < self._settings.checkpoint_idle_seconds:
            return
        self._start_checkpoint()

    def _checkpoint_if_wal_full(self) -> None:
        """Start a CHECKPOINT, on every core, once DuckDB's WAL holds settings.wal_checkpoint_bytes.

        Why not DuckDB's own threshold: under sustained ingest (no idle time) DuckDB checkpoints
        inside the COMMIT that crosses it, on its usual threads (every core but one: one thread
        on 2 cores): every few million rows one bulk put took many times as long as the others,
        and every write waited behind it. Here the same
        checkpoint runs on the checkpoint thread with every core (so it ends sooner), as an idle
        one does: meanwhile puts, acks and bumps that the put log takes go on.
        """
        if self._fault is not None or not self._wal_may_be_full or self._checkpoint_running():
            return
        try:
            size = os.path.getsize(self._wal_path)
        except OSError:  # no WAL: nothing committed since the last checkpoint
            size = 0
        if size < self._settings.wal_checkpoint_bytes:
            self._wal_may_be_full = False
        elif time.monotonic() >= self._wal_retry_at:
            self._start_checkpoint()  # measured again once it ends (deferred: still full)

    def _start_checkpoint(self) -> None:
        self._dirty_since_checkpoint = False
        self._checkpointing = self._checkpoint_io.submit(_checkpoint, self._con.cursor())
        # wake the loop when it ends: logged rows may be waiting for it (_materialize_due)
        self._checkpointing.add_done_callback(lambda _: self._queue.put(_WAKE))

    def _checkpoint_running(self) -> bool:
        """Whether a checkpoint is running on the checkpoint thread (one that ended is
        reaped)."""
        if self._checkpointing is not None and self._checkpointing.done():
            self._checkpoint_finished()
        return self._checkpointing is not None

    def _checkpoint_finished(self) -> None:
        """Wait for a running checkpoint (before any DuckDB transaction of the writer)."""
        if self._checkpointing is not None:
            running, self._checkpointing = self._checkpointing, None
            error = running.result()
            if error is not None and _invalidated(self._con, error):
                self._enter_fault(error, invalid=True)  # a full disk: see storage_fault.py
            elif error is not None:
                # deferred (a reader's snapshot): again when next idle, or in a second if the
                # WAL is full; DuckDB's own threshold remains behind it
                self._dirty_since_checkpoint = True
                self._wal_retry_at = time.monotonic() + 1.0

    def _run_group(self, ops: list[Op]) -> None:
        given = len(ops)
        ops = self._prepare_small(ops)
        if given and not ops and not self._index.has_pending_row_updates():
            return  # every put of the group was refused: nothing to commit
        logged = self._log_puts(ops)
        if logged is not None:
            for op, result in zip(ops, logged):
                _resolve(op, result)
            return
        if self._logged and any(isinstance(op, CallOp) for op in ops):
            # DDL commits apart from logged rows: a crash between that COMMIT and cutting the
            # log back must not leave rows of a dropped table to replay into a new one.
            self._materialize()
        try:
            results, txn = self._transaction(ops)
        except Exception as group_error:  # noqa: BLE001 - isolate the culprit below
            if self._fault is not None:  # DuckDB cannot be written: every op is refused
                for op in ops:
                    _fail(op, self._fault.error(len(self._logged)))
                return
            if len(ops) == 1 and not isinstance(ops[0], MergedPutOp):
                _fail(ops[0], group_error)
                return
            if not ops:
                log.error("writing lease bookkeeping failed: %s", group_error)
                return
            for op in self._apart(ops):
                try:
                    (result,), txn = self._transaction([op])
                except Exception as e:  # noqa: BLE001
                    _fail(op, e)
                else:
                    _resolve(op, result)
                    self._fill_payloads(txn)
            return
        for op, result in zip(ops, results):
            _resolve(op, result)
        self._fill_payloads(txn)

    # -- small puts ------------------------------------------------------------------------------
    def _prepare_small(self, ops: list[Op]) -> list[Op]:
        """Replace small puts by prepared ones, merging runs of them to the same table and schema.

        A put that fails preparation fails alone, and leaves the group.
        """
        out: list[Op] = []
        run: list[SmallPutOp] = []
        rows = 0
        for op in ops:
            if isinstance(op, SmallPutOp):
                if run and (op.table != run[0].table or rows + op.data.num_rows > self._settings.merged_put_rows
                            or not op.data.schema.equals(run[0].data.schema)):
                    out.extend(self._prepare_run(run))
                    run, rows = [], 0
                run.append(op)
                rows += op.data.num_rows
                continue
            if run:
                out.extend(self._prepare_run(run))
                run, rows = [], 0
            out.append(op)
        if run:
            out.extend(self._prepare_run(run))
        return out

    def _prepare_run(self, run: list[SmallPutOp]) -> list[Op]:
        index = self._index
        if len(run) > 1:
            try:
                merged = pa.concat_tables([op.data for op in run])
                # Two puts of one sample stay apart: prepare would merge them into one row.
                if pc.count_distinct(merged.column("sample_id")).as_py() == merged.num_rows:
                    return [MergedPutOp(index.prepare(run[0].table, merged), run)]
            except Exception:  # noqa: BLE001 - one of them is bad: prepare each to find it
                pass
        out: list[Op] = []
        for op in run:
            try:
                put = PutOp(index.prepare(op.table, op.data))
            except Exception as e:  # noqa: BLE001 - handed to this put's caller
                _fail(op, e)
                continue
            put.future = op.future
            out.append(put)
        return out

    def _apart(self, ops: list[Op]) -> list[Op]:
        """The ops of a failed group, to be retried one by one (merged puts split again)."""
        out: list[Op] = []
        for op in ops:
            if isinstance(op, MergedPutOp):
                for member in op.members:
                    out.extend(self._prepare_run([member]))
            else:
                out.append(op)
        return out

    def _fill_payloads(self, txn: _Txn) -> None:
        if not txn.need_payload or self._index.cache.full:
            return  # full: claims read these rows from DuckDB
        by_table: dict[int, tuple[LiveTable, list[Row]]] = {}
        for live, row in txn.need_payload:
            by_table.setdefault(id(live), (live, []))[1].append(row)
        for live, rows in by_table.values():
            try:
                loaded = self._load_payloads(live, [r.row_id for r in rows])
            except Exception as e:  # noqa: BLE001 - claims read the rows themselves then
                log.warning("could not cache claimable rows of %r: %s", live.tdef.name, e)
                continue
            with self._index.lock:
                for row in rows:
                    if row.payload is None:
                        row.payload = loaded.get(row.row_id)

    def _evict_logged_values(self) -> None:
        """Drop the cached values of rows just applied from the put log, newest first, while the
        claim cache is over its limit: DuckDB can serve them now."""
        values, self._logged_values = self._logged_values, []
        index = self._index
        if not index.cache.full:
            return
        with index.lock:
            while values and index.cache.full:
                live, keys, table = values.pop()
                live.evict(keys, table)
                del table  # the last reference: the cache counts its bytes back now

    def _transaction(self, ops: list[Op]) -> tuple[list[Any], _Txn]:
        index = self._index
        con = self._con
        txn = _Txn()
        results: list[Any] = [None] * len(ops)
        self._checkpoint_finished()
        fault = self._fault
        if fault is not None and fault.invalid:
            raise fault.error(len(self._logged))  # only _recover opens DuckDB again
        blob_write: Future | None = None
        logged = len(self._logged)
        # Whether the group's own work (statements, blob writes) is running: a failure there
        # is the group's; one before or after it (the logged changes, the COMMIT) is DuckDB's.
        in_ops = False
        try:
            if self._putlog is not None:
                self._putlog.sync_cut()  # see PutLog.clear
            con.execute("BEGIN TRANSACTION")
            # first: changes stay in order
            apply_records(con, self._logged, index.live, replaying=self._replay_logged)
            in_ops = True
            blob_write = self._start_blob_write(txn, ops)
            self._run_ops(txn, ops, results)
            self._row_updates(txn)
            if blob_write is None:
                self._blobs.sync()
            else:
                writing: Future = blob_write
                blob_write = None  # finished once result() returns or raises
                writing.result()  # the chunks are durable before any key to them commits
            in_ops = False
            con.execute("COMMIT")
        except BaseException as e:
            if blob_write is not None:
                # Let the blob thread finish before the blob store is touched again; what it
                # wrote stays unreferenced (as after a failed COMMIT).
                try:
                    blob_write.result()
                except Exception:  # noqa: BLE001 - the statement's error is the one raised
                    pass
            self._blobs.rollback()
            if txn.row_updates:
                index.requeue_row_updates(txn.row_updates)
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            if logged:  # not inserted: try again later, less often while it keeps failing
                self._retry_at = time.monotonic() + self._retry_delay
                self._retry_delay = min(self._retry_delay * 2, 5.0)
            invalid = isinstance(e, duckdb.Error) and _invalidated(con, e)
            if invalid or (logged and not in_ops and isinstance(e, (OSError, duckdb.Error))):
                # DuckDB cannot take what is acknowledged already: refuse every change until
                # it can (a failure of a group with nothing logged fails only the group)
                raise self._enter_fault(e, invalid).error(len(self._logged)) from e
            if isinstance(e, (OSError, duckdb.IOException)):
                raise StorageError(f"the database could not be written: {e}") from e
            raise
        self.commits += 1
        self._last_commit = time.monotonic()
        self._dirty_since_checkpoint = True
        self._wal_may_be_full = True
        self._replay_logged = False
        if logged:
            self._logged_committed()
        self._apply(txn)
        return results, txn

    def _apply(self, txn: _Txn) -> None:
        """A durable group's effects on memory (its COMMIT or its log append happened)."""
        index = self._index
        with index.lock:
            for effect in txn.applies:
                effect()
            index.notify()

    def _run_ops(self, txn: _Txn, ops: list[Op], results: list[Any]) -> None:
        """Run a group's operations in order (consecutive puts together)."""
        puts: list[tuple[int, PutOp]] = []
        for i, op in enumerate(ops):
            if isinstance(op, PutOp):
                puts.append((i, op))
                continue
            if puts:
                self._puts(txn, puts, results)
                puts = []
            if isinstance(op, SettleOp):
                results[i] = self._settle(txn, op)
            elif isinstance(op, BumpOp):
                results[i] = self._bump(txn, op)
            elif isinstance(op, CallOp):
                if txn.logged is not None:
                    raise _NotLoggable("DDL and maintenance run in DuckDB")
                value = op.run(self._con)
                if op.apply is not None:
                    apply = op.apply
                    txn.applies.append(functools.partial(apply, value))
                results[i] = value
        if puts:
            self._puts(txn, puts, results)

    # -- the put log ---------------------------------------------------------------------------
    def _log_puts(self, ops: list[Op]) -> list[Any] | None:
        """Make a group durable in the put log instead of DuckDB; its results, or None when
        the group must go through DuckDB.

        A group qualifies when it is only puts, acks and bumps (see _bumps_apart),
        its puts of at most settings.log_put_rows rows, every row new (a key DuckDB may hold goes through
        DuckDB, which decides insert or update) and every ready row claimable from the values
        written (claims must not read DuckDB for it). The group runs as in a transaction, but
        its statements become records; its blob chunks are written and fsynced before the
        records that hold their keys (on the blob thread, while the records are encoded, when
        they are large). Memory changes only once the log is durable, so a group that turns out
        not to qualify (or fails, e.g. on a stale version, which the DuckDB path then reports)
        falls back whole; chunks it wrote stay unreferenced, as after a failed COMMIT.
        """
        puts = [op for op in ops if isinstance(op, PutOp)]
        index = self._index
        if self._putlog is None or (not ops and not index.has_pending_row_updates()) or any(
                not isinstance(op, (PutOp, BumpOp)) and not (isinstance(op, SettleOp) and op.ack)
                for op in ops) \
                or sum(op.prepared.rows for op in puts) > self._settings.log_put_rows:
            return None
        txn = _Txn()
        txn.logged = []
        results: list[Any] = [None] * len(ops)
        try:
            for op in puts:
                txn.physical[id(op)] = self._with_blob_keys(op.prepared)
            self._run_ops(txn, ops, results)
        except Exception:  # noqa: BLE001 - _NotLoggable, or an error the DuckDB path reports
            self._blobs.rollback()
            return None
        blobs = self._blobs
        writing = self._blob_io.submit(blobs.sync) \
            if blobs.pending_bytes >= self._settings.overlap_blob_bytes else None
        updates = self._log_row_updates(txn)
        try:
            encoded = encode(txn.logged)
            if writing is None:
                blobs.sync()
            else:
                done, writing = writing, None
                done.result()  # the chunks are durable before any key to them is
            self._putlog.write(encoded)
        except Exception as e:  # noqa: BLE001 - nothing is applied yet: DuckDB takes the group
            if writing is not None:
                try:
                    writing.result()
                except Exception:  # noqa: BLE001 - the first error is the one logged
                    pass
            blobs.rollback()
            index.requeue_row_updates(updates)
            # Once until a write works again: on a full disk every group would log it.
            (log.debug if self._putlog_failing else log.warning)(
                "put log not written, the group goes to DuckDB: %s", e)
            self._putlog_failing = True
            return None
        self._putlog_failing = False
        self.commits += 1  # a group commit, to the log
        self._logged.extend(txn.logged)
        self._logged_values.extend(txn.logged_values)
        self.logged_rows += sum(rows.num_rows for _, _, rows in txn.logged)
        if self._logged_since is None:
            self._logged_since = time.monotonic()
        self._apply(txn)
        return results

    def _logged_committed(self) -> None:
        """The logged rows are committed to DuckDB: forget them and cut the log back."""
        self._logged = []
        self._evict_logged_values()
        self.logged_rows = 0
        self._logged_since = None
        self._retry_delay = self._settings.materialize_delay
        self._retry_at = 0.0
        assert self._putlog is not None
        try:
            self._putlog.clear()
        except OSError as e:  # replay skips rows DuckDB has; only a drop + re-create could mind
            log.error("the put log could not be cut back: %s", e)

    def _start_blob_write(self, txn: _Txn, ops: list[Op]) -> Future | None:
        """Stage the chunks of the group's puts; when they are large, start writing them.

        Why: for wide rows, writing and fsyncing a group's chunks and inserting its rows ran one
        after the other and together took most of the writer's time. DuckDB and the blob write both release the GIL, and the COMMIT only has
        to wait for the chunks to be durable, not start after them. A group with
        maintenance (CallOp: GC rolls and deletes segments) writes its chunks inline.
        """
        blobs = self._blobs
        for op in ops:
            if isinstance(op, PutOp):
                txn.physical[id(op)] = self._with_blob_keys(op.prepared)
        if blobs.pending_bytes < self._settings.overlap_blob_bytes or \
                any(isinstance(op, CallOp) for op in ops):
            return None
        return self._blob_io.submit(blobs.sync)

    # -- puts ----------------------------------------------------------------------------------
    def _puts(self, txn: _Txn, puts: list[tuple[int, PutOp]], results: list[Any]) -> None:
        """Run a run of consecutive puts, merging those with the same shape into one statement."""
        index = self._index
        batch: list[tuple[PreparedPut, pa.Table]] = []
        batch_keys: set[tuple[str, int]] | None = None  # built once a second put may join
        for i, op in puts:
            p = op.prepared
            live = index.live_table(p.table)
            self._check_versions(live, p)
            physical = txn.physical.pop(id(op))
            version = index.versions[live.tdef.version_group]
            if isinstance(op, MergedPutOp):
                results[i] = [{"rows": m.data.num_rows, "version": version} for m in op.members]
                txn.applies.append(functools.partial(index.count_put, p.rows, len(op.members)))
            else:
                results[i] = {"rows": p.rows, "version": version}
                txn.applies.append(functools.partial(index.count_put, p.rows))
            if batch:
                if batch_keys is None:
                    batch_keys = {k for q, _ in batch for k in q.keys}
                if batch[0][0].signature() != p.signature() or not batch_keys.isdisjoint(p.keys):
                    self._write_rows(txn, batch)
                    batch, batch_keys = [], None
                else:
                    batch_keys.update(p.keys)
            batch.append((p, physical))
        if batch:
            self._write_rows(txn, batch)

    def _check_versions(self, live: LiveTable, p: PreparedPut) -> None:
        current = self._index.versions[live.tdef.version_group]
        bound = current - live.tdef.max_staleness
        versions = p.physical.column("policy_version").to_numpy()
        high, low = int(versions.max()), int(versions.min())
        if high > current:
            raise StaleVersion(f"policy_version {high} is ahead of table {p.table!r}'s current "
                               f"version {current}; expected a version in [{max(bound, 0)}, "
                               f"{current}]")
        if low < bound:
            raise StaleVersion(
                f"policy_version {low} is stale for table {p.table!r}: its current version is "
                f"{current} and max_staleness {live.tdef.max_staleness} accepts versions ≥ "
                f"{bound}; regenerate the sample with the current policy")

    def _with_blob_keys(self, p: PreparedPut) -> pa.Table:
        """Append the put's chunks; turn its ``__ref`` row indexes into blob keys."""
        physical = p.physical
        for ref in [n for n in physical.column_names if n.endswith("__ref")]:
            index = one_array(physical.column(ref))
            chunk = p.chunks.get(ref[: -len("__ref")])
            if chunk is None:
                keys = pa.nulls(len(index), pa.large_string())
            else:
                prefix = self._blobs.append(chunk)
                keys = keys_for(prefix, len(index) - index.null_count).take(index)
            physical = physical.set_column(physical.schema.get_field_index(ref), ref, keys)
        return physical

    def _write_rows(self, txn: _Txn, batch: list[tuple[PreparedPut, pa.Table]]) -> None:
        index = self._index
        first = batch[0][0]
        live = index.live_table(first.table)
        tname = first.table
        physical = pa.concat_tables([t for _, t in batch]) if len(batch) > 1 else batch[0][1]
        keys = first.keys if len(batch) == 1 else [k for p, _ in batch for k in p.keys]
        set_mask = np.concatenate([p.set_mask for p, _ in batch])
        clear_mask = np.concatenate([p.clear_mask for p, _ in batch])
        n = len(keys)
        txn_rows = txn.new_rows(tname)
        next_id = txn.next_row_id.get(tname, live.next_row_id)
        terminal: set[int] = set()
        fresh = _all_fresh(live, txn_rows, keys)
        if txn.logged is not None and not fresh:
            raise _NotLoggable("some rows may exist")
        if fresh:  # the bulk case: every row new, numbered in one step
            row_ids = np.arange(next_id, next_id + n, dtype=np.int64)
            txn.add_new_run(tname, keys, next_id)
            next_id += n
            is_new = np.ones(n, bool)
        else:
            row_ids, is_new, next_id = self._classify(live, tname, txn_rows, keys, next_id,
                                                      terminal)
        txn.next_row_id[tname] = next_id
        physical = physical.append_column("row_id", pa.array(row_ids, pa.int64()))
        current = index.versions[live.tdef.version_group]
        con = self._con
        data_cols = first.data_columns
        status_cols = first.status_columns
        tdef = live.tdef
        if is_new.any():
            new_rows = physical if is_new.all() else physical.filter(pa.array(is_new))
            # (column, SQL expression of the value written, with {} for the batch's column)
            inserted: list[tuple[str, str, str | None]] = [
                (c, "{}", c) for c in ("row_id", "sample_id", "input_id", "turn",
                                       "trajectory_id", "policy_version")]
            inserted += [
                ("finished_version", f"coalesce({{}}, {int(current)})", "finished_version"),
                ("created_at", "now()", None), ("updated_at", "now()", None)]
            for c in data_cols:
                inserted.append((c, "{}", c))
                ref = tdef.column(c).ref
                if ref:
                    inserted.append((ref, "{}", ref))
            for s in status_cols:
                inserted.append((s, "coalesce({}, false)", s))
            into = f"INSERT INTO {quote(tname)} ({', '.join(quote(c) for c, _, _ in inserted)}) "
            sources = [src for _, _, src in inserted if src is not None]
            if txn.logged is not None:
                txn.logged.append(("rows", {"table": tname},
                                   _as_inserted(new_rows, inserted, current)))
            elif new_rows.num_rows <= self._settings.values_insert_rows and _bindable(new_rows, sources):
                # A few rows: one parametrised INSERT … VALUES costs less than register +
                # INSERT … SELECT + unregister, whose cost is the same whatever the rows (from a
                # handful of rows on, the registered table wins); the same expressions, with
                # parameters.
                one = "(" + ", ".join(e.format("?") for _, e, _ in inserted) + ")"
                by_col = [new_rows.column(src).to_pylist() for src in sources]
                params = [col[r] for r in range(new_rows.num_rows) for col in by_col]
                con.execute(into + "VALUES " + ", ".join([one] * new_rows.num_rows), params)
            else:
                exprs = [e.format(f"b.{quote(src)}") if src else e for _, e, src in inserted]
                with registered(con, "_expstore_new", new_rows):
                    con.execute(into + f"SELECT {', '.join(exprs)} FROM _expstore_new AS b")
        if (~is_new).any():
            old_rows = physical.filter(pa.array(~is_new)) if is_new.any() else physical
            sets = [f"finished_version = coalesce(b.finished_version, {int(current)})",
                    "updated_at = now()"]
            for c in data_cols:
                w = quote(f"{c}__w")
                sets.append(f"{quote(c)} = CASE WHEN b.{w} THEN b.{quote(c)} ELSE t.{quote(c)} END")
                ref = tdef.column(c).ref
                if ref:
                    sets.append(f"{quote(ref)} = CASE WHEN b.{w} THEN b.{quote(ref)} "
                                f"ELSE t.{quote(ref)} END")
            for s in status_cols:
                sets.append(f"{quote(s)} = coalesce(b.{quote(s)}, t.{quote(s)})")
            update = f"UPDATE {quote(tname)} AS t SET {', '.join(sets)} FROM "
            used = ["row_id", "finished_version"]
            for c in data_cols:
                used += [c, f"{c}__w"] + ([ref] if (ref := tdef.column(c).ref) else [])
            used += status_cols
            if old_rows.num_rows <= self._settings.values_update_rows and _bindable(old_rows, used):
                # A few rows (partial writes of single samples): the batch's columns as a
                # parametrised VALUES list instead of a registered Arrow table.
                one = "(" + ", ".join(["?"] * len(used)) + ")"
                by_col = [old_rows.column(c).to_pylist() for c in used]
                params = [col[r] for r in range(old_rows.num_rows) for col in by_col]
                updated = con.execute(
                    update + f"(VALUES {', '.join([one] * old_rows.num_rows)}) AS b("
                    f"{', '.join(map(quote, used))}) WHERE t.row_id = b.row_id", params).fetchall()
            else:
                with registered(con, "_expstore_old", old_rows):
                    updated = con.execute(update + "_expstore_old AS b WHERE t.row_id = b.row_id"
                                          ).fetchall()
            _check_updated(updated, old_rows.num_rows, tname)

        payload = None  # the rows' claimable values, if this write holds them all
        cached = None   # payload, if the claim cache keeps it (see store/cache.py)
        complete = np.zeros(len(keys), bool)
        if len(data_cols) == len(tdef.columns):
            # The write carries every data column: the row's claimable values are all here.
            values: dict[str, Any] = {n: physical.column(n) for n in
                                      ("sample_id", "input_id", "turn", "trajectory_id",
                                       "policy_version")}
            values["finished_version"] = _or(physical.column("finished_version"),
                                             pa.scalar(int(current), pa.int64()))
            for col in tdef.columns:
                values[col.name] = physical.column(col.name)
                if col.ref:
                    values[col.ref] = physical.column(col.ref)
            for col in tdef.columns:
                values[col.status] = _or(physical.column(col.status), _FALSE)
            # The columns have the cache's types already (a cast of the table was most of a
            # one-row put's Python in the writer after its INSERT).
            schema = live.payload_schema
            payload = pa.Table.from_arrays([values[f.name] for f in schema], schema=schema)
            if txn.logged is not None:  # DuckDB cannot serve these rows before the log is applied
                index.cache.hold(payload)
                txn.logged_values.append((live, keys, payload))
                cached = payload
            elif index.cache.admit(payload):
                cached = payload
            # Per row: a null value leaves the stored one, which this batch does not hold, so
            # only rows that wrote every data column may take their values from it.
            complete = np.logical_and.reduce([
                physical.column(f"{c.name}__w").to_numpy(zero_copy_only=False).astype(bool)
                for c in tdef.columns])
        ready = (set_mask & live.required_mask) == live.required_mask
        if txn.logged is not None and (ready & ~complete).any():
            raise _NotLoggable("a ready row's values would have to be read from DuckDB")

        if fresh and payload is not None and complete.all() and ready.all():
            # Every row new, ready and with its values at hand (the bulk case): indexed as one
            # block, its rows built when a claim or a write first touches their group.
            codes, group_keys = _group_codes(physical)
            block = RowBlock(keys, row_ids, physical.column("turn").to_numpy(),
                             physical.column("trajectory_id").to_numpy(), set_mask, codes,
                             cached, group_keys)

            def apply_block() -> None:
                if index.live.get(tname) is not live:
                    return  # dropped meanwhile
                live.next_row_id = max(live.next_row_id, next_id)
                live.add_block(block)

            txn.applies.append(apply_block)
            return

        input_ids = physical.column("input_id").to_pylist()
        turns = physical.column("turn").to_pylist()
        trajs = physical.column("trajectory_id").to_pylist()
        ids_list = row_ids.tolist()
        new_list = is_new.tolist()
        sets = set_mask.tolist()
        clears = clear_mask.tolist()
        complete_list = complete.tolist()

        def apply() -> None:
            if index.live.get(tname) is not live:
                return  # dropped meanwhile
            live.next_row_id = max(live.next_row_id, next_id)
            required = live.required_mask
            rows = live.rows
            rows_get = rows.get
            add_ready = live.add_ready
            for i, key in enumerate(keys):
                rid = ids_list[i]
                if terminal and rid in terminal:
                    continue
                row = rows_get(key)
                if isinstance(row, RowBlock):
                    row = live.row(key)  # still in a bulk put's block: build it
                if row is None:
                    if not new_list[i]:
                        continue  # consumed or gone since: nothing live to update
                    # A new row (the bulk case): its mask is what this write set.
                    mask = sets[i]
                    row = Row(rid, key[0], key[1], input_ids[i], turns[i], trajs[i], mask)
                    rows[key] = row
                    if cached is not None and complete_list[i]:
                        row.payload = (cached, i)
                    if mask & required == required:
                        add_ready(row, key)
                        if row.payload is None:
                            txn.need_payload.append((live, row))
                    continue
                row.mask = (row.mask & ~clears[i]) | sets[i]
                row.payload = (cached, i) if cached is not None and complete_list[i] else None
                if row.state == LEASED:
                    continue
                if row.mask & required == required:
                    live.make_ready(row)
                    if row.payload is None:
                        txn.need_payload.append((live, row))
                else:
                    live.unready(row)
        txn.applies.append(apply)

    def _classify(self, live: LiveTable, tname: str, txn_rows: dict[tuple[str, int], int],
                  keys: list[tuple[str, int]], next_id: int,
                  terminal: set[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Row ids of ``keys``: a live row's, one new earlier in this transaction's, a terminal
        row's (added to ``terminal``: the write updates it) or a new one from ``next_id``.

        Returns (row ids, which are new, the next free row id).
        """
        n = len(keys)
        first_id = next_id
        rows_get = live.rows.get
        txn_get = txn_rows.get
        # Keys neither live nor new in this transaction may be terminal rows (consumed, stale,
        # dead: an at-least-once producer re-sending); the write then updates them instead of
        # inserting the key twice. The table's terminal index answers; without one, DuckDB.
        terminal_index = live.terminal
        ids: list[int] = [0] * n
        new_flags: list[bool] = [False] * n
        for i, key in enumerate(keys):
            row = rows_get(key)
            if row is not None:
                ids[i] = row.row_id_of(key) if isinstance(row, RowBlock) else row.row_id
                continue
            known = txn_get(key)
            if known is not None:
                ids[i] = known
                continue
            if terminal_index is not None:
                by_sid = terminal_index.get(key[1])
                rid = by_sid.get(key[0]) if by_sid is not None else None
                if rid is not None:
                    ids[i] = rid
                    terminal.add(rid)
                    continue
            ids[i] = next_id
            txn_rows[key] = next_id
            next_id += 1
            new_flags[i] = True
        row_ids = np.array(ids, np.int64)
        is_new = np.array(new_flags, bool)
        # No index (or it was given up while we looked: forget() fills it before a row leaves
        # ``rows``, so only its removal can hide a key): ask DuckDB about the keys left.
        if is_new.any() and (terminal_index is None or live.terminal is not terminal_index):
            found = self._existing_rows(tname, [keys[i] for i in np.nonzero(is_new)[0]])
            if found:
                for i in np.nonzero(is_new)[0].tolist():
                    rid = found.get(keys[i])
                    if rid is not None:
                        txn_rows.pop(keys[i], None)
                        row_ids[i] = int(rid)
                        is_new[i] = False
                        terminal.add(int(rid))
                # Re-number what is really new so row ids stay dense.
                next_id = first_id
                for i in np.nonzero(is_new)[0].tolist():
                    row_ids[i] = next_id
                    txn_rows[keys[i]] = next_id
                    next_id += 1
        return row_ids, is_new, next_id

    def _existing_rows(self, table: str, keys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Row ids of keys already in DuckDB (only terminal rows can be; live ones are known)."""
        if not self._index.may_have_terminal_rows(table):
            return {}
        if len(keys) <= self._settings.point_lookup_keys:  # a few filtered scans cost less than one join
            out: dict[tuple[str, int], int] = {}
            for key in keys:
                hit = self._con.execute(
                    f"SELECT row_id FROM {quote(table)} WHERE sample_id = ? AND policy_version = ?",
                    list(key)).fetchall()
                if hit:
                    out[key] = int(hit[0][0])
            return out
        probe = pa.table({"sample_id": [k[0] for k in keys],
                          "policy_version": pa.array([k[1] for k in keys], pa.int64())})
        with registered(self._con, "_expstore_probe", probe):
            found = self._con.execute(
                f"SELECT t.sample_id, t.policy_version, t.row_id FROM {quote(table)} AS t "
                "JOIN _expstore_probe AS p USING (sample_id, policy_version)").fetchall()
        return {(s, int(v)): int(r) for s, v, r in found}

    # -- acks, nacks ------------------------------------------------------------------------
    def _settle(self, txn: _Txn, op: SettleOp) -> dict[str, Any]:
        index = self._index
        lease = op.lease
        with index.lock:
            plan = index.settle_plan(lease, ack=op.ack)
            index.supersede_row_updates(lease, plan)
        for tname, rows in plan.items():
            if tname not in index.live:
                continue
            if op.ack:
                # The claim's lease columns may not be flushed yet (and never will be once the
                # row is consumed), so the ack writes the delivery count and owner itself.
                version = index.versions[index.live[tname].tdef.version_group]
                n = len(rows)
                self._record(txn, ("ack", {"table": tname}, pa.table({
                    "row_id": pa.array([r.row_id for r, _ in rows], pa.int64()),
                    "delivery_count": pa.array([r.deliveries for r, _ in rows], pa.int32()),
                    "consumed_version": pa.array([version] * n, pa.int64()),
                    "lease_id": pa.array([lease.claim_id] * n, pa.string()),
                    "lease_owner": pa.array([lease.owner] * n, pa.string()),
                    "updated_at": _now(n)})))
                continue
            nacked: ListColumns = {"row_id": ("BIGINT", [r.row_id for r, _ in rows]),
                                   "delivery_count": ("INTEGER", [r.deliveries for r, _ in rows]),
                                   "dead": ("BOOLEAN", [o == "dead" for _, o in rows]),
                                   "stale": ("BOOLEAN", [o == "stale" for _, o in rows])}
            with row_source(self._con, "_expstore_nack", nacked) as (source, params):
                self._con.execute(
                    f"UPDATE {quote(tname)} AS t SET is_processing = false, "
                    "lease_expires_at = NULL, delivery_count = b.delivery_count, "
                    "dead = b.dead, stale = t.stale OR b.stale, updated_at = now() "
                    f"FROM {source} AS b WHERE t.row_id = b.row_id", params)
        txn.applies.append(functools.partial(index.settled, lease, plan,
                                             "ack" if op.ack else "nack"))
        return {"claim_id": lease.claim_id, "acked" if op.ack else "nacked": len(lease.rows)}

    def _record(self, txn: _Txn, record: Record) -> None:
        """A change as the put log holds it: logged in a logged group, else applied now (one
        statement text for either way, in store/putlog.py)."""
        if txn.logged is not None:
            txn.logged.append(record)
        else:
            apply_records(self._con, [record], self._index.live)

    # -- versions -------------------------------------------------------------------------------
    def _bump(self, txn: _Txn, op: BumpOp) -> int:
        index = self._index
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
        self._record(txn, ("bump", {
            "group": op.group, "version": new, "weights_uri": op.weights_uri,
            "at": dt.datetime.now(dt.timezone.utc).isoformat()}, pa.table({
                "table": pa.array([live.tdef.name for live, rows in stale for _ in rows],
                                  pa.string()),
                "row_id": pa.array([r.row_id for _, rows in stale for r in rows],
                                   pa.int64())})))

        txn.applies.append(functools.partial(index.apply_bump, op.group, new, op.weights_uri,
                                             stale))
        return new

    # -- lease bookkeeping -----------------------------------------------------------------
    def _row_updates(self, txn: _Txn) -> None:
        """Write the lease columns (and stale/dead flags) that claims and expiries changed."""
        updates = self._index.take_row_updates()
        if not updates:
            return
        txn.row_updates = updates
        con = self._con
        for tname, rows in updates.items():
            if tname not in self._index.live:
                continue
            leases: ListColumns = {name: (kind, [getattr(r, name) for r in rows])
                                   for name, kind in LEASE_COLUMNS}
            with row_source(con, "_expstore_leases", leases) as (source, params):
                con.execute(lease_update(tname, source), params)

    def _log_row_updates(self, txn: _Txn) -> dict[str, list[LeaseUpdate]]:
        """The lease bookkeeping a logged group carries (as a DuckDB transaction would)."""
        assert txn.logged is not None
        updates = self._index.take_row_updates()
        for tname, rows in updates.items():
            if tname in self._index.live:
                txn.logged.append(("leases", {"table": tname}, lease_table(rows)))
        return updates


def _group_codes(physical: pa.Table) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Each row's group number, groups numbered in the order they first appear, and the groups'
    keys ``(policy_version, input_id)``.

    Why Arrow: a bulk put's rows have one version, and dictionary-encoding the input ids numbers
    the groups the same way as a dict filled row by row, at a fraction of its cost.
    """
    versions = physical.column("policy_version")
    bounds = pc.min_max(versions)
    version = bounds["min"].as_py()
    if version == bounds["max"].as_py():
        encoded = pc.dictionary_encode(physical.column("input_id").combine_chunks())
        return (encoded.indices.to_numpy(zero_copy_only=False),
                [(version, iid) for iid in encoded.dictionary.to_pylist()])
    by_group: dict[tuple[int, str], int] = {}
    get = by_group.get
    codes: list[int] = []
    for gk in zip(versions.to_pylist(), physical.column("input_id").to_pylist()):
        g = get(gk)
        if g is None:
            g = by_group[gk] = len(by_group)
        codes.append(g)
    return np.array(codes, np.int64), list(by_group)


def _all_fresh(live: LiveTable, txn_rows: dict[tuple[str, int], int],
               keys: list[tuple[str, int]]) -> bool:
    """Whether every key is new: not live, not new earlier in this transaction, not a remembered
    terminal row (False without a terminal index: DuckDB must be asked).

    Why: a bulk put's keys are all new, and set operations check them many times faster than the
    per-key loop of :meth:`Writer._classify`.
    """
    terminal = live.terminal
    if terminal is None or not live.rows.keys().isdisjoint(keys) \
            or (txn_rows and not txn_rows.keys().isdisjoint(keys)):
        return False
    if terminal:
        versions = {v for _, v in keys}
        for version in [v for v in versions if v in terminal]:
            sids = (s for s, v in keys if v == version) if len(versions) > 1 else \
                (s for s, _ in keys)
            if not terminal[version].keys().isdisjoint(sids):
                return False
    # A row forgotten meanwhile is remembered before it leaves ``rows``, unless the index was
    # given up (see Writer._classify).
    return live.terminal is terminal


def _as_inserted(rows: pa.Table, inserted: list[tuple[str, str, str | None]],
                 current: int) -> pa.Table:
    """The rows an ``INSERT`` of ``inserted`` (column, SQL expression, source column) would
    write, computed in Arrow, for the put log."""
    n = rows.num_rows
    now = _now(n)
    columns: list[Any] = []
    for _, expression, source in inserted:
        if source is None:
            assert expression == "now()", expression
            columns.append(now)
        elif expression == "{}":
            columns.append(rows.column(source))
        elif expression == "coalesce({}, false)":
            columns.append(_or(rows.column(source), _FALSE))
        else:
            assert expression == f"coalesce({{}}, {int(current)})", expression
            column = rows.column(source)
            columns.append(pa.array(np.full(n, current, np.int64)) if column.null_count == n
                           else _or(column, pa.scalar(int(current), pa.int64())))
    return pa.Table.from_arrays(columns, names=[c for c, _, _ in inserted])


_FALSE = pa.scalar(False)
_TIMESTAMPTZ = pa.timestamp("us", "UTC")


def _now(n: int) -> pa.Array:
    """The time now, ``n`` times, as DuckDB's now() would give it to a TIMESTAMPTZ column."""
    now = time.time_ns() // 1000
    if n <= 64:  # (for a few rows a list is cheaper than numpy's set-up)
        return pa.array([now] * n, _TIMESTAMPTZ)
    return pa.array(np.full(n, now, "datetime64[us]"), _TIMESTAMPTZ)


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


def _invalidated(con: duckdb.DuckDBPyConnection, error: BaseException) -> bool:
    """Whether DuckDB invalidated the database (after a failed checkpoint or WAL write, e.g.
    a full disk): every statement fails until it is opened again. Asked of the database itself,
    not read from the error's text."""
    if isinstance(error, duckdb.FatalException):
        return True
    try:
        con.execute("SELECT 1").fetchall()
    except duckdb.Error:
        return True
    return False


def _cause(error: BaseException) -> str:
    """An error's text for the one line that names a storage fault."""
    text = str(error)
    return text if len(text) <= 400 else f"{text[:400]}… ({len(text)} characters)"


def _reads_apart(ops: list[Op]) -> list[list[Op] | ReadOp]:
    """The ops in order, each read on its own between the runs of the others (a run may be
    empty: lease bookkeeping alone)."""
    parts: list[list[Op] | ReadOp] = []
    run: list[Op] = []
    for op in ops:
        if isinstance(op, ReadOp):
            if run:
                parts.append(run)
                run = []
            parts.append(op)
        else:
            run.append(op)
    if run or not parts:
        parts.append(run)
    return parts


def _bumps_apart(ops: list[Op]) -> list[list[Op]]:
    """Split a group so that every version bump commits with nothing but the acks queued right
    before it; whatever follows a bump starts a new group.

    Why: puts are checked against, and nacks settled by, the in-memory versions and rows, which a
    transaction updates only after its commit. A put sharing a transaction with a bump would be
    checked against the old version, and its rows would miss the bump's stale marking: a
    strictly on-policy trainer would then be handed samples of the previous policy. Acks before
    a bump may share its commit (one fsync for a trainer's last ack and its bump): the rows they
    consume are leased, which the bump's stale marking passes over, and they record the version
    before the bump, as they would in a commit of their own.
    """
    parts: list[list[Op]] = [[]]
    for op in ops:
        if isinstance(op, BumpOp):
            if not all(isinstance(o, SettleOp) and o.ack for o in parts[-1]):
                parts.append([])
            parts[-1].append(op)
            parts.append([])
        else:
            parts[-1].append(op)
    return [p for p in parts if p] or [[]]


def _or(column: pa.ChunkedArray, default: pa.Scalar) -> pa.ChunkedArray:
    """``coalesce(column, default)``, without a kernel call when nothing is null."""
    return pc.coalesce(column, default) if column.null_count else column


def _bindable(table: pa.Table, names: list[str]) -> bool:
    """Whether these columns go through Python values to DuckDB parameters unchanged."""
    return all(_bindable_type(table.schema.field(n).type) for n in names)


def _bindable_type(t: pa.DataType) -> bool:
    return (pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_float32(t)
            or pa.types.is_float64(t) or pa.types.is_large_string(t)
            or pa.types.is_string(t))


def _check_updated(result: list[tuple], expected: int, table: str) -> None:
    """Every row a put updates exists: a miss would lose the write, so the transaction fails."""
    if result and int(result[0][0]) != expected:
        raise StorageError(f"a write to {table!r} updated {int(result[0][0])} rows, expected "
                           f"{expected}; nothing was written")


def _futures(op: Op) -> list[Future]:
    """The futures that answer an op's callers (one for each put of a merged put)."""
    if isinstance(op, MergedPutOp):
        return [m.future for m in op.members]
    return [op.future]


def _resolve(op: Op, result: Any) -> None:
    results = result if isinstance(op, MergedPutOp) else [result]
    for future, one in zip(_futures(op), results):
        if not future.done():
            future.set_result(one)


def _fail(op: Op, error: BaseException) -> None:
    if not isinstance(error, ExpstoreError):
        if isinstance(error, duckdb.Error):
            error = StorageError(f"the store could not apply the change: {error}")
    for future in _futures(op):
        if not future.done():
            future.set_exception(error)
