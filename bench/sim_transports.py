"""Transports for the pipeline simulation: how rollouts hand samples to the trainer.

A transport gives rollout workers ``producer()`` (a ``put(row)`` of their own, one connection
each, as separate rollout processes would have) and ``wait_version(v)``, and the trainer
``subscribe(size, global_size)``, ``next_batch(timeout)`` (a batch with ``ack()`` and
``is_boundary``, or None) and ``bump()``.

* ``IdealTransport``: an in-memory ``queue.Queue`` and a condition variable — the floor.
* ``ExpstoreTransport``: the real thing, through a running expstore server: one-sample puts, a
  micro-batch subscription, ``bump_version`` at the global-batch boundary and ``wait_version`` for
  the rollouts (each side on its own connection).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import pyarrow as pa

from bench.workloads import NARROW_COLUMNS, narrow_table


class Transport(Protocol):
    name: str

    def producer(self) -> tuple[Callable[[pa.Table], None], Callable[[], None]]: ...
    def wait_version(self, version: int) -> int: ...
    def subscribe(self, size: int, global_size: int) -> None: ...
    def next_batch(self, timeout: float) -> Any: ...
    def bump(self) -> int: ...
    def version(self) -> int: ...
    def close(self) -> None: ...


class _IdealBatch:
    def __init__(self, rows: list[pa.Table], is_boundary: bool) -> None:
        self.rows = rows
        self.is_boundary = is_boundary

    def ack(self, wait: bool = True) -> None:
        pass


class IdealTransport:
    name = "ideal"

    def __init__(self) -> None:
        self._q: queue.Queue[pa.Table] = queue.Queue()
        self._cond = threading.Condition()
        self._version = 0

    def producer(self) -> tuple[Callable[[pa.Table], None], Callable[[], None]]:
        return self._q.put, lambda: None

    def version(self) -> int:
        with self._cond:
            return self._version

    def wait_version(self, version: int) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._version >= version)
            return self._version

    def subscribe(self, size: int, global_size: int) -> None:
        self._size, self._per_global = size, global_size // size
        self._pending: list[pa.Table] = []
        self._k = 0

    def next_batch(self, timeout: float) -> _IdealBatch | None:
        try:
            while len(self._pending) < self._size:
                self._pending.append(self._q.get(timeout=timeout))
        except queue.Empty:
            return None
        rows, self._pending = self._pending, []
        self._k += 1
        return _IdealBatch(rows, is_boundary=self._k % self._per_global == 0)

    def bump(self) -> int:
        with self._cond:
            self._version += 1
            self._cond.notify_all()
            return self._version

    def close(self) -> None:
        pass


class ExpstoreTransport:
    name = "expstore"

    def __init__(self, uri: str, table: str) -> None:
        import store

        self._uri = uri
        self._table = table
        self._producer = store.connect(uri)
        self._trainer = store.connect(uri)
        self._producer.create_table(table, dict(NARROW_COLUMNS), if_not_exists=True)
        self._warmup_table = f"{table}_warmup"
        self._producer.create_table(self._warmup_table, dict(NARROW_COLUMNS),
                                    if_not_exists=True)
        self._producers = 0
        self._sub: Any = None

    def producer(self) -> tuple[Callable[[pa.Table], None], Callable[[], None]]:
        import store

        s = store.connect(self._uri)
        # A rollout worker connects once and writes for hours. Its client opens the stream its
        # puts travel on at its first put: do that here, on a table of its own, so that the run
        # does not time a connection set-up per worker (the ideal queue has none) in its first
        # global batch.
        self._producers += 1
        s.put(self._warmup_table, narrow_table(1, start=10**9 + self._producers))
        return (lambda row: s.put(self._table, row)), s.close

    def version(self) -> int:
        return int(self._producer.get_version(self._table))

    def wait_version(self, version: int) -> int:
        return int(self._producer.wait_version(self._table, version))

    def subscribe(self, size: int, global_size: int) -> None:
        self._sub = self._trainer.subscribe(self._table, micro_batch_size=size,
                                            global_batch_size=global_size)

    def next_batch(self, timeout: float) -> Any:
        return self._sub.next(timeout=timeout)

    def bump(self) -> int:
        return int(self._sub.bump_version())

    def close(self) -> None:
        if self._sub is not None and hasattr(self._sub, "close"):
            self._sub.close()
        self._trainer.close()
        self._producer.close()
