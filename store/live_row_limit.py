"""The store's ``max_live_rows``: a put that would take a table past it is refused with
``TableFull`` on the caller's thread, before it is queued (store/embedded.py's ``put_async``)."""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from .errors import TableFull
from .live import LiveTable
from .prepare import put_versions


def small_put_keys(arrow: pa.Table, current_version: int) -> list[tuple[Any, Any]]:
    """A small put's (sample id, policy version) keys, before the writer prepares it."""
    versions = put_versions(arrow, current_version)
    return list(zip(arrow.column("sample_id").to_pylist(), versions.to_pylist()))


def check_room(live: LiveTable, keys: list[tuple[Any, Any]], limit: int) -> None:
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
