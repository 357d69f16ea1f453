"""docs/protocol.md followed with nothing but ``pyarrow.flight``, ``pyarrow`` and ``json``.

This is what rollout code in another language does: no expstore client is imported on the client
side (only the server is started in-process). Every message format checked here is one the
protocol document promises.
"""
from __future__ import annotations

import json
import queue
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_server import ExpstoreFlightServer

TABLE = "solver"


@pytest.fixture
def location(tmp_path):
    with ExpstoreFlightServer(str(tmp_path / "x.duckdb"), host="127.0.0.1", port=0) as server:
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        yield f"grpc://127.0.0.1:{server.port}"
    thread.join(timeout=30)


@pytest.fixture
def client(location):
    with flight.FlightClient(location) as c:
        c.wait_for_available(timeout=10)
        yield c


# -- the client side: only pyarrow + json below ----------------------------------------------------
def act(client: flight.FlightClient, name: str, body: dict) -> list[bytes]:
    return [r.body.to_pybytes() for r in
            client.do_action(flight.Action(name, json.dumps(body).encode()))]


def act_json(client: flight.FlightClient, name: str, body: dict) -> dict:
    (result,) = act(client, name, body)
    return json.loads(result)


def sql(client: flight.FlightClient, text: str, params: list | None = None) -> pa.Table:
    ticket = {"sql": text} if params is None else {"sql": text, "params": params}
    return client.do_get(flight.Ticket(json.dumps(ticket).encode())).read_all()


def put_in_steps(client: flight.FlightClient, batches: list[pa.RecordBatch]) -> list[dict]:
    """One do_put stream; each batch's answer is awaited before the next batch is sent."""
    writer, answers = client.do_put(flight.FlightDescriptor.for_path(TABLE), batches[0].schema)
    out = []
    with writer:
        for batch in batches:
            writer.write_batch(batch)
            out.append(json.loads(answers.read().to_pybytes()))
        writer.done_writing()
        assert answers.read() is None  # the stream ends after the last answer
    return out


def claim(client: flight.FlightClient, body: dict) -> tuple[dict, dict[str, pa.Table]]:
    results = act(client, "claim", body)
    header = json.loads(results[0])
    tables = {name: pa.ipc.open_stream(results[i + 1]).read_all()
              for i, name in enumerate(header["tables"])}
    return header, tables


def test_produce_claim_ack_bump_over_raw_flight(client, location):
    created = act_json(client, "create_table", {
        "name": TABLE, "columns": {"prompt": "string", "response": "string", "reward": "float64"},
        "max_staleness": 0, "lease_seconds": 30})
    assert created["name"] == TABLE and created["version"] == 0
    assert [c["name"] for c in created["columns"]] == ["prompt", "response", "reward"]

    # The flight of the table says what a producer may write.
    (info,) = list(client.list_flights())
    assert info.descriptor.path == [TABLE.encode()]
    assert info.schema.field("sample_id").type == pa.large_string()
    assert "reward_status" in info.schema.names

    ids = ["q1_0_0", "q1_0_1", "q2_0_0", "q2_0_1"]
    # 1. prompts first: a batch of only (sample_id, prompt), answered once durable.
    prompts = pa.record_batch({"sample_id": ids[:2], "prompt": ["1+1?", "1+1?"]})
    more = pa.record_batch({"sample_id": ids[2:], "prompt": ["2+2?", "2+2?"]})
    answers = put_in_steps(client, [prompts, more])
    assert answers == [{"batch": 0, "rows": 2, "version": 0}, {"batch": 1, "rows": 2, "version": 0}]

    # Incomplete rows are pending: a claim finds nothing and holds no lease.
    header, tables = claim(client, {"table": TABLE, "limit": 4})
    assert header["claim_id"] == "" and header["tables"] == {} and tables == {}

    # 2. a response streamed in two steps: partial with an explicit false status, then final.
    partial = pa.record_batch({"sample_id": ids, "response": ["2", "2", "4", "4"],
                               "response_status": [False] * 4})
    final = pa.record_batch({"sample_id": ids, "response": ["2.", "2!", "4.", "4!"],
                             "response_status": [True] * 4})
    assert [a["rows"] for a in put_in_steps(client, [partial, final])] == [4, 4]
    # 3. the reward last (a plain Python float column: types convert to the table's).
    rewards = pa.record_batch({"sample_id": ids, "reward": pa.array([1.0, 0.0, 1.0, 0.5])})
    assert put_in_steps(client, [rewards]) == [{"batch": 0, "rows": 4, "version": 0}]

    # Claim: JSON header, then one Arrow IPC stream per table, in the deterministic order.
    header, tables = claim(client, {"table": TABLE, "limit": 3, "consumer": "trainer-0"})
    assert set(header) == {"claim_id", "consumer", "expires_at", "tables"}
    assert header["consumer"] == "trainer-0" and header["tables"] == {TABLE: 3}
    assert header["expires_at"] > time.time()
    rows = tables[TABLE]
    assert rows.column("sample_id").to_pylist() == ids[:3]
    assert rows.column("input_id").to_pylist() == ["q1", "q1", "q2"]
    assert rows.column("trajectory_id").to_pylist() == [0, 1, 0]
    assert rows.column("response").to_pylist() == ["2.", "2!", "4."]
    assert rows.column("reward").to_pylist() == [1.0, 0.0, 1.0]
    assert all(rows.column("response_status").to_pylist())

    # SQL sees the lease shortly after (lease columns are soft state, written lazily).
    deadline = time.monotonic() + 10
    while sql(client, f"SELECT count(*) AS n FROM {TABLE} WHERE is_processing AND "
                      "lease_owner = 'trainer-0'").column("n").to_pylist() != [3]:
        assert time.monotonic() < deadline, "the lease never became visible to SQL"
        time.sleep(0.02)

    acked = act_json(client, "ack", {"claim_id": header["claim_id"]})
    assert acked == {"claim_id": header["claim_id"], "acked": 3}
    again = act_json(client, "ack", {"claim_id": header["claim_id"]})
    assert again["duplicate"] is True and again["acked"] == 3

    consumed = sql(client, f"SELECT sample_id, consumed FROM {TABLE} WHERE policy_version = ? "
                           "ORDER BY sample_id", [0])
    assert consumed.to_pylist() == [{"sample_id": s, "consumed": s != "q2_0_1"} for s in ids]

    # A producer long-polls for the next version from another thread; the trainer bumps.
    waited: queue.Queue = queue.Queue()
    with flight.FlightClient(location) as producer:
        thread = threading.Thread(target=lambda: waited.put(act_json(
            producer, "wait_version", {"table": TABLE, "min_version": 1, "timeout": 30})))
        thread.start()
        bumped = act_json(client, "bump_version", {"table": TABLE, "expected": 0,
                                                   "weights_uri": "file:///w/1"})
        assert bumped == {"table": TABLE, "version": 1, "weights_uri": "file:///w/1"}
        seen = waited.get(timeout=10)
        thread.join(timeout=10)
    assert seen == {"table": TABLE, "version": 1, "reached": True, "weights_uri": "file:///w/1"}
    assert act_json(client, "get_version", {"table": TABLE}) == {
        "table": TABLE, "version": 1, "weights_uri": "file:///w/1"}
    # A long-poll that times out answers with reached = false.
    assert act_json(client, "wait_version", {"table": TABLE, "min_version": 5,
                                             "timeout": 0})["reached"] is False

    # A lost compare-and-set is a typed error with a machine-readable code.
    with pytest.raises(flight.FlightServerError) as lost:
        act(client, "bump_version", {"table": TABLE, "expected": 0})
    assert json.loads(lost.value.extra_info) == {"code": "version_conflict"}

    # The unclaimed version-0 row is now stale (max_staleness 0): kept for SQL, never delivered.
    stats = act_json(client, "stats", {"table": TABLE})[TABLE]
    assert (stats["consumed"], stats["stale"], stats["ready"]) == (3, 1, 0)
    # A producer that writes a version-0 sample now is told it is stale.
    writer, answers = client.do_put(flight.FlightDescriptor.for_path(TABLE), pa.schema(
        [("sample_id", pa.string()), ("policy_version", pa.int64()), ("prompt", pa.string())]))
    writer.write_batch(pa.record_batch({"sample_id": ["q3_0_0"], "policy_version": [0],
                                        "prompt": ["late"]}))
    failed = json.loads(answers.read().to_pybytes())
    assert failed["batch"] == 0 and failed["error"]["code"] == "stale_version"
    writer.done_writing()
    assert answers.read() is None
    # The call's status (a typed Flight error) arrives when the client closes the writer.
    with pytest.raises(flight.FlightServerError) as stale:
        writer.close()
    assert json.loads(stale.value.extra_info) == {"code": "stale_version"}
    assert "policy_version 0 is stale" in str(stale.value)


def test_subscription_over_raw_do_exchange(client):
    act(client, "create_table", {"name": TABLE, "columns": {"prompt": "string",
                                                            "reward": "float64"},
                                 "max_staleness": 1})
    ids = [f"q{i}_0_0" for i in range(6)]
    put_in_steps(client, [pa.record_batch({"sample_id": ids, "prompt": ["p"] * 6,
                                           "reward": [float(i) for i in range(6)]})])

    command = {"subscribe": {"table": TABLE, "micro_batch_size": 2, "global_batch_size": 4,
                             "max_in_flight": 1, "consumer": "raw-trainer"}}
    writer, reader = client.do_exchange(
        flight.FlightDescriptor.for_command(json.dumps(command).encode()))
    with writer:
        hello = reader.read_chunk()
        assert hello.data is None
        assert json.loads(hello.app_metadata.to_pybytes()) == {
            "type": "subscribed", "table": TABLE, "version": 0}

        def next_message() -> tuple[dict, pa.RecordBatch | None]:
            chunk = reader.read_chunk()
            return json.loads(chunk.app_metadata.to_pybytes()), chunk.data

        def send(msg: dict) -> None:
            writer.write_metadata(pa.py_buffer(json.dumps(msg).encode()))

        seen = []
        for request, boundary in ((1, False), (2, True)):
            meta, data = next_message()
            assert meta["type"] == "micro_batch" and meta["rows"] == 2 == data.num_rows
            assert meta["is_boundary"] is boundary and meta["global_batch"] == 0
            assert meta["index"] == request - 1 and meta["version"] == 0
            assert {"sample_id", "reward", "reward_status", "delivery_count"} <= set(
                data.schema.names)
            seen += data.column("sample_id").to_pylist()
            # A bump before the boundary, or before the boundary micro-batch is acked, is
            # refused: a bump ends the global batch.
            send({"type": "bump", "request": 10 + request})
            answer, _ = next_message()
            assert (answer["type"], answer["request"], answer["code"]) == (
                "error", 10 + request, "invalid_argument")
            assert ("neither acked nor nacked" if boundary else "is not complete") \
                in answer["message"]
            send({"type": "ack", "claim_id": meta["claim_id"], "request": request})
            answer, none = next_message()
            assert none is None
            assert answer == {"type": "acked", "request": request, "claim_id": meta["claim_id"],
                              "acked": 2}
        assert seen == ids[:4]

        # At the boundary nothing more comes until the bump; a bad message gets an error answer
        # on the same ordered stream (and no micro-batch arrived before it).
        send({"type": "ack", "claim_id": "no-such-claim", "request": 3})
        answer, _ = next_message()
        assert answer["type"] == "error" and answer["request"] == 3
        assert answer["code"] == "invalid_argument" and "no-such-claim" in answer["message"]

        writer.write_metadata(pa.py_buffer(b"not json"))
        answer, _ = next_message()
        assert (answer["type"], answer["request"], answer["code"]) == (
            "error", None, "invalid_argument")
        assert "b'not json' is not a JSON object" in answer["message"]

        send({"type": "bump", "request": 4, "weights_uri": "file:///w/1"})
        answer, _ = next_message()
        assert answer == {"type": "bumped", "request": 4, "version": 1}
        meta, data = next_message()
        assert (meta["type"], meta["index"], meta["global_batch"], meta["version"]) == (
            "micro_batch", 0, 1, 1)
        assert data.column("sample_id").to_pylist() == ids[4:]
        send({"type": "nack", "claim_id": meta["claim_id"], "request": 5})
        answer, _ = next_message()
        assert answer == {"type": "nacked", "request": 5, "claim_id": meta["claim_id"],
                          "nacked": 2}
        # The nacked rows come straight back (delivered a second time).
        meta, data = next_message()
        assert meta["type"] == "micro_batch" and meta["index"] == 0
        assert data.column("sample_id").to_pylist() == ids[4:]
        send({"type": "close"})
        writer.done_writing()
        with pytest.raises(StopIteration):
            reader.read_chunk()
    # Closing nacked what was in flight: the rows are ready again.
    stats = act_json(client, "stats", {"table": TABLE})[TABLE]
    assert (stats["consumed"], stats["processing"], stats["ready"]) == (4, 0, 2)


def test_subscription_answers_an_ack_before_the_bump_sent_after_it(client):
    """Messages on a subscription are handled in the order sent, also at a global-batch boundary,
    where the server waits for a message before it can deliver again (an ack that came in while
    it waited was once put back behind the bump that followed it)."""
    rounds = 300
    act(client, "create_table", {"name": TABLE, "columns": {"reward": "float64"},
                                 "max_staleness": rounds + 1})
    put_in_steps(client, [pa.record_batch({"sample_id": [f"q{i}_0_0" for i in range(rounds)],
                                           "reward": [float(i) for i in range(rounds)]})])
    command = {"subscribe": {"table": TABLE, "micro_batch_size": 1, "global_batch_size": 1}}
    writer, reader = client.do_exchange(
        flight.FlightDescriptor.for_command(json.dumps(command).encode()))
    with writer:
        reader.read_chunk()  # subscribed
        order = []
        for i in range(rounds):
            meta = json.loads(reader.read_chunk().app_metadata.to_pybytes())
            assert meta["type"] == "micro_batch" and meta["is_boundary"]
            for msg in ({"type": "ack", "claim_id": meta["claim_id"], "request": 2 * i},
                        {"type": "bump", "request": 2 * i + 1}):
                writer.write_metadata(pa.py_buffer(json.dumps(msg).encode()))
            answers = [json.loads(reader.read_chunk().app_metadata.to_pybytes())
                       for _ in range(2)]
            order.append([(a["type"], a["request"]) for a in answers])
        writer.write_metadata(pa.py_buffer(b'{"type": "close"}'))
        writer.done_writing()
    assert order == [[("acked", 2 * i), ("bumped", 2 * i + 1)] for i in range(rounds)]


def test_a_json_ticket_is_read_whatever_whitespace_leads_it(client):
    """Tickets starting with "{" are taken as ours without asking Flight SQL; JSON led by
    whitespace is still read, after Flight SQL finds it is not one of its tickets."""
    for raw in (b'{"sql": "SELECT 41 + 1 AS x"}', b' \n {"sql": "SELECT 41 + 1 AS x"}'):
        assert client.do_get(flight.Ticket(raw)).read_all().column("x").to_pylist() == [42]
