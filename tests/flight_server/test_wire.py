"""flight_server/wire: every message of docs/protocol.md, encoded and decoded in one place.

Three kinds of checks: each message is written with exactly the bytes docs/protocol.md shows
(a client in another language compares these), each decodes back to what was encoded, and each
kind of malformed input is refused with an error naming the bad value and what was expected.
Last, a guard: no module of flight_server/ but the wire package turns wire bytes into JSON or
back.
"""
from __future__ import annotations

import ast
import doctest
import importlib
import json
import pkgutil
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flight_server import wire
from flight_server.wire import actions as wire_actions
from flight_server.wire import session as wire_session
from flight_server.wire import subscribe as wire_subscribe
from store import errors as E
from store.claims import Claim, ClaimRequest

ROOT = Path(__file__).resolve().parents[2]

names = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)
texts = st.text(max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False)
    | texts, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(texts, inner, max_size=4), max_leaves=12)


# -- the bytes docs/protocol.md shows -----------------------------------------------------------

def test_requests_are_written_as_the_protocol_shows_them():
    assert wire.SqlTicket("SELECT sample_id, reward FROM solver WHERE policy_version = ?",
                          [3], 5).encode() == \
        b'{"sql": "SELECT sample_id, reward FROM solver WHERE policy_version = ?", ' \
        b'"params": [3], "timeout": 5}'
    assert wire.table_ticket("solver") == b'{"sql": "SELECT * FROM \\"solver\\""}'
    request = ClaimRequest("solver", 16)
    assert wire.ClaimTicket(wire.claim_body(request, "trainer-0", None)).encode() == \
        b'{"claim": {"table": "solver", "limit": 16, "min_rows": 1, "consumer": "trainer-0"}}'
    assert wire.claim_many_body([request, ClaimRequest("v", 4, "reward > 0", "input_id", 2)],
                                None, 30) == {
        "requests": [{"table": "solver", "limit": 16, "min_rows": 1},
                     {"table": "v", "limit": 4, "min_rows": 1, "where": "reward > 0",
                      "group_by": "input_id", "group_size": 2}],
        "lease_seconds": 30}
    assert wire.action("ack", {"claim_id": "c1"}).body.to_pybytes() == b'{"claim_id": "c1"}'
    assert wire.action("health").body.to_pybytes() == b"{}"
    assert wire.SESSION_COMMAND == b'{"session": {}}'
    assert wire.SessionRequest(7, "claim", {"table": "solver", "limit": 16}).encode() \
        .to_pybytes() == \
        b'{"id": 7, "action": "claim", "body": {"table": "solver", "limit": 16}}\n'
    assert wire.SessionRequest(9, "put", {"table": "solver"}, [b"IPC"]).encode().to_pybytes() \
        == b'{"id": 9, "action": "put", "body": {"table": "solver"}, "sizes": [3]}\nIPC'
    assert wire.put_command(2) == b'{"put": {"replicas": 2}}'
    assert wire.FetchTicket([wire.FetchColumn(["0:4096:81920:17", None], "string")]).encode() \
        == b'{"get": {"columns": [{"keys": ["0:4096:81920:17", null], "type": "string"}]}}'


def test_subscription_messages_are_written_as_the_protocol_shows_them():
    options = wire.SubscribeOptions("solver", 16, 64, {
        "where": None, "consumer": "trainer-0", "max_in_flight": 2})
    assert options.encode() == (
        b'{"subscribe": {"table": "solver", "micro_batch_size": 16, "global_batch_size": 64, '
        b'"consumer": "trainer-0", "max_in_flight": 2}}')
    assert wire.SubscribeOptions(["solver", "verifier"], 4, 8).encode() == (
        b'{"subscribe": {"tables": ["solver", "verifier"], "micro_batch_size": 4, '
        b'"global_batch_size": 8}}')
    m = wire.ClientMessage
    assert m("ack", 3, claim_id="c1").encode() == b'{"type": "ack", "claim_id": "c1", "request": 3}'
    assert m("nack", 4, claim_id="c1").encode() == \
        b'{"type": "nack", "claim_id": "c1", "request": 4}'
    assert m("bump", 5).encode() == b'{"type": "bump", "weights_uri": null, "request": 5}'
    assert m("resume", 6).encode() == b'{"type": "resume", "request": 6}'
    assert m("close").encode() == b'{"type": "close"}'
    assert wire_subscribe.hello("solver", 0).to_pybytes() == \
        b'{"type": "subscribed", "table": "solver", "version": 0}'
    assert wire.MicroBatchMeta("c1", 0, False, 3, 1, 16).encode().to_pybytes() == (
        b'{"type": "micro_batch", "claim_id": "c1", "index": 0, "is_boundary": false, '
        b'"version": 3, "global_batch": 1, "rows": 16}')
    assert wire_subscribe.error_reply(None, E.NotFound("gone"), fatal=True) == {
        "type": "error", "request": None, "code": "not_found", "message": "gone",
        "fatal": True}
    assert wire_subscribe.message(wire_subscribe.CLOSING).to_pybytes() == \
        b'{"type": "closing", "request": null}'


def test_answers_are_written_as_the_protocol_shows_them():
    assert wire.put_answer(0, {"rows": 2, "version": 0}) == \
        b'{"batch": 0, "rows": 2, "version": 0}'
    assert wire.put_error_answer(3, E.StaleVersion("policy_version 0 is stale")) == \
        b'{"batch": 3, "error": {"code": "stale_version", "message": "policy_version 0 is stale"}}'
    assert wire.put_error_answer(4, RuntimeError("boom")) == \
        b'{"batch": 4, "error": {"code": "internal", "message": "boom"}}'
    header = wire.ClaimHeader("9f0c", "trainer-0", 1767225600.25, {"solver": 16})
    assert header.encode() == (b'{"claim_id": "9f0c", "consumer": "trainer-0", '
                               b'"expires_at": 1767225600.25, "tables": {"solver": 16}}')
    assert wire_session.answer(7, [b"ab", b"cde"]).to_pybytes() == \
        b'{"id": 7, "sizes": [2, 3]}\nabcde'
    assert wire_session.error_answer(8, E.LeaseExpired("late")).to_pybytes() == \
        b'{"id": 8, "error": {"code": "lease_expired", "message": "late"}}\n'
    assert wire_session.closing().to_pybytes() == b'{"id": null, "closing": true}\n'
    assert wire.node_put_answer(0, 2, {"text": "dn-a1@0:4096:81920"}) == \
        b'{"batch": 0, "rows": 2, "chunks": {"text": "dn-a1@0:4096:81920"}}'
    # an answer holds what the store returned; what JSON has no type for is written as text
    assert wire.results_bytes({"at": pa.scalar(1).type}) == [b'{"at": "int64"}']
    assert wire.results_bytes([b"raw", b"parts"]) == [b"raw", b"parts"]


# -- round trips ---------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(sql=texts, params=st.none() | st.lists(json_values, max_size=3),
       timeout=st.none() | st.floats(min_value=0.001, max_value=30))
def test_an_sql_ticket_round_trips(sql, params, timeout):
    ticket = wire.SqlTicket(sql, params, timeout)
    assert wire.parse_ticket(ticket.encode(), max_timeout=30) == ticket


@settings(max_examples=60, deadline=None)
@given(body=st.dictionaries(names, json_values, max_size=5))
def test_a_claim_ticket_round_trips(body):
    ticket = wire.ClaimTicket(body)
    assert wire.parse_ticket(ticket.encode(), max_timeout=30) == ticket


def test_a_claim_body_round_trips_to_the_same_request():
    for request in (ClaimRequest("solver", 16),
                    ClaimRequest("v", 8, "reward > 0", "input_id", 4, 4)):
        for consumer, lease in ((None, None), ("trainer-0", 12.5)):
            body = json.loads(wire.encode_body(wire.claim_body(request, consumer, lease)))
            decoded = wire.parse_claim_body(body)
            assert decoded == wire.ClaimBody([request], consumer, lease)
            many = json.loads(wire.encode_body(wire.claim_many_body([request] * 2, consumer,
                                                                    lease)))
            assert wire.parse_claim_many_body(many) == wire.ClaimBody([request] * 2, consumer,
                                                                      lease)


@settings(max_examples=60, deadline=None)
@given(columns=st.integers(1, 3).flatmap(lambda rows: st.lists(
    st.builds(wire.FetchColumn, st.lists(st.none() | st.from_regex(r"[0-9]+:[0-9]+:[0-9]+:[0-9]+",
                                                                    fullmatch=True),
                                         min_size=rows, max_size=rows),
              st.sampled_from(["string", "binary", "list<int32>"])), min_size=1, max_size=3)))
def test_a_fetch_ticket_round_trips(columns):
    ticket = wire.FetchTicket(columns)
    assert wire.parse_fetch_ticket(ticket.encode()) == ticket


@settings(max_examples=60, deadline=None)
@given(request_id=st.integers(0, 2**40) | st.none(), action=names,
       body=st.dictionaries(names, json_values, max_size=4),
       parts=st.lists(st.binary(max_size=30), max_size=3).map(tuple),
       schemas=st.none() | st.dictionaries(names, names, max_size=3))
def test_a_session_request_round_trips(request_id, action, body, parts, schemas):
    request = wire.SessionRequest(request_id, action, body, parts, schemas)
    assert wire.SessionRequest.decode(request.encode().to_pybytes()) == request


@settings(max_examples=60, deadline=None)
@given(request_id=st.integers(0, 2**40),
       parts=st.lists(st.binary(max_size=30), max_size=3).map(tuple))
def test_a_session_answer_round_trips(request_id, parts):
    got = wire.SessionAnswer.decode(wire_session.answer(request_id, parts).to_pybytes())
    assert got == wire.SessionAnswer(request_id, parts)
    # as the client reads it: the buffer the message arrived in, parts copied out of it
    message = wire_session.answer(request_id, [pa.py_buffer(p) for p in parts])
    assert wire.SessionAnswer.decode(message) == wire.SessionAnswer(request_id, parts)


def test_a_session_answer_read_from_its_buffer_keeps_long_headers_and_errors():
    error = E.NotFound("no table " + "x" * 6000)        # a header past the first 4 KiB
    answer = wire.SessionAnswer.decode(wire_session.error_answer(5, error))
    assert type(answer.error) is E.NotFound and str(answer.error) == str(error)
    parts = [b'{"claim_id": "c"}', bytes(range(256)) * 800]
    got = wire.SessionAnswer.decode(wire_session.answer(6, parts))
    assert got == wire.SessionAnswer(6, tuple(parts))
    assert all(type(p) is bytes for p in got.parts)
    with pytest.raises(E.ExpstoreError, match="malformed session answer"):
        wire.SessionAnswer.decode(pa.py_buffer(b'{"id": 1, "sizes": [9]}\nab'))


@pytest.mark.parametrize("code", sorted(E.ERROR_CLASSES))
def test_every_error_code_round_trips_as_a_flight_error_and_as_a_payload(code):
    error = E.ERROR_CLASSES[code](f"bad value {code!r}; expected another")
    received = wire.from_flight(wire.flight_error(error))
    assert type(received) is type(error) and str(received) == str(error)
    assert wire.code_of(wire.flight_error(error).extra_info) == code
    answer = wire.SessionAnswer.decode(wire_session.error_answer(1, error).to_pybytes())
    assert type(answer.error) is type(error) and str(answer.error) == str(error)
    reply = wire_subscribe.server_message(wire_subscribe.message(
        wire_subscribe.error_reply(2, error)).to_pybytes())
    got = wire_subscribe.reply_error(reply)
    assert type(got) is type(error) and str(got) == str(error)


def test_a_flight_error_without_our_code_keeps_its_kind():
    assert isinstance(wire.from_flight(flight.FlightUnavailableError("gone")), E.Unavailable)
    assert isinstance(wire.from_flight(flight.FlightServerError("x", extra_info=b"not json")),
                      E.ExpstoreError)
    assert wire.code_of(b'["a list"]') is None and wire.code_of(b'{"code": 3}') is None


def _table(n: int) -> pa.Table:
    return pa.table({"sample_id": [f"q{i}_0_0" for i in range(n)], "reward": [1.0] * n})


def test_a_claim_answer_round_trips():
    claim = Claim("c1", "trainer-0", 1767225600.25, {"solver": _table(3), "verifier": _table(1)})
    back = wire.claim_of_results(wire.claim_results(claim))
    assert (back.claim_id, back.consumer, back.expires_at) == ("c1", "trainer-0", 1767225600.25)
    assert {k: v.to_pylist() for k, v in back.tables.items()} == \
        {k: v.to_pylist() for k, v in claim.tables.items()}
    empty = wire.claim_results(Claim("", "trainer-0", 0.0, {"solver": _table(0)}))
    assert len(empty) == 1 and wire.claim_of_results(empty).tables == {}
    header = wire.ClaimHeader.decode(wire.claim_results(claim)[0])
    nodes = [{"node_id": "dn-a1", "locations": ["grpc://10.0.0.5:40111"], "placement": None,
              "alive": True}]
    with_nodes = wire.ClaimHeader(header.claim_id, header.consumer, header.expires_at,
                                  header.tables, nodes)
    assert wire.ClaimHeader.decode(with_nodes.encode()) == with_nodes


def test_a_claim_answer_naming_known_schemas_round_trips():
    claim = Claim("c1", "trainer-0", 5.0, {"solver": _table(3), "verifier": _table(1)})
    learned: dict = {}
    first = wire.claim_of_results(wire.claim_results(claim, {}), {}, learned)
    assert set(learned) == {"solver", "verifier"} and first.tables["solver"].num_rows == 3
    fingerprints = {t: fp for t, (fp, _) in learned.items()}
    assert fingerprints["solver"] == wire.schema_fingerprint("solver", _table(2).schema)
    # solver named: its rows come without the schema; verifier's stale name: a stream again
    results = wire.claim_results(claim, {"solver": fingerprints["solver"], "verifier": "stale"})
    header = wire.ClaimHeader.decode(results[0])
    assert header.batches == ["solver"] and header.schemas == {"verifier": fingerprints["verifier"]}
    again: dict = {}
    back = wire.claim_of_results(results, {"solver": learned["solver"][1]}, again)
    assert {k: v.to_pylist() for k, v in back.tables.items()} == \
        {k: v.to_pylist() for k, v in claim.tables.items()}
    assert set(again) == {"verifier"}
    # a batch the client cannot read: no schema of its own for it
    with pytest.raises(E.ExpstoreError, match="without a schema the request named"):
        wire.claim_of_results(results)
    # an answer of a server from before schemas (streams, no fingerprints) still reads
    old = wire.claim_of_results(wire.claim_results(claim), {"solver": _table(0).schema}, again)
    assert old.tables["solver"].num_rows == 3


def test_a_claim_stream_round_trips():
    claim = Claim("c1", "trainer-0", 12.5, {"solver": _table(2)})
    streamed = wire.claim_stream_table(claim)
    assert streamed.schema.metadata[wire.EXPIRES_AT_KEY] == b"12.5"
    back = wire.claim_of_stream("solver", streamed)
    assert (back.claim_id, back.consumer, back.expires_at) == ("c1", "trainer-0", 12.5)
    assert back.data.equals(claim.data) and not back.data.schema.metadata


@settings(max_examples=40, deadline=None)
@given(table=names | st.lists(names, min_size=2, max_size=3), micro=st.integers(1, 64),
       options=st.fixed_dictionaries({}, optional={
           "consumer": names, "max_in_flight": st.integers(1, 4),
           "where": texts, "group_by": st.just("input_id"), "group_size": st.integers(1, 4)}))
def test_subscribe_options_round_trip(table, micro, options):
    sent = wire.SubscribeOptions(table, micro, micro * 4, options)
    assert wire.parse_subscribe(sent.encode()) == sent


def test_subscription_messages_round_trip():
    for message in (wire.ClientMessage("ack", 1, claim_id="c"),
                    wire.ClientMessage("bump", 2, weights_uri="s3://w/3"),
                    wire.ClientMessage("resume", 3)):
        assert wire.ClientMessage.decode(message.encode()) == message
    meta = wire.MicroBatchMeta("c1", 1, True, 2, 0, 8, {"a": 4, "b": 4})
    assert wire.MicroBatchMeta.of(wire_subscribe.server_message(meta.encode().to_pybytes())) \
        == meta
    tables = {"a": _table(2), "b": _table(1)}
    batch = wire_subscribe.multi_batch(tables)
    assert batch.schema == wire.MULTI_SCHEMA
    back = wire_subscribe.tables_of_multi_batch(batch)
    assert {k: v.to_pylist() for k, v in back.items()} == \
        {k: v.to_pylist() for k, v in tables.items()}


def test_put_messages_round_trip():
    assert wire.parse_put_answer(wire.put_answer(2, {"rows": 1, "version": 4})) == \
        {"batch": 2, "rows": 1, "version": 4}
    for replicas in (1, 2):
        assert wire.parse_put_command(wire.put_command(replicas)) == replicas
    assert wire.parse_put_command(b'{"put": {}}') == 1
    assert wire.chunks_of_answer(wire.node_put_answer(0, 1, {"x": "n@0:0:1"})) == \
        {"x": "n@0:0:1"}


def test_an_action_body_round_trips_and_is_checked_against_its_fields():
    for name, (required, optional) in wire.ACTION_FIELDS.items():
        body = {f: 1 for f in required + optional}
        assert wire.check_body(name, wire.parse_body(wire.encode_body(body), name)) == body
    assert wire.parse_body(b"", "health") == {}


def _documented_bodies() -> dict[str, tuple[set[str], set[str]]]:
    """Each action's body in docs/protocol.md's tables: (required, optional) field names."""
    rows = re.findall(r"^\| `(\w+)` \| (?:reader|writer|admin) \| `(\{.*?\})` \|",
                      (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8"), re.M)
    documented: dict[str, tuple[set[str], set[str]]] = {}
    for name, body in rows:
        # the fields are the body's top-level comma-separated parts: "name", "where?: SQL …"
        fields, depth, token = [], 0, ""
        for ch in body[1:-1] + ",":
            if ch in "{[(":
                depth += 1
            elif ch in "}])":
                depth -= 1
            if ch == "," and depth == 0:
                if token.strip():
                    named = re.match(r"\s*(\w+)(\??)", token)
                    assert named is not None, f"{name}: cannot read the field {token!r}"
                    fields.append(named.groups())
                token = ""
            else:
                token += ch
        documented[name] = ({f for f, o in fields if not o}, {f for f, o in fields if o})
    return documented


def test_the_action_fields_are_those_docs_protocol_md_lists():
    documented = _documented_bodies()
    assert set(wire.ACTION_FIELDS) - {"put"} == set(documented)
    for name, (required, optional) in documented.items():
        assert (set(wire.ACTION_FIELDS[name][0]), set(wire.ACTION_FIELDS[name][1])) == \
            (required, optional), name


def test_each_action_needs_the_role_docs_protocol_md_names():
    from flight_server.actions import ACTIONS
    from flight_server.cluster import coordinator, datanode
    roles = {name: spec.role for name, spec in ACTIONS.items()}
    roles.update({name: role for name, (role, _) in coordinator._CLUSTER_ACTIONS.items()})
    roles.update({name: role for name, (role, _) in datanode._ACTIONS.items()})
    documented = re.findall(r"^\| `(\w+)` \| (reader|writer|admin) \| `\{",
                            (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8"), re.M)
    assert documented and all(roles[name] == role for name, role in documented), \
        [(name, role, roles.get(name)) for name, role in documented if roles.get(name) != role]


# -- malformed input -------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, named", [
    (b"SELECT 1", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b"x" * (wire.MAX_TICKET_BYTES + 1), "larger than"),
    (b'["SELECT 1"]', "must be a JSON object"),
    (b'{"sql": 7}', "must be a JSON object"),
    (b'{"sql": "SELECT 1", "limit": 3}', "unknown fields ['limit']"),
    (b'{"sql": "SELECT 1", "timeout": 0}', "timeout 0 is invalid; expected seconds in (0, 30"),
    (b'{"sql": "SELECT 1", "timeout": 31}', "timeout 31 is invalid"),
    (b'{"sql": "SELECT 1", "timeout": true}', "timeout True is invalid"),
    (b'{"sql": "SELECT 1", "timeout": "5"}', "timeout '5' is invalid"),
    (b'{"claim": {"table": "t"}, "sql": "SELECT 1"}', "unknown fields ['sql']"),
    (b'{"claim": [1]}', "must be a JSON object (the claim action's body), got list"),
])
def test_a_malformed_ticket_is_refused_naming_the_problem(raw, named):
    with pytest.raises(E.InvalidArgument) as e:
        wire.parse_ticket(raw, max_timeout=30)
    assert named in str(e.value)


@pytest.mark.parametrize("raw, named", [
    (b"{", "data node ticket is invalid"),
    (b'{"get": {}}', "data node ticket is invalid ('columns')"),
    (b'{"get": {"columns": [{"keys": ["1:0:1:0"]}]}}', "invalid ('type')"),
    (b'{"get": {"columns": []}}', "columns are malformed"),
    (b'{"get": {"columns": [{"keys": "1:0:1:0", "type": "string"}]}}', "malformed"),
    (b'{"get": {"columns": [{"keys": [3], "type": "string"}]}}', "malformed"),
    (b'{"get": {"columns": [{"keys": ["a"], "type": 5}]}}', "malformed"),
    (b'{"get": {"columns": [{"keys": ["a"], "type": "string"}, '
     b'{"keys": [], "type": "string"}]}}', "keys lists of one length"),
])
def test_a_malformed_fetch_ticket_is_refused(raw, named):
    with pytest.raises(E.InvalidArgument) as e:
        wire.parse_fetch_ticket(raw)
    assert named in str(e.value)


@pytest.mark.parametrize("raw, named", [
    (b"{", "body of action 'ack' is not valid JSON"),
    (b"[1]", "body of action 'ack' must be a JSON object, got list"),
    (b'"x"', "must be a JSON object, got str"),
])
def test_a_malformed_action_body_is_refused(raw, named):
    with pytest.raises(E.InvalidArgument) as e:
        wire.parse_body(raw, "ack")
    assert named in str(e.value)


@pytest.mark.parametrize("name, body, named", [
    ("ack", {}, "action 'ack' needs field(s) ['claim_id']"),
    ("ack", {"claim_id": "c", "rows": 3}, "does not take field(s) ['rows']; it takes "
                                         "['claim_id']"),
    ("claim", {"table": "t", "limt": 4}, "needs field(s) ['limit']"),
    ("claim_many", {"requests": {"table": "t"}}, "'requests' must be a list"),
    ("claim_many", {"requests": [{"table": "t", "limit": 1, "consumer": "x"}]},
     "unknown fields ['consumer']"),
    ("claim_many", {"requests": ["t"]}, "claim request 't' is not a JSON object"),
    ("claim_many", {"requests": [{"table": "t"}]}, "claim request needs 'table' and 'limit'"),
    ("claim_many", {"requests": [{"table": "t", "limit": "16"}]},
     "claim limit '16' is invalid; expected an integer in [1, 100000]"),
])
def test_an_action_body_with_wrong_fields_is_refused(name, body, named):
    with pytest.raises(E.InvalidArgument) as e:
        if name == "claim":
            wire.parse_claim_body(body)
        elif name == "claim_many":
            wire.parse_claim_many_body(body)
        else:
            wire.check_body(name, body)
    assert named in str(e.value)


def test_a_flag_must_be_a_json_boolean():
    assert wire.flag({}, "if_exists", "drop_table") is False
    with pytest.raises(E.InvalidArgument, match="'if_exists' must be true or false, got 'false'"):
        wire.flag({"if_exists": "false"}, "if_exists", "drop_table")


@pytest.mark.parametrize("raw, named", [
    (b"not json\n", "must be a JSON object {id, action, body} on one line"),
    (b"[1]\n", "must be a JSON object {id, action, body}"),
    (b'{"id": 1, "sizes": "3"}\nabc', "sizes must be a list of byte counts, got '3'"),
    (b'{"id": 1, "sizes": [-1]}\n', "sizes must be a list of byte counts"),
    (b'{"id": 1, "sizes": [true]}\nx', "sizes must be a list of byte counts"),
    (b'{"id": 1, "sizes": [4]}\nabc', "add up to 4 bytes but 3 follow its header"),
])
def test_a_malformed_session_request_is_refused(raw, named):
    """A header that does not parse is refused at once; parts that do not fit a parsed header
    when the request is checked, its id known for the answer."""
    with pytest.raises(E.InvalidArgument) as e:
        wire.SessionRequest.decode(raw).check(("claim", "put"))
    assert named in str(e.value)
    if b"sizes" in raw:
        assert wire.SessionRequest.decode(raw).id == 1


def test_a_session_header_may_span_lines_when_it_has_no_parts():
    raw = b'{"id": 3,\n "action": "ack",\n "body": {"claim_id": "c"}}'
    assert wire.SessionRequest.decode(raw) == wire.SessionRequest(3, "ack", {"claim_id": "c"})


@pytest.mark.parametrize("request_, named", [
    (wire.SessionRequest(1, "wait_version", {}), "action 'wait_version' is not served on a "
                                                 "session; session actions: ['claim', 'put']"),
    (wire.SessionRequest(1, ["claim"], {}), "action ['claim'] is not served"),
    (wire.SessionRequest(1, "claim", [1]), "body must be a JSON object, got list"),
    (wire.SessionRequest(1, "claim", {}, [b"x"]), "a 'claim' request carries no parts; got 1"),
])
def test_a_session_request_the_server_does_not_serve_is_refused(request_, named):
    with pytest.raises(E.InvalidArgument) as e:
        request_.check(("claim", "put"))
    assert named in str(e.value)


@pytest.mark.parametrize("raw, named", [
    (b"{", "do_exchange command is not valid JSON"),
    (b'{"subscribe": 3}', "must be {\"subscribe\": {table"),
    (b'{"subscribe": {"table": "t", "micro_batch_size": 1, "global_batch_size": 1, "x": 1}}',
     "unknown fields ['x']"),
    (b'{"subscribe": {"micro_batch_size": 1, "global_batch_size": 1}}',
     "needs 'table' (one table) or 'tables'"),
    (b'{"subscribe": {"table": "t", "tables": ["t"], "micro_batch_size": 1, '
     b'"global_batch_size": 1}}', "not both"),
    (b'{"subscribe": {"tables": [], "micro_batch_size": 1, "global_batch_size": 1}}',
     "'tables' [] is not a list of table names"),
    (b'{"subscribe": {"tables": ["a", 2], "micro_batch_size": 1, "global_batch_size": 1}}',
     "'tables' ['a', 2] is not a list"),
    (b'{"subscribe": {"table": "t", "global_batch_size": 1}}',
     "subscribe needs 'micro_batch_size'"),
])
def test_a_malformed_subscribe_command_is_refused(raw, named):
    with pytest.raises(E.InvalidArgument) as e:
        wire.parse_subscribe(raw)
    assert named in str(e.value)


def test_a_client_message_that_is_not_an_object_keeps_what_came_for_its_error():
    for raw in (b"{", b"[1]", b'"ack"', b"\xff"):
        assert wire.ClientMessage.decode(raw) == wire.ClientMessage("invalid",
                                                                    unreadable=repr(raw))
    assert wire.ClientMessage.decode(b"x" * 500).unreadable == repr(b"x" * 100)


@pytest.mark.parametrize("raw, named", [
    (b"{", "data node put command b'{' is invalid"),
    (b'{"put": 2}', "is invalid"),
    (b'{"store": {}}', "expected {\"put\": {\"replicas\": 1 or 2}}"),
    (b'{"put": {"replicas": 3}}', "replicas 3 is invalid; expected 1 or 2"),
    (b'{"put": {"replicas": true}}', "replicas True is invalid"),
])
def test_a_malformed_put_command_is_refused(raw, named):
    with pytest.raises(E.InvalidArgument) as e:
        wire.parse_put_command(raw)
    assert named in str(e.value)


def test_a_put_to_a_data_node_needs_a_command_descriptor():
    with pytest.raises(E.InvalidArgument, match="expects FlightDescriptor.for_command"):
        wire.put_command_of(flight.FlightDescriptor.for_path("t"))


@pytest.mark.parametrize("decode, raw, named", [
    (wire.ClaimHeader.decode, b"<html>", "malformed claim header"),
    (wire.ClaimHeader.decode, b"[]", "expected a JSON object, got list"),
    (wire.ClaimHeader.decode, b'{"claim_id": "c"}', "it lacks 'consumer'"),
    (wire.ClaimHeader.decode, b'{"claim_id": 1, "consumer": "", "expires_at": 0, '
                              b'"tables": {}}', "malformed claim header"),
    (lambda raw: wire.claim_of_results([raw, b"extra"]), b'{"claim_id": "", "consumer": "", '
     b'"expires_at": 0.0, "tables": {}}', "2 parts for 0 tables"),
    (wire.SessionAnswer.decode, b"nope\n", "malformed session answer"),
    (wire.SessionAnswer.decode, b'{"id": 1, "sizes": [9]}\nab', "malformed session answer"),
    (wire.parse_put_answer, b"", "malformed do_put answer"),
    (wire.chunks_of_answer, b'{"batch": 0}', "has no chunks"),
    (lambda raw: wire.json_result([raw], "stats"), b"{", "answer to action 'stats'"),
    (lambda raw: wire.MicroBatchMeta.of(json.loads(raw)), b'{"type": "micro_batch"}',
     "malformed micro-batch from the server: it lacks 'claim_id'"),
    (lambda raw: wire.table_def(json.loads(raw)), b'{"name": "t"}', "lacks 'columns'"),
])
def test_a_malformed_answer_is_a_store_error_naming_it(decode, raw, named):
    with pytest.raises(E.ExpstoreError) as e:
        decode(raw)
    assert named in str(e.value)


def test_a_claim_stream_without_its_metadata_is_a_store_error():
    with pytest.raises(E.ExpstoreError, match="schema metadata lacks"):
        wire.claim_of_stream("solver", _table(1))


def test_the_wire_modules_examples_run():
    for info in pkgutil.iter_modules(wire.__path__):
        module = importlib.import_module(f"flight_server.wire.{info.name}")
        failed, _ = doctest.testmod(module)
        assert failed == 0, info.name


# -- the guard: the wire is parsed in one place ---------------------------------------------------

#: json calls outside flight_server/wire/ that are not wire messages: (file, function, call).
NOT_WIRE = {
    ("flight_server/auth.py", "load_tokens", "load"):
        "reads the tokens file given to the server (a local file, not a message)",
    ("flight_server/cluster/security.py", "ClusterSecurity._tokens", "loads"):
        "reads the cluster's tokens file text (a local file, not a message)",
    ("flight_server/cluster/coordinator.py", "ClusterRegistry.__init__", "load"):
        "reads the coordinator's registry file beside its database",
    ("flight_server/cluster/coordinator.py", "ClusterRegistry.save", "dump"):
        "writes the coordinator's registry file beside its database",
    ("flight_server/cluster/coordinator.py", "CoordinatorServer._action_dead_letters", "loads"):
        "reads the dead-letter log file, one JSON line per row",
    ("flight_server/cluster/coordinator.py", "CoordinatorServer._record_dead", "dumps"):
        "appends to the dead-letter log file",
}
JSON_FUNCTIONS = {"load", "loads", "dump", "dumps"}


class _JsonUses(ast.NodeVisitor):
    """Every use of the json module in one file: (enclosing function, what), where ``what`` is
    the json function called, or an import that hides the module's name."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, str]] = []

    def _visit_scope(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_scope(node, node.name)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_scope(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in ("json", "simplejson", "orjson", "ujson"):
            self.found.append((".".join(self.scope), f"from {node.module} import"))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in ("simplejson", "orjson", "ujson") or \
                    (alias.name == "json" and alias.asname not in (None, "json")):
                self.found.append((".".join(self.scope), f"import {alias.name}"))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                func.value.id == "json" and func.attr in JSON_FUNCTIONS:
            self.found.append((".".join(self.scope), func.attr))
        self.generic_visit(node)


def json_uses(root: Path) -> set[tuple[str, str, str]]:
    """(file, function, json call) of every json use under flight_server/ outside wire/."""
    uses = set()
    for path in sorted((root / "flight_server").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("flight_server/wire/"):
            continue
        visitor = _JsonUses()
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), relative))
        uses.update((relative, scope, what) for scope, what in visitor.found)
    return uses


def test_no_module_but_the_wire_turns_wire_bytes_into_json_or_back():
    """Messages are encoded and decoded in flight_server/wire/ only: a json call anywhere else
    in flight_server/ is a second parser of the protocol, unless it is listed in NOT_WIRE with
    why it is not a message."""
    stray = json_uses(ROOT) - set(NOT_WIRE)
    assert not stray, ("json used outside flight_server/wire/ (encode or decode the message "
                       f"there, or list a non-wire use in NOT_WIRE with its reason): "
                       f"{sorted(stray)}")


def test_every_listed_non_wire_use_still_exists():
    """NOT_WIRE lists only what is there: a stale entry would let a new use through."""
    assert set(NOT_WIRE) <= json_uses(ROOT), sorted(set(NOT_WIRE) - json_uses(ROOT))


def test_the_guard_sees_a_json_call_hidden_in_a_method(tmp_path):
    module = tmp_path / "flight_server" / "thing.py"
    module.parent.mkdir()
    module.write_text("import json\nfrom json import loads\nclass A:\n"
                      "    def f(self, raw):\n        return json.loads(raw)\n")
    assert json_uses(tmp_path) == {("flight_server/thing.py", "A.f", "loads"),
                                   ("flight_server/thing.py", "", "from json import")}
