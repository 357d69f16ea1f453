"""A claim that carries the ack of the claim before it (``claim(…, ack=claim_id)``): a trainer's
micro-batch loop in one request per micro-batch. The ack is as durable as a waited ack when the
claim returns; an ack that is refused leases nothing; a failed ack commit gives the new claim's
rows back. Embedded, remote on the session, and remote as a claim stream, through real servers
over real DuckDB files."""
from __future__ import annotations

import time

import pytest

import store
from flight_server.client import RemoteStore
from store.errors import ExpstoreError, LeaseExpired, NotFound

from reliability_helpers import ServerProcess, inject_writer_bug


def _fill(s, table: str, n: int) -> None:
    s.create_table(table, {"reward": "float64", "text": "string"}, storage={"text": "ref"},
                   if_not_exists=True)
    s.put(table, {"sample_id": [f"q{i // 4}_0_{i % 4}" for i in range(n)],
                  "reward": [float(i) for i in range(n)],
                  "text": [f"row {i} " * 40 for i in range(n)]})


def test_each_claim_acks_the_one_before(any_store):
    s = any_store
    _fill(s, "t", 40)
    seen: list[str] = []
    claim = s.claim("t", 8, consumer="trainer")
    seen += claim.data.column("sample_id").to_pylist()
    while True:
        nxt = s.claim("t", 8, consumer="trainer", ack=claim.claim_id)
        # the ack is applied when the claim returns: acking again is a duplicate
        assert s.ack(claim.claim_id).get("duplicate") is True
        if not nxt.claim_id:
            break
        assert nxt.data.column("text").to_pylist() == [
            f"row {int(r)} " * 40 for r in nxt.data.column("reward").to_pylist()]
        seen += nxt.data.column("sample_id").to_pylist()
        claim = nxt
    assert len(seen) == len(set(seen)) == 40
    stats = s.stats("t")["t"]
    assert (stats["consumed"], stats["processing"], stats["ready"]) == (40, 0, 0)


@pytest.mark.parametrize("streams", ["never", "always"])
def test_remote_claims_carry_acks_on_either_path(tmp_path, streams):
    srv = ServerProcess(tmp_path / "x.duckdb").start()
    try:
        with RemoteStore(srv.uri, claim_streams=streams) as s:
            _fill(s, "t", 24)
            first = s.claim("t", 8)
            second = s.claim("t", 8, ack=first.claim_id)
            assert second.data.num_rows == 8
            srv.kill()               # kill -9: what was answered must be durable
        srv.start()
        with RemoteStore(srv.uri) as s:
            stats = s.stats("t")["t"]
            assert stats["consumed"] == 8     # the first claim's ack survived
            assert stats["processing"] == 0   # leases do not survive a restart
            assert stats["ready"] == 16
    finally:
        srv.stop()


def test_a_refused_ack_leases_nothing(any_store):
    s = any_store
    _fill(s, "t", 16)
    with pytest.raises(NotFound, match="nope"):
        s.claim("t", 8, ack="nope")
    short = s.claim("t", 4, lease_seconds=0.01)
    first = s.claim("t", 4)
    s.ack(first.claim_id)
    time.sleep(0.05)
    with pytest.raises(LeaseExpired):
        s.claim("t", 4, ack=short.claim_id)
    stats = s.stats("t")["t"]
    assert stats["processing"] == 0 and stats["consumed"] == 4



@pytest.mark.parametrize("bad", [
    {"limit": 0}, {"table": "nope"}, {"group_size": 3}, {"lease_seconds": -1.0},
    {"consumer": 7}])
def test_a_refused_claim_acks_nothing(any_store, bad):
    """A claim the store refuses (a bad limit, an unknown table, a group size without its
    column, bad lease seconds or consumer) leaves the ack it carried undone: the caller sees
    the error, and the micro-batch it meant to settle is still theirs to ack."""
    s = any_store
    _fill(s, "t", 16)
    held = s.claim("t", 4, consumer="trainer")
    args = {"table": "t", "limit": 4, "consumer": "trainer", **bad}
    with pytest.raises(ExpstoreError):
        s.claim(args.pop("table"), args.pop("limit"), ack=held.claim_id, **args)
    stats = s.stats("t")["t"]
    assert (stats["processing"], stats["consumed"]) == (4, 0)
    assert s.ack(held.claim_id).get("duplicate") is not True
    assert s.stats("t")["t"]["consumed"] == 4

def test_a_failed_ack_commit_gives_the_new_claims_rows_back(tmp_path, monkeypatch):
    s = store.connect(str(tmp_path / "x.duckdb"))
    _fill(s, "t", 16)
    first = s.claim("t", 8)
    live = s._index.live["t"]                # noqa: SLF001 - the rows' in-memory state
    inject_writer_bug(monkeypatch, s)
    with pytest.raises(ExpstoreError):
        s.claim("t", 8, ack=first.claim_id)
    assert live.ready_count == 8              # the new claim's rows are ready again
    assert all(row.deliveries == 0 for row in live.ready_rows(8))
    s.close()
