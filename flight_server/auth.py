"""Optional bearer-token authentication with three roles.

The tokens file is JSON: ``{"tokens": [{"token": "…", "role": "reader|writer|admin",
"name": "…"}]}``. Roles are ordered: a writer can do what a reader can, an admin everything.

* reader: SQL, listing, describe, stats, versions, health
* writer: puts, claims, acks, nacks, subscriptions
* admin: create/drop tables, version bumps, GC, checkpoints
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

import pyarrow.flight as flight

from store.errors import InvalidArgument, PermissionDenied

ROLES = ("reader", "writer", "admin")


@dataclass(frozen=True)
class Principal:
    name: str
    role: str

    def require(self, role: str, operation: str) -> None:
        if ROLES.index(self.role) < ROLES.index(role):
            raise PermissionDenied(f"{operation} needs the {role!r} role; token {self.name!r} has "
                                   f"{self.role!r}")


ANONYMOUS_ADMIN = Principal("anonymous", "admin")


def load_tokens(path: str) -> dict[str, Principal]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"tokens file {path!r} cannot be read as JSON: {e}") from e
    return parse_tokens(doc, path)


def parse_tokens(doc: object, source: str) -> dict[str, Principal]:
    """The tokens of a tokens file's parsed JSON (``source`` names it in errors): a cluster
    ships the file's text to its data nodes, which parse it here."""
    path = source
    entries = doc.get("tokens") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InvalidArgument(f"tokens file {path!r} must hold {{\"tokens\": [{{\"token\": …, "
                              "\"role\": …}}, …]}}")
    tokens: dict[str, Principal] = {}
    for i, entry in enumerate(entries):
        token, role = entry.get("token"), entry.get("role")
        if not isinstance(token, str) or len(token) < 8:
            raise InvalidArgument(f"token #{i} in {path!r} must be a string of ≥ 8 characters")
        if role not in ROLES:
            raise InvalidArgument(f"token #{i} in {path!r} has role {role!r}; expected one of "
                                  f"{ROLES}")
        tokens[token] = Principal(str(entry.get("name", f"token{i}")), role)
    return tokens


class AuthMiddleware(flight.ServerMiddleware):
    def __init__(self, principal: Principal) -> None:
        self.principal = principal


class AuthMiddlewareFactory(flight.ServerMiddlewareFactory):
    """Checks ``authorization: Bearer <token>`` on every call, in constant time per token."""

    def __init__(self, tokens: dict[str, Principal]) -> None:
        self._tokens = [(t.encode(), p) for t, p in tokens.items()]

    def start_call(self, info: flight.CallInfo, headers: dict) -> AuthMiddleware:
        values = headers.get("authorization") or headers.get("Authorization") or []
        presented = values[0] if values else ""
        if isinstance(presented, bytes):
            presented = presented.decode("utf-8", "replace")
        return AuthMiddleware(self.principal(presented))

    def principal(self, presented: str) -> Principal:
        """Who an ``authorization`` header value names (also for the metrics endpoint).

        Raises:
            flight.FlightUnauthenticatedError: no bearer token, or one that is not valid.
        """
        if not presented.lower().startswith("bearer "):
            raise flight.FlightUnauthenticatedError(
                "[unauthenticated] this server needs a bearer token "
                "(header 'authorization: Bearer <token>')")
        candidate = presented[7:].strip().encode()
        found = None
        for token, principal in self._tokens:
            # compare_digest on every token: the time taken does not reveal which one matched.
            if hmac.compare_digest(token, candidate):
                found = principal
        if found is None:
            raise flight.FlightUnauthenticatedError("[unauthenticated] the bearer token is not "
                                                    "valid")
        return found


def principal_of(context: flight.ServerCallContext) -> Principal:
    middleware = context.get_middleware("auth")
    return middleware.principal if middleware is not None else ANONYMOUS_ADMIN
