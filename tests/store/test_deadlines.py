"""The query time limits' thread (store/deadlines.py): an armed action runs once its deadline
passes, never once cancelled, and cancelling waits for an action being run."""
from __future__ import annotations

import threading
import time

from store.deadlines import Deadlines
from waiting import wait_until


def test_an_action_runs_once_its_deadline_passes_and_in_deadline_order():
    deadlines = Deadlines()
    ran: list[str] = []
    done = threading.Event()
    started = time.monotonic()      # before arming: a deadline counts from its arm call
    # "soon" is armed second yet due 0.45 s before "late": only a stall of that long between
    # the two arm calls could make it due later
    deadlines.arm(0.5, lambda: (ran.append("late"), done.set()))
    deadlines.arm(0.05, lambda: ran.append("soon"))
    assert done.wait(10)
    assert ran == ["soon", "late"]
    assert time.monotonic() - started >= 0.5
    assert deadlines.pending() == 0


def test_a_cancelled_action_never_runs_and_many_cancelled_are_dropped():
    deadlines = Deadlines()
    ran: list[int] = []
    # The deadline thread is kept busy while the 200 are armed and 150 of them cancelled, so
    # that none falls due before its cancel however slowly this thread runs; it calls them
    # (the ones not cancelled) once let go.
    inside, release = threading.Event(), threading.Event()
    deadlines.arm(0.0, lambda: (inside.set(), release.wait(10)))
    assert inside.wait(10)
    armed = [deadlines.arm(0.05 + i / 1000, lambda i=i: ran.append(i)) for i in range(200)]
    for d in armed[:150]:
        deadlines.cancel(d)
    assert len(deadlines._heap) < 200          # compacted once mostly cancelled
    release.set()
    wait_until(lambda: deadlines.pending() == 0, message="the 50 actions not cancelled ran")
    assert sorted(ran) == list(range(150, 200))
    deadlines.cancel(armed[0])                  # cancelling twice, or after it ran, is harmless
    deadlines.cancel(armed[-1])
    assert deadlines.pending() == 0


def test_cancel_waits_for_an_action_being_run_and_a_failing_action_stops_nothing():
    deadlines = Deadlines()
    inside, release, after = threading.Event(), threading.Event(), threading.Event()

    def slow() -> None:
        inside.set()
        release.wait(10)

    deadlines.arm(0.0, lambda: 1 / 0)           # logged, and the thread goes on
    running = deadlines.arm(0.01, slow)
    deadlines.arm(0.02, after.set)
    assert inside.wait(10)
    cancelled = threading.Event()
    canceller = threading.Thread(target=lambda: (deadlines.cancel(running), cancelled.set()))
    canceller.start()
    assert not cancelled.wait(0.2)              # the action is still being run
    release.set()
    assert cancelled.wait(10)
    assert after.wait(10)
    canceller.join(10)
