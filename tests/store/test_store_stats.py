"""Stats: rows by state add up, per table and per version."""
from __future__ import annotations

import threading
import time

import pytest

STATES = ("pending", "ready", "processing", "consumed", "stale", "dead")


def _check_sum(st):
    assert sum(st[k] for k in STATES) == st["rows"], st
    assert sum(st["rows_per_version"].values()) == st["rows"], st
    assert all(st[k] >= 0 for k in STATES), st


def _states(s, table="t"):
    st = s.stats(table)[table]
    _check_sum(st)
    return {k: st[k] for k in STATES}


def test_every_state_counted(any_store, wait_until):
    s = any_store
    s.create_table("t", {"prompt": "string", "reward": "float64"}, max_staleness=1,
                   max_deliveries=1, required=["reward"])
    assert _states(s) == dict.fromkeys(STATES, 0)
    s.put("t", {"sample_id": [f"old_0_{i}" for i in range(2)], "reward": [1.0, 1.0]})
    s.bump_version("t")
    s.bump_version("t")                                  # version 0 is now stale
    s.put("t", {"sample_id": [f"q{i}_0_0" for i in range(6)], "reward": [1.0] * 6})
    s.put("t", {"sample_id": ["p_0_0", "p_0_1"], "prompt": ["a", "b"]})   # pending
    consumed = s.claim("t", 2)
    s.ack(consumed.claim_id)                              # q0, q1 consumed
    dead = s.claim("t", 1)
    s.nack(dead.claim_id)                                 # q2 dead (max_deliveries=1)
    s.claim("t", 1)                                       # q3 processing
    expected = {"pending": 2, "ready": 2, "processing": 1, "consumed": 2, "stale": 2,
                "dead": 1}
    assert _states(s) == expected
    st = s.stats("t")["t"]
    assert st["version"] == 2 and st["version_group"] == "t"
    assert st["rows"] == 10 and st["rows_per_version"] == {0: 2, 2: 8}


def test_stats_of_all_tables(any_store):
    s = any_store
    s.create_table("a", {"reward": "float64"})
    s.create_table("b", {"reward": "float64"}, version_group="g")
    s.put("a", {"sample_id": ["x_0_0"], "reward": [1.0]})
    all_stats = s.stats()
    assert set(all_stats) == {"a", "b"}
    assert all_stats["a"]["ready"] == 1 and all_stats["b"]["rows"] == 0
    assert all_stats["b"]["version_group"] == "g"
    for st in all_stats.values():
        _check_sum(st)


@pytest.mark.parametrize("settle", ["ack", "nack", "expire"])
def test_states_add_up_through_a_lease(any_store, wait_until, settle):
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_deliveries=2)
    s.put("t", {"sample_id": [f"q{i}_0_0" for i in range(5)], "reward": [1.0] * 5})
    claim = s.claim("t", 3, lease_seconds=0.2 if settle == "expire" else 60)
    # (the 0.2 s lease may have ended before a slow machine answers the stats: then its rows
    # are rightly ready again)
    assert _states(s)["processing"] == 3 or time.time() >= claim.expires_at
    if settle == "ack":
        s.ack(claim.claim_id)
        assert _states(s)["consumed"] == 3
    elif settle == "nack":
        s.nack(claim.claim_id)
        assert _states(s)["ready"] == 5
    else:
        wait_until(lambda: _states(s)["ready"] == 5, message="the lease expiring")
    # Dead-letter everything: deliver twice more without acking.
    for _ in range(2):
        c = s.claim("t", 5)
        if c:
            s.nack(c.claim_id)
        _states(s)
    st = _states(s)
    assert st["dead"] + st["consumed"] == 5 and st["ready"] == 0


def test_states_add_up_under_concurrent_load(any_store):
    """Stats taken while producers, trainers and lease expiries run still add up."""
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_deliveries=3)
    stop = threading.Event()
    errors: list[BaseException] = []

    def producer() -> None:
        i = 0
        try:
            while not stop.is_set():
                s.put("t", {"sample_id": [f"q{i + k}_0_0" for k in range(5)],
                            "reward": [1.0] * 5})
                i += 5
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def trainer(k: int) -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                claim = s.claim("t", 4, lease_seconds=0.05 if n % 3 == 0 else 30)
                if not claim:
                    continue
                if n % 3 == 1:
                    s.ack(claim.claim_id)
                elif n % 3 == 2:
                    s.nack(claim.claim_id)
                # every third claim is left to expire
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=producer)] + [
        threading.Thread(target=trainer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        # Stats beside the load for 3 s at least, and on until the trainers have consumed rows
        # and left some to be delivered again or dead-lettered (a slow machine gets there
        # later, not never).
        started = time.monotonic()
        checks = 0
        while True:
            st = s.stats("t")["t"]
            assert sum(st[k] for k in STATES) == st["rows"], st
            assert all(st[k] >= 0 for k in STATES), st
            checks += 1
            waited = time.monotonic() - started
            if waited >= 3 and checks > 10 and st["consumed"] > 0 \
                    and st["dead"] + st["ready"] > 0:
                break
            assert waited < 120, f"the load made no such progress in 120 s ({checks} checks): {st}"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    _check_sum(s.stats("t")["t"])
