"""SubscriptionDataset: a torch DataLoader over a subscription, for a trainer of one's own.

Real components: ``any_store`` runs each test against the embedded store on a DuckDB file and
against a real Flight server over one (127.0.0.1, port 0) through the remote client.
"""
from __future__ import annotations

import doctest
import gc
import traceback
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from torch.utils.data import DataLoader  # noqa: E402

import consumers.torch_dataset as torch_dataset  # noqa: E402
from consumers.torch_dataset import StoreItem, SubscriptionDataset  # noqa: E402
from consumers.trainer import grpo_loss  # noqa: E402
from producers.rollout.tiny_lm import build_tiny_lm  # noqa: E402
from store.errors import InvalidArgument  # noqa: E402
from waiting import wait_until  # noqa: E402

ROWS = 16
COLUMNS = {"token_ids": "list<int32>", "prompt_len": "int32", "logprobs": "list<float32>",
           "reward": "float64"}


def fill(s: Any) -> set[str]:
    # max_staleness=1: the second global batch trains, at version 1, on rows put at version 0.
    s.create_table("agent", COLUMNS, max_staleness=1)
    rows = [{"sample_id": f"q{i // 2}_0_{i % 2}", "token_ids": [256, 1 + i % 5, 2, 3],
             "prompt_len": 2, "logprobs": [-5.0, -5.0], "reward": float(i % 2)}
            for i in range(ROWS)]
    s.put("agent", rows)
    return {r["sample_id"] for r in rows}


def dataset(s: Any, **options: Any) -> SubscriptionDataset:
    sub = s.subscribe("agent", micro_batch_size=4, global_batch_size=8, group_by="input_id",
                      group_size=2)
    return SubscriptionDataset(sub, group_size=2, **options)


def ids(item: StoreItem) -> list[str]:
    return item.micro_batch.data.column("sample_id").to_pylist()


def counts(s: Any) -> dict[str, int]:
    return s.stats("agent")["agent"]


def train(ds: SubscriptionDataset, model: torch.nn.Module, opt: torch.optim.Optimizer,
          seen: list[StoreItem], fail_at: int | None = None) -> None:
    """The loop a user writes around their own trainer; raises at the ``fail_at``-th item."""
    for item in DataLoader(ds, batch_size=None, num_workers=0):
        seen.append(item)
        if len(seen) == fail_at:
            raise RuntimeError("the training step failed")
        loss_sum, count = grpo_loss(model, item.batch)
        (loss_sum / count / 2).backward()  # two micro-batches per global batch
        if item.is_boundary:
            ds.settle()
            opt.step()
            opt.zero_grad()
            ds.bump_version(weights_uri=f"file:///w/v{item.version + 1}")


def test_a_dataloader_trains_two_global_batches_on_every_row_once(any_store) -> None:
    all_ids = fill(any_store)
    model = build_tiny_lm(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[StoreItem] = []
    with dataset(any_store, max_global_batches=2) as ds:
        train(ds, model, opt, seen)
    assert [(i.index, i.is_boundary, i.version) for i in seen] == \
        [(0, False, 0), (1, True, 0), (0, False, 1), (1, True, 1)]
    assert all(isinstance(i.batch.input_ids, torch.Tensor) for i in seen)
    trained = [sid for i in seen for sid in ids(i)]
    assert sorted(trained) == sorted(all_ids)  # each row once
    assert any_store.get_version("agent") == 2
    stats = counts(any_store)
    assert stats["consumed"] == ROWS and stats["processing"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_step_that_raises_leaves_its_micro_batch_to_be_delivered_again(any_store) -> None:
    all_ids = fill(any_store)
    model = build_tiny_lm(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first: list[StoreItem] = []
    with dataset(any_store, max_global_batches=2) as ds:
        with pytest.raises(RuntimeError, match="the training step failed"):
            train(ds, model, opt, first, fail_at=2)
        finished, failed = first
        opt.zero_grad()  # the failed step's gradient is the loop's to drop
        # The finished micro-batch was acked when the next was asked for; the failed one was
        # not (a grpc:// server may already have pushed its rows again, so they can be
        # processing rather than ready).
        wait_until(lambda: counts(any_store)["consumed"] == 4, timeout=30,
                   message="the finished micro-batch acked")
        stats = counts(any_store)
        assert stats["consumed"] == 4 and stats["ready"] + stats["processing"] == ROWS - 4
        again: list[StoreItem] = []
        train(ds, model, opt, again)  # a new iteration: the global batch goes on
    assert again[0].index == 1 and again[0].is_boundary and again[0].version == 0
    retried = [sid for i in again for sid in ids(i)]
    assert set(ids(failed)) <= set(retried)
    assert sorted(ids(finished) + retried) == sorted(all_ids)  # none lost, none twice
    assert any_store.get_version("agent") == 2
    assert counts(any_store)["consumed"] == ROWS


def test_asking_for_the_next_item_without_bumping_is_refused(any_store) -> None:
    fill(any_store)
    with dataset(any_store) as ds:
        with pytest.raises(InvalidArgument, match="middle of one"):
            ds.bump_version()
        items = iter(DataLoader(ds, batch_size=None))
        next(items)
        boundary = next(items)
        assert boundary.is_boundary
        with pytest.raises(InvalidArgument, match=r"call ds\.bump_version"):
            next(items)
        # The boundary micro-batch was not acked: it went back (the subscription's global
        # batch is open again), and the version did not move.
        wait_until(lambda: counts(any_store)["consumed"] == 4, timeout=30,
                   message="the first micro-batch acked")
        assert counts(any_store)["consumed"] == 4
        assert any_store.get_version("agent") == 0
        items = iter(DataLoader(ds, batch_size=None))
        again = next(items)
        assert again.index == 1 and again.is_boundary
        assert sorted(ids(again)) == sorted(ids(boundary))
        assert ds.bump_version() == 1
    assert counts(any_store)["consumed"] == 8


def test_a_loop_that_stops_early_gives_its_micro_batch_back(any_store) -> None:
    fill(any_store)
    with dataset(any_store) as ds:
        items = iter(DataLoader(ds, batch_size=None))
        next(items)
        boundary = next(items)
        assert ds.subscription.at_boundary
        del items  # the loop stopped (break) with the boundary micro-batch unfinished
        gc.collect()
        # Nacked, not acked: its slot in the global batch is open again, its rows come back.
        assert not ds.subscription.at_boundary
        items = iter(DataLoader(ds, batch_size=None))
        again = next(items)
        assert again.index == 1 and sorted(ids(again)) == sorted(ids(boundary))
        assert ds.bump_version() == 1
    assert counts(any_store)["consumed"] == 8


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_processes_are_refused_with_the_reason(any_store, context: str) -> None:
    fill(any_store)
    with dataset(any_store) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
        with pytest.raises((RuntimeError, TypeError), match="cannot cross processes") as raised:
            next(iter(loader))  # spawn: refused as the workers start; fork: in the workers
        assert "num_workers=0" in str(raised.value)
        # torch re-raises the worker's error from a frame that holds it: a cycle through the
        # traceback that keeps the iterator alive until the garbage collector, which finalizes
        # its queues before the iterator's own shutdown, so each worker's join then waits its
        # full 5 s. Clearing the frames lets the iterator shut its workers down here, at once.
        traceback.clear_frames(raised.tb)
        assert counts(any_store)["consumed"] == 0  # nothing was acked
        # The subscription is untouched and works in this process.
        item = next(iter(DataLoader(ds, batch_size=None)))
        assert item.index == 0 and item.num_rows == 4


def test_the_module_example_runs() -> None:
    result = doctest.testmod(torch_dataset)
    assert result.attempted > 0 and result.failed == 0
