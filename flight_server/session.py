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

Claims and version reads are answered in request order. Acks and nacks are answered when their
commit is durable, from another thread, so a claim sent after an ack does not wait for the ack's
fsync: answers can overtake each other, and clients match them by ``id``. When the server shuts
down it sends ``{"id": null, "closing": true}`` and the client ends its side of the stream.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import pyarrow as pa
import pyarrow.flight as flight

from store.embedded import EmbeddedStore
from store.errors import InvalidArgument

from .actions import ACTIONS, action_results, check_fields
from .auth import Principal
from .errors import as_store_error
from .metrics import Metrics

log = logging.getLogger("expstore.session")

# Verbs a session carries: the fast ones. Long polls (wait_version) or SQL would hold up every
# request behind them on the stream; they stay on do_action / do_get.
SESSION_ACTIONS = ("claim", "claim_many", "ack", "nack", "get_version")
ASYNC_ACTIONS: dict[str, Callable[[EmbeddedStore, str], Future]] = {
    "ack": EmbeddedStore.ack_async, "nack": EmbeddedStore.nack_async}
# Settles waiting for their commit on one session; more block the reading side (back-pressure).
MAX_PENDING_SETTLES = 256

_SETTLE_ANSWERS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="expstore-session")


def is_session(command: bytes) -> bool:
    """Whether a ``do_exchange`` command opens an action session (``{"session": {…}}``)."""
    try:
        doc = json.loads(command)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(doc, dict) and "session" in doc


def frame(header: dict[str, Any], parts: Sequence[bytes] = ()) -> pa.Buffer:
    """One answer message: the JSON header, a newline, the parts (their sizes in the header)."""
    if parts:
        header = {**header, "sizes": [len(p) for p in parts]}
    return pa.py_buffer(b"".join([json.dumps(header, default=str).encode(), b"\n", *parts]))


def error_frame(request_id: Any, error: BaseException) -> pa.Buffer:
    e = as_store_error(error)
    return frame({"id": request_id, "error": {"code": e.code, "message": str(e)}})


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
        self._write_lock = threading.Lock()  # answers come from this thread and the settles'
        self._settles: queue.Queue[tuple[Any, str, float, Future] | None] = queue.Queue()
        self._slots = threading.Semaphore(MAX_PENDING_SETTLES)
        self._broken = False

    def run(self) -> None:
        self._writer.begin(pa.schema([]))
        settles = _SETTLE_ANSWERS.submit(self._answer_settles)
        try:
            while True:
                try:
                    chunk = self._reader.read_chunk()
                except StopIteration:
                    return
                if chunk.app_metadata is not None:
                    self._handle(chunk.app_metadata.to_pybytes())
        finally:
            self._settles.put(None)
            settles.result()

    def close(self) -> None:
        """The server is shutting down: ask the client to end the stream."""
        self._write(frame({"id": None, "closing": True}))

    def _handle(self, raw: bytes) -> None:
        request_id = None
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise InvalidArgument("a session request must be a JSON object {id, action, "
                                      "body}")
            request_id = request.get("id")
            name, body = request.get("action"), request.get("body", {})
            if name not in SESSION_ACTIONS:
                raise InvalidArgument(f"action {name!r} is not served on a session; session "
                                      f"actions: {list(SESSION_ACTIONS)} (use do_action for the "
                                      "others)")
            if not isinstance(body, dict):
                raise InvalidArgument(f"session request body must be a JSON object, got "
                                      f"{type(body).__name__}")
            spec = ACTIONS[name]
            self._principal.require(spec.role, name)
            if name in ASYNC_ACTIONS:
                claim_id = check_fields(body, name, ("claim_id",))["claim_id"]
                started = time.perf_counter()
                future = ASYNC_ACTIONS[name](self._store, claim_id)
                self._slots.acquire()
                self._settles.put((request_id, name, started, future))
                return
            with self._metrics.timed(name):
                parts = action_results(spec.handler(self._store, body))
            self._write(frame({"id": request_id}, parts))
        except Exception as e:  # noqa: BLE001 - every request gets an answer, errors included
            self._write(error_frame(request_id, e))

    def _answer_settles(self) -> None:
        while (item := self._settles.get()) is not None:
            request_id, name, started, future = item
            try:
                self._write(frame({"id": request_id}, action_results(future.result())))
            except BaseException as e:  # noqa: BLE001 - the client gets the error as the answer
                self._write(error_frame(request_id, e))
            finally:
                self._slots.release()
                self._metrics.observe(name, time.perf_counter() - started)

    def _write(self, message: pa.Buffer) -> None:
        with self._write_lock:
            if self._broken:
                return
            try:
                self._writer.write_metadata(message)
            except (pa.ArrowException, OSError) as e:  # the client went away
                log.debug("session client gone: %s", e)
                self._broken = True
