"""Claims: order, predicates, groups, ack/nack, leases, dead letters, multi-table, concurrency."""
from __future__ import annotations

import random
import threading
import time

import pytest

import store
import store.writer
from store import ClaimRequest
from store.errors import InvalidArgument, LeaseExpired, NotFound, QueryRefused
from thread_helpers import run_threads

ORDER_COLS = ["policy_version", "input_id", "turn", "trajectory_id"]


def _stats(s, table="t"):
    return s.stats(table)[table]


def _ids(claim, table=None):
    data = claim.tables[table] if table else claim.data
    return data.column("sample_id").to_pylist()


def _fill(s, table, sample_ids, **extra):
    s.put(table, {"sample_id": list(sample_ids), "reward": [1.0] * len(sample_ids), **extra})


def _wait_ready(s, wait_until, table, n):
    wait_until(lambda: _stats(s, table)["ready"] == n, timeout=10,
               message=f"{n} ready rows in {table}")


def test_claim_order_is_deterministic(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_staleness=5)
    v0 = [f"{inp}_{turn}_{traj}" for inp in ("b", "a", "a_x", "c") for turn in (1, 0)
          for traj in (2, 0, 1)]
    random.Random(7).shuffle(v0)
    _fill(s, "t", v0[:12])
    s.bump_version("t")
    _fill(s, "t", ["a_0_0", "0_0_0"])                        # version 1: after all of version 0
    _fill(s, "t", v0[12:], policy_version=[0] * len(v0[12:]))
    got = []
    while True:
        claim = s.claim("t", 5)
        if not claim:
            break
        rows = claim.data.select(ORDER_COLS).to_pylist()
        got.extend(tuple(r[c] for c in ORDER_COLS) for r in rows)
        s.ack(claim.claim_id)
    assert len(got) == len(v0) + 2
    assert got == sorted(got)
    assert got[-2:] == [(1, "0", 0, 0), (1, "a", 0, 0)]


def test_empty_claim(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    claim = s.claim("t", 4)
    assert not claim and claim.num_rows == 0 and claim.claim_id == ""
    # The empty answer still has the claim's schema: code that reads columns needs no branch.
    assert claim.table == "t" and claim.data.schema == s.claim_schema("t")
    assert claim.data.column("reward").to_pylist() == []
    s.create_table("u", {"response": "string"})
    s.put("u", {"sample_id": ["q0_0_0"], "response": ["4"]})
    both = s.claim_many([ClaimRequest("t", 2), ClaimRequest("u", 2)])
    assert not both and both.claim_id == ""
    assert {n: t.schema for n, t in both.tables.items()} == {"t": s.claim_schema("t"),
                                                               "u": s.claim_schema("u")}
    with pytest.raises(NotFound, match="nope"):
        s.claim("nope", 4)


@pytest.mark.parametrize("kwargs, bad", [({"limit": 0}, "0"), ({"limit": 2, "min_rows": 3}, "3"),
                                         ({"limit": 4, "group_by": "turn", "group_size": 2},
                                          "'turn'"),
                                         ({"limit": 4, "group_by": "input_id", "group_size": 8},
                                          "8"),
                                         ({"limit": 4, "lease_seconds": -1}, "-1")])
def test_bad_claim_arguments(any_store, kwargs, bad):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _fill(s, "t", ["a_0_0"])
    options = {k: v for k, v in kwargs.items() if k != "limit"}  # kwargs is shared by backends
    with pytest.raises(InvalidArgument, match=bad):
        s.claim("t", kwargs["limit"], **options)
    assert _stats(s)["ready"] == 1


def test_where_predicate(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64", "next_agent_id": "int32"})
    s.put("t", {"sample_id": [f"q{i}_0_0" for i in range(10)],
                "reward": [float(i) for i in range(10)],
                "next_agent_id": [i % 3 for i in range(10)]})
    claim = s.claim("t", 3, where="reward >= 5 AND next_agent_id <> 0")
    assert _ids(claim) == ["q5_0_0", "q7_0_0", "q8_0_0"]
    assert s.claim("t", 10, where="reward > 100").num_rows == 0
    # Rows a predicate skipped are still ready for others.
    assert _stats(s)["ready"] == 7
    with pytest.raises(QueryRefused):
        s.claim("t", 3, where="reward > 0; DROP TABLE t")
    with pytest.raises(QueryRefused):
        s.claim("t", 3, where="no_such_column > 0")
    assert _stats(s)["ready"] == 7


def _grpo_rows(s, groups):
    """groups: {input_id: [reward per trajectory]}."""
    ids, rewards = [], []
    for inp, rs in groups.items():
        for k, r in enumerate(rs):
            ids.append(f"{inp}_0_{k}")
            rewards.append(r)
    s.put("t", {"sample_id": ids, "reward": rewards})


def _groups(claim):
    out: dict[str, int] = {}
    for inp in claim.data.column("input_id").to_pylist():
        out[inp] = out.get(inp, 0) + 1
    return out


def test_group_claims_deliver_whole_groups(any_store):
    s = any_store
    s.create_table("t", {"prompt": "string", "reward": "float64"}, required=["reward"])
    _grpo_rows(s, {"g1": [1, 0, 1, 0], "g2": [1, 1, 0], "g3": [0, 1, 0, 1], "g4": [1, 1, 1, 0]})
    # g2 is incomplete: one trajectory is still being generated.
    s.put("t", {"sample_id": ["g2_0_3"], "prompt": ["p"]})
    claim = s.claim("t", 6, group_by="input_id", group_size=4)
    assert _groups(claim) == {"g1": 4}                       # 6 rows hold one whole group only
    claim2 = s.claim("t", 16, group_by="input_id", group_size=4)
    assert _groups(claim2) == {"g3": 4, "g4": 4}
    assert not s.claim("t", 16, group_by="input_id", group_size=4)
    s.put("t", {"sample_id": ["g2_0_3"], "reward": [1.0]})   # the group completes
    claim3 = s.claim("t", 16, group_by="input_id", group_size=4)
    assert _groups(claim3) == {"g2": 4}
    # A nack returns whole groups, and they come back whole.
    s.nack(claim2.claim_id)
    again = s.claim("t", 4, group_by="input_id", group_size=4)
    assert _groups(again) == {"g3": 4}


def test_group_claims_with_min_rows(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _grpo_rows(s, {"g1": [1, 0], "g2": [1, 0]})
    assert not s.claim("t", 8, group_by="input_id", group_size=2, min_rows=6)
    assert _stats(s)["ready"] == 4
    assert s.claim("t", 8, group_by="input_id", group_size=2, min_rows=4).num_rows == 4


def test_group_filter_in_sql(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _grpo_rows(s, {"same": [1, 1, 1, 1], "mixed": [1, 0, 0, 1], "zeros": [0, 0, 0, 0],
                   "mixed2": [0, 0, 0, 1]})
    informative = ("input_id IN (SELECT input_id FROM t GROUP BY input_id "
                   "HAVING min(reward) < max(reward))")
    claim = s.claim("t", 16, where=informative, group_by="input_id", group_size=4)
    assert _groups(claim) == {"mixed": 4, "mixed2": 4}
    assert _stats(s)["ready"] == 8                          # the uninformative groups wait


def _sparse_backlog(s, inputs=1500, per=4):
    """inputs x per ready rows, in groups of ``per``; reward 1 on a sparse, spread set of rows
    (whole groups and, for some groups, all but their last row), 0 elsewhere."""
    ids, rewards = [], []
    for i in range(inputs):
        hit = (i * 7919) % 1000
        for t in range(per):
            ids.append(f"q{i:05d}_0_{t}")
            rewards.append(1.0 if hit < 6 or (hit < 12 and t < per - 1) else 0.0)
    s.put("t", {"sample_id": ids, "reward": rewards})
    return list(zip(ids, rewards))


@pytest.mark.parametrize("group_size", [None, 4])
def test_a_predicate_over_a_long_backlog_takes_the_first_matches(any_store, group_size):
    """A claim with a predicate evaluates ready rows in rounds (the first 256, then four times
    as many each round); what it takes is what evaluating the whole backlog would give: the
    first matching rows in claim order, or the first groups with enough matching rows,
    wherever a round ends."""
    s = any_store
    s.create_table("t", {"reward": "float64"})
    rows = _sparse_backlog(s)
    matching = [sid for sid, r in rows if r == 1.0]
    if group_size is None:
        want = matching[:16]
    else:
        by_input: dict[str, list[str]] = {}
        for sid in matching:
            by_input.setdefault(sid.split("_")[0], []).append(sid)
        whole = [sids for sids in by_input.values() if len(sids) >= group_size]
        want = [sid for sids in whole[:4] for sid in sids[:group_size]]
    kw = {"group_by": "input_id", "group_size": group_size} if group_size else {}
    claim = s.claim("t", 16, where="reward > 0.5", **kw)
    assert _ids(claim) == want
    # the matches come from past the first rounds, and nothing else was taken
    assert rows.index((want[-1], 1.0)) > 1024
    assert _stats(s)["ready"] == len(rows) - 16


def test_ack_is_idempotent_and_final(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _fill(s, "t", ["a_0_0", "b_0_0"])
    claim = s.claim("t", 10)
    first = s.ack(claim.claim_id)
    assert first["acked"] == 2
    second = s.ack(claim.claim_id)
    assert second["acked"] == 2 and second.get("duplicate")
    st = _stats(s)
    assert st["consumed"] == 2 and st["processing"] == 0 and st["ready"] == 0
    with pytest.raises(LeaseExpired, match=claim.claim_id):
        s.nack(claim.claim_id)
    assert not s.claim("t", 10)
    consumed = s.query("SELECT consumed, is_processing FROM t").to_pylist()
    assert consumed == [{"consumed": True, "is_processing": False}] * 2


def test_ack_unknown_claim(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    with pytest.raises(NotFound, match="deadbeef"):
        s.ack("deadbeef")
    with pytest.raises(NotFound, match="deadbeef"):
        s.nack("deadbeef")
    with pytest.raises(InvalidArgument):
        s.ack("")


def test_nack_makes_rows_ready_and_counts_deliveries(any_store, wait_until):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _fill(s, "t", ["a_0_0", "b_0_0", "c_0_0"])
    claim = s.claim("t", 2, consumer="trainer-0")
    assert claim.data.column("delivery_count").to_pylist() == [1, 1]
    assert _stats(s)["processing"] == 2 and _stats(s)["ready"] == 1
    assert s.nack(claim.claim_id)["nacked"] == 2
    assert _stats(s)["ready"] == 3 and _stats(s)["processing"] == 0
    with pytest.raises(LeaseExpired):
        s.ack(claim.claim_id)
    again = s.claim("t", 3)
    assert _ids(again) == ["a_0_0", "b_0_0", "c_0_0"]
    assert again.data.column("delivery_count").to_pylist() == [2, 2, 1]
    s.ack(again.claim_id)
    counts = s.query("SELECT sample_id, delivery_count FROM t ORDER BY 1").to_pylist()
    assert [c["delivery_count"] for c in counts] == [2, 2, 1]


def test_lease_owner_and_processing_visible_in_sql(any_store, wait_until):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _fill(s, "t", ["a_0_0"])
    claim = s.claim("t", 1, consumer="trainer-7")
    sql = "SELECT is_processing, lease_owner, lease_id, delivery_count FROM t"
    row = wait_until(lambda: (r := s.query(sql).to_pylist()[0])["is_processing"] and r,
                     message="the lease reaching SQL")
    assert row == {"is_processing": True, "lease_owner": "trainer-7",
                   "lease_id": claim.claim_id, "delivery_count": 1}


def test_an_idle_writer_flushes_a_claims_lease_when_due(tmp_path, monkeypatch, wait_until):
    """A claim asks for its lease columns to be written within ``lease_flush_delay``; an idle
    writer sleeping until its next checkpoint (here: a minute) is woken for it."""
    s = store.connect(str(tmp_path / "x.duckdb"), checkpoint_idle_seconds=60.0)
    try:
        s.create_table("t", {"reward": "float64"})
        _fill(s, "t", ["a_0_0"])
        time.sleep(0.2)  # the writer is idle now, waiting up to a minute
        claim = s.claim("t", 1, consumer="trainer-3")
        wait_until(lambda: s.query("SELECT lease_id FROM t").to_pylist()[0]["lease_id"]
                   == claim.claim_id, timeout=20, message="the lease reaching SQL")
    finally:
        s.close()


@pytest.mark.parametrize("n", [10, 1500], ids=["few rows", "many rows"])
def test_lease_columns_acks_and_nacks_reach_sql_for_few_rows_and_many(any_store, wait_until, n):
    """The writer sends a few rows to SQL as list parameters and many as an Arrow table: the
    columns come out the same either way."""
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _fill(s, "t", [f"{i}_0_0" for i in range(2 * n)])
    first, second = s.claim("t", n, consumer="a"), s.claim("t", n, consumer="b")
    sql = ("SELECT lease_owner, lease_id, count(*) AS n, min(lease_expires_at) AS lo, "
           "max(lease_expires_at) AS hi, max(delivery_count) AS d FROM t WHERE is_processing "
           "GROUP BY ALL ORDER BY 1")
    rows = wait_until(lambda: r if len(r := s.query(sql).to_pylist()) == 2 else None,
                      message="both leases reaching SQL")
    for row, claim, owner in zip(rows, (first, second), "ab"):
        assert (row["lease_owner"], row["lease_id"], row["n"], row["d"]) == \
            (owner, claim.claim_id, n, 1)
        assert row["lo"] == row["hi"]
        assert abs(row["lo"].timestamp() - claim.expires_at) < 1e-3
    s.ack(first.claim_id)
    s.nack(second.claim_id)
    after = s.query("SELECT consumed, is_processing, lease_owner, lease_expires_at IS NULL AS "
                    "no_expiry, delivery_count, count(*) AS n FROM t GROUP BY ALL ORDER BY ALL")
    assert after.to_pylist() == [
        {"consumed": False, "is_processing": False, "lease_owner": "b", "no_expiry": True,
         "delivery_count": 1, "n": n},
        {"consumed": True, "is_processing": False, "lease_owner": "a", "no_expiry": False,
         "delivery_count": 1, "n": n}]


def test_lease_expiry_makes_rows_ready(any_store, wait_until):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _fill(s, "t", ["a_0_0", "b_0_0"])
    claim = s.claim("t", 2, lease_seconds=0.2)
    assert claim.expires_at <= time.time() + 0.2 + 1e-3
    # While the lease runs nobody else gets its rows (a slow machine may be past its end by
    # the time the second claim is answered: then the rows are rightly ready again).
    assert not s.claim("t", 2) or time.time() >= claim.expires_at
    _wait_ready(s, wait_until, "t", 2)
    assert _stats(s)["processing"] == 0
    with pytest.raises(LeaseExpired, match=claim.claim_id):
        s.ack(claim.claim_id)
    with pytest.raises(LeaseExpired, match=claim.claim_id):
        s.nack(claim.claim_id)
    again = s.claim("t", 2)
    assert _ids(again) == ["a_0_0", "b_0_0"]
    assert again.data.column("delivery_count").to_pylist() == [2, 2]
    s.ack(again.claim_id)
    assert _stats(s)["consumed"] == 2


def test_ack_after_expiry_without_waiting_for_the_writer(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    _fill(s, "t", ["a_0_0"])
    claim = s.claim("t", 1, lease_seconds=0.05)
    deadline = time.monotonic() + 5
    while time.time() < claim.expires_at and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(LeaseExpired):
        s.ack(claim.claim_id)
    assert _stats(s)["consumed"] == 0


def test_table_lease_seconds_default(any_store, wait_until):
    s = any_store
    s.create_table("t", {"reward": "float64"}, lease_seconds=0.2)
    _fill(s, "t", ["a_0_0"])
    claim = s.claim("t", 1)
    assert claim.expires_at - time.time() <= 0.2
    _wait_ready(s, wait_until, "t", 1)


def test_dead_letter_after_max_deliveries(any_store, wait_until):
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_deliveries=3)
    _fill(s, "t", ["a_0_0", "b_0_0"])
    for _ in range(2):
        s.nack(s.claim("t", 1).claim_id)              # a_0_0: deliveries 1, 2
    claim = s.claim("t", 1, lease_seconds=0.2)        # a_0_0: the 3rd delivery, left to expire
    assert _ids(claim) == ["a_0_0"]
    wait_until(lambda: _stats(s)["dead"] == 1, message="the row dead-lettered")
    st = _stats(s)
    assert st == {**st, "rows": 2, "dead": 1, "ready": 1, "processing": 0, "pending": 0}
    # Dead rows are kept for SQL (once the expiry's bookkeeping is flushed) and never
    # delivered again.
    sql = "SELECT sample_id, dead, delivery_count, consumed FROM t WHERE dead"
    expected = [{"sample_id": "a_0_0", "dead": True, "delivery_count": 3, "consumed": False}]
    wait_until(lambda: s.query(sql).to_pylist() == expected, message="the dead row in SQL")
    assert _ids(s.claim("t", 10)) == ["b_0_0"]
    # Re-sending a dead sample does not bring it back.
    _fill(s, "t", ["a_0_0"])
    assert not s.claim("t", 10)
    assert _stats(s)["dead"] == 1


def test_a_late_ack_of_a_dead_lettered_row_says_dead(any_store, wait_until):
    """Issue 29: the answer said "its rows were or will be delivered again" for a row that was
    dead-lettered and never will be."""
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_deliveries=1)
    _fill(s, "t", ["a_0_0"])
    claim = s.claim("t", 1, lease_seconds=0.2)        # the last delivery, left to expire
    wait_until(lambda: _stats(s)["dead"] == 1, message="the row dead-lettered")
    with pytest.raises(LeaseExpired) as late:
        s.ack(claim.claim_id)
    message = str(late.value)
    assert "its lease expired" in message and "1 dead" in message, message
    assert "never delivered again" in message and "ready to be delivered" not in message


def test_a_late_ack_of_an_expired_lease_says_which_rows_come_again(any_store, wait_until):
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_deliveries=2)
    _fill(s, "t", ["a_0_0", "b_0_0"])
    s.nack(s.claim("t", 1).claim_id)                   # a_0_0 delivered once
    claim = s.claim("t", 2, lease_seconds=0.2)        # a_0_0: its last delivery; b_0_0: 1st
    wait_until(lambda: _stats(s)["ready"] == 1, message="the lease expired")
    with pytest.raises(LeaseExpired, match="1 ready to be delivered again, 1 dead"):
        s.ack(claim.claim_id)


def test_dead_letter_by_nack(any_store):
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_deliveries=1)
    _fill(s, "t", ["a_0_0"])
    s.nack(s.claim("t", 1).claim_id)
    assert _stats(s)["dead"] == 1 and not s.claim("t", 1)


def test_claim_many_is_atomic(any_store):
    s = any_store
    for name in ("solver", "verifier", "critic"):
        s.create_table(name, {"reward": "float64"})
    _fill(s, "solver", [f"q{i}_0_0" for i in range(5)])
    _fill(s, "verifier", ["q0_0_0"])
    requests = [ClaimRequest("solver", 4), ClaimRequest("verifier", 2, min_rows=2)]
    empty = s.claim_many(requests, consumer="multi")
    assert not empty and empty.claim_id == ""
    assert _stats(s, "solver")["ready"] == 5 and _stats(s, "verifier")["ready"] == 1
    _fill(s, "verifier", ["q1_0_0"])
    claim = s.claim_many(requests, consumer="multi")
    assert set(claim.tables) == {"solver", "verifier"}
    assert _ids(claim, "solver") == ["q0_0_0", "q1_0_0", "q2_0_0", "q3_0_0"]
    assert _ids(claim, "verifier") == ["q0_0_0", "q1_0_0"]
    assert claim.num_rows == 6
    assert s.ack(claim.claim_id)["acked"] == 6
    assert _stats(s, "solver")["consumed"] == 4 and _stats(s, "verifier")["consumed"] == 2
    # A nack of a multi-table claim gives every table its rows back.
    claim = s.claim_many([ClaimRequest("solver", 4), ClaimRequest("critic", 1, min_rows=1)])
    assert not claim and _stats(s, "solver")["ready"] == 1
    _fill(s, "critic", ["c_0_0"])
    claim = s.claim_many([ClaimRequest("solver", 4), ClaimRequest("critic", 1)])
    assert claim.num_rows == 2
    s.nack(claim.claim_id)
    assert _stats(s, "solver")["ready"] == 1 and _stats(s, "critic")["ready"] == 1


def test_claim_many_refuses_bad_requests(any_store):
    s = any_store
    s.create_table("a", {"reward": "float64"})
    with pytest.raises(InvalidArgument):
        s.claim_many([])
    with pytest.raises(InvalidArgument, match="'a'"):
        s.claim_many([ClaimRequest("a", 1), ClaimRequest("a", 2)])
    with pytest.raises(NotFound, match="'b'"):
        s.claim_many([ClaimRequest("a", 1), ClaimRequest("b", 1)])


@pytest.mark.parametrize("where", [None, "reward >= 0"])
def test_concurrent_claimers_never_share_a_row(any_store, where):
    s = any_store
    s.create_table("t", {"reward": "float64"})
    n = 600
    _fill(s, "t", [f"q{i:04d}_0_{i % 3}" for i in range(n)])
    got: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def claimer(k: int) -> None:
        mine: list[str] = []
        try:
            start.wait()
            while True:
                claim = s.claim("t", 7, where=where, consumer=f"c{k}")
                if not claim:
                    break
                mine.extend(_ids(claim))
                s.ack(claim.claim_id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        got[k] = mine

    threads = [threading.Thread(target=claimer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    everything = [sid for ids in got.values() for sid in ids]
    assert len(everything) == len(set(everything)) == n
    assert _stats(s)["consumed"] == n


def test_concurrent_claims_and_nacks_keep_rows_exclusive(any_store):
    """Claimers that nack part of what they get: every row is held by at most one at a time."""
    s = any_store
    s.create_table("t", {"reward": "float64"}, max_deliveries=1000)
    n = 200
    _fill(s, "t", [f"q{i:04d}_0_0" for i in range(n)])
    holders: dict[str, int] = {}
    lock = threading.Lock()
    violations: list[str] = []
    consumed: list[str] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            claim = s.claim("t", 5, consumer=f"w{k}")
            if not claim:
                if s.stats("t")["t"]["consumed"] == n:
                    return
                time.sleep(0.001)
                continue
            ids = _ids(claim)
            with lock:
                for sid in ids:
                    if sid in holders:
                        violations.append(sid)
                    holders[sid] = k
            ack = rng.random() < 0.6
            with lock:
                for sid in ids:
                    holders.pop(sid, None)
                if ack:
                    consumed.extend(ids)
            (s.ack if ack else s.nack)(claim.claim_id)

    errors = run_threads(worker, 3, timeout=60)
    assert not errors, errors
    assert not violations
    assert sorted(consumed) == sorted(f"q{i:04d}_0_0" for i in range(n))
