"""Export a table or a query result to Parquet or JSON Lines, in chunks, with progress.

A table is read page by page (``row_id > last ORDER BY row_id LIMIT n``, a keyset page: no
OFFSET rescans), so exporting a large table never holds more than one page in memory. An ad-hoc
query (``--sql``) is run once — the store's query API returns whole results — and written in
chunks of its record batches.

>>> import store
>>> from expstore.export import export
>>> s = store.connect("./expstore.duckdb")                                # doctest: +SKIP
>>> export(s, "solver.parquet", table="solver")["rows"]                 # doctest: +SKIP
128
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from store.errors import InvalidArgument
from store.naming import quote

from .output import dumps

FORMATS = ("parquet", "jsonl")
CHUNK_ROWS = 10_000

#: Called with the total row count; yields something with ``update(rows)`` (a click progressbar).
ProgressFactory = Callable[[int], ContextManager[Any]]


SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def format_for(path: str, fmt: str | None) -> str:
    """The export format: given, or from the file name (``.parquet``/``.pq`` → parquet,
    ``.jsonl``/``.ndjson`` → jsonl).

    Raises:
        InvalidArgument: an unknown format, or a file name that names none (``x.csv`` must not
            silently become Parquet).
    """
    if fmt is not None:
        if fmt not in FORMATS:
            raise InvalidArgument(f"export format {fmt!r} is unknown; expected one of {FORMATS}")
        return fmt
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise InvalidArgument(
            f"cannot tell the export format from the file name {path!r}; export writes Parquet "
            f"(.parquet) or JSON Lines (.jsonl): name the file so or give --format parquet|jsonl"
            + (" (for CSV: expstore query \"SELECT …\" -o FILE.csv)" if suffix == ".csv" else ""))
    return SUFFIXES[suffix]


def export(store: Any, path: str, *, table: str | None = None, sql: str | None = None,
           fmt: str | None = None, chunk_rows: int = CHUNK_ROWS,
           timeout: float | None = None, progress: ProgressFactory | None = None) -> dict:
    """Write a table's rows (all columns, by ``row_id``) or a query's result to ``path``.

    The file appears only when complete (written as ``<path>.partial`` and renamed).

    Returns:
        ``{"rows": n, "output": path, "format": fmt, "source": table-or-sql}``.

    Raises:
        InvalidArgument: neither or both of ``table`` and ``sql``; a bad format or chunk size.
        NotFound: the table does not exist. QueryRefused / QueryTimeout: from the query.
    """
    if (table is None) == (sql is None):
        raise InvalidArgument("export needs a table name or a SQL query (not both)")
    if not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise InvalidArgument(f"chunk size {chunk_rows!r} is invalid; expected a positive integer")
    fmt = format_for(path, fmt)
    if table is not None:
        store.describe(table)  # NotFound names the existing tables
        total = int(store.query(f"SELECT count(*) AS n FROM {quote(table)}").column(0)[0]
                    .as_py())
        chunks = _table_pages(store, table, chunk_rows, timeout)
    else:
        result = store.query(sql, timeout=timeout)
        total = result.num_rows
        chunks = _batches(result, chunk_rows)
    bar = progress(total) if progress is not None else contextlib.nullcontext(None)
    partial = f"{path}.partial"
    try:
        with bar as b:
            rows = _write(chunks, partial, fmt, None if b is None else b.update)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    return {"rows": rows, "output": path, "format": fmt,
            "source": table if table is not None else sql}


def _table_pages(store: Any, table: str, chunk_rows: int,
                 timeout: float | None) -> Iterator[pa.Table]:
    sql = f"SELECT * FROM {quote(table)} WHERE row_id > ? ORDER BY row_id LIMIT ?"
    last = -(2 ** 63)
    while True:
        page = store.query(sql, [last, chunk_rows], timeout=timeout)
        yield page  # the first page is yielded even when empty: it carries the schema
        if page.num_rows < chunk_rows:
            return
        last = page.column("row_id")[-1].as_py()


def _batches(result: pa.Table, chunk_rows: int) -> Iterator[pa.Table]:
    batches = result.to_batches(max_chunksize=chunk_rows)
    if not batches:
        yield result
    for batch in batches:
        yield pa.Table.from_batches([batch], result.schema)


def _write(chunks: Iterator[pa.Table], path: str, fmt: str,
           advance: Callable[[int], Any] | None) -> int:
    rows = 0
    if fmt == "parquet":
        writer: pq.ParquetWriter | None = None
        schema: pa.Schema | None = None
        try:
            for chunk in chunks:
                if writer is None or schema is None:
                    schema = chunk.schema
                    writer = pq.ParquetWriter(path, schema)
                elif chunk.schema != schema:
                    chunk = chunk.cast(schema)
                writer.write_table(chunk)
                rows += chunk.num_rows
                if advance is not None:
                    advance(chunk.num_rows)
        finally:
            if writer is not None:
                writer.close()
        return rows
    with open(path, "w", encoding="utf-8") as f:
        for chunk in chunks:
            for record in chunk.to_pylist():
                f.write(dumps(record, indent=None))
                f.write("\n")
            rows += chunk.num_rows
            if advance is not None:
                advance(chunk.num_rows)
    return rows
