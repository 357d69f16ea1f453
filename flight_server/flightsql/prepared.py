"""Open prepared statements: SQL text and the parameters last bound by DoPut.

A prepared statement is only a name for SQL plus a binding: the executor plans each query
itself, so nothing heavy is held. Handles are random 16-byte tokens, which keeps one client from
using another's statement by guessing. Clients that die without ClosePreparedStatement leave
entries behind, so idle ones expire (the timeout is announced as
FLIGHT_SQL_SERVER_STATEMENT_TIMEOUT) and the number open at once is bounded.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.flight as flight


@dataclass
class PreparedStatement:
    """One open statement; ``parameters`` is the last DoPut's table (None before any)."""

    sql: str
    parameters: pa.Table | None = None
    last_used: float = 0.0


class PreparedStatements:
    """A thread-safe registry of open prepared statements.

    Example:
        >>> registry = PreparedStatements(idle_timeout_s=60.0)
        >>> handle = registry.open("SELECT 1")
        >>> registry.get(handle).sql
        'SELECT 1'
        >>> registry.close(handle)
    """

    def __init__(self, idle_timeout_s: float = 600.0, max_open: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_open = max_open
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[bytes, PreparedStatement] = {}

    def open(self, sql: str) -> bytes:
        """Register ``sql`` and return its new handle.

        Raises:
            FlightUnavailableError: ``max_open`` statements are open and none has expired.
        """
        now = self._clock()
        with self._lock:
            self._expire(now)
            if len(self._open) >= self.max_open:
                raise flight.FlightUnavailableError(
                    f"{len(self._open)} prepared statements are open, the limit is "
                    f"{self.max_open}: close statements with ClosePreparedStatement")
            handle = secrets.token_bytes(16)
            self._open[handle] = PreparedStatement(sql, None, now)
            return handle

    def get(self, handle: bytes) -> PreparedStatement:
        """The statement of ``handle``, marked as used now.

        Raises:
            KeyError: no such open statement (never created, closed or expired).
        """
        now = self._clock()
        with self._lock:
            self._expire(now)
            statement = self._open.get(handle)
            if statement is None:
                raise KeyError(f"prepared statement handle {handle.hex()!r} is not open: "
                               "it was closed, expired after "
                               f"{self.idle_timeout_s:g} s idle, or never created")
            statement.last_used = now
            return statement

    def bind(self, handle: bytes, parameters: pa.Table) -> None:
        """Replace the parameters bound to ``handle`` (see :meth:`get` for errors)."""
        statement = self.get(handle)
        with self._lock:
            statement.parameters = parameters

    def close(self, handle: bytes) -> None:
        """Forget ``handle``; closing an unknown or expired handle is not an error."""
        with self._lock:
            self._open.pop(handle, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def _expire(self, now: float) -> None:
        if self.idle_timeout_s <= 0:
            return
        deadline = now - self.idle_timeout_s
        for handle in [h for h, s in self._open.items() if s.last_used < deadline]:
            del self._open[handle]
