"""Gradient accumulation over micro-batches equals one full-batch step (consumers.accumulation).

This is the paper's consistency claim: a global batch split into micro-batches of any sizes, in any
order, gives the same gradient and the same parameters after the optimizer step as the full batch.
"""
from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from consumers.accumulation import GradientAccumulator, reduce_loss  # noqa: E402
from consumers.grpo import clipped_policy_loss, group_advantages, token_logprobs  # noqa: E402
from consumers.torch_collate import TorchBatch, collate  # noqa: E402
from producers.rollout.tiny_lm import TinyCausalLM, build_tiny_lm  # noqa: E402

SIZES = [5, 1, 4, 2]  # unequal micro-batches of a 12-sample global batch


def global_batch(seed: int = 0, n_groups: int = 3, group_size: int = 4) -> pa.Table:
    """A GRPO-shaped global batch: variable lengths, group-normalised advantages precomputed."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(n_groups):
        for k in range(group_size):
            prompt_len = int(rng.integers(2, 5))
            n = prompt_len + int(rng.integers(1, 9))
            toks = [256, *rng.integers(0, 256, n - 1).tolist()]
            rows.append({"sample_id": f"q{g}_0_{k}", "input_id": f"q{g}", "token_ids": toks, "prompt_len": prompt_len,
                         "logprobs": (-rng.uniform(4.5, 6.5, n - prompt_len)).tolist(), "reward": float(rng.integers(0, 3))})
    t = pa.Table.from_pylist(rows)
    b = collate(t, float_dtype=torch.float64)
    adv = group_advantages(b.rewards, b.group_ids)  # type: ignore[arg-type]
    # Advantages belong to whole groups; computing them on the global batch lets micro-batches split groups.
    return t.append_column("advantage", pa.array(adv.numpy()))


def micro_batches(t: pa.Table, sizes: list[int], seed: int) -> list[pa.Table]:
    order = np.random.default_rng(seed).permutation(t.num_rows)
    shuffled = t.take(pa.array(order))
    out, start = [], 0
    for s in sizes:
        out.append(shuffled.slice(start, s))
        start += s
    assert start == t.num_rows
    return out


def grpo_loss(model: TinyCausalLM, b: TorchBatch, level: str = "token") -> tuple[torch.Tensor, int]:
    logits = model(b.input_ids, b.position_ids, b.segment_ids if b.packed else None)
    lp = token_logprobs(logits, b.input_ids)
    adv = b.per_token(b.advantages)  # type: ignore[arg-type]
    if level == "token":
        loss_sum, n = clipped_policy_loss(lp, b.old_logprobs, adv, b.loss_mask)  # type: ignore[arg-type]
        return loss_sum, int(n)
    ratio = (lp - b.old_logprobs).exp()  # type: ignore[operator]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return reduce_loss(per_token, b.loss_mask, b.segment_ids, b.num_samples, level=level)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def full_batch(model: TinyCausalLM, t: pa.Table, level: str) -> list[torch.Tensor]:
    loss_sum, n = grpo_loss(model, collate(t, float_dtype=torch.float64), level)
    (loss_sum / n).backward()
    return grads(model)


@pytest.fixture()
def models() -> tuple[TinyCausalLM, TinyCausalLM]:
    ref = build_tiny_lm(seed=7).double()
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("level", ["token", "sample"])
@pytest.mark.parametrize("mode", ["deferred_is_last", "deferred_finish", "known_count"])
@pytest.mark.parametrize("pack", [None, 24])
def test_accumulated_step_equals_full_batch_step(models: tuple[TinyCausalLM, TinyCausalLM], level: str, mode: str,
                                                 pack: int | None) -> None:
    ref, acc_model = models
    t = global_batch()
    expected = full_batch(ref, t, level)
    parts = [collate(m, float_dtype=torch.float64, pack_length=pack) for m in micro_batches(t, SIZES, seed=1)]
    known = None
    if mode == "known_count":
        known = sum(grpo_loss(acc_model, b, level)[1] for b in parts)
    acc = GradientAccumulator(acc_model.parameters(), global_count=known)
    for i, b in enumerate(parts):
        loss_sum, n = grpo_loss(acc_model, b, level)
        acc.backward(loss_sum, n, is_last=(mode == "deferred_is_last" and i == len(parts) - 1))
    total = acc.finish()
    assert total == (collate(t).num_loss_tokens if level == "token" else t.num_rows)
    for g_acc, g_ref in zip(grads(acc_model), expected):
        torch.testing.assert_close(g_acc, g_ref, rtol=1e-10, atol=1e-13)

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_acc = torch.optim.AdamW(acc_model.parameters(), lr=1e-2)
    opt_ref.step()
    opt_acc.step()
    for p_acc, p_ref in zip(acc_model.parameters(), ref.parameters()):
        torch.testing.assert_close(p_acc, p_ref, rtol=1e-10, atol=1e-12)


def test_accumulator_serves_consecutive_global_batches(models: tuple[TinyCausalLM, TinyCausalLM]) -> None:
    ref, acc_model = models
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_acc = torch.optim.SGD(acc_model.parameters(), lr=0.5)
    acc = GradientAccumulator(acc_model.parameters())
    for step in range(3):
        t = global_batch(seed=10 + step)
        opt_ref.zero_grad()
        full_batch(ref, t, "token")
        opt_ref.step()
        opt_acc.zero_grad()
        parts = micro_batches(t, [3, 3, 6] if step % 2 else [7, 5], seed=step)
        for i, m in enumerate(parts):
            acc.backward(*grpo_loss(acc_model, collate(m, float_dtype=torch.float64)), is_last=i == len(parts) - 1)
        acc.finish()
        opt_acc.step()
    for p_acc, p_ref in zip(acc_model.parameters(), ref.parameters()):
        torch.testing.assert_close(p_acc, p_ref, rtol=1e-10, atol=1e-12)


def test_naive_mean_over_micro_batches_is_not_the_full_batch_gradient(models: tuple[TinyCausalLM, TinyCausalLM]) -> None:
    """The shortcut the helper replaces (micro-batch mean / number of micro-batches) is measurably wrong."""
    ref, naive = models
    t = global_batch()
    expected = full_batch(ref, t, "token")
    parts = micro_batches(t, SIZES, seed=1)
    for m in parts:
        loss_sum, n = grpo_loss(naive, collate(m, float_dtype=torch.float64))
        (loss_sum / n / len(parts)).backward()
    diff = max(float((a - b).abs().max()) for a, b in zip(grads(naive), expected))
    scale = max(float(b.abs().max()) for b in expected)
    assert diff > 1e-3 * scale


def test_mean_reduction_and_count_checks() -> None:
    w = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    acc = GradientAccumulator([w], global_count=5)
    x1, x2 = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64)
    acc.backward((w * x1).mean(), 2, reduction="mean")
    acc.backward((w * x2).sum(), 3)
    assert acc.finish() == 5
    assert w.grad is not None and w.grad.item() == pytest.approx(3.0)
    acc.backward((w * x1).sum(), 2)
    with pytest.raises(ValueError, match="sum to 2, but global_count is 5"):
        acc.finish()
    with pytest.raises(ValueError, match="reduction must be"):
        acc.backward(w.sum(), 1, reduction="avg")
    with pytest.raises(ValueError, match="global_count must be > 0"):
        GradientAccumulator([w], global_count=0)


def test_deferred_mode_refuses_engines_that_move_gradients_out_of_grad() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0]))

    def backward_then_take_grads(loss: torch.Tensor) -> None:  # what ZeRO 2/3 do after each backward
        loss.backward()
        w.grad = None

    acc = GradientAccumulator([w], backward_fn=backward_then_take_grads)
    with pytest.raises(RuntimeError, match="pass global_count"):
        acc.backward((w * 3).sum(), 1)
