"""Claims answered as a Flight record-batch stream (``do_get`` with a ``{"claim": …}`` ticket),
through a real server over a real DuckDB file: the same rows as the session's answer, the same
lease, the same errors and role; and the client's choice of path."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_server import ExpstoreFlightServer
from flight_server.client import STREAM_CLAIM_BYTES, RemoteStore
from flight_server.errors import to_flight
from store.errors import InvalidArgument, NotFound

from flight_fixtures import (TOKENS, action_json, bearer, error_code, running_server,
                             write_tokens)

COLUMNS = {"tokens": "list<float32>", "text": "string", "grid": "tensor<float32>",
           "reward": "float64"}


def _rows(n: int, start: int = 0, width: int = 100) -> dict[str, Any]:
    return {"sample_id": [f"q{i}_0_0" for i in range(start, start + n)],
            "tokens": [list(np.arange(width, dtype=np.float32) + i)
                       for i in range(start, start + n)],
            "text": [f"row {i} " * (i % 7) for i in range(start, start + n)],
            "grid": [np.arange(6, dtype=np.float32).reshape(2, 3) + i
                     for i in range(start, start + n)],
            "reward": [i / 3 for i in range(start, start + n)]}


@pytest.fixture
def server(tmp_path):
    with running_server(tmp_path / "x.duckdb") as srv:
        with RemoteStore(srv.location) as s:
            s.create_table("exp", COLUMNS, storage={"tokens": "ref", "text": "auto"},
                           lease_seconds=600)
        yield srv


def _ticket(body: Any, **extra: Any) -> flight.Ticket:
    return flight.Ticket(json.dumps({"claim": body, **extra}).encode())


def test_a_stream_claim_holds_the_same_values_as_a_session_claim(server):
    with RemoteStore(server.location, claim_streams="always") as streamed, \
            RemoteStore(server.location, claim_streams="never") as sessioned:
        streamed.put("exp", _rows(40))
        first = streamed.claim("exp", 12, consumer="c-1", lease_seconds=30)
        assert streamed._claim_streams is True          # it did come as a stream
        assert first.claim_id and first.consumer == "c-1" and first.table == "exp"
        assert 25 < first.expires_at - time.time() <= 30
        assert first.data.schema.equals(streamed.claim_schema("exp"), check_metadata=True)
        streamed.nack(first.claim_id)
        again = sessioned.claim("exp", 12, consumer="c-1", lease_seconds=30)
        assert again.data.schema.equals(first.data.schema, check_metadata=True)
        assert again.data.column("sample_id").to_pylist() == \
            first.data.column("sample_id").to_pylist()
        assert again.data.drop_columns(["delivery_count"]).equals(
            first.data.drop_columns(["delivery_count"]))
        assert [d + 1 for d in first.data.column("delivery_count").to_pylist()] == \
            again.data.column("delivery_count").to_pylist()
        for sample_id, tokens in zip(first.data.column("sample_id").to_pylist(),
                                     first.data.column("tokens").to_pylist()):
            i = int(sample_id[1:].split("_")[0])
            assert tokens == list(np.arange(100, dtype=np.float32) + i)


def test_a_stream_claim_leases_its_rows_until_acked(server):
    with RemoteStore(server.location, claim_streams="always") as a, \
            RemoteStore(server.location, claim_streams="never") as b:
        a.put("exp", _rows(16))
        held = a.claim("exp", 10)
        other = b.claim("exp", 16)
        assert other.data.num_rows == 6
        assert not set(held.data.column("sample_id").to_pylist()) & \
            set(other.data.column("sample_id").to_pylist())
        leases = {lease["claim_id"]: lease for lease in a.leases("exp")}
        assert leases[held.claim_id]["rows"] == {"exp": 10}
        assert a.ack(held.claim_id)["acked"] == 10
        assert a.ack(held.claim_id).get("duplicate") is True
        assert a.stats("exp")["exp"]["consumed"] == 10


def test_concurrent_stream_claimers_never_get_a_row_twice(server):
    total = 240
    with RemoteStore(server.location) as s:
        s.put("exp", _rows(total, width=8))
    got: list[list[str]] = []
    acked: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def consume() -> None:
        try:
            with RemoteStore(server.location, claim_streams="always") as s:
                while True:
                    c = s.claim("exp", 7)
                    if not c.claim_id:
                        return
                    ids = c.data.column("sample_id").to_pylist()
                    n = s.ack(c.claim_id)["acked"]
                    with lock:
                        got.append(ids)
                        acked.append(n)
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    every = [i for ids in got for i in ids]
    assert len(every) == len(set(every)) == total == sum(acked)


def test_an_empty_stream_claim_is_the_claim_schema_with_no_rows(server):
    with flight.FlightClient(server.location) as client:
        data = client.do_get(_ticket({"table": "exp", "limit": 4})).read_all()
    with RemoteStore(server.location, claim_streams="always") as s:
        schema = s.claim_schema("exp")
        assert data.num_rows == 0
        assert data.schema.remove_metadata().equals(schema.remove_metadata())
        meta = data.schema.metadata
        assert meta[b"expstore.table"] == b"exp" and meta[b"expstore.claim_id"] == b""
        assert json.loads(meta[b"expstore.expires_at"]) == 0.0
        empty = s.claim("exp", 4)
        assert empty.claim_id == "" and not empty
        assert empty.data.schema.equals(schema, check_metadata=True)
        assert s.leases("exp") == []


@pytest.mark.parametrize("ticket, code, named", [
    (_ticket({"table": "nosuch", "limit": 4}), "not_found", "nosuch"),
    (_ticket({"table": "exp", "limt": 4}), "invalid_argument", "limt"),
    (_ticket({"table": "exp", "limit": 0}), "invalid_argument", "limit"),
    (_ticket({"table": "exp", "limit": 4, "lease_seconds": True}), "invalid_argument",
     "lease_seconds"),
    (_ticket(["exp", 4]), "invalid_argument", "JSON object"),
    (_ticket({"table": "exp", "limit": 4}, sql="SELECT 1"), "invalid_argument", "sql"),
    (_ticket({"table": "exp", "limit": 4, "where": "reward > 0; DROP TABLE exp"}),
     "query_refused", ""),
])
def test_stream_claim_errors_are_the_actions(server, ticket, code, named):
    with flight.FlightClient(server.location) as client:
        with pytest.raises(flight.FlightError) as raised:
            client.do_get(ticket).read_all()
        assert error_code(raised.value) == code
        assert named in str(raised.value)
        # nothing was leased by the failed call
        assert action_json(client, "leases", {}) == []


def test_the_client_raises_the_store_error(server):
    with RemoteStore(server.location, claim_streams="always") as s:
        with pytest.raises(NotFound, match="nosuch"):
            s.claim("nosuch", 4)
        with pytest.raises(InvalidArgument, match="claim_streams"):
            RemoteStore(server.location, claim_streams="sometimes")


def test_stream_claims_need_the_writer_role(tmp_path):
    with running_server(tmp_path / "x.duckdb",
                        tokens_file=write_tokens(tmp_path / "tokens.json")) as srv:
        with RemoteStore(srv.location, token=TOKENS["admin"]) as admin:
            admin.create_table("exp", {"reward": "float64"})
            admin.put("exp", {"sample_id": ["q1_0_0"], "reward": [1.0]})
        with flight.FlightClient(srv.location) as client:
            ticket = _ticket({"table": "exp", "limit": 1})
            with pytest.raises(flight.FlightUnauthorizedError) as raised:
                client.do_get(ticket, bearer(TOKENS["reader"])).read_all()
            assert error_code(raised.value) == "permission_denied"
            assert "'writer'" in str(raised.value) and "'reader'" in str(raised.value)
            data = client.do_get(ticket, bearer(TOKENS["writer"])).read_all()
            assert data.num_rows == 1 and data.schema.metadata[b"expstore.claim_id"]


def test_auto_streams_a_tables_first_claim_then_only_claims_whose_answer_is_large(server):
    with RemoteStore(server.location) as s:
        s.create_table("small", {"reward": "float64", "tag": "string"})
        s.put("small", {"sample_id": [f"q{i}_0_0" for i in range(64)],
                        "reward": [1.0] * 64, "tag": ["a"] * 64})
        wide_width = STREAM_CLAIM_BYTES // 4 // 4   # float32 values: 4 rows make the bound
        s.put("exp", _rows(12, width=wide_width))
        # nothing known of their rows yet: a first claim comes as a stream, whatever its size
        assert s._streams_claims("exp", 16) and s._streams_claims("small", 1)
        first = s.claim("small", 16)
        assert first.data.num_rows == 16 and s._claim_streams is True   # it came as a stream
        assert not s._streams_claims("small", 16)
        assert s._streams_claims("small", 10**6)
        assert s.claim("small", 16).data.num_rows == 16                  # on the session
        s.claim("exp", 1)
        assert s._streams_claims("exp", 4) and not s._streams_claims("exp", 2)
        streamed = s.claim("exp", 4)
        assert streamed.data.num_rows == 4


class _ServerWithoutClaimTickets(ExpstoreFlightServer):
    """A server from before claim tickets: do_get takes SQL tickets only."""

    def do_get(self, context: flight.ServerCallContext,
               ticket: flight.Ticket) -> flight.FlightDataStream:
        if "claim" in json.loads(ticket.ticket):
            raise to_flight(InvalidArgument(
                'ticket must be a JSON object {"sql": "SELECT …", "params"?: [...], '
                '"timeout"?: seconds}'))
        return super().do_get(context, ticket)


def test_the_client_claims_on_the_session_from_a_server_without_claim_tickets(tmp_path):
    srv = _ServerWithoutClaimTickets(str(tmp_path / "x.duckdb"), host="127.0.0.1", port=0)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    try:
        with RemoteStore(srv.location, claim_streams="always") as s:
            s.create_table("exp", {"reward": "float64"})
            s.put("exp", {"sample_id": [f"q{i}_0_0" for i in range(8)], "reward": [1.0] * 8})
            first = s.claim("exp", 4)
            assert first.data.num_rows == 4 and s._claim_streams is False
            assert s.claim("exp", 4).data.num_rows == 4
            assert s.ack(first.claim_id)["acked"] == 4
    finally:
        srv.close()
        thread.join(30)
