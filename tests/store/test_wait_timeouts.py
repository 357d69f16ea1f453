"""Every wait's ``timeout`` means the same in every store (store/waits.py): None waits as long
as it takes, seconds > 0 wait that long, 0 does not wait; a negative, NaN or infinite timeout is
refused with InvalidArgument naming it, before anything is done.

Before this rule a ``put(timeout=-1)`` timed out at once in the embedded store (the put still
applied) and waited the client's default 60 s in the remote one, where -1 was the marker of that
default; a subscription's ``next(timeout=-1)`` returned None embedded and raised ValueError
remote.
"""
from __future__ import annotations

import math
import re

import pytest

from store.errors import InvalidArgument

BAD = [-1, -0.5, math.nan, math.inf, -math.inf, True, "5"]


def _table(s) -> None:
    s.create_table("t", {"reward": "float64"})


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_put_refuses_a_bad_timeout_and_stores_nothing(any_store, bad):
    _table(any_store)
    with pytest.raises(InvalidArgument) as err:
        any_store.put("t", {"sample_id": ["q0_0_0"], "reward": [1.0]}, timeout=bad)
    assert repr(bad) in str(err.value) and "None" in str(err.value)
    assert any_store.stats("t")["t"]["rows"] == 0
    # None waits as long as it takes, seconds > 0 that long: both answer once durable
    assert any_store.put("t", {"sample_id": ["q0_0_0"], "reward": [1.0]}, timeout=None)[
        "rows"] == 1
    assert any_store.put("t", {"sample_id": ["q1_0_0"], "reward": [1.0]}, timeout=30)[
        "rows"] == 1


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_wait_version_refuses_a_bad_timeout(any_store, bad):
    _table(any_store)
    with pytest.raises(InvalidArgument, match="wait_version timeout"):
        any_store.wait_version("t", 1, timeout=bad)
    assert any_store.wait_version("t", 5, timeout=0) == 0   # 0: the version now, at once
    any_store.bump_version("t")
    assert any_store.wait_version("t", 1, timeout=0) == 1


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf], ids=repr)
def test_a_subscription_refuses_a_bad_timeout_and_idle_timeout(any_store, bad):
    _table(any_store)
    with pytest.raises(InvalidArgument, match=f"^idle_timeout {re.escape(repr(bad))} is invalid"):
        any_store.subscribe("t", 1, 1, idle_timeout=bad)
    sub = any_store.subscribe("t", 1, 1)
    try:
        with pytest.raises(InvalidArgument, match="next timeout"):
            sub.next(timeout=bad)
        assert sub.next(timeout=0) is None               # 0: nothing ready, no wait
    finally:
        sub.close()


def test_arrive_poll_refuses_a_bad_timeout_and_0_does_not_wait(embedded_store):
    s = embedded_store
    s.create_table("a", {"reward": "float64"}, version_group="g")
    s.create_table("b", {"reward": "float64"}, version_group="g")
    with pytest.raises(InvalidArgument, match="arrive_poll timeout -1"):
        s.arrive_poll("a", expected=0, timeout=-1)
    assert s.barrier("a")["arrived"] == []               # refused before arriving
    answer = s.arrive_poll("a", expected=0, timeout=0)
    assert (answer["complete"], answer["waiting_for"]) == (False, ["b"])
