"""The client side of an action session (see flight_server.session for the wire format).

A :class:`SessionChannel` sends each request as it comes, from any thread, and a reader thread
hands every answer to the Future of its request, so callers wait with a timeout and acks can be
left in flight while the next claim goes out.
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.flight as flight

from store import errors as E

from . import wire
from .wire.errors import from_flight
from .wire.session import SESSION_COMMAND, SessionAnswer, SessionRequest

log = logging.getLogger("expstore.client")


class Answer(Future):
    """The Future of one request's answer. A ``result(timeout)`` that runs out raises the
    store's QueryTimeout (the answer may still come; a claim nobody reads expires with its
    lease)."""

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        except FutureTimeout:
            raise E.QueryTimeout(f"no answer from the server within {timeout} s") from None


def json_answer(answer: Future, action: str) -> Answer:
    """The Future of a one-document answer to ``action``, decoded."""
    out = Answer()

    def decode(done: Future) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
            return
        try:
            out.set_result(wire.json_result(done.result(), action))
        except E.ExpstoreError as e:
            out.set_exception(e)

    answer.add_done_callback(decode)
    return out


class SessionChannel:
    """One open session stream; unusable (``failed``) once the stream breaks or closes."""

    def __init__(self, client: flight.FlightClient, headers: list[tuple[bytes, bytes]]) -> None:
        # No deadline: the stream lives as long as the store object; each call has its own.
        options = flight.FlightCallOptions(headers=headers)
        descriptor = flight.FlightDescriptor.for_command(SESSION_COMMAND)
        self._writer, self._reader = client.do_exchange(descriptor, options)
        self._writer.begin(pa.schema([]))
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._ended_writing = False
        #: Whether the server takes puts on this session (None: no put tried yet).
        self.carries_puts: bool | None = None
        self._thread = threading.Thread(target=self._read_answers, name="expstore-session",
                                        daemon=True)
        self._thread.start()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def call(self, action: str, body: dict[str, Any], parts: Sequence[bytes] = (),
             schemas: dict[str, str] | None = None) -> Answer:
        """Send one request (with ``parts`` after its header: a put's rows; a claim's with the
        ``schemas`` its client holds); the Future resolves to the answer's parts (bytes) or
        raises the store error the server answered with."""
        future = Answer()
        with self._lock:
            if self._error is not None:
                raise self._error
            request_id = next(self._ids)
            self._pending[request_id] = future
            message = SessionRequest(request_id, action, body, parts, schemas).encode()
            try:
                self._writer.write_metadata(message)
            except (flight.FlightError, pa.ArrowException, OSError) as e:
                del self._pending[request_id]
                self._fail_locked(from_flight(e))
                raise self._error from None  # type: ignore[misc]
        return future

    def close(self) -> None:
        with self._lock:
            self._fail_locked(E.StoreClosed("the client was closed"))
        self._thread.join(5.0)

    # -- the reader thread ---------------------------------------------------------------------
    def _read_answers(self) -> None:
        error: BaseException
        try:
            while True:
                chunk = self._reader.read_chunk()
                if chunk.app_metadata is not None:
                    self._answer(chunk.app_metadata)
        except StopIteration:
            error = E.Unavailable("the server ended the session")
        except (flight.FlightError, pa.ArrowException, OSError) as e:
            error = from_flight(e)
        except Exception as e:  # noqa: BLE001 - a malformed answer ends the session
            error = E.ExpstoreError(f"malformed session answer: {type(e).__name__}: {e}")
        with self._lock:
            self._fail_locked(error)
            try:
                self._writer.close()  # finishes the call on our side
            except (flight.FlightError, pa.ArrowException, OSError) as e:
                log.debug("closing the session stream: %s", e)

    def _answer(self, raw: bytes | pa.Buffer) -> None:
        answer = SessionAnswer.decode(raw)
        if answer.closing:
            with self._lock:
                self._fail_locked(E.Unavailable("the server is shutting down"))
            return
        with self._lock:
            future = self._pending.pop(answer.id, None)
        if future is None:  # the caller gave up waiting (timeout)
            return
        if answer.error is not None:
            future.set_exception(answer.error)
            return
        future.set_result(answer.parts)

    def _fail_locked(self, error: BaseException) -> None:
        """Fail every request waiting, once, and end our side of the stream (the server then
        ends its handler; a server that is closing waits for exactly that)."""
        if self._error is None:
            self._error = error
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self._error)
        if not self._ended_writing:
            self._ended_writing = True
            try:
                self._writer.done_writing()
            except (flight.FlightError, pa.ArrowException, OSError) as e:
                log.debug("ending the session stream: %s", e)
