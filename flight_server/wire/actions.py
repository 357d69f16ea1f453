"""``do_action`` bodies and answers (docs/protocol.md, "do_action").

A body is a JSON object (empty bytes mean ``{}``) whose fields each action lists in
:data:`ACTION_FIELDS`; an answer is one JSON document, except a claim's: a JSON header
(:class:`ClaimHeader`) then one Arrow IPC stream per claimed table. A claim asked for as a
``do_get`` stream carries the header's fields in the stream schema's metadata instead
(:func:`claim_stream_metadata`).

>>> body = parse_body(b'{"claim_id": "c1"}', "ack")
>>> body, encode_body(body)
({'claim_id': 'c1'}, b'{"claim_id": "c1"}')
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple, Sequence

import pyarrow as pa
import pyarrow.flight as flight
import xxhash

from store.claims import Claim, ClaimRequest
from store.errors import ExpstoreError, InvalidArgument
from store.ipc import ipc_stream
from store.schema import ColumnDef, TableDef

from .codec import answer_object, decode, decode_answer, encode, encode_answer

#: Each action's body fields: (required, optional). Actions of the coordinator included.
ACTION_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "create_table": (("name", "columns"), ("if_not_exists", "max_staleness", "version_group",
                                           "max_deliveries", "lease_seconds", "storage",
                                           "required")),
    "drop_table": (("name",), ("if_exists",)),
    "describe": (("table",), ()),
    "list_tables": ((), ()),
    "claim": (("table", "limit"), ("where", "group_by", "group_size", "consumer",
                                   "lease_seconds", "min_rows", "ack")),
    "claim_many": (("requests",), ("consumer", "lease_seconds")),
    "ack": (("claim_id",), ()),
    "nack": (("claim_id",), ()),
    "renew": (("claim_id",), ("lease_seconds",)),
    "bump_version": (("table",), ("expected", "weights_uri")),
    "arrive": (("tables", "expected"), ("weights_uri", "timeout")),
    "set_barrier_timeout": (("table", "seconds"), ()),
    "barrier": (("table",), ()),
    "get_version": (("table",), ()),
    "wait_version": (("table", "min_version"), ("timeout",)),
    "stats": ((), ("table",)),
    "leases": ((), ("table",)),
    "health": ((), ()),
    "gc": ((), ("drop_rows", "keep_versions")),
    "requeue": (("table",), ("where",)),
    "checkpoint": ((), ()),
    "put": (("table",), ()),  # a session's put: the rows follow as a part
    # a coordinator's (docs/protocol.md, "Coordinator actions")
    "register_node": (("node_id", "location"), ("placement",)),
    "cluster": ((), ()),
    "report_lost": (("node_id",), ()),
    "dead_letters": ((), ("table",)),
    # a data node's (its health is the one above: no fields)
    "copy_chunks": (("chunks", "to"), ()),
    "collect": (("live_segments", "grace_seconds"), ()),
}


def check_fields(body: dict[str, Any], action: str, required: tuple[str, ...],
                 optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``body`` itself if it has every ``required`` field and no field but those and the
    ``optional`` ones; InvalidArgument naming what is missing or extra."""
    missing = [f for f in required if f not in body]
    if missing:
        raise InvalidArgument(f"action {action!r} needs field(s) {missing}; got {sorted(body)}")
    extra = set(body) - set(required) - set(optional)
    if extra:
        raise InvalidArgument(f"action {action!r} does not take field(s) {sorted(extra)}; it "
                              f"takes {list(required) + list(optional)}")
    return body


def check_body(action: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` checked against the fields :data:`ACTION_FIELDS` lists for ``action``."""
    return check_fields(body, action, *ACTION_FIELDS[action])


def parse_body(raw: bytes, action: str) -> dict[str, Any]:
    """An action's body: a JSON object (empty bytes: ``{}``). Its fields are checked by
    :func:`check_body`, after the caller's role (a body's fields are no secret, but the role
    error is the one a caller needs first)."""
    if not raw:
        return {}
    body = decode(raw, lambda e: f"body of action {action!r} is not valid JSON: {e}")
    if not isinstance(body, dict):
        raise InvalidArgument(f"body of action {action!r} must be a JSON object, got "
                              f"{type(body).__name__}")
    return body


def encode_body(body: dict[str, Any] | None) -> bytes:
    """An action's body as a client sends it (None: ``{}``)."""
    return encode(body or {})


def action(name: str, body: dict[str, Any] | None = None) -> flight.Action:
    """The Flight action ``name`` with ``body``."""
    return flight.Action(name, encode_body(body))


def flag(body: dict[str, Any], key: str, action: str) -> bool:
    """A JSON boolean field (absent: false). Strings such as "false" are refused, not truthy."""
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"action {action!r} field {key!r} must be true or false, got "
                              f"{value!r}")
    return value


# -- answers ------------------------------------------------------------------------------------

def results_bytes(result: Any) -> list[bytes]:
    """A handler's answer as the results of a call: raw parts (bytes, or Arrow buffers: a
    session claim's record batch) as they are, anything else as one JSON document."""
    if isinstance(result, list) and result and \
            all(isinstance(r, (bytes, pa.Buffer)) for r in result):
        return result
    return [encode_answer(result)]


def json_result(results: Sequence[bytes], action: str) -> Any:
    """The JSON document an action answered with."""
    if not results:
        raise ExpstoreError(f"the server answered action {action!r} with no result")
    return decode_answer(results[0], f"answer to action {action!r}")


# -- claims -------------------------------------------------------------------------------------

def claim_request_doc(request: ClaimRequest) -> dict[str, Any]:
    """One table's part of a claim body: ``table``, ``limit``, ``min_rows`` and the options
    set."""
    d: dict[str, Any] = {"table": request.table, "limit": request.limit,
                         "min_rows": request.min_rows}
    for key in ("where", "group_by", "group_size"):
        if getattr(request, key) is not None:
            d[key] = getattr(request, key)
    return d


def claim_body(request: ClaimRequest, consumer: str | None,
               lease_seconds: float | None, ack: str | None = None) -> dict[str, Any]:
    """The ``claim`` action's body (also a claim ticket's ``claim``); ``ack``: the claim id it
    acks first."""
    body = claim_request_doc(request)
    if consumer is not None:
        body["consumer"] = consumer
    if lease_seconds is not None:
        body["lease_seconds"] = lease_seconds
    if ack is not None:
        body["ack"] = ack
    return body


def claim_many_body(requests: list[ClaimRequest], consumer: str | None,
                    lease_seconds: float | None) -> dict[str, Any]:
    """The ``claim_many`` action's body."""
    body: dict[str, Any] = {"requests": [claim_request_doc(r) for r in requests]}
    if consumer is not None:
        body["consumer"] = consumer
    if lease_seconds is not None:
        body["lease_seconds"] = lease_seconds
    return body


class ClaimBody(NamedTuple):
    """A ``claim`` or ``claim_many`` body, decoded: the requests (checked), for whom, for how
    long (None: the table's lease; checked by the store), and for a ``claim``, the claim id it
    acks first (``ack``; checked by the store)."""

    requests: list[ClaimRequest]
    consumer: Any = None
    lease_seconds: Any = None
    ack: Any = None


REQUEST_FIELDS = ("table", "limit", "where", "group_by", "group_size", "min_rows")


def claim_request(d: Any) -> ClaimRequest:
    """One table's part of a claim body, checked (its values by :meth:`ClaimRequest.validated`)."""
    if not isinstance(d, dict):
        raise InvalidArgument(f"claim request {d!r} is not a JSON object")
    extra = set(d) - set(REQUEST_FIELDS)
    if extra:
        raise InvalidArgument(f"claim request has unknown fields {sorted(extra)}; expected "
                              f"{sorted(REQUEST_FIELDS)}")
    if "table" not in d or "limit" not in d:
        raise InvalidArgument("claim request needs 'table' and 'limit'")
    return ClaimRequest(d["table"], d["limit"], d.get("where"), d.get("group_by"),
                        d.get("group_size"), d.get("min_rows", 1)).validated()


def parse_claim_body(body: dict[str, Any]) -> ClaimBody:
    """A ``claim`` body (or a claim ticket's ``claim``), checked."""
    check_body("claim", body)
    rest = {k: v for k, v in body.items() if k not in ("consumer", "lease_seconds", "ack")}
    return ClaimBody([claim_request(rest)], body.get("consumer"),
                     body.get("lease_seconds"), body.get("ack"))


def parse_claim_many_body(body: dict[str, Any]) -> ClaimBody:
    """A ``claim_many`` body, checked."""
    check_body("claim_many", body)
    if not isinstance(body["requests"], list):
        raise InvalidArgument("claim_many 'requests' must be a list of claim requests")
    return ClaimBody([claim_request(r) for r in body["requests"]],
                     body.get("consumer"), body.get("lease_seconds"))


class ClaimHeader(NamedTuple):
    """The first result of a claim: its id (``""``: nothing claimed), consumer, lease end
    (seconds since the epoch) and rows per table, in the order of the parts that follow; a
    coordinator adds ``data_nodes``, the endpoints of the nodes holding the values. Answers to a
    session request that names the claim schemas it knows (:func:`claim_results`) add
    ``schemas``, the fingerprint of each table's schema sent as a stream, and ``batches``, the
    tables whose part is a lone record batch in the schema the request named."""

    claim_id: str
    consumer: str
    expires_at: float
    tables: dict[str, int]
    data_nodes: list[dict[str, Any]] | None = None
    schemas: dict[str, str] | None = None
    batches: list[str] | None = None

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"claim_id": self.claim_id, "consumer": self.consumer,
                               "expires_at": self.expires_at, "tables": self.tables}
        for key in ("data_nodes", "schemas", "batches"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        return encode(doc)

    @classmethod
    def decode(cls, raw: bytes) -> "ClaimHeader":
        doc = answer_object(raw, "claim header")
        try:
            claim_id, consumer = doc["claim_id"], doc["consumer"]
            expires_at, tables = doc["expires_at"], doc["tables"]
        except KeyError as e:
            raise ExpstoreError(f"malformed claim header from the server: it lacks {e}") \
                from None
        schemas, batches = doc.get("schemas"), doc.get("batches")
        if not (isinstance(claim_id, str) and isinstance(consumer, str)
                and isinstance(expires_at, (int, float)) and isinstance(tables, dict)
                and (schemas is None or isinstance(schemas, dict))
                and (batches is None or isinstance(batches, list))):
            raise ExpstoreError(f"malformed claim header from the server: {doc!r}")
        return cls(claim_id, consumer, expires_at, tables, doc.get("data_nodes"), schemas,
                   batches)


def schema_fingerprint(table: str, schema: pa.Schema) -> str:
    """The name a server gives table ``table``'s claim schema ``schema`` in claim answers:
    opaque to clients, which only compare it (a hash of the schema's IPC message)."""
    seen = _FINGERPRINTS.get(table)
    if seen is not None and seen[0].equals(schema, check_metadata=True):
        return seen[1]  # (a hash of the schema per answer cost more than the rest of it)
    fingerprint = xxhash.xxh3_64_hexdigest(schema.serialize().to_pybytes())
    if len(_FINGERPRINTS) >= 4096:  # tables come and go: keep it bounded
        _FINGERPRINTS.clear()
    _FINGERPRINTS[table] = (schema, fingerprint)
    return fingerprint


#: The last claim schema of each table and its fingerprint.
_FINGERPRINTS: dict[str, tuple[pa.Schema, str]] = {}


def claim_results(claim: Claim, known: dict[str, str] | None = None) -> list[bytes]:
    """A claim's answer: the header, then one part per table. An empty claim goes without
    parts: the client knows the claim schemas.

    Each part is an Arrow IPC stream, unless ``known`` (a session request's ``schemas``: table
    → the fingerprint of the claim schema the client holds) names the table's schema: then it
    is the one record-batch message, without the schema. Why: a small claim's answer is mostly
    read and written for its schema, which a client claiming micro-batches already has
    (A/B in BENCHMARKS.md, "Session claim answers without the schema")."""
    tables = claim.tables if claim.claim_id else {}
    rows = {name: t.num_rows for name, t in tables.items()}
    if known is None:
        header = ClaimHeader(claim.claim_id, claim.consumer, claim.expires_at, rows)
        return [header.encode(), *(ipc_stream(t) for t in tables.values())]
    parts: list[bytes] = []
    schemas: dict[str, str] = {}
    batches: list[str] = []
    for name, table in tables.items():
        fingerprint = schema_fingerprint(name, table.schema)
        one = table.to_batches()
        if known.get(name) == fingerprint and len(one) == 1:
            # the serialized batch as it is (the answer's frame copies it once, into the
            # message): no bytes copy of it first
            parts.append(one[0].serialize())  # type: ignore[arg-type]
            batches.append(name)
        else:
            parts.append(ipc_stream(table))
            schemas[name] = fingerprint
    header = ClaimHeader(claim.claim_id, claim.consumer, claim.expires_at, rows,
                         schemas=schemas, batches=batches)
    return [header.encode(), *parts]


def claim_of_results(results: Sequence[bytes], known: dict[str, pa.Schema] | None = None,
                     learned: dict[str, tuple[str, pa.Schema]] | None = None) -> Claim:
    """The :class:`Claim` of a claim's answer.

    Args:
        known: the claim schemas, by table, whose fingerprints the request named: a part the
            header lists in ``batches`` is one record batch in that schema.
        learned: filled with ``table: (fingerprint, schema)`` of each stream the header gives
            a fingerprint for (``schemas``), for the next requests to name.
    """
    header = ClaimHeader.decode(results[0]) if results else None
    if header is None or len(results) - 1 != len(header.tables):
        raise ExpstoreError(f"malformed claim answer from the server: {len(results)} parts for "
                            f"{len(header.tables) if header else 0} tables and a header")
    batches = header.batches or ()
    fingerprints = header.schemas or {}
    tables: dict[str, pa.Table] = {}
    for name, body in zip(header.tables, results[1:]):
        if name in batches:
            schema = (known or {}).get(name)
            if schema is None:
                raise ExpstoreError(f"malformed claim answer from the server: table {name!r} "
                                    "came as a record batch without a schema the request named")
            batch = pa.ipc.read_record_batch(pa.py_buffer(body), schema)
            tables[name] = pa.Table.from_batches([batch])
            continue
        tables[name] = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        if learned is not None and isinstance(fingerprints.get(name), str):
            learned[name] = (fingerprints[name], tables[name].schema)
    return Claim(header.claim_id, header.consumer, header.expires_at, tables)


# A claim answered as a do_get stream (a claim ticket) carries the claim in the stream schema's
# metadata under these keys: its id ("" for an empty claim), consumer, and lease expiry (a JSON
# number, seconds since the epoch).
CLAIM_ID_KEY, CONSUMER_KEY, EXPIRES_AT_KEY = \
    b"expstore.claim_id", b"expstore.consumer", b"expstore.expires_at"


def claim_stream_table(claim: Claim) -> pa.Table:
    """A one-table claim as a stream serves it: its rows, the claim in the schema's metadata."""
    table = claim.data
    metadata = dict(table.schema.metadata or {})
    metadata.update({CLAIM_ID_KEY: claim.claim_id.encode(), CONSUMER_KEY: claim.consumer.encode(),
                     EXPIRES_AT_KEY: encode(claim.expires_at)})
    return table.replace_schema_metadata(metadata)


def claim_of_stream(table: str, data: pa.Table) -> Claim:
    """A claim answered as a do_get stream: its rows, and the claim in the schema's metadata
    (taken off, so that the rows' schema is the claim schema, as on the other paths)."""
    metadata = dict(data.schema.metadata or {})
    try:
        claim_id = metadata.pop(CLAIM_ID_KEY).decode()
        consumer = metadata.pop(CONSUMER_KEY).decode()
        expires_at = float(json.loads(metadata.pop(EXPIRES_AT_KEY)))
    except (KeyError, ValueError) as e:
        raise ExpstoreError(f"malformed claim stream: its schema metadata lacks {e}") from None
    return Claim(claim_id, consumer, expires_at, {table: data.replace_schema_metadata(metadata)})


def table_def(description: dict[str, Any]) -> TableDef:
    """The :class:`TableDef` a ``describe`` answer describes (extra fields, such as the
    version or a coordinator's ``placement``, are not part of it)."""
    try:
        return TableDef(description["name"],
                        tuple(ColumnDef.from_json(c) for c in description["columns"]),
                        description["version_group"], description["max_staleness"],
                        description["max_deliveries"], description["lease_seconds"])
    except (KeyError, TypeError) as e:
        raise ExpstoreError(f"malformed answer to action 'describe' from the server: it lacks "
                            f"{e}") from None


__all__ = ["ACTION_FIELDS", "CLAIM_ID_KEY", "CONSUMER_KEY", "EXPIRES_AT_KEY", "ClaimBody",
           "ClaimHeader", "action", "check_body", "check_fields", "claim_body",
           "claim_many_body", "claim_of_results", "claim_of_stream", "claim_request_doc",
           "claim_results", "claim_stream_table", "encode_body", "flag", "schema_fingerprint",
           "json_result", "parse_body", "parse_claim_body", "parse_claim_many_body",
           "results_bytes", "table_def"]
