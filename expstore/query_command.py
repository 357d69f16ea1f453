"""``expstore query``: one read-only SELECT, printed as a table, CSV, JSON or written to Parquet.

Registered on the ``expstore`` group in expstore/cli.py.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import click

from .options import ExpstoreCommand, Target, json_option, store_options
from .output import MAX_CELL, format_result, raw_cell

QUERY_FORMATS = ("table", "csv", "json", "parquet")


def _param(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@click.command(cls=ExpstoreCommand)
@click.argument("sql")
@click.option("--param", "-p", "params", multiple=True, metavar="VALUE",
              help="Value bound to the next ? (JSON if it parses, else a string; repeatable).")
@click.option("--format", "fmt", type=click.Choice(QUERY_FORMATS), default=None,
              help="Output format [default: from --output's name (.csv, .json, .parquet), else "
                   "table; parquet needs --output].")
@click.option("--output", "-o", type=click.Path(dir_okay=False),
              help="Write to this file instead of stdout.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Cancel the query after this long (default: the store's limit).")
@click.option("--max-width", type=click.IntRange(min=4), default=MAX_CELL, show_default=True,
              help="With --format table: cut cells longer than this.")
@click.option("--vertical", "-x", is_flag=True,
              help="With --format table: one block of 'column value' lines per row (chosen by "
                   "itself when the columns do not fit the terminal side by side).")
@store_options()
@json_option
def query(sql: str, params: tuple[str, ...], fmt: str | None, output: str | None,
          timeout: float | None, max_width: int, vertical: bool, target: Target,
          as_json: bool) -> None:
    """Run one read-only SELECT and print the result.

    A result with more columns than fit the terminal side by side is shown one row per block
    (--vertical) instead of cutting every cell to a few characters.

    \b
    Example:
        expstore query "SELECT sample_id, reward FROM solver WHERE reward > ?" -p 0.5
        expstore query "SELECT * FROM solver LIMIT 3" --vertical
        expstore query "SELECT * FROM solver" -o solver.csv
        expstore query "SELECT * FROM solver" --format parquet -o solver.parquet
    """
    if as_json:
        if fmt not in (None, "json"):
            raise click.UsageError(f"--json and --format {fmt} exclude each other")
        fmt = "json"
    fmt = fmt or (_format_of(output) if output else "table")
    if fmt == "parquet" and not output:
        raise click.UsageError("--format parquet needs --output FILE")
    with target.open() as s:
        result = s.query(sql, [_param(p) for p in params] if params else None, timeout=timeout)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(result, output)
        click.echo(f"wrote {result.num_rows} rows to {output}", err=True)
        return
    with _text_sink(output) as out:
        if fmt == "json":
            from .output import dumps

            out.write(dumps(result.to_pylist()) + "\n")
        elif fmt == "csv":
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(result.column_names)
            for row in result.to_pylist():
                writer.writerow([raw_cell(v) for v in row.values()])
        else:
            rows = [list(r.values()) for r in result.to_pylist()]
            out.write(format_result(result.column_names, rows, max_cell=max_width,
                                    vertical=True if vertical else None) + "\n")
            out.write(f"({result.num_rows} row{'s' if result.num_rows != 1 else ''})\n")
    if output:
        click.echo(f"wrote {result.num_rows} rows to {output}", err=True)


_QUERY_FORMAT_OF_SUFFIX = {".csv": "csv", ".json": "json", ".parquet": "parquet",
                           ".pq": "parquet"}


def _format_of(path: str) -> str:
    """The query output format a file name asks for; table text for any other name."""
    return _QUERY_FORMAT_OF_SUFFIX.get(os.path.splitext(path)[1].lower(), "table")


@contextmanager
def _text_sink(path: str | None) -> Iterator[Any]:
    if path is None:
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8", newline="") as f:
        yield f
