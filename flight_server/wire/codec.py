"""JSON on the wire: how every JSON message is written and read.

Requests a client builds are written strictly (a value JSON cannot hold is the caller's
mistake, raised as TypeError where it is made); answers a server builds hold what the store
returned, so values JSON has no type for (a timestamp) are written as their text. Both write
``json.dumps``'s default spelling (``", "`` and ``": "`` separators, ASCII escapes): clients in
other languages and tests compare these bytes.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from store.errors import ExpstoreError, InvalidArgument

#: What ``json.loads`` raises for bytes that are not one JSON document.
JSON_ERRORS = (ValueError, UnicodeDecodeError, RecursionError)


def encode(doc: Any) -> bytes:
    """A request's JSON bytes; TypeError for a value JSON cannot hold."""
    return json.dumps(doc).encode()


def encode_answer(doc: Any) -> bytes:
    """An answer's JSON bytes; values JSON has no type for are written as their text."""
    return json.dumps(doc, default=str).encode()


def decode(raw: bytes | str, problem: Callable[[Exception], str]) -> Any:
    """One JSON document; InvalidArgument with ``problem(error)`` as its message if it is not.

    >>> decode(b'{"a": 1}', lambda e: f"bad: {e}")
    {'a': 1}
    """
    try:
        return json.loads(raw)
    except JSON_ERRORS as e:
        raise InvalidArgument(problem(e)) from None


def decode_answer(raw: bytes | str, what: str) -> Any:
    """A JSON document a server answered with; a store error naming ``what`` if it is not one
    (a server of another protocol, or a broken one)."""
    try:
        return json.loads(raw)
    except JSON_ERRORS as e:
        raise ExpstoreError(f"malformed {what} from the server: {e}; expected a JSON "
                            "document") from None


def answer_object(raw: bytes | str, what: str) -> dict[str, Any]:
    """A JSON object a server answered with (see :func:`decode_answer`)."""
    doc = decode_answer(raw, what)
    if not isinstance(doc, dict):
        raise ExpstoreError(f"malformed {what} from the server: expected a JSON object, got "
                            f"{type(doc).__name__}")
    return doc
