"""Bounded waiting for tests: poll a state query until it holds, never a bare sleep."""
from __future__ import annotations

import time
from typing import Any, Callable


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0,
               message: str = "condition", interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy (and return it); raise
    AssertionError naming ``message`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} did not hold within {timeout} s")
        time.sleep(interval)
