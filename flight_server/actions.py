"""The ``do_action`` verbs: a small table of name → (role, description, handler).

Bodies are JSON objects; each answer is one JSON result, except ``claim`` and ``claim_many``
which follow their JSON header with one Arrow IPC stream per claimed table (see
docs/protocol.md). Bodies and answers are decoded and encoded by :mod:`flight_server.wire`;
a handler gets a body whose fields were checked against ``wire.ACTION_FIELDS``.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from store.claims import Claim
from store.embedded import EmbeddedStore
from store.errors import InvalidArgument

from . import wire

Handler = Callable[[EmbeddedStore, dict[str, Any]], Any]


@dataclass(frozen=True)
class ActionSpec:
    name: str
    role: str
    description: str
    handler: Handler


def _create_table(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    name, columns = b.pop("name"), b.pop("columns")
    wire.flag(b, "if_not_exists", "create_table")
    return s.create_table(name, columns, **b)


def _drop_table(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return {"dropped": s.drop_table(b["name"],
                                    if_exists=wire.flag(b, "if_exists", "drop_table"))}


def _claim_one(s: EmbeddedStore, b: dict[str, Any]) -> Claim:
    claim, acked = claim_acking(s, b)
    if acked is not None:
        acked.result()                   # the claim is the client's once the ack is durable
    return claim


def claim_acking(s: EmbeddedStore, b: dict[str, Any]) -> tuple[Claim, Future | None]:
    """The claim action: the claim, and with ``ack`` (a claim id settled first, see
    :meth:`EmbeddedStore.ack_and_claim`) the Future of that ack, which the answer waits for."""
    body = wire.parse_claim_body(b)
    if body.ack is None:
        return s.claim_many(body.requests, consumer=body.consumer,
                            lease_seconds=body.lease_seconds), None
    return s.ack_and_claim(body.ack, body.requests, consumer=body.consumer,
                           lease_seconds=body.lease_seconds)


def _claim(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return wire.claim_results(_claim_one(s, b))


def claim_of_action(s: EmbeddedStore, name: str, b: dict[str, Any]) -> Claim:
    """The claim of a ``claim`` (without ``ack``) or ``claim_many`` action, its body checked,
    for a caller that encodes the answer itself (a session's, naming the schemas its client
    holds)."""
    b = wire.check_body(name, b)
    return _claim_one(s, b) if name == "claim" else _claims_of(s, b)


def claim_stream_table(s: EmbeddedStore, b: dict[str, Any]) -> pa.Table:
    """A claim asked for by a ``do_get`` ticket ``{"claim": {<claim body>}}``: the claimed rows
    in the table's claim schema, the claim's id, consumer and lease expiry in the schema's
    metadata (an empty claim: no rows, ``expstore.claim_id`` empty). Served as a record-batch
    stream, its buffers go to the client as they are: no IPC message built into a gRPC one."""
    return wire.claim_stream_table(_claim_one(s, b))


def _claims_of(s: EmbeddedStore, b: dict[str, Any]) -> Claim:
    body = wire.parse_claim_many_body(b)
    return s.claim_many(body.requests, consumer=body.consumer, lease_seconds=body.lease_seconds)


def _claim_many(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return wire.claim_results(_claims_of(s, b))


def _ack(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.ack(b["claim_id"])


def _nack(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.nack(b["claim_id"])


def _renew(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.renew(b["claim_id"], lease_seconds=b.get("lease_seconds"))


def _bump(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    version = s.bump_version(b["table"], expected=b.get("expected"),
                             weights_uri=b.get("weights_uri"))
    return {"table": b["table"], "version": version, "weights_uri": b.get("weights_uri")}


def _arrive(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    tables = b["tables"]
    if not isinstance(tables, list) or not tables or not all(isinstance(t, str) for t in tables):
        raise InvalidArgument(f"arrive 'tables' {tables!r} is not a list of table names")
    answer = s.arrive_poll(tables, expected=b["expected"], weights_uri=b.get("weights_uri"),
                           timeout=_wait_seconds(b, "arrive"))
    return {"tables": tables, **answer}


def _set_barrier_timeout(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return {"table": b["table"], "seconds": s.set_barrier_timeout(b["table"], b["seconds"])}


def _barrier(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.barrier(b["table"])


def _wait_seconds(b: dict[str, Any], action: str) -> float:
    timeout = b.get("timeout", 30.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or \
            not 0 <= timeout <= MAX_WAIT_SECONDS:
        raise InvalidArgument(f"{action} timeout {timeout!r} is invalid; expected seconds "
                              f"in [0, {MAX_WAIT_SECONDS}]")
    return float(timeout)


def _get_version(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return {"table": b["table"], "version": s.get_version(b["table"]),
            "weights_uri": s.weights_uri(b["table"])}


MAX_WAIT_SECONDS = 300.0


def _wait_version(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    timeout = _wait_seconds(b, "wait_version")
    min_version = b["min_version"]
    version = s.wait_version(b["table"], min_version, timeout)  # checks min_version
    return {"table": b["table"], "version": version, "reached": version >= min_version,
            "weights_uri": s.weights_uri(b["table"])}


def _stats(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.stats(b.get("table"))


def _leases(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.leases(b.get("table"))


def _describe(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.describe(b["table"])


def _list_tables(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return {"tables": s.list_tables()}


def _health(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.health()


def _gc(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.gc(drop_rows=b.get("drop_rows", ()), keep_versions=b.get("keep_versions", 0))


def _requeue(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    return s.requeue(b["table"], where=b.get("where"))


def _checkpoint(s: EmbeddedStore, b: dict[str, Any]) -> Any:
    s.checkpoint()
    return {"checkpoint": True}


ACTIONS: dict[str, ActionSpec] = {a.name: a for a in [
    ActionSpec("create_table", "admin", "Create an experience table. Body: {name, columns: "
               "{col: type}, if_not_exists?, max_staleness?, version_group?, max_deliveries?, "
               "lease_seconds?, storage?: {col: value|ref|auto}, required?: [col]}", _create_table),
    ActionSpec("drop_table", "admin", "Drop a table. Body: {name, if_exists?}", _drop_table),
    ActionSpec("claim", "writer", "Lease up to `limit` ready rows. Body: {table, limit, where?, "
               "group_by?, group_size?, consumer?, lease_seconds?, min_rows?}. Answer: a JSON "
               "header {claim_id, expires_at, tables}, then one Arrow IPC stream per table",
               _claim),
    ActionSpec("claim_many", "writer", "Lease rows from several tables atomically. Body: "
               "{requests: [claim bodies without consumer], consumer?, lease_seconds?}",
               _claim_many),
    ActionSpec("ack", "writer", "Mark a claim's rows consumed (idempotent). Body: {claim_id}",
               _ack),
    ActionSpec("nack", "writer", "Return a claim's rows to ready. Body: {claim_id}", _nack),
    ActionSpec("renew", "writer", "Extend an active claim's lease to lease_seconds from now "
               "(default: its tables' lease_seconds). Body: {claim_id, lease_seconds?}. Answer: "
               "{claim_id, expires_at}", _renew),
    ActionSpec("bump_version", "admin", "Bump a table's version group (compare-and-set). Body: "
               "{table, expected?, weights_uri?}", _bump),
    ActionSpec("arrive", "admin", "Arrive at the version group's barrier after a global batch "
               "at version `expected`; the group is bumped once every member table arrived. "
               "Long poll. Body: {tables: [table], expected, weights_uri?, timeout? (s, default "
               "30, max 300)}. Answer: {tables, version, complete, waiting_for}", _arrive),
    ActionSpec("set_barrier_timeout", "admin", "How long the table's version group's barrier "
               "waits for its last member. Body: {table, seconds}", _set_barrier_timeout),
    ActionSpec("barrier", "reader", "The state of the table's version group's barrier. Body: "
               "{table}", _barrier),
    ActionSpec("get_version", "reader", "Current version and weights. Body: {table}",
               _get_version),
    ActionSpec("wait_version", "reader", "Long-poll until version ≥ min_version. Body: {table, "
               "min_version, timeout? (s, default 30, max 300)}", _wait_version),
    ActionSpec("stats", "reader", "Rows by state per table. Body: {table?}", _stats),
    ActionSpec("leases", "reader", "Claims currently leased. Body: {table?}", _leases),
    ActionSpec("describe", "reader", "A table's definition and version. Body: {table}",
               _describe),
    ActionSpec("list_tables", "reader", "Names of the experience tables. Body: {}", _list_tables),
    ActionSpec("health", "reader", "Liveness and basic counters. Body: {}", _health),
    ActionSpec("gc", "admin", "Delete finished rows no write can reach (drop_rows: some of "
               "consumed, stale, dead; those of the newest keep_versions versions stay), then "
               "blob segments no row references. Body: {drop_rows?: [state], keep_versions?: "
               "int}", _gc),
    ActionSpec("requeue", "admin", "Bring a table's dead rows back (a redrive): ready again "
               "(pending where incomplete), delivery count 0; rows below the staleness bound, "
               "and a coordinator's rows whose values were lost, stay dead and are counted. "
               "Body: {table, where?: SQL predicate}. Answer: {table, requeued, skipped_stale, "
               "skipped_lost}", _requeue),
    ActionSpec("checkpoint", "admin", "Fold the WAL into the database file. Body: {}",
               _checkpoint),
]}


def run_action(spec: ActionSpec, store: EmbeddedStore, body: dict[str, Any]) -> list[bytes]:
    """Run an action on a decoded body: its fields checked, its answer encoded as results."""
    return wire.results_bytes(spec.handler(store, wire.check_body(spec.name, body)))
