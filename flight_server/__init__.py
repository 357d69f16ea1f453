"""expstore's Arrow Flight service: the server, its remote client, auth and Flight SQL."""
from __future__ import annotations

from .server import ExpstoreFlightServer

__all__ = ["ExpstoreFlightServer"]
