"""Reopening an embedded store: data, states and versions come back; leases are void."""
from __future__ import annotations

import time

import pytest

from store.errors import LeaseExpired, StoreClosed

COLUMNS = {"prompt": "string", "reward": "float64"}


def _states(s, table="t"):
    st = s.stats(table)[table]
    return {k: st[k] for k in ("pending", "ready", "processing", "consumed", "stale", "dead")}


def test_everything_survives_reopen(open_store):
    s = open_store()
    s.create_table("t", COLUMNS, max_staleness=1, max_deliveries=1, version_group="g")
    s.put("t", {"sample_id": ["old_0_0"], "prompt": ["p"], "reward": [1.0]})
    s.bump_version("t", weights_uri="w1")
    s.bump_version("t", weights_uri="w2")                          # old_0_0 is stale
    s.put("t", {"sample_id": [f"q{i}_0_0" for i in range(5)], "prompt": ["p"] * 5,
                "reward": [1.0] * 5})
    s.put("t", {"sample_id": ["pend_0_0"], "prompt": ["p"]})
    s.ack(s.claim("t", 1).claim_id)                                # q0 consumed
    s.nack(s.claim("t", 1).claim_id)                               # q1 dead
    held = s.claim("t", 1, consumer="trainer-0")                   # q2 leased
    before = _states(s)
    desc = s.describe("t")
    s.close()

    s = open_store()
    assert s.list_tables() == ["t"]
    assert s.describe("t") == desc
    assert s.get_version("t") == 2 and s.describe("t")["weights_uri"] == "w2"
    # Leases are soft state: the held one is void, its row ready again (store/recovery.py).
    assert before["processing"] == 1
    assert _states(s) == {**before, "processing": 0, "ready": before["ready"] + 1}
    with pytest.raises(LeaseExpired, match="restart voids every lease"):
        s.ack(held.claim_id)
    claim = s.claim("t", 10)
    assert claim.data.column("sample_id").to_pylist() == ["q2_0_0", "q3_0_0", "q4_0_0"]
    s.ack(claim.claim_id)
    # The pending row completes after the restart.
    s.put("t", {"sample_id": ["pend_0_0"], "reward": [0.0]})
    assert s.claim("t", 10).data.column("sample_id").to_pylist() == ["pend_0_0"]


def test_expired_leases_are_ready_after_reopen(open_store, wait_until):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["a_0_0", "b_0_0"], "prompt": ["p", "q"], "reward": [1.0, 2.0]})
    claim = s.claim("t", 2, lease_seconds=0.3)
    s.close()
    while time.time() < claim.expires_at + 0.05:
        time.sleep(0.05)
    s = open_store()
    assert _states(s)["ready"] == 2
    with pytest.raises(LeaseExpired):
        s.ack(claim.claim_id)
    again = s.claim("t", 2)
    assert again.data.column("delivery_count").to_pylist() == [2, 2]


def test_ack_is_idempotent_across_reopen(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.put("t", {"sample_id": ["a_0_0"], "prompt": ["p"], "reward": [1.0]})
    claim = s.claim("t", 1)
    s.ack(claim.claim_id)
    s.close()
    s = open_store()
    assert s.ack(claim.claim_id)["acked"] == 1
    assert _states(s)["consumed"] == 1 and not s.claim("t", 1)


def test_closed_store_refuses_work(open_store):
    s = open_store()
    s.create_table("t", COLUMNS)
    s.close()
    s.close()                                                     # idempotent
    with pytest.raises(StoreClosed):
        s.put("t", {"sample_id": ["a_0_0"], "reward": [1.0]})
    with pytest.raises(StoreClosed):
        s.bump_version("t")
