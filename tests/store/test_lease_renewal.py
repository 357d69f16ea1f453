"""Lease renewal (``Store.renew``): a consumer whose step outlasts its lease keeps its rows.

Run against every backend of ``any_store`` (embedded, and a RemoteStore on a session over a real
Flight server); tests/flight_server/test_renew_action.py covers plain ``do_action`` calls and a
cluster's coordinator.
"""
from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from waiting import wait_until

from store.errors import InvalidArgument, LeaseExpired, NotFound


def _table(s, rows=4, lease_seconds=60.0):
    s.create_table("t", {"reward": "float64"}, lease_seconds=lease_seconds)
    s.put("t", {"sample_id": [f"q{i}_0_0" for i in range(rows)], "reward": [1.0] * rows})


def _leased_ids(s):
    return {r["claim_id"] for r in s.leases("t")}


def test_renewed_claim_outlives_its_lease_and_its_twin_expires(any_store):
    s = any_store
    _table(s)
    renewed = s.claim("t", 2, lease_seconds=0.5)
    twin = s.claim("t", 2, lease_seconds=0.5)
    answer = s.renew(renewed.claim_id, lease_seconds=30)
    assert answer["claim_id"] == renewed.claim_id
    assert answer["expires_at"] >= renewed.expires_at + 25
    time.sleep(1.5)
    # the twin's rows are claimable again; the renewed claim's are not
    again = s.claim("t", 4)
    assert sorted(again.data.column("sample_id").to_pylist()) == \
        sorted(twin.data.column("sample_id").to_pylist())
    assert renewed.claim_id in _leased_ids(s)
    assert s.ack(renewed.claim_id)["acked"] == 2
    with pytest.raises(LeaseExpired, match="its lease expired"):
        s.ack(twin.claim_id)
    s.ack(again.claim_id)
    assert s.stats("t")["t"]["consumed"] == 4


def test_renew_without_seconds_takes_the_tables_lease(any_store):
    s = any_store
    _table(s, lease_seconds=120.0)
    claim = s.claim("t", 1, lease_seconds=1)
    before = time.time()
    expires_at = s.renew(claim.claim_id)["expires_at"]
    assert before + 110 < expires_at < time.time() + 121
    assert [r["expires_at"] for r in s.leases("t")] == [pytest.approx(expires_at)]


def test_renew_after_the_claim_ended_is_refused_saying_how(any_store):
    s = any_store
    _table(s)
    acked = s.claim("t", 1)
    s.ack(acked.claim_id)
    with pytest.raises(LeaseExpired, match="already acked; it cannot be renewed"):
        s.renew(acked.claim_id)
    nacked = s.claim("t", 1)
    s.nack(nacked.claim_id)
    with pytest.raises(LeaseExpired, match="ended before this renew: it was nacked"):
        s.renew(nacked.claim_id)
    expired = s.claim("t", 1, lease_seconds=0.05)
    wait_until(lambda: expired.claim_id not in _leased_ids(s), message="the lease to expire")
    with pytest.raises(LeaseExpired, match="ended before this renew: its lease expired"):
        s.renew(expired.claim_id)
    # none of them was leased again by the attempt
    assert s.leases("t") == []


def test_renew_of_an_unknown_claim_or_bad_seconds_names_the_value(any_store):
    s = any_store
    _table(s)
    with pytest.raises(NotFound, match="'0123abcd' is unknown"):
        s.renew("0123abcd")
    claim = s.claim("t", 1)
    for bad in (0, -1, 86401, "10", True):
        with pytest.raises(InvalidArgument, match=f"lease_seconds {bad!r} is invalid"):
            s.renew(claim.claim_id, lease_seconds=bad)
    with pytest.raises(InvalidArgument, match="claim id '' is not a non-empty string"):
        s.renew("")
    assert s.ack(claim.claim_id)["acked"] == 1


def test_sql_shows_the_renewed_expiry(any_store):
    s = any_store
    _table(s)
    claim = s.claim("t", 2, lease_seconds=300)

    def sql_shows(expires_at: float) -> bool:
        rows = s.query("SELECT lease_expires_at FROM t WHERE lease_id = ?",
                       [claim.claim_id]).column(0).to_pylist()
        return len(rows) == 2 and all(isinstance(r, dt.datetime)
                                      and abs(r.timestamp() - expires_at) < 0.001 for r in rows)

    # the claim's own bookkeeping written first: the renewal must be written again
    wait_until(lambda: sql_shows(claim.expires_at), timeout=30,
               message="SQL to show the claim's lease_expires_at")
    expires_at = s.renew(claim.claim_id, lease_seconds=600)["expires_at"]
    wait_until(lambda: sql_shows(expires_at), timeout=30,
               message="SQL to show the renewed lease_expires_at")


def test_a_lease_renewed_shorter_expires_at_its_new_time(any_store):
    s = any_store
    _table(s, rows=1)
    claim = s.claim("t", 1, lease_seconds=600)
    s.renew(claim.claim_id, lease_seconds=0.2)
    # the store expires it on its own (no ack or renew of it looks first)
    wait_until(lambda: s.claim("t", 1).num_rows == 1, timeout=30,
               message="the renewed lease to expire at its new time")


def test_micro_batch_renew(any_store):
    s = any_store
    _table(s)
    with s.subscribe("t", micro_batch_size=2, global_batch_size=4, idle_timeout=5,
                     lease_seconds=0.5) as sub:
        batch = sub.next(timeout=5)
        assert batch is not None
        # by default the subscription's own lease_seconds, as its claims take
        assert batch.renew()["expires_at"] < time.time() + 30
        assert batch.renew(lease_seconds=30)["claim_id"] == batch.claim_id
        time.sleep(1.5)
        assert batch.claim_id in _leased_ids(s)
        assert batch.ack()["acked"] == 2
        with pytest.raises(LeaseExpired, match="already acked"):
            batch.renew()


def test_a_claim_being_acked_is_not_renewed_and_its_ack_stands(embedded_store):
    from store.ops import CallOp
    s = embedded_store
    _table(s, rows=1)
    claim = s.claim("t", 1)
    gate = threading.Event()
    held = s._writer.submit(CallOp(run=lambda con: gate.wait(30)))  # noqa: SLF001 - writer busy
    try:
        acked = s.ack_async(claim.claim_id)   # queued behind the held op: settling
        with pytest.raises(LeaseExpired, match="is being acked or nacked"):
            s.renew(claim.claim_id)
    finally:
        gate.set()
    held.result(30)
    assert acked.result(30)["acked"] == 1
    assert s.stats("t")["t"]["consumed"] == 1 and s.leases("t") == []


@pytest.mark.parametrize("settle", ["ack", "nack"])
def test_a_renewal_settled_before_its_flush_leaves_no_row_leased(any_store, settle):
    """The renewal's bookkeeping waits for the writer; the settle that follows at once must
    supersede it, or a later flush would mark the consumed (or released) rows leased again."""
    s = any_store
    _table(s, rows=2)
    claim = s.claim("t", 2)

    def processing() -> list:
        return s.query("SELECT is_processing FROM t ORDER BY sample_id").column(0).to_pylist()

    wait_until(lambda: processing() == [True, True], timeout=30,
               message="the claim's bookkeeping to be written")
    s.renew(claim.claim_id, lease_seconds=600)
    getattr(s, settle)(claim.claim_id)
    wait_until(lambda: processing() == [False, False], timeout=30,
               message="the settle to be written")
    time.sleep(1.0)  # past several flush delays: nothing marks the rows leased again
    assert processing() == [False, False]
    assert s.leases("t") == []
    stats = s.stats("t")["t"]
    assert (stats["consumed"], stats["ready"]) == ((2, 0) if settle == "ack" else (0, 2))
