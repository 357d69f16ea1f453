"""One rule for how long a caller waits, the same in every store (embedded and remote).

A wait's ``timeout`` (``put``, ``wait_version``, ``arrive_poll``, a subscription's ``next`` and
``idle_timeout``) is:

* ``None``: wait as long as it takes;
* a finite number of seconds > 0: wait at most that long;
* ``0``: do not wait: answer with what holds now (``wait_version`` the current version, ``next``
  a micro-batch only if one is ready, ``put`` a TimeoutError unless the write is already
  durable; the write may still be applied).

Anything else (a negative number, NaN, infinity, a bool, a string) is refused with
InvalidArgument naming the value, before anything is done: a negative timeout once timed out at
once in one store and meant "the client's default" in the other.

A query's ``timeout`` is not a wait but a time limit on its work: there 0 is refused too
(store/sqlguard.py, ``check_query_options``).

>>> check_wait(None, "put"), check_wait(0, "put"), check_wait(2, "put")
(None, 0.0, 2.0)
>>> check_wait(-1, "put")
Traceback (most recent call last):
...
store.errors.InvalidArgument: put timeout -1 is invalid; expected None (wait as long as it takes) or a finite number of seconds ≥ 0 (0: do not wait)
"""
from __future__ import annotations

import math

from .errors import InvalidArgument


def check_wait(timeout: object, what: str) -> float | None:
    """``timeout`` as seconds (None: no limit) if it is a valid wait for ``what``.

    Raises:
        InvalidArgument: naming ``what``, the value, and what is expected.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout < 0:
        name = what if what.endswith("timeout") else f"{what} timeout"  # a parameter's name
        raise InvalidArgument(f"{name} {timeout!r} is invalid; expected None (wait as "
                              "long as it takes) or a finite number of seconds ≥ 0 (0: do not "
                              "wait)")
    return float(timeout)
