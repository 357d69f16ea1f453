"""The DeepSpeed consumer loop: micro-batches in, optimizer steps, published weights, version bumps.

For every micro-batch of a subscription the loop collates it, calls the user's loss function,
backpropagates through ``engine.backward`` with the scale from
:class:`consumers.accumulation.GradientAccumulator`, and at the accumulation boundary
(``MicroBatch.is_boundary``) takes ``engine.step()``, publishes the weights and calls
``bump_version(weights_uri=...)`` so producers switch to the new policy.

The boundary comes from the subscription, not from DeepSpeed's micro-step counter: with group
claims a global batch need not hold exactly ``gradient_accumulation_steps`` micro-batches. Build the
engine with :func:`deepspeed_config` (``managed_gradient_accumulation: false``: ``backward`` only
accumulates, ``step`` is the boundary). A managed engine also works: the loop then sets the boundary
explicitly with ``engine.set_gradient_accumulation_boundary``.

ZeRO-3 (the paper's configuration, ``deepspeed_config(..., zero_stage=3)``) partitions the
parameters as well as gradients and optimizer state: ``engine.module.state_dict()`` then holds
empty placeholders, so the loop publishes :func:`full_state_dict`, which gathers each parameter in
turn. ZeRO 2 and 3 reduce gradients out of ``.grad`` at every micro-step, so the loop needs the
global batch's unit count up front (``global_count``); it refuses to start without it.

Acks: by default a micro-batch is acked right after its backward (its gradient is in the
accumulation cache, the paper's model), without waiting for the answer; the loop waits for all of
them before the optimizer step (:class:`consumers.acks.PendingAcks`): a failed one (an expired
lease) stops the step, the weights untouched. ``ack_at_step=True`` acks
the whole global batch only after the optimizer step, so a trainer crash mid-batch re-delivers
those samples, at the price of holding more leases: the subscription's ``max_in_flight`` must be
at least the number of micro-batches per global batch, and its lease longer than one global batch
takes.

Stopping: ``run(..., stop=event)`` ends when another thread sets ``event``, whether the loop
waits for a micro-batch or its bump waits at the version group's barrier for another agent's
trainer, as :meth:`consumers.trainer.TorchTrainer.run` does (:mod:`consumers.stopping`);
nothing is acked that was not trained on.

Example (assuming ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` are set)::

    from consumers.trainer import grpo_loss
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                      config=deepspeed_config(micro_batch_size=4, global_batch_size=16))
    s = store.connect("grpc://127.0.0.1:8815")
    sub = s.subscribe("solver", micro_batch_size=4, global_batch_size=16, group_by="input_id",
                      group_size=4)
    loop = DeepSpeedTrainLoop(engine, grpo_loss, weights_dir="./weights")
    for report in loop.run(sub, sub.bump_version, max_steps=100):
        print(report.step, report.version, report.loss)
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import torch

from consumers.accumulation import GradientAccumulator
from consumers.acks import PendingAcks
from consumers.stopping import bump, check_takes_stop, micro_batches_until
from consumers.torch_collate import TorchBatch, collate
from producers.rollout.weights import prune_published, publish_state_dict
from store.subscription import STOP_POLL_SECONDS, BumpStopped

__all__ = ["MicroBatchLike", "LossFn", "StepReport", "DeepSpeedTrainLoop", "deepspeed_config",
           "check_gradient_dtypes", "full_state_dict"]


class MicroBatchLike(Protocol):
    """What the loop needs of a micro-batch (``consumers`` subscriptions yield these)."""

    @property
    def data(self) -> pa.Table: ...
    @property
    def index(self) -> int: ...
    @property
    def is_boundary(self) -> bool: ...
    def ack(self, wait: bool = True) -> Any: ...


#: ``loss_fn(engine, batch) -> (loss_sum, count)``: the micro-batch's summed loss and its number of
#: units (loss tokens for a token-mean loss, samples for a sample-mean loss).
LossFn = Callable[[Any, TorchBatch], tuple[torch.Tensor, "int | torch.Tensor"]]


@dataclass(frozen=True)
class StepReport:
    """What one optimizer step did."""

    step: int
    micro_batches: int
    count: int
    loss: float
    weights_uri: str
    version: int | None


def deepspeed_config(
    micro_batch_size: int,
    global_batch_size: int,
    *,
    zero_stage: int = 0,
    world_size: int = 1,
    gradient_clipping: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config for this loop: batch sizes, ZeRO stage, caller-owned accumulation boundary.

    ``gradient_accumulation_steps = global / (micro * world)``; it only feeds DeepSpeed's
    bookkeeping, since the loop scales losses itself (``scale_wrt_gas=False``).

    ``gradient_clipping`` is explicit because DeepSpeed 0.19 clips at norm 1.0 unless told
    otherwise, which silently changes the update. Clipping sees the global-batch gradient: the
    loop completes its normalisation before ``engine.step()``.
    """
    if global_batch_size % (micro_batch_size * world_size):
        raise ValueError(f"global_batch_size {global_batch_size} is not a multiple of "
                         f"micro_batch_size {micro_batch_size} x world_size {world_size}")
    cfg: dict[str, Any] = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": global_batch_size // (micro_batch_size * world_size),
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": zero_stage},
        # A client torch optimizer under ZeRO is "untested" to DeepSpeed; it is what we test.
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": gradient_clipping,
        "steps_per_print": 10**9,
    }
    if zero_stage in (1, 2):
        # With overlap_comm DeepSpeed reduces in backward hooks, taking gradients out of .grad.
        cfg["zero_optimization"]["overlap_comm"] = False
    if extra:
        cfg.update(extra)
    return cfg


def check_gradient_dtypes(module: torch.nn.Module, supported: Iterable[torch.dtype],
                          device: str) -> None:
    """Refuse, before any training, a model whose gradients DeepSpeed cannot reduce.

    DeepSpeed finds out only when it first reduces gradients, at the end of the first global
    batch, with an assertion that names neither the model nor what to do ("attempting to
    reduce an unsupported grad type: torch.float64").

    >>> check_gradient_dtypes(torch.nn.Linear(2, 2).double(), [torch.float32], "cpu")
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: the model's parameters are torch.float64 (e.g. 'weight'), but DeepSpeed on cpu ...

    Raises:
        TypeError: a trainable parameter's dtype is not in ``supported``.
    """
    allowed = list(supported)
    bad = [(name, p.dtype) for name, p in module.named_parameters()
           if p.requires_grad and p.dtype not in allowed]
    if bad:
        dtypes = ", ".join(sorted({str(dtype) for _, dtype in bad}))
        raise TypeError(f"the model's parameters are {dtypes} (e.g. {bad[0][0]!r}), but DeepSpeed "
                        f"on {device} reduces gradients of {', '.join(map(str, allowed))} only: "
                        "convert the model before deepspeed.initialize, e.g. model.float()")


def _check_engine_dtypes(engine: Any) -> None:
    """:func:`check_gradient_dtypes` against the accelerator DeepSpeed picked."""
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return  # not a DeepSpeed engine: the caller's engine decides what it reduces
    accelerator = get_accelerator()
    check_gradient_dtypes(engine.module, accelerator.supported_dtypes(),
                          accelerator.device_name())


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's module state dict with every tensor whole, whatever the ZeRO stage.

    Under ZeRO-3 a parameter's ``data`` is an empty placeholder outside forward and backward; each
    is gathered in turn (``deepspeed.zero.GatheredParameters``, read-only) and copied to the host,
    so at most one whole parameter is materialised beyond the partitions. Gathering is a
    collective: with several ranks, every rank must call this, in the same order (the loop does).
    Other stages return ``engine.module.state_dict()`` as it is.
    """
    module = engine.module
    partitioned = getattr(engine, "zero_optimization_partition_weights", lambda: False)()
    if not partitioned:
        return dict(module.state_dict())
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if hasattr(tensor, "ds_id"):  # a ZeRO-3 partitioned parameter
            with deepspeed.zero.GatheredParameters([tensor]):
                out[name] = tensor.detach().to("cpu", copy=True)
        else:
            out[name] = tensor.detach()
    return out


class DeepSpeedTrainLoop:
    """Drive a DeepSpeed engine from a micro-batch subscription.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (see :func:`deepspeed_config`).
        loss_fn: ``loss_fn(engine, batch) -> (loss_sum, count)``; run the forward through ``engine``.
        weights_dir: where weights are published after each step.
        global_count: the global batch's unit count if known up front (required for ZeRO 2/3);
            None derives it from the micro-batches (see :mod:`consumers.accumulation`).
        collate_fn: table -> :class:`TorchBatch`; default :func:`consumers.torch_collate.collate`.
        name: prefix of published files (the agent's name in a multi-agent run).
        keep_last: prune older published files, keeping this many (None keeps all).
        ack_at_step: ack micro-batches after the optimizer step instead of after their backward.

    Raises:
        TypeError: the engine's model has parameters of a dtype DeepSpeed cannot reduce on its
            accelerator (float64 anywhere; see :func:`check_gradient_dtypes`).
        ValueError: ``global_count`` is None with an engine at ZeRO stage 2 or 3.
    """

    def __init__(
        self,
        engine: Any,
        loss_fn: LossFn,
        weights_dir: str | os.PathLike[str],
        *,
        global_count: int | None = None,
        collate_fn: Callable[[pa.Table], TorchBatch] = collate,
        name: str = "policy",
        keep_last: int | None = None,
        ack_at_step: bool = False,
    ) -> None:
        stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
        if stage >= 2 and global_count is None:
            # ZeRO 2/3 take gradients out of .grad at every micro-step: deferred normalisation
            # would rescale nothing and train on wrongly scaled gradients.
            raise ValueError(f"ZeRO stage {stage} reduces gradients at every micro-step; pass global_count "
                             "(the global batch's number of loss units, e.g. samples for a sample-mean loss)")
        self.engine = engine
        self.loss_fn = loss_fn
        self.weights_dir = weights_dir
        self.collate_fn = collate_fn
        self.name = name
        self.keep_last = keep_last
        self.ack_at_step = ack_at_step
        self.step = 0
        _check_engine_dtypes(engine)
        self._acks = PendingAcks()
        self._managed = bool(engine.managed_gradient_accumulation()) if hasattr(engine, "managed_gradient_accumulation") else True
        self.accumulator = GradientAccumulator(
            engine.module.parameters(),
            global_count=global_count,
            backward_fn=lambda loss: engine.backward(loss, scale_wrt_gas=False),
        )

    def run(
        self,
        micro_batches: Iterable[MicroBatchLike],
        bump_version: Callable[..., Any],
        *,
        max_steps: int | None = None,
        stop: threading.Event | None = None,
        poll: float = STOP_POLL_SECONDS,
    ) -> Iterator[StepReport]:
        """Train on ``micro_batches``; yield a :class:`StepReport` after each optimizer step.

        ``bump_version(weights_uri=uri)`` is called after each step; its return value (the new
        version) is reported. Stops after ``max_steps`` steps, when the iterator ends, or when
        ``stop`` is set; a partial global batch at the end is not stepped (its micro-batches are
        left unacked when ``ack_at_step`` so they are re-delivered).

        ``stop`` (an event another thread sets) ends the loop at the next micro-batch: a
        subscription is then asked for one ``poll`` seconds at a time (its ``idle_timeout``
        still ends the loop), so a trainer waiting for rows that never come stops too. It also
        ends a bump waiting at the version group's barrier for another agent's trainer
        (``bump_version`` is then called with ``stop=``, as a subscription's takes): that global
        batch was trained on, stepped, published and acked, the version did not move, its
        arrival stays at the barrier, and nothing is yielded for it (see
        :mod:`consumers.stopping`). Close the subscription afterwards (its in-flight
        micro-batches are nacked; a remote one stops the server waiting for the bump). With
        several ranks, set the event on every rank: a rank that stops alone leaves the
        others waiting in DeepSpeed's collectives.

        Raises:
            TypeError: ``stop`` is given but ``bump_version`` takes no ``stop`` keyword.
        """
        check_takes_stop(bump_version, stop)
        pending: list[MicroBatchLike] = []
        device = getattr(self.engine, "device", torch.device("cpu"))
        if max_steps is not None and max_steps <= 0:
            return
        steps_at_start = self.step
        if stop is not None:
            micro_batches = micro_batches_until(
                micro_batches, stop=stop, poll=poll,
                idle_timeout=getattr(micro_batches, "idle_timeout", None))
        for mb in micro_batches:
            batch = self.collate_fn(mb.data).to(device)
            if self._managed:
                self.engine.set_gradient_accumulation_boundary(bool(mb.is_boundary))
            loss_sum, count = self.loss_fn(self.engine, batch)
            self.accumulator.backward(loss_sum, count, is_last=bool(mb.is_boundary))
            if self.ack_at_step:
                pending.append(mb)
            else:
                self._acks.send(mb)
                if mb.is_boundary:
                    self._settle_before_step()
            if self._managed:
                self.engine.step()  # a no-op unless the boundary was set above
            if mb.is_boundary:
                try:
                    report = self._finish_step(pending, bump_version, stop)
                except BumpStopped:
                    return
                yield report
                pending = []
                # Stop here, not at the next item: pulling one more would claim (and strand) a
                # micro-batch of the next global batch.
                if max_steps is not None and self.step - steps_at_start >= max_steps:
                    return

    def _settle_before_step(self) -> None:
        """Wait for every ack of the global batch before its step: a micro-batch whose lease
        ended went back to the table (for another consumer), so no step may use its gradient;
        the error is raised with the engine's weights as they were and its gradients dropped."""
        try:
            self._acks.settle()
        except BaseException:
            self.accumulator.discard()
            if hasattr(self.engine, "zero_grad"):
                self.engine.zero_grad()
            raise

    def _finish_step(self, pending: list[MicroBatchLike], bump_version: Callable[..., Any],
                     stop: threading.Event | None) -> StepReport:
        micro, loss = self.accumulator.micro_batches, self.accumulator.mean_loss
        count = self.accumulator.finish()
        if not self._managed:
            self.engine.step()
        self.step += 1
        uri = publish_state_dict(full_state_dict(self.engine), self.weights_dir, self.step, name=self.name)
        for mb in pending:
            self._acks.send(mb)
        self._acks.settle()
        version = bump(bump_version, uri, stop)
        if self.keep_last is not None:
            prune_published(self.weights_dir, self.keep_last, name=self.name)
        return StepReport(self.step, micro, count, loss, uri, version if isinstance(version, int) else None)
