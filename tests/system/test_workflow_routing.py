"""Routing per sample: the next agent is decided by each sample's own output, at run time.

A debate between two agents on a real store: each sample's output says whether the debate goes
on (to the other agent) or ends, and a turn limit bounds the cycle. Every routing decision is
checked against the output it was made from, through SQL over what the workflow wrote.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

import store  # noqa: E402
from producers.rollout.tiny_lm import TinyLMBackend  # noqa: E402
from producers.workflow import Agent, LatencyModel, MultiAgentWorkflow  # noqa: E402

PRO, CON = 0, 1
MAX_TURNS, N = 4, 2


def goes_on(response_token_ids: list[int]) -> bool:
    """The debate goes on when a reply's tokens sum to an odd number (a stand-in for "the reply
    raises an objection"): a decision only the sample's own output can make."""
    return sum(response_token_ids) % 2 == 1


def debaters() -> list[Agent]:
    def reply_to(other: int):
        return lambda request, g: other if goes_on(g.token_ids) else None

    def reward(request, g) -> float:
        return float(len(g.token_ids))

    return [
        Agent("pro", PRO, None, lambda q, up: f"argue for: {q} | {(up or '')[:16]}", reward,
              route=reply_to(CON)),
        Agent("con", CON, None, lambda q, up: f"argue against: {(up or '')[:16]}", reward,
              route=reply_to(PRO)),
    ]


def test_a_debate_routes_each_sample_by_its_own_output_within_the_turn_limit(tmp_path):
    s = store.connect(os.path.join(tmp_path, "x.duckdb"))
    try:
        wf = MultiAgentWorkflow(s, debaters(), n=N, max_new_tokens=4, max_turns=MAX_TURNS,
                                latency=LatencyModel(median=0.001, slow_fraction=0.0))
        wf.create_tables()
        backends = {"pro": TinyLMBackend(seed=1), "con": TinyLMBackend(seed=2)}
        queries = [(f"q{i}", f"{i} is prime") for i in range(4)]
        result = wf.run(queries, queries_per_round=len(queries), backends=backends)

        rows = s.query(
            "SELECT 'pro' AS agent, sample_id, input_id, turn, parent_id, next_agent_id, "
            "token_ids, prompt_len FROM pro UNION ALL SELECT 'con', sample_id, input_id, turn, "
            "parent_id, next_agent_id, token_ids, prompt_len FROM con").to_pylist()
        by_id = {r["sample_id"]: r for r in rows}
        assert len(rows) == sum(result.samples.values())
        children: dict[str, list[dict]] = {}
        for r in rows:
            if r["parent_id"] is not None:
                children.setdefault(r["parent_id"], []).append(r)

        ended_by_output = reached_limit = 0
        for r in rows:
            response = r["token_ids"][r["prompt_len"]:]
            at_limit = r["turn"] == MAX_TURNS - 1
            other = CON if r["agent"] == "pro" else PRO
            # The routing decision written with the sample is the one its own output makes,
            # except at the turn limit, which ends every trajectory.
            want = None if at_limit or not goes_on(response) else other
            assert r["next_agent_id"] == want, r["sample_id"]
            kids = children.get(r["sample_id"], [])
            if want is None:
                assert kids == []
                reached_limit += at_limit
                ended_by_output += not at_limit
            else:
                # n samples of the other agent, one turn later, made from this sample.
                assert len(kids) == N
                assert {k["agent"] for k in kids} == {"con" if want == CON else "pro"}
                assert {k["turn"] for k in kids} == {r["turn"] + 1}
                assert {k["input_id"] for k in kids} == {
                    f"{r['input_id']}.{r['sample_id'].rsplit('_', 1)[1]}"}
            if r["parent_id"] is None:
                assert r["agent"] == "pro" and r["turn"] == 0
            else:
                assert by_id[r["parent_id"]]["turn"] == r["turn"] - 1
        assert max(r["turn"] for r in rows) == MAX_TURNS - 1
        # A real test: some debates went round the cycle up to the limit, some ended early.
        assert reached_limit > 0 and ended_by_output > 0
        assert result.routed == {"pro": sum(1 for r in rows if r["agent"] == "pro"
                                            and r["next_agent_id"] is not None),
                                 "con": sum(1 for r in rows if r["agent"] == "con"
                                            and r["next_agent_id"] is not None)}
    finally:
        s.close()


def test_routing_that_can_cycle_needs_a_turn_limit(tmp_path):
    s = store.connect(os.path.join(tmp_path, "x.duckdb"))
    try:
        with pytest.raises(ValueError, match="max_turns"):
            MultiAgentWorkflow(s, debaters())
        fixed = [Agent("pro", PRO, CON, lambda q, up: q, lambda r, g: 0.0),
                 Agent("con", CON, PRO, lambda q, up: q, lambda r, g: 0.0)]
        with pytest.raises(ValueError, match="cycle at 'pro'; give max_turns"):
            MultiAgentWorkflow(s, fixed)
        bounded = MultiAgentWorkflow(s, fixed, max_turns=3)
        with pytest.raises(ValueError, match="no fixed global batch"):
            bounded.batch_sizes(2)
        # A route naming an agent that does not exist fails the run, naming it.
        lost = [Agent("pro", PRO, None, lambda q, up: q, lambda r, g: 0.0,
                      route=lambda r, g: 7)]
        wf = MultiAgentWorkflow(s, lost, n=1, max_new_tokens=2, max_turns=2,
                                latency=LatencyModel(median=0.001, slow_fraction=0.0))
        wf.create_tables()
        with pytest.raises(ValueError, match="unknown agent id 7"):
            wf.run([("q0", "x")], 1, {"pro": TinyLMBackend(seed=0)})
    finally:
        s.close()
