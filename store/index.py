"""The in-memory index: the state the writer and the reads share, behind one lock.

What it holds: the live tables (rows pending, ready or leased; see store/live.py), each version
group's version, weights and barrier, the leases and their expiry order, the lease bookkeeping
not yet written to DuckDB, the recently ended claims (so that a late ack or nack is answered
precisely), the claim cache and the monitoring counters.

Who changes it: the writer, after a commit (``apply`` effects run under :attr:`StoreIndex.lock`),
and the claim path, which leases rows at once and leaves their bookkeeping here for the writer
(see :meth:`StoreIndex.take_row_updates`) to write once due (an ack sooner supersedes it). The facade (store/embedded.py) builds one
index and passes it to the writer and the reads; neither holds the facade.

Methods marked "lock held" expect the caller to hold :attr:`StoreIndex.lock` (an ``RLock``).
"""
from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Iterator

import datetime as dt

from .barrier import Barrier
from .cache import ClaimCache
from .errors import NotFound
from .live import LEASED, Lease, LiveTable, Row
from .naming import check_identifier
from .prepare import PreparedPut, prepare_put
from .putlog import LeaseUpdate
from .recovery import State
from .schema import TableDef
from .settings import StoreSettings

log = logging.getLogger("expstore.store")

#: A settled lease's rows by table, each with its outcome: consumed, ready, dead or stale.
SettlePlan = dict[str, list[tuple[Row, str]]]
#: An acked lease's rows by table (all consumed): the live table, the rows, their row ids and
#: their delivery counts.
AckPlan = dict[str, tuple[LiveTable, list[Row], list[int], list[int]]]


class StoreIndex:
    """The shared in-memory state of one store (see the module docstring).

    Args:
        state: what store/recovery.py loaded from DuckDB.
        settings: the store's settings.
    """

    def __init__(self, state: State, settings: StoreSettings) -> None:
        self.settings = settings
        self.lock = threading.RLock()
        #: Notified on every change that a waiter may care about (versions, rows, barriers).
        self.changed = threading.Condition(self.lock)
        self.change_seq = 0
        #: Set by EmbeddedStore.end_waits (a server stopping): why long polls (wait_version,
        #: a barrier arrival) end now instead of holding the server's shutdown.
        self.waits_ended: str | None = None
        self.cache = ClaimCache(settings.cache_bytes)
        self.live: dict[str, LiveTable] = state.live
        self.versions: dict[str, int] = state.versions
        self.weights: dict[str, str | None] = state.weights
        self.barrier_timeouts: dict[str, float] = state.barrier_timeouts
        self.barriers: dict[str, Barrier] = {}
        #: Leases by claim id, and the answers of those being settled.
        self.claims: dict[str, Lease] = {}
        self.settling: dict[str, Future] = {}
        #: Counts table creations and drops (the query views follow them; see sqlvalues).
        self.ddl_seq = 0
        #: Monotonic counters for monitoring (flight_server.metrics exports them).
        self.counters: dict[str, int] = {
            "rows_put": 0, "puts": 0, "claims": 0, "rows_claimed": 0, "acks": 0,
            "rows_acked": 0, "nacks": 0, "leases_expired": 0, "redeliveries": 0,
            "dead_letters": 0, "stale_rows": 0, "version_bumps": 0, "rows_requeued": 0}
        self._expiry: list[tuple[float, str]] = []
        # Per table and row id: a LeaseUpdate, or for a row a claim leased, (its Lease, the row's
        # delivery count), built into its LeaseUpdate only when taken (see _updates): a claim
        # acked before its flush is due, the micro-batch loop's, never needs one.
        self._row_updates: dict[str, dict[int, LeaseUpdate | tuple[Lease, int]]] = {}
        self._recent_acked: OrderedDict[str, int] = OrderedDict()
        self._recent_expired: OrderedDict[str, str] = OrderedDict()
        # claims being ended by dead_letter(): their rows settle as dead, not ready
        self._dead_lettering: set[str] = set()
        self._terminal_possible: set[str] = state.terminal_possible
        for tname, voided in state.voided.items():  # written by the writer's first group
            self._row_updates[tname] = {u.row_id: u for u in voided}
        for claim_id in state.ended:
            _remember(self._recent_expired, claim_id, "the store restarted since it was "
                      "claimed, and a restart voids every lease (leases are soft state); its "
                      "rows are ready to be delivered again", settings.recent_claims)

    # -- tables ------------------------------------------------------------------------------
    def table_names(self) -> list[str]:
        with self.lock:
            return sorted(self.live)

    def live_table(self, name: str) -> LiveTable:
        """The live table ``name``; NotFound (listing the tables) when there is none."""
        live = self.live.get(name) if isinstance(name, str) else None
        if live is None:
            if isinstance(name, str):
                check_identifier(name, "table")
            raise self.no_table(name)
        return live

    def no_table(self, name: object) -> NotFound:
        return NotFound(f"table {name!r} does not exist; tables: {self.table_names()}")

    def version_of(self, live: LiveTable) -> int:
        """The current version of ``live``'s version group."""
        return self.versions[live.tdef.version_group]

    def members(self, group: str) -> list[str]:
        """The tables of a version group (lock held)."""
        return sorted(n for n, live in self.live.items() if live.tdef.version_group == group)

    def add_table(self, tdef: TableDef) -> None:
        """A created table, after its DDL committed (lock held)."""
        self.live[tdef.name] = LiveTable(tdef, terminal_max=self.settings.terminal_index_max)
        self.ddl_seq += 1
        self.versions.setdefault(tdef.version_group, 0)
        self.weights.setdefault(tdef.version_group, None)

    def drop_table(self, name: str) -> None:
        """A dropped table, after its DDL committed (lock held): its leases lose its rows."""
        live = self.live.pop(name)
        self.ddl_seq += 1
        group = live.tdef.version_group
        if not any(t.tdef.version_group == group for t in self.live.values()):
            self.versions.pop(group, None)
            self.weights.pop(group, None)
            self.barrier_timeouts.pop(group, None)
            # A round of the group's last table, finished or not, ends with it: a table made
            # again under the name starts at version 0, where that round would hold it.
            self.barriers.pop(group, None)
        # (A barrier round waiting for this table is woken by the writer's notify and
        # waits for one member fewer.)
        for cid, lease in list(self.claims.items()):
            lease.rows = [(t, r) for t, r in lease.rows if t is not live]
            if not lease.rows:
                del self.claims[cid]
        self._row_updates.pop(name, None)

    def may_have_terminal_rows(self, table: str) -> bool:
        """Whether DuckDB may hold consumed, stale or dead rows of ``table``."""
        return table in self._terminal_possible

    # -- puts --------------------------------------------------------------------------------
    def prepare(self, table: str, data: Any) -> PreparedPut:
        """Validate and convert a write to ``table`` against its current version."""
        live = self.live_table(table)
        return prepare_put(live.tdef, data, self.version_of(live),
                           self.settings.ref_threshold)

    def count_put(self, rows: int, puts: int = 1) -> None:
        self.counters["puts"] += puts
        self.counters["rows_put"] += rows

    # -- versions ----------------------------------------------------------------------------
    def apply_bump(self, group: str, new: int, weights_uri: str | None,
                   stale: list[tuple[LiveTable, list[Row]]]) -> None:
        """A committed version bump (lock held): rows below the bound leave the index."""
        self.counters["version_bumps"] += 1
        self.versions[group] = new
        self.weights[group] = weights_uri
        for live, rows in stale:
            for row in rows:
                if row.state != LEASED:  # (one leased since is staled when it settles)
                    live.forget(row)
                    self.counters["stale_rows"] += 1
        for live in self.live.values():
            if live.tdef.version_group == group:
                live.prune_terminal(new - live.tdef.max_staleness)

    # -- leases ------------------------------------------------------------------------------
    @staticmethod
    def new_lease(owner: str, seconds: float) -> Lease:
        """A lease under a new claim id, holding nothing yet: the live tables lease rows to it
        (``LiveTable.take``), then :meth:`register` makes it a claim."""
        # 32 random hex digits, spelled as uuid4().hex was, without building a UUID object
        return Lease(os.urandom(16).hex(), owner, time.time() + seconds, [])

    def register(self, lease: Lease, picks: list[tuple[LiveTable, list[Row]]]) -> None:
        """Make a lease whose rows the live tables leased to it a claim (lock held); their
        bookkeeping waits here for the writer."""
        claim_id = lease.claim_id
        redeliveries = 0
        for live, rows in picks:
            lease.rows.extend([(live, row) for row in rows])
            pending = self._row_updates.setdefault(live.tdef.name, {})
            for row in rows:
                deliveries = row.deliveries
                pending[row.row_id] = (lease, deliveries)
                if deliveries > 1:
                    redeliveries += 1
        self.claims[claim_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, claim_id))
        self.counters["claims"] += 1
        self.counters["rows_claimed"] += len(lease.rows)
        self.counters["redeliveries"] += redeliveries

    def release_unread(self, lease: Lease) -> bool:
        """Give back rows whose data could not be read, without counting a delivery; whether
        there was anything to give back (then the writer has bookkeeping to write)."""
        with self.lock:
            if self.claims.pop(lease.claim_id, None) is None:
                return False
            for live, row in lease.rows:
                row.deliveries -= 1
                live.release(row)
                self._row_updates.setdefault(live.tdef.name, {})[row.row_id] = \
                    LeaseUpdate.released(row.row_id, row.deliveries)
            self.notify()
        return True

    def active_lease(self, claim_id: str) -> Lease | None:
        """The lease of ``claim_id`` (lock held); one past its expiry is ended here first."""
        lease = self.claims.get(claim_id)
        if lease is not None and lease.state == Lease.ACTIVE and lease.expires_at <= time.time():
            self.expire(lease)
            return None
        return lease

    def renew(self, lease: Lease, seconds: float | None) -> float:
        """Extend an active lease to ``seconds`` from now (None: the longest ``lease_seconds`` of
        its tables, as a claim takes by default); its new expiry (lock held).

        The expiry heap gets a new entry (:meth:`expire_leases` skips the old one: the lease
        expires later than it says), and the rows' bookkeeping waits here again, so that the
        writer's next flush writes the new ``lease_expires_at``. Only a lease that still holds
        its rows is renewed (the caller checks it is active), so no consumed or released row is
        marked leased again; an ack or expiry after this supersedes the entries as it would a
        claim's."""
        if seconds is None:
            seconds = max(live.tdef.lease_seconds for live, _ in lease.rows)
        lease.expires_at = time.time() + seconds
        heapq.heappush(self._expiry, (lease.expires_at, lease.claim_id))
        current: LiveTable | None = None
        for live, row in lease.rows:
            if live is not current:  # a lease's rows come table by table (see register)
                current = live
                pending = self._row_updates.setdefault(live.tdef.name, {})
            pending[row.row_id] = (lease, row.deliveries)
        return lease.expires_at

    def recently_acked(self, claim_id: str) -> int | None:
        """The rows a recently acked claim consumed, if it is one (lock held)."""
        return self._recent_acked.get(claim_id)

    def why_ended(self, claim_id: str) -> str | None:
        """Why a recently ended claim ended and what became of its rows (lock held)."""
        return self._recent_expired.get(claim_id)

    @contextmanager
    def dead_lettering(self, claim_id: str) -> Iterator[None]:
        """While inside, the rows of ``claim_id`` settle as dead when it is nacked."""
        with self.lock:
            self._dead_lettering.add(claim_id)
        try:
            yield
        finally:
            with self.lock:
                self._dead_lettering.discard(claim_id)

    def settle_plan(self, lease: Lease) -> SettlePlan:
        """What becomes of each row of a lease that ends now unacked (lock held): an ack
        consumes every row (:meth:`ack_plan`)."""
        plan: SettlePlan = {}
        for live, row in lease.rows:
            if lease.claim_id in self._dead_lettering:
                outcome = "dead"
            elif row.version < self.versions.get(live.tdef.version_group, 0) \
                    - live.tdef.max_staleness:
                outcome = "stale"
            elif row.deliveries >= live.tdef.max_deliveries:
                outcome = "dead"
            else:
                outcome = "ready"
            plan.setdefault(live.tdef.name, []).append((row, outcome))
        return plan

    def ack_plan(self, lease: Lease) -> AckPlan:
        """What an ack of ``lease`` consumes (lock held): :meth:`settle_plan` and
        :meth:`supersede_row_updates` of an ack in one pass over its rows, which also gathers
        the row ids and delivery counts its put log record holds (every acked row is consumed,
        so there is no outcome to work out per row)."""
        plan: AckPlan = {}
        claim_id = lease.claim_id
        current: LiveTable | None = None
        for live, row in lease.rows:
            if live is not current:  # a lease's rows come table by table (see register)
                current = live
                name = live.tdef.name
                entry = plan.get(name)
                if entry is None:
                    entry = plan[name] = (live, [], [], [])
                _, rows, row_ids, deliveries = entry
                pending = self._row_updates.get(name)
            rows.append(row)
            row_id = row.row_id
            row_ids.append(row_id)
            deliveries.append(row.deliveries)
            if pending:
                _drop_own(pending, row_id, claim_id)
        return plan

    def acked(self, lease: Lease, plan: AckPlan) -> None:
        """:meth:`settled` of an ack (lock held): every row consumed, forgotten table by
        table."""
        self.claims.pop(lease.claim_id, None)
        self.settling.pop(lease.claim_id, None)
        for tname, (_, rows, _, _) in plan.items():
            live = self.live.get(tname)
            if live is None:
                continue
            self._terminal_possible.add(tname)
            live.forget_rows(rows)
        self.counters["acks"] += 1
        self.counters["rows_acked"] += len(lease.rows)
        _remember(self._recent_acked, lease.claim_id, len(lease.rows),
                  self.settings.recent_claims)

    def settled(self, lease: Lease, plan: SettlePlan, how: str) -> None:
        """Apply a lease settled unacked to memory (lock held); ``how`` is "nack" or
        "expired" (an ack: :meth:`acked`)."""
        self.claims.pop(lease.claim_id, None)
        self.settling.pop(lease.claim_id, None)
        for tname, rows in plan.items():
            live = self.live.get(tname)
            if live is None:
                continue
            self._terminal_possible.add(tname)
            for row, outcome in rows:
                if outcome == "ready":
                    live.release(row)
                else:
                    live.forget(row)
                    if outcome in ("dead", "stale"):
                        self.counters["dead_letters" if outcome == "dead" else "stale_rows"] += 1
        recent = self.settings.recent_claims
        if how == "nack":
            self.counters["nacks"] += 1
            _remember(self._recent_expired, lease.claim_id, _ended("it was nacked", plan), recent)
        else:
            self.counters["leases_expired"] += 1
            _remember(self._recent_expired, lease.claim_id, _ended("its lease expired", plan),
                      recent)

    def expire(self, lease: Lease) -> None:
        """End an expired lease (lock held): rows ready again, or dead/stale."""
        plan = self.settle_plan(lease)
        for tname, rows in plan.items():
            pending = self._row_updates.setdefault(tname, {})
            for row, outcome in rows:
                pending[row.row_id] = LeaseUpdate.released(
                    row.row_id, row.deliveries, stale=outcome == "stale", dead=outcome == "dead")
        self.settled(lease, plan, "expired")
        self.notify()

    def expire_leases(self) -> None:
        """End every lease past its expiry."""
        now = time.time()
        expired = False
        with self.lock:
            while self._expiry and self._expiry[0][0] <= now:
                _, cid = heapq.heappop(self._expiry)
                lease = self.claims.get(cid)
                if lease is not None and lease.state == Lease.ACTIVE and lease.expires_at <= now:
                    self.expire(lease)
                    expired = True
        if expired:
            log.info("leases expired; their rows are ready again")

    def next_expiry_in(self) -> float | None:
        """Seconds until the next lease may expire; None without leases."""
        with self.lock:
            if not self._expiry:
                return None
            return max(0.0, self._expiry[0][0] - time.time())

    # -- lease bookkeeping waiting for the writer ---------------------------------------------
    def has_pending_row_updates(self) -> bool:
        with self.lock:
            return any(self._row_updates.values())

    def take_row_updates(self) -> dict[str, list[LeaseUpdate]]:
        """Take the bookkeeping waiting to be written, by table (the writer, once due)."""
        with self.lock:
            taken = {t: rows for t, rows in self._row_updates.items() if rows}
            self._row_updates = {}
        return {t: _updates(rows) for t, rows in taken.items()}  # (outside the lock: claims wait)

    def requeue_row_updates(self, updates: dict[str, list[LeaseUpdate]]) -> None:
        """Put back bookkeeping a failed transaction had taken (newer entries win)."""
        with self.lock:
            for tname, rows in updates.items():
                if tname not in self.live:
                    continue
                pending = self._row_updates.setdefault(tname, {})
                for entry in rows:
                    pending.setdefault(entry.row_id, entry)

    def supersede_row_updates(self, lease: Lease, plan: SettlePlan) -> None:
        """Drop the bookkeeping of ``lease`` that its settle, written now, supersedes (lock
        held): flushed afterwards it would mark the rows leased again."""
        for tname, rows in plan.items():
            pending = self._row_updates.get(tname)
            if pending:
                for row, _ in rows:
                    _drop_own(pending, row.row_id, lease.claim_id)

    def unwritten_row_updates(self, table: str) -> list[LeaseUpdate]:
        """The bookkeeping of ``table`` not written yet (lock held): expired leases' stale and
        dead rows left memory before their flags reach DuckDB."""
        return _updates(self._row_updates.get(table, {}))

    # -- waiting -----------------------------------------------------------------------------
    def notify(self) -> None:
        """Wake every waiter on :attr:`changed` (lock held)."""
        self.change_seq += 1
        self.changed.notify_all()

    # -- monitoring --------------------------------------------------------------------------
    def table_gauges(self) -> list[dict[str, Any]]:
        """Per table: its version and rows ready, processing and pending, at one instant."""
        with self.lock:
            return [{"table": name, "version": self.versions.get(live.tdef.version_group, 0),
                     "ready": live.ready_count, "processing": live.leased_count,
                     "pending": len(live.rows) - live.ready_count - live.leased_count}
                    for name, live in self.live.items()]


def _ended(how: str, plan: SettlePlan) -> str:
    """Why a claim ended and what became of its rows, for a late ack or nack of it: a row
    dead-lettered or made stale is never delivered again, and the answer says so."""
    outcomes: dict[str, int] = {}
    for rows in plan.values():
        for _, outcome in rows:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    fates = []
    if outcomes.get("ready"):
        fates.append(f"{outcomes['ready']} ready to be delivered again")
    if outcomes.get("dead"):
        fates.append(f"{outcomes['dead']} dead: dead-lettered after reaching the table's "
                     "max_deliveries, never delivered again")
    if outcomes.get("stale"):
        fates.append(f"{outcomes['stale']} stale: older than the staleness bound, never "
                     "delivered again")
    return f"{how}; of its rows, {', '.join(fates)}" if fates else how


def _drop_own(pending: dict[int, LeaseUpdate | tuple[Lease, int]], row_id: int,
              claim_id: str) -> None:
    """Drop ``row_id``'s pending bookkeeping if it is claim ``claim_id``'s (a settle written
    now supersedes it)."""
    entry = pending.get(row_id)
    if entry is not None and (entry.lease_id if isinstance(entry, LeaseUpdate)
                              else entry[0].claim_id) == claim_id:
        del pending[row_id]


def _updates(pending: dict[int, LeaseUpdate | tuple[Lease, int]]) -> list[LeaseUpdate]:
    """Pending bookkeeping entries as LeaseUpdates, a claim's ``(lease, delivery count)`` built
    into one from its lease's fields as they are now (a renewal changes ``expires_at`` and
    queues the rows again, so the newest expiry is the one written)."""
    out: list[LeaseUpdate] = []
    expiry: dict[int, dt.datetime] = {}  # by id(lease)
    for row_id, entry in pending.items():
        if not isinstance(entry, LeaseUpdate):
            lease, deliveries = entry
            expires = expiry.get(id(lease))
            if expires is None:
                expires = expiry[id(lease)] = dt.datetime.fromtimestamp(lease.expires_at,
                                                                        dt.timezone.utc)
            entry = LeaseUpdate(row_id, True, lease.claim_id, lease.owner, expires, deliveries,
                                False, False)
        out.append(entry)
    return out


def _remember(d: OrderedDict, key: str, value: Any, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)
