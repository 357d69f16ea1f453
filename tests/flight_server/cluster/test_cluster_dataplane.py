"""The cluster's data plane without Ray: a real coordinator and real data nodes, each a Flight
server on a free loopback port in this process, over real DuckDB and blob files.

The same servers on a Ray cluster of several nodes are tested in tests/flight_server/cluster/test_cluster_ray.py.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import store
import flight_server.cluster.client as cluster_client
from flight_server.cluster.client import ClusterStore
from flight_server.cluster.coordinator import CoordinatorServer
from flight_server.cluster.datanode import DataNodeServer
from flight_server.cluster.locations import parse_key, row_keys
from flight_server.cluster.security import NO_SECURITY, ClusterSecurity
from producers import ExperienceWriter
from store.errors import InvalidArgument, LeaseExpired, NotFound, PermissionDenied
from store.halves import BFLOAT16

from flight_fixtures import (TOKENS, WRONG_TOKEN, action_json, bearer, error_code,
                             self_signed_cert, write_tokens)
from waiting import wait_until

VALUE = 64 * 1024


class Cluster:
    def __init__(self, root: Path, nodes: int = 3, node_timeout: float = 1.0,
                 security: ClusterSecurity = NO_SECURITY, **coordinator: Any) -> None:
        self.root = root
        self.security = security
        self.coordinator = CoordinatorServer(str(root / "coord.duckdb"), port=0,
                                             node_timeout=node_timeout, **coordinator)
        self.uri = self.coordinator.location
        self.nodes = [self.start_node(i) for i in range(nodes)]

    def start_node(self, i: int) -> DataNodeServer:
        node = DataNodeServer(str(self.root / f"dn-{i}"), f"dn-{i}", coordinator=self.uri,
                              placement=f"machine-{i}", security=self.security)
        node.start_heartbeat()
        return node

    def received(self) -> list[int]:
        return [n.counters["bytes_received"] for n in self.nodes]

    def close(self) -> None:
        for n in self.nodes:
            n.close()
        self.coordinator.close()


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def client(c: Cluster, machine: int | None, **options: Any) -> ClusterStore:
    s = store.connect(c.uri, placement=None if machine is None else f"machine-{machine}",
                      **options)
    assert isinstance(s, ClusterStore)
    return s


def make_table(s: Any, name: str = "t", **options: Any) -> None:
    s.create_table(name, {"response": "string", "tokens": "list<int32>", "reward": "float64"},
                   storage={"response": "ref", "tokens": "ref"}, **options)


def rows(prefix: str, n: int, turn: int = 0) -> dict[str, list]:
    return {"sample_id": [f"{prefix}{i}_{turn}_0" for i in range(n)],
            "response": [f"{prefix}{i}:" + "r" * VALUE for i in range(n)],
            "tokens": [[i, i + 1, i + 2] for i in range(n)],
            "reward": [float(i) for i in range(n)]}


def test_values_go_to_the_producers_node_and_only_keys_to_the_coordinator(cluster):
    with client(cluster, 1) as producer, client(cluster, 2) as trainer:
        make_table(producer)
        producer.put("t", rows("a", 16))
        assert cluster.received()[1] > 16 * VALUE
        assert cluster.received()[0] == cluster.received()[2] == 0
        # SQL on the coordinator sees the location keys, not the values
        keys = producer.query("SELECT response FROM t").column(0).to_pylist()
        assert all(parse_key(k)[0][0].node == "dn-1" for k in keys)

        claim = trainer.claim("t", 16)
        data = claim.tables["t"]
        assert sorted(data.column("response").to_pylist()) == sorted(rows("a", 16)["response"])
        assert data.schema.field("tokens").type == pa.large_list(pa.int32())
        assert sorted(data.column("reward").to_pylist()) == [float(i) for i in range(16)]
        assert trainer.fetch_stats["local_fetches"] == 0   # the trainer is on another machine
        trainer.ack(claim.claim_id)
        counted = trainer.cluster(refresh=True)
        moved = 16 * VALUE
        # the coordinator took in and gave out keys and simple columns only
        assert 0 < counted["put_bytes"] < moved / 50
        assert 0 < counted["claim_bytes"] < moved / 50


def test_a_data_node_serialises_a_puts_columns_as_it_writes_them(cluster):
    """The node hands a received column to its blob store as it arrived, to be serialised as
    it is written into memory the store reuses from one write to the next (with O_DIRECT), not
    serialised into new memory of its own first; the values read back are the values put."""
    node = cluster.nodes[1]
    if not node.blobs.direct_io:
        pytest.skip("the blob directory's filesystem refuses O_DIRECT (no reused buffers)")
    with client(cluster, 1) as producer:
        make_table(producer)
        assert node.blobs._writes._slots == [None, None]
        producer.put("t", rows("a", 16))              # a 1 MB column: written from a slot
        assert node.blobs._writes._slots[0] is not None
        claimed = producer.claim("t", 16).tables["t"]
        assert sorted(claimed.column("response").to_pylist()) == \
            sorted(rows("a", 16)["response"])
        assert sorted(claimed.column("tokens").to_pylist()) == \
            sorted(rows("a", 16)["tokens"])


def test_a_claim_answer_names_the_data_nodes_that_hold_its_values(cluster):
    with client(cluster, 0) as p0, client(cluster, 2) as p2:
        make_table(p0)
        p0.put("t", rows("a", 2))
        p2.put("t", rows("b", 2))
    c = flight.FlightClient(cluster.uri)
    results = [r.body.to_pybytes() for r in c.do_action(flight.Action(
        "claim", json.dumps({"table": "t", "limit": 4}).encode()))]
    header = json.loads(results[0])
    assert {n["node_id"] for n in header["data_nodes"]} == {"dn-0", "dn-2"}
    by_id = {n.node_id: n for n in cluster.nodes}
    for n in header["data_nodes"]:
        assert n["locations"] == [by_id[n["node_id"]].location] and n["alive"]
    # a raw client fetches a value from the node named in its key
    data = pa.ipc.open_stream(results[1]).read_all()
    holders, row = parse_key(data.column("tokens")[0].as_py())
    node = flight.FlightClient(by_id[holders[0].node].location)
    ticket = {"get": {"columns": [{"keys": [f"{holders[0].chunk}:{row}", None],
                                   "type": "list<int32>"}]}}
    got = node.do_get(flight.Ticket(json.dumps(ticket).encode())).read_all()
    assert got.column(0).to_pylist()[0] in ([0, 1, 2], [1, 2, 3])
    assert got.column(0).to_pylist()[1] is None
    action_json(c, "ack", {"claim_id": header["claim_id"]})


def test_a_coordinator_refuses_claim_tickets_and_its_client_claims_on_the_action(cluster):
    """A do_get claim stream has no place for the data nodes a claim's answer must name."""
    with client(cluster, 0, claim_streams="always") as p0:
        make_table(p0)
        p0.put("t", rows("a", 2))
        c = flight.FlightClient(cluster.uri)
        with pytest.raises(flight.FlightError) as raised:
            c.do_get(flight.Ticket(json.dumps({"claim": {"table": "t", "limit": 2}}).encode()))\
                .read_all()
        assert error_code(raised.value) == "invalid_argument"
        assert "coordinator" in str(raised.value)
        claim = p0.claim("t", 2)
        assert sorted(claim.data.column("tokens").to_pylist()) == [[0, 1, 2], [1, 2, 3]]
        assert p0.ack(claim.claim_id)["acked"] == 2


def requests_seen(c: Cluster, verb: str) -> int:
    """How many ``verb`` requests the coordinator answered (its request metrics)."""
    return int(c.coordinator.metrics.registry.get_sample_value(
        "expstore_request_seconds_count", {"verb": verb}) or 0)


def test_a_claim_carries_the_ack_of_the_one_before_to_the_coordinator(cluster):
    """``claim(…, ack=previous)``: one request per micro-batch; the ack is durable, and the
    new claim's values fetched, when it returns."""
    with client(cluster, 0) as producer, client(cluster, 1) as trainer:
        make_table(producer)
        producer.put("t", rows("a", 8))
        first = trainer.claim("t", 4)
        acks = requests_seen(cluster, "ack")
        second = trainer.claim("t", 4, ack=first.claim_id)
        assert requests_seen(cluster, "ack") == acks    # no ack request of its own
        got = second.tables["t"]
        assert sorted(got.column("response").to_pylist()) == sorted(
            r for r in rows("a", 8)["response"]
            if r.split(":")[0] not in {s.split(":")[0] for s in
                                       first.tables["t"].column("response").to_pylist()})
        assert trainer.ack(first.claim_id).get("duplicate") is True
        stats = trainer.stats("t")["t"]
        assert (stats["consumed"], stats["processing"]) == (4, 4)
        # the last micro-batch's ack rides on a claim that finds nothing
        assert not trainer.claim("t", 4, ack=second.claim_id).claim_id
        stats = trainer.stats("t")["t"]
        assert (stats["consumed"], stats["processing"], stats["ready"]) == (8, 0, 0)
        producer.put("t", rows("b", 4))
        with pytest.raises(NotFound, match="nope"):      # a refused ack leases nothing
            trainer.claim("t", 4, ack="nope")
        assert trainer.stats("t")["t"]["processing"] == 0


def test_a_claim_is_renewed_through_the_coordinator(cluster):
    """The coordinator serves the store's ``renew`` as a single server does: the rows stay the
    claim's past its first lease and its ack succeeds; a twin left alone expires."""
    with client(cluster, 0) as producer, client(cluster, 1) as trainer:
        make_table(producer)
        producer.put("t", rows("a", 4))
        renewed = trainer.claim("t", 2, lease_seconds=0.5)
        twin = trainer.claim("t", 2, lease_seconds=0.5)
        assert trainer.renew(renewed.claim_id, lease_seconds=30)["expires_at"] > \
            renewed.expires_at + 25
        time.sleep(1.5)
        assert [lease["claim_id"] for lease in trainer.leases("t")] == [renewed.claim_id]
        assert trainer.ack(renewed.claim_id)["acked"] == 2
        with pytest.raises(LeaseExpired, match="its lease expired"):
            trainer.renew(twin.claim_id)
        with trainer.subscribe("t", 2, 2, idle_timeout=10) as sub:  # a ClusterSubscription's
            batch = sub.next(timeout=10)
            assert batch is not None
            assert batch.renew(lease_seconds=600)["expires_at"] > time.time() + 500
            batch.ack()


def test_a_local_node_serves_its_machines_trainer_and_fetches_run_in_parallel(cluster):
    producers = [client(cluster, m) for m in range(3)]
    make_table(producers[0])
    for m, p in enumerate(producers):
        p.put("t", rows(f"m{m}x", 4))
    with client(cluster, 1) as trainer:
        claim = trainer.claim("t", 12)
        assert claim.tables["t"].num_rows == 12
        # values on three nodes: one fetch from each (both columns), at once, one local
        assert trainer.fetch_stats["parallel"] == 3
        assert trainer.fetch_stats["fetches"] == 3
        assert trainer.fetch_stats["local_fetches"] == 1
        assert all(v.endswith("r" * 100) for v in claim.tables["t"].column("response").to_pylist())
    for p in producers:
        p.close()


def test_group_claims_and_subscriptions_with_values_on_several_nodes(cluster):
    producers = [client(cluster, m) for m in range(3)]
    make_table(producers[0])
    for m, p in enumerate(producers):   # every group has one sample from each machine
        p.put("t", {"sample_id": [f"g{g}_0_{m}" for g in range(4)],
                    "response": [f"g{g}m{m}"] * 4 if False else [f"g{g}m{m}" for g in range(4)],
                    "tokens": [[g, m] for g in range(4)], "reward": [1.0] * 4})
    with client(cluster, 0) as trainer:
        claim = trainer.claim("t", 6, group_by="input_id", group_size=3)
        data = claim.tables["t"]
        assert data.num_rows == 6
        for g in set(data.column("input_id").to_pylist()):
            mine = data.filter(pa.compute.equal(data.column("input_id"), g))
            assert sorted(mine.column("response").to_pylist()) == [f"{g}m{m}" for m in range(3)]
        trainer.ack(claim.claim_id)
        with trainer.subscribe("t", 3, 6, group_by="input_id", group_size=3) as sub:
            batches = [sub.next(timeout=10) for _ in range(2)]
            assert all(b is not None and b.num_rows == 3 for b in batches)
            for b in batches:
                assert b.data.column("tokens").to_pylist()[0][0] == int(b.data.column(
                    "input_id")[0].as_py()[1:])
                b.ack()
            assert batches[1].is_boundary
            assert sub.bump_version() == 1
        assert trainer.get_version("t") == 1
    for p in producers:
        p.close()


def test_with_two_replicas_a_lost_node_loses_nothing(cluster):
    with client(cluster, 1, replicas=2) as producer, client(cluster, 0) as trainer:
        make_table(producer)
        producer.put("t", rows("a", 8))
        received = cluster.received()
        assert received[1] > 8 * VALUE and max(received[0], received[2]) > 8 * VALUE
        cluster.nodes[1].close()              # the producer's machine is gone
        claim = trainer.claim("t", 8)
        assert sorted(claim.tables["t"].column("response").to_pylist()) == \
            sorted(rows("a", 8)["response"])
        trainer.ack(claim.claim_id)
        assert trainer.stats("t")["t"]["dead"] == 0


def test_without_replicas_rows_of_a_lost_node_are_dead_lettered_with_the_reason(cluster):
    with client(cluster, 1) as lost_side, client(cluster, 2) as other, \
            client(cluster, 0) as trainer:
        make_table(lost_side)
        lost_side.put("t", rows("lost", 4))
        other.put("t", rows("kept", 4))
        cluster.nodes[1].close()
        claim = trainer.claim("t", 8)        # finds dn-1 gone: gives back, reports, claims again
        got = claim.tables["t"]
        assert sorted(got.column("sample_id").to_pylist()) == [f"kept{i}_0_0" for i in range(4)]
        assert all(v.startswith("kept") for v in got.column("response").to_pylist())
        trainer.ack(claim.claim_id)
        stats = trainer.stats("t")["t"]
        assert stats["dead"] == 4 and stats["ready"] == 0
        reasons = trainer._json("dead_letters", {"table": "t"})
        assert sorted(r["sample_id"] for r in reasons) == [f"lost{i}_0_0" for i in range(4)]
        assert all("dn-1" in r["reason"] and "replica" in r["reason"] for r in reasons)
        assert trainer.claim("t", 8).claim_id == ""   # nothing half, nothing hangs


def test_requeue_on_a_coordinator_leaves_dead_the_rows_whose_values_are_lost(cluster):
    with client(cluster, 1) as lost_side, client(cluster, 2) as other, \
            client(cluster, 0) as trainer:
        make_table(lost_side, max_deliveries=1)
        lost_side.put("t", rows("lost", 3))
        other.put("t", rows("kept", 2))
        trainer.nack(trainer.claim("t", 8).claim_id)     # one delivery each: all 5 dead
        cluster.nodes[1].close()
        assert trainer.call_action("report_lost", {"node_id": "dn-1"})["alive"] is False

        assert trainer.requeue("t") == {"table": "t", "requeued": 2, "skipped_stale": 0,
                                        "skipped_lost": 3}
        claim = trainer.claim("t", 8)
        assert sorted(claim.tables["t"].column("response").to_pylist()) == \
            sorted(rows("kept", 2)["response"])
        trainer.ack(claim.claim_id)

        cluster.nodes[1] = cluster.start_node(1)          # its disk came back
        wait_until(lambda: "dn-1" not in cluster.coordinator.registry.lost, timeout=10,
                   message="dn-1 registered again")
        assert trainer.requeue("t")["requeued"] == 3
        trainer.cluster(refresh=True)   # (its directory, cached for a few seconds, says lost)
        claim = trainer.claim("t", 8)
        assert sorted(claim.tables["t"].column("response").to_pylist()) == \
            sorted(rows("lost", 3)["response"])


def _directory(s: ClusterStore, refresh: bool = False) -> dict[str, dict[str, Any]]:
    """The client's view of the data nodes (node id → its entry), cached unless ``refresh``."""
    return {n["node_id"]: n for n in s.cluster(refresh=refresh)["nodes"]}


@pytest.fixture
def directory_kept(monkeypatch) -> None:
    """The client keeps its list of data nodes for the whole test (5 s by default, which a
    node's restart on a loaded machine can outlast): the list is then surely stale."""
    monkeypatch.setattr(cluster_client, "DIRECTORY_SECONDS", 600.0)


def test_a_claim_while_the_directory_still_says_a_returned_node_is_lost_costs_no_delivery(
        cluster, directory_kept):
    """The client caches the coordinator's list of data nodes for a few seconds. A claim made
    while that list still calls a node lost that has registered again asks the coordinator
    again and fetches from the node: its rows are not given back (with one delivery allowed,
    a nack would dead-letter them)."""
    with client(cluster, 1) as lost_side, client(cluster, 0) as trainer:
        make_table(lost_side, max_deliveries=1)
        lost_side.put("t", rows("a", 4))
        cluster.nodes[1].close()
        assert trainer.call_action("report_lost", {"node_id": "dn-1"})["dead_lettered"] == 4
        assert not _directory(trainer, refresh=True)["dn-1"]["alive"]
        cluster.nodes[1] = cluster.start_node(1)          # its disk came back
        wait_until(lambda: "dn-1" not in cluster.coordinator.registry.lost, timeout=10,
                   message="dn-1 registered again")
        assert trainer.requeue("t")["requeued"] == 4
        assert not _directory(trainer)["dn-1"]["alive"], \
            "the client's directory was refreshed before the claim: nothing stale to test"
        claim = trainer.claim("t", 4)
        got = claim.tables["t"]
        assert got.num_rows == 4, "the claim was given back (and, at one delivery, dead)"
        assert sorted(got.column("response").to_pylist()) == sorted(rows("a", 4)["response"])
        assert got.column("delivery_count").to_pylist() == [1] * 4    # claimed once
        trainer.ack(claim.claim_id)
        assert trainer.stats("t")["t"]["dead"] == 0


def test_a_claim_while_the_directory_still_has_a_nodes_old_location_costs_no_delivery(
        tmp_path, directory_kept):
    """A data node restarted on a new port before the coordinator missed it: the client's
    cached list still has the old location, where the fetch fails; the client asks the
    coordinator again and fetches from the new one, without giving the rows back."""
    c = Cluster(tmp_path, node_timeout=60)        # (never found silent in this test)
    try:
        with client(c, 1) as producer, client(c, 0) as trainer:
            make_table(producer, max_deliveries=1)
            producer.put("t", rows("a", 4))
            old = _directory(trainer, refresh=True)["dn-1"]["location"]
            c.nodes[1].close()
            c.nodes[1] = c.start_node(1)               # the same disk, a new port
            assert c.nodes[1].location != old
            wait_until(lambda: c.coordinator.registry.nodes["dn-1"]["location"]
                       == c.nodes[1].location, timeout=10, message="dn-1 registered again")
            assert _directory(trainer)["dn-1"]["location"] == old, \
                "the client's directory was refreshed before the claim: nothing stale to test"
            claim = trainer.claim("t", 4)
            got = claim.tables["t"]
            assert got.num_rows == 4, "the claim was given back (and, at one delivery, dead)"
            assert sorted(got.column("response").to_pylist()) == \
                sorted(rows("a", 4)["response"])
            assert got.column("delivery_count").to_pylist() == [1] * 4
            trainer.ack(claim.claim_id)
            assert trainer.stats("t")["t"]["dead"] == 0
    finally:
        c.close()


def test_the_coordinator_finds_a_silent_node_lost_without_any_client(cluster):
    with client(cluster, 1) as producer:
        make_table(producer)
        producer.put("t", rows("a", 3))
        cluster.nodes[1].close()
        wait_until(lambda: producer.stats("t")["t"]["dead"] == 3, timeout=20,
                   message="rows of the silent node dead-lettered")
        assert not {n["node_id"]: n for n in producer.cluster(refresh=True)["nodes"]}["dn-1"][
            "alive"]


def test_a_restarted_coordinator_keeps_its_tables_and_nodes_register_again(tmp_path):
    c = Cluster(tmp_path)
    try:
        with client(c, 0) as s:
            make_table(s)
            s.put("t", rows("a", 4))
        port = c.coordinator.port
        c.coordinator.close()
        c.coordinator = CoordinatorServer(str(tmp_path / "coord.duckdb"), port=port)
        with client(c, 2) as s:
            assert s.describe("t")["columns"][0]["placement"] == "data_node"
            claim = s.claim("t", 4)
            assert claim.tables["t"].num_rows == 4
            assert claim.tables["t"].column("tokens").to_pylist()[0] == [0, 1, 2]
            wait_until(lambda: len(c.coordinator.registry.nodes) == 3, timeout=10,
                       message="data nodes registered again")
    finally:
        c.close()


def test_bad_input_is_refused_with_the_value_named(cluster):
    with pytest.raises(InvalidArgument, match="replicas 3"):
        client(cluster, 0, replicas=3)
    with pytest.raises(InvalidArgument, match="put_threads 0"):
        client(cluster, 0, put_threads=0)
    with pytest.raises(InvalidArgument, match="location key 'nope'"):
        parse_key("nope")
    c = flight.FlightClient(cluster.uri)
    with pytest.raises(flight.FlightServerError) as e:
        action_json(c, "register_node", {"node_id": "bad id!", "location": "grpc://x:1"})
    assert error_code(e.value) == "invalid_argument" and "bad id!" in str(e.value)
    node = flight.FlightClient(cluster.nodes[0].location)
    with pytest.raises(flight.FlightServerError, match="ticket"):
        node.do_get(flight.Ticket(b'{"get": {"keys": ["0:0:1:0"]}}')).read_all()
    with pytest.raises(flight.FlightServerError, match="replicas 5"):
        w, _ = node.do_put(flight.FlightDescriptor.for_command(b'{"put": {"replicas": 5}}'),
                           pa.schema([("v", pa.string())]))
        w.write_batch(pa.record_batch({"v": ["x"]}))
        w.close()
    assert row_keys("dn-0@0:0:1", 2).to_pylist() == ["dn-0@0:0:1/0", "dn-0@0:0:1/1"]
    with client(cluster, 0) as s:
        make_table(s)
        with pytest.raises(InvalidArgument, match="put timeout -1 is invalid"):
            s.put("t", rows("a", 1), timeout=-1)          # the rule of every store's waits
        assert cluster.received() == [0, 0, 0]            # refused before values went anywhere
        assert s.stats("t")["t"]["rows"] == 0


def test_a_rows_columns_written_on_different_machines_come_back_together(cluster):
    with client(cluster, 0) as first, client(cluster, 2) as later, client(cluster, 1) as trainer:
        make_table(first)
        ids = [f"p{i}_0_0" for i in range(5)]
        first.put("t", {"sample_id": ids, "response": [f"resp{i}" for i in range(5)]})
        later.put("t", {"sample_id": ids[:4], "tokens": [[i] for i in range(4)],
                        "reward": [1.0] * 4})
        first.put("t", {"sample_id": ids[4:], "tokens": [[9]], "reward": [2.0]})
        claim = trainer.claim("t", 5)
        data = claim.tables["t"].sort_by("sample_id")
        assert data.column("response").to_pylist() == [f"resp{i}" for i in range(5)]
        assert data.column("tokens").to_pylist() == [[0], [1], [2], [3], [9]]
        assert trainer.fetch_stats["fetches"] == 2      # one call to each of the two nodes


def test_half_precision_values_cross_the_data_nodes_bit_for_bit(cluster):
    """bfloat16 (an Arrow extension type) and float16 values by reference on a data node,
    bfloat16 scalars on the coordinator: a claim on another machine gets the same bits."""
    bits = [0x7F81, 0xFFC1, 0x7F80, 0x0001, 0x8001, 0x8000, 0x3F80, 0xBF00]
    bf16 = pa.ExtensionArray.from_storage(BFLOAT16, pa.array(bits, pa.uint16()))
    with client(cluster, 0) as producer, client(cluster, 1) as trainer:
        producer.create_table("t", {"b": "bfloat16", "lb": "list<bfloat16>",
                                    "lh": "list<float16>"}, storage={"lb": "ref", "lh": "ref"})
        producer.put("t", pa.table({
            "sample_id": ["a_0_0", "b_0_0"], "b": bf16.slice(0, 2),
            "lb": pa.LargeListArray.from_arrays(pa.array([0, 8, 16], pa.int64()),
                                                pa.concat_arrays([bf16, bf16])),
            "lh": pa.array([[1.5, -2.0], [65504.0]], pa.large_list(pa.float16()))}))
        data = trainer.claim("t", 2).tables["t"].sort_by("sample_id")
        assert data.column("b").type == BFLOAT16
        assert data.column("b").combine_chunks().storage.to_pylist() == bits[:2]
        assert data.column("lb").combine_chunks().flatten().storage.to_pylist() == bits * 2
        assert data.column("lh").to_pylist() == [[1.5, -2.0], [65504.0]]


def test_a_null_by_reference_value_gets_no_key(cluster):
    """A row's null in a data-node column is no value written: no key at the coordinator (the
    row waits for that column, as on one server); the others' keys name the node."""
    with client(cluster, 0) as producer:
        make_table(producer)
        data = rows("n", 4)
        data["response"][1] = None
        data["tokens"][2] = None
        producer.put("t", data)
        keys = {r["sample_id"]: r for r in producer.query(
            "SELECT sample_id, response, tokens FROM t").to_pylist()}
        assert keys["n1_0_0"]["response"] is None and keys["n2_0_0"]["tokens"] is None
        named = [k for r in keys.values() for k in (r["response"], r["tokens"]) if k]
        assert len(named) == 6 and all(parse_key(k)[0][0].node == "dn-0" for k in named)
        got = {r["sample_id"]: r for r in producer.claim("t", 4).tables["t"].to_pylist()}
        assert sorted(got) == ["n0_0_0", "n3_0_0"]      # the complete rows
        assert got["n0_0_0"]["response"] == data["response"][0]
        assert got["n3_0_0"]["tokens"] == data["tokens"][3]


# -- auth and TLS on the data nodes ------------------------------------------------------------
@pytest.fixture
def secured(tmp_path) -> Iterator[tuple[Cluster, str]]:
    """A cluster serving TLS with one self-signed certificate and taking the tokens of
    flight_fixtures.TOKENS, on the coordinator and every data node."""
    cert, key = self_signed_cert(tmp_path)
    tokens = write_tokens(tmp_path / "tokens.json")
    c = Cluster(tmp_path, security=ClusterSecurity.from_files(tokens, cert, key, cert),
                tokens_file=tokens, tls_cert=cert, tls_key=key, tls_root_certs=cert)
    yield c, cert
    c.close()


def test_data_nodes_serve_tls_and_take_the_coordinators_tokens(secured):
    c, cert = secured
    assert c.uri.startswith("grpc+tls://")
    assert all(n.location.startswith("grpc+tls://") for n in c.nodes)
    wait_until(lambda: len(c.coordinator.registry.nodes) == 3, timeout=10,
               message="data nodes registered with the node token over TLS")
    with client(c, 1, token=TOKENS["admin"], tls_root_certs=cert, replicas=2) as producer, \
            client(c, 2, token=TOKENS["writer"], tls_root_certs=cert) as trainer:
        make_table(producer)
        producer.put("t", rows("a", 4))          # forwarded to a peer with the node token
        received = c.received()
        assert received[1] > 4 * VALUE and max(received[0], received[2]) > 4 * VALUE
        claim = trainer.claim("t", 4)
        assert sorted(claim.tables["t"].column("response").to_pylist()) == \
            sorted(rows("a", 4)["response"])
        assert trainer.fetch_stats["fetches"] == 1
        trainer.ack(claim.claim_id)


def test_a_data_node_refuses_a_missing_or_wrong_token_as_the_coordinator_does(secured):
    c, cert = secured
    root = Path(cert).read_bytes()
    ticket = flight.Ticket(json.dumps({"get": {"columns": [
        {"keys": ["0:0:1:0"], "type": "string"}]}}).encode())
    for token in (None, WRONG_TOKEN):
        refusals = []
        for location in (c.uri, c.nodes[0].location):
            with flight.FlightClient(location, tls_root_certs=root) as raw:
                with pytest.raises(flight.FlightUnauthenticatedError) as refused:
                    action_json(raw, "health", {}, bearer(token))
                refusals.append(str(refused.value).split("[unauthenticated]")[1].split(".")[0])
                with pytest.raises(flight.FlightUnauthenticatedError):
                    raw.do_get(ticket, bearer(token)).read_all()
        assert refusals[0] == refusals[1]
    with flight.FlightClient(c.nodes[0].location, tls_root_certs=root) as raw:
        with pytest.raises(flight.FlightUnauthorizedError, match="'writer' role"):
            w, _ = raw.do_put(flight.FlightDescriptor.for_command(b'{"put": {"replicas": 1}}'),
                              pa.schema([("v", pa.string())]), bearer(TOKENS["reader"]))
            w.write_batch(pa.record_batch({"v": ["x"]}))
            w.close()
        with pytest.raises(flight.FlightUnauthorizedError, match="'admin' role"):
            action_json(raw, "collect", {"live_segments": [], "grace_seconds": 0},
                        bearer(TOKENS["writer"]))
        assert action_json(raw, "health", {}, bearer(TOKENS["reader"]))["node_id"] == "dn-0"
    # a client without the certificate's root, or speaking plain gRPC, gets nothing
    with flight.FlightClient(c.nodes[0].location) as untrusting:
        with pytest.raises(flight.FlightUnavailableError):
            action_json(untrusting, "health", {}, bearer(TOKENS["reader"]))
    with flight.FlightClient(c.nodes[0].location.replace("grpc+tls", "grpc")) as plain:
        with pytest.raises(flight.FlightUnavailableError):
            action_json(plain, "health", {}, bearer(TOKENS["reader"]))
    # the cluster's client with a reader's token cannot put values on a data node
    with ClusterStore(c.uri, token=TOKENS["reader"], tls_root_certs=cert) as reader:
        with ClusterStore(c.uri, token=TOKENS["admin"], tls_root_certs=cert) as admin:
            make_table(admin)
        with pytest.raises(PermissionDenied, match="a data node's do_put"):
            reader.put("t", rows("x", 1))


# -- re-replication after a loss ---------------------------------------------------------------
def test_after_a_loss_second_copies_are_restored_so_a_second_loss_loses_nothing(cluster):
    with client(cluster, 1, replicas=2) as producer, client(cluster, 0) as trainer:
        make_table(producer)
        producer.put("t", rows("a", 8))
        producer.put("t", rows("b", 8))
        # a response still being streamed: pending, and it must stay so when its key is rewritten
        producer.put("t", {"sample_id": ["open0_0_0"], "response": ["so far"],
                           "response_status": [False], "tokens": [[1]], "reward": [0.5]})
        holders = {h.node for k in producer.query("SELECT tokens FROM t").column(0).to_pylist()
                   for h in parse_key(k)[0]}
        assert len(holders) == 2 and "dn-1" in holders    # the producer's node and a peer
        (other,) = holders - {"dn-1"}
        (third,) = {"dn-0", "dn-2"} - holders
        cluster.nodes[1].close()
        # the coordinator finds dn-1 silent, and the other holder copies what it alone holds
        # now to the third node
        wait_until(lambda: _repaired(trainer), timeout=30,
                   message="second copies restored after the loss of dn-1")
        state = trainer.cluster(refresh=True)
        assert state["replicas_restored"] == 6     # 3 puts × 2 data-node columns
        assert trainer.stats("t")["t"]["pending"] == 1
        keys = trainer.query("SELECT response, tokens FROM t")
        for column in keys.columns:
            assert all({h.node for h in parse_key(k)[0]} == {other, third}
                       for k in column.to_pylist())
        cluster.nodes[int(other[-1])].close()       # the other original holder
        trainer.put("t", {"sample_id": ["open0_0_0"], "response": ["so far, and done"]})
        claim = trainer.claim("t", 17)
        got = claim.tables["t"]
        assert got.num_rows == 17
        assert sorted(got.column("response").to_pylist()) == \
            sorted(rows("a", 8)["response"] + rows("b", 8)["response"] + ["so far, and done"])
        assert sorted(got.column("tokens").to_pylist()) == \
            sorted(rows("a", 8)["tokens"] * 2 + [[1]])
        trainer.ack(claim.claim_id)
        assert trainer.stats("t")["t"]["dead"] == 0


def _repaired(s: ClusterStore) -> bool:
    state = s.cluster(refresh=True)
    lost = {n["node_id"] for n in state["nodes"] if not n["alive"]}
    return "dn-1" in lost and not state["repair_pending"] and state["under_replicated"] == 0 \
        and state["replicas_restored"] > 0


# -- GC of data-node segments ------------------------------------------------------------------
def _disk(path: Path) -> int:
    return sum(os.path.getsize(p) for p in path.glob("seg-*.arrow"))


def test_gc_deletes_the_segments_no_row_names_on_the_data_nodes(tmp_path):
    c = Cluster(tmp_path, gc_grace=0)
    try:
        with client(c, 0) as s:
            make_table(s, "gone")
            make_table(s, "kept")
            s.put("gone", rows("g", 16))
            first = s.gc()                          # everything is named: nothing goes
            assert first["data_nodes"]["dn-0"]["segments_removed"] == 0
            s.put("kept", rows("k", 4))
            node = flight.FlightClient(c.nodes[0].location)
            held = _disk(tmp_path / "dn-0")
            assert held > 20 * VALUE
            s.drop_table("gone")
            # within the grace period a node keeps even a segment no row names
            kept = action_json(node, "collect", {"live_segments": [], "grace_seconds": 3600})
            assert kept["segments_removed"] == 0 and _disk(tmp_path / "dn-0") == held
            answer = s.gc()
            freed = answer["data_nodes"]["dn-0"]
            assert freed["segments_removed"] == 1 and freed["bytes_freed"] > 16 * VALUE
            assert _disk(tmp_path / "dn-0") <= held - 16 * VALUE   # the space is returned
            assert answer["data_nodes"]["dn-1"]["segments_removed"] == 0
            claim = s.claim("kept", 4)
            assert sorted(claim.tables["kept"].column("response").to_pylist()) == \
                sorted(rows("k", 4)["response"])
            s.ack(claim.claim_id)
            with pytest.raises(flight.FlightServerError, match="live_segments"):
                action_json(node, "collect", {"live_segments": ["0"], "grace_seconds": 0})
        # the operator's command: `expstore gc --uri <coordinator>` reports every data node
        from click.testing import CliRunner

        from expstore.cli import cli
        ran = CliRunner().invoke(cli, ["gc", "--uri", c.uri, "--json"])
        assert ran.exit_code == 0, ran.output
        assert set(json.loads(ran.output)["data_nodes"]) == {"dn-0", "dn-1", "dn-2"}
    finally:
        c.close()


def test_gc_drop_rows_frees_the_consumed_rows_segments_on_the_data_nodes(tmp_path):
    """Retention through a coordinator: finished rows dropped there no longer name their
    data node's segments, which its collect then deletes."""
    c = Cluster(tmp_path, gc_grace=0)
    try:
        with client(c, 0) as s:
            make_table(s, "t")
            s.put("t", rows("a", 16))
            s.gc()                                  # the nodes start new segments
            s.put("t", rows("b", 1))                # the table's newest row, kept
            while (claim := s.claim("t", 8)).claim_id:
                s.ack(claim.claim_id)
            s.bump_version("t")
            held = _disk(tmp_path / "dn-0")
            answer = s.gc(drop_rows=["consumed"])
            assert answer["rows_dropped"] == 16
            freed = answer["data_nodes"]["dn-0"]
            assert freed["segments_removed"] >= 1 and freed["bytes_freed"] > 16 * VALUE
            assert _disk(tmp_path / "dn-0") <= held - 16 * VALUE
            assert s.query("SELECT sample_id FROM t").column(0).to_pylist() == ["b0_0_0"]
    finally:
        c.close()


def test_the_coordinators_half_of_a_put_travels_on_the_session(cluster):
    """Keys and simple columns of 256 rows are small: one message on the client's open
    session, not a do_put call of their own (a new call per put cost the producer more)."""
    def calls(verb: str) -> float:
        return cluster.coordinator.metrics.registry.get_sample_value(
            "expstore_request_seconds_count", {"verb": verb}) or 0.0

    with client(cluster, 0) as producer:
        make_table(producer)
        producer.put("t", rows("warm", 1))       # the session learns it carries puts
        # (a call is counted once the server is done with it: after its answer)
        wait_until(lambda: calls("put") == 1, timeout=10, message="the first put counted")
        producer.put("t", rows("a", 256))
        wait_until(lambda: calls("do_put") + calls("put") == 2, timeout=10,
                   message="the second put counted")
        assert (calls("do_put"), calls("put")) == (0, 2)
        assert producer.stats("t")["t"]["ready"] == 257


def test_put_async_returns_at_once_and_its_puts_land_in_order(cluster):
    """put_async hands the values to a put thread: the caller goes on while the data node
    writes (here: while it is held), and the puts reach the coordinator in order."""
    node = cluster.nodes[0]
    with client(cluster, 0) as producer:
        make_table(producer)
        producer.put("t", rows("warm", 1))
        futures: list[Any] = []
        with node._write_lock:                  # the data node cannot store anything now
            caller = threading.Thread(target=lambda: futures.extend(
                producer.put_async("t", rows("a", 8, turn=t)) for t in range(3)))
            caller.start()
            caller.join(10)
            assert not caller.is_alive(), "put_async waited for the data node"
            assert len(futures) == 3 and not any(f.done() for f in futures)
        assert [f.result(30)["rows"] for f in futures] == [8, 8, 8]
        order = producer.query("SELECT sample_id FROM t ORDER BY row_id").column(0).to_pylist()
        assert [int(i.split("_")[1]) for i in order[1:]] == [t for t in range(3) for _ in range(8)]
        claim = producer.claim("t", 100)
        assert sorted(claim.tables["t"].column("response").to_pylist()) == sorted(
            [f"warm0:" + "r" * VALUE] + [v for t in range(3) for v in rows("a", 8, t)["response"]])


def test_put_async_raises_through_its_future_and_close_waits_for_its_puts(cluster):
    with client(cluster, 0) as producer:
        make_table(producer)
        bad = producer.put_async("t", {"sample_id": ["x_0_0"], "reward": ["not a number"]})
        with pytest.raises(InvalidArgument, match="reward"):
            bad.result(30)
        for t in range(4):
            producer.put_async("t", rows("b", 8, turn=t))
    # (close answered the puts made before it)
    with client(cluster, 1) as trainer:
        assert trainer.stats("t")["t"]["ready"] == 32


def _puts_at(node: DataNodeServer) -> int:
    """How many puts' values ``node`` is storing (or waiting to store) right now."""
    code = DataNodeServer._store_batch.__code__
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code is code and frame.f_locals.get("self") is node:
                count += 1
                break
            frame = frame.f_back
    return count


def test_put_async_sends_several_puts_values_at_once_and_the_last_put_wins(cluster):
    """With put_threads, the values of several puts travel to the data node at once (here:
    all wait at the held node together); their keys still reach the coordinator in the order
    of the puts, so a sample's column holds the last put's value, whichever put the node
    stored first."""
    node = cluster.nodes[0]
    with client(cluster, 0, put_threads=3) as producer:
        make_table(producer, required=["response"])
        producer.put("t", rows("warm", 1))
        with node._write_lock:
            futures = [producer.put_async("t", {
                "sample_id": [f"a{i}_0_0" for i in range(8)],
                "response": [f"put {t} row {i}" for i in range(8)],
                "reward": [float(t)] * 8}) for t in range(3)]
            wait_until(lambda: _puts_at(node) == 3, timeout=10,
                       message="three puts' values at the data node at once")
            assert not any(f.done() for f in futures)
        assert [f.result(30)["rows"] for f in futures] == [8, 8, 8]
        claim = producer.claim("t", 100, where="sample_id LIKE 'a%'")
        got = claim.tables["t"].select(["response", "reward"]).to_pylist()
        assert sorted(got, key=lambda r: r["response"]) == [
            {"response": f"put 2 row {i}", "reward": 2.0} for i in range(8)]


def test_a_writer_retrying_a_put_never_overwrites_what_a_later_put_wrote(cluster):
    """A fault on a put while later ones are on their way: the first put carries a sample
    whose version a bump made stale, so the coordinator refuses it whole (StaleVersion), while
    the second, sent meanwhile, writes a newer response of a sample the first put also
    carried. The writer sends the first put's samples again, one by one, after the second
    was answered: without the newer column, which would otherwise be overwritten by the
    older value."""
    node = cluster.nodes[0]
    with client(cluster, 0) as producer:
        make_table(producer, required=["response"])
        producer.bump_version("t")                        # version 1: samples of 0 are stale
        w = ExperienceWriter(producer, "t", batch_rows=2, flush_interval=30,
                             track_version=False, puts_in_flight=4)
        with node._write_lock:                            # both puts wait at the data node
            w.write([{"sample_id": "y_0_0", "response": "stale", "policy_version": 0},
                     {"sample_id": "x_0_0", "response": "older", "reward": 1.0,
                      "policy_version": 1}])
            wait_until(lambda: w.in_flight_rows == 2, timeout=10, message="first put sent")
            w.write([{"sample_id": "x_0_0", "response": "newer", "policy_version": 1},
                     {"sample_id": "z_0_0", "response": "other", "policy_version": 1}])
            wait_until(lambda: w.in_flight_rows == 4, timeout=10, message="second put sent")
        w.close(timeout=30)
        assert [r["sample_id"] for r in w.stale_rows] == ["y_0_0"]
        claim = producer.claim("t", 10)
        got = {r["sample_id"]: (r["response"], r["reward"])
               for r in claim.tables["t"].select(["sample_id", "response", "reward"]).to_pylist()}
        # x's reward came only with the first put: it is sent again; its response is the newer
        assert got == {"x_0_0": ("newer", 1.0), "z_0_0": ("other", None)}


def test_a_writers_flush_and_close_wait_for_every_put_in_flight(cluster):
    node = cluster.nodes[0]
    with client(cluster, 0) as producer:
        make_table(producer, required=["response"])
        w = ExperienceWriter(producer, "t", batch_rows=4, flush_interval=30,
                             track_version=False, puts_in_flight=3)
        closed = threading.Event()
        with node._write_lock:
            for t in range(3):
                w.write([{"sample_id": f"s{i}_{t}_0", "response": f"r{t}"} for i in range(4)])
                wait_until(lambda: w.in_flight_rows == 4 * (t + 1), timeout=10,
                           message=f"put {t} sent")
            closer = threading.Thread(target=lambda: (w.close(timeout=30), closed.set()))
            closer.start()
            assert not closed.wait(0.5), "close returned with puts in flight"
        closer.join(30)
        assert closed.is_set() and w.rows_written == 12 and w.in_flight_rows == 0
        assert producer.stats("t")["t"]["ready"] == 12
