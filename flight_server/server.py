"""The Arrow Flight service over an embedded store.

Verbs (the wire contract is docs/protocol.md):

* ``list_flights`` / ``get_flight_info`` / ``get_schema``: one flight per experience table;
* ``do_put`` with ``FlightDescriptor.for_path(table)``: upsert a stream of record batches, each
  answered with JSON metadata once durable;
* ``do_get`` with a JSON ticket ``{"sql": …, "params"?: […], "timeout"?: s}``: read-only SQL;
* ``do_exchange`` with ``{"subscribe": {…}}``: a micro-batch subscription (flight_server.exchange);
  with ``{"session": {}}``: claims, acks and nacks on one stream (flight_server.session);
* ``do_action``: the table in flight_server.actions.

Every message is encoded and decoded by :mod:`flight_server.wire`.

>>> from flight_server.server import ExpstoreFlightServer    # doctest: +SKIP
>>> with ExpstoreFlightServer("./expstore.duckdb", port=0) as server:
...     print(server.location)
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.flight as flight

from store.embedded import EmbeddedStore
from store.errors import InvalidArgument, NotFound, Unavailable

from . import wire
from .actions import ACTIONS, claim_stream_table, run_action
from .auth import AuthMiddlewareFactory, Principal, load_tokens, principal_of
from .errors import flight_errors, to_flight
from .exchange import ExchangeSession
from .metrics import Metrics
from .session import ActionSession

log = logging.getLogger("expstore.server")

# The IPC options of the record-batch streams do_get answers with (claims, queries): given, so
# that pyarrow does not read its legacy-format settings from the environment on every call.
STREAM_OPTIONS = pa.ipc.IpcWriteOptions()

# Batches of one do_put committed concurrently: later batches are queued to the writer while
# earlier ones are committing, so a stream runs at group-commit speed, not one fsync per batch,
# and the writer commits many batches as one DuckDB transaction, whose COMMIT costs less per
# row when larger: narrow batches went through the server faster with 32 in flight than with 8
# (A/B in docs/bench/history.md, "The round of 2026-11-24 10:10"). The byte bound keeps wide
# batches (tens of MB each) from holding gigabytes (wide unchanged); one batch always goes.
PUT_PIPELINE = 32
PUT_PIPELINE_BYTES = 128 << 20


class ExpstoreFlightServer(flight.FlightServerBase):
    """Serve an experience store over Arrow Flight.

    Args:
        db: the DuckDB file (opened as an :class:`EmbeddedStore`), or an open store.
        host, port: where to listen (port 0 picks a free one; see :attr:`port`).
        tokens_file: JSON tokens file turning on bearer-token auth (see flight_server.auth).
        tls_cert, tls_key: PEM files turning on TLS (``grpc+tls://``).
        metrics_port: serve Prometheus metrics over HTTP on this port (0: a free one); with a
            tokens file, a scrape needs one of its bearer tokens.
        metrics_host: the address the metrics endpoint listens on (default: ``host``).
        store_options: passed to :class:`EmbeddedStore`.
    """

    def __init__(self, db: str | EmbeddedStore, *, host: str = "127.0.0.1", port: int = 8815,
                 tokens_file: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, metrics_port: int | None = None,
                 metrics_host: str | None = None, put_pipeline_bytes: int = PUT_PIPELINE_BYTES,
                 **store_options: Any) -> None:
        tls = None
        scheme = "grpc"
        if tls_cert or tls_key:
            if not (tls_cert and tls_key):
                raise InvalidArgument("TLS needs both a certificate and a key file")
            with open(tls_cert, "rb") as c, open(tls_key, "rb") as k:
                tls = [flight.CertKeyPair(c.read(), k.read())]
            scheme = "grpc+tls"
        middleware = {}
        self.auth_enabled = tokens_file is not None
        auth = AuthMiddlewareFactory(load_tokens(tokens_file)) if tokens_file is not None \
            else None
        if auth is not None:
            middleware["auth"] = auth
        self._owns_store = not isinstance(db, EmbeddedStore)
        self.store: EmbeddedStore = db if isinstance(db, EmbeddedStore) else \
            EmbeddedStore(db, **store_options)
        # Everything a call uses exists before the base class binds the port: it serves
        # calls from then on, before serve() is called.
        self.host = host
        self.scheme = scheme
        # the bytes of one do_put stream's batches received but not yet answered, at most
        self.put_pipeline_bytes = put_pipeline_bytes
        self.flight_sql = _flight_sql_handler(self.store)
        self._stopping = threading.Event()
        self._sessions: set[ActionSession] = set()
        self._sessions_lock = threading.Lock()
        # pyarrow's shutdown() may be called once only (a second call releases its reference to
        # this object again): later calls wait for the first to finish.
        self._shutdown_lock = threading.Lock()
        self._shut_down = False
        self.metrics = Metrics(self.store)
        self.metrics_host = metrics_host or host
        # /metrics binds first: a port it cannot have then fails before Flight serves, and the
        # store is closed again (its file lock released) whichever of the two fails.
        try:
            self.metrics_port = self.metrics.serve(metrics_port, self.metrics_host, auth) \
                if metrics_port is not None else None
            super().__init__(f"{scheme}://{host}:{port}", tls_certificates=tls,
                             middleware=middleware)
        except BaseException:
            self.metrics.close()
            if self._owns_store:
                self.store.close()
            raise

    @property
    def location(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    # -- helpers -----------------------------------------------------------------------------
    def _principal(self, context: flight.ServerCallContext, role: str, what: str) -> Principal:
        principal = principal_of(context)
        with flight_errors():
            principal.require(role, what)
        return principal

    def _table_of(self, descriptor: flight.FlightDescriptor) -> str:
        if descriptor.descriptor_type != flight.DescriptorType.PATH or len(descriptor.path) != 1:
            raise InvalidArgument("expected a descriptor FlightDescriptor.for_path(<table>) with "
                                  "one path element")
        name = descriptor.path[0]
        return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)

    def _flight_info(self, table: str) -> flight.FlightInfo:
        schema = self.store.write_schema(table)
        descriptor = flight.FlightDescriptor.for_path(table)
        ticket = flight.Ticket(wire.table_ticket(table))
        endpoint = flight.FlightEndpoint(ticket, [])
        return flight.FlightInfo(schema, descriptor, [endpoint], -1, -1)

    # -- listing -----------------------------------------------------------------------------
    def list_flights(self, context: flight.ServerCallContext, criteria: bytes) -> Iterator:
        self._principal(context, "reader", "list_flights")
        with flight_errors():
            infos = [self._flight_info(t) for t in self.store.list_tables()]
        yield from infos

    def get_flight_info(self, context: flight.ServerCallContext,
                        descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        self._principal(context, "reader", "get_flight_info")
        with flight_errors():
            if self.flight_sql is not None and self.flight_sql.is_flight_sql_descriptor(descriptor):
                return self.flight_sql.get_flight_info(context, descriptor)
            return self._flight_info(self._table_of(descriptor))

    def get_schema(self, context: flight.ServerCallContext,
                   descriptor: flight.FlightDescriptor) -> flight.SchemaResult:
        self._principal(context, "reader", "get_schema")
        with flight_errors():
            if self.flight_sql is not None and self.flight_sql.is_flight_sql_descriptor(descriptor):
                return self.flight_sql.get_schema(context, descriptor)
            return flight.SchemaResult(self.store.write_schema(self._table_of(descriptor)))

    # -- writes -------------------------------------------------------------------------------
    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader,
               writer: flight.FlightMetadataWriter) -> None:
        if self.flight_sql is not None and self.flight_sql.is_flight_sql_descriptor(descriptor):
            self._principal(context, "reader", "flight sql")
            with flight_errors():
                return self.flight_sql.do_put(context, descriptor, reader, writer)
        self._principal(context, "writer", "do_put")
        with flight_errors(), self.metrics.timed("do_put"):
            table = self._table_of(descriptor)
            self.store.describe(table)  # an unknown table fails before any batch is read
            answers = _PutAnswers(writer, PUT_PIPELINE, self.put_pipeline_bytes)
            index = 0
            # A large batch is checked and serialised on a pool thread while this one receives
            # the next; one at a time, so batches reach the writer (and answers) in stream order.
            preparing: Future | None = None
            try:
                try:
                    chunk_stream = iter(reader)
                except (OSError, pa.ArrowException) as e:
                    raise _client_gone_or(e, context) from e
                for chunk in _read_or_gone(chunk_stream, context):
                    answers.raise_failure()
                    if chunk.data is None or chunk.data.num_rows == 0:
                        continue
                    if preparing is not None:
                        preparing.result()  # a batch that failed preparation ends the stream
                    nbytes = chunk.data.nbytes
                    answers.reserve(nbytes)
                    if nbytes >= PREPARE_APART_BYTES:
                        preparing = _PREPARE_POOL.submit(self._queue_batch, answers, index,
                                                         table, chunk.data)
                    else:
                        self._queue_batch(answers, index, table, chunk.data)
                    index += 1
                if preparing is not None:
                    preparing.result()
            except ClientGone as e:
                answers.client_gone(e)
            finally:
                if preparing is not None:  # (the stream may have broken while a batch was
                    wait_futures([preparing])  # prepared: it is queued or answered either way)
                # Answer (or fail on) every batch already handed to the writer, in order.
                answers.finish()
            if answers.gone is not None:
                # Not an error of the server's: one line, no traceback (the batches handed to
                # the writer are stored all the same; an at-least-once producer sends again).
                log.info("do_put to %r: the client went away after %d batches (%s); the "
                         "batches received are stored, their answers were not delivered",
                         table, index, answers.gone)
                raise answers.gone
            answers.raise_failure()

    def _queue_batch(self, answers: "_PutAnswers", index: int, table: str,
                     data: pa.RecordBatch) -> None:
        """Prepare and queue one batch of a do_put (room for it reserved), and queue its answer
        at once: a client may wait for this answer before it sends the next batch. A batch that
        fails preparation is answered with its error at once, and the error is raised to the
        handler, which ends the stream before it queues another batch."""
        try:
            future = self.store.put_async(table, data)
        except BaseException as e:
            failed: Future = Future()
            failed.set_exception(e)
            answers.submit(index, failed, data.nbytes)
            raise
        answers.submit(index, future, data.nbytes)

    # -- reads ---------------------------------------------------------------------------------
    def do_get(self, context: flight.ServerCallContext,
               ticket: flight.Ticket) -> flight.FlightDataStream:
        raw = ticket.ticket
        # A ticket of our own is a JSON object, and a Flight SQL ticket (a protobuf Any, its
        # first field's tag first) never starts with "{": only other tickets are parsed as
        # protobuf to find out, which was a share of a small claim's time in the handler.
        if self.flight_sql is not None and not raw.startswith(b"{") \
                and self.flight_sql.is_flight_sql_ticket(ticket):
            self._principal(context, "reader", "flight sql")
            with flight_errors():
                return self.flight_sql.do_get(context, ticket)
        principal = self._principal(context, "reader", "do_get")
        with flight_errors():
            doc = wire.ticket_document(raw)
        if wire.is_claim_ticket(doc):
            return self._claim_stream(principal, doc)
        with flight_errors(), self.metrics.timed("do_get"):
            sql = wire.sql_ticket(doc, self.store.query_timeout)
            result = self.store.query(sql.sql, sql.params, timeout=sql.timeout)
            return flight.RecordBatchStream(result, options=STREAM_OPTIONS)

    def _claim_stream(self, principal: Principal, doc: dict[str, Any]) -> flight.FlightDataStream:
        """A ticket ``{"claim": {<claim body>}}``: the claim action, answered as a stream."""
        with flight_errors(), self.metrics.timed("claim"):
            principal.require("writer", "do_get claim")
            body = wire.claim_ticket(doc).body
            return flight.RecordBatchStream(claim_stream_table(self.store, body),
                                            options=STREAM_OPTIONS)

    # -- subscriptions --------------------------------------------------------------------------
    def do_exchange(self, context: flight.ServerCallContext,
                    descriptor: flight.FlightDescriptor,
                    reader: flight.MetadataRecordBatchReader,
                    writer: flight.MetadataRecordBatchWriter) -> None:
        command = descriptor.command \
            if descriptor.descriptor_type == flight.DescriptorType.CMD else b""
        if wire.is_session(command):
            # each request on a session is checked against its own action's role
            self._serve_session(self._principal(context, "reader", "do_exchange"), reader,
                                writer)
            return
        principal = self._principal(context, "writer", "do_exchange")
        with flight_errors():
            if descriptor.descriptor_type != flight.DescriptorType.CMD:
                raise InvalidArgument("do_exchange expects FlightDescriptor.for_command("
                                      "'{\"subscribe\": {…}}') or '{\"session\": {}}'")
            options = wire.parse_subscribe(command)
            session = ExchangeSession(self.store, principal, options, reader, writer,
                                      self._stopping)
        try:
            session.run()
        except flight.FlightError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken client stream ends the session
            log.debug("subscription ended: %s", e)

    def _serve_session(self, principal: Principal, reader: flight.MetadataRecordBatchReader,
                       writer: flight.MetadataRecordBatchWriter) -> None:
        session = ActionSession(self.store, principal, self.metrics, reader, writer)
        with self._sessions_lock:
            if self._stopping.is_set():
                raise to_flight(Unavailable("the server is shutting down"))
            self._sessions.add(session)
        try:
            session.run()
        except Exception as e:  # noqa: BLE001 - a broken client stream ends the session
            log.debug("session ended: %s", e)
        finally:
            with self._sessions_lock:
                self._sessions.discard(session)

    # -- actions ---------------------------------------------------------------------------------
    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        actions = [(a.name, f"[{a.role}] {a.description}") for a in ACTIONS.values()]
        if self.flight_sql is not None:
            actions += [(a.type, a.description) for a in self.flight_sql.list_actions()]
        return actions

    def do_action(self, context: flight.ServerCallContext,
                  action: flight.Action) -> Iterator[bytes]:
        if self.flight_sql is not None and self.flight_sql.is_flight_sql_action(action.type):
            self._principal(context, "reader", "flight sql")
            with flight_errors():
                results = list(self.flight_sql.do_action(context, action))
            yield from results
            return
        spec = ACTIONS.get(action.type)
        if spec is None:
            raise to_flight(NotFound(f"unknown action {action.type!r}; actions: "
                                     f"{sorted(ACTIONS)}"))
        self._principal(context, spec.role, action.type)
        with flight_errors(), self.metrics.timed(action.type):
            body = wire.parse_body(action.body.to_pybytes() if action.body else b"",
                                   action.type)
            out = run_action(spec, self.store, body)
        yield from out

    # -- lifecycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop serving: open subscriptions are told to close, then in-flight calls finish."""
        with self._sessions_lock:
            self._stopping.set()
            sessions = list(self._sessions)
        for session in sessions:
            session.close()
        # Long polls (a producer's wait_version, a trainer's barrier arrival) last minutes:
        # ended here, they do not hold the shutdown for its grace.
        self.store.end_waits("the server is shutting down; call again once it is back")
        with self._shutdown_lock:
            if not self._shut_down:
                super().shutdown()
                self._shut_down = True
        if not self._owns_store:
            self.store.end_waits(None)

    def open_sessions(self) -> int:
        """Action sessions open now (each holds a call until its client ends it)."""
        with self._sessions_lock:
            return len(self._sessions)

    def close_store(self) -> None:
        """Close the store (if this server opened it) and the metrics endpoint. :meth:`close`
        does this after the shutdown; called alone, it does not wait for open calls: for a
        process that exits next because its shutdown is stuck on a call that does not end (see
        expstore.serve). Calls still open then fail with StoreClosed."""
        self.metrics.close()
        if self._owns_store:
            self.store.close()

    def close(self) -> None:
        """Stop serving and close the store (if this server opened it)."""
        try:
            self.shutdown()
        finally:
            self.close_store()

    def __exit__(self, *exc: object) -> None:
        self.close()


# Batches of at least this many bytes are prepared on _PREPARE_POOL, while the next batch is
# received (a wide batch's preparation is long enough to be worth overlapping); smaller ones
# inline, where a hand-off costs more than it overlaps.
PREPARE_APART_BYTES = 1 << 20
_PREPARE_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="expstore-put-prepare")
_ANSWER_POOL = ThreadPoolExecutor(max_workers=512, thread_name_prefix="expstore-put-answers")


class ClientGone(Unavailable):
    """The client of a call went away (disconnected, killed) in the middle of it."""


def _client_gone_or(error: BaseException, context: flight.ServerCallContext) -> BaseException:
    """``error`` of a stream read, or ClientGone when the call was cancelled under it (the
    client disconnected): then it is no failure of the server, nor bad input."""
    if context.is_cancelled():
        return ClientGone(f"the call was cancelled: {error}")
    return error


def _read_or_gone(chunks: Iterator, context: flight.ServerCallContext) -> Iterator:
    """A do_put's chunks; a read that fails because the client went away raises ClientGone."""
    while True:
        try:
            chunk = next(chunks)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            raise _client_gone_or(e, context) from e
        yield chunk


class _PutAnswers:
    """Answers a do_put's batches, in order, each as soon as its commit is durable.

    The answers are written from their own thread because the handler's thread spends its time
    blocked reading the next batch: a client that waits for batch k's answer before it sends
    batch k+1 (a producer pacing itself on durability) would otherwise never be answered.
    At most ``limit`` batches and ``limit_bytes`` wait for their answer (a larger batch waits
    until none does); the reading side blocks beyond that.
    """

    def __init__(self, writer: flight.FlightMetadataWriter, limit: int, limit_bytes: int) -> None:
        self._writer = writer
        self._queue: queue.Queue[tuple[int, Future, int] | None] = queue.Queue()
        self._limit, self._limit_bytes = limit, limit_bytes
        self._in_flight = self._in_flight_bytes = 0
        self._room = threading.Condition()
        self._failure: BaseException | None = None
        #: Set once the client went away (an answer could not be written, or a read failed).
        self.gone: ClientGone | None = None
        # A pooled thread, not a new one per call: one-sample puts are mostly this overhead.
        self._done = _ANSWER_POOL.submit(self._run)

    def reserve(self, nbytes: int) -> None:
        """Wait for room for a batch of ``nbytes``, before it is handed to the writer."""
        with self._room:
            while self._in_flight and (self._in_flight >= self._limit or
                                       self._in_flight_bytes + nbytes > self._limit_bytes):
                self._room.wait()
            self._in_flight += 1
            self._in_flight_bytes += nbytes

    def submit(self, index: int, future: Future, nbytes: int) -> None:
        """Queue the answer of a batch ``reserve`` made room for."""
        self._queue.put((index, future, nbytes))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            index, future, nbytes = item
            try:
                result = future.result()
                if self._failure is None:
                    self._write(wire.put_answer(index, result))
            except BaseException as e:  # noqa: BLE001 - handed to the handler's thread
                if self._failure is None:
                    self._failure = e
                    # The handler's thread only raises this once it reads the client's next
                    # message; a client waiting for this batch's answer learns of it now.
                    self._write(wire.put_error_answer(index, e))
            finally:
                with self._room:
                    self._in_flight -= 1
                    self._in_flight_bytes -= nbytes
                    self._room.notify()

    def _write(self, answer: bytes) -> None:
        try:
            self._writer.write(pa.py_buffer(answer))
        except (pa.ArrowException, OSError) as e:  # the client went away
            self.client_gone(ClientGone(f"an answer could not be written: {e}"))

    def client_gone(self, error: ClientGone) -> None:
        """Note that the client went away: no more answers are written."""
        if self.gone is None:
            self.gone = error
        if self._failure is None:
            self._failure = error

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def finish(self) -> None:
        """Wait until every submitted batch is answered (or failed); then let go of the call's
        writer, which must be destroyed inside the call (see ActionSession._let_go_of_stream)."""
        self._queue.put(None)
        self._done.result()
        self._writer = None  # type: ignore[assignment]


def _flight_sql_handler(store: EmbeddedStore) -> Any:
    """The Flight SQL handler, when that part of the server is installed."""
    try:
        from .sql_executor import make_handler
    except ImportError:  # protobuf missing: our own protocol still works
        log.warning("Flight SQL is off: %s", "protobuf is not installed")
        return None
    return make_handler(store)
