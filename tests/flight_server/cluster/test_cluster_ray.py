"""The cluster on a real Ray cluster of three logical nodes on this machine, bound to 127.0.0.1.

One Ray cluster and one expstore cluster (``cluster_up``: a coordinator actor and a data-node
actor per Ray node) serve the whole module; producers and trainers are Ray tasks pinned to
nodes. The tests that kill data nodes run last, in file order.
"""
from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # before Ray starts: keep it on loopback
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'expstore[cluster]')")

import store  # noqa: E402
from flight_server.cluster.ray_cluster import cluster_up, data_node_id  # noqa: E402

from waiting import wait_until  # noqa: E402

VALUE = 32 * 1024


@pytest.fixture(scope="module")
def ray_nodes() -> Iterator[list[str]]:
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=c.address, namespace="expstore", log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 3
        # Ray 2.60 would silently use the machine's external address without the env var
        assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
        yield [n["NodeID"] for n in nodes]
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def deployed(ray_nodes, tmp_path_factory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("cluster")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handle = cluster_up(None, db=str(root / "coordinator.duckdb"), port=port,
                        data_dir=str(root / "data"), node_timeout=2.0)
    yield handle
    handle.stop()


def on(node: str) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
            "num_cpus": 0}


@ray.remote
def produce(uri: str, table: str, ids: list[str], replicas: int = 1) -> dict[str, Any]:
    """A rollout worker: writes samples through store.connect, from wherever Ray placed it."""
    import store as st
    with st.connect(uri, replicas=replicas) as s:
        s.put(table, {"sample_id": ids, "response": [f"{i}:" + "v" * VALUE for i in ids],
                      "tokens": [[len(i), 7] for i in ids], "reward": [1.0] * len(ids)})
        return {"placement": s.placement, "home": s.home_node()["node_id"]}


@ray.remote
def train(uri: str, table: str, limit: int, **claim: Any) -> dict[str, Any]:
    """A trainer: claims, checks every value arrived whole, acks."""
    import store as st
    with st.connect(uri) as s:
        c = s.claim(table, limit, **claim)
        data = c.tables.get(table)
        ids = [] if data is None else data.column("sample_id").to_pylist()
        whole = data is None or all(
            r == f"{i}:" + "v" * VALUE for i, r in zip(ids, data.column("response").to_pylist()))
        if c.claim_id:
            s.ack(c.claim_id)
        groups = [] if data is None else data.column("input_id").to_pylist()
        return {"ids": ids, "whole": whole, "groups": groups, "stats": dict(s.fetch_stats),
                "placement": s.placement}


def make_table(s: Any, name: str, **options: Any) -> None:
    s.create_table(name, {"response": "string", "tokens": "list<int32>", "reward": "float64"},
                   storage={"response": "ref", "tokens": "ref"}, **options)


def node_health(handle: Any) -> dict[str, dict[str, Any]]:
    return {nid: ray.get(a.health.remote()) for nid, a in handle.datanodes.items()}


def test_one_data_node_per_ray_node_all_on_loopback(deployed, ray_nodes):
    with store.connect(deployed.uri) as s:
        nodes = s.cluster()["nodes"]
    assert sorted(n["placement"] for n in nodes) == sorted(ray_nodes)
    assert {n["node_id"] for n in nodes} == {data_node_id(r) for r in ray_nodes}
    assert all(n["location"].startswith("grpc://127.0.0.1:") and n["alive"] for n in nodes)
    assert deployed.uri.startswith("grpc://127.0.0.1:")


def test_cluster_up_refuses_unknown_nodes_and_a_second_cluster_before_starting_anything(
        deployed, ray_nodes, tmp_path):
    """Before, an unknown node id started a coordinator with no data node at all (and took the
    actors' names), and a second cluster_up failed with Ray's bare ActorAlreadyExistsError."""
    args = dict(db=str(tmp_path / "other.duckdb"), port=1, data_dir=str(tmp_path / "data"))
    for nodes, named in ((["deadbeef"], "'deadbeef'"), ([], "at least one data node")):
        with pytest.raises(store.InvalidArgument, match=named) as raised:
            cluster_up(None, nodes=nodes, **args)
        assert ray_nodes[0] in str(raised.value)          # the alive ids, to pick from
    with pytest.raises(store.AlreadyExists, match=f"already runs .* at {deployed.uri}"):
        cluster_up(None, nodes=ray_nodes[:1], **args)
    with store.connect(deployed.uri) as s:                 # the running cluster is untouched
        assert len([n for n in s.cluster()["nodes"] if n["alive"]]) == 3
    assert not (tmp_path / "other.duckdb").exists()


def test_producer_and_trainer_on_different_nodes_values_move_once(deployed, ray_nodes):
    with store.connect(deployed.uri) as s:
        make_table(s, "locality")
    before = node_health(deployed)
    ids = [f"loc{i}_0_0" for i in range(16)]
    placed = ray.get(produce.options(**on(ray_nodes[1])).remote(deployed.uri, "locality", ids))
    assert placed == {"placement": ray_nodes[1], "home": data_node_id(ray_nodes[1])}
    after = node_health(deployed)
    grew = {nid for nid in after
            if after[nid]["bytes_received"] > before[nid]["bytes_received"]}
    assert grew == {ray_nodes[1]}                      # values stayed on the producer's node
    got = ray.get(train.options(**on(ray_nodes[2])).remote(deployed.uri, "locality", 16))
    assert sorted(got["ids"]) == sorted(ids) and got["whole"]
    assert got["placement"] == ray_nodes[2] and got["stats"]["local_fetches"] == 0
    served = node_health(deployed)[ray_nodes[1]]["bytes_served"] - \
        after[ray_nodes[1]]["bytes_served"]
    assert served >= 16 * VALUE                        # fetched from the producer's node
    with store.connect(deployed.uri) as s:
        counted = s.cluster(refresh=True)
    assert counted["put_bytes"] + counted["claim_bytes"] < 16 * VALUE / 20


def test_a_trainer_reads_its_own_nodes_values_locally_and_others_in_parallel(deployed,
                                                                              ray_nodes):
    with store.connect(deployed.uri) as s:
        make_table(s, "parallel")
    ray.get([produce.options(**on(n)).remote(deployed.uri, "parallel",
                                             [f"n{k}x{i}_0_0" for i in range(4)])
             for k, n in enumerate(ray_nodes)])
    got = ray.get(train.options(**on(ray_nodes[0])).remote(deployed.uri, "parallel", 12))
    assert len(got["ids"]) == 12 and got["whole"]
    assert got["stats"]["parallel"] == 3               # three nodes at once (both columns)
    assert got["stats"]["local_fetches"] == 1          # its own node's


def test_group_claims_and_version_bumps_across_nodes(deployed, ray_nodes):
    with store.connect(deployed.uri) as s:
        make_table(s, "solver", version_group="agents")
        make_table(s, "critic", version_group="agents")
    # each GRPO group of three has one sample written on each node
    ray.get([produce.options(**on(n)).remote(deployed.uri, "solver",
                                             [f"g{g}_0_{k}" for g in range(4)])
             for k, n in enumerate(ray_nodes)])
    got = ray.get(train.options(**on(ray_nodes[1])).remote(
        deployed.uri, "solver", 6, group_by="input_id", group_size=3))
    assert got["whole"] and len(got["ids"]) == 6
    assert sorted(set(got["groups"])) == sorted({g for g in got["groups"]}) and \
        all(got["groups"].count(g) == 3 for g in set(got["groups"]))
    with store.connect(deployed.uri) as s:
        with s.subscribe("solver", 3, 6, group_by="input_id", group_size=3) as sub:
            batches = [sub.next(timeout=20) for _ in range(2)]
            assert all(b is not None and b.num_rows == 3 for b in batches)
            assert all(r.endswith("v" * 64) for b in batches
                       for r in b.data.column("response").to_pylist())
            for b in batches:
                b.ack()
            # a version group's barrier: the critic's trainer arrives too (from another client)
            with store.connect(deployed.uri) as c, ThreadPoolExecutor(max_workers=1) as pool:
                critic = pool.submit(c.arrive, "critic", expected=0)
                assert sub.bump_version() == 1
                assert critic.result(timeout=60) == 1
        assert s.get_version("critic") == 1            # the group moved together
        with pytest.raises(store.ExpstoreError, match="stale"):
            s.put("critic", {"sample_id": ["late_0_0"], "reward": [1.0],
                             "policy_version": [0], "response": ["x"], "tokens": [[1]]})


def test_a_killed_data_node_with_replicas_loses_nothing(deployed, ray_nodes):
    with store.connect(deployed.uri) as s:
        make_table(s, "replicated")
    ids = [f"rep{i}_0_0" for i in range(8)]
    victim = ray_nodes[2]
    ray.get(produce.options(**on(victim)).remote(deployed.uri, "replicated", ids, replicas=2))
    # rows left unclaimed until a second node is lost (the next test)
    ray.get(produce.options(**on(victim)).remote(deployed.uri, "replicated",
                                                 [f"later{i}_0_0" for i in range(4)], replicas=2))
    ray.kill(deployed.datanodes.pop(victim), no_restart=True)
    got = ray.get(train.options(**on(ray_nodes[0])).remote(deployed.uri, "replicated", 8,
                                                           where="sample_id LIKE 'rep%'"))
    assert sorted(got["ids"]) == sorted(ids) and got["whole"]
    with store.connect(deployed.uri) as s:
        assert s.stats("replicated")["replicated"]["dead"] == 0
        # the coordinator restores a second copy of what the lost node held, on the others
        wait_until(lambda: _restored(s, data_node_id(victim)), timeout=60,
                   message="second copies restored after the data node's loss")
        keys = s.query("SELECT tokens FROM replicated WHERE sample_id LIKE 'later%'")
        assert all(data_node_id(victim) not in k for k in keys.column(0).to_pylist())


def _restored(s: Any, lost: str) -> bool:
    state = s.cluster(refresh=True)
    gone = {n["node_id"] for n in state["nodes"] if not n["alive"]}
    return lost in gone and state["replicas_restored"] > 0 and not state["repair_pending"] \
        and state["under_replicated"] == 0


def test_a_killed_data_node_without_replicas_dead_letters_its_rows(deployed, ray_nodes):
    with store.connect(deployed.uri) as s:
        make_table(s, "single")
    victim, survivor = ray_nodes[1], ray_nodes[0]
    ray.get(produce.options(**on(victim)).remote(deployed.uri, "single",
                                                 [f"lost{i}_0_0" for i in range(4)]))
    ray.get(produce.options(**on(survivor)).remote(deployed.uri, "single",
                                                   [f"kept{i}_0_0" for i in range(4)]))
    killed = deployed.datanodes.pop(victim)
    ray.kill(killed, no_restart=True)
    _wait_dead(killed)  # ray.kill returns before the process is gone
    started = time.monotonic()
    got = ray.get(train.options(**on(survivor)).remote(deployed.uri, "single", 8), timeout=60)
    assert sorted(got["ids"]) == [f"kept{i}_0_0" for i in range(4)] and got["whole"]
    assert time.monotonic() - started < 60
    with store.connect(deployed.uri) as s:
        wait_until(lambda: s.stats("single")["single"]["dead"] == 4, timeout=20,
                   message="the lost node's rows dead-lettered")
        reasons = s._json("dead_letters", {"table": "single"})
        assert sorted(r["sample_id"] for r in reasons) == [f"lost{i}_0_0" for i in range(4)]
        assert all(data_node_id(victim) in r["reason"] for r in reasons)
    # a second node lost: the replicated rows' restored copies still serve them in full
    again = ray.get(train.options(**on(survivor)).remote(deployed.uri, "replicated", 4),
                    timeout=60)
    assert sorted(again["ids"]) == [f"later{i}_0_0" for i in range(4)] and again["whole"]


def test_a_killed_coordinator_is_restarted_by_ray_from_its_file(deployed, ray_nodes):
    with store.connect(deployed.uri) as s:
        make_table(s, "durable")
        s.put("durable", {"sample_id": ["d0_0_0", "d1_0_0"], "response": ["a", "b"],
                          "tokens": [[1], [2]], "reward": [1.0, 2.0]})
        pid = ray.get(deployed.coordinator.pid.remote())
        os.kill(pid, 9)
        # the client's next calls reach the restarted coordinator at the same address
        wait_until(lambda: _answers(s), timeout=60, interval=0.5,
                   message="the coordinator answers again")
        assert ray.get(deployed.coordinator.pid.remote()) != pid
        claim = s.claim("durable", 2)
        assert sorted(claim.tables["durable"].column("response").to_pylist()) == ["a", "b"]
        s.ack(claim.claim_id)
        # the data nodes registered again (heartbeats), the killed ones stay lost
        live = {n["node_id"] for n in s.cluster(refresh=True)["nodes"] if n["alive"]}
        assert data_node_id(ray_nodes[0]) in live


def _answers(s: Any) -> bool:
    try:
        return s.health()["status"] == "ok"
    except store.ExpstoreError:
        return False


def test_cluster_up_with_tokens_and_tls_and_down_from_the_cli(deployed, tmp_path):
    from click.testing import CliRunner

    from expstore.cli import cli
    from flight_fixtures import TOKENS, self_signed_cert, write_tokens
    deployed.stop()                     # the names are the CLI's to take now
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cert, key = self_signed_cert(tmp_path)
    tokens = write_tokens(tmp_path / "tokens.json")
    runner = CliRunner()
    up = runner.invoke(cli, ["cluster", "up", "--db", str(tmp_path / "cli.duckdb"), "--port",
                             str(port), "--data-dir", str(tmp_path / "data"),
                             "--tokens-file", tokens, "--tls-cert", cert, "--tls-key", key,
                             "--tls-root-certs", cert, "--json"])
    assert up.exit_code == 0, up.output
    assert f"grpc+tls://127.0.0.1:{port}" in up.output and '"data_nodes": 3' in up.output
    uri = f"grpc+tls://127.0.0.1:{port}"
    with store.connect(uri, token=TOKENS["admin"], tls_root_certs=cert) as s:
        nodes = s.cluster()["nodes"]    # the data node actors registered with the node token
        assert len(nodes) == 3 and all(n["location"].startswith("grpc+tls://") for n in nodes)
        make_table(s, "secured")
        s.put("secured", {"sample_id": ["s0_0_0"], "response": ["r"], "tokens": [[1]],
                          "reward": [1.0]})
        claim = s.claim("secured", 1)
        assert claim.tables["secured"].column("response").to_pylist() == ["r"]
        s.ack(claim.claim_id)
    with pytest.raises(store.ExpstoreError, match="unauthenticated|bearer token"):
        store.connect(uri, tls_root_certs=cert)._json("cluster")
    down = runner.invoke(cli, ["cluster", "down", "--json"])
    assert down.exit_code == 0, down.output
    assert "expstore-coordinator" in down.output


def _wait_dead(actor: Any) -> None:
    """Until calls to a killed actor fail (its process, and so its Flight server, is gone)."""
    def dead() -> bool:
        try:
            ray.get(actor.pid.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True
        return False
    wait_until(dead, timeout=30, message="the killed data node to be gone")
