"""Acks a trainer sends without waiting, settled before its version bump.

A trainer acks each micro-batch right after its backward. Waiting for the answer (the ack is
durable, a commit on the server) put a round trip into every micro-batch: a share of every
step on the CPU, and a larger one on a GPU, where a micro-batch trains faster (see BENCHMARKS.md,
"On a GPU"). Sent with ``ack(wait=False)`` the ack travels while the next
micro-batch trains; the store applies it before any later change, the bump included. The torch
and DeepSpeed trainers still wait for every answer before their optimizer step, so a failed ack (an expired lease: the rows go to another consumer) stops the step instead
of passing unnoticed.
"""
from __future__ import annotations

import inspect
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

from store.errors import Unavailable

__all__ = ["PendingAcks"]


def _takes_wait(ack: Any) -> bool:
    try:
        params = inspect.signature(ack).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "wait" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class PendingAcks:
    """Send acks without waiting; :meth:`settle` waits for all of them (raising the first error)."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self._futures: list[Future] = []

    def send(self, mb: Any) -> None:
        """Ack ``mb`` without waiting where it can (a :class:`store.subscription.MicroBatch`
        can); a micro-batch of the caller's own whose ``ack()`` takes no ``wait`` is acked as it
        acks, before this returns."""
        if _takes_wait(mb.ack):
            answer = mb.ack(wait=False)
        else:
            answer = mb.ack()
        if isinstance(answer, Future):
            self._futures.append(answer)

    def settle(self) -> None:
        """Wait until every ack sent so far is durable; raise the first one's error, if any.

        Raises:
            Unavailable: the server stopped (at once: its stream's acks fail when it ends), or
                sent no answer within ``timeout`` seconds.
        """
        futures, self._futures = self._futures, []
        for future in futures:
            try:
                future.result(self.timeout)
            except FutureTimeout:
                raise Unavailable(f"no answer to an ack within {self.timeout:g} s: the server "
                                  "is overloaded or unreachable") from None

    def __len__(self) -> int:
        return len(self._futures)
