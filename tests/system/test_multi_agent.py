"""The planner → solver → verifier workflow through the Flight server, with a trainer per agent.

Real components only: the Flight server on 127.0.0.1 port 0 over a DuckDB file in tmp_path, the
remote store client, tiny CPU LMs as rollout backends, torch trainers on group-aware micro-batch
subscriptions. One query of the first round is made deliberately slow.
"""
from __future__ import annotations

from functools import partial

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from consumers.torch_collate import collate  # noqa: E402
from consumers.trainer import TorchTrainer, TrainerThread, grpo_loss  # noqa: E402
from flight_fixtures import running_server  # noqa: E402
from flight_server.client import RemoteStore  # noqa: E402
from producers.rollout.tiny_lm import TinyLMBackend, build_tiny_lm  # noqa: E402
from producers.workflow import LatencyModel, MultiAgentWorkflow, reference_agents  # noqa: E402

# SLOW: long enough that, on 2 busy cores, the round's other queries and the first micro-batches
# still fit inside the slow query's latency (1.5 s failed once under the full suite's load).
ROUNDS, PER_ROUND, N, SLOW = 2, 3, 2, 3.0


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


@pytest.mark.parametrize("shared", [None, "team"])
def test_three_agents_route_train_on_their_own_versions_and_isolate_a_slow_query(tmp_path, shared):
    """``shared``: each agent its own version group, or all three in one (unified weight
    updating: every trainer's bump arrives at the group's barrier)."""
    queries = [(f"q{i}", f"{i}+{3 * i}=?") for i in range(ROUNDS * PER_ROUND)]
    latency = LatencyModel(median=0.01, sigma=0.5, slow_fraction=0.1, slow_factor=4,
                           slow_queries={"q0": SLOW}, seed=1)
    with running_server(tmp_path / "x.duckdb") as server, RemoteStore(server.location) as s:
        wf = MultiAgentWorkflow(s, reference_agents(), n=N, max_new_tokens=6, latency=latency,
                                version_timeout=60)
        wf.create_tables(**({"version_group": shared} if shared else {}))
        sizes = wf.batch_sizes(PER_ROUND)
        trainers: dict[str, TrainerThread] = {}
        for i, agent in enumerate(wf.agents):
            table = wf.tables[agent.name]
            micro, global_batch, group = sizes[table]
            model = build_tiny_lm(seed=i)
            trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), grpo_loss,
                                   tmp_path / "weights", name=table,
                                   collate_fn=partial(collate, group_size=group))
            sub = s.subscribe(table, micro, global_batch, group_by="input_id", group_size=group,
                              consumer=f"trainer-{table}")
            trainers[table] = TrainerThread(trainer, sub, max_steps=ROUNDS, idle_timeout=60)
            trainers[table].start()
        backends = {a.name: TinyLMBackend(build_tiny_lm(seed=i)) for i, a in enumerate(wf.agents)}
        try:
            result = wf.run(queries, PER_ROUND, backends)
        finally:
            for t in trainers.values():
                t.join(timeout=60)
        for table, t in trainers.items():
            assert not t.is_alive(), f"the trainer of {table} did not finish"
            assert t.error is None, t.error

        # all three tables filled: n, n^2, n^3 samples per query
        per_query = {"planner": N, "solver": N ** 2, "verifier": N ** 3}
        assert result.samples == {wf.tables[a]: len(queries) * k for a, k in per_query.items()}
        for agent, k in per_query.items():
            stats = s.stats(agent)[agent]
            assert stats["rows"] == stats["consumed"] == len(queries) * k

        # routing: every verifier sample traces back to a solver and a planner sample of its query
        chain = s.query(
            "SELECT v.sample_id, v.query_id AS vq, sv.query_id AS sq, p.query_id AS pq, "
            "v.input_id AS vi, sv.input_id AS si, p.input_id AS pi, sv.trajectory_id AS st, "
            "p.trajectory_id AS pt, v.policy_version AS vv, sv.policy_version AS sv_, "
            "p.policy_version AS pv, p.next_agent_id AS pn, sv.next_agent_id AS sn, "
            "v.next_agent_id AS vn FROM verifier v "
            "JOIN solver sv ON v.parent_id = sv.sample_id "
            "JOIN planner p ON sv.parent_id = p.sample_id").to_pylist()
        assert len(chain) == len(queries) * N ** 3
        for r in chain:
            assert r["vq"] == r["sq"] == r["pq"] and r["pi"] == r["pq"]
            assert r["si"] == f"{r['pi']}.{r['pt']}" and r["vi"] == f"{r['si']}.{r['st']}"
            assert (r["pn"], r["sn"], r["vn"]) == (1, 2, None)
            # one round, one version of each agent: strictly on-policy
            rnd = int(r["pq"][1:]) // PER_ROUND
            assert r["vv"] == r["sv_"] == r["pv"] == rnd
        assert s.query("SELECT count(*) AS n FROM planner WHERE parent_id IS NOT NULL"
                       ).column("n")[0].as_py() == 0

        # each trainer bumped its own version (or, in one group, the group's), once per round
        for table, t in trainers.items():
            assert s.describe(table)["version_group"] == (shared or table)
            assert s.get_version(table) == ROUNDS
            assert [st.version for st in t.steps] == list(range(1, ROUNDS + 1))
            bumps = s.query("SELECT version FROM _expstore_versions WHERE version_group = ? "
                            "ORDER BY version", [shared or table]).column(0).to_pylist()
            assert bumps == list(range(ROUNDS + 1))
            assert s.weights_uri(table) == t.steps[-1].weights_uri  # its own weights
        # and the rollouts reloaded the published weights before each round after the first
        # (ROUNDS - 1 bumps). The last bump comes after the last rollout: a driver hears of it
        # only if the run has not closed its writer yet, which on a loaded machine it has.
        assert all(ROUNDS - 1 <= wf.drivers[a.name].reloads <= ROUNDS for a in wf.agents), \
            {a.name: wf.drivers[a.name].reloads for a in wf.agents}

    # the slow query did not delay the other queries of its round
    slow_start, slow_end = result.queries["q0"]
    assert slow_end - slow_start >= SLOW
    for qid in (f"q{i}" for i in range(1, PER_ROUND)):
        start, end = result.queries[qid]
        assert end < slow_start + SLOW, f"{qid} finished only after the slow query's latency"
    # and the verifier trainer started on micro-batches while the slow query was still rolling out
    verifier = trainers["verifier"].trainer
    assert verifier.busy[0][0] < slow_end
    assert overlap(verifier.busy, [(slow_start, slow_end)]) > 0
