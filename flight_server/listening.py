"""Whether a server can listen on an address, asked with one bind before gRPC tries.

gRPC's own failure to listen is "Server did not start properly" between lines of its C-core's
log, the same for every cause. ``expstore serve`` and ``expstore demo`` ask here first, so that
a port in use, a host that is not this machine's or a privileged port is one line naming it.
"""
from __future__ import annotations

import errno
import socket

from store.errors import InvalidArgument

__all__ = ["check_can_listen"]


def check_can_listen(host: str, port: int, option: str = "--port") -> None:
    """Refuse, with the cause and what to do, an address gRPC could not listen on (see the
    module docstring). A port taken between this check and the server's bind still fails the
    server's way.

    Raises:
        InvalidArgument: the host is unknown or not an address of this machine, or the port is in
            use.
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InvalidArgument(f"--host {host!r} is not a known host name or address "
                              f"({e.strerror}); use 127.0.0.1, 0.0.0.0 or an address of this "
                              "machine") from None
    # gRPC listens on every address the name resolves to that it can bind (``localhost``: ::1
    # and 127.0.0.1), so the host is refused only if none binds; a port in use on any is.
    errors = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC does: a port whose last connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise InvalidArgument(
                        f"port {port} on {host} is in use (another expstore serve?); stop what "
                        f"listens there, or pick another with {option} (0 picks a free one)"
                    ) from None
                errors.append(e)
    if len(errors) < len(addresses):
        return
    first = errors[0]
    if first.errno == errno.EADDRNOTAVAIL:
        raise InvalidArgument(
            f"--host {host} is not an address of this machine; use 127.0.0.1 (this machine "
            "only), 0.0.0.0 (every interface) or one of its addresses")
    if first.errno == errno.EACCES:
        raise InvalidArgument(f"port {port} needs privileges to listen on; pick one above 1023 "
                              f"with {option}")
    raise InvalidArgument(f"cannot listen on {host}:{port} ({option}): {first.strerror}")
