"""``do_get`` tickets (docs/protocol.md, "do_get"): read-only SQL, a claim as a stream, and the
value fetch a data node answers.

>>> SqlTicket("SELECT 1", timeout=5).encode()
b'{"sql": "SELECT 1", "timeout": 5}'
>>> parse_ticket(b'{"sql": "SELECT 1", "timeout": 5}', max_timeout=30)
SqlTicket(sql='SELECT 1', params=None, timeout=5)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from store.errors import InvalidArgument

from .codec import decode, encode

#: Bytes a ticket may have.
MAX_TICKET_BYTES = 1 << 20
SQL_FIELDS = ("sql", "params", "timeout")
_EXPECTED = "{\"sql\": \"SELECT …\"} or {\"claim\": {…}}"


@dataclass(frozen=True)
class SqlTicket:
    """One read-only SELECT; ``params`` bind its ``?``; ``timeout`` in seconds."""

    sql: str
    params: list[Any] | None = None
    timeout: float | None = None

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"sql": self.sql}
        if self.params is not None:
            doc["params"] = list(self.params)
        if self.timeout is not None:
            doc["timeout"] = self.timeout
        return encode(doc)


@dataclass(frozen=True)
class ClaimTicket:
    """A claim answered as a record-batch stream; ``body`` is the ``claim`` action's body
    (checked as the action checks it)."""

    body: dict[str, Any]

    def encode(self) -> bytes:
        return encode({"claim": self.body})


def table_ticket(table: str) -> bytes:
    """The ticket of a table's flight: all its rows."""
    return SqlTicket(f'SELECT * FROM "{table}"').encode()


def ticket_document(raw: bytes) -> Any:
    """A ticket's JSON document, of at most :data:`MAX_TICKET_BYTES`."""
    if len(raw) > MAX_TICKET_BYTES:
        raise InvalidArgument(f"ticket of {len(raw)} bytes is larger than {MAX_TICKET_BYTES}")
    return decode(raw, lambda e: f"ticket is not valid JSON: {e}; expected {_EXPECTED}")


def is_claim_ticket(doc: Any) -> bool:
    """Whether a ticket document asks for a claim (its role is checked before its fields)."""
    return isinstance(doc, dict) and "claim" in doc


def claim_ticket(doc: dict[str, Any]) -> ClaimTicket:
    """A claim ticket's document, checked: ``{"claim": {…}}`` and nothing else."""
    if len(doc) != 1 or "claim" not in doc:
        raise InvalidArgument(f"a claim ticket is {{\"claim\": {{…}}}} alone; it has "
                              f"unknown fields {sorted(set(doc) - {'claim'})}")
    body = doc["claim"]
    if not isinstance(body, dict):
        raise InvalidArgument(f"a claim ticket's claim must be a JSON object (the claim "
                              f"action's body), got {type(body).__name__}")
    return ClaimTicket(body)


def sql_ticket(doc: Any, max_timeout: float) -> SqlTicket:
    """An SQL ticket's document, checked; ``timeout`` must lie in ``(0, max_timeout]``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("sql"), str):
        raise InvalidArgument("ticket must be a JSON object {\"sql\": \"SELECT …\", "
                              "\"params\"?: [...], \"timeout\"?: seconds} or "
                              "{\"claim\": {<claim body>}}")
    extra = set(doc) - set(SQL_FIELDS)
    if extra:
        raise InvalidArgument(f"ticket has unknown fields {sorted(extra)}")
    timeout = doc.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float))
                                or isinstance(timeout, bool)
                                or not 0 < timeout <= max_timeout):
        raise InvalidArgument(f"query timeout {timeout!r} is invalid; expected seconds in "
                              f"(0, {max_timeout}], the server's query time limit (expstore "
                              "serve --set query_timeout=N raises it)")
    # params are checked by the store's query, which a local caller reaches too
    return SqlTicket(doc["sql"], doc.get("params"), timeout)


def parse_ticket(raw: bytes, max_timeout: float) -> SqlTicket | ClaimTicket:
    """A ``do_get`` ticket of the store's own protocol, checked."""
    doc = ticket_document(raw)
    return claim_ticket(doc) if is_claim_ticket(doc) else sql_ticket(doc, max_timeout)


# -- a data node's value fetch (docs/protocol.md, "Reading: claims carry the data nodes") -------

@dataclass(frozen=True)
class FetchColumn:
    """One column asked of a data node: per row, ``segment:offset:length:row`` or None (the
    value comes from another node, or is null); ``type`` is its declared type."""

    keys: list[str | None]
    type: str


@dataclass(frozen=True)
class FetchTicket:
    """The values of some rows, one :class:`FetchColumn` per column, all of one length."""

    columns: list[FetchColumn]

    def encode(self) -> bytes:
        return encode({"get": {"columns": [{"keys": c.keys, "type": c.type}
                                           for c in self.columns]}})


_FETCH_EXPECTED = ("{\"get\": {\"columns\": [{\"keys\": [\"segment:offset:length:row\" or null, "
                   "…], \"type\": \"<column type>\"}, …]}} with keys lists of one length")


def parse_fetch_ticket(raw: bytes) -> FetchTicket:
    """A data node's ``do_get`` ticket, checked."""
    try:
        columns = decode(raw, lambda e: f"data node ticket is invalid ({e}); expected "
                                        f"{_FETCH_EXPECTED}")["get"]["columns"]
        parsed = [FetchColumn(c["keys"], c["type"]) for c in columns]
    except (TypeError, KeyError) as e:
        raise InvalidArgument(f"data node ticket is invalid ({e}); expected "
                              f"{_FETCH_EXPECTED}") from None
    if not parsed or any(not isinstance(c.keys, list) or not isinstance(c.type, str)
                         or not all(x is None or isinstance(x, str) for x in c.keys)
                         for c in parsed) or len({len(c.keys) for c in parsed}) != 1:
        raise InvalidArgument(f"data node ticket columns are malformed; expected "
                              f"{_FETCH_EXPECTED}")
    return FetchTicket(parsed)
