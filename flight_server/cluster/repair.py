"""Restoring a second copy of the values a data node's loss left with one holder: the
coordinator's repair pass (:meth:`CoordinatorServer.restore_replicas
<flight_server.cluster.coordinator.CoordinatorServer.restore_replicas>`), column by column."""
from __future__ import annotations

import logging
from typing import Any, Callable

import pyarrow as pa

from store.embedded import EmbeddedStore
from store.errors import ExpstoreError

from .locations import Holder, chunk_location, degraded_predicate, parse_holder, parse_key

log = logging.getLogger(__name__)


def restore_column(store: EmbeddedStore, node_action: Callable[[str, str, dict[str, Any]], Any],
                   table: str, column: str, lost: list[str],
                   live: dict[str, str]) -> tuple[int, int]:
    """Give the values of ``table``.``column`` that the loss of the nodes ``lost`` left with
    one live holder a second copy (``live``: node id → location); how many chunks are still
    left with one, and how many were copied.

    Each such chunk is copied by its live holder to the next live node in ring order
    (``node_action(location, "copy_chunks", …)``), then the rows' keys are rewritten to name
    both holders: an upsert of the key column, its status, policy and finished versions kept as
    they were."""
    status = f"{column}_status"      # written back as it is: a streamed value stays open
    rows = store.query(
        f'SELECT sample_id, policy_version, finished_version, "{status}", "{column}" '
        f'FROM "{table}" WHERE NOT consumed AND NOT stale AND NOT dead AND '
        f"{degraded_predicate(column, lost)}")
    if rows.num_rows == 0:
        return 0, 0
    keys = rows.column(column).to_pylist()
    locations = sorted({k.rpartition("/")[0] for k in keys})
    plan: dict[tuple[str, str], list[tuple[str, Holder]]] = {}
    left = 0
    for location in locations:
        holders = parse_key(f"{location}/0")[0]
        source = next((h for h in holders if h.node in live), None)
        if source is None:           # the other holder is not registered (any more)
            left += 1
            continue
        named = {h.node for h in holders}
        target = next((n for n in _ring_after(source.node, sorted(live)) if n not in named),
                      None)
        if target is None:
            left += 1
            continue
        plan.setdefault((source.node, target), []).append((location, source))
    moved: dict[str, str] = {}
    for (source_node, target), items in plan.items():
        try:
            copies = node_action(live[source_node], "copy_chunks", {
                "chunks": [h.chunk for _, h in items], "to": live[target]})["copies"]
        except ExpstoreError as e:
            log.warning("copying %d chunk(s) from %s to %s failed: %s", len(items),
                        source_node, target, e)
            left += len(items)
            continue
        for location, holder in items:
            moved[location] = chunk_location([holder, parse_holder(copies[holder.chunk])])
    if not moved:
        return left, 0
    new_keys, keep = [], []
    for i, key in enumerate(keys):
        location, _, row = key.rpartition("/")
        if location in moved:
            new_keys.append(f"{moved[location]}/{row}")
            keep.append(i)
    kept = rows.take(keep)
    update = pa.table({"sample_id": kept.column("sample_id"),
                       "policy_version": kept.column("policy_version"),
                       "finished_version": kept.column("finished_version"),
                       status: kept.column(status),
                       column: pa.array(new_keys, pa.large_string())})
    try:
        store.put(table, update)
    except ExpstoreError as e:          # e.g. a bump staled some rows meanwhile
        log.warning("pointing %d row(s) of %s.%s at their new copies failed: %s",
                    update.num_rows, table, column, e)
        return left + len(moved), 0
    log.info("restored a second copy of %d chunk(s) of %s.%s", len(moved), table, column)
    return left, len(moved)


def _ring_after(node: str, nodes: list[str]) -> list[str]:
    """``nodes`` (sorted) in ring order starting after ``node``: copies spread over the nodes."""
    return [n for n in nodes if n > node] + [n for n in nodes if n <= node]
