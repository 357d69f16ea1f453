"""Small puts on the action session (docs/protocol.md, "Sessions"): the wire format, its bad
input, roles, and RemoteStore.put / put_async choosing the session or a do_put stream."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import store
from flight_fixtures import TOKENS, running_server, write_tokens
from flight_server.client import SESSION_PUT_BYTES, SESSION_PUT_ROWS, RemoteStore
from test_flight_session import RawSession
from thread_helpers import run_threads
from waiting import wait_until


def ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def send_put(session: RawSession, request_id, body, parts: list[bytes]) -> None:
    head = json.dumps({"id": request_id, "action": "put", "body": body,
                       "sizes": [len(p) for p in parts]}).encode()
    session.writer.write_metadata(pa.py_buffer(b"\n".join([head, b"".join(parts)])))


def rows(n: int, first: int = 0, reward: float = 0.5) -> pa.Table:
    return pa.table({"sample_id": [f"q{first + i}_0_0" for i in range(n)],
                     "reward": pa.array([reward] * n, pa.float64())})


@pytest.fixture
def server(tmp_path):
    with running_server(tmp_path / "p.duckdb") as srv:
        srv.store.create_table("solver", {"reward": "float64"})
        yield srv


def test_raw_session_put_is_answered_once_durable(server):
    session = RawSession(flight.connect(server.location))
    send_put(session, "p1", {"table": "solver"}, [ipc(rows(3))])
    header, parts = session.answer()
    assert header["id"] == "p1" and "error" not in header
    assert json.loads(parts[0]) == {"rows": 3, "version": 0}
    # answered means committed: the rows are in DuckDB and claimable
    assert server.store.query("SELECT count(*) AS n FROM solver").to_pylist() == [{"n": 3}]
    # a put and a claim back to back, answers matched by id
    send_put(session, "p2", {"table": "solver"}, [ipc(rows(2, first=10))])
    session.send("c", "claim", {"table": "solver", "limit": 5})
    answers = {h["id"]: (h, p) for h, p in (session.answer(), session.answer())}
    assert json.loads(answers["p2"][1][0])["rows"] == 2
    assert json.loads(answers["c"][1][0])["tables"]["solver"] >= 3
    session.close()


@pytest.mark.parametrize("body, parts, code, words", [
    ({"table": "nope"}, [ipc(rows(1))], "not_found", "nope"),
    ({}, [ipc(rows(1))], "invalid_argument", "table"),
    ({"table": 7}, [ipc(rows(1))], "invalid_argument", "string"),
    ({"table": "solver", "x": 1}, [ipc(rows(1))], "invalid_argument", "x"),
    ({"table": "solver"}, [], "invalid_argument", "one part"),
    ({"table": "solver"}, [ipc(rows(1)), ipc(rows(1))], "invalid_argument", "one part"),
    ({"table": "solver"}, [b"certainly not arrow"], "invalid_argument", "Arrow IPC"),
    ({"table": "solver"}, [ipc(pa.table({"sample_id": ["q1_0_0"], "bogus": [1]}))],
     "schema_mismatch", "bogus"),
    ({"table": "solver"}, [ipc(pa.table({"sample_id": ["no-turn"], "reward": [1.0]}))],
     "invalid_argument", "no-turn"),
    ({"table": "solver"}, [ipc(pa.table({"sample_id": ["q1_0_0"], "reward": ["high"]}))],
     "schema_mismatch", "reward"),
    ({"table": "solver"}, [ipc(pa.table({"sample_id": ["q1_0_0"], "reward": [1.0],
                                          "policy_version": [5]}))], "stale_version", "ahead"),
])
def test_bad_puts_get_typed_errors_and_store_nothing(server, body, parts, code, words):
    session = RawSession(flight.connect(server.location))
    send_put(session, 1, body, parts)
    header, answer = session.answer()
    assert answer == [] and header["id"] == 1
    assert header["error"]["code"] == code, header
    assert words in header["error"]["message"]
    # the session goes on, and nothing was written
    send_put(session, 2, {"table": "solver"}, [ipc(rows(1, first=99))])
    assert "error" not in session.answer()[0]
    assert server.store.query("SELECT sample_id FROM solver").to_pylist() == [
        {"sample_id": "q99_0_0"}]
    session.close()


@pytest.mark.parametrize("raw, words", [
    (b'{"id": 1, "action": "put", "body": {"table": "solver"}, "sizes": [10]}\n123',
     "add up to 10 bytes but 3 follow"),
    (b'{"id": 1, "action": "put", "body": {"table": "solver"}, "sizes": "ten"}\n',
     "list of byte counts"),
    (b'{"id": 1, "action": "put", "body": {"table": "solver"}, "sizes": [-1]}\n',
     "list of byte counts"),
    (b'{"id": 1, "action": "claim", "body": {"table": "solver", "limit": 1}, "sizes": [2]}\nab',
     "carries no parts"),
])
def test_malformed_parts_are_refused(server, raw, words):
    session = RawSession(flight.connect(server.location))
    session.writer.write_metadata(pa.py_buffer(raw))
    header, _ = session.answer()
    assert header["error"]["code"] == "invalid_argument" and words in header["error"]["message"]
    assert header["id"] == 1  # the header parsed: its answer names it, so the client can match it
    session.close()


def test_a_header_over_several_lines_without_parts_still_parses(server):
    session = RawSession(flight.connect(server.location))
    doc = {"id": 4, "action": "get_version", "body": {"table": "solver"}}
    session.writer.write_metadata(pa.py_buffer(json.dumps(doc, indent=2).encode()))
    header, parts = session.answer()
    assert header["id"] == 4 and json.loads(parts[0])["version"] == 0
    session.close()


def test_a_reader_token_cannot_put_on_a_session(tmp_path):
    tokens = write_tokens(tmp_path / "tokens.json")
    with running_server(tmp_path / "a.duckdb", tokens_file=tokens) as srv:
        srv.store.create_table("solver", {"reward": "float64"})
        reader = RawSession(flight.connect(srv.location), TOKENS["reader"])
        send_put(reader, 1, {"table": "solver"}, [ipc(rows(1))])
        header, _ = reader.answer()
        assert header["error"]["code"] == "permission_denied"
        assert "writer" in header["error"]["message"]
        reader.close()
        writer = RawSession(flight.connect(srv.location), TOKENS["writer"])
        send_put(writer, 1, {"table": "solver"}, [ipc(rows(1))])
        assert "error" not in writer.answer()[0]
        writer.close()
        assert srv.store.stats("solver")["solver"]["rows"] == 1


def served(server, verb: str) -> float:
    """How many requests of ``verb`` the server has served (its latency histogram's count)."""
    return server.metrics.registry.get_sample_value("expstore_request_seconds_count",
                                                    {"verb": verb}) or 0.0


def assert_served(server, puts: int, do_puts: int) -> None:
    """The server counted this many session puts and do_put calls (a request is counted just
    after its answer is written, so the count may trail the client by a moment)."""
    wait_until(lambda: (served(server, "put"), served(server, "do_put")) == (puts, do_puts), 10,
               f"{puts} session puts and {do_puts} do_put calls counted")


def test_remote_put_takes_the_session_when_small_and_do_put_when_large(server):
    s = store.connect(server.location)
    assert s.put("solver", rows(SESSION_PUT_ROWS)) == {"rows": SESSION_PUT_ROWS, "version": 0}
    assert_served(server, 1, 0)
    assert s.put("solver", rows(SESSION_PUT_ROWS + 1, first=1000))["rows"] == SESSION_PUT_ROWS + 1
    assert_served(server, 1, 1)
    off = RemoteStore(server.location, sessions=False)
    assert off.put("solver", rows(1, first=5000))["rows"] == 1
    assert_served(server, 1, 2)
    assert off._session is None  # noqa: SLF001
    off.close()
    s.close()
    assert server.store.stats("solver")["solver"]["rows"] == 2 * SESSION_PUT_ROWS + 2


def test_a_small_slice_of_a_large_table_takes_the_session(server):
    """A row sliced out of a big batch shares the batch's buffers; what it would send is
    small, so it goes on the session like any small write, and only its own row lands."""
    big = rows(20_000, first=100_000)
    assert big.get_total_buffer_size() > SESSION_PUT_BYTES  # the buffers the slices share
    s = store.connect(server.location)
    for i in (0, 7, 19_999):
        assert s.put("solver", big.slice(i, 1)) == {"rows": 1, "version": 0}
    assert s.put_async("solver", big.slice(100, SESSION_PUT_ROWS)).result(60)["rows"] == \
        SESSION_PUT_ROWS
    assert_served(server, 4, 0)
    got = server.store.query("SELECT sample_id FROM solver ORDER BY sample_id").column(0)
    assert sorted(got.to_pylist()) == sorted(
        [f"q{100_000 + i}_0_0" for i in (0, 7, 19_999)]
        + [f"q{100_100 + i}_0_0" for i in range(SESSION_PUT_ROWS)])
    s.close()


def test_remote_put_async_keeps_many_puts_in_flight(server):
    s = store.connect(server.location)
    futures = [s.put_async("solver", rows(1, first=i, reward=float(i))) for i in range(200)]
    assert [f.result(60)["rows"] for f in futures] == [1] * 200
    big = s.put_async("solver", rows(500, first=10_000))  # streamed in a do_put
    assert big.result(60)["rows"] == 500
    bad = s.put_async("solver", {"sample_id": ["broken"], "reward": [1.0]})
    with pytest.raises(store.InvalidArgument, match="broken"):
        bad.result(60)
    got = server.store.query("SELECT count(*) AS n, sum(reward) AS r FROM solver").to_pylist()
    assert got == [{"n": 700, "r": float(sum(range(200))) + 500 * 0.5}]
    s.close()


def test_many_producers_on_their_own_sessions(server):
    """64 producer threads, each with its own client: every put lands exactly once."""
    def produce(k: int) -> None:
        with store.connect(server.location) as s:
            for i in range(20):
                s.put("solver", {"sample_id": [f"p{k}x{i}_0_0"], "reward": [float(k)]})

    errors = run_threads(produce, 64, timeout=120)
    assert not errors, errors[:3]
    counts = server.store.query(
        "SELECT count(*) AS n, count(DISTINCT sample_id) AS d, sum(reward) AS r FROM solver"
    ).to_pylist()[0]
    assert counts == {"n": 64 * 20, "d": 64 * 20, "r": float(sum(range(64)) * 20)}
    assert server.store.counters["puts"] == 64 * 20


def test_a_server_without_session_puts_gets_do_put_instead(server, monkeypatch):
    """A server from before session puts refuses them; the client then streams its puts in
    do_put calls, for put and put_async alike, and claims still go on the session."""
    import flight_server.session as session_module
    monkeypatch.setattr(session_module, "SESSION_ACTIONS",
                        tuple(a for a in session_module.SESSION_ACTIONS if a != "put"))
    s = store.connect(server.location)
    assert s.put("solver", rows(2)) == {"rows": 2, "version": 0}
    assert s.put_async("solver", rows(1, first=50)).result(30)["rows"] == 1
    assert_served(server, 0, 2)
    assert s._session.carries_puts is False  # noqa: SLF001
    assert s.claim("solver", 3).data.num_rows == 3
    s.close()


def test_a_client_that_stops_reading_holds_up_no_other_sessions_answers(server):
    """Put answers of every session are written by one thread; a session whose client stops
    reading (its stream blocked in a large claim answer) must not stall the others'."""
    server.store.create_table("big", {"text": "string"}, storage={"text": "value"})
    pad = "x" * 65536
    for start in range(0, 512, 64):
        server.store.put("big", {"sample_id": [f"b{i}_0_0" for i in range(start, start + 64)],
                                 "text": [pad] * 64})
    stuck = flight.connect(server.location)
    raw = RawSession(stuck)
    # A large put keeps the writer busy, so that the puts below are answered only once the
    # claim's answer fills the stream.
    busy = server.store.put_async("solver", {"sample_id": [f"w{i}_0_0" for i in range(200000)],
                                             "reward": [0.0] * 200000})
    for i in range(20):  # puts answered while the claim's answer (32 MB, never read) blocks
        send_put(raw, i, {"table": "solver"}, [ipc(rows(1, first=1000 + i, reward=1.0))])
        if i == 10:
            raw.send(100, "claim", {"table": "big", "limit": 512})
    other = store.connect(server.location)
    try:
        assert busy.result(60)["rows"] == 200000
        for i in range(30):
            assert other.put("solver", {"sample_id": [f"o{i}_0_0"], "reward": [0.5]},
                             timeout=20)["rows"] == 1
    finally:
        other.close()
        stuck.close()
