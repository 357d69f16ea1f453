"""A server shuts down cleanly while trainers are still subscribed."""
from __future__ import annotations

import threading
import time

import pytest

import store
from flight_server import ExpstoreFlightServer


def test_close_with_an_open_subscription_ends_it_and_returns(tmp_path):
    server = ExpstoreFlightServer(str(tmp_path / "x.duckdb"), port=0)
    threading.Thread(target=server.serve, daemon=True).start()
    remote = store.connect(server.location)
    remote.create_table("agent", {"reward": "float64"})
    remote.put("agent", {"sample_id": ["q0_0_0", "q1_0_0"], "reward": [1.0, 2.0]})
    sub = remote.subscribe("agent", micro_batch_size=1, global_batch_size=4, max_in_flight=4)
    first = sub.next(timeout=10)
    assert first is not None
    closed = threading.Event()

    def close() -> None:
        server.close()
        closed.set()

    started = time.monotonic()
    threading.Thread(target=close, daemon=True).start()
    assert closed.wait(20), "server.close() hung on an open subscription"
    assert time.monotonic() - started < 20
    with pytest.raises(store.Unavailable, match="shutting down"):
        while sub.next(timeout=10) is not None:
            pass
    sub.close()
    remote.close()
    # The unacked micro-batch was nacked when the stream ended: its row is ready after reopening.
    reopened = store.connect(str(tmp_path / "x.duckdb"))
    try:
        assert reopened.stats("agent")["agent"]["consumed"] == 0
        assert len(reopened.claim("agent", 10)) == 2
    finally:
        reopened.close()
