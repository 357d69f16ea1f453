"""The ``expstore`` command line: a thin click layer over the store library.

Every command opens one store (``--db PATH`` embedded, or ``--uri grpc://…`` remote, chosen by
:func:`store.connect`), makes one library call and prints the answer: aligned columns for people,
``--json`` for scripts. Library errors (:class:`store.ExpstoreError`) become
:class:`click.ClickException` in one place (:class:`expstore.options.ExpstoreCommand`), so a bad
table name or type ends with a one-line message and exit status 1, never a traceback. The
options every command shares are in expstore/options.py; ``expstore cluster`` is in
expstore/cluster_commands.py.

Example::

    expstore create-table solver prompt:string reward:float64 --db ./expstore.duckdb
    expstore query "SELECT count(*) FROM solver" --json
"""
from __future__ import annotations

import csv
import datetime as dt
import importlib
import json
import logging
import os
import shutil
import sys
import textwrap
import time
from contextlib import contextmanager
from typing import Any, Iterator

# gRPC's C core logs each failed TLS handshake and retry on stderr at its default verbosity;
# the command's own one-line error says what failed. Set before any channel opens.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import click

from store.cache import DEFAULT_CACHE_LIMIT
from store.errors import AlreadyExists, ExpstoreError, Unavailable

from . import __version__
from .cluster_commands import cluster
from .options import (DEFAULT_PORT, ExpstoreGroup, Target, db_option, json_option, size_option,
                      store_options)
from .output import MAX_CELL, echo_json, format_pairs, format_result, format_table, raw_cell
from .serve import SHUTDOWN_GRACE_SECONDS

QUERY_FORMATS = ("table", "csv", "json", "parquet")


# -- the group ----------------------------------------------------------------------------------------
@click.group(cls=ExpstoreGroup, context_settings={"help_option_names": ["-h", "--help"],
                                                  "max_content_width": 100})
@click.version_option(__version__, prog_name="expstore")
def cli() -> None:
    """expstore: an experience store for RL training of LLM agents (Arrow Flight over DuckDB).

    Commands work on an embedded DuckDB file (--db, default ./expstore.duckdb) or on a running
    server (--uri grpc://HOST:PORT); set EXPSTORE_DB / EXPSTORE_URI / EXPSTORE_TOKEN to avoid
    repeating them.

    \b
    Example:
        expstore serve --db ./expstore.duckdb --port 8815 &
        expstore create-table solver prompt:string reward:float64 --uri grpc://127.0.0.1:8815
        expstore stats --uri grpc://127.0.0.1:8815 --watch
    """


# -- serve / migrate ------------------------------------------------------------------------------
@cli.command()
@db_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0 picks a free one; the ready line names it).")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False),
              help="JSON file of bearer tokens and roles; turns on auth.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False),
              help="PEM certificate; with --tls-key turns on TLS (grpc+tls://).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key.")
@click.option("--memory-limit", metavar="SIZE", help="DuckDB memory limit, e.g. 4GB.")
@click.option("--cache-limit", metavar="SIZE", default=DEFAULT_CACHE_LIMIT, show_default=True,
              callback=size_option,
              help="Memory for ready rows' values kept so that claims need no DuckDB read, e.g. "
                   "512MB. Rows put while it is full are claimed from DuckDB (0: all rows but "
                   "those of the put log not yet applied to DuckDB).")
@click.option("--max-live-rows", type=click.IntRange(min=1), metavar="N",
              help="The most live rows (pending, ready or being processed) a table may hold; a "
                   "put adding rows past it fails with table_full (retryable), so that producers "
                   "outrunning their trainers cannot grow the server without bound. Default: no "
                   "limit.")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus /metrics over HTTP on this port (0: a free one; needs the "
                   "flight_server.metrics module; without it the option is ignored with a "
                   "warning). With --tokens-file a scrape needs one of its tokens (header "
                   "'Authorization: Bearer <token>', any role), else 401.")
@click.option("--metrics-host", metavar="ADDRESS",
              help="Address /metrics listens on (default: --host), e.g. 127.0.0.1 to keep it "
                   "off the network while Flight listens on 0.0.0.0.")
@click.option("--set", "store_options", multiple=True, metavar="NAME=VALUE",
              help="Any store setting (store/settings.py, StoreSettings: its docstring gives each "
                   "one's meaning and default), e.g. --set query_timeout=10 --set "
                   "blob_direct_io=off. Repeatable.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True, help="Log level of the server's stderr log.")
@click.option("--shutdown-grace", metavar="SECONDS", type=click.FloatRange(min=0),
              default=SHUTDOWN_GRACE_SECONDS, show_default=True,
              help="On SIGINT/SIGTERM, wait this long for open calls to end (a second signal "
                   "stops waiting); then close the store and exit without them.")
def serve(db: str, host: str, port: int, tokens_file: str | None, tls_cert: str | None,
          tls_key: str | None, memory_limit: str | None, cache_limit: int,
          max_live_rows: int | None, metrics_port: int | None, metrics_host: str | None,
          store_options: tuple[str, ...], log_level: str, shutdown_grace: float) -> None:
    """Serve a store over Arrow Flight until SIGINT/SIGTERM.

    Prints one line, "expstore serving grpc://HOST:PORT (db PATH)", once it accepts calls. On
    SIGINT or SIGTERM it stops accepting, finishes running calls (for up to --shutdown-grace
    seconds, or until a second signal), closes the store (which checkpoints) and exits 0. While
    it runs, it owns the database file: other commands reach the store with --uri.

    \b
    Example:
        expstore serve --db ./expstore.duckdb --port 8815
        expstore serve --tokens-file tokens.json --tls-cert cert.pem --tls-key key.pem
        expstore serve --set max_concurrent_queries=4 --set blob_segment_bytes=1073741824
    """
    from store.settings import StoreSettings

    from .serve import run_server

    logging.basicConfig(stream=sys.stderr, level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)  # its setup chatter is noise
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("TLS needs both --tls-cert and --tls-key")
    try:
        settings = StoreSettings.parse_options(store_options)
        StoreSettings().with_options(**settings)  # a bad value fails here, before the server
    except ExpstoreError as e:
        raise click.BadParameter(str(e), param_hint="--set") from None
    run_server(db, host=host, port=port, tokens_file=tokens_file, tls_cert=tls_cert,
               tls_key=tls_key, memory_limit=memory_limit, cache_limit=cache_limit,
               max_live_rows=max_live_rows, metrics_port=metrics_port,
               metrics_host=metrics_host, warn=lambda message: click.echo(message, err=True),
               shutdown_grace=shutdown_grace, store_options=settings)


@cli.command()
@db_option
@click.option("--revision", default="head", show_default=True,
              help="Catalog revision to upgrade to.")
@json_option
def migrate(db: str, revision: str, as_json: bool) -> None:
    """Upgrade the catalog of an embedded database (creates it when new).

    Stop a server that owns the file first: only one process can write a DuckDB file.

    \b
    Example:
        expstore migrate --db ./expstore.duckdb
        expstore migrate --db ./expstore.duckdb --revision head --json
    """
    import migrations
    from alembic.util import CommandError
    from store.opening import catalog_revision

    before = catalog_revision(db)
    try:
        migrations.upgrade(db, revision)
    except CommandError as e:
        raise click.ClickException(f"cannot migrate {db!r} to revision {revision!r}: {e}") from e
    after = catalog_revision(db)
    if as_json:
        echo_json({"db": db, "from": before, "to": after, "head": migrations.head()})
    else:
        click.echo(f"{db}: catalog {before or '(new)'} -> {after}"
                   + (" (already there)" if before == after else ""))


# -- tables -------------------------------------------------------------------------------------
@cli.command()
@store_options()
@json_option
def tables(target: Target, as_json: bool) -> None:
    """List the experience tables.

    \b
    Example:
        expstore tables --db ./expstore.duckdb
        expstore tables --uri grpc://127.0.0.1:8815 --json
    """
    with target.open() as s:
        names = s.list_tables()
    if as_json:
        echo_json(names)
    elif names:
        click.echo("\n".join(names))
    else:
        click.echo(f"no tables in {target.address}", err=True)


def _parse_columns(specs: tuple[str, ...]) -> dict[str, str]:
    columns: dict[str, str] = {}
    for spec in specs:
        name, sep, type_ = spec.partition(":")
        if not sep or not name.strip() or not type_.strip():
            raise click.BadParameter(f"{spec!r} is not NAME:TYPE (e.g. reward:float64)",
                                     param_hint="COLUMNS")
        if name in columns:
            raise click.BadParameter(f"column {name!r} is given twice", param_hint="COLUMNS")
        columns[name.strip()] = type_.strip()
    return columns


def _parse_storage(specs: tuple[str, ...]) -> dict[str, str] | None:
    if not specs:
        return None
    storage: dict[str, str] = {}
    for spec in specs:
        name, sep, mode = spec.partition("=")
        if not sep or not name or not mode:
            raise click.BadParameter(f"{spec!r} is not COLUMN=MODE (e.g. response=ref)",
                                     param_hint="--storage")
        storage[name] = mode
    return storage


@cli.command("create-table")
@click.argument("name")
@click.argument("columns", nargs=-1, required=True, metavar="COLUMN:TYPE...")
@click.option("--if-not-exists", is_flag=True, help="Accept an existing table of that name.")
@click.option("--max-staleness", type=click.IntRange(min=0), default=0, show_default=True,
              help="Rows older than version - N become stale (0: strictly on-policy).")
@click.option("--version-group", metavar="GROUP",
              help="Share a version counter with other tables (default: the table's name).")
@click.option("--max-deliveries", type=click.IntRange(min=1), default=5, show_default=True,
              help="Deliveries before a row is dead.")
@click.option("--lease-seconds", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="Default lease of a claim.")
@click.option("--storage", multiple=True, metavar="COLUMN=MODE",
              help="Storage of a column: value, ref or auto (repeatable).")
@click.option("--required", multiple=True, metavar="COLUMN",
              help="A column that must be written before a row is ready (repeatable; default: "
                   "all columns).")
@store_options(create=True)
@json_option
def create_table(name: str, columns: tuple[str, ...], if_not_exists: bool, max_staleness: int,
                 version_group: str | None, max_deliveries: int, lease_seconds: float,
                 storage: tuple[str, ...], required: tuple[str, ...], target: Target,
                 as_json: bool) -> None:
    """Create an experience table with data columns NAME:TYPE.

    Types: bool, int8..int64, uint8..uint64, float32, float64, string, binary, timestamp,
    list<T>, tensor<T>. Quote types with <> in a shell.

    \b
    Example:
        expstore create-table solver prompt:string response:string reward:float64 \\
            'token_ids:list<int32>' --storage response=ref --max-staleness 1
    """
    cols = _parse_columns(columns)
    definition: dict[str, Any] = dict(
        version_group=version_group, max_staleness=max_staleness, max_deliveries=max_deliveries,
        lease_seconds=lease_seconds, storage=_parse_storage(storage),
        required=list(required) or None)
    # Checked before the store opens: a refused definition leaves no new database file behind.
    from store.schema import TableDef
    TableDef.build(name, cols, **definition)
    with target.open() as s:
        try:
            description = s.create_table(name, cols, if_not_exists=if_not_exists,
                                         **definition)
        except AlreadyExists:
            raise click.ClickException(
                f"table {name!r} already exists in {target.address}; add --if-not-exists to "
                "accept it as it is, or pick another name") from None
    _print_description(description, as_json)


@cli.command()
@click.argument("name")
@store_options()
@json_option
def describe(name: str, target: Target, as_json: bool) -> None:
    """Show a table's columns, version and settings.

    \b
    Example:
        expstore describe solver
        expstore describe solver --uri grpc://127.0.0.1:8815 --json
    """
    with target.open() as s:
        description = s.describe(name)
    _print_description(description, as_json)


def _print_description(d: dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(d)
        return
    pairs = [(k, v) for k, v in d.items() if k != "columns"]
    click.echo(format_pairs(pairs))
    click.echo("")
    click.echo(format_table(["column", "type", "storage", "required"],
                            [[c.get("name"), c.get("type"), c.get("storage"), c.get("required")]
                             for c in d.get("columns", [])]))


# -- query ------------------------------------------------------------------------------------------
def _param(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@cli.command()
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


# -- stats / leases -----------------------------------------------------------------------------
STATS_COLUMNS = ["version", "rows", "pending", "ready", "processing", "consumed", "stale", "dead"]


def _stats_text(stats: dict[str, Any], table: str | None) -> str:
    if not stats:
        return "no tables"
    rows = [[name, s.get("version_group")] + [s.get(c) for c in STATS_COLUMNS]
            for name, s in sorted(stats.items())]
    text = format_table(["table", "group"] + STATS_COLUMNS, rows)
    if table is not None and table in stats:
        line = "rows per policy version: " + _per_version_text(
            stats[table].get("rows_per_version") or {})
        text += "\n\n" + textwrap.fill(line, width=shutil.get_terminal_size((120, 24)).columns,
                                       subsequent_indent="  ", break_long_words=False,
                                       break_on_hyphens=False)
    return text


#: Versions the text view of stats lists one by one (the newest); --json has every one.
STATS_VERSIONS_SHOWN = 10


def _per_version_text(per_version: dict[Any, int]) -> str:
    """``v0: 25, v1: 3, …``: the newest versions one by one, the older ones summed up in one
    entry, so that a run of thousands of versions still fits a terminal."""
    if not per_version:
        return "none"
    items = sorted((int(v), n) for v, n in per_version.items())
    older, newest = items[:-STATS_VERSIONS_SHOWN], items[-STATS_VERSIONS_SHOWN:]
    parts = [f"v{v}: {n}" for v, n in newest]
    if older:
        parts.insert(0, f"v{older[0][0]}–v{older[-1][0]}: {sum(n for _, n in older)} rows in "
                        f"{len(older)} versions")
    return ", ".join(parts)


@cli.command()
@click.argument("table", required=False)
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              metavar="SECONDS", help="With --watch: seconds between refreshes.")
@click.option("--count", type=click.IntRange(min=1), metavar="N",
              help="With --watch: stop after N refreshes.")
@store_options()
@json_option
def stats(table: str | None, watch: bool, interval: float, count: int | None, target: Target,
          as_json: bool) -> None:
    """Rows by state (pending, ready, processing, consumed, stale, dead) and versions.

    With --watch the view refreshes every --interval seconds; with --json each refresh is one
    JSON line.

    \b
    Example:
        expstore stats
        expstore stats solver --json
        expstore stats --uri grpc://127.0.0.1:8815 --watch --interval 1
    """
    data: dict[str, Any] | None
    down: str | None
    with target.open() as s:
        if not watch:
            data = s.stats(table)
            if as_json:
                echo_json(data)
            else:
                click.echo(_stats_text(data, table))
            return
        from .output import dumps

        refreshes = 0
        try:
            while True:
                try:
                    data, down = s.stats(table), None
                except Unavailable as e:  # a server restarting: watch it come back
                    data, down = None, _why_unavailable(e, target)
                refreshes += 1
                if as_json:
                    click.echo(dumps(data if down is None else
                                     {"error": down, "code": Unavailable.code}, indent=None))
                else:
                    click.clear()
                    now = dt.datetime.now().strftime("%H:%M:%S")
                    click.echo(f"expstore stats  {target.address}  {now}  "
                               f"(every {interval:g} s, Ctrl-C to stop)\n")
                    click.echo(_stats_text(data, table) if data is not None else
                               f"unavailable: {down}\n(trying again every {interval:g} s)")
                if count is not None and refreshes >= count:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            return


def _why_unavailable(error: Exception, target: Target) -> str:
    """Why a server does not answer: a refused connection (nothing listens there now) in the
    CLI's words rather than gRPC's, else the error's own message."""
    if target.uri:
        from flight_server.reachable import check_listening
        try:
            check_listening(target.uri)
        except Unavailable as refused:
            return str(refused)
    return str(error)


@cli.command()
@click.argument("table", required=False)
@store_options()
@json_option
def leases(table: str | None, target: Target, as_json: bool) -> None:
    """Claims currently leased: id, consumer, expiry and rows per table.

    \b
    Example:
        expstore leases --uri grpc://127.0.0.1:8815
        expstore leases solver --json
    """
    with target.open() as s:
        current = s.leases(table)
    if as_json:
        echo_json(current)
        return
    if not current:
        click.echo("no active leases" + (f" on {table}" if table else ""), err=True)
        return
    now = time.time()
    rows = [[lease["claim_id"], lease.get("consumer"), lease.get("state"),
             f"{lease['expires_at'] - now:.1f}s",
             ", ".join(f"{t}:{n}" for t, n in sorted(lease.get("rows", {}).items()))]
            for lease in current]
    click.echo(format_table(["claim_id", "consumer", "state", "expires_in", "rows"], rows))


# -- versions ---------------------------------------------------------------------------------
@cli.group()
def version() -> None:
    """Show or bump a table's policy version (shared by its version group); its barrier.

    \b
    Example:
        expstore version show solver
        expstore version bump solver --expected 3 --weights-uri s3://ckpt/step-4
        expstore version barrier solver --timeout 120
    """


@version.command("show")
@click.argument("table")
@store_options()
@json_option
def version_show(table: str, target: Target, as_json: bool) -> None:
    """Print a table's current version and the weights published with it.

    \b
    Example:
        expstore version show solver
        expstore version show solver --json
    """
    with target.open() as s:
        d = s.describe(table)
    info = {"table": table, "version_group": d.get("version_group"), "version": d.get("version"),
            "weights_uri": d.get("weights_uri")}
    if as_json:
        echo_json(info)
    else:
        click.echo(format_pairs(list(info.items())))


@version.command("barrier")
@click.argument("table")
@click.option("--timeout", "seconds", type=float, metavar="SECONDS",
              help="Set how long the group's barrier waits for its last member (then the "
                   "round fails with barrier_timeout).")
@store_options()
@json_option
def version_barrier(table: str, seconds: float | None, target: Target, as_json: bool) -> None:
    """Show the barrier of a table's version group: its members, who arrived at the current
    version and who it waits for (unified weight updating).

    \b
    Example:
        expstore version barrier solver
        expstore version barrier solver --timeout 120 --json
    """
    with target.open() as s:
        if seconds is not None:
            s.set_barrier_timeout(table, seconds)
        state = s.barrier(table)
    if as_json:
        echo_json(state)
    else:
        click.echo(format_pairs([(k, ", ".join(v) if isinstance(v, list) else v)
                                 for k, v in state.items()]))


@version.command("bump")
@click.argument("table")
@click.option("--expected", type=int, metavar="N",
              help="Only bump if the version is N now (compare-and-set).")
@click.option("--weights-uri", metavar="URI", help="Where the new weights were published.")
@store_options()
@json_option
def version_bump(table: str, expected: int | None, weights_uri: str | None, target: Target,
                 as_json: bool) -> None:
    """Bump the version of a table's version group; older rows may become stale.

    \b
    Example:
        expstore version bump solver
        expstore version bump solver --expected 3 --weights-uri s3://ckpt/step-4 --json
    """
    with target.open() as s:
        new = s.bump_version(table, expected=expected, weights_uri=weights_uri)
    if as_json:
        echo_json({"table": table, "version": new, "weights_uri": weights_uri})
    else:
        click.echo(f"{table}: version {new}")


# -- export / gc ------------------------------------------------------------------------------
@cli.command()
@click.argument("table", required=False)
@click.option("--sql", help="Export the result of this SELECT instead of a table.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False),
              help="File to write (appears only when complete).")
@click.option("--format", "fmt", type=click.Choice(["parquet", "jsonl"]),
              help="File format [default: from the file name: .parquet/.pq → parquet, "
                   ".jsonl/.ndjson → jsonl; another name needs --format].")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="Rows read and written per chunk.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Time limit per query.")
@store_options()
@json_option
def export(table: str | None, sql: str | None, output: str, fmt: str | None, chunk_rows: int,
           timeout: float | None, target: Target, as_json: bool) -> None:
    """Export a table (all rows and columns) or a query result to Parquet or JSON Lines.

    \b
    Example:
        expstore export solver -o solver.parquet
        expstore export --sql "SELECT * FROM solver WHERE reward > 0" -o good.jsonl
    """
    from .export import export as run_export

    if (table is None) == (sql is None):
        raise click.UsageError("give a TABLE or --sql (one of them)")
    label = f"exporting {table}" if table is not None else "exporting query"

    def progress(total: int) -> Any:
        return click.progressbar(length=total, label=label, file=sys.stderr,
                                 show_pos=True)

    with target.open() as s:
        result = run_export(s, output, table=table, sql=sql, fmt=fmt, chunk_rows=chunk_rows,
                            timeout=timeout, progress=progress)
    if as_json:
        echo_json(result)
    else:
        click.echo(f"exported {result['rows']} rows to {result['output']} ({result['format']})")


@cli.command()
@click.option("--drop", "drop_rows", multiple=True,
              type=click.Choice(["consumed", "stale", "dead"]),
              help="First delete the rows in this state (repeatable) whose policy version is "
                   "below the table's version minus its max_staleness (no write can reach "
                   "them any more), so that their values can go too.")
@click.option("--keep-versions", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="N", help="With --drop: keep the rows of the newest N versions (for SQL).")
@store_options()
@json_option
def gc(drop_rows: tuple[str, ...], keep_versions: int, target: Target, as_json: bool) -> None:
    """Delete blob segments that no row references any more.

    Consumed, stale and dead rows are kept (for SQL) until --drop deletes them: without it a
    long-running store grows with every row ever written.

    On a cluster's coordinator, also each data node's segments that no row names (once they
    are older than the cluster's --gc-grace); the answer has a line per data node.

    \b
    Example:
        expstore gc --db ./expstore.duckdb
        expstore gc --uri grpc://127.0.0.1:8815 --drop consumed --drop stale
        expstore gc --uri grpc://127.0.0.1:8815 --drop consumed --keep-versions 20
        expstore gc --uri grpc://127.0.0.1:8815 --token $ADMIN_TOKEN --json
    """
    with target.open() as s:
        if keep_versions and not drop_rows:
            raise click.UsageError("--keep-versions says which rows --drop keeps; give --drop")
        result = s.gc(drop_rows=list(drop_rows), keep_versions=keep_versions) if drop_rows \
            else s.gc()
    if as_json:
        echo_json(result)
    else:
        click.echo(format_pairs(list(result.items())))


cli.add_command(cluster)


# -- demo / bench: entry points owned by other packages ---------------------------------------
def _entry_point(module_name: str, what: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise click.ClickException(
                f"{what} is not available: module {module_name!r} is missing from this "
                "installation") from e
        raise click.ClickException(f"{what} needs module {e.name!r}, which is not installed "
                                   f"(pip install -e '.[dev]' installs the extras)") from e


PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True}


@cli.command(context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def demo(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Run the multi-agent demo (consumers.demo); ARGS go to it unchanged.

    \b
    Example:
        expstore demo
        expstore demo -- --help
    """
    module = _entry_point("consumers.demo", "the demo")
    ctx.exit(int(module.main(list(args)) or 0))


@cli.command(context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Run the benchmark suite (python -m bench); ARGS go to it unchanged.

    \b
    Example:
        expstore bench --quick --only flight_raw
        expstore bench -- --help
    """
    module = _entry_point("bench", "the benchmark suite")
    ctx.exit(int(module.main(list(args)) or 0))


def main(argv: list[str] | None = None, *, command: click.Command = cli,
         prog_name: str = "expstore") -> None:
    """The ``expstore`` console script (and ``python -m flight_server``: ``command=serve``)."""
    try:
        command.main(args=argv, prog_name=prog_name)
    except SystemExit as done:
        if "duckdb_engine" in sys.modules:
            # Once a catalog's migrations ran in this process (a fresh database: the demo, a
            # server), DuckDB's nanobind module prints pages of "leaked ..." lines during
            # interpreter teardown, burying the command's own last lines. The command has
            # finished and closed its store: flush what is ours and leave without the teardown.
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if done.code is not None and not isinstance(done.code, int):
                print(done.code, file=sys.stderr)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        raise


if __name__ == "__main__":
    main()
