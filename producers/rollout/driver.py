"""The rollout driver: a :class:`RolloutBackend` writing samples to an experience table.

For every :class:`RolloutRequest` the driver samples ``n`` responses, writes each as one sample
``{input_id}_{turn}_{trajectory_id}`` (``trajectory_id`` is the sample index) through an
:class:`producers.writer.ExperienceWriter`, in two parts as a real rollout produces them:

1. the generation: ``prompt``, ``response``, ``token_ids`` (prompt and response tokens, what the
   collator trains on), ``logprobs`` (response tokens only), ``prompt_len``, and the request's
   extra columns (``next_agent_id``, a parent id, …);
2. the reward from the user's reward function.

Both parts carry the policy version the generation used (:attr:`Generation.policy_version`);
the final part also carries ``finished_version``, the store's version when the sample was done.
With ``stream_partial=True`` the growing response is upserted every ``partial_every`` tokens with
``response_status = false`` (SQL sees live responses; trainers do not, the row is not ready), and
the final response sets the status to true.

The driver reloads weights when the trainer bumps the version: the writer's ``on_bump`` hands it
``(version, weights_uri)`` and the backend loads the published file before any later generation
(the backend's lock guarantees a generation never straddles a swap). :meth:`RolloutDriver.rollout`
waits, with a deadline, until the backend holds at least the version it is asked for, so a caller
that runs strictly on-policy rounds (round ``r`` needs version ``base + r``) never generates under
old weights.

Example (embedded store, tiny CPU model):
    >>> import store, tempfile, os
    >>> from producers.writer import ExperienceWriter
    >>> from producers.rollout.tiny_lm import TinyLMBackend
    >>> s = store.connect(os.path.join(tempfile.mkdtemp(), "x.duckdb"))
    >>> _ = s.create_table("solver", ROLLOUT_COLUMNS)
    >>> with ExperienceWriter(s, "solver") as w:
    ...     driver = RolloutDriver(TinyLMBackend(seed=0), w, lambda req, gen: float(len(gen.text)),
    ...                            n=2, max_new_tokens=4)
    ...     samples = driver.rollout(RolloutRequest("q1", "2+2="))
    >>> [x.sample_id for x in samples]
    ['q1_0_0', 'q1_0_1']
    >>> s.query("SELECT count(*) AS n FROM solver WHERE reward_status").column("n")[0].as_py()
    2
    >>> s.close()
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from store.naming import format_sample_id

from .base import Generation, PartialGeneration, RolloutBackend, SamplingConfig

log = logging.getLogger("expstore.rollout")

__all__ = ["ROLLOUT_COLUMNS", "RewardFn", "RolloutDriver", "RolloutRequest", "RolloutSample",
           "SampleColumnsFn"]

#: The data columns the driver writes; ``create_table(name, ROLLOUT_COLUMNS)`` makes a table for
#: it (add the columns of any request extras).
ROLLOUT_COLUMNS: dict[str, str] = {
    "prompt": "string", "response": "string", "token_ids": "list<int32>",
    "logprobs": "list<float32>", "prompt_len": "int32", "reward": "float64",
}


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to roll out.

    Args:
        input_id: the prompt's id; samples are ``{input_id}_{turn}_{k}`` for ``k < n``.
        prompt: the prompt text.
        turn: the turn (or agent step) this prompt belongs to.
        columns: extra data columns written with every sample of this prompt (e.g.
            ``next_agent_id``, the id of the upstream sample).
    """

    input_id: str
    prompt: str
    turn: int = 0
    columns: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutSample:
    """What the driver wrote for one generation."""

    sample_id: str
    request: RolloutRequest
    generation: Generation
    reward: float
    policy_version: int
    finished_version: int
    #: Columns decided from this generation (``sample_columns``), written with it.
    columns: Mapping[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.generation.text


#: ``reward_fn(request, generation) -> float``.
RewardFn = Callable[[RolloutRequest, Generation], float]
#: ``sample_columns(request, generation) -> {column: value}``: columns decided from a sample's
#: own output (e.g. the next agent), written with the sample.
SampleColumnsFn = Callable[[RolloutRequest, Generation], Mapping[str, Any]]


class RolloutDriver:
    """Run a rollout backend against one experience table (see the module docstring).

    Args:
        backend: the :class:`RolloutBackend` (tiny LM, vLLM, …).
        writer: the table's :class:`ExperienceWriter`; the driver registers an ``on_bump``
            callback on it. The writer must track the version (its default).
        reward_fn: ``reward_fn(request, generation) -> float``.
        n: samples per prompt.
        max_new_tokens, sampling: passed to :meth:`RolloutBackend.generate`.
        stream_partial: upsert growing responses with ``response_status = false``.
        partial_every: tokens between two partial upserts of one sample.
        max_regenerations: times a generation whose version went stale (the trainer bumped while
            it ran) is redone before it is dropped.
        load_published: load the weights the store records for the current version, if any,
            when the driver starts (a producer joining a run that already trained).
        sample_columns: columns decided per sample from its generation (e.g. where a
            multi-agent workflow routes it next); they override the request's ``columns``.

    Thread safety: :meth:`rollout` may be called from many threads at once (the backend
    serialises generation; the writer is thread-safe).
    """

    def __init__(self, backend: RolloutBackend, writer: Any, reward_fn: RewardFn, *, n: int = 4,
                 max_new_tokens: int = 32, sampling: SamplingConfig | None = None,
                 stream_partial: bool = False, partial_every: int = 8,
                 max_regenerations: int = 2, load_published: bool = True,
                 sample_columns: SampleColumnsFn | None = None) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if partial_every < 1:
            raise ValueError(f"partial_every must be >= 1, got {partial_every}")
        self.backend = backend
        self.writer = writer
        self.table: str = writer.table
        self.reward_fn = reward_fn
        self.n = n
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.stream_partial = stream_partial
        self.partial_every = partial_every
        self.max_regenerations = max_regenerations
        self.sample_columns = sample_columns
        self.max_staleness = int(writer.store.describe(self.table).get("max_staleness", 0))
        self._cond = threading.Condition()
        #: Version of the weights the backend held when the driver started without published
        #: weights (the initial weights count as that version).
        self.base_version = int(writer.version)
        # A bump without a weights URI keeps the weights: alias[v] is the newest version that
        # still means "the weights of version v".
        self._alias: dict[int, int] = {}
        self._loaded = self.base_version
        self.reloads = 0
        self.samples_written = 0
        self.partial_writes = 0
        self.dropped_stale = 0
        self.reload_errors: list[BaseException] = []
        #: what the last failed load was, until a load succeeds: (version, weights_uri, error)
        self._failed_load: tuple[int, str | None, BaseException] | None = None
        if load_published:
            uri = writer.store.weights_uri(self.table)
            if uri is not None and backend.weights_uri != uri:
                backend.load_weights(uri, self.base_version)
                self.reloads += 1
        writer.on_bump(self._on_bump)

    # -- versions ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version the backend's current weights are (or stand for)."""
        with self._cond:
            return self._loaded

    def _tag(self, generation_version: int | None) -> int:
        v = self.base_version if generation_version is None else int(generation_version)
        return self._alias.get(v, v)

    def _on_bump(self, version: int, weights_uri: str | None) -> None:
        """The writer saw a bump: load the published weights before the next generation."""
        try:
            if weights_uri is not None and self.backend.weights_uri != weights_uri:
                self.backend.load_weights(weights_uri, version)
                self.reloads += 1
            elif weights_uri is None:
                held = self.backend.policy_version
                self._alias[self.base_version if held is None else int(held)] = version
        except Exception as e:  # noqa: BLE001 - recorded; rollouts keep waiting for a good load
            log.exception("loading weights %r for version %d failed", weights_uri, version)
            self.reload_errors.append(e)
            self._failed_load = (version, weights_uri, e)
            return
        with self._cond:
            self._failed_load = None
            self._loaded = max(self._loaded, version)
            self._cond.notify_all()

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until the backend holds weights of at least ``version``; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._loaded < version:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
            return True

    # -- rollouts ------------------------------------------------------------------------------
    def rollout(self, request: RolloutRequest, *, min_version: int | None = None,
                timeout: float | None = 60.0) -> list[RolloutSample]:
        """Generate ``n`` samples for ``request`` and write them; return what was written.

        Args:
            min_version: generate only with weights of at least this version (default: the
                store's current version as the writer last saw it).
            timeout: seconds to wait for those weights.

        Raises:
            TimeoutError: the weights did not arrive in time (naming why the last load
                failed, if one did: e.g. a published file this machine cannot read).
        """
        for attempt in range(self.max_regenerations + 1):
            need = self.writer.version if min_version is None else min_version
            if not self.wait_for_version(need, timeout):
                failed = self._failed_load
                cause = "" if failed is None else (
                    f"; loading the weights of version {failed[0]} from {failed[1]!r} failed: "
                    f"{type(failed[2]).__name__}: {failed[2]} (the rollout machine must be able "
                    "to read what the trainer publishes)")
                raise TimeoutError(f"the weights of version {need} of {self.table!r} did not "
                                   f"arrive within {timeout} s (loaded: {self.version}){cause}")
            gens = self._generate(request)
            version = self._tag(gens[0].policy_version)
            # A bump that landed while we generated makes these samples too old for a strictly
            # on-policy table: writing them would be refused. Redo them under the new weights.
            if version >= self.writer.version - self.max_staleness:
                return self._write(request, gens, version)
            log.info("generation for %r used version %d, the table is at %d: regenerating",
                     request.input_id, version, self.writer.version)
        self.dropped_stale += len(gens)
        return []

    def run(self, requests: Iterable[RolloutRequest], *, min_version: int | None = None,
            timeout: float | None = 60.0) -> list[RolloutSample]:
        """:meth:`rollout` for each request in turn; returns all samples written."""
        out: list[RolloutSample] = []
        for request in requests:
            out.extend(self.rollout(request, min_version=min_version, timeout=timeout))
        return out

    def _generate(self, request: RolloutRequest) -> list[Generation]:
        on_partial = self._partial_writer(request) if self.stream_partial else None
        return self.backend.generate([request.prompt], self.n, self.max_new_tokens,
                                     sampling=self.sampling, on_partial=on_partial)

    def _partial_writer(self, request: RolloutRequest) -> Callable[[PartialGeneration], None]:
        def on_partial(p: PartialGeneration) -> None:
            # Runs under the backend's lock: the weights (and so the version) cannot change
            # until this generation ends, so the backend's version here is the generation's.
            if p.finished or len(p.token_ids) % self.partial_every:
                return
            self.writer.write({
                "sample_id": format_sample_id(request.input_id, request.turn, p.sample_index),
                "policy_version": self._tag(self.backend.policy_version),
                "prompt": request.prompt, "response": p.text, "response_status": False})
            self.partial_writes += 1
        return on_partial

    def _write(self, request: RolloutRequest, gens: list[Generation],
               version: int) -> list[RolloutSample]:
        finished = max(version, int(self.writer.version))
        rows, samples, decided = [], [], []
        for g in gens:
            sid = format_sample_id(request.input_id, request.turn, g.sample_index)
            own = dict(self.sample_columns(request, g)) if self.sample_columns else {}
            decided.append(own)
            rows.append({
                "sample_id": sid, "policy_version": version, "finished_version": finished,
                "prompt": request.prompt,
                # Explicit: a buffered partial write of this sample said false, and parts of one
                # sample merge in the writer's buffer.
                "response": g.text, "response_status": True,
                "token_ids": g.full_token_ids, "logprobs": g.logprobs,
                "prompt_len": g.prompt_len, **request.columns, **own})
        self.writer.write(rows)
        for g, row, own in zip(gens, rows, decided):
            reward = float(self.reward_fn(request, g))
            self.writer.write({"sample_id": row["sample_id"], "policy_version": version,
                               "reward": reward})
            samples.append(RolloutSample(row["sample_id"], request, g, reward, version, finished,
                                         own))
        self.samples_written += len(samples)
        return samples
