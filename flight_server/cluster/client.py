"""The client of a cluster: the :class:`RemoteStore` interface over a coordinator and its data nodes.

``store.connect("grpc://coordinator:8815")`` returns a :class:`ClusterStore` when the server is a
coordinator (its ``health`` answer has ``cluster``). A put sends the values of data-node columns
to a data node, its own machine's where there is one (else any), and only the location keys and
simple columns to the coordinator. A claim or a micro-batch arrives with location keys; the
client fetches the values from the data nodes that hold them, in parallel, its own node's
replica first, and hands the rows on with the values in place: the same Arrow tables (and torch
tensors) as from a single server.

The list of data nodes is cached for ``DIRECTORY_SECONDS``. When values are on nodes that list
calls lost, or a node cannot be reached, the client asks the coordinator for the list again, and
fetches again if the answer differs for those nodes (one registered again, or at a new location):
a stale list costs no delivery. Otherwise the claim is given back (nacked) and the node reported
to the coordinator, which dead-letters the rows whose values nobody else holds; the client claims
again. Rows are never handed on with some values missing.

>>> s = store.connect("grpc://127.0.0.1:8815")          # doctest: +SKIP
>>> s.put("solver", {"sample_id": ["q_0_0"], "response": ["..."]})   # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import os
import random
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight

from store.claims import Claim, ClaimRequest
from store.errors import ExpstoreError, InvalidArgument, Unavailable
from store.types import one_array, parse_type
from store.subscription import rows_of_all

from .. import wire
from ..client import CALL_DEFAULT, SESSION_PUT_BYTES, RemoteStore
from ..wire.errors import from_flight
from ..session_client import Answer
from ..subscriber import RemoteSubscription
from .locations import parse_key, row_keys, row_numbers

#: how long the list of data nodes is trusted before it is asked for again
DIRECTORY_SECONDS = 5.0
#: claims retried after values were found missing (each retry follows a nack and a report)
LOST_RETRIES = 5


class LostValues(Unavailable):
    """Values of a claim could not be fetched from any node holding them."""

    def __init__(self, nodes: set[str], message: str) -> None:
        super().__init__(message)
        self.nodes = nodes


def local_placement() -> str | None:
    """Where this process runs, to prefer that machine's data node: ``EXPSTORE_PLACEMENT``, else
    the Ray node id when this process is a connected Ray driver or worker, else None."""
    env = os.environ.get("EXPSTORE_PLACEMENT")
    if env:
        return env
    ray = sys.modules.get("ray")          # never imported here: only if the caller uses Ray
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return str(ray.get_runtime_context().get_node_id())
    return None


def connect_remote(uri: str, **options: Any) -> RemoteStore:
    """A :class:`RemoteStore`, or a :class:`ClusterStore` when ``uri`` is a coordinator."""
    cluster_options = {k: options.pop(k) for k in ("replicas", "placement", "fetch_threads",
                                                    "put_threads") if k in options}
    remote = RemoteStore(uri, **options)
    try:
        is_coordinator = "cluster" in remote.health()
    except ExpstoreError:
        return remote                      # (auth and the like: its own calls will say)
    if not is_coordinator:
        if cluster_options:
            remote.close()
            raise InvalidArgument(f"{uri} is not a cluster coordinator; options "
                                  f"{sorted(cluster_options)} need one")
        return remote
    remote.close()
    return ClusterStore(uri, **cluster_options, **options)


class ClusterStore(RemoteStore):
    """A store over a coordinator and its data nodes (see the module docstring).

    Args:
        uri: the coordinator.
        replicas: 1, or 2 to have each value on a second data node before the put returns.
        placement: this process's machine (default :func:`local_placement`).
        fetch_threads: how many value fetches run at once.
        put_threads: how many puts made with :meth:`put_async` send their values to data
            nodes at once (their keys still reach the coordinator in the order of the puts).
        **options: as for :class:`RemoteStore`.
    """

    def __init__(self, uri: str, *, replicas: int = 1, placement: str | None = None,
                 fetch_threads: int = 8, put_threads: int = 2, **options: Any) -> None:
        if replicas not in (1, 2) or isinstance(replicas, bool):
            raise InvalidArgument(f"replicas {replicas!r} is invalid; expected 1 or 2")
        if isinstance(put_threads, bool) or not isinstance(put_threads, int) or put_threads < 1:
            raise InvalidArgument(f"put_threads {put_threads!r} is invalid; expected an "
                                  "integer ≥ 1")
        roots = options.get("tls_root_certs")
        if isinstance(roots, str):
            with open(roots, "rb") as f:
                roots = f.read()
        #: trusted when fetching from and writing to data nodes over TLS, as for the coordinator
        self._tls_root_certs: bytes | None = roots
        super().__init__(uri, **options)
        self.replicas = replicas
        self.placement = placement if placement is not None else local_placement()
        self._directory: dict[str, Any] = {}
        self._directory_at = 0.0
        self._directory_lock = threading.Lock()
        self._node_clients: dict[str, flight.FlightClient] = {}
        self._pool = ThreadPoolExecutor(max_workers=fetch_threads,
                                        thread_name_prefix="expstore-fetch")
        self._rng = random.Random()
        #: put_async's threads (started by the first one): those sending values to data nodes,
        #: the one sending keys to the coordinator in order; and its puts not yet answered
        self._put_threads = put_threads
        self._value_senders: ThreadPoolExecutor | None = None
        self._putter: ThreadPoolExecutor | None = None
        self._putter_lock = threading.Lock()
        self._pending_puts: set[Future] = set()
        #: what this client fetched: calls, calls served by its own node, bytes
        self.fetch_stats = {"fetches": 0, "local_fetches": 0, "bytes": 0, "parallel": 0}

    # -- the directory --------------------------------------------------------------------------
    def cluster(self, refresh: bool = False) -> dict[str, Any]:
        """The coordinator's ``cluster`` answer (nodes, data-node columns, byte counters)."""
        with self._directory_lock:
            if refresh or time.monotonic() - self._directory_at > DIRECTORY_SECONDS:
                self._directory = self._json("cluster")
                self._directory_at = time.monotonic()
            return self._directory

    def _remote_columns(self, table: str) -> dict[str, str]:
        columns = self.cluster()["tables"].get(table)
        if columns is None:
            columns = self.cluster(refresh=True)["tables"].get(table, {})
        return columns

    def _nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in self.cluster()["nodes"]}

    def _node_client(self, location: str) -> flight.FlightClient:
        with self._directory_lock:
            client = self._node_clients.get(location)
            if client is None:
                kwargs = {"tls_root_certs": self._tls_root_certs} \
                    if self._tls_root_certs is not None and location.startswith("grpc+tls://") \
                    else {}
                client = self._node_clients[location] = flight.FlightClient(location, **kwargs)
            return client

    def home_node(self, exclude: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
        """The data node this process writes to: its own machine's, else any live one."""
        alive = [n for n in self.cluster()["nodes"] if n["alive"] and n["node_id"] not in exclude]
        if not alive:
            alive = [n for n in self.cluster(refresh=True)["nodes"]
                     if n["alive"] and n["node_id"] not in exclude]
        if not alive:
            raise Unavailable("no live data node is registered with the coordinator at "
                              f"{self.uri}")
        local = [n for n in alive if self.placement and n["placement"] == self.placement]
        return local[0] if local else self._rng.choice(alive)

    # -- writes ----------------------------------------------------------------------------------
    def put(self, table: str, data: Any, *,
            timeout: float | None = CALL_DEFAULT) -> dict[str, Any]:
        seconds = self.call_timeout(timeout, "put")   # refused before values go anywhere
        arrow = self._with_locations(table, self._arrow(table, data))
        return super().put(table, arrow, timeout=seconds)

    def put_async(self, table: str, data: Any) -> Future:
        """:meth:`put` without waiting: the values go to a data node on one of this client's
        ``put_threads`` (several puts' values travel at once), and the keys to the coordinator
        as soon as they are back, on the session where the put is small. Puts reach the
        coordinator in the order they were made (a put's keys wait for those of the puts
        before it), so a later put of a sample's column still wins over an earlier one. The
        Future resolves once the rows are durable, or raises what put would."""
        done: Answer = Answer()
        with self._putter_lock:
            if self._putter is None:
                self._value_senders = ThreadPoolExecutor(
                    max_workers=self._put_threads, thread_name_prefix="expstore-put-values")
                self._putter = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="expstore-put")
            self._pending_puts.add(done)
            assert self._value_senders is not None
            located = self._value_senders.submit(self._located, table, data)
            self._putter.submit(self._keys_in_order, table, located, done)
        done.add_done_callback(self._put_answered)
        return done

    def _put_answered(self, done: Future) -> None:
        with self._putter_lock:
            self._pending_puts.discard(done)

    def _located(self, table: str, data: Any) -> pa.Table:
        return self._with_locations(table, self._arrow(table, data))

    def _keys_in_order(self, table: str, located: Future, done: Future) -> None:
        """The coordinator's half of a put, on the one put thread (in the order of the puts),
        once its values are on a data node."""
        try:
            arrow = located.result()
            channel = self._channel() if self._on_session(arrow) else None
            if channel is not None and channel.carries_puts:
                keys = self._put_on_session(channel, table, arrow)
                keys.add_done_callback(lambda f: _settle(done, f))
            else:
                done.set_result(RemoteStore.put(self, table, arrow))
        except Exception as e:  # noqa: BLE001 - whatever put would raise, the Future does
            done.set_exception(e)

    def _with_locations(self, table: str, arrow: pa.Table) -> pa.Table:
        """Put the values of data-node columns on a data node; the table with their keys."""
        remote = self._remote_columns(table)
        columns = [c for c in arrow.column_names if c in remote]
        if not columns or arrow.num_rows == 0:
            return arrow
        values = pa.table({c: _as_type(one_array(arrow.column(c)), parse_type(remote[c]))
                           for c in columns})
        tried: set[str] = set()
        while True:
            node = self.home_node(exclude=tried)
            try:
                chunks = self._put_values(node["location"], values)
                break
            except (flight.FlightUnavailableError, flight.FlightTimedOutError):
                tried.add(node["node_id"])   # gone meanwhile: the next one (the coordinator
                self.cluster(refresh=True)   # learns it from the missing heartbeats)
        numbers = row_numbers(arrow.num_rows)
        for c in columns:
            keys = row_keys(chunks[c], numbers)
            if values.column(c).null_count:       # no key where no value was written
                keys = pc.if_else(pc.is_valid(values.column(c)), keys,
                                  pa.scalar(None, pa.large_string()))
            arrow = arrow.set_column(arrow.schema.get_field_index(c), c, keys)
        return arrow

    def _put_values(self, location: str, values: pa.Table) -> dict[str, str]:
        descriptor = flight.FlightDescriptor.for_command(wire.put_command(self.replicas))
        client = self._node_client(location)
        try:
            writer, answers = client.do_put(descriptor, values.schema, self._options())
            try:
                writer.write_table(values, max_chunksize=max(1, values.num_rows))
                writer.done_writing()
                answer = answers.read()
            finally:
                writer.close()          # a refused put's error comes from here
        except (flight.FlightUnavailableError, flight.FlightTimedOutError):
            raise                          # the caller tries another node
        except flight.FlightError as e:
            raise from_flight(e) from None
        if answer is None:
            raise Unavailable(f"data node {location} ended the put without an answer")
        return wire.chunks_of_answer(answer.to_pybytes())

    def _on_session(self, arrow: pa.Table) -> bool:
        """The coordinator's half of a put holds keys and simple columns: it goes on the
        session whenever it is small in bytes, however many rows it has (a ``do_put`` call of
        its own cost a producer more than the session's message)."""
        return self._use_sessions and arrow.num_rows > 0 and (
            arrow.get_total_buffer_size() <= SESSION_PUT_BYTES
            or arrow.nbytes <= SESSION_PUT_BYTES)

    # -- claims ------------------------------------------------------------------------------------
    def _streams_claims(self, table: str, limit: int) -> bool:
        return False  # a coordinator answers claims on the action (with its data nodes)

    def claim(self, table: str, limit: int, *, where: str | None = None,
              group_by: str | None = None, group_size: int | None = None,
              consumer: str | None = None, lease_seconds: float | None = None,
              min_rows: int = 1, ack: str | None = None) -> Claim:
        """See :meth:`RemoteStore.claim`; with ``ack``, the coordinator acks that claim and
        claims in one request (the ``claim`` action's ``ack``), answering once the ack is
        durable: a trainer's micro-batch costs the coordinator one request, not two."""
        request = ClaimRequest(table, limit, where, group_by, group_size, min_rows)
        if ack is None:
            return self.claim_many([request], consumer=consumer, lease_seconds=lease_seconds)
        return self._claimed("claim", wire.claim_body(request, consumer, lease_seconds, ack),
                             [request])

    def claim_many(self, requests: list[ClaimRequest], *, consumer: str | None = None,
                   lease_seconds: float | None = None) -> Claim:
        return self._claimed("claim_many",
                             wire.claim_many_body(requests, consumer, lease_seconds), requests)

    def _claimed(self, action: str, body: dict[str, Any],
                 requests: list[ClaimRequest]) -> Claim:
        """A claim (``action`` with ``body``) with its values fetched from the data nodes; given
        back and made again while values are found on unreachable nodes."""
        for _ in range(LOST_RETRIES):
            # on the session where there is one (the endpoints come from the directory)
            claim = wire.claim_of_results(self._fast(action, body).result(self._timeout))
            # a carried ack is durable once answered: a claim made again carries none
            body.pop("ack", None)
            if not claim.claim_id:
                return self._empty_claim(claim, requests)
            try:
                tables = {t: self.resolve(t, data) for t, data in claim.tables.items()}
            except LostValues as e:
                self._give_back(claim.claim_id, e.nodes)
                continue
            return dataclasses.replace(claim, tables=tables)
        raise Unavailable(f"claims kept finding values on unreachable data nodes after "
                          f"{LOST_RETRIES} tries; see the coordinator's log")

    def _give_back(self, claim_id: str, nodes: set[str]) -> None:
        """Nack a claim whose values could not all be fetched, then report the nodes (the
        coordinator dead-letters the rows only their lost nodes held, now ready again)."""
        try:
            self.nack(claim_id)
        except ExpstoreError:
            pass                                   # expired meanwhile: ready again anyway
        for node in sorted(nodes):
            self._json("report_lost", {"node_id": node})
        self.cluster(refresh=True)

    def subscribe(self, table: str | list[str], micro_batch_size: int, global_batch_size: int,
                  **options: Any) -> "ClusterSubscription":
        return ClusterSubscription(self, table, micro_batch_size, global_batch_size, **options)

    # -- fetching values ----------------------------------------------------------------------------
    def resolve(self, table: str, data: pa.Table) -> pa.Table:
        """``data`` with the location keys of data-node columns replaced by their values,
        fetched in parallel, each from a holder on this machine where there is one.

        Raises:
            LostValues: some value is on no reachable node, also by the coordinator's
                directory asked again (nothing is returned half).
        """
        remote = self._remote_columns(table)
        columns = [c for c in data.column_names if c in remote]
        if not columns or data.num_rows == 0:
            return data
        nodes = self._nodes()
        try:
            return self._resolve(data, columns, remote, nodes)
        except LostValues as e:
            # The directory is up to DIRECTORY_SECONDS old: a node it calls lost may have
            # registered again since, or moved to a new location. Giving the claim back for a
            # stale view would cost each row a delivery, so ask once more and fetch again, but
            # only where the answer differs for those nodes: a node that is gone does not make
            # the caller wait for a second timeout.
            fresh = {n["node_id"]: n for n in self.cluster(refresh=True)["nodes"]}
            if all(_reachable_as(nodes.get(n)) == _reachable_as(fresh.get(n))
                   for n in e.nodes):
                raise
            return self._resolve(data, columns, remote, fresh)

    def _resolve(self, data: pa.Table, columns: list[str], remote: dict[str, str],
                 nodes: dict[str, dict[str, Any]]) -> pa.Table:
        """:meth:`resolve` with the data nodes as ``nodes`` (node id → directory entry)."""
        plans = {c: self._plan(one_array(data.column(c)), nodes) for c in columns}
        # One request per node for all the columns it serves: the node's rows, and per column
        # the key of each row (None where that value comes from another node, or is null).
        requests: dict[str, tuple[np.ndarray, list[list[str | None]]]] = {}
        for node in {n for plan in plans.values() for n in plan}:
            rows = np.unique(np.concatenate([plan[node][1] for plan in plans.values()
                                             if node in plan]))
            aligned = []
            for c in columns:
                keyed: list[str | None] = [None] * len(rows)
                if node in plans[c]:
                    local, at = plans[c][node]
                    for i, key in zip(np.searchsorted(rows, at), local):
                        keyed[i] = key
                aligned.append(keyed)
            requests[node] = (rows, aligned)
        self.fetch_stats["parallel"] = max(self.fetch_stats["parallel"], len(requests))
        futures = {node: self._pool.submit(self._fetch, nodes[node], aligned,
                                           [remote[c] for c in columns])
                   for node, (_, aligned) in requests.items()}
        failed: set[str] = set()
        fetched: dict[str, pa.Table] = {}
        for node, future in futures.items():
            try:
                fetched[node] = future.result()
            except (flight.FlightUnavailableError, flight.FlightTimedOutError, OSError):
                failed.add(node)
            except flight.FlightError as e:  # refused (a token, a bad key): not a lost node
                raise from_flight(e) from None
        if failed:
            raise LostValues(failed, f"data node(s) {sorted(failed)} did not answer")
        for i, c in enumerate(columns):
            value_type = parse_type(remote[c])
            pieces, positions = [], []
            for node, (rows, aligned) in requests.items():
                mine = np.fromiter((k is not None for k in aligned[i]), dtype=bool,
                                   count=len(rows))
                if mine.any():
                    got = one_array(fetched[node].column(i))
                    pieces.append(got.filter(pa.array(mine)).cast(value_type))
                    positions.append(rows[mine])
            values = _scatter(pieces, positions, data.num_rows, value_type)
            data = data.set_column(data.schema.get_field_index(c),
                                   pa.field(c, value_type), values)
        return data

    def _plan(self, keys: pa.Array, nodes: dict[str, dict[str, Any]]
              ) -> dict[str, tuple[list[str], np.ndarray]]:
        """Which node serves each key: node → (its local blob keys, the rows' positions)."""
        chunk_of = pc.replace_substring_regex(keys, r"/[0-9]+$", "")
        row_of = pc.replace_substring_regex(keys, r"^.*/", "")
        encoded = pc.dictionary_encode(chunk_of).combine_chunks() \
            if isinstance(chunk_of, pa.ChunkedArray) else pc.dictionary_encode(chunk_of)
        indices = encoded.indices.to_numpy(zero_copy_only=False)
        valid = np.asarray(pc.is_valid(keys).to_numpy(zero_copy_only=False), dtype=bool)
        rows = row_of.to_pylist()
        plan: dict[str, tuple[list[str], list[int]]] = {}
        for code, location in enumerate(encoded.dictionary.to_pylist()):
            holders = parse_key(f"{location}/0")[0]
            holder = self._pick(holders, nodes)
            entry = plan.setdefault(holder.node, ([], []))
            for pos in np.nonzero((indices == code) & valid)[0]:
                entry[0].append(f"{holder.chunk}:{rows[pos]}")
                entry[1].append(int(pos))
        return {n: (k, np.asarray(p, dtype=np.int64)) for n, (k, p) in plan.items()}

    def _pick(self, holders: tuple, nodes: dict[str, dict[str, Any]]) -> Any:
        """A live holder, this machine's first; a lost or unknown one only if none is live."""
        live = [h for h in holders if h.node in nodes and nodes[h.node]["alive"]]
        if not live:
            raise LostValues({h.node for h in holders},
                             f"no live data node holds values on {[h.node for h in holders]}")
        local = [h for h in live if self.placement
                 and nodes[h.node].get("placement") == self.placement]
        return (local or live)[0]

    def _fetch(self, node: dict[str, Any], keys: list[list[str | None]],
               types: list[str]) -> pa.Table:
        ticket = flight.Ticket(wire.FetchTicket(
            [wire.FetchColumn(k, t) for k, t in zip(keys, types)]).encode())
        table = self._node_client(node["location"]).do_get(ticket, self._options()).read_all()
        self.fetch_stats["fetches"] += 1
        self.fetch_stats["bytes"] += table.nbytes
        if self.placement and node.get("placement") == self.placement:
            self.fetch_stats["local_fetches"] += 1
        return table

    def close(self) -> None:
        # puts made before close are sent and answered first (as a single server's session
        # answers the puts already on it)
        if self._putter is not None:
            self._putter.shutdown(wait=True)     # (each waits for its values first)
            assert self._value_senders is not None
            self._value_senders.shutdown(wait=True)
            with self._putter_lock:
                pending = list(self._pending_puts)
            wait_futures(pending, timeout=self._timeout)
        super().close()
        self._pool.shutdown(wait=False)
        with self._directory_lock:
            for client in self._node_clients.values():
                client.close()
            self._node_clients.clear()


class ClusterSubscription(RemoteSubscription):
    """A subscription whose micro-batches arrive with their values fetched from the data nodes.

    A micro-batch whose values cannot all be fetched is nacked (its slot is free again) and its
    nodes reported; the next micro-batch pushed is returned instead."""

    def __init__(self, remote: ClusterStore, table: str | list[str], micro_batch_size: int,
                 global_batch_size: int, **options: Any) -> None:
        self._cluster = remote
        super().__init__(remote, table, micro_batch_size, global_batch_size, **options)

    def next(self, timeout: float | None = None) -> Any:
        for _ in range(LOST_RETRIES):
            batch = super().next(timeout)
            if batch is None:
                return None
            try:
                tables = {t: self._cluster.resolve(t, d) for t, d in batch.tables.items()}
                return dataclasses.replace(
                    batch, data=rows_of_all(tables) if len(tables) > 1 else tables[batch.table],
                    tables=tables)
            except LostValues as e:
                batch.nack()
                for node in sorted(e.nodes):
                    self._cluster.call_action("report_lost", {"node_id": node})
                self._cluster.cluster(refresh=True)
        raise Unavailable(f"micro-batches kept finding values on unreachable data nodes after "
                          f"{LOST_RETRIES} tries")


def _reachable_as(node: dict[str, Any] | None) -> tuple[bool, str] | None:
    """What of a directory entry decides whether and where a node's values are fetched."""
    return None if node is None else (node["alive"], node["location"])


def _scatter(pieces: list[pa.Array], positions: list[np.ndarray], n: int,
             value_type: pa.DataType) -> pa.Array:
    """Values fetched per node, put back in row order; null where a row had no key."""
    if not pieces:
        return pa.nulls(n, value_type)
    values = pa.concat_arrays(pieces)
    order = np.full(n, -1, dtype=np.int64)
    order[np.concatenate(positions)] = np.arange(len(values), dtype=np.int64)
    mask = order < 0
    take = pa.array(order, mask=mask) if mask.any() else pa.array(order)
    return values.take(take)


def _as_type(values: pa.Array, value_type: pa.DataType) -> pa.Array:
    """``values`` as the column's type (a cast only where they are not already)."""
    return values if values.type == value_type else values.cast(value_type)


def _settle(done: Future, answered: Future) -> None:
    """Resolve ``done`` as ``answered`` was resolved."""
    error = answered.exception()
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(answered.result())
