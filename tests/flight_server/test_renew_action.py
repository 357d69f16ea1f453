"""The ``renew`` action over a real Flight server: a plain ``do_action`` (raw, and a RemoteStore
without sessions) and on an action session. The store-level behaviour runs against every backend
in tests/store/test_lease_renewal.py; a cluster's coordinator is covered in
tests/flight_server/cluster/test_cluster_dataplane.py."""
from __future__ import annotations

import json
import time

import pyarrow.flight as flight
import pytest

import store
from flight_server.session import SESSION_ACTIONS
from flight_server.session_client import SessionChannel
from store.errors import InvalidArgument, LeaseExpired, NotFound

from flight_fixtures import action, action_json, error_code, parse_claim, running_server


@pytest.fixture
def server(tmp_path):
    with running_server(tmp_path / "x.duckdb") as srv:
        with flight.FlightClient(f"grpc://127.0.0.1:{srv.port}") as client:
            action(client, "create_table", {"name": "t", "columns": {"reward": "float64"}})
            s = store.connect(srv.location, sessions=False)
            s.put("t", {"sample_id": [f"q{i}_0_0" for i in range(4)], "reward": [1.0] * 4})
            s.close()
            yield srv, client


def _claim(client, lease_seconds):
    header, _ = parse_claim(action(client, "claim", {"table": "t", "limit": 1,
                                                     "lease_seconds": lease_seconds}))
    return header["claim_id"]


def test_renew_on_a_plain_action_keeps_the_rows_and_refuses_ended_claims(server):
    _, client = server
    renewed, twin = _claim(client, 0.5), _claim(client, 0.5)
    answer = action_json(client, "renew", {"claim_id": renewed, "lease_seconds": 30})
    assert answer["claim_id"] == renewed and answer["expires_at"] > time.time() + 25
    time.sleep(1.5)
    assert [lease["claim_id"] for lease in action_json(client, "leases", {})] == [renewed]
    assert action_json(client, "ack", {"claim_id": renewed})["acked"] == 1
    for claim_id, code, words in ((renewed, "lease_expired", "already acked"),
                                  (twin, "lease_expired", "its lease expired"),
                                  ("feedbeef", "not_found", "'feedbeef' is unknown")):
        with pytest.raises(flight.FlightError) as refused:
            action(client, "renew", {"claim_id": claim_id})
        assert error_code(refused.value) == code and words in str(refused.value)


def test_renew_action_names_a_bad_field(server):
    _, client = server
    claim_id = _claim(client, 60)
    for body, words in (({"claim_id": claim_id, "lease_seconds": 0}, "lease_seconds 0 is invalid"),
                        ({"claim_id": claim_id, "lease_seconds": "5"},
                         "lease_seconds '5' is invalid"),
                        ({"claim_id": 7}, "claim id 7 is not a non-empty string"),
                        ({}, "needs field(s) ['claim_id']"),
                        ({"claim_id": claim_id, "seconds": 5}, "does not take field(s)")):
        with pytest.raises(flight.FlightError) as refused:
            action(client, "renew", body)
        assert error_code(refused.value) == "invalid_argument", body
        assert words in str(refused.value)


def test_renew_is_a_session_action(server):
    srv, client = server
    assert "renew" in SESSION_ACTIONS
    claim_id = _claim(client, 60)
    channel = SessionChannel(client, [])
    try:
        parts = channel.call("renew", {"claim_id": claim_id, "lease_seconds": 600}).result(30)
        answer = json.loads(parts[0])
        assert answer["claim_id"] == claim_id and answer["expires_at"] > time.time() + 500
    finally:
        channel.close()


@pytest.mark.parametrize("sessions", [True, False])
def test_remote_store_renews_on_either_path(server, sessions):
    srv, _ = server
    with store.connect(srv.location, sessions=sessions) as s:
        claim = s.claim("t", 1, lease_seconds=30)
        before = time.time()
        answer = s.renew(claim.claim_id)   # the table's lease_seconds (60)
        assert before + 50 < answer["expires_at"] < time.time() + 61
        with pytest.raises(InvalidArgument, match="lease_seconds -1 is invalid"):
            s.renew(claim.claim_id, lease_seconds=-1)
        with pytest.raises(NotFound):
            s.renew("0" * 32)
        s.nack(claim.claim_id)
        with pytest.raises(LeaseExpired, match="it was nacked"):
            s.renew(claim.claim_id)
