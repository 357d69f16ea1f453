"""The client side of a ``do_exchange`` subscription (see flight_server/exchange.py).

A reader thread receives the server's messages: micro-batches go to a queue the iterator reads,
answers to acks, nacks and bumps resolve the futures their callers wait on. No polling: the
server pushes a micro-batch as soon as enough rows are ready. A sender thread writes the
client's messages in the order they were made, so that ``ack(wait=False)`` returns without
waiting for the stream (a write took a noticeable share of the trainer's time between two
micro-batches).
"""
from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.flight as flight

from store.errors import ExpstoreError, InvalidArgument, StoreClosed, Unavailable
from store.subscription import STOP_POLL_SECONDS, BumpStopped, MicroBatch, check_can_bump, \
    rows_of_all
from store.waits import check_wait

from .wire.errors import from_flight
from .wire.subscribe import ClientMessage, MicroBatchMeta, SubscribeOptions, reply_error, \
    server_message, tables_of_multi_batch


@dataclass
class RemoteMicroBatch(MicroBatch):
    """A micro-batch pushed by the server; ack and nack travel on the subscription's stream."""

    _sub: "RemoteSubscription"  # type: ignore[assignment]

    def ack(self, wait: bool = True) -> Any:
        """Ack; with ``wait=False`` return at once with a Future of the answer. Messages are
        handled in order, so a later ``bump_version`` still follows this ack."""
        return self._sub._settle(self, "ack", wait)

    def nack(self, wait: bool = True) -> Any:
        return self._sub._settle(self, "nack", wait)


class RemoteSubscription:
    """Iterator of micro-batches pushed by the server; same interface as
    :class:`store.subscription.Subscription`."""

    def __init__(self, remote: Any, table: str | list[str], micro_batch_size: int,
                 global_batch_size: int, *, idle_timeout: float | None = None,
                 **options: Any) -> None:
        self.idle_timeout = check_wait(idle_timeout, "idle_timeout")  # before the stream opens
        self._remote = remote
        self.tables = [table] if isinstance(table, str) else list(table)
        self.table = self.tables[0] if self.tables else ""
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.max_in_flight = int(options.get("max_in_flight") or 2)
        self._lease_seconds = options.get("lease_seconds")
        self._unsettled: set[str] = set()
        command = SubscribeOptions(table if isinstance(table, str) else self.tables,
                                   micro_batch_size, global_batch_size, options)
        descriptor = flight.FlightDescriptor.for_command(command.encode())
        try:
            self._writer, self._reader = remote.open_exchange(descriptor)
        except (flight.FlightError, pa.ArrowException) as e:
            raise from_flight(e) from None
        try:
            first = self._reader.read_chunk()
            hello = server_message(first.app_metadata.to_pybytes() if first.app_metadata
                                   else None)
        except (flight.FlightError, pa.ArrowException) as e:
            self._close_refused()
            raise from_flight(e) from None
        error = reply_error(hello)
        if error is None and hello.get("type") != "subscribed":
            error = ExpstoreError(f"malformed subscription hello from the server: {hello!r}")
        if error is not None:
            self._close_refused()
            raise error
        self.version = int(hello["version"])
        self.global_batch = 0
        self._batches: queue.Queue[RemoteMicroBatch | BaseException | None] = queue.Queue()
        self._pending: dict[int, Future] = {}
        # Once the stream has ended (the server stopped, was killed, or ended the subscription)
        # no answer can come: every message waiting for one, and every later one, fails with
        # this error at once. _pending_lock orders that against new messages.
        self._ended: ExpstoreError | None = None
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        # Messages to write, in order: (bytes, request id), or None to end our side.
        self._outbox: queue.SimpleQueue[tuple[bytes, int | None] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_messages,
                                        name="expstore-subscriber-send", daemon=True)
        self._sender.start()
        self._at_boundary = False
        self._delivered = 0  # micro-batches of this global batch handed to the trainer
        self._thread = threading.Thread(target=self._receive, name="expstore-subscriber",
                                        daemon=True)
        self._thread.start()

    # -- receiving -------------------------------------------------------------------------
    def _receive(self) -> None:
        error: ExpstoreError | None = None
        try:
            while True:
                chunk = self._reader.read_chunk()
                meta = server_message(chunk.app_metadata.to_pybytes()
                                      if chunk.app_metadata else None)
                if meta.get("type") == "micro_batch":
                    batch = MicroBatchMeta.of(meta)
                    if batch.tables is not None:  # several tables: a row per table, as IPC
                        tables = tables_of_multi_batch(chunk.data)
                        data = rows_of_all(tables)
                    else:
                        data = pa.Table.from_batches([chunk.data])
                        tables = {self.table: data}
                    self._batches.put(RemoteMicroBatch(
                        data, self.table, batch.claim_id, batch.index, batch.is_boundary,
                        batch.version, batch.global_batch, self, tables))
                elif meta.get("type") == "closing":
                    # The server is shutting down and waits for us to end our side.
                    error = Unavailable("the server is shutting down; subscribe again once it "
                                        "is back")
                    with self._lock:
                        try:
                            self._writer.done_writing()
                        except (flight.FlightError, pa.ArrowException):
                            pass
                    break
                elif meta.get("type") == "error" and meta.get("fatal"):
                    # The server ended the subscription: next() raises it; close() finishes the
                    # stream, which the server waits for.
                    error = reply_error(meta)
                    break
                else:
                    request = meta.get("request")
                    with self._pending_lock:
                        future = (self._pending.pop(request, None) if isinstance(request, int)
                                  else None)
                    if future is not None:
                        future.set_result(meta)
        except StopIteration:
            pass
        except (flight.FlightError, pa.ArrowException) as e:
            if not self._closed:
                error = _stream_error(e)
        finally:
            ended = error or (StoreClosed("the subscription is closed") if self._closed else
                              Unavailable("the server ended the subscription stream; subscribe "
                                          "again once it is back"))
            with self._pending_lock:
                self._ended = ended
                pending, self._pending = list(self._pending.values()), {}
            for future in pending:
                if not future.done():
                    future.set_exception(_copy(ended))
            self._batches.put(error)

    def _send(self, msg: ClientMessage) -> Future:
        """Send a message; the Future resolves to its answer (or raises its error)."""
        if self._closed:
            raise StoreClosed("the subscription is closed")
        request = next(self._ids)
        answer: Future = Future()
        result: Future = Future()
        with self._pending_lock:
            if self._ended is not None:
                result.set_exception(_copy(self._ended))
                return result
            self._pending[request] = answer

        def unwrap(f: Future) -> None:
            try:
                reply = f.result()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                result.set_exception(e)
                return
            error = reply_error(reply)
            if error is not None:
                result.set_exception(error)
            else:  # the answer as the store's methods give it, without the stream's fields
                result.set_result({k: v for k, v in reply.items() if k not in ("type", "request")})

        answer.add_done_callback(unwrap)
        message = msg._replace(request=request)
        self._outbox.put((message.encode(), request))
        return result

    def _send_messages(self) -> None:
        while (item := self._outbox.get()) is not None:
            payload, request = item
            try:
                with self._lock:
                    self._writer.write_metadata(pa.py_buffer(payload))
            except Exception as e:  # noqa: BLE001 - this thread must go on: its caller hears
                with self._pending_lock:
                    future = self._pending.pop(request, None) if request is not None else None
                if future is not None and not future.done():
                    future.set_exception(_stream_error(e) if isinstance(
                        e, (flight.FlightError, pa.ArrowException)) else e)
        try:
            with self._lock:
                self._writer.write_metadata(pa.py_buffer(ClientMessage("close").encode()))
                self._writer.done_writing()
        except (flight.FlightError, pa.ArrowException):
            pass

    def _request(self, msg: ClientMessage) -> dict[str, Any]:
        return _answer(self._send(msg), str(msg.type))

    # -- the iterator ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[RemoteMicroBatch]:
        return self

    def __next__(self) -> RemoteMicroBatch:
        batch = self.next(self.idle_timeout)
        if batch is None:
            raise StopIteration
        return batch

    def next(self, timeout: float | None = None) -> RemoteMicroBatch | None:
        """The next micro-batch, waiting up to ``timeout`` seconds (None: forever; 0: only one
        here now); None when none came. As the embedded subscription's (store/waits.py)."""
        timeout = check_wait(timeout, "next")
        if self._at_boundary:
            raise InvalidArgument("the global batch is complete: call bump_version() (or "
                                  "resume()) before asking for the next micro-batch")
        if len(self._unsettled) >= self.max_in_flight:
            # The server will not push more (flow control): waiting would never end.
            raise InvalidArgument(f"{len(self._unsettled)} micro-batches are in flight "
                                  f"(max_in_flight={self.max_in_flight}); ack or nack one first")
        try:
            item = self._batches.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None or isinstance(item, BaseException):
            self._batches.put(item)  # later calls see the end too
            if isinstance(item, BaseException):
                raise item
            return None
        if item.is_boundary:
            self._at_boundary = True
        self._unsettled.add(item.claim_id)
        self._delivered = item.index + 1
        return item

    def renew(self, batch: MicroBatch, lease_seconds: float | None = None) -> dict[str, Any]:
        """Renew a micro-batch's lease (see :meth:`MicroBatch.renew`): a ``renew`` request of
        the store's own, beside the stream (a renewal needs no order with the stream's acks)."""
        if lease_seconds is None:
            lease_seconds = self._lease_seconds
        return self._remote.renew(batch.claim_id, lease_seconds=lease_seconds)

    def _settle(self, batch: RemoteMicroBatch, kind: str, wait: bool = True) -> Any:
        if self._closed or batch.claim_id not in self._unsettled:
            # Settled already (or nacked when the subscription closed): the stream no longer
            # knows it, the store answers as for any claim, as an embedded subscription's does
            # (a second ack is a duplicate; a nack after an ack, lease_expired).
            settle = self._remote.ack if kind == "ack" else self._remote.nack
            if wait:
                return settle(batch.claim_id)
            done: Future = Future()
            try:
                done.set_result(settle(batch.claim_id))
            except ExpstoreError as e:
                done.set_exception(e)
            return done
        answer = self._send(ClientMessage(kind, claim_id=batch.claim_id))
        # The server frees the slot when it handles the message, before any later message.
        self._unsettled.discard(batch.claim_id)
        if kind == "nack":
            self._at_boundary = False  # the rows come back; their slot is free (as embedded)
            self._delivered -= 1
        return _answer(answer, kind) if wait else answer

    @property
    def at_boundary(self) -> bool:
        return self._at_boundary

    def bump_version(self, weights_uri: str | None = None, *,
                     stop: threading.Event | None = None) -> int:
        """Arrive at the version group's barrier (see :class:`store.subscription.Subscription`):
        answered once the group's version advanced. No client timeout: the server answers
        ``barrier_timeout`` when the group's barrier timeout passes.

        ``stop`` ends the wait as it does embedded (:class:`store.subscription.BumpStopped`;
        the arrival stays on the server). The bump is still pending on the stream, so the
        subscription must then be closed: the server gives up waiting for its caller within
        one of its barrier steps once the stream's client side has ended (a round that
        completes before then advances the group as usual; only its answer is not read)."""
        # Checked here too, against what the trainer was handed: the server may have pushed
        # the global batch's last micro-batch already, before the trainer took it.
        check_can_bump(self.tables, self.global_batch, self._delivered,
                       self.global_batch_size // self.micro_batch_size, self._at_boundary,
                       self._unsettled)
        # No ANSWER_TIMEOUT here: the barrier may wait for another agent's trainer for as long
        # as the group's barrier timeout (the server answers then); a stream that ends fails
        # this Future at once.
        pending = self._send(ClientMessage("bump", weights_uri=weights_uri))
        while True:
            try:
                answer = pending.result(None if stop is None else STOP_POLL_SECONDS)
                break
            except FutureTimeout:
                if stop is not None and stop.is_set():
                    raise BumpStopped(f"stopped while waiting at the barrier; the arrival of "
                                      f"{self.tables} at version {self.version} stays") from None
        self.version = int(answer["version"])
        self.global_batch += 1
        self._at_boundary = False
        self._delivered = 0
        return self.version

    def resume(self) -> None:
        self._request(ClientMessage("resume"))
        self.global_batch += 1
        self._at_boundary = False
        self._delivered = 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.put(None)  # after every message sent before: then close, done_writing
        self._sender.join(timeout=10)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            # The server did not end the stream (a handler stuck in a long wait): cancel the
            # call rather than wait for it in close().
            try:
                self._reader.cancel()
            except (flight.FlightError, pa.ArrowException):
                pass
            self._thread.join(timeout=10)
        try:
            self._writer.close()
        except (flight.FlightError, pa.ArrowException):
            pass

    def _close_refused(self) -> None:
        """End the call of a subscription the server refused. Closing the writer raises the
        call's error again; left to the garbage collector, pyarrow prints it on stderr
        ("Close() failed: …") long after the caller handled it."""
        try:
            self._writer.close()
        except (flight.FlightError, pa.ArrowException):
            pass

    def __enter__(self) -> "RemoteSubscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Seconds a caller waits for the answer to an ack, nack, bump or resume of a live stream.
ANSWER_TIMEOUT = 120.0


def _answer(future: Future, what: str) -> dict[str, Any]:
    """The answer of ``future``; a server that stays silent is Unavailable, not a bare
    TimeoutError (a stream that ended fails its futures at once, see _receive)."""
    try:
        return future.result(ANSWER_TIMEOUT)
    except FutureTimeout:
        raise Unavailable(f"no answer to the {what} within {ANSWER_TIMEOUT:g} s: the server is "
                          "overloaded or unreachable") from None


def _stream_error(error: BaseException) -> ExpstoreError:
    """The store error of a broken subscription stream: the server's typed error where it sent
    one, else Unavailable (the connection dropped: the server stopped or died)."""
    translated = from_flight(error)
    if not isinstance(translated, ExpstoreError) or type(translated) is ExpstoreError or \
            isinstance(translated, (InvalidArgument, Unavailable)):
        # (gRPC's own words, e.g. "Stream removed (Socket closed)", say neither what broke
        # nor what to do)
        return Unavailable(f"the subscription stream broke (the server stopped or the "
                           f"connection dropped): {translated}; its micro-batches not acked "
                           "are delivered again: subscribe again once the server is back")
    return translated


def _copy(error: ExpstoreError) -> ExpstoreError:
    """A fresh exception of the same class (one raised in several threads would gather all of
    their tracebacks)."""
    return type(error)(str(error))
