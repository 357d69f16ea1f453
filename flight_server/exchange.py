"""``do_exchange`` subscriptions: the server pushes micro-batches, the client sends acks.

The server runs one :class:`store.subscription.Subscription` per stream. A reader thread turns the
client's messages (metadata-only writes: ack, nack, bump, resume, close) into a queue and wakes
the loop; the loop handles them in order, then pushes a micro-batch whenever one can be claimed
and fewer than ``max_in_flight`` are unacked, and otherwise sleeps until the store commits
something. Answers go out in the order of the messages. An ack is handed to the store's writer
without waiting for its commit (its answer is sent once it is durable), so the bump that follows
the last ack of a global batch is queued right behind it and may share its commit. When the
client goes away, its in-flight micro-batches are nacked so that their rows are ready again.

A ``bump`` arrives at the version group's barrier (store/barrier.py) and is answered once the
group's version advanced; the loop waits for it in steps, so that a shutdown is not held up by a
barrier still waiting for another agent's trainer.

A subscription over several tables (``"tables": [...]``) sends each micro-batch as one record
batch of :data:`flight_server.wire.MULTI_SCHEMA`: one row per table, with that table's rows as an
Arrow IPC stream (the tables' claim schemas differ, and one Flight stream has one schema). Every
message is encoded and decoded by :mod:`flight_server.wire.subscribe`.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

import pyarrow.flight as flight

from store.embedded import EmbeddedStore
from store.errors import ExpstoreError, InvalidArgument, Unavailable
from store.subscription import MicroBatch, Subscription

from . import wire
from .auth import Principal
from .errors import as_store_error
from .wire.subscribe import CLOSING, ClientMessage, MicroBatchMeta, error_reply, hello, \
    message, multi_batch, reply

log = logging.getLogger("expstore.exchange")

# Queued by an ack's Future once it is done: the loop sends the answers that are ready.
_SETTLED = ClientMessage("_settled")
#: Seconds a bump waits on the barrier between two looks at the server's shutdown.
ARRIVE_STEP = 1.0


def _error(request: Any, error: BaseException, fatal: bool = False) -> dict[str, Any]:
    # its message bounded, like every error a client is told of
    return error_reply(request, as_store_error(error), fatal)


class ExchangeSession:
    def __init__(self, store: EmbeddedStore, principal: Principal,
                 options: wire.SubscribeOptions,
                 reader: flight.MetadataRecordBatchReader,
                 writer: flight.MetadataRecordBatchWriter,
                 stopping: threading.Event | None = None) -> None:
        self._store = store
        self._stopping = stopping or threading.Event()
        self._principal = principal
        self._sub = Subscription(store, options.target, options.micro_batch_size,
                                 options.global_batch_size, **options.options)
        self._reader = reader
        self._writer = writer
        self._inbox: queue.Queue[ClientMessage | None] = queue.Queue()
        # A message _wait_for_message took out of the inbox, handled before the inbox's next:
        # putting it back would queue it behind any message that arrived meanwhile (an ack
        # behind the bump sent after it).
        self._held: list[ClientMessage | None] = []
        # Answers in message order: a reply, or an ack's Future and the reply's header.
        self._answers: collections.deque[tuple[dict[str, Any], Future | None]] = \
            collections.deque()
        self._batches: dict[str, MicroBatch] = {}
        self._done = False
        self._client_ended = threading.Event()  # the client finished its side of the stream

    def run(self) -> None:
        multi = len(self._sub.tables) > 1
        self._writer.begin(wire.MULTI_SCHEMA if multi
                           else self._store.claim_schema(self._sub.table))
        self._writer.write_metadata(hello(self._sub.table, self._sub.version,
                                          self._sub.tables if multi else None))
        thread = threading.Thread(target=self._read_client, name="expstore-exchange-reader",
                                  daemon=True)
        thread.start()
        try:
            while not self._done:
                self._handle_messages()
                if self._done:
                    break
                if self._stopping.is_set():
                    self._say_closing()
                    break
                if self._can_deliver():
                    seen = self._store.change_seq
                    try:
                        batch = self._sub.next(timeout=0)
                    except ExpstoreError as e:
                        self._fail(e)
                        raise
                    if batch is not None:
                        self._send(batch)
                        continue
                    self._store.wait_changed(seen, 1.0)
                else:
                    self._wait_for_message(1.0)
        finally:
            self._done = True
            self._sub.close()  # nacks whatever the client never acked
            # The reader thread must be out of read_chunk() before this handler returns: the
            # stream it reads is freed then, and a read in progress would crash the process.
            # It ends when the client finishes its side or the call is cancelled.
            while thread.is_alive():
                thread.join(1.0)
            self._let_go_of_stream()

    def _let_go_of_stream(self) -> None:
        """Drop our references to the call's reader and writer before the handler returns.

        An ack's Future holds this session (its done-callback, :meth:`_settled`) until the
        store's writer has committed it, which can be after the handler returned: when the
        server stops, or when the client went away with acks in flight. Whoever drops the last
        reference to the session would then destroy the call's reader and writer after the
        call was freed, and corrupt the heap (see ActionSession._let_go_of_stream). Only this
        handler's thread writes to the stream, and it is done."""
        self._reader = self._writer = None  # type: ignore[assignment]

    def _say_closing(self) -> None:
        """The server is shutting down: ask the client to end its side of the stream (our
        reader thread, and so this handler, can only finish once it does)."""
        try:
            self._writer.write_metadata(message(CLOSING))
        except Exception as e:  # noqa: BLE001 - the client is gone: its stream ends anyway
            log.debug("could not announce the shutdown: %s", e)

    def _fail(self, error: ExpstoreError) -> None:
        """Tell the client the subscription failed, then wait for it to end the stream."""
        try:
            self._writer.write_metadata(message(_error(None, error, fatal=True)))
        except Exception as e:  # noqa: BLE001 - the client is gone: its stream ends anyway
            log.debug("could not report the subscription error: %s", e)

    # -- client messages -----------------------------------------------------------------------
    def _read_client(self) -> None:
        try:
            while True:
                chunk = self._reader.read_chunk()
                if chunk.app_metadata is None:
                    continue
                self._inbox.put(ClientMessage.decode(chunk.app_metadata.to_pybytes()))
                self._store.wake()
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001 - a broken stream ends the session
            log.debug("exchange client stream ended: %s", e)
        self._client_ended.set()
        self._inbox.put(None)
        self._store.wake()

    def _wait_for_message(self, timeout: float) -> None:
        if self._held:
            return
        try:
            self._held.append(self._inbox.get(timeout=timeout))
        except queue.Empty:
            pass

    def _handle_messages(self) -> None:
        while True:
            if self._held:
                msg = self._held.pop()
            else:
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    return
            if msg is None or msg.type == "close":
                self._send_answers(wait=True)
                self._done = True
                return
            if msg is not _SETTLED:
                self._answers.append(self._answer(msg))
            self._send_answers()

    def _send_answers(self, wait: bool = False) -> None:
        """Send the answers that are ready, in message order (``wait``: all of them)."""
        while self._answers:
            answer, future = self._answers[0]
            if future is not None:
                if not (wait or future.done()):
                    return
                try:
                    answer = {**answer, **future.result()}
                except Exception as e:  # noqa: BLE001 - a failed commit: the client gets it
                    answer = _error(answer["request"], e)
            self._answers.popleft()
            self._writer.write_metadata(message(answer))

    def _settled(self, _: Future) -> None:
        self._inbox.put(_SETTLED)
        self._store.wake()

    def _answer(self, msg: ClientMessage) -> tuple[dict[str, Any], Future | None]:
        """Handle one message: its reply, or for an ack the reply's header and the Future that
        completes it."""
        kind = msg.type
        request = msg.request
        try:
            if msg.unreadable is not None:
                raise InvalidArgument(f"subscription message {msg.unreadable} is not a JSON "
                                      "object; expected one such as {\"type\": \"ack\", "
                                      "\"claim_id\": …, \"request\": 1}")
            if kind in ("ack", "nack"):
                self._principal.require("writer", kind)
                claim_id = msg.claim_id
                batch = self._batches.pop(claim_id, None) if isinstance(claim_id, str) else None
                if batch is None:
                    raise InvalidArgument(f"claim {claim_id!r} is not in flight on this "
                                          "subscription")
                if kind == "nack":
                    return reply("nacked", request, **batch.nack()), None
                future = self._sub.ack_async(batch)
                future.add_done_callback(self._settled)
                return reply("acked", request), future
            if kind == "bump":
                self._principal.require("admin", "bump_version")
                return reply("bumped", request, version=self._arrive(msg.weights_uri)), None
            if kind == "resume":
                self._sub.resume()
                return reply("resumed", request), None
            raise InvalidArgument(f"unknown subscription message type {kind!r}; expected ack, "
                                  "nack, bump, resume or close")
        except ExpstoreError as e:
            return _error(request, e), None

    def _arrive(self, weights_uri: Any) -> int:
        """Arrive at the barrier for the subscription's tables and start the next global batch
        at the group's new version."""
        self._sub.check_can_bump()
        # The acks answered before the bump are durable first: a trainer that sent them
        # without waiting hears of them before a wait on other agents' trainers.
        self._send_answers(wait=True)
        tables = self._sub.tables if len(self._sub.tables) > 1 else self._sub.table
        while True:
            if self._stopping.is_set():
                raise Unavailable("the server is shutting down while this bump waited at the "
                                  "barrier; arrive again once it is back")
            if self._client_ended.is_set():
                # Nobody is left to answer; the arrival stays, as a trainer's that arrived and
                # then died does (soft state, until the round completes or times out).
                raise Unavailable("the subscription was closed while its bump waited at the "
                                  "barrier")
            answer = self._store.arrive_poll(tables, expected=self._sub.version,
                                             weights_uri=weights_uri, timeout=ARRIVE_STEP)
            if answer["complete"]:
                self._sub.advance(int(answer["version"]))
                return self._sub.version

    # -- micro-batches -------------------------------------------------------------------------
    def _can_deliver(self) -> bool:
        # Not while an ack is unanswered: a client reads its answer before the micro-batch
        # whose slot the ack freed.
        return not self._answers and not self._sub.at_boundary and \
            len(self._batches) < self._sub.max_in_flight

    def _send(self, batch: MicroBatch) -> None:
        self._batches[batch.claim_id] = batch
        multi = len(self._sub.tables) > 1
        meta = MicroBatchMeta(batch.claim_id, batch.index, batch.is_boundary, batch.version,
                              batch.global_batch, batch.num_rows,
                              {name: t.num_rows for name, t in batch.tables.items()}
                              if multi else None)
        if multi:
            record = multi_batch(batch.tables)
        else:
            # (never empty: a subscription's claim takes at least micro_batch_size rows)
            record = batch.data.combine_chunks().to_batches()[0]
        self._writer.write_with_metadata(record, meta.encode())
