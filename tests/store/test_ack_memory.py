"""What an ack leaves in memory, table by table: every row consumed (gone from the live index,
remembered as terminal for later puts of its key), the lease's unwritten bookkeeping dropped,
the counters and the recently acked claims updated; embedded, over a real DuckDB file."""
from __future__ import annotations

import store.live
from store.claims import ClaimRequest

COLUMNS = {"prompt": "string", "reward": "float64"}


def _put(s, table, sids):
    s.put(table, [{"sample_id": sid, "prompt": f"p {sid}", "reward": 1.0} for sid in sids])


def test_an_ack_of_two_tables_consumes_every_row_in_memory(open_store):
    s = open_store(lease_flush_delay=60.0)       # the claim's bookkeeping waits, unwritten
    s.create_table("a", COLUMNS)
    s.create_table("b", COLUMNS)
    _put(s, "a", [f"q{i}_0_0" for i in range(6)])
    _put(s, "b", [f"r{i}_0_0" for i in range(3)])
    claim = s.claim_many([ClaimRequest("a", 4), ClaimRequest("b", 2)], consumer="me")
    index = s._index
    leased = {t: [r for r in index.live[t].rows.values()
                  if type(r) is store.live.Row and r.state == store.live.LEASED]
              for t in ("a", "b")}
    assert [len(leased[t]) for t in ("a", "b")] == [4, 2]
    assert all(u for u in (index._row_updates.get("a"), index._row_updates.get("b")))
    before = dict(index.counters)
    assert s.ack(claim.claim_id)["acked"] == 6

    assert index.counters["acks"] == before["acks"] + 1
    assert index.counters["rows_acked"] == before["rows_acked"] + 6
    assert index.recently_acked(claim.claim_id) == 6
    assert s.ack(claim.claim_id).get("duplicate") is True
    assert claim.claim_id not in index.claims
    for t, n_left in (("a", 2), ("b", 1)):
        live = index.live[t]
        assert live.leased_count == 0 and live.ready_count == n_left
        assert len(live.rows) == n_left
        for row in leased[t]:
            assert row.key not in live.rows
            assert row.state == store.live.PENDING and row.lease is None and row.payload is None
            assert live.terminal[row.version][row.sample_id] == row.row_id
        assert not any(row.row_id in index._row_updates.get(t, {}) for row in leased[t])
    st = s.stats()
    assert st["a"]["consumed"] == 4 and st["b"]["consumed"] == 2
    assert st["a"]["processing"] == 0 and st["b"]["ready"] == 1
    _put(s, "a", ["q0_0_0"])                      # a consumed key, found in the terminal index
    assert s.stats("a")["a"]["consumed"] == 4 and s.stats("a")["a"]["ready"] == 2
