"""The rollout driver with the tiny CPU LM on a real store: samples, rewards, versions, reloads,
streamed partial responses."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

import store  # noqa: E402
from consumers.torch_collate import collate  # noqa: E402
from producers.rollout.driver import ROLLOUT_COLUMNS, RolloutDriver, RolloutRequest  # noqa: E402
from producers.rollout.tiny_lm import ByteTokenizer, TinyLMBackend, build_tiny_lm  # noqa: E402
from producers.rollout.weights import publish_state_dict  # noqa: E402
from producers.writer import ExperienceWriter  # noqa: E402
from thread_helpers import run_threads  # noqa: E402
from waiting import wait_until  # noqa: E402

COLUMNS = {**ROLLOUT_COLUMNS, "next_agent_id": "int32"}


def length_reward(request: RolloutRequest, gen) -> float:
    return float(len(gen.token_ids)) / 10


def eos_weights(directory, step: int) -> str:
    """Publish weights under which the model answers EOS at once (a visible policy change)."""
    sd = {k: v.clone() for k, v in build_tiny_lm(seed=0).state_dict().items()}
    sd["ln_f.weight"].zero_()
    sd["ln_f.bias"].fill_(1.0)
    sd["head.weight"].zero_()
    sd["head.weight"][ByteTokenizer.EOS] = 1.0
    return publish_state_dict(sd, directory, step)


@pytest.fixture
def s(tmp_path):
    st = store.connect(str(tmp_path / "x.duckdb"))
    st.create_table("solver", COLUMNS, max_staleness=0, required=list(ROLLOUT_COLUMNS))
    yield st
    st.close()


class RecordingWriter(ExperienceWriter):
    """The real writer; it also keeps what it was given, in order."""

    def __init__(self, *args, **kwargs) -> None:
        self.log: list[dict] = []
        self.on_write = None
        super().__init__(*args, **kwargs)

    def write(self, rows) -> None:
        batch = [rows] if isinstance(rows, dict) else list(rows)
        self.log.extend(dict(r) for r in batch)
        super().write(batch)
        if self.on_write is not None:
            self.on_write(batch)


def test_samples_are_written_with_ids_tokens_rewards_and_versions(s) -> None:
    with ExperienceWriter(s, "solver") as w:
        driver = RolloutDriver(TinyLMBackend(seed=0), w, length_reward, n=3, max_new_tokens=6)
        samples = driver.run([RolloutRequest("gsm_1", "2+2=", columns={"next_agent_id": 2}),
                              RolloutRequest("gsm_2", "3*3=", turn=1)])
    assert [x.sample_id for x in samples] == [f"gsm_1_0_{k}" for k in range(3)] + \
        [f"gsm_2_1_{k}" for k in range(3)]
    rows = {r["sample_id"]: r for r in s.query(
        "SELECT * FROM solver ORDER BY sample_id").to_pylist()}
    assert len(rows) == 6 and driver.samples_written == 6
    for x in samples:
        r = rows[x.sample_id]
        g = x.generation
        assert (r["prompt"], r["response"]) == (x.request.prompt, g.text)
        assert r["token_ids"] == g.prompt_token_ids + g.token_ids and r["prompt_len"] == g.prompt_len
        assert r["logprobs"] == pytest.approx(g.logprobs, rel=1e-6)
        assert r["reward"] == x.reward == len(g.token_ids) / 10
        assert r["policy_version"] == r["finished_version"] == x.policy_version == 0
        assert all(r[f"{c}_status"] for c in ROLLOUT_COLUMNS)
        assert r["next_agent_id"] == (2 if x.request.input_id == "gsm_1" else None)
    # the rows are ready and collate into a trainable batch
    claim = s.claim("solver", 6, group_by="input_id", group_size=3, min_rows=6)
    batch = collate(claim.data, group_size=3)
    assert batch.num_samples == 6 and batch.num_loss_tokens == sum(len(x.generation.token_ids)
                                                                   for x in samples)


def test_bump_reloads_weights_before_the_next_generation(s, tmp_path) -> None:
    backend = TinyLMBackend(seed=0)
    with ExperienceWriter(s, "solver") as w:
        driver = RolloutDriver(backend, w, length_reward, n=2, max_new_tokens=8)
        before = driver.rollout(RolloutRequest("q0", "hello"))
        assert {x.policy_version for x in before} == {0}
        # the trainer consumes version 0, publishes new weights and bumps with their URI
        w.flush(timeout=30)
        claim = s.claim("solver", 2)
        s.ack(claim.claim_id)
        uri = eos_weights(tmp_path / "weights", step=1)
        assert s.bump_version("solver", expected=0, weights_uri=uri) == 1
        after = driver.rollout(RolloutRequest("q1", "hello"), min_version=1, timeout=30)
    assert backend.weights_uri == uri and backend.policy_version == 1 and driver.reloads == 1
    assert all(x.policy_version == 1 and x.generation.token_ids == [ByteTokenizer.EOS]
               for x in after)
    versions = s.query("SELECT sample_id, policy_version FROM solver ORDER BY 1").to_pylist()
    assert versions == [{"sample_id": "q0_0_0", "policy_version": 0},
                        {"sample_id": "q0_0_1", "policy_version": 0},
                        {"sample_id": "q1_0_0", "policy_version": 1},
                        {"sample_id": "q1_0_1", "policy_version": 1}]


def test_weights_that_cannot_be_loaded_are_named_when_the_wait_ends(s, tmp_path) -> None:
    """A trainer on another machine publishes to a path this machine cannot read. Before, the
    rollout waited and said only that the weights did not arrive; the load's error was in a log."""
    backend = TinyLMBackend(seed=0)
    with ExperienceWriter(s, "solver") as w:
        driver = RolloutDriver(backend, w, length_reward, n=1, max_new_tokens=2)
        uri = eos_weights(tmp_path / "weights", step=1)
        for published in (tmp_path / "weights").iterdir():
            published.unlink()                       # what this machine sees of the trainer's disk
        assert s.bump_version("solver", expected=0, weights_uri=uri) == 1
        # The writer's version watch learns of the bump and tries the load on its own thread;
        # the rollout's short wait below must not race that on a slow machine.
        wait_until(lambda: driver.reload_errors, timeout=30, message="the failed load")
        with pytest.raises(TimeoutError) as raised:
            driver.rollout(RolloutRequest("q0", "x"), min_version=1, timeout=2)
    message = str(raised.value)
    assert "version 1" in message and f"from {uri!r} failed" in message, message
    assert backend.policy_version != 1 and driver.reload_errors


def test_rollout_waits_for_weights_with_a_deadline(s) -> None:
    with ExperienceWriter(s, "solver") as w:
        driver = RolloutDriver(TinyLMBackend(seed=0), w, length_reward, n=1, max_new_tokens=2)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="version 3"):
            driver.rollout(RolloutRequest("q0", "x"), min_version=3, timeout=0.3)
        assert time.monotonic() - started < 5


def test_partial_responses_stream_with_status_false_then_complete(s) -> None:
    seen_while_streaming: list[dict] = []
    with RecordingWriter(s, "solver") as w:
        def look(batch: list[dict]) -> None:
            # once, mid-generation: the growing response is in the store, the sample not ready
            if not seen_while_streaming and batch[0].get("response_status") is False:
                w.flush(timeout=30)
                seen_while_streaming.extend(s.query(
                    "SELECT sample_id, response, response_status, reward_status FROM solver "
                    "WHERE NOT response_status").to_pylist())
                assert not s.claim("solver", 10)  # nothing ready: trainers never see it
        w.on_write = look
        driver = RolloutDriver(TinyLMBackend(seed=1), w, length_reward, n=2, max_new_tokens=12,
                               stream_partial=True, partial_every=3)
        samples = driver.rollout(RolloutRequest("q7", "stream me"))
    assert seen_while_streaming and not seen_while_streaming[0]["reward_status"]
    assert driver.partial_writes > 0
    for x in samples:
        writes = [r for r in w.log if r["sample_id"] == x.sample_id]
        partial = [r for r in writes if r.get("response_status") is False]
        final = [r for r in writes if r.get("response_status") is True]
        assert partial and len(final) == 1 and writes[-1].get("reward") == x.reward
        assert all(x.text.startswith(r["response"]) or "\ufffd" in r["response"] for r in partial)
        assert writes.index(final[0]) > writes.index(partial[-1])
    rows = s.query("SELECT response, response_status, reward_status FROM solver "
                   "ORDER BY sample_id").to_pylist()
    assert [r["response"] for r in rows] == [x.text for x in samples]
    assert all(r["response_status"] and r["reward_status"] for r in rows)
    assert s.claim("solver", 10).data.num_rows == 2


class BumpingBackend(TinyLMBackend):
    """Simulates the trainer bumping (with new weights) while the first generation runs."""

    def __init__(self, s, writer_ref: list, weights_uri: str) -> None:
        super().__init__(seed=0)
        self.s, self.writer_ref, self.uri, self.calls = s, writer_ref, weights_uri, 0

    def _generate(self, *args):
        self.calls += 1
        if self.calls == 1:
            self.s.bump_version("solver", weights_uri=self.uri)
            deadline = time.monotonic() + 10
            while self.writer_ref[0].version < 1 and time.monotonic() < deadline:
                time.sleep(0.01)  # the writer's long-poll learns of the bump
        return super()._generate(*args)


def test_a_bump_during_generation_regenerates_instead_of_writing_stale(s, tmp_path) -> None:
    ref: list = []
    backend = BumpingBackend(s, ref, eos_weights(tmp_path / "w", step=1))
    with ExperienceWriter(s, "solver") as w:
        ref.append(w)
        driver = RolloutDriver(backend, w, length_reward, n=2, max_new_tokens=5)
        samples = driver.rollout(RolloutRequest("q0", "hi"), timeout=30)
    assert backend.calls == 2 and driver.dropped_stale == 0
    assert [x.policy_version for x in samples] == [1, 1]
    assert s.query("SELECT DISTINCT policy_version FROM solver").column(0).to_pylist() == [1]


def test_parts_of_different_samples_in_one_batch_claim_complete(s) -> None:
    """A reward function that flushes makes the writer send one sample's reward together with
    the next sample's generation in one put; a claim must return every value of both samples,
    not the nulls the put carried for the columns a sample did not write in it."""
    s.create_table("plain", ROLLOUT_COLUMNS)
    with ExperienceWriter(s, "plain", batch_rows=1000, flush_interval=10) as w:
        def flushing_reward(request, gen) -> float:
            w.flush(timeout=30)  # sends what is buffered: the previous reward + this generation
            return float(len(gen.token_ids))
        driver = RolloutDriver(TinyLMBackend(seed=2), w, flushing_reward, n=1, max_new_tokens=3)
        samples = driver.run([RolloutRequest(f"q{i}", "a") for i in range(3)])
    data = sorted(s.claim("plain", 10).data.to_pylist(), key=lambda r: r["sample_id"])
    assert [r["sample_id"] for r in data] == [x.sample_id for x in samples]
    for r, x in zip(data, samples):
        assert r["token_ids"] == x.generation.full_token_ids and r["reward"] == x.reward
        assert r["prompt"] == "a" and r["response"] == x.text


def test_concurrent_rollouts_share_one_backend(s) -> None:
    with ExperienceWriter(s, "solver") as w:
        driver = RolloutDriver(TinyLMBackend(seed=0), w, length_reward, n=2, max_new_tokens=4)
        errors = run_threads(lambda i: driver.rollout(RolloutRequest(f"q{i}", f"p{i}")), 6,
                             timeout=30)
    assert not errors and driver.samples_written == 12
    assert s.stats("solver")["solver"]["ready"] == 12
