"""A reference multi-agent workflow: planner → solver → verifier, one experience table per agent.

Every agent has its own policy (a :class:`RolloutBackend`), its own table and its own trainer. A
query goes to the planner; each planner sample's output becomes a solver prompt and each solver
sample's output a verifier prompt. Which agent gets a sample's output is the sample's
``next_agent_id`` (written with it, so SQL sees the routing too); the verifier's is null: the
trajectory ends. With ``n`` samples per prompt, one query yields ``n`` planner, ``n²`` solver and
``n³`` verifier samples. Ids trace the tree: the solver prompt made from planner sample
``q3_0_1`` has input id ``q3.1`` (samples ``q3.1_1_k``), the verifier prompt made from solver
sample ``q3.1_1_0`` has input id ``q3.1.0``; the ``parent_id`` column names the upstream sample.
A sample's turn is its depth in the trajectory (the first agent's samples are turn 0).

Routing per sample: an agent with a ``route`` decides each sample's next agent at run time from
the sample's own output (``route(request, generation) -> agent id or None``), so trajectories
branch by what the models say, and may cycle (a debate between two agents). ``max_turns`` bounds
every trajectory: a sample at turn ``max_turns - 1`` goes nowhere (its ``next_agent_id`` is
null), whatever its route says. Routed workflows need ``max_turns``; a chain of fixed
``next_agent_id`` must not cycle without one.

Scheduling follows FlexMARL's parallel sampling (section 5.1): rollouts are dependency-driven
asyncio tasks. All queries run at once (inter-query parallelism) and the branches of one query
run at once too (intra-query parallelism); an output is dispatched to the next agent as soon as
it exists. Blocking work (generation, writes) runs in a thread pool. A query with a long-tail
latency therefore delays only its own branches, never other queries.

Versions: strictly on-policy rounds. Queries are processed in rounds of ``queries_per_round``;
round ``r`` of agent ``a`` generates with version ``base_a + r`` of ``a``'s policy, and waits
for it. Each agent's trainer takes one optimizer step per round: its global batch is exactly the
round's samples of that agent (:meth:`MultiAgentWorkflow.batch_sizes`), so no sample is written
after the bump that would make it stale, and a trainer starts on micro-batches while the round's
other rollouts, long tails included, are still running: the pipeline of section 4.3.

Version groups: one per agent by default (the table's own name): the agents do not share
parameters and each trainer bumps its own version when its agent's global batch is done.
``create_tables(version_group="team")`` puts them in one group instead, for the paper's unified
weight updating: each trainer's bump then arrives at the group's barrier, and every agent's
version advances once all trainers have finished the round (store/barrier.py); an arrival stales
no other agent's samples.

With routing per sample, how many samples an agent gets in a round depends on what the models
say: :meth:`MultiAgentWorkflow.batch_sizes` (fixed global batches) is for fixed chains only.

Example (embedded store, tiny CPU models; see ``consumers/demo.py`` for trainers):
    >>> import store, tempfile, os
    >>> from producers.rollout.tiny_lm import TinyLMBackend
    >>> s = store.connect(os.path.join(tempfile.mkdtemp(), "x.duckdb"))
    >>> wf = MultiAgentWorkflow(s, reference_agents(), n=2, max_new_tokens=4,
    ...                         latency=LatencyModel(median=0.001), table_prefix="ex_")
    >>> wf.create_tables()
    >>> backends = {a.name: TinyLMBackend(seed=i) for i, a in enumerate(wf.agents)}
    >>> result = wf.run([("q0", "2+3?")], queries_per_round=1, backends=backends)
    >>> result.samples
    {'ex_planner': 2, 'ex_solver': 4, 'ex_verifier': 8}
    >>> s.close()
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .rollout.base import Generation, RolloutBackend, SamplingConfig
from .rollout.driver import ROLLOUT_COLUMNS, RewardFn, RolloutDriver, RolloutRequest, RolloutSample
from .writer import ExperienceWriter

log = logging.getLogger("expstore.workflow")

__all__ = ["Agent", "LatencyModel", "MultiAgentWorkflow", "WorkflowResult", "WORKFLOW_COLUMNS",
           "reference_agents"]

#: The columns of every agent table: the driver's, plus the routing and tracing columns.
WORKFLOW_COLUMNS: dict[str, str] = {**ROLLOUT_COLUMNS, "query_id": "string",
                                    "parent_id": "string", "next_agent_id": "int32"}
#: ``parent_id`` and ``next_agent_id`` may be null (a planner has no parent, a verifier ends).
REQUIRED = [*ROLLOUT_COLUMNS, "query_id"]


@dataclass(frozen=True)
class Agent:
    """One agent of the workflow.

    Args:
        name: the agent's name (its table is ``table_prefix + name``).
        agent_id: the id other agents' ``next_agent_id`` refers to.
        next_agent_id: where this agent's outputs go; None ends the trajectory.
        make_prompt: ``make_prompt(query_text, upstream_text)`` builds this agent's prompt
            (``upstream_text`` is None for the first agent).
        reward_fn: ``reward_fn(request, generation) -> float``.
        route: ``route(request, generation) -> agent id or None``: the next agent of each
            sample, decided from its own output at run time (None: ``next_agent_id`` for all).
    """

    name: str
    agent_id: int
    next_agent_id: int | None
    make_prompt: Callable[[str, str | None], str]
    reward_fn: RewardFn
    route: Callable[[RolloutRequest, Generation], int | None] | None = None


def _clean(text: str, limit: int) -> str:
    """Keep a model's output printable and short before it becomes the next prompt."""
    return "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in text)[:limit]


def _share(text: str, allowed: Callable[[str], bool]) -> float:
    return sum(map(allowed, text)) / max(len(text), 1)


def reference_agents() -> list[Agent]:
    """Planner → solver → verifier with toy rewards a tiny byte-level model can move."""
    return [
        Agent("planner", 0, 1, lambda q, _up: f"plan: {q}",
              lambda req, g: _share(g.text, lambda c: c.isalpha() or c == " ")),
        Agent("solver", 1, 2, lambda q, up: f"{q} | plan: {_clean(up or '', 24)} | answer:",
              lambda req, g: _share(g.text, str.isdigit) + 0.1 * (g.finish_reason == "stop")),
        Agent("verifier", 2, None, lambda q, up: f"check: {_clean(up or '', 24)} ->",
              lambda req, g: float(g.text[:1].lower() in ("y", "n"))
              + _share(g.text, str.islower)),
    ]


@dataclass
class LatencyModel:
    """Injected inference latency with a long tail (seconds), per rollout request.

    ``median * exp(sigma * N(0, 1))``, times ``slow_factor`` with probability
    ``slow_fraction``; ``slow_queries`` adds a fixed delay to a query's first agent (a
    deliberately slow query). The latency is a sleep outside the backend: it stands for a remote
    inference server's time, which does not use this machine's CPU.
    """

    median: float = 0.02
    sigma: float = 0.6
    slow_fraction: float = 0.05
    slow_factor: float = 10.0
    slow_queries: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def sample(self, query_id: str, depth: int) -> float:
        delay = self.median * math.exp(self.sigma * self._rng.gauss(0.0, 1.0))
        if self._rng.random() < self.slow_fraction:
            delay *= self.slow_factor
        if depth == 0:
            delay += self.slow_queries.get(query_id, 0.0)
        return delay


@dataclass
class WorkflowResult:
    """What a run did, with the timings the demo's summary is made of (monotonic seconds)."""

    samples: dict[str, int]
    started: float
    finished: float
    #: query id → (start, end): from its first rollout's start to its last sample's write.
    queries: dict[str, tuple[float, float]]
    #: (table, start, end) of every rollout request, injected latency included.
    rollouts: list[tuple[str, float, float]]
    #: table → samples that went to the next agent.
    routed: dict[str, int]

    @property
    def wall_seconds(self) -> float:
        return self.finished - self.started


class MultiAgentWorkflow:
    """Run queries through the agents, writing every sample to its agent's table.

    Args:
        store: a store (``store.connect(...)``: embedded or ``grpc://``) for tables and writers.
        agents: the agents; the first one receives the queries.
        n: samples per prompt (and the group size of each agent's trainer).
        max_new_tokens, sampling: generation settings for every agent.
        latency: the injected long-tail latency.
        table_prefix: prefix of the agent tables (fresh names per run keep runs apart).
        max_workers: threads for generation and writes.
        version_timeout: seconds a round may wait for its agent's new version.
        max_turns: the most turns (agent steps) of one trajectory; needed when routing can
            cycle (an agent with a ``route``, or fixed ``next_agent_id`` s in a loop).
    """

    def __init__(self, store: Any, agents: Sequence[Agent], *, n: int = 2, max_new_tokens: int = 8,
                 sampling: SamplingConfig | None = None, latency: LatencyModel | None = None,
                 table_prefix: str = "", max_workers: int = 16,
                 version_timeout: float = 120.0, max_turns: int | None = None) -> None:
        if not agents:
            raise ValueError("a workflow needs at least one agent")
        ids = [a.agent_id for a in agents]
        if len(set(ids)) != len(ids):
            raise ValueError(f"agent ids must be unique, got {ids}")
        self.store = store
        self.agents = list(agents)
        self.by_id = {a.agent_id: a for a in agents}
        for a in agents:
            if a.next_agent_id is not None and a.next_agent_id not in self.by_id:
                raise ValueError(f"agent {a.name!r} routes to unknown agent id {a.next_agent_id}")
        if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        self.routes_per_sample = any(a.route is not None for a in agents)
        #: Agent name -> its turn in a fixed chain (the agents a fixed chain reaches); empty for
        #: routed or cycling workflows, whose agents may sit at any turn.
        self.depth = {} if self.routes_per_sample else self._depths(max_turns is not None)
        if not self.depth and max_turns is None:
            raise ValueError("routing decided per sample can cycle: give max_turns, the most "
                             "turns of one trajectory")
        self.max_turns = max_turns if max_turns is not None else len(self.depth)
        self.depth = {name: d for name, d in self.depth.items() if d < self.max_turns}
        self.reachable = set(self.depth) if self.depth else {a.name for a in agents}
        self.n = n
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.latency = latency or LatencyModel()
        self.tables = {a.name: f"{table_prefix}{a.name}" for a in agents}
        self.max_workers = max_workers
        self.version_timeout = version_timeout
        self.drivers: dict[str, RolloutDriver] = {}

    def _depths(self, bounded: bool) -> dict[str, int]:
        depth: dict[str, int] = {}
        agent, seen = self.agents[0], set()
        for d in itertools.count():
            if agent.agent_id in seen:
                if bounded:
                    return {}  # a cycle that max_turns bounds: agents at any turn
                raise ValueError(f"agent routing has a cycle at {agent.name!r}; give max_turns "
                                 "to bound it")
            seen.add(agent.agent_id)
            depth[agent.name] = d
            if agent.next_agent_id is None:
                break
            agent = self.by_id[agent.next_agent_id]
        return depth

    # -- set-up --------------------------------------------------------------------------------
    def create_tables(self, **options: Any) -> None:
        """One table per agent, each its own version group unless ``version_group`` is given
        (see the module docstring); ``options`` go to ``create_table``."""
        for a in self.agents:
            self.store.create_table(self.tables[a.name], WORKFLOW_COLUMNS, required=REQUIRED,
                                    **{"max_staleness": 0, "if_not_exists": True, **options})

    def batch_sizes(self, queries_per_round: int,
                    micro_batches: int = 4) -> dict[str, tuple[int, int, int]]:
        """Per table: ``(micro_batch_size, global_batch_size, group_size)`` for its trainer.

        The global batch is one round of that agent's samples,
        ``queries_per_round * n ** (depth + 1)``; micro-batches hold whole groups of ``n``.

        Raises:
            ValueError: routing is decided per sample, or cycles: a round's samples per agent
                are not known in advance.
        """
        if not self.depth:
            raise ValueError("with routing decided per sample (or a bounded cycle) the samples "
                             "an agent gets per round depend on the models' outputs: there is "
                             "no fixed global batch per round")
        out = {}
        for a in self.agents:
            if a.name not in self.depth:
                continue
            total = queries_per_round * self.n ** (self.depth[a.name] + 1)
            groups = total // self.n
            per = max(1, groups // micro_batches)
            while groups % per:
                per += 1
            out[self.tables[a.name]] = (per * self.n, total, self.n)
        return out

    # -- running -------------------------------------------------------------------------------
    def run(self, queries: Sequence[tuple[str, str]], queries_per_round: int,
            backends: Mapping[str, RolloutBackend], *,
            on_sample: Callable[[str, RolloutSample], None] | None = None) -> WorkflowResult:
        """Roll out ``queries`` (``(query_id, text)`` pairs) in on-policy rounds.

        Args:
            queries_per_round: queries per version round; each agent's trainer must use the
                global batch size :meth:`batch_sizes` gives for it.
            backends: agent name → its rollout backend.
            on_sample: called (from a worker thread) for every sample written.

        Raises:
            TimeoutError: a round waited more than ``version_timeout`` for its version.
        """
        missing = [a.name for a in self.agents if a.name in self.reachable
                   and a.name not in backends]
        if missing:
            raise ValueError(f"no rollout backend for agents {missing}")
        writers = {a.name: ExperienceWriter(self.store, self.tables[a.name], batch_rows=64,
                                            flush_interval=0.01)
                   for a in self.agents if a.name in self.reachable}
        try:
            self.drivers = {
                name: RolloutDriver(backends[name], w, self._agent(name).reward_fn, n=self.n,
                                    max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                    sample_columns=self._router(self._agent(name)))
                for name, w in writers.items()}
            run = _Run(self, queries, queries_per_round, on_sample)
            result = asyncio.run(run.main())
            for w in writers.values():
                w.flush(timeout=60)
            result.finished = time.monotonic()
            return result
        finally:
            for w in writers.values():
                try:
                    w.close(timeout=30)
                except Exception as e:  # noqa: BLE001 - the run's own error matters more
                    log.warning("closing the writer of %r failed: %s", w.table, e)

    def _agent(self, name: str) -> Agent:
        return next(a for a in self.agents if a.name == name)

    def _router(self, agent: Agent) -> Callable[[RolloutRequest, Generation], dict[str, Any]]:
        """The ``next_agent_id`` of each of ``agent``'s samples, from its own output."""
        def next_agent(request: RolloutRequest, generation: Generation) -> dict[str, Any]:
            if request.turn + 1 >= self.max_turns:
                return {"next_agent_id": None}  # the turn limit ends every trajectory
            nxt = agent.route(request, generation) if agent.route else agent.next_agent_id
            if nxt is not None and nxt not in self.by_id:
                raise ValueError(f"agent {agent.name!r} routed sample of {request.input_id!r} "
                                 f"to unknown agent id {nxt!r}; agent ids: {sorted(self.by_id)}")
            return {"next_agent_id": nxt}
        return next_agent


class _Run:
    """The asyncio side of one :meth:`MultiAgentWorkflow.run`."""

    def __init__(self, wf: MultiAgentWorkflow, queries: Sequence[tuple[str, str]],
                 per_round: int, on_sample: Callable[[str, RolloutSample], None] | None) -> None:
        if per_round < 1:
            raise ValueError(f"queries_per_round must be >= 1, got {per_round}")
        self.wf = wf
        self.queries = list(queries)
        self.per_round = per_round
        self.on_sample = on_sample
        self.base = {name: d.version for name, d in wf.drivers.items()}
        self.samples = {wf.tables[name]: 0 for name in wf.drivers}
        self.routed = {wf.tables[name]: 0 for name in wf.drivers}
        self.query_times: dict[str, tuple[float, float]] = {}
        self.rollouts: list[tuple[str, float, float]] = []
        self.waiters: dict[str, list[tuple[int, asyncio.Future]]] = {n: [] for n in wf.drivers}
        self.lock = threading.Lock()

    async def main(self) -> WorkflowResult:
        loop = asyncio.get_running_loop()
        def waker(name: str) -> Callable[[int, str | None], None]:
            def wake(version: int, uri: str | None) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(self._wake, name)
            return wake

        for name, driver in self.wf.drivers.items():
            driver.writer.on_bump(waker(name))
        started = time.monotonic()
        with ThreadPoolExecutor(self.wf.max_workers, thread_name_prefix="expstore-rollout") as pool:
            self.pool = pool
            await asyncio.gather(*(self._query(qid, text, i // self.per_round)
                                   for i, (qid, text) in enumerate(self.queries)))
        return WorkflowResult(dict(self.samples), started, time.monotonic(), self.query_times,
                              self.rollouts, dict(self.routed))

    # -- versions: an agent's round r waits for version base + r, without blocking a thread ---
    def _wake(self, name: str) -> None:
        version = self.wf.drivers[name].version
        keep = []
        for need, fut in self.waiters[name]:
            if need <= version:
                if not fut.done():
                    fut.set_result(version)
            else:
                keep.append((need, fut))
        self.waiters[name] = keep

    async def _version(self, name: str, need: int) -> None:
        if self.wf.drivers[name].version >= need:
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters[name].append((need, fut))
        try:
            await asyncio.wait_for(fut, self.wf.version_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"agent {name!r} waited {self.wf.version_timeout} s for version "
                               f"{need} (its trainer has not finished the previous global "
                               f"batch; is it running with the batch sizes of batch_sizes()?)"
                               ) from None

    # -- rollouts ----------------------------------------------------------------------------
    async def _query(self, qid: str, text: str, rnd: int) -> None:
        first = self.wf.agents[0]
        request = RolloutRequest(qid, first.make_prompt(text, None), 0, {
            "query_id": qid, "parent_id": None})
        started = await self._branch(first, request, text, rnd)
        self.query_times[qid] = (started, time.monotonic())

    async def _branch(self, agent: Agent, request: RolloutRequest, text: str, rnd: int) -> float:
        need = self.base[agent.name] + rnd
        await self._version(agent.name, need)
        started = time.monotonic()
        await asyncio.sleep(self.wf.latency.sample(request.columns["query_id"], request.turn))
        driver = self.wf.drivers[agent.name]
        samples = await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: driver.rollout(request, min_version=need,
                                              timeout=self.wf.version_timeout))
        table = self.wf.tables[agent.name]
        with self.lock:
            self.rollouts.append((table, started, time.monotonic()))
            self.samples[table] += len(samples)
        if self.on_sample is not None:
            for s in samples:
                self.on_sample(table, s)
        children = []
        for s in samples:
            nxt = s.columns.get("next_agent_id")  # decided from this sample's output
            if nxt is None:
                continue
            child = self.wf.by_id[nxt]
            traj = s.generation.sample_index
            child_request = RolloutRequest(
                f"{request.input_id}.{traj}", child.make_prompt(text, s.text),
                request.turn + 1, {"query_id": request.columns["query_id"],
                                   "parent_id": s.sample_id})
            children.append(self._branch(child, child_request, text, rnd))
        self.routed[table] += len(children)
        await asyncio.gather(*children)
        return started
