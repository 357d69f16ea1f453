"""A/B of the micro-batch (a claim of 16 carrying the last ack, answered once it is durable)
between two servers side by side, the rounds alternated, one client.

    python scripts/ab_microbatch.py OLD_TREE NEW_TREE [--rounds 10] [--per-round 150]
                                    [--old-env K=V ...] [--new-env K=V ...]

Each side is ``python -m flight_server`` run from its tree (a worktree of the revision, e.g.
made by scripts/ab_bench.py, or this checkout); ``--old-env`` / ``--new-env`` set environment
variables of one side's server only (the same tree on both sides then compares a setting). Every
round makes fresh tables of the bench's narrow and wide rows on both servers (sized for the round:
a table of the bench's size, its values in the claim cache), runs ``--per-round`` micro-batches
on each, the side that goes first swapped each round, and drops them. Prints per kind the median
of each side's per-round p50s, new / old as the median of the rounds' ratios, and in how many
rounds the new side was faster. The client is this checkout's: use it for server-side changes
(scripts/ab_bench.py runs each revision's client too).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("narrow", "wide", "narrow_groups", "wide_groups")


def _env(tree: Path, pairs: list[str]) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"an environment setting must be NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=150)
    ap.add_argument("--old-env", nargs="*", default=[])
    ap.add_argument("--new-env", nargs="*", default=[])
    args = ap.parse_args()

    import store
    from bench.expstore_reads import carried_acks, micro_batch_table
    from bench.util import free_port, wait_port

    work = Path(tempfile.mkdtemp(prefix="ab-microbatch-"))
    servers: dict[str, subprocess.Popen] = {}
    stores = {}
    p50s: dict[str, dict[str, list[float]]] = {k: {"old": [], "new": []} for k in KINDS}
    rows = 16 * (args.per_round + 30)
    try:
        for side, tree, pairs in (("old", args.old, args.old_env), ("new", args.new, args.new_env)):
            port = free_port()
            log = open(work / f"{side}.log", "wb")  # noqa: SIM115 - closed with the process
            proc = servers[side] = subprocess.Popen(
                [sys.executable, "-m", "flight_server", "--db", str(work / f"{side}.duckdb"),
                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=tree,
                env=_env(tree, pairs))
            wait_port(port, timeout=60, alive=lambda p=proc: p.poll() is None)
            stores[side] = store.connect(f"grpc://127.0.0.1:{port}")
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for kind in KINDS:
                table = f"{kind}_{r}"
                for side in order:
                    micro_batch_table(stores[side], table, kind.split("_")[0], rows)
                for side in order:
                    took = carried_acks(stores[side], table, args.per_round, 16,
                                        kind.endswith("groups"), 1e9)
                    p50s[kind][side].append(statistics.median(took) * 1e3)
                for side in order:
                    stores[side].drop_table(table)
        for s in stores.values():
            s.close()
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(20)
        shutil.rmtree(work, ignore_errors=True)
    print(f"micro-batch of 16 carrying the last ack, p50 ms ({args.rounds} alternated rounds "
          f"of {args.per_round})")
    for kind in KINDS:
        old, new = p50s[kind]["old"], p50s[kind]["new"]
        ratios = [n / o for o, n in zip(old, new)]
        print(f"  {kind:14s} old {statistics.median(old):.3f}  new {statistics.median(new):.3f}"
              f"  new/old {statistics.median(ratios):.3f}  new faster in "
              f"{sum(x < 1 for x in ratios)}/{len(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
