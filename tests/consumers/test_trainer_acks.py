"""The trainers ack each micro-batch without waiting and wait for every answer before the bump.

Real components: the embedded store on a DuckDB file in tmp_path, or the Flight server over one
(127.0.0.1, port 0) with the remote client. A lease that ends while its micro-batch trains must
stop the step before the version moves: the rows go back to the table, and no policy version
claims to have trained on them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

import store  # noqa: E402
from consumers.acks import PendingAcks  # noqa: E402
from consumers.trainer import TorchTrainer, grpo_loss  # noqa: E402
from flight_fixtures import running_server  # noqa: E402
from flight_server.client import RemoteStore  # noqa: E402
from producers.rollout.tiny_lm import build_tiny_lm  # noqa: E402
from store.errors import LeaseExpired  # noqa: E402
from waiting import wait_until  # noqa: E402

COLUMNS = {"token_ids": "list<int32>", "prompt_len": "int32", "logprobs": "list<float32>",
           "reward": "float64"}


@contextlib.contextmanager
def opened(via: str, tmp_path: Any) -> Iterator[Any]:
    if via == "embedded":
        with store.connect(str(tmp_path / "x.duckdb")) as s:
            yield s
    else:
        with running_server(tmp_path / "x.duckdb") as server, RemoteStore(server.location) as s:
            yield s


def fill(s: Any) -> None:
    s.create_table("agent", COLUMNS)
    s.put("agent", [{"sample_id": f"q{i // 2}_0_{i % 2}", "token_ids": [256, 1, 2, 3],
                     "prompt_len": 2, "logprobs": [-5.0, -5.0], "reward": float(i % 2)}
                    for i in range(8)])


@pytest.mark.parametrize("via", ["embedded", "flight"])
def test_acks_are_sent_at_once_and_settled_before_the_bump(tmp_path, via: str) -> None:
    with opened(via, tmp_path) as s:
        fill(s)
        model = build_tiny_lm(seed=0)
        trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), grpo_loss,
                               tmp_path / "w")
        with contextlib.closing(s.subscribe("agent", 4, 8, group_by="input_id",
                                            group_size=2)) as sub:
            first = sub.next(timeout=10)
            trainer.train_micro_batch(first)
            assert len(trainer._acks) == 1  # sent, its answer not waited for
            second = sub.next(timeout=10)  # the slot was freed by the ack that was sent
            trainer.train_micro_batch(second)
            step = trainer.finish_global_batch(sub)
            assert len(trainer._acks) == 0
        assert step.version == 1 == s.get_version("agent")
        stats = s.stats("agent")["agent"]
        assert stats["consumed"] == 8 and stats["processing"] == 0


@pytest.mark.parametrize("via", ["embedded", "flight"])
def test_an_ack_that_fails_stops_the_step_before_the_bump(tmp_path, via: str) -> None:
    with opened(via, tmp_path) as s:
        fill(s)
        model = build_tiny_lm(seed=0)
        calls = []

        def slow_second_loss(m: Any, b: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:  # the lease ends while this micro-batch trains
                wait_until(lambda: not s.leases("agent"), timeout=30,
                           message="the second micro-batch's lease to expire")
            return grpo_loss(m, b)

        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               slow_second_loss, tmp_path / "w")
        with contextlib.closing(s.subscribe("agent", 4, 8, group_by="input_id", group_size=2,
                                            lease_seconds=1.0)) as sub:
            with pytest.raises(LeaseExpired):
                list(trainer.run(sub, max_steps=1, idle_timeout=10))
        assert s.get_version("agent") == 0  # no version claims the step
        # and there was no step: the expired micro-batch's rows go to another consumer, so its
        # gradient must not reach the model (before, the step was taken and published first)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(p.grad is None for p in model.parameters())
        assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())
        stats = s.stats("agent")["agent"]
        assert stats["consumed"] == 4 and stats["consumed"] + stats["ready"] == 8


def test_pending_acks_raise_the_first_error_and_forget_settled_ones() -> None:
    from concurrent.futures import Future

    class Answer:
        def __init__(self, error: BaseException | None) -> None:
            self.future: Future = Future()
            self.error = error

        def ack(self, wait: bool = True) -> Future:
            assert wait is False
            if self.error is None:
                self.future.set_result({"acked": 1})
            else:
                self.future.set_exception(self.error)
            return self.future

    class OwnMicroBatch:  # a caller's own micro-batch type, from before acks could be sent
        acked = 0

        def ack(self) -> None:
            OwnMicroBatch.acked += 1

    acks = PendingAcks()
    acks.send(OwnMicroBatch())
    assert OwnMicroBatch.acked == 1 and len(acks) == 0  # acked as it acks, nothing to wait for
    acks.send(Answer(None))
    acks.send(Answer(LeaseExpired("claim c1 ended")))
    assert len(acks) == 2
    with pytest.raises(LeaseExpired, match="c1"):
        acks.settle()
    assert len(acks) == 0
    acks.settle()  # nothing left: returns at once


def test_an_ack_left_unanswered_is_unavailable_not_a_bare_timeout():
    """An answer that never comes (a server that hangs without closing its stream) ends the
    wait with the project's retryable error, naming the wait."""
    from concurrent.futures import Future

    class Silent:
        def ack(self, wait: bool = True) -> Future:
            return Future()  # sent, never answered

    acks = PendingAcks(timeout=0.05)
    acks.send(Silent())
    with pytest.raises(store.Unavailable, match="no answer to an ack within 0.05 s"):
        acks.settle()


def test_ack_at_step_refuses_a_subscription_that_cannot_hold_a_global_batch(tmp_path) -> None:
    """Acks held until the step need a whole global batch in flight: a subscription with a
    smaller max_in_flight is refused before it claims anything, naming both numbers (it would
    otherwise stop at its second micro-batch with "2 micro-batches are in flight")."""
    with store.connect(str(tmp_path / "x.duckdb")) as s:
        fill(s)
        model = build_tiny_lm(seed=0)
        trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), grpo_loss,
                               tmp_path / "w", ack_at_step=True)
        sub = s.subscribe("agent", micro_batch_size=2, global_batch_size=8)
        with pytest.raises(ValueError, match="4 micro-batches .* max_in_flight is 2"):
            next(trainer.run(sub, max_steps=1))
        assert s.stats("agent")["agent"]["ready"] == 8
        sub.close()


def test_ack_at_step_acks_the_global_batch_after_the_step(tmp_path) -> None:
    """Nothing of a global batch is acked before its optimizer step; all of it is after."""
    with store.connect(str(tmp_path / "x.duckdb")) as s:
        fill(s)
        model = build_tiny_lm(seed=0)
        consumed_at_loss: list[int] = []

        def loss(m: Any, b: Any) -> Any:
            consumed_at_loss.append(s.stats("agent")["agent"]["consumed"])
            return grpo_loss(m, b)

        trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss,
                               tmp_path / "w", ack_at_step=True)
        with s.subscribe("agent", micro_batch_size=2, global_batch_size=8,
                         max_in_flight=4) as sub:
            steps = list(trainer.run(sub, max_steps=1))
        assert [(r.version, r.micro_batches) for r in steps] == [(1, 4)]
        assert consumed_at_loss == [0, 0, 0, 0]
        assert s.stats("agent")["agent"]["consumed"] == 8
