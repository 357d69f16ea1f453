"""A torch ``IterableDataset`` over a subscription, for a trainer of your own (TRL, verl style).

Hand it to ``DataLoader(ds, batch_size=None)``: each item is one micro-batch collated to tensors
(:func:`consumers.torch_collate.collate`, or your ``collate_fn``, with its keyword options), a
:class:`StoreItem` that also carries the claim, the version it was claimed at and whether it
ends a global batch.

When a micro-batch is settled (the rule):

* It is **acked when the next item is asked for**: the loop asks only once its step on this one
  is done (backward included). The ack is sent without waiting (:mod:`consumers.acks`).
* The item with ``is_boundary`` ends a global batch. Your loop then takes its optimizer step and
  calls :meth:`SubscriptionDataset.bump_version` (``weights_uri=`` where you published the
  weights): it acks that last micro-batch, waits until every ack of the global batch is durable
  (raising if one failed, e.g. its lease expired and its rows went back: the version does not
  move), then bumps the version and starts the next global batch. Call
  :meth:`SubscriptionDataset.settle` before ``optimizer.step()`` to have a failed ack stop the
  step itself. Asking for the next item without bumping is an error.
* A micro-batch the loop did not finish (its step raised, or the loop stopped early) is never
  acked: it is nacked when the iteration ends (the DataLoader's iterator is closed or dropped,
  a new iteration starts, or :meth:`SubscriptionDataset.close`), and its rows are delivered
  again. Were the process to die first, its lease expires (or the ``grpc://`` stream's end
  gives it back) with the same result.

``num_workers`` must be 0: the subscription holds gRPC connections and threads (or the embedded
store's DuckDB connection), which cannot be copied into worker processes. A worker refuses to
start with an error saying so. Collation is fast next to a training step; the subscription
already prefetches (the server pushes micro-batches ahead, up to ``max_in_flight``).

Example (embedded store; a ``grpc://`` store's subscription works the same)::

    >>> import store, tempfile, os, torch
    >>> from torch.utils.data import DataLoader
    >>> from consumers.trainer import grpo_loss
    >>> from producers.rollout.tiny_lm import build_tiny_lm
    >>> s = store.connect(os.path.join(tempfile.mkdtemp(), "x.duckdb"))
    >>> _ = s.create_table("agent", {"token_ids": "list<int32>", "prompt_len": "int32",
    ...                              "logprobs": "list<float32>", "reward": "float64"},
    ...                    max_staleness=1)   # rows of version 0 still train at version 1
    >>> _ = s.put("agent", [{"sample_id": f"q{i // 2}_0_{i % 2}", "token_ids": [256, 1, 2],
    ...                      "prompt_len": 2, "logprobs": [-5.0], "reward": float(i % 2)}
    ...                     for i in range(16)])
    >>> model = build_tiny_lm(seed=0)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> sub = s.subscribe("agent", micro_batch_size=4, global_batch_size=8,
    ...                   group_by="input_id", group_size=2)
    >>> ds = SubscriptionDataset(sub, max_global_batches=2, group_size=2)
    >>> for item in DataLoader(ds, batch_size=None):
    ...     loss_sum, count = grpo_loss(model, item.batch)
    ...     (loss_sum / count / 2).backward()        # 2 micro-batches per global batch
    ...     if item.is_boundary:
    ...         opt.step(); opt.zero_grad()
    ...         _ = ds.bump_version(weights_uri=None)
    >>> s.get_version("agent"), s.stats("agent")["agent"]["consumed"]
    (2, 16)
    >>> ds.close(); s.close()
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from torch.utils.data import IterableDataset, get_worker_info

from consumers.acks import PendingAcks
from consumers.torch_collate import TorchBatch, collate
from store.errors import InvalidArgument

__all__ = ["StoreItem", "SubscriptionDataset"]


@dataclass
class StoreItem:
    """One micro-batch as the DataLoader yields it: its tensors and what settles it."""

    #: the collated tensors (:class:`consumers.torch_collate.TorchBatch` with the default collate)
    batch: TorchBatch | Any
    #: the claim (:class:`store.subscription.MicroBatch`): rows in ``micro_batch.data``
    micro_batch: Any

    @property
    def is_boundary(self) -> bool:
        """True for the last micro-batch of a global batch: step, then ``ds.bump_version()``."""
        return bool(self.micro_batch.is_boundary)

    @property
    def version(self) -> int:
        """The policy version the micro-batch was claimed at."""
        return int(self.micro_batch.version)

    @property
    def index(self) -> int:
        """Its position in the global batch (0-based)."""
        return int(self.micro_batch.index)

    @property
    def claim_id(self) -> str:
        return str(self.micro_batch.claim_id)

    @property
    def num_rows(self) -> int:
        return int(self.micro_batch.data.num_rows)


class SubscriptionDataset(IterableDataset):
    """Micro-batches of ``subscription``, collated, for ``DataLoader(ds, batch_size=None)``.

    Args:
        subscription: from ``store.subscribe(...)`` (embedded or ``grpc://``).
        collate_fn: table -> batch; default :func:`consumers.torch_collate.collate`.
        max_global_batches: end each iteration after this many global batches (None: go on);
            it never claims past the last one.
        idle_timeout: end the iteration after this many seconds without a micro-batch
            (None: wait for rows forever).
        ack_timeout: seconds :meth:`settle` waits for the answer to the acks.
        **collate_options: passed to ``collate_fn`` (``columns``, ``pad_id``, ``pack_length``,
            ``group_size``, ...).
    """

    def __init__(self, subscription: Any, *,
                 collate_fn: Callable[..., Any] = collate,
                 max_global_batches: int | None = None, idle_timeout: float | None = None,
                 ack_timeout: float = 120.0, **collate_options: Any) -> None:
        super().__init__()
        if max_global_batches is not None and (not isinstance(max_global_batches, int) or
                                               isinstance(max_global_batches, bool) or
                                               max_global_batches < 1):
            raise InvalidArgument(f"max_global_batches {max_global_batches!r} is invalid; "
                                  "expected an integer >= 1 or None")
        self.subscription = subscription
        self.collate_fn = collate_fn
        self.collate_options = collate_options
        self.max_global_batches = max_global_batches
        self.idle_timeout = idle_timeout
        self._acks = PendingAcks(timeout=ack_timeout)
        #: the micro-batch last handed out and not settled yet
        self._current: Any = None
        #: which iteration is live: an older generator, closed late, must not touch the new one's
        self._generation = 0

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[StoreItem]:
        info = get_worker_info()
        if info is not None:
            raise RuntimeError(
                f"SubscriptionDataset cannot run in a DataLoader worker process "
                f"(num_workers={info.num_workers}): its subscription holds gRPC connections and "
                "threads (or the embedded store's DuckDB connection), which cannot cross "
                "processes. Use DataLoader(ds, batch_size=None, num_workers=0); the "
                "subscription already fetches micro-batches ahead of the loop.")
        self._give_back_current()  # a previous iteration left it unfinished
        self._generation += 1
        return self._items(self._generation)

    def _items(self, generation: int) -> Iterator[StoreItem]:
        boundaries = 0
        try:
            while self.max_global_batches is None or boundaries < self.max_global_batches:
                mb = self.subscription.next(timeout=self.idle_timeout)
                if mb is None:
                    return
                self._current = mb
                item = StoreItem(self._collate(mb.data), mb)
                if mb.is_boundary:
                    boundaries += 1
                yield item
                # Asked for the next item: the loop's step on this one is done.
                self._finish_current()
        finally:
            if generation == self._generation:
                self._give_back_current()

    def _collate(self, data: pa.Table) -> Any:
        return self.collate_fn(data, **self.collate_options)

    def _finish_current(self) -> None:
        mb = self._current
        if mb is None:
            return
        if mb.is_boundary and self.subscription.at_boundary:
            raise InvalidArgument(
                f"micro-batch {mb.index} ended global batch {mb.global_batch}: call "
                "ds.bump_version(weights_uri=...) after the optimizer step, before asking for "
                "the next item; it stays unacked and is delivered again")
        self._current = None
        self._acks.send(mb)

    def _give_back_current(self) -> None:
        mb, self._current = self._current, None
        if mb is None:
            return
        try:
            mb.nack()
        except Exception:  # noqa: BLE001 - a lease that already ended gives the rows back too
            pass

    # -- the end of a global batch -------------------------------------------------------------
    def settle(self) -> None:
        """At the end of a global batch: ack its last micro-batch and wait until every ack is
        durable. Call it before ``optimizer.step()`` to have a lost lease stop the step.

        Raises:
            InvalidArgument: the subscription is not at the end of a global batch.
            store.errors.LeaseExpired: a micro-batch's lease ended before its ack (its rows went
                back to the table): the global batch's gradient must not be used.
            store.errors.Unavailable: no answer within ``ack_timeout`` seconds.
        """
        if not self.subscription.at_boundary:
            raise InvalidArgument("settle() and bump_version() belong at the end of a global "
                                  "batch (after the item with is_boundary); the subscription "
                                  "is in the middle of one")
        mb, self._current = self._current, None
        if mb is not None:
            self._acks.send(mb)
        self._acks.settle()

    def bump_version(self, weights_uri: str | None = None) -> int:
        """After the optimizer step at a boundary: :meth:`settle`, then bump the version
        (``subscription.bump_version``) and start the next global batch. Returns the new
        version."""
        self.settle()
        return int(self.subscription.bump_version(weights_uri=weights_uri))

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Nack the unfinished micro-batch, if any, and close the subscription."""
        self._generation += 1
        self._give_back_current()
        self.subscription.close()

    def __enter__(self) -> SubscriptionDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a SubscriptionDataset cannot be pickled: its subscription holds gRPC "
                        "connections and threads (or a DuckDB connection) that cannot cross "
                        "processes; use DataLoader(ds, batch_size=None, num_workers=0)")

