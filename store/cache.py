"""How much memory the claim cache may hold: ready rows' claimable values, kept so that claims
need no DuckDB read.

Why a bound: every put's values stayed cached until their rows were consumed, so a server whose
producers outran its trainers grew by each backlog row's values (a soak's server grew far past
DuckDB's memory limit; docs/reliability.md, section 4). Now a put's values are cached only while
the cache holds less than its limit; rows put past it are claimed from DuckDB (the claim that
reads them reads the next ready rows' values too, see ``ClaimEngine._read_values``), and the
cache fills again as the backlog drains. Rows that the put log holds and DuckDB does not yet
have are always cached (DuckDB cannot serve them); once applied to DuckDB, they leave the cache
if it is over its limit (see ``LoggedChanges.applied`` in store/logged.py).

What is counted is the Arrow tables the cache refers to (a put's batch, or rows read back from
DuckDB), by the size of the buffers they hold (a slice holds its whole buffer; ``nbytes``, which
counts only the sliced part, costs many times as much as that on a table of store width), from
when the cache takes one until the table is freed (its last row consumed or evicted): a
``weakref.finalize`` gives the bytes back, so no code path has to remember to.
"""
from __future__ import annotations

import re
import threading
import weakref

import pyarrow as pa

from .errors import InvalidArgument

#: The default limit: room for ~1 M narrow rows or ~80 k wide ones (4 KB of text, 1,024 token ids
#: and logprobs), far more than a trainer's next few micro-batches need.
DEFAULT_CACHE_LIMIT = "1GiB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(value: str | int) -> int:
    """Bytes of a size such as ``1GB``, ``512MiB`` or ``0`` (DuckDB's spelling; KB = 1000 B,
    KiB = 1024 B).

    Raises:
        InvalidArgument: not a size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgument(f"size {value!r} is negative; expected bytes >= 0")
        return value
    match = _SIZE.fullmatch(str(value))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidArgument(f"size {value!r} is invalid; expected a number of bytes with an "
                              "optional unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MB")
    return int(float(match.group(1)) * _UNITS[unit])


class ClaimCache:
    """Counts the bytes of the tables ready rows' cached values refer to, against a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()  # finalizers run on whichever thread frees a table

    @property
    def full(self) -> bool:
        return self.used >= self.limit

    def admit(self, table: pa.Table) -> bool:
        """Count ``table`` if there is room; False: do not cache it."""
        if self.full:
            return False
        self.hold(table)
        return True

    def hold(self, table: pa.Table) -> None:
        """Count ``table`` whatever the limit (values DuckDB cannot serve yet, or rows a claim
        read back)."""
        size = table.get_total_buffer_size()
        with self._lock:
            self.used += size
        weakref.finalize(table, self._release, size)

    def _release(self, size: int) -> None:
        with self._lock:
            self.used -= size
