"""Unified weight updating: a version group's barrier, embedded and through a Flight server.

Each agent's trainer arrives at the group's barrier after its global batch; the group's version
advances once, when every member table arrived, and no arrival stales another member's rows. A
member that never arrives holds the barrier only for the group's barrier timeout.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Iterator

import pytest

import store
from store.errors import BarrierTimeout, InvalidArgument, VersionConflict
from flight_fixtures import running_server

AGENTS = ("solver", "verifier", "critic")


@pytest.fixture(params=["embedded", "remote"])
def both(request, tmp_path) -> Iterator[Any]:
    """The same store embedded and through a real Flight server on 127.0.0.1."""
    with contextlib.ExitStack() as stack:
        if request.param == "embedded":
            s = store.connect(str(tmp_path / "x.duckdb"))
        else:
            server = stack.enter_context(running_server(tmp_path / "x.duckdb"))
            s = store.connect(server.location)
        stack.callback(s.close)
        yield s


def _team(s: Any, max_staleness: int = 0) -> None:
    for name in AGENTS:
        s.create_table(name, {"reward": "float64"}, version_group="team",
                       max_staleness=max_staleness)


def _put(s: Any, table: str, ids: list[str]) -> None:
    s.put(table, {"sample_id": ids, "reward": [1.0] * len(ids)})


def _arrive_in_thread(s: Any, table: str, expected: int, **kw: Any) -> queue.Queue:
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            out.put(s.arrive(table, expected=expected, **kw))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out.put(e)

    threading.Thread(target=run, daemon=True).start()
    return out


def test_the_group_advances_once_when_every_member_arrived(both):
    s = both
    _team(s)
    for name in AGENTS:
        _put(s, name, [f"{name}{i}_0_0" for i in range(4)])
    # The solver's trainer is done with its global batch; the others are still training.
    solver = _arrive_in_thread(s, "solver", 0, weights_uri="file:///w/solver/1")
    verifier = _arrive_in_thread(s, "verifier", 0, weights_uri="file:///w/verifier/1")
    deadline = time.monotonic() + 30
    while s.barrier("critic")["arrived"] != ["solver", "verifier"]:
        assert time.monotonic() < deadline, s.barrier("critic")
        time.sleep(0.02)
    assert solver.empty() and verifier.empty()  # both wait for the critic
    # Nothing was bumped and nothing went stale: the critic still trains on its version-0 rows.
    assert s.get_version("critic") == 0
    assert all(s.stats(n)[n]["stale"] == 0 for n in AGENTS)
    claim = s.claim("critic", 4)
    assert claim.num_rows == 4 and set(claim.data.column("policy_version").to_pylist()) == {0}
    s.ack(claim.claim_id)
    state = s.barrier("critic")
    assert state["waiting_for"] == ["critic"] and state["members"] == list(sorted(AGENTS))

    assert s.arrive("critic", expected=0, weights_uri="file:///w/critic/1") == 1
    assert solver.get(timeout=30) == 1 and verifier.get(timeout=30) == 1
    assert [s.get_version(n) for n in AGENTS] == [1, 1, 1]
    # One bump for the whole group, each member's weights recorded for it.
    history = s.query("SELECT version FROM _expstore_versions WHERE version_group = 'team' "
                      "ORDER BY version").column(0).to_pylist()
    assert history == [0, 1]
    assert {n: s.weights_uri(n) for n in AGENTS} == {
        n: f"file:///w/{n}/1" for n in AGENTS}
    assert s.describe("solver")["weights_uri"] == "file:///w/solver/1"
    # The unconsumed rows of version 0 (solver, verifier) became stale at the one bump.
    assert [s.stats(n)[n]["stale"] for n in AGENTS] == [4, 4, 0]


def test_arriving_again_is_harmless_and_a_wrong_version_is_refused(both):
    s = both
    _team(s)
    first = _arrive_in_thread(s, "solver", 0)
    again = _arrive_in_thread(s, "solver", 0)  # e.g. a retry after a lost answer
    verifier = _arrive_in_thread(s, ["verifier"], 0)  # a list of tables works too
    deadline = time.monotonic() + 30
    while s.barrier("critic")["arrived"] != ["solver", "verifier"]:
        assert time.monotonic() < deadline, s.barrier("critic")
        time.sleep(0.02)
    assert first.empty()
    assert s.arrive("critic", expected=0) == 1
    assert [q.get(timeout=30) for q in (first, again, verifier)] == [1, 1, 1]
    # The barrier at 0 is complete: arriving at it again answers the new version at once.
    assert s.arrive("solver", expected=0) == 1
    assert s.get_version("solver") == 1
    with pytest.raises(VersionConflict, match="version of 'team' is 1, not the expected 3"):
        s.arrive("solver", expected=3)
    with pytest.raises(InvalidArgument, match="'1'"):
        s.arrive("solver", expected="1")
    s.create_table("alone", {"reward": "float64"})
    with pytest.raises(InvalidArgument, match="different version groups"):
        s.arrive(["solver", "alone"], expected=1)
    # A table alone in its group: its arrival is the bump.
    assert s.arrive("alone", expected=0) == 1


def test_a_member_that_never_arrives_times_the_barrier_out(both):
    s = both
    _team(s)
    assert s.set_barrier_timeout("solver", 1.5) == 1.5
    assert s.describe("critic")["barrier_timeout"] == 1.5  # a setting of the group
    started = time.monotonic()
    solver = _arrive_in_thread(s, "solver", 0)
    verifier = _arrive_in_thread(s, "verifier", 0)
    errors = [solver.get(timeout=60), verifier.get(timeout=60)]
    waited = time.monotonic() - started
    for e in errors:
        assert isinstance(e, BarrierTimeout), e
        assert "['critic'] did not arrive" in str(e) and "nothing was bumped" in str(e)
    assert waited < 30  # the timeout, not a hang
    assert s.get_version("solver") == 0
    # Both arrivals were told: the round is over, and the critic's late arrival opens a new
    # one, which completes once the others arrive again.
    s.set_barrier_timeout("solver", 60)
    late = _arrive_in_thread(s, "critic", 0)
    deadline = time.monotonic() + 30
    while s.barrier("solver")["arrived"] != ["critic"]:
        assert time.monotonic() < deadline, s.barrier("solver")
        time.sleep(0.02)
    again = [_arrive_in_thread(s, name, 0) for name in ("solver", "verifier")]
    assert [q.get(timeout=30) for q in [late, *again]] == [1, 1, 1]


def test_an_arrival_after_the_timeout_hears_of_it(tmp_path):
    s = store.connect(str(tmp_path / "x.duckdb"))
    try:
        _team(s)
        s.set_barrier_timeout("solver", 0.3)
        # The solver's trainer polls (as the Flight client does) and is not waiting when the
        # timeout passes; the verifier's call waits and is told at once.
        assert s.arrive_poll("solver", expected=0, timeout=0)["complete"] is False
        with pytest.raises(BarrierTimeout, match=r"\['critic'\] did not arrive"):
            s.arrive("verifier", expected=0)
        # The critic's late arrival, and the solver's next poll, are told too: the round
        # failed, nothing starts silently in its place.
        with pytest.raises(BarrierTimeout):
            s.arrive_poll("critic", expected=0, timeout=0)
        with pytest.raises(BarrierTimeout):
            s.arrive_poll("solver", expected=0, timeout=0)
        # Every table that had arrived was told: the next arrival opens a new round.
        assert s.arrive_poll("solver", expected=0, timeout=0)["waiting_for"] == [
            "critic", "verifier"]
        assert s.barrier("solver")["arrived"] == ["solver"]
    finally:
        s.close()


def test_timeout_setting_and_member_weights_survive_a_restart(tmp_path):
    path = str(tmp_path / "x.duckdb")
    s = store.connect(path)
    _team(s)
    s.set_barrier_timeout("verifier", 42)
    with pytest.raises(InvalidArgument, match="barrier timeout 0"):
        s.set_barrier_timeout("verifier", 0)
    waiting = [_arrive_in_thread(s, n, 0, weights_uri=f"w-{n}") for n in AGENTS[:2]]
    assert s.arrive(AGENTS[2], expected=0, weights_uri=f"w-{AGENTS[2]}") == 1
    assert [q.get(timeout=30) for q in waiting] == [1, 1]
    s.close()
    s = store.connect(path)
    try:
        assert s.describe("solver")["barrier_timeout"] == 42
        assert {n: s.weights_uri(n) for n in AGENTS} == {n: f"w-{n}" for n in AGENTS}
        assert s.get_version("critic") == 1
        # Arrivals are soft state: a trainer that arrived at 0 before the restart hears that
        # the barrier completed.
        assert s.arrive("solver", expected=0) == 1
        # A plain bump records one URI for the whole group, as before.
        s.bump_version("solver", weights_uri="w-all")
        assert s.weights_uri("critic") == "w-all"
    finally:
        s.close()


def test_trainers_subscriptions_bump_through_the_barrier(both):
    """Two agents' subscriptions in one group: the first boundary's bump waits for the other
    trainer, which finishes its global batch on version-0 rows that stay deliverable."""
    s = both
    for name in AGENTS[:2]:
        s.create_table(name, {"reward": "float64"}, version_group="pair")
        _put(s, name, [f"{name}{i}_0_0" for i in range(4)])
    subs = {n: s.subscribe(n, micro_batch_size=2, global_batch_size=4) for n in AGENTS[:2]}
    try:
        first = subs["solver"]
        for _ in range(2):
            mb = first.next(timeout=30)
            mb.ack()
        assert mb.is_boundary
        bumped: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: bumped.put(first.bump_version("w-solver")),
                         daemon=True).start()
        second = subs["verifier"]
        seen = []
        for _ in range(2):
            mb = second.next(timeout=30)
            assert mb is not None, "the other agent's rows went stale at the first arrival"
            seen.append(mb.data.column("policy_version").to_pylist())
            mb.ack()
        assert seen == [[0, 0], [0, 0]] and bumped.empty()
        assert second.bump_version("w-verifier") == 1
        assert bumped.get(timeout=30) == 1
        assert first.version == second.version == 1
    finally:
        for sub in subs.values():
            sub.close()


def test_one_subscription_over_several_tables(both):
    """A shared model (or a centralised critic) trained on every agent's samples: each
    micro-batch holds micro_batch_size rows of each table, claimed in one atomic step; its
    boundary arrives for all its tables at once."""
    s = both
    for name in AGENTS[:2]:
        s.create_table(name, {"prompt": "string", "reward": "float64"}, version_group="pair")
    s.create_table("other", {"reward": "float64"})
    with pytest.raises(InvalidArgument, match="share a version group"):
        s.subscribe(["solver", "other"], micro_batch_size=2, global_batch_size=4)
    s.put("solver", {"sample_id": [f"s{i}_0_0" for i in range(4)], "prompt": ["p"] * 4,
                     "reward": [1.0] * 4})
    s.put("verifier", {"sample_id": ["v0_0_0"], "prompt": ["p"], "reward": [2.0]})
    sub = s.subscribe(["solver", "verifier"], micro_batch_size=2, global_batch_size=4)
    try:
        # The verifier has one ready row: nothing is claimed from either table.
        assert sub.next(timeout=0.5) is None
        assert s.stats("solver")["solver"]["processing"] == 0
        s.put("verifier", {"sample_id": [f"v{i}_0_0" for i in range(1, 4)],
                           "prompt": ["p"] * 3, "reward": [2.0] * 3})
        batches = []
        for _ in range(2):
            mb = sub.next(timeout=30)
            assert mb is not None
            assert {n: t.num_rows for n, t in mb.tables.items()} == {"solver": 2, "verifier": 2}
            assert mb.data.num_rows == 4 and mb.data.column("reward").to_pylist() == [
                1.0, 1.0, 2.0, 2.0]
            assert mb.tables["verifier"].schema.names == s.claim_schema("verifier").names
            mb.ack()
            batches.append(mb)
        assert [b.is_boundary for b in batches] == [False, True]
        # One trainer for both tables: its arrival covers the whole group.
        assert sub.bump_version("w-shared") == 1
        assert s.get_version("solver") == s.get_version("verifier") == 1
        assert s.weights_uri("solver") == s.weights_uri("verifier") == "w-shared"
        consumed = [s.stats(n)[n]["consumed"] for n in AGENTS[:2]]
        assert consumed == [4, 4]
    finally:
        sub.close()


def test_a_subscription_whose_partner_never_arrives_hears_the_timeout(both):
    s = both
    for name in AGENTS[:2]:
        s.create_table(name, {"reward": "float64"}, version_group="pair")
    s.set_barrier_timeout("solver", 0.5)
    _put(s, "solver", ["s0_0_0", "s1_0_0"])
    with s.subscribe("solver", micro_batch_size=2, global_batch_size=2) as sub:
        mb = sub.next(timeout=30)
        mb.ack()
        assert mb.is_boundary
        with pytest.raises(BarrierTimeout, match=r"\['verifier'\] did not arrive"):
            sub.bump_version("w")
        # Nothing was bumped; the trainer may arrive again once its partner is back.
        assert s.get_version("solver") == 0 and sub.version == 0 and sub.at_boundary
        s.set_barrier_timeout("solver", 60)
        partner = _arrive_in_thread(s, "verifier", 0)
        assert sub.bump_version("w") == 1 and partner.get(timeout=30) == 1


def test_arrivals_are_arrived_again_after_a_server_restart(tmp_path):
    """Arrivals are soft state: a trainer waiting at the barrier when the server is killed
    arrives again once it is back (the remote client does it), and the round completes."""
    from reliability_helpers import ServerProcess

    server = ServerProcess(tmp_path / "x.duckdb").start()
    try:
        with store.connect(server.uri) as admin:
            _team(admin)
            admin.drop_table("critic")
            trainer = store.connect(server.uri)
            solver = _arrive_in_thread(trainer, "solver", 0, weights_uri="w-solver")
            deadline = time.monotonic() + 30
            while admin.barrier("solver")["arrived"] != ["solver"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        server.kill()
        server.start()
        with store.connect(server.uri) as verifier:
            assert verifier.arrive("verifier", expected=0, weights_uri="w-verifier") == 1
            assert solver.get(timeout=60) == 1
            assert verifier.weights_uri("solver") == "w-solver"
        trainer.close()
    finally:
        server.stop()


def test_closing_a_subscription_whose_bump_waits_at_the_barrier_does_not_hang(tmp_path):
    """A trainer that gives up while its bump waits for a partner (the barrier timeout is long)
    closes its subscription at once; the server's handler stops waiting for the barrier."""
    with running_server(tmp_path / "x.duckdb") as server, store.connect(server.location) as s:
        for name in AGENTS[:2]:
            s.create_table(name, {"reward": "float64"}, version_group="pair")
        s.set_barrier_timeout("solver", 600)
        _put(s, "solver", ["s0_0_0", "s1_0_0"])
        sub = s.subscribe("solver", micro_batch_size=2, global_batch_size=2)
        mb = sub.next(timeout=30)
        mb.ack()
        bumping = queue.Queue()
        threading.Thread(target=lambda: bumping.put(_outcome(sub.bump_version)),
                         daemon=True).start()
        deadline = time.monotonic() + 30
        while s.barrier("solver")["arrived"] != ["solver"]:
            assert time.monotonic() < deadline, "the bump never arrived at the barrier"
            time.sleep(0.02)
        closer = threading.Thread(target=sub.close, daemon=True)
        closer.start()
        closer.join(60)
        assert not closer.is_alive(), "close() waited for the barrier"
        assert isinstance(bumping.get(timeout=60), store.ExpstoreError)
        assert s.get_version("solver") == 0  # nothing was bumped


def _outcome(call: Any) -> Any:
    try:
        return call()
    except BaseException as e:  # noqa: BLE001 - the test looks at what it was
        return e


def test_a_table_dropped_and_made_again_bumps_from_version_0(any_store):
    """The finished round of the dropped table's group was kept, at expected version 0 and
    'bumping', so the new table's first bump (its version back at 0) waited on it forever."""
    s = any_store
    for expected_version in (1, 1):
        s.drop_table("t", if_exists=True)
        s.create_table("t", {"reward": "float64"})
        s.put("t", [{"sample_id": f"q{i}_0_0", "reward": 1.0} for i in range(2)])
        sub = s.subscribe("t", 2, 2, idle_timeout=5)
        next(iter(sub)).ack()
        answer: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: answer.put(sub.bump_version()), daemon=True).start()
        assert answer.get(timeout=15) == expected_version
        sub.close()
