"""Placing a coordinator and one data node per Ray node on an existing Ray cluster.

Ray does the placing and restarting: the coordinator is an actor pinned to one node
(``NodeAffinitySchedulingStrategy``, hard) with ``max_restarts=-1``, so Ray restarts it there,
where its DuckDB file is, and it listens on the same port again; each data node is an actor
pinned to its Ray node, with its blob segments on that node's disk. Ray is imported only when
these functions run (``pip install 'expstore[cluster]'``).

Ray 2.60 replaces ``node_ip_address="127.0.0.1"`` with the machine's external address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set; :func:`import_ray` sets it before Ray starts.

>>> handle = cluster_up(address="auto", db="/data/expstore.duckdb",
...                     data_dir="/local/expstore-data")          # doctest: +SKIP
>>> s = store.connect(handle.uri)                                  # doctest: +SKIP
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from store.errors import AlreadyExists, InvalidArgument, Unavailable

from .security import NO_SECURITY, ClusterSecurity

NAMESPACE = "expstore"
COORDINATOR_NAME = "expstore-coordinator"
DATANODE_PREFIX = "expstore-datanode-"


def import_ray() -> Any:
    """Ray, with the loopback-binding fix set first; a clear error where Ray is missing."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as e:
        raise InvalidArgument("expstore's cluster mode needs Ray: pip install "
                              "'expstore[cluster]'") from e
    return ray


class CoordinatorActor:
    """The coordinator's Ray actor: the server runs from construction until the process ends."""

    def __init__(self, db: str, port: int, options: dict[str, Any]) -> None:
        import ray

        from .coordinator import CoordinatorServer
        host = ray.util.get_node_ip_address()
        self.server = CoordinatorServer(db, host=host, port=port, **options)

    def location(self) -> str:
        return str(self.server.location)

    def pid(self) -> int:
        return os.getpid()

    def cpu_seconds(self) -> float:
        """CPU time of the coordinator's process so far (every thread): what it costs."""
        return time.process_time()

    def stop(self) -> None:
        self.server.close()


class DataNodeActor:
    """A data node's Ray actor: serves and heartbeats until the process ends."""

    def __init__(self, root: str, node_id: str, coordinator: str,
                 security: ClusterSecurity = NO_SECURITY) -> None:
        import ray

        from .datanode import DataNodeServer
        self.server = DataNodeServer(root, node_id, host=ray.util.get_node_ip_address(),
                                     coordinator=coordinator,
                                     placement=ray.get_runtime_context().get_node_id(),
                                     security=security)
        self.server.start_heartbeat()

    def location(self) -> str:
        return self.server.location

    def pid(self) -> int:
        return os.getpid()

    def health(self) -> dict[str, Any]:
        return self.server.health()

    def stop(self) -> None:
        self.server.close()


@dataclass
class ClusterHandle:
    """What :func:`cluster_up` started: the coordinator's URI and the actors."""

    uri: str
    coordinator: Any
    datanodes: dict[str, Any] = field(default_factory=dict)   # Ray node id → actor

    def stop(self) -> None:
        """Kill the actors (the DuckDB file and every node's segments stay on disk)."""
        ray = import_ray()
        for actor in [*self.datanodes.values(), self.coordinator]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def data_node_id(ray_node_id: str) -> str:
    return f"dn-{ray_node_id[:12]}"


def cluster_up(address: str | None = "auto", *, db: str = "expstore.duckdb", port: int = 8815,
               data_dir: str = "expstore-data", node_timeout: float = 6.0,
               detached: bool = False, ready_timeout: float = 120.0,
               server_options: dict[str, Any] | None = None,
               nodes: list[str] | None = None, tokens_file: str | None = None,
               tls_cert: str | None = None, tls_key: str | None = None,
               tls_root_certs: str | None = None, gc_grace: float = 3600.0) -> ClusterHandle:
    """Start a coordinator on this Ray node and a data node on every alive Ray node.

    Args:
        address: the Ray cluster (``"auto"``: the one running here); None: the Ray this
            process already joined.
        db: the coordinator's DuckDB file on this node (made absolute).
        port: the coordinator's port; fixed, so that a restarted coordinator has the same URI.
        data_dir: each data node keeps its segments under ``data_dir/<node id>`` on its node.
        node_timeout: seconds without a heartbeat before a data node is probed (and lost).
        detached: keep the actors after this process exits (``expstore cluster up``).
        ready_timeout: seconds to wait for every data node to register.
        nodes: the Ray node ids to start data nodes on (default: every alive node); an id
            that is no alive node is refused before anything starts.
        tokens_file, tls_cert, tls_key: as for ``expstore serve``, read here: the coordinator
            and every data node accept the same tokens and serve TLS with the same
            certificate (it must name every machine's address).
        tls_root_certs: PEM roots the cluster's servers trust when calling each other over
            TLS (a self-signed certificate is its own root; default: the system's).
        gc_grace: ``gc`` leaves on the data nodes segments written in the last ``gc_grace``
            seconds.

    Raises:
        InvalidArgument: ``nodes`` is empty or names a node that is not alive.
        AlreadyExists: an expstore coordinator already runs in this Ray cluster.
    """
    security = ClusterSecurity.from_files(tokens_file, tls_cert, tls_key, tls_root_certs)
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    if nodes is not None:
        unknown = [n for n in nodes if n not in alive]
        if unknown or not nodes:
            what = (f"{unknown!r} are not alive Ray nodes of this cluster" if unknown
                    else "a cluster needs at least one data node")
            raise InvalidArgument(f"nodes {list(nodes)!r}: {what}; the alive Ray node ids "
                                  f"are {alive}")
    _check_no_coordinator(ray)
    here = ray.get_runtime_context().get_node_id()
    lifetime = {"lifetime": "detached"} if detached else {}
    options = {"node_timeout": node_timeout, "gc_grace": gc_grace,
               "tls_root_certs": security.tls_root_certs, **(server_options or {})}
    # the coordinator runs here: it reads the same files
    options.update({k: os.path.abspath(v) for k, v in (("tokens_file", tokens_file),
                                                        ("tls_cert", tls_cert),
                                                        ("tls_key", tls_key)) if v})
    coordinator = ray.remote(CoordinatorActor).options(
        name=COORDINATOR_NAME, namespace=NAMESPACE, num_cpus=0, max_restarts=-1,
        max_task_retries=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        **lifetime).remote(os.path.abspath(db), port, options)
    uri = ray.get(coordinator.location.remote(), timeout=ready_timeout)
    handle = ClusterHandle(uri, coordinator)
    data_root = os.path.abspath(data_dir)
    for node in ray.nodes():
        if not node["Alive"] or (nodes is not None and node["NodeID"] not in nodes):
            continue
        nid = node["NodeID"]
        handle.datanodes[nid] = ray.remote(DataNodeActor).options(
            name=f"{DATANODE_PREFIX}{nid[:12]}", namespace=NAMESPACE, num_cpus=0,
            max_restarts=-1, max_task_retries=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
            **lifetime).remote(os.path.join(data_root, data_node_id(nid)), data_node_id(nid),
                               uri, security)
    ray.get([a.location.remote() for a in handle.datanodes.values()], timeout=ready_timeout)
    wait_registered(uri, len(handle.datanodes), ready_timeout, security)
    return handle


def _check_no_coordinator(ray: Any) -> None:
    """Refuse a second cluster in one Ray cluster before starting anything: its actors'
    names are taken (Ray would refuse the coordinator with a bare ActorAlreadyExistsError, and
    the first cluster's data nodes would be left to register with nothing)."""
    try:
        existing = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        where = f" at {ray.get(existing.location.remote(), timeout=10)}"
    except Exception:  # noqa: BLE001 - a coordinator that does not answer is still there
        where = ""
    raise AlreadyExists(f"an expstore coordinator already runs in this Ray cluster{where}: "
                        "connect to it, or stop it first (expstore cluster down)")


def wait_registered(uri: str, nodes: int, timeout: float,
                    security: ClusterSecurity = NO_SECURITY) -> None:
    """Wait until the coordinator at ``uri`` lists ``nodes`` live data nodes."""
    from ..client import RemoteStore
    deadline = time.monotonic() + timeout
    with RemoteStore(uri, sessions=False, connect_timeout=timeout,
                     token=security.node_token(),
                     tls_root_certs=security.tls_root_certs) as s:
        while True:
            live = [n for n in s.call_action("cluster")["nodes"] if n["alive"]]
            if len(live) >= nodes:
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"{len(live)} of {nodes} data nodes registered with {uri} "
                                  f"within {timeout} s")
            time.sleep(0.2)


def cluster_down(address: str | None = "auto") -> list[str]:
    """Kill the named expstore actors of the Ray cluster; the names of those killed."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    killed = []
    for info in ray.util.list_named_actors(all_namespaces=True):
        name = info["name"]
        if info.get("namespace") != NAMESPACE:
            continue
        if name == COORDINATOR_NAME or name.startswith(DATANODE_PREFIX):
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                killed.append(name)
            except ValueError:
                pass
    return killed
