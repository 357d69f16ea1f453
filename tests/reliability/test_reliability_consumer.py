"""Consumer failure: a trainer killed with SIGKILL in the middle of a micro-batch.

Its rows come back to another consumer once its lease expires; its late ack is refused with
:class:`store.errors.LeaseExpired` and nothing is counted twice. A ``do_exchange`` subscriber
killed mid-batch has its leases released as soon as the server sees the stream end, long before
the lease would expire.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import store
from store.errors import LeaseExpired

import reliability_helpers as rh

# A consumer process: claim (or subscribe), report what it holds on stdout, then hang as a
# trainer stuck in its gradient step would, until it is killed.
_CLAIMER = r"""
import json, sys, time, store
s = store.connect(sys.argv[1])
c = s.claim("t", int(sys.argv[2]), consumer="victim", lease_seconds=float(sys.argv[3]))
print(json.dumps({"claim_id": c.claim_id, "ids": c.data.column("sample_id").to_pylist()}),
      flush=True)
time.sleep(600)
"""
_SUBSCRIBER = r"""
import json, sys, time, store
s = store.connect(sys.argv[1])
sub = s.subscribe("t", micro_batch_size=4, global_batch_size=8, consumer="victim",
                  lease_seconds=600.0, max_in_flight=2)
held = []
for _ in range(2):
    mb = sub.next(timeout=30)
    held += mb.data.column("sample_id").to_pylist()
print(json.dumps({"ids": held}), flush=True)
time.sleep(600)
"""


@pytest.fixture
def server(tmp_path):
    srv = rh.ServerProcess(tmp_path / "x.duckdb").start()
    yield srv
    srv.stop()


def _spawn(code: str, *args: str) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=str(rh.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=str(rh.ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _readline(proc, timeout=60)
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise
    return proc, json.loads(line)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"the consumer process said nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"the consumer process died: {proc.stderr.read()[-2000:]}")
    return line


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


def _fill(s, n: int) -> list[str]:
    s.create_table("t", {"reward": "float64"}, lease_seconds=60.0, max_deliveries=5)
    ids = rh.sample_ids("q", 0, n)
    s.put("t", {"sample_id": ids, "reward": [rh.reward_of(i) for i in ids]})
    return ids


def test_killed_consumer_rows_are_redelivered_and_its_late_ack_is_refused(server):
    with store.connect(server.uri) as s:
        ids = _fill(s, 40)
        proc, held = _spawn(_CLAIMER, server.uri, "8", "2.0")
        victim_ids = held["ids"]
        assert len(victim_ids) == 8
        _kill(proc)
        # While the lease runs, nobody else gets the victim's rows.
        others = s.claim("t", 100, consumer="survivor")
        assert others.num_rows == 32
        assert not set(others.data.column("sample_id").to_pylist()) & set(victim_ids)
        s.ack(others.claim_id)
        # After the lease: the same rows, delivered a second time, to the survivor.
        again = rh.wait_until(lambda: s.claim("t", 100, consumer="survivor"), 15,
                              "the victim's rows came back after its lease")
        assert sorted(again.data.column("sample_id").to_pylist()) == sorted(victim_ids)
        assert set(again.data.column("delivery_count").to_pylist()) == {2}
        # The victim's ack arrives late (a process that was only stalled, say): refused, with a
        # message naming the claim and what happened.
        with pytest.raises(LeaseExpired) as info:
            s.ack(held["claim_id"])
        assert held["claim_id"] in str(info.value) and "expired" in str(info.value)
        assert s.ack(again.claim_id)["acked"] == 8
        st = s.stats("t")["t"]
        assert (st["consumed"], st["ready"], st["processing"], st["rows"]) == (40, 0, 0, 40)
        consumed = s.query('SELECT count(*) AS n, count(DISTINCT sample_id) AS d FROM "t" '
                           'WHERE consumed').to_pylist()[0]
        assert consumed == {"n": 40, "d": 40}
        assert sorted(ids) == sorted(s.query('SELECT sample_id FROM "t"').column(0).to_pylist())


def test_late_ack_after_expiry_is_refused_even_before_anyone_reclaims(server):
    with store.connect(server.uri) as s:
        _fill(s, 6)
        claim = s.claim("t", 6, lease_seconds=0.5)
        rh.wait_until(lambda: time.time() > claim.expires_at + 0.05, 5, "the lease ran out")
        with pytest.raises(LeaseExpired, match="expired"):
            s.ack(claim.claim_id)
        with pytest.raises(LeaseExpired):
            s.ack(claim.claim_id)          # asking again gives the same answer
        st = s.stats("t")["t"]
        assert (st["consumed"], st["ready"], st["processing"]) == (0, 6, 0)
        again = s.claim("t", 6)
        s.ack(again.claim_id)
        s.ack(again.claim_id)              # a duplicate ack is harmless and not counted twice
        assert s.stats("t")["t"]["consumed"] == 6


def test_killed_exchange_subscriber_releases_its_leases_on_disconnect(server):
    with store.connect(server.uri) as s:
        _fill(s, 16)
        proc, held = _spawn(_SUBSCRIBER, server.uri)
        assert len(held["ids"]) == 8
        assert s.stats("t")["t"]["processing"] == 8
        t0 = time.monotonic()
        _kill(proc)
        # The lease is 600 s: only the server noticing the dead stream can free the rows.
        rh.wait_until(lambda: s.stats("t")["t"]["processing"] == 0, 20,
                      "the dead subscriber's leases were released")
        released_in = time.monotonic() - t0
        assert s.leases("t") == []
        got = s.claim("t", 16, consumer="survivor")
        assert got.num_rows == 16
        assert set(held["ids"]) <= set(got.data.column("sample_id").to_pylist())
        s.ack(got.claim_id)
        assert s.stats("t")["t"]["consumed"] == 16
        print(f"leases of a killed subscriber released {released_in:.2f} s after SIGKILL")


def test_a_subscription_that_fails_server_side_reports_it_and_the_server_survives(server):
    """A claim error inside a live subscription (here: its table was dropped) reaches the client
    as the store's error, and ending that stream does not take the server down."""
    from store.errors import NotFound
    with store.connect(server.uri) as s:
        _fill(s, 2)
        sub = s.subscribe("t", micro_batch_size=4, global_batch_size=8, idle_timeout=30)
        s.drop_table("t")
        s.create_table("u", {"reward": "float64"})
        s.put("u", {"sample_id": rh.sample_ids("z", 0, 8), "reward": [1.0] * 8})
        with pytest.raises(NotFound):
            sub.next(timeout=30)
        sub.close()
        assert rh.health(server.uri) is not None
        assert s.claim("u", 8).num_rows == 8
