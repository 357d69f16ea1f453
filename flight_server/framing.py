"""How a session message is framed, both ways (see flight_server.session): a JSON header on one
line, a newline, then the parts its ``sizes`` lists, back to back.

Shared by the server (session.py) and the client (session_client.py), which must not import the
server's module (it pulls in the embedded store).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import pyarrow as pa

from store.errors import InvalidArgument


def frame(header: dict[str, Any], parts: Sequence[bytes] = ()) -> pa.Buffer:
    """One message: the JSON header, a newline, the parts (their sizes in the header)."""
    if parts:
        header = {**header, "sizes": [len(p) for p in parts]}
    return pa.py_buffer(b"".join([json.dumps(header, default=str).encode(), b"\n", *parts]))


def split_parts(sizes: Any, rest: bytes) -> list[bytes]:
    """The parts after a header, cut by its ``sizes``; InvalidArgument if they do not fit."""
    if not isinstance(sizes, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
        raise InvalidArgument(f"a message's sizes must be a list of byte counts, got {sizes!r}")
    if sum(sizes) != len(rest):
        raise InvalidArgument(f"the message's sizes {sizes} add up to {sum(sizes)} bytes but "
                              f"{len(rest)} follow its header")
    parts, at = [], 0
    for n in sizes:
        parts.append(rest[at:at + n])
        at += n
    return parts


# A claim answered as a do_get stream (``{"claim": {…}}`` ticket) carries the claim in the
# stream schema's metadata under these keys: its id ("" for an empty claim), consumer, and lease
# expiry (JSON number, seconds since the epoch).
CLAIM_ID_KEY, CONSUMER_KEY, EXPIRES_AT_KEY = \
    b"expstore.claim_id", b"expstore.consumer", b"expstore.expires_at"
