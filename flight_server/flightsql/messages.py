"""Flight SQL protobuf messages, built at import time, and the Any envelope around them.

Why not checked-in ``*_pb2.py``: generated code pins the protobuf runtime to at least the
protoc release that generated it (``protobuf>=7.35`` for today's grpcio-tools), which would
clash with the protobuf pins of torch, Ray or vLLM. Building the descriptor here needs only the
long-stable ``descriptor_pb2`` API, so any ``protobuf>=4.25`` works. ``FlightSql.proto`` beside
this file stays the readable source; a test compiles it with protoc and checks that
:data:`_MESSAGES` matches it.

The messages live in a private descriptor pool so that another library registering the official
``FlightSql.proto`` in the default pool cannot collide with them; the type URLs are the
specification's all the same.
"""
from __future__ import annotations

from typing import Any

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

PACKAGE = "arrow.flight.protocol.sql"
TYPE_URL_PREFIX = f"type.googleapis.com/{PACKAGE}."
PROTO_FILE = "expstore/flightsql/FlightSql.proto"

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "bool": _F.TYPE_BOOL,
          "uint32": _F.TYPE_UINT32, "int32": _F.TYPE_INT32}

# message name -> [(label, type, field name, number)]; label is "", "optional" or "repeated"
# exactly as written in FlightSql.proto.
_MESSAGES: dict[str, list[tuple[str, str, str, int]]] = {
    "CommandGetSqlInfo": [("repeated", "uint32", "info", 1)],
    "CommandGetCatalogs": [],
    "CommandGetDbSchemas": [("optional", "string", "catalog", 1),
                            ("optional", "string", "db_schema_filter_pattern", 2)],
    "CommandGetTables": [("optional", "string", "catalog", 1),
                         ("optional", "string", "db_schema_filter_pattern", 2),
                         ("optional", "string", "table_name_filter_pattern", 3),
                         ("repeated", "string", "table_types", 4),
                         ("", "bool", "include_schema", 5)],
    "CommandGetTableTypes": [],
    "CommandStatementQuery": [("", "string", "query", 1),
                              ("optional", "bytes", "transaction_id", 2)],
    "TicketStatementQuery": [("", "bytes", "statement_handle", 1)],
    "CommandPreparedStatementQuery": [("", "bytes", "prepared_statement_handle", 1)],
    "ActionCreatePreparedStatementRequest": [("", "string", "query", 1),
                                             ("optional", "bytes", "transaction_id", 2)],
    "ActionCreatePreparedStatementResult": [("", "bytes", "prepared_statement_handle", 1),
                                            ("", "bytes", "dataset_schema", 2),
                                            ("", "bytes", "parameter_schema", 3)],
    "ActionClosePreparedStatementRequest": [("", "bytes", "prepared_statement_handle", 1)],
    "DoPutPreparedStatementResult": [("optional", "bytes", "prepared_statement_handle", 1)],
}


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto of :data:`_MESSAGES` (what protoc makes of FlightSql.proto)."""
    fdp = descriptor_pb2.FileDescriptorProto(name=PROTO_FILE, package=PACKAGE, syntax="proto3")
    for name, fields in _MESSAGES.items():
        msg = fdp.message_type.add(name=name)
        for label, type_name, field_name, number in fields:
            field = msg.field.add(name=field_name, number=number, type=_TYPES[type_name],
                                  json_name=_json_name(field_name))
            field.label = _F.LABEL_REPEATED if label == "repeated" else _F.LABEL_OPTIONAL
            if label == "optional":
                # proto3 `optional` is a synthetic one-field oneof; it gives HasField().
                field.proto3_optional = True
                field.oneof_index = len(msg.oneof_decl)
                msg.oneof_decl.add(name=f"_{field_name}")
    return fdp


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


_pool = descriptor_pool.DescriptorPool()
_pool.Add(file_descriptor())


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))


CommandGetSqlInfo = _message("CommandGetSqlInfo")
CommandGetCatalogs = _message("CommandGetCatalogs")
CommandGetDbSchemas = _message("CommandGetDbSchemas")
CommandGetTables = _message("CommandGetTables")
CommandGetTableTypes = _message("CommandGetTableTypes")
CommandStatementQuery = _message("CommandStatementQuery")
TicketStatementQuery = _message("TicketStatementQuery")
CommandPreparedStatementQuery = _message("CommandPreparedStatementQuery")
ActionCreatePreparedStatementRequest = _message("ActionCreatePreparedStatementRequest")
ActionCreatePreparedStatementResult = _message("ActionCreatePreparedStatementResult")
ActionClosePreparedStatementRequest = _message("ActionClosePreparedStatementRequest")
DoPutPreparedStatementResult = _message("DoPutPreparedStatementResult")

_CLASSES: dict[str, Any] = {name: _message(name) for name in _MESSAGES}


def pack(message: Message) -> bytes:
    """Serialise ``message`` inside a google.protobuf.Any, as Flight SQL sends commands."""
    envelope = any_pb2.Any()
    envelope.Pack(message)
    return envelope.SerializeToString()


def peek(data: bytes) -> tuple[str, bytes] | None:
    """The Flight SQL message name and payload inside ``data``, or None if it is not one.

    ``None`` means "not Flight SQL" (for instance expstore's own JSON tickets, which cannot parse
    as an Any whose type URL has the Flight SQL prefix), so callers can route on it.
    """
    envelope = any_pb2.Any()
    try:
        envelope.ParseFromString(data)
    except DecodeError:
        return None
    if not envelope.type_url.startswith(TYPE_URL_PREFIX):
        return None
    return envelope.type_url[len(TYPE_URL_PREFIX):], envelope.value


def unpack(name: str, payload: bytes) -> Any:
    """Decode the payload of a message ``name`` that :func:`peek` found.

    Raises:
        ValueError: the payload does not decode as that message (a malformed request).
    """
    try:
        return _CLASSES[name].FromString(payload)
    except DecodeError as e:
        raise ValueError(f"Flight SQL {name} does not decode: {e}") from e
