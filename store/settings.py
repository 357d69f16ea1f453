"""The store's settings: one frozen object, passed to the parts that need them.

Every knob of the embedded store lives here with its default and the reason for it; the
constructor (``EmbeddedStore(path, settings=...)`` or ``store.connect(path, **fields)``), the CLI
(``expstore serve`` flags) and tests set them. Nothing reads a module constant that a caller
would have to patch.

>>> from store.settings import StoreSettings
>>> StoreSettings(cache_limit="256MB", max_live_rows=100_000).max_live_rows
100000
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from .cache import DEFAULT_CACHE_LIMIT, parse_size
from .errors import InvalidArgument


@dataclass(frozen=True)
class StoreSettings:
    """Settings of an embedded store (and of the server over it).

    What users set:
        ref_threshold: complex values larger than this many bytes go by reference in ``auto``
            columns.
        memory_limit: DuckDB's memory limit, e.g. ``"4GB"`` (None: DuckDB's default).
        cache_limit: memory for ready rows' values kept so that claims need no DuckDB read
            (bytes, or a size such as ``"512MB"``); rows put while it is full are claimed from
            DuckDB (store/cache.py).
        max_live_rows: the most live rows (pending, ready or being processed) a table may hold;
            a put that would add rows past it fails with ``TableFull`` (retryable). None: no
            limit.
        query_timeout: seconds before an ad-hoc query is cancelled.
        max_concurrent_queries: ad-hoc queries running at once; more wait their turn, so that
            people's SQL cannot starve the writer of CPU.

    Tuning of the writer thread (store/writer.py):
        max_group_ops: operations one group commit takes from the queue at most.
        merged_put_rows: small puts prepared together, rows per merged batch at most.
        checkpoint_idle_seconds: the writer checkpoints once no write came for this long.
        wal_checkpoint_bytes: the writer checkpoints between two groups once DuckDB's WAL holds
            this much (DuckDB's own threshold is set above it, store/opening.py).
        lease_flush_delay: claims' lease bookkeeping is soft state, written at most this long
            after a claim, with the group that commits then or on its own; an ack sooner
            supersedes it, and it is never written (groups before then leave it waiting).
        point_lookup_keys: up to this many keys are looked up one by one; more are joined
            against the table.
        values_insert_rows / values_update_rows: up to this many rows are written with one
            parametrised statement instead of a registered Arrow source.
        overlap_blob_bytes: a group staging at least this many blob bytes writes them on the blob
            thread while its statements run; smaller ones write inline.
        log_put_rows: groups of new, claimable rows up to this size are made durable in the put
            log and inserted into DuckDB later (store/putlog.py).
        materialize_rows / materialize_delay: logged rows go into DuckDB with the next DuckDB
            transaction, once this many wait, or this long after the first, whichever is first
            (an apply holds up the acks and puts behind it, so not too often).
        materialize_max_rows: while a checkpoint runs, logged rows wait for it up to this many.

    Tuning of blob segments (store/blobs.py):
        blob_segment_bytes: a segment file takes new chunks until it holds this many bytes.
        blob_recent_bytes: the newest chunks stay readable from memory up to this many bytes,
            so that claims of fresh rows read no file (a bounded part of the server's RSS).
        blob_direct_io: write segments with O_DIRECT where the filesystem takes it (the page
            cache is not filled with bytes the store keeps in memory anyway); None: yes, unless
            the environment says ``EXPSTORE_BLOB_DIRECT_IO=0``.

    Tuning of the index (store/live.py):
        terminal_index_max: consumed, stale or dead rows a table remembers in memory, so that a
            re-sent write of one needs no DuckDB lookup; past it, the writer asks DuckDB.

    Tuning of claims (store/claim_engine.py):
        recent_claims: claim ids remembered after they ended, to answer a late ack precisely.
        where_first_rows: ready rows a claim with a predicate evaluates first (then 4x more per
            round).
        load_ahead_rows / load_ahead_bytes / load_ahead_first_rows: a claim reading rows from
            DuckDB reads the next ready rows' values too, up to this many rows and about this
            many bytes (by the size of the table's rows read last time; the first-rows figure
            before any).
    """

    ref_threshold: int = 512
    memory_limit: str | None = None
    cache_limit: int | str = DEFAULT_CACHE_LIMIT
    max_live_rows: int | None = None
    query_timeout: float = 30.0
    max_concurrent_queries: int = 2

    max_group_ops: int = 512
    merged_put_rows: int = 4096
    checkpoint_idle_seconds: float = 2.0
    wal_checkpoint_bytes: int = 512 << 20
    lease_flush_delay: float = 0.25
    point_lookup_keys: int = 4
    values_insert_rows: int = 4
    values_update_rows: int = 4
    overlap_blob_bytes: int = 1 << 20
    log_put_rows: int = 4096
    materialize_rows: int = 16384
    materialize_delay: float = 0.5
    materialize_max_rows: int = 262144

    recent_claims: int = 100_000
    where_first_rows: int = 256
    load_ahead_rows: int = 4096
    load_ahead_bytes: int = 16 << 20
    load_ahead_first_rows: int = 1024
    blob_segment_bytes: int = 256 << 20
    blob_recent_bytes: int = 256 << 20
    blob_direct_io: bool | None = None
    terminal_index_max: int = 1_000_000

    def __post_init__(self) -> None:
        m = self.max_live_rows
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise InvalidArgument(f"max_live_rows {m!r} is invalid; expected a positive number "
                                  "of rows or None")
        parse_size(self.cache_limit)  # a bad size fails here, naming it
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("memory_limit", "cache_limit", "max_live_rows", "blob_direct_io"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidArgument(f"setting {f.name} = {value!r} is invalid; expected a "
                                      "number ≥ 0")
        if self.blob_direct_io not in (None, True, False):
            raise InvalidArgument(f"setting blob_direct_io = {self.blob_direct_io!r} is invalid; "
                                  "expected True, False or None")
        if self.query_timeout <= 0 or self.max_concurrent_queries < 1:
            raise InvalidArgument(
                f"query_timeout {self.query_timeout!r} and max_concurrent_queries "
                f"{self.max_concurrent_queries!r} must be positive")

    @property
    def cache_bytes(self) -> int:
        return parse_size(self.cache_limit)

    @classmethod
    def parse_options(cls, pairs: Iterable[str]) -> dict[str, Any]:
        """``NAME=VALUE`` texts (``expstore serve --set``) as typed options for :meth:`with_options`.

        >>> StoreSettings.parse_options(["query_timeout=5", "blob_direct_io=off"])
        {'query_timeout': 5.0, 'blob_direct_io': False}
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        options: dict[str, Any] = {}
        for pair in pairs:
            name, sep, text = pair.partition("=")
            name, text = name.strip(), text.strip()
            if not sep or name not in fields:
                raise InvalidArgument(
                    f"store option {pair!r} is invalid; expected NAME=VALUE with NAME one of: "
                    f"{', '.join(sorted(fields))}")
            options[name] = _typed(name, text, getattr(cls, name))
        return options

    def with_options(self, **options: Any) -> "StoreSettings":
        """A copy with ``options`` set; an unknown name is an error naming the valid ones."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise InvalidArgument(f"unknown store option(s) {', '.join(map(repr, unknown))}; "
                                  f"expected some of: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **options) if options else self


_NONE = ("none", "null", "")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _typed(name: str, text: str, default: Any) -> Any:
    """``text`` as the type of the field whose default is ``default`` (sizes stay text: the
    fields that take them parse them)."""
    low = text.lower()
    if name in ("memory_limit", "cache_limit"):
        return None if low in _NONE and name == "memory_limit" else text
    if name in ("max_live_rows", "blob_direct_io") and low in _NONE:
        return None
    if name == "blob_direct_io" or isinstance(default, bool):
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise InvalidArgument(f"store option {name}={text!r} is invalid; expected on or off")
    try:
        return float(text) if isinstance(default, float) else int(text.replace("_", ""))
    except ValueError:
        kind = "a number" if isinstance(default, float) else "a whole number"
        raise InvalidArgument(f"store option {name}={text!r} is invalid; expected {kind}") \
            from None
