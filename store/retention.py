"""Retention: which finished rows ``gc`` may delete, and the statement that deletes them.

A row is deleted only when nothing can bring it back into play: it is finished (consumed,
stale or dead, as ``stats`` counts them) and its ``policy_version`` lies below the table's
staleness window (``version - max_staleness``), so a write of the same sample, re-sent by an
at-least-once producer, is refused as stale instead of making the sample ready a second time.
A leased row is never finished, so a claim in progress keeps its rows. The table's newest row
(by ``row_id``) stays, so that row ids keep growing after a reopen, which takes the next one
from the largest left. ``keep_versions`` widens the window for people's SQL: the finished
rows of the newest versions stay.
"""
from __future__ import annotations

from typing import Any

import duckdb

from .errors import InvalidArgument
from .naming import quote

# Each state as stats() counts it (a row in one state only).
DROPPABLE: dict[str, str] = {
    "consumed": "consumed",
    "stale": "(stale AND NOT consumed)",
    "dead": "(dead AND NOT consumed AND NOT stale)",
}


def check_drop_rows(drop_rows: Any) -> tuple[str, ...]:
    """The states named by ``gc(drop_rows=...)``: a list of names out of :data:`DROPPABLE`."""
    choices = ", ".join(DROPPABLE)
    if not isinstance(drop_rows, (list, tuple)):
        raise InvalidArgument(f"drop_rows {drop_rows!r} is not a list of row states; expected "
                              f"a list of: {choices}")
    for state in drop_rows:
        if not isinstance(state, str) or state not in DROPPABLE:
            raise InvalidArgument(f"drop_rows names {state!r}, which is not a state gc may "
                                  f"drop; expected some of: {choices}")
    return tuple(dict.fromkeys(drop_rows))


def check_keep_versions(keep_versions: Any) -> int:
    """``gc(keep_versions=...)``: how many of the newest versions keep their finished rows."""
    if not isinstance(keep_versions, int) or isinstance(keep_versions, bool) \
            or keep_versions < 0:
        raise InvalidArgument(f"keep_versions {keep_versions!r} is not a number of versions; "
                              "expected an integer ≥ 0")
    return keep_versions


def drop_finished_rows(con: duckdb.DuckDBPyConnection, table: str, states: tuple[str, ...],
                       below_version: int) -> int:
    """Delete ``table``'s rows in ``states`` whose version is below ``below_version`` (but the
    newest row); how many went."""
    if not states or below_version <= 0:
        return 0
    which = " OR ".join(DROPPABLE[s] for s in states)
    name = quote(table)
    row = con.execute(
        f"DELETE FROM {name} WHERE ({which}) AND policy_version < ? "
        f"AND row_id < (SELECT max(row_id) FROM {name})", [below_version]).fetchone()
    return int(row[0]) if row else 0
