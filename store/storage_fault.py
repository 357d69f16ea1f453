"""The store's state while its database cannot be written: a full disk, a failed checkpoint.

Why a state and not an error per write: when DuckDB fails a checkpoint (a full disk) it
invalidates the database, and every later statement fails the same way; a writer retrying each
change in a loop logs thousands of errors a second while the put log keeps acknowledging puts
that cannot reach DuckDB. Instead the writer enters this state once (one log line naming the
cause), refuses every change at once with :class:`StorageUnavailable` (retryable: nothing of it
is stored), tries to recover on a back-off (reopen DuckDB if it was invalidated, then apply the
changes waiting in the put log), and leaves the state once that commits (one log line).
``health`` and ``/metrics`` report the state and its cause meanwhile.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .errors import StorageUnavailable

log = logging.getLogger("expstore.writer")

#: Seconds before the first try to recover, doubled after each failed try up to RETRY_MAX.
RETRY_FIRST = 0.5
RETRY_MAX = 5.0
#: A recovery that keeps failing is logged again at most this often (once a minute, not a storm).
RELOG_SECONDS = 60.0


@dataclass
class StorageFault:
    """Why the database cannot be written, and when to try again.

    Args:
        cause: the error that put the store in this state (its text).
        invalid: DuckDB invalidated the database; it must be opened again before any statement.
    """

    cause: str
    invalid: bool
    since: float = field(default_factory=time.time)
    retry_at: float = field(default_factory=lambda: time.monotonic() + RETRY_FIRST)
    delay: float = RETRY_FIRST
    attempts: int = 0
    _logged_at: float = field(default_factory=time.monotonic)
    #: A database DuckDB invalidated is trusted again only once a checkpoint succeeds (the
    #: failure was a checkpoint, or a write, that found no room).
    checkpoint_due: bool = False

    def __post_init__(self) -> None:
        self.checkpoint_due = self.invalid

    def error(self, waiting: int = 0, read: bool = False) -> StorageUnavailable:
        """The error every change (or, ``read``, every SQL read) gets meanwhile; ``waiting``:
        acknowledged changes in the put log that DuckDB does not have yet (they are applied
        once it recovers)."""
        held = f"; {waiting} acknowledged changes wait in the put log (durable)" if waiting \
            else ""
        what = "a read now would miss acknowledged changes or fail" if read else \
            "nothing of this change was stored"
        return StorageUnavailable(
            f"the database cannot be written: {self.cause}{held}; {what}. The store retries on "
            "its own and works again once the cause is gone (free disk space); retry later")

    def update(self, cause: str, invalid: bool) -> None:
        """The cause of a later failure while in this state (a failed try to recover)."""
        self.invalid = self.invalid or invalid
        self.checkpoint_due = self.checkpoint_due or invalid
        changed = cause != self.cause
        self.cause = cause
        now = time.monotonic()
        if changed or now - self._logged_at >= RELOG_SECONDS:
            self._logged_at = now
            log.warning("the database still cannot be written after %d tries (%.0f s): %s",
                        self.attempts, time.time() - self.since, cause)
        else:
            log.debug("the database still cannot be written: %s", cause)

    def failed_try(self) -> None:
        """Back off after a try to recover that failed."""
        self.delay = min(self.delay * 2, RETRY_MAX)
        self.retry_at = time.monotonic() + self.delay

    def due(self) -> bool:
        return time.monotonic() >= self.retry_at

    def seconds_to_retry(self) -> float:
        return max(0.0, self.retry_at - time.monotonic())

    def describe(self, waiting: int) -> dict:
        """For ``health``: the cause, since when, and what waits."""
        return {"cause": self.cause, "since": self.since, "reopen_needed": self.invalid,
                "recovery_tries": self.attempts, "waiting_changes": waiting,
                "retrying_every_s": self.delay}
