"""``expstore requeue``: bring a table's dead rows back (a redrive), once the cause is fixed.

Registered on the ``expstore`` group in expstore/cli.py.
"""
from __future__ import annotations

import click

from .options import ExpstoreCommand, Target, json_option, store_options
from .output import echo_json


@click.command(cls=ExpstoreCommand)
@click.argument("table")
@click.option("--where", metavar="SQL",
              help="Only the dead rows this SQL predicate over the table's columns holds for "
                   "(as a claim's where).")
@store_options()
@json_option
def requeue(table: str, where: str | None, target: Target, as_json: bool) -> None:
    """Make TABLE's dead rows ready again, their delivery count reset to 0.

    Rows become dead after the table's max_deliveries deliveries (or when a cluster lost the
    only copy of their values). Once the cause is fixed, requeue delivers them again, each up
    to max_deliveries more times. Rows below the staleness bound stay dead (they would be stale
    at once), and so do a coordinator's rows whose values are lost; both are counted.

    \b
    Example:
        expstore requeue solver --db ./expstore.duckdb
        expstore requeue solver --where "reward IS NOT NULL" --uri grpc://127.0.0.1:8815 --json
    """
    with target.open() as s:
        result = s.requeue(table, where=where)
    if as_json:
        echo_json(result)
        return
    skipped = [f"{n} {why}" for n, why in ((result["skipped_stale"], "below the staleness bound"),
                                           (result["skipped_lost"], "with their values lost"))
               if n]
    click.echo(f"requeued {result['requeued']} dead rows of {result['table']}"
               + (f"; left dead: {', '.join(skipped)}" if skipped else ""))
