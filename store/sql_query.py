"""One read-only SELECT over live data, as ``EmbeddedStore.query`` runs it: in one of the
query slots, within its time limit, with by-reference columns read as their values.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from .blobs import BlobStore
from .index import StoreIndex
from .readers import Readers
from .sqlvalues import drop_keys, whole_table, with_values


def run_select(readers: Readers, index: StoreIndex, blobs: BlobStore, sql: str,
               params: list[Any] | None, limit: float) -> pa.Table:
    """Run ``sql`` (a SELECT the SQL guard accepted) with ``params`` within ``limit`` seconds;
    a result holding both ``X`` and its key ``X__ref`` (as ``SELECT *`` does) leaves the key out.

    Raises:
        QueryRefused: the SQL is invalid.
        QueryTimeout: it ran past ``limit``.
        QueryBusy: no query slot became free within ``limit``.
    """
    deadline = readers.take_query_slot(limit, "the query")
    try:
        name = whole_table(sql) if not params else None
        live = index.live.get(name) if name is not None else None
        if live is not None and live.claim_refs:
            # a whole table: read as stored, its values cut afterwards (see whole_table)
            stored = readers.run(sql, [], limit, deadline, stored=live.tdef.name)
            return drop_keys(with_values(blobs, stored, live.tdef))
        return drop_keys(readers.run(sql, list(params or []), limit, deadline))
    finally:
        readers.release_query_slot()
