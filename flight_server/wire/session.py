"""Action sessions on ``do_exchange`` (docs/protocol.md, "do_exchange: action sessions").

Every message, both ways, is metadata-only: a JSON header on one line, a newline, then the parts
its ``sizes`` lists, back to back. A request's header is ``{"id", "action", "body"}`` (a put's
rows follow as one part, an Arrow IPC stream; a claim's may add ``"schemas"``, the claim schemas
the client holds); an answer's is ``{"id"}`` with the parts the ``do_action`` of that name
returns, or ``{"id", "error": {"code", "message"}}``; a server that shuts down sends
``{"id": null, "closing": true}``.

>>> SessionRequest(7, "ack", {"claim_id": "c1"}).encode().to_pybytes()
b'{"id": 7, "action": "ack", "body": {"claim_id": "c1"}}\\n'
>>> SessionRequest.decode(b'{"id": 7, "action": "ack", "body": {"claim_id": "c1"}}\\n')
SessionRequest(id=7, action='ack', body={'claim_id': 'c1'}, parts=(), schemas=None, problem=None)
"""
from __future__ import annotations

import json
from typing import Any, NamedTuple, Sequence

import pyarrow as pa

from store import errors as E
from store.errors import InvalidArgument

from .codec import JSON_ERRORS, answer_object, encode_answer
from .errors import error_doc, error_of_doc

#: The session actions whose request may name the claim schemas the client holds.
CLAIM_ACTIONS = ("claim", "claim_many")

#: The command of ``FlightDescriptor.for_command`` that opens a session.
SESSION_COMMAND = b'{"session": {}}'


def frame(header: dict[str, Any], parts: Sequence[bytes] = ()) -> pa.Buffer:
    """One message: the JSON header, a newline, the parts (their sizes in the header)."""
    if parts:
        header = {**header, "sizes": [len(p) for p in parts]}
    return pa.py_buffer(b"".join([encode_answer(header), b"\n", *parts]))


def split_parts(sizes: Any, rest: bytes | memoryview) -> tuple[bytes, ...]:
    """The parts after a header, cut by its ``sizes``, each as bytes (one copy of it where
    ``rest`` is a view of the message); InvalidArgument if they do not fit."""
    if not isinstance(sizes, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        raise InvalidArgument(f"a message's sizes must be a list of byte counts, got {sizes!r}")
    if sum(sizes) != len(rest):
        raise InvalidArgument(f"the message's sizes {sizes} add up to {sum(sizes)} bytes but "
                              f"{len(rest)} follow its header")
    parts, at = [], 0
    for n in sizes:
        parts.append(bytes(rest[at:at + n]))
        at += n
    return tuple(parts)


def _header_and_rest(raw: bytes | pa.Buffer) -> tuple[bytes, bytes | memoryview]:
    """A message's header line and what follows it (a view of a buffer's memory: its parts
    are copied once, by :func:`split_parts`, not the whole message first)."""
    if isinstance(raw, bytes):
        head, _, rest = raw.partition(b"\n")
        return head, rest
    view = memoryview(raw)
    end = bytes(view[:_HEADER_PEEK]).find(b"\n")
    if end < 0:
        end = bytes(view).find(b"\n")
    if end < 0:
        return bytes(view), b""
    return bytes(view[:end]), view[end + 1:]


# How much of a message is searched for the end of its header before the whole of it (a
# header is a line of JSON: an id, sizes, an error's message).
_HEADER_PEEK = 4096


def is_session(command: bytes) -> bool:
    """Whether a ``do_exchange`` command opens an action session (``{"session": {…}}``)."""
    try:
        doc = json.loads(command)
    except JSON_ERRORS:
        return False
    return isinstance(doc, dict) and "session" in doc


class SessionRequest(NamedTuple):
    """One request on a session. ``action``, ``body`` and ``schemas`` are as sent until
    :meth:`check`. ``schemas`` (claims only; None: not sent): the claim schemas the client
    holds, table → fingerprint, and that it reads answers naming them (see
    :func:`flight_server.wire.actions.claim_results`)."""

    id: Any
    action: Any
    body: Any
    parts: Sequence[bytes] = ()
    schemas: Any = None
    #: why the parts after a readable header could not be cut (raised by :meth:`check`, whose
    #: caller then knows the request's id), else None
    problem: str | None = None

    def encode(self) -> pa.Buffer:
        header = {"id": self.id, "action": self.action, "body": self.body}
        if self.schemas is not None:
            header["schemas"] = self.schemas
        return frame(header, self.parts)

    @classmethod
    def decode(cls, raw: bytes) -> "SessionRequest":
        """A request message: its JSON header, and the parts after it that ``sizes`` names."""
        head, _, rest = raw.partition(b"\n")
        try:
            request = json.loads(head)
        except JSON_ERRORS as e:
            try:  # a header written over several lines, with no parts
                request, rest = json.loads(raw), b""
            except JSON_ERRORS:
                raise InvalidArgument(f"a session request must be a JSON object {{id, action, "
                                      f"body}} on one line, then its parts; {e}") from None
        if not isinstance(request, dict):
            raise InvalidArgument("a session request must be a JSON object {id, action, body}")
        try:
            parts, problem = split_parts(request.get("sizes", []), rest), None
        except InvalidArgument as e:
            parts, problem = (), str(e)
        return cls(request.get("id"), request.get("action"), request.get("body", {}), parts,
                   request.get("schemas"), problem)

    def check(self, served: Sequence[str]) -> "SessionRequest":
        """The request itself if its action is one of ``served`` with a JSON object as its
        body, and parts only for a put; InvalidArgument naming what is wrong."""
        if self.problem is not None:
            raise InvalidArgument(self.problem)
        if self.action not in served:
            raise InvalidArgument(f"action {self.action!r} is not served on a session; "
                                      f"session actions: {list(served)} (use do_action for "
                                      "the others)")
        if not isinstance(self.body, dict):
            raise InvalidArgument(f"session request body must be a JSON object, got "
                                      f"{type(self.body).__name__}")
        if self.action != "put" and self.parts:
            raise InvalidArgument(f"a {self.action!r} request carries no parts; got "
                                      f"{len(self.parts)}")
        if self.schemas is not None:
            if self.action not in CLAIM_ACTIONS:
                raise InvalidArgument(f"only claim requests ({list(CLAIM_ACTIONS)}) name "
                                      f"schemas; a {self.action!r} request does not")
            if not isinstance(self.schemas, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.schemas.items()):
                raise InvalidArgument(f"a request's schemas must be a JSON object of table name "
                                      f"to schema fingerprint (strings), got {self.schemas!r}")
        return self


def answer(request_id: Any, parts: Sequence[bytes]) -> pa.Buffer:
    """The answer to a request: the parts its ``do_action`` returns."""
    return frame({"id": request_id}, parts)


def error_answer(request_id: Any, error: E.ExpstoreError) -> pa.Buffer:
    """The answer to a request that failed."""
    return frame({"id": request_id, "error": error_doc(error)})


#: What the server sends when it shuts down: the client ends its side of the stream.
CLOSING = {"id": None, "closing": True}


def closing() -> pa.Buffer:
    return frame(CLOSING)


class SessionAnswer(NamedTuple):
    """An answer a client received: to request ``id``, its ``parts``, or its ``error``; or
    ``closing`` (the server shuts down; no request)."""

    id: Any
    parts: Sequence[bytes] = ()
    error: E.ExpstoreError | None = None
    closing: bool = False

    @classmethod
    def decode(cls, raw: bytes | pa.Buffer) -> "SessionAnswer":
        """An answer message, as bytes or as the Arrow buffer it arrived in."""
        head, rest = _header_and_rest(raw)
        header = answer_object(head, "session answer")
        if header.get("closing"):
            return cls(None, closing=True)
        problem = header.get("error")
        if problem is not None:
            return cls(header.get("id"), error=error_of_doc(problem))
        try:
            parts = split_parts(header.get("sizes", []), rest)
        except InvalidArgument as e:
            raise E.ExpstoreError(f"malformed session answer from the server: {e}") from None
        return cls(header.get("id"), parts)
