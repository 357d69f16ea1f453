"""The one boundary where store errors become Flight errors, and back.

The server raises Flight error types (they reach clients with a clean message and the gRPC status
that matches: UNAUTHENTICATED, PERMISSION_DENIED, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL, and
FAILED for the rest) and puts the store's error code in ``extra_info`` as JSON, so the Python
client rebuilds the exact :mod:`store.errors` class and raw Flight clients can branch on
``extra_info`` instead of message text.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Iterator

import pyarrow as pa
import pyarrow.flight as flight

from store import errors as E

log = logging.getLogger("expstore.flight")

_FLIGHT_TYPE: dict[type[E.ExpstoreError], type[flight.FlightError]] = {
    E.Unauthenticated: flight.FlightUnauthenticatedError,
    E.PermissionDenied: flight.FlightUnauthorizedError,
    E.QueryTimeout: flight.FlightTimedOutError,
    E.StoreClosed: flight.FlightUnavailableError,
    E.Unavailable: flight.FlightUnavailableError,
    E.StorageError: flight.FlightInternalError,
}


def to_flight(error: BaseException) -> flight.FlightError:
    """The Flight error a client receives for ``error``."""
    if isinstance(error, flight.FlightError):
        return error
    if not isinstance(error, E.ExpstoreError):
        log.exception("internal error", exc_info=error)
        error = E.ExpstoreError(f"internal error: {type(error).__name__}: {error}")
    kind = next((t for c, t in _FLIGHT_TYPE.items() if isinstance(error, c)),
                flight.FlightServerError)
    info = json.dumps({"code": error.code}).encode()
    return kind(f"[{error.code}] {error}", extra_info=info)


def as_store_error(error: BaseException) -> E.ExpstoreError:
    """The store error a client is told of: bad-input exceptions from Arrow or from parsing
    become InvalidArgument; anything else unexpected is logged and becomes "internal"."""
    if isinstance(error, E.ExpstoreError):
        return error
    if isinstance(error, (pa.ArrowException, ValueError, TypeError, KeyError, RecursionError)):
        return E.InvalidArgument(str(error))
    log.exception("internal error", exc_info=error)
    return E.ExpstoreError(f"internal error: {type(error).__name__}: {error}")


@contextmanager
def flight_errors() -> Iterator[None]:
    """Translate anything raised inside into a Flight error."""
    try:
        yield
    except flight.FlightError:
        raise
    except Exception as e:  # noqa: BLE001 - sent to the client as the matching store error
        raise to_flight(as_store_error(e)) from None


def from_flight(error: BaseException) -> BaseException:
    """The :mod:`store.errors` exception for a Flight error received by a client."""
    code = None
    extra = getattr(error, "extra_info", None)
    if extra:
        try:
            code = json.loads(bytes(extra)).get("code")
        except (ValueError, AttributeError):
            code = None
    message = str(error).split(". Detail:")[0]
    if code is not None and message.startswith(f"[{code}] "):
        message = message[len(code) + 3:]
    if code in E.ERROR_CLASSES:
        return E.ERROR_CLASSES[code](message)
    if isinstance(error, flight.FlightUnauthenticatedError):
        return E.Unauthenticated(message)
    if isinstance(error, flight.FlightUnauthorizedError):
        return E.PermissionDenied(message)
    if isinstance(error, flight.FlightUnavailableError):
        return E.Unavailable(message)
    if isinstance(error, flight.FlightTimedOutError):
        return E.QueryTimeout(message)
    if isinstance(error, pa.ArrowInvalid):
        return E.InvalidArgument(message)
    return E.ExpstoreError(message)
