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
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Any, Mapping

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from .barrier import DEFAULT_BARRIER_TIMEOUT, SETTING_PREFIX, Barrier, check_expected, \
    check_timeout, encode_weights, weights_of
from .blobs import BlobStore
from .claims import Claim, ClaimRequest, check_consumer, check_lease_seconds
from .errors import AlreadyExists, StoreClosed, ExpstoreError, InvalidArgument, LeaseExpired, NotFound, \
    QueryBusy, QueryRefused, QueryTimeout, StorageError, TableFull, VersionConflict
from .index import StoreIndex
from .live import LOADING, Lease, LiveTable, Row
from .naming import check_identifier, quote
from .opening import connect_duckdb, ensure_catalog, run_checkpoint
from .prepare import SMALL_ROWS, check_columns, put_versions, to_arrow_table
from .settings import StoreSettings
from .putlog import PutLog, log_path, replay
from .recovery import load_state
from .schema import TableDef
from .sqlguard import check_select, predicate_query
from .sqlvalues import ValueCursor, ValueViews, drop_keys
from .types import one_array
from .ops import BumpOp, CallOp, PutOp, ReadOp, SettleOp, SmallPutOp
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
        ensure_catalog(path)
        self._memory_limit = memory_limit
        self._con = connect_duckdb(path, memory_limit)
        self._query_slots = threading.BoundedSemaphore(max_concurrent_queries)
        # One reader cursor per thread, kept here (not in thread-locals) so that close() can
        # drop every one of them, also those of threads that live on (gRPC's pool).
        self._readers: dict[int, duckdb.DuckDBPyConnection] = {}
        # Cursors of SQL and claim predicates: their tables show by-reference values (see
        # store/sqlvalues.py); the store's own reads use the plain readers above.
        self._value_readers: dict[int, ValueCursor] = {}
        self._reader_root = self._con.cursor()
        self._reader_lock = threading.Lock()
        try:
            self.blobs = BlobStore(blob_dir or f"{path}.blobs", blob_filesystem)
            self._views = ValueViews(self.blobs)
            replayed = replay(self._con, path)
            if replayed:
                log.info("%d rows of the put log inserted after an unclean stop", replayed)
            state = load_state(self._con)
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
        self._writer = Writer(index, self._con, settings, putlog, blobs=self.blobs,
                              wal_path=f"{path}.wal", reopen=self._reopen_database,
                              load_payloads=self.load_payloads)

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

        def run(con: duckdb.DuckDBPyConnection) -> bool:
            # SQL folds identifiers' case, quoted or not: "EXP" beside "exp" is one table to it.
            clash = next((t for t in self._index.live if t.lower() == name.lower() and t != name), None)
            if clash is not None:
                raise AlreadyExists(f"table {name!r} clashes with the existing table {clash!r}: "
                                    "table names that differ only in case are one name in SQL; "
                                    "choose another name")
            if name in self._index.live:
                if if_not_exists:
                    return False
                raise AlreadyExists(f"table {name!r} already exists; pass if_not_exists=True to "
                                    "accept an existing table")
            con.execute(tdef.ddl())
            con.execute("INSERT INTO _expstore_tables (name, definition, version_group) "
                        "VALUES (?, ?, ?)", [name, tdef.to_json(), tdef.version_group])
            if tdef.version_group not in self._index.versions:
                con.execute("INSERT INTO _expstore_groups (name, version) VALUES (?, 0)",
                            [tdef.version_group])
                con.execute("INSERT INTO _expstore_versions (version_group, version) "
                            "VALUES (?, 0)", [tdef.version_group])
            return True

        def apply(created: bool) -> None:
            if created:
                self._index.add_table(tdef)

        self._writer.call(CallOp(run, apply))
        return self.describe(name)

    def drop_table(self, name: str, *, if_exists: bool = False) -> bool:
        """Drop a table and its rows; leases on it end. Blobs go at the next :meth:`gc`."""
        check_identifier(name, "table")

        def run(con: duckdb.DuckDBPyConnection) -> bool:
            live = self._index.live.get(name)
            if live is None:
                if if_exists:
                    return False
                raise self._index.no_table(name)
            con.execute(f"DROP TABLE {quote(name)}")
            con.execute("DELETE FROM _expstore_tables WHERE name = ?", [name])
            group = live.tdef.version_group
            if not any(t.tdef.version_group == group for n, t in self._index.live.items() if n != name):
                con.execute("DELETE FROM _expstore_groups WHERE name = ?", [group])
                con.execute("DELETE FROM _expstore_versions WHERE version_group = ?", [group])
                con.execute("DELETE FROM _expstore_settings WHERE key = ?",
                            [SETTING_PREFIX + group])
            return True

        def apply(dropped: bool) -> None:
            if dropped:
                self._index.drop_table(name)

        return bool(self._writer.call(CallOp(run, apply)))

    def list_tables(self) -> list[str]:
        with self._index.lock:
            return sorted(self._index.live)

    def describe(self, name: str) -> dict[str, Any]:
        """A table's definition, current version and published weights."""
        live = self._index.live_table(name)
        d = live.tdef.describe()
        d["version"] = self._index.versions[live.tdef.version_group]
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

        ``data`` is a ``pyarrow.Table`` / ``RecordBatch``, a dict of columns or a list of row
        dicts, with ``sample_id`` and any subset of the data and status columns (and optionally
        ``policy_version``, default the current version). A written column's status becomes
        true unless the write gives the status itself; a null value leaves that column as it was.

        Raises:
            SchemaMismatch, InvalidArgument: bad columns, types or sample ids.
            StaleVersion: a policy version outside the staleness bound or in the future.
        """
        return self.put_async(table, data).result(timeout)

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
                self._check_room(live, self._keys_of(live, arrow), limit)
            return self._writer.submit(SmallPutOp(table, arrow))
        prepared = self._index.prepare(table, arrow)
        if limit is not None and len(live.rows) + prepared.rows > limit:
            self._check_room(live, prepared.keys, limit)
        return self._writer.submit(PutOp(prepared))

    def _keys_of(self, live: LiveTable, arrow: pa.Table) -> list[tuple[Any, Any]]:
        """A small put's (sample id, policy version) keys, before the writer prepares it."""
        versions = put_versions(arrow, self._index.versions[live.tdef.version_group])
        return list(zip(arrow.column("sample_id").to_pylist(), versions.to_pylist()))

    def _check_room(self, live: LiveTable, keys: list[tuple[Any, Any]], limit: int) -> None:
        """Refuse a put that would take a table past ``max_live_rows``; rows it only updates
        (a reward written to a pending row) take no room.

        Checked before the put is queued, not under the writer: puts checked at once may
        overshoot the limit by their rows; a put refused here costs the writer nothing.
        """
        rows = live.rows
        new = sum(1 for key in set(keys) if key not in rows)
        if new and len(rows) + new > limit:
            raise TableFull(
                f"table {live.tdef.name!r} holds {len(rows):,} live rows (pending, ready or "
                f"being processed) and this put would add {new:,}, over the store's "
                f"max_live_rows of {limit:,}; retry once consumers have acked rows (or a version "
                "bump has made old ones stale)")

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
        acked claim staying leased as after a failed ack. An unknown or ended claim ``ack``
        raises here and nothing is claimed; a claim that fails after the ack started leaves
        the ack to finish (acking again answers ``duplicate``).
        """
        settled = self.ack_async(ack)
        claim = self.claim_many(requests, consumer=consumer, lease_seconds=lease_seconds)
        answer: Future = Future()

        def done(f: Future) -> None:
            error = f.exception()
            if error is None:
                answer.set_result(f.result())
                return
            with self._lock:
                lease = self._claims.get(claim.claim_id)
            if lease is not None:
                self._release_unread(lease)
            answer.set_exception(error)
        settled.add_done_callback(done)
        return claim, answer

    def claim_many(self, requests: list[ClaimRequest], *, consumer: str | None = None,
                   lease_seconds: float | None = None) -> Claim:
        """Lease rows from several tables in one atomic step, under one claim id.

        Either every request gets at least its ``min_rows`` or nothing is leased.
        """
        if not requests:
            raise InvalidArgument("claim_many needs at least one claim request")
        requests = [r.validated() for r in requests]
        if len({r.table for r in requests}) != len(requests):
            names = [r.table for r in requests]
            twice = next(n for n in names if names.count(n) > 1)
            raise InvalidArgument(f"claim_many names table {twice!r} twice; give one request "
                                  "per table")
        check_lease_seconds(lease_seconds)
        owner = check_consumer(consumer)
        lives = [self._index.live_table(r.table) for r in requests]
        accepted: list[set[int] | None] = []
        for req, live in zip(requests, lives):
            accepted.append(None if req.where is None else self._accepted(req, live))
        with self._index.lock:
            picks: list[list[Row]] = []
            for req, live, ok in zip(requests, lives, accepted):
                if self._index.live.get(req.table) is not live:
                    raise self._index.no_table(req.table)
                rows = live.select(req.limit, req.group_size,
                                   None if ok is None else _member_of(ok))
                if len(rows) < req.min_rows:
                    return Claim("", owner, 0.0, {
                        live.tdef.name: live.tdef.claim_schema().empty_table()
                        for live in lives})
                picks.append(rows)
            seconds = lease_seconds or max(live.tdef.lease_seconds for live in lives)
            lease = self._index.lease(owner, seconds, list(zip(lives, picks)))
        self._writer.poke()
        try:
            tables = {live.tdef.name: self._fetch(live, rows) for live, rows in zip(lives, picks)}
        except BaseException:
            self._release_unread(lease)
            raise
        return Claim(lease.claim_id, owner, lease.expires_at, tables)

    def _release_unread(self, lease: Lease) -> None:
        """Give back rows whose data could not be read, without counting a delivery."""
        if self._index.release_unread(lease):
            self._writer.poke()

    def _accepted(self, req: ClaimRequest, live: LiveTable) -> set[int]:
        """Ready rows satisfying a claim's predicate: enough of the first ready rows for the
        claim, or of all of them.

        Why in rounds: asking DuckDB about every ready row took seconds with a large backlog (and
        built every row of the backlog as an object); a claim needs only the first rows that
        match. Each round evaluates the next rows in
        claim order, four times as many as the round before, and stops once the claim could be
        served from what matched (the selection a claim makes from a prefix of the order is
        the one it makes from the whole order when the prefix holds enough matches).
        """
        assert req.where is not None
        sql = predicate_query(req.table, req.where)
        matched: set[int] = set()
        asked: set[int] = set()
        want = max(4 * req.limit, self.settings.where_first_rows)
        # A predicate is SQL like any query (a sub-select can take minutes): it shares the query
        # slots and time limit of the query path, over all its rounds and the wait for a slot.
        limit = self.query_timeout
        deadline = self._take_query_slot(limit, f"claim predicate {req.where[:200]!r}")
        try:
            while True:
                with self._index.lock:
                    ready = live.ready_count
                    prefix = live.ready_rows(max(min(want, ready), 1))
                fresh = [r.row_id for r in prefix if r.row_id not in asked]
                asked.update(fresh)
                matched |= self._matching(sql, req.where, fresh, limit, deadline)
                if len(prefix) >= ready or _fills(prefix, matched, req.limit, req.group_size):
                    return matched
                want *= 4
        finally:
            self._query_slots.release()

    def _matching(self, sql: str, where: str, row_ids: list[int], limit: float,
                  deadline: float) -> set[int]:
        """Which candidate rows satisfy a claim predicate (``sql``: its checked query)."""
        if not row_ids:
            return set()
        try:
            rows = self._run_read(sql, [row_ids], limit, deadline)
        except QueryBusy:
            raise
        except QueryTimeout as e:
            raise QueryTimeout(f"claim predicate {where[:200]!r} ran past the query time limit "
                               f"of {limit} s and was cancelled") from e
        except QueryRefused as e:
            raise QueryRefused(f"claim predicate {where[:200]!r} failed: {e}") from e
        return set(rows.column(0).to_pylist())

    def _fetch(self, live: LiveTable, rows: list[Row]) -> pa.Table:
        """The claim's rows, from the claim cache where possible, else from DuckDB."""
        tdef = live.tdef
        payloads = [r.payload for r in rows]
        missing = [i for i, p in enumerate(payloads) if p is None or p is LOADING]
        if missing:
            loaded = self._read_values(live, [rows[i] for i in missing])
            for i in missing:
                payloads[i] = loaded.get(rows[i].row_id)
        # the claim's rows by the cached table (the put) they come from
        sources: dict[int, tuple[pa.Table, list[int], list[int]]] = {}
        for position, (r, payload) in enumerate(zip(rows, payloads)):
            if payload is None:
                raise StorageError(f"row {r.sample_id!r} (version {r.version}) of "
                                   f"{tdef.name!r} vanished while being claimed")
            table, index = payload
            entry = sources.setdefault(id(table), (table, [], []))
            entry[1].append(index)
            entry[2].append(position)
        if len(sources) == 1:
            table, indices, _ = next(iter(sources.values()))
            columns = self._one_put_columns(live, table, indices)
        else:
            columns = self._columns(live, sources)
        deliveries = [r.deliveries for r in rows]
        delivery_count = (_first_deliveries(len(rows)) if deliveries.count(1) == len(rows)
                          else pa.array(deliveries, pa.int32()))
        return pa.Table.from_arrays([delivery_count if at < 0 else columns[at]
                                     for at in live.claim_sources], schema=tdef.claim_schema())

    def _one_put_columns(self, live: LiveTable, table: pa.Table,
                         indices: list[int]) -> dict[int, pa.Array]:
        """The claim's columns (by position in the payload) from rows ``indices`` of one cached
        put: each column the claim returns cut alone, by-reference values from the put's chunks
        by row number where they are held in memory (:meth:`BlobStore.put_rows`).

        Why column by column: the claim answers a few of the put's columns' rows; slicing and
        combining the whole cached table (its keys and inline placeholders too) first cost more
        than the rest of the cut."""
        n = len(indices)
        first: int | None = indices[0]
        if indices[-1] - indices[0] != n - 1 or indices != list(range(indices[0], indices[0] + n)):
            first = None
        positions = None if first is not None else pa.array(indices, pa.int64())

        def rows(at: int) -> pa.Array:
            column = table.column(at)
            part = column.slice(first, n) if positions is None else column.take(positions)
            return part.chunk(0) if part.num_chunks == 1 else part.combine_chunks()

        columns: dict[int, pa.Array] = {}
        for value_at, key_at in live.claim_refs:
            cut = self.blobs.put_rows(table, key_at, indices, table.schema.field(value_at).type)
            if cut is None:
                keys = rows(key_at)
                if keys.null_count == len(keys):  # every value inline
                    continue
                cut = self._resolved(rows(value_at), keys)
            columns[value_at] = cut
        for at in live.claim_sources:
            if at >= 0 and at not in columns:
                columns[at] = rows(at)
        return columns

    def _columns(self, live: LiveTable,
                 sources: dict[int, tuple[pa.Table, list[int], list[int]]]) -> dict[int, pa.Array]:
        """The claim's columns (by position in the payload) from rows of several cached tables:
        one cut per table, then one reorder into claim order (far cheaper than a slice and a
        concat per row), by-reference values resolved from their keys."""
        parts = [_rows_of(table, indices) for table, indices, _ in sources.values()]
        data = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        order = [p for _, _, positions in sources.values() for p in positions]
        if len(parts) > 1 and order != sorted(order):
            data = data.take(_inverse(order))
        columns = dict(enumerate(data.combine_chunks().columns))
        for value_at, key_at in live.claim_refs:
            keys = columns[key_at]
            if keys.null_count < len(keys):  # some values are in the blob store
                columns[value_at] = self._resolved(columns[value_at], keys)
        return columns

    def _read_values(self, live: LiveTable, claimed: list[Row]) -> dict[int, tuple[pa.Table, int]]:
        """Values of claimed rows that have none cached, read from DuckDB with those of the next
        ready rows without them (up to ``settings.load_ahead_rows``), which the cache keeps for the next
        claims.

        Why ahead: on a large table the query costs milliseconds however few rows it reads, so
        each claim reading its own rows paid that; read together, the next claims pay nothing.

        A row is marked LOADING while the query runs; a write that replaces its values meanwhile
        replaces the mark, and then what the query read (older) is not kept.
        """
        cfg = self.settings
        want = cfg.load_ahead_first_rows if live.row_bytes is None else \
            max(1, min(cfg.load_ahead_rows, cfg.load_ahead_bytes // max(1, live.row_bytes)))
        with self._index.lock:
            ahead = [r for r in live.ready_rows(want) if r.payload is None]
            reading = claimed + ahead
            for r in reading:
                r.payload = LOADING
        loaded: dict[int, tuple[pa.Table, int]] = {}
        try:
            loaded = self.load_payloads(live, [r.row_id for r in reading])
        finally:
            with self._index.lock:
                for r in reading:
                    if r.payload is LOADING:
                        r.payload = loaded.get(r.row_id)
        return loaded

    def load_payloads(self, live: LiveTable, row_ids: list[int]) -> dict[int, tuple[pa.Table, int]]:
        """Read rows' claimable values from DuckDB into the claim cache's form (counted there).

        Only rows DuckDB holds lack cached values (rows of the put log stay cached until DuckDB
        has them), so the read need not wait for the put log to be applied.
        """
        if not row_ids:
            return {}
        schema = live.tdef.payload_schema()
        # A semi-join, not a range and list_contains: DuckDB pushes the join's bounds into the
        # scan, so ids close together skip the other row groups (as with the range), and ids
        # spread over the table cost much less than with the range (docs/bench/history.md,
        # "The round of 2026-11-25 01:03").
        sql = (f"SELECT row_id, {', '.join(map(quote, schema.names))} FROM "
               f"{quote(live.tdef.name)} WHERE row_id IN (SELECT unnest(?::BIGINT[]))")
        table = self._reader(materialize=False).sql(sql, params=[row_ids]).to_arrow_table()
        ids = table.column("row_id").to_pylist()
        table = table.drop_columns(["row_id"]).cast(schema)
        if ids:
            live.row_bytes = table.get_total_buffer_size() // len(ids)
        self.cache.hold(table)
        return {rid: (table, i) for i, rid in enumerate(ids)}

    def _resolved(self, inline: pa.ChunkedArray, keys: pa.ChunkedArray) -> pa.Array:
        """A column's values: inline ones where the blob key is null, else read from blobs."""
        inline = one_array(inline)
        values = self.blobs.resolve(keys.to_pylist(), inline.type)
        if keys.null_count == 0:     # every value by reference: nothing to merge (if_else copies)
            return values
        return pc.if_else(pc.is_valid(keys), values, inline)

    def ack(self, claim_id: str) -> dict[str, Any]:
        """Mark a claim's rows consumed; durable on return; acking twice is harmless.

        Raises:
            LeaseExpired: the lease ended (expired, nacked or revoked) before this ack.
            NotFound: the claim id was never issued.
        """
        return self._settle(claim_id, ack=True)

    def nack(self, claim_id: str) -> dict[str, Any]:
        """Give a claim's rows back: ready again (delivery count kept), or dead past the max."""
        return self._settle(claim_id, ack=False)

    def dead_letter(self, claim_id: str) -> dict[str, Any]:
        """End a claim with every row dead-lettered: kept for SQL, never delivered again.

        For rows whose values are gone (a cluster's data node lost without a replica): the
        caller claims exactly those rows, records why, and ends the claim here; durable on
        return (see flight_server/coordinator.py).
        """
        with self._index.dead_lettering(claim_id):
            answer = self._settle(claim_id, ack=False)
        return {"claim_id": claim_id, "dead": answer["nacked"]}

    def ack_async(self, claim_id: str) -> Future:
        """:meth:`ack` without waiting: the Future resolves to ack's answer once it is durable.

        What :meth:`ack` would raise at once (an unknown or ended claim) is raised here too; a
        failed commit comes from the Future, and the claim stays leased as it was.
        """
        return self._settle_async(claim_id, ack=True)

    def nack_async(self, claim_id: str) -> Future:
        """:meth:`nack` without waiting (see :meth:`ack_async`)."""
        return self._settle_async(claim_id, ack=False)

    def _settle(self, claim_id: str, ack: bool) -> dict[str, Any]:
        return self._settle_async(claim_id, ack).result()

    def _settle_async(self, claim_id: str, ack: bool) -> Future:
        if not isinstance(claim_id, str) or not claim_id:
            raise InvalidArgument(f"claim id {claim_id!r} is not a non-empty string")
        with self._index.lock:
            lease = self._index.active_lease(claim_id)
            if lease is None:
                recently_acked = self._index.recently_acked(claim_id)
                if recently_acked is not None:
                    if ack:
                        return _done({"claim_id": claim_id, "acked": recently_acked,
                                      "duplicate": True})
                    raise LeaseExpired(f"claim {claim_id!r} was already acked; it cannot be "
                                       "nacked")
                why = self._index.why_ended(claim_id)
                if why is not None:
                    raise LeaseExpired(f"claim {claim_id!r} ended before this "
                                       f"{'ack' if ack else 'nack'}: {why}")
            elif lease.state == Lease.SETTLING:
                return self._index.settling[claim_id]
            else:
                lease.state = Lease.SETTLING
                # The caller's Future resolves only after a failed commit has put the lease
                # back, so that a retry finds it leased, not still settling.
                answer: Future = Future()
                self._index.settling[claim_id] = answer
                self._writer.submit(SettleOp(lease, ack)).add_done_callback(
                    lambda done: self._settle_done(lease, done, answer))
                return answer
        acked = self._acked_before(claim_id) if ack else 0
        if acked:
            return _done({"claim_id": claim_id, "acked": acked, "duplicate": True})
        raise NotFound(f"claim {claim_id!r} is unknown: it was never issued, or it was taken "
                       "before a restart, which voids every lease (its rows are ready to be "
                       "delivered again)")

    def _settle_done(self, lease: Lease, done: Future, answer: Future) -> None:
        """Hand the writer's outcome on; a failed commit leaves the claim leased as before."""
        error = done.exception()
        if error is None:
            answer.set_result(done.result())
            return
        with self._index.lock:
            if lease.state == Lease.SETTLING and self._index.claims.get(lease.claim_id) is lease:
                lease.state = Lease.ACTIVE
            self._index.settling.pop(lease.claim_id, None)
        answer.set_exception(error)

    def _acked_before(self, claim_id: str) -> int:
        """Rows a claim consumed before a restart (acks record the claim id on the rows)."""
        total = 0
        for name in self.list_tables():
            # fetchall: a result left unfinished would refuse the cursor's next statement
            rows = self._reader().execute(
                f"SELECT count(*) FROM {quote(name)} WHERE lease_id = ? AND consumed",
                [claim_id]).fetchall()
            total += int(rows[0][0]) if rows else 0
        return total

    # -- called by the writer (lock held unless said) ----------------------------------------------
    # -- versions ---------------------------------------------------------------------------------
    def get_version(self, table: str) -> int:
        live = self._index.live_table(table)
        return self._index.versions[live.tdef.version_group]

    def bump_version(self, table: str, *, expected: int | None = None,
                     weights_uri: str | None = None) -> int:
        """Bump the version of the table's version group (compare-and-set on ``expected``).

        Rows older than the new version minus ``max_staleness`` become stale. ``weights_uri``
        records where the trainer published the new weights.

        Raises:
            VersionConflict: ``expected`` is not the current version.
        """
        live = self._index.live_table(table)
        if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool)):
            raise InvalidArgument(f"expected version {expected!r} is not an integer")
        if weights_uri is not None and not isinstance(weights_uri, str):
            raise InvalidArgument(f"weights_uri {weights_uri!r} is not a string")
        return int(self._writer.call(BumpOp(live.tdef.version_group, expected, weights_uri)))

    def wait_version(self, table: str, min_version: int, timeout: float | None = None) -> int:
        """Block until the table's version is at least ``min_version``; return the version.

        Returns the current version when ``timeout`` passes first.
        """
        if self._closed:
            raise StoreClosed("the store is closed")
        live = self._index.live_table(table)
        group = live.tdef.version_group
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._index.changed:
            while self._index.versions.get(group, -1) < min_version and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._index.changed.wait(remaining if remaining is not None else 1.0)
            return self._index.versions.get(group, -1)

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
        """:meth:`arrive`, waiting at most ``timeout`` seconds (None: until the round ends).

        Returns ``{"version", "complete", "waiting_for"}``: ``complete`` false when the caller's
        timeout passed first (the arrival stays; arriving again with the same ``expected``
        waits on, as a long poll does).
        """
        check_expected(expected)
        if weights_uri is not None and not isinstance(weights_uri, str):
            raise InvalidArgument(f"weights_uri {weights_uri!r} is not a string")
        names = [tables] if isinstance(tables, str) else list(tables)
        if not names:
            raise InvalidArgument("arrive needs at least one table")
        group = self._group_of(names)
        caller_deadline = None if timeout is None else time.monotonic() + timeout
        with self._index.changed:
            while True:
                if self._closed:
                    raise StoreClosed("the store is closed")
                now = time.monotonic()
                current = self._index.versions.get(group)
                if current is None:
                    raise NotFound(f"version group {group!r} does not exist")
                barrier = self._index.barriers.get(group)
                if barrier is not None and (barrier.expected < current
                                            or barrier.forgotten(now)):
                    del self._index.barriers[group]
                    barrier = None
                if current == expected + 1:
                    return {"version": current, "complete": True, "waiting_for": []}
                if current != expected:
                    raise VersionConflict(
                        f"version of {group!r} is {current}, not the expected {expected}: "
                        f"table(s) {names} cannot arrive at version {expected}")
                if barrier is None:
                    barrier = Barrier(group, expected, self._index.barrier_timeouts.get(
                        group, DEFAULT_BARRIER_TIMEOUT))
                    self._index.barriers[group] = barrier
                if barrier.failed is not None:
                    barrier.told.update(names)
                    raise _fresh(barrier.failed)
                for name in names:
                    barrier.arrived.setdefault(name, weights_uri)
                members = self._index.members(group)
                missing = barrier.missing(members)
                if not missing and not barrier.bumping:
                    barrier.bumping = True
                    break
                if missing and now >= barrier.deadline:
                    error = barrier.fail(members, now)
                    barrier.told.update(names)
                    self._index.notify()
                    raise _fresh(error)
                if caller_deadline is not None and now >= caller_deadline:
                    return {"version": current, "complete": False, "waiting_for": missing}
                # While the last arrival's bump commits, wait for it, not for the deadline.
                wait = barrier.deadline - now if missing else 1.0
                if caller_deadline is not None:
                    wait = min(wait, caller_deadline - now)
                self._index.changed.wait(max(wait, 0.0))
        # The last member arrived: bump once, for the whole group, outside the lock.
        try:
            new = int(self._writer.call(BumpOp(group, expected,
                                               encode_weights(barrier.arrived))))
        except ExpstoreError as e:
            with self._index.changed:
                if self._index.versions.get(group, -1) > expected:  # bumped meanwhile
                    return {"version": self._index.versions[group], "complete": True,
                            "waiting_for": []}
                barrier.failed, barrier.failed_at = e, time.monotonic()
                barrier.told.update(names)
                self._index.notify()
            raise
        return {"version": new, "complete": True, "waiting_for": []}

    def set_barrier_timeout(self, table: str, seconds: float) -> float:
        """Set how long the barrier of the table's version group waits for its last member,
        counted from a round's first arrival (durable; default 600 s)."""
        seconds = check_timeout(seconds)
        group = self._index.live_table(table).tdef.version_group

        def run(con: duckdb.DuckDBPyConnection) -> None:
            con.execute("INSERT OR REPLACE INTO _expstore_settings (key, value) VALUES (?, ?)",
                        [SETTING_PREFIX + group, repr(seconds)])

        def apply(_: None) -> None:
            self._index.barrier_timeouts[group] = seconds

        self._writer.call(CallOp(run, apply))
        return seconds

    def barrier(self, table: str) -> dict[str, Any]:
        """The state of the table's version group's barrier: ``{"version_group", "version",
        "members", "arrived", "waiting_for", "timeout", "seconds_left", "failed"}``."""
        group = self._index.live_table(table).tdef.version_group
        with self._index.lock:
            members = self._index.members(group)
            barrier = self._index.barriers.get(group)
            timeout = self._index.barrier_timeouts.get(group, DEFAULT_BARRIER_TIMEOUT)
            out: dict[str, Any] = {"version_group": group, "version": self._index.versions[group],
                                   "members": members, "arrived": [], "waiting_for": [],
                                   "timeout": timeout, "seconds_left": None, "failed": None}
            if barrier is not None and barrier.expected == self._index.versions[group]:
                out.update(arrived=sorted(barrier.arrived),
                           waiting_for=barrier.missing(members),
                           seconds_left=max(0.0, barrier.deadline - time.monotonic()),
                           failed=None if barrier.failed is None else str(barrier.failed))
            return out

    def _group_of(self, tables: list[str]) -> str:
        groups = {name: self._index.live_table(name).tdef.version_group for name in tables}
        if len(set(groups.values())) != 1:
            raise InvalidArgument(f"tables {groups} are in different version groups; one "
                                  "arrival (or subscription) covers tables of one group")
        return next(iter(groups.values()))

    def wait_changed(self, since: int, timeout: float) -> int:
        """Block until something changed after change number ``since`` (for subscriptions)."""
        with self._index.changed:
            if self._index.change_seq == since and not self._closed:
                self._index.changed.wait(timeout)
            return self._index.change_seq

    @property
    def change_seq(self) -> int:
        return self._index.change_seq

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
        if params is not None and not isinstance(params, (list, tuple)):
            raise InvalidArgument(f"query parameters {params!r} are not a list")
        limit = self.query_timeout if timeout is None else timeout
        deadline = self._take_query_slot(limit, "the query")
        try:
            return drop_keys(self._run_read(sql, list(params or []), limit, deadline))
        finally:
            self._query_slots.release()

    def _take_query_slot(self, limit: float, what: str) -> float:
        """Take one of the query slots, waiting at most ``limit`` seconds; return the deadline
        (monotonic) by which the work must end, the wait included. The caller releases it."""
        deadline = time.monotonic() + limit
        if not self._query_slots.acquire(timeout=limit):
            raise QueryBusy(f"no query slot became free within {limit} s for {what}; too "
                               "many concurrent queries (and claim predicates)")
        return deadline

    def _run_read(self, sql: str, params: list[Any], timeout: float,
                  deadline: float | None = None) -> pa.Table:
        """Run users' SQL (a query or a claim predicate) on this thread's value cursor;
        cancelled after ``timeout`` seconds, or at ``deadline`` (monotonic)."""
        left = timeout if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise QueryTimeout(f"query ran past its {timeout} s limit (waiting for a query slot "
                               "included) and was cancelled")
        values = self._value_reader()
        cursor = values.cursor
        values.take_error()
        timer = threading.Timer(left, cursor.interrupt)
        timer.daemon = True
        timer.start()
        try:
            # The second layer under the SQL guard: the engine itself refuses any write in a
            # read-only transaction, whatever syntax slips past the guard.
            cursor.execute("BEGIN TRANSACTION READ ONLY")
            try:
                return cursor.sql(sql, params=params).to_arrow_table()
            finally:
                try:
                    cursor.execute("ROLLBACK")
                except duckdb.Error:
                    pass
        except duckdb.InterruptException as e:
            raise QueryTimeout(f"query ran past its {timeout} s limit and was cancelled") from e
        except duckdb.Error as e:
            fault = self._writer.fault
            if fault is not None:  # the database was invalidated under the query
                raise fault.error(self._writer.waiting_changes, read=True) from e
            blob_error = values.take_error()
            if blob_error is not None:  # a by-reference value could not be read
                raise blob_error from e
            raise QueryRefused(f"query failed: {e}") from e
        finally:
            timer.cancel()

    def _value_reader(self) -> ValueCursor:
        """This thread's value cursor, its views in step with the tables (see sqlvalues)."""
        self._writer.materialize()  # every acknowledged write is in DuckDB before a read
        ident = threading.get_ident()
        values = self._value_readers.get(ident)
        if values is None:
            with self._reader_lock:
                if self._closed:
                    raise StoreClosed("the store is closed")
                values = self._value_readers[ident] = self._views.cursor(
                    self._reader_root.cursor())
        with self._index.lock:
            seq, tables = self._index.ddl_seq, [live.tdef for live in self._index.live.values()]
        try:
            self._views.refresh(values, tables, seq)
        except duckdb.Error as e:
            raise StorageError(f"cannot prepare the query views of by-reference columns: {e}") \
                from e
        return values

    def _reader(self, materialize: bool = True) -> duckdb.DuckDBPyConnection:
        if materialize:
            self._writer.materialize()  # every acknowledged write is in DuckDB before a read
        ident = threading.get_ident()
        cursor = self._readers.get(ident)
        if cursor is None:
            with self._reader_lock:
                if self._closed:
                    raise StoreClosed("the store is closed")
                cursor = self._reader_root.cursor()
                self._readers[ident] = cursor
        return cursor

    # -- stats ------------------------------------------------------------------------------------
    def stats(self, table: str | None = None) -> dict[str, Any]:
        """Rows by state (pending, ready, processing, consumed, stale, dead), version, rows per
        version, for one table or all."""
        names = [table] if table is not None else self.list_tables()
        out: dict[str, Any] = {}
        for name in names:
            live = self._index.live_table(name)
            out[name] = self._writer.call(ReadOp(functools.partial(self._table_stats, live)))
        return out

    def _table_stats(self, live: LiveTable, con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
        """One table's stats, on the writer thread between two groups (see ReadOp)."""
        name = live.tdef.name
        if self._index.live.get(name) is not live:
            raise self._index.no_table(name)  # dropped since stats() looked it up
        per_version = con.execute(
            f"SELECT policy_version, count(*), count(*) FILTER (WHERE consumed), "
            f"count(*) FILTER (WHERE stale AND NOT consumed), "
            f"count(*) FILTER (WHERE dead AND NOT consumed AND NOT stale) "
            f"FROM {quote(name)} GROUP BY 1 ORDER BY 1").fetchall()
        with self._index.lock:
            ready, processing = live.ready_count, live.leased_count
            live_rows = len(live.rows)
            version = self._index.versions[live.tdef.version_group]
            # Expired leases' stale/dead rows left memory; their flags are not written yet.
            unflushed = self._index.unwritten_row_updates(name)
        total, consumed, stale, dead = (sum(int(r[i]) for r in per_version) for i in (1, 2, 3, 4))
        stale += sum(1 for u in unflushed if u.stale)
        dead += sum(1 for u in unflushed if u.dead and not u.stale)
        return {
            "version": version, "version_group": live.tdef.version_group,
            "rows": total, "pending": live_rows - ready - processing, "ready": ready,
            "processing": processing, "consumed": consumed, "stale": stale, "dead": dead,
            "rows_per_version": {int(r[0]): int(r[1]) for r in per_version},
        }

    def leases(self, table: str | None = None) -> list[dict[str, Any]]:
        """The claims currently leased: id, owner, expiry, rows per table."""
        if table is not None:
            self._index.live_table(table)  # an unknown table is an error, as for stats()
        with self._index.lock:
            out = []
            for lease in self._index.claims.values():
                tables: dict[str, int] = {}
                for live, _ in lease.rows:
                    tables[live.tdef.name] = tables.get(live.tdef.name, 0) + 1
                if table is not None and table not in tables:
                    continue
                out.append({"claim_id": lease.claim_id, "consumer": lease.owner,
                            "expires_at": lease.expires_at, "state": lease.state,
                            "rows": tables})
            return sorted(out, key=lambda d: d["expires_at"])

    # -- maintenance ------------------------------------------------------------------------------
    def gc(self) -> dict[str, int]:
        """Delete blob segments no row references."""
        def run(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
            self.blobs.roll()
            live_segments: set[int] = set()
            for live in self._index.live.values():
                for c in live.tdef.columns:
                    if c.ref:
                        rows = con.execute(
                            f"SELECT DISTINCT CAST(split_part({quote(c.ref)}, ':', 1) AS BIGINT) "
                            f"FROM {quote(live.tdef.name)} WHERE {quote(c.ref)} IS NOT NULL"
                        ).fetchall()
                        live_segments.update(int(r[0]) for r in rows)
            return self.blobs.collect(live_segments)
        return self._writer.call(CallOp(run))

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
        writer = self._writer
        fatal, fault = writer.fatal, writer.fault
        failed = fatal is not None or fault is not None
        out: dict[str, Any] = {
            "status": "closed" if self._closed else "failed" if failed else "ok",
            "tables": len(self._index.live), "commits": writer.commits,
            "claim_cache_bytes": self.cache.used, "claim_cache_limit": self.cache.limit}
        if fatal is not None:
            out["error"] = repr(fatal)
        elif fault is not None:
            out["error"] = f"the database cannot be written: {fault.cause}"
            out["storage"] = fault.describe(writer.waiting_changes)
        return out

    def gauges(self) -> dict[str, Any]:
        """What monitoring samples (see flight_server/metrics.py): per table its version and
        rows ready, processing and pending; the writer's queue depth and whether it runs."""
        writer = self._writer
        return {"tables": self._index.table_gauges(), "writer_queue_depth": writer.queue_depth,
                "writer_running": writer.fatal is None}

    def _reopen_database(self) -> duckdb.DuckDBPyConnection:
        """Close every connection to the database and open it again (the writer calls this
        after DuckDB invalidated it; DuckDB replays its WAL). Raises StorageError if it cannot
        be opened yet; the writer tries again later."""
        with self._reader_lock:
            self._close_readers()
            try:
                self._con.close()
            except duckdb.Error:
                pass
            # (a cached instance of the invalid database would be handed back while any
            # connection to it is open: all are closed above)
            self._con = connect_duckdb(self.path, self._memory_limit)
            self._reader_root = self._con.cursor()
        return self._con

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._index.changed:
            self._index.changed.notify_all()
        self._writer.close()  # applies what waits in the put log first, then closes it
        try:
            run_checkpoint(self._con)
        except duckdb.Error:
            pass
        with self._reader_lock:
            self._close_readers()
        self._con.close()
        self.blobs.close()

    def _close_readers(self) -> None:
        """Close every reader cursor, the query cursors too (``_reader_lock`` held); their
        threads get new ones on their next read."""
        cursors = [v.cursor for v in self._value_readers.values()]
        for cursor in cursors + list(self._readers.values()) + [self._reader_root]:
            try:
                cursor.close()
            except duckdb.Error:
                pass
        self._readers.clear()
        self._value_readers.clear()

    def __enter__(self) -> "EmbeddedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------------------
_ONES = pa.array(np.ones(1024, np.int32))


def _first_deliveries(n: int) -> pa.Array:
    """A delivery_count column of ``n`` ones (a claim's rows are usually first deliveries)."""
    return _ONES.slice(0, n) if n <= len(_ONES) else pa.array(np.ones(n, np.int32))


#: A claim's rows from one cached put are cut out as at most this many zero-copy slices (runs of
#: consecutive rows); more runs take a ``take``, which copies every column of the rows.
MAX_SLICES = 8


def _rows_of(table: pa.Table, indices: list[int]) -> pa.Table:
    """Rows ``indices`` of ``table``, in that order: zero-copy slices when they form a few
    ascending runs (the usual case: rows are claimed in about the order they were written; a
    slice costs next to nothing, where a take copies every column of the rows), else a take."""
    first = indices[0]
    if indices[-1] - first == len(indices) - 1 and indices == list(range(first, first + len(indices))):
        return table.slice(first, len(indices))
    runs: list[tuple[int, int]] = []
    start = previous = first
    for index in indices[1:]:
        if index != previous + 1:
            runs.append((start, previous - start + 1))
            if len(runs) >= MAX_SLICES:
                return table.take(indices)
            start = index
        previous = index
    runs.append((start, previous - start + 1))
    return pa.concat_tables([table.slice(at, n) for at, n in runs])


def _inverse(order: list[int]) -> list[int]:
    """The permutation that puts rows listed in ``order`` (their claim positions) back into
    claim order."""
    inverse = [0] * len(order)
    for i, position in enumerate(order):
        inverse[position] = i
    return inverse


def _fills(prefix: list[Row], matched: set[int], limit: int, group_size: int | None) -> bool:
    """Whether a claim can take all it may from the matching rows of ``prefix`` (the first ready
    rows, in claim order): ``limit`` rows, or as many whole groups as fit in it.

    A claim choosing among the matches of a prefix then chooses what it would among the matches
    of all ready rows: it takes rows in order (a group cut at the end of the prefix gives its
    first rows), and it stops before the prefix ends. Rows another claim leases meanwhile are
    skipped, so such a claim may return fewer rows (never others).
    """
    if not group_size:
        return sum(1 for r in prefix if r.row_id in matched) >= limit
    chosen = 0
    for _, rows in itertools.groupby(prefix, key=lambda r: (r.version, r.input_id)):
        whole = sum(1 for r in rows if r.row_id in matched) // group_size
        chosen += min(whole, (limit - chosen) // group_size) * group_size
        if chosen + group_size > limit:
            return True
    return False


def _member_of(row_ids: set[int]) -> Callable[[Row], bool]:
    return lambda row: row.row_id in row_ids


def _fresh(error: Exception) -> Exception:
    """A new exception like ``error``: one raised in several threads would gather all of their
    tracebacks."""
    return type(error)(str(error))


def _done(result: Any) -> Future:
    """A Future that already holds ``result`` (an answer known without the writer)."""
    future: Future = Future()
    future.set_result(result)
    return future


__all__ = ["EmbeddedStore", "ExpstoreError", "StorageError"]


if TYPE_CHECKING:
    from store.interface import Store

    def _implements_store(s: EmbeddedStore) -> Store:
        return s  # mypy checks that EmbeddedStore implements the Store protocol
