"""Connecting a Python client to an address where nothing listens fails at once, naming it.

Before, ``store.connect("grpc://127.0.0.1:P")`` with no server at P let gRPC retry the refused
connection for the client's whole connect timeout (10 s), then said "no expstore server answers
at …" in gRPC's words. An explicit ``connect_timeout`` still waits for a server that is still
starting, as the cluster's start-up does.
"""
from __future__ import annotations

import threading
import time

import pytest

import store
from flight_server import ExpstoreFlightServer
from flight_server.client import RemoteStore
from reliability_helpers import free_port
from store.errors import Unavailable


def test_a_port_where_nothing_listens_is_refused_naming_it() -> None:
    port = free_port()
    with pytest.raises(Unavailable) as raised:
        store.connect(f"grpc://127.0.0.1:{port}")
    message = str(raised.value)
    assert f"no expstore server listens at 127.0.0.1:{port} (connection refused)" in message
    assert f"expstore serve --port {port}" in message


def test_an_unknown_host_is_refused_naming_it() -> None:
    with pytest.raises(Unavailable, match=r"the host 'no-such-host\.invalid' of "
                                          r"grpc://no-such-host\.invalid:8815 is unknown"):
        store.connect("grpc://no-such-host.invalid:8815")


def test_a_connect_timeout_waits_for_a_server_that_is_still_starting(tmp_path) -> None:
    """The server binds its port only after the client began waiting for it."""
    port = free_port()
    started: list[ExpstoreFlightServer] = []
    client_waits = threading.Event()

    def start_later() -> None:
        client_waits.wait(30)
        time.sleep(0.5)  # let the client's first connect be refused
        server = ExpstoreFlightServer(str(tmp_path / "x.duckdb"), host="127.0.0.1", port=port)
        started.append(server)
        server.serve()

    thread = threading.Thread(target=start_later, daemon=True)
    thread.start()
    try:
        client_waits.set()
        with RemoteStore(f"grpc://127.0.0.1:{port}", connect_timeout=60) as s:
            assert s.list_tables() == []
    finally:
        for server in started:
            server.close()
        thread.join(timeout=30)
    assert started and not thread.is_alive()
