"""What is worked out once for a cached put's Arrow table and kept while that table lives (its
claim layout, which of its key columns name a chunk whole)."""
from __future__ import annotations

import weakref
from typing import Callable, Generic, TypeVar

import pyarrow as pa

T = TypeVar("T")


class TableMemo(Generic[T]):
    """A value per live table, by identity: tables are not hashable, and two puts with equal
    contents are still two entries of the claim cache. An entry goes when its table does."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, T]] = {}

    def of(self, table: pa.Table, make: Callable[[], T]) -> T:
        """The value kept for ``table``, made by ``make()`` on first use."""
        memo = id(table)
        known = self._known.get(memo)
        if known is not None and known[0]() is table:
            return known[1]
        value = make()
        self._known[memo] = (weakref.ref(table, lambda _: self._known.pop(memo, None)), value)
        return value
