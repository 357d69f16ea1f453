"""Leases are soft state written lazily: a settle must never be undone by a later flush."""
from __future__ import annotations

import store


def test_nacked_rows_are_ready_after_reopen(db_path):
    s = store.connect(db_path)
    s.create_table("agent", {"reward": "float64"})
    s.put("agent", {"sample_id": [f"q{i}_0_0" for i in range(4)], "reward": [1.0] * 4})
    claim = s.claim("agent", 4, lease_seconds=3600)
    s.nack(claim.claim_id)  # before the lazy lease flush had a chance to run
    s.close()
    s = store.connect(db_path)
    try:
        assert s.leases() == []
        assert s.stats("agent")["agent"]["ready"] == 4
        assert len(s.claim("agent", 4)) == 4
    finally:
        s.close()


def test_an_unsettled_lease_survives_a_restart_and_can_be_acked(db_path):
    s = store.connect(db_path)
    s.create_table("agent", {"reward": "float64"})
    s.put("agent", {"sample_id": ["q0_0_0", "q1_0_0"], "reward": [1.0, 2.0]})
    claim = s.claim("agent", 1, lease_seconds=3600)
    s.close()  # closing flushes the lease bookkeeping
    s = store.connect(db_path)
    try:
        assert [lease["claim_id"] for lease in s.leases()] == [claim.claim_id]
        assert s.ack(claim.claim_id)["acked"] == 1
        assert s.stats("agent")["agent"]["consumed"] == 1
        assert len(s.claim("agent", 4)) == 1
    finally:
        s.close()
