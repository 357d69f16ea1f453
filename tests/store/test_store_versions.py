"""Versions: compare-and-set bumps, version groups, staleness bounds, waiting for a version."""
from __future__ import annotations

import threading
import time

import pytest

from store.errors import InvalidArgument, LeaseExpired, NotFound, StaleVersion, VersionConflict
from store.ops import ReadOp


def _stats(s, table="t"):
    return s.stats(table)[table]


def _put(s, ids, table="t", **extra):
    s.put(table, {"sample_id": list(ids), "reward": [1.0] * len(ids), **extra})


def test_bump_and_get(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    assert s.get_version("t") == 0
    assert s.bump_version("t") == 1
    assert s.bump_version("t", expected=1, weights_uri="s3://w/2") == 2
    assert s.get_version("t") == 2
    d = s.describe("t")
    assert d["version"] == 2 and d["weights_uri"] == "s3://w/2"
    assert s.put("t", {"sample_id": ["a_0_0"], "reward": [1.0]})["version"] == 2
    assert s.query("SELECT policy_version FROM t").column(0).to_pylist() == [2]
    with pytest.raises(NotFound, match="nope"):
        s.bump_version("nope")
    with pytest.raises(InvalidArgument, match="'1'"):
        s.bump_version("t", expected="1")


def test_cas_conflict(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    s.bump_version("t")
    with pytest.raises(VersionConflict, match="0"):
        s.bump_version("t", expected=0)
    assert s.get_version("t") == 1


def test_cas_race_has_one_winner(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    n = 8
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def trainer(i: int) -> None:
        barrier.wait()
        try:
            results[i] = s.bump_version("t", expected=0)
        except VersionConflict as e:
            results[i] = e

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [r for r in results if r == 1]
    losers = [r for r in results if isinstance(r, VersionConflict)]
    assert len(winners) == 1 and len(losers) == n - 1
    assert s.get_version("t") == 1


def test_version_group_bumps_together(any_store):
    s = any_store
    s.create_table("solver", {"reward": "float64"}, version_group="team")
    s.create_table("verifier", {"reward": "float64"}, version_group="team")
    s.create_table("alone", {"reward": "float64"})
    assert s.describe("solver")["version_group"] == "team"
    assert s.bump_version("verifier", weights_uri="w1") == 1
    assert s.get_version("solver") == s.get_version("verifier") == 1
    assert s.get_version("alone") == 0
    assert s.describe("solver")["weights_uri"] == "w1"
    with pytest.raises(VersionConflict):
        s.bump_version("solver", expected=0)
    # A table joining an existing group starts at the group's version.
    s.create_table("critic", {"reward": "float64"}, version_group="team")
    assert s.get_version("critic") == 1
    # Staleness follows the group's version in every member table.
    _put(s, ["a_0_0"], table="solver")
    _put(s, ["a_0_0"], table="verifier")
    s.bump_version("critic")
    assert _stats(s, "solver")["stale"] == 1 and _stats(s, "verifier")["stale"] == 1
    assert not s.claim("solver", 10) and not s.claim("verifier", 10)


def test_on_policy_rows_go_stale_at_bump(any_store):
    s = any_store
    s.create_table("t", {"prompt": "string", "reward": "float64"}, max_staleness=0,
                   required=["reward"])
    _put(s, ["ready_0_0", "ready_0_1"])
    s.put("t", {"sample_id": ["pending_0_0"], "prompt": ["p"]})
    assert _stats(s)["ready"] == 2 and _stats(s)["pending"] == 1
    s.bump_version("t")
    st = _stats(s)
    assert st["stale"] == 3 and st["ready"] == 0 and st["pending"] == 0
    assert not s.claim("t", 10)
    stale = s.query("SELECT sample_id FROM t WHERE stale ORDER BY 1").column(0).to_pylist()
    assert stale == ["pending_0_0", "ready_0_0", "ready_0_1"]
    # The old version's samples cannot be completed or re-sent any more.
    with pytest.raises(StaleVersion):
        s.put("t", {"sample_id": ["pending_0_0"], "policy_version": [0], "reward": [1.0]})
    # New samples at the new version are delivered.
    _put(s, ["fresh_0_0"])
    assert s.claim("t", 10).data.column("sample_id").to_pylist() == ["fresh_0_0"]


@pytest.mark.parametrize("k", [1, 3])
def test_bounded_staleness(any_store, k):
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_staleness=k)
    _put(s, [f"v0_0_{i}" for i in range(3)])
    for version in range(1, k + 1):
        s.bump_version("t")
        _put(s, [f"v{version}_0_0"])
        assert _stats(s)["stale"] == 0
    # Rows k versions old are still deliverable; one more bump makes version 0 stale.
    s.bump_version("t")
    st = _stats(s)
    assert st["stale"] == 3
    claim = s.claim("t", 100)
    versions = claim.data.column("policy_version").to_pylist()
    assert versions and min(versions) >= s.get_version("t") - k
    assert 0 not in versions
    sql_stale = s.query("SELECT count(*) FROM t WHERE stale AND policy_version = 0")
    assert sql_stale.column(0).to_pylist() == [3]


def test_stale_rows_under_lease(any_store, wait_until):
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_staleness=0)
    _put(s, ["a_0_0", "b_0_0", "c_0_0"])
    acked = s.claim("t", 1)
    nacked = s.claim("t", 1)
    expired = s.claim("t", 1, lease_seconds=0.3)
    s.bump_version("t")
    # A trainer that already holds a sample may still finish its step with it.
    assert s.ack(acked.claim_id)["acked"] == 1
    # But rows coming back after the bump are stale, not ready.
    s.nack(nacked.claim_id)
    wait_until(lambda: _stats(s)["stale"] == 2, message="the expired lease's row going stale")
    st = _stats(s)
    assert st["consumed"] == 1 and st["ready"] == 0 and st["processing"] == 0
    assert not s.claim("t", 10)
    # An expired lease's stale flag reaches SQL with the next lease-bookkeeping flush.
    sql = "SELECT sample_id, stale, consumed FROM t ORDER BY 1"
    expected = [{"sample_id": "a_0_0", "stale": False, "consumed": True},
                {"sample_id": "b_0_0", "stale": True, "consumed": False},
                {"sample_id": "c_0_0", "stale": True, "consumed": False}]
    wait_until(lambda: s.query(sql).to_pylist() == expected, message=f"SQL showing {expected}")
    with pytest.raises(LeaseExpired, match=expired.claim_id):
        s.ack(expired.claim_id)


def test_wait_version(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    assert s.wait_version("t", 0, timeout=0.01) == 0
    t0 = time.monotonic()
    assert s.wait_version("t", 1, timeout=0.3) == 0          # times out with the current one
    assert 0.25 <= time.monotonic() - t0 < 5
    got: list[int] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        got.append(s.wait_version("t", 2, timeout=30))

    th = threading.Thread(target=waiter)
    th.start()
    assert started.wait(5)
    s.bump_version("t")
    th.join(0.2)
    assert th.is_alive(), "wait_version returned before the version was reached"
    s.bump_version("t")
    th.join(10)
    assert not th.is_alive() and got == [2]


def test_puts_racing_a_bump_never_leave_old_rows_ready(any_store):
    """A put committed together with a bump must be checked against, and marked stale by, it."""
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_staleness=0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def producer(k: int) -> None:
        i = 0
        try:
            while not stop.is_set():
                version = s.get_version("t")
                try:
                    s.put("t", {"sample_id": [f"p{k}x{i}_0_{j}" for j in range(4)],
                                "policy_version": [version] * 4, "reward": [1.0] * 4})
                except StaleVersion:
                    pass
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            new = s.bump_version("t")
            claim = s.claim("t", 1000)
            if claim:
                old = [v for v in claim.data.column("policy_version").to_pylist() if v < new]
                assert not old, f"rows of version(s) {set(old)} delivered at version {new}"
                s.ack(claim.claim_id)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors


def test_acks_queued_before_a_bump_share_its_commit(embedded_store, wait_until):
    """A trainer's last ack and its bump, queued together, are made durable in one commit and
    give what acking first, then bumping, gives: the acked rows consumed at the old version and
    not stale; the rest of the old version stale."""
    s = embedded_store
    s.create_table("t", {"reward": "float64"}, max_staleness=0)
    _put(s, [f"a_0_{i}" for i in range(4)])
    first, second = s.claim("t", 2), s.claim("t", 1)
    _put(s, [f"b{i}_0_0" for i in range(3)])  # ready at the old version: stale after the bump
    # Hold the writer inside a read (run between groups, it commits nothing) until the ack and the
    # bump both wait in its queue, so that it takes them together.
    reading, release = threading.Event(), threading.Event()

    def hold(_con):
        reading.set()
        assert release.wait(30), "the test never released the writer"

    held = s._writer.submit(ReadOp(run=hold))  # noqa: SLF001
    assert reading.wait(30), "the writer never ran the read"
    commits = s.health()["commits"]
    acked = s.ack_async(first.claim_id)
    bumped: list[int] = []
    bumper = threading.Thread(target=lambda: bumped.append(s.bump_version("t")))
    bumper.start()
    wait_until(lambda: s._writer.queue_depth == 2,  # noqa: SLF001
               message="the ack and the bump queued behind the read")
    release.set()
    held.result(30)
    bumper.join(30)
    assert bumped == [1]
    assert acked.result()["acked"] == 2
    assert s.health()["commits"] - commits == 1, "the ack and the bump did not share a commit"
    st = _stats(s)
    assert (st["consumed"], st["processing"], st["ready"], st["stale"]) == (2, 1, 0, 4)
    rows = s.query("SELECT sample_id, consumed, consumed_version, stale FROM t "
                   "WHERE sample_id LIKE 'a%' ORDER BY 1").to_pylist()
    claimed = {first.data.column("sample_id")[i].as_py(): True for i in range(2)}
    for row in rows:
        if row["sample_id"] in claimed:
            assert (row["consumed"], row["consumed_version"], row["stale"]) == (True, 0, False)
        else:
            assert (row["consumed"], row["stale"]) == (False,
                                                        row["sample_id"] not in second.data.column(
                                                            "sample_id").to_pylist())
    s.nack(second.claim_id)  # back after the bump: stale
    assert _stats(s)["stale"] == 5
