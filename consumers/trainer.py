"""A plain torch trainer over a micro-batch subscription: FlexMARL's fine-grained pipeline.

For each micro-batch the trainer collates it, computes the loss, backpropagates it through
:class:`consumers.accumulation.GradientAccumulator` (the scale that makes the accumulated
gradient equal the global batch's) and acks it: its gradient is in the accumulation cache (the
ack is not waited for; every answer is, before the optimizer step: :mod:`consumers.acks`). At the
accumulation boundary (``MicroBatch.is_boundary``, set by the subscription) it completes the
gradient, takes the optimizer step, publishes the weights and calls
``sub.bump_version(weights_uri=uri)``, so producers load the new policy and the subscription
starts the next global batch. The model is updated once per global batch, never in between:
training on micro-batches as they arrive is mathematically one full-batch step
(``tests/system/test_consistency.py`` checks it through the Flight server).

Acks after the step: with ``ack_at_step=True`` the trainer acks a global batch's micro-batches
only after its optimizer step (and before the bump). A trainer killed in the middle of a global
batch then gives every one of its rows back (a ``grpc://`` subscription's leases are released when
its stream ends; others come back when they expire), and they are delivered again to the
trainer that takes over; by default its micro-batches acked before the crash are
consumed, although their gradients died with it and no step used them. The price: the
subscription holds a whole global batch's leases, so its ``max_in_flight`` must be at least the
micro-batches per global batch (:meth:`TorchTrainer.run` refuses a smaller one), and its
``lease_seconds`` longer than a global batch takes.

The same loop with a DeepSpeed engine is :class:`consumers.deepspeed_loop.DeepSpeedTrainLoop`.

Example (embedded store; a remote ``grpc://`` store's subscription works the same):
    >>> import store, tempfile, os, torch
    >>> from consumers.grpo import clipped_policy_loss, token_logprobs
    >>> from producers.rollout.tiny_lm import build_tiny_lm
    >>> d = tempfile.mkdtemp()
    >>> s = store.connect(os.path.join(d, "x.duckdb"))
    >>> _ = s.create_table("agent", {"token_ids": "list<int32>", "prompt_len": "int32",
    ...                              "logprobs": "list<float32>", "reward": "float64"})
    >>> _ = s.put("agent", [{"sample_id": f"q{i // 2}_0_{i % 2}", "token_ids": [256, 1, 2],
    ...                      "prompt_len": 2, "logprobs": [-5.0], "reward": float(i % 2)}
    ...                     for i in range(8)])
    >>> def loss(model, b):
    ...     lp = token_logprobs(model(b.input_ids, b.position_ids), b.input_ids)
    ...     return clipped_policy_loss(lp, b.old_logprobs, b.per_token(b.advantages), b.loss_mask)
    >>> model = build_tiny_lm(seed=0)
    >>> trainer = TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss, d)
    >>> sub = s.subscribe("agent", micro_batch_size=4, global_batch_size=8,
    ...                   group_by="input_id", group_size=2)
    >>> [(r.step, r.version, r.micro_batches) for r in trainer.run(sub, max_steps=1)]
    [(1, 1, 2)]
    >>> s.get_version("agent")
    1
    >>> s.close()
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from consumers.accumulation import GradientAccumulator
from consumers.acks import PendingAcks
from consumers.grpo import clipped_policy_loss, token_logprobs
from consumers.stopping import bump, micro_batches_until
from consumers.torch_collate import TorchBatch, collate
from store.subscription import BumpStopped
from producers.rollout.weights import prune_published, publish_state_dict

__all__ = ["LossFn", "TrainStep", "TorchTrainer", "TrainerThread", "grpo_loss"]

#: ``loss_fn(model, batch) -> (loss_sum, count)``: the micro-batch's summed loss and its number of
#: units (loss tokens for a token-mean loss, samples for a sample-mean loss).
LossFn = Callable[[torch.nn.Module, TorchBatch], "tuple[torch.Tensor, int | torch.Tensor]"]


def grpo_loss(model: torch.nn.Module, batch: TorchBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The GRPO clipped policy loss, token-mean: ``(loss_sum, n_loss_tokens)``.

    For a causal LM called as ``model(input_ids, position_ids)`` (e.g. the tiny LM); the batch
    needs rollout logprobs and rewards (or an ``advantage`` column).
    """
    if batch.old_logprobs is None or batch.advantages is None:
        raise ValueError("grpo_loss needs 'logprobs' and 'reward' (or 'advantage') columns in "
                         "the micro-batch")
    lp = token_logprobs(model(batch.input_ids, batch.position_ids), batch.input_ids)
    return clipped_policy_loss(lp, batch.old_logprobs, batch.per_token(batch.advantages),
                               batch.loss_mask)


@dataclass(frozen=True)
class TrainStep:
    """What one optimizer step (one global batch) did."""

    step: int
    version: int
    micro_batches: int
    samples: int
    count: int
    loss: float
    weights_uri: str
    busy_seconds: float


class TorchTrainer:
    """Train a torch model from a subscription (see the module docstring).

    Args:
        model: the policy; its parameters are what the optimizer updates.
        optimizer: a torch optimizer over ``model``'s parameters.
        loss_fn: ``loss_fn(model, batch) -> (loss_sum, count)``.
        weights_dir: where weights are published after each step.
        name: prefix of published files (the agent's table in a multi-agent run).
        global_count: the global batch's unit count if known up front; None derives it from the
            micro-batches (see :mod:`consumers.accumulation`).
        collate_fn: table -> :class:`TorchBatch`; default :func:`consumers.torch_collate.collate`.
        max_grad_norm: clip the *global* gradient's norm before the step (None: no clipping).
        keep_last: prune older published files, keeping this many (None keeps all).
        device: where batches go (default: the model's device).
        ack_at_step: ack micro-batches after the optimizer step instead of after their backward
            (see the module docstring).

    Attributes:
        busy: ``(start, end)`` monotonic times of the trainer's compute (one per micro-batch,
            one per optimizer step), for measuring how much of it overlapped with rollouts.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                 weights_dir: str | os.PathLike[str], *, name: str = "policy",
                 global_count: int | None = None,
                 collate_fn: Callable[[pa.Table], TorchBatch] = collate,
                 max_grad_norm: float | None = None, keep_last: int | None = None,
                 device: torch.device | str | None = None, ack_at_step: bool = False) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.weights_dir = weights_dir
        self.name = name
        self.collate_fn = collate_fn
        self.max_grad_norm = max_grad_norm
        self.keep_last = keep_last
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.accumulator = GradientAccumulator(model.parameters(), global_count=global_count)
        self.ack_at_step = ack_at_step
        self._acks = PendingAcks()
        #: with ack_at_step: the global batch's micro-batches, acked after its optimizer step
        self._held: list[Any] = []
        self.step = 0
        self.samples = 0
        self.busy: list[tuple[float, float]] = []
        self._global_samples = 0
        self._global_busy = 0.0

    @property
    def busy_seconds(self) -> float:
        return sum(end - start for start, end in self.busy)

    # -- the two halves of the loop -------------------------------------------------------------
    def train_micro_batch(self, mb: Any) -> None:
        """Collate, loss, accumulate the gradient, ack: one gradient-accumulation step."""
        start = time.monotonic()
        self.model.train()
        batch = self.collate_fn(mb.data).to(self.device)
        loss_sum, count = self.loss_fn(self.model, batch)
        self.accumulator.backward(loss_sum, count, is_last=bool(mb.is_boundary))
        self._global_samples += mb.data.num_rows
        self._record(start)
        if self.ack_at_step:
            self._held.append(mb)
            return
        try:
            self._acks.send(mb)
        except BaseException:
            self._discard_global_batch()
            raise

    def _discard_global_batch(self) -> None:
        """An ack failed (its lease ended: the rows went back): no step may use this global
        batch, so its gradients and counts go."""
        self.accumulator.discard()
        self._global_samples, self._global_busy = 0, 0.0

    def finish_global_batch(self, sub: Any, *,
                            stop: threading.Event | None = None) -> TrainStep:
        """Optimizer step, publish the weights, bump the version (at the boundary).

        Acked after each backward (the default), every ack of the global batch is answered
        before its optimizer step: a micro-batch whose lease ended meanwhile went back to the
        table (for another consumer), so no step may use its gradient. The error is raised with
        the model as it was and the accumulated gradients dropped.

        ``stop`` is handed to ``sub.bump_version``: set while the bump waits at the barrier for
        another agent's trainer, it ends the wait with
        :class:`store.subscription.BumpStopped`. The global batch's step was then taken (counted
        in ``step`` and ``samples``, its weights published, its micro-batches acked) but the
        version did not move and no :class:`TrainStep` is reported; its arrival stays at the
        barrier (see ``Subscription.bump_version``).
        """
        start = time.monotonic()
        micro, loss = self.accumulator.micro_batches, self.accumulator.mean_loss
        count = self.accumulator.finish()
        try:
            self._acks.settle()
        except BaseException:
            self._discard_global_batch()
            raise
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        uri = publish_state_dict(self.model.state_dict(), self.weights_dir, self.step,
                                 name=self.name)
        self._record(start)
        held, self._held = self._held, []
        for mb in held:
            self._acks.send(mb)
        self._acks.settle()
        try:
            version = int(bump(sub.bump_version, uri, stop))
        except BumpStopped:
            self.samples += self._global_samples
            self._global_samples, self._global_busy = 0, 0.0
            raise
        if self.keep_last is not None:
            prune_published(self.weights_dir, self.keep_last, name=self.name)
        report = TrainStep(self.step, version, micro, self._global_samples, count, loss, uri,
                           self._global_busy)
        self.samples += self._global_samples
        self._global_samples, self._global_busy = 0, 0.0
        return report

    def _record(self, start: float) -> None:
        end = time.monotonic()
        self.busy.append((start, end))
        self._global_busy += end - start

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, sub: Any, *, max_steps: int | None = None,
            stop: threading.Event | None = None, idle_timeout: float | None = None,
            poll: float = 0.25) -> Iterator[TrainStep]:
        """Train on ``sub``'s micro-batches; yield a :class:`TrainStep` after each step.

        Stops after ``max_steps`` optimizer steps, when ``stop`` is set, or after
        ``idle_timeout`` seconds without a micro-batch. It never asks for a micro-batch past the
        last step it will take (that would claim, and strand, rows of the next global batch).
        With ``ack_at_step``, the micro-batches of a global batch it stops in stay unacked
        (closing the subscription gives them back). ``stop`` also ends a bump waiting at the
        version group's barrier for another agent's trainer: that global batch's step was
        taken and acked, the version did not move, and nothing is yielded for it (see
        :meth:`finish_global_batch`).

        Raises:
            ValueError: ``ack_at_step`` with a subscription whose ``max_in_flight`` cannot hold a
                global batch (it would stop at its ``max_in_flight``-th micro-batch).
        """
        if self.ack_at_step:
            _check_holds_a_global_batch(sub)
        if max_steps is not None and max_steps <= 0:
            return
        steps_at_start = self.step
        for mb in micro_batches_until(sub, stop=stop, idle_timeout=idle_timeout, poll=poll):
            self.train_micro_batch(mb)
            if mb.is_boundary:
                try:
                    report = self.finish_global_batch(sub, stop=stop)
                except BumpStopped:
                    return
                yield report
                # Stop here, not at the next micro-batch: asking for it would claim (and
                # strand) rows of the next global batch.
                if max_steps is not None and self.step - steps_at_start >= max_steps:
                    return


def _check_holds_a_global_batch(sub: Any) -> None:
    per_global = getattr(sub, "global_batch_size", 0) // max(getattr(sub, "micro_batch_size", 1), 1)
    room = getattr(sub, "max_in_flight", None)
    if room is not None and per_global and room < per_global:
        raise ValueError(f"ack_at_step holds a global batch's {per_global} micro-batches "
                         f"unacked until the step, but the subscription's max_in_flight is "
                         f"{room}; subscribe with max_in_flight={per_global} (or more)")


class TrainerThread(threading.Thread):
    """Run :meth:`TorchTrainer.run` on a subscription in a background thread.

    ``steps`` collects the :class:`TrainStep` reports, ``error`` the exception that ended the
    loop, if any. :meth:`stop` ends it at the next poll, or, when its bump waits at the version
    group's barrier for another agent's trainer, within a fraction of a second embedded and
    about a second through a Flight server: that global batch's step was taken and acked, the
    version did not move, and its arrival stays at the barrier, so the group advances once the
    other members arrive (or the round times out); a trainer started again arrives again (see
    :meth:`TorchTrainer.finish_global_batch`). The subscription is closed at the end (its
    in-flight micro-batches are nacked).
    """

    def __init__(self, trainer: TorchTrainer, sub: Any, *, max_steps: int | None = None,
                 idle_timeout: float | None = None,
                 on_step: Callable[[TrainStep], None] | None = None) -> None:
        super().__init__(name=f"expstore-trainer-{trainer.name}", daemon=True)
        self.trainer, self.sub = trainer, sub
        self.max_steps, self.idle_timeout, self.on_step = max_steps, idle_timeout, on_step
        self.steps: list[TrainStep] = []
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            for step in self.trainer.run(self.sub, max_steps=self.max_steps,
                                         stop=self._stop_event, idle_timeout=self.idle_timeout):
                self.steps.append(step)
                if self.on_step is not None:
                    self.on_step(step)
        except BaseException as e:  # noqa: BLE001 - handed to whoever joins the thread
            self.error = e
        finally:
            try:
                self.sub.close()
            except Exception:  # noqa: BLE001 - closing a broken stream can fail too
                pass

    def stop(self) -> None:
        self._stop_event.set()
