"""How a trainer's loop stops when asked: between micro-batches and at the version barrier.

Both trainers (:class:`consumers.trainer.TorchTrainer` and
:class:`consumers.deepspeed_loop.DeepSpeedTrainLoop`) take a ``stop`` event that another thread
sets (``TrainerThread.stop``, a signal handler). It ends the loop in either of its two waits:

* waiting for the next micro-batch: :func:`micro_batches_until` asks a subscription for one
  ``poll`` seconds at a time and looks at the event in between, so a stopped trainer claims
  nothing it will not train on;
* waiting at the version group's barrier for another agent's trainer: :func:`bump` hands the
  event to ``bump_version``, which raises :class:`store.subscription.BumpStopped` soon after it
  is set. The global batch behind that bump was trained on, stepped and acked; the version did
  not move and the arrival stays (see ``Subscription.bump_version``).
"""
from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from store.subscription import STOP_POLL_SECONDS

__all__ = ["micro_batches_until", "bump", "check_takes_stop"]


def micro_batches_until(source: Iterable[Any], *, stop: threading.Event | None = None,
                        idle_timeout: float | None = None,
                        poll: float = STOP_POLL_SECONDS) -> Iterator[Any]:
    """``source``'s micro-batches until ``stop`` is set or ``idle_timeout`` seconds pass
    without one.

    A subscription (anything with ``next(timeout=...)``) is asked ``poll`` seconds at a time,
    so a stop or the idle timeout ends a wait for a micro-batch that may never come. Any other
    iterable is iterated, the event looked at before each item is taken (its own waits are its
    own). Nothing is taken from ``source`` after the event is set, nor before the caller asks
    for the next item: a caller that stops asking strands nothing.
    """
    next_of = getattr(source, "next", None)
    if next_of is None:
        items = iter(source)
        while stop is None or not stop.is_set():
            try:
                yield next(items)
            except StopIteration:
                return
        return
    last = time.monotonic()
    while stop is None or not stop.is_set():
        mb = next_of(timeout=poll)
        if mb is None:
            if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                return
            continue
        last = time.monotonic()
        yield mb


def _takes_stop(bump_version: Callable[..., Any]) -> bool:
    """Whether ``bump_version`` accepts a ``stop`` keyword."""
    try:
        params = inspect.signature(bump_version).parameters
    except (TypeError, ValueError):
        return False
    return "stop" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_takes_stop(bump_version: Callable[..., Any], stop: threading.Event | None) -> None:
    """Refuse, before any training, a ``stop`` that the bump could not honour.

    Raises:
        TypeError: ``stop`` is given and ``bump_version`` takes no ``stop`` keyword (it would
            fail only after the first global batch's step).
    """
    if stop is not None and not _takes_stop(bump_version):
        raise TypeError(f"bump_version {bump_version!r} takes no 'stop' keyword, so a stop "
                        "could not end its wait at the barrier; pass a subscription's "
                        "bump_version (it takes stop=) or call run() without stop")


def bump(bump_version: Callable[..., Any], weights_uri: str | None,
         stop: threading.Event | None) -> Any:
    """``bump_version(weights_uri=...)``, handed ``stop`` when there is one.

    Raises:
        store.subscription.BumpStopped: ``stop`` was set while the bump waited at the barrier.
    """
    if stop is None:
        return bump_version(weights_uri=weights_uri)
    return bump_version(weights_uri=weights_uri, stop=stop)
