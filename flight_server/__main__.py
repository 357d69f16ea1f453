"""``python -m flight_server``: the same as ``expstore serve`` (same options, same function).

Example::

    python -m flight_server --db ./expstore.duckdb --port 8815
"""
from __future__ import annotations

from expstore.cli import main, serve

if __name__ == "__main__":
    main(command=serve, prog_name="python -m flight_server")
