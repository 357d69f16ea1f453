"""store.connect refuses a server address it cannot use at once, naming it, instead of letting
gRPC try a default port or an empty host for its whole connect timeout."""
from __future__ import annotations

import time

import pytest

import store
from store.errors import InvalidArgument


@pytest.mark.parametrize("uri, named", [
    ("grpc://127.0.0.1", "names no port"),
    ("grpc://:8815", "names no host"),
    ("grpc+tls://example.invalid", "names no port"),
    ("grpc://127.0.0.1:notaport", "'notaport'"),
    ("grpc://127.0.0.1:99999", "out of range"),
    ("grpc+tcp://", "names no host"),
])
def test_an_address_without_host_or_port_is_refused_at_once(uri, named):
    started = time.monotonic()
    with pytest.raises(InvalidArgument) as raised:
        store.connect(uri)
    assert repr(uri) in str(raised.value) and named in str(raised.value)
    assert "grpc://HOST:PORT" in str(raised.value)
    assert time.monotonic() - started < 5  # not gRPC's connect timeout
