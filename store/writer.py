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

This module is the loop: taking groups, the transaction, storage faults. What goes into one group
(reads and bumps apart, small puts prepared and merged) is store/op_groups.py. What a group runs
lives beside it: the operations and a transaction's effects (store/ops.py), the row SQL of puts
(store/rows_sql.py), settles and bumps (store/settle.py), the changes waiting in the put log
(store/logged.py), checkpoints (store/checkpoints.py). The writer reads and changes the in-memory
index (store/index.py) it is given; it does not know the store facade.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import duckdb
import pyarrow as pa

from .blobs import BlobStore
from .checkpoints import Checkpoints
from .errors import ExpstoreError, StorageError, StorageUnavailable, StoreClosed
from .index import StoreIndex
from .live import LiveTable, Row
from .op_groups import bumps_apart, merged_apart, prepare_small, reads_apart
from .opening import invalidated, run_checkpoint
from .ops import BumpOp, CallOp, FlushOp, MergedPutOp, NotLoggable, Op, PutOp, ReadOp, SettleOp, \
    Txn, fail, resolve
from .logged import LoggedChanges
from .putlog import PutLog, apply_records
from .rows_sql import RowWriter
from .settings import StoreSettings
from .settle import bump, log_lease_updates, settle, write_lease_updates
from .storage_fault import StorageFault

#: Rows' claimable values by row id: a cached Arrow table and the row's index in it.
Payloads = dict[int, tuple[pa.Table, int]]

log = logging.getLogger("expstore.writer")

_WAKE = object()  # queued by Writer.poke


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
        # Changes durable in the put log, not yet in DuckDB (see store/logged.py).
        self._logged = LoggedChanges(putlog, index, blobs, settings)
        # Ops; None: close; _WAKE: recompute how long to sleep (see poke)
        self._queue: queue.Queue[Op | object | None] = queue.Queue()
        self._flush_due: float | None = None
        self._closed = False
        self._fatal: BaseException | None = None
        self._taken: list[Op] = []  # the ops of the group being run
        # Set while the database cannot be written (see store/storage_fault.py).
        self._fault: StorageFault | None = None
        self.commits = 0  # group commits: DuckDB transactions and put-log appends
        self._blob_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expstore-blob-io")
        # CHECKPOINTs run on a thread (and cursor) of their own: see store/checkpoints.py.
        self._checkpoints = Checkpoints(settings, wal_path, wake=lambda: self._queue.put(_WAKE))
        self._rows = RowWriter(index, blobs, settings)
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
            fail(op, fault.error(len(self._logged), read=isinstance(op, ReadOp)))
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

    def read_fault(self) -> Exception | None:
        """The error for a read that failed while the database cannot be read (invalidated
        under it, or missing acknowledged changes), if it cannot now."""
        fault = self._fault
        return None if fault is None else fault.error(len(self._logged), read=True)

    @property
    def logged_rows(self) -> int:
        """Rows in the put log that DuckDB does not hold yet."""
        return self._logged.rows

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
        self._checkpoints.close()
        self._blob_io.shutdown()
        self._logged.close()

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
            logged_due = self._logged.seconds_to_due()
            if logged_due is not None and not self._checkpoint_running():
                # (a running checkpoint wakes the loop when it ends: see Checkpoints)
                timeout = max(0.0, min(timeout, logged_due))
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
                    fail(op, error)
                if stop:
                    self._stop_faulted()
                    return
                continue
            # Lease bookkeeping rides along with the group once its flush is due (or nothing
            # asked for one: expiries), not sooner: most claims are acked before then, and an
            # ack supersedes their bookkeeping, which is then never written at all. A close
            # writes what is pending: after a restart, an ack of a claim made before it is told
            # that the restart voided the lease, not that the claim is unknown.
            leases = stop or self._flush_due is None or time.monotonic() >= self._flush_due \
                or any(isinstance(op, FlushOp) and op.leases for op in ops)
            if leases:
                self._flush_due = None
            if ops or (leases and self._index.has_pending_row_updates()):
                for part in reads_apart(ops):
                    if isinstance(part, ReadOp):
                        self._read(part)
                        continue
                    for group in bumps_apart(part):
                        self._run_group(group, leases)
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
            fail(op, self._fault.error(len(self._logged), read=True))
            return
        try:
            resolve(op, op.run(self._con))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            fail(op, e)

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
            fault.update(_cause(e), invalidated(self._con, e))
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
        self._checkpoints.reopened()
        self._con = self._reopen_database()
        # The changes logged before may have reached DuckDB's WAL in the COMMIT that failed.
        self._logged.replay = bool(self._logged)

    def _stop_faulted(self) -> None:
        """Close while the database cannot be written: what was acknowledged stays in the put
        log, applied when the store is opened again."""
        if self._logged:
            log.warning("closing while the database cannot be written: %d acknowledged changes "
                        "stay in the put log %r and are applied when the store opens again",
                        len(self._logged), getattr(self._logged.putlog, "path", None))
        self._drain(StoreClosed("the store is closed"))

    def _materialize_due(self) -> bool:
        return self._logged.due(self._checkpoint_running())

    def _drain(self, error: ExpstoreError) -> None:
        """Fail every op still queued with ``error``."""
        while True:
            try:
                op = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, Op) and not op.future.done():
                op.future.set_exception(error)

    # -- checkpoints (see store/checkpoints.py) ---------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        """Start a CHECKPOINT once DuckDB has been idle a while (not during a storage fault)."""
        if self._fault is None and not self._checkpoint_running():
            self._checkpoints.start_if_idle(self._con)

    def _checkpoint_if_wal_full(self) -> None:
        """Start a CHECKPOINT once DuckDB's WAL is full (not during a storage fault)."""
        if self._fault is None and not self._checkpoint_running():
            self._checkpoints.start_if_wal_full(self._con)

    def _checkpoint_running(self) -> bool:
        """Whether a checkpoint is running on the checkpoint thread (one that ended is
        reaped)."""
        if self._checkpoints.ended():
            self._checkpoint_finished()
        return self._checkpoints.running

    def _checkpoint_finished(self) -> None:
        """Wait for a running checkpoint (before any DuckDB transaction of the writer)."""
        error = self._checkpoints.finish(self._con)
        if error is not None:  # it invalidated the database (a full disk: see storage_fault.py)
            self._enter_fault(error, invalid=True)

    def _run_group(self, ops: list[Op], leases: bool = True) -> None:
        """Commit a group of operations; with ``leases``, the pending lease bookkeeping too."""
        given = len(ops)
        ops = prepare_small(self._index, ops, self._settings.merged_put_rows)
        if given and not ops and not (leases and self._index.has_pending_row_updates()):
            return  # every put of the group was refused: nothing to commit
        logged = self._log_puts(ops, leases)
        if logged is not None:
            for op, result in zip(ops, logged):
                resolve(op, result)
            return
        if self._logged and any(isinstance(op, CallOp) for op in ops):
            # DDL commits apart from logged rows: a crash between that COMMIT and cutting the
            # log back must not leave rows of a dropped table to replay into a new one.
            self._materialize()
        try:
            results, txn = self._transaction(ops, leases)
        except Exception as group_error:  # noqa: BLE001 - isolate the culprit below
            if self._fault is not None:  # DuckDB cannot be written: every op is refused
                for op in ops:
                    fail(op, self._fault.error(len(self._logged)))
                return
            if len(ops) == 1 and not isinstance(ops[0], MergedPutOp):
                fail(ops[0], group_error)
                return
            if not ops:
                log.error("writing lease bookkeeping failed: %s", group_error)
                return
            for op in merged_apart(self._index, ops):
                try:
                    (result,), txn = self._transaction([op], leases)
                except Exception as e:  # noqa: BLE001
                    fail(op, e)
                else:
                    resolve(op, result)
                    self._fill_payloads(txn)
            return
        for op, result in zip(ops, results):
            resolve(op, result)
        self._fill_payloads(txn)

    def _fill_payloads(self, txn: Txn) -> None:
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

    def _transaction(self, ops: list[Op], leases: bool = True) -> tuple[list[Any], Txn]:
        index = self._index
        con = self._con
        txn = Txn()
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
            if self._logged.putlog is not None:
                self._logged.putlog.sync_cut()  # see PutLog.clear
            con.execute("BEGIN TRANSACTION")
            # first: changes stay in order
            apply_records(con, self._logged.records, index.live, replaying=self._logged.replay)
            in_ops = True
            blob_write = self._start_blob_write(txn, ops)
            self._run_ops(txn, ops, results)
            if leases:
                write_lease_updates(self._con, self._index, txn)
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
                self._logged.apply_failed()
            invalid = isinstance(e, duckdb.Error) and invalidated(con, e)
            if invalid or (logged and not in_ops and isinstance(e, (OSError, duckdb.Error))):
                # DuckDB cannot take what is acknowledged already: refuse every change until
                # it can (a failure of a group with nothing logged fails only the group)
                raise self._enter_fault(e, invalid).error(len(self._logged)) from e
            if isinstance(e, (OSError, duckdb.IOException)):
                raise StorageError(f"the database could not be written: {e}") from e
            raise
        self.commits += 1
        self._checkpoints.committed()
        self._logged.replay = False
        if logged:
            self._logged.applied()
        self._apply(txn)
        return results, txn

    def _apply(self, txn: Txn) -> None:
        """A durable group's effects on memory (its COMMIT or its log append happened)."""
        index = self._index
        with index.lock:
            for effect in txn.applies:
                effect()
            index.notify()

    def _run_ops(self, txn: Txn, ops: list[Op], results: list[Any]) -> None:
        """Run a group's operations in order (consecutive puts together)."""
        puts: list[tuple[int, PutOp]] = []
        for i, op in enumerate(ops):
            if isinstance(op, PutOp):
                puts.append((i, op))
                continue
            if puts:
                self._rows.write_puts(self._con, txn, puts, results)
                puts = []
            if isinstance(op, SettleOp):
                results[i] = settle(self._con, self._index, txn, op)
            elif isinstance(op, BumpOp):
                results[i] = bump(self._con, self._index, txn, op)
            elif isinstance(op, CallOp):
                if txn.logged is not None:
                    raise NotLoggable("DDL and maintenance run in DuckDB")
                value = op.run(self._con)
                if op.apply is not None:
                    apply = op.apply
                    txn.applies.append(functools.partial(apply, value))
                results[i] = value
        if puts:
            self._rows.write_puts(self._con, txn, puts, results)

    # -- the put log ---------------------------------------------------------------------------
    def _log_puts(self, ops: list[Op], leases: bool = True) -> list[Any] | None:
        """Make a group durable in the put log instead of DuckDB; its results, or None when
        the group must go through DuckDB.

        A group qualifies when it is only puts, acks and bumps (see op_groups.bumps_apart),
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
        if self._logged.putlog is None or (not ops and not index.has_pending_row_updates()) or any(
                not isinstance(op, (PutOp, BumpOp)) and not (isinstance(op, SettleOp) and op.ack)
                for op in ops) \
                or sum(op.prepared.rows for op in puts) > self._settings.log_put_rows:
            return None
        txn = Txn()
        txn.logged = []
        results: list[Any] = [None] * len(ops)
        try:
            for op in puts:
                txn.physical[id(op)] = self._rows.with_blob_keys(op.prepared)
            self._run_ops(txn, ops, results)
        except Exception:  # noqa: BLE001 - NotLoggable, or an error the DuckDB path reports
            self._blobs.rollback()
            return None
        updates = log_lease_updates(self._index, txn) if leases else {}
        if not self._logged.append(txn, updates, self._blob_io):
            return None
        self.commits += 1  # a group commit, to the log
        self._apply(txn)
        return results

    def _start_blob_write(self, txn: Txn, ops: list[Op]) -> Future | None:
        """Stage the chunks of the group's puts; when they are large, start writing them.

        Why: for wide rows, writing and fsyncing a group's chunks and inserting its rows ran one
        after the other and together took most of the writer's time. DuckDB and the blob write both release the GIL, and the COMMIT only has
        to wait for the chunks to be durable, not start after them. A group with
        maintenance (CallOp: GC rolls and deletes segments) writes its chunks inline.
        """
        blobs = self._blobs
        for op in ops:
            if isinstance(op, PutOp):
                txn.physical[id(op)] = self._rows.with_blob_keys(op.prepared)
        if blobs.pending_bytes < self._settings.overlap_blob_bytes or \
                any(isinstance(op, CallOp) for op in ops):
            return None
        return self._blob_io.submit(blobs.sync)


def _cause(error: BaseException) -> str:
    """An error's text for the one line that names a storage fault."""
    text = str(error)
    return text if len(text) <= 400 else f"{text[:400]}… ({len(text)} characters)"
