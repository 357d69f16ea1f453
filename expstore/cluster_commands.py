"""``expstore cluster``: start and stop expstore over a Ray cluster (docs/scale-out.md).

Ray is imported only when one of these commands runs.
"""
from __future__ import annotations

import click

from .options import DEFAULT_DB, DEFAULT_PORT, ExpstoreGroup, click_errors, json_option
from .output import echo_json, format_pairs


# -- cluster: scale-out on Ray ------------------------------------------------------------------
@click.group(cls=ExpstoreGroup)
def cluster() -> None:
    """Run expstore over a Ray cluster: a coordinator and a data node per Ray node.

    Needs Ray (pip install 'expstore[cluster]'); see docs/scale-out.md.

    \b
    Example:
        expstore cluster up --address auto --db /data/expstore.duckdb --data-dir /local/expstore
        expstore cluster down --address auto
    """


@cluster.command("up")
@click.option("--address", default="auto", show_default=True,
              help="The Ray cluster to join (as ray.init's address).")
@click.option("--db", default=DEFAULT_DB, show_default=True,
              help="The coordinator's DuckDB file, on this machine.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535),
              help="The coordinator's port (fixed: a restarted coordinator keeps its address).")
@click.option("--data-dir", default="./expstore-data", show_default=True,
              help="Each data node keeps its values under DATA_DIR/<node id> on its machine.")
@click.option("--node-timeout", default=6.0, show_default=True, type=click.FloatRange(min=0.5),
              help="Seconds without a data node's heartbeat before it is probed (and lost).")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False),
              help="JSON tokens file turning on bearer-token auth on the coordinator and every "
                   "data node; they call each other with its first admin token.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False),
              help="PEM certificate; with --tls-key every server of the cluster serves TLS "
                   "(it must name every machine's address).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="PEM private key.")
@click.option("--tls-root-certs", type=click.Path(exists=True, dir_okay=False),
              help="PEM roots the servers trust when calling each other (a self-signed "
                   "--tls-cert is its own root; default: the system's).")
@click.option("--gc-grace", default=3600.0, show_default=True, type=click.FloatRange(min=0),
              help="gc leaves on the data nodes segments written in the last GC_GRACE seconds "
                   "(a put's keys may still be on their way to the coordinator).")
@json_option
def cluster_up_command(address: str, db: str, port: int, data_dir: str, node_timeout: float,
                       tokens_file: str | None, tls_cert: str | None, tls_key: str | None,
                       tls_root_certs: str | None, gc_grace: float, as_json: bool) -> None:
    """Start the coordinator here and a data node on every Ray node (detached actors).

    \b
    Example:
        expstore cluster up --address auto --db /data/expstore.duckdb --port 8815
        expstore cluster up --tokens-file tokens.json --tls-cert cert.pem --tls-key key.pem \\
            --tls-root-certs cert.pem
    """
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("TLS needs both --tls-cert and --tls-key")
    from flight_server.cluster.ray_cluster import cluster_up
    with click_errors():
        handle = cluster_up(address, db=db, port=port, data_dir=data_dir,
                            node_timeout=node_timeout, detached=True, tokens_file=tokens_file,
                            tls_cert=tls_cert, tls_key=tls_key, tls_root_certs=tls_root_certs,
                            gc_grace=gc_grace)
    info = {"coordinator": handle.uri, "data_nodes": len(handle.datanodes)}
    if as_json:
        echo_json(info)
    else:
        click.echo(format_pairs(list(info.items())))


@cluster.command("down")
@click.option("--address", default="auto", show_default=True,
              help="The Ray cluster (as ray.init's address).")
@json_option
def cluster_down_command(address: str, as_json: bool) -> None:
    """Stop the coordinator and data nodes (their files stay on disk).

    \b
    Example:
        expstore cluster down --address auto
    """
    from flight_server.cluster.ray_cluster import cluster_down
    with click_errors():
        killed = cluster_down(address)
    if as_json:
        echo_json({"stopped": killed})
    else:
        click.echo(f"stopped {len(killed)} actor(s)")
