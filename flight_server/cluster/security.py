"""Auth and TLS across a cluster: what its servers serve with and call each other with.

A cluster runs with the coordinator's tokens file and certificate: every data node accepts the
same bearer tokens (same roles, same errors, :mod:`flight_server.auth`) and serves TLS when the
coordinator does. The servers call each other (registration, replica forwarding, probes, copies
and collection) with the first ``admin`` token of the tokens file, the *node token*.

The files are read once where the cluster starts; this object carries their contents, so Ray
can ship it to a data node on another machine (where the paths may not exist).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pyarrow.flight as flight

from store.errors import InvalidArgument

from ..auth import AuthMiddlewareFactory, Principal, parse_tokens


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"{what} {path!r} cannot be read: {e}") from e


@dataclass(frozen=True)
class ClusterSecurity:
    """Tokens and TLS material of a cluster (all None: plain ``grpc://`` without tokens).

    Args:
        tokens_json: the tokens file's text (see :mod:`flight_server.auth`).
        tls_cert, tls_key: PEM certificate and key every server of the cluster serves with;
            the certificate must name every machine's address (subjectAltName).
        tls_root_certs: PEM roots the servers trust when they call each other (None: the
            system's roots).
    """

    tokens_json: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_root_certs: bytes | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("TLS needs both a certificate and a key file")
        self.tokens()            # a bad tokens file fails here, where the cluster starts
        self.node_token()

    @classmethod
    def from_files(cls, tokens_file: str | None = None, tls_cert: str | None = None,
                   tls_key: str | None = None,
                   tls_root_certs: str | bytes | None = None) -> "ClusterSecurity":
        tokens = _read(tokens_file, "tokens file")
        roots = tls_root_certs if isinstance(tls_root_certs, bytes) else \
            _read(tls_root_certs, "TLS root certificates")
        return cls(tokens.decode("utf-8", "replace") if tokens is not None else None,
                   _read(tls_cert, "TLS certificate"), _read(tls_key, "TLS key"), roots)

    @property
    def scheme(self) -> str:
        return "grpc+tls" if self.tls_cert is not None else "grpc"

    def tokens(self) -> dict[str, Principal] | None:
        return self._tokens

    @cached_property
    def _tokens(self) -> dict[str, Principal] | None:
        if self.tokens_json is None:
            return None
        try:
            doc: Any = json.loads(self.tokens_json)
        except ValueError as e:
            raise InvalidArgument(f"the cluster's tokens file cannot be read as JSON: {e}") \
                from e
        return parse_tokens(doc, "the cluster's tokens file")

    def node_token(self) -> str | None:
        """The token the cluster's servers present to each other: the first ``admin`` one."""
        return self._node_token

    @cached_property
    def _node_token(self) -> str | None:
        tokens = self.tokens()
        if tokens is None:
            return None
        for token, principal in tokens.items():
            if principal.role == "admin":
                return token
        raise InvalidArgument("the cluster's tokens file has no 'admin' token; its servers "
                              "call each other with the first admin token")

    # -- serving -------------------------------------------------------------------------------
    def server_options(self) -> dict[str, Any]:
        """``tls_certificates`` and ``middleware`` for a ``FlightServerBase``."""
        tokens = self.tokens()
        return {
            "tls_certificates": [flight.CertKeyPair(self.tls_cert, self.tls_key)]
            if self.tls_cert is not None and self.tls_key is not None else None,
            "middleware": {"auth": AuthMiddlewareFactory(tokens)} if tokens is not None else {},
        }

    # -- calling another server of the cluster -----------------------------------------------
    def client(self, location: str) -> flight.FlightClient:
        if self.tls_root_certs is not None and location.startswith("grpc+tls://"):
            return flight.FlightClient(location, tls_root_certs=self.tls_root_certs)
        return flight.FlightClient(location)

    def options(self, timeout: float | None) -> flight.FlightCallOptions:
        token = self.node_token()
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        return flight.FlightCallOptions(headers=headers, timeout=timeout)


NO_SECURITY = ClusterSecurity()
