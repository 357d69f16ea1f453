"""TrainerThread.stop() ends a trainer whose bump waits at the barrier for another agent.

Real components: the embedded store on a DuckDB file in tmp_path, or the Flight server over one
(127.0.0.1, port 0) with the remote client (the ``any_store`` fixture). Two agents' tables share
a version group; only one agent trains, so its bump waits at the barrier for the other, whose
trainer is gone. Before the fix ``join`` waited for the group's barrier timeout (600 s).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from consumers.trainer import TorchTrainer, TrainerThread, grpo_loss  # noqa: E402
from producers.rollout.tiny_lm import build_tiny_lm  # noqa: E402
from waiting import wait_until  # noqa: E402

COLUMNS = {"token_ids": "list<int32>", "prompt_len": "int32", "logprobs": "list<float32>",
           "reward": "float64"}


def test_stop_ends_a_trainer_waiting_at_the_barrier(any_store, tmp_path) -> None:
    s = any_store
    for agent in ("solver", "verifier"):
        s.create_table(agent, COLUMNS, version_group="team")
    s.put("solver", [{"sample_id": f"q{i // 2}_0_{i % 2}", "token_ids": [256, 1, 2, 3],
                      "prompt_len": 2, "logprobs": [-5.0, -5.0], "reward": float(i % 2)}
                     for i in range(8)])
    model = build_tiny_lm(seed=0)
    trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), grpo_loss,
                           tmp_path / "w", name="solver")
    sub = s.subscribe("solver", 4, 8, group_by="input_id", group_size=2)
    thread = TrainerThread(trainer, sub, max_steps=1)
    thread.start()
    try:
        wait_until(lambda: s.barrier("solver")["arrived"] == ["solver"], timeout=60)
        thread.stop()
        # (the barrier would hold it for its 600 s timeout; a stop takes about a second remote)
        thread.join(timeout=60)
        assert not thread.is_alive(), "stop() did not end the bump waiting at the barrier"
    finally:
        thread.stop()
        thread.join(timeout=30)
    assert thread.error is None and thread.steps == []
    # The step was taken and its micro-batches acked; the version did not move.
    assert trainer.step == 1 and trainer.samples == 8
    stats = s.stats("solver")["solver"]
    assert stats["consumed"] == 8 and stats["processing"] == 0
    assert s.get_version("solver") == 0
    barrier = s.barrier("verifier")
    assert barrier["arrived"] == ["solver"] and barrier["waiting_for"] == ["verifier"]
    # The arrival stayed: the other agent completes the round, and a solver trainer started
    # again arrives again at the same version and is answered the new one.
    assert s.arrive("verifier", expected=0) == 1
    assert s.arrive("solver", expected=0) == 1
    assert s.get_version("verifier") == 1
