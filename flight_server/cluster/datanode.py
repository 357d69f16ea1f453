"""A data node: a small Flight server holding the by-reference values written on its machine.

Values arrive in a ``do_put`` (one chunk per column of each batch, appended to this node's
:class:`store.blobs.BlobStore` and fsynced before the answer), leave in a ``do_get`` of the rows a
consumer claimed. With ``replicas: 2`` the node forwards each batch to a second data node and
answers only once both hold it. The node registers with the coordinator, and again every
``HEARTBEAT_SECONDS``: a restarted coordinator learns the nodes from their next heartbeat.

With the cluster's tokens (:mod:`flight_server.cluster.security`) every call needs a bearer token
(reads: reader, puts: writer, the coordinator's ``copy_chunks`` and ``collect``: admin), and the
node presents the node token to the coordinator and its peers; with its certificate it serves
``grpc+tls://``.

>>> with DataNodeServer("/tmp/dn-doc", "dn-doc", port=0) as node:   # doctest: +SKIP
...     print(node.location)
"""
from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.flight as flight

from store.blob_chunks import Chunk, ColumnChunk, read_only, serialize_chunk_buffer
from store.blobs import BlobStore
from store.errors import InvalidArgument, NotFound, Unavailable
from store.types import one_array, parse_type

from .. import wire
from ..auth import principal_of
from ..errors import flight_errors, from_flight
from .locations import Holder, check_node_id, chunk_location
from .security import NO_SECURITY, ClusterSecurity

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0
#: how long a forward to a replica may take before the put fails (the producer retries)
REPLICA_TIMEOUT = 30.0


class DataNodeServer(flight.FlightServerBase):
    """Serve one machine's by-reference values.

    Args:
        root: the directory of this node's blob segments (created if missing).
        node_id: the node's name in location keys (letters, digits, ``_.-``).
        host, port: where to listen (port 0: a free one).
        coordinator: the coordinator's ``grpc://`` URI to register with (None: unregistered,
            e.g. in tests of the node alone).
        placement: where the node runs, e.g. its Ray node id; producers and consumers that run
            there prefer this node.
        security: the cluster's tokens and TLS material (default: none).
    """

    def __init__(self, root: str, node_id: str, *, host: str = "127.0.0.1", port: int = 0,
                 coordinator: str | None = None, placement: str | None = None,
                 security: ClusterSecurity = NO_SECURITY) -> None:
        self.node_id = check_node_id(node_id)
        self.blobs = BlobStore(root)
        self.host = host
        self.placement = placement
        self.coordinator = coordinator
        self.security = security
        self.counters = {"bytes_received": 0, "bytes_served": 0, "chunks_written": 0,
                         "replica_puts": 0, "chunks_copied": 0, "segments_removed": 0,
                         "bytes_freed": 0}
        self._write_lock = threading.Lock()
        self._peers: list[dict[str, Any]] = []
        self._clients: dict[str, flight.FlightClient] = {}
        self._clients_lock = threading.Lock()
        self._forwarder = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dn-replica")
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        super().__init__(f"{security.scheme}://{host}:{port}", **security.server_options())

    @property
    def location(self) -> str:
        return f"{self.security.scheme}://{self.host}:{self.port}"

    # -- registration ------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Register with the coordinator now and every HEARTBEAT_SECONDS (re-registration is
        how a restarted coordinator learns this node again)."""
        if self.coordinator is None or self._heartbeat is not None:
            return
        self._register_once()
        self._heartbeat = threading.Thread(target=self._beat, name=f"dn-heartbeat-{self.node_id}",
                                           daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self._register_once()
            except Exception as e:  # noqa: BLE001 - the coordinator may be restarting
                log.info("data node %s: registering with the coordinator failed (%s); retrying",
                         self.node_id, e)

    def _register_once(self) -> None:
        assert self.coordinator is not None
        body = {"node_id": self.node_id, "location": self.location,
                "placement": self.placement}
        client = self._client(self.coordinator)
        try:
            results = list(client.do_action(wire.action("register_node", body),
                                            self.security.options(10)))
        except flight.FlightError as e:
            raise from_flight(e) from None
        answer = wire.json_result([r.body.to_pybytes() for r in results], "register_node")
        self._peers = [n for n in answer["nodes"] if n["node_id"] != self.node_id and n["alive"]]

    def _client(self, location: str) -> flight.FlightClient:
        with self._clients_lock:
            client = self._clients.get(location)
            if client is None:
                client = self._clients[location] = self.security.client(location)
            return client

    # -- writes --------------------------------------------------------------------------------
    def do_put(self, context: flight.ServerCallContext, descriptor: flight.FlightDescriptor,
               reader: flight.MetadataRecordBatchReader,
               writer: flight.FlightMetadataWriter) -> None:
        with flight_errors():
            principal_of(context).require("writer", "a data node's do_put")
            replicas = wire.put_command_of(descriptor)
            index = 0
            for chunk in reader:
                batch = chunk.data
                if batch is None or batch.num_rows == 0:
                    continue
                chunks = self._store_batch(batch, replicas)
                writer.write(pa.py_buffer(wire.node_put_answer(index, batch.num_rows, chunks)))
                index += 1

    def _store_batch(self, batch: pa.RecordBatch, replicas: int) -> dict[str, str]:
        """Write a batch's columns here (and on a peer for replicas=2); durable on return."""
        forward = self._forwarder.submit(self._forward, batch) if replicas == 2 else None
        chunks = [_chunk_of(one_array(col)) for col in batch.columns]
        with self._write_lock:
            try:
                prefixes = [self.blobs.append(c) for c in chunks]
                self.blobs.sync()
            except BaseException:
                self.blobs.rollback()
                raise
            self.counters["bytes_received"] += sum(len(c) for c in chunks)
            self.counters["chunks_written"] += len(chunks)
        holders = [[Holder(self.node_id, p)] for p in prefixes]
        if forward is not None:
            peer_id, peer_chunks = forward.result()
            for i, name in enumerate(batch.schema.names):
                holders[i].append(Holder(peer_id, peer_chunks[name].split("@", 1)[1]))
        return {name: chunk_location(h) for name, h in zip(batch.schema.names, holders)}

    def _forward(self, batch: pa.RecordBatch) -> tuple[str, dict[str, str]]:
        """Put ``batch`` on another live data node (replicas=1 there); its node id and chunks."""
        if not self._peers and self.coordinator is not None:
            self._register_once()       # the peers we knew may be stale: ask again
        errors = []
        for peer in _ring_after(self.node_id, self._peers):
            try:
                descriptor = flight.FlightDescriptor.for_command(wire.put_command(1))
                client = self._client(peer["location"])
                w, answers = client.do_put(descriptor, batch.schema,
                                           self.security.options(REPLICA_TIMEOUT))
                try:
                    w.write_batch(batch)
                    w.done_writing()
                    answer = answers.read()
                finally:
                    w.close()           # a refused put's error comes from here
                if answer is None:
                    errors.append(f"{peer['node_id']}: the put ended without an answer")
                    continue
                self.counters["replica_puts"] += 1
                return peer["node_id"], wire.chunks_of_answer(answer.to_pybytes())
            except flight.FlightError as e:
                errors.append(f"{peer['node_id']}: {e}")
        raise Unavailable(f"replicas=2 needs a second live data node; none took the values "
                          f"({'; '.join(errors) or 'no other node is registered'})")

    # -- reads ---------------------------------------------------------------------------------
    def do_get(self, context: flight.ServerCallContext,
               ticket: flight.Ticket) -> flight.RecordBatchStream:
        with flight_errors():
            principal_of(context).require("reader", "a data node's do_get")
            fetch = wire.parse_fetch_ticket(ticket.ticket)
            table = pa.table({f"c{i}": self.blobs.resolve(c.keys, parse_type(c.type))
                              for i, c in enumerate(fetch.columns)})
            self.counters["bytes_served"] += table.nbytes
            return flight.RecordBatchStream(table)

    # -- actions ---------------------------------------------------------------------------------
    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return [(name, f"[{role}] {text}") for name, (role, text) in _ACTIONS.items()]

    def do_action(self, context: flight.ServerCallContext,
                  action: flight.Action) -> Iterator[bytes]:
        with flight_errors():
            if action.type not in _ACTIONS:
                raise NotFound(f"unknown data node action {action.type!r}; actions: "
                               f"{sorted(_ACTIONS)}")
            principal_of(context).require(_ACTIONS[action.type][0], action.type)
            body = wire.parse_body(action.body.to_pybytes() if action.body else b"",
                                   action.type)
            answer = getattr(self, f"_action_{action.type}")(wire.check_body(action.type, body))
        yield wire.encode(answer)

    def _action_health(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.health()

    def _action_copy_chunks(self, body: dict[str, Any]) -> dict[str, Any]:
        """Copy whole chunks of this node to the data node at ``to`` (a do_put there, one batch
        per chunk): how the coordinator restores a second copy after a loss."""
        chunks, to = body["chunks"], body["to"]
        if not isinstance(chunks, list) or not all(isinstance(c, str) and _CHUNK.fullmatch(c)
                                                    for c in chunks):
            raise InvalidArgument(f"copy_chunks chunks {str(chunks)[:200]!r} are invalid; "
                                  "expected a list of 'segment:offset:length'")
        if not isinstance(to, str) or "://" not in to:
            raise InvalidArgument(f"copy_chunks to {to!r} is invalid; expected the target "
                                  "node's grpc://host:port")
        by_type: dict[pa.DataType, list[tuple[str, pa.Array]]] = {}
        for chunk in chunks:
            values = self.blobs.chunk(chunk)
            by_type.setdefault(values.type, []).append((chunk, values))
        copies: dict[str, str] = {}
        client = self._client(to)
        for value_type, group in by_type.items():
            schema = pa.schema([("v", value_type)])
            descriptor = flight.FlightDescriptor.for_command(wire.put_command(1))
            try:
                writer, answers = client.do_put(descriptor, schema,
                                                self.security.options(REPLICA_TIMEOUT))
                try:
                    for chunk, values in group:
                        writer.write_batch(pa.record_batch([values], schema=schema))
                        answer = answers.read()
                        if answer is None:
                            break           # refused: writer.close() raises why
                        copies[chunk] = wire.chunks_of_answer(answer.to_pybytes())["v"]
                    writer.done_writing()
                finally:
                    writer.close()
                missing = [chunk for chunk, _ in group if chunk not in copies]
                if missing:
                    raise Unavailable(f"data node {to} ended the copy of {len(missing)} "
                                      "chunk(s) without answering")
            except flight.FlightError as e:
                raise from_flight(e) from None
        self.counters["chunks_copied"] += len(copies)
        return {"copies": copies}

    def _action_collect(self, body: dict[str, Any]) -> dict[str, Any]:
        """Delete the segments holding no live value: those not in ``live_segments`` and not
        written in the last ``grace_seconds`` (keys of a put may still be on their way to the
        coordinator), never the one being written, which is rolled first."""
        live, grace = body["live_segments"], body["grace_seconds"]
        if not isinstance(live, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                 and x >= 0 for x in live):
            raise InvalidArgument(f"collect live_segments {str(live)[:200]!r} are invalid; "
                                  "expected a list of segment numbers (integers ≥ 0)")
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise InvalidArgument(f"collect grace_seconds {grace!r} is invalid; expected a "
                                  "number ≥ 0")
        with self._write_lock:
            self.blobs.roll()
            answer = self.blobs.collect(live, keep_newer_than=time.time() - grace)
        self.counters["segments_removed"] += answer["segments_removed"]
        self.counters["bytes_freed"] += answer["bytes_freed"]
        return {**answer, "segments": len(self.blobs.segments())}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "node_id": self.node_id, "location": self.location,
                "placement": self.placement, "segments": len(self.blobs.segments()),
                **self.counters}

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self.shutdown()
        self._forwarder.shutdown(wait=False)
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


_ACTIONS: dict[str, tuple[str, str]] = {
    "health": ("reader", "The node's id, location, segments and counters. Body: {}"),
    "copy_chunks": ("admin", "Copy whole chunks to another data node. Body: {chunks: "
                             "['segment:offset:length', …], to: 'grpc://…'}. Answer: {copies: "
                             "{chunk: 'node@segment:offset:length'}}"),
    "collect": ("admin", "Delete segments holding no live value. Body: {live_segments: [n, …], "
                         "grace_seconds}. Answer: {segments_removed, bytes_freed, segments}"),
}
_CHUNK = re.compile(r"[0-9]+:[0-9]+:[0-9]+")


def _chunk_of(values: pa.Array) -> Chunk:
    """A column of a received batch as a chunk to append: serialised by the blob store when it
    writes it, into memory it reuses from one write to the next (and the values kept for reads
    as they arrived), where nothing can change them meanwhile (read-only buffers, as a Flight
    batch's are); else serialised now.

    Why: serialising each column into new memory made the kernel fault in and zero that memory
    on every put, and the write waited for the whole serialisation; written as a ColumnChunk,
    one column is serialised while the one before it is written."""
    return ColumnChunk(values) if read_only(values) else serialize_chunk_buffer(values)


def _ring_after(node_id: str, peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peers in ring order starting after ``node_id``: replicas spread over the nodes."""
    ordered = sorted(peers, key=lambda n: n["node_id"])
    later = [n for n in ordered if n["node_id"] > node_id]
    return later + [n for n in ordered if n["node_id"] <= node_id]
