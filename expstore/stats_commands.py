"""``expstore stats`` (rows by state and version, once or refreshed with ``--watch``) and
``expstore leases`` (the claims leased now).

Registered on the ``expstore`` group in expstore/cli.py.
"""
from __future__ import annotations

import datetime as dt
import shutil
import textwrap
import time
from typing import Any

import click

from store.errors import Unavailable

from .options import ExpstoreCommand, Target, json_option, store_options
from .output import echo_json, format_table


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


@click.command(cls=ExpstoreCommand)
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


@click.command(cls=ExpstoreCommand)
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
