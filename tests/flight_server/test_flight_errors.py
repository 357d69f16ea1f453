"""Every store error reaches a Flight client as the matching typed Flight error.

The server answers with a Flight error type chosen by the store error's class and puts the error's
code in ``extra_info`` (JSON ``{"code": …}``); the message names the bad value. After each error
the server still answers and the stored data is unchanged. The Python RemoteStore turns the same
errors back into the :mod:`store.errors` classes.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_fixtures import action, action_json, error_code, put_batches, query, running_server
from flight_server.errors import from_flight, to_flight
from store import errors as E

TABLE = "solver"
HEAVY_SQL = "SELECT count(*) FROM range(100000000000) t(i) WHERE hash(i) % 7 = 3"
CHECKSUM = (f"SELECT count(*) AS n, sum(hash(sample_id, policy_version, prompt, response, reward, "
            f"prompt_status, response_status, reward_status, consumed, stale, dead)) AS h "
            f"FROM {TABLE}")


def _schema_put(client: flight.FlightClient, batch: pa.RecordBatch, table: str = TABLE) -> None:
    put_batches(client, table, [batch])


def _ticket(client: flight.FlightClient, raw: bytes) -> None:
    client.do_get(flight.Ticket(raw)).read_all()


def _subscribe(client: flight.FlightClient, command: bytes) -> None:
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command))
    with writer:
        reader.read_chunk()


def _claim_then_ack_late(client: flight.FlightClient) -> None:
    results = action(client, "claim", {"table": TABLE, "limit": 2, "lease_seconds": 0.05})
    header = json.loads(results[0])
    assert header["claim_id"]
    deadline = time.monotonic() + 5
    while time.time() <= header["expires_at"]:  # the lease's own clock, bounded
        assert time.monotonic() < deadline
        time.sleep(0.01)
    action(client, "ack", {"claim_id": header["claim_id"]})


ServerCase = tuple[Callable[[flight.FlightClient], Any], type, str, str]

CASES: dict[str, ServerCase] = {
    "unknown table (describe)": (
        lambda c: action(c, "describe", {"table": "nosuch"}),
        flight.FlightServerError, "not_found", "'nosuch'"),
    "unknown table (do_put)": (
        lambda c: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0"]}), "nosuch"),
        flight.FlightServerError, "not_found", "'nosuch'"),
    "unknown table (get_flight_info)": (
        lambda c: c.get_flight_info(flight.FlightDescriptor.for_path("nosuch")),
        flight.FlightServerError, "not_found", "'nosuch'"),
    "unknown table (claim)": (
        lambda c: action(c, "claim", {"table": "nosuch", "limit": 1}),
        flight.FlightServerError, "not_found", "'nosuch'"),
    "unknown table (subscribe)": (
        lambda c: _subscribe(c, json.dumps({"subscribe": {
            "table": "nosuch", "micro_batch_size": 1, "global_batch_size": 1}}).encode()),
        flight.FlightServerError, "not_found", "'nosuch'"),
    "unknown table (SQL)": (
        lambda c: query(c, "SELECT * FROM nosuch"),
        flight.FlightServerError, "query_refused", "nosuch"),
    "unknown action": (
        lambda c: action(c, "frobnicate", {}),
        flight.FlightServerError, "not_found", "'frobnicate'"),
    "unknown action field": (
        lambda c: action(c, "describe", {"table": TABLE, "colour": "red"}),
        flight.FlightServerError, "invalid_argument", "'colour'"),
    "unknown column (put)": (
        lambda c: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0"], "bogus": [1]})),
        flight.FlightServerError, "schema_mismatch", "'bogus'"),
    "unknown column (claim predicate)": (
        lambda c: action(c, "claim", {"table": TABLE, "limit": 1, "where": "bogus > 0"}),
        flight.FlightServerError, "query_refused", "bogus"),
    "unknown column (SQL)": (
        lambda c: query(c, f"SELECT bogus FROM {TABLE}"),
        flight.FlightServerError, "query_refused", "bogus"),
    "meta column written": (
        lambda c: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0"], "consumed": [True]})),
        flight.FlightServerError, "schema_mismatch", "'consumed'"),
    "wrong type": (
        lambda c: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0"], "reward": ["abc"]})),
        flight.FlightServerError, "schema_mismatch", "'reward'"),
    "batch without sample_id": (
        lambda c: _schema_put(c, pa.record_batch({"prompt": ["p"]})),
        flight.FlightServerError, "schema_mismatch", "'sample_id'"),
    "malformed sample id": (
        lambda c: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0", "not-an-id"]})),
        flight.FlightServerError, "invalid_argument", "'not-an-id'"),
    "stale version (put)": (
        lambda c: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0"],
                                                  "policy_version": [0]})),
        flight.FlightServerError, "stale_version", "policy_version 0"),
    "future version (put)": (
        lambda c: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0"],
                                                  "policy_version": [7]})),
        flight.FlightServerError, "stale_version", "policy_version 7"),
    "stale expected version (bump)": (
        lambda c: action(c, "bump_version", {"table": TABLE, "expected": 0}),
        flight.FlightServerError, "version_conflict", "expected 0"),
    "future expected version (bump)": (
        lambda c: action(c, "bump_version", {"table": TABLE, "expected": 9}),
        flight.FlightServerError, "version_conflict", "expected 9"),
    "malformed JSON body": (
        lambda c: action(c, "describe", b'{"table": '),
        flight.FlightServerError, "invalid_argument", "'describe'"),
    "malformed JSON ticket": (
        lambda c: _ticket(c, b"SELECT 1"),
        flight.FlightServerError, "invalid_argument", "not valid JSON"),
    "truncated JSON object ticket": (
        lambda c: _ticket(c, b'{"claim": {"table": '),
        flight.FlightServerError, "invalid_argument", "not valid JSON"),
    "malformed subscribe command": (
        lambda c: _subscribe(c, b"{subscribe"),
        flight.FlightServerError, "invalid_argument", "not valid JSON"),
    "non-object JSON body": (
        lambda c: action(c, "describe", b'["solver"]'),
        flight.FlightServerError, "invalid_argument", "got list"),
    "non-object JSON ticket": (
        lambda c: _ticket(c, b'"SELECT 1"'),
        flight.FlightServerError, "invalid_argument", "JSON object"),
    "SQL not read-only (DELETE)": (
        lambda c: query(c, f"DELETE FROM {TABLE}"),
        flight.FlightServerError, "query_refused", "DELETE"),
    "SQL not read-only (two statements)": (
        lambda c: query(c, f"SELECT 1; DROP TABLE {TABLE}"),
        flight.FlightServerError, "query_refused", "2 statements"),
    "SQL not read-only (ATTACH)": (
        lambda c: query(c, "ATTACH 'other.duckdb'"),
        flight.FlightServerError, "query_refused", "ATTACH"),
    "SQL not read-only (file access)": (
        lambda c: query(c, "SELECT * FROM read_csv('/etc/passwd')"),
        flight.FlightServerError, "query_refused", "read_csv"),
    "query timeout": (
        lambda c: _ticket(c, json.dumps({"sql": HEAVY_SQL, "timeout": 0.2}).encode()),
        flight.FlightTimedOutError, "query_timeout", "0.2 s"),
    "claim limit 0": (
        lambda c: action(c, "claim", {"table": TABLE, "limit": 0}),
        flight.FlightServerError, "invalid_argument", "limit 0"),
    "claim limit -1": (
        lambda c: action(c, "claim", {"table": TABLE, "limit": -1}),
        flight.FlightServerError, "invalid_argument", "limit -1"),
    "claim limit 10**9": (
        lambda c: action(c, "claim", {"table": TABLE, "limit": 10**9}),
        flight.FlightServerError, "invalid_argument", f"limit {10**9}"),
    "claim limit not an integer": (
        lambda c: action(c, "claim", {"table": TABLE, "limit": "16"}),
        flight.FlightServerError, "invalid_argument", "'16'"),
    "ack of unknown claim": (
        lambda c: action(c, "ack", {"claim_id": "c0ffee"}),
        flight.FlightServerError, "not_found", "'c0ffee'"),
    "ack after lease expiry": (
        _claim_then_ack_late,
        flight.FlightServerError, "lease_expired", "its lease expired"),
    "table created twice": (
        lambda c: action(c, "create_table", {"name": TABLE, "columns": {"x": "int32"}}),
        flight.FlightServerError, "already_exists", f"'{TABLE}'"),
    "unknown column type": (
        lambda c: action(c, "create_table", {"name": "t2", "columns": {"x": "complex128"}}),
        flight.FlightServerError, "invalid_argument", "'complex128'"),
    "bad wait_version timeout": (
        lambda c: action(c, "wait_version", {"table": TABLE, "min_version": 1, "timeout": 1e9}),
        flight.FlightServerError, "invalid_argument", "1000000000.0"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with one table at version 2 holding 8 complete rows, and a raw client.

    One server takes the whole error matrix: each case also proves that the errors before it
    left the server answering and the data untouched.
    """
    with running_server(tmp_path_factory.mktemp("errors") / "x.duckdb") as server:
        with flight.FlightClient(f"grpc://127.0.0.1:{server.port}") as client:
            action(client, "create_table", {
                "name": TABLE, "columns": {"prompt": "string", "response": "string",
                                           "reward": "float64"}, "max_staleness": 1})
            for expected in (0, 1):
                action(client, "bump_version", {"table": TABLE, "expected": expected})
            ids = [f"q{i}_0_{j}" for i in range(4) for j in range(2)]
            put_batches(client, TABLE, [pa.record_batch({
                "sample_id": ids, "prompt": ["p"] * 8, "response": ["r"] * 8,
                "reward": [float(i) for i in range(8)]})])
            yield server, client


def _checksum(client: flight.FlightClient) -> list[dict[str, Any]]:
    return query(client, CHECKSUM).to_pylist()


@pytest.mark.parametrize("case", list(CASES))
def test_server_error_is_typed_and_harmless(served, case):
    _, client = served
    operation, flight_type, code, named = CASES[case]
    before = _checksum(client)
    assert before[0]["n"] == 8
    with pytest.raises(flight.FlightError) as raised:
        operation(client)
    error = raised.value
    assert type(error) is flight_type, f"{case}: {type(error).__name__}: {error}"
    assert error_code(error) == code, f"{case}: {error}"
    assert str(error).startswith(f"[{code}] ")
    assert named in str(error), f"{case}: the message does not name {named!r}: {error}"
    # The server is still up and nothing was written.
    assert action_json(client, "health")["status"] == "ok"
    assert _checksum(client) == before


def test_get_schema_error_is_untyped_in_pyarrow(served):
    """In pyarrow 26 get_schema errors are untyped at both ends: the server callback does not
    turn a FlightError into its status (get_flight_info does) and FlightClient.get_schema raises
    a plain ArrowException/OSError. The message still carries the code and the bad value; use
    get_flight_info or the ``describe`` action for typed errors."""
    _, client = served
    with pytest.raises((pa.ArrowException, OSError)) as raised:
        client.get_schema(flight.FlightDescriptor.for_path("nosuch"))
    assert "[not_found]" in str(raised.value) and "'nosuch'" in str(raised.value)
    assert action_json(client, "health")["status"] == "ok"


def test_storage_error_is_internal(tmp_path):
    """A blob segment lost under the server: reads fail with FlightInternalError, storage_error.
    (The server is restarted before the loss: a running one still holds its newest values in
    memory and would serve them.)"""
    with running_server(tmp_path / "x.duckdb") as server:
        with flight.FlightClient(f"grpc://127.0.0.1:{server.port}") as client:
            action(client, "create_table", {"name": TABLE, "columns": {"response": "string"},
                                            "storage": {"response": "ref"}})
            put_batches(client, TABLE, [pa.record_batch({"sample_id": ["q_0_0"],
                                                         "response": ["x" * 100]})])
    blobs = tmp_path / "x.duckdb.blobs"
    segments = [p for p in blobs.rglob("*") if p.is_file()]
    assert segments, "the by-reference value went to no blob segment"
    for p in segments:
        os.truncate(p, 0)
    with running_server(tmp_path / "x.duckdb") as server:
        with flight.FlightClient(f"grpc://127.0.0.1:{server.port}") as client:
            with pytest.raises(flight.FlightInternalError) as raised:
                query(client, f"SELECT * FROM {TABLE}")
            assert error_code(raised.value) == "storage_error"
            assert "blob" in str(raised.value)
            assert action_json(client, "health")["status"] == "ok"


def test_closed_store_is_unavailable(tmp_path):
    """A server whose store was closed answers writes with FlightUnavailableError."""
    from store.embedded import EmbeddedStore
    s = EmbeddedStore(str(tmp_path / "x.duckdb"))
    s.create_table(TABLE, {"reward": "float64"})
    with running_server(s) as server:
        with flight.FlightClient(f"grpc://127.0.0.1:{server.port}") as client:
            s.close()
            with pytest.raises(flight.FlightUnavailableError) as raised:
                action(client, "bump_version", {"table": TABLE})
            assert error_code(raised.value) == "store_closed"
            with pytest.raises(flight.FlightUnavailableError):
                put_batches(client, TABLE, [pa.record_batch({"sample_id": ["q_0_0"],
                                                             "reward": [1.0]})])


# -- the one boundary, for every error class ------------------------------------------------------
EXPECTED_FLIGHT_TYPE = {
    "unauthenticated": flight.FlightUnauthenticatedError,
    "permission_denied": flight.FlightUnauthorizedError,
    "query_timeout": flight.FlightTimedOutError,
    "query_busy": flight.FlightTimedOutError,
    "store_closed": flight.FlightUnavailableError,
    "unavailable": flight.FlightUnavailableError,
    "table_full": flight.FlightUnavailableError,
    "storage_error": flight.FlightInternalError,
    "storage_unavailable": flight.FlightUnavailableError,
}


class RaisingServer(flight.FlightServerBase):
    """A tiny server whose action ``raise`` raises the store error named by its body, translated
    at the real boundary (flight_server.errors.to_flight)."""

    def do_action(self, context, action):
        code = action.body.to_pybytes().decode()
        raise to_flight(E.ERROR_CLASSES[code](f"bad value {code!r}"))


@pytest.mark.parametrize("code", sorted(E.ERROR_CLASSES))
def test_every_error_class_round_trips(code):
    with RaisingServer("grpc://127.0.0.1:0") as server, \
            flight.FlightClient(f"grpc://127.0.0.1:{server.port}") as client:
        with pytest.raises(flight.FlightError) as raised:
            list(client.do_action(flight.Action("raise", code.encode())))
    error = raised.value
    assert type(error) is EXPECTED_FLIGHT_TYPE.get(code, flight.FlightServerError)
    assert error_code(error) == code
    rebuilt = from_flight(error)
    assert type(rebuilt) is E.ERROR_CLASSES[code]
    assert str(rebuilt) == f"bad value {code!r}"


# -- the same errors through the Python remote store -----------------------------------------------
def _remote_ack_late(r) -> None:
    claim = r.claim(TABLE, 2, lease_seconds=0.05)
    assert claim.claim_id
    deadline = time.monotonic() + 5
    while time.time() <= claim.expires_at:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r.ack(claim.claim_id)


REMOTE_CASES: dict[str, tuple[Callable[[Any], Any], type, str]] = {
    "unknown table": (lambda r: r.describe("nosuch"), E.NotFound, "'nosuch'"),
    "unknown action": (lambda r: r._json("frobnicate"), E.NotFound, "'frobnicate'"),
    "unknown column": (lambda r: r.put(TABLE, pa.table({"sample_id": ["q_0_0"], "bogus": [1]})),
                       E.SchemaMismatch, "'bogus'"),
    "wrong type": (lambda r: r.put(TABLE, pa.table({"sample_id": ["q_0_0"], "reward": ["abc"]})),
                   E.SchemaMismatch, "'reward'"),
    "no sample_id": (lambda r: r.put(TABLE, pa.table({"prompt": ["p"]})), E.SchemaMismatch,
                     "'sample_id'"),
    "malformed sample id": (lambda r: r.put(TABLE, pa.table({"sample_id": ["not-an-id"]})),
                            E.InvalidArgument, "'not-an-id'"),
    "stale version": (lambda r: r.put(TABLE, pa.table({"sample_id": ["q_0_0"],
                                                       "policy_version": [0]})),
                      E.StaleVersion, "policy_version 0"),
    "future version": (lambda r: r.put(TABLE, pa.table({"sample_id": ["q_0_0"],
                                                        "policy_version": [7]})),
                       E.StaleVersion, "policy_version 7"),
    "version conflict": (lambda r: r.bump_version(TABLE, expected=0), E.VersionConflict,
                         "expected 0"),
    "SQL not read-only": (lambda r: r.query(f"DELETE FROM {TABLE}"), E.QueryRefused, "DELETE"),
    "query timeout": (lambda r: r.query(HEAVY_SQL, timeout=0.2), E.QueryTimeout, "0.2 s"),
    "query timeout above the server's limit": (lambda r: r.query("SELECT 1", timeout=600),
                                               E.InvalidArgument, "server's query time limit"),
    "claim limit 0": (lambda r: r.claim(TABLE, 0), E.InvalidArgument, "limit 0"),
    "claim limit -1": (lambda r: r.claim(TABLE, -1), E.InvalidArgument, "limit -1"),
    "claim limit 10**9": (lambda r: r.claim(TABLE, 10**9), E.InvalidArgument, "1000000000"),
    "ack of unknown claim": (lambda r: r.ack("c0ffee"), E.NotFound, "'c0ffee'"),
    "ack after lease expiry": (_remote_ack_late, E.LeaseExpired, "its lease expired"),
    "table created twice": (lambda r: r.create_table(TABLE, {"x": "int32"}), E.AlreadyExists,
                            f"'{TABLE}'"),
}


@pytest.mark.parametrize("case", list(REMOTE_CASES))
def test_remote_store_raises_store_errors(served, case):
    from flight_server.client import RemoteStore
    server, client = served
    operation, error_class, named = REMOTE_CASES[case]
    before = _checksum(client)
    with RemoteStore(f"grpc://127.0.0.1:{server.port}") as remote:
        with pytest.raises(E.ExpstoreError) as raised:
            operation(remote)
        assert type(raised.value) is error_class, f"{case}: {raised.value!r}"
        assert named in str(raised.value)
        assert not str(raised.value).startswith("[")  # the wire prefix is stripped
        assert remote.health()["status"] == "ok"
    assert _checksum(client) == before


# -- long input: the echo is bounded, the typed code always arrives ------------------------------
LONG = "n" * 100_000
LONG_WIDE = "é" * 100_000  # non-ASCII: gRPC percent-encodes each of its bytes


def _long_session_request(client: flight.FlightClient, doc: dict[str, Any]) -> None:
    """A session request; its error answer (a frame, not gRPC metadata) is raised as the
    matching Flight error so that the cases below check every verb kind alike."""
    descriptor = flight.FlightDescriptor.for_command(b'{"session": {}}')
    writer, reader = client.do_exchange(descriptor)
    with writer:
        writer.begin(pa.schema([]))
        writer.write_metadata(pa.py_buffer(json.dumps(doc).encode()))
        header = json.loads(reader.read_chunk().app_metadata.to_pybytes().partition(b"\n")[0])
        writer.done_writing()
    error = header["error"]
    raise flight.FlightServerError(f"[{error['code']}] {error['message']}",
                                   extra_info=json.dumps({"code": error["code"]}).encode())


def _long_subscription_ack(client: flight.FlightClient, claim_id: str) -> None:
    """An ack of an unknown claim on a subscription stream: its error comes back as a frame."""
    command = json.dumps({"subscribe": {"table": TABLE, "micro_batch_size": 1,
                                        "global_batch_size": 1}}).encode()
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command))
    with writer:
        reader.read_chunk()  # hello
        writer.write_metadata(pa.py_buffer(json.dumps(
            {"type": "ack", "claim_id": claim_id, "request": 1}).encode()))
        while True:
            meta = json.loads(reader.read_chunk().app_metadata.to_pybytes())
            if meta.get("type") == "error":
                break
        writer.write_metadata(pa.py_buffer(b'{"type": "close"}'))
        writer.done_writing()
    raise flight.FlightServerError(f"[{meta['code']}] {meta['message']}",
                                   extra_info=json.dumps({"code": meta["code"]}).encode())


LONG_CASES: dict[str, tuple[Callable[[flight.FlightClient, str], Any], str]] = {
    "action body (describe)": (lambda c, n: action(c, "describe", {"table": n}),
                               "invalid_argument"),
    "action body (claim)": (lambda c, n: action(c, "claim", {"table": n, "limit": 1}),
                            "invalid_argument"),
    "action body (ack)": (lambda c, n: action(c, "ack", {"claim_id": n}), "not_found"),
    "action name": (lambda c, n: action(c, n, {}), "not_found"),
    "do_put descriptor": (
        lambda c, n: _schema_put(c, pa.record_batch({"sample_id": ["q_0_0"]}), n), "invalid_argument"),
    "get_flight_info descriptor": (
        lambda c, n: c.get_flight_info(flight.FlightDescriptor.for_path(n)), "invalid_argument"),
    "do_get SQL": (lambda c, n: query(c, f"SELECT * FROM {n[:99_000]}"), "query_refused"),
    "do_get ticket field": (lambda c, n: _ticket(c, json.dumps({"sql": "SELECT 1", n: 1})
                                                 .encode()), "invalid_argument"),
    "subscribe command": (lambda c, n: _subscribe(c, json.dumps({"subscribe": {
        "table": n, "micro_batch_size": 1, "global_batch_size": 1}}).encode()), "invalid_argument"),
    "subscription ack": (_long_subscription_ack, "invalid_argument"),
    "session action name": (lambda c, n: _long_session_request(
        c, {"id": 1, "action": n, "body": {}}), "invalid_argument"),
    "session body": (lambda c, n: _long_session_request(
        c, {"id": 1, "action": "ack", "body": {"claim_id": n}}), "not_found"),
    "Flight SQL statement": (lambda c, n: c.get_flight_info(_flight_sql_statement(
        f"SELECT * FROM {n[:99_000]}")), "query_refused"),
}


def _flight_sql_statement(sql: str) -> flight.FlightDescriptor:
    from flight_server.flightsql import messages
    return flight.FlightDescriptor.for_command(
        messages.pack(messages.CommandStatementQuery(query=sql)))


@pytest.mark.parametrize("name", [LONG, LONG_WIDE], ids=["ascii", "non-ascii"])
@pytest.mark.parametrize("case", list(LONG_CASES))
def test_long_input_is_echoed_bounded_with_its_typed_code(served, case, name):
    _, client = served
    operation, code = LONG_CASES[case]
    with pytest.raises(flight.FlightError) as raised:
        operation(client, name)
    error = raised.value
    assert error_code(error) == code, f"{case}: {type(error).__name__}: {str(error)[:300]}"
    message = str(error)
    assert len(message.encode()) < 2_000, f"{case}: a {len(message):,}-character message"
    assert name[:50] in message, f"{case}: the message does not start the bad value: {message}"
    assert "characters" in message, f"{case}: the message does not state the length: {message}"
    assert action_json(client, "health")["status"] == "ok"


def test_long_input_through_the_remote_store_keeps_its_class(served):
    from flight_server.client import RemoteStore
    server, _ = served
    with RemoteStore(f"grpc://127.0.0.1:{server.port}") as remote:
        with pytest.raises(E.InvalidArgument, match="100,000 characters"):
            remote.describe(LONG)
        with pytest.raises(E.NotFound, match="100,000 characters"):
            remote.ack(LONG_WIDE)


# -- a refused subscription ----------------------------------------------------------------------
def test_a_refused_subscription_raises_once_and_prints_nothing(served, capfd):
    import gc

    from flight_server.client import RemoteStore
    server, _ = served
    with RemoteStore(f"grpc://127.0.0.1:{server.port}") as remote:
        with pytest.raises(E.InvalidArgument, match="not a multiple of micro_batch_size 3"):
            remote.subscribe(TABLE, micro_batch_size=3, global_batch_size=4)
        with pytest.raises(E.NotFound, match="'nope'"):
            remote.subscribe("nope", micro_batch_size=1, global_batch_size=1)
        gc.collect()
    # pyarrow prints an unclosed call's error on stderr ("Close() failed") when it is collected
    assert "Close() failed" not in capfd.readouterr().err


# -- the server's log ----------------------------------------------------------------------------
def test_a_refused_call_is_one_debug_line_without_traceback(served, caplog):
    """A caller's mistake is answered to the caller; the server logs it once, at DEBUG (an
    operator's ``--log-level debug``), with its code and message and no traceback, whichever
    path it came by (a verb, an action session, a subscription)."""
    import logging

    from flight_server.client import RemoteStore
    server, client = served
    with caplog.at_level(logging.INFO, logger="expstore"):
        with pytest.raises(flight.FlightError):
            action(client, "describe", {"table": "nope_info"})
    assert not [r for r in caplog.records if "nope_info" in r.getMessage()]
    with caplog.at_level(logging.DEBUG, logger="expstore"):
        with pytest.raises(flight.FlightError):
            action(client, "describe", {"table": "nope_verb"})
        with RemoteStore(f"grpc://127.0.0.1:{server.port}") as remote:
            with pytest.raises(E.NotFound):
                remote.put("nope_session", {"sample_id": ["a_0_0"]})
            with pytest.raises(E.NotFound):
                remote.subscribe("nope_sub", micro_batch_size=1, global_batch_size=1)
    for name in ("nope_verb", "nope_session", "nope_sub"):
        lines = [r for r in caplog.records if name in r.getMessage()]
        assert len(lines) == 1, (name, [r.getMessage() for r in caplog.records])
        assert lines[0].levelno == logging.DEBUG and lines[0].exc_info is None
        assert "not_found" in lines[0].getMessage()
