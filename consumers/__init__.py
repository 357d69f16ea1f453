"""Trainer-side clients: micro-batch subscriptions and their torch / DeepSpeed glue.

>>> import store
>>> s = store.connect("grpc://127.0.0.1:8815")                            # doctest: +SKIP
>>> sub = s.subscribe("solver", micro_batch_size=16, global_batch_size=64) # doctest: +SKIP
>>> for mb in sub:                                                        # doctest: +SKIP
...     loss = step(mb.data)            # one gradient-accumulation step
...     mb.ack()
...     if mb.is_boundary:              # the global batch is complete
...         optimizer.step(); sub.bump_version(weights_uri=publish(model))

torch, DeepSpeed and their collation helpers are imported only from their own modules
(:mod:`consumers.torch_collate`, :mod:`consumers.accumulation`, :mod:`consumers.deepspeed_loop`,
:mod:`consumers.torch_dataset`: an ``IterableDataset`` for a ``DataLoader`` in a trainer of your own).
"""
from __future__ import annotations

from typing import Any

import store as store_pkg
from store.subscription import MicroBatch, Subscription


def subscribe(target: Any, table: str, micro_batch_size: int, global_batch_size: int,
              **options: Any):
    """Open a subscription on a store object or a URI/path."""
    s = store_pkg.connect(target) if isinstance(target, str) else target
    return s.subscribe(table, micro_batch_size, global_batch_size, **options)


__all__ = ["MicroBatch", "Subscription", "subscribe"]
