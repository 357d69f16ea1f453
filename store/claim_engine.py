"""The claim engine: which ready rows a claim takes, leasing them, and reading their values.

A claim runs on the caller's thread: a predicate, if any, is evaluated in DuckDB over the first
ready rows only (:meth:`ClaimEngine._accepted`, holding a query slot); under the index's lock
the live tables lease the rows a claim takes (``LiveTable.take``; a claim short of its
``min_rows`` gives them back) and the index registers the lease (its rows' lease bookkeeping
waits for the writer: leases are soft state); then the rows' values are
cut from the claim cache, or read from DuckDB for rows it does not hold (read ahead for the next
claims), and by-reference values are read from the blob store.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .blobs import BlobStore
from .claims import Claim, ClaimRequest, check_consumer, check_lease_seconds
from .errors import InvalidArgument, QueryBusy, QueryRefused, QueryTimeout, StorageError
from .halves import from_stored_table, if_else
from .index import StoreIndex
from .live import LOADING, Lease, LiveTable, Row
from .naming import quote
from .readers import Readers
from .row_cut import RowCut
from .schema import TableDef
from .settings import StoreSettings
from .sqlguard import predicate_query
from .table_memo import TableMemo
from .types import empty_table, one_array

#: Predicates remembered as bound (see ClaimEngine._matching); past this many, forgotten.
MAX_BOUND_PREDICATES = 1024

#: Rows' claimable values by row id: a cached Arrow table and the row's index in it.
Payloads = dict[int, tuple[pa.Table, int]]


class ClaimEngine:
    """Serves claims over one store's index (see the module docstring).

    Args:
        index: the in-memory index whose ready rows claims take.
        readers: cursors for the rows' values and the query slots predicates share.
        blobs: where by-reference values are read from.
        settings: read-ahead sizes and the query time limit.
        poke: asks the writer to write lease bookkeeping soon (never blocks).
    """

    def __init__(self, index: StoreIndex, readers: Readers, blobs: BlobStore,
                 settings: StoreSettings, poke: Callable[[], None]) -> None:
        self._index = index
        self._readers = readers
        self._blobs = blobs
        self._settings = settings
        self._poke = poke
        self._layouts: TableMemo[PutLayout] = TableMemo()   # by cached put
        # predicates known to bind, by query, to the definition of the table they were bound to
        self._bound: dict[str, TableDef] = {}

    def claim_many(self, requests: list[ClaimRequest], *, consumer: str | None = None,
                   lease_seconds: float | None = None) -> Claim:
        """Lease rows from several tables in one atomic step, under one claim id.

        Either every request gets at least its ``min_rows`` or nothing is leased.
        """
        return self.claim_checked(self.check(requests, consumer, lease_seconds), lease_seconds)

    def check(self, requests: list[ClaimRequest], consumer: str | None,
              lease_seconds: float | None) -> "CheckedClaim":
        """What :meth:`claim_many` refuses before it leases anything, checked: the requests
        validated, the claim's owner and the live tables named (a caller that must not act on a
        bad claim, such as an ack carried with it, checks first).

        Raises:
            InvalidArgument: a request, the consumer or ``lease_seconds`` is malformed.
            NotFound: a table does not exist.
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
        return CheckedClaim(requests, owner, [self._index.live_table(r.table) for r in requests])

    def claim_checked(self, checked: "CheckedClaim", lease_seconds: float | None) -> Claim:
        """:meth:`claim_many` of requests :meth:`check` passed."""
        requests, owner, lives = checked
        accepted: list[set[int] | None] = []
        for req, live in zip(requests, lives):
            accepted.append(None if req.where is None else self._accepted(req, live))
        seconds = lease_seconds or max(live.tdef.lease_seconds for live in lives)
        with self._index.lock:
            for req, live in zip(requests, lives):
                if self._index.live.get(req.table) is not live:
                    raise self._index.no_table(req.table)
            lease = self._index.new_lease(owner, seconds)
            picks: list[list[Row]] = []
            try:
                for req, live, ok in zip(requests, lives, accepted):
                    rows = live.take(req.limit, req.group_size,
                                     None if ok is None else _member_of(ok), req.min_rows, lease)
                    if len(rows) < req.min_rows:  # (take leased none of them)
                        break
                    picks.append(rows)
            finally:
                if len(picks) < len(requests):  # short, or failed: what was leased goes back
                    for live, rows in zip(lives, picks):
                        live.give_back(rows)
            if len(picks) < len(requests):
                return Claim("", owner, 0.0, {
                    live.tdef.name: empty_table(live.tdef.claim_schema()) for live in lives})
            self._index.register(lease, list(zip(lives, picks)))
        self._poke()
        try:
            tables = {live.tdef.name: self._fetch(live, rows) for live, rows in zip(lives, picks)}
        except BaseException:
            self.release_unread(lease)
            raise
        return Claim(lease.claim_id, owner, lease.expires_at, tables)

    def release_unread(self, lease: Lease) -> None:
        """Give back rows whose data could not be read, without counting a delivery."""
        if self._index.release_unread(lease):
            self._poke()

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
        want = max(4 * req.limit, self._settings.where_first_rows)
        # A predicate is SQL like any query (a sub-select can take minutes): it shares the query
        # slots and time limit of the query path, over all its rounds and the wait for a slot.
        limit = self._settings.query_timeout
        deadline = self._readers.take_query_slot(limit, f"claim predicate {req.where[:200]!r}")
        try:
            while True:
                with self._index.lock:
                    ready = live.ready_count
                    prefix = live.ready_rows(max(min(want, ready), 1))
                fresh = [r.row_id for r in prefix if r.row_id not in asked]
                asked.update(fresh)
                if fresh or not asked:  # (none ready at all: the predicate is still bound)
                    matched |= self._matching(live, sql, req.where, fresh, limit, deadline)
                if len(prefix) >= ready or _fills(prefix, matched, req.limit, req.group_size):
                    return matched
                want *= 4
        finally:
            self._readers.release_query_slot()

    def check_predicate(self, table: str, where: str) -> None:
        """Bind a claim predicate to ``table`` without evaluating it on any row (see
        :meth:`_matching`): one naming an unknown column fails now.

        Raises:
            QueryRefused: naming the predicate and DuckDB's reason.
        """
        self.rows_matching(table, where, [], "claim predicate")

    def rows_matching(self, table: str, where: str, row_ids: list[int],
                      what: str) -> set[int]:
        """Which of ``row_ids`` (rows of ``table`` in any state) satisfy ``where``, checked and
        run as a claim's predicate is (one query slot, the query time limit; by-reference
        values seen): ``requeue`` picks the dead rows it brings back so. With no rows the
        predicate is still bound: one naming an unknown column fails.

        Raises:
            QueryRefused, QueryTimeout: naming the predicate as ``what`` it is.
        """
        live = self._index.live_table(table)
        limit = self._settings.query_timeout
        deadline = self._readers.take_query_slot(limit, f"{what} {where[:200]!r}")
        try:
            return self._matching(live, predicate_query(live.tdef.name, where), where, row_ids,
                                  limit, deadline, what)
        finally:
            self._readers.release_query_slot()

    def _matching(self, live: LiveTable, sql: str, where: str, row_ids: list[int],
                  limit: float, deadline: float, what: str = "claim predicate") -> set[int]:
        """Which candidate rows satisfy a claim predicate (``sql``: its checked query).

        With no candidates the query still runs (DuckDB binds it, reads nothing) until it has
        once for this table: a predicate naming an unknown column is refused as soon as it is
        used, not at the first claim that finds rows ready (possibly hours into a run)."""
        if not row_ids and self._bound.get(sql) is live.tdef:
            return set()
        try:
            rows = self._readers.run(sql, [row_ids], limit, deadline)
        except QueryBusy:
            raise
        except QueryTimeout as e:
            raise QueryTimeout(f"{what} {where[:200]!r} ran past the query time limit "
                               f"of {limit} s and was cancelled") from e
        except QueryRefused as e:
            raise QueryRefused(f"{what} {where[:200]!r} failed: {e}") from e
        if not row_ids:
            if len(self._bound) >= MAX_BOUND_PREDICATES:
                self._bound.clear()
            self._bound[sql] = live.tdef
        return set(rows.column(0).to_pylist())

    def _fetch(self, live: LiveTable, rows: list[Row]) -> pa.Table:
        """The claim's rows, from the claim cache where possible, else from DuckDB."""
        deliveries = [r.deliveries for r in rows]
        delivery_count = _delivery_count(deliveries)
        one_put = self._cached_put(rows)
        if one_put is None:
            payloads = [r.payload for r in rows]
            missing = [i for i, p in enumerate(payloads) if p is None or p is LOADING]
            if missing:
                loaded = self._read_values(live, [rows[i] for i in missing])
                for i in missing:
                    payloads[i] = loaded.get(rows[i].row_id)
            first = payloads[0]
            if first is not None and all(p is not None and p[0] is first[0] for p in payloads):
                one_put = first[0], [p[1] for p in payloads]  # type: ignore[index]
            else:
                return self._several_puts_table(live, self._sources(live, rows, payloads),
                                                deliveries)
        return self._one_put_table(live, one_put[0], RowCut(one_put[1]), delivery_count)

    @staticmethod
    def _cached_put(rows: list[Row]) -> tuple[pa.Table, list[int]] | None:
        """The cached put and the row numbers there of the claim's rows when every row's
        values are cached from one put (the usual case), found in one pass; else None."""
        first = rows[0].payload
        if first is None or first is LOADING:
            return None
        table = first[0]
        at: list[int] = []
        for r in rows:
            p = r.payload
            if p is None or p is LOADING or p[0] is not table:
                return None
            at.append(p[1])
        return table, at

    @staticmethod
    def _sources(live: LiveTable, rows: list[Row], payloads: list[tuple[pa.Table, int] | None]
                 ) -> dict[int, tuple[pa.Table, list[int], list[int]]]:
        """The claim's rows by the cached table (the put) they come from: its row numbers
        there and their positions in the claim."""
        sources: dict[int, tuple[pa.Table, list[int], list[int]]] = {}
        for position, (r, payload) in enumerate(zip(rows, payloads)):
            if payload is None:
                raise StorageError(f"row {r.sample_id!r} (version {r.version}) of "
                                   f"{live.tdef.name!r} vanished while being claimed")
            table, index = payload
            entry = sources.setdefault(id(table), (table, [], []))
            entry[1].append(index)
            entry[2].append(position)
        return sources

    def _one_put_table(self, live: LiveTable, table: pa.Table, rows: RowCut,
                       delivery_count: pa.Array) -> pa.Table:
        """The claim's table from rows ``rows`` of one cached put: the plain columns cut
        together, each by-reference column alone, from the put's chunks by row number where
        they are held in memory (:meth:`BlobStore.put_columns`).

        Why not the whole cached table cut at once: its keys and inline placeholders would be
        cut too, for nothing, where the put's chunks are held. A by-reference column whose
        values the put holds all inline (no key: a narrow table's short strings) is cut with
        the plain ones: cutting its keys to find that out cost more than its values. Why the
        other columns are inserted into the cut record batch, not the cut taken apart into
        arrays and a table built of them: an Arrow object per column, and checking them
        against the schema again, were much of a small claim's time in the store. How a put's
        columns divide so is worked out once per put (:class:`PutLayout`)."""
        layout = self._layout(live, table)
        plain = layout.plain
        held = self._blobs.put_columns(table, layout.key_ats, rows, layout.value_types)
        refs: list[pa.Array] = []
        for (value_at, key_at), got in zip(layout.refs, held):
            if got is None:
                keys = rows.array(table.column(key_at))
                got = rows.array(table.column(value_at))
                if keys.null_count < len(keys):  # some values are in the blob store
                    got = self._resolved(got, keys)
            refs.append(got)
        schema = live.tdef.claim_schema()
        if isinstance(plain, pa.RecordBatch):
            batch = rows.rows_of(plain)
            for position, field, i in layout.inserts:
                batch = batch.add_column(position, field, delivery_count if i < 0 else refs[i])
            return pa.Table.from_batches([batch], schema=schema)
        columns = dict(zip(layout.plain_at, rows.columns(plain)))
        columns.update((value_at, got) for (value_at, _), got in zip(layout.refs, refs))
        return pa.Table.from_arrays([delivery_count if at < 0 else columns[at]
                                     for at in live.claim_sources], schema=schema)

    def _layout(self, live: LiveTable, table: pa.Table) -> "PutLayout":
        """How a cached put's claim columns divide (see :class:`PutLayout`), worked out on its
        first claim and kept while the put is cached (a cached put belongs to one table)."""
        return self._layouts.of(table, lambda: PutLayout.of(live, table))

    def _several_puts_table(self, live: LiveTable,
                            sources: dict[int, tuple[pa.Table, list[int], list[int]]],
                            deliveries: list[int]) -> pa.Table:
        """The claim's table from rows of several cached tables (a claim spanning puts), in
        claim order: sliced from the puts' columns where they are held in memory
        (:meth:`_held_runs_table`, the usual case); else each table's rows cut as one put's
        are (:meth:`_one_put_table`), then put into claim order by runs.

        Why not the cached tables' rows cut, joined and their keys resolved one by one: parsing
        and grouping a key per value in Python made a claim spanning two puts several times as
        costly as one within a put."""
        held = self._held_runs_table(live, sources, deliveries)
        if held is not None:
            return held
        parts: list[pa.Table] = []
        # (part, row in it) of each claim position
        where: list[tuple[int, int]] = [(0, 0)] * len(deliveries)
        for k, (table, indices, positions) in enumerate(sources.values()):
            delivery_count = _delivery_count([deliveries[p] for p in positions])
            parts.append(self._one_put_table(live, table, RowCut(indices), delivery_count))
            for j, p in enumerate(positions):
                where[p] = (k, j)
        pieces = [parts[k].slice(start, n) for k, start, n in _runs_across(where)]
        return pa.concat_tables(pieces).combine_chunks()

    def _held_runs_table(self, live: LiveTable,
                         sources: dict[int, tuple[pa.Table, list[int], list[int]]],
                         deliveries: list[int]) -> pa.Table | None:
        """The claim's table sliced by runs (consecutive rows of one put, in claim order)
        straight from the puts' columns, joined in one copy: the plain columns as each put's
        one record batch, the by-reference ones as their chunks held in memory hold them (row
        ``j`` of each is row ``j`` of the put). None unless every put is one record batch whose
        by-reference values are all held, as their columns' types, and all divide their
        columns alike (:class:`PutLayout`).

        Why: cutting each put's rows into a table, then joining those in claim order, copied
        every value twice and built a table per put; a claim's groups often come from many
        puts (rollouts finish out of input-id order). Why a record batch per put, not each
        column sliced by runs: a slice per column and run cost more than the copy for a claim
        of a few rows (A/B in BENCHMARKS.md, "a claim spanning puts")."""
        layouts: list[PutLayout] = []
        values: list[list[pa.Array]] = []
        # (put, its row) of each claim position
        where: list[tuple[int, int]] = [(0, 0)] * len(deliveries)
        for k, (table, indices, positions) in enumerate(sources.values()):
            layout = self._layout(live, table)
            if not isinstance(layout.plain, pa.RecordBatch) or (
                    layouts and layout.plain_at != layouts[0].plain_at):
                return None
            held = self._blobs.put_values(table, layout.key_ats)
            if any(v is None or v.type != t for v, t in zip(held, layout.value_types)):
                return None
            layouts.append(layout)
            values.append(held)
            for row, p in zip(indices, positions):
                where[p] = (k, row)
        runs = _runs_across(where)
        batch = _joined([layouts[k].plain.slice(at, n) for k, at, n in runs], pa.concat_batches)
        refs = [_joined([values[k][i].slice(at, n) for k, at, n in runs], pa.concat_arrays)
                for i in range(len(layouts[0].refs))]
        delivery_count = _delivery_count(deliveries)
        for position, field, i in layouts[0].inserts:
            batch = batch.add_column(position, field, delivery_count if i < 0 else refs[i])
        return pa.Table.from_batches([batch], schema=live.tdef.claim_schema())

    def _read_values(self, live: LiveTable, claimed: list[Row]) -> Payloads:
        """Values of claimed rows that have none cached, read from DuckDB with those of the next
        ready rows without them (up to ``settings.load_ahead_rows``), which the cache keeps for the next
        claims.

        Why ahead: on a large table the query costs milliseconds however few rows it reads, so
        each claim reading its own rows paid that; read together, the next claims pay nothing.

        A row is marked LOADING while the query runs; a write that replaces its values meanwhile
        replaces the mark, and then what the query read (older) is not kept.
        """
        cfg = self._settings
        want = cfg.load_ahead_first_rows if live.row_bytes is None else \
            max(1, min(cfg.load_ahead_rows, cfg.load_ahead_bytes // max(1, live.row_bytes)))
        with self._index.lock:
            ahead = [r for r in live.ready_rows(want) if r.payload is None]
            reading = claimed + ahead
            for r in reading:
                r.payload = LOADING
        loaded: Payloads = {}
        try:
            loaded = self.load_payloads(live, [r.row_id for r in reading])
        finally:
            with self._index.lock:
                for r in reading:
                    if r.payload is LOADING:
                        r.payload = loaded.get(r.row_id)
        return loaded

    def load_payloads(self, live: LiveTable, row_ids: list[int]) -> Payloads:
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
        table = self._readers.cursor(materialize=False).sql(sql, params=[row_ids]).to_arrow_table()
        ids = table.column("row_id").to_pylist()
        table = from_stored_table(table.drop_columns(["row_id"]), schema)
        if ids:
            live.row_bytes = table.get_total_buffer_size() // len(ids)
        self._index.cache.hold(table)
        return {rid: (table, i) for i, rid in enumerate(ids)}

    def _resolved(self, inline: pa.ChunkedArray, keys: pa.ChunkedArray) -> pa.Array:
        """A column's values: inline ones where the blob key is null, else read from blobs."""
        inline = one_array(inline)
        values = self._blobs.resolve(keys.to_pylist(), inline.type)
        if keys.null_count == 0:     # every value by reference: nothing to merge (if_else copies)
            return values
        return if_else(pc.is_valid(keys), values, inline)


class CheckedClaim(NamedTuple):
    """A claim's requests as :meth:`ClaimEngine.check` passed them, with its owner and the live
    table of each request."""

    requests: list[ClaimRequest]
    owner: str
    lives: list[LiveTable]


class PutLayout(NamedTuple):
    """How the claim columns of one cached put divide, the same for each of its claims.

    Attributes:
        plain_at: payload positions of the columns cut as they are, in claim order: the plain
            ones, and the by-reference ones whose values the put holds all inline (no key).
        plain: those columns of the put (one record batch where the put is one).
        refs: ``(value position, key position)`` of the by-reference columns read from the
            blob store.
        key_ats: their key positions.
        value_types: their value types.
        inserts: where the other claim columns go into the cut ``plain`` batch to make the
            claim's, in claim order: ``(claim position, claim field, i)``, ``i`` the index in
            ``refs`` or -1 for ``delivery_count``.
    """

    plain_at: list[int]
    plain: pa.RecordBatch | pa.Table
    refs: list[tuple[int, int]]
    key_ats: list[int]
    value_types: list[pa.DataType]
    inserts: list[tuple[int, pa.Field, int]]

    @classmethod
    def of(cls, live: LiveTable, table: pa.Table) -> "PutLayout":
        plain, refs = live.claim_plain, live.claim_refs
        if refs:
            rows_put = table.num_rows
            inline = [value_at for value_at, key_at in refs
                      if table.column(key_at).null_count == rows_put]
            if inline:
                sources = live.claim_sources
                plain = sorted(plain + inline, key=sources.index)
                refs = [ref for ref in refs if ref[0] not in inline]
        ref_of = {value_at: i for i, (value_at, _) in enumerate(refs)}
        claim = live.tdef.claim_schema()
        inserts = [(position, claim.field(position), -1 if at < 0 else ref_of[at])
                   for position, at in enumerate(live.claim_sources) if at < 0 or at in ref_of]
        selected = table.select(plain)
        batches = selected.to_batches()
        schema = table.schema
        return cls(plain, batches[0] if len(batches) == 1 else selected, refs,
                   [key_at for _, key_at in refs],
                   [schema.field(value_at).type for value_at, _ in refs], inserts)


_ONES = pa.array(np.ones(1024, np.int32))


#: ``_ONES``' first n, by n, made once each.
_ONES_BY_LENGTH: dict[int, pa.Array] = {}


def _delivery_count(deliveries: list[int]) -> pa.Array:
    """The ``delivery_count`` column of rows delivered that many times each."""
    if deliveries.count(1) == len(deliveries):
        return _first_deliveries(len(deliveries))
    return pa.array(deliveries, pa.int32())


def _first_deliveries(n: int) -> pa.Array:
    """A delivery_count column of ``n`` ones (a claim's rows are usually first deliveries)."""
    ones = _ONES_BY_LENGTH.get(n)
    if ones is None:
        if n > len(_ONES):
            return pa.array(np.ones(n, np.int32))
        ones = _ONES_BY_LENGTH[n] = _ONES.slice(0, n)
    return ones


def _joined(pieces: list, concat: Callable[[list], Any]) -> Any:
    """One piece as it is (a zero-copy slice), several joined by ``concat`` (one copy)."""
    return pieces[0] if len(pieces) == 1 else concat(pieces)


def _runs_across(where: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(source, first row, length)`` of each run of consecutive rows of one source, in order,
    from the ``(source, row)`` of each position."""
    runs: list[tuple[int, int, int]] = []
    k0, start = where[0]
    n = 1
    for k, row in where[1:]:
        if k == k0 and row == start + n:
            n += 1
        else:
            runs.append((k0, start, n))
            k0, start, n = k, row, 1
    runs.append((k0, start, n))
    return runs


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
