"""A documented trainer (consumers/trainer.py) killed with SIGKILL in the middle of a global batch.

With ``ack_at_step=True`` nothing of the global batch it was training is consumed: its rows come
back (the server releases a killed subscriber's leases when its stream ends) and the trainer
that takes over trains on every one of them once, in one step. Real components: a Flight server
on 127.0.0.1 over a DuckDB file, the trainer in a subprocess of its own.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

import store  # noqa: E402
from consumers.torch_collate import collate  # noqa: E402
from consumers.trainer import TorchTrainer, grpo_loss  # noqa: E402
from flight_fixtures import running_server  # noqa: E402
from producers.rollout.tiny_lm import build_tiny_lm  # noqa: E402
from waiting import wait_until  # noqa: E402

import reliability_helpers as rh  # noqa: E402

COLUMNS = {"token_ids": "list<int32>", "prompt_len": "int32", "logprobs": "list<float32>",
           "reward": "float64"}
SUBSCRIPTION = dict(micro_batch_size=2, global_batch_size=8, group_by="input_id", group_size=2,
                    max_in_flight=4, lease_seconds=600.0)

# Trains two micro-batches of the global batch, then hangs in the third one's loss (a trainer
# stuck in its backward) until it is killed.
_TRAINER = r"""
import sys, time, torch, store
from consumers.trainer import TorchTrainer, grpo_loss
from producers.rollout.tiny_lm import build_tiny_lm
calls = [0]
def loss(model, batch):
    calls[0] += 1
    if calls[0] == 3:
        print("in the third micro-batch", flush=True)
        time.sleep(600)
    return grpo_loss(model, batch)
s = store.connect(sys.argv[1])
sub = s.subscribe("agent", **eval(sys.argv[3]))
model = build_tiny_lm(seed=0)
trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, sys.argv[2],
                       ack_at_step=True)
for _ in trainer.run(sub, max_steps=1):
    pass
"""


def _consumed_and_processing(s) -> tuple[int, int]:
    stats = s.stats("agent")["agent"]
    return stats["consumed"], stats["processing"]


def test_a_trainer_killed_mid_global_batch_consumes_nothing_and_its_rows_train_once(tmp_path):
    ids = [f"q{i // 2}_0_{i % 2}" for i in range(8)]
    with running_server(tmp_path / "x.duckdb") as server, store.connect(server.location) as s:
        s.create_table("agent", COLUMNS)
        s.put("agent", [{"sample_id": sid, "token_ids": [256, 1, 2, 3], "prompt_len": 2,
                         "logprobs": [-5.0, -5.0], "reward": float(i % 2)}
                        for i, sid in enumerate(ids)])
        env = dict(os.environ, PYTHONPATH=str(rh.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-c", _TRAINER, server.location,
                                 str(tmp_path / "w1"), repr(SUBSCRIPTION)], cwd=str(rh.ROOT),
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert line, f"the trainer died: {proc.stderr.read()[-2000:]}"
            # Two micro-batches trained (by default they would be acked by now), the third in
            # its loss; the server pushes the fourth (max_in_flight=4) on its own thread, which
            # a loaded machine may run after this point: waited for, never acked.
            wait_until(lambda: _consumed_and_processing(s) == (0, 8), timeout=30,
                       message="0 rows consumed and 8 leased while the trainer hangs")
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
        wait_until(lambda: s.stats("agent")["agent"]["ready"] == 8, timeout=30,
                   message="the killed trainer's rows are ready again")

        seen: list[str] = []

        def recording(table):
            seen.extend(table.column("sample_id").to_pylist())
            return collate(table)

        model = build_tiny_lm(seed=0)
        trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), grpo_loss,
                               tmp_path / "w2", collate_fn=recording, ack_at_step=True)
        with s.subscribe("agent", **SUBSCRIPTION) as sub:
            steps = list(trainer.run(sub, max_steps=1))
        assert [(r.version, r.micro_batches, r.samples) for r in steps] == [(1, 4, 8)]
        assert sorted(seen) == sorted(ids)              # every row once, none lost or doubled
        stats = s.stats("agent")["agent"]
        assert (stats["consumed"], stats["ready"], stats["processing"]) == (8, 0, 0)
