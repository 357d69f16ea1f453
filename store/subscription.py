"""Micro-batch subscriptions: the trainer's side of FlexMARL's fine-grained pipeline.

A subscription hands out micro-batches as soon as enough rows are ready, counts them into global
batches, and marks the last micro-batch of each global batch (``is_boundary``): the gradient
accumulation boundary. It then delivers nothing more until the trainer bumps the version
(:meth:`Subscription.bump_version`) or calls :meth:`Subscription.resume`, so that no sample of the
next global batch is claimed under the old weights.

``bump_version`` *arrives* at the version group's barrier (store/barrier.py): in a group of one
table that is the bump; in a group of several agents' tables it returns once every member's
trainer has arrived and the group's version advanced once. Given a ``stop`` event, it stops
waiting soon after the event is set and raises :class:`BumpStopped`; its arrival stays at the
barrier (see :meth:`Subscription.bump_version`).

A subscription over several tables (a shared model, or a centralised critic trained on every
agent's samples) draws each micro-batch from all of them in one atomic claim: ``micro_batch_size``
rows of each table, or nothing. Its tables share one version group; at its boundary it arrives
for all of them at once.

>>> import store, tempfile, os
>>> s = store.connect(os.path.join(tempfile.mkdtemp(), "x.duckdb"))
>>> _ = s.create_table("agent", {"reward": "float64"})
>>> _ = s.put("agent", {"sample_id": [f"q{i}_0_0" for i in range(4)], "reward": [1.0] * 4})
>>> sub = s.subscribe("agent", micro_batch_size=2, global_batch_size=4, idle_timeout=1)
>>> for mb in sub:
...     _ = mb.ack()
...     if mb.is_boundary:
...         version = sub.bump_version()
...         break
>>> version
1
>>> s.close()
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, Protocol

import pyarrow as pa

from .claims import Claim, ClaimRequest, check_consumer, check_lease_seconds
from .errors import InvalidArgument, QueryBusy
from .waits import check_wait

log = logging.getLogger("expstore.subscription")

#: Seconds between two looks at a ``bump_version`` caller's stop event while it waits at the
#: barrier.
STOP_POLL_SECONDS = 0.25


class BumpStopped(Exception):
    """``bump_version``'s wait at the barrier was ended by its caller's ``stop`` event before the
    group's version advanced. Not a store error (the store never raises it): the arrival was
    made and stays, so the round completes, or times out, as if the trainer had died there."""


class _Store(Protocol):
    def claim_many(self, requests: list[ClaimRequest], *, consumer: str | None = None,
                   lease_seconds: float | None = None) -> Claim: ...
    def ack(self, claim_id: str) -> dict[str, Any]: ...
    def ack_async(self, claim_id: str) -> Future: ...
    def nack(self, claim_id: str) -> dict[str, Any]: ...
    def renew(self, claim_id: str, *, lease_seconds: float | None = None) -> dict[str, Any]: ...
    def get_version(self, table: str) -> int: ...
    def arrive(self, tables: str | list[str], *, expected: int,
               weights_uri: str | None = None) -> int: ...
    def arrive_poll(self, tables: str | list[str], *, expected: int,
                    weights_uri: str | None = None,
                    timeout: float | None = None) -> dict[str, Any]: ...
    def wait_changed(self, since: int, timeout: float) -> int: ...
    @property
    def change_seq(self) -> int: ...


@dataclass
class MicroBatch:
    """One micro-batch: feed it to one gradient-accumulation step, then :meth:`ack` it.

    ``tables`` maps each table to its rows; ``data`` is the rows of all of them (one table's
    rows for a one-table subscription; for several, their rows in the subscription's table
    order, columns unified by name, absent ones null). ``table`` is the first table.
    """

    data: pa.Table
    table: str
    claim_id: str
    index: int
    is_boundary: bool
    version: int
    global_batch: int
    _sub: "Subscription"
    tables: dict[str, pa.Table] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tables:
            self.tables = {self.table: self.data}

    @property
    def num_rows(self) -> int:
        return self.data.num_rows

    def ack(self, wait: bool = True) -> Any:
        """Ack (durable on return); with ``wait=False`` return at once with a Future of the
        answer. Changes are made in order, so a later ``bump_version`` still follows this ack."""
        return self._sub._settle(self, ack=True) if wait else self._sub.ack_async(self)

    def nack(self, wait: bool = True) -> Any:
        result = self._sub._settle(self, ack=False)
        return result if wait else _done(result)

    def renew(self, lease_seconds: float | None = None) -> dict[str, Any]:
        """Extend this micro-batch's lease to ``lease_seconds`` from now (None: the
        subscription's ``lease_seconds``, else its tables'), for a step that outlasts the lease;
        answers ``{"claim_id", "expires_at"}``. Raises ``LeaseExpired`` once it was acked,
        nacked or expired (see :meth:`store.embedded.EmbeddedStore.renew`)."""
        return self._sub.renew(self, lease_seconds)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def check_can_bump(tables: list[str], global_batch: int, delivered: int, per_global: int,
                   at_boundary: bool, unsettled: Collection[str]) -> None:
    """Raise InvalidArgument unless a subscription's bump may end its global batch now: at its
    boundary (its last micro-batch delivered to the trainer), with every micro-batch acked or
    nacked (an ack sent without waiting counts: the bump follows it).

    Why refuse: a bump in the middle of a global batch would make the accumulated gradient
    that of part of a batch, and one with a micro-batch not yet settled would let the next
    version start while rows of this one may still come back (a nack, a lease that ends) and
    be trained on again. A trainer that wants to stop early nacks what it holds."""
    names = repr(tables[0]) if len(tables) == 1 else repr(tables)
    if not at_boundary:
        raise InvalidArgument(
            f"bump_version() ends a global batch, and global batch {global_batch} of {names} "
            f"is not complete: {delivered} of its {per_global} micro-batches delivered; bump "
            "after the micro-batch with is_boundary (at_boundary is then true)")
    if unsettled:
        held = sorted(unsettled)
        raise InvalidArgument(
            f"bump_version() ends a global batch, and {len(held)} of its micro-batches are "
            f"neither acked nor nacked (claim ids {', '.join(held[:4])}"
            f"{', …' if len(held) > 4 else ''}): ack them (ack(wait=False) is enough: the bump "
            "follows it) before bumping")


class Subscription:
    """Iterator of :class:`MicroBatch` over one table or several (see the module docstring).

    Args:
        table: a table, or a list of tables of one version group.
        micro_batch_size: rows per micro-batch (a multiple of ``group_size`` for group claims);
            with several tables, rows of each table.
        global_batch_size: rows per global batch (a multiple of ``micro_batch_size``); with
            several tables, rows of each table.
        where, group_by, group_size: as for :meth:`store.embedded.EmbeddedStore.claim` (with
            several tables, applied to each).
        max_in_flight: micro-batches handed out and not yet acked or nacked.
        idle_timeout: stop iterating after this many seconds without a micro-batch (None: never;
            0: once no micro-batch is ready; see store/waits.py).
    """

    def __init__(self, store: Any, table: str | list[str], micro_batch_size: int,
                 global_batch_size: int,
                 *, where: str | None = None, group_by: str | None = None,
                 group_size: int | None = None, consumer: str | None = None,
                 max_in_flight: int = 2, lease_seconds: float | None = None,
                 idle_timeout: float | None = None) -> None:
        for label, value in (("micro_batch_size", micro_batch_size),
                             ("global_batch_size", global_batch_size),
                             ("max_in_flight", max_in_flight)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{label} {value!r} is invalid; expected an integer ≥ 1")
        if global_batch_size % micro_batch_size:
            raise InvalidArgument(f"global_batch_size {global_batch_size} is not a multiple of "
                                  f"micro_batch_size {micro_batch_size}")
        if group_size and micro_batch_size % group_size:
            raise InvalidArgument(f"micro_batch_size {micro_batch_size} is not a multiple of "
                                  f"group_size {group_size}: groups are never split")
        tables = [table] if isinstance(table, str) else list(table)
        if not tables or len(set(tables)) != len(tables):
            raise InvalidArgument(f"a subscription needs one table or a list of distinct "
                                  f"tables, got {table!r}")
        # Check the claim arguments now, so that a bad subscription fails when it is made, not
        # at its first claim.
        self._requests = [ClaimRequest(t, micro_batch_size, where, group_by, group_size,
                                       micro_batch_size).validated() for t in tables]
        if where is not None:
            for t in tables:
                try:
                    store.check_predicate(t, where)
                except QueryBusy:
                    # Every query slot is taken: the subscription waits for one as for rows,
                    # and its first claim binds the predicate (ClaimEngine._matching).
                    pass
        if len(tables) > 1:
            groups = {t: store.describe(t)["version_group"] for t in tables}
            if len(set(groups.values())) != 1:
                raise InvalidArgument(f"the tables of one subscription must share a version "
                                      f"group (its boundary bumps them together); got {groups}")
        check_lease_seconds(lease_seconds)
        check_consumer(consumer)
        self._store = store
        self.tables = tables
        self.table = tables[0]
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.micro_batches_per_global = global_batch_size // micro_batch_size
        self._claim_args = {"consumer": consumer or "subscription",
                            "lease_seconds": lease_seconds}
        self._lease_seconds = lease_seconds
        self.max_in_flight = max_in_flight
        self.idle_timeout = check_wait(idle_timeout, "idle_timeout")
        self.version = store.get_version(self.table)
        self.global_batch = 0
        self._index = 0
        self._paused = False
        self._in_flight: dict[str, MicroBatch] = {}
        self._closed = False

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[MicroBatch]:
        return self

    def __next__(self) -> MicroBatch:
        batch = self.next(timeout=self.idle_timeout)
        if batch is None:
            raise StopIteration
        return batch

    def next(self, timeout: float | None = None) -> MicroBatch | None:
        """The next micro-batch, waiting up to ``timeout`` seconds (None: forever; 0: only one
        ready now); None when none came."""
        timeout = check_wait(timeout, "next")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._closed:
            if self._paused:
                raise InvalidArgument(
                    "the global batch is complete: call bump_version() (or resume()) before "
                    "asking for the next micro-batch")
            if len(self._in_flight) >= self.max_in_flight:
                raise InvalidArgument(f"{len(self._in_flight)} micro-batches are in flight "
                                      f"(max_in_flight={self.max_in_flight}); ack or nack one "
                                      "first")
            seen = self._store.change_seq
            try:
                claim = self._store.claim_many(self._requests, **self._claim_args)
            except QueryBusy as e:
                # A predicate waits for a query slot like any query; people's SQL holding every
                # slot must not end a trainer's subscription: it tries again, as after an empty
                # claim. (A predicate that itself runs past the time limit still ends it.)
                log.warning("subscription to %r: %s; trying again", self.table, e)
                claim = None
            if claim:
                return self._deliver(claim)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            # No polling loop: sleep until the store commits something (a put, nack, expiry).
            self._store.wait_changed(seen, 1.0 if remaining is None else min(remaining, 1.0))
        return None

    def _deliver(self, claim: Claim) -> MicroBatch:
        boundary = self._index == self.micro_batches_per_global - 1
        batch = MicroBatch(rows_of_all(claim.tables) if len(self.tables) > 1 else claim.data,
                           self.table, claim.claim_id, self._index, boundary, self.version,
                           self.global_batch, self, dict(claim.tables))
        self._in_flight[claim.claim_id] = batch
        self._index += 1
        if boundary:
            self._paused = True
        return batch

    def _settle(self, batch: MicroBatch, ack: bool) -> dict[str, Any]:
        result = (self._store.ack if ack else self._store.nack)(batch.claim_id)
        self._in_flight.pop(batch.claim_id, None)
        if not ack:
            # The rows come back; this micro-batch's slot in the global batch is free again.
            self._index -= 1
            self._paused = False
        return result

    def renew(self, batch: MicroBatch, lease_seconds: float | None = None) -> dict[str, Any]:
        """Renew a micro-batch's lease (see :meth:`MicroBatch.renew`)."""
        if lease_seconds is None:
            lease_seconds = self._lease_seconds
        return self._store.renew(batch.claim_id, lease_seconds=lease_seconds)

    def ack_async(self, batch: MicroBatch) -> Future:
        """Ack without waiting: the Future resolves to ack's answer once it is durable. The
        micro-batch's slot is free at once; a bump sent after this follows it (the store's
        writer takes changes in order)."""
        future = self._store.ack_async(batch.claim_id)
        self._in_flight.pop(batch.claim_id, None)
        return future

    # -- the accumulation boundary -------------------------------------------------------------
    def bump_version(self, weights_uri: str | None = None, *,
                     stop: threading.Event | None = None) -> int:
        """After the optimizer step at a boundary: arrive at the version group's barrier for
        this subscription's tables (in a group of one table, the bump itself), wait until the
        group's version advanced, and start the next global batch at it.

        ``stop`` (a trainer's stop event) ends the wait within :data:`STOP_POLL_SECONDS` of
        being set: :class:`BumpStopped` is raised, the subscription stays at its boundary and
        version, and the arrival stays at the barrier. That is safe for the other members: the
        group still advances only once every member arrived, and this one did finish its
        global batch (its step was taken, its acks are durable). A trainer started again
        arrives again at the same version: it waits on the same round, or is answered the new
        version at once if the round completed meanwhile.

        Raises:
            BarrierTimeout: another member of the group never arrived (see store/barrier.py).
            VersionConflict: the group's version moved past this subscription's.
            BumpStopped: ``stop`` was set before the group's version advanced.
        """
        self.check_can_bump()
        tables = self.tables if len(self.tables) > 1 else self.table
        if stop is None:
            new = self._store.arrive(tables, expected=self.version, weights_uri=weights_uri)
        else:
            while True:
                answer = self._store.arrive_poll(tables, expected=self.version,
                                                 weights_uri=weights_uri,
                                                 timeout=STOP_POLL_SECONDS)
                if answer["complete"]:
                    new = int(answer["version"])
                    break
                if stop.is_set():
                    raise BumpStopped(f"stopped while waiting at the barrier for "
                                      f"{answer['waiting_for']}; the arrival of {tables!r} at "
                                      f"version {self.version} stays")
        self.advance(new)
        return new

    def check_can_bump(self) -> None:
        """Raise InvalidArgument unless a bump may end the global batch now (see
        :func:`check_can_bump`)."""
        check_can_bump(self.tables, self.global_batch, self._index,
                       self.micro_batches_per_global, self._paused, self._in_flight)

    def advance(self, version: int) -> None:
        """Start the next global batch at ``version`` (what :meth:`bump_version` does once its
        arrival completed; the Flight server calls it after arriving on its own)."""
        self.version = version
        self.resume()

    def resume(self) -> None:
        """Start the next global batch without bumping (off-policy trainers)."""
        self.global_batch += 1
        self._index = 0
        self._paused = False

    @property
    def at_boundary(self) -> bool:
        return self._paused

    def close(self) -> None:
        """Nack what is still in flight and stop iterating."""
        self._closed = True
        for claim_id in list(self._in_flight):
            try:
                self._store.nack(claim_id)
            except Exception:  # noqa: BLE001 - a lease that already ended needs nothing
                pass
            self._in_flight.pop(claim_id, None)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rows_of_all(tables: dict[str, pa.Table]) -> pa.Table:
    """The rows of several tables as one table: columns unified by name (absent ones null)."""
    return pa.concat_tables([t.replace_schema_metadata(None) for t in tables.values()],
                            promote_options="default")
