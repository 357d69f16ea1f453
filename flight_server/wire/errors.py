"""Error codes on the wire, both ways (docs/protocol.md, "Errors").

A failed call is a Flight error whose type follows the store error's class, whose message
begins ``[<code>] `` and whose ``extra_info`` is ``{"code": "<code>"}``; a failed message on a
stream (a session request, a do_put batch, a subscription message) carries the same code and
message as JSON, ``{"code": …, "message": …}``. This module turns store errors into both and
back; :mod:`flight_server.errors` is the server's boundary that bounds messages and logs
unexpected failures before they get here.
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from store import errors as E

from .codec import JSON_ERRORS, encode

#: The Flight error type of each store error class (the rest: FlightServerError).
FLIGHT_TYPE: dict[type[E.ExpstoreError], type[flight.FlightError]] = {
    E.Unauthenticated: flight.FlightUnauthenticatedError,
    E.PermissionDenied: flight.FlightUnauthorizedError,
    E.QueryTimeout: flight.FlightTimedOutError,
    E.StoreClosed: flight.FlightUnavailableError,
    E.Unavailable: flight.FlightUnavailableError,
    E.StorageError: flight.FlightInternalError,
}


def flight_error(error: E.ExpstoreError) -> flight.FlightError:
    """The Flight error a client receives for ``error``: typed, ``[code] message``, the code
    in ``extra_info``.

    >>> e = flight_error(E.NotFound("unknown table 'x'"))
    >>> type(e).__name__, str(e), e.extra_info
    ('FlightServerError', "[not_found] unknown table 'x'", b'{"code": "not_found"}')
    """
    kind = next((t for c, t in FLIGHT_TYPE.items() if isinstance(error, c)),
                flight.FlightServerError)
    return kind(f"[{error.code}] {error}", extra_info=encode({"code": error.code}))


def code_of(extra_info: Any) -> str | None:
    """The error code in a Flight error's ``extra_info`` (None: none, or not ours)."""
    if not extra_info:
        return None
    try:
        doc = json.loads(bytes(extra_info))
    except (*JSON_ERRORS, TypeError):
        return None
    code = doc.get("code") if isinstance(doc, dict) else None
    return code if isinstance(code, str) else None


def from_flight(error: BaseException) -> BaseException:
    """The :mod:`store.errors` exception for a Flight error received by a client."""
    code = code_of(getattr(error, "extra_info", None))
    message = str(error).split(". Detail:")[0]
    if code is not None and message.startswith(f"[{code}] "):
        message = message[len(code) + 3:]
    if code in E.ERROR_CLASSES:
        return E.ERROR_CLASSES[code](message)
    if isinstance(error, flight.FlightUnauthenticatedError):
        # sent without extra_info (see docs/protocol.md), so its code is known by its type
        return E.Unauthenticated(message.removeprefix("[unauthenticated] "))
    if isinstance(error, flight.FlightUnauthorizedError):
        return E.PermissionDenied(message)
    if isinstance(error, flight.FlightUnavailableError):
        return E.Unavailable(message)
    if isinstance(error, flight.FlightTimedOutError):
        return E.QueryTimeout(message)
    if isinstance(error, pa.ArrowInvalid):
        return E.InvalidArgument(message)
    return E.ExpstoreError(message)


def error_doc(error: E.ExpstoreError) -> dict[str, str]:
    """An error as a stream message carries it: ``{"code": …, "message": …}``."""
    return {"code": error.code, "message": str(error)}


def error_of_doc(doc: Any) -> E.ExpstoreError:
    """The store error of an ``error_doc`` received (an unknown code: ExpstoreError)."""
    if not isinstance(doc, dict):
        return E.ExpstoreError(f"malformed error from the server: {doc!r}")
    return E.ERROR_CLASSES.get(str(doc.get("code")), E.ExpstoreError)(doc.get("message", ""))
