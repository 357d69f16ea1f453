"""The paper's unified weight updating, end to end: three agents, three trainer processes.

FlexMARL (section 4.3): "After processing micro batches equivalent to the global batch, all agents
aggregate the cached gradients to perform unified weight updating (policy version+1)." Here three
agent tables share a version group on a real Flight server (127.0.0.1, port 0, a DuckDB file in
tmp_path). Producer threads write each agent's samples of version v once the group is at v, in
several bursts; three trainers, each in a process of its own (spawn), train their agent's model
in float64 on its subscription's micro-batches and arrive at the group's barrier after each global
batch, in an order shuffled per step. The group's version must advance once per step, in
lock-step for every agent, no trainer may get the new version before the last one arrived, no
row may go stale or be delivered off its version, and each agent's parameters must equal those of
one plain full-batch step per global batch on its own samples.
"""
from __future__ import annotations

import multiprocessing
import random
import threading
import time
from typing import Any

import pyarrow as pa
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from flight_server.client import RemoteStore  # noqa: E402
from flight_fixtures import running_server  # noqa: E402

AGENTS = ("planner", "coder", "reviewer")
MICRO, GLOBAL, STEPS = 4, 12, 3
GROUP = "team"
COLUMNS = {"xs": "list<float64>", "y": "float64"}
LR = 0.05
#: Per step, the order in which the trainers arrive at the barrier.
ORDERS = [(2, 0, 1), (0, 1, 2), (1, 2, 0)]


def agent_rows(agent: int, step: int) -> list[dict]:
    """A global batch of one agent: samples with 1-5 values each, so micro-batches carry
    unequal numbers of loss terms (the case plain averaging of micro-batch means gets wrong)."""
    rng = random.Random(agent * 1000 + step)
    rows = []
    for i in range(GLOBAL):
        xs = [rng.uniform(-2, 2) for _ in range(rng.randint(1, 5))]
        rows.append({"sample_id": f"a{agent}s{step}q{i}_0_0", "xs": xs,
                     "y": 3.0 * sum(xs) / len(xs) - 1.0 + agent})
    return rows


def initial_model(agent: int) -> "torch.nn.Module":
    torch.manual_seed(100 + agent)
    return torch.nn.Linear(1, 1).double()


class Terms:
    """A collated micro-batch: one loss term per value."""

    def __init__(self, table: pa.Table) -> None:
        xs = table.column("xs").to_pylist()
        ys = table.column("y").to_pylist()
        self.x = torch.tensor([[v] for row in xs for v in row], dtype=torch.float64)
        self.y = torch.tensor([[y] for row, y in zip(xs, ys) for _ in row], dtype=torch.float64)

    def to(self, device: Any) -> "Terms":
        return self


def squared_error(model: "torch.nn.Module", batch: Terms) -> tuple["torch.Tensor", int]:
    return ((model(batch.x) - batch.y) ** 2).sum(), batch.x.shape[0]


def full_batch_reference(agent: int) -> list["torch.Tensor"]:
    """One ordinary optimizer step per global batch on all of its values at once."""
    model = initial_model(agent)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        batch = Terms(pa.Table.from_pylist(agent_rows(agent, step)))
        opt.zero_grad()
        loss, n = squared_error(model, batch)
        (loss / n).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class Arriving:
    """A subscription whose trainer arrives in this step's place of :data:`ORDERS` (it waits
    until the barrier shows the trainers before it), and notes when it arrived and when the
    barrier answered."""

    def __init__(self, s: Any, sub: Any, agent: int) -> None:
        self.s, self.sub, self.agent = s, sub, agent
        self.times: list[tuple[float, float]] = []
        self.off_version = 0

    def next(self, timeout: float | None = None) -> Any:
        mb = self.sub.next(timeout)
        if mb is not None:
            versions = set(mb.data.column("policy_version").to_pylist())
            self.off_version += sum(1 for v in versions if v != mb.version or v != self.sub.version)
        return mb

    def bump_version(self, weights_uri: str | None = None) -> int:
        step = len(self.times)
        order = ORDERS[step]
        ahead = {AGENTS[a] for a in order[:order.index(self.agent)]}
        deadline = time.monotonic() + 120
        while not ahead <= set(self.s.barrier(AGENTS[self.agent])["arrived"]):
            assert time.monotonic() < deadline, f"{ahead} never arrived"
            time.sleep(0.02)
        time.sleep(0.05)  # the barrier's clock and time.time() are apart by a call
        arrived = time.time()
        version = self.sub.bump_version(weights_uri)
        self.times.append((arrived, time.time()))
        return version


def train_agent(location: str, agent: int, weights_dir: str, out: Any) -> None:
    """A trainer process: its agent's subscription, float64 accumulation, barrier bumps."""
    from consumers.trainer import TorchTrainer

    try:
        model = initial_model(agent)
        trainer = TorchTrainer(model, torch.optim.Adam(model.parameters(), lr=LR),
                               squared_error, weights_dir, name=AGENTS[agent], collate_fn=Terms)
        with RemoteStore(location) as s:
            sub = s.subscribe(AGENTS[agent], MICRO, GLOBAL, consumer=f"trainer-{agent}")
            wrapped = Arriving(s, sub, agent)
            try:
                reports = list(trainer.run(wrapped, max_steps=STEPS, idle_timeout=120))
            finally:
                sub.close()
        out.put({"agent": agent, "versions": [r.version for r in reports],
                 "micro": [r.micro_batches for r in reports], "times": wrapped.times,
                 "off_version": wrapped.off_version,
                 "params": [p.detach().tolist() for p in model.parameters()]})
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put({"agent": agent, "error": repr(e)})


def produce(location: str, agent: int, errors: list[BaseException]) -> None:
    """Each version's samples once the group is at it, in three bursts."""
    try:
        with RemoteStore(location) as s:
            for step in range(STEPS):
                assert s.wait_version(AGENTS[agent], step, timeout=120) == step
                rows = agent_rows(agent, step)
                for burst in (rows[:5], rows[5:9], rows[9:]):
                    s.put(AGENTS[agent], [{**r, "policy_version": step} for r in burst])
                    time.sleep(0.05 * (agent + 1))
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_three_trainer_processes_update_in_lock_step(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with running_server(tmp_path / "x.duckdb") as server:
        with RemoteStore(server.location) as s:
            for name in AGENTS:
                s.create_table(name, COLUMNS, version_group=GROUP, max_staleness=0)
            s.set_barrier_timeout(AGENTS[0], 120)
            trainers = [ctx.Process(target=train_agent, args=(
                server.location, a, str(tmp_path / "weights"), out), daemon=True)
                for a in range(len(AGENTS))]
            for p in trainers:
                p.start()
            errors: list[BaseException] = []
            producers = [threading.Thread(target=produce, args=(server.location, a, errors),
                                          daemon=True) for a in range(len(AGENTS))]
            for t in producers:
                t.start()
            results = {}
            for _ in trainers:
                r = out.get(timeout=240)
                results[r["agent"]] = r
            for p in trainers:
                p.join(timeout=60)
            for t in producers:
                t.join(timeout=60)
            assert not errors, errors
            assert all("error" not in r for r in results.values()), results

            # Lock-step: every trainer saw versions 1, 2, 3; the group was bumped once a step.
            assert all(r["versions"] == [1, 2, 3] for r in results.values()), results
            assert all(r["micro"] == [GLOBAL // MICRO] * STEPS for r in results.values())
            history = s.query("SELECT version, weights_uri FROM _expstore_versions WHERE "
                              "version_group = ? ORDER BY version", [GROUP]).to_pylist()
            assert [h["version"] for h in history] == [0, 1, 2, 3]
            for step in range(STEPS):
                times = [results[a]["times"][step] for a in range(len(AGENTS))]
                last_arrival = max(arrived for arrived, _ in times)
                # No trainer got the new version before the last one arrived ...
                assert all(answered >= last_arrival for _, answered in times)
                # ... and they arrived in the shuffled order of this step.
                by_arrival = sorted(range(len(AGENTS)), key=lambda a: times[a][0])
                assert tuple(by_arrival) == tuple(sorted(
                    range(len(AGENTS)), key=lambda a: ORDERS[step].index(a)))
            for a, name in enumerate(AGENTS):
                # Each agent's own weights, recorded by the one bump of the last step.
                assert s.weights_uri(name).endswith(f"/{name}-step{STEPS:08d}.pt")
                rows = s.query(f"SELECT policy_version, consumed, consumed_version, stale, "
                               f"delivery_count FROM {name}").to_pylist()
                assert len(rows) == GLOBAL * STEPS
                # Every sample trained once, under the version that generated it: nothing
                # stale, nothing off-version.
                assert all(r["consumed"] and not r["stale"] and r["delivery_count"] == 1
                           and r["consumed_version"] == r["policy_version"] for r in rows)
                assert results[a]["off_version"] == 0

    for a in range(len(AGENTS)):
        expected = full_batch_reference(a)
        got = [torch.tensor(p, dtype=torch.float64) for p in results[a]["params"]]
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
        moved = max(float((g - p0.detach()).abs().max())
                    for g, p0 in zip(got, initial_model(a).parameters()))
        assert moved > 1e-2  # the steps happened, far above the tolerance
