"""The embedded experience store: one DuckDB file, its put log and a blob directory, in-process.

>>> import store, tempfile, os
>>> s = store.connect(os.path.join(tempfile.mkdtemp(), "x.duckdb"))
>>> _ = s.create_table("solver", {"response": "string", "reward": "float64"})
>>> s.put("solver", [{"sample_id": "q1_0_0", "response": "4", "reward": 1.0}])["rows"]
1
>>> c = s.claim("solver", 16)
>>> c.data.column("reward").to_pylist()
[1.0]
>>> s.ack(c.claim_id)["acked"]
1
>>> s.close()
"""
from __future__ import annotations

import functools
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Mapping

import duckdb
import pyarrow as pa
import pyarrow.fs as pafs

from . import maintenance, versions
from .barrier import DEFAULT_BARRIER_TIMEOUT, check_expected, check_timeout, weights_of
from .barriers import Barriers
from .blobs import BlobStore
from .claim_engine import ClaimEngine
from .claims import Claim, ClaimRequest, claim_requests
from .errors import ExpstoreError, InvalidArgument, StorageError, StoreClosed
from .index import StoreIndex
from .live_row_limit import check_room, small_put_keys
from .naming import check_identifier
from .opening import check_memory_limit, connect_duckdb, ensure_catalog, run_checkpoint
from .ops import BumpOp, CallOp, FlushOp, PutOp, ReadOp, SmallPutOp
from .prepare import SMALL_ROWS, check_columns, put_timeout, to_arrow_table
from .putlog import PutLog, log_path, replay
from .readers import Readers
from .recovery import load_state
from .reports import lease_list, table_stats
from .requeue import dead_row_ids, requeue_op
from .retention import check_drop_rows, check_keep_versions
from .schema import TableDef
from .settings import StoreSettings
from .settler import Settler
from .sqlguard import check_query_options, check_select, predicate_query
from .sql_query import run_select
from .table_ddl import create_table_op, drop_table_op
from .waits import check_wait
from .writer import Writer

log = logging.getLogger("expstore.store")



class EmbeddedStore:
    """The experience store on a local DuckDB file (see the module docstring for an example).

    Args:
        path: the DuckDB file; created with a fresh catalog if missing.
        blob_dir: where by-reference values go (default ``<path>.blobs``).
        blob_filesystem: a ``pyarrow.fs.FileSystem`` for the blob store (S3, …); default local.
        settings: the store's settings (:class:`store.settings.StoreSettings`; its defaults
            when None).
        **options: fields of :class:`~store.settings.StoreSettings` to set on top of
            ``settings`` (``cache_limit="512MB"``, ``max_live_rows=100_000``, …).
    """

    def __init__(self, path: str, *, blob_dir: str | None = None,
                 blob_filesystem: pafs.FileSystem | None = None,
                 settings: StoreSettings | None = None, **options: Any) -> None:
        self.path = path
        self.settings = settings = (settings or StoreSettings()).with_options(**options)
        self.max_live_rows = settings.max_live_rows
        self.ref_threshold = settings.ref_threshold
        self.query_timeout = settings.query_timeout
        memory_limit, max_concurrent_queries = settings.memory_limit, settings.max_concurrent_queries
        check_memory_limit(memory_limit)
        ensure_catalog(path)
        self._memory_limit = memory_limit
        self._con = connect_duckdb(path, memory_limit)
        try:
            self.blobs = BlobStore(blob_dir or f"{path}.blobs", blob_filesystem,
                                   recent_bytes=settings.blob_recent_bytes,
                                   segment_bytes=settings.blob_segment_bytes,
                                   direct_io=settings.blob_direct_io)
            replayed = replay(self._con, path)
            if replayed:
                log.info("%d rows of the put log inserted after an unclean stop", replayed)
            state = load_state(self._con, settings.terminal_index_max)
            putlog = PutLog(log_path(path))
        except BaseException:
            self._con.close()
            raise
        #: The in-memory state the writer and the reads share (see store/index.py).
        self._index = index = StoreIndex(state, settings)
        self.cache = index.cache
        #: Monotonic counters for monitoring (flight_server.metrics exports them).
        self.counters = index.counters
        self._closed = False
        # The parts, each given what it needs (the writer is started last; the reads reach it
        # through these callables only).
        self._readers = Readers(self._con, index, self.blobs, max_concurrent_queries,
                                materialize=lambda: self._writer.materialize(),
                                read_fault=lambda: self._writer.read_fault())
        self._claims = claims = ClaimEngine(index, self._readers, self.blobs, settings,
                                            poke=lambda: self._writer.poke())
        self._writer = Writer(index, self._con, settings, putlog, blobs=self.blobs,
                              wal_path=f"{path}.wal", reopen=self._reopen_database,
                              load_payloads=lambda live, ids: claims.load_payloads(live, ids))
        self._barriers = Barriers(
            index, bump=lambda group, expected, weights: int(self._writer.call(
                BumpOp(group, expected, weights))), closed=lambda: self._closed)
        self._settler = Settler(index, self._writer, self._readers)
        if index.has_pending_row_updates():
            # The leases this open voided: written before anyone reads, so that SQL does not
            # show their rows as processing while stats and claims say they are ready.
            try:
                self._writer.call(FlushOp())
            except ExpstoreError:  # (a storage fault: the writer keeps them for a later group)
                pass

    # -- tables --------------------------------------------------------------------------------
    def create_table(self, name: str, columns: Mapping[str, Any], *, if_not_exists: bool = False,
                     max_staleness: int = 0, version_group: str | None = None,
                     max_deliveries: int = 5, lease_seconds: float = 60.0,
                     storage: Mapping[str, str] | None = None,
                     required: list[str] | None = None) -> dict[str, Any]:
        """Create an experience table; returns its description.

        Raises:
            AlreadyExists: the table exists and ``if_not_exists`` is false, or one whose name
                differs only in case exists.
            InvalidArgument: a bad name, type, storage mode or setting.
        """
        tdef = TableDef.build(name, columns, version_group=version_group,
                              max_staleness=max_staleness, max_deliveries=max_deliveries,
                              lease_seconds=lease_seconds, storage=storage, required=required)
        self._writer.call(create_table_op(self._index, tdef, if_not_exists))
        return self.describe(name)

    def drop_table(self, name: str, *, if_exists: bool = False) -> bool:
        """Drop a table and its rows; leases on it end. Blobs go at the next :meth:`gc`."""
        check_identifier(name, "table")
        return bool(self._writer.call(drop_table_op(self._index, name, if_exists)))

    def list_tables(self) -> list[str]:
        return self._index.table_names()

    def describe(self, name: str) -> dict[str, Any]:
        """A table's definition, current version and published weights."""
        live = self._index.live_table(name)
        d = live.tdef.describe()
        d["version"] = self._index.version_of(live)
        d["weights_uri"] = self.weights_uri(name)
        d["barrier_timeout"] = self._index.barrier_timeouts.get(live.tdef.version_group,
                                                          DEFAULT_BARRIER_TIMEOUT)
        return d

    def schema(self, name: str) -> pa.Schema:
        """The Arrow schema of a table's rows as claims and reads return them."""
        return self._index.live_table(name).tdef.arrow_schema()

    def claim_schema(self, name: str) -> pa.Schema:
        """The Arrow schema of claimed rows (and of subscription micro-batches)."""
        return self._index.live_table(name).tdef.claim_schema()

    def write_schema(self, name: str) -> pa.Schema:
        """The Arrow schema a producer may write (any subset of it, with ``sample_id``)."""
        return self._index.live_table(name).tdef.write_schema()

    # -- writes --------------------------------------------------------------------------------
    def put(self, table: str, data: Any, *, timeout: float | None = None) -> dict[str, Any]:
        """Upsert samples; returns once they are durable.

        ``data`` is a ``pyarrow.Table`` / ``RecordBatch``, a dict of columns, a list of row
        dicts or a data frame (pandas, polars: anything with ``__arrow_c_stream__``), with
        ``sample_id`` and any subset of the data and status columns (and optionally
        ``policy_version``, default the current version). A written column's status becomes
        true unless the write gives the status itself; a null value leaves that column as it was.
        ``timeout``: None waits as long as it takes, seconds > 0 that long, 0 not at all
        (store/waits.py, the same in every store).

        Raises:
            SchemaMismatch, InvalidArgument: bad columns, types or sample ids, or a timeout that
                is negative, NaN or infinite (nothing is stored).
            StaleVersion: a policy version outside the staleness bound or in the future.
            TimeoutError: not durable within ``timeout`` (it may still be applied).
        """
        timeout = check_wait(timeout, "put")  # before the put is queued: refused, not stored
        future = self.put_async(table, data)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():
                raise  # the put's own error
            raise put_timeout(table, timeout) from None

    def put_async(self, table: str, data: Any) -> Future:
        """Check a write and queue it; the Future resolves once it is durable.

        An unknown table or column raises here. The values of a large write are validated here
        too; those of a small one (≤ ``SMALL_ROWS`` rows) by the writer thread, which prepares
        many small writes at once: their errors, like commit errors (e.g. StaleVersion), come
        from the Future. Several writes in flight at once share group commits (the Flight server
        pipelines a stream's batches this way).
        """
        live = self._index.live_table(table)
        arrow = to_arrow_table(live.tdef, data)
        limit = self.max_live_rows
        if arrow.num_rows <= SMALL_ROWS:
            check_columns(live.tdef, arrow)
            if limit is not None and len(live.rows) + arrow.num_rows > limit:
                check_room(live, small_put_keys(arrow, self._index.version_of(live)), limit)
            return self._writer.submit(SmallPutOp(table, arrow))
        prepared = self._index.prepare(table, arrow)
        if limit is not None and len(live.rows) + prepared.rows > limit:
            check_room(live, prepared.keys, limit)
        return self._writer.submit(PutOp(prepared))

    # -- claims --------------------------------------------------------------------------------
    def claim(self, table: str, limit: int, *, where: str | None = None,
              group_by: str | None = None, group_size: int | None = None,
              consumer: str | None = None, lease_seconds: float | None = None,
              min_rows: int = 1, ack: str | None = None) -> Claim:
        """Lease up to ``limit`` ready rows (see :class:`ClaimRequest`); with ``ack``, first
        ack that claim (see :meth:`ack_and_claim`)."""
        request = ClaimRequest(table, limit, where, group_by, group_size, min_rows)
        if ack is not None:
            claim, acked = self.ack_and_claim(ack, [request], consumer=consumer,
                                              lease_seconds=lease_seconds)
            acked.result()
            return claim
        return self.claim_many([request], consumer=consumer, lease_seconds=lease_seconds)

    def ack_and_claim(self, ack: str, requests: list[ClaimRequest], *,
                      consumer: str | None = None,
                      lease_seconds: float | None = None) -> tuple[Claim, Future]:
        """Ack claim ``ack`` and make a new claim while the ack's commit runs: the new claim,
        and a Future of the ack's answer, resolved once the ack is durable.

        Why: a trainer settles one micro-batch and fetches the next; done as one request, the
        claim's work overlaps the ack's fsync and the pair costs one round trip. The claim
        must not be used before the Future resolves: if the ack's commit fails, the new claim's
        rows are given back (no delivery counted) and the Future raises what ack would, the
        acked claim staying leased as after a failed ack. A malformed new claim (or one naming
        an unknown table) raises here and nothing is acked; an unknown or ended claim ``ack``
        raises here and nothing is claimed; a claim that fails after the ack started (its
        predicate, reading its values) leaves the ack to finish (acking again answers
        ``duplicate``).
        """
        # the new claim checked first: a malformed one is refused without acking anything
        checked = self._claims.check(claim_requests(requests), consumer, lease_seconds)
        settled = self.ack_async(ack)
        claim = self._claims.claim_checked(checked, lease_seconds)
        answer: Future = Future()

        def done(f: Future) -> None:
            error = f.exception()
            if error is None:
                answer.set_result(f.result())
                return
            with self._index.lock:
                lease = self._index.claims.get(claim.claim_id)
            if lease is not None:
                self._claims.release_unread(lease)
            answer.set_exception(error)
        settled.add_done_callback(done)
        return claim, answer

    def claim_many(self, requests: list[ClaimRequest], *, consumer: str | None = None,
                   lease_seconds: float | None = None) -> Claim:
        """Lease rows from several tables in one atomic step, under one claim id (see
        :meth:`store.claim_engine.ClaimEngine.claim_many`).

        Either every request gets at least its ``min_rows`` or nothing is leased.
        """
        return self._claims.claim_many(claim_requests(requests), consumer=consumer,
                                       lease_seconds=lease_seconds)

    def ack(self, claim_id: str) -> dict[str, Any]:
        """Mark a claim's rows consumed; durable on return; acking twice is harmless.

        Raises:
            LeaseExpired: the lease ended (expired, nacked or revoked) before this ack.
            NotFound: the claim id was never issued.
        """
        return self._settler.settle(claim_id, ack=True)

    def nack(self, claim_id: str) -> dict[str, Any]:
        """Give a claim's rows back: ready again (delivery count kept), or dead past the max."""
        return self._settler.settle(claim_id, ack=False)

    def dead_letter(self, claim_id: str) -> dict[str, Any]:
        """End a claim with every row dead-lettered: kept for SQL, never delivered again.

        For rows whose values are gone (a cluster's data node lost without a replica): the
        caller claims exactly those rows, records why, and ends the claim here; durable on
        return (see flight_server/coordinator.py).
        """
        with self._index.dead_lettering(claim_id):
            answer = self._settler.settle(claim_id, ack=False)
        return {"claim_id": claim_id, "dead": answer["nacked"]}

    def ack_async(self, claim_id: str) -> Future:
        """:meth:`ack` without waiting: the Future resolves to ack's answer once it is durable.

        What :meth:`ack` would raise at once (an unknown or ended claim) is raised here too; a
        failed commit comes from the Future, and the claim stays leased as it was.
        """
        return self._settler.settle_async(claim_id, ack=True)

    def nack_async(self, claim_id: str) -> Future:
        """:meth:`nack` without waiting (see :meth:`ack_async`)."""
        return self._settler.settle_async(claim_id, ack=False)

    def renew(self, claim_id: str, *, lease_seconds: float | None = None) -> dict[str, Any]:
        """Extend an active claim's lease to ``lease_seconds`` from now (None: the longest
        ``lease_seconds`` of its tables, as a claim takes by default); answers ``{"claim_id",
        "expires_at"}``. For a step that takes longer than the lease: renewed in time, the rows
        stay this consumer's and its ack succeeds. Visible to SQL (``lease_expires_at``) after
        the next lease bookkeeping flush.

        Raises:
            LeaseExpired: the claim ended (acked, nacked or expired; the message says which) or
                is being acked or nacked now.
            NotFound: the claim id was never issued, or was voided by a restart.
            InvalidArgument: a malformed claim id or ``lease_seconds``.
        """
        return self._settler.renew(claim_id, lease_seconds)

    # -- versions ---------------------------------------------------------------------------------
    def get_version(self, table: str) -> int:
        live = self._index.live_table(table)
        return self._index.version_of(live)

    def bump_version(self, table: str, *, expected: int | None = None,
                     weights_uri: str | None = None) -> int:
        """Bump the version of the table's version group (compare-and-set on ``expected``).

        Rows older than the new version minus ``max_staleness`` become stale. ``weights_uri``
        records where the trainer published the new weights.

        Raises:
            VersionConflict: ``expected`` is not the current version.
        """
        live = self._index.live_table(table)
        versions.check_bump(expected, weights_uri)
        return int(self._writer.call(BumpOp(live.tdef.version_group, expected, weights_uri)))

    def wait_version(self, table: str, min_version: int, timeout: float | None = None) -> int:
        """Block until the table's version is at least ``min_version``; return the version.

        Returns the current version when ``timeout`` passes first (None: no limit; 0: at once;
        see store/waits.py).
        """
        if self._closed:
            raise StoreClosed("the store is closed")
        return versions.wait_version(self._index, table, min_version,
                                     check_wait(timeout, "wait_version"), lambda: self._closed)

    def weights_uri(self, table: str) -> str | None:
        """Where the table's trainer published the weights of the current version (its own
        URI after a barrier bump, the group's after ``bump_version``)."""
        live = self._index.live_table(table)
        return weights_of(self._index.weights.get(live.tdef.version_group), table)

    # -- the barrier (unified weight updating; see store/barrier.py) ------------------------------
    def arrive(self, tables: str | list[str], *, expected: int,
               weights_uri: str | None = None) -> int:
        """A trainer's global batch at version ``expected`` is done: arrive at its version
        group's barrier and return the group's new version once every member table arrived.

        Nothing is bumped or staled until the last member arrives; then the group's version
        advances once (as ``bump_version``, with each member's ``weights_uri`` recorded for it).
        ``tables`` may name several tables of one group (a subscription over several tables).
        In a group of one table an arrival bumps at once.

        Raises:
            BarrierTimeout: the group's barrier timeout passed before every member arrived.
            VersionConflict: the group's version is neither ``expected`` nor ``expected + 1``.
        """
        while True:
            answer = self.arrive_poll(tables, expected=expected, weights_uri=weights_uri,
                                      timeout=None)
            if answer["complete"]:
                return int(answer["version"])

    def arrive_poll(self, tables: str | list[str], *, expected: int,
                    weights_uri: str | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
        """:meth:`arrive`, waiting at most ``timeout`` seconds (None: until the round ends; 0:
        arrive and answer at once; see store/waits.py).

        Returns ``{"version", "complete", "waiting_for"}``: ``complete`` false when the caller's
        timeout passed first (the arrival stays; arriving again with the same ``expected``
        waits on, as a long poll does).
        """
        check_expected(expected)
        versions.check_weights_uri(weights_uri)
        names = [tables] if isinstance(tables, str) else list(tables)
        if not names:
            raise InvalidArgument("arrive needs at least one table")
        group = versions.group_of(self._index, names)
        return self._barriers.arrive_poll(group, names, expected, weights_uri,
                                          check_wait(timeout, "arrive_poll"))

    def set_barrier_timeout(self, table: str, seconds: float) -> float:
        """Set how long the barrier of the table's version group waits for its last member,
        counted from a round's first arrival (durable; default 600 s)."""
        seconds = check_timeout(seconds)
        group = self._index.live_table(table).tdef.version_group
        self._writer.call(versions.barrier_timeout_op(self._index, group, seconds))
        return seconds

    def barrier(self, table: str) -> dict[str, Any]:
        """The state of the table's version group's barrier: ``{"version_group", "version",
        "members", "arrived", "waiting_for", "timeout", "seconds_left", "failed"}``."""
        return self._barriers.state(self._index.live_table(table).tdef.version_group)

    def wait_changed(self, since: int, timeout: float) -> int:
        """Block until something changed after change number ``since`` (for subscriptions)."""
        with self._index.changed:
            if self._index.change_seq == since and not self._closed:
                self._index.changed.wait(timeout)
            return self._index.change_seq

    @property
    def change_seq(self) -> int:
        return self._index.change_seq

    def end_waits(self, reason: str | None) -> None:
        """End every long poll (:meth:`wait_version`, :meth:`arrive_poll`) and every query
        (SQL, claim predicates), running or later, with ``Unavailable(reason)``: a server that
        stops must not wait for them (they may last minutes); their clients call again once
        it is back. ``None`` lets them run again (a server stopped over a store its caller
        opened gives it back as it was)."""
        with self._index.changed:
            self._index.waits_ended = reason
            self._index.notify()
        self._readers.end_queries(reason)

    def wake(self) -> None:
        """Wake everything blocked in :meth:`wait_changed` (e.g. a message arrived)."""
        with self._index.changed:
            self._index.notify()

    # -- SQL ----------------------------------------------------------------------------------------
    def query(self, sql: str, params: list[Any] | None = None, *,
              timeout: float | None = None) -> pa.Table:
        """Run one read-only SELECT over live data; by-reference columns read as their values
        (see store/sqlvalues.py), and a result holding both ``X`` and its key ``X__ref`` (as
        ``SELECT *`` does) leaves the key out.

        Raises:
            QueryRefused: not a single read-only SELECT, or the SQL is invalid.
            QueryTimeout: it ran past ``timeout`` (default the store's ``query_timeout``).
        """
        check_select(sql)
        check_query_options(params, timeout)
        return run_select(self._readers, self._index, self.blobs, sql, params,
                          self.query_timeout if timeout is None else timeout)

    def check_predicate(self, table: str, where: str) -> None:
        """Bind a claim predicate to the table without evaluating it on any row, so that one
        naming an unknown column fails now rather than at the first claim that finds ready rows
        (a subscription made before its rollouts start would otherwise fail only then).

        Raises:
            QueryRefused: naming the predicate and DuckDB's reason.
        """
        self._claims.check_predicate(table, where)

    # -- stats ------------------------------------------------------------------------------------
    def stats(self, table: str | None = None) -> dict[str, Any]:
        """Rows by state (pending, ready, processing, consumed, stale, dead), version, rows per
        version, for one table or all."""
        names = [table] if table is not None else self.list_tables()
        out: dict[str, Any] = {}
        for name in names:
            live = self._index.live_table(name)
            out[name] = self._writer.call(ReadOp(functools.partial(table_stats, self._index,
                                                                    live)))
        return out

    def leases(self, table: str | None = None) -> list[dict[str, Any]]:
        """The claims currently leased: id, owner, expiry, rows per table."""
        return lease_list(self._index, table)

    # -- maintenance ------------------------------------------------------------------------------
    def gc(self, *, drop_rows: Any = (), keep_versions: Any = 0) -> dict[str, int]:
        """Delete blob segments no row references; first, with ``drop_rows`` (some of
        ``"consumed"``, ``"stale"``, ``"dead"``), the rows in those states that no write can
        reach any more (store/retention.py), except those of the newest ``keep_versions``
        versions: without it a consumed row and its values stay for ever. Answers
        ``segments_removed``, ``bytes_freed`` and ``rows_dropped``.

        Raises:
            InvalidArgument: ``drop_rows`` names something else, or ``keep_versions`` is not
                an integer ≥ 0.
        """
        states = check_drop_rows(drop_rows)
        keep = check_keep_versions(keep_versions)
        return self._writer.call(maintenance.gc_op(self._index, self.blobs, states, keep))

    def requeue(self, table: str, *, where: str | None = None,
                values_lost: str | None = None) -> dict[str, Any]:
        """Bring the table's dead rows back (a redrive, store/requeue.py): live again, their
        delivery count 0, ready where complete (else pending); durable on return. ``where``
        picks some of them, a SQL predicate over the table's columns as a claim's.

        Rows below the staleness bound stay dead (they would be stale at once), and so do rows
        matching ``values_lost``: SQL of the server's own (a cluster's coordinator: rows whose
        values only lost data nodes held), never a caller's. Answers ``{"table", "requeued",
        "skipped_stale", "skipped_lost"}``.

        Raises:
            NotFound: no such table.
            QueryRefused: ``where`` is not one boolean SQL expression over the table.
        """
        live = self._index.live_table(table)
        if where is not None:
            predicate_query(table, where)      # a malformed predicate: refused before any work
        # Rows dead-lettered by an expired lease are counted dead (stats) before their flags
        # are written (lease bookkeeping waits until it is due): written first, so that they
        # are found below.
        self._writer.call(FlushOp(leases=True))
        candidates = dead_row_ids(self._readers.cursor(), table)
        if where is not None:
            matched = self._claims.rows_matching(table, where, candidates, "requeue where")
            candidates = [r for r in candidates if r in matched]
        lost: set[int] = set()
        if values_lost is not None and candidates:
            lost = self._claims.rows_matching(table, values_lost, candidates,
                                              "the predicate of rows whose values are lost")
            candidates = [r for r in candidates if r not in lost]
        return self._writer.call(requeue_op(self._index, live, candidates, len(lost)))

    def checkpoint(self) -> None:
        """Fold the WAL into the database file now."""
        self._writer.call(CallOp(lambda con: None))
        self._writer.call(CallOp(run_checkpoint))

    def subscribe(self, table: str | list[str], micro_batch_size: int, global_batch_size: int,
                  **kwargs: Any):
        """A micro-batch subscription; see :class:`store.subscription.Subscription`."""
        from .subscription import Subscription
        return Subscription(self, table, micro_batch_size, global_batch_size, **kwargs)

    def health(self) -> dict[str, Any]:
        """``status``: ok, closed, or failed, with the cause in ``error``: either the writer
        stopped after an unexpected error (writes fail until the store is opened again), or
        the database cannot be written (a full disk; ``storage`` says since when and what waits):
        changes are refused with the retryable ``StorageUnavailable`` until the store recovers
        on its own."""
        return maintenance.health(self._index, self._writer, self._closed)

    def gauges(self) -> dict[str, Any]:
        """What monitoring samples (see flight_server/metrics.py): per table its version and
        rows ready, processing and pending; the writer's queue depth and whether it runs; the
        bytes on disk of the database, its WAL, the put log and the blob segments."""
        return maintenance.gauges(self._index, self._writer, self.disk_bytes())

    def disk_bytes(self) -> dict[str, int]:
        """Bytes on disk: ``database``, ``wal``, ``putlog``, ``blobs`` (a file not there: 0)."""
        return maintenance.disk_bytes(self.path, self.blobs)

    def _reopen_database(self) -> duckdb.DuckDBPyConnection:
        """Close every connection to the database and open it again (the writer calls this
        after DuckDB invalidated it; DuckDB replays its WAL). Raises StorageError if it cannot
        be opened yet; the writer tries again later."""
        def reopen() -> duckdb.DuckDBPyConnection:
            try:
                self._con.close()
            except duckdb.Error:
                pass
            # (a cached instance of the invalid database would be handed back while any
            # connection to it is open: all are closed first)
            self._con = connect_duckdb(self.path, self._memory_limit)
            return self._con
        return self._readers.reopen(reopen)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._readers.closing()
        with self._index.changed:
            self._index.changed.notify_all()
        self._writer.close()  # applies what waits in the put log first, then closes it
        try:
            run_checkpoint(self._con)
        except duckdb.Error:
            pass
        self._readers.close()
        self._con.close()
        self.blobs.close()

    def __enter__(self) -> "EmbeddedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EmbeddedStore", "ExpstoreError", "StorageError"]


if TYPE_CHECKING:
    from store.interface import Store

    def _implements_store(s: EmbeddedStore) -> Store:
        return s  # mypy checks that EmbeddedStore implements the Store protocol
