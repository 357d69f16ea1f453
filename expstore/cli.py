"""The ``expstore`` command line: a thin click layer over the store library.

Every command opens one store (``--db PATH`` embedded, or ``--uri grpc://…`` remote, chosen by
:func:`store.connect`), makes one library call and prints the answer: aligned columns for people,
``--json`` for scripts. Library errors (:class:`store.ExpstoreError`) become
:class:`click.ClickException` in one place (:class:`expstore.options.ExpstoreCommand`), so a bad
table name or type ends with a one-line message and exit status 1, never a traceback. The
options every command shares are in expstore/options.py. This module holds the group and the
smaller commands; groups of larger ones are in modules of their own, registered here:
``query`` in expstore/query_command.py, ``stats`` and ``leases`` in expstore/stats_commands.py,
``version`` in expstore/version_commands.py, ``cluster`` in expstore/cluster_commands.py,
``requeue`` in expstore/requeue_command.py.

Example::

    expstore create-table solver prompt:string reward:float64 --db ./expstore.duckdb
    expstore query "SELECT count(*) FROM solver" --json
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

# gRPC's C core logs each failed TLS handshake and retry on stderr at its default verbosity;
# the command's own one-line error says what failed. Set before any channel opens.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import click

from store.cache import DEFAULT_CACHE_LIMIT
from store.errors import AlreadyExists, ExpstoreError

from . import __version__
from .cluster_commands import cluster
from .options import (DEFAULT_PORT, ExpstoreGroup, Target, db_option, json_option, size_option,
                      store_options)
from .output import echo_json, format_pairs, format_table
from .query_command import query
from .requeue_command import requeue
from .serve import SHUTDOWN_GRACE_SECONDS
from .stats_commands import leases, stats
from .version_commands import version


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

    Types: bool, int8..int64, uint8..uint64, float16, bfloat16, float32, float64, string,
    binary, timestamp, list<T>, tensor<T>. Quote types with <> in a shell.

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


# the commands that live in modules of their own
cli.add_command(query)
cli.add_command(stats)
cli.add_command(leases)
cli.add_command(version)
cli.add_command(requeue)
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
