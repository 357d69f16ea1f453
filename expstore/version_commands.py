"""``expstore version``: show or bump a table's policy version, and its version group's barrier.

Registered on the ``expstore`` group in expstore/cli.py.
"""
from __future__ import annotations

import click

from .options import ExpstoreGroup, Target, json_option, store_options
from .output import echo_json, format_pairs


@click.group(cls=ExpstoreGroup)
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
