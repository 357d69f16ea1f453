"""Unified weight updating: the barrier that advances a version group once.

FlexMARL's agents each accumulate gradients over their global batch, then "aggregate the cached
gradients to perform unified weight updating (policy version+1)". In expstore the agents' tables
share a version group, and each agent's trainer *arrives* at the group's barrier when its global
batch is done (:meth:`store.embedded.EmbeddedStore.arrive`). An arrival changes no version and
stales no row; the group's version is bumped once, when every member table has arrived, and every
waiting trainer then gets the new version.

A member that never arrives (its trainer died) holds the barrier only until the group's barrier
timeout, counted from the round's first arrival: then the round fails, and every arrival at that
version gets :class:`BarrierTimeout` naming the tables that did not arrive. The failed round answers
so until each table that had arrived has been told, or for one more timeout; after that a new
arrival starts a new round (the trainers arrive again once the missing one is back).

Arrivals are soft state, like leases: a restart forgets them, and a trainer whose call failed
arrives again with the same ``expected`` version. An arrival at version ``v`` when the group is
already at ``v + 1`` answers ``v + 1`` at once: the barrier it arrived at is complete.

This module holds the barrier's state and decisions; the store runs them under its lock.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from .errors import BarrierTimeout, InvalidArgument

#: Seconds a round waits for its last member, from its first arrival (per group, settable with
#: ``set_barrier_timeout``).
DEFAULT_BARRIER_TIMEOUT = 600.0
MAX_BARRIER_TIMEOUT = 86400.0
#: ``_expstore_settings`` key of a group's barrier timeout.
SETTING_PREFIX = "barrier_timeout/"


@dataclass
class Barrier:
    """One round of a version group's barrier: the arrivals at version ``expected``."""

    group: str
    expected: int
    timeout: float
    started: float = field(default_factory=time.monotonic)
    #: Member table → the weights URI its trainer published (None: none given).
    arrived: dict[str, str | None] = field(default_factory=dict)
    bumping: bool = False
    failed: Exception | None = None
    failed_at: float = 0.0
    #: Tables that arrived and have been answered the round's failure.
    told: set[str] = field(default_factory=set)

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def missing(self, members: list[str]) -> list[str]:
        return sorted(set(members) - set(self.arrived))

    def fail(self, members: list[str], now: float) -> BarrierTimeout:
        """End the round as timed out; returns its error."""
        missing = self.missing(members)
        self.failed = error = BarrierTimeout(
            f"the barrier of version group {self.group!r} at version {self.expected} timed out "
            f"after {self.timeout:g} s: table(s) {missing} did not arrive (arrived: "
            f"{sorted(self.arrived)}); nothing was bumped. Arrive again once their trainers "
            "are back, or raise the group's barrier timeout")
        self.failed_at = now
        return error

    def forgotten(self, now: float) -> bool:
        """A failed round stops answering its failure once every table that had arrived was
        told, or one more timeout after it failed."""
        return self.failed is not None and (set(self.arrived) <= self.told
                                            or now >= self.failed_at + self.timeout)


def check_expected(expected: object) -> int:
    if not isinstance(expected, int) or isinstance(expected, bool):
        raise InvalidArgument(f"expected version {expected!r} is invalid; an arrival needs the "
                              "integer version its trainer trained on")
    return expected


def check_timeout(seconds: object) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not 0 < seconds <= MAX_BARRIER_TIMEOUT:
        raise InvalidArgument(f"barrier timeout {seconds!r} is invalid; expected seconds in "
                              f"(0, {MAX_BARRIER_TIMEOUT:g}]")
    return float(seconds)


def encode_weights(arrived: dict[str, str | None]) -> str | None:
    """The weights URI a barrier bump records for its group: one URI when every member gave the
    same (a group of one table, a shared model), else the members' URIs as one JSON object
    (``{"solver": "s3://…", "verifier": "s3://…"}``); None when no trainer gave one."""
    given = {table: uri for table, uri in sorted(arrived.items()) if uri is not None}
    if len(set(arrived.values())) == 1:
        return next(iter(arrived.values()))
    return json.dumps(given, sort_keys=True) if given else None


def weights_of(recorded: str | None, table: str) -> str | None:
    """A table's published weights from what its group recorded: a barrier bump's per-member
    object, or one URI for the whole group (``bump_version``)."""
    if recorded is None or not recorded.startswith("{"):
        return recorded
    try:
        members = json.loads(recorded)
    except ValueError:
        return recorded
    return members.get(table) if isinstance(members, dict) else recorded
