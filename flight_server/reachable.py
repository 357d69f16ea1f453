"""Whether anything listens at a server's address, asked with one plain TCP connect.

gRPC retries a refused connection with back-off for as long as a client lets it wait, so a
mistyped port, or a server that is not running, cost the whole connect timeout and ended in
gRPC's words. A refused TCP connect is an answer at once; the client asks it first unless it
was told to wait for a server that is still starting (``RemoteStore(connect_timeout=...)``).
"""
from __future__ import annotations

import socket
from urllib.parse import urlsplit

from store.errors import Unavailable

__all__ = ["check_listening", "PROBE_SECONDS"]

#: How long the TCP connect may take before the client leaves the question to gRPC (a host
#: that drops packets answers nothing; only a refusal or an accepted connection is an answer).
PROBE_SECONDS = 2.0


def check_listening(uri: str) -> None:
    """Raise at once where nothing listens at ``uri`` (``grpc://HOST:PORT`` or the like).

    An address this cannot read, a host that does not answer within :data:`PROBE_SECONDS` or a
    network that cannot be reached is left to the gRPC client, which waits and says so.

    Raises:
        Unavailable: the connection was refused (nothing listens at that port), or the host
            name is unknown.
    """
    try:
        parts = urlsplit(uri)
        host, port = parts.hostname, parts.port
    except ValueError:
        return
    if not host or port is None:
        return
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            pass
    except ConnectionRefusedError:
        raise Unavailable(f"no expstore server listens at {host}:{port} (connection refused); "
                          f"start one with `expstore serve --port {port}`, or check the "
                          f"address {uri}") from None
    except socket.gaierror as e:
        raise Unavailable(f"the host {host!r} of {uri} is unknown ({e.strerror}); check the "
                          "address") from None
    except OSError:
        return
