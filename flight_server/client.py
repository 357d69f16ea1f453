"""The remote store: the same interface as the embedded store, over Arrow Flight.

>>> import store
>>> s = store.connect("grpc://127.0.0.1:8815", token="…")     # doctest: +SKIP
>>> s.put("solver", [{"sample_id": "q1_0_0", "reward": 1.0}])   # doctest: +SKIP
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import pyarrow as pa
import pyarrow.flight as flight

from store.claims import Claim, ClaimRequest, claim_requests
from store.sqlguard import check_query_options, check_sql_text
from store.errors import ExpstoreError, InvalidArgument, QueryTimeout, StoreClosed, Unavailable
from store.prepare import NO_ROWS, put_timeout, to_arrow_table
from store.schema import TableDef, check_column_mapping
from store.types import empty_table
from store.waits import check_wait

from . import wire
from .reachable import check_listening
from .session_client import Answer, SessionChannel, json_answer
from .wire.errors import from_flight

if TYPE_CHECKING:
    from .subscriber import RemoteSubscription

# Writes up to this size go on the session stream (one message; the server prepares small ones
# many at a time); larger ones are streamed in a do_put call of their own.
SESSION_PUT_ROWS = 64
SESSION_PUT_BYTES = 256 * 1024
# How a server that predates session puts refuses one (the client then uses do_put).
NOT_ON_SESSION = "is not served on a session"
# How a server that predates claim streams refuses a claim ticket (the client then claims on
# the session).
NO_CLAIM_TICKETS = "ticket must be a JSON object {\"sql\""
# Seconds one ``arrive`` call waits on the server (a long poll, re-sent until the barrier ends),
# and how long ``arrive`` goes on arriving again while the server cannot be reached.
ARRIVE_POLL_SECONDS = 60.0
RECONNECT_SECONDS = 120.0
CLAIM_STREAMS = ("auto", "always", "never")
# How long a client waits for a server that accepted its connection to answer, unless told.
DEFAULT_CONNECT_SECONDS = 10.0
# A claim whose answer should hold at least this many bytes comes as a do_get stream.
STREAM_CLAIM_BYTES = 512 * 1024


class _CallDefault:
    """The marker of "this client's own per-call timeout" (``RemoteStore(timeout=...)``) where
    a method's ``timeout`` was not given: an object no caller passes by accident (-1 stood for
    it once, so that ``put(timeout=-1)`` waited 60 s here and not at all embedded)."""

    def __repr__(self) -> str:
        return "<the client's timeout>"


CALL_DEFAULT: Any = _CallDefault()


class RemoteStore:
    """A client of an expstore Flight server.

    Args:
        uri: ``grpc://host:port`` or ``grpc+tls://host:port``.
        token: bearer token when the server has auth on.
        tls_root_certs: PEM bytes or a path, to trust a self-signed server certificate.
        timeout: default seconds per call (None: no limit; the rule of every wait,
            store/waits.py: negative, NaN or infinite values are refused).
        connect_timeout: seconds to wait for the server, a server still starting included
            (its port refusing connections until it listens). None (the default): fail at once
            where nothing listens (a refused connection: a wrong port, no server running), and
            wait up to DEFAULT_CONNECT_SECONDS for a server that accepts the connection to
            answer.
        sessions: send claims, acks, nacks and small puts on one long-lived ``do_exchange``
            session (a fraction of a ``do_action`` or ``do_put`` call's cost); False: one call
            each (what a server without sessions, from before they existed, needs).
        claim_streams: how ``claim`` answers travel: ``"auto"`` (default) as a ``do_get``
            record-batch stream when the table's rows in its last claim make the answer
            likely to hold at least STREAM_CLAIM_BYTES, or when nothing is known of its rows
            yet (the table's first claim from this client), else on the session;
            ``"always"`` or ``"never"`` as a stream. ``claim_many`` answers always come on the
            session.
    """

    def __init__(self, uri: str, *, token: str | None = None,
                 tls_root_certs: bytes | str | None = None, timeout: float | None = 60.0,
                 connect_timeout: float | None = None, sessions: bool = True,
                 claim_streams: str = "auto") -> None:
        if claim_streams not in CLAIM_STREAMS:
            raise InvalidArgument(f"claim_streams {claim_streams!r} is unknown; expected one of "
                                  f"{list(CLAIM_STREAMS)}")
        self.uri = uri
        if uri.startswith("grpc+tcp://"):
            uri = "grpc://" + uri[len("grpc+tcp://"):]
        kwargs: dict[str, Any] = {}
        if tls_root_certs is not None:
            if isinstance(tls_root_certs, str):
                with open(tls_root_certs, "rb") as f:
                    tls_root_certs = f.read()
            kwargs["tls_root_certs"] = tls_root_certs
        self._client = flight.FlightClient(uri, **kwargs)
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._timeout = check_wait(timeout, "RemoteStore")
        self._defs: dict[str, TableDef] = {}
        self._closed = False
        self._session: SessionChannel | None = None
        self._session_lock = threading.Lock()
        self._use_sessions = sessions
        self.claim_streams = claim_streams
        self._row_bytes: dict[str, float] = {}  # per table: bytes a row, in its last claim
        # per table: the fingerprint and claim schema the server last sent in a claim answer
        self._claim_schemas: dict[str, tuple[str, pa.Schema]] = {}
        self._claim_streams: bool | None = None  # whether the server serves them (None: unknown)
        self._wait_ready(check_wait(connect_timeout, "connect"))

    def _wait_ready(self, timeout: float | None) -> None:
        if timeout is None:
            check_listening(self.uri)
            timeout = DEFAULT_CONNECT_SECONDS
        try:
            self._client.wait_for_available(timeout=timeout)
        except (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError):
            return  # it answered (wait_for_available sends no token): the server is up
        except flight.FlightError as e:
            hint = ""
            if "handshake" in str(e).lower():
                hint = ("; the TLS handshake failed: the server serves no TLS (use grpc://), or "
                        "its certificate is not trusted (tls_root_certs, CLI --tls-root-certs)")
            raise Unavailable(f"no expstore server answers at {self.uri}: {e}{hint}") from None

    def _options(self, timeout: float | None = CALL_DEFAULT) -> flight.FlightCallOptions:
        t = self._timeout if timeout is CALL_DEFAULT else timeout
        return flight.FlightCallOptions(headers=self._headers, timeout=t)

    def call_timeout(self, timeout: Any, what: str) -> float | None:
        """A caller's ``timeout`` for ``what`` in seconds (None: no limit), this client's own
        where none was given (:data:`CALL_DEFAULT`).

        Raises:
            InvalidArgument: a negative, NaN or infinite timeout (store/waits.py).
        """
        return self._timeout if timeout is CALL_DEFAULT else check_wait(timeout, what)

    @contextmanager
    def _calls(self) -> Iterator[None]:
        try:
            yield
        except (flight.FlightError, pa.ArrowException) as e:
            raise from_flight(e) from None

    def _action(self, name: str, body: dict[str, Any] | None = None,
                timeout: float | None = CALL_DEFAULT) -> list[bytes]:
        with self._calls():
            results = self._client.do_action(wire.action(name, body), self._options(timeout))
            return [r.body.to_pybytes() for r in results]

    def _json(self, name: str, body: dict[str, Any] | None = None,
              timeout: float | None = CALL_DEFAULT) -> Any:
        return wire.json_result(self._action(name, body, timeout), name)

    def call_action(self, name: str, body: dict[str, Any] | None = None) -> Any:
        """Run the server's action ``name`` with a JSON ``body``; its JSON answer (for actions
        this class has no method for, e.g. a coordinator's ``cluster`` and ``report_lost``)."""
        return self._json(name, body)

    def open_exchange(self, descriptor: flight.FlightDescriptor
                      ) -> tuple[flight.FlightStreamWriter, flight.FlightStreamReader]:
        """Start a ``do_exchange`` stream (a subscription's), with this client's headers and
        no time limit; its writer and reader."""
        return self._client.do_exchange(descriptor, self._options(None))

    # -- tables --------------------------------------------------------------------------------
    def create_table(self, name: str, columns: Mapping[str, Any], *, if_not_exists: bool = False,
                     max_staleness: int = 0, version_group: str | None = None,
                     max_deliveries: int = 5, lease_seconds: float = 60.0,
                     storage: Mapping[str, str] | None = None,
                     required: list[str] | None = None) -> dict[str, Any]:
        """See :meth:`store.embedded.EmbeddedStore.create_table`."""
        check_column_mapping(name, columns)
        body = {"name": name, "columns": {k: _type_spelling(v) for k, v in columns.items()},
                "if_not_exists": if_not_exists, "max_staleness": max_staleness,
                "version_group": version_group, "max_deliveries": max_deliveries,
                "lease_seconds": lease_seconds, "storage": storage, "required": required}
        return self._json("create_table", body)

    def drop_table(self, name: str, *, if_exists: bool = False) -> bool:
        self._defs.pop(name, None)
        return bool(self._json("drop_table", {"name": name, "if_exists": if_exists})["dropped"])

    def list_tables(self) -> list[str]:
        return list(self._json("list_tables")["tables"])

    def describe(self, name: str) -> dict[str, Any]:
        return self._json("describe", {"table": name})

    def _tdef(self, name: str) -> TableDef:
        tdef = self._defs.get(name)
        if tdef is None:
            tdef = wire.table_def(self.describe(name))
            self._defs[name] = tdef
        return tdef

    def schema(self, name: str) -> pa.Schema:
        return self._tdef(name).arrow_schema()

    def claim_schema(self, name: str) -> pa.Schema:
        return self._tdef(name).claim_schema()

    def write_schema(self, name: str) -> pa.Schema:
        return self._tdef(name).write_schema()

    # -- writes --------------------------------------------------------------------------------
    def put(self, table: str, data: Any, *,
            timeout: float | None = CALL_DEFAULT) -> dict[str, Any]:
        """Upsert rows; returns once the server answered that they are durable. ``timeout``
        as embedded (None: as long as it takes, 0: no wait; store/waits.py); not given: this
        client's per-call timeout."""
        seconds = self.call_timeout(timeout, "put")   # refused before anything is sent
        try:
            return self._put(table, data, seconds)
        except (TimeoutError, QueryTimeout):  # a put runs no query: the caller's time ran out
            raise put_timeout(table, seconds) from None

    def _put(self, table: str, data: Any, timeout: float | None) -> dict[str, Any]:
        arrow = self._arrow(table, data)
        channel = self._channel() if self._on_session(arrow) else None
        if channel is not None and channel.carries_puts is not False:
            try:
                answer = self._put_on_session(channel, table, arrow).result(timeout)
            except InvalidArgument as e:
                if channel.carries_puts is not None or NOT_ON_SESSION not in str(e):
                    raise
                channel.carries_puts = False  # a server from before session puts: do_put
            else:
                channel.carries_puts = True
                return answer
        answers = self.put_batches(table, arrow.to_batches(), arrow.schema, timeout=timeout)
        # One answer per batch on the wire; the caller gets the embedded store's shape.
        return {"rows": sum(a["rows"] for a in answers), "version": answers[-1]["version"]}

    def put_async(self, table: str, data: Any) -> Future:
        """:meth:`put` without waiting: the Future resolves to its answer once the rows are
        durable, or raises what put would. Small writes go out on the session at once (many
        can be in flight; the session's first one waits, to learn whether the server takes
        puts on sessions); a large one is streamed before this returns."""
        arrow = self._arrow(table, data)
        channel = self._channel() if self._on_session(arrow) else None
        if channel is not None and channel.carries_puts:  # (unknown before a first put(): wait)
            return self._put_on_session(channel, table, arrow)
        return _answered(lambda: self.put(table, arrow))

    def _arrow(self, table: str, data: Any) -> pa.Table:
        if isinstance(data, pa.Table):
            return data
        if isinstance(data, pa.RecordBatch):
            return pa.Table.from_batches([data])
        return to_arrow_table(self._tdef(table), data)

    def _on_session(self, arrow: pa.Table) -> bool:
        """Small writes go on the session (a message on an open stream, not a new call)."""
        if not (self._use_sessions and 0 < arrow.num_rows <= SESSION_PUT_ROWS):
            return False
        # get_total_buffer_size is cheap but counts whole buffers, also where the rows are a
        # slice of a larger table (a producer writing one row of a batch it holds): those are
        # measured again by nbytes, which counts only the rows' bytes (many times dearer).
        return (arrow.get_total_buffer_size() <= SESSION_PUT_BYTES
                or arrow.nbytes <= SESSION_PUT_BYTES)

    @staticmethod
    def _put_on_session(channel: SessionChannel, table: str, arrow: pa.Table) -> Answer:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, arrow.schema) as w:
            w.write_table(arrow)
        return json_answer(channel.call("put", {"table": table},
                                        [sink.getvalue().to_pybytes()]), "put")

    def put_batches(self, table: str, batches: list[pa.RecordBatch], schema: pa.Schema,
                    *, timeout: float | None = CALL_DEFAULT) -> list[dict[str, Any]]:
        seconds = self.call_timeout(timeout, "put")
        answers: list[dict[str, Any]] = []
        with self._calls():
            writer, meta = self._client.do_put(flight.FlightDescriptor.for_path(table), schema,
                                               self._options(seconds))
            try:
                for batch in batches:
                    if batch.num_rows:
                        writer.write_batch(batch)
                writer.done_writing()
                while True:
                    buf = meta.read()
                    if buf is None:
                        break
                    answers.append(wire.parse_put_answer(buf.to_pybytes()))
            finally:
                writer.close()
        if not answers:
            raise InvalidArgument(NO_ROWS)
        return answers

    # -- claims --------------------------------------------------------------------------------
    def claim(self, table: str, limit: int, *, where: str | None = None,
              group_by: str | None = None, group_size: int | None = None,
              consumer: str | None = None, lease_seconds: float | None = None,
              min_rows: int = 1, ack: str | None = None) -> Claim:
        """A claim; with ``ack``, that claim is acked first, in the same request: the answer
        comes once the ack is durable, and the claim's work overlapped the ack's commit (see
        ``EmbeddedStore.ack_and_claim``)."""
        request = ClaimRequest(table, limit, where, group_by, group_size, min_rows)
        if self._streams_claims(table, limit):
            claim = self._claim_streamed(request, consumer, lease_seconds, ack)
        elif ack is not None:
            body = wire.claim_body(request, consumer, lease_seconds, ack)
            claim = self._claim_on_session("claim", body, [table])
            if not claim.claim_id:
                claim = self._empty_claim(claim, [request])
        else:
            claim = self.claim_many([request], consumer=consumer, lease_seconds=lease_seconds)
        if claim.data.num_rows:
            # (the decoded answer's own buffers: their total is its size, and cheap to take)
            self._row_bytes[table] = claim.data.get_total_buffer_size() / claim.data.num_rows
        return claim

    def _streams_claims(self, table: str, limit: int) -> bool:
        """Whether a claim comes as a do_get stream (see docs/protocol.md): when its answer is
        expected to be large, from the size of the table's rows in its last claim. A stream
        sends the Arrow buffers as they are, where a session answer copies them into and out
        of one gRPC message; but it is a call of its own, dearer than a message on the open
        session when the answer is small (A/B in BENCHMARKS.md, issue 30).

        A table's first claim, whose size nothing tells yet, comes as a stream: for a small
        answer the call costs little more than the session's message, once; a large one (a
        table of wide by-reference rows, often read by a few large claims) is spared the copies
        through one message, which cost it several times more."""
        if self.claim_streams == "never" or self._claim_streams is False:
            return False
        if self.claim_streams == "always":
            return True
        row_bytes = self._row_bytes.get(table)
        return row_bytes is None or row_bytes * limit >= STREAM_CLAIM_BYTES

    def _claim_streamed(self, request: ClaimRequest, consumer: str | None,
                        lease_seconds: float | None, ack: str | None = None) -> Claim:
        body = wire.claim_body(request, consumer, lease_seconds, ack)
        ticket = flight.Ticket(wire.ClaimTicket(body).encode())
        try:
            with self._calls():
                data = self._client.do_get(ticket, self._options()).read_all()
        except InvalidArgument as e:
            if self._claim_streams is not None or NO_CLAIM_TICKETS not in str(e):
                raise
            self._claim_streams = False  # a server from before claim streams: the session
            if ack is not None:
                self.ack(ack)
            return self.claim_many([request], consumer=consumer, lease_seconds=lease_seconds)
        self._claim_streams = True
        return wire.claim_of_stream(request.table, data)

    def claim_many(self, requests: list[ClaimRequest], *, consumer: str | None = None,
                   lease_seconds: float | None = None) -> Claim:
        requests = claim_requests(requests)
        body = wire.claim_many_body(requests, consumer, lease_seconds)
        claim = self._claim_on_session("claim_many", body, [r.table for r in requests])
        return claim if claim.claim_id else self._empty_claim(claim, requests)

    def _claim_on_session(self, action: str, body: dict[str, Any], tables: list[str]) -> Claim:
        """Send a claim and decode its answer. On a session the request names the claim schemas
        this client holds (learned from earlier answers), and the server sends those tables'
        rows as a record batch without the schema (docs/protocol.md)."""
        channel = self._channel()
        if channel is None:
            return wire.claim_of_results(self._action(action, body))
        held = self._claim_schemas
        known = {t: held[t] for t in tables if t in held}
        answer = channel.call(action, body, schemas={t: fp for t, (fp, _) in known.items()})
        learned: dict[str, tuple[str, pa.Schema]] = {}
        claim = wire.claim_of_results(answer.result(self._timeout),
                                      {t: schema for t, (_, schema) in known.items()}, learned)
        held.update(learned)
        return claim

    def _empty_claim(self, claim: Claim, requests: list[ClaimRequest]) -> Claim:
        """Nothing was claimed: the answer carries no stream, so the empty tables come from the
        claim schemas this client knows (as an embedded store's empty claim has them)."""
        claim.tables = {r.table: empty_table(self.claim_schema(r.table)) for r in requests}
        return claim

    def ack(self, claim_id: str) -> dict[str, Any]:
        """Mark a claim's rows consumed; durable on return; acking twice is harmless."""
        return self.ack_async(claim_id).result(self._timeout)

    def nack(self, claim_id: str) -> dict[str, Any]:
        return self.nack_async(claim_id).result(self._timeout)

    def ack_async(self, claim_id: str) -> Future:
        """:meth:`ack` without waiting: the Future resolves to its answer once it is durable
        (a trainer can claim its next micro-batch meanwhile), or raises what ack would."""
        return json_answer(self._fast("ack", {"claim_id": claim_id}), "ack")

    def nack_async(self, claim_id: str) -> Future:
        """:meth:`nack` without waiting (see :meth:`ack_async`)."""
        return json_answer(self._fast("nack", {"claim_id": claim_id}), "nack")

    def renew(self, claim_id: str, *, lease_seconds: float | None = None) -> dict[str, Any]:
        """Extend an active claim's lease to ``lease_seconds`` from now (None: its tables'
        ``lease_seconds``); answers ``{"claim_id", "expires_at"}`` (see
        :meth:`store.embedded.EmbeddedStore.renew`). On the session when there is one."""
        body: dict[str, Any] = {"claim_id": claim_id}
        if lease_seconds is not None:
            body["lease_seconds"] = lease_seconds
        return json_answer(self._fast("renew", body), "renew").result(self._timeout)

    def _fast(self, name: str, body: dict[str, Any]) -> Answer:
        """Send a hot-path request on the session stream (a do_action call where the server
        has none); the answer's parts come from the returned Future."""
        channel = self._channel()
        if channel is not None:
            return channel.call(name, body)
        return _answered(lambda: self._action(name, body))

    def _channel(self) -> "SessionChannel | None":
        """The open session, opened on first use and again after the last one broke (a
        restarted server); None when sessions are off."""
        with self._session_lock:
            if self._closed:
                raise StoreClosed("this RemoteStore is closed")
            if not self._use_sessions:
                return None
            if self._session is None or self._session.failed:
                with self._calls():
                    self._session = SessionChannel(self._client, self._headers)
            return self._session

    # -- versions ------------------------------------------------------------------------------
    def get_version(self, table: str) -> int:
        return int(self._json("get_version", {"table": table})["version"])

    def weights_uri(self, table: str) -> str | None:
        return self._json("get_version", {"table": table})["weights_uri"]

    def bump_version(self, table: str, *, expected: int | None = None,
                     weights_uri: str | None = None) -> int:
        body: dict[str, Any] = {"table": table}
        if expected is not None:
            body["expected"] = expected
        if weights_uri is not None:
            body["weights_uri"] = weights_uri
        return int(self._json("bump_version", body)["version"])

    def arrive(self, tables: str | list[str], *, expected: int,
               weights_uri: str | None = None) -> int:
        """Arrive at the version group's barrier (see :meth:`EmbeddedStore.arrive`): long
        polls until every member arrived and the group's version advanced. Arrivals are soft
        state on the server: after it restarts, this arrives again (the same ``expected``
        answers at once if the barrier completed before the restart)."""
        body: dict[str, Any] = {"tables": [tables] if isinstance(tables, str) else list(tables),
                                "expected": expected, "timeout": ARRIVE_POLL_SECONDS}
        if weights_uri is not None:
            body["weights_uri"] = weights_uri
        lost_since: float | None = None
        while True:
            try:
                answer = self._json("arrive", body, timeout=ARRIVE_POLL_SECONDS + 30)
            except Unavailable:
                # The server went away (a restart forgets arrivals): arrive again once it is
                # back, for as long as a restart may take.
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > RECONNECT_SECONDS:
                    raise
                time.sleep(0.5)
                continue
            lost_since = None
            if answer["complete"]:
                return int(answer["version"])

    def set_barrier_timeout(self, table: str, seconds: float) -> float:
        return float(self._json("set_barrier_timeout", {"table": table,
                                                        "seconds": seconds})["seconds"])

    def barrier(self, table: str) -> dict[str, Any]:
        return self._json("barrier", {"table": table})

    def wait_version(self, table: str, min_version: int, timeout: float | None = None) -> int:
        """Long-poll the server until the version reaches ``min_version`` (no client polling:
        each call blocks server-side for up to 300 s). ``timeout`` as embedded (None: no
        limit, 0: the current version at once; store/waits.py)."""
        timeout = check_wait(timeout, "wait_version")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = 300.0 if deadline is None else max(0.0, min(300.0,
                                                                    deadline - time.monotonic()))
            answer = self._json("wait_version", {"table": table, "min_version": min_version,
                                                 "timeout": remaining}, timeout=remaining + 30)
            if answer["reached"] or (deadline is not None and time.monotonic() >= deadline):
                return int(answer["version"])

    # -- SQL and stats -------------------------------------------------------------------------
    def query(self, sql: str, params: list[Any] | None = None, *,
              timeout: float | None = None) -> pa.Table:
        check_query_options(params, timeout)
        ticket = wire.SqlTicket(check_sql_text(sql), params, timeout)
        with self._calls():
            reader = self._client.do_get(flight.Ticket(ticket.encode()), self._options())
            return reader.read_all()

    def stats(self, table: str | None = None) -> dict[str, Any]:
        out = self._json("stats", {"table": table} if table else {})
        for entry in out.values():
            entry["rows_per_version"] = {int(k): v for k, v in entry["rows_per_version"].items()}
        return out

    def leases(self, table: str | None = None) -> list[dict[str, Any]]:
        return self._json("leases", {"table": table} if table else {})

    def health(self) -> dict[str, Any]:
        return self._json("health")

    def gc(self, *, drop_rows: Any = (), keep_versions: Any = 0) -> dict[str, int]:
        body: dict[str, Any] = {}
        if drop_rows != ():
            body["drop_rows"] = drop_rows
        if keep_versions != 0:
            body["keep_versions"] = keep_versions
        return self._json("gc", body)

    def requeue(self, table: str, *, where: str | None = None) -> dict[str, Any]:
        """Bring the table's dead rows back (see :meth:`store.embedded.EmbeddedStore.requeue`);
        the admin role on a server with auth."""
        body: dict[str, Any] = {"table": table}
        if where is not None:
            body["where"] = where
        return self._json("requeue", body)

    def checkpoint(self) -> None:
        self._json("checkpoint")

    def subscribe(self, table: str | list[str], micro_batch_size: int, global_batch_size: int,
                  **options: Any) -> "RemoteSubscription":
        from .subscriber import RemoteSubscription
        return RemoteSubscription(self, table, micro_batch_size, global_batch_size, **options)

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        with self._session_lock:
            if self._closed:
                return
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            session.close()
        self._client.close()

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _type_spelling(value: Any) -> Any:
    if isinstance(value, pa.DataType):
        from store.types import parse_type, type_name
        return type_name(parse_type(value))
    return value


def _answered(call: Callable[[], Any]) -> Answer:
    """Run ``call`` now; its result (or store error) as an already resolved Future."""
    done = Answer()
    try:
        done.set_result(call())
    except ExpstoreError as e:
        done.set_exception(e)
    return done


__all__ = ["RemoteStore"]


if TYPE_CHECKING:
    from store.interface import Store

    def _implements_store(s: RemoteStore) -> Store:
        return s  # mypy checks that RemoteStore implements the Store protocol
