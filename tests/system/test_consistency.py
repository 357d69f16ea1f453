"""The paper's consistency claim, end to end through the Flight server.

FlexMARL (section 4.3) trains on micro-batches as soon as they are ready and updates the policy
once per global batch; gradient accumulation makes that *the same* update as one full-batch step.
Here several producer threads write the samples of each global batch in shuffled order with
random delays, through the real Flight server (127.0.0.1, port 0, a DuckDB file in tmp_path),
each sample in two parts (the generation, then the reward); a torch trainer consumes the
subscription in group-aware micro-batches of 16 (global batch 64) through a remote client. The
trained parameters must equal, in float64, those of one plain full-batch step per global batch
on the same samples, and the version must be bumped exactly once per global batch. It runs on
the CPU, and on the GPU where there is one (``-m gpu``).
"""
from __future__ import annotations

import copy
import random
import threading
import time
from functools import partial

import pyarrow as pa
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from consumers.grpo import clipped_policy_loss, token_logprobs  # noqa: E402
from consumers.torch_collate import TorchBatch, collate  # noqa: E402
from consumers.trainer import TorchTrainer  # noqa: E402
from flight_server.client import RemoteStore  # noqa: E402
from producers.rollout.tiny_lm import TinyLMBackend, build_tiny_lm  # noqa: E402
from producers.rollout.weights import load_state_dict  # noqa: E402
from producers.writer import ExperienceWriter  # noqa: E402
from devices import DEVICES  # noqa: E402
from flight_fixtures import running_server  # noqa: E402

MICRO, GLOBAL, GROUP, GLOBAL_BATCHES, PRODUCERS = 16, 64, 4, 3, 3
TABLE = "policy"
COLUMNS = {"prompt": "string", "response": "string", "token_ids": "list<int32>",
           "logprobs": "list<float32>", "prompt_len": "int32", "reward": "float64"}


def make_global_batch(backend: TinyLMBackend, k: int) -> list[dict]:
    """64 real generations: 16 prompts x 4 samples, responses of different lengths."""
    rows = []
    for j in range(GLOBAL // GROUP):
        prompt = f"b{k} q{j}: {j * 7 % 13}+{k + j}="
        for g in backend.generate([prompt], GROUP, max_new_tokens=2 + (j * 5 + k) % 9):
            rows.append({"sample_id": f"b{k}q{j}_0_{g.sample_index}", "prompt": prompt,
                         "response": g.text, "token_ids": g.full_token_ids,
                         "logprobs": g.logprobs, "prompt_len": g.prompt_len,
                         "reward": float(len(g.token_ids) % 3 + (g.sample_index == 1))})
    return rows


def grpo_loss(model: torch.nn.Module, b: TorchBatch) -> tuple[torch.Tensor, torch.Tensor]:
    lp = token_logprobs(model(b.input_ids, b.position_ids), b.input_ids)
    return clipped_policy_loss(lp, b.old_logprobs, b.per_token(b.advantages), b.loss_mask)


collate64 = partial(collate, float_dtype=torch.float64, group_size=GROUP)


def full_batch_reference(model: torch.nn.Module, batches: list[list[dict]],
                         device: str) -> list[torch.Tensor]:
    """One ordinary optimizer step per global batch, on all of its samples at once."""
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for rows in batches:
        table = pa.Table.from_pylist(rows).append_column(
            "input_id", pa.array([r["sample_id"].rsplit("_", 2)[0] for r in rows]))
        opt.zero_grad()
        loss_sum, n = grpo_loss(model, collate64(table).to(device))
        (loss_sum / n).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class Producer(threading.Thread):
    """Writes its share of each global batch once the store is at that batch's version."""

    def __init__(self, location: str, shares: list[list[dict]], seed: int) -> None:
        super().__init__(daemon=True, name=f"producer-{seed}")
        self.location, self.shares, self.rng = location, shares, random.Random(seed)
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            with RemoteStore(self.location) as s, \
                    ExperienceWriter(s, TABLE, batch_rows=4, flush_interval=0.005) as w:
                for version, share in enumerate(self.shares):
                    assert s.wait_version(TABLE, version, timeout=60) >= version
                    # generation parts and rewards, all in random order (writes are upserts;
                    # a sample is ready once both parts arrived)
                    parts = [{k: v for k, v in r.items() if k != "reward"} for r in share]
                    parts += [{"sample_id": r["sample_id"], "reward": r["reward"]} for r in share]
                    for row in self.rng.sample(parts, len(parts)):
                        if self.rng.random() < 0.3:
                            time.sleep(self.rng.uniform(0, 0.01))  # a random arrival delay
                        w.write({**row, "policy_version": version})
                    w.flush(timeout=60)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)


@pytest.mark.parametrize("device", DEVICES)
def test_micro_batch_training_through_flight_equals_full_batch_steps(tmp_path, device: str) -> None:
    backend = TinyLMBackend(seed=3)
    batches = [make_global_batch(backend, k) for k in range(GLOBAL_BATCHES)]
    model = build_tiny_lm(seed=7).double().to(device)
    initial = [p.detach().clone() for p in model.parameters()]
    expected = full_batch_reference(copy.deepcopy(model), batches, device)

    rng = random.Random(11)
    shares: list[list[list[dict]]] = [[] for _ in range(PRODUCERS)]
    for rows in batches:
        shuffled = rng.sample(rows, len(rows))
        for p in range(PRODUCERS):
            shares[p].append(shuffled[p::PRODUCERS])

    counts: list[int] = []

    def counting_loss(m: torch.nn.Module, b: TorchBatch) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, n = grpo_loss(m, b)
        counts.append(int(n))
        return loss_sum, n

    with running_server(tmp_path / "x.duckdb") as server:
        with RemoteStore(server.location) as s:
            s.create_table(TABLE, COLUMNS, max_staleness=0)
            producers = [Producer(server.location, shares[p], seed=p) for p in range(PRODUCERS)]
            for p in producers:
                p.start()
            trainer = TorchTrainer(model, torch.optim.Adam(model.parameters(), lr=0.02),
                                   counting_loss, tmp_path / "weights", name=TABLE,
                                   collate_fn=collate64)
            sub = s.subscribe(TABLE, MICRO, GLOBAL, group_by="input_id", group_size=GROUP)
            try:
                reports = list(trainer.run(sub, max_steps=GLOBAL_BATCHES, idle_timeout=60))
            finally:
                sub.close()
            for p in producers:
                p.join(timeout=60)
                assert not p.is_alive(), f"{p.name} did not finish"
                assert not p.errors, p.errors

            assert [r.version for r in reports] == [1, 2, 3] == [r.step for r in reports]
            assert [(r.micro_batches, r.samples) for r in reports] == [(4, GLOBAL)] * 3
            assert s.get_version(TABLE) == GLOBAL_BATCHES
            versions = s.query("SELECT version, weights_uri FROM _expstore_versions "
                               "WHERE version_group = ? ORDER BY version", [TABLE]).to_pylist()
            assert [v["version"] for v in versions] == [0, 1, 2, 3]  # one bump per global batch
            assert [v["weights_uri"] for v in versions[1:]] == [r.weights_uri for r in reports]
            rows = s.query(f"SELECT policy_version, consumed, consumed_version, delivery_count "
                           f"FROM {TABLE}").to_pylist()
            assert len(rows) == GLOBAL * GLOBAL_BATCHES
            # every sample trained under the version that generated it, exactly once
            assert all(r["consumed"] and r["consumed_version"] == r["policy_version"]
                       and r["delivery_count"] == 1 for r in rows)

    assert len(counts) == 12 and len(set(counts)) > 1  # unequal micro-batches: a real test
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)
    moved = max(float((p.detach() - p0).abs().max()) for p, p0 in zip(model.parameters(), initial))
    assert moved > 1e-2  # the steps happened, far above the tolerance
    published = load_state_dict(reports[-1].weights_uri)
    for k, v in model.state_dict().items():
        assert published[k].device.type == "cpu"  # loadable where the trainer's device is not
        torch.testing.assert_close(published[k], v.cpu())
