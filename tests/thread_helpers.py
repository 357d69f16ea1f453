"""Running a test's workers on threads and collecting what they raised."""
from __future__ import annotations

import threading
from typing import Callable


def run_threads(work: Callable[[int], object], count: int,
                timeout: float) -> list[BaseException]:
    """Run ``work(0)`` … ``work(count - 1)`` each on its own thread, join each within
    ``timeout`` seconds and return the exceptions they raised (empty: none)."""
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            work(k)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors
