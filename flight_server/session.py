"""``do_exchange`` action sessions: the hot verbs of ``do_action`` over one long-lived stream.

Each ``do_action`` is a new gRPC call; a message on a stream that is already open costs a
fraction of that, which is most of a claim's round trip on loopback. A trainer claiming and
acking many times a second therefore opens one session (``FlightDescriptor.for_command(
'{"session": {}}')``) and sends one metadata-only message per request::

    {"id": 7, "action": "claim", "body": {<the do_action body>}}

and the server answers each with one metadata-only message: a JSON header, a newline, then the
parts ``do_action`` would have returned for the request, back to back::

    {"id": 7, "sizes": [112, 2216]}\\n<part 1><part 2>
    {"id": 7, "error": {"code": "not_found", "message": "…"}}\\n

A small write travels the same way (a ``do_put`` call each costs what a ``do_action`` does):
the request's one-line header names the table and the size of one part, an Arrow IPC stream of
the rows, after a newline::

    {"id": 8, "action": "put", "body": {"table": "policy"}, "sizes": [1184]}\\n<IPC stream>

Claims, renewals and version reads are answered in request order. Puts, acks, nacks and claims that carry
an ack are answered when their commit is durable, from another thread, so a claim sent after an
ack does not wait for the ack's fsync: answers can overtake each other, and clients match them
by ``id``. One thread writes
those answers for every session (:class:`_DurableAnswers`). When the server
shuts down it sends ``{"id": null, "closing": true}`` and the client ends its side of the stream.
The messages are encoded and decoded by :mod:`flight_server.wire.session`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.flight as flight

from store.embedded import EmbeddedStore
from store.errors import InvalidArgument

from . import wire
from .actions import ACTIONS, claim_acking, claim_of_action, run_action
from .auth import Principal
from .errors import as_store_error
from .metrics import Metrics
from .wire.session import SessionRequest, answer, closing, error_answer

log = logging.getLogger("expstore.session")

# Verbs a session carries: the fast ones. Long polls (wait_version) or SQL would hold up every
# request behind them on the stream; they stay on do_action / do_get.
SESSION_ACTIONS = ("claim", "claim_many", "ack", "nack", "renew", "get_version", "put")
# Verbs answered once their commit is durable, out of order.
DURABLE_ACTIONS = ("ack", "nack", "put")
# Writes waiting for their commit on one session; more block the reading side (back-pressure).
MAX_PENDING_WRITES = 256

# Where a durable answer goes when its session's stream is busy (see _DurableAnswers).
_BUSY_STREAMS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="expstore-session")


class _DurableAnswers:
    """Writes the answers of puts, acks and nacks, for every session, once they are durable.

    Why one thread: a group commit resolves the writes of many sessions at once. With a thread
    per session waiting on its answers, dozens of them woke together and competed with the
    writer for the interpreter lock: with many one-sample producers, a group commit spent most
    of its time waiting for the lock, not working. One thread writing them in turn raised the
    rate of puts (A/B in docs/bench/history.md, "The round of 2026-11-24 08:03"). A session
    whose stream is busy (a large claim answer being written to a client that reads slowly) is
    answered from a pool thread instead, so that it holds up no other session.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[ActionSession, Any, str, float, Future]] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, session: "ActionSession", request_id: Any, name: str, started: float,
               future: Future) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="expstore-session-answers")
                self._thread.start()
        put = self._queue.put
        future.add_done_callback(lambda done: put((session, request_id, name, started, done)))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            session = item[0]
            if not session._answer(item[1:], blocking=False):
                _BUSY_STREAMS.submit(session._answer, item[1:])


_DURABLE = _DurableAnswers()


def read_rows(parts: Sequence[bytes]) -> pa.Table:
    """The rows of a put request: its one part, an Arrow IPC stream."""
    if len(parts) != 1:
        raise InvalidArgument(f"a put request carries its rows as one part (an Arrow IPC "
                              f"stream); got {len(parts)} parts")
    try:
        return pa.ipc.open_stream(parts[0]).read_all()
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise InvalidArgument(f"a put request's rows are not a readable Arrow IPC stream: "
                              f"{e}") from None


def error_frame(request_id: Any, error: BaseException) -> pa.Buffer:
    return error_answer(request_id, as_store_error(error))


def _once_done(first: Future, result: Any) -> Future:
    """A Future of ``result`` that resolves when ``first`` does (with its error, if any)."""
    out: Future = Future()

    def done(f: Future) -> None:
        error = f.exception()
        if error is None:
            out.set_result(result)
        else:
            out.set_exception(error)
    first.add_done_callback(done)
    return out


class ActionSession:
    """Serves one session stream until the client ends it (or the server shuts down)."""

    def __init__(self, store: EmbeddedStore, principal: Principal, metrics: Metrics,
                 reader: flight.MetadataRecordBatchReader,
                 writer: flight.MetadataRecordBatchWriter) -> None:
        self._store = store
        self._principal = principal
        self._metrics = metrics
        self._reader = reader
        self._writer = writer
        self._write_lock = threading.Lock()  # answers come from this thread and _DURABLE's
        self._slots = threading.Semaphore(MAX_PENDING_WRITES)
        # Writes not answered yet: the handler returns only once there are none.
        self._unanswered = 0
        self._answered = threading.Condition()
        self._broken = False

    def run(self) -> None:
        self._writer.begin(pa.schema([]))
        try:
            while True:
                try:
                    chunk = self._reader.read_chunk()
                except StopIteration:
                    return
                if chunk.app_metadata is not None:
                    self._handle(chunk.app_metadata.to_pybytes())
        finally:
            with self._answered:
                self._answered.wait_for(lambda: self._unanswered == 0)
            self._let_go_of_stream()

    def _let_go_of_stream(self) -> None:
        """Drop our references to the call's reader and writer before the handler returns.

        pyarrow's reader and writer own C++ objects that point into the gRPC call, which is
        freed when the handler returns. Whoever drops the last reference destroys them: that
        must be the handler's own frame, inside the call. Otherwise a thread that still holds
        this session a moment longer (the thread that wrote its last answer, a shutdown
        closing sessions) destroys them after the call is gone, and the heap is corrupted:
        servers stopped with a session open died now and then with "double free or corruption".
        """
        with self._write_lock:
            self._broken = True  # close() after this writes nothing
            self._reader = self._writer = None  # type: ignore[assignment]

    def close(self) -> None:
        """The server is shutting down: ask the client to end the stream."""
        self._write(closing())

    def _handle(self, raw: bytes) -> None:
        request_id = None
        try:
            request = SessionRequest.decode(raw)
            request_id = request.id
            request.check(SESSION_ACTIONS)
            name, body, parts = request.action, request.body, request.parts
            if name in DURABLE_ACTIONS or (name == "claim" and "ack" in body):
                started = time.perf_counter()
                future = self._start_write(name, body, parts, request.schemas)
                self._slots.acquire()
                with self._answered:
                    self._unanswered += 1
                _DURABLE.submit(self, request_id, name, started, future)
                return
            spec = ACTIONS[name]
            self._principal.require(spec.role, name)
            with self._metrics.timed(name):
                if request.schemas is None:
                    results = run_action(spec, self._store, body)
                else:
                    results = wire.claim_results(claim_of_action(self._store, name, body),
                                                 request.schemas)
            self._write(answer(request_id, results))
        except Exception as e:  # noqa: BLE001 - every request gets an answer, errors included
            self._write(error_frame(request_id, e))

    def _start_write(self, name: str, body: dict[str, Any], parts: Sequence[bytes],
                     schemas: dict[str, str] | None = None) -> Future:
        """Queue a put, ack or nack; its Future resolves once the write is durable.
        ``schemas``: a claim's, the claim schemas its client holds."""
        if name == "put":
            self._principal.require("writer", name)
            table = wire.check_body(name, body)["table"]
            if not isinstance(table, str):
                raise InvalidArgument(f"put's table must be a string, got {table!r}")
            return self._store.put_async(table, read_rows(parts))
        self._principal.require(ACTIONS[name].role, name)
        if name == "claim":  # one that carries an ack
            # the answer is built now, while the ack commits, and sent once it is durable
            claim, acked = claim_acking(self._store, body)
            assert acked is not None
            return _once_done(acked, wire.claim_results(claim, schemas))
        claim_id = wire.check_body(name, body)["claim_id"]
        settle = EmbeddedStore.ack_async if name == "ack" else EmbeddedStore.nack_async
        return settle(self._store, claim_id)

    def _answer(self, item: tuple[Any, str, float, Future], blocking: bool = True) -> bool:
        """Write a durable write's answer; False (nothing written) when ``blocking`` is False
        and another thread is writing to the stream."""
        request_id, name, started, future = item
        try:
            message = answer(request_id, wire.results_bytes(future.result()))
        except BaseException as e:  # noqa: BLE001 - the client gets the error as the answer
            message = error_frame(request_id, e)
        try:
            if not self._write(message, blocking):
                return False
        except Exception:  # noqa: BLE001 - unwritable: count it answered, or run() never ends
            log.exception("could not write the answer to request %r", request_id)
        self._slots.release()
        self._metrics.observe(name, time.perf_counter() - started)
        with self._answered:
            self._unanswered -= 1
            if not self._unanswered:
                self._answered.notify_all()
        return True

    def _write(self, message: pa.Buffer, blocking: bool = True) -> bool:
        """Write a message (nothing once the stream broke); False when ``blocking`` is False and
        another thread holds the stream."""
        if not self._write_lock.acquire(blocking):
            return False
        try:
            if self._broken:
                return True
            try:
                self._writer.write_metadata(message)
            except (pa.ArrowException, OSError) as e:  # the client went away
                log.debug("session client gone: %s", e)
                self._broken = True
            return True
        finally:
            self._write_lock.release()
