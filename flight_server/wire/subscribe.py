"""Micro-batch subscriptions on ``do_exchange`` (docs/protocol.md, "do_exchange: micro-batch
subscriptions").

The command is ``{"subscribe": {…}}`` (:class:`SubscribeOptions`). Then every message is
metadata: the server's hello, each micro-batch's metadata (:class:`MicroBatchMeta`), answers and
errors; the client's ``ack``, ``nack``, ``bump``, ``resume`` and ``close``. A subscription over
several tables sends each micro-batch as one record batch of :data:`MULTI_SCHEMA`.

>>> o = SubscribeOptions("solver", 16, 64, {"consumer": "t0"})
>>> o.encode()[:60]
b'{"subscribe": {"table": "solver", "micro_batch_size": 16, "g'
>>> parse_subscribe(o.encode()) == o
True
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pyarrow as pa

from store import errors as E
from store.errors import InvalidArgument
from store.ipc import ipc_stream

from .codec import JSON_ERRORS, answer_object, decode, encode
from .errors import error_doc, error_of_doc

SUBSCRIBE_FIELDS = {"table", "tables", "micro_batch_size", "global_batch_size", "where",
                    "group_by", "group_size", "consumer", "max_in_flight", "lease_seconds"}
#: The stream schema of a subscription over several tables: a row per table of a micro-batch.
MULTI_SCHEMA = pa.schema([pa.field("table", pa.string(), nullable=False),
                          pa.field("rows", pa.binary(), nullable=False)])
#: The types of message a client sends.
CLIENT_MESSAGES = ("ack", "nack", "bump", "resume", "close")


@dataclass(frozen=True)
class SubscribeOptions:
    """What a subscription asks for: ``table`` (one name, or a list for ``"tables"``), the
    batch sizes, and the other options as sent (``where``, ``group_by``, ``group_size``,
    ``consumer``, ``max_in_flight``, ``lease_seconds``; checked by the store's
    :class:`~store.subscription.Subscription`)."""

    table: Any
    micro_batch_size: Any
    global_batch_size: Any
    options: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        which: dict[str, Any] = {"table": self.table} if isinstance(self.table, str) \
            else {"tables": list(self.table)}
        return encode({"subscribe": {**which, "micro_batch_size": self.micro_batch_size,
                                     "global_batch_size": self.global_batch_size,
                                     **{k: v for k, v in self.options.items()
                                        if v is not None}}})

    @property
    def target(self) -> Any:
        """What the store's subscription is given: the table, or the tables when a list of
        several was sent (a list of one is its table)."""
        if isinstance(self.table, list) and len(self.table) == 1:
            return self.table[0]
        return self.table


def parse_subscribe(command: bytes) -> SubscribeOptions:
    """A subscribe command, checked: fields known, ``table`` or ``tables``, sizes present."""
    doc = decode(command, lambda e: f"do_exchange command is not valid JSON: {e}")
    sub = doc.get("subscribe") if isinstance(doc, dict) else None
    if not isinstance(sub, dict):
        raise InvalidArgument("do_exchange command must be {\"subscribe\": {table, "
                              "micro_batch_size, global_batch_size, …}}")
    extra = set(sub) - SUBSCRIBE_FIELDS
    if extra:
        raise InvalidArgument(f"subscribe has unknown fields {sorted(extra)}; expected "
                              f"{sorted(SUBSCRIBE_FIELDS)}")
    if ("table" in sub) == ("tables" in sub):
        raise InvalidArgument("subscribe needs 'table' (one table) or 'tables' (a list), not "
                              "both")
    if "tables" in sub:
        tables = sub.pop("tables")
        if not isinstance(tables, list) or not tables or \
                not all(isinstance(t, str) for t in tables):
            raise InvalidArgument(f"subscribe 'tables' {tables!r} is not a list of table names")
        table: Any = tables
    else:
        table = sub.pop("table")  # checked by the store, as a local subscription's
    for required in ("micro_batch_size", "global_batch_size"):
        if required not in sub:
            raise InvalidArgument(f"subscribe needs {required!r}")
    micro, total = sub.pop("micro_batch_size"), sub.pop("global_batch_size")
    return SubscribeOptions(table, micro, total, sub)


# -- the server's messages ---------------------------------------------------------------------

def message(doc: dict[str, Any]) -> pa.Buffer:
    """A subscription message as metadata."""
    return pa.py_buffer(encode(doc))


def hello(table: str, version: int, tables: list[str] | None = None) -> pa.Buffer:
    """The first message: subscribed at ``version`` (``tables``: several)."""
    doc: dict[str, Any] = {"type": "subscribed", "table": table, "version": version}
    if tables is not None:
        doc["tables"] = tables
    return message(doc)


@dataclass(frozen=True)
class MicroBatchMeta:
    """The metadata of a micro-batch: its claim, its place in the global batch (``index``,
    ``is_boundary`` on the last), the version, the global batch's number, its rows (and per
    table, for several tables)."""

    claim_id: str
    index: int
    is_boundary: bool
    version: int
    global_batch: int
    rows: int
    tables: dict[str, int] | None = None

    def encode(self) -> pa.Buffer:
        doc: dict[str, Any] = {"type": "micro_batch", "claim_id": self.claim_id,
                               "index": self.index, "is_boundary": self.is_boundary,
                               "version": self.version, "global_batch": self.global_batch,
                               "rows": self.rows}
        if self.tables is not None:
            doc["tables"] = self.tables
        return message(doc)

    @classmethod
    def of(cls, doc: dict[str, Any]) -> "MicroBatchMeta":
        """From a received message of type ``micro_batch``."""
        try:
            return cls(doc["claim_id"], doc["index"], doc["is_boundary"], doc["version"],
                       doc["global_batch"], doc["rows"], doc.get("tables"))
        except KeyError as e:
            raise E.ExpstoreError(f"malformed micro-batch from the server: it lacks {e}") \
                from None


def reply(kind: str, request: Any, **fields: Any) -> dict[str, Any]:
    """The answer to a client message, of type ``kind`` (acked, nacked, bumped, resumed)."""
    return {"type": kind, "request": request, **fields}


def error_reply(request: Any, error: E.ExpstoreError, fatal: bool = False) -> dict[str, Any]:
    """A message that failed (``fatal``: the subscription itself failed)."""
    doc = {"type": "error", "request": request, **error_doc(error)}
    if fatal:
        doc["fatal"] = True
    return doc


#: Sent when the server shuts down: the client ends its side of the stream.
CLOSING = {"type": "closing", "request": None}


def server_message(raw: bytes | None) -> dict[str, Any]:
    """A message the client received (no metadata: ``{}``)."""
    return answer_object(raw, "subscription message") if raw else {}


def reply_error(doc: dict[str, Any]) -> E.ExpstoreError | None:
    """The store error of an ``error`` message (None for any other)."""
    return error_of_doc(doc) if doc.get("type") == "error" else None


# -- the client's messages ---------------------------------------------------------------------

class ClientMessage(NamedTuple):
    """A message from the client: ``type`` is one of :data:`CLIENT_MESSAGES` (anything else
    is answered with an error), ``request`` the id its answer repeats."""

    type: Any
    request: Any = None
    claim_id: Any = None
    weights_uri: Any = None
    #: what was received instead of a JSON object (its first bytes), else None
    unreadable: str | None = None

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"type": self.type}
        if self.type in ("ack", "nack"):
            doc["claim_id"] = self.claim_id
        elif self.type == "bump":
            doc["weights_uri"] = self.weights_uri
        if self.type != "close":
            doc["request"] = self.request
        return encode(doc)

    @classmethod
    def decode(cls, raw: bytes) -> "ClientMessage":
        """Never fails: what is not a JSON object is a message of type ``"invalid"`` whose
        ``unreadable`` holds the start of what came, answered with an error naming it."""
        try:
            doc = json.loads(raw)
        except JSON_ERRORS:
            doc = None
        if not isinstance(doc, dict):
            return cls("invalid", unreadable=repr(bytes(raw[:100])))
        return cls(doc.get("type"), doc.get("request"), doc.get("claim_id"),
                   doc.get("weights_uri"))


# -- several tables in one micro-batch ---------------------------------------------------------

def multi_batch(tables: dict[str, pa.Table]) -> pa.RecordBatch:
    """A micro-batch over several tables: a row per table, its rows as an Arrow IPC stream."""
    return pa.record_batch([pa.array(list(tables), pa.string()),
                            pa.array([ipc_stream(t) for t in tables.values()], pa.binary())],
                           schema=MULTI_SCHEMA)


def tables_of_multi_batch(batch: pa.RecordBatch) -> dict[str, pa.Table]:
    """The tables of a :func:`multi_batch`."""
    return {name: pa.ipc.open_stream(rows).read_all() for name, rows in zip(
        batch.column(0).to_pylist(), batch.column(1).to_pylist())}
