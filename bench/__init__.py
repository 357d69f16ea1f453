"""expstore's benchmark suite: ``python -m bench`` or ``expstore bench``.

Every figure is printed next to a baseline measured in the same run (raw Arrow Flight loopback,
in-process DuckDB, Redis Streams, a Ray queue, an in-memory queue), and the issue's targets are
printed as ratios with PASS/MISS. Results go to ``bench/out/`` (JSON and PNG plots); ``--write-md``
regenerates the results section of ``BENCHMARKS.md``.

Example::

    python -m bench --quick --only flight_raw
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite with command-line ``argv`` (``None``: ``sys.argv[1:]``); returns the exit code."""
    from bench.cli import main as _main  # imported late: ``import bench`` stays cheap

    return _main(argv)


__all__ = ["main"]
