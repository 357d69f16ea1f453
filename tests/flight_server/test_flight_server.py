"""The Flight server's verbs and its behaviour under concurrency, one real server per test.

Listing and schemas, per-batch put answers, many producers and consumers at once, and
do_exchange subscriptions: pushed without polling, bounded by ``max_in_flight``, paused at the
accumulation boundary until a bump, and released when a subscriber disappears.
"""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import store
from flight_fixtures import (action, action_json, parse_claim, put_batches, query,
                             running_server, wait_until)

TABLE = "solver"


@pytest.fixture
def server(tmp_path):
    with running_server(tmp_path / "x.duckdb") as srv:
        yield srv


@pytest.fixture
def client(server):
    with flight.FlightClient(server.location) as c:
        yield c


def _create(client: flight.FlightClient, name: str = TABLE, **options: Any) -> dict:
    return action_json(client, "create_table", {
        "name": name, "columns": {"prompt": "string", "reward": "float64"}, **options})


def _rows(ids: list[str]) -> pa.RecordBatch:
    return pa.record_batch({"sample_id": ids, "prompt": ["p"] * len(ids),
                            "reward": [float(i) for i in range(len(ids))]})


# -- listing -------------------------------------------------------------------------------------
def test_one_flight_per_table_with_its_schema(client):
    _create(client, "solver")
    action(client, "create_table", {"name": "verifier", "columns": {
        "verdict": "bool", "token_ids": "list<int32>", "logits": "tensor<float32>"}})
    infos = {info.descriptor.path[0].decode(): info for info in client.list_flights()}
    assert set(infos) == {"solver", "verifier"}
    for name, info in infos.items():
        described = action_json(client, "describe", {"table": name})
        data = [c["name"] for c in described["columns"]]
        expected = ["sample_id", "policy_version", "finished_version", *data,
                    *[f"{c}_status" for c in data]]
        assert info.schema.names == expected
        assert client.get_flight_info(flight.FlightDescriptor.for_path(name)).schema == \
            info.schema
        assert client.get_schema(flight.FlightDescriptor.for_path(name)).schema == info.schema
    verifier = infos["verifier"].schema
    assert verifier.field("token_ids").type == pa.large_list(pa.int32())
    assert verifier.field("logits").type == pa.struct([
        ("shape", pa.list_(pa.int64())), ("data", pa.large_list(pa.float32()))])

    # The endpoint's ticket reads the table back with do_get.
    put_batches(client, "solver", [_rows(["q1_0_0", "q2_0_0"])])
    (endpoint,) = infos["solver"].endpoints
    table = client.do_get(endpoint.ticket).read_all()
    assert sorted(table.column("sample_id").to_pylist()) == ["q1_0_0", "q2_0_0"]
    assert "consumed" in table.column_names  # reads see the meta columns too


def test_do_put_answers_every_batch(client):
    _create(client)
    batches = [_rows([f"q{b}_0_{i}" for i in range(b + 1)]) for b in range(5)]
    answers = put_batches(client, TABLE, batches)  # waits for each answer before the next batch
    assert answers == [{"batch": b, "rows": b + 1, "version": 0} for b in range(5)]

    # A client that streams everything first gets the same answers, in order.
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(TABLE), batches[0].schema)
    for i in range(20):
        writer.write_batch(_rows([f"s{i}_0_0", f"s{i}_0_1"]))
    writer.done_writing()
    streamed = []
    while (buf := reader.read()) is not None:
        streamed.append(json.loads(buf.to_pybytes()))
    writer.close()
    assert [a["batch"] for a in streamed] == list(range(20))
    assert all(a["rows"] == 2 for a in streamed)
    assert query(client, f"SELECT count(*) AS n FROM {TABLE}").to_pylist() == [{"n": 55}]


def test_do_put_holds_a_bounded_number_of_bytes_in_flight(tmp_path, monkeypatch):
    """Batches wait for room before they reach the writer: at most ``put_pipeline_bytes`` of
    them (any one batch alone), however fast the client streams; all are answered, in order."""
    from store.ops import CallOp

    size = _rows(["s00_0_0", "s00_0_1"]).nbytes  # every batch below has this size
    with running_server(tmp_path / "x.duckdb", put_pipeline_bytes=int(3.5 * size)) as srv, \
            flight.FlightClient(srv.location) as c:
        _create(c)
        queued: list[int] = []
        put_async = srv.store.put_async
        monkeypatch.setattr(srv.store, "put_async",
                            lambda table, data: (queued.append(data.num_rows),
                                                 put_async(table, data))[1])
        gate = threading.Event()
        held = srv.store._writer.submit(CallOp(run=lambda con: gate.wait(30)))  # writer busy
        writer, reader = c.do_put(flight.FlightDescriptor.for_path(TABLE), _rows(["x"]).schema)
        try:
            for i in range(10):
                writer.write_batch(_rows([f"s{i:02}_0_0", f"s{i:02}_0_1"]))
            wait_until(lambda: len(queued) == 3)
            time.sleep(0.3)
            assert len(queued) == 3  # the fourth batch waits for room
            gate.set()
            held.result(30)
            writer.done_writing()
            answers = []
            while (buf := reader.read()) is not None:
                answers.append(json.loads(buf.to_pybytes()))
        finally:
            gate.set()
            writer.close()
    assert [a["batch"] for a in answers] == list(range(10)) and len(queued) == 10


def test_put_answer_means_durable(tmp_path):
    """What was answered survives the server (its store is reopened from the file)."""
    with running_server(tmp_path / "x.duckdb") as srv:
        with flight.FlightClient(srv.location) as c:
            _create(c)
            put_batches(c, TABLE, [_rows(["q1_0_0"]), _rows(["q2_0_0"])])
    with running_server(tmp_path / "x.duckdb") as srv:
        with flight.FlightClient(srv.location) as c:
            ids = query(c, f"SELECT sample_id FROM {TABLE} ORDER BY 1").column(0).to_pylist()
    assert ids == ["q1_0_0", "q2_0_0"]


# -- concurrency ---------------------------------------------------------------------------------
def test_many_producers_and_two_consumers(server, client):
    _create(client, lease_seconds=60)
    producers, puts, rows_per_put = 16, 10, 5
    expected = {f"p{p}x{k}_0_{r}" for p in range(producers) for k in range(puts)
                for r in range(rows_per_put)}
    produced = threading.Event()
    errors: queue.Queue = queue.Queue()
    delivered: list[list[str]] = [[], []]

    def produce(p: int) -> None:
        try:
            with flight.FlightClient(server.location) as c:
                for k in range(puts):
                    put_batches(c, TABLE, [_rows([f"p{p}x{k}_0_{r}"
                                                  for r in range(rows_per_put)])])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.put(e)

    def consume(i: int) -> None:
        try:
            with flight.FlightClient(server.location) as c:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    header, tables = parse_claim(action(c, "claim", {
                        "table": TABLE, "limit": 16, "consumer": f"trainer-{i}"}))
                    if not header["claim_id"]:
                        if produced.is_set() and sum(map(len, delivered)) >= len(expected):
                            return
                        continue
                    delivered[i].extend(tables[TABLE].column("sample_id").to_pylist())
                    assert action_json(c, "ack", {"claim_id": header["claim_id"]})["acked"] \
                        == tables[TABLE].num_rows
        except BaseException as e:  # noqa: BLE001
            errors.put(e)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    consumers = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads + consumers:
        t.start()
    for t in threads:
        t.join(timeout=60)
    produced.set()
    for t in consumers:
        t.join(timeout=60)
    assert errors.empty(), errors.get()
    assert not any(t.is_alive() for t in threads + consumers)
    everything = delivered[0] + delivered[1]
    duplicates = [s for s, n in Counter(everything).items() if n > 1]
    assert not duplicates, f"delivered twice: {duplicates[:5]}"
    assert set(everything) == expected
    assert delivered[0] and delivered[1], "both consumers should have had a share"
    stats = action_json(client, "stats", {"table": TABLE})[TABLE]
    assert (stats["rows"], stats["consumed"], stats["ready"], stats["processing"]) == (
        len(expected), len(expected), 0, 0)


# -- subscriptions over do_exchange ----------------------------------------------------------------
class RawSubscriber:
    """A do_exchange subscription read by a thread into a queue (pyarrow.flight + json only)."""

    def __init__(self, location: str, **subscribe: Any) -> None:
        self.client = flight.FlightClient(location)
        command = json.dumps({"subscribe": {"table": TABLE, **subscribe}}).encode()
        self.writer, self.reader = self.client.do_exchange(
            flight.FlightDescriptor.for_command(command))
        self.hello = json.loads(self.reader.read_chunk().app_metadata.to_pybytes())
        self.inbox: queue.Queue = queue.Queue()
        self._requests = iter(range(1, 1 << 30))
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        try:
            while True:
                chunk = self.reader.read_chunk()
                self.inbox.put((json.loads(chunk.app_metadata.to_pybytes()), chunk.data))
        except BaseException as e:  # noqa: BLE001 - the end of the stream, or its error
            self.inbox.put((None, e))

    def next(self, timeout: float = 10.0) -> tuple[dict, pa.RecordBatch | None]:
        try:
            meta, data = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"nothing arrived on the subscription within {timeout} s")
        assert meta is not None, f"the subscription ended: {data!r}"
        return meta, data

    def request(self, msg: dict) -> dict:
        """Send a message and return its answer (asserting nothing else came before it)."""
        request = next(self._requests)
        self.writer.write_metadata(pa.py_buffer(json.dumps({**msg, "request": request})
                                                .encode()))
        meta, data = self.next()
        assert meta.get("request") == request, f"expected the answer to {msg}, got {meta}"
        return meta

    def probe(self) -> None:
        """A round trip on the ordered stream: a micro-batch sent before it would be read first
        (and fail the request's assertion)."""
        answer = self.request({"type": "ack", "claim_id": "probe"})
        assert answer["type"] == "error"

    def close(self) -> None:
        try:
            self.writer.write_metadata(pa.py_buffer(b'{"type": "close"}'))
            self.writer.done_writing()
        finally:
            self.thread.join(timeout=10)
            self.writer.close()
            self.client.close()


def _stats(client: flight.FlightClient) -> dict:
    return action_json(client, "stats", {"table": TABLE})[TABLE]


def test_subscription_pushes_without_polling(server, client):
    _create(client)
    sub = RawSubscriber(server.location, micro_batch_size=2, global_batch_size=4)
    try:
        assert sub.hello == {"type": "subscribed", "table": TABLE, "version": 0}
        assert sub.inbox.empty()
        started = time.monotonic()
        put_batches(client, TABLE, [_rows(["q1_0_0", "q1_0_1"])])
        meta, data = sub.next(timeout=10)  # blocked on the stream; the server pushed it
        assert time.monotonic() - started < 5
        assert meta["type"] == "micro_batch" and data.num_rows == 2
        assert sub.request({"type": "ack", "claim_id": meta["claim_id"]})["acked"] == 2
    finally:
        sub.close()


def test_subscription_respects_max_in_flight(server, client):
    _create(client)
    put_batches(client, TABLE, [_rows([f"q{i}_0_0" for i in range(20)])])
    sub = RawSubscriber(server.location, micro_batch_size=2, global_batch_size=20,
                        max_in_flight=3, consumer="k3")
    try:
        first = [sub.next() for _ in range(3)]
        assert [m["index"] for m, _ in first] == [0, 1, 2]
        sub.probe()  # no fourth micro-batch came before the probe's answer
        leases = action_json(client, "leases", {"table": TABLE})
        assert len(leases) == 3 and {lease["consumer"] for lease in leases} == {"k3"}
        assert _stats(client)["processing"] == 6
        # Each ack frees exactly one slot.
        sub.request({"type": "ack", "claim_id": first[0][0]["claim_id"]})
        meta, _ = sub.next()
        assert meta["type"] == "micro_batch" and meta["index"] == 3
        sub.probe()
        assert len(action_json(client, "leases", {"table": TABLE})) == 3
    finally:
        sub.close()


def test_subscription_pauses_at_the_boundary_until_bump(server, client):
    _create(client, max_staleness=1)
    put_batches(client, TABLE, [_rows([f"q{i}_0_0" for i in range(8)])])
    sub = RawSubscriber(server.location, micro_batch_size=2, global_batch_size=4,
                        max_in_flight=4)
    try:
        a, _ = sub.next()
        b, _ = sub.next()
        assert (a["index"], a["is_boundary"], b["index"], b["is_boundary"]) == (0, False, 1, True)
        for m in (a, b):
            sub.request({"type": "ack", "claim_id": m["claim_id"]})
        sub.probe()  # paused: free slots, ready rows, yet nothing is delivered
        assert _stats(client)["ready"] == 4
        # A producer waiting for the new version learns of the bump.
        waited: queue.Queue = queue.Queue()
        with flight.FlightClient(server.location) as producer:
            waiter = threading.Thread(target=lambda: waited.put(action_json(
                producer, "wait_version", {"table": TABLE, "min_version": 1, "timeout": 30})))
            waiter.start()
            assert sub.request({"type": "bump", "weights_uri": "s3://w/1"}) == {
                "type": "bumped", "request": 4, "version": 1}
            assert waited.get(timeout=10)["version"] == 1
            waiter.join(timeout=10)
        c, _ = sub.next()
        assert (c["index"], c["global_batch"], c["version"]) == (0, 1, 1)
        # resume() starts the next global batch without a bump (off-policy trainers).
        d, _ = sub.next()
        assert d["is_boundary"]
        for m in (c, d):
            sub.request({"type": "ack", "claim_id": m["claim_id"]})
        assert sub.request({"type": "resume"})["type"] == "resumed"
        assert action_json(client, "get_version", {"table": TABLE})["version"] == 1
    finally:
        sub.close()


SUBSCRIBER_PROCESS = """
import json, sys
import pyarrow.flight as flight
client = flight.FlightClient(sys.argv[1])
command = {"subscribe": {"table": sys.argv[2], "micro_batch_size": 2, "global_batch_size": 4,
                         "max_in_flight": 2, "consumer": "doomed"}}
writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(json.dumps(command).encode()))
reader.read_chunk()
for _ in range(2):
    chunk = reader.read_chunk()
    print(json.dumps(chunk.data.column("sample_id").to_pylist()), flush=True)
reader.read_chunk()  # holds its leases until killed
"""


def test_killed_subscriber_releases_its_leases(server, client):
    """A trainer process that dies mid-batch (SIGKILL: no close message, no end of stream)."""
    _create(client, lease_seconds=600)  # far beyond the test: only the disconnect frees them
    ids = [f"q{i}_0_0" for i in range(4)]
    put_batches(client, TABLE, [_rows(ids)])
    proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER_PROCESS, server.location, TABLE],
                            stdout=subprocess.PIPE, text=True)
    try:
        taken = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert sorted(taken[0] + taken[1]) == ids
        assert _stats(client)["processing"] == 4
        assert {lease["consumer"] for lease in action_json(client, "leases", {})} == {"doomed"}
    finally:
        proc.kill()
        proc.wait(timeout=30)
    wait_until(lambda: _stats(client)["ready"] == 4, timeout=15,
               message="the dead subscriber's rows becoming ready")
    assert action_json(client, "leases", {"table": TABLE}) == []
    header, tables = parse_claim(action(client, "claim", {"table": TABLE, "limit": 10,
                                                          "consumer": "other"}))
    assert sorted(tables[TABLE].column("sample_id").to_pylist()) == ids
    assert action_json(client, "ack", {"claim_id": header["claim_id"]})["acked"] == 4


def test_producer_long_polls_for_a_bump_from_another_thread(server, client):
    _create(client)
    with store.connect(server.location) as remote:
        got: queue.Queue = queue.Queue()
        thread = threading.Thread(target=lambda: got.put(remote.wait_version(TABLE, 2, 30)))
        thread.start()
        assert got.empty()
        action(client, "bump_version", {"table": TABLE, "expected": 0})
        action(client, "bump_version", {"table": TABLE, "expected": 1, "weights_uri": "w2"})
        assert got.get(timeout=10) == 2
        thread.join(timeout=10)
        assert remote.weights_uri(TABLE) == "w2"
        # A long-poll whose version never comes returns the current one at its deadline.
        started = time.monotonic()
        assert remote.wait_version(TABLE, 9, timeout=0.3) == 2
        assert time.monotonic() - started < 5


def test_remote_subscription_round_trip(server, client):
    """The Python client over the same stream: iterate, ack, boundary, bump."""
    _create(client)
    put_batches(client, TABLE, [_rows([f"q{i}_0_0" for i in range(4)])])
    with store.connect(server.location) as remote:
        with remote.subscribe(TABLE, 2, 4, idle_timeout=10) as sub:
            seen = []
            for mb in sub:
                seen += mb.data.column("sample_id").to_pylist()
                assert mb.ack()["acked"] == 2
                if mb.is_boundary:
                    assert sub.bump_version("w1") == 1
                    break
        assert sorted(seen) == [f"q{i}_0_0" for i in range(4)]
        assert remote.get_version(TABLE) == 1


def test_claim_reports_this_delivery_in_delivery_count(client):
    _create(client)
    put_batches(client, TABLE, [_rows([f"q{i}_0_0" for i in range(20)])])
    counts = []
    for _ in range(20):
        header, tables = parse_claim(action(client, "claim", {"table": TABLE, "limit": 1}))
        counts += tables[TABLE].column("delivery_count").to_pylist()
    assert counts == [1] * 20


PUTTER_PROCESS = """
import os, signal, sys
import pyarrow as pa
import pyarrow.flight as flight
client = flight.FlightClient(sys.argv[1])
n = 20000
batch = pa.record_batch({"sample_id": [f"big{i}_0_0" for i in range(n)],
                         "prompt": ["p" * 2000] * n, "reward": [1.0] * n})
writer, reader = client.do_put(flight.FlightDescriptor.for_path(sys.argv[2]), batch.schema)
writer.write_batch(batch)
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # gone before the batch is answered
"""


def test_a_producer_killed_mid_put_is_an_info_line_not_an_error(server, client, caplog):
    """Issue 29: a client that disconnected mid-put left an ERROR "internal error" traceback
    in the server's log. It is no failure of the server: one INFO line, and the batch the
    server received is stored all the same."""
    import logging

    _create(client)
    caplog.set_level(logging.INFO, logger="expstore")
    for attempt in range(3):  # the kill lands at various points of the put
        proc = subprocess.run([sys.executable, "-c", PUTTER_PROCESS, server.location, TABLE],
                              capture_output=True, text=True, timeout=120)
        assert proc.stdout.strip() == "sent", proc.stderr[-2000:]
    wait_until(lambda: any("the client went away" in r.getMessage()
                           for r in caplog.records), timeout=30,
               message="the server noting the producer that went away")
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [(r.levelname, r.getMessage()[:200]) for r in errors]
    gone = [r for r in caplog.records if "the client went away" in r.getMessage()]
    assert all(r.levelno == logging.INFO and not r.exc_info for r in gone)
    wait_until(lambda: _stats(client)["rows"] == 20000, timeout=60,
               message="the received batch stored")
