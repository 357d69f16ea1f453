"""Version groups as the store's facade serves them: checking a bump's arguments, waiting for a
version, the one group that several tables share, and the barrier timeout the writer stores.

A barrier round itself is store/barrier.py, the rounds of a store store/barriers.py; the bump
the writer commits is in store/settle.py. The facade (store/embedded.py) gives these functions
the index they read.
"""
from __future__ import annotations

import time
from typing import Callable

import duckdb

from .barrier import SETTING_PREFIX
from .errors import InvalidArgument, Unavailable
from .index import StoreIndex
from .ops import CallOp


def check_bump(expected: object, weights_uri: object) -> None:
    """Check ``bump_version``'s ``expected`` (an integer or None) and ``weights_uri``.

    Raises:
        InvalidArgument: naming the bad value.
    """
    if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool)):
        raise InvalidArgument(f"expected version {expected!r} is not an integer")
    check_weights_uri(weights_uri)


def check_weights_uri(weights_uri: object) -> None:
    """Raise InvalidArgument unless ``weights_uri`` is a string or None."""
    if weights_uri is not None and not isinstance(weights_uri, str):
        raise InvalidArgument(f"weights_uri {weights_uri!r} is not a string")


def wait_version(index: StoreIndex, table: str, min_version: int, timeout: float | None,
                 closed: Callable[[], bool]) -> int:
    """Block until the version of ``table``'s group is at least ``min_version``, ``timeout``
    passes or the store closes; the group's version then.

    Raises:
        InvalidArgument: ``min_version`` is not an integer.
        NotFound: ``table`` is unknown.
        Unavailable: the store's waits were ended (a server stopping; see ``end_waits``).
    """
    if not isinstance(min_version, int) or isinstance(min_version, bool):
        raise InvalidArgument(f"min_version {min_version!r} is not an integer")
    group = index.live_table(table).tdef.version_group
    deadline = None if timeout is None else time.monotonic() + timeout
    with index.changed:
        while index.versions.get(group, -1) < min_version and not closed():
            if index.waits_ended is not None:
                raise Unavailable(index.waits_ended)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            index.changed.wait(remaining if remaining is not None else 1.0)
        return index.versions.get(group, -1)


def group_of(index: StoreIndex, tables: list[str]) -> str:
    """The version group of ``tables``, which must all be in one.

    Raises:
        NotFound: a table is unknown.
        InvalidArgument: the tables are in different groups.
    """
    groups = {name: index.live_table(name).tdef.version_group for name in tables}
    if len(set(groups.values())) != 1:
        raise InvalidArgument(f"tables {groups} are in different version groups; one "
                              "arrival (or subscription) covers tables of one group")
    return next(iter(groups.values()))


def barrier_timeout_op(index: StoreIndex, group: str, seconds: float) -> CallOp:
    """The writer's op that sets how long ``group``'s barrier waits (checked seconds): stored
    in the catalog's settings, then in the index once that commits."""
    def run(con: duckdb.DuckDBPyConnection) -> None:
        con.execute("INSERT OR REPLACE INTO _expstore_settings (key, value) VALUES (?, ?)",
                    [SETTING_PREFIX + group, repr(seconds)])

    def apply(_: None) -> None:
        index.barrier_timeouts[group] = seconds

    return CallOp(run, apply)
