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


# -- a trainer's acks once the server is gone: Unavailable at once, never a 120 s hang ----------
def _outcome(call, bound: float = 60.0) -> BaseException | object:
    """What ``call()`` raised (or returned), waited for in a thread up to ``bound`` seconds so
    that a hang fails the test instead of stalling it."""
    box: list = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    assert box, f"the call hung for {bound} s"
    return box[0]


def _subscribed_server(tmp_path):
    import reliability_helpers as rh
    srv = rh.ServerProcess(tmp_path / "x.duckdb").start()
    remote = store.connect(srv.uri)
    remote.create_table("agent", {"reward": "float64"})
    remote.put("agent", {"sample_id": [f"q{i}_0_0" for i in range(4)],
                         "reward": [1.0, 2.0, 3.0, 4.0]})
    sub = remote.subscribe("agent", micro_batch_size=1, global_batch_size=4, max_in_flight=3)
    held = [sub.next(timeout=30) for _ in range(3)]
    assert all(mb is not None for mb in held)
    return srv, remote, sub, held


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_acks_after_the_server_stopped_fail_at_once_with_unavailable(tmp_path, how):
    from consumers.acks import PendingAcks
    srv, remote, sub, (first, second, third) = _subscribed_server(tmp_path)
    try:
        if how == "SIGTERM":
            assert srv.stop() == 0
        else:
            srv.kill()
        error = _outcome(first.ack)
        assert isinstance(error, store.Unavailable), repr(error)
        # says what broke and what to do, not only gRPC's "Stream removed (Socket closed)"
        assert "subscribe again once" in str(error), str(error)
        pending = PendingAcks()
        pending.send(second)
        assert isinstance(_outcome(pending.settle), store.Unavailable)
        # (a bump now is refused before it is sent: the global batch is not complete)
        assert isinstance(_outcome(lambda: sub.bump_version()), store.InvalidArgument)
        assert isinstance(_outcome(third.nack), store.Unavailable)
        # (max_in_flight=3: no fourth micro-batch was pushed, so the next one is the end)
        assert isinstance(_outcome(lambda: sub.next(timeout=5)), store.Unavailable)
    finally:
        sub.close()
        remote.close()
        srv.kill()


def test_an_ack_pending_when_the_server_dies_fails_with_unavailable(tmp_path):
    """An ack sent (not waited for) to a frozen server, which is then killed: its answer can
    never come, and settling it says so at once."""
    import os
    import signal
    from consumers.acks import PendingAcks
    srv, remote, sub, (first, _, _) = _subscribed_server(tmp_path)
    try:
        os.kill(srv.pid, signal.SIGSTOP)
        pending = PendingAcks()
        pending.send(first)
        assert len(pending) == 1
        srv.kill()
        error = _outcome(pending.settle)
        assert isinstance(error, store.Unavailable), repr(error)
    finally:
        sub.close()
        remote.close()
        srv.kill()



def test_a_server_over_a_callers_store_ends_its_long_polls_and_gives_the_store_back(tmp_path,
                                                                                   wait_until):
    """Closing the server ends a remote barrier arrival at once (Unavailable; the arrival
    stays, as soft state does); the embedded store its caller opened waits as before."""
    import json

    import pyarrow.flight as flight

    embedded = store.connect(str(tmp_path / "x.duckdb"))
    for table in ("planner", "verifier"):
        embedded.create_table(table, {"reward": "float64"}, version_group="team")
    server = ExpstoreFlightServer(embedded, port=0)
    threading.Thread(target=server.serve, daemon=True).start()
    client = flight.FlightClient(server.location)
    body = json.dumps({"tables": ["planner"], "expected": 0, "timeout": 120}).encode()
    outcome: list = []
    waiting = threading.Thread(target=lambda: outcome.append(_outcome(
        lambda: list(client.do_action(flight.Action("arrive", body))))), daemon=True)
    waiting.start()
    wait_until(lambda: embedded.barrier("planner")["arrived"] == ["planner"], 30,
               "the arrival reached the server")
    server.close()
    waiting.join(60)
    assert isinstance(outcome[0], flight.FlightUnavailableError), outcome
    assert "shutting down" in str(outcome[0])
    client.close()
    assert embedded.wait_version("planner", 1, timeout=0.1) == 0
    assert embedded.query("SELECT count(*) AS n FROM planner").column("n")[0].as_py() == 0
    assert embedded.arrive("verifier", expected=0) == 1    # planner's arrival stayed
    assert embedded.wait_version("planner", 1, timeout=5) == 1
    embedded.close()
