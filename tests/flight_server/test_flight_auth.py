"""Bearer-token roles over every Flight verb and every action, and TLS.

One server with a tokens file (reader, writer, admin) takes the whole matrix: for each verb and
action and each caller (no token, a wrong token, each role) exactly the allowed calls succeed;
the others fail with FlightUnauthenticatedError (no or wrong token) or FlightUnauthorizedError
(a role below the one needed). The expected roles are written out here, from the design, not read
from the server's tables.
"""
from __future__ import annotations

import itertools
import json
from typing import Any, Callable

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import store
from flight_fixtures import (TOKENS, WRONG_TOKEN, action, action_json, bearer, error_code,
                             put_batches, query, running_server, self_signed_cert, write_tokens)
from flight_server.actions import ACTIONS
from store import errors as E

TABLE = "solver"
ROLES = ("reader", "writer", "admin")
CALLERS = ("none", "wrong", "reader", "writer", "admin")

#: The least role each operation needs (design: reader = SQL and listing; writer = puts, claims,
#: acks, subscriptions; admin = DDL, version bumps, GC, re-queueing dead rows).
NEEDS = {
    "list_flights": "reader", "get_flight_info": "reader", "get_schema": "reader",
    "do_get": "reader", "do_put": "writer", "do_exchange": "writer",
    "get_version": "reader", "wait_version": "reader", "stats": "reader", "leases": "reader",
    "describe": "reader", "list_tables": "reader", "health": "reader",
    "claim": "writer", "claim_many": "writer", "ack": "writer", "nack": "writer",
    "renew": "writer",
    "create_table": "admin", "drop_table": "admin", "bump_version": "admin", "gc": "admin",
    "checkpoint": "admin", "arrive": "admin", "set_barrier_timeout": "admin",
    "requeue": "admin", "barrier": "reader", "do_get claim": "writer",
}
_names = itertools.count()


class Ctx:
    def __init__(self, client: flight.FlightClient, opts: flight.FlightCallOptions) -> None:
        self.client = client
        self.opts = opts
        self.admin = bearer(TOKENS["admin"])

    def act(self, name: str, body: dict[str, Any]) -> Any:
        return action(self.client, name, body, self.opts)

    def admin_claim(self) -> str:
        header = json.loads(action(self.client, "claim", {"table": TABLE, "limit": 1},
                                   self.admin)[0])
        assert header["claim_id"], "the matrix table ran out of ready rows"
        return header["claim_id"]


def _exchange(ctx: Ctx) -> None:
    command = {"subscribe": {"table": TABLE, "micro_batch_size": 1, "global_batch_size": 1}}
    writer, reader = ctx.client.do_exchange(
        flight.FlightDescriptor.for_command(json.dumps(command).encode()), ctx.opts)
    with writer:
        hello = json.loads(reader.read_chunk().app_metadata.to_pybytes())
        assert hello["type"] == "subscribed"
        writer.write_metadata(pa.py_buffer(b'{"type": "close"}'))
        writer.done_writing()


def _arrive(ctx: Ctx) -> None:
    """An arrival at the barrier of the table's own group (one member): a bump."""
    version = json.loads(action(ctx.client, "get_version", {"table": TABLE}, ctx.admin)[0])
    ctx.act("arrive", {"tables": [TABLE], "expected": version["version"], "timeout": 0})


def _create_then_drop(ctx: Ctx) -> None:
    name = f"drop{next(_names)}"
    action(ctx.client, "create_table", {"name": name, "columns": {"x": "int32"}}, ctx.admin)
    ctx.act("drop_table", {"name": name})


OPERATIONS: dict[str, Callable[[Ctx], Any]] = {
    "list_flights": lambda c: list(c.client.list_flights(options=c.opts)),
    "get_flight_info": lambda c: c.client.get_flight_info(
        flight.FlightDescriptor.for_path(TABLE), c.opts),
    "get_schema": lambda c: c.client.get_schema(flight.FlightDescriptor.for_path(TABLE), c.opts),
    "do_get": lambda c: query(c.client, f"SELECT count(*) FROM {TABLE}", options=c.opts),
    "do_get claim": lambda c: c.client.do_get(flight.Ticket(json.dumps(
        {"claim": {"table": TABLE, "limit": 1}}).encode()), c.opts).read_all(),
    "do_put": lambda c: put_batches(c.client, TABLE, [pa.record_batch(
        {"sample_id": [f"put{next(_names)}_0_0"], "reward": [1.0]})], c.opts),
    "do_exchange": _exchange,
    "create_table": lambda c: c.act("create_table", {"name": f"made{next(_names)}",
                                                     "columns": {"x": "int32"}}),
    "drop_table": _create_then_drop,
    "claim": lambda c: c.act("claim", {"table": TABLE, "limit": 1}),
    "claim_many": lambda c: c.act("claim_many", {"requests": [{"table": TABLE, "limit": 1}]}),
    "ack": lambda c: c.act("ack", {"claim_id": c.admin_claim()}),
    "nack": lambda c: c.act("nack", {"claim_id": c.admin_claim()}),
    "renew": lambda c: c.act("renew", {"claim_id": c.admin_claim()}),
    "bump_version": lambda c: c.act("bump_version", {"table": TABLE}),
    "get_version": lambda c: c.act("get_version", {"table": TABLE}),
    "wait_version": lambda c: c.act("wait_version", {"table": TABLE, "min_version": 0,
                                                     "timeout": 0}),
    "stats": lambda c: c.act("stats", {}),
    "leases": lambda c: c.act("leases", {"table": TABLE}),
    "describe": lambda c: c.act("describe", {"table": TABLE}),
    "list_tables": lambda c: c.act("list_tables", {}),
    "health": lambda c: c.act("health", {}),
    "gc": lambda c: c.act("gc", {}),
    "checkpoint": lambda c: c.act("checkpoint", {}),
    "requeue": lambda c: c.act("requeue", {"table": TABLE}),
    "arrive": _arrive,
    "set_barrier_timeout": lambda c: c.act("set_barrier_timeout", {"table": TABLE,
                                                                   "seconds": 600}),
    "barrier": lambda c: c.act("barrier", {"table": TABLE}),
}


def test_matrix_covers_every_verb_and_action():
    verbs = {"list_flights", "get_flight_info", "get_schema", "do_get", "do_put", "do_exchange",
             "do_get claim"}
    assert set(OPERATIONS) == verbs | set(ACTIONS) == set(NEEDS)
    # The server's own table agrees with the design's roles.
    assert {name: spec.role for name, spec in ACTIONS.items()} == {
        name: NEEDS[name] for name in ACTIONS}


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    with running_server(root / "x.duckdb", tokens_file=write_tokens(root / "tokens.json")) as srv:
        with flight.FlightClient(f"grpc://127.0.0.1:{srv.port}") as client:
            admin = bearer(TOKENS["admin"])
            action(client, "create_table", {"name": TABLE, "columns": {"reward": "float64"},
                                            "max_staleness": 1000, "lease_seconds": 600},
                   admin)
            put_batches(client, TABLE, [pa.record_batch({
                "sample_id": [f"q{i}_0_0" for i in range(400)], "reward": [0.5] * 400})], admin)
            yield srv, client


def _options(caller: str) -> flight.FlightCallOptions:
    if caller == "none":
        return bearer(None)
    return bearer(WRONG_TOKEN if caller == "wrong" else TOKENS[caller])


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_role_matrix(auth_server, operation, caller):
    _, client = auth_server
    ctx = Ctx(client, _options(caller))
    if caller in ("none", "wrong"):
        # pyarrow 26's FlightClient.get_schema raises untyped errors (see test_flight_errors).
        expected = (pa.ArrowException, OSError) if operation == "get_schema" else \
            flight.FlightUnauthenticatedError
        with pytest.raises(expected) as raised:
            OPERATIONS[operation](ctx)
        assert "bearer token" in str(raised.value)
        assert "[unauthenticated]" in str(raised.value)
    elif ROLES.index(caller) < ROLES.index(NEEDS[operation]):
        with pytest.raises(flight.FlightUnauthorizedError) as raised:
            OPERATIONS[operation](ctx)
        assert error_code(raised.value) == "permission_denied"
        # The message names the operation, the role needed and the role held.
        message = str(raised.value)
        assert operation in message and repr(NEEDS[operation]) in message
        assert repr(caller) in message
    else:
        OPERATIONS[operation](ctx)


def test_list_actions_is_open_to_readers_and_describes_roles(auth_server):
    _, client = auth_server
    described = dict((a.type, a.description) for a in
                     client.list_actions(bearer(TOKENS["reader"])))
    for name, spec in ACTIONS.items():
        assert described[name].startswith(f"[{spec.role}] ")


def test_subscription_messages_check_roles(auth_server):
    """A writer may subscribe and ack, but bumping from its stream needs the admin role."""
    srv, client = auth_server
    command = {"subscribe": {"table": TABLE, "micro_batch_size": 1, "global_batch_size": 1}}
    writer, reader = client.do_exchange(
        flight.FlightDescriptor.for_command(json.dumps(command).encode()),
        bearer(TOKENS["writer"]))
    with writer:
        assert json.loads(reader.read_chunk().app_metadata.to_pybytes())["type"] == "subscribed"
        batch = reader.read_chunk()
        meta = json.loads(batch.app_metadata.to_pybytes())
        assert meta["type"] == "micro_batch" and meta["is_boundary"]
        writer.write_metadata(pa.py_buffer(json.dumps(
            {"type": "ack", "claim_id": meta["claim_id"], "request": 1}).encode()))
        assert json.loads(reader.read_chunk().app_metadata.to_pybytes())["type"] == "acked"
        writer.write_metadata(pa.py_buffer(b'{"type": "bump", "request": 2}'))
        answer = json.loads(reader.read_chunk().app_metadata.to_pybytes())
        assert answer["type"] == "error" and answer["request"] == 2
        assert answer["code"] == "permission_denied" and "'admin'" in answer["message"]
        writer.write_metadata(pa.py_buffer(b'{"type": "close"}'))
        writer.done_writing()


def test_remote_store_with_tokens(auth_server):
    srv, _ = auth_server
    uri = f"grpc://127.0.0.1:{srv.port}"
    with store.connect(uri, token=TOKENS["reader"]) as reader:
        assert TABLE in reader.list_tables()
        with pytest.raises(E.PermissionDenied, match="'writer'"):
            reader.put(TABLE, pa.table({"sample_id": ["r_0_0"], "reward": [1.0]}))
    with store.connect(uri, token=WRONG_TOKEN) as stranger:
        with pytest.raises(E.Unauthenticated) as raised:
            stranger.list_tables()
        assert str(raised.value) == "the bearer token is not valid"  # no wire prefix


# -- TLS -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_cert(root)
    with running_server(root / "x.duckdb", tls_cert=cert, tls_key=key) as srv:
        assert srv.location.startswith("grpc+tls://")
        yield srv, cert


def test_tls_client_with_root_certs(tls_server):
    srv, cert = tls_server
    with open(cert, "rb") as f:
        root = f.read()
    with flight.FlightClient(f"grpc+tls://127.0.0.1:{srv.port}", tls_root_certs=root) as client:
        action(client, "create_table", {"name": TABLE, "columns": {"reward": "float64"}})
        put_batches(client, TABLE, [pa.record_batch({"sample_id": ["q_0_0"], "reward": [1.0]})])
        assert query(client, f"SELECT reward FROM {TABLE}").to_pylist() == [{"reward": 1.0}]
    # The Python client takes a path to the same certificate.
    with store.connect(f"grpc+tls://127.0.0.1:{srv.port}", tls_root_certs=cert) as remote:
        assert remote.health()["status"] == "ok"


def test_plain_client_is_refused_by_tls_server(tls_server):
    srv, _ = tls_server
    with flight.FlightClient(f"grpc://127.0.0.1:{srv.port}") as client:
        with pytest.raises(flight.FlightUnavailableError):
            action(client, "health", {}, flight.FlightCallOptions(timeout=10))


def test_tls_client_without_the_certificate_is_refused(tls_server):
    srv, _ = tls_server
    with flight.FlightClient(f"grpc+tls://127.0.0.1:{srv.port}") as client:
        with pytest.raises(flight.FlightUnavailableError):
            action(client, "health", {}, flight.FlightCallOptions(timeout=10))


def test_tls_needs_both_files(tmp_path):
    cert, _ = self_signed_cert(tmp_path)
    with pytest.raises(E.InvalidArgument, match="both"):
        running_server(tmp_path / "x.duckdb", tls_cert=cert).__enter__()


def test_health_answer_shape(auth_server):
    _, client = auth_server
    assert set(action_json(client, "health", {}, bearer(TOKENS["reader"]))) >= {"status",
                                                                                 "tables"}
