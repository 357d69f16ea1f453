"""Action sessions: claims, acks and nacks on one do_exchange stream (docs/protocol.md)."""
from __future__ import annotations

import json
import threading
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import store
from flight_fixtures import TOKENS, bearer, running_server, write_tokens
from flight_server import ExpstoreFlightServer
from flight_server.client import RemoteStore

ROWS = {"sample_id": [f"q{i}_0_{j}" for i in range(4) for j in range(4)],
        "reward": [float(i) for i in range(16)]}


class RawSession:
    """The wire protocol with pyarrow.flight and json only."""

    def __init__(self, client: flight.FlightClient, token: str | None = None) -> None:
        descriptor = flight.FlightDescriptor.for_command(b'{"session": {}}')
        self.writer, self.reader = client.do_exchange(descriptor, bearer(token))
        self.writer.begin(pa.schema([]))

    def send(self, request_id, action, body, **more) -> None:
        doc = {"id": request_id, "action": action, "body": body, **more}
        self.writer.write_metadata(pa.py_buffer(json.dumps(doc).encode()))

    def answer(self) -> tuple[dict, list[bytes]]:
        raw = self.reader.read_chunk().app_metadata.to_pybytes()
        head, _, rest = raw.partition(b"\n")
        header = json.loads(head)
        parts, at = [], 0
        for size in header.get("sizes", []):
            parts.append(rest[at:at + size])
            at += size
        assert at == len(rest)
        return header, parts

    def close(self) -> None:
        self.writer.done_writing()
        with pytest.raises(StopIteration):
            self.reader.read_chunk()
        self.writer.close()


@pytest.fixture
def server(tmp_path):
    with running_server(tmp_path / "s.duckdb") as srv:
        srv.store.create_table("solver", {"reward": "float64"})
        srv.store.put("solver", ROWS)
        yield srv


def test_raw_session_claims_and_acks_with_matching_ids(server):
    client = flight.connect(server.location)
    session = RawSession(client)
    session.send(1, "claim", {"table": "solver", "limit": 4, "consumer": "raw"})
    header, parts = session.answer()
    assert header["id"] == 1 and "error" not in header
    claim = json.loads(parts[0])
    rows = pa.ipc.open_stream(pa.py_buffer(parts[1])).read_all()
    assert claim["tables"] == {"solver": 4} and rows.num_rows == 4
    assert rows.column("sample_id").to_pylist() == ["q0_0_0", "q0_0_1", "q0_0_2", "q0_0_3"]
    # An ack and the next claim sent back to back: both answered, matched by id.
    session.send("ack-1", "ack", {"claim_id": claim["claim_id"]})
    session.send(2, "claim", {"table": "solver", "limit": 4, "consumer": "raw"})
    answers = dict((h["id"], (h, p)) for h, p in (session.answer(), session.answer()))
    assert json.loads(answers["ack-1"][1][0])["acked"] == 4
    assert json.loads(answers[2][1][0])["tables"] == {"solver": 4}
    session.send(3, "get_version", {"table": "solver"})
    header, parts = session.answer()
    assert header["id"] == 3 and json.loads(parts[0])["version"] == 0
    session.close()
    assert server.store.stats("solver")["solver"]["consumed"] == 4


@pytest.mark.parametrize("request_doc, code, words", [
    ({"id": 1, "action": "query", "body": {"sql": "SELECT 1"}}, "invalid_argument",
     "not served on a session"),
    ({"id": 2, "action": "claim", "body": {"table": "nope", "limit": 1}}, "not_found", "nope"),
    ({"id": 3, "action": "claim", "body": {"table": "solver"}}, "invalid_argument", "limit"),
    ({"id": 4, "action": "ack", "body": {"claim_id": "c0ffee"}}, "not_found", "c0ffee"),
    ({"id": 5, "action": "ack", "body": {"claim_id": "x", "extra": 1}}, "invalid_argument",
     "claim_id"),
    ({"id": 6, "action": "claim", "body": [1, 2]}, "invalid_argument", "JSON object"),
    ([1, 2, 3], "invalid_argument", "JSON object"),
])
def test_bad_requests_get_typed_errors_and_the_session_goes_on(server, request_doc, code, words):
    client = flight.connect(server.location)
    session = RawSession(client)
    session.writer.write_metadata(pa.py_buffer(json.dumps(request_doc).encode()))
    header, parts = session.answer()
    assert parts == []
    assert header["id"] == (request_doc.get("id") if isinstance(request_doc, dict) else None)
    assert header["error"]["code"] == code and words in header["error"]["message"]
    session.writer.write_metadata(pa.py_buffer(b"not json"))
    header, _ = session.answer()
    assert header["error"]["code"] == "invalid_argument"
    session.send(9, "claim", {"table": "solver", "limit": 2})
    header, parts = session.answer()
    assert header["id"] == 9 and json.loads(parts[0])["tables"] == {"solver": 2}
    session.close()


def test_a_claim_naming_its_schema_gets_the_rows_without_it(server):
    client = flight.connect(server.location)
    session = RawSession(client)
    # Without "schemas" (a client from before them): streams, and the header as it was.
    session.send(1, "claim", {"table": "solver", "limit": 2})
    header, parts = session.answer()
    claim = json.loads(parts[0])
    assert "schemas" not in claim and "batches" not in claim
    assert pa.ipc.open_stream(pa.py_buffer(parts[1])).read_all().num_rows == 2
    # "schemas": {} asks for the fingerprints: a stream, and its schema's fingerprint.
    session.send(2, "claim", {"table": "solver", "limit": 2}, schemas={})
    header, parts = session.answer()
    claim = json.loads(parts[0])
    assert claim["batches"] == [] and set(claim["schemas"]) == {"solver"}
    schema = pa.ipc.open_stream(pa.py_buffer(parts[1])).read_all().schema
    fingerprint = claim["schemas"]["solver"]
    # Naming it: the rows come as one record-batch message, read with that schema.
    session.send(3, "claim_many", {"requests": [{"table": "solver", "limit": 3}]},
                 schemas={"solver": fingerprint})
    header, parts = session.answer()
    claim = json.loads(parts[0])
    assert claim["batches"] == ["solver"] and claim["schemas"] == {}
    rows = pa.ipc.read_record_batch(pa.py_buffer(parts[1]), schema)
    assert rows.schema.equals(schema, check_metadata=True)
    assert rows.column(0).to_pylist() == ["q1_0_0", "q1_0_1", "q1_0_2"]
    # A claim carrying an ack too (answered once the ack is durable).
    session.send(4, "claim", {"table": "solver", "limit": 2, "ack": claim["claim_id"]},
                 schemas={"solver": fingerprint})
    header, parts = session.answer()
    assert header["id"] == 4 and json.loads(parts[0])["batches"] == ["solver"]
    assert pa.ipc.read_record_batch(pa.py_buffer(parts[1]), schema).num_rows == 2
    assert server.store.stats("solver")["solver"]["consumed"] == 3
    # A fingerprint the server does not give this schema (a stale one): a stream again.
    session.send(5, "claim", {"table": "solver", "limit": 1}, schemas={"solver": "0123abcd"})
    header, parts = session.answer()
    claim = json.loads(parts[0])
    assert claim["batches"] == [] and claim["schemas"] == {"solver": fingerprint}
    assert pa.ipc.open_stream(pa.py_buffer(parts[1])).read_all().num_rows == 1
    session.close()


@pytest.mark.parametrize("more, words", [
    ({"action": "claim", "body": {"table": "solver", "limit": 1}, "schemas": ["solver"]},
     "schemas must be a JSON object of table name to schema fingerprint"),
    ({"action": "claim", "body": {"table": "solver", "limit": 1}, "schemas": {"solver": 7}},
     "schemas must be a JSON object of table name to schema fingerprint"),
    ({"action": "ack", "body": {"claim_id": "c1"}, "schemas": {}},
     "only claim requests"),
])
def test_bad_schemas_are_refused_by_name(server, more, words):
    session = RawSession(flight.connect(server.location))
    session.writer.write_metadata(pa.py_buffer(json.dumps({"id": 1, **more}).encode()))
    header, parts = session.answer()
    assert header["error"]["code"] == "invalid_argument"
    assert words in header["error"]["message"] and parts == []
    assert server.store.stats("solver")["solver"]["processing"] == 0
    session.close()


def test_the_client_reads_claims_without_schemas_and_follows_a_new_one(server):
    s = store.connect(server.location)
    first = s.claim("solver", 2, consumer="t")
    second = s.claim("solver", 2, consumer="t", ack=first.claim_id)
    third = s.claim_many([store.ClaimRequest("solver", 2)], consumer="t")
    assert s._claim_schemas["solver"][1].equals(first.data.schema)  # noqa: SLF001 - the path
    for claim in (second, third):
        assert claim.data.schema.equals(first.data.schema, check_metadata=True)
    assert [c.data.column("sample_id").to_pylist() for c in (first, second, third)] == [
        ["q0_0_0", "q0_0_1"], ["q0_0_2", "q0_0_3"], ["q1_0_0", "q1_0_1"]]
    # The table made again with other columns: the fingerprint the client names is stale, the
    # server sends the new schema, and the client reads it.
    server.store.drop_table("solver")
    server.store.create_table("solver", {"score": "int64"})
    server.store.put("solver", {"sample_id": ["n0_0_0"], "score": [5]})
    fourth = s.claim("solver", 2, consumer="t")
    assert fourth.data.column("score").to_pylist() == [5]
    assert "reward" not in fourth.data.column_names
    s.close()


def test_roles_are_checked_per_request(tmp_path):
    tokens = write_tokens(tmp_path / "tokens.json")
    with running_server(tmp_path / "a.duckdb", tokens_file=tokens) as srv:
        srv.store.create_table("solver", {"reward": "float64"})
        srv.store.put("solver", ROWS)
        client = flight.connect(srv.location)
        with pytest.raises(flight.FlightUnauthenticatedError):
            RawSession(client).answer()
        reader = RawSession(client, TOKENS["reader"])
        reader.send(1, "get_version", {"table": "solver"})
        assert json.loads(reader.answer()[1][0])["version"] == 0
        reader.send(2, "claim", {"table": "solver", "limit": 1})
        header, _ = reader.answer()
        assert header["error"]["code"] == "permission_denied"
        assert "writer" in header["error"]["message"]
        reader.close()
        assert srv.store.stats("solver")["solver"]["processing"] == 0
        writer = RawSession(client, TOKENS["writer"])
        writer.send(1, "claim", {"table": "solver", "limit": 1})
        assert "error" not in writer.answer()[0]
        writer.close()


def test_remote_store_uses_a_session_and_ack_async_is_durable(server, tmp_path):
    s = store.connect(server.location)
    claim = s.claim("solver", 4, consumer="t")  # (a table's first claim comes as a stream)
    future = s.ack_async(claim.claim_id)
    nxt = s.claim("solver", 4, consumer="t")  # sent while the ack may still be committing
    assert s._session is not None and not s._session.failed  # noqa: SLF001 - the path in use
    assert future.result(30)["acked"] == 4
    assert nxt.data.num_rows == 4 and set(nxt.data.column("sample_id").to_pylist()).isdisjoint(
        claim.data.column("sample_id").to_pylist())
    assert s.ack(claim.claim_id)["duplicate"] is True
    with pytest.raises(store.LeaseExpired):  # remote: every error comes from the Future
        s.nack_async(claim.claim_id).result(30)
    assert s.nack(nxt.claim_id)["nacked"] == 4
    with pytest.raises(store.NotFound, match="never issued"):
        s.ack("feedface")
    s.close()
    with pytest.raises(store.StoreClosed):
        s.claim("solver", 1)
    assert server.store.stats("solver")["solver"]["consumed"] == 4


def test_sessions_off_and_on_give_the_same_answers(server):
    on, off = store.connect(server.location), RemoteStore(server.location, sessions=False)
    a = on.claim("solver", 3, consumer="on")
    b = off.claim("solver", 3, consumer="off")
    assert off._session is None  # noqa: SLF001
    assert a.data.schema.equals(b.data.schema)
    assert on.ack(b.claim_id)["acked"] == off.ack(a.claim_id)["acked"] == 3
    assert on.ack(a.claim_id) == off.ack(a.claim_id) == {"claim_id": a.claim_id, "acked": 3,
                                                           "duplicate": True}
    on.close()
    off.close()


def test_many_threads_share_one_session(server):
    s = store.connect(server.location)
    server.store.put("solver", {"sample_id": [f"m{i}_0_0" for i in range(400)],
                                "reward": [0.0] * 400})
    seen: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def consume() -> None:
        try:
            while True:
                c = s.claim("solver", 3, consumer=threading.current_thread().name)
                if c.data.num_rows == 0:
                    return
                with lock:
                    seen.extend(c.data.column("sample_id").to_pylist())
                s.ack_async(c.claim_id).result(30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=consume) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(seen) == len(set(seen)) == 416
    assert server.store.stats("solver")["solver"]["consumed"] == 416
    s.close()


def test_a_restarted_server_gets_a_new_session_and_shutdown_does_not_hang(tmp_path):
    db = tmp_path / "r.duckdb"
    first = ExpstoreFlightServer(str(db), port=0)
    port = first.port
    threading.Thread(target=first.serve, daemon=True).start()
    first.store.create_table("solver", {"reward": "float64"})
    first.store.put("solver", ROWS)
    s = RemoteStore(first.location, timeout=30)
    c = s.claim("solver", 2)
    s.ack(c.claim_id)
    started = time.monotonic()
    first.close()  # the client's session is open: the server asks it to end, then stops
    assert time.monotonic() - started < 20
    with pytest.raises(store.Unavailable):
        s.claim("solver", 2)
    second = ExpstoreFlightServer(str(db), port=port)
    threading.Thread(target=second.serve, daemon=True).start()
    try:
        # A new session on the same client (gRPC reconnects after its back-off).
        deadline = time.monotonic() + 20
        while True:
            try:
                c = s.claim("solver", 2)
                break
            except store.Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert c.data.num_rows == 2
        assert s.ack(c.claim_id)["acked"] == 2
    finally:
        s.close()
        second.close()
    reopened = store.connect(str(db))
    try:
        assert reopened.stats("solver")["solver"]["consumed"] == 4
    finally:
        reopened.close()

