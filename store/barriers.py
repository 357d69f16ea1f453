"""The barrier rounds of a store's version groups (unified weight updating).

One round (store/barrier.py) collects the arrivals of a group's member tables at version
``expected``; the last arrival bumps the group's version once, for all of them, through the
writer. Waiters wait on the index's condition (``StoreIndex.changed``), which every commit
notifies.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .barrier import DEFAULT_BARRIER_TIMEOUT, Barrier, encode_weights
from .errors import ExpstoreError, NotFound, StoreClosed, Unavailable, VersionConflict
from .index import StoreIndex


class Barriers:
    """The barriers of one store.

    Args:
        index: the in-memory index (versions, members, the barriers' state, the condition).
        bump: bumps a group's version through the writer (compare-and-set on ``expected``, with
            the encoded weights URIs); the new version.
        closed: whether the store is closed (waiters give up then).
    """

    def __init__(self, index: StoreIndex, bump: Callable[[str, int, str | None], int],
                 closed: Callable[[], bool]) -> None:
        self._index = index
        self._bump = bump
        self._closed = closed

    def arrive_poll(self, group: str, names: list[str], expected: int,
                    weights_uri: str | None, timeout: float | None) -> dict[str, Any]:
        """Tables ``names`` of ``group`` arrive at version ``expected``; wait at most
        ``timeout`` seconds (None: until the round ends) for the round to end (see
        ``EmbeddedStore.arrive_poll``)."""
        index = self._index
        caller_deadline = None if timeout is None else time.monotonic() + timeout
        with index.changed:
            while True:
                if self._closed():
                    raise StoreClosed("the store is closed")
                if index.waits_ended is not None:  # the arrival stays, as soft state does
                    raise Unavailable(index.waits_ended)
                now = time.monotonic()
                current = index.versions.get(group)
                if current is None:
                    raise NotFound(f"version group {group!r} does not exist")
                barrier = index.barriers.get(group)
                if barrier is not None and (barrier.expected < current
                                            or barrier.forgotten(now)):
                    del index.barriers[group]
                    barrier = None
                if current == expected + 1:
                    return {"version": current, "complete": True, "waiting_for": []}
                if current != expected:
                    raise VersionConflict(
                        f"version of {group!r} is {current}, not the expected {expected}: "
                        f"table(s) {names} cannot arrive at version {expected}")
                if barrier is None:
                    barrier = Barrier(group, expected, index.barrier_timeouts.get(
                        group, DEFAULT_BARRIER_TIMEOUT))
                    index.barriers[group] = barrier
                if barrier.failed is not None:
                    barrier.told.update(names)
                    raise _fresh(barrier.failed)
                for name in names:
                    barrier.arrived.setdefault(name, weights_uri)
                members = index.members(group)
                missing = barrier.missing(members)
                if not missing and not barrier.bumping:
                    barrier.bumping = True
                    break
                if missing and now >= barrier.deadline:
                    error = barrier.fail(members, now)
                    barrier.told.update(names)
                    index.notify()
                    raise _fresh(error)
                if caller_deadline is not None and now >= caller_deadline:
                    return {"version": current, "complete": False, "waiting_for": missing}
                # While the last arrival's bump commits, wait for it, not for the deadline.
                wait = barrier.deadline - now if missing else 1.0
                if caller_deadline is not None:
                    wait = min(wait, caller_deadline - now)
                index.changed.wait(max(wait, 0.0))
        # The last member arrived: bump once, for the whole group, outside the lock.
        try:
            new = self._bump(group, expected, encode_weights(barrier.arrived))
        except ExpstoreError as e:
            with index.changed:
                if index.versions.get(group, -1) > expected:  # bumped meanwhile
                    return {"version": index.versions[group], "complete": True,
                            "waiting_for": []}
                barrier.failed, barrier.failed_at = e, time.monotonic()
                barrier.told.update(names)
                index.notify()
            raise
        return {"version": new, "complete": True, "waiting_for": []}

    def state(self, group: str) -> dict[str, Any]:
        """The state of ``group``'s barrier (see ``EmbeddedStore.barrier``)."""
        index = self._index
        with index.lock:
            members = index.members(group)
            barrier = index.barriers.get(group)
            timeout = index.barrier_timeouts.get(group, DEFAULT_BARRIER_TIMEOUT)
            out: dict[str, Any] = {"version_group": group, "version": index.versions[group],
                                   "members": members, "arrived": [], "waiting_for": [],
                                   "timeout": timeout, "seconds_left": None, "failed": None}
            if barrier is not None and barrier.expected == index.versions[group]:
                out.update(arrived=sorted(barrier.arrived),
                           waiting_for=barrier.missing(members),
                           seconds_left=max(0.0, barrier.deadline - time.monotonic()),
                           failed=None if barrier.failed is None else str(barrier.failed))
            return out


def _fresh(error: Exception) -> Exception:
    """A new exception like ``error``: one raised in several threads would gather all of their
    tracebacks."""
    return type(error)(str(error))
