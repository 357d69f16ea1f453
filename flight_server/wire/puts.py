"""``do_put`` answers, and the data node's put (docs/protocol.md, "do_put" and "Writing: values
to a data node").

Each batch of a ``do_put`` is answered, once durable, with ``{"batch": i, "rows": n,
"version": v}``, or ``{"batch": i, "error": {"code", "message"}}``. A data node's ``do_put``
descriptor is ``{"put": {"replicas": 1|2}}`` and its answers name the chunks written.

>>> put_answer(0, {"rows": 2, "version": 0})
b'{"batch": 0, "rows": 2, "version": 0}'
>>> parse_put_command(put_command(2))
2
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow.flight as flight

from store import errors as E
from store.errors import InvalidArgument

from .codec import JSON_ERRORS, answer_object, encode, encode_answer


def put_answer(batch: int, result: dict[str, Any]) -> bytes:
    """The answer to batch ``batch`` of a ``do_put``: the store's answer to its put."""
    return encode_answer({"batch": batch, **result})


def put_error_answer(batch: int, error: BaseException) -> bytes:
    """The answer to a batch that failed (an error of another kind is ``internal``)."""
    return encode_answer({"batch": batch, "error": {
        "code": getattr(error, "code", "internal"), "message": str(error)}})


def parse_put_answer(raw: bytes) -> dict[str, Any]:
    """A ``do_put`` answer a client received."""
    return answer_object(raw, "do_put answer")


# -- a data node -------------------------------------------------------------------------------

def put_command(replicas: int) -> bytes:
    """The descriptor command of a ``do_put`` to a data node."""
    return encode({"put": {"replicas": replicas}})


def parse_put_command(command: bytes) -> int:
    """The replicas a data node's ``do_put`` command asks for (1 or 2)."""
    try:
        doc = json.loads(command)
        replicas = doc["put"].get("replicas", 1)
    except (*JSON_ERRORS, TypeError, KeyError, AttributeError) as e:
        raise InvalidArgument(f"data node put command {command[:200]!r} is invalid "
                              f"({e}); expected {{\"put\": {{\"replicas\": 1 or 2}}}}") from None
    if replicas not in (1, 2) or isinstance(replicas, bool):
        raise InvalidArgument(f"replicas {replicas!r} is invalid; expected 1 or 2")
    return int(replicas)


def put_command_of(descriptor: flight.FlightDescriptor) -> int:
    """The replicas of a data node's ``do_put`` descriptor."""
    if descriptor.descriptor_type != flight.DescriptorType.CMD:
        raise InvalidArgument("a data node's do_put expects FlightDescriptor.for_command("
                              "'{\"put\": {\"replicas\": 1}}')")
    return parse_put_command(descriptor.command)


def node_put_answer(batch: int, rows: int, chunks: dict[str, str]) -> bytes:
    """A data node's answer to a batch: the chunk location of each column."""
    return encode({"batch": batch, "rows": rows, "chunks": chunks})


def chunks_of_answer(raw: bytes) -> dict[str, str]:
    """The chunk locations of a data node's answer."""
    answer = answer_object(raw, "data node put answer")
    chunks = answer.get("chunks")
    if not isinstance(chunks, dict):
        raise E.ExpstoreError(f"malformed data node put answer: {answer!r} has no chunks")
    return chunks
