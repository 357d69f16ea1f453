"""The in-memory index of live rows, which serves claims without touching DuckDB.

Why: a claim as a DuckDB ``UPDATE … RETURNING`` costs a whole write transaction, and two threads
claiming at once conflict.
A lease is soft state (a server restart voids it), so claims are served from memory: the writer
keeps, for every *live* row (not consumed, stale or dead), its status bits and state, and an ordered
index of ready rows. DuckDB stays the durable record; this index is rebuilt from it on open.

Ready rows are kept per *group* ``(policy_version, input_id)`` with a heap of group keys, so one
structure gives both the deterministic row order (version, input id, turn, trajectory) and whole
groups for GRPO-style group claims.

All methods here are called with the store's index lock held.
"""
from __future__ import annotations

import heapq
import operator
from itertools import islice
from typing import Any, Callable, Iterator

import numpy as np

from .schema import TableDef
from .settings import StoreSettings

PENDING, READY, LEASED = "pending", "ready", "processing"

Key = tuple[str, int]          # (sample_id, policy_version)
GroupKey = tuple[int, str]     # (policy_version, input_id)

#: A row's payload while a claim reads its values from DuckDB (ClaimEngine._read_values in store/claim_engine.py).
LOADING: tuple[Any, int] = (None, -1)


class Row:
    """One live row's bookkeeping (its data stays in DuckDB and the blob store)."""

    __slots__ = ("row_id", "sample_id", "version", "input_id", "turn", "trajectory_id", "mask",
                 "state", "lease", "deliveries", "payload")

    def __init__(self, row_id: int, sample_id: str, version: int, input_id: str, turn: int,
                 trajectory_id: int, mask: int = 0, deliveries: int = 0, state: str = PENDING,
                 lease: Lease | None = None, payload: tuple[Any, int] | None = None) -> None:
        self.row_id = row_id
        self.sample_id = sample_id
        self.version = version
        self.input_id = input_id
        self.turn = turn
        self.trajectory_id = trajectory_id
        self.mask = mask
        self.state = state
        self.lease = lease
        self.deliveries = deliveries
        # (table, index): the row's claimable values, cached so that claims need no DuckDB read;
        # None: not cached (the claim cache was full, see store/cache.py), claims read DuckDB.
        self.payload = payload

    @property
    def key(self) -> Key:
        return (self.sample_id, self.version)

    @property
    def group_key(self) -> GroupKey:
        return (self.version, self.input_id)

    def order(self) -> tuple[int, int]:
        return (self.turn, self.trajectory_id)


#: A row's place in its group (Row.order, as a C-level key for sorting).
_ORDER = operator.attrgetter("turn", "trajectory_id")


class Lease:
    """The rows of one claim, possibly from several tables, held until ack, nack or expiry."""

    ACTIVE, SETTLING = "active", "settling"

    __slots__ = ("claim_id", "owner", "expires_at", "rows", "state")

    def __init__(self, claim_id: str, owner: str, expires_at: float,
                 rows: list[tuple["LiveTable", Row]]) -> None:
        self.claim_id = claim_id
        self.owner = owner
        self.expires_at = expires_at
        self.rows = rows
        self.state = Lease.ACTIVE


class RowBlock:
    """The ready rows of one bulk put, kept as columns until a claim or a write touches them.

    Why: building a :class:`Row` per row was a large share of what a bulk put cost the server
    (on the writer thread, under the index lock). A block costs one dict entry per row
    (``LiveTable.rows`` maps each of its keys to the block) and one entry per group; a group's rows
    become objects when the group is first read (:meth:`LiveTable._materialise`).

    The rows of group ``g`` (``group_keys[g]``) are ``order[starts[g]:starts[g + 1]]``, in claim
    order (turn, trajectory): a group built from one block needs no sort (``_Group.in_order``).
    Arrays
    for the block, not a list per group (nor a list and a tuple per group in ``_Group``), because
    every container that outlives a young collection counts toward Python's next full one, which
    walks the whole ready-row index: with flat arrays, embedded bulk puts ran fewer full
    collections and spent less time in them. The per-row columns (row ids, turns, trajectory
    ids, status masks, group numbers, the order) are numpy arrays, not lists of ints: a full
    collection visits every item of a list and none of an array, and an array costs 4-8 bytes a
    row where a list costs 8 plus an int object for each value over 256 (row ids, positions). A
    row's input id is its group's (``group_keys[codes[i]]``), not a string per row.
    """

    __slots__ = ("keys", "row_ids", "turns", "trajs", "masks", "codes", "payload",
                 "group_keys", "order", "starts", "min_version", "left", "_pos")

    def __init__(self, keys: list[Key], row_ids: np.ndarray, turns: np.ndarray,
                 trajs: np.ndarray, masks: np.ndarray, codes: np.ndarray, payload: Any,
                 group_keys: list[GroupKey]) -> None:
        self.keys = keys
        self.row_ids = row_ids
        self.turns = turns
        self.trajs = trajs
        self.masks = masks
        self.codes = codes
        self.payload = payload
        self.group_keys = group_keys
        self.order = np.lexsort((trajs, turns, codes))
        self.starts = np.concatenate(([0], np.cumsum(np.bincount(codes)))).tolist()
        self.min_version = min(gk[0] for gk in group_keys)
        self.left = len(keys)          # rows not yet built
        self._pos: dict[Key, int] | None = None

    def position(self, key: Key) -> int:
        pos = self._pos
        if pos is None:  # built on first use, by whichever thread asks first (idempotent)
            pos = self._pos = dict(zip(self.keys, range(len(self.keys))))
        return pos[key]

    def row_id_of(self, key: Key) -> int:
        return int(self.row_ids[self.position(key)])

    def group_of(self, key: Key) -> GroupKey:
        return self.group_keys[int(self.codes[self.position(key)])]


class _Group:
    __slots__ = ("key", "ready", "in_order", "in_heap", "lazy", "lazy_index", "lazy_more")

    def __init__(self, key: GroupKey) -> None:
        self.key = key
        # Made on first use: most groups of a bulk put are built only when claimed, and a dict
        # per group of 8 rows cost as much as the group (allocation and collections).
        self.ready: dict[Key, Row] | None = None
        # ``ready`` holds its rows in claim order (turn, trajectory), so a claim takes them as
        # they are: rows built from one block (sorted, see RowBlock) into an empty group. Any
        # other row added clears it; taking rows out keeps the order.
        self.in_order = True
        self.in_heap = False
        # Ready rows of blocks not built yet (see RowBlock): the group is ``lazy_index`` of
        # block ``lazy``, and of more blocks in ``lazy_more`` (a group written by several bulk
        # puts; rare, so the common case allocates nothing more).
        self.lazy: RowBlock | None = None
        self.lazy_index = 0
        self.lazy_more: list[tuple[RowBlock, int]] | None = None

    def ready_map(self) -> dict[Key, Row]:
        """``ready``, made on first use."""
        if self.ready is None:
            self.ready = {}
        return self.ready


class LiveTable:
    """Live rows of one experience table."""

    def __init__(self, tdef: TableDef, next_row_id: int = 0,
                 terminal_max: int = StoreSettings.terminal_index_max) -> None:
        self.tdef = tdef
        # A live row's Row, or the RowBlock that holds it until it is built: use row() to get
        # a Row; only the writer's lookup of row ids reads blocks directly.
        self.rows: dict[Key, Row | RowBlock] = {}
        self._blocks: set[RowBlock] = set()   # blocks with rows not built yet
        self.next_row_id = next_row_id
        self._groups: dict[GroupKey, _Group] = {}
        self._heap: list[GroupKey] = []
        self.ready_count = 0
        self.leased_count = 0
        self.required_mask = tdef.required_mask
        self.payload_schema = tdef.payload_schema()
        # A claim's table is built from cached payload columns in one step: where each claim
        # column comes from in the payload (-1: delivery_count, which each claim sets), and the
        # (value, blob key) positions of each column that may be stored by reference.
        payload = self.payload_schema.names
        self.claim_sources = [-1 if n == "delivery_count" else payload.index(n)
                              for n in tdef.claim_schema().names]
        self.claim_refs = [(payload.index(c.name), payload.index(c.ref))
                           for c in tdef.columns if c.ref]
        # The claim columns taken from the payload as they are (not values that may be stored
        # by reference), cut together.
        by_ref = {value_at for value_at, _ in self.claim_refs}
        self.claim_plain = [at for at in self.claim_sources if at >= 0 and at not in by_ref]
        # Terminal rows (consumed, stale, dead) that a put may still address, so that a put of a
        # key that is not live needs no DuckDB lookup: policy_version -> sample_id -> row_id.
        # Only versions a put may still carry (>= current version - max_staleness; older ones
        # are refused as stale) are kept, so its size is bounded by the staleness window. None:
        # not kept (over terminal_max); the writer then asks DuckDB.
        self.terminal: dict[int, dict[str, int]] | None = {}
        self.terminal_max = terminal_max
        self.terminal_count = 0
        # Bytes of a row's values as last read from DuckDB (how many rows a claim reads ahead).
        self.row_bytes: int | None = None

    # -- state transitions ---------------------------------------------------------------------
    def is_complete(self, row: Row) -> bool:
        req = self.required_mask
        return row.mask & req == req

    def make_ready(self, row: Row) -> None:
        if row.state == READY:
            return
        if row.state == LEASED:
            self.leased_count -= 1
        row.state = READY
        row.lease = None
        gk = (row.version, row.input_id)  # row.group_key, without a property call (hot path)
        group = self._groups.get(gk)
        if group is None:
            group = self._groups[gk] = _Group(gk)
        ready = group.ready_map()
        group.in_order = not ready
        ready[(row.sample_id, row.version)] = row
        self.ready_count += 1
        if not group.in_heap:
            heapq.heappush(self._heap, gk)
            group.in_heap = True

    def add_ready(self, row: Row, key: Key) -> None:
        """:meth:`make_ready` for a row just created (pending, not leased) under ``key``: the
        bulk put path."""
        gk = (row.version, row.input_id)
        group = self._groups.get(gk)
        if group is None:
            group = self._groups[gk] = _Group(gk)
        row.state = READY
        ready = group.ready_map()
        group.in_order = not ready
        ready[key] = row
        self.ready_count += 1
        if not group.in_heap:
            heapq.heappush(self._heap, gk)
            group.in_heap = True

    def add_block(self, block: RowBlock) -> None:
        """Index the ready rows of a bulk put without building them."""
        self.rows.update(dict.fromkeys(block.keys, block))
        groups = self._groups
        heap = self._heap
        for g, gk in enumerate(block.group_keys):
            group = groups.get(gk)
            if group is None:
                group = groups[gk] = _Group(gk)
            if group.lazy is None:
                group.lazy = block
                group.lazy_index = g
            elif group.lazy_more is None:
                group.lazy_more = [(block, g)]
            else:
                group.lazy_more.append((block, g))
            if not group.in_heap:
                heapq.heappush(heap, gk)
                group.in_heap = True
        self.ready_count += len(block.keys)
        self._blocks.add(block)

    def row(self, key: Key) -> Row | None:
        """The live row of ``key`` (built from its block if need be), or None."""
        row = self.rows.get(key)
        if not isinstance(row, RowBlock):
            return row
        group = self._groups[row.group_of(key)]
        self._materialise(group)
        built = self.rows.get(key)
        assert not isinstance(built, RowBlock)
        return built

    def _materialise(self, group: _Group) -> None:
        """Build the group's rows that are still in blocks: ready, with their block's cached
        values (if it has them)."""
        if group.lazy is None:
            return
        lazy = [(group.lazy, group.lazy_index)] + (group.lazy_more or [])
        group.lazy = group.lazy_more = None
        rows = self.rows
        ready = group.ready_map()
        group.in_order = not ready and len(lazy) == 1
        for block, g in lazy:
            keys, payload = block.keys, block.payload
            at = block.order[block.starts[g]:block.starts[g + 1]]
            input_id = block.group_keys[g][1]
            for i, rid, turn, traj, mask in zip(
                    at.tolist(), block.row_ids[at].tolist(), block.turns[at].tolist(),
                    block.trajs[at].tolist(), block.masks[at].tolist()):
                key = keys[i]
                row = Row(rid, key[0], key[1], input_id, turn, traj, mask)
                row.state = READY
                row.payload = None if payload is None else (payload, i)
                rows[key] = row
                ready[key] = row
            block.left -= len(at)
            if block.left <= 0:
                self._blocks.discard(block)

    def unready(self, row: Row) -> None:
        """Take a ready row out of the ready index (it becomes pending)."""
        if row.state != READY:
            return
        group = self._groups.get((row.version, row.input_id))  # row.group_key (hot path)
        if group is not None:
            if group.ready is not None:
                group.ready.pop((row.sample_id, row.version), None)
            if not group.ready and not group.in_heap and group.lazy is None:
                del self._groups[group.key]
        self.ready_count -= 1
        row.state = PENDING

    def give_back(self, rows: list[Row]) -> None:
        """Undo :meth:`take`: the rows ready again, their delivery not counted (a claim that
        could not be served whole)."""
        for row in rows:
            row.deliveries -= 1
            self.make_ready(row)   # (leased, so it counts them out of leased_count)

    def release(self, row: Row) -> None:
        """End a row's lease without consuming it: ready again if complete, else pending."""
        if row.state == LEASED:
            self.leased_count -= 1
            row.state = PENDING
            row.lease = None
        if self.is_complete(row):
            self.make_ready(row)

    def forget(self, row: Row) -> None:
        """Drop a row that reached a terminal state (consumed, stale, dead)."""
        self.forget_rows([row])

    def forget_rows(self, rows: list[Row]) -> None:
        """Drop rows that reached a terminal state, in one pass (an ack's rows)."""
        # Remembered as terminal before it leaves ``rows``: the writer, which looks keys up
        # without the lock, finds a key in one or the other.
        remember = self.remember_terminal
        pop = self.rows.pop
        for row in rows:
            remember(row.version, row.sample_id, row.row_id)
            row.payload = None
            state = row.state
            if state == LEASED:
                self.leased_count -= 1
            elif state == READY:
                self.unready(row)
            row.state = PENDING
            row.lease = None
            pop((row.sample_id, row.version), None)

    def revive(self, row: Row) -> None:
        """A dead row made live again (``requeue``): no longer a terminal row, ready if its
        required statuses are true, else pending."""
        terminal = self.terminal
        if terminal is not None:
            by_sid = terminal.get(row.version)
            if by_sid is not None and by_sid.pop(row.sample_id, None) is not None:
                self.terminal_count -= 1
        self.rows[row.key] = row
        if self.is_complete(row):
            self.make_ready(row)

    def evict(self, keys: list[Key], table: Any) -> None:
        """Drop the cached values that ``keys``' ready rows hold in ``table`` (claims read
        them from DuckDB then). Leased rows keep theirs: their claim is about to read them."""
        rows_get = self.rows.get
        for key in keys:
            row = rows_get(key)
            if isinstance(row, RowBlock):
                if row.payload is table:
                    row.payload = None
            elif row is not None and row.state == READY and row.payload is not None \
                    and row.payload[0] is table:
                row.payload = None

    # -- terminal rows -----------------------------------------------------------------------------
    def remember_terminal(self, version: int, sample_id: str, row_id: int) -> None:
        terminal = self.terminal
        if terminal is None:
            return
        if self.terminal_count >= self.terminal_max:
            self.terminal = None  # the writer notices and asks DuckDB (see store/rows_sql.py)
            self.terminal_count = 0
            return
        by_sid = terminal.get(version)
        if by_sid is None:
            by_sid = terminal[version] = {}
        if sample_id not in by_sid:
            self.terminal_count += 1
        by_sid[sample_id] = row_id

    def prune_terminal(self, bound: int) -> None:
        """Forget terminal rows of versions below ``bound``: puts of them are refused as stale."""
        terminal = self.terminal
        if terminal is None:
            return
        for version in [v for v in terminal if v < bound]:
            self.terminal_count -= len(terminal.pop(version))

    # -- reading the ready index ----------------------------------------------------------------
    def _iter_groups(self, build: bool = True) -> Iterator[_Group]:
        """Ready groups in order; the caller must call :meth:`_restore` with what it consumed.
        Groups still in blocks are built first, unless ``build`` is false."""
        while self._heap:
            gk = heapq.heappop(self._heap)
            group = self._groups.get(gk)
            if group is None:
                continue
            group.in_heap = False
            if group.lazy is not None:
                if not build:
                    yield group
                    continue
                self._materialise(group)
            if not group.ready:
                del self._groups[gk]
                continue
            yield group

    def _restore(self, groups: list[_Group]) -> None:
        for group in groups:
            if group.ready and not group.in_heap:
                heapq.heappush(self._heap, group.key)
                group.in_heap = True
            elif not group.ready and not group.in_heap:
                self._groups.pop(group.key, None)

    def take(self, limit: int, group_size: int | None, accept: Callable[[Row], bool] | None,
             min_rows: int, lease: Lease) -> list[Row]:
        """Lease to ``lease`` up to ``limit`` ready rows in claim order (whole groups of
        ``group_size`` if given; only rows ``accept`` takes, if given), if there are at least
        ``min_rows`` of them; else take nothing and return those it found.

        Why not choose, then lease: a group still in its block (see :class:`RowBlock`) had
        every row built as a ready row, copied out of the ready index and popped from it again;
        here such a group's rows are built leased, and only those the claim leaves are filed as
        ready.
        """
        chosen: list[Row] = []
        seen: list[_Group] = []
        try:
            for group in self._iter_groups(build=accept is not None):
                seen.append(group)
                room = limit - len(chosen)
                if group.lazy is not None:
                    if group.lazy_more is None and not group.ready:
                        self._take_block_groups(group, room, group_size, lease, chosen, seen)
                        if len(chosen) + (group_size or 1) > limit:
                            break
                        continue
                    self._materialise(group)
                ready = group.ready
                assert ready  # _iter_groups yields groups with ready rows
                rows = list(ready.values()) if group.in_order \
                    else sorted(ready.values(), key=_ORDER)
                if accept is not None:
                    rows = [r for r in rows if accept(r)]
                if group_size:
                    rows = rows[:min(len(rows), room) // group_size * group_size]
                else:
                    rows = rows[:room]
                for row in rows:
                    del ready[(row.sample_id, row.version)]
                    row.state = LEASED
                    row.lease = lease
                    row.deliveries += 1
                self.ready_count -= len(rows)
                self.leased_count += len(rows)
                chosen.extend(rows)
                if len(chosen) + (group_size or 1) > limit:
                    break
        finally:
            self._restore(seen)
        if len(chosen) < min_rows:
            self.give_back(chosen)
        return chosen

    def _take_block_groups(self, group: _Group, room: int, group_size: int | None,
                           lease: Lease, chosen: list[Row], seen: list[_Group]) -> None:
        """Build the rows of a group held by one block (and no ready rows), and of the groups
        of the same block that come next in claim order, as far as the claim goes: the first
        ``room`` (whole groups of ``group_size`` per group) leased to ``lease`` onto
        ``chosen``, the rest ready. The groups after the first are popped from the heap here
        (onto ``seen``, for :meth:`_restore`), as :meth:`take`'s loop would have.

        Why several groups in one pass: a claim of many rows takes several groups of one bulk
        put in a row (8 for 64 rows of groups of 8), and each group's own slice of the block's
        arrays (a numpy index and a list per column) cost about as much as building its rows."""
        block = group.lazy
        assert block is not None
        starts, heap, groups = block.starts, self._heap, self._groups
        # (group, its number in the block, rows it leases), in claim order
        plan: list[tuple[_Group, int, int]] = []
        limit, taken = room, 0
        while True:
            g = group.lazy_index
            group.lazy = None
            n = starts[g + 1] - starts[g]
            taking = min(n, room) // group_size * group_size if group_size else min(n, room)
            plan.append((group, g, taking))
            room -= taking
            taken += taking
            if taken + (group_size or 1) > limit or not heap:
                break
            following = groups.get(heap[0])
            if following is None or following.lazy is not block \
                    or following.lazy_more is not None or following.ready:
                break
            heapq.heappop(heap)
            following.in_heap = False
            seen.append(following)
            group = following
        order = block.order
        at = order[starts[plan[0][1]]:starts[plan[0][1] + 1]] if len(plan) == 1 else \
            np.concatenate([order[starts[g]:starts[g + 1]] for _, g, _ in plan])
        keys, payload, rows = block.keys, block.payload, self.rows
        built = zip(at.tolist(), block.row_ids[at].tolist(), block.turns[at].tolist(),
                    block.trajs[at].tolist(), block.masks[at].tolist())
        left_count = 0
        for group, g, taking in plan:
            input_id = block.group_keys[g][1]
            n = starts[g + 1] - starts[g]
            for i, rid, turn, traj, mask in islice(built, taking):
                key = keys[i]
                row = rows[key] = Row(rid, key[0], key[1], input_id, turn, traj, mask, 1, LEASED,
                                      lease, None if payload is None else (payload, i))
                chosen.append(row)
            if taking < n:
                left = group.ready_map()
                group.in_order = True
                left_count += n - taking
                for i, rid, turn, traj, mask in islice(built, n - taking):
                    key = keys[i]
                    rows[key] = left[key] = Row(rid, key[0], key[1], input_id, turn, traj, mask,
                                                0, READY, None,
                                                None if payload is None else (payload, i))
        self.ready_count -= taken
        self.leased_count += taken
        block.left -= taken + left_count
        if block.left <= 0:
            self._blocks.discard(block)

    def ready_rows(self, limit: int) -> list[Row]:
        """The first ``limit`` ready rows in claim order, taking nothing (candidates for a
        predicate, rows to read ahead): :meth:`take` chooses the same way and leases."""
        chosen: list[Row] = []
        seen: list[_Group] = []
        try:
            for group in self._iter_groups():
                seen.append(group)
                assert group.ready is not None  # _iter_groups yields groups with ready rows
                rows = list(group.ready.values()) if group.in_order \
                    else sorted(group.ready.values(), key=_ORDER)
                chosen.extend(rows[: limit - len(chosen)])
                if len(chosen) >= limit:
                    break
        finally:
            self._restore(seen)
        return chosen

    def build_blocks_below(self, bound: int) -> None:
        """Build the rows of every block holding a version below ``bound`` (before
        :meth:`stale_rows`)."""
        for block in [b for b in self._blocks if b.min_version < bound]:
            for gk in block.group_keys:
                group = self._groups.get(gk)
                if group is not None:
                    self._materialise(group)

    def stale_rows(self, bound: int) -> list[Row]:
        """Live rows older than ``bound`` that are not under a lease; rows still in blocks are
        not seen (:meth:`build_blocks_below` first).

        The writer calls this without the index lock: only it adds or removes keys of ``rows``.
        """
        return [r for r in self.rows.values()
                if isinstance(r, Row) and r.version < bound and r.state != LEASED]
