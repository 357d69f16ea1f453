"""Gradient accumulation that reproduces the full global-batch gradient exactly.

The global-batch loss is ``L = (1/D) * sum_j S_j`` where micro-batch ``j`` contributes the *sum*
``S_j`` of its per-unit losses and ``D = sum_j d_j`` counts the units of the whole global batch:

* token-level normalisation (token-mean, e.g. DAPO / GRPO "token-mean"): a unit is a loss token,
  ``d_j`` is the micro-batch's number of loss tokens;
* sample-level normalisation (sequence-mean): a unit is a sample, ``S_j`` sums each sample's own
  loss (itself a mean over its tokens, if you like), ``d_j`` is the number of samples.

Gradients are linear, so backpropagating ``S_j / D`` per micro-batch and summing gives exactly
``grad L``. The common shortcut, backpropagating each micro-batch's *mean* divided by the number
of micro-batches (DeepSpeed's ``scale_wrt_gas``), equals ``grad L`` only when every micro-batch has
the same count ``d_j``. With streamed RL samples it does not: responses have different lengths, and
group claims make micro-batches of different sizes. Hence this helper.

The catch for token-level losses is that ``D`` is known only when the global batch is complete,
but micro-batches are backpropagated as they arrive (that is the point of the pipeline). Two ways:

1. **Known denominator** (``global_count=D``): the caller knows ``D`` up front (sample-level with a
   fixed global batch size; token-level with fixed-length sequences, or a constant normaliser such
   as Dr. GRPO's ``global_batch * max_len``). Each micro-batch backpropagates ``S_j / D``. Works
   with any engine, including ZeRO stage 2/3 which reduce gradients every micro-step.
   :meth:`GradientAccumulator.finish` checks that the counts really summed to ``D``.
2. **Deferred** (``global_count=None``, the default): micro-batches backpropagate ``c * S_j`` with
   a provisional scale ``c`` (``1 / d_0``, which keeps gradient magnitudes sane), and when ``D`` is
   known the accumulated gradients held in ``param.grad`` are multiplied by ``1 / (c * D)``. If the
   caller flags the last micro-batch (``is_last=True``, the subscription's ``is_boundary``), the
   rescale happens *before* its backward and that backward uses ``S_last / D`` directly; otherwise
   :meth:`~GradientAccumulator.finish` rescales. Either way the result is exact (one extra
   multiply per gradient element). It needs the gradients to stay in ``param.grad`` between
   micro-steps: plain torch, DeepSpeed ZeRO 0 and 1. Not ZeRO 2/3: use a known denominator there.

Example (plain torch, token-mean over a global batch split 3 + 1):
    >>> import torch
    >>> w = torch.nn.Parameter(torch.tensor([1.0]))
    >>> acc = GradientAccumulator([w])
    >>> for x, last in ((torch.tensor([1.0, 2.0, 3.0]), False), (torch.tensor([4.0]), True)):
    ...     _ = acc.backward((w * x).sum(), count=len(x), is_last=last)
    >>> acc.finish()
    4
    >>> w.grad.item()  # mean of 1, 2, 3, 4
    2.5
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["GradientAccumulator", "reduce_loss", "BackwardFn"]

BackwardFn = Callable[[torch.Tensor], object]


def _default_backward(loss: torch.Tensor) -> None:
    loss.backward()


class GradientAccumulator:
    """Scales micro-batch losses so the accumulated gradient equals the global-batch gradient.

    Args:
        params: the parameters whose ``.grad`` accumulates (the deferred mode rescales them).
        global_count: the global batch's unit count ``D`` if known up front; None defers it.
        backward_fn: how to backpropagate a scaled loss; default ``loss.backward()``. For DeepSpeed:
            ``lambda loss: engine.backward(loss, scale_wrt_gas=False)``.

    One instance serves many global batches: call :meth:`finish` before the optimizer step, then
    the accumulator is ready for the next global batch.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        global_count: int | None = None,
        backward_fn: BackwardFn | None = None,
    ) -> None:
        if global_count is not None and global_count <= 0:
            raise ValueError(f"global_count must be > 0, got {global_count}")
        self.params = [p for p in params if p.requires_grad]
        self.global_count = global_count
        self.backward_fn = backward_fn or _default_backward
        self._reset()

    def _reset(self) -> None:
        self.count = 0
        self.micro_batches = 0
        self.loss_sum = 0.0
        self._provisional: float | None = None
        self._finalized = False

    @property
    def deferred(self) -> bool:
        return self.global_count is None

    def backward(
        self,
        loss: torch.Tensor,
        count: int | torch.Tensor,
        *,
        reduction: str = "sum",
        is_last: bool = False,
    ) -> torch.Tensor:
        """Backpropagate one micro-batch's loss with the scale that makes accumulation exact.

        Args:
            loss: the micro-batch's loss: the sum over its units (``reduction="sum"``), or their
                mean (``reduction="mean"``; it is multiplied back by ``count``).
            count: the micro-batch's number of units (loss tokens or samples), ``d_j``.
            is_last: this micro-batch completes the global batch (``MicroBatch.is_boundary``).

        Returns:
            The scaled loss that was backpropagated (detached).
        """
        if self._finalized:
            raise RuntimeError("backward after the global batch was finalised; call finish() first")
        d = int(count)
        if d < 0:
            raise ValueError(f"count must be >= 0, got {d}")
        if reduction == "mean":
            loss = loss * d
        elif reduction != "sum":
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.count += d
        self.micro_batches += 1
        self.loss_sum += float(loss.detach())
        if self.global_count is not None:
            scale = 1.0 / self.global_count
        elif is_last:
            if self.count == 0:
                raise ValueError("the global batch has no loss units (count 0 in every micro-batch)")
            if self._provisional is not None:
                self._rescale(1.0 / (self._provisional * self.count))
            scale = 1.0 / self.count
            self._finalized = True
        else:
            if self._provisional is None:
                self._provisional = 1.0 / max(d, 1)
            scale = self._provisional
        scaled = loss * scale
        self.backward_fn(scaled)
        if self.deferred and not is_last and self._provisional is not None and d > 0:
            self._check_grads_kept()
        return scaled.detach()

    def finish(self) -> int:
        """Complete the global batch's gradient (rescaling if still needed); return ``D``.

        Call it after the last micro-batch's backward and before the optimizer step.

        Raises:
            ValueError: a known ``global_count`` does not match the counts seen.
        """
        if self.global_count is not None and self.count != self.global_count:
            total = self.count
            self._reset()
            raise ValueError(f"micro-batch counts sum to {total}, but global_count is {self.global_count}")
        if self.deferred and not self._finalized:
            if self.count == 0:
                raise ValueError("the global batch has no loss units (count 0 in every micro-batch)")
            if self._provisional is not None:
                self._rescale(1.0 / (self._provisional * self.count))
        total = self.count
        self._reset()
        return total

    def discard(self) -> None:
        """Drop the global batch so far: its gradients (``param.grad`` set to None) and counts.

        For a global batch that must not be stepped (an ack of it failed: its rows went back).
        """
        for p in self.params:
            p.grad = None
        self._reset()

    @property
    def mean_loss(self) -> float:
        """The global-batch loss so far, ``sum_j S_j / sum_j d_j`` (for logging)."""
        return self.loss_sum / self.count if self.count else float("nan")

    @torch.no_grad()
    def _rescale(self, factor: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def _check_grads_kept(self) -> None:
        # ZeRO 2/3 move gradients out of .grad every micro-step; rescaling .grad would then silently
        # do nothing, so refuse instead of training on wrong gradients.
        if self.params and all(p.grad is None for p in self.params):
            raise RuntimeError(
                "deferred normalisation needs gradients to stay in param.grad between micro-steps "
                "(plain torch, DeepSpeed ZeRO 0/1); pass global_count=... for engines that reduce every step")


def reduce_loss(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    segment_ids: torch.Tensor,
    num_samples: int,
    level: str = "token",
) -> tuple[torch.Tensor, int]:
    """Reduce a ``[R, L]`` per-token loss to ``(loss_sum, count)`` for :class:`GradientAccumulator`.

    ``level="token"``: the sum over loss tokens and their number (global token-mean).
    ``level="sample"``: each sample's mean over its loss tokens, summed, and the number of samples
    that have any loss token (global sample-mean). Works for padded and packed layouts.
    """
    mask = loss_mask.to(per_token.dtype)
    if level == "token":
        return (per_token * mask).sum(), int(loss_mask.sum())
    if level != "sample":
        raise ValueError(f"level must be 'token' or 'sample', got {level!r}")
    seg = segment_ids.clamp(min=0).reshape(-1)
    sums = torch.zeros(num_samples, dtype=per_token.dtype, device=per_token.device).index_add_(
        0, seg, (per_token * mask).reshape(-1))
    counts = torch.zeros(num_samples, dtype=per_token.dtype, device=per_token.device).index_add_(0, seg, mask.reshape(-1))
    has = counts > 0
    return (sums[has] / counts[has]).sum(), int(has.sum())
