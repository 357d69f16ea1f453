"""Time limits of the read side's queries: one thread that calls each query's cancel when its
deadline passes, unless the query ended first.

Why one thread, not a ``threading.Timer`` per query: starting a thread waits until the new
thread runs, which on a busy machine is a scheduling round (and a turn of the interpreter lock)
before every query; a whole table's ``SELECT *`` or a claim predicate paid it each time.

>>> import threading
>>> fired = threading.Event()
>>> deadlines = Deadlines()
>>> armed = deadlines.arm(0.01, fired.set)
>>> fired.wait(5)
True
>>> later = deadlines.arm(60, fired.clear)
>>> deadlines.cancel(later)
>>> deadlines.pending()
0
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("expstore.deadlines")


class Deadline:
    """One armed deadline (see :meth:`Deadlines.arm`); ``action`` is None once it has fired or
    was cancelled."""

    __slots__ = ("action",)

    def __init__(self, action: Callable[[], object]) -> None:
        self.action: Callable[[], object] | None = action


class Deadlines:
    """Calls each armed action once its deadline passes, unless cancelled first, from one
    daemon thread (started on first use)."""

    def __init__(self, name: str = "expstore-deadlines") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._armed = 0          # deadlines in the heap not cancelled nor fired
        self._thread: threading.Thread | None = None
        self._calling: Deadline | None = None    # whose action the thread is calling

    def arm(self, seconds: float, action: Callable[[], object]) -> Deadline:
        """Call ``action`` (on the deadline thread) in ``seconds`` unless :meth:`cancel` comes
        first."""
        deadline = Deadline(action)
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), deadline))
            self._armed += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if self._heap[0][2] is deadline:   # sooner than what the thread waits for
                self._cond.notify()
        return deadline

    def cancel(self, deadline: Deadline) -> None:
        """Do not call its action; if it is being called, return once that call is over (as
        ``Timer.cancel`` would not: then no interrupt lands on the cursor's next query)."""
        with self._cond:
            while self._calling is deadline:
                self._cond.wait()
            if deadline.action is None:
                return
            deadline.action = None
            self._armed -= 1
            # cancelled entries leave the heap as they come to its top, or all at once when
            # they are most of it (long limits, many short queries)
            if len(self._heap) > 64 and len(self._heap) > 2 * self._armed:
                self._heap = [e for e in self._heap if e[2].action is not None]
                heapq.heapify(self._heap)

    def pending(self) -> int:
        """Deadlines armed and neither fired nor cancelled."""
        with self._cond:
            return self._armed

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    heap = self._heap
                    while heap and heap[0][2].action is None:
                        heapq.heappop(heap)
                    if not heap:
                        self._cond.wait()
                        continue
                    wait = heap[0][0] - time.monotonic()
                    if wait <= 0:
                        deadline = heapq.heappop(heap)[2]
                        action, deadline.action = deadline.action, None
                        self._armed -= 1
                        self._calling = deadline
                        break
                    self._cond.wait(wait)
            try:
                assert action is not None
                action()
            except Exception:  # noqa: BLE001 - one failed action must not stop the others
                log.exception("a query's time-limit action failed")
            finally:
                with self._cond:
                    self._calling = None
                    self._cond.notify_all()
