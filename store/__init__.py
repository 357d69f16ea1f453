"""expstore's experience store: ``connect(uri)`` returns the same interface embedded or remote.

>>> import store
>>> s = store.connect("./expstore.duckdb")            # doctest: +SKIP  (embedded, in-process)
>>> s = store.connect("grpc://127.0.0.1:8815")        # doctest: +SKIP  (a running server)
"""
from __future__ import annotations

from typing import Any

from .claims import Claim, ClaimRequest
from .errors import *  # noqa: F401,F403 - the error hierarchy is part of the interface
from .errors import ExpstoreError, InvalidArgument
from .interface import Store
from .naming import SampleId, format_sample_id, parse_sample_id

REMOTE_SCHEMES = ("grpc://", "grpc+tcp://", "grpc+tls://")


def connect(uri: str, **options: Any) -> Store:
    """Open a store: a file path (embedded) or ``grpc://host:port`` / ``grpc+tls://…`` (remote).

    Options go to :class:`store.embedded.EmbeddedStore` or
    :class:`flight_server.client.RemoteStore` (e.g. ``token=…``, ``tls_root_certs=…``).
    """
    if not isinstance(uri, str) or not uri:
        raise InvalidArgument(f"store uri {uri!r} is not a path or grpc:// address")
    if uri.startswith(REMOTE_SCHEMES):
        _check_address(uri)
        # a cluster's coordinator answers with a ClusterStore (flight_server/cluster/client.py)
        from flight_server.cluster.client import connect_remote
        return connect_remote(uri, **options)
    if "://" in uri:
        raise InvalidArgument(f"store uri {uri!r} has an unknown scheme; expected a file path or "
                              f"one of {', '.join(REMOTE_SCHEMES)}")
    from .embedded import EmbeddedStore
    return EmbeddedStore(uri, **options)


def _check_address(uri: str) -> None:
    """Refuse a server address without a host or a port at once: gRPC would try port 443 or
    an empty host name for its whole connect timeout, then fail with its own words."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        host, port = parts.hostname, parts.port
    except ValueError as e:  # a port that is no number, or out of range
        raise InvalidArgument(f"store uri {uri!r} is not grpc://HOST:PORT ({e}); e.g. "
                              "grpc://127.0.0.1:8815") from None
    if not host or port is None:
        raise InvalidArgument(f"store uri {uri!r} names no {'port' if host else 'host'}; "
                              "expected grpc://HOST:PORT, e.g. grpc://127.0.0.1:8815")


__all__ = ["connect", "Store", "Claim", "ClaimRequest", "ExpstoreError", "SampleId", "format_sample_id",
           "parse_sample_id"]
