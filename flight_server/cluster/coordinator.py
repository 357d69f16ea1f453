"""The coordinator: today's Flight server over the embedded store, plus a registry of data nodes.

It holds every table's meta, status and simple columns, claims, leases and versions, durable on
its DuckDB file, as a single server does. A column declared ``storage: "ref"`` lives on the data
nodes: the coordinator's table keeps a by-value string column of location keys in its place
(see :mod:`flight_server.cluster.locations`), and the declared type in ``<db>.cluster.json``.
The coordinator never receives or sends those values; ``cluster`` reports the bytes of Arrow data
its store was given to write and handed out in claims (:class:`CountingStore`), which tests
compare with the values' size.

Data nodes register (``register_node``) and repeat it as a heartbeat. A node silent for
``node_timeout`` seconds, or reported by a client that could not reach it (``report_lost``), is
probed; if it does not answer it is *lost*: live rows with a value that no other live node holds
are dead-lettered, with the reason kept in ``<db>.deadletters.jsonl`` (``dead_letters``). A lost
node that registers again serves again (its disk came back); rows already dead-lettered stay so
until ``requeue`` brings them back, which leaves dead (``skipped_lost``) the rows whose values
only nodes still lost held.

After a loss, values that had two holders have one: the coordinator has the surviving holder copy
each such chunk to another live node (``copy_chunks``) and points the rows at the two holders
(:meth:`CoordinatorServer.restore_replicas`), so a second loss loses nothing acknowledged.
``gc`` also tells each data node which of its segments rows still name (``collect``); the nodes
delete the others once they are older than ``gc_grace``.

With a tokens file and certificate the coordinator calls data nodes as they call it, with the
node token over TLS (:mod:`flight_server.cluster.security`).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight

from store.claims import Claim, ClaimRequest
from store.embedded import EmbeddedStore
from store.errors import ExpstoreError, InvalidArgument, NotFound
from store.types import is_complex, parse_type, type_name

from .. import wire
from ..actions import ACTIONS
from ..errors import flight_errors, from_flight, to_flight
from ..server import ExpstoreFlightServer
from .locations import check_node_id, holder_segments_sql, lost_predicate, parse_key
from .repair import restore_column
from .security import ClusterSecurity

log = logging.getLogger(__name__)

#: the consumer name of the coordinator's own claims of rows whose values were lost
SWEEPER = "expstore-coordinator:lost-values"
PROBE_TIMEOUT = 2.0
#: how long a data node may take to copy chunks or collect segments
NODE_CALL_TIMEOUT = 300.0
#: a pass restoring replicas runs again this long after a loss (keys acknowledged by the data
#: nodes before it may reach the coordinator after the first pass), and this long after a pass
#: that left values with one copy (no other live node, or a node failed)
REPAIR_FOLLOW_UP = 5.0
#: how long closing waits for the node monitor to end its step (a probe, a sweep; a copy between
#: data nodes may take longer, and is then left to fail)
MONITOR_STOP_SECONDS = 10.0


class ClusterRegistry:
    """Data nodes and the data-node columns of each table, kept in a JSON file beside the DB.

    The file is replaced atomically (write, fsync, rename) on every change; changes are rare
    (a table created or dropped, a node seen for the first time or lost)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.tables: dict[str, dict[str, str]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.lost: set[str] = set()
        if os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
            self.tables = doc.get("tables", {})
            now = time.monotonic()
            for node_id, node in doc.get("nodes", {}).items():
                # known from before a restart: alive until it misses its heartbeats
                self.nodes[node_id] = {**node, "last_seen": now}
            self.lost = set(doc.get("lost", []))

    def save(self) -> None:
        doc = {"tables": self.tables, "lost": sorted(self.lost),
               "nodes": {k: {"location": v["location"], "placement": v.get("placement")}
                         for k, v in self.nodes.items()}}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def node_list(self) -> list[dict[str, Any]]:
        return [{"node_id": k, "location": v["location"], "placement": v.get("placement"),
                 "alive": k not in self.lost} for k, v in sorted(self.nodes.items())]


class CountingStore(EmbeddedStore):
    """The coordinator's store: counts the Arrow bytes of the rows it is given to write and of
    the rows its claims hand out, whichever way they come (do_put, a session, do_action, a
    subscription): what the ``cluster`` action reports as ``put_bytes`` / ``claim_bytes``."""

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        self.put_bytes = 0
        self.claim_bytes = 0

    def put_async(self, table: str, data: Any) -> Future:
        self.put_bytes += int(getattr(data, "nbytes", 0))
        return super().put_async(table, data)

    def claim_many(self, requests: list[ClaimRequest], *, consumer: str | None = None,
                   lease_seconds: float | None = None) -> Claim:
        claim = super().claim_many(requests, consumer=consumer, lease_seconds=lease_seconds)
        if consumer != SWEEPER:
            self.claim_bytes += sum(t.nbytes for t in claim.tables.values())
        return claim


_SERVER_OPTIONS = ("host", "port", "tokens_file", "tls_cert", "tls_key", "metrics_port")


class CoordinatorServer(ExpstoreFlightServer):
    """An expstore Flight server that is the coordinator of a cluster of data nodes.

    Args:
        db: the DuckDB file.
        node_timeout: seconds without a heartbeat after which a data node is probed, and
            declared lost if the probe fails.
        gc_grace: ``gc`` leaves on the data nodes the segments written in the last
            ``gc_grace`` seconds (a put's keys may still be on their way here).
        tls_root_certs: PEM roots (bytes or a path) to trust when calling data nodes over TLS.
        **options: passed to :class:`ExpstoreFlightServer` (and its store).
    """

    def __init__(self, db: str, *, node_timeout: float = 6.0, gc_grace: float = 3600.0,
                 tls_root_certs: bytes | str | None = None, **options: Any) -> None:
        server = {k: options.pop(k) for k in _SERVER_OPTIONS if k in options}
        self.security = ClusterSecurity.from_files(
            server.get("tokens_file"), server.get("tls_cert"), server.get("tls_key"),
            tls_root_certs)
        super().__init__(CountingStore(db, **options), **server)
        self._owns_store = True
        self.registry = ClusterRegistry(f"{self.store.path}.cluster.json")
        self.node_timeout = node_timeout
        self.gc_grace = gc_grace
        self.cluster_counters = {"dead_lettered": 0, "replicas_restored": 0,
                                 "under_replicated": 0}
        self._repair_lock = threading.Lock()
        # when the next pass restoring replicas is due (monotonic), None: none is; a restart
        # with lost nodes in the registry checks once
        self._repair_due: float | None = time.monotonic() if self.registry.lost else None
        self._follow_up: float | None = None
        self._dead_path = f"{self.store.path}.deadletters.jsonl"
        self._sweep_lock = threading.Lock()
        self._monitor_stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch_nodes, name="expstore-node-monitor",
                                         daemon=True)
        self._monitor.start()

    # -- the actions a coordinator adds or changes ----------------------------------------------
    def list_actions(self, context: flight.ServerCallContext) -> list[tuple[str, str]]:
        return super().list_actions(context) + [
            (name, f"[{role}] {text}") for name, (role, text) in _CLUSTER_ACTIONS.items()]

    def do_action(self, context: flight.ServerCallContext,
                  action: flight.Action) -> Iterator[bytes]:
        name = action.type
        if name in _CLUSTER_ACTIONS:
            self._principal(context, _CLUSTER_ACTIONS[name][0], name)
            with flight_errors(), self.metrics.timed(name):
                body = wire.parse_body(action.body.to_pybytes() if action.body else b"", name)
                answer = getattr(self, f"_action_{name}")(wire.check_body(name, body))
            yield from wire.results_bytes(answer)
            return
        if name == "requeue":
            yield from self._requeue(context, action)
            return
        if name == "create_table":
            with flight_errors():
                action = self._create_table(action)
        parts = list(super().do_action(context, action))
        if name in ("claim", "claim_many"):
            parts = self._with_endpoints(parts)
        elif name == "describe":
            parts = [wire.encode(self._declared(wire.json_result(parts, name)))]
        elif name == "drop_table":
            self._forget_table(action)
        elif name == "gc":
            answer = wire.json_result(parts, name)
            answer["data_nodes"] = self.collect_data_nodes()
            parts = [wire.encode(answer)]
        elif name == "health":
            answer = wire.json_result(parts, name)
            with self.registry.lock:
                answer["cluster"] = {"nodes": len(self.registry.nodes),
                                     "lost": len(self.registry.lost)}
            parts = [wire.encode(answer)]
        yield from parts

    def _requeue(self, context: flight.ServerCallContext,
                 action: flight.Action) -> Iterator[bytes]:
        """``requeue`` as on one server, but rows whose values only lost data nodes held stay
        dead (``skipped_lost``): requeued, they could never be delivered whole. A node that
        registered again holds its values again: its rows come back."""
        self._principal(context, ACTIONS["requeue"].role, "requeue")
        with flight_errors(), self.metrics.timed("requeue"):
            body = wire.check_body("requeue", wire.parse_body(
                action.body.to_pybytes() if action.body else b"", "requeue"))
            table = body["table"]
            with self.registry.lock:
                lost = sorted(self.registry.lost)
                columns = list(self.registry.tables.get(table, {})) if isinstance(table, str) \
                    else []
            values_lost = " OR ".join(lost_predicate(c, lost) for c in columns) \
                if lost and columns else None
            answer = self.store.requeue(table, where=body.get("where"), values_lost=values_lost)
        yield from wire.results_bytes(answer)

    def _claim_stream(self, principal: Any, doc: dict[str, Any]) -> flight.FlightDataStream:
        # A claim's answer must name the data nodes that hold its by-reference values; a stream
        # of rows has no place for them.
        raise to_flight(InvalidArgument("a coordinator answers claims on the claim action, "
                                        "not as a do_get stream (its answer names the data "
                                        "nodes holding the values)"))

    def _create_table(self, action: flight.Action) -> flight.Action:
        """Columns declared ``storage: "ref"`` go to the data nodes: the coordinator's table
        gets a string column of location keys in their place; the registry keeps the type."""
        body = wire.parse_body(action.body.to_pybytes() if action.body else b"", "create_table")
        storage = body.get("storage") or {}
        columns = body.get("columns")
        if not isinstance(storage, dict) or not isinstance(columns, dict):
            return action                  # the store refuses it with the usual message
        remote: dict[str, str] = {}
        for col, mode in storage.items():
            if mode == "ref" and col in columns:
                value_type = parse_type(columns[col])
                if not is_complex(value_type):
                    return action          # refused by the store, naming the column
                remote[col] = type_name(value_type)
        if not remote:
            return action
        name = body.get("name")
        if not isinstance(name, str) or name in self.store.list_tables():
            return action                  # if_not_exists or already_exists decides
        with self.registry.lock:
            # saved before the table exists: a table never has data-node columns unrecorded
            self.registry.tables[name] = remote
            self.registry.save()
        body["columns"] = {c: ("string" if c in remote else t) for c, t in columns.items()}
        body["storage"] = {c: ("value" if c in remote else m) for c, m in storage.items()}
        return wire.action("create_table", body)

    def _forget_table(self, action: flight.Action) -> None:
        # (the body was decoded and checked by the drop_table that just succeeded)
        name = wire.parse_body(action.body.to_pybytes(), "drop_table").get("name")
        with self.registry.lock:
            if name in self.registry.tables and name not in self.store.list_tables():
                del self.registry.tables[name]
                self.registry.save()

    def _declared(self, description: dict[str, Any]) -> dict[str, Any]:
        """``describe`` with data-node columns shown as declared (type, ``storage: "ref"``)
        and ``placement: "data_node"``."""
        with self.registry.lock:
            remote = self.registry.tables.get(str(description.get("name")), {})
        for col in description.get("columns", []):
            if col["name"] in remote:
                col.update(type=remote[col["name"]], storage="ref", placement="data_node")
        return description

    def _with_endpoints(self, parts: list[bytes]) -> list[bytes]:
        """Add to a claim's header the data nodes holding its values (``data_nodes``)."""
        header = wire.ClaimHeader.decode(parts[0])
        nodes: set[str] = set()
        with self.registry.lock:
            tables = {t: dict(self.registry.tables.get(t, {})) for t in header.tables}
        for (table, columns), body in zip(tables.items(), parts[1:]):
            if not columns:
                continue
            data = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
            for col in columns:
                if col not in data.column_names:
                    continue
                chunks = pc.unique(pc.replace_substring_regex(
                    data.column(col), r"/[0-9]+$", "")).to_pylist()
                for location in chunks:
                    if location:
                        nodes.update(h.node for h in parse_key(f"{location}/0")[0])
        with self.registry.lock:
            data_nodes = [
                {"node_id": n, "locations": [self.registry.nodes[n]["location"]],
                 "placement": self.registry.nodes[n].get("placement"),
                 "alive": n not in self.registry.lost}
                for n in sorted(nodes) if n in self.registry.nodes]
        return [header._replace(data_nodes=data_nodes).encode(), *parts[1:]]

    # -- registry actions -------------------------------------------------------------------------
    def _action_register_node(self, body: dict[str, Any]) -> dict[str, Any]:
        node_id = check_node_id(body["node_id"])
        location = body["location"]
        if not isinstance(location, str) or "://" not in location:
            raise InvalidArgument(f"data node location {location!r} is invalid; expected "
                                  "grpc://host:port")
        with self.registry.lock:
            known = self.registry.nodes.get(node_id)
            changed = (known is None or known["location"] != location
                       or known.get("placement") != body.get("placement")
                       or node_id in self.registry.lost)
            self.registry.nodes[node_id] = {"location": location,
                                            "placement": body.get("placement"),
                                            "last_seen": time.monotonic()}
            if node_id in self.registry.lost:
                log.info("data node %s is back", node_id)
                self.registry.lost.discard(node_id)
            if changed and self.cluster_counters["under_replicated"]:
                self._repair_due = time.monotonic()      # a node to copy to, perhaps
            if changed:
                self.registry.save()
            return {"node_id": node_id, "nodes": self.registry.node_list()}

    def _action_cluster(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.registry.lock:
            counted = self.store
            assert isinstance(counted, CountingStore)
            return {"nodes": self.registry.node_list(),
                    "tables": {t: dict(c) for t, c in self.registry.tables.items()},
                    "put_bytes": counted.put_bytes, "claim_bytes": counted.claim_bytes,
                    "repair_pending": self._repair_due is not None
                    or self._follow_up is not None, **self.cluster_counters}

    def _action_report_lost(self, body: dict[str, Any]) -> dict[str, Any]:
        node_id = check_node_id(body["node_id"])
        with self.registry.lock:
            node = self.registry.nodes.get(node_id)
        if node is None:
            raise NotFound(f"data node {node_id!r} is not registered; registered: "
                           f"{sorted(self.registry.nodes)}")
        alive = node_id not in self.registry.lost and self._probe(node["location"])
        dead = 0
        if not alive:
            self._mark_lost(node_id)
            dead = self.sweep()
        return {"node_id": node_id, "alive": alive, "dead_lettered": dead}

    def _action_dead_letters(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        table = body.get("table")
        if not os.path.exists(self._dead_path):
            return []
        with open(self._dead_path) as f:
            entries = [json.loads(line) for line in f if line.strip()]
        return [e for e in entries if table is None or e["table"] == table]

    # -- liveness and lost values -------------------------------------------------------------------
    def _probe(self, location: str) -> bool:
        client = self.security.client(location)
        try:
            list(client.do_action(wire.action("health"),
                                  self.security.options(PROBE_TIMEOUT)))
            return True
        except (flight.FlightUnauthenticatedError, flight.FlightUnauthorizedError):
            return True                # it answered (with other tokens than ours: its log says)
        except flight.FlightError:
            return False
        finally:
            client.close()

    def _node_action(self, location: str, name: str, body: dict[str, Any]) -> Any:
        """A data node's action, called with the node token; its JSON answer."""
        client = self.security.client(location)
        try:
            results = list(client.do_action(wire.action(name, body),
                                            self.security.options(NODE_CALL_TIMEOUT)))
            return wire.json_result([r.body.to_pybytes() for r in results], name)
        except flight.FlightError as e:
            raise from_flight(e) from None
        finally:
            client.close()

    def _mark_lost(self, node_id: str) -> None:
        with self.registry.lock:
            if node_id in self.registry.lost:
                return
            log.warning("data node %s is lost", node_id)
            self.registry.lost.add(node_id)
            self.registry.save()
            now = time.monotonic()
            self._repair_due = now
            self._follow_up = now + REPAIR_FOLLOW_UP

    def _watch_nodes(self) -> None:
        while not self._monitor_stop.wait(1.0):
            now = time.monotonic()
            with self.registry.lock:
                silent = [(k, v["location"]) for k, v in self.registry.nodes.items()
                          if k not in self.registry.lost
                          and now - v["last_seen"] > self.node_timeout]
            lost = [k for k, location in silent if not self._probe(location)]
            for node_id in lost:
                self._mark_lost(node_id)
            if lost:
                try:
                    self.sweep()
                except Exception:  # noqa: BLE001 - retried at the next loss or report
                    log.exception("dead-lettering the rows of lost data nodes failed")
            self._repair_if_due()

    def _repair_if_due(self) -> None:
        now = time.monotonic()
        with self.registry.lock:
            due = self._repair_due is not None and self._repair_due <= now
            if not due and self._follow_up is not None and self._follow_up <= now:
                due, self._follow_up = True, None
            if due:
                self._repair_due = None
        if not due:
            return
        try:
            left = self.restore_replicas()
        except Exception:  # noqa: BLE001 - tried again later
            log.exception("restoring second copies after a data node loss failed")
            left = -1
        if left:
            with self.registry.lock:
                self._repair_due = time.monotonic() + REPAIR_FOLLOW_UP

    def restore_replicas(self) -> int:
        """Give every value left with one live holder by a loss a second copy; how many chunks
        still have one (no other live node to copy to, or a copy failed: tried again later).

        For each data-node column, the rows still to be delivered (not consumed, stale or dead)
        whose key has one lost and one live holder: the live holder copies each such chunk to
        the next live node in ring order (``copy_chunks``), then the rows' keys are rewritten to
        name both (an upsert of the key column, its status, policy and finished versions kept
        as they were)."""
        with self.registry.lock:
            lost = sorted(self.registry.lost)
            live = {k: v["location"] for k, v in self.registry.nodes.items()
                    if k not in self.registry.lost}
            tables = {t: list(c) for t, c in self.registry.tables.items()}
        left = 0
        with self._repair_lock:
            for table, columns in tables.items() if lost else ():
                if table not in self.store.list_tables():
                    continue
                for column in columns:
                    column_left, restored = restore_column(
                        self.store, self._node_action, table, column, lost, live)
                    left += column_left
                    self.cluster_counters["replicas_restored"] += restored
        self.cluster_counters["under_replicated"] = left
        return left

    # -- garbage collection on the data nodes ----------------------------------------------------
    def collect_data_nodes(self) -> dict[str, Any]:
        """Tell each live data node which of its segments rows still name (rows in any state:
        a finished row's values stay until ``gc``'s ``drop_rows`` deletes the row, as on one
        server); it deletes the others older than ``gc_grace``. Per node its answer, or the
        error that stopped it."""
        with self.registry.lock:
            live = {k: v["location"] for k, v in self.registry.nodes.items()
                    if k not in self.registry.lost}
            tables = {t: list(c) for t, c in self.registry.tables.items()}
        named: dict[str, set[int]] = {n: set() for n in live}
        for table, columns in tables.items():
            if table not in self.store.list_tables():
                continue
            for column in columns:
                try:
                    found = self.store.query(holder_segments_sql(table, column))
                except ExpstoreError:
                    if table in self.store.list_tables():
                        raise
                    break                    # dropped meanwhile: its keys are gone
                for node, segment in zip(found.column("node").to_pylist(),
                                         found.column("segment").to_pylist()):
                    named.setdefault(node, set()).add(int(segment))
        answers: dict[str, Any] = {}
        for node, location in sorted(live.items()):
            try:
                answers[node] = self._node_action(location, "collect", {
                    "live_segments": sorted(named[node]), "grace_seconds": self.gc_grace})
            except ExpstoreError as e:
                answers[node] = {"error": str(e)}
        return answers

    def sweep(self) -> int:
        """Dead-letter the live, ready rows whose values no live data node holds; how many.

        Rows leased meanwhile are swept when given back: a consumer that cannot fetch them
        nacks its claim and reports the node (``report_lost``), which sweeps again."""
        with self.registry.lock:
            lost = sorted(self.registry.lost)
            tables = {t: list(c) for t, c in self.registry.tables.items()}
        if not lost:
            return 0
        total = 0
        with self._sweep_lock:
            for table, columns in tables.items():
                if table not in self.store.list_tables():
                    continue
                where = " OR ".join(lost_predicate(c, lost) for c in columns)
                while True:
                    claim = self.store.claim(table, 4096, where=where, consumer=SWEEPER)
                    if not claim.claim_id:
                        break
                    self._record_dead(table, claim.tables[table], columns, lost)
                    total += self.store.dead_letter(claim.claim_id)["dead"]
        self.cluster_counters["dead_lettered"] += total
        return total

    def _record_dead(self, table: str, rows: pa.Table, columns: list[str],
                     lost: list[str]) -> None:
        """Append why each row is dead-lettered, fsynced before the rows are marked dead."""
        lines = []
        for i, (sid, version) in enumerate(zip(rows.column("sample_id").to_pylist(),
                                               rows.column("policy_version").to_pylist())):
            gone = sorted({h.node for c in columns
                           if (key := rows.column(c)[i].as_py()) is not None
                           for h in parse_key(key)[0]} & set(lost))
            lines.append(json.dumps({
                "table": table, "sample_id": sid, "policy_version": version,
                "reason": f"values lost: data node(s) {', '.join(gone)} lost and no other "
                          "node held a replica", "at": time.time()}))
        with open(self._dead_path, "a") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        # The node monitor reads and writes the store (sweeps, repairs): it ends its step
        # before the store closes under it (a query still running refused the close).
        self._monitor_stop.set()
        if self._monitor is not threading.current_thread():
            self._monitor.join(MONITOR_STOP_SECONDS)
        super().close()


_CLUSTER_ACTIONS: dict[str, tuple[str, str]] = {
    "register_node": ("writer", "A data node announces itself (repeated as a heartbeat). Body: "
                                "{node_id, location, placement?}. Answer: {node_id, nodes}"),
    "cluster": ("reader", "The data nodes and data-node columns. Body: {}. Answer: {nodes: "
                          "[{node_id, location, placement, alive}], tables: {table: {col: type}}, "
                          "put_bytes, claim_bytes, dead_lettered, replicas_restored, "
                          "under_replicated, repair_pending}"),
    "report_lost": ("writer", "A client could not reach a data node: probe it, and if it is gone "
                              "dead-letter rows whose values it alone held. Body: {node_id}"),
    "dead_letters": ("reader", "Rows dead-lettered because their values were lost, with the "
                               "reason. Body: {table?}"),
}
