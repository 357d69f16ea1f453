"""The one boundary where store errors become Flight errors, and back.

The server raises Flight error types (they reach clients with a clean message and the gRPC status
that matches: UNAUTHENTICATED, PERMISSION_DENIED, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL, and
FAILED for the rest) and puts the store's error code in ``extra_info`` as JSON, so the Python
client rebuilds the exact :mod:`store.errors` class and raw Flight clients can branch on
``extra_info`` instead of message text. How a code travels is the wire's
(:mod:`flight_server.wire.errors`); what this boundary adds is the policy: unexpected failures
are logged and become ``internal``, bad-input exceptions become ``invalid_argument``.

Messages are bounded here too: they echo what the caller sent (a table name, a claim id, an action
name, a descriptor), and gRPC carries a Flight error's message and ``extra_info`` in its
metadata, whose size is limited (8 KB by default): a long echo cost the client the typed code, a
longer one the whole error. Each echoed run keeps its first characters and states its length.
"""
from __future__ import annotations

import copy
import logging
import re
from types import TracebackType

import pyarrow as pa
import pyarrow.flight as flight

from store import errors as E

from .wire.errors import flight_error, from_flight

log = logging.getLogger("expstore.flight")

#: Characters kept of one echoed run of the caller's input (a run without spaces or quotes).
MAX_ECHO_CHARS = 200
#: UTF-8 bytes of a whole message; gRPC percent-encodes non-ASCII bytes (three times longer).
MAX_MESSAGE_BYTES = 1024
_LONG_RUN = re.compile(rf"[^\s'\"…]{{{MAX_ECHO_CHARS + 1},}}")


def bound_message(message: str) -> str:
    """``message`` with every run of more than :data:`MAX_ECHO_CHARS` characters without spaces or
    quotes cut to its start and its length, and the whole cut to :data:`MAX_MESSAGE_BYTES` (its
    start and end kept: the end usually says what was expected).

    >>> bound_message("unknown table " + "x" * 1000 + " ; tables: a, b")[-40:]
    'xxxxx… (1,000 characters) ; tables: a, b'
    """
    message = _LONG_RUN.sub(
        lambda m: f"{m.group()[:MAX_ECHO_CHARS]}… ({len(m.group()):,} characters)", message)
    encoded = message.encode("utf-8", "replace")
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return message
    half = MAX_MESSAGE_BYTES // 2 - 40
    head = encoded[:half].decode("utf-8", "ignore")
    tail = encoded[-half:].decode("utf-8", "ignore")
    return f"{head} … ({len(message):,} characters in all) … {tail}"


def _bounded(error: E.ExpstoreError) -> E.ExpstoreError:
    """``error`` itself if its message is within bounds, else a copy with a bounded message."""
    message = str(error)
    short = bound_message(message)
    if short == message:
        return error
    bounded = copy.copy(error)
    bounded.args = (short,)
    return bounded


def to_flight(error: BaseException) -> flight.FlightError:
    """The Flight error a client receives for ``error``."""
    if isinstance(error, flight.FlightError):
        return error
    if not isinstance(error, E.ExpstoreError):
        log.exception("internal error", exc_info=error)
        error = E.ExpstoreError(f"internal error: {type(error).__name__}: {error}")
    return flight_error(_bounded(error))


def as_store_error(error: BaseException) -> E.ExpstoreError:
    """The store error a client is told of: bad-input exceptions from Arrow or from parsing
    become InvalidArgument; anything else unexpected is logged and becomes "internal".
    A refusal (the caller's mistake, or a retryable state such as a full table) is logged
    once here, at DEBUG, without a traceback: the caller has the message, an operator sees it
    with ``--log-level debug``."""
    if isinstance(error, E.ExpstoreError):
        return _refused(_bounded(error))
    if isinstance(error, (pa.ArrowException, ValueError, TypeError, KeyError, RecursionError)):
        return _refused(_bounded(E.InvalidArgument(str(error))))
    log.exception("internal error", exc_info=error)
    return _bounded(E.ExpstoreError(f"internal error: {type(error).__name__}: {error}"))


def _refused(error: E.ExpstoreError) -> E.ExpstoreError:
    log.debug("refused: [%s] %s", error.code, error)
    return error


class _FlightErrors:
    """The context manager :func:`flight_errors` returns (it holds no state: one serves all)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if error is None or isinstance(error, flight.FlightError) \
                or not isinstance(error, Exception):
            return  # (re-raised as it is)
        if isinstance(error, NotImplementedError):
            raise NotImplementedError(bound_message(str(error))) from None
        raise to_flight(as_store_error(error)) from None  # (the matching store error)


_FLIGHT_ERRORS = _FlightErrors()


def flight_errors() -> _FlightErrors:
    """Translate anything raised inside into a Flight error. ``NotImplementedError`` (a Flight
    SQL verb this read-only server does not offer) stays one: pyarrow answers it with gRPC's
    UNIMPLEMENTED, which has no Flight error class, and ADBC raises ``NotSupportedError``.

    A class, not a generator: every call of every verb enters it, and a generator's context
    manager costs several times as much to enter and leave."""
    return _FLIGHT_ERRORS


__all__ = ["as_store_error", "bound_message", "flight_errors", "from_flight", "to_flight"]
